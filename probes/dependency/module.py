"""LightningModule that trains a dependency-probe scorer on cached attention and scores UAS."""

from __future__ import annotations

from typing import Callable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from probes.dependency.metrics import UAS
from probes.training.module import SPLITS, ProbeModule


class DependencyProbe(ProbeModule):
    """Trains `scorer` (built in `build` with the sizes the datamodule gives: ``scorer_sizes()``, e.g. encoder
    layers x heads and the GloVe dimension) with cross-entropy over each word's candidate heads.

    `<split>/uas` counts every word, punctuation included (the UD / CoNLL 2018 convention);
    `<split>/uas_nopunct` leaves out UPOS PUNCT (the Stanford-dependency convention of Clark et al.).
    The loss is the mean over words. Conventions shared with the other modules (monitor, optimizer,
    metrics per split): :class:`probes.training.module.ProbeModule`.

    Args:
        scorer: partial of the scorer (``probes.dependency.components.scorers``, or
            ``probes.structural.components.directed.HiddenPairMLP`` on hidden states).
        optimizer, scheduler, monitor, mode, scheduler_monitor: see :class:`~probes.training.module.ProbeModule`
            (``conf/probe/attn_glove.yaml``: Adam, no scheduler, ``val/uas``, ``max``).
    """

    not_hyperparameters = ("scorer",)

    def __init__(self, scorer: Callable[..., torch.nn.Module], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, monitor: str = "val/uas", mode: str = "max",
                 scheduler_monitor: str | None = None):
        super().__init__(optimizer, scheduler, monitor, mode, scheduler_monitor=scheduler_monitor,
                         metrics={s: {"uas": UAS(), "uas_nopunct": UAS()} for s in SPLITS})
        self.scorer_factory = scorer
        self.scorer: torch.nn.Module | None = None

    def build(self, datamodule: pl.LightningDataModule) -> None:
        """The scorer, with the datamodule's ``scorer_sizes()``, and its frozen word-vector table (if any)."""
        if self.scorer is None:
            self.scorer = self.scorer_factory(**datamodule.scorer_sizes())
        self.register_buffer("vectors", datamodule.vectors, persistent=False)  # (V + 1, d) frozen GloVe rows or None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.scorer(batch, self.vectors)  # (B, N, N + 1)
        N, lengths = logits.shape[1], batch["lengths"]
        cand = torch.arange(N + 1, device=logits.device).view(1, 1, N + 1)
        invalid = (cand > lengths.view(-1, 1, 1)) | (cand == torch.arange(1, N + 1, device=logits.device).view(1, N, 1))
        return logits.masked_fill(invalid, -1e4)  # padding and self are never heads

    def step(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, int, dict]:
        """Cross-entropy over the candidate heads (mean over words), UAS updates, the predicted heads."""
        logits = self(batch)  # (B, N, N + 1)
        gold = batch["heads"]  # (B, N), -100 on padding
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=-100)
        pred = logits.argmax(-1)  # (B, N)
        words = gold >= 0
        m = getattr(self, f"{split}_metrics")
        m["uas"].update(pred, gold, words)
        m["uas_nopunct"].update(pred, gold, words & ~batch["punct"])
        # the test predictions for probes.dependency.callbacks.ConlluPredictionWriter
        return loss, int(words.sum()), dict(index=batch["index"], pred=pred, lengths=batch["lengths"])

    def describe_batch(self, batch: dict[str, torch.Tensor]) -> str:
        """The batch's sentence indices in the split."""
        return f"sentences {batch['index'].tolist()}"
