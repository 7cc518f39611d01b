"""Hewitt & Manning's (2019) probes: a rank-k linear map B (k x D) of a layer's word vectors h (D)."""

from __future__ import annotations

import torch
from torch import nn


class _RankProbe(nn.Module):
    """Holds B, stored as its transpose (D, k) and initialised uniform(-0.05, 0.05) as in their ``probe.py``."""

    def __init__(self, dim: int, rank: int | None = None, init: float = 0.05):
        super().__init__()
        rank = dim if rank is None else int(rank)  # None: full rank (their BERT configs: maximum_rank = hidden size)
        self.proj = nn.Parameter(torch.empty(dim, rank))  # (D, k)
        nn.init.uniform_(self.proj, -init, init)

    @property
    def rank(self) -> int:
        """k, the rank of the projection."""
        return self.proj.shape[1]


class DistanceProbe(_RankProbe):
    """d_B(h_i, h_j) = ||B (h_i - h_j)||^2 for every word pair, fitted to the tree distance."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, N, D) -> (B, N, N) squared distances.

        Computed as ||Bh_i||^2 + ||Bh_j||^2 - 2 <Bh_i, Bh_j> (no (B, N, N, k) difference tensor), clamped at 0."""
        t = h @ self.proj  # (B, N, k)
        sq = (t * t).sum(-1)  # (B, N)
        d = sq.unsqueeze(2) + sq.unsqueeze(1) - 2 * (t @ t.transpose(1, 2))  # (B, N, N)
        return d.clamp(min=0)


class DepthProbe(_RankProbe):
    """||B h_i||^2 for every word, fitted to the word's depth in the tree."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, N, D) -> (B, N) squared norms."""
        t = h @ self.proj  # (B, N, k)
        return (t * t).sum(-1)
