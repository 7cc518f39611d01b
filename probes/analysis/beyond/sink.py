"""``analysis=sink``: the attention-sink metric of Gu et al. 2024 ("When Attention Sink Emerges in Language Models").

Definition: on inputs of exactly ``window`` (T = 64) pieces, for every window n, layer l and head h,
``alpha[n, l, h]`` = the mean over the query rows t = 0..T-1 of ``A[n, l, h, t, 0]``, the attention to the
first token (position 0: [CLS] for BERT-style encoders, ``<s>`` for MPNet / RoBERTa-style ones, the BOS of
decoders whose tokenizer adds one, else the window's first piece). Every row sees position 0, causal or not; a
causal model's row 0 (attention 1 to itself) is counted like any other. The **sink rate** is the authors' own:
each window's alpha is compared with the threshold (epsilon, 0.3 in Gu et al.) and the indicator
``alpha[n, l, h] > threshold`` is averaged over the windows, layers and heads (``compute_attention_sink`` in
``eval_sink_open_source.py`` of github.com/sail-sg/Attention-Sink: ``(importance_scores > epsilon)`` averaged
over samples, layers and heads, its position-0 entry). Beside it, under its own name, the share of (l, h) pairs
whose alpha averaged over the windows exceeds the threshold (``share_mean_alpha_above``: mean, then threshold),
a different quantity: a head above the threshold in 60 % of the windows counts 0.6 in the sink rate and 1 or 0
in that share, as its mean alpha falls.

Inputs (:func:`text_windows`): the words of every sentence of the treebank split, in file order, joined with
single spaces into one running text of the whole split (document boundaries are ignored: the text runs on
from one document into the next), tokenized by the model's own tokenizer without special tokens and cut into
consecutive chunks of ``window`` - (the number of special tokens the tokenizer adds to one sequence) pieces;
each chunk gets the tokenizer's own specials (those it puts before and after one text,
:func:`probes.model.families.special_ids`), so every input holds exactly ``window`` pieces. The first
``max_windows`` full chunks are read (Gu et al.: 100 sequences); a split with fewer pieces than one window is
an error naming the split. The attention maps come from the project's model layer through the map engine
(:class:`probes.maps.MapEngine` with :class:`probes.measures.attention.Attention`), as every analysis reads them.

Documents (``documents``: a name of ``conf/analyze.yaml``'s ``documents``): each whole document is one input in
place of a window (its running text with the tokenizer's own specials); alpha per document, the rate over
documents; documents longer than ``encoder.max_length`` pieces are skipped and named in ``summary.json``.

The attention is reduced on the maps' device a batch at a time (:class:`probes.maps.reducers.HeadStats` with
``stats=("cls",)``): the (N, L, H) alphas are copied to the host once, no map is.

Outputs: ``sink.csv`` (layer, head, alpha: the mean over windows, windows_above: the share of windows with
alpha > threshold; 0-based), ``sink_by_layer.csv`` (layer, mean_alpha, sink_rate: the authors' rate over the
layer's windows and heads, share_mean_alpha_above: the share of its heads whose mean alpha exceeds the
threshold, n_heads), ``sink.png`` (per layer: mean alpha over heads with every head's alpha, and the sink rate
with every head's share of windows above the threshold), ``sink_heads.png`` (alpha per layer x head),
``summary.json`` (``sink_rate``, ``share_mean_alpha_above``, ``sink_rate_definition``, ``threshold``,
``window``, ``n_windows``, ``first_token``: the piece at position 0 of the first window, ``first_is_special``,
``causal``, ``per_layer_mean_alpha``, ``per_layer_sink_rate``, ``seconds``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from probes.analysis import plots
from probes.analysis.clark.head_stats import document_inputs
from probes.analysis.clark.metrics import is_causal
from probes.data.documents import DocumentSource
from probes.maps import HeadStats, MapEngine
from probes.measures.attention import Attention
from probes.model.families import special_ids
from probes.model.inputs import Encoded, check_pieces

log = logging.getLogger(__name__)


class TooFewPieces(ValueError):
    """The running text has fewer pieces than one window."""


def running_split_text(sentences) -> str:
    """The words of every sentence (treebank ``Sentence`` objects, file order) joined with single spaces into one
    running text; document boundaries are not marked."""
    return " ".join(" ".join(s.words) for s in sentences)


def text_windows(tokenizer, text: str, window: int = 64, max_windows: int | None = 100,
                 what: str = "the text") -> list[Encoded]:
    """Consecutive windows of exactly ``window`` pieces of ``text`` as the model reads it (module doc).

    Args:
        tokenizer: The model's own (fast) tokenizer.
        text: The running text.
        window: Pieces per window, the tokenizer's specials included.
        max_windows: The most windows (the first ones); None: every full window.
        what: How errors name the text (e.g. the split and its file).

    Returns:
        The windows, each ``[specials before] chunk [specials after]`` with ``word_of_piece`` -1 throughout (raw
        text has no words).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__}: the sink windows need a fast (tokenizers) tokenizer, whose "
                        "character offsets check the pieces against the text")
    first, last = special_ids(tokenizer)
    body = int(window) - len(first) - len(last)
    if body < 1:
        raise ValueError(f"analysis.window={window} leaves no room for text beside the {len(first) + len(last)} "
                         f"special tokens {type(tokenizer).__name__} adds to one sequence")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = list(enc["input_ids"])  # (N,) the pieces of the whole text
    n = len(ids) // body if max_windows is None else min(len(ids) // body, int(max_windows))
    if n < 1:
        raise TooFewPieces(f"{what} has {len(ids)} pieces, fewer than one window of {window} ({body} pieces of text "
                           f"+ {len(first) + len(last)} special tokens of {type(tokenizer).__name__}); use a longer "
                           "split or a smaller analysis.window")
    used = ids[:n * body]
    check_pieces(tokenizer, used, text[:enc["offset_mapping"][n * body - 1][1]], sentence=what)
    out = []
    for k in range(n):
        chunk = used[k * body:(k + 1) * body]  # (window - specials,)
        seq = [*first, *chunk, *last]  # (window,)
        out.append(Encoded(seq, [-1] * len(seq), 0, None))
    return out


