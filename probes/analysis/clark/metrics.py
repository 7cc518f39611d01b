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
def most_attended(maps: torch.Tensor, n_words: torch.Tensor, transpose: bool = False,
                  causal: bool = False) -> torch.Tensor:
    """Most-attended other word of every word of a batch of word maps, per head (Clark's ``attn_head_predictor``).

    maps: (B, L, H, W, W) word maps padded to one side W (item b: [CLS] at 0, its n_b words at 1..n_b, [SEP] at
    n_b + 1; anything beyond is never read); n_words: (B,) n_b. ``transpose=False`` (dep2head): word j's
    prediction is the word its row attends to most; ``transpose=True`` (head2dep): the word that attends most to
    j. Attention to self and to [CLS]/[SEP] is ignored; ties go to the first word. Returns (B, L, H, W - 2) long,
    1-based word indices (entries of j >= n_b are meaningless). A one-word item predicts the word itself (never a
    correct head).

    ``causal`` (decoders: row i sees words <= i only): the candidates are the words a head can see in that
    direction: dep2head, the words *before* j (j's row); head2dep, the words *after* j (the rows that see j). A
    word with no candidate (the first word in dep2head, the last in head2dep) predicts 0 (ROOT), never a scored
    head.
    """
    a = maps[..., 1:-1, 1:-1]  # (B, L, H, N, N) N = W - 2: the word positions of the widest item
    N = a.shape[-1]
    idx = torch.arange(N, device=a.device)
    # cand[b, j, k]: word k is a candidate for word j (dep2head: in j's row; head2dep: in j's column)
    cand = (idx[None, None, :] < n_words.to(a.device)[:, None, None]) & (idx[:, None] != idx[None, :])  # (B, N, N)
    if causal:  # dep2head candidates k < j; head2dep candidates k > j
        cand = cand & ((idx[None, :] < idx[:, None]) if not transpose else (idx[None, :] > idx[:, None]))
    # max(dim).indices: the first maximum, as argmax, and faster on a CPU (also along dim -2)
    if transpose:  # column j: the most attending row k (no transposed copy)
        pred = a.masked_fill(~cand.transpose(1, 2)[:, None, None], float("-inf")).max(-2).indices + 1  # (B, L, H, N)
    else:
        pred = a.masked_fill(~cand[:, None, None], float("-inf")).max(-1).indices + 1  # (B, L, H, N); none: 0 + 1
    if causal:
        pred.masked_fill_(~cand.any(-1)[:, None, None], 0)  # words without a candidate: ROOT
    return pred


