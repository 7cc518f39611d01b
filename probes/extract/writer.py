"""Writing a cache entry from Lightning's predict loop: one shard per rank, the entry finalized by rank 0."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter

from probes.extract import cache
from probes.io import naming_full_disk

log = logging.getLogger(__name__)


def extraction_peer(trainer: Callable[..., pl.Trainer]) -> bool:
    """Whether this process is a rank > 0 of the extraction's own multi-process Trainer (started by Lightning's
    launcher, SLURM or torchrun): the group's rank 0 takes the build lock for all of it.

    Args:
        trainer: The partial Trainer constructor of the extraction.
    """
    kw = getattr(trainer, "keywords", {})
    if str(kw.get("devices", 1)) == "1" and int(kw.get("num_nodes", 1)) == 1:
        return False
    t = trainer()
    return t.world_size > 1 and t.global_rank > 0


class CacheWriter(BasePredictionWriter):
    """Writes each rank's predictions to its own shard; rank 0 finalizes the entry. A full disk is a
    :class:`~probes.io.DiskFullError` naming the entry being written (:func:`probes.io.naming_full_disk`).

    Args:
        final_dir: The entry's folder (built in ``<final_dir>.partial`` and renamed into place).
        manifest: The manifest written last.
    """

    def __init__(self, final_dir: Path, manifest: dict):
        super().__init__(write_interval="batch")
        self.final_dir = Path(final_dir)
        self.partial_dir = self.final_dir.with_name(self.final_dir.name + ".partial")
        self.manifest = manifest
        self.shard: cache.ShardWriter | None = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            if self.partial_dir.exists():
                log.warning("removing incomplete cache from an interrupted run: %s", self.partial_dir)
                shutil.rmtree(self.partial_dir)
            with naming_full_disk(self.partial_dir, "creating the cache entry"):
                self.partial_dir.mkdir(parents=True)
        trainer.strategy.barrier()
        with naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard = cache.ShardWriter(self.partial_dir, trainer.global_rank)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        maps = prediction["maps"].numpy()  # (B, L, H, W, W) float16
        with naming_full_disk(self.shard.data_path, "writing the cache entry's maps"):
            for k, (i, n) in enumerate(zip(prediction["index"].tolist(), prediction["n_words"].tolist())):
                self.shard.write(i, maps[k, :, :, : n + 2, : n + 2])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard.close()
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            with naming_full_disk(self.partial_dir, "finishing the cache entry"):
                cache.finalize(self.partial_dir, self.final_dir, self.manifest)
        trainer.strategy.barrier()
