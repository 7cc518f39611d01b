"""Process memory settings: glibc malloc thresholds for training on memory-mapped caches and for the extraction
stages, Python's garbage collector paused over bursts of small objects, the peak RSS a job reports, and the peak of a
process's own (anonymous) memory that benchmarks report."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import resource
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
# glibc's own ceiling for its dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) and the trim
# threshold it pairs with it (twice): what a process that never fixed them reaches (glibc cannot go back to
# its dynamic mode once they are fixed); and its default trim threshold, which a fixed mmap threshold keeps
DYNAMIC_MMAP_MAX, DYNAMIC_TRIM_MAX, DEFAULT_TRIM = 32 << 20, 64 << 20, 128 << 10
_fixed: dict[int, int] = {}  # the values this process fixed through this module (glibc cannot be asked)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with ``mallopt`` (glibc), found once per process (``find_library`` runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    ok = bool(libc and libc.mallopt(param, int(value)))
    if ok:
        _fixed[param] = int(value)
    return ok


@contextlib.contextmanager
def reusable_heap(nbytes: int = 64 << 20) -> Iterator[bool]:
    """Inside the block, freed buffers of up to ``nbytes`` stay in this process's heap for the next allocation
    (glibc: mmap and trim thresholds raised); on exit the thresholds fixed before (:func:`set_mmap_threshold`)
    are put back, or glibc's dynamic ceilings where none were (glibc then trims the heap's free top down to
    the restored trim threshold at the next free). Yields whether it applied (False without glibc).

    For the frozen-model stages, which allocate and free the same batch-sized buffers at every batch: served
    by fresh mmaps (a fixed low threshold such as train.py's ``malloc_mmap_threshold``, in force when the
    caches are built in the training process, ``data.extract_in_child=false``) or from a heap trimmed after
    each batch, every batch faults its pages in again. On 1,000 EWT sentences through MiniLM (one thread,
    AMD EPYC Zen 4) an extraction under the 256 KiB threshold took 0.66 million page faults and 1.2 s of
    kernel time at bf16 (1.25 million and 2.1 s at 32-true); inside this block 25-33 thousand and 0.06-0.08 s
    (bench/README.md)."""
    libc = _libc()
    if libc is None:
        yield False
        return
    before = dict(_fixed)
    ok = _mallopt(M_MMAP_THRESHOLD, nbytes) and _mallopt(M_TRIM_THRESHOLD, 4 * nbytes)
    try:
        yield ok
    finally:
        _mallopt(M_MMAP_THRESHOLD, before.get(M_MMAP_THRESHOLD, DYNAMIC_MMAP_MAX))
        _mallopt(M_TRIM_THRESHOLD, before.get(M_TRIM_THRESHOLD, DEFAULT_TRIM if M_MMAP_THRESHOLD in before
                                              else DYNAMIC_TRIM_MAX))
        for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
            if param not in before:
                _fixed.pop(param, None)  # the ceilings stand in for glibc's own mode: nothing fixed by a caller


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside (restored after, if it was on): a burst of short-lived small objects
    (tokenizing a split, planning an analysis's examples) is freed by reference counting before any collection
    sees it, instead of triggering collections of the oldest generation, each of which scans every object of the
    process (about 0.07 s with MiniLM loaded: 610,000 objects)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def set_mmap_threshold(nbytes: int | None) -> bool:
    """Serve allocations of at least `nbytes` by mmap and give them back to the OS on free (glibc).

    glibc raises its mmap threshold each time a large block is freed, after which batch-sized buffers
    come from the heap and are kept there: a training process grows by the largest batches it has
    seen. A fixed threshold turns that off. Returns False where there is no glibc (or `nbytes` is None).
    """
    if nbytes is None:
        return False
    ok = _mallopt(M_MMAP_THRESHOLD, nbytes)
    log.log(logging.INFO if ok else logging.WARNING, "malloc mmap threshold %s: %d bytes",
            "set" if ok else "could not be set (not glibc)", nbytes)
    return ok


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS count (Linux `clear_refs` 5), so each job of a multirun reports its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set size in MiB since the last `reset_peak_rss` (VmHWM), else since process start."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AnonPeak:
    """The high-water mark of the process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``,
    sampled every 10 ms in a daemon thread from construction on), MiB: the memory the process holds itself.
    ``ru_maxrss`` also counts the file pages of memory-mapped weights (a safetensors folder is read in place),
    which the kernel can drop and read again."""

    def __init__(self):
        self.peak = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> float:
        """RssAnon now, MiB (NaN where /proc/self/status has none)."""
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def read(self) -> float:
        """The peak so far, MiB."""
        self.peak = max(self.peak, self.now())
        return self.peak

    def close(self) -> None:
        """Stop sampling (the peak read so far stays)."""
        self._stop.set()
