"""The LightningModule base of the four trainable packages (dependency, structural, glue, patterns).

One convention for all of them:

- **Monitor** from the config (``probe.monitor``, ``probe.mode``): a validation metric, tracked over the
  epochs as ``<monitor>_best`` (torchmetrics ``MaxMetric`` for ``mode: max``, ``MinMetric`` for ``min``;
  sanity-check epochs and NaN values do not count). The checkpoint callbacks of ``conf/callbacks`` read the
  same two keys.
- **Hyperparameters**: every constructor argument is saved (``save_hyperparameters``) except the
  optimizer and scheduler partials, the metrics and what a subclass names in ``not_hyperparameters``
  (big objects: an encoder, a partial building the scorer).
- **Optimizer and scheduler**: partials from the config. The optimizer gets :meth:`ProbeModule.param_groups`
  (a group with an ``lr_scale`` key trains at the optimizer's lr times it: layer-wise learning rates); the
  scheduler gets :meth:`ProbeModule.scheduler_arguments` (what only the module knows, e.g. the number of
  optimizer steps) and is stepped every ``scheduler_interval``; a plateau scheduler reads
  ``scheduler_monitor`` (default: the monitor).
- **Metrics**: one ``MetricCollection`` per split (``train_metrics``, ``val_metrics``, ``test_metrics``),
  updated by the subclass's :meth:`ProbeModule.step`, logged as ``<split>/<name>`` at the end of each epoch;
  the loss as ``<split>/loss`` (train: also per step, ``train/loss_step``), averaged over the items the
  subclass names (words, sentences, examples, maps).
- **Sanity guard**: a NaN or infinite value in a batch's floating-point inputs (e.g. a damaged cached map)
  raises :class:`NonFiniteInputError` naming the split, epoch, batch, the sentences (items) holding it and the
  data they came from (the datamodule's ``source(stage)``: the cache entry); a NaN or infinite loss raises
  :class:`NonFiniteLossError` naming the split, epoch, batch and its items. A dataset that counts each item's
  non-finite values as it reads them (:func:`count_nonfinite`, in the loader's worker where there is one) puts
  the counts in the batch as ``nonfinite`` (B,), and the check reads them instead of the batch's tensors.
- **Resume**: a checkpoint also holds the tracked best and the random generators' states
  (:meth:`ProbeModule.on_save_checkpoint`), restored when ``python train.py resume=<run folder>`` loads it.
- **Checkpoints load weights-only**: what a checkpoint holds is tensors and plain values (hyperparameters through
  :func:`plain`, numpy's generator state as a tensor), so every reader loads it with ``weights_only=True``
  (:mod:`probes.training.checkpoint`).
- **Models without parameters**: :meth:`ProbeModule.build` creates whatever needs sizes from the data, so
  :meth:`ProbeModule.trainable` can tell before fitting whether there is anything to train (``probes.train``
  scores a parameter-free probe without fitting).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import pytorch_lightning as pl
import torch
from torchmetrics import MaxMetric, Metric, MetricCollection, MinMetric

from probes.config import plain

SPLITS = ("train", "val", "test")
BEST = {"max": MaxMetric, "min": MinMetric}  # probe.mode -> the aggregator of the tracked best


class NonFiniteLossError(FloatingPointError):
    """A batch gave a NaN or infinite loss (the message names the split, epoch, batch and its items)."""


class NonFiniteInputError(FloatingPointError):
    """A batch's inputs hold a NaN or infinite value (the message names the split, epoch, batch, the items
    holding it and the data they were read from, e.g. the cache entry)."""


def count_nonfinite(values: np.ndarray) -> int:
    """Number of NaN and infinite values in the float array ``values``: one single-threaded numpy sum, finite
    unless a value is not (or the sum overflows: then counted exactly), so the common case is one pass over data
    the caller has just touched (a torch sum of a small tensor waits for its thread pool on a busy machine)."""
    if np.isfinite(np.add.reduce(values, axis=None)):
        return 0
    return int(values.size - np.count_nonzero(np.isfinite(values)))


class ProbeModule(pl.LightningModule):
    """Base of the trainable LightningModules; subclasses implement :meth:`step` (and :meth:`build`,
    :meth:`param_groups`, :meth:`scheduler_arguments`, :meth:`describe_batch` where they need to).

    Args:
        optimizer: partial of a ``torch.optim`` optimizer (``params`` is filled in); None only for a module
            that is never fitted.
        scheduler: partial of an lr scheduler (``optimizer`` and :meth:`scheduler_arguments` filled in), or None.
        monitor: the validation metric tracked as best, ``val/<name>`` of ``metrics["val"]``.
        mode: ``max`` or ``min``: which direction of ``monitor`` is better.
        metrics: per split (``train``, ``val``, ``test``) the torchmetrics to update, by name (logged as
            ``<split>/<name>``); a split may have none.
        scheduler_monitor: what a ``ReduceLROnPlateau`` scheduler reads; None: ``monitor``.
    """

    not_hyperparameters: tuple[str, ...] = ()  # constructor arguments not saved with the hyperparameters
    scheduler_interval: str = "epoch"  # "epoch" or "step": when Lightning steps the scheduler

    def __init__(self, optimizer: Callable | None, scheduler: Callable | None, monitor: str, mode: str,
                 metrics: Mapping[str, Mapping[str, Metric]], scheduler_monitor: str | None = None):
        super().__init__()
        # collects the arguments of every __init__ up the subclass chain (Lightning reads their frames)
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "metrics", *self.not_hyperparameters])
        for k, v in self.hparams.items():  # what the checkpoint keeps: loadable weights-only
            self.hparams[k] = plain(v)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        if sorted(metrics) != sorted(SPLITS):
            raise ValueError(f"{type(self).__name__}: metrics must have the splits {list(SPLITS)}, got {sorted(metrics)}")
        self.train_metrics, self.val_metrics, self.test_metrics = (
            MetricCollection(dict(metrics[s]), prefix=f"{s}/") for s in SPLITS)
        names = [f"val/{k}" for k in metrics["val"]]
        if monitor not in names:
            raise ValueError(f"{type(self).__name__}: monitor={monitor!r} (probe.monitor) is not one of its "
                             f"validation metrics {names}")
        if mode not in BEST:
            raise ValueError(f"{type(self).__name__}: mode={mode!r} (probe.mode) must be one of {sorted(BEST)}")
        self.monitor, self.mode = monitor, mode
        self.scheduler_monitor = scheduler_monitor or monitor
        self.val_best = BEST[mode]()

    # ------------------------------------------------------------------ model
    def build(self, datamodule: pl.LightningDataModule | None) -> None:
        """Create the parts whose sizes come from the data (called again by ``setup``: build once)."""

    def setup(self, stage: str) -> None:
        self.build(self.trainer.datamodule)

    def trainable(self) -> bool:
        """Whether any parameter requires a gradient (call after :meth:`build`)."""
        return any(p.requires_grad for p in self.parameters())

    # ------------------------------------------------------------------ steps
    def step(self, batch: Any, split: str) -> tuple[torch.Tensor, int, Any]:
        """One batch of ``split``: updates ``<split>_metrics`` and returns ``(loss, items, output)``: the loss,
        the number of items it is the mean over (its weight in the epoch mean), what ``test_step`` returns."""
        raise NotImplementedError

    def describe_batch(self, batch: Any) -> str:
        """The batch's items (sentence indices, example ids, ...) for error messages."""
        return ""

    def check_loss(self, loss: torch.Tensor, batch: Any, batch_idx: int, split: str) -> None:
        """Raise :class:`NonFiniteLossError` naming the batch when ``loss`` is NaN or infinite."""
        if not bool(torch.isfinite(loss).all()):
            what = self.describe_batch(batch)
            raise NonFiniteLossError(f"{type(self).__name__}: {split} loss is {loss.detach().cpu().tolist()} in "
                                     f"epoch {self.current_epoch}, batch {batch_idx}" + (f" ({what})" if what else ""))

    def check_batch(self, batch: Any, batch_idx: int, split: str) -> None:
        """Raise :class:`NonFiniteInputError` when a floating-point tensor of ``batch`` (a mapping) holds a NaN or
        infinite value, naming the rows holding it (their ``index`` in the split, where the batch has one),
        :meth:`describe_batch` and the datamodule's ``source(stage)`` (where the stage's data was read).

        A batch with ``nonfinite`` (B,), each item's non-finite values counted by the dataset as it read them
        (:func:`count_nonfinite`; its floating-point tensors are made from those values only), is judged by
        those counts; the tensors are scanned only to name the one holding the values."""
        if not isinstance(batch, Mapping):
            return
        counts = batch.get("nonfinite")  # (B,) per item, or None: the tensors are scanned
        if torch.is_tensor(counts) and not bool(counts.any()):
            return
        for name, value in batch.items():
            if not (torch.is_tensor(value) and value.is_floating_point()):
                continue
            # one pass without a mask: a sum is finite unless a value is not (or it overflows: checked below)
            if bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all()):
                continue
            bad = ~torch.isfinite(value.detach())
            rows = bad.flatten(1).any(1).nonzero().flatten() if value.dim() > 1 else bad.nonzero().flatten()
            self._raise_nonfinite(batch, batch_idx, split, f"{int(bad.sum())} non-finite values (NaN/inf) in "
                                  f"'{name}'", rows, len(value))
        if torch.is_tensor(counts):  # read as non-finite, but in values the batch's tensors leave out
            rows = counts.nonzero().flatten()
            self._raise_nonfinite(batch, batch_idx, split, f"{int(counts.sum())} non-finite values (NaN/inf) in "
                                  "the data read (not in the batch's tensors)", rows, len(counts))

    def _raise_nonfinite(self, batch: Mapping, batch_idx: int, split: str, what: str, rows: torch.Tensor,
                         size: int) -> None:
        """Raise :class:`NonFiniteInputError`: ``what`` was found in ``rows`` of a batch of ``size`` items."""
        index = batch.get("index")
        items = (index[rows.to(index.device)].tolist() if torch.is_tensor(index) and index.dim() == 1
                 and len(index) == size else rows.tolist())
        stage = {"val": "val", "test": "test"}.get(split, "train")
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        source = dm.source(stage) if hasattr(dm, "source") else "unknown"
        described = self.describe_batch(batch)
        raise NonFiniteInputError(
            f"{type(self).__name__}: {split} batch {batch_idx} of epoch {self.current_epoch}: {what} of items {items}"
            + (f" ({described})" if described else "") + f", read from {source}: the data is damaged, rebuild it")

    def _run_step(self, batch: Any, batch_idx: int, split: str) -> tuple[torch.Tensor, Any]:
        self.check_batch(batch, batch_idx, split)
        loss, items, output = self.step(batch, split)
        self.check_loss(loss, batch, batch_idx, split)
        self.log(f"{split}/loss", loss, on_step=split == "train", on_epoch=True, prog_bar=True, batch_size=items,
                 sync_dist=True)  # DDP: the mean over processes
        return loss, output

    def training_step(self, batch, batch_idx):
        return self._run_step(batch, batch_idx, "train")[0]

    def validation_step(self, batch, batch_idx):
        self._run_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        return self._run_step(batch, batch_idx, "test")[1]

    # ------------------------------------------------------------------ epoch ends
    def log_metrics(self, split: str) -> dict[str, torch.Tensor]:
        """Compute, reset and log ``<split>_metrics`` (for ``val`` also ``<monitor>_best``); returns the values."""
        collection: MetricCollection = getattr(self, f"{split}_metrics")
        values = dict(collection.compute()) if len(collection) else {}
        collection.reset()
        if split == "val":
            current = values[self.monitor]
            if not self.trainer.sanity_checking and not torch.isnan(current):
                self.val_best.update(current)
            if self.val_best.update_count:
                values[f"{self.monitor}_best"] = self.val_best.compute()
        # computed from the synced metric states: equal on every rank
        self.log_dict(values, prog_bar=split != "train", sync_dist=True)
        return values

    def on_train_epoch_end(self) -> None:
        self.log_metrics("train")

    def on_validation_epoch_end(self) -> None:
        self.log_metrics("val")

    def on_test_epoch_end(self) -> None:
        self.log_metrics("test")

    # ------------------------------------------------------------------ resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep what a resumed run needs besides the weights: the tracked best (a torchmetrics state, not in
        the state dict) and the random generators' states (dropout, shuffling of the next epoch)."""
        checkpoint["probes"] = dict(
            val_best={k: getattr(self.val_best, k).detach().cpu().clone() for k in self.val_best._defaults},
            val_best_updates=int(self.val_best._update_count),
            rng=dict(torch=torch.get_rng_state(), numpy=_numpy_state(), python=random.getstate(),
                     cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore what :meth:`on_save_checkpoint` kept (checkpoints without it: nothing to restore)."""
        state = checkpoint.get("probes")
        if not state:
            return
        for k, v in state["val_best"].items():
            setattr(self.val_best, k, v.to(getattr(self.val_best, k).device))
        self.val_best._update_count = state["val_best_updates"]
        self.val_best._computed = None
        # the generators as they were at the end of that epoch: a loader made next draws its shuffling seed from
        # them as in the run left alone (loader workers started before it, in a sanity check, would draw first)
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    # ------------------------------------------------------------------ optimisation
    def param_groups(self) -> list[dict] | list[torch.nn.Parameter]:
        """What the optimizer trains: by default every parameter that requires a gradient."""
        return [p for p in self.parameters() if p.requires_grad]

    def scheduler_arguments(self) -> dict[str, Any]:
        """Keyword arguments the scheduler partial gets besides ``optimizer``."""
        return {}

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError(f"{type(self).__name__} needs an optimizer partial to train (probe.optimizer)")
        optimizer = self.optimizer_factory(params=self.param_groups())
        for group in optimizer.param_groups:  # before the scheduler reads the lrs
            if "lr_scale" in group:
                group["lr"] = group["lr"] * group["lr_scale"]
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer, **self.scheduler_arguments())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval,
                                                         "monitor": self.scheduler_monitor}}


def _numpy_state() -> tuple:
    """numpy's global generator state as types a ``weights_only`` checkpoint load accepts (a tensor, not an array)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)
