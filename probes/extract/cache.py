"""Keyed, versioned on-disk cache of word-level attention maps, and what every cache kind shares: the key, the
shard writer, the build lock, integrity checks and the reader base :class:`CacheEntry`.

Layout of one cache entry (read lazily, one sentence at a time) `<cache_dir>/attention/<slug>-<hash>/`:
  manifest.json        key, sizes, shard list, skipped sentences (written last)
  maps-r<rank>.f16     float16 maps of the sentences that rank wrote, back to back
  index-r<rank>.npy    (N_r, 3) int64 rows: sentence index, element offset, side W
A map of a sentence with n words has side W = n + 2 ([CLS], words, [SEP]) and shape (L, H, W, W). An entry of
chosen rows (:mod:`probes.extract.rows`; the manifest lists each sentence's ``rows``) holds (R, L, H, W) of each.
An entry is built in `<entry>.partial/` and renamed into place once complete, so nothing that
lacks a manifest is ever read; an interrupted build is deleted and redone by the next run.

Integrity: each shard writer computes the CRC-32 of its data file and its index while writing them; the
manifest lists every file's size and CRC-32 (``checksums``). An entry is verified once per process when it is
first opened (:func:`verify`, about 1 s per GB of maps); a damaged entry (a file missing, truncated or with
other bytes, or a manifest without checksums) raises :class:`CacheDamaged`, which names the entry, the file and
the command that rebuilds it, and :func:`set_aside` moves such an entry out of the way
(``<entry>.damaged-<time>``) so that it is rebuilt.

Concurrent builds (parallel sweep jobs, DDP ranks' loaders): :func:`build_lock` takes an exclusive
lock on `<cache_dir>/.locks/<kind>/<entry>.lock` (:func:`lock_path`; ``filelock``: ``flock``, released
by the kernel when its holder dies; outside the kind's folder, which lists entries only), so exactly
one process builds an entry while the others wait and then read it; a waiting process whose builder
was killed gets the lock, finds no manifest and builds the entry itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import mmap
import os
import shlex
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from filelock import FileLock, Timeout

from probes.io import atomic_write_text
from probes.model.inputs import WORD_ENCODING

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # part of every key: entries of another format are never found


def cache_key_hash(key: dict) -> str:
    """The 16 hex digits that name a cache entry: sha256 of the key as sorted JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_key(encoder, source, kind, settings, precision: str) -> dict:
    """Everything that changes an entry's contents, for every cache kind; its hash names the entry.

    The fields common to every kind (format, encoder name and weights, the rule that makes words into pieces
    (:data:`probes.model.inputs.WORD_ENCODING`), ``max_length``, precision, storage, whether the model is
    causal and whether each sequence starts with a BOS, :meth:`~probes.model.load.Encoder.key_fields`), then
    ``source.key_fields(settings)`` (which sentences: dataset, split, data digest, how many or how they were
    made, the long-sentence policy where it applies) and ``kind.key_fields(encoder, settings)`` (what is
    stored: pooling, layers and map kind, or layers and pooling).

    Args:
        encoder: The :class:`~probes.model.load.Encoder`.
        source: The sentences' source (:mod:`probes.extract.runner`: ``TreebankSplit``, ``WordLists``).
        kind: The cache kind (:class:`~probes.extract.runner.CacheKind`).
        settings: An :class:`~probes.extract.settings.ExtractSettings`.
        precision: The resolved compute precision.

    Returns:
        The key (a JSON-serialisable dict).
    """
    return dict(format_version=FORMAT_VERSION, encoder=encoder.name, revision=encoder.fingerprint,
                word_encoding=WORD_ENCODING, max_length=settings.max_length_for(encoder), precision=precision,
                storage="float16",
                **encoder.key_fields(), **source.key_fields(settings), **kind.key_fields(encoder, settings))


