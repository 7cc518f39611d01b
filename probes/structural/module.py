"""LightningModules of the structural probes (Hewitt & Manning 2019): distance and depth.

Conventions shared with every trainable module (:class:`probes.training.module.ProbeModule`): the probe
(``components``) is built in `build` with its size from the data (the encoder's hidden size), optimizer
and scheduler from config, torchmetrics per split (``val/uuas`` ..., the monitored one tracked as
``val/<metric>_best``). Loss: their L1 loss, per sentence the summed absolute error over word pairs
(words) divided by the squared length (the length), averaged over the batch's sentences. Metrics need a
spanning tree per sentence, so they are computed on val and test only (train logs its loss). The
scheduler (``ReduceLROnPlateau`` in ``conf/probe/structural_distance.yaml``) reads the dev loss
(``scheduler_monitor: val/loss``, Hewitt & Manning).
"""

from __future__ import annotations

from typing import Callable

import pytorch_lightning as pl
import torch
from torchmetrics import Metric, MetricCollection

from probes.structural.metrics import UUAS, DepthSpearman, DistanceSpearman, RootAccuracy
from probes.training.module import ProbeModule


class StructuralProbe(ProbeModule):
    """Base: ``probe(dim=...)`` maps (B, N, D) word vectors to predictions; subclasses pick targets and metrics.

    Args:
        probe: partial of the probe (``probes.structural.components.probes``); ``dim`` comes from the data.
        optimizer, scheduler, monitor, mode, scheduler_monitor: see :class:`~probes.training.module.ProbeModule`.
        layer: the encoder layer probed (0 = embedding output; recorded with the hyperparameters, read by
            the datamodule).
    """

    not_hyperparameters = ("probe",)

    def __init__(self, probe: Callable[..., torch.nn.Module], optimizer: Callable | None,
                 scheduler: Callable | None = None, layer: int | None = None, monitor: str = "val/uuas",
                 mode: str = "max", scheduler_monitor: str | None = None):
        super().__init__(optimizer, scheduler, monitor, mode, scheduler_monitor=scheduler_monitor,
                         metrics={"train": {}, "val": self.make_metrics(), "test": self.make_metrics()})
        self.probe_factory = probe
        self.probe: torch.nn.Module | None = None

    @staticmethod
    def make_metrics() -> dict[str, Metric]:
        """Fresh metrics of one evaluation split, by name."""
        raise NotImplementedError

    def build(self, datamodule: pl.LightningDataModule) -> None:
        """The probe, sized by the datamodule's hidden size (``dim``)."""
        if self.probe is None:
            self.probe = self.probe_factory(dim=datamodule.dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, N, D) word vectors of ``batch["hidden"]`` -> the probe's predictions."""
        return self.probe(batch["hidden"])

    def target(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The gold values the probe predicts, -1 on padding."""
        raise NotImplementedError

    def loss(self, pred: torch.Tensor, gold: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """L1 over the real entries (gold != -1), per sentence / length^k (k = pred's word dimensions), batch mean."""
        k = pred.dim() - 1  # 2 for distances (B, N, N), 1 for depths (B, N)
        real = (gold != -1).float()
        per_sent = ((pred - gold).abs() * real).flatten(1).sum(1)  # (B,)
        return (per_sent / lengths.float().pow(k)).mean()

    def update_metrics(self, metrics: MetricCollection, pred: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        """Update one evaluation split's metrics with a batch's predictions."""
        raise NotImplementedError

    def step(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, int, None]:
        """The L1 loss (mean over sentences); on val and test the metric updates."""
        pred = self(batch)  # (B, N, N) distances or (B, N) depths
        loss = self.loss(pred, self.target(batch), batch["lengths"])
        if split != "train":
            self.update_metrics(getattr(self, f"{split}_metrics"), pred, batch)
        return loss, len(batch["lengths"]), None

    def describe_batch(self, batch: dict[str, torch.Tensor]) -> str:
        """The batch's sentence indices in the split."""
        return f"sentences {batch['index'].tolist()}"


class DistanceProbeModule(StructuralProbe):
    """Distance probe: UUAS of the predicted distances' spanning tree and DSpr."""

    @staticmethod
    def make_metrics() -> dict[str, Metric]:
        """UUAS and DSpr."""
        return {"uuas": UUAS(), "dspr": DistanceSpearman()}

    def target(self, batch):
        """Gold tree distances."""
        return batch["distances"]  # (B, N, N), -1 on padding

    def update_metrics(self, metrics, pred, batch):
        """UUAS of the predicted distances' spanning tree, DSpr against the gold distances."""
        metrics["uuas"].update(pred, batch["distances"], batch["punct"], batch["lengths"])
        metrics["dspr"].update(pred, batch["distances"], batch["lengths"])


class DepthProbeModule(StructuralProbe):
    """Depth probe: root accuracy and NSpr."""

    @staticmethod
    def make_metrics() -> dict[str, Metric]:
        """Root accuracy and NSpr."""
        return {"root_acc": RootAccuracy(), "nspr": DepthSpearman()}

    def target(self, batch):
        """Gold tree depths."""
        return batch["depths"]  # (B, N), -1 on padding

    def update_metrics(self, metrics, pred, batch):
        """Root accuracy of the least deep word, NSpr against the gold depths."""
        metrics["root_acc"].update(pred, batch["depths"], batch["punct"], batch["lengths"])
        metrics["nspr"].update(pred, batch["depths"], batch["lengths"])
