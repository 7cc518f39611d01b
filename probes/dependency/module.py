"""LightningModule that trains a dependency-probe scorer on cached attention and scores UAS."""

from __future__ import annotations

from typing import Callable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics import MaxMetric, MetricCollection

from probes.dependency.metrics import UAS


class DependencyProbe(pl.LightningModule):
    """Trains `scorer` (built in `setup` with sizes from the data: encoder layers x heads, GloVe dim).

    `<split>/uas` counts every word, punctuation included (the UD / CoNLL 2018 convention);
    `<split>/uas_nopunct` leaves out UPOS PUNCT (the Stanford-dependency convention of Clark et al.).
    """

    def __init__(self, scorer: Callable[..., torch.nn.Module], optimizer: Callable | None = None,
                 scheduler: Callable | None = None):
        super().__init__()
        self.scorer_factory = scorer
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scorer: torch.nn.Module | None = None
        self.train_metrics, self.val_metrics, self.test_metrics = (
            MetricCollection({"uas": UAS(), "uas_nopunct": UAS()}, prefix=f"{s}/") for s in ("train", "val", "test"))
        self.val_uas_best = MaxMetric()

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if self.scorer is None:
            self.scorer = self.scorer_factory(num_maps=dm.num_maps, word_dim=dm.word_dim)
        self.register_buffer("vectors", dm.vectors, persistent=False)  # (V + 1, d) frozen GloVe rows

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.scorer(batch, self.vectors)  # (B, N, N + 1)
        N, lengths = logits.shape[1], batch["lengths"]
        cand = torch.arange(N + 1, device=logits.device).view(1, 1, N + 1)
        invalid = (cand > lengths.view(-1, 1, 1)) | (cand == torch.arange(1, N + 1, device=logits.device).view(1, N, 1))
        return logits.masked_fill(invalid, -1e4)  # padding and self are never heads

    def _step(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch)  # (B, N, N + 1)
        gold = batch["heads"]  # (B, N), -100 on padding
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=-100)
        pred = logits.argmax(-1)  # (B, N)
        words = gold >= 0
        m = getattr(self, f"{split}_metrics")
        m["uas"].update(pred, gold, words)
        m["uas_nopunct"].update(pred, gold, words & ~batch["punct"])
        bs = int(words.sum())
        self.log(f"{split}/loss", loss, on_step=split == "train", on_epoch=True, prog_bar=True, batch_size=bs,
                 sync_dist=True)  # DDP: the mean over processes (the UAS metrics sync their counts)
        self.log_dict(m, on_step=False, on_epoch=True, prog_bar=split != "train", batch_size=bs)
        return loss, pred

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")[0]

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_uas_best(self.val_metrics["uas"].compute())
        self.log("val/uas_best", self.val_uas_best.compute(), prog_bar=True, sync_dist=True)  # same on every rank

    def test_step(self, batch, batch_idx):
        _, pred = self._step(batch, "test")
        return dict(index=batch["index"], pred=pred, lengths=batch["lengths"])

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params=params)
        if self.scheduler_factory is None:
            return optimizer
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=self.scheduler_factory(optimizer=optimizer),
                                                           monitor="val/uas", interval="epoch"))
