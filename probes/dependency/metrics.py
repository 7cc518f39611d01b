"""Attachment-score metrics."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class UAS(Metric):
    """Unlabelled attachment score: share of scored words whose predicted head is the gold head."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, gold: torch.Tensor, mask: torch.Tensor) -> None:
        """pred, gold: (B, N) head indices (0 = ROOT); mask: (B, N) True where the word is scored."""
        self.correct += ((pred == gold) & mask).sum()
        self.total += mask.sum()

    def compute(self) -> torch.Tensor:
        return self.correct.float() / self.total.clamp(min=1)
