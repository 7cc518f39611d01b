"""What every trainable package's run keeps for ``python train.py resume=<run folder>``: the last epoch's full
checkpoint (weights, optimizer, scheduler, loops, callbacks' states), written atomically every epoch."""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Checkpoint

from probes.io import file_mode

LAST = "last.ckpt"


class LastCheckpoint(Checkpoint):
    """Write ``<dirpath>/last.ckpt`` at the end of every training epoch, replacing the previous one atomically
    (a temporary file renamed into place: a run killed while writing keeps the epoch before).

    A :class:`~pytorch_lightning.callbacks.Checkpoint`, so Lightning runs it after the other callbacks and
    after the checkpoint callbacks listed before it (``model_checkpoint``): the file holds their state of this
    epoch (the best score and path so far)."""

    def __init__(self, dirpath: str, filename: str = LAST):
        self.dirpath, self.filename = Path(dirpath), filename

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.dirpath / self.filename

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.dirpath.mkdir(parents=True, exist_ok=True)
        tmp = self.dirpath / f".{self.filename}.epoch{trainer.current_epoch}.tmp"  # the same name on every rank
        trainer.save_checkpoint(tmp, weights_only=False)  # the full state (resume); every rank calls it, rank 0 writes
        if trainer.is_global_zero:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), file_mode())
            os.replace(tmp, self.path)
        trainer.strategy.barrier("last_checkpoint")
