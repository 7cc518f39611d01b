"""Reductions of a batch of piece maps over sets of pieces, batched on the maps' device.

The analyses that score spans of a sentence (a frame's target and its element, the pieces of a word kind, the
source and target words of a relation) ask many small questions of each sentence's map: the largest weight from
one set of pieces to another, the pooled attention a set of pieces receives. Asked one at a time in Python (and
each map copied to the host), the questions cost about as much as the forward; here they are asked all at once for
a batch of maps where they lie (:meth:`probes.maps.MapEngine.iter_piece_map_batches`):

* :func:`block_max`: for N (batch index, row mask, column mask) triples, the maximum of each sentence's map over
  the block of its rows x columns, (N, L, H).
* :func:`column_reduce`: for N (batch index, column mask) pairs, the sum or maximum of per-row vectors
  (B, ..., T) over the masked positions, (N, ...).
* :func:`segment_max`: the maximum of N results over the segments they belong to (the groups of one example);
  :func:`weighted_sums`: float64 sums of N results under weights (counts, 1 / group size for means).

Both list the entries they read on the host (ragged: each triple's own rows x columns, no padding to the largest)
and gather them on the maps' device in chunks of at most ``max_elements`` floats, each reduced into the result by
a scatter, so memory stays bounded whatever N and the blocks' sizes are.
The piece sets themselves live on the host as :class:`Spans` (compressed rows of piece positions), built once per
item; :meth:`Spans.masks` turns the spans of a batch into its (N, T) masks without a loop over them, and
:func:`positions_of` (:func:`concat_ranges`) picks the rows of a batch's items out of tables kept item by item.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

# floats gathered at once by one chunk of block_max / column_reduce (64 MiB of float32)
MAX_ELEMENTS = 2 ** 24


def concat_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(starts, stops)])`` without the loop: (sum(stops - starts),)."""
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)  # (n,) each
    lengths = stops - starts                                                               # (n,)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(lengths) - lengths                                                  # (n,) output offsets
    return np.repeat(starts - before, lengths) + np.arange(total, dtype=np.int64)          # (total,)