# Gu et al.'s sink rate, as their code computes it (summary.json ``sink_rate_definition``).
SINK_RATE_DEFINITION = ("Gu et al. 2024: the indicator alpha > threshold of every window, layer and head, averaged "
                        "over the windows, layers and heads (compute_attention_sink, eval_sink_open_source.py, "
                        "github.com/sail-sg/Attention-Sink); alpha: a head's attention to position 0, mean over the "
                        "query rows of one window")


def first_token_alpha(encoder, windows: Sequence[Encoded], device: str = "cpu", max_batch_size: int = 32,
                      desc: str = "sink", max_tokens: int | None = None, attention_budget_mb: float = 1024
                      ) -> np.ndarray:
    """(N, L, H): each window's (or document's) mean over the query rows of each head's attention to position 0.
    Reduced batch by batch on the maps' device (:class:`probes.maps.reducers.HeadStats` ``stats=("cls",)``):
    the (N, L, H) values stay there until one copy at the end; no map leaves the device. ``max_tokens``: pieces per
    batch (None: ``max_batch_size`` of the longest input); a batch whose whole maps exceed ``attention_budget_mb``
    (``extract.attention_budget_mb``) is reduced in blocks of query rows."""
    T = max(w.n_pieces for w in windows)
    engine = MapEngine(encoder.model, Attention(), tokenizer=encoder.tokenizer, device=device,
                       max_tokens=int(max_tokens) if max_tokens else T * int(max_batch_size),
                       max_batch_size=int(max_batch_size), max_pairs=None, attention_budget_mb=attention_budget_mb)
    reducer = HeadStats(stats=("cls",))
    alpha = None
    for positions, batch in engine.iter_reduced_batches(list(windows), reducer, desc=desc):
        a = batch["cls"]  # (B, L, H) float64, on the maps' device
        if alpha is None:
            alpha = torch.full((len(windows), *a.shape[1:]), float("nan"), dtype=torch.float64, device=a.device)
        alpha[torch.as_tensor(positions, device=a.device)] = a
    alpha = alpha.cpu().numpy() if alpha is not None else None  # (N, L, H)
    if alpha is None or not np.isfinite(alpha).all():
        raise RuntimeError(f"sink: the attention to position 0 of {encoder.name} is missing or not finite in "
                           f"{len(windows) if alpha is None else int((~np.isfinite(alpha)).any(axis=(1, 2)).sum())} "
                           f"of {len(windows)} inputs")
    return alpha


def alpha_table(alpha: np.ndarray, threshold: float) -> pd.DataFrame:
    """(layer, head, alpha, windows_above) rows of the (N, L, H) per-window alphas: the mean over the windows and
    the share of windows with alpha > ``threshold``; 0-based layer/head."""
    mean, above = alpha.mean(0), (alpha > threshold).mean(0)  # (L, H) each
    L, H = mean.shape
    return pd.DataFrame([(l, h, float(mean[l, h]), float(above[l, h])) for l in range(L) for h in range(H)],
                        columns=["layer", "head", "alpha", "windows_above"])


def layer_table(alpha: np.ndarray, threshold: float) -> pd.DataFrame:
    """(layer, mean_alpha, sink_rate, share_mean_alpha_above, n_heads) of the (N, L, H) per-window alphas: the
    mean alpha over windows and heads, Gu et al.'s rate (alpha > ``threshold`` per window, averaged over the
    windows and heads) and the share of heads whose mean alpha over the windows exceeds ``threshold``."""
    mean = alpha.mean(0)  # (L, H)
    return pd.DataFrame(dict(layer=np.arange(mean.shape[0]), mean_alpha=mean.mean(1),
                             sink_rate=(alpha > threshold).mean(axis=(0, 2)),
                             share_mean_alpha_above=(mean > threshold).mean(1),
                             n_heads=np.full(mean.shape[0], mean.shape[1])))