def most_attended_rows(rows: torch.Tensor, n_words: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """:func:`most_attended` (dep2head, not causal) of chosen words only, from their rows alone: ``rows`` (M, L, H, W)
    row ``word[m] + 1`` of item m's word map (any float dtype), the item's n_words[m] words at
    columns 1..n (anything beyond never read); ``word`` (M,) 0-based. Returns (M, L, H) long, 1-based word indices:
    the same as ``most_attended(maps, n_words)[item, :, :, word]`` (the same candidates, ties to the first word) at
    M rows' cost instead of every row's."""
    W = rows.shape[-1]
    idx = torch.arange(W - 2, device=rows.device)  # (N,)
    cand = (idx[None, :] < n_words.to(rows.device)[:, None]) & (idx[None, :] != word[:, None])  # (M, N)
    # in the rows' own dtype (float16 to float32 is exact: the same order and ties; half the passes on a CPU)
    r = rows[..., 1:W - 1].masked_fill(~cand[:, None, None], float("-inf"))  # (M, L, H, N) the word columns
    return r.max(-1).indices + 1  # (M, L, H)


def predict_heads(word_attn: torch.Tensor | np.ndarray, transpose: bool = False, causal: bool = False) -> np.ndarray:
    """:func:`most_attended` of one item's word maps ``word_attn`` (L, H, W, W), W = n + 2: (L, H, n) int,
    1-based word indices (0: no candidate, ``causal`` only)."""
    a = torch.as_tensor(np.asarray(word_attn, dtype=np.float32))  # (L, H, W, W)
    n = a.shape[-1] - 2
    return most_attended(a[None], torch.tensor([n]), transpose, causal)[0].numpy()


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


class DepLabels:
    """The gold trees of many sentences as flat tensors, prepared once (:class:`DepAccumulator` reads a batch of
    them by index, no per-sentence Python in its loop).

    Per sentence s (in the order given): ``n[s]`` words stored from ``start[s]``; per word (flat, sum of n):
    ``head`` the gold head (1-based, 0 = root), ``rel`` the row of its relation in ``relations`` (-1: not scored:
    attached to the root or a relation in ``exclude``), ``pos`` the 0-based word whose prediction is scored
    (:func:`evaluation_positions`). ``relations``: the scored relations in order of first appearance
    (``strip_subtypes``: ``nmod:poss`` -> ``nmod``).
    """

    def __init__(self, trees: Sequence[tuple[Sequence[str], Sequence[int], Sequence[str]]],
                 exclude: Sequence[str] = ("root", "punct"), poss_relations: Sequence[str] = (),
                 strip_subtypes: bool = False):
        excluded, row = set(exclude), {}
        heads, rels, pos, n = [], [], [], []
        for words, hs, deprels in trees:
            rs = [r.split(":")[0] if strip_subtypes else r for r in deprels]
            heads += [int(h) for h in hs]
            rels += [-1 if h == 0 or r in excluded else row.setdefault(r, len(row)) for h, r in zip(hs, rs)]
            pos += evaluation_positions(words, rs, poss_relations).tolist()
            n.append(len(words))
        self.relations = list(row)
        self.n = torch.tensor(n, dtype=torch.long)  # (S,)
        self.start = torch.cumsum(self.n, 0) - self.n  # (S,)
        self.head = torch.tensor(heads, dtype=torch.long)  # (sum n,)
        self.rel = torch.tensor(rels, dtype=torch.long)  # (sum n,)
        self.pos = torch.tensor(pos, dtype=torch.long)  # (sum n,)

    def to(self, device: torch.device | str) -> DepLabels:
        """The tensors moved to ``device`` (in place); returns self."""
        for k in ("n", "start", "head", "rel", "pos"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def batch(self, index: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, head, rel, pos) of the sentences ``index`` (B,), padded to N words: n (B,); head, rel, pos (B, N),
        rel -1 beyond each sentence's words."""
        n = self.n[index]  # (B,)
        j = torch.arange(N, device=n.device)
        inside = j[None, :] < n[:, None]  # (B, N)
        flat = torch.where(inside, self.start[index][:, None] + j[None, :], 0)  # (B, N)
        if not self.head.numel():  # sentences without words
            return n, torch.zeros_like(flat), torch.full_like(flat, -1), torch.zeros_like(flat)
        return n, self.head[flat], torch.where(inside, self.rel[flat], -1), self.pos[flat]


class DepAccumulator:
    """Counts correct head predictions per relation, for every head/direction and every offset, a batch at a time
    (:meth:`add_batch`: sums kept as tensors on the maps' device; :meth:`add`: one sentence).

    Relations in ``exclude`` (and words whose gold head is root) are left out, also of ``all``.
    ``causal``: the direction rule of decoders (:func:`most_attended`). ``head_before[rel]`` counts the
    pairs whose gold head precedes the scored word (those dep2head can get right in a causal model;
    head2dep can get the others). ``count``, ``head_before``, ``head_correct`` (rel -> (2, L, H)) and
    ``offset_correct`` (rel -> (n_offsets,)) hold the relations with at least one scored word.
    """

    def __init__(self, num_layers: int, num_heads: int, offsets: Sequence[int] = (-3, -2, -1, 0, 1, 2),
                 exclude: Sequence[str] = ("root", "punct"), poss_relations: Sequence[str] = (),
                 strip_subtypes: bool = False, causal: bool = False):
        self.L, self.H = num_layers, num_heads
        self.causal = bool(causal)
        self.offsets = list(offsets)
        self.exclude = list(exclude)
        self.poss_relations = list(poss_relations)
        self.strip_subtypes = strip_subtypes
        self.n_sentences = 0
        self._names: list[str] = ["all"]  # row r of the sums: relation _names[r]
        self._sums: dict[str, torch.Tensor] | None = None  # count, head_before (R,); head (R, 2, L, H); offset (R, O)
        self._copied: dict[str, np.ndarray] | None = None

    def labels(self, trees) -> DepLabels:
        """:class:`DepLabels` of ``trees`` ((words, heads, deprels) per sentence) under this accumulator's rules."""
        return DepLabels(trees, self.exclude, self.poss_relations, self.strip_subtypes)

    def add(self, word_attn, words: Sequence[str], heads: Sequence[int], deprels: Sequence[str]) -> None:
        """word_attn: (L, H, n + 2, n + 2); words, heads (0 = root, 1-based), deprels: (n,)."""
        assert np.shape(word_attn)[-1] == len(words) + 2, (np.shape(word_attn), len(words))
        maps = torch.as_tensor(np.asarray(word_attn, dtype=np.float32))[None]  # (1, L, H, W, W)
        self.add_batch(maps, self.labels([(words, heads, deprels)]), torch.zeros(1, dtype=torch.long))

    def add_batch(self, maps: torch.Tensor, labels: DepLabels, index: torch.Tensor) -> None:
        """maps: (B, L, H, W, W) word maps of the sentences ``index`` (B,) of ``labels`` (on the maps' device),
        padded to W (sentence b's words at 1..n_b; beyond n_b + 1 never read)."""
        B, N = maps.shape[0], maps.shape[-1] - 2
        n, heads, rel, pos = labels.batch(index, N)  # (B,), (B, N) x 3
        self.n_sentences += B
        pred = torch.stack([most_attended(maps, n, False, self.causal),
                            most_attended(maps, n, True, self.causal)])  # (2, B, L, H, N)
        scored = pos[:, None, None, :].expand(B, self.L, self.H, N)  # (B, L, H, N)
        head_ok = torch.stack([p.gather(-1, scored) for p in pred]) == heads[None, :, None, None, :]  # (2, B, L, H, N)
        j = pos + 1  # (B, N) 1-based scored word
        off = torch.as_tensor(self.offsets, device=maps.device)  # (O,)
        off_ok = torch.minimum((j[None] + off[:, None, None]).clamp(min=0), n[None, :, None]) == heads[None]  # (O, B, N)
        before = heads < j  # (B, N) gold head precedes the scored word
        rows = torch.as_tensor([self._row(r) for r in labels.relations], dtype=torch.long, device=maps.device)
        keep = rel >= 0  # (B, N)
        which = torch.zeros(B, N, len(self._names), device=maps.device)  # (B, N, R) "all" and each relation
        which[..., 0] = keep.float()
        if rows.numel():
            which.view(B * N, -1)[keep.view(-1).nonzero()[:, 0], rows[rel[keep]]] = 1.0
        add = dict(count=which.sum((0, 1)),  # (R,)
                   head_before=torch.einsum("bn,bnr->r", before.float(), which),
                   head=torch.einsum("dblhn,bnr->rdlh", head_ok.float(), which),  # (R, 2, L, H)
                   offset=torch.einsum("obn,bnr->ro", off_ok.float(), which))  # (R, O)
        add = {k: v.round().long() for k, v in add.items()}  # exact counts (float32 sums of a batch < 2^24)
        self._copied = None
        if self._sums is None:
            self._sums = add
            return
        for k, v in add.items():
            old = self._sums[k]
            if old.shape[0] < v.shape[0]:  # relations seen for the first time
                old = torch.cat([old, old.new_zeros((v.shape[0] - old.shape[0], *old.shape[1:]))])
            self._sums[k] = old + v

    def _row(self, rel: str) -> int:
        if rel not in self._names:
            self._names.append(rel)
        return self._names.index(rel)

    def _host(self) -> dict[str, np.ndarray]:
        """The sums copied to the host (once after each change)."""
        if self._sums is None:
            return {}
        if self._copied is None:
            self._copied = {k: v.cpu().numpy() for k, v in self._sums.items()}
        return self._copied

    def _by_rel(self, key: str) -> dict:
        s = self._host()
        if not s:
            return {}
        c = s["count"]
        return {r: (int(s[key][i]) if s[key].ndim == 1 else s[key][i]) for i, r in enumerate(self._names) if c[i] > 0}

    @property
    def count(self) -> dict[str, int]:
        """rel -> scored words (``all``: every relation)."""
        return self._by_rel("count")

    @property
    def head_before(self) -> dict[str, int]:
        """rel -> scored words whose gold head precedes them."""
        return self._by_rel("head_before")

    @property
    def head_correct(self) -> dict[str, np.ndarray]:
        """rel -> (2, L, H) correct predictions of every head in both directions (DIRECTIONS order)."""
        return self._by_rel("head")

    @property
    def offset_correct(self) -> dict[str, np.ndarray]:
        """rel -> (n_offsets,) correct predictions of each offset baseline."""
        return self._by_rel("offset")

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
