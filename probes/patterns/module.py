"""LightningModule around :class:`~probes.patterns.components.cnn.PatternCNN` (Kovaleva et al. 2019 §3).

Batches are ``(x, y, index)``: preprocessed maps (B, C, size, size), class indices, and the
position of each map in the datamodule's id list (for the test predictions file).

Loss: cross-entropy with optional class weights (``class_weighting``: ``inverse_sqrt`` = weight
proportional to 1/sqrt(class count in train, counts read from the datamodule at fit start),
``inverse``, or ``none``) and label smoothing. ``optimizer`` and ``scheduler`` are partials from the
config, as in every LightningModule of the project (``conf/probe/pattern_cnn.yaml``: AdamW, lr 2e-3,
weight decay 1e-2 on weights with 2+ dimensions, none on biases and BatchNorm; cosine decay to lr/100
over all optimizer steps, ``T_max`` filled in by the module; ``scheduler: null`` keeps the lr constant).

Metrics (torchmetrics, one set per split): ``<split>/acc`` (micro accuracy), ``<split>/macro_f1``;
``val/macro_f1_best`` (the best epoch so far; the checkpoint callback monitors ``val/macro_f1``).
Test also logs per-class ``test/precision_<class>``, ``test/recall_<class>``, ``test/f1_<class>``,
``test/support_<class>`` and writes into ``report_dir`` (default: the trainer's
``default_root_dir`` = the run folder): ``per_class.csv`` (class, precision, recall, f1, support,
plus a ``macro`` and an ``accuracy`` row), ``confusion.csv`` (rows = gold, columns = predicted) and
``test_predictions.csv`` (id, gold, predicted).
"""

from __future__ import annotations

import logging
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics import MaxMetric, MetricCollection
from torchmetrics.classification import (MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassF1Score,
                                         MulticlassPrecision, MulticlassRecall)

from probes.patterns.components.cnn import CLASSES, PatternCNN, preprocess_many

log = logging.getLogger(__name__)


def _split_metrics(n: int) -> MetricCollection:
    return MetricCollection({"acc": MulticlassAccuracy(n, average="micro"),
                             "macro_f1": MulticlassF1Score(n, average="macro")})


