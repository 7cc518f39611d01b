"""LightningModules of the structural probes (Hewitt & Manning 2019): distance and depth.

Same conventions as :class:`probes.dependency.module.DependencyProbe`: the probe (``components``) is built
in `setup` with its size from the data (the encoder's hidden size), optimizer and scheduler from config,
torchmetrics per split (``val/uuas`` ..., the monitored one tracked as ``val/<metric>_best``). Loss: their
L1 loss, per sentence the summed absolute error over word pairs (words) divided by the squared
length (the length), averaged over the batch's sentences. Metrics need a spanning tree per sentence, so
they are computed on val and test only (train logs its loss).
"""

from __future__ import annotations

from typing import Callable

import pytorch_lightning as pl
import torch
from torchmetrics import MaxMetric, MetricCollection

from probes.structural.metrics import UUAS, DepthSpearman, DistanceSpearman, RootAccuracy


class StructuralProbe(pl.LightningModule):
    """Base: ``probe(dim=...)`` maps (B, N, D) word vectors to predictions; subclasses pick targets and metrics.

    layer: the encoder layer probed (0 = embedding output; recorded with the hyperparameters, read by the
    datamodule). monitor: the val metric tracked as best, selected by the checkpoint callback.
    """

    metric_names: tuple[str, ...] = ()

    def __init__(self, probe: Callable[..., torch.nn.Module], optimizer: Callable, scheduler: Callable | None = None,
                 layer: int | None = None, monitor: str = "val/uuas"):
        super().__init__()
        self.save_hyperparameters(ignore=["probe", "optimizer", "scheduler"])
        self.probe_factory, self.optimizer_factory, self.scheduler_factory = probe, optimizer, scheduler
        self.monitor = monitor
        self.probe: torch.nn.Module | None = None
        self.val_metrics, self.test_metrics = (MetricCollection(self.make_metrics(), prefix=f"{s}/") for s in ("val", "test"))
        self.val_best = MaxMetric()

    def make_metrics(self) -> dict:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.probe is None:
            self.probe = self.probe_factory(dim=self.trainer.datamodule.dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.probe(batch["hidden"])

    def target(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, pred: torch.Tensor, gold: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """L1 over the real entries (gold != -1), per sentence / length^k (k = pred's word dimensions), batch mean."""
        k = pred.dim() - 1  # 2 for distances (B, N, N), 1 for depths (B, N)
        real = (gold != -1).float()
        per_sent = ((pred - gold).abs() * real).flatten(1).sum(1)  # (B,)
        return (per_sent / lengths.float().pow(k)).mean()

    def update_metrics(self, metrics: MetricCollection, pred: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _step(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        pred = self(batch)
        loss = self.loss(pred, self.target(batch), batch["lengths"])
        bs = len(batch["lengths"])
        self.log(f"{split}/loss", loss, on_step=split == "train", on_epoch=True, prog_bar=True, batch_size=bs)
        if split != "train":
            m = getattr(self, f"{split}_metrics")
            self.update_metrics(m, pred, batch)
            self.log_dict(m, on_step=False, on_epoch=True, prog_bar=True, batch_size=bs)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_best(self.val_metrics[self.monitor.split("/", 1)[1]].compute())
        self.log(f"{self.monitor}_best", self.val_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        # Hewitt & Manning: ReduceLROnPlateau on the dev loss
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=self.scheduler_factory(optimizer=optimizer),
                                                           monitor="val/loss", interval="epoch"))


class DistanceProbeModule(StructuralProbe):
    """Distance probe: UUAS of the predicted distances' spanning tree and DSpr."""

    def make_metrics(self) -> dict:
        return {"uuas": UUAS(), "dspr": DistanceSpearman()}

    def target(self, batch):
        return batch["distances"]  # (B, N, N), -1 on padding

    def update_metrics(self, metrics, pred, batch):
        metrics["uuas"].update(pred, batch["distances"], batch["punct"], batch["lengths"])
        metrics["dspr"].update(pred, batch["distances"], batch["lengths"])


class DepthProbeModule(StructuralProbe):
    """Depth probe: root accuracy and NSpr."""

    def make_metrics(self) -> dict:
        return {"root_acc": RootAccuracy(), "nspr": DepthSpearman()}

    def target(self, batch):
        return batch["depths"]  # (B, N), -1 on padding

    def update_metrics(self, metrics, pred, batch):
        metrics["root_acc"].update(pred, batch["depths"], batch["punct"], batch["lengths"])
        metrics["nspr"].update(pred, batch["depths"], batch["lengths"])
