"""Process memory settings for training on memory-mapped caches."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def set_mmap_threshold(nbytes: int | None) -> bool:
    """Serve allocations of at least `nbytes` by mmap and give them back to the OS on free (glibc).

    glibc raises its mmap threshold each time a large block is freed, after which batch-sized buffers
    come from the heap and are kept there: a training process grows by the largest batches it has
    seen. A fixed threshold turns that off. Returns False where there is no glibc (or `nbytes` is None).
    """
    if nbytes is None:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        ok = bool(libc and libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        ok = False
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
