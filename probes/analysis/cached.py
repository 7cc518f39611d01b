"""Batches of cached word maps for the analyses that read the attention cache (``dep_heads``, ``coref_heads``):
entries of similar sizes read together, zero-padded into one tensor on the analysis's device, so that what an
analysis computes from them runs as batched tensor operations, never per sentence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

MIB = 2 ** 20
# the most MiB of one batch's float32 maps: on a CPU small enough that the passes over them run in the caches
# (2-vCPU EPYC Zen 4, dep_heads of 500 EWT dev sentences, MiniLM: 2 MiB 0.15 CPU-s, 4 MiB 0.18, 256 MiB 1.05);
# on a GPU large batches
BATCH_MIB = {"cpu": 2, "cuda": 256}


def word_map_batches(cache, indices: Sequence[int], n_words: Sequence[int], device: str | torch.device = "cpu",
                     budget_mb: float | None = None, desc: str = "word maps", progress: bool = True,
                     dtype: torch.dtype | None = torch.float32
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
        dtype: The maps' dtype on ``device`` (None: the cache's, float16, for a reader that converts only what it
            reads).

    Yields:
        batch: the entries of this batch; maps: (B, L, H, W, W) of ``dtype`` on ``device``, entry b's block at
        ``[b, :, :, :W_b, :W_b]``, zeros beyond (an entry alone: its block, not copied on the host); n: (B,) long,
        n_b.
    """
    words = {int(i): int(n) for i, n in zip(indices, n_words, strict=True) if i in cache}
    order = sorted(words, key=lambda i: words[i])
    device = torch.device(device)
    if budget_mb is None:
        budget_mb = BATCH_MIB.get(device.type, BATCH_MIB["cuda"])
    if not order:
        return
    first = cache[order[0]]  # (L, H, W, W) read once: its shape, then its block
    L, H = np.shape(first)[:2]
    per_side2 = 4 * L * H  # float32 bytes per W^2 of one entry
    with tqdm(total=len(order), desc=desc, unit="sent", disable=None if progress else True) as bar:
        start = 0
        while start < len(order):
            stop = start + 1
            while (stop < len(order)
                   and (stop - start + 1) * per_side2 * (words[order[stop]] + 2) ** 2 <= budget_mb * MIB):
                stop += 1
            batch = order[start:stop]
            W = words[batch[-1]] + 2
            blocks = []
            for i in batch:
                m = first if i == order[0] else cache[i]  # (L, H, W_i, W_i)
                if m.shape[-1] != words[i] + 2:
                    raise ValueError(f"cache {getattr(cache, 'path', '')}: entry {i} has word maps of side "
                                     f"{m.shape[-1]}, expected {words[i] + 2} for its {words[i]} words (the cache was "
                                     "built from other sentences)")
                blocks.append(m)
            if len(blocks) == 1:  # one entry (a long one, alone over the budget): its own block, no padded copy
                host = np.asarray(blocks[0], dtype=np.float16)[None]  # (1, L, H, W, W)
            else:
                host = np.zeros((len(batch), L, H, W, W), dtype=np.float16)  # (B, L, H, W, W)
                for b, m in enumerate(blocks):
                    host[b, :, :, :m.shape[-1], :m.shape[-1]] = m
            maps = torch.from_numpy(host).to(device)  # (B, L, H, W, W) float16
            maps = maps.to(dtype) if dtype is not None else maps
            yield batch, maps, torch.tensor([words[i] for i in batch], dtype=torch.long, device=device)
            bar.update(len(batch))
            start = stop
