"""Reducers: what becomes of each layer's attention when no whole map is kept (long sentences, documents).

A reducer gets the probabilities of the captured layers as they are computed, block by block
(:mod:`probes.model.blockwise`: ``probs (B, H, q, c)`` of query rows ``rows = (a, b)`` over keys ``cols = (lo, hi)``;
every other key has probability 0 for these rows) or one whole map per layer (one block: rows ``(0, T)``, keys
``(0, T)``), and folds them into a small state before the next block is computed. The same object serves
sentences and documents; :class:`probes.maps.MapEngine` runs it (``iter_reduced``, and ``word_maps`` of long
batches).

Life of a reducer, once per batch: :meth:`Reducer.start` (the batch's items, the layers, the device), then
:meth:`Reducer.update` for every block of every captured layer, then :meth:`Reducer.results` (one result per
item, in batch order) or :meth:`Reducer.batch_results` (the batch's results as batched tensors on the device:
``MapEngine.iter_reduced_batches``). :meth:`Reducer.nbytes` says how large the state of a batch would be, before any forward.

* :class:`Pool`: rows and columns pooled to units: words (``[first special] words [last special]``, the layout of
  word maps), sentences of a document, spans of N pieces, any units given per piece; result (L', H, U_r, U_c).
* :class:`HeadStats`: per-head statistics of the pieces' attention (Clark et al.'s ``prev``/``self``/``next``,
  ``cls``, ``sep``, ``sep_sep``, ``rest_sep``, ``punct``, ``entropy``, ``cls_entropy``, as
  :func:`probes.analysis.clark.metrics.sentence_head_stats` computes them on a whole map) plus the attention
  distance ``|i - j|`` (mean and histogram); result stat -> (L', H) (the histogram (L', H, K)).
* :class:`HeadDistances`: the Jensen-Shannon divergence between every pair of heads of all captured layers,
  summed over each item's smoothed rows (Clark et al.'s head distances); result (K, K), K = L' x H.
* :class:`Several`: several reducers over one forward; result name -> each one's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from probes.model.inputs import Encoded, check_pooling
from probes.stats import LN2

# (position of the item in what the engine was given, the item) -> (unit of every piece, -1: left out; units)
UnitFn = Callable[[int, Encoded], tuple[Sequence[int], int]]
# (position, item) -> (T,) a flag per piece
FlagFn = Callable[[int, Encoded], Sequence[bool]]

FLOAT_BYTES = 4  # the states are float32 (statistics: float64, small)


def chunk_for(device: torch.device | str | None, cpu: int, gpu: int) -> int:
    """The most elements of a reducer's chunk temporaries on ``device``: ``cpu`` on a CPU (a chunk within its caches),
    ``gpu`` elsewhere (few, large chunks: each operation is a kernel launch); None (any device): the larger."""
    if device is None:
        return max(cpu, gpu)
    return cpu if torch.device(device).type == "cpu" else gpu


def log_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = log(x)`` elementwise (``out`` of ``x``'s shape, dtype and device; returned). On a CPU through numpy's
    vectorised log, which shares the tensors' memory (2-vCPU AMD EPYC Zen 4, one thread, float32 in the caches:
    0.25-0.4 ns an element against 0.8-1.2 for ``torch.log``; both within a few units in the last place), elsewhere
    ``torch.log``."""
    if x.device.type == "cpu":
        np.log(x.numpy(), out=out.numpy())
        return out
    return torch.log(x, out=out)


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

    def batch_results(self):
        """The batch's results as batched tensors on the maps' device (leading dim B), where the reducer has them
        (:class:`HeadStats`); sums over batches stay on the device and are copied once at the end."""
        raise NotImplementedError(f"{type(self).__name__} gives results per item only (results())")

    def nbytes(self, layers: Sequence[int], heads: int, positions: Sequence[int], items: Sequence[Encoded],
               device: torch.device | None = None) -> int:
        """Bytes of the state of a batch of ``items`` (what :meth:`start` would allocate on ``device``; None: the
        most it would on any device)."""
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

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
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

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
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

    Every block is reduced for the whole batch at once, with tensor operations on the maps' device (no loop over
    the items): per-row quantities (the attention to the flagged keys by one matmul, the block's diagonals, the
    smoothed rows' entropy) stacked and summed over the rows with each statistic's row weights (1 / n; 0 for
    padding) by one product, a few dozen operations per block whatever the batch (on a GPU each operation is a
    kernel launch); with the distance, the attention at each offset j - i summed over the rows by one matmul on
    the block skewed so that an offset is a column (prev / self / next, the distance and its histogram come from
    it). A block is reduced in chunks of rows whose temporaries stay within :attr:`CPU_CHUNK_ELEMENTS` on a CPU,
    :attr:`GPU_CHUNK_ELEMENTS` elsewhere (a batch's block in one chunk). Padding rows are never read into a sum (a
    padded row's values, even non-finite ones, are set aside with ``where`` / zeroed).

    State: the (B, L', H, S) float64 sums over rows of the S statistics (the histogram (B, L', H, K)) on the maps'
    device, and per item its length, its separator and punctuation flags (B, T) and each row's weights (B, T).
    :meth:`batch_results` gives the batch's statistics as (B, L', H) tensors (for sums over many batches kept on
    the device: :mod:`probes.analysis.clark.head_stats`), :meth:`results` one dict per item.

    Args:
        sep: the separators of each item (:data:`FlagFn`); None: its last piece.
        punct: the punctuation pieces (e.g. :func:`probes.analysis.clark.metrics.punct_positions`); None: no
            ``punct`` statistic.
        smoothing: the entropy's smoothing ``s`` (Clark's 1e-4).
        bins: the number of distance bins.
        stats: the statistics to compute (of :attr:`STATS`); None: all. Fewer cost less: ``("cls",)`` reads one
            column of each block.
    """

    SUMS = ("prev", "self", "next", "cls", "sep", "sep_sep", "rest_sep", "punct", "entropy", "cls_entropy",
            "distance")
    STATS = SUMS + ("distance_hist",)
    _KEYS = frozenset({"sep", "sep_sep", "rest_sep", "punct"})  # need the flagged keys' matmul (cls alone does not)
    _OFFSETS = frozenset({"prev", "self", "next", "distance", "distance_hist"})  # need the attention by offset
    _ENTROPY = frozenset({"entropy", "cls_entropy"})

    def __init__(self, sep: FlagFn | None = None, punct: FlagFn | None = None, smoothing: float = 1e-4,
                 bins: int = DISTANCE_BINS, stats: Sequence[str] | None = None):
        self.sep_of, self.punct_of = sep, punct
        self.smoothing, self.bins = float(smoothing), int(bins)
        if self.bins < 2:
            raise ValueError(f"bins must be >= 2, got {bins}")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        unknown = sorted(set(stats or ()) - set(self.STATS))
        if unknown or (stats is not None and not stats):
            raise ValueError(f"stats={list(stats)}: expected a non-empty subset of {list(self.STATS)}")
        self.stats = frozenset(stats or self.STATS) - ({"punct"} if punct is None else set())
        # the statistics summed over rows in _chunk (prev / self / next come from _offsets when it runs)
        offsets = self.stats & {"distance", "distance_hist"}
        self._fused = tuple(k for k in self.SUMS if k in self.stats and k != "distance"
                            and not (offsets and k in self._DIAGONALS))

    CPU_CHUNK_ELEMENTS = 2 ** 22  # floats of one chunk's largest temporary (the skewed rows: B x H x q x (c + q))
    GPU_CHUNK_ELEMENTS = 2 ** 26  # elsewhere: a batch's block in one chunk (each operation is a kernel launch)
    CHUNK_COPIES = 4  # temporaries of a chunk's size: the block in float32, x and its log, the skewed rows
    _DIAGONALS = {"prev": -1, "self": 0, "next": 1}  # key offset j - i of each diagonal statistic
    _TO_KEYS = {"cls": 0, "sep": 1, "sep_sep": 1, "rest_sep": 1, "punct": 2}  # column of the flagged keys' matmul

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
        """The (B, L', H, S) sums and (B, L', H, K) histogram, per item its flags and row weights, and a chunk's
        temporaries (the device's chunk; None: the larger, a GPU's)."""
        B, T = len(items), max((e.n_pieces for e in items), default=0)
        most = chunk_for(device, self.CPU_CHUNK_ELEMENTS, self.GPU_CHUNK_ELEMENTS)
        chunk = min(most, B * int(heads) * T * (T + min(T, 64)))
        return (B * len(layers) * int(heads) * (len(self.SUMS) + self.bins) * 8
                + B * T * (4 * FLOAT_BYTES + (3 + len(self._fused)) * 8 + 1) + self.CHUNK_COPIES * chunk * FLOAT_BYTES)

    def _flags(self, positions, items, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(separators (B, T) bool, punctuation (B, T) bool) of the batch, padding False: one tensor per batch."""
        sep, punct = np.zeros((len(items), T), dtype=bool), np.zeros((len(items), T), dtype=bool)  # (B, T) each
        for b, (k, e) in enumerate(zip(positions, items)):  # each item's flags from its callbacks, written in place
            n = e.n_pieces
            s = self.sep_of(k, e) if self.sep_of is not None else None
            p = self.punct_of(k, e) if self.punct_of is not None else None
            if (s is not None and len(s) != n) or (p is not None and len(p) != n):
                raise ValueError(f"item {k}: separator / punctuation flags must have one entry per piece ({n})")
            if s is None:
                sep[b, n - 1] = True
            else:
                sep[b, :n] = s
            if p is not None:
                punct[b, :n] = p
        return torch.from_numpy(sep), torch.from_numpy(punct)

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        B, L, H, s = len(items), len(self.layers), self.heads, self.smoothing
        self.n = [e.n_pieces for e in items]
        if min(self.n, default=1) < 1:
            raise ValueError("HeadStats: an item has no pieces")
        sep, punct = self._flags(positions, items, T)  # (B, T) each
        n = torch.tensor(self.n, dtype=torch.float64)  # (B,)
        real = torch.arange(T)[None, :] < n[:, None]  # (B, T)
        n_sep = sep.sum(1).double()  # (B,)
        keys = torch.stack([torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
                            sep, punct, real], 1).float()  # (B, 4, T): position 0, separator, punctuation, any key
        self.keys = keys.to(device)
        self.n_sep = n_sep.to(device)
        # each row's weight in a mean over rows: all rows (1 / n), separator rows (1 / n_sep), the other rows
        self.w_row = (real.double() / n[:, None]).to(device)  # (B, T)
        self.w_sep = (sep.double() / n_sep.clamp(min=1)[:, None]).to(device)  # (B, T)
        self.w_rest = ((real & ~sep).double() / (n - n_sep).clamp(min=1)[:, None]).to(device)  # (B, T)
        # the entropy's per-item constants (see _chunk): c = s / (n (1 - s)), entr(c), entr(s / n)
        c = s / (n * (1.0 - s))
        self.c = c.to(device)  # (B,)
        self.entr_c = torch.special.entr(c).to(device)  # (B,)
        self.entr_out = torch.special.entr(s / n).to(device)  # (B,)
        self.n_t = n.to(device)  # (B,)
        self.c32 = self.c.float()[:, None, None, None]  # (B, 1, 1, 1)
        self._constants = {}  # (lo, c) -> (B,) float64: _entropy_constant
        # the sums over rows of every statistic (B, L', H, S), one name's a (B, L', H) view of it
        self.acc = torch.zeros(B, L, H, len(self.SUMS), dtype=torch.float64, device=device)
        self.sums = {k: self.acc[..., i] for i, k in enumerate(self.SUMS)}
        # the row weights of the statistics summed in _chunk (B, T, F): cls_entropy reads row 0 alone
        first = (torch.arange(T) == 0).double().expand(B, T).to(device)  # (B, T)
        weight = dict(sep_sep=self.w_sep, rest_sep=self.w_rest, cls_entropy=first)
        self.w_fused = (torch.stack([weight.get(k, self.w_row) for k in self._fused], -1) if self._fused
                        else None)  # (B, T, F)
        self.fused_index = torch.tensor([self.SUMS.index(k) for k in self._fused], device=device)  # (F,)
        self.hist = torch.zeros(B, L, H, self.bins, dtype=torch.float64, device=device)  # (B, L', H, K)
        self.edges = torch.tensor(distance_bin_edges(self.bins)[1:], device=device)  # (K - 1,) upper bounds

    def update(self, layer, probs, rows, cols) -> None:
        (a, b), (lo, _) = rows, cols
        B, H, q, c = probs.shape
        last = min(b, max(self.n))  # rows at or beyond every item's length are padding only
        if last <= a or lo >= max(self.n):
            return
        step = max(1, chunk_for(probs.device, self.CPU_CHUNK_ELEMENTS, self.GPU_CHUNK_ELEMENTS)
                   // (B * H * (c + min(q, 64))))
        for r0 in range(a, last, step):  # a bounded share of the block at a time
            r1 = min(last, r0 + step)
            self._chunk(self._position(layer), probs[:, :, r0 - a:r1 - a].float(), r0, lo)

    def _chunk(self, l: int, p: torch.Tensor, a: int, lo: int) -> None:
        """Add the statistics of rows a .. a + q of the batch (p (B, H, q, c) over keys lo .. lo + c) to layer
        position l's sums: every statistic's per-row quantity stacked (B, H, q, F), padding rows set to 0, and
        summed over the rows with each statistic's row weights by one product and sum, added to the sums by one
        ``index_add_`` (a few operations per chunk whatever the statistics: on a GPU each is a kernel launch)."""
        B, H, q, c = p.shape
        want = self.stats
        w_row = self.w_row[:, a:a + q]  # (B, q) 0 for padding rows
        valid = w_row > 0  # (B, q)
        some_padding = min(self.n) < a + q
        to = None
        if want & (self._KEYS | self._ENTROPY):
            keys = self.keys[:, None, :, lo:lo + c]  # (B, 1, 4, c)
            # (B, H, q, 4): to position 0, separators, punctuation, all keys; as the keys' 4 rows times the transposed
            # map (a 4-row product per head: 2.5-4x faster on a 2-vCPU EPYC Zen 4 than the map times 4 columns, the
            # same sums bit for bit there)
            to = torch.matmul(keys, p.transpose(-1, -2)).transpose(-1, -2).double()
        if want & {"distance", "distance_hist"}:
            self._offsets(l, p, a, lo, valid, w_row, some_padding)
        if not self._fused:
            return
        ent = self._entropy(p, lo, to) if want & self._ENTROPY else None  # (B, H, q)
        quantities = []  # per-row quantities (B, H, q) float64, in the order of self._fused
        for name in self._fused:
            if name in self._DIAGONALS:  # block diagonal a - lo + offset: row r's attention to key a + r + offset
                quantities.append(self._diagonal(p, a - lo + self._DIAGONALS[name]))
            elif name in self._TO_KEYS:
                if to is not None:
                    quantities.append(to[..., self._TO_KEYS[name]])
                elif lo == 0:  # cls alone: the column of position 0
                    quantities.append(p[..., 0].double())
                else:  # position 0 is not among these keys
                    quantities.append(p.new_zeros((B, H, q), dtype=torch.float64))
            else:  # entropy, cls_entropy (whose weights keep row 0 alone)
                quantities.append(ent)
        rows = torch.stack(quantities, -1)  # (B, H, q, F)
        if some_padding:  # padding rows set aside (even where they hold non-finite values)
            rows = torch.where(valid[:, None, :, None], rows, 0.0)
        sums = (rows * self.w_fused[:, None, a:a + q]).sum(2)  # (B, H, F)
        self.acc[:, l].index_add_(2, self.fused_index, sums)

    @staticmethod
    def _diagonal(p: torch.Tensor, d: int) -> torch.Tensor:
        """Block diagonal ``d`` of p (B, H, q, c) as one value per row (B, H, q) float64: row r's entry (r, r + d),
        0 where r + d is outside the block's keys."""
        B, H, q, c = p.shape
        diag = torch.diagonal(p, offset=d, dim1=-2, dim2=-1)  # (B, H, m): rows max(0, -d) .. of the block
        r0, m = max(0, -d), diag.shape[-1]
        if not m:
            return p.new_zeros((B, H, q), dtype=torch.float64)
        return torch.nn.functional.pad(diag.double(), (r0, q - r0 - m))  # (B, H, q)

    def _entropy(self, p: torch.Tensor, lo: int, to: torch.Tensor) -> torch.Tensor:
        """The entropy (nats) of each row's smoothed distribution over its item's n keys (B, H, q) float64, from the
        block p (B, H, q, c) over keys lo .. lo + c and ``to`` (B, H, q, 4), the rows' attention to all keys.

        With the smoothed row y = (1 - s) p + s / n = (1 - s) (p + c') over the item's n keys, c' = s / (n (1 - s)):
        sum_j entr(y_j) = (1 - s) sum_j entr(p_j + c') - (1 - s) log(1 - s) sum_j (p_j + c'). The block's columns
        beyond the item's length (p = 0) are taken out again, and its keys outside the block (p = 0) add entr(s / n)
        each: per item a constant of (lo, c) (:meth:`_entropy_constant`)."""
        B, H, q, c = p.shape
        s = self.smoothing
        x = torch.add(p, self.c32)  # (B, H, q, c)
        if s > 0:  # x > 0: entr(x) = -x log x, as log then an in-place product (twice entr's speed on a CPU)
            y = log_into(x, torch.empty_like(x))
            block = y.mul_(x).sum(-1).double()  # (B, H, q) minus sum_j entr(p_j + c')
            del y
            scale = -(1.0 - s)
        else:
            block = torch.special.entr(x).sum(-1).double()  # (B, H, q)
            scale = 1.0 - s
        del x
        ent = torch.add(block.mul_(scale), to[..., 3], alpha=-(1.0 - s) * math.log1p(-s))  # (B, H, q)
        return ent.add_(self._entropy_constant(lo, c)[:, None, None])

    def _entropy_constant(self, lo: int, c: int) -> torch.Tensor:
        """(B,) float64: the part of each item's row entropy that depends only on the block's keys lo .. lo + c
        (:meth:`_entropy`), computed once per batch and block shape."""
        key = (lo, c)
        if key not in self._constants:
            s = self.smoothing
            cn = (self.n_t - lo).clamp(0, c)  # (B,) the item's real keys in the block
            self._constants[key] = ((1.0 - s) * (-(c - cn) * self.entr_c - math.log1p(-s) * self.c * cn)
                                    + (self.n_t - cn) * self.entr_out)
        return self._constants[key]

    def _offsets(self, l: int, p: torch.Tensor, a: int, lo: int, valid: torch.Tensor, w_row: torch.Tensor,
                 some_padding: bool) -> None:
        """prev / self / next, the distance and its histogram of rows a .. a + q (p (B, H, q, c)): the attention at
        each offset j - i summed over the rows with their weights (w_row (B, q); valid (B, q) the real rows), by one
        matmul on the block skewed so that an offset is a column (row r shifted right by q - 1 - r; column m holds
        offset first + m)."""
        B, H, q, c = p.shape
        w = c + q - 1
        first = lo - a - (q - 1)
        skewed = p.new_zeros(B, H, q, w)  # (B, H, q, w)
        rows_of = skewed.as_strided((B, H, q, c), (H * q * w, q * w, w - 1, 1), q - 1)  # (B, H, q, c) view
        if some_padding:  # padding rows written as 0 (even where they hold non-finite values)
            torch.where(valid[:, None, :, None], p, p.new_zeros(()), out=rows_of)
        else:
            rows_of.copy_(p)
        mass = torch.matmul(w_row.float()[:, None, None, :], skewed).squeeze(-2).double()  # (B, H, w)
        del skewed, rows_of
        for name, off in (("prev", -1), ("self", 0), ("next", 1)):
            if name in self.stats and 0 <= off - first < w:
                self.sums[name][:, l] += mass[..., off - first]
        dist = (torch.arange(w, device=p.device) + first).abs()  # (w,) |j - i| of each column
        if "distance" in self.stats:
            self.sums["distance"][:, l] += (mass * dist.double()).sum(-1)
        if "distance_hist" in self.stats:
            self.hist[:, l].index_add_(2, torch.bucketize(dist, self.edges, right=True), mass)  # (B, H, K)

    def batch_results(self) -> dict[str, torch.Tensor]:
        """The batch's statistics (those asked for): stat -> (B, L', H) float64 on the maps' device
        (``distance_hist``: (B, L', H, K)); ``punct`` only with ``punct`` flags, ``sep_sep`` NaN for an item without a separator, ``rest_sep``
        NaN for one whose every piece is one."""
        out = {k: v for k, v in self.sums.items() if k in self.stats}
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=self.n_sep.device)
        if "sep_sep" in out:
            out["sep_sep"] = torch.where((self.n_sep > 0)[:, None, None], out["sep_sep"], nan)
        if "rest_sep" in out:
            out["rest_sep"] = torch.where((self.n_sep < self.n_t)[:, None, None], out["rest_sep"], nan)
        if "distance_hist" in self.stats:
            out["distance_hist"] = self.hist
        return out

    def results(self) -> list[dict[str, torch.Tensor]]:
        """Per item: stat -> (L', H) float64 (``distance_hist``: (L', H, K)), as :meth:`batch_results`."""
        batch = self.batch_results()
        return [{k: v[i].clone() for k, v in batch.items()} for i in range(len(self.n))]


