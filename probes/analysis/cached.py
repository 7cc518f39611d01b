"""Batches of cached word maps for the analyses that read the attention cache: entries of similar sizes read
together, zero-padded into one tensor on the analysis's device, so that what an analysis computes from them runs as
batched tensor operations, never per sentence. Whole maps (:func:`word_map_batches`, ``dep_heads``) or chosen rows of
them, read from the pages that hold them (:func:`word_row_batches`, ``coref_heads``' mention heads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

MIB = 2 ** 20
# the most MiB of one batch's float32 maps: on a CPU small enough that the passes over them run in the caches
# (2-vCPU EPYC Zen 4, dep_heads of 500 EWT dev sentences, MiniLM: 2 MiB 0.15 CPU-s, 4 MiB 0.18, 256 MiB 1.05);
# on a GPU large batches
BATCH_MIB = {"cpu": 2, "cuda": 256}


def _order(cache, indices: Sequence[int], n_words: Sequence[int], device, budget_mb: float | None
           ) -> tuple[dict[int, int], list[int], torch.device, float]:
    """(words of each held entry, the held entries by size, the device, the budget in bytes)."""
    words = {int(i): int(n) for i, n in zip(indices, n_words, strict=True) if i in cache}
    device = torch.device(device)
    if budget_mb is None:
        budget_mb = BATCH_MIB.get(device.type, BATCH_MIB["cuda"])
    return words, sorted(words, key=lambda i: words[i]), device, budget_mb * MIB


def _runs(order: list[int], nbytes: Callable[[list[int]], float], budget: float) -> Iterator[list[int]]:
    """Consecutive runs of ``order``, each as long as its ``nbytes`` stays within ``budget`` (at least one entry)."""
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and nbytes(order[start:stop + 1]) <= budget:
            stop += 1
        yield order[start:stop]
        start = stop


def _check_side(cache, i: int, side: int, n: int) -> None:
    if side != n + 2:
        raise ValueError(f"cache {getattr(cache, 'path', '')}: entry {i} has word maps of side {side}, expected "
                         f"{n + 2} for its {n} words (the cache was built from other sentences)")


def word_map_batches(cache, indices: Sequence[int], n_words: Sequence[int], device: str | torch.device = "cpu",
                     budget_mb: float | None = None, desc: str = "word maps", progress: bool = True
                     ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Yield ``(batch, maps, n)`` over the entries ``indices`` of ``cache`` that it holds (the others, skipped
    sentences, are left out), by size (the smallest first).

    Args:
        cache: An attention cache (``cache[i]``: (L, H, W_i, W_i) word maps, W_i = n_i + 2; ``i in cache``).
        indices: The entries to read.
        n_words: The words n_i of each of ``indices`` (an entry of another side is an error).
        device: Where the maps go.
        budget_mb: The most MiB of one batch's float32 maps (B x L x H x W^2; an entry above it alone); None:
            :data:`BATCH_MIB` of the device's type (else the GPU's).
        desc, progress: The progress bar's label; whether to show it.

    Yields:
        batch: the entries of this batch; maps: (B, L, H, W, W) float32 on ``device``, entry b's block at
        ``[b, :, :, :W_b, :W_b]``, zeros beyond (an entry alone: its block, not copied on the host); n: (B,) long,
        n_b.
    """
    words, order, device, budget = _order(cache, indices, n_words, device, budget_mb)
    if not order:
        return
    first = cache[order[0]]  # (L, H, W, W) read once: its shape, then its block
    L, H = np.shape(first)[:2]
    with tqdm(total=len(order), desc=desc, unit="sent", disable=None if progress else True) as bar:
        for batch in _runs(order, lambda run: 4 * L * H * len(run) * (words[run[-1]] + 2) ** 2, budget):
            W = words[batch[-1]] + 2
            blocks = []
            for i in batch:
                m = first if i == order[0] else cache[i]  # (L, H, W_i, W_i)
                _check_side(cache, i, m.shape[-1], words[i])
                blocks.append(m)
            if len(blocks) == 1:  # one entry (a long one, alone over the budget): its own block, no padded copy
                host = np.asarray(blocks[0], dtype=np.float16)[None]  # (1, L, H, W, W)
            else:
                host = np.zeros((len(batch), L, H, W, W), dtype=np.float16)  # (B, L, H, W, W)
                for b, m in enumerate(blocks):
                    host[b, :, :, :m.shape[-1], :m.shape[-1]] = m
            maps = torch.from_numpy(host).to(device).float()  # (B, L, H, W, W)
            yield batch, maps, torch.tensor([words[i] for i in batch], dtype=torch.long, device=device)
            bar.update(len(batch))


def word_row_batches(cache, indices: Sequence[int], n_words: Sequence[int], rows: Sequence[Sequence[int]],
                     device: str | torch.device = "cpu", budget_mb: float | None = None, desc: str = "word rows",
                     progress: bool = True) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Yield ``(batch, maps, n)`` over the entries ``indices`` of ``cache`` that it holds, by size (the smallest
    first), as :func:`word_map_batches` but with chosen rows of each entry's maps only, read from the pages that
    hold them (``cache.rows``): for an analysis that scores a few words of each entry (coref_heads' mention heads).

    Args:
        cache: An attention cache (``cache.rows(i, rows)``: (R, L, H, W_i) float16, W_i = n_i + 2 =
            ``cache.side(i)``).
        indices, n_words: The entries to read and their words n_i (an entry of another side is an error).
        rows: Per entry of ``indices``, the rows to read (positions 0..W_i - 1 of its word map, [CLS] at 0).
        device: Where the rows go.
        budget_mb: The most MiB of one batch's rows as float32 (R x L x H x W; an entry above it alone); None:
            :data:`BATCH_MIB` of the device's type (else the GPU's).
        desc, progress: The progress bar's label; whether to show it.

    Yields:
        batch: the entries of this batch; maps: (R, L, H, W) float16 on ``device``, the rows of the batch's entries
        in batch order, each entry's in the order given, zeros beyond its side W_b; n: (B,) long, n_b.
    """
    chosen = {int(i): list(r) for i, r in zip(indices, rows, strict=True)}
    words, order, device, budget = _order(cache, indices, n_words, device, budget_mb)
    if not order:
        return
    L, H = cache.num_layers, cache.num_heads
    with tqdm(total=len(order), desc=desc, unit="sent", disable=None if progress else True) as bar:
        for batch in _runs(order, lambda run: 4 * L * H * sum(len(chosen[i]) for i in run) * (words[run[-1]] + 2),
                           budget):
            host = np.zeros((sum(len(chosen[i]) for i in batch), L, H, words[batch[-1]] + 2),
                            dtype=np.float16)  # (R, L, H, W)
            r0 = 0
            for i in batch:
                _check_side(cache, i, cache.side(i), words[i])
                R_i = len(chosen[i])
                cache.rows(i, chosen[i], out=host[r0:r0 + R_i, :, :, :words[i] + 2])  # (R_i, L, H, W_i) in place
                r0 += R_i
            yield (batch, torch.from_numpy(host).to(device),
                   torch.tensor([words[i] for i in batch], dtype=torch.long, device=device))
            bar.update(len(batch))