def sink(ctx, *, split: str = "dev", window: int = 64, max_windows: int | None = 100, threshold: float = 0.3,
         max_batch_size: int = 32, documents: str | None = None, sources: Mapping[str, DocumentSource] | None = None,
         max_documents: int | None = None, max_tokens: int = 16384) -> pd.DataFrame:
    """Compute, save and plot the attention-sink metric (module doc); returns the (layer, head, alpha,
    windows_above) table.

    Args:
        ctx: The analysis context.
        split: The treebank split whose running text is read.
        window: Pieces per input, the tokenizer's specials included (Gu et al.: 64).
        max_windows: The first N windows of the split; None: all.
        threshold: epsilon: a head sinks in a window when its alpha there exceeds it (Gu et al.: 0.3).
        max_batch_size: Windows per forward.
        documents: None: windows of the split (above). A key of ``sources``: its whole documents instead, each
            one input with the tokenizer's specials (alpha per document, the rate over documents); those above
            ``encoder.max_length`` pieces are skipped and counted. ``split``, ``window`` and ``max_windows`` are then
            not used.
        sources: Name -> :class:`~probes.data.documents.DocumentSource` (``documents`` of ``conf/analyze.yaml``).
        max_documents: The first N documents of the source; None: all.
        max_tokens: Pieces per forward of documents (a longer document is read alone).
    """
    t0 = time.time()
    encoder = ctx.encoder
    tok = encoder.tokenizer
    inputs: dict = dict(split=split, window=int(window))
    if documents is not None:
        windows, inputs = _documents(encoder, documents, sources or {}, max_documents)
        max_tokens = max(int(max_tokens), max(w.n_pieces for w in windows))
    else:
        if window > encoder.max_length:
            raise ValueError(f"analysis.window={window} exceeds {encoder.name}'s usable length of "
                             f"{encoder.max_length}")
        sentences = ctx.sentences(split)
        what = f"split {split!r} ({ctx.treebank.path(split)})"
        windows = text_windows(tok, running_split_text(sentences), window, max_windows, what=what)
        max_tokens = None
    alpha = first_token_alpha(encoder, windows, ctx.device, max_batch_size, max_tokens=max_tokens,
                              attention_budget_mb=float(ctx.extract_cfg.attention_budget_mb))  # (N, L, H)
    df = alpha_table(alpha, threshold)
    by_layer = layer_table(alpha, threshold)
    ctx.save_table(df, "sink")
    ctx.save_table(by_layer, "sink_by_layer")

    mean, above = alpha.mean(0), (alpha > threshold).mean(0)  # (L, H) each
    titles = {"alpha": "alpha (mean over windows of the attention to position 0)",
              "above": f"sink rate: share of windows with alpha > {threshold:g}"}
    ctx.save_figure(plots.layer_curves({"alpha": mean, "above": above}, groups=[["alpha", "above"]],
                                       ylabels=["alpha / share"], hlines=[{f"epsilon = {threshold:g}": threshold}],
                                       titles=titles), "sink")
    ctx.save_figure(plots.heatmaps({"alpha": mean}, titles=titles, ncols=1), "sink_heads")

    first_id = windows[0].input_ids[0]
    sink_rate = float((alpha > threshold).mean())
    share = float((mean > threshold).mean())
    ctx.log_summary(dict(analysis="sink", **inputs, encoder=encoder.name, causal=is_causal(encoder),
                         sink_rate=sink_rate, share_mean_alpha_above=share, sink_rate_definition=SINK_RATE_DEFINITION,
                         threshold=float(threshold), n_windows=len(windows),
                         first_token=tok.convert_ids_to_tokens(first_id),
                         first_is_special=first_id in set(tok.all_special_ids),
                         per_layer_mean_alpha=[float(x) for x in by_layer.mean_alpha],
                         per_layer_sink_rate=[float(x) for x in by_layer.sink_rate],
                         seconds=round(time.time() - t0, 1)))
    log.info("sink: rate %.3f (alpha > %g per input; mean alpha > %g: %.3f of the heads) over %d %s in %.1fs",
             sink_rate, threshold, threshold, share, len(windows),
             "documents" if documents is not None else f"windows of {window} pieces", time.time() - t0)
    return df


def _documents(encoder, documents: str, sources: Mapping[str, DocumentSource], max_documents: int | None
               ) -> tuple[list[Encoded], dict]:
    """(the whole documents of ``sources[documents]`` that fit the encoder, each encoded with its specials
    (:func:`probes.analysis.clark.head_stats.document_inputs`, as head_stats reads them); the summary's entries: what
    was read, what was skipped and why)."""
    encoded, counts = document_inputs(encoder, documents, sources, max_documents, "sink")
    lengths = [e.n_pieces for e in encoded]
    return encoded, dict(
        input="documents", documents=documents, source_path=str(sources[documents].path),
        max_documents=max_documents, n_input_documents=counts.n_input_documents, n_documents=counts.n_documents,
        n_skipped_documents=counts.n_skipped_documents, skipped_documents=counts.skipped,
        documents_left_out=f"longer than encoder.max_length = {encoder.max_length} pieces (one input each)",
        pieces=dict(min=min(lengths), mean=round(float(np.mean(lengths)), 1), max=max(lengths)))
