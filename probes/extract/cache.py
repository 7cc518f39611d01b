"""Keyed, versioned on-disk cache of word-level attention maps (and the key of every cache kind).

Layout of one cache entry (read lazily, one sentence at a time) `<cache_dir>/attention/<slug>-<hash>/`:
  manifest.json        key, sizes, shard list, skipped sentences (written last)
  maps-r<rank>.f16     float16 maps of the sentences that rank wrote, back to back
  index-r<rank>.npy    (N_r, 3) int64 rows: sentence index, element offset, side W
A map of a sentence with n words has side W = n + 2 ([CLS], words, [SEP]) and shape (L, H, W, W).
An entry is built in `<entry>.partial/` and renamed into place once complete, so nothing that
lacks a manifest is ever read; an interrupted build is deleted and redone by the next run.

Concurrent builds (parallel sweep jobs, DDP ranks' loaders): :func:`build_lock` takes an exclusive
lock on `<cache_dir>/.locks/<kind>/<entry>.lock` (:func:`lock_path`; ``filelock``: ``flock``, released
by the kernel when its holder dies; outside the kind's folder, which lists entries only), so exactly
one process builds an entry while the others wait and then read it; a waiting process whose builder
was killed gets the lock, finds no manifest and builds the entry itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from filelock import FileLock, Timeout

from probes.io import atomic_write_text

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def cache_key_hash(key: dict) -> str:
    """The 16 hex digits that name a cache entry: sha256 of the key as sorted JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_key(encoder, source, kind, settings, precision: str) -> dict:
    """Everything that changes an entry's contents, for every cache kind; its hash names the entry.

    The fields common to every kind (format, encoder name and weights, ``max_length``, precision, storage),
    then ``source.key_fields(settings)`` (which sentences: dataset, split, data digest, how many or how they
    were made, the long-sentence policy where it applies) and ``kind.key_fields(encoder, settings)`` (what is
    stored: pooling and map kind, or layers and pooling). ``source``/``kind``: the objects of
    :mod:`probes.extract.runner`; ``settings``: an :class:`~probes.extract.settings.ExtractSettings`.
    """
    return dict(format_version=FORMAT_VERSION, encoder=encoder.name, revision=encoder.fingerprint,
                max_length=settings.max_length_for(encoder), precision=precision, storage="float16",
                **source.key_fields(settings), **kind.key_fields(encoder, settings))


def entry_dir(cache_dir: str | Path, key: dict, folder: str = "attention") -> Path:
    """``<cache_dir>/<folder>/<encoder>-<dataset>-<split>-<hash of key>`` (``folder``: the cache kind's)."""
    slug = "-".join(str(key[k]) for k in ("encoder", "dataset", "split")).replace("/", "_")
    return Path(cache_dir) / folder / f"{slug}-{cache_key_hash(key)}"


def is_complete(final_dir: str | Path) -> bool:
    """An entry is complete once its manifest exists (it is written last, then the folder renamed into place)."""
    return (Path(final_dir) / "manifest.json").exists()


def lock_path(final_dir: str | Path) -> Path:
    """The build lock of the entry ``<cache_dir>/<kind>/<entry>``: ``<cache_dir>/.locks/<kind>/<entry>.lock``."""
    final_dir = Path(final_dir)
    return final_dir.parent.parent / ".locks" / final_dir.parent.name / f"{final_dir.name}.lock"


@contextlib.contextmanager
def build_lock(final_dir: str | Path, poll_interval: float = 0.5, timeout: float | None = None) -> Iterator[bool]:
    """Hold the build lock of the cache entry ``final_dir`` (any kind of entry: a folder that is complete
    once it has a ``manifest.json``) for the duration of the block.

    Yields True when this process must build the entry (it holds the lock and the entry is still
    incomplete, e.g. because the previous builder was killed), False when it is complete (built by another
    process while this one waited): then just read it. The lock (:func:`lock_path`) is an ``flock`` that the
    kernel releases when its holder exits or dies, so a killed builder never blocks the others.
    ``timeout``: seconds to wait for another builder (None: no limit; raises ``TimeoutError``).
    """
    final_dir, path = Path(final_dir), lock_path(final_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process building %s", final_dir)
        t0 = time.monotonic()
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout, poll_interval=poll_interval)
        except Timeout:
            raise TimeoutError(f"cache entry {final_dir} still locked by another builder after {timeout} s "
                               f"(lock file {lock.lock_file})") from None
        log.info("cache entry lock acquired after %.1f s: %s", time.monotonic() - t0, final_dir)
    try:
        yield not is_complete(final_dir)
    finally:
        lock.release()