def entry_dir(cache_dir: str | Path, key: dict, folder: str = "attention") -> Path:
    """``<cache_dir>/<folder>/<encoder>-<dataset>-<split>-<hash of key>`` (``folder``: the cache kind's)."""
    slug = "-".join(str(key[k]) for k in ("encoder", "dataset", "split")).replace("/", "_")
    return Path(cache_dir) / folder / f"{slug}-{cache_key_hash(key)}"


def is_complete(path: str | Path) -> bool:
    """Whether the cache entry at ``path`` (any kind) is complete: its manifest exists. The manifest is written
    last in ``<entry>.partial/``, which is then renamed to ``path``; every check of completeness is this one.

    Args:
        path: The entry folder (:func:`entry_dir`).

    Returns:
        True when the entry can be opened.
    """
    return (Path(path) / "manifest.json").is_file()


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


def index_name(shard: str) -> str:
    """The index file of the shard ``maps-r<rank>.f16``: ``index-r<rank>.npy``."""
    return shard.replace("maps", "index").replace(".f16", ".npy")


class ShardWriter:
    """Appends one rank's maps to its shard; `close()` fsyncs the data, writes the index and the CRC-32 and
    size of both (``checksums-r<rank>.json``, merged into the manifest by :func:`finalize`)."""

    def __init__(self, partial_dir: Path, rank: int):
        self.data_path = partial_dir / f"maps-r{rank}.f16"
        self.index_path = partial_dir / f"index-r{rank}.npy"
        self.sums_path = partial_dir / f"checksums-r{rank}.json"
        self._f = open(self.data_path, "wb")  # mode 0666 & ~umask, as every file of the cache
        self._rows: list[tuple[int, int, int]] = []
        self._offset = 0
        self._crc, self._bytes = 0, 0
        self._buf = np.empty(0, dtype=np.float16)  # write_many's batch buffer

    def _put(self, block: np.ndarray) -> None:
        """Append ``block``'s bytes (no intermediate copy) and fold them into the shard's CRC-32."""
        view = memoryview(np.ascontiguousarray(block)).cast("B")
        self._f.write(view)
        self._crc = zlib.crc32(view, self._crc)
        self._bytes += len(view)

    def index_size(self, sentence_index: int, block: np.ndarray) -> int:
        """The index's third column for ``block``, sentence ``sentence_index``'s maps: their side W; an assertion
        error for anything but (L, H, W, W) float16 (a subclass stores blocks of another shape:
        :class:`probes.extract.representations.HiddenShardWriter`)."""
        assert block.dtype == np.float16 and block.shape[-1] == block.shape[-2], \
            f"sentence {sentence_index}: expected square float16 maps (L, H, W, W), got {block.dtype} {block.shape}"
        return block.shape[-1]

    def write(self, sentence_index: int, maps: np.ndarray) -> None:
        """maps: (L, H, W, W) float16 (a subclass's blocks: :meth:`index_size`)."""
        size = self.index_size(sentence_index, maps)
        self._put(maps)
        self._rows.append((sentence_index, self._offset, size))
        self._offset += maps.size

    def write_many(self, items: list[tuple[int, np.ndarray]]) -> None:
        """Append several sentences' maps ((sentence index, (L, H, W, W) float16 or a subclass's block) each, in
        order) as one contiguous write: the bytes, index rows and CRC-32 of :meth:`write` called on each in turn."""
        if not items:
            return
        sizes = [m.size for _, m in items]
        total = sum(sizes)
        if self._buf.size < total:  # kept from batch to batch: no new pages to fault in at every write
            self._buf = np.empty(total, dtype=np.float16)
        buf = self._buf[:total]  # (sum of the blocks' elements,) the batch's blocks back to back
        at = 0
        for (i, m), n in zip(items, sizes):
            size = self.index_size(i, m)
            buf[at:at + n].reshape(m.shape)[...] = m  # one copy of the (strided) block
            self._rows.append((i, self._offset + at, size))
            at += n
        self._put(buf)
        self._offset += at

    def close(self) -> None:
        self._buf = np.empty(0, dtype=np.float16)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        buf = io.BytesIO()  # the bytes np.save(path) writes, hashed on their way to the file
        np.save(buf, np.asarray(self._rows, dtype=np.int64).reshape(-1, 3))
        index = buf.getvalue()
        with open(self.index_path, "wb") as f:
            f.write(index)
        sums = {self.data_path.name: dict(bytes=self._bytes, crc32=f"{self._crc:08x}"),
                self.index_path.name: dict(bytes=len(index), crc32=f"{zlib.crc32(index):08x}")}
        atomic_write_text(self.sums_path, json.dumps(sums))


