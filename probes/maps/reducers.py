"""Reducers: what becomes of each layer's attention when no whole map is kept (long sentences, documents).

A reducer gets the probabilities of the captured layers as they are computed, block by block
(:mod:`probes.model.blockwise`: ``probs (B, H, q, c)`` of query rows ``rows = (a, b)`` over keys ``cols = (lo, hi)``;
every other key has probability 0 for these rows) or one whole map per layer (one block: rows ``(0, T)``, keys
``(0, T)``), and folds them into a small state before the next block is computed. The same object serves
sentences and documents; :class:`probes.maps.MapEngine` runs it (``iter_reduced``, and ``word_maps`` of long
batches).

Life of a reducer, once per batch: :meth:`Reducer.start` (the batch's items, the layers, the device), then
:meth:`Reducer.update` for every block of every captured layer, then :meth:`Reducer.results` (one result per
item, in batch order). :meth:`Reducer.nbytes` says how large the state of a batch would be, before any forward.

* :class:`Pool`: rows and columns pooled to units: words (``[first special] words [last special]``, the layout of
  word maps), sentences of a document, spans of N pieces, any units given per piece; result (L', H, U_r, U_c).
* :class:`HeadStats`: per-head statistics of the pieces' attention (Clark et al.'s ``prev``/``self``/``next``,
  ``cls``, ``sep``, ``sep_sep``, ``rest_sep``, ``punct``, ``entropy``, ``cls_entropy``, as
  :func:`probes.analysis.clark.metrics.sentence_head_stats` computes them on a whole map) plus the attention
  distance ``|i - j|`` (mean and histogram); result stat -> (L', H) (the histogram (L', H, K)).
* :class:`Several`: several reducers over one forward; result name -> each one's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from probes.model.inputs import Encoded, check_pooling

# (position of the item in what the engine was given, the item) -> (unit of every piece, -1: left out; units)
UnitFn = Callable[[int, Encoded], tuple[Sequence[int], int]]
# (position, item) -> (T,) a flag per piece
FlagFn = Callable[[int, Encoded], Sequence[bool]]

FLOAT_BYTES = 4  # the states are float32 (statistics: float64, small)


def word_units(k: int, item: Encoded) -> tuple[list[int], int]:
    """Words as units, in the layout of word maps: unit 0 the first special token, 1..n the words, n + 1 the last
    special (a special the tokenizer does not add is an empty unit); ``n + 2`` units."""
    return [w + 1 for w in item.word_of_piece], item.n_words + 2


def span_units(n: int) -> UnitFn:
    """Spans of ``n`` pieces as units: piece t belongs to unit ``t // n`` (specials included)."""
    if int(n) < 1:
        raise ValueError(f"spans of {n} pieces: expected n >= 1")

    def units(k: int, item: Encoded) -> tuple[list[int], int]:
        T = item.n_pieces
        return [t // int(n) for t in range(T)], -(-T // int(n))

    return units


def given_units(units: Sequence[Sequence[int]], counts: Sequence[int] | None = None) -> UnitFn:
    """Units given per item (the item's position in what the engine iterates) and piece, -1 for a piece left out
    (e.g. the sentence of every piece of a document); ``counts``: the number of units of each item (None: the
    largest unit + 1)."""
    def of(k: int, item: Encoded) -> tuple[Sequence[int], int]:
        u = units[k]
        if len(u) != item.n_pieces:
            raise ValueError(f"item {k}: {len(u)} units given for {item.n_pieces} pieces")
        return u, (int(counts[k]) if counts is not None else max(u, default=-1) + 1)

    return of


class Reducer:
    """Base class; see the module docstring. ``layers``: the model layers (0-based) of the captured maps, in the
    order of the results; ``heads``: H."""

    layers: list[int]
    heads: int

    def start(self, layers: Sequence[int], heads: int, positions: Sequence[int], items: Sequence[Encoded], T: int,
              device: torch.device) -> None:
        """A new batch: ``items`` (their positions in what the engine iterates), padded to ``T`` pieces; the state
        lives on ``device``."""
        raise NotImplementedError

    def update(self, layer: int, probs: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """One block of model layer ``layer``: probs (B, H, b - a, hi - lo), rows = (a, b), cols = (lo, hi)."""
        raise NotImplementedError

    def results(self) -> list:
        """One result per item of the batch, in order."""
        raise NotImplementedError

    def nbytes(self, layers: Sequence[int], heads: int, positions: Sequence[int], items: Sequence[Encoded]) -> int:
        """Bytes of the state of a batch of ``items`` (what :meth:`start` would allocate)."""
        raise NotImplementedError

    def _position(self, layer: int) -> int:
        return self._layer_pos[layer]

    def _set_layers(self, layers: Sequence[int], heads: int) -> None:
        self.layers, self.heads = [int(l) for l in layers], int(heads)
        self._layer_pos = {l: i for i, l in enumerate(self.layers)}


def _unit_scale(units: torch.Tensor, n: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(units (T,) with the pieces ``mode`` leaves out set to -1, scale (n,) of each unit's sum): ``mean`` divides a
    unit's sum by its pieces, ``sum`` keeps it, ``first`` keeps the unit's first piece only."""
    check_pooling(mode)
    real = units >= 0
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, units[real], torch.ones(int(real.sum()),
                                                                                       dtype=torch.float64))  # (n,)
    if mode == "mean":
        return units, (1.0 / count.clamp(min=1.0)).float()
    if mode == "first":
        seen = torch.zeros(n, dtype=torch.bool)
        out = units.clone()
        for t in range(units.numel()):
            u = int(units[t])
            if u >= 0:
                if seen[u]:
                    out[t] = -1
                seen[u] = True
        units = out
    return units, torch.ones(n)


class Pool(Reducer):
    """Rows and columns of every captured layer pooled to units (Clark et al.'s word maps: rows the mean over a
    word's pieces, columns the sum): result per item (L', H, U_r, U_c) float32, entry (r, c) = sum over the pieces
    i of row unit r and j of column unit c of alpha_ij, times each unit's scale (``mean``: 1 / its pieces).

    State: ``sums`` (B, L', H, U_r, U_c + 1) float32 on the maps' device (U: the batch's most units; the last
    column gathers the pieces left out), and per item the row units (T,), column units (T,) and scales.

    Args:
        rows: the row unit of every piece (:data:`UnitFn`; :func:`word_units`, :func:`span_units`,
            :func:`given_units`).
        cols: the column units; None: ``rows``.
        from_units, to_units: pooling of a unit's rows and of its columns: ``mean``, ``sum`` or ``first``.
    """

    def __init__(self, rows: UnitFn = word_units, cols: UnitFn | None = None, from_units: str = "mean",
                 to_units: str = "sum"):
        check_pooling(from_units, "from_units")
        check_pooling(to_units, "to_units")
        self.rows_of, self.cols_of = rows, (cols or rows)
        self.from_units, self.to_units = from_units, to_units

    def _units(self, positions, items) -> list[tuple[Sequence[int], int, Sequence[int], int]]:
        out = []
        for k, e in zip(positions, items):
            ru, nr = self.rows_of(k, e)
            cu, nc = self.cols_of(k, e)
            for what, u, n in (("row", ru, nr), ("column", cu, nc)):
                if len(u) != e.n_pieces:
                    raise ValueError(f"item {k}: {len(u)} {what} units for {e.n_pieces} pieces")
                if len(u) and not -1 <= min(u) <= max(u) < n:
                    raise ValueError(f"item {k}: {what} units must be -1 (left out) or in 0..{n - 1}")
            out.append((ru, int(nr), cu, int(nc)))
        return out

    def nbytes(self, layers, heads, positions, items) -> int:
        units = self._units(positions, items)
        Ur, Uc = max(u[1] for u in units), max(u[3] for u in units)
        return len(items) * len(layers) * int(heads) * Ur * (Uc + 1) * FLOAT_BYTES

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        units = self._units(positions, items)
        B = len(items)
        n_rows, n_cols = [u[1] for u in units], [u[3] for u in units]
        row_units = torch.full((B, T), -1, dtype=torch.long)  # (B, T) -1: left out (and padding)
        col_units = torch.full((B, T), -1, dtype=torch.long)  # (B, T)
        row_scale, col_scale = torch.zeros(B, max(n_rows)), torch.zeros(B, max(n_cols))  # (B, Ur), (B, Uc)
        for i, (ru, nr, cu, nc) in enumerate(units):
            r, rs = _unit_scale(torch.as_tensor(list(ru), dtype=torch.long), nr, self.from_units)
            c, cs = _unit_scale(torch.as_tensor(list(cu), dtype=torch.long), nc, self.to_units)
            row_units[i, :r.numel()], col_units[i, :c.numel()] = r, c
            row_scale[i, :nr], col_scale[i, :nc] = rs, cs
        self._begin(row_units, row_scale, n_rows, col_units, col_scale, n_cols, device)

    def _begin(self, row_units: torch.Tensor, row_scale: torch.Tensor, n_rows: list[int], col_units: torch.Tensor,
               col_scale: torch.Tensor, n_cols: list[int], device: torch.device) -> None:
        """The state of a batch: row_units, col_units (B, T) the unit of every piece (-1: left out, padding),
        row_scale (B, Ur), col_scale (B, Uc) each unit's factor, n_rows, n_cols the units of each item."""
        B = row_units.shape[0]
        Ur, Uc = max(n_rows), max(n_cols)
        self.n_rows, self.n_cols = list(n_rows), list(n_cols)
        self.sums = torch.zeros(B, len(self.layers), self.heads, Ur, Uc + 1, device=device)  # (B, L', H, Ur, Uc+1)
        self.row_units = row_units.to(device)  # (B, T)
        self.col_units = torch.where(col_units >= 0, col_units, torch.full_like(col_units, Uc)).to(device)  # (B, T)
        self.row_scale, self.col_scale = row_scale, col_scale  # (B, Ur), (B, Uc)

    def update(self, layer, probs, rows, cols) -> None:
        l = self._position(layer)
        (a, b), (lo, hi) = rows, cols
        for i in range(probs.shape[0]):
            ru = self.row_units[i, a:b]  # (q,)
            keep = ru >= 0
            if not bool(keep.any()):
                continue
            p = probs[i].float()  # (H, q, c)
            if not bool(keep.all()):
                p, ru = p[:, keep], ru[keep]
            local, inv = torch.unique(ru, return_inverse=True)  # (u,), (q',): the row units of this block
            r = p.new_zeros(p.shape[0], local.numel(), p.shape[2]).index_add_(1, inv, p)  # (H, u, c) rows pooled
            pooled = r.new_zeros(r.shape[0], r.shape[1], self.sums.shape[-1])  # (H, u, Uc + 1)
            pooled.index_add_(2, self.col_units[i, lo:hi], r)
            self.sums[i, l].index_add_(1, local, pooled)  # (H, Ur, Uc + 1)

    def results(self) -> list[torch.Tensor]:
        """Per item (L', H, U_r, U_c) float32 on the maps' device."""
        out = []
        for i, (nr, nc) in enumerate(zip(self.n_rows, self.n_cols)):
            s = self.sums[i, :, :, :nr, :nc]  # (L', H, nr, nc)
            rs = self.row_scale[i, :nr].to(s.device)
            cs = self.col_scale[i, :nc].to(s.device)
            out.append(s * rs[:, None] * cs[None, :])
        return out


class MatrixPool(Pool):
    """:class:`Pool` whose units and scales come from word pooling matrices ``from_mat``, ``to_mat`` (B, W, T)
    (:func:`probes.maps.batches.make_batch`: one non-zero per piece's column, a unit's factor): piece t belongs to
    the row where its column is non-zero (none: left out), a unit's scale is its row's largest entry. Results (L',
    H, W, W) per item, as :func:`probes.maps.engine.pool_layers` gives them."""

    def __init__(self, from_mat: torch.Tensor, to_mat: torch.Tensor):
        super().__init__()
        self.from_mat, self.to_mat = from_mat, to_mat

    def nbytes(self, layers, heads, positions, items) -> int:
        B, W, _ = self.from_mat.shape
        return B * len(layers) * int(heads) * W * (W + 1) * FLOAT_BYTES

    @staticmethod
    def _of(mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(units (B, T), -1 where a piece's column is zero; scales (B, W))."""
        nz = mat != 0  # (B, W, T)
        units = torch.where(nz.any(1), nz.to(torch.uint8).argmax(1), -1)  # (B, T)
        return units.long().cpu(), mat.amax(-1).float().cpu()

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        (ru, rs), (cu, cs) = self._of(self.from_mat), self._of(self.to_mat)
        W = self.from_mat.shape[1]
        n = [W] * ru.shape[0]
        self._begin(ru, rs, n, cu, cs, n, device)


# attention distance |i - j| histogram: bin 0 holds d = 0, bin k >= 1 holds 2^(k-1) <= d < 2^k
DISTANCE_BINS = 18  # the last bin holds d >= 2^16 too


def distance_bin_edges(bins: int = DISTANCE_BINS) -> list[int]:
    """Lower edges of the distance bins: 0, 1, 2, 4, ..., 2^(bins - 2)."""
    return [0] + [2 ** k for k in range(bins - 1)]


class HeadStats(Reducer):
    """Per-head statistics of every captured layer's piece attention, each item's rows and columns its own n real
    pieces, as :func:`probes.analysis.clark.metrics.sentence_head_stats` on the item's (n, n) map:

    ``prev`` / ``self`` / ``next``: sum over rows of the attention to i - 1 / i / i + 1, divided by n; ``cls``:
    mean over rows of the attention to position 0; ``sep``: mean over rows of the total attention to the
    separators, ``sep_sep`` / ``rest_sep`` the same over the separator rows / the other rows; ``punct``: mean total
    attention to punctuation; ``entropy``: mean over rows of the entropy (nats) of the smoothed row ``(1 - s) a +
    s / n``; ``cls_entropy``: that of row 0; ``distance``: mean over rows of sum_j alpha_ij |i - j|;
    ``distance_hist``: mean over rows of the attention at each distance bin (:func:`distance_bin_edges`).

    State: per statistic (B, L', H) float64 sums over rows (the histogram (B, L', H, K)) on the maps' device, and
    per item its length, its separator and punctuation flags (T,).

    Args:
        sep: the separators of each item (:data:`FlagFn`); None: its last piece.
        punct: the punctuation pieces (e.g. :func:`probes.analysis.clark.metrics.punct_positions`); None: no
            ``punct`` statistic.
        smoothing: the entropy's smoothing ``s`` (Clark's 1e-4).
        bins: the number of distance bins.
    """

    def __init__(self, sep: FlagFn | None = None, punct: FlagFn | None = None, smoothing: float = 1e-4,
                 bins: int = DISTANCE_BINS):
        self.sep_of, self.punct_of = sep, punct
        self.smoothing, self.bins = float(smoothing), int(bins)
        if self.bins < 2:
            raise ValueError(f"bins must be >= 2, got {bins}")

    SUMS = ("prev", "self", "next", "cls", "sep", "sep_sep", "rest_sep", "punct", "entropy", "cls_entropy",
            "distance")

    def nbytes(self, layers, heads, positions, items) -> int:
        return len(items) * len(layers) * int(heads) * (len(self.SUMS) + self.bins) * 8

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        B, L, H = len(items), len(self.layers), self.heads
        self.n = [e.n_pieces for e in items]
        self.sums = {k: torch.zeros(B, L, H, dtype=torch.float64, device=device) for k in self.SUMS}
        self.hist = torch.zeros(B, L, H, self.bins, dtype=torch.float64, device=device)  # (B, L', H, K)
        keys = torch.zeros(B, T, 4)  # (B, T, 4): position 0, separator, punctuation, every key
        self.sep = torch.zeros(B, T, dtype=torch.bool)  # (B, T)
        for i, (k, e) in enumerate(zip(positions, items)):
            n = e.n_pieces
            sep = torch.zeros(n, dtype=torch.bool)
            if self.sep_of is None:
                sep[n - 1] = True
            else:
                sep = torch.as_tensor(list(self.sep_of(k, e)), dtype=torch.bool)
            punct = torch.as_tensor(list(self.punct_of(k, e)) if self.punct_of is not None else [False] * n,
                                    dtype=torch.float32)
            if sep.numel() != n or punct.numel() != n:
                raise ValueError(f"item {k}: separator / punctuation flags must have one entry per piece ({n})")
            self.sep[i, :n] = sep
            keys[i, 0, 0] = 1.0
            keys[i, :n, 1], keys[i, :n, 2], keys[i, :n, 3] = sep.float(), punct, 1.0
        self.keys, self.sep = keys.to(device), self.sep.to(device)
        self.edges = torch.tensor(distance_bin_edges(self.bins)[1:], device=device)  # (K - 1,) upper bounds

    def update(self, layer, probs, rows, cols) -> None:
        (a, b), (lo, hi) = rows, cols
        for i in range(probs.shape[0]):
            n = self.n[i]
            qn, cn = min(b, n) - a, min(hi, n) - lo  # the item's real rows and keys in this block
            for r0 in range(0, max(qn, 0) if cn > 0 else 0, self.CHUNK):  # a bounded share of the block at a time
                p = probs[i, :, r0:min(qn, r0 + self.CHUNK), :cn].float()  # (H, q, c)
                self._rows(self._position(layer), i, p, a + r0, lo)

    CHUNK = 256  # query rows whose temporaries (about three copies of their probabilities) exist at once

    def _rows(self, l: int, i: int, p: torch.Tensor, a: int, lo: int) -> None:
        """Add the statistics of rows a .. a + q of item i (p (H, q, c) over keys lo .. lo + c, all real) to layer
        position l's sums."""
        H, qn, cn = p.shape
        n, s, sums = self.n[i], self.smoothing, self.sums
        # the attention at each offset j - i summed over the rows: row r shifted right by qn - 1 - r, so that an
        # offset is a column; column m holds offset lo - a + m - (qn - 1)
        w = cn + qn - 1
        skewed = p.new_zeros(H, qn, w)  # (H, q, w)
        skewed.as_strided((H, qn, cn), (qn * w, w - 1, 1), qn - 1).copy_(p)
        mass = skewed.sum(1, dtype=torch.float64)  # (H, w)
        del skewed
        first = lo - a - (qn - 1)  # the offset of column 0
        for name, off in (("prev", -1), ("self", 0), ("next", 1)):
            if 0 <= off - first < w:
                sums[name][i, l] += mass[:, off - first] / n
        dist = (torch.arange(w, device=p.device) + first).abs()  # (w,) |j - i| of each column
        sums["distance"][i, l] += (mass * dist.double()).sum(-1) / n
        self.hist[i, l].index_add_(1, torch.bucketize(dist, self.edges, right=True), mass / n)  # (H, K)
        to = torch.matmul(p, self.keys[i, lo:lo + cn])  # (H, q, 4): to position 0, separators, punctuation, all
        sums["cls"][i, l] += to[..., 0].double().sum(-1) / n
        to_sep = to[..., 1].double()  # (H, q)
        sep_rows = self.sep[i, a:a + qn]  # (q,)
        n_sep = int(self.sep[i].sum())
        sums["sep"][i, l] += to_sep.sum(-1) / n
        if n_sep:
            sums["sep_sep"][i, l] += to_sep[:, sep_rows].sum(-1) / n_sep
        if n_sep < n:
            sums["rest_sep"][i, l] += to_sep[:, ~sep_rows].sum(-1) / (n - n_sep)
        sums["punct"][i, l] += to[..., 2].double().sum(-1) / n
        # entropy of the smoothed row (1 - s) p + s / n = (1 - s) (p + c) over the item's n keys, c = s / (n (1 - s)):
        # sum_j entr((1 - s)(p_j + c)) = (1 - s) sum_j entr(p_j + c) - (1 - s) log(1 - s) sum_j (p_j + c); the keys
        # outside the block have p = 0
        c = s / (n * (1.0 - s))
        x = torch.add(p, c)  # (H, q, c)
        ent = torch.special.entr(x, out=x).sum(-1).double()  # (H, q)
        del x
        ent = (1.0 - s) * (ent - math.log1p(-s) * (to[..., 3].double() + c * cn))
        ent += (n - cn) * float(torch.special.entr(torch.tensor(s / n, dtype=torch.float64)))
        sums["entropy"][i, l] += ent.sum(-1) / n
        if a == 0:
            sums["cls_entropy"][i, l] += ent[:, 0]

    def results(self) -> list[dict[str, torch.Tensor]]:
        """Per item: stat -> (L', H) float64 (``distance_hist``: (L', H, K)); ``punct`` only with ``punct`` flags,
        ``sep_sep`` NaN without a separator, ``rest_sep`` NaN when every piece is one."""
        out = []
        for i, n in enumerate(self.n):
            n_sep = int(self.sep[i].sum())
            res = {k: v[i].clone() for k, v in self.sums.items()}
            if self.punct_of is None:
                del res["punct"]
            if not n_sep:
                res["sep_sep"].fill_(float("nan"))
            if n_sep == n:
                res["rest_sep"].fill_(float("nan"))
            res["distance_hist"] = self.hist[i].clone()
            out.append(res)
        return out


class Several(Reducer):
    """Several reducers over one forward: result per item name -> that reducer's result."""

    def __init__(self, **reducers: Reducer):
        if not reducers:
            raise ValueError("Several needs at least one reducer")
        self.reducers = reducers

    def nbytes(self, layers, heads, positions, items) -> int:
        return sum(r.nbytes(layers, heads, positions, items) for r in self.reducers.values())

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        for r in self.reducers.values():
            r.start(layers, heads, positions, items, T, device)

    def update(self, layer, probs, rows, cols) -> None:
        for r in self.reducers.values():
            r.update(layer, probs, rows, cols)

    def results(self) -> list[dict]:
        per = {name: r.results() for name, r in self.reducers.items()}
        return [{name: per[name][i] for name in per} for i in range(len(next(iter(per.values()))))]