class ShardWriter:
    """Appends one rank's maps to its shard; `close()` fsyncs the data and writes the index."""

    def __init__(self, partial_dir: Path, rank: int):
        self.data_path = partial_dir / f"maps-r{rank}.f16"
        self.index_path = partial_dir / f"index-r{rank}.npy"
        self._f = open(self.data_path, "wb")
        self._rows: list[tuple[int, int, int]] = []
        self._offset = 0

    def write(self, sentence_index: int, maps: np.ndarray) -> None:
        """maps: (L, H, W, W) float16."""
        assert maps.dtype == np.float16 and maps.shape[-1] == maps.shape[-2]
        self._f.write(memoryview(np.ascontiguousarray(maps)).cast("B"))  # no intermediate bytes copy
        self._rows.append((sentence_index, self._offset, maps.shape[-1]))
        self._offset += maps.size

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        np.save(self.index_path, np.asarray(self._rows, dtype=np.int64).reshape(-1, 3))


def finalize(partial_dir: Path, final_dir: Path, manifest: dict) -> None:
    """Check the shards cover every expected sentence once, write the manifest, rename into place."""
    shards = sorted(p.name for p in partial_dir.glob("maps-r*.f16"))
    seen = np.concatenate([np.load(partial_dir / s.replace("maps", "index").replace(".f16", ".npy"))[:, 0]
                           for s in shards]) if shards else np.zeros(0, dtype=np.int64)
    expected = set(range(manifest["n_sentences"])) - set(manifest["skipped"])
    if len(seen) != len(set(seen.tolist())) or set(seen.tolist()) != expected:
        raise RuntimeError(f"cache shards in {partial_dir} do not cover each sentence exactly once")
    manifest = dict(manifest, shards=shards, bytes=sum((partial_dir / s).stat().st_size for s in shards))
    atomic_write_text(partial_dir / "manifest.json", json.dumps(manifest, indent=1))
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(partial_dir, final_dir)


class AttentionCache:
    """Read-only view of a complete cache entry; maps are memory-mapped and read lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.exists():
            raise FileNotFoundError(f"no complete attention cache at {self.path} (missing manifest.json)")
        self.manifest = json.loads(manifest.read_text())
        if self.manifest["format_version"] != FORMAT_VERSION:
            raise ValueError(f"{manifest}: cache format {self.manifest['format_version']}, expected {FORMAT_VERSION}")
        self.num_layers = self.manifest["num_layers"]
        self.num_heads = self.manifest["num_heads"]
        n = self.manifest["n_sentences"]
        self._where = np.full((n, 3), -1, dtype=np.int64)  # (N, 3): shard, offset, side
        for s, shard in enumerate(self.manifest["shards"]):
            idx = np.load(self.path / shard.replace("maps", "index").replace(".f16", ".npy"))
            self._where[idx[:, 0], 0] = s
            self._where[idx[:, 0], 1:] = idx[:, 1:]
        self._fds: list[int] | None = None  # opened on first access in each process

    def __len__(self) -> int:
        return len(self._where)

    @property
    def skipped(self) -> list[int]:
        return self.manifest["skipped"]

    def __contains__(self, i: int) -> bool:
        return self._where[i, 0] >= 0

    def __getitem__(self, i: int) -> np.ndarray:
        """(L, H, W, W) float16 maps of sentence i, read from disk on each call.

        Reads copy (os.pread) rather than memory-map, so pages of a cache larger than memory never
        accumulate in the reading process.
        """
        shard, offset, side = (int(v) for v in self._where[i])
        if shard < 0:
            raise KeyError(f"sentence {i} is not in cache {self.path} (skipped: longer than the encoder's maximum)")
        if self._fds is None:
            self._fds = [os.open(self.path / s, os.O_RDONLY) for s in self.manifest["shards"]]
        shape = (self.num_layers, self.num_heads, side, side)
        nbytes = 2 * int(np.prod(shape))
        buf = os.pread(self._fds[shard], nbytes, 2 * offset)
        if len(buf) != nbytes:
            raise OSError(f"{self.path / self.manifest['shards'][shard]}: truncated at sentence {i}")
        return np.frombuffer(buf, dtype=np.float16).reshape(shape)

    def __getstate__(self):
        return dict(self.__dict__, _fds=None)

    def __del__(self):
        for fd in self._fds or []:
            os.close(fd)
