"""Pure computations on attention maps (no model, no files): what the analyses and tests call.

Shapes: ``attn`` is ``(L, H, T, T)`` (or ``(K, T, T)`` with K = L * H flattened heads); rows are the
attending (from) position, columns the attended (to) position, each row a distribution.
Wordpiece maps have the family's first special token ([CLS] / <s>) at position 0 and its last
([SEP] / </s>) at T - 1 (called [CLS] / [SEP] below); word maps (the attention cache) have side
W = n + 2 with [CLS] at 0, words 1..n, [SEP] at n + 1. Heads and predictions of words are
1-based word indices (0 = root), as in CoNLL-U.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from probes.stats import entropy
from probes.model.families import is_byte_level

HEAD_STATS = ("prev", "self", "next", "cls", "sep", "sep_sep", "rest_sep", "punct", "entropy", "cls_entropy")
# Clark et al.'s punctuation (General_Analysis.ipynb: ``token == "." or token == ","``), the same in head_stats,
# clustering and grad_sep; a piece counts once its tokenizer marker is stripped (``Ġ,`` / ``▁.``).
PERIOD_COMMA = frozenset({".", ","})
# Smoothing of Clark's code: entropies use 0.9999 * a + 0.0001 / T ("to avoid NaNs"), the JS distances
# between heads (head_distances.py) 0.999 * a + 0.001 / T.
ENTROPY_SMOOTHING = 1e-4
JS_SMOOTHING = 1e-3
DIRECTIONS = ("dep2head", "head2dep")  # row of the dependent / column of the dependent (transposed map)


def is_causal(encoder) -> bool:
    """The model layer's convention (``encoder.family.causal``): True for a causal LM, whose attention row
    of a token covers itself and the earlier tokens only."""
    return bool(getattr(encoder.family, "causal", False))


# ------------------------------------------------------------------------------------------ §3
# Markers a tokenizer puts on pieces: WordPiece continuation, byte-level BPE word start (space),
# SentencePiece word start.
PIECE_MARKERS = ("##", "\u0120", "\u2581")  # "##", "Ġ", "▁"


def piece_text(token: str) -> str:
    """The piece without its tokenizer's marker: ``##.`` / ``Ġ,`` / ``▁,`` -> ``.`` / ``,`` / ``,``."""
    for m in PIECE_MARKERS:
        if token.startswith(m):
            return token[len(m):]
    return token


def is_period_comma(token: str) -> bool:
    """A ``.`` or ``,`` piece (:data:`PERIOD_COMMA`) once its marker is stripped (:func:`piece_text`)."""
    return piece_text(token) in PERIOD_COMMA


def piece_strings(tokenizer, ids: Sequence[int], byte_level: bool | None = None) -> list[str]:
    """The pieces of ``ids`` (T,) as :func:`is_period_comma` reads them: ``convert_ids_to_tokens``; for
    byte-level BPE the piece's own characters (``ĠâĢľ`` -> ``“``) unless it holds part of a character.
    ``byte_level``: :func:`probes.model.families.is_byte_level` of the tokenizer (computed if None;
    pass it when calling per sentence, it parses the tokenizer's JSON)."""
    if byte_level is None:
        byte_level = is_byte_level(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(ids))
    if not byte_level:
        return tokens
    out = []
    for t in tokens:
        text = tokenizer.convert_tokens_to_string([t]).strip()
        out.append(t if "\ufffd" in text or not text else text)
    return out


def punct_positions(tokenizer, ids: Sequence[int], byte_level: bool | None = None) -> list[bool]:
    """(T,) ``.`` / ``,`` pieces (:func:`is_period_comma`, Clark's definition) of one sequence; the
    specials at positions 0 and T - 1 and any of the tokenizer's special ids never count."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    punct = [is_period_comma(t) and i not in special for t, i in zip(piece_strings(tokenizer, ids, byte_level), ids)]
    if punct:
        punct[0] = punct[-1] = False
    return punct


def smooth(attn: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Clark's smoothing of attention rows: ``(1 - s) * attn + s / T`` (T = the last dim); rows still sum to 1."""
    return (1.0 - smoothing) * attn + smoothing / attn.shape[-1]


def smoothed_entropy(attn: torch.Tensor, smoothing: float = ENTROPY_SMOOTHING) -> torch.Tensor:
    """Entropy (nats) of every row of :func:`smooth` ``(attn)``, as Clark's General_Analysis.ipynb:
    (..., T, T) -> (...,  T)."""
    return entropy(smooth(attn.float(), smoothing))


