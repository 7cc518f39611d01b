"""Progress lines in the run's log when no one watches a terminal (nohup, CI, SLURM: stdout or stderr not a TTY).

A long stage logs ``<what>: <done>/<total> <unit> (<pct>), <rate>, elapsed <t>, ETA <t>`` through python logging
(which Hydra writes to the run's ``.log`` file; the extraction child appends to the same file,
:mod:`probes.extract.runner`) at a steady interval: ``every_s`` seconds, by default ``$PROBES_PROGRESS_S``, else
:data:`EVERY_S` (30). On a terminal nothing is logged: tqdm's and Lightning's bars show the progress there.

* :class:`Progress`: a counter (``update(n)``) that logs at the interval and a closing line; a context manager.
* :func:`progress`: the same around an iterable (``for x in progress(items, "flow", total=n)``).
* :class:`ProgressCallback`: a Lightning callback for fit, validate, test and predict (``conf/callbacks/*.yaml``,
  the extraction stage's Trainer).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import pytorch_lightning as pl

log = logging.getLogger(__name__)

EVERY_S = 30.0  # seconds between two progress lines
ENV = "PROBES_PROGRESS_S"  # overrides EVERY_S for every stage (also in the extraction child, which inherits it)

T = TypeVar("T")


def interval(every_s: float | None = None) -> float:
    """Seconds between two lines: ``every_s``, else ``$PROBES_PROGRESS_S``, else :data:`EVERY_S` (``0``: at
    every update; ``inf``: the closing line only)."""
    if every_s is not None:
        value, source = every_s, "every_s"
    elif os.environ.get(ENV, "").strip():
        value, source = os.environ[ENV].strip(), ENV
    else:
        return EVERY_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{source}: expected seconds between progress lines (a number >= 0, inf: only the "
                         f"closing line), got {value!r}")
    return seconds


def _isatty(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def watched() -> bool:
    """Whether a person watches a terminal: stdout and stderr are both TTYs (where tqdm's and Lightning's bars
    draw). Otherwise (nohup, CI, SLURM, a pipe) progress goes into the log."""
    return _isatty(sys.stdout) and _isatty(sys.stderr)


def duration(seconds: float) -> str:
    """``42s``, ``6m05s``, ``2h03m``."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def singular(unit: str) -> str:
    """``batches`` -> ``batch``, ``sentences`` -> ``sentence``, ``items`` -> ``item``."""
    if unit.endswith(("ches", "shes", "sses", "xes")):
        return unit[:-2]
    return unit[:-1] if unit.endswith("s") else unit


def rate(n: float, seconds: float, unit: str) -> str:
    """``3.4 batches/s``, or ``12.5 s/batch`` below one per second (``unit``: plural)."""
    if n <= 0 or seconds <= 0:
        return f"? {unit}/s"
    per_s = n / seconds
    if per_s >= 1:
        return f"{per_s:,.1f} {unit}/s"
    return f"{1 / per_s:,.1f} s/{singular(unit)}"


