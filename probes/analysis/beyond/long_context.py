"""``analysis=long_context``: per-layer attention statistics of running text of whole documents at growing lengths.

Inputs: the documents of ``source`` (one of ``sources``: UD GUM / EWT train by ``# newdoc id``, LitBank's
excerpts; :class:`probes.data.documents.DocumentSource`), in file order, joined into one running text and cut
after the last whole sentence that keeps it within each length of ``lengths`` in the model's own pieces, its
special tokens included (:func:`probes.data.documents.running_text`). A length above the model's usable length
(:func:`probes.model.families.usable_max_length`) is skipped, with the reason logged and kept in summary.json; so
is a length the source cannot fill beyond the one before.

Each text is read as one sequence; the attention of the chosen layers is reduced block by block
(:class:`probes.maps.MapEngine` ``iter_reduced`` with :class:`probes.maps.reducers.HeadStats`: whole maps within
``extract.attention_budget_mb``, blocks of query rows beyond it), so no (T, T) map is kept. Per layer and head:
``cls`` the mean over query rows of the attention to position 0 (the first token: a BOS, else the first piece),
``entropy`` (nats, Clark et al.'s smoothed rows), ``distance`` the mean over rows of sum_j a_ij |i - j| (pieces),
and the distance histogram (bins 0, 1, 2-3, 4-7, ...; :func:`probes.maps.reducers.distance_bin_edges`).

Outputs: ``long_context.csv`` (length, n_pieces, layer, head, cls, entropy, distance, prev, self, next, punct; 0-based
layer/head), ``long_context_by_layer.csv`` (length, n_pieces, layer, and the mean over heads of cls, entropy,
distance), ``distance_hist.csv`` (length, n_pieces, layer, bin: the lower edge, share: the mean over heads),
``long_context.png`` (per layer, one line per length: first-token share, entropy, mean distance) and
``summary.json`` (lengths run and skipped with the reasons, each text's pieces, sentences and documents, seconds
and the process's peak resident memory after each length, per-layer values).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from probes.analysis import plots
from probes.analysis.clark.metrics import is_causal
from probes.data.documents import DocumentSource, encode_document, running_text
from probes.maps import MapEngine
from probes.maps.reducers import HeadStats, distance_bin_edges
from probes.model.families import usable_max_length

log = logging.getLogger(__name__)

STATS = ("cls", "entropy", "distance")  # per layer: the figure's panels and the by-layer table's columns
TITLES = dict(cls="first-token share (attention to position 0)", entropy="entropy (nats)",
              distance="mean attention distance (pieces)")


def head_stats_frame(stats: Mapping[str, torch.Tensor], layers: Sequence[int], n_pieces: int) -> pd.DataFrame:
    """:class:`~probes.maps.reducers.HeadStats`' result of one item (stat -> (L', H); ``distance_hist`` (L', H,
    K)) as one row per (layer, head): layer, head (0-based), n_pieces, every statistic, and ``hist_<d>`` the
    attention at the distance bin whose lower edge is d."""
    hist = stats["distance_hist"].cpu().numpy()  # (L', H, K)
    _, H, K = hist.shape
    cols = {k: v.cpu().numpy() for k, v in stats.items() if k != "distance_hist"}  # (L', H) each
    rows = []
    for i, l in enumerate(layers):
        for h in range(H):
            row = dict(layer=int(l), head=h, n_pieces=int(n_pieces))
            row.update({k: float(v[i, h]) for k, v in cols.items()})
            row.update({f"hist_{d}": float(hist[i, h, b]) for b, d in enumerate(distance_bin_edges(K))})
            rows.append(row)
    return pd.DataFrame(rows)


def peak_rss_gib() -> float:
    """The process's resident high-water mark (``ru_maxrss``, KiB on Linux), GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def length_figure(by_layer: pd.DataFrame, encoder: str, source: str):
    """Per-layer curves of :data:`STATS`, one line per length (layers 1-based)."""
    fig, axes = plt.subplots(1, len(STATS), figsize=(5 * len(STATS), 3.6), squeeze=False)
    L = int(by_layer.layer.max()) + 1
    for ax, stat in zip(axes[0], STATS):
        for n, g in by_layer.groupby("length"):
            g = g.sort_values("layer")
            ax.plot(g.layer + 1, g[stat], marker="o", ms=3, label=f"{int(g.n_pieces.iloc[0])} pieces")
        ax.set_xlabel("layer")
        ax.set_ylabel(stat)
        ax.set_title(TITLES[stat], fontsize=9)
        plots.layer_ticks(ax, 1, L)
        ax.legend(fontsize=7)
    fig.suptitle(f"{encoder}: running text of whole {source} documents (mean over heads)", fontsize=10)
    fig.tight_layout()
    return fig


