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
``val/macro_f1_best`` (the best epoch so far of the monitor, ``probe.monitor: val/macro_f1``, which a
checkpoint callback with a validation split keeps); conventions shared with every trainable module:
:class:`probes.training.module.ProbeModule`.
Test also logs per-class ``test/precision_<class>``, ``test/recall_<class>``, ``test/f1_<class>``,
``test/support_<class>`` and writes into ``report_dir`` (default: the trainer's
``default_root_dir`` = the run folder): ``per_class.csv`` (class, precision, recall, f1, support,
plus a ``macro`` and an ``accuracy`` row), ``confusion.csv`` (rows = gold, columns = predicted) and
``test_predictions.csv`` (id, gold, predicted).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassF1Score,
                                         MulticlassPrecision, MulticlassRecall)

from probes.io import atomic_write
from probes.patterns.components.cnn import (CLASSES, RESIZE_MATRICES, PatternCNN, preprocess, preprocess_many,
                                            preprocess_padded)
from probes.training.module import SPLITS, ProbeModule

log = logging.getLogger(__name__)
# maps the CNN classifies at once on a CPU: its activations (16 channels x size^2 floats a map) stay in the caches
# (the fused network, one thread, 2-vCPU AMD EPYC Zen 4, size 32: 0.08 ms a map in chunks of 32 to 128, 0.09 in
# chunks of 256, 0.14 in chunks of 512)
CPU_BATCH_MAPS = 128
# on an accelerator: large chunks keep it busy (a map's activations are ~64 KiB)
DEVICE_BATCH_MAPS = 4096
# padded maps preprocessed at once (:meth:`PatternClassifier.predict_padded`): on a CPU 4 MiB of float32, so that
# the step's temporaries stay in the caches; on an accelerator a few operations per batch
CPU_PREPROCESS_ELEMENTS = 2 ** 20
DEVICE_PREPROCESS_ELEMENTS = 2 ** 27


def _split_metrics(n: int) -> dict[str, Metric]:
    return {"acc": MulticlassAccuracy(n, average="micro"), "macro_f1": MulticlassF1Score(n, average="macro")}