class Spans:
    """Sets of piece positions kept on the host as compressed rows: span ``s`` holds
    ``pieces[starts[s]:starts[s + 1]]``.

    Built by :meth:`add` one span at a time (once per item, before the maps stream), read by :meth:`masks`
    a batch at a time.
    """

    def __init__(self):
        self._pieces: list[int] = []
        self._starts: list[int] = [0]
        self._frozen: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._starts) - 1

    def add(self, pieces: Iterable[int]) -> int:
        """Append one span (its piece positions); returns its id."""
        self._pieces.extend(int(p) for p in pieces)
        self._starts.append(len(self._pieces))
        self._frozen = None
        return len(self._starts) - 2

    def add_many(self, masks: np.ndarray) -> np.ndarray:
        """Append one span per row of a (S, T) boolean mask; returns their (S,) ids."""
        masks = np.asarray(masks, dtype=bool)                  # (S, T)
        first = len(self)
        self._pieces.extend(np.nonzero(masks)[1].tolist())     # row-major: each row's pieces in order
        self._starts.extend((self._starts[-1] + np.cumsum(masks.sum(1))).tolist())
        self._frozen = None
        return np.arange(first, first + masks.shape[0], dtype=np.int64)

    def extend(self, pieces: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Append spans given back to back: span s holds the next ``lengths[s]`` of ``pieces``; returns their ids."""
        lengths = np.asarray(lengths, dtype=np.int64)            # (S,)
        first = len(self)
        self._pieces.extend(np.asarray(pieces, dtype=np.int64).tolist())
        self._starts.extend((self._starts[-1] + np.cumsum(lengths)).tolist())
        self._frozen = None
        return np.arange(first, first + len(lengths), dtype=np.int64)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(pieces (P,), starts (S + 1,)) as int64 arrays."""
        if self._frozen is None:
            self._frozen = (np.asarray(self._pieces, dtype=np.int64), np.asarray(self._starts, dtype=np.int64))
        return self._frozen

    def sizes(self, ids: np.ndarray) -> np.ndarray:
        """(n,) number of pieces of spans ``ids``."""
        _, starts = self.arrays()
        ids = np.asarray(ids, dtype=np.int64)
        return starts[ids + 1] - starts[ids]

    def masks(self, ids: np.ndarray, T: int) -> np.ndarray:
        """(n, T) bool masks of spans ``ids`` on the host: row r is True at the pieces of span ``ids[r]``."""
        pieces, starts = self.arrays()
        ids = np.asarray(ids, dtype=np.int64)                                     # (n,)
        lengths = starts[ids + 1] - starts[ids]                                   # (n,)
        out = np.zeros((len(ids), T), dtype=bool)                                 # (n, T)
        out[np.repeat(np.arange(len(ids)), lengths), pieces[concat_ranges(starts[ids], starts[ids + 1])]] = True
        return out


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else torch.as_tensor(x).cpu().numpy()


def _members(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (N, T) bool mask as compressed rows: (positions (P,), starts (N,), counts (N,)); row n's positions are
    ``positions[starts[n]:starts[n] + counts[n]]``, in order."""
    counts = mask.sum(1).astype(np.int64)                          # (N,)
    positions = np.nonzero(mask)[1].astype(np.int64)               # (P,) row-major
    return positions, np.cumsum(counts) - counts, counts


def _reader(x: torch.Tensor, total: int):
    """``read(positions) -> (m, D)``: the vectors of ``x`` (B, D, S) at ``positions`` (m,) long, ``b * S + s``.
    Reading few of the B * S positions (``total`` < B * S / 2) indexes ``x`` where it lies; reading more lays it
    out position-major first (one copy), so that each vector is one contiguous row."""
    B, D, S = x.shape
    if 2 * total < B * S:
        return lambda at: x[at // S, :, at % S]                     # (m, D)
    flat = x.transpose(1, 2).reshape(B * S, D)                      # (B*S, D)
    return lambda at: flat.index_select(0, at)                      # (m, D)


def _element_chunks(sizes: np.ndarray, width: int, max_elements: int):
    """Yield ``(owner (m,), rank (m,))`` for consecutive chunks of the elements of N ragged groups (group n has
    ``sizes[n]`` elements): the group of each element and its rank inside the group, at most
    ``max_elements // width`` elements per chunk (at least 1)."""
    ends = np.cumsum(sizes)                                        # (N,) end of each group's elements
    total = int(ends[-1]) if len(ends) else 0
    step = max(1, int(max_elements // max(int(width), 1)))
    for a in range(0, total, step):
        e = np.arange(a, min(a + step, total), dtype=np.int64)     # (m,) element ids
        owner = np.searchsorted(ends, e, side="right")             # (m,) their group
        yield owner, e - (ends[owner] - sizes[owner])


def block_max(maps: torch.Tensor, index, rows, cols, *, absolute: bool = False, fill: float = float("-inf"),
              max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Maximum of each triple's map over its block of rows x columns: ``out[n] = max_{i in rows[n], j in cols[n]}
    maps[index[n], :, :, i, j]``.

    Only the blocks' entries are read: the (b, i, j) of every triple's rows x columns are listed on the host
    (ragged, no padding), their (L * H) vectors gathered on the maps' device in chunks and reduced into the result
    by a scatter maximum, so a chunk may end inside a triple. Where the blocks cover more than half of the batch's
    map entries, the maps are first copied entry-major (each (L * H) vector one row), else read where they lie.

    Args:
        maps: (B, L, H, T, T) maps of a batch (rows = queries), on any device.
        index: (N,) the batch entry of each triple.
        rows, cols: (N, T) bool masks of each triple's rows and columns (host arrays or tensors: the entries are
            listed on the host; a device tensor is copied there).
        absolute: The maximum of ``|maps|``.
        fill: The result of a triple whose block is empty.
        max_elements: The most floats gathered at once (entries x L x H per chunk).

    Returns:
        (N, L, H) on the maps' device, in the maps' dtype.
    """
    B, L, H, T, _ = maps.shape
    index, rows, cols = _host(index).astype(np.int64), _host(rows).astype(bool), _host(cols).astype(bool)
    N, D = index.shape[0], L * H
    out = torch.full((N, D), float("-inf"), dtype=maps.dtype, device=maps.device)  # (N, L*H)
    if N:
        rp, rs, kr = _members(rows)                                                   # row pieces
        cp, cs, kc = _members(cols)                                                   # column pieces
        read = _reader(maps.reshape(B, D, T * T), int((kr * kc).sum()))              # (b, i * T + j) -> (L*H,)
        for t, rank in _element_chunks(kr * kc, D, max_elements):                     # (m,) triple, rank each
            i, j = rp[rs[t] + rank // kc[t]], cp[cs[t] + rank % kc[t]]                # (m,) row, column
            vals = read(torch.from_numpy((index[t] * T + i) * T + j).to(maps.device))  # (m, L*H)
            if absolute:
                vals = vals.abs()
            owner = torch.from_numpy(t).to(maps.device)[:, None].expand(-1, D)        # (m, L*H)
            out.scatter_reduce_(0, owner, vals, "amax", include_self=True)
        if fill != float("-inf"):
            out[torch.from_numpy(kr * kc == 0).to(maps.device)] = fill
    elif fill != float("-inf"):
        out.fill_(fill)
    return out.view(N, L, H)


def column_reduce(vectors: torch.Tensor, index, cols, how: str = "sum", *, fill: float | None = None,
                  max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Sum or maximum of per-position vectors over each pair's columns: ``out[n] = reduce_{j in cols[n]}
    vectors[index[n], ..., j]`` (a sum adds the positions in order).

    Args:
        vectors: (B, ..., T) per-position values of a batch (e.g. received attention (B, L, H, T)).
        index: (N,) the batch entry of each pair.
        cols: (N, T) bool masks of the positions reduced (listed on the host, as in :func:`block_max`).
        how: ``sum`` or ``max``.
        fill: The result of an empty mask; None: 0 for ``sum``, -inf for ``max``.
        max_elements: The most floats gathered at once (positions x the vectors' size per chunk).

    Returns:
        (N, ...) on the vectors' device.
    """
    if how not in ("sum", "max"):
        raise ValueError(f"how must be sum or max, got {how!r}")
    B, *mid, T = vectors.shape
    D = int(np.prod(mid, dtype=np.int64)) if mid else 1
    index, cols = _host(index).astype(np.int64), _host(cols).astype(bool)            # (N,), (N, T)
    N = index.shape[0]
    out = torch.full((N, D), 0.0 if how == "sum" else float("-inf"), dtype=vectors.dtype,
                     device=vectors.device)                                           # (N, D)
    if N:
        cp, cs, kc = _members(cols)
        read = _reader(vectors.reshape(B, D, T), int(kc.sum()))                      # (b, j) -> (D,)
        for t, rank in _element_chunks(kc, D, max_elements):                         # (m,) pair, rank each
            vals = read(torch.from_numpy(index[t] * T + cp[cs[t] + rank]).to(vectors.device))  # (m, D)
            owner = torch.from_numpy(t).to(vectors.device)                           # (m,)
            if how == "sum":
                out.index_add_(0, owner, vals)
            else:
                out.scatter_reduce_(0, owner[:, None].expand(-1, D), vals, "amax", include_self=True)
        if fill is not None:
            out[torch.from_numpy(kc == 0).to(vectors.device)] = fill
    elif fill is not None:
        out.fill_(fill)
    return out.view(N, *mid)


def segment_max(values: torch.Tensor, segments, n_segments: int) -> torch.Tensor:
    """Maximum of ``values`` (N, ...) over the rows of each segment (``segments`` (N,) in 0..n_segments-1):
    (n_segments, ...), -inf where a segment has no row."""
    segments = torch.as_tensor(segments, dtype=torch.long).to(values.device)         # (N,)
    out = torch.full((n_segments, *values.shape[1:]), float("-inf"), dtype=values.dtype, device=values.device)
    at = segments.view(-1, *[1] * (values.dim() - 1)).expand_as(values)             # (N, ...)
    return out.scatter_reduce_(0, at, values, "amax", include_self=True)             # (n_segments, ...)


def weighted_sums(values: torch.Tensor, weights: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``weights.T @ values`` in float64: (Q, ...) sums of N rows ``values`` (N, ...) under the columns of
    ``weights`` (N, Q) (e.g. one column selecting the rows counted, one holding 1 / group size for means); the
    values must be finite (an empty block's -inf times a weight of 0 is nan)."""
    w = torch.as_tensor(weights, dtype=torch.float64).to(values.device)              # (N, Q)
    return torch.tensordot(w, values.double(), dims=([0], [0]))                      # (Q, ...)


def positions_of(items: Sequence[int], starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a table kept item by item (item k's rows ``starts[k]:stops[k]``) that belong to the batch
    ``items`` (B,): (their row ids (n,), the batch entry of each (n,))."""
    items = np.asarray(items, dtype=np.int64)                                        # (B,)
    a, b = starts[items], stops[items]                                               # (B,) each
    return concat_ranges(a, b), np.repeat(np.arange(len(items), dtype=np.int64), b - a)