def long_context(ctx, *, source: str = "gum", sources: Mapping[str, DocumentSource],
                 lengths: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768),
                 layers: Sequence[int] | None = None) -> pd.DataFrame:
    """Compute, save and plot the statistics (module doc); returns the per-head table.

    Args:
        ctx: The analysis context.
        source: The key of ``sources`` to read.
        sources: Name -> :class:`~probes.data.documents.DocumentSource`.
        lengths: Pieces per text (the specials included); those above the model's usable length are skipped.
        layers: 0-based layers; None: all.
    """
    if source not in sources:
        raise ValueError(f"analysis.source={source!r}: expected one of {sorted(sources)} (analysis.sources)")
    bad = [n for n in lengths if int(n) < 2]
    if not lengths or bad:
        raise ValueError(f"analysis.lengths must be lengths of at least 2 pieces, got {list(lengths)}")
    t0 = time.time()
    encoder = ctx.encoder
    limit = usable_max_length(encoder.model.config)
    skipped = {int(n): f"above {encoder.name}'s usable length of {limit} pieces" for n in lengths if int(n) > limit}
    for n, why in skipped.items():
        log.info("long_context: length %d skipped: %s", n, why)
    todo = sorted(int(n) for n in lengths if int(n) <= limit)
    if not todo:
        raise ValueError(f"every length of analysis.lengths={list(lengths)} is above {encoder.name}'s usable length "
                         f"of {limit} pieces")
    docs = sources[source].read()
    engine = MapEngine.from_config(ctx.extract_cfg, encoder.model, kind="attention", layers=layers,
                                   tokenizer=encoder.tokenizer, device=ctx.device, max_length=None)
    frames, texts, prev = [], {}, 0
    for n in todo:
        doc = running_text(encoder.tokenizer, docs, n, name=f"{source} running text of {n} pieces")
        de = encode_document(encoder.tokenizer, doc)
        if de.n_pieces <= prev:
            skipped[n] = f"the {source} documents give no text longer than the {prev} pieces of the length before"
            log.info("long_context: length %d skipped: %s", n, skipped[n])
            continue
        prev = de.n_pieces
        t1 = time.time()
        reducer = HeadStats(punct=lambda k, e, flags=de.punct: flags)
        ((_, stats),) = list(engine.iter_reduced([de.encoded], reducer, desc=f"long_context {n}"))
        seconds = time.time() - t1
        df = head_stats_frame(stats, engine.layers, de.n_pieces)
        if not np.isfinite(df[list(STATS)].to_numpy(dtype=float)).all():
            raise RuntimeError(f"long_context: non-finite statistics of {encoder.name} at {de.n_pieces} pieces")
        df.insert(0, "length", n)
        frames.append(df)
        texts[n] = dict(n_pieces=de.n_pieces, n_sentences=doc.n_sentences, n_documents=_n_documents(docs, doc),
                        seconds=round(seconds, 1), peak_rss_gib=round(peak_rss_gib(), 2),
                        rows_per_block=engine.rows_per_block(1, de.n_pieces))
        log.info("long_context: %d pieces (%d sentences) in %.1fs, peak RSS %.2f GiB", de.n_pieces, doc.n_sentences,
                 seconds, texts[n]["peak_rss_gib"])
    heads = pd.concat(frames, ignore_index=True)
    keep = ["length", "n_pieces", "layer", "head", *STATS, "prev", "self", "next", "punct"]
    ctx.save_table(heads[keep], "long_context")
    by_layer = heads.groupby(["length", "n_pieces", "layer"], as_index=False)[list(STATS)].mean()
    ctx.save_table(by_layer, "long_context_by_layer")
    hist_cols = [c for c in heads.columns if c.startswith("hist_")]
    hist = heads.groupby(["length", "n_pieces", "layer"], as_index=False)[hist_cols].mean().melt(
        id_vars=["length", "n_pieces", "layer"], var_name="bin", value_name="share")
    hist["bin"] = hist["bin"].str[len("hist_"):].astype(int)
    ctx.save_table(hist.sort_values(["length", "layer", "bin"]), "distance_hist")
    ctx.save_figure(length_figure(by_layer, encoder.name, source), "long_context")
    per_layer = {stat: {str(n): [float(x) for x in g.sort_values("layer")[stat]] for n, g in by_layer.groupby("length")}
                 for stat in STATS}
    ctx.log_summary(dict(analysis="long_context", encoder=encoder.name, causal=is_causal(encoder), source=source,
                         source_path=str(sources[source].path), usable_max_length=limit, lengths=todo,
                         lengths_run=sorted(texts), skipped={str(k): v for k, v in sorted(skipped.items())},
                         texts={str(k): v for k, v in texts.items()}, layers=list(engine.layers),
                         attention_budget_mb=float(ctx.extract_cfg.attention_budget_mb), per_layer=per_layer,
                         seconds=round(time.time() - t0, 1)))
    return heads


def _n_documents(docs, doc) -> int:
    """How many of ``docs`` (in order) the running text ``doc`` reaches into."""
    at, k = 0, 0
    for d in docs:
        if at >= len(doc.text):
            break
        k += 1
        at += len(d.text) + 1
    return k
