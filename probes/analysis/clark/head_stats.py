"""``analysis=head_stats``: surface-level attention statistics per head (Clark et al. §3, Figs 1, 2, 4).

Wordpiece level, live encoder, each sentence alone as ``[CLS] s [SEP]`` (tokenized from the
treebank words; [CLS] / [SEP] stand for the family's first and last special tokens, e.g. <s> / </s>,
always at positions 0 and T - 1). Sentences longer than ``encoder.max_length`` pieces are skipped
(counted in the log and in ``summary.json``). For every head (0-based ``layer``, ``head`` in files;
1-based ``layer-head`` in figures), averaged over attending tokens within a sentence and then over
sentences (as Clark's code):

* ``prev`` / ``self`` / ``next``: attention to the previous token / itself / the next token;
* ``cls`` / ``sep``: total attention to [CLS] / [SEP];
* ``punct``: total attention to punctuation pieces (only punctuation characters once the piece
  marker ``##`` / ``Ġ`` / ``▁`` is stripped; see :func:`probes.analysis.clark.metrics.is_punct_piece`);
* ``entropy``: mean entropy (nats) of the heads' attention distributions over all tokens;
* ``cls_entropy``: entropy of the distribution of [CLS] alone;
* ``uniform_entropy``: the Fig 4 reference, mean over sentences of log T (the entropy of uniform
  attention); the same value is repeated on every (layer, head) row so the table stays tidy.

Outputs: ``head_stats.csv`` (layer, head, stat, value), ``head_stats_by_layer.csv`` (layer, stat,
mean/min/max over heads), ``head_stats_heatmaps.png``, ``head_stats_layers.png``, ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pandas as pd
import torch

from probes.analysis.clark.metrics import HEAD_STATS, HeadStatsAccumulator, punct_positions
from probes.analysis.naming import head_name
from probes.model import hooks
from probes.model.families import is_byte_level
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)


def stats_table(stats: dict[str, np.ndarray], uniform_entropy: float | None = None) -> pd.DataFrame:
    """Tidy (layer, head, stat, value) rows from stat -> (L, H) arrays; 0-based layer/head."""
    rows = []
    for k, v in stats.items():
        L, H = v.shape
        for l in range(L):
            for h in range(H):
                rows.append((l, h, k, float(v[l, h])))
        if uniform_entropy is not None and k == "entropy":
            rows += [(l, h, "uniform_entropy", float(uniform_entropy)) for l in range(L) for h in range(H)]
    return pd.DataFrame(rows, columns=["layer", "head", "stat", "value"])


def by_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Mean/min/max over heads of each stat per layer."""
    return (df.groupby(["layer", "stat"], sort=True)["value"].agg(["mean", "min", "max"]).reset_index())


def wordpiece_attention(encoder, sentences, device: str = "cpu", max_tokens: int = 4096, max_batch_size: int = 64,
                        desc: str = "attention") -> Iterator[tuple[int, torch.Tensor, list[bool]]]:
    """Yield ``(index, attn (L, H, T, T) float32 on device, punct (T,))`` for every sentence (list of
    words) that fits ``encoder.max_length`` pieces, each alone as ``[CLS] s [SEP]``, in length-batch
    order; longer ones are skipped (logged). ``index`` is the sentence's position in ``sentences``."""
    tok = encoder.tokenizer
    encoded = encode_words(tok, [list(w) for w in sentences])
    keep = [i for i, e in enumerate(encoded) if e.n_pieces <= encoder.max_length]
    if len(keep) < len(encoded):
        log.warning("%d of %d sentences exceed %d wordpieces and are skipped", len(encoded) - len(keep),
                    len(encoded), encoder.max_length)
    byte_level = is_byte_level(tok)
    items = [encoded[i] for i in keep]
    for k, attn in hooks.iter_attention(encoder.model, items, tok.pad_token_id, device=device, max_tokens=max_tokens,
                                        max_batch_size=max_batch_size, desc=desc):
        yield keep[k], attn, punct_positions(tok, items[k].input_ids, byte_level)


def compute(encoder, sentences, device: str = "cpu", **batching) -> HeadStatsAccumulator:
    """:class:`HeadStatsAccumulator` over the sentences (treebank ``Sentence`` objects) that fit."""
    acc = HeadStatsAccumulator()
    for _, attn, punct in wordpiece_attention(encoder, [s.words for s in sentences], device=device,
                                              desc="head_stats", **batching):
        acc.add(attn, punct)
    return acc


def head_stats(ctx, *, split: str = "dev", max_sentences: int | None = None, max_tokens: int = 4096,
               max_batch_size: int = 64, top_k: int = 3) -> pd.DataFrame:
    """Compute, save and plot the per-head statistics; returns the tidy table."""
    from probes.analysis import plots

    t0 = time.time()
    sentences = ctx.sentences(split, max_sentences)
    acc = compute(ctx.encoder, sentences, device=ctx.device, max_tokens=max_tokens, max_batch_size=max_batch_size)
    stats = acc.result()
    stats = {k: stats[k] for k in HEAD_STATS}
    df = stats_table(stats, acc.uniform_entropy)
    ctx.save_table(df, "head_stats")
    layer_df = by_layer(df[df.stat != "uniform_entropy"])
    ctx.save_table(layer_df, "head_stats_by_layer")

    ctx.save_figure(plots.heatmaps(stats), "head_stats_heatmaps")
    ctx.save_figure(plots.layer_curves(
        stats, groups=[["cls", "sep", "punct"], ["prev", "self", "next"], ["entropy", "cls_entropy"]],
        ylabels=["avg. attention", "avg. attention", "avg. entropy (nats)"],
        hlines=[None, None, {"uniform": acc.uniform_entropy}]), "head_stats_layers")

    top = {}
    for k, v in stats.items():
        flat = np.argsort(-v, axis=None)[:top_k]
        top[k] = [dict(name=head_name(*np.unravel_index(i, v.shape)), value=float(v.flat[i])) for i in flat]
    per_layer = {k: [float(x) for x in v.mean(1)] for k, v in stats.items()}
    ctx.log_summary(dict(analysis="head_stats", split=split, encoder=ctx.encoder.name,
                         n_sentences=acc.n, n_input_sentences=len(sentences), n_skipped=len(sentences) - acc.n,
                         uniform_entropy=acc.uniform_entropy, per_layer_mean=per_layer, top_heads=top,
                         seconds=round(time.time() - t0, 1)))
    log.info("head_stats: %d sentences in %.1fs", acc.n, time.time() - t0)
    return df