def sentence_head_stats(attn: torch.Tensor, punct: torch.Tensor | Sequence[bool],
                        sep: torch.Tensor | Sequence[bool] | None = None,
                        smoothing: float = ENTROPY_SMOOTHING) -> dict[str, torch.Tensor]:
    """Per-head statistics of one sequence's wordpiece attention, as Clark's General_Analysis.ipynb.

    attn: (L, H, T, T), [CLS] at 0; punct: (T,) bool, ``.`` / ``,`` pieces; sep: (T,) bool, the
    separators ([SEP] / </s>: one at T - 1 for ``[CLS] s [SEP]``, two or three for a pair; None = T - 1).
    Returns stat -> (L, H), means over the T attending tokens of the sequence:
      prev / next: attention to position i - 1 / i + 1 (the diagonal's sum / T, as Clark's code: the
      first / last token, which has none, counts 0), self: attention to itself,
      cls / sep / punct: total attention to [CLS] / all separators / punctuation,
      sep_sep: total attention from a separator to the separators (mean over the separator rows),
      rest_sep: the same from every other token (mean over the T - n_sep other rows, [CLS] included),
      entropy: entropy of the smoothed attention rows (:func:`smoothed_entropy`), cls_entropy: of [CLS]'s row.
    """
    attn = attn.float()
    T = attn.shape[-1]
    punct = torch.as_tensor(punct, dtype=torch.bool, device=attn.device)  # (T,)
    if sep is None:
        sep = torch.zeros(T, dtype=torch.bool, device=attn.device)
        sep[T - 1] = True
    sep = torch.as_tensor(sep, dtype=torch.bool, device=attn.device)  # (T,)
    n_sep = int(sep.sum())
    to_sep = attn[..., sep].sum(-1)  # (L, H, T) total attention of every row to the separators
    ent = smoothed_entropy(attn, smoothing)  # (L, H, T)
    nan = torch.full(attn.shape[:2], float("nan"), device=attn.device)
    return dict(
        prev=torch.diagonal(attn, offset=-1, dim1=-2, dim2=-1).sum(-1) / T,
        self=torch.diagonal(attn, dim1=-2, dim2=-1).mean(-1),
        next=torch.diagonal(attn, offset=1, dim1=-2, dim2=-1).sum(-1) / T,
        cls=attn[..., 0].mean(-1),
        sep=to_sep.mean(-1),
        sep_sep=to_sep[..., sep].mean(-1) if n_sep else nan,
        rest_sep=to_sep[..., ~sep].mean(-1) if n_sep < T else nan,
        punct=attn[..., punct].sum(-1).mean(-1),
        entropy=ent.mean(-1),
        cls_entropy=ent[..., 0],
    )


def uniform_row_entropy(T: int, causal: bool = False) -> float:
    """Mean entropy (nats) of the T rows of a map attending uniformly to every key it may see: log T
    (bidirectional), or the mean over rows i = 0..T-1 of log(i + 1) (causal: row i sees i + 1 keys)."""
    return float(np.log(np.arange(1, T + 1)).mean()) if causal else float(np.log(T))


class HeadStatsAccumulator:
    """Averages :func:`sentence_head_stats` over sentences (each sentence weighs 1, as Clark's code).

    ``uniform_entropy`` is the reference of Clark's Fig 4: the mean over sentences of the entropy every
    row would have if it attended uniformly to all the keys it may see (:func:`uniform_row_entropy`:
    log T; for a ``causal`` model row i sees i + 1 keys).
    """

    def __init__(self, causal: bool = False):
        self.sums: dict[str, torch.Tensor] = {}
        self.n = 0
        self.log_t = 0.0
        self.causal = bool(causal)

    def add(self, attn: torch.Tensor, punct, sep=None) -> None:
        """attn (L, H, T, T); punct, sep (T,) bool (see :func:`sentence_head_stats`)."""
        for k, v in sentence_head_stats(attn, punct, sep).items():
            v = v.detach().double().cpu()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.n += 1
        self.log_t += uniform_row_entropy(attn.shape[-1], self.causal)

    def result(self) -> dict[str, np.ndarray]:
        """stat -> (L, H) mean over the added sentences."""
        if self.n == 0:
            raise ValueError("no sentences were added")
        return {k: (v / self.n).numpy() for k, v in self.sums.items()}

    @property
    def uniform_entropy(self) -> float:
        """Mean over the added sentences of :func:`uniform_row_entropy` (nats)."""
        return self.log_t / max(self.n, 1)


def uniform_entropy_sum(lengths: torch.Tensor, causal: bool = False) -> float:
    """Sum over sequences of :func:`uniform_row_entropy` of each length (lengths (N,), vectorized): log T, or for
    a causal model the mean over rows of log(i + 1) = lgamma(T + 1) / T."""
    t = lengths.double()
    return float((torch.lgamma(t + 1) / t).sum() if causal else torch.log(t).sum())


