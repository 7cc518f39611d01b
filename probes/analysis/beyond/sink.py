"""``analysis=sink``: the attention-sink metric of Gu et al. 2024 ("When Attention Sink Emerges in Language Models").

Definition: on inputs of exactly ``window`` (T = 64) pieces, for every layer l and head h,
``alpha[l, h]`` = the mean over the query rows t = 0..T-1 of ``A[l, h, t, 0]``, the attention to the first
token (position 0: [CLS] for BERT-style encoders, ``<s>`` for MPNet / RoBERTa-style ones, the BOS of decoders
whose tokenizer adds one, else the window's first piece). Every row sees position 0, causal or not; a causal
model's row 0 (attention 1 to itself) is counted like any other. ``alpha`` is averaged over the windows
(mean of the per-window alphas) and then thresholded: the **sink rate** is the share of (l, h) pairs with
``alpha > threshold`` (epsilon, 0.3 in Gu et al.).

Inputs (:func:`text_windows`): the words of every sentence of the treebank split, in file order, joined with
single spaces into one running text of the whole split (document boundaries are ignored: the text runs on
from one document into the next), tokenized by the model's own tokenizer without special tokens and cut into
consecutive chunks of ``window`` - (the number of special tokens the tokenizer adds to one sequence) pieces;
each chunk gets the tokenizer's own specials (those it puts before and after one text,
:func:`probes.model.families.special_ids`), so every input holds exactly ``window`` pieces. The first
``max_windows`` full chunks are read (Gu et al.: 100 sequences); a split with fewer pieces than one window is
an error naming the split. The attention maps come from the project's model layer through the map engine
(:class:`probes.maps.MapEngine` with :class:`probes.measures.attention.Attention`), as every analysis reads them.

Outputs: ``sink.csv`` (layer, head, alpha; 0-based), ``sink_by_layer.csv`` (layer, mean_alpha, share_above,
n_heads), ``sink.png`` (per layer: mean alpha over heads with every head's alpha, and the share of heads above
the threshold), ``sink_heads.png`` (alpha per layer x head), ``summary.json`` (``sink_rate``, ``threshold``,
``window``, ``n_windows``, ``first_token``: the piece at position 0 of the first window, ``first_is_special``,
``causal``, ``seconds``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from probes.analysis import plots
from probes.analysis.clark.metrics import is_causal
from probes.maps import MapEngine
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


def first_token_alpha(encoder, windows: Sequence[Encoded], device: str = "cpu", max_batch_size: int = 32,
                      desc: str = "sink") -> np.ndarray:
    """(L, H) mean over ``windows`` of each head's mean attention to position 0 over the query rows."""
    T = windows[0].n_pieces
    engine = MapEngine(encoder.model, Attention(), tokenizer=encoder.tokenizer, device=device,
                       max_tokens=T * int(max_batch_size), max_batch_size=int(max_batch_size), max_pairs=None)
    total = None
    for _, attn in engine.iter_piece_maps(list(windows), desc=desc):  # attn: (L, H, T, T)
        alpha = attn[..., :, 0].double().mean(-1)  # (L, H) mean over query rows of attention to position 0
        total = alpha if total is None else total + alpha
    return (total / len(windows)).cpu().numpy()


def alpha_table(alpha: np.ndarray) -> pd.DataFrame:
    """(layer, head, alpha) rows of an (L, H) array; 0-based layer/head."""
    L, H = alpha.shape
    return pd.DataFrame([(l, h, float(alpha[l, h])) for l in range(L) for h in range(H)],
                        columns=["layer", "head", "alpha"])


def layer_table(alpha: np.ndarray, threshold: float) -> pd.DataFrame:
    """(layer, mean_alpha, share_above, n_heads) of an (L, H) array: mean over heads and the share of heads with
    alpha > ``threshold``."""
    above = alpha > threshold  # (L, H)
    return pd.DataFrame(dict(layer=np.arange(alpha.shape[0]), mean_alpha=alpha.mean(1), share_above=above.mean(1),
                             n_heads=np.full(alpha.shape[0], alpha.shape[1])))


def sink(ctx, *, split: str = "dev", window: int = 64, max_windows: int | None = 100, threshold: float = 0.3,
         max_batch_size: int = 32) -> pd.DataFrame:
    """Compute, save and plot the attention-sink metric (module doc); returns the (layer, head, alpha) table.

    Args:
        ctx: The analysis context.
        split: The treebank split whose running text is read.
        window: Pieces per input, the tokenizer's specials included (Gu et al.: 64).
        max_windows: The first N windows of the split; None: all.
        threshold: epsilon: a head is a sink head when its alpha exceeds it (Gu et al.: 0.3).
        max_batch_size: Windows per forward.
    """
    t0 = time.time()
    encoder = ctx.encoder
    if window > encoder.max_length:
        raise ValueError(f"analysis.window={window} exceeds {encoder.name}'s usable length of {encoder.max_length}")
    tok = encoder.tokenizer
    sentences = ctx.sentences(split)
    what = f"split {split!r} ({ctx.treebank.path(split)})"
    windows = text_windows(tok, running_split_text(sentences), window, max_windows, what=what)
    alpha = first_token_alpha(encoder, windows, ctx.device, max_batch_size)  # (L, H)
    df = alpha_table(alpha)
    ctx.save_table(df, "sink")
    ctx.save_table(layer_table(alpha, threshold), "sink_by_layer")

    titles = {"alpha": "alpha (mean attention to position 0)", "above": f"share of heads with alpha > {threshold:g}"}
    stats = {"alpha": alpha, "above": (alpha > threshold).astype(float)}  # (L, H) each
    ctx.save_figure(plots.layer_curves(stats, groups=[["alpha", "above"]], ylabels=["alpha / share of heads"],
                                       hlines=[{f"epsilon = {threshold:g}": threshold}], titles=titles), "sink")
    ctx.save_figure(plots.heatmaps({"alpha": alpha}, titles=titles, ncols=1), "sink_heads")

    first_id = windows[0].input_ids[0]
    sink_rate = float((alpha > threshold).mean())
    ctx.log_summary(dict(analysis="sink", split=split, encoder=encoder.name, causal=is_causal(encoder),
                         sink_rate=sink_rate, threshold=float(threshold), window=int(window), n_windows=len(windows),
                         first_token=tok.convert_ids_to_tokens(first_id),
                         first_is_special=first_id in set(tok.all_special_ids),
                         per_layer_mean_alpha=[float(x) for x in alpha.mean(1)],
                         seconds=round(time.time() - t0, 1)))
    log.info("sink: rate %.3f (alpha > %g) over %d windows of %d pieces in %.1fs", sink_rate, threshold,
             len(windows), window, time.time() - t0)
    return df