def file_checksum(path: str | Path, chunk: int = 1 << 22) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of a file, read in ``chunk``-byte pieces."""
    crc, size, buf = 0, 0, bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def finalize(partial_dir: Path, final_dir: Path, manifest: dict) -> None:
    """Check the shards cover every expected sentence once, write the manifest (with every file's size and
    CRC-32 from the shard writers), rename into place."""
    shards = sorted(p.name for p in partial_dir.glob("maps-r*.f16"))
    seen = np.concatenate([np.load(partial_dir / index_name(s))[:, 0]
                           for s in shards]) if shards else np.zeros(0, dtype=np.int64)
    expected = set(range(manifest["n_sentences"])) - set(manifest["skipped"])
    if len(seen) != len(set(seen.tolist())) or set(seen.tolist()) != expected:
        raise RuntimeError(f"cache shards in {partial_dir} do not cover each sentence exactly once")
    checksums = {}
    for sums in sorted(partial_dir.glob("checksums-r*.json")):
        checksums.update(json.loads(sums.read_text()))
    for name in [n for s in shards for n in (s, index_name(s))]:
        if name not in checksums:  # a writer that kept no checksum: hash the file as it is now
            size, crc = file_checksum(partial_dir / name)
            checksums[name] = dict(bytes=size, crc32=crc)
        if (partial_dir / name).stat().st_size != checksums[name]["bytes"]:
            raise RuntimeError(f"{partial_dir / name}: {(partial_dir / name).stat().st_size} bytes on disk, "
                               f"its writer wrote {checksums[name]['bytes']}")
    manifest = dict(manifest, shards=shards, bytes=sum((partial_dir / s).stat().st_size for s in shards),
                    checksums={n: checksums[n] for n in sorted(checksums)})
    manifest.setdefault("command", build_command(manifest.get("key", {})))
    atomic_write_text(partial_dir / "manifest.json", json.dumps(manifest, indent=1))
    for sums in partial_dir.glob("checksums-r*.json"):
        sums.unlink()
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(partial_dir, final_dir)
    _VERIFIED.add(_identity(final_dir))  # its bytes were hashed as they were written


# ----------------------------------------------------------------------------- integrity
COMMAND_ENV = "PROBES_EXTRACT_COMMAND"  # set by the runner for its child: the command of the process that asked

_VERIFIED: set[tuple] = set()  # (entry, manifest inode, mtime) verified in this process


class CacheDamaged(RuntimeError):
    """A complete cache entry whose files are not those its manifest lists (missing, truncated, other bytes).

    ``entry``: the entry folder; ``file``: the damaged file; the message says how to rebuild the entry."""

    def __init__(self, entry: Path, file: str, problem: str, command: str):
        self.entry, self.file = Path(entry), file
        super().__init__(f"damaged cache entry {entry}: {file} {problem}. Delete the entry and rebuild it:\n"
                         f"  rm -r {shlex.quote(str(entry))}\n  {command}")


def build_command(key: dict) -> str:
    """The command that (re)builds an entry: the one that asked for it (``$PROBES_EXTRACT_COMMAND`` in the
    runner's child), else this process's command line; ``train.py`` overrides become ``python -m probes.extract``
    with the same overrides (same config) and the entry's split."""
    env = os.environ.get(COMMAND_ENV)
    if env:
        return env
    argv = list(sys.argv) or ["python"]
    script = Path(argv[0])
    if script.name == "train.py" or script.parts[-3:] == ("probes", "extract", "__main__.py"):
        args = [a for a in argv[1:] if not a.startswith("-") and not a.startswith("splits=")]
        split = key.get("split")
        return shlex.join(["python", "-m", "probes.extract", *args, *([f"splits=[{split}]"] if split else [])])
    if script.suffix == ".py" and "probes" in script.parts:  # a module of the package run with -m
        parts = script.with_suffix("").parts
        mod = ".".join(parts[len(parts) - 1 - parts[::-1].index("probes"):]).removesuffix(".__main__")
        return shlex.join(["python", "-m", mod, *argv[1:]])
    return shlex.join(["python", *argv])


def _identity(path: Path) -> tuple:
    st = (Path(path) / "manifest.json").stat()
    return str(Path(path).resolve()), st.st_ino, st.st_mtime_ns


def verify(path: str | Path, manifest: dict | None = None, force: bool = False) -> bool:
    """Check the files of the complete entry at ``path`` against its manifest's sizes and CRC-32s, once per
    process (``force``: again). True when verified; :class:`CacheDamaged` when a file is missing, has another
    size or other bytes, or when the manifest is unreadable or lists no checksums."""
    path = Path(path)
    ident = _identity(path)
    if ident in _VERIFIED and not force:
        return True
    if manifest is None:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except ValueError as e:
            raise CacheDamaged(path, "manifest.json", f"is not valid JSON ({e})",
                               "rerun the command that built it (missing entries are rebuilt)") from None
    command = manifest.get("command") or build_command(manifest.get("key", {}))
    sums = manifest.get("checksums")
    if sums is None:
        raise CacheDamaged(path, "manifest.json", "lists no checksums", command)
    for shard in manifest["shards"]:
        for name in (shard, index_name(shard)):
            if name not in sums:
                raise CacheDamaged(path, name, "has no checksum in manifest.json", command)
    for name, want in sums.items():
        f = path / name
        if not f.is_file():
            raise CacheDamaged(path, name, "is missing", command)
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CacheDamaged(path, name, f"has {size} bytes, {want['bytes']} were written (truncated?)"
                               if size < want["bytes"] else f"has {size} bytes, {want['bytes']} were written",
                               command)
        _, crc = file_checksum(f)
        if crc != want["crc32"]:
            raise CacheDamaged(path, name, f"has other bytes than were written (CRC-32 {crc}, written {want['crc32']})",
                               command)
    _VERIFIED.add(ident)
    return True


def set_aside(path: str | Path, reason: str = "") -> Path:
    """Rename the entry ``path`` to ``<path>.damaged-<UTC time>`` (kept for inspection, not found by key, so
    rebuilt by the next run that needs it); logged. Returns the new path."""
    path = Path(path)
    dest = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
    os.replace(path, dest)
    log.warning("moved damaged cache entry %s aside to %s; it will be rebuilt%s", path, dest,
                f" ({reason})" if reason else "")
    return dest


class CacheEntry:
    """Read-only view of a complete cache entry of any kind: its manifest (format checked), each sentence's
    shard, offset and size from the shards' indexes, blocks read lazily with ``os.pread``. The entry's files are
    checked against its manifest's checksums when it is first opened in a process (:func:`verify`;
    :class:`CacheDamaged`). A subclass says what a sentence's block is (:class:`AttentionCache`,
    :class:`probes.extract.representations.RepresentationCache`).
    """

    what = "cache"  # in errors: the kind of entry

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fds: list[int] | None = None  # opened on first access in each process
        manifest = self.path / "manifest.json"
        if not is_complete(self.path):
            raise FileNotFoundError(f"no complete {self.what} cache at {self.path} (missing manifest.json)")
        try:
            self.manifest = json.loads(manifest.read_text())
        except ValueError as e:
            raise CacheDamaged(self.path, "manifest.json", f"is not valid JSON ({e})",
                               "rerun the command that built it (missing entries are rebuilt)") from None
        verify(self.path, self.manifest)
        if self.manifest["format_version"] != FORMAT_VERSION:
            raise ValueError(f"{manifest}: cache format {self.manifest['format_version']}, expected {FORMAT_VERSION}")
        n = self.manifest["n_sentences"]
        self._where = np.full((n, 3), -1, dtype=np.int64)  # (N, 3): shard, element offset, size (index column 2)
        for s, shard in enumerate(self.manifest["shards"]):
            idx = np.load(self.path / index_name(shard))
            self._where[idx[:, 0], 0] = s
            self._where[idx[:, 0], 1:] = idx[:, 1:]

    def __len__(self) -> int:
        return len(self._where)

    @property
    def skipped(self) -> list[int]:
        return self.manifest["skipped"]

    def __contains__(self, i: int) -> bool:
        return self._where[i, 0] >= 0

    def _locate(self, i: int) -> tuple[int, int, int]:
        """(shard, element offset, size: the index's third column) of sentence ``i``; KeyError when skipped."""
        shard, offset, size = (int(v) for v in self._where[i])
        if shard < 0:
            raise KeyError(f"sentence {i} is not in cache {self.path} (skipped: longer than the encoder's maximum)")
        return shard, offset, size

    def _read(self, i: int, shard: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """The float16 block of ``shape`` at element ``offset`` of ``shard`` (sentence ``i``, for errors), copied
        from disk into a writable buffer (``os.preadv``, not a memory map, so pages of a cache larger than memory
        never accumulate in the reading process); :class:`CacheDamaged` when the shard ends early."""
        out = np.empty(shape, dtype=np.float16)  # writable, not zeroed: it can go to torch without a copy
        nbytes = out.nbytes
        if os.preadv(self._fd(shard), [out], 2 * offset) != nbytes:
            raise self._truncated(i, shard)
        return out

    def _take(self, i: int, shard: int, offset: int, shape: tuple[int, ...], index: np.ndarray, axis: int,
              out: np.ndarray) -> np.ndarray:
        """``np.take(block, index, axis)`` written into ``out`` (float16, any strides; the indices checked by the
        caller; gathered contiguous, then copied: cheaper than ``np.take(out=)``, which copies a strided ``out`` in
        and back out) of the block of ``shape`` at element ``offset`` of ``shard`` (sentence ``i``, for errors),
        touching only the pages that hold the taken elements: the block is memory-mapped and the map closed before
        returning (its pages never stay mapped in the reading process; a complete entry's files are never written
        again, so the map cannot shrink under the reader); :class:`CacheDamaged` when the shard ends early. On a
        2-vCPU AMD EPYC Zen 4, coref_heads' 2,240 mention rows of 47 GUM dev segments of MiniLM (1.04 GB of maps in
        the page cache): 0.05-0.13 CPU-s against 0.14-0.19 for reading the whole maps, both varying with the
        machine's state."""
        fd = self._fd(shard)
        start, nbytes = 2 * offset, 2 * math.prod(shape)
        if os.fstat(fd).st_size < start + nbytes:
            raise self._truncated(i, shard)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fd, start + nbytes - base, prot=mmap.PROT_READ, offset=base)
        try:  # the view is a temporary of this one expression: no buffer of the map outlives it
            out[...] = np.frombuffer(m, np.float16, math.prod(shape), start - base).reshape(shape).take(index, axis)
        finally:
            m.close()
        return out

    def _truncated(self, i: int, shard: int) -> CacheDamaged:
        """The error of a shard that ends before sentence ``i``'s block does."""
        return CacheDamaged(self.path, self.manifest["shards"][shard], f"is truncated at sentence {i}",
                            self.manifest.get("command") or build_command(self.manifest.get("key", {})))

    def _fd(self, shard: int) -> int:
        if self._fds is None:
            self._fds = [os.open(self.path / s, os.O_RDONLY) for s in self.manifest["shards"]]
        return self._fds[shard]

    def __getstate__(self):
        return dict(self.__dict__, _fds=None)

    def __del__(self):
        for fd in getattr(self, "_fds", None) or []:
            os.close(fd)


class AttentionCache(CacheEntry):
    """An entry of word-level maps (any map kind): sentence i with n words is (L, H, W, W), W = n + 2; or an entry
    of chosen rows of them (:mod:`probes.extract.rows`: the manifest's ``rows``, sentence i's (R_i, L, H, W) block),
    read by :meth:`rows` only."""

    what = "attention"

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.num_layers = self.manifest["num_layers"]  # L of the stored maps: len(layers)
        self.num_heads = self.manifest["num_heads"]
        self.layers: list[int] = list(self.manifest["layers"])  # the model's 0-based layer of each stored one
        kept = self.manifest.get("rows")  # an entry of chosen rows: each sentence's, increasing; None: whole maps
        self.kept_rows: list[np.ndarray] | None = (None if kept is None else
                                                   [np.asarray(r, dtype=np.intp) for r in kept])

    def __getitem__(self, i: int) -> np.ndarray:
        """(L, H, W, W) float16 maps of sentence i, read from disk on each call; a ValueError for an entry of chosen
        rows (read with :meth:`rows`)."""
        if self.kept_rows is not None:
            raise ValueError(f"cache {self.path} keeps chosen rows of each sentence's maps only (its manifest's "
                             f"rows): read them with rows(i, rows), not whole maps")
        shard, offset, side = self._locate(i)
        return self._read(i, shard, offset, (self.num_layers, self.num_heads, side, side))

    def side(self, i: int) -> int:
        """W of sentence i's maps (its words + 2), without reading them; KeyError when skipped."""
        return self._locate(i)[2]

    def rows(self, i: int, rows: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """(R, L, H, W) float16: the rows ``rows`` (positions 0..W-1 of the word map, [CLS] at 0; any order,
        repeats allowed) of sentence i's maps, every layer and head, reading only the pages that hold them
        (:meth:`CacheEntry._take`; an entry of chosen rows: its block of them), written into ``out`` when given (an
        (R, L, H, W) float16 array, any strides: e.g. part of a padded batch); an IndexError names a row outside
        0..W-1, or one an entry of chosen rows does not keep."""
        shard, offset, side = self._locate(i)
        r = np.asarray(rows, dtype=np.intp).reshape(-1)  # (R,)
        if r.size and (r.min() < 0 or r.max() >= side):
            bad = int(r[(r < 0) | (r >= side)][0])
            raise IndexError(f"cache {self.path}: sentence {i} has word maps of side {side}, no row {bad}")
        L, H = self.num_layers, self.num_heads
        if out is None:
            out = np.empty((len(r), L, H, side), dtype=np.float16)  # (R, L, H, W)
        elif out.shape != (len(r), L, H, side) or out.dtype != np.float16:
            raise ValueError(f"out: {out.dtype} {out.shape}, expected float16 {(len(r), L, H, side)}")
        if self.kept_rows is None:
            self._take(i, shard, offset, (L, H, side, side), r, 2, out.transpose(1, 2, 0, 3))  # into (L, H, R, W)
            return out
        kept = self.kept_rows[i]  # (R_i,) increasing
        at = np.searchsorted(kept, r)  # (R,) each row's place among the kept ones
        held = at < len(kept)
        held[held] = kept[at[held]] == r[held]
        if not held.all():
            raise IndexError(f"cache {self.path}: sentence {i} keeps rows {kept.tolist()} of its maps only, not row "
                             f"{int(r[~held][0])}")
        block = self._read(i, shard, offset, (len(kept), L, H, side))  # (R_i, L, H, W): the whole small block
        out[...] = block if np.array_equal(at, np.arange(len(kept))) else block[at]  # (R, L, H, W)
        return out