class HeadStatsTotals:
    """Averages per-sequence head statistics over sequences (each sequence weighs 1, as
    :class:`HeadStatsAccumulator`), fed a batch at a time with :class:`probes.maps.reducers.HeadStats`'
    ``batch_results`` (stat -> (B, L, H) on the maps' device): the sums stay on that device, one copy at
    :meth:`result`. Same interface as :class:`HeadStatsAccumulator` (``result``, ``uniform_entropy``, ``causal``,
    ``n``)."""

    def __init__(self, causal: bool = False, stats: Sequence[str] = HEAD_STATS):
        self.causal, self.stats = bool(causal), tuple(stats)
        self.sums: dict[str, torch.Tensor] = {}
        self.n = 0
        self.log_t = 0.0

    def add_batch(self, batch: dict[str, torch.Tensor], lengths: Sequence[int]) -> None:
        """``batch``: stat -> (B, L, H) of B sequences of ``lengths`` (B,) pieces; stats other than ``stats`` are
        ignored."""
        for k in self.stats:
            v = batch[k].sum(0)  # (L, H)
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.n += len(lengths)
        self.log_t += uniform_entropy_sum(torch.as_tensor(list(lengths)), self.causal)

    def result(self) -> dict[str, np.ndarray]:
        """stat -> (L, H) mean over the added sequences."""
        if self.n == 0:
            raise ValueError("no sentences were added")
        return {k: (v / self.n).cpu().numpy() for k, v in self.sums.items()}

    @property
    def uniform_entropy(self) -> float:
        """Mean over the added sequences of :func:`uniform_row_entropy` (nats)."""
        return self.log_t / max(self.n, 1)


class PunctFlags:
    """:func:`punct_positions` of many sequences of one tokenizer, each piece id judged once (memo): call with a
    sequence's ids (T,), get its (T,) flags."""

    def __init__(self, tokenizer, byte_level: bool | None = None):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer) if byte_level is None else bool(byte_level)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.memo: dict[int, bool] = {}

    def __call__(self, ids: Sequence[int]) -> list[bool]:
        memo = self.memo
        new = [i for i in set(ids) if i not in memo]
        if new:
            for i, s in zip(new, piece_strings(self.tokenizer, new, self.byte_level)):
                memo[i] = is_period_comma(s) and i not in self.special
        out = [memo[i] for i in ids]
        if out:
            out[0] = out[-1] = False
        return out


# ------------------------------------------------------------------------------------------ §4
def predict_heads(word_attn: torch.Tensor | np.ndarray, transpose: bool = False, causal: bool = False) -> np.ndarray:
    """Most-attended other word of every word, per head (Clark's ``attn_head_predictor``).

    word_attn: (L, H, W, W) word-level maps, W = n + 2. ``transpose=False`` (dep2head): word j's
    prediction is the word its row attends to most; ``transpose=True`` (head2dep): the word that
    attends most to j. Attention to self and to [CLS]/[SEP] is ignored. Returns (L, H, n) int,
    1-based word indices. A one-word sentence predicts the word itself (never a correct head).

    ``causal`` (decoders: row i sees words <= i only): the candidates are the words a head can see in
    that direction: dep2head, the words *before* j (j's row); head2dep, the words *after* j (the rows
    that see j). So dep2head can only be right when the gold head precedes the dependent, head2dep
    only when it follows; a word with no candidate (the first word in dep2head, the last in head2dep)
    predicts 0 (ROOT), which is never a scored head.
    """
    a = torch.as_tensor(np.asarray(word_attn, dtype=np.float32))
    if transpose:
        a = a.transpose(-1, -2)
    a = a[..., 1:-1, 1:-1].clone()  # (L, H, n, n) words only
    n = a.shape[-1]
    idx = torch.arange(n)
    a[..., idx, idx] = float("-inf")
    if causal:
        # row j of a: dep2head candidates k < j; head2dep (transposed) candidates k > j
        visible = idx[None, :] < idx[:, None] if not transpose else idx[None, :] > idx[:, None]  # (n, n)
        a = a.masked_fill(~visible, float("-inf"))
        pred = a.argmax(-1) + 1  # (L, H, n)
        none = ~visible.any(-1)  # (n,) words without a candidate
        pred[..., none] = 0
        return pred.numpy()
    if n == 1:
        return np.ones(a.shape[:-1], dtype=np.int64)
    return a.argmax(-1).numpy() + 1


def offset_predictions(n: int, offset: int) -> np.ndarray:
    """Fixed-offset baseline: word j (1-based) predicts word j + offset, clipped into 0..n (0 = ROOT), as
    Clark's ``offset_predictor`` (``max(0, min(i + offset + 1, len(words)))``). (n,) int."""
    return np.clip(np.arange(1, n + 1) + offset, 0, n)


