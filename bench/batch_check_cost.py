"""What the non-finite input check costs a training epoch, side by side: the old per-batch check against the new
one, and no check at all.

Trains the probe of ``experiment=smoke`` (UD EWT, default encoder) for ``--epochs`` epochs three ways,
interleaved ``--repeats`` times (old, new, none, then new, none, old, ...: each round in an order rotated
from the last):

- *old*: ``ProbeModule.check_batch`` scans every floating-point tensor of each batch in the training process (one
  torch sum per tensor: the collated features hold every map value twice, plus padding);
- *new*: the dependency dataset counts each sentence's non-finite values as it reads it (``count_nonfinite``: one
  numpy sum of the float32 copy it makes anyway, in the loader's worker when ``data.num_workers`` > 0) and
  ``check_batch`` reads the batch's ``nonfinite`` counts;
- *none*: neither.

Prints each side's fastest epoch and its least-CPU epoch (the training process's CPU time, which other
processes change less than wall time), the ratios to *none* and the time spent inside the check in this process. A
script, not a test:

    PROBES_DATA_DIR=../shared/data python bench/batch_check_cost.py [--repeats 3] [--epochs 2] [overrides ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import pytorch_lightning as pl
from hydra.utils import instantiate

import probes.dependency.datamodule as D
from probes.config import compose
from probes.training.module import ProbeModule

CHECK, COUNT = ProbeModule.check_batch, D.count_nonfinite
SIDES = ("old", "new", "none")


class EpochTimer(pl.Callback):
    """Wall time and this process's CPU time (all its threads; not the loader's workers) of every training epoch
    (validation excluded)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.t1, self.c1 = time.perf_counter(), time.process_time()

    def on_train_epoch_end(self, trainer, pl_module):
        self.times.append(self.t1 - self.t0)
        self.cpu.append(self.c1 - self.c0)


def timed(fn, spent: list[float]):
    """``fn`` adding its time to ``spent`` (in the process that calls it)."""
    def run(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        spent.append(time.perf_counter() - t0)
        return out
    return run


def old_check(self, batch, batch_idx, split):
    """The check before the dataset counted: every floating-point tensor of the batch scanned here."""
    CHECK(self, {k: v for k, v in batch.items() if k != "nonfinite"}, batch_idx, split)


def run(cfg, side: str, checks: list[float], counts: list[float]) -> EpochTimer:
    """Fit ``cfg``'s probe with the ``side`` check; the epochs' times (``checks``, ``counts``: time inside
    ``check_batch`` and inside the dataset's count, where it runs in this process)."""
    ProbeModule.check_batch = {"old": timed(old_check, checks), "new": timed(CHECK, checks),
                               "none": lambda self, batch, batch_idx, split: None}[side]
    D.count_nonfinite = timed(COUNT, counts) if side == "new" else (lambda values: 0)
    try:
        pl.seed_everything(cfg.seed, workers=True)
        dm = instantiate(cfg.data)
        dm.prepare_data()
        model = instantiate(cfg.probe)
        model.build(dm)
        timer = EpochTimer()
        trainer = instantiate(cfg.trainer, callbacks=[timer], logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(model, datamodule=dm)
        return timer
    finally:
        ProbeModule.check_batch, D.count_nonfinite = CHECK, COUNT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="train.yaml overrides (default: experiment=smoke)")
    args = ap.parse_args()
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    cfg = compose("train", ["experiment=smoke", "logger=none", "paths.output_dir=/tmp/batch-check-bench",
                            f"trainer.max_epochs={args.epochs}", *args.overrides])
    times = {s: [] for s in SIDES}
    cpu = {s: [] for s in SIDES}
    checks = {s: [] for s in SIDES}
    counts: list[float] = []
    for r in range(args.repeats):
        for side in SIDES[r % 3:] + SIDES[:r % 3]:  # the order rotated from round to round
            timer = run(cfg, side, checks[side], counts)
            times[side] += timer.times
            cpu[side] += timer.cpu
        print(f"  round {r + 1}: " + ", ".join(f"{s} {min(times[s][-args.epochs:]):.3f} s" for s in SIDES)
              + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    batches = len(checks["old"]) // (args.repeats * args.epochs)
    print(f"CPU: {os.cpu_count()} cores; {batches} training batches per epoch; data.num_workers="
          f"{cfg.data.num_workers}; data: {os.environ.get('PROBES_DATA_DIR')}; overrides: experiment=smoke "
          f"{' '.join(args.overrides)}; load average {os.getloadavg()[0]:.2f}")
    best = {s: min(times[s]) for s in SIDES}
    least = {s: min(cpu[s]) for s in SIDES}
    for s in SIDES:
        inside = sum(checks[s]) / (args.repeats * args.epochs)
        print(f"{s:>4}: fastest epoch {best[s]:.3f} s (of {len(times[s])}), {best[s] / best['none']:.3f}x none; "
              f"least CPU {least[s]:.3f} s (training process), {least[s] / least['none']:.3f}x none; "
              f"check_batch {1e3 * inside:.1f} ms per epoch ({1e3 * inside / max(batches, 1):.3f} ms per batch)")
    if counts:
        per_epoch = sum(counts) / (args.repeats * args.epochs)
        print(f"new: the dataset's count in this process {1e3 * per_epoch:.1f} ms per epoch "
              f"({1e6 * sum(counts) / len(counts):.1f} us per sentence)")
    else:
        print("new: the dataset's count ran in the loader's worker (not timed here)")
    print(f"old / new: {best['old'] / best['new']:.3f}")


if __name__ == "__main__":
    main()