class Several(Reducer):
    """Several reducers over one forward: result per item name -> that reducer's result."""

    def __init__(self, **reducers: Reducer):
        if not reducers:
            raise ValueError("Several needs at least one reducer")
        self.reducers = reducers

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
        return sum(r.nbytes(layers, heads, positions, items, device) for r in self.reducers.values())

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        for r in self.reducers.values():
            r.start(layers, heads, positions, items, T, device)

    def update(self, layer, probs, rows, cols) -> None:
        for r in self.reducers.values():
            r.update(layer, probs, rows, cols)

    def batch_results(self) -> dict:
        """name -> each reducer's :meth:`Reducer.batch_results`."""
        return {name: r.batch_results() for name, r in self.reducers.items()}

    def results(self) -> list[dict]:
        per = {name: r.results() for name, r in self.reducers.items()}
        return [{name: per[name][i] for name in per} for i in range(len(next(iter(per.values()))))]


class HeadDistances(Reducer):
    """Distances between every pair of heads (Clark et al.'s ``head_distances.py``): for heads a, b of all captured
    layers (K = L' x H, index ``l' * H + h``), the Jensen-Shannon divergence (nats) of their smoothed attention rows,
    summed over the rows of each item, each item's rows and keys its own n real pieces, each row smoothed over them
    ``(1 - s) alpha + s / n``. Result per item (K, K) float64, symmetric, zero diagonal, clamped at 0 (as
    :func:`probes.stats.js_divergence_matrix` on the item's (K, n, n) smoothed map, times ln 2).

    Computation, for the whole batch at once on the maps' device (no loop over items): with t = x_a + x_b (x the
    smoothed rows), ``JS = 1/2 sum (ln 2 t - t log t + x_a log x_a + x_b log x_b)``; per head the sums of x and
    x log x over its real entries, per pair a < b the sum of t log t over runs of items of similar lengths (each over
    its own longest T' rows and keys, :meth:`_runs`), in chunks of items x heads x rows x T' whose temporaries stay
    within ``chunk_elements``; on a GPU (``pair_blocks``) blocks of pairs gathered by index over the whole batch
    instead, a few operations per block (:meth:`_pair_blocks`). Each row's sum in ``dtype``, the sums over rows in
    float64. Padded rows and keys are set to 1/2 (whatever the block held there, non-finite values included): a
    pair's t is then 1 and t log t exactly 0, so no padded entry reaches a sum. Rounding: in float32 a row's JS is a difference of sums of about
    log n nats, so it carries about 1e-7 nats of rounding (relative to a small distance, of two nearly identical
    heads, more); ``dtype=float64`` is exact to rounding.

    State: the smoothed maps of every captured layer of the batch (B, L', H, T, T) in ``dtype`` (the whole maps, as
    a piece-map loop holds them), until :meth:`batch_results`. A pair of heads may come from different layers, and a
    layer's rows come only after every row of the layer below (the forward needs them all), so blocks of rows
    (documents) cannot be reduced before the last layer's: they are written into the whole maps, whose memory grows
    with T^2 on that path too (:meth:`nbytes` says so before any forward).

    Args:
        smoothing: s (Clark's 1e-3; 0 allowed: the slower ``xlogy`` then keeps 0 log 0 = 0).
        dtype: the maps' and the chunks' dtype (float32; float64 for exact checks); sums are float64.
        chunk_elements: the most elements of one chunk's temporaries; None: :attr:`CPU_CHUNK_ELEMENTS` on a CPU
            (the chunk stays in the caches), :attr:`GPU_CHUNK_ELEMENTS` elsewhere.
        pair_blocks: reduce blocks of pairs (a, b) at once, gathered by index (:meth:`_pair_blocks`: a few
            operations per block, each a kernel launch on a GPU), over the whole batch as one run; False: head a
            against the heads after it, one a at a time, over runs of similar lengths (:meth:`_pairs`: each chunk
            stays in a CPU's caches, no padding work). None: pair blocks on any device but a CPU.
    """

    PAD = 0.5  # padded entries: t = 1/2 + 1/2, t log t = 0
    CPU_CHUNK_ELEMENTS = 2 ** 19  # 2 MiB of float32: the fastest on a 2-vCPU EPYC Zen 4 (2^15 .. 2^21 measured)
    GPU_CHUNK_ELEMENTS = 2 ** 26  # 256 MiB of float32 per temporary
    RUN_PADDING = 0.1  # the most padded share of a run's work (:meth:`_runs`; 1,000 EWT pairs: 27 % in whole batches)

    def __init__(self, smoothing: float = 1e-3, dtype: torch.dtype = torch.float32, chunk_elements: int | None = None,
                 pair_blocks: bool | None = None):
        self.pair_blocks = pair_blocks
        self.smoothing = float(smoothing)
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        if chunk_elements is not None and int(chunk_elements) < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
        self.dtype, self.chunk_elements = dtype, chunk_elements

    def _chunk(self, device: torch.device | None) -> int:
        """``chunk_elements``, else the device's chunk (:func:`chunk_for`; None: the larger)."""
        if self.chunk_elements is not None:
            return int(self.chunk_elements)
        return chunk_for(device, self.CPU_CHUNK_ELEMENTS, self.GPU_CHUNK_ELEMENTS)

    def _by_pair_blocks(self, device: torch.device) -> bool:
        return self.pair_blocks if self.pair_blocks is not None else torch.device(device).type != "cpu"

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
        """The whole smoothed maps, the chunk's two temporaries (the device's chunk, :meth:`_chunk`; None: the
        larger, :attr:`GPU_CHUNK_ELEMENTS`, unless ``chunk_elements``; at least one row of one pair), one head's masked
        map twice, the (B, K, K) sums."""
        B, T = len(items), max((e.n_pieces for e in items), default=0)
        K, size = len(layers) * int(heads), torch.finfo(self.dtype).bits // 8
        chunk = max(B * T, min(self._chunk(device), B * max(K - 1, 1) * T * T))
        copies = 3 if device is None or self._by_pair_blocks(device) else 2  # pair blocks: a's, b's, t log t
        return (B * K * T * T + copies * chunk + 2 * B * T * T) * size + 4 * B * K * K * 8 + B * T * T

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)
        self.n = [e.n_pieces for e in items]
        if min(self.n, default=1) < 1:
            raise ValueError("HeadDistances: an item has no pieces")
        B, L, H = len(items), len(self.layers), self.heads
        n = torch.tensor(self.n, device=device)  # (B,)
        self.real = torch.arange(T, device=device)[None, :] < n[:, None]  # (B, T)
        self.floor = (self.smoothing / n.double()).to(self.dtype)  # (B,) s / n: a key of probability 0, smoothed
        self._pad = torch.tensor(self.PAD, dtype=self.dtype, device=device)  # () what padded entries hold
        base = torch.where(self.real[:, :, None] & self.real[:, None, :], self.floor[:, None, None],
                           self._pad)  # (B, T, T)
        self.maps = base[:, None, None].expand(B, L, H, T, T).clone()  # (B, L', H, T, T)
        self.device, self._out = torch.device(device), None

    def update(self, layer, probs, rows, cols) -> None:
        (a, b), (lo, hi) = rows, cols
        keep = (self.real[:, a:b, None] & self.real[:, None, lo:hi])[:, None]  # (B, 1, q, c)
        x = probs.to(self.dtype).mul(1.0 - self.smoothing).add_(self.floor[:, None, None, None])  # (B, H, q, c)
        torch.where(keep, x, self._pad, out=self.maps[:, self._position(layer), :, a:b, lo:hi])

    def _own(self, x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of x, sum of x log x) over each item's real entries, per head: x (B, K, T, T) -> (B, K), (B, K)
        float64."""
        B, K, T, _ = x.shape
        real = (self.real[:, :, None] & self.real[:, None, :])[:, None]  # (B, 1, T, T)
        mass = torch.zeros(B, K, dtype=torch.float64, device=x.device)  # (B, K)
        own = torch.zeros(B, K, dtype=torch.float64, device=x.device)  # (B, K)
        step = max(1, chunk // (B * T * T))
        for k0 in range(0, K, step):
            xk = torch.where(real, x[:, k0:k0 + step], 0.0)  # (B, k, T, T)
            mass[:, k0:k0 + step] = xk.sum(-1).sum(-1, dtype=torch.float64)
            own[:, k0:k0 + step] = torch.special.xlogy(xk, xk).sum(-1).sum(-1, dtype=torch.float64)
        return mass, own

    def _runs(self) -> list[tuple[int, int, int]]:
        """(first, end, T') of runs of consecutive items whose padding to the run's longest, T', is at most
        :attr:`RUN_PADDING` of the run's T'^2 work (a length batch, sorted, splits into a few)."""
        runs, i = [], 0
        while i < len(self.n):
            j, top, square = i + 1, self.n[i], self.n[i] ** 2
            while j < len(self.n):
                t, sq = max(top, self.n[j]), square + self.n[j] ** 2
                if 1.0 - sq / ((j + 1 - i) * t * t) > self.RUN_PADDING:
                    break
                j, top, square = j + 1, t, sq
            runs.append((i, j, top))
            i = j
        return runs

    def _pairs(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """sum of t log t, t = x_a + x_b, over all entries (padding: 0), pairs a < b: x (B, K, T, T) -> (B, K, K)
        float64 (0 where a >= b); each run of items of similar lengths (:meth:`_runs`) over its own T' rows and
        keys, in chunks of items x heads x rows x T' elements."""
        B, K, T, _ = x.shape
        out = torch.zeros(B, K, K, dtype=torch.float64, device=x.device)  # (B, K, K)
        buf_t = buf_l = None
        for i, j, Tr in self._runs():
            xr, n = x[i:j, :, :Tr, :Tr], j - i  # (n, K, T', T')
            if Tr < T:  # a contiguous copy (K / 2 times fewer elements than the pairs read): the sums below run on
                xr = xr.contiguous()  # contiguous rows, three times faster than strided ones on a CPU
            if n * Tr * Tr <= chunk:
                heads, rows = chunk // (n * Tr * Tr), Tr
            else:
                heads, rows = 1, max(1, chunk // (n * Tr))
            size = n * min(heads, K - 1) * rows * Tr
            if buf_t is None or buf_t.numel() < size:
                buf_t, buf_l = x.new_empty(size), x.new_empty(size)  # the chunk's temporaries
            for a in range(K - 1):
                for r0 in range(0, Tr, rows):
                    xa = xr[:, a:a + 1, r0:r0 + rows]  # (n, 1, q, T')
                    for b0 in range(a + 1, K, heads):
                        xb = xr[:, b0:b0 + heads, r0:r0 + rows]  # (n, k, q, T')
                        shape = (n, xb.shape[1], xb.shape[2], Tr)
                        t = torch.add(xa, xb, out=buf_t[:math.prod(shape)].view(shape))  # (n, k, q, T')
                        tlt = self._t_log_t(t, buf_l[:t.numel()].view(shape))  # (n, k, q, T')
                        out[i:j, a, b0:b0 + heads] += tlt.sum(-1).sum(-1, dtype=torch.float64)  # rows: float64
        return out

    def _t_log_t(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = t log t`` (returned): with smoothing t > 0, log then an in-place product (faster than ``xlogy`` on
        a CPU); without, entries may be 0 and ``xlogy`` keeps 0 log 0 = 0."""
        if self.smoothing == 0.0:
            return torch.special.xlogy(t, t, out=out)
        return log_into(t, out).mul_(t)

    def _pair_blocks(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """As :meth:`_pairs` (x (B, K, T, T) -> (B, K, K) float64, 0 where a >= b), over the whole batch as one run:
        the pairs a < b in blocks of as many as a chunk holds, each block's a and b maps gathered by index (n, k, T,
        T), added, t log t summed over each row (in ``dtype``) and over the rows (float64), written to the pairs'
        entries at once; a few operations per block whatever the number of heads. Items whose one pair of maps
        exceeds a chunk (long documents) are left to :meth:`_pairs`."""
        B, K, T, _ = x.shape
        if B * T * T > chunk:
            return self._pairs(x, chunk)
        out = torch.zeros(B, K, K, dtype=torch.float64, device=x.device)  # (B, K, K)
        ia, ib = torch.triu_indices(K, K, 1, device=x.device)  # (2, P) every pair a < b
        step = chunk // (B * T * T)  # pairs per block
        for p0 in range(0, ia.numel(), step):
            a, b = ia[p0:p0 + step], ib[p0:p0 + step]  # (k,) each
            t = x.index_select(1, a).add_(x.index_select(1, b))  # (B, k, T, T)
            tlt = self._t_log_t(t, torch.empty_like(t))  # (B, k, T, T)
            out[:, a, b] = tlt.sum(-1).sum(-1, dtype=torch.float64)  # (B, k) rows: float64
        return out

    def batch_results(self) -> torch.Tensor:
        """(B, K, K) float64 on the maps' device: each item's sums over its rows of the heads' JS divergences (nats)."""
        if self._out is None:
            B, L, H, T, _ = self.maps.shape
            x, chunk = self.maps.view(B, L * H, T, T), self._chunk(self.device)  # (B, K, T, T)
            mass, own = self._own(x, chunk)  # (B, K) each
            pairs = (self._pair_blocks if self._by_pair_blocks(self.device) else self._pairs)(x, chunk)  # (B, K, K)
            self.maps = None  # the maps are no longer needed
            d = 0.5 * (LN2 * (mass[:, :, None] + mass[:, None, :]) + own[:, :, None] + own[:, None, :] - pairs)
            d = torch.triu(d, diagonal=1).clamp_min(0)  # (B, K, K) pairs a < b; each item clamped, as per sentence
            self._out = d + d.transpose(1, 2)
        return self._out

    def results(self) -> list[torch.Tensor]:
        """Per item (K, K) float64, as :meth:`batch_results`."""
        out = self.batch_results()
        return [out[i] for i in range(out.shape[0])]
