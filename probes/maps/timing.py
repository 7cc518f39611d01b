"""Where an extraction's time goes: CPU and wall seconds per named stage (tokenizing, batching, forward, pooling,
device->host copies, writing), recorded only inside :func:`measuring`.

The engine, its batches and the cache writer wrap their stages in :func:`stage`; outside :func:`measuring` that is a
flag check. Inside, each stage's thread CPU time (``time.thread_time``: what other processes on the machine change
least) and wall time are added to the active :class:`StageTimes`, from whichever thread runs it (the batch
prefetcher's and the background writer's included); while a ``torch.profiler`` is recording, each stage is also a
``stage:<name>`` range, so the profiler's operators can be grouped by the stage they ran in (:func:`op_groups`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

STAGE_PREFIX = "stage:"

# operators whose work is a matrix product (the model's projections, attention scores and A @ V, word pooling)
MATMUL_OPS = frozenset({"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                        "aten::_addmm_activation", "aten::mkldnn_linear", "mkldnn::_linear_pointwise",
                        "aten::linear", "aten::matmul"})
SOFTMAX_OPS = frozenset({"aten::exp", "aten::exp_", "aten::exp2", "aten::exp2_"})  # besides every *softmax* operator


class StageTimes:
    """CPU seconds, wall seconds and calls per stage, added from any thread."""

    def __init__(self):
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.threads: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def add(self, name: str, cpu: float, wall: float) -> None:
        """Add one call of stage ``name`` (``cpu``, ``wall`` seconds) run by the calling thread."""
        with self._lock:
            self.cpu[name] += cpu
            self.wall[name] += wall
            self.calls[name] += 1
            self.threads[name].add(threading.current_thread().name)

    def as_dict(self) -> dict[str, dict]:
        """``{stage: {cpu_s, wall_s, calls, threads}}``."""
        with self._lock:
            return {k: dict(cpu_s=self.cpu[k], wall_s=self.wall[k], calls=self.calls[k],
                            threads=sorted(self.threads[k])) for k in self.cpu}


_ACTIVE: list[StageTimes] = []  # the recorders of the open measuring() blocks (the innermost records)


@contextlib.contextmanager
def measuring() -> Iterator[StageTimes]:
    """Record every :func:`stage` of this process (all threads) until the block ends; yields the record."""
    times = StageTimes()
    _ACTIVE.append(times)
    try:
        yield times
    finally:
        _ACTIVE.remove(times)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as stage ``name`` while :func:`measuring` is open (a ``stage:<name>`` profiler range while a
    profiler records); otherwise nothing."""
    if not _ACTIVE:
        yield
        return
    times = _ACTIVE[-1]
    ranged = torch.autograd.profiler.record_function(STAGE_PREFIX + name) \
        if torch.autograd._profiler_enabled() else contextlib.nullcontext()
    c0, t0 = time.thread_time(), time.perf_counter()
    try:
        with ranged:
            yield
    finally:
        times.add(name, time.thread_time() - c0, time.perf_counter() - t0)


def op_group(name: str) -> str:
    """``matmul``, ``softmax`` or ``other`` for a profiler operator name."""
    if name in MATMUL_OPS:
        return "matmul"
    if "softmax" in name or name in SOFTMAX_OPS:
        return "softmax"
    return "other"


def op_groups(events: Iterable) -> dict[str, dict[str, float]]:
    """Self time (seconds) of the profiler's operators per stage and group.

    Args:
        events: ``profiler.events()`` (``FunctionEvent``s with ``cpu_parent``) of a run inside :func:`measuring`.

    Returns:
        ``{stage: {"matmul": s, "softmax": s, "other": s, "range": s}}``: each operator's self CPU time under the
        innermost ``stage:`` range around it, by :func:`op_group`; ``range`` is the ranges' own length (so
        ``range`` less the operators' sum is Python and dispatch between operators).
    """
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict(matmul=0.0, softmax=0.0, other=0.0, range=0.0))
    for ev in events:
        if ev.name.startswith(STAGE_PREFIX):
            out[ev.name[len(STAGE_PREFIX):]]["range"] += ev.cpu_time_total / 1e6
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(STAGE_PREFIX):
            parent = parent.cpu_parent
        if parent is None:
            continue
        out[parent.name[len(STAGE_PREFIX):]][op_group(ev.name)] += ev.self_cpu_time_total / 1e6
    return {k: dict(v) for k, v in out.items()}