class Progress:
    """Counts work done and logs a line every ``every_s`` seconds (:func:`interval`) and one at the end.

    Args:
        desc: What is counted (the line's start), e.g. ``fit`` or ``attention extraction``.
        total: The amount of work (None: unknown; no percentage or ETA).
        unit: Plural unit name (``batches``, ``sentences``).
        every_s: Seconds between lines; None: ``$PROBES_PROGRESS_S`` or :data:`EVERY_S`.
        enabled: Log at all; None: when no one watches a terminal (:func:`watched`).
        logger: Where the lines go (this module's logger by default).
        clock: Monotonic seconds (tests give a fake one).
    """

    def __init__(self, desc: str, total: int | None, unit: str = "items", every_s: float | None = None,
                 enabled: bool | None = None, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.unit = desc, None if total is None else int(total), unit
        self.every_s = interval(every_s)
        self.enabled = (not watched()) if enabled is None else bool(enabled)
        self.log = logger or log
        self.clock = clock
        self.done = 0
        self.note = ""  # extra words after the counts (a Lightning fit: the epoch)
        self.t0 = self.last = clock()
        self.closed = False

    def line(self, now: float | None = None) -> str:
        """``<desc>: <done>/<total> <unit> (<pct>), <rate>, elapsed <t>, ETA <t>``."""
        now = self.clock() if now is None else now
        el = now - self.t0
        count = f"{self.done:,}/{self.total:,}" if self.total else f"{self.done:,}"
        pct = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        eta = ""
        if self.total:
            left = max(self.total - self.done, 0)
            eta = f", ETA {duration(left * el / self.done) if self.done else '?'}"
        note = f", {self.note}" if self.note else ""
        return f"{self.desc}: {count} {self.unit}{pct}{note}, {rate(self.done, el, self.unit)}, " \
               f"elapsed {duration(el)}{eta}"

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; log a line when ``every_s`` seconds have passed since the last one."""
        self.done += n
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.log.info("%s", self.line(now))

    def close(self, failed: bool = False) -> None:
        """Log the closing line (once): ``done``, or ``stopped`` when ``failed``."""
        if self.closed:
            return
        self.closed = True
        if not self.enabled:
            return
        el = self.clock() - self.t0
        count = f"{self.done:,}/{self.total:,}" if self.total else f"{self.done:,}"
        self.log.info("%s: %s %s %s in %s (%s)", self.desc, "stopped at" if failed else "done", count, self.unit,
                      duration(el), rate(self.done, el, self.unit))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "items",
             every_s: float | None = None, enabled: bool | None = None,
             logger: logging.Logger | None = None) -> Iterator[T]:
    """Yield ``items``, counting each in a :class:`Progress` (``total``: ``len(items)`` when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total, unit, every_s, enabled, logger) as p:
        for x in items:
            yield x
            p.update()


class ProgressCallback(pl.Callback):
    """Progress lines of a Lightning run (:class:`Progress`, rank 0 only): fit counts training batches over all
    epochs up to ``max_epochs`` (its ETA: to the last epoch; early stopping can end sooner; validation time is in
    the rate), validate and test (outside fit) and predict count their batches.

    Args:
        every_s: Seconds between lines; None: ``$PROBES_PROGRESS_S`` or :data:`EVERY_S` (30).
        enabled: Log at all; None: when no one watches a terminal (stdout or stderr not a TTY), where the
            Lightning progress bar shows nothing.
        desc: The lines' first word for predict (e.g. ``attention extraction``); None: ``predict``.
    """

    def __init__(self, every_s: float | None = None, enabled: bool | None = None, desc: str | None = None):
        self.every_s = interval(every_s)  # checked now: a bad value fails before the run
        self.enabled, self.desc = enabled, desc
        self.progress: Progress | None = None

    def _start(self, trainer: pl.Trainer, desc: str, total: float | None, unit: str = "batches") -> None:
        enabled = (not watched() if self.enabled is None else bool(self.enabled)) and trainer.is_global_zero
        total = None if total is None or not math.isfinite(total) else int(total)
        self.progress = Progress(desc, total, unit, self.every_s, enabled)

    def _step(self) -> None:
        if self.progress is not None:
            self.progress.update()

    def _end(self, failed: bool = False) -> None:
        if self.progress is not None:
            self.progress.close(failed)
            self.progress = None

    # fit: training batches of every epoch left
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        per_epoch = float(trainer.num_training_batches)
        epochs = trainer.max_epochs
        total = per_epoch * (epochs - trainer.current_epoch) if epochs is not None and epochs > 0 else None
        self._start(trainer, "fit", total)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.progress is not None:
            epochs = trainer.max_epochs
            self.progress.note = f"epoch {trainer.current_epoch + 1}" + (f"/{epochs}" if epochs and epochs > 0 else "")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    # validate / test outside fit
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            self._start(trainer, "validate", sum(trainer.num_val_batches))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            self._step()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            self._end()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, "test", sum(trainer.num_test_batches))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._step()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, self.desc or "predict", sum(trainer.num_predict_batches))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._step()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end(failed=True)
