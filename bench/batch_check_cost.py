"""What the non-finite input check (``ProbeModule.check_batch``) costs a training epoch, side by side.

Trains the probe of ``experiment=smoke`` (UD EWT, default encoder) for ``--epochs`` epochs with the check and
with it switched off, interleaved (on, off, on, off, ...) ``--repeats`` times; prints each side's fastest
epoch, their ratio and the time spent inside the check itself. A script, not a test:

    PROBES_DATA_DIR=../shared/data python bench/batch_check_cost.py [--repeats 3] [--epochs 2] [overrides ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import pytorch_lightning as pl
from hydra.utils import instantiate

from probes.config import compose
from probes.training.module import ProbeModule

ORIGINAL = ProbeModule.check_batch


class EpochTimer(pl.Callback):
    """Wall time of every training epoch (validation excluded)."""

    def __init__(self):
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.t1 = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self.times.append(self.t1 - self.t0)


def run(cfg, check: bool, spent: list[float]) -> list[float]:
    """Fit ``cfg``'s probe with the check on or off; the epochs' times."""
    def timed(self, batch, batch_idx, split):
        t0 = time.perf_counter()
        ORIGINAL(self, batch, batch_idx, split)
        spent.append(time.perf_counter() - t0)
    ProbeModule.check_batch = timed if check else (lambda self, batch, batch_idx, split: None)
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
        return timer.times
    finally:
        ProbeModule.check_batch = ORIGINAL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="train.yaml overrides (default: experiment=smoke)")
    args = ap.parse_args()
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    cfg = compose("train", ["experiment=smoke", "logger=none", "paths.output_dir=/tmp/batch-check-bench",
                            f"trainer.max_epochs={args.epochs}", *args.overrides])
    on, off, spent = [], [], []
    for _ in range(args.repeats):
        on += run(cfg, True, spent)
        off += run(cfg, False, [])
    batches = len(spent) // (args.repeats * args.epochs)
    print(f"CPU: {os.cpu_count()} cores; {batches} training batches per epoch; data: "
          f"{os.environ.get('PROBES_DATA_DIR')}; overrides: experiment=smoke {' '.join(args.overrides)}")
    print(f"epoch with the check   : {min(on):.3f} s (fastest of {len(on)})")
    print(f"epoch without the check: {min(off):.3f} s (fastest of {len(off)})")
    print(f"ratio with / without   : {min(on) / min(off):.3f}")
    per_epoch = sum(spent) / (args.repeats * args.epochs)
    print(f"time inside the check  : {per_epoch:.4f} s per epoch = {100 * per_epoch / min(on):.2f}% of the fastest "
          f"epoch ({1e3 * sum(spent) / len(spent):.3f} ms per batch)")


if __name__ == "__main__":
    main()
