"""Attention in blocks of query rows: the masks described rather than built, and the blocks a listener reduces.

A listener (:mod:`probes.model.hooks`) that asks for blocks (``block_rows(module, B, H, T)`` returns a number of
rows) gets a layer's attention as an iterator of :class:`Block` (:func:`row_blocks`): for rows ``[a, b)`` the
scores against the keys any of those rows may see, with the family's own rules (the one function of
:mod:`probes.model.attention_function` that also makes the whole map), the mask rows made for the block alone,
softmax per row: probabilities ``(B, H, b - a, hi - lo)`` over keys ``[lo, hi)``. The keys no row of the block
may see (causal and sliding-window masks, right padding) are left out: their probabilities are exactly zero.

While a blockwise forward runs (:func:`compact_masks`), the mask function registered for the project's
attention implementation (:func:`probes_mask`) returns a :class:`RowMask` instead of a ``(B, 1, T, T)`` tensor:
transformers' own mask function (causal, sliding window, padding, ...: ``mask_function(batch, head, q_idx,
kv_idx)`` of :mod:`transformers.masking_utils`) kept with the sizes, so that a block's rows are made from the
same rules as the whole mask (``eager_mask`` with ``q_length = b - a`` and ``q_offset = a``), never ``T x T``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers.masking_utils import eager_mask

_COMPACT = ContextVar("probes_compact_masks", default=False)  # within compact_masks(): probes_mask describes


@contextmanager
def compact_masks() -> Iterator[None]:
    """Within the block, :func:`probes_mask` returns :class:`RowMask` descriptions instead of whole masks."""
    token = _COMPACT.set(True)
    try:
        yield
    finally:
        _COMPACT.reset(token)


class RowMask:
    """A ``(B, 1, q_length, kv_length)`` additive float mask, described: :meth:`rows` makes any rows of it with
    transformers' ``eager_mask`` and the arguments the model's mask creation gave (mask function, sizes,
    offsets, 2-D padding mask, dtype, device)."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self.batch_size, self.q_length = int(kwargs["batch_size"]), int(kwargs["q_length"])
        self.kv_length = int(kwargs["kv_length"])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def rows(self, a: int, b: int) -> torch.Tensor | None:
        """Rows ``[a, b)``: (B, 1, b - a, kv_length) additive float (0 where a key may be seen, the dtype's
        minimum where not); None where the whole mask would be (no padding, nothing masked)."""
        offset = self.kwargs.get("q_offset", 0)
        return eager_mask(**{**self.kwargs, "q_length": b - a, "q_offset": offset + a})

    def full(self) -> torch.Tensor | None:
        """The whole mask, as transformers' ``eager_mask`` makes it."""
        return self.rows(0, self.q_length)


def probes_mask(**kwargs) -> torch.Tensor | RowMask | None:
    """The mask function registered for ``attn_implementation="probes"``: transformers' ``eager_mask``, or within
    :func:`compact_masks` its :class:`RowMask` description (None where ``eager_mask`` gives none)."""
    if not _COMPACT.get():
        return eager_mask(**kwargs)
    described = RowMask(kwargs)
    return None if described.rows(0, min(1, described.q_length)) is None else described


def mask_rows(mask: torch.Tensor | RowMask | None, a: int, b: int, keys: int) -> torch.Tensor | None:
    """Rows ``[a, b)`` of ``mask`` (a :class:`RowMask`, a (B, 1|H, T|1, K) boolean or additive tensor, or None),
    cut to the first ``keys`` columns: (B, 1|H, b - a | 1, keys) or None."""
    if mask is None:
        return None
    if isinstance(mask, RowMask):
        m = mask.rows(a, b)
        return None if m is None else m[..., :keys]
    if mask.dim() == 4 and mask.shape[-2] != 1:
        mask = mask[..., a:b, :]
    return mask[..., :keys]


def whole_mask(mask: torch.Tensor | RowMask | None, keys: int) -> torch.Tensor | None:
    """The whole mask (a :class:`RowMask` made in full; a tensor as it is) cut to ``keys`` columns."""
    if isinstance(mask, RowMask):
        mask = mask.full()
    return None if mask is None else mask[..., :keys]


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Boolean of the keys each query may see, from a boolean or an additive float mask (same shape)."""
    if mask.dtype == torch.bool:
        return mask
    return torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min / 2)


def key_span(mask: torch.Tensor | None, keys: int) -> tuple[int, int]:
    """``(lo, hi)``: the keys some row of a block may see (mask (B, 1|H, q|1, K)), or ``(0, K)`` when a row may see
    none (such a row's softmax spreads over every key, as on the whole map) or there is no mask."""
    if mask is None:
        return 0, keys
    seen = visible(mask)  # (B, 1|H, q|1, K)
    if not bool(seen.any(-1).all()):
        return 0, keys
    cols = seen.reshape(-1, seen.shape[-1]).any(0).nonzero()  # (n, 1) columns some row sees
    return int(cols[0]), int(cols[-1]) + 1


@dataclass
class Block:
    """One block of a layer's attention: ``probs`` (B, H, b - a, hi - lo) of query rows ``rows = (a, b)`` over the
    keys ``cols = (lo, hi)`` (every key outside has probability 0 for these rows), and the mask they were given
    (B, 1|H, b - a | 1, hi - lo) boolean or additive, or None."""

    probs: torch.Tensor
    mask: torch.Tensor | None
    rows: tuple[int, int]
    cols: tuple[int, int]


# (rows, cols, mask of those rows and keys) -> probabilities (B, H, rows, cols): a family's rules
Probs = Callable[[slice, slice, "torch.Tensor | None"], torch.Tensor]


def row_blocks(probs: Probs, mask: torch.Tensor | RowMask | None, queries: int, keys: int, rows: int
               ) -> Iterator[Block]:
    """The blocks of ``rows`` query rows (the last one shorter) of a layer with ``queries`` rows and ``keys``
    keys; each block's probabilities are computed when it is asked for, by ``probs`` (the family's rules) on the
    block's rows, the keys they may see (:func:`key_span`) and the mask made for them."""
    if rows < 1:
        raise ValueError(f"rows per block must be >= 1, got {rows}")
    for a in range(0, queries, rows):
        b = min(queries, a + rows)
        m = mask_rows(mask, a, b, keys)  # (B, 1|H, b - a | 1, K) or None
        lo, hi = key_span(m, keys)
        if m is not None and (lo, hi) != (0, keys):
            m = m[..., lo:hi]
        yield Block(probs(slice(a, b), slice(lo, hi), m), m, (a, b), (lo, hi))