class PatternClassifier(pl.LightningModule):
    def __init__(self, classes: Sequence[str] = CLASSES, size: int = 32, resize: str = "area",
                 channels: Sequence[str] = ("max",), widths: Sequence[int] = (16, 32, 64), hidden: int = 64,
                 dropout: float = 0.3, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 class_weighting: str = "inverse_sqrt", label_smoothing: float = 0.0,
                 report_dir: str | None = None):
        super().__init__()
        # plain lists (not ListConfig) so the checkpoint loads with torch.load(weights_only=True)
        classes, channels, widths = [str(c) for c in classes], [str(c) for c in channels], [int(w) for w in widths]
        report_dir = None if report_dir is None else str(report_dir)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])  # partials: not in the checkpoint
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.classes = tuple(classes)
        self.channels = tuple(channels)
        if class_weighting not in ("none", "inverse", "inverse_sqrt"):
            raise ValueError(f"class_weighting must be none, inverse or inverse_sqrt, got {class_weighting!r}")
        self.net = PatternCNN(len(self.classes), len(self.channels), size, tuple(widths), hidden, dropout)
        self.register_buffer("class_weight", torch.ones(len(self.classes)))
        n = len(self.classes)
        self.train_metrics = _split_metrics(n).clone(prefix="train/")
        self.val_metrics = _split_metrics(n).clone(prefix="val/")
        self.test_metrics = _split_metrics(n).clone(prefix="test/")
        self.val_best = MaxMetric()
        self.test_per_class = MetricCollection({
            "precision": MulticlassPrecision(n, average=None), "recall": MulticlassRecall(n, average=None),
            "f1": MulticlassF1Score(n, average=None)})
        self.test_confusion = MulticlassConfusionMatrix(n)
        self._test_rows: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ inference
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def preprocess(self, maps: Sequence[np.ndarray]) -> torch.Tensor:
        hp = self.hparams
        return preprocess_many(maps, hp.size, hp.resize, self.channels)

    @torch.inference_mode()
    def predict_maps(self, maps: Sequence[np.ndarray], batch_size: int = 512) -> np.ndarray:
        """Class index of every (T, T) map (any sizes), in eval mode, on the module's device."""
        was_training = self.training
        self.eval()
        out = []
        try:
            for i in range(0, len(maps), batch_size):
                x = self.preprocess(maps[i:i + batch_size]).to(self.device)
                out.append(self(x).argmax(1).cpu())
        finally:
            self.train(was_training)
        return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.int64)

    def predict_labels(self, maps: Sequence[np.ndarray], batch_size: int = 512) -> list[str]:
        return [self.classes[i] for i in self.predict_maps(maps, batch_size)]

    # ------------------------------------------------------------------ training
    def on_fit_start(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        counts = getattr(dm, "train_class_counts", None)
        if counts is not None and self.hparams.class_weighting != "none":
            c = torch.as_tensor(np.asarray(counts, dtype=np.float32)).clamp_min(1.0)
            w = 1.0 / (c if self.hparams.class_weighting == "inverse" else c.sqrt())
            self.class_weight.copy_((w / (w * c).sum() * c.sum()).to(self.class_weight))
            log.info("class weights: %s", dict(zip(self.classes, [round(float(v), 3) for v in self.class_weight])))

    def _loss(self, logits, y):
        return F.cross_entropy(logits, y, weight=self.class_weight, label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self(x)
        loss = self._loss(logits, y)
        self.train_metrics.update(logits, y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=len(y))
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self(x)
        self.log("val/loss", self._loss(logits, y), on_epoch=True, batch_size=len(y))
        self.val_metrics.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        m = self.val_metrics.compute()
        self.val_metrics.reset()
        self.log_dict(m)
        if not self.trainer.sanity_checking:
            self.val_best.update(m["val/macro_f1"])
        if self.val_best.update_count:  # the best epoch so far (not logged by the sanity check)
            self.log("val/macro_f1_best", self.val_best.compute())

    def on_test_epoch_start(self) -> None:
        self._test_rows = []

    def test_step(self, batch, batch_idx):
        x, y, index = batch
        logits = self(x)
        self.log("test/loss", self._loss(logits, y), on_epoch=True, batch_size=len(y))
        self.test_metrics.update(logits, y)
        self.test_per_class.update(logits, y)
        self.test_confusion.update(logits, y)
        pred = logits.argmax(1)
        self._test_rows += list(zip(index.tolist(), y.tolist(), pred.tolist()))

    def on_test_epoch_end(self) -> None:
        import pandas as pd

        m = self.test_metrics.compute()
        per = {k: v.cpu().numpy() for k, v in self.test_per_class.compute().items()}
        conf = self.test_confusion.compute().cpu().numpy()
        for c in (self.test_metrics, self.test_per_class, self.test_confusion):
            c.reset()
        self.log_dict(m)
        support = conf.sum(1)
        rows = []
        for i, name in enumerate(self.classes):
            for k in ("precision", "recall", "f1"):
                self.log(f"test/{k}_{name}", float(per[k][i]))
            self.log(f"test/support_{name}", float(support[i]))
            rows.append(dict(cls=name, precision=float(per["precision"][i]), recall=float(per["recall"][i]),
                             f1=float(per["f1"][i]), support=int(support[i])))
        present = support > 0
        rows.append(dict(cls="macro", precision=float(per["precision"][present].mean()),
                         recall=float(per["recall"][present].mean()), f1=float(m["test/macro_f1"]),
                         support=int(support.sum())))
        rows.append(dict(cls="accuracy", precision=np.nan, recall=np.nan, f1=float(m["test/acc"]),
                         support=int(support.sum())))
        out = self._report_dir()
        if out is None:
            return
        df = pd.DataFrame(rows).rename(columns={"cls": "class"})
        _write_csv(df, out / "per_class.csv")
        cm = pd.DataFrame(conf.astype(int), index=pd.Index(self.classes, name="gold"), columns=self.classes)
        _write_csv(cm.reset_index(), out / "confusion.csv")
        ids = getattr(getattr(self.trainer, "datamodule", None), "ids", None)
        if ids is not None and self._test_rows:
            pred = pd.DataFrame([dict(id=ids[i], gold=self.classes[g], predicted=self.classes[p])
                                 for i, g, p in self._test_rows])
            _write_csv(pred, out / "test_predictions.csv")
        log.info("per-class test scores (%s):\n%s", out / "per_class.csv", df.to_string(index=False))

    def _report_dir(self) -> Path | None:
        d = self.hparams.report_dir or (self.trainer.default_root_dir if self._trainer is not None else None)
        if d is None or self.trainer.global_rank != 0:
            return None
        p = Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def param_groups(self) -> list[dict]:
        """Weights (2+ dimensions) with the optimizer's weight decay; biases and BatchNorm without."""
        decay, no_decay = [], []
        for n, p in self.named_parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("PatternClassifier needs an optimizer partial to train (probe.optimizer)")
        opt = self.optimizer_factory(params=self.param_groups())
        if self.scheduler_factory is None:
            return opt
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        sched = self.scheduler_factory(optimizer=opt, T_max=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _write_csv(df, path: Path) -> None:
    from probes.io import atomic_write

    atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))


def load_classifier(checkpoint: str | Path, device: str = "cpu") -> PatternClassifier:
    """A trained :class:`PatternClassifier` from a Lightning checkpoint, eval mode."""
    p = Path(checkpoint).expanduser()
    if p.is_dir():
        found = sorted((p / "checkpoints").glob("*.ckpt")) or sorted(p.glob("*.ckpt"))
        if not found:
            raise FileNotFoundError(f"no .ckpt file in {p} or {p / 'checkpoints'}")
        p = found[0]
    if not p.is_file():
        raise FileNotFoundError(f"pattern CNN checkpoint not found: {p}")
    ckpt = torch.load(p, map_location=device, weights_only=True)
    # only the architecture's arguments (checkpoints written before `optimizer` came from the config
    # also hold lr, weight_decay and cosine)
    known = set(inspect.signature(PatternClassifier.__init__).parameters) - {"self", "optimizer", "scheduler"}
    hp = {k: v for k, v in (ckpt.get("hyper_parameters") or {}).items() if k in known}
    model = PatternClassifier(**{**hp, "report_dir": None})
    model.load_state_dict(ckpt["state_dict"])
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
