"""A directed dependency scorer on hidden states, for :class:`probes.dependency.module.DependencyProbe`.

The attention probes' interface (see :mod:`probes.dependency.components.scorers`): a collated batch ->
logits (B, N, N + 1) over candidate heads (column 0 = ROOT, column i + 1 = word i). Here the pair
features are the words' hidden states of one layer (``batch["hidden"]``, (B, N, D)) instead of
attention maps and GloVe vectors.
"""

from __future__ import annotations

import torch
from torch import nn


class HiddenPairMLP(nn.Module):
    """MLP(tanh, hidden) over [h_j ; h_i] for dependent j and candidate head i; ROOT is a learned vector.

    W [h_j ; h_i] is computed as W_dep h_j + W_cand h_i, so no (B, N, N, 2D) pair tensor is built
    (as in ``DistanceGlove``). ``word_dim`` is the hidden size (the datamodule's ``scorer_sizes()``).
    """

    def __init__(self, word_dim: int, hidden: int = 256):
        super().__init__()
        self.dep = nn.Linear(word_dim, hidden)
        self.cand = nn.Linear(word_dim, hidden, bias=False)
        self.root = nn.Parameter(torch.zeros(word_dim))  # (D,) ROOT's candidate vector
        self.out = nn.Linear(hidden, 1)

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor | None = None) -> torch.Tensor:
        """``vectors`` is unused (hidden-state data have no word-vector table: None)."""
        h = batch["hidden"]  # (B, N, D)
        B = h.shape[0]
        cand = torch.cat([self.root.view(1, 1, -1).expand(B, 1, -1), h], 1)  # (B, N + 1, D)
        z = self.dep(h).unsqueeze(2) + self.cand(cand).unsqueeze(1)  # (B, N, N + 1, hidden)
        return self.out(torch.tanh(z)).squeeze(-1)  # (B, N, N + 1)