POSS_CLITICS = frozenset({"'s", "'", "’s", "’"})


def evaluation_positions(words: Sequence[str], deprels: Sequence[str], poss_relations: Sequence[str] = ()) -> np.ndarray:
    """0-based position whose prediction is scored for each word (usually the word itself).

    Clark et al.'s special case for possessives: a dependent of a ``poss_relations`` relation that
    is followed by a clitic ('s or ') is scored by the clitic's prediction (the paper's poss
    heads attend from 's to the possessed noun, Section 4.2).
    """
    pos = np.arange(len(words))
    poss = set(poss_relations)
    for j, r in enumerate(deprels):
        if r in poss and j + 1 < len(words) and words[j + 1] in POSS_CLITICS:
            pos[j] = j + 1
    return pos


class DepAccumulator:
    """Counts correct head predictions per relation, for every head/direction and every offset.

    Relations in ``exclude`` (and words whose gold head is root) are left out, also of ``all``.
    ``causal``: the direction rule of decoders (:func:`predict_heads`). ``head_before[rel]`` counts the
    pairs whose gold head precedes the scored word (those dep2head can get right in a causal model;
    head2dep can get the others).
    """

    def __init__(self, num_layers: int, num_heads: int, offsets: Sequence[int] = (-3, -2, -1, 0, 1, 2),
                 exclude: Sequence[str] = ("root", "punct"), poss_relations: Sequence[str] = (),
                 strip_subtypes: bool = False, causal: bool = False):
        self.L, self.H = num_layers, num_heads
        self.causal = bool(causal)
        self.head_before: dict[str, int] = {}
        self.offsets = list(offsets)
        self.exclude = set(exclude)
        self.poss_relations = list(poss_relations)
        self.strip_subtypes = strip_subtypes
        self.count: dict[str, int] = {}
        self.head_correct: dict[str, np.ndarray] = {}  # rel -> (2, L, H)
        self.offset_correct: dict[str, np.ndarray] = {}  # rel -> (n_offsets,)
        self.n_sentences = 0

    def _rel(self, r: str) -> str:
        return r.split(":")[0] if self.strip_subtypes else r

    def add(self, word_attn, words: Sequence[str], heads: Sequence[int], deprels: Sequence[str]) -> None:
        """word_attn: (L, H, n + 2, n + 2); words, heads (0 = root, 1-based), deprels: (n,)."""
        n = len(words)
        assert np.shape(word_attn)[-1] == n + 2, (np.shape(word_attn), n)
        rels = [self._rel(r) for r in deprels]
        heads = np.asarray(heads)
        keep = np.array([h != 0 and r not in self.exclude for h, r in zip(heads, rels)], dtype=bool)
        self.n_sentences += 1
        if not keep.any():
            return
        pos = evaluation_positions(words, rels, self.poss_relations)
        pred = np.stack([predict_heads(word_attn, transpose=False, causal=self.causal),
                         predict_heads(word_attn, transpose=True, causal=self.causal)])  # (2, L, H, n)
        head_ok = pred[..., pos] == heads  # (2, L, H, n)
        before = heads < pos + 1  # (n,) gold head precedes the scored word (1-based)
        off_ok = np.stack([offset_predictions(n, o)[pos] == heads for o in self.offsets])  # (O, n)
        rels_arr = np.asarray(rels, dtype=object)
        for r in ["all", *sorted({r for r, k in zip(rels, keep) if k})]:
            m = keep if r == "all" else keep & (rels_arr == r)
            c = int(m.sum())
            self.count[r] = self.count.get(r, 0) + c
            self.head_before[r] = self.head_before.get(r, 0) + int((before & m).sum())
            hc = head_ok[..., m].sum(-1)
            oc = off_ok[:, m].sum(-1)
            if r in self.head_correct:
                self.head_correct[r] += hc
                self.offset_correct[r] += oc
            else:
                self.head_correct[r] = hc.astype(np.int64)
                self.offset_correct[r] = oc.astype(np.int64)

    def head_accuracy(self, rel: str) -> np.ndarray:
        """(2, L, H) accuracy of every head in both directions (DIRECTIONS order)."""
        return self.head_correct[rel] / max(self.count[rel], 1)

    def head_before_share(self, rel: str) -> float:
        """Share of ``rel``'s pairs whose head precedes the scored word: in a causal model the most
        dep2head can reach (head2dep: 1 minus it)."""
        return self.head_before[rel] / max(self.count[rel], 1)

    def offset_accuracy(self, rel: str) -> np.ndarray:
        """(n_offsets,) accuracy of each offset baseline."""
        return self.offset_correct[rel] / max(self.count[rel], 1)


# ------------------------------------------------------------------------------------------ §5