class PatternClassifier(ProbeModule):
    """The pattern CNN as a LightningModule: architecture, loss and test reports (see the module docstring).

    Args:
        classes: the class names, in the order of the CNN's outputs.
        size, resize, channels: preprocessing of a map (``probes.patterns.components.cnn.preprocess``).
        widths, hidden, dropout: the CNN (``PatternCNN``).
        optimizer, scheduler, monitor, mode, scheduler_monitor: see :class:`~probes.training.module.ProbeModule`
            (``conf/probe/pattern_cnn.yaml``).
        class_weighting: ``none``, ``inverse`` or ``inverse_sqrt`` (of the train class counts).
        label_smoothing: of the cross-entropy.
        report_dir: folder of the test reports; None: the trainer's ``default_root_dir``.
    """

    scheduler_interval = "step"  # the cosine decay is defined over optimizer steps

    def __init__(self, classes: Sequence[str] = CLASSES, size: int = 32, resize: str = "area",
                 channels: Sequence[str] = ("max",), widths: Sequence[int] = (16, 32, 64), hidden: int = 64,
                 dropout: float = 0.3, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 class_weighting: str = "inverse_sqrt", label_smoothing: float = 0.0,
                 report_dir: str | None = None, monitor: str = "val/macro_f1", mode: str = "max",
                 scheduler_monitor: str | None = None):
        # plain lists (not ListConfig) so the checkpoint loads with torch.load(weights_only=True); rebound
        # before the base class saves the hyperparameters
        classes, channels, widths = [str(c) for c in classes], [str(c) for c in channels], [int(w) for w in widths]
        report_dir = None if report_dir is None else str(report_dir)
        n = len(classes)
        super().__init__(optimizer, scheduler, monitor, mode, scheduler_monitor=scheduler_monitor,
                         metrics={s: _split_metrics(n) for s in SPLITS})
        self.classes = tuple(classes)
        self.channels = tuple(channels)
        if class_weighting not in ("none", "inverse", "inverse_sqrt"):
            raise ValueError(f"class_weighting must be none, inverse or inverse_sqrt, got {class_weighting!r}")
        self.net = PatternCNN(len(self.classes), len(self.channels), size, tuple(widths), hidden, dropout)
        self.register_buffer("class_weight", torch.ones(len(self.classes)))
        self.test_per_class = MetricCollection({
            "precision": MulticlassPrecision(n, average=None), "recall": MulticlassRecall(n, average=None),
            "f1": MulticlassF1Score(n, average=None)})
        self.test_confusion = MulticlassConfusionMatrix(n)
        self._test_rows: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ inference
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def preprocess(self, maps: Sequence[np.ndarray]) -> torch.Tensor:
        """(M, C, size, size) network inputs of M maps, preprocessed as in training."""
        hp = self.hparams
        return preprocess_many(maps, hp.size, hp.resize, self.channels)

    @torch.inference_mode()
    def _classify(self, maps, batch_size: int, prepare) -> torch.Tensor:
        """(M,) long class index of each of ``maps``, ``batch_size`` at a time: ``prepare`` (a chunk of maps -> its
        network inputs), then the CNN's eval-mode function on the module's device (:meth:`inference_net`; the
        module's own mode is left as it was)."""
        net = self.inference_net()
        out = [net(prepare(maps[i:i + batch_size]).to(self.device)).argmax(1) for i in range(0, len(maps), batch_size)]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=self.device)

    def inference_net(self) -> torch.nn.Module:
        """The CNN's eval-mode function, fused for inference (:meth:`PatternCNN.inference_net
        <probes.patterns.components.cnn.PatternCNN.inference_net>`), built again only when a weight or statistic
        changed (their tensors and version counters are the key), so that a stream of small calls pays once."""
        key = tuple((id(t), t._version, t.device) for t in (*self.net.parameters(), *self.net.buffers()))
        if getattr(self, "_inference", (None, None))[0] != key:
            self._inference = (key, self.net.inference_net())
        return self._inference[1]

    def predict_maps(self, maps: Sequence[np.ndarray], batch_size: int = 512) -> np.ndarray:
        """Class index of every (T, T) map (any sizes), in eval mode, on the module's device."""
        return self._classify(maps, batch_size, self.preprocess).cpu().numpy()

    def preprocess_tensor(self, maps: torch.Tensor) -> torch.Tensor:
        """(M, C, size, size) network inputs of M equal-size (M, T, T) maps (a tensor on any device), on their
        device: the same preprocessing as :meth:`preprocess` (:func:`~probes.patterns.components.cnn.preprocess`)."""
        hp = self.hparams
        return preprocess(maps, hp.size, hp.resize, self.channels)

    def predict_tensor(self, maps: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """(M,) long class index of each of M equal-size (M, T, T) maps (a tensor, float32), in eval mode:
        preprocessed where the maps are (:meth:`preprocess_tensor`), ``batch_size`` maps at a time (None:
        :data:`CPU_BATCH_MAPS` on a CPU, :data:`DEVICE_BATCH_MAPS` on an accelerator), and classified on the
        module's device (the same classes as :meth:`predict_maps`); the result is on the module's device."""
        if maps.dim() != 3:
            raise ValueError(f"expected (M, T, T) maps, got {tuple(maps.shape)}")
        return self._classify(maps, self._batch_maps(batch_size), self.preprocess_tensor)

    def _batch_maps(self, batch_size: int | None) -> int:
        """Maps the CNN classifies at once: ``batch_size``, else :data:`CPU_BATCH_MAPS` on a CPU and
        :data:`DEVICE_BATCH_MAPS` on an accelerator."""
        if batch_size is not None:
            return batch_size
        return CPU_BATCH_MAPS if self.device.type == "cpu" else DEVICE_BATCH_MAPS

    @torch.inference_mode()
    def predict_padded(self, maps: torch.Tensor, lengths: torch.Tensor, batch_size: int | None = None
                       ) -> torch.Tensor:
        """(B, K) long class index of each of K maps of B items padded to one length, in eval mode: maps (B, K, T,
        T), item b's real in ``[:lengths[b], :lengths[b]]``; the same classes as :meth:`predict_tensor` on each
        item's maps cut to its length (network inputs to the rounding of the resize, ~1e-7). With an area or nearest
        resize (:data:`~probes.patterns.components.cnn.RESIZE_MATRICES`) the items are preprocessed together, a few
        operations whatever their lengths (:func:`~probes.patterns.components.cnn.preprocess_padded`, as many items
        at once as :data:`CPU_PREPROCESS_ELEMENTS` or :data:`DEVICE_PREPROCESS_ELEMENTS` padded entries hold), and
        classified ``batch_size`` maps at a time (None: as :meth:`predict_tensor`); with another resize the items
        of each length together. On the maps' device; the result on the module's."""
        if maps.dim() != 4:
            raise ValueError(f"expected (B, K, T, T) maps, got {tuple(maps.shape)}")
        B, K, T, _ = maps.shape
        lengths = torch.as_tensor(lengths, device=maps.device)  # (B,)
        if lengths.shape != (B,):
            raise ValueError(f"lengths: expected one per item ({B}), got shape {tuple(lengths.shape)}")
        hp = self.hparams
        out = torch.empty(B, K, dtype=torch.long, device=self.device)  # (B, K)
        if hp.resize not in RESIZE_MATRICES:
            for t in torch.unique(lengths).tolist():  # each distinct length, not each item
                idx = (lengths == t).nonzero().squeeze(1)  # (G,) the items of t pieces
                group = maps[:, :, :t, :t].index_select(0, idx).reshape(-1, t, t)  # (G K, t, t)
                out[idx.to(self.device)] = self.predict_tensor(group, batch_size).view(-1, K)
            return out
        batch_size = self._batch_maps(batch_size)
        elements = CPU_PREPROCESS_ELEMENTS if maps.device.type == "cpu" else DEVICE_PREPROCESS_ELEMENTS
        step = max(1, elements // max(K * T * T, 1))  # items preprocessed at once (at least one)
        for b in range(0, B, step):
            # (G K, C, size, size) the network inputs of the step's G items
            x = preprocess_padded(maps[b:b + step], lengths[b:b + step], hp.size, hp.resize, self.channels)
            out[b:b + step] = self._classify(x, batch_size, lambda chunk: chunk).view(-1, K)
        return out

    def predict_labels(self, maps: Sequence[np.ndarray], batch_size: int = 512) -> list[str]:
        """Class name of every (T, T) map (:meth:`predict_maps`)."""
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

    def step(self, batch, split: str) -> tuple[torch.Tensor, int, None]:
        """Weighted cross-entropy (mean over maps), metric updates; on test also the per-class scores."""
        x, y, index = batch  # (B, C, size, size), (B,), (B,)
        logits = self(x)  # (B, classes)
        loss = self._loss(logits, y)
        getattr(self, f"{split}_metrics").update(logits, y)
        if split == "test":
            self.test_per_class.update(logits, y)
            self.test_confusion.update(logits, y)
            pred = logits.argmax(1)
            self._test_rows += list(zip(index.tolist(), y.tolist(), pred.tolist()))
        return loss, len(y), None

    def describe_batch(self, batch) -> str:
        """The batch's positions in the datamodule's id list."""
        return f"maps at positions {batch[2].tolist()} of the datamodule's id list"

    def on_test_epoch_start(self) -> None:
        self._test_rows = []

    def on_test_epoch_end(self) -> None:
        """Log the test metrics and per-class scores; write ``per_class.csv``, ``confusion.csv`` and
        ``test_predictions.csv`` into the report folder (rank 0)."""
        m = self.log_metrics("test")
        per = {k: v.cpu().numpy() for k, v in self.test_per_class.compute().items()}
        conf = self.test_confusion.compute().cpu().numpy()
        for c in (self.test_per_class, self.test_confusion):
            c.reset()
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

    def scheduler_arguments(self) -> dict[str, int]:
        """``T_max``: all optimizer steps of the fit (cosine decay over the whole run)."""
        return {"T_max": max(1, int(self.trainer.estimated_stepping_batches))}


def _write_csv(df, path: Path) -> None:
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
