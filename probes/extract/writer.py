"""Writing a cache entry, from Lightning's predict loop or the stage's own: one shard per rank, the entry finalized
by rank 0.

The writer copies each batch's maps to the host (from a GPU: to page-locked memory, asynchronously) and appends them
to the shard as one contiguous write, in a background thread (a bounded queue, in order) where the caller asks for it
(the stage's own loop, and Lightning's on a GPU), so that the device computes the next batch meanwhile. The bytes
written are the same either way.
"""

from __future__ import annotations

import functools
import logging
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from probes.extract import cache
from probes.io import naming_full_disk
from probes.maps.timing import stage

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


def to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """The tensors on the host: CPU tensors as they are (None); CUDA tensors copied asynchronously into page-locked
    memory, with the event to wait on before reading them.

    Returns:
        (host tensors, event or None).
    """
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors), None
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    event = torch.cuda.Event()
    event.record()
    return out, event


class BackgroundWrites:
    """Runs jobs in order in one background thread, at most ``depth`` waiting; the first job's error is raised by the
    next :meth:`submit` or by :meth:`finish` (the jobs after it are skipped).

    Args:
        depth: How many jobs may wait (>= 1); :meth:`submit` blocks while that many do.
    """

    def __init__(self, depth: int = 2):
        self._jobs: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._error: BaseException | None = None
        self._skip = False
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._error is not None or self._skip:
                continue
            try:
                job()
            except BaseException as e:  # raised in the submitting thread
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (raises the error of an earlier job instead)."""
        self._raise()
        self._jobs.put(job)

    def finish(self) -> None:
        """Wait for every queued job; raise the first error."""
        self._jobs.put(None)
        self._thread.join()
        self._raise()

    def abandon(self) -> None:
        """Skip the queued jobs and stop the thread (after an error elsewhere); raises nothing."""
        self._skip = True
        self._jobs.put(None)
        self._thread.join()


class CacheWriter(pl.Callback):
    """Writes each rank's predictions to its own shard; rank 0 finalizes the entry. A full disk is a
    :class:`~probes.io.DiskFullError` naming the entry being written (:func:`probes.io.naming_full_disk`).
    A plain callback, not a ``BasePredictionWriter``: a batch's sentences are its ``index``, and Lightning's batch
    indices, which a loader of whole batches does not have, would only be warned about at every extraction.

    Its steps (:meth:`open`, :meth:`put`, :meth:`close`, :meth:`abandon`) serve Lightning's predict hooks and the
    stage's own loop (:func:`probes.extract.stage.predict_loop`) alike. Each batch's sentences go to the shard as one
    contiguous write (:meth:`probes.extract.cache.ShardWriter.write_many`). A subclass stores blocks of another shape
    (:meth:`new_shard`, :meth:`blocks`: :class:`probes.extract.representations.HiddenCacheWriter`).

    Args:
        final_dir: The entry's folder (built in ``<final_dir>.partial`` and renamed into place).
        manifest: The manifest written last.
        background: Write in a background thread (:class:`BackgroundWrites`); None: as the caller of :meth:`open`
            asks (Lightning's hooks: when the model is on a GPU).
        depth: Batches that may wait for the background thread.
    """

    def __init__(self, final_dir: Path, manifest: dict, background: bool | None = None, depth: int = 2):
        super().__init__()
        self.final_dir = Path(final_dir)
        self.partial_dir = self.final_dir.with_name(self.final_dir.name + ".partial")
        self.manifest = manifest
        self.shard: cache.ShardWriter | None = None
        self.background, self.depth = background, depth
        self._behind: BackgroundWrites | None = None

    # ------------------------------------------------------------------------- the steps
    def open(self, rank: int = 0, first: bool = True, barrier: Callable[[], None] = lambda: None,
             background: bool = False) -> None:
        """Open rank ``rank``'s shard; the first rank (``first``) removes an interrupted run's partial folder and
        creates it before the others (``barrier``) open theirs. ``background``: the writes' thread unless the
        constructor's ``background`` says otherwise."""
        if first:
            if self.partial_dir.exists():
                log.warning("removing incomplete cache from an interrupted run: %s", self.partial_dir)
                shutil.rmtree(self.partial_dir)
            with naming_full_disk(self.partial_dir, "creating the cache entry"):
                self.partial_dir.mkdir(parents=True)
        barrier()
        with naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard = self.new_shard(rank)
        behind = self.background if self.background is not None else background
        self._behind = BackgroundWrites(self.depth) if behind else None

    def new_shard(self, rank: int) -> cache.ShardWriter:
        """Rank ``rank``'s shard writer in the partial folder (a subclass's for blocks of another shape)."""
        return cache.ShardWriter(self.partial_dir, rank)

    def blocks(self, maps: np.ndarray, index: list[int], n_words: list[int]) -> list[tuple[int, np.ndarray]]:
        """(sentence index, its block) of each sentence of a batch's padded ``maps`` ((B, L, H, W, W) float16 on the
        host): its (L, H, n + 2, n + 2) maps, n its words (a subclass's blocks of another shape)."""
        return [(i, maps[k, :, :, : n + 2, : n + 2]) for k, (i, n) in enumerate(zip(index, n_words))]

    def put(self, maps: torch.Tensor, index: torch.Tensor, n_words: torch.Tensor) -> None:
        """Write one batch: ``maps`` (B, L, H, W, W) float16, ``index`` and ``n_words`` (B,), on any device (a GPU's
        copied to page-locked host memory asynchronously); in the background thread when there is one (the error of
        an earlier batch is raised here)."""
        with stage("to host"):
            (maps, index, n_words), ready = to_host(maps, index, n_words)
        job = functools.partial(self._write_maps, maps, index, n_words, ready)
        if self._behind is None:
            job()
        else:
            self._behind.submit(job)

    def close(self, first: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
        """Wait for the background writes (raising their first error), close this rank's shard and, once every
        rank has (``barrier``), finalize the entry on the first rank (``first``): manifest, rename into place."""
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.finish()  # every batch written; the first error of the thread raised here
        with stage("finalize"), naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard.close()
        barrier()
        if first:
            with stage("finalize"), naming_full_disk(self.partial_dir, "finishing the cache entry"):
                cache.finalize(self.partial_dir, self.final_dir, self.manifest)
        barrier()

    def abandon(self) -> None:
        """Stop the background writes after an error elsewhere (queued batches skipped); the entry stays
        ``.partial``, never complete. Raises nothing."""
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.abandon()

    def _write_maps(self, maps: torch.Tensor, index: torch.Tensor, n_words: torch.Tensor,
                    ready: torch.cuda.Event | None) -> None:
        """Append one batch's word maps ((B, L, H, W, W) float16 on the host, or a subclass's :meth:`blocks`' input;
        index, n_words (B,)) to the shard, as one write."""
        if ready is not None:
            ready.synchronize()
        with stage("write"), naming_full_disk(self.shard.data_path, "writing the cache entry's maps"):
            self.shard.write_many(self.blocks(maps.numpy(), index.tolist(), n_words.tolist()))

    # ------------------------------------------------------------------------- Lightning's hooks
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.open(trainer.global_rank, trainer.is_global_zero, trainer.strategy.barrier,
                  background=pl_module.device.type == "cuda")

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.write_on_batch_end(trainer, pl_module, outputs, None, batch, batch_idx, dataloader_idx)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        """Write one batch's predictions (``maps``, ``index``, ``n_words``); ``batch_indices`` is not read."""
        self.put(prediction["maps"], prediction["index"], prediction["n_words"])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close(trainer.is_global_zero, trainer.strategy.barrier)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.abandon()
