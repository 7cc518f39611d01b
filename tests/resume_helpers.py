"""Helpers of the tests that resume runs (tests/test_resume.py, test_run_record.py, test_checkpoint_safety.py): a
callback making a real ``kill -9`` of the training process right after an epoch's checkpoints are written (listed
after them, it runs after them), and ``python train.py`` in a subprocess. The training process imports this
module for the callback (also docs/results/resume/run.sh): it imports nothing of the tests' own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pytorch_lightning.callbacks import Checkpoint

KILL_ENV = "PROBES_TEST_KILL_AFTER_EPOCH"
ROOT = Path(__file__).resolve().parents[1]  # the repository


class KillAfterEpoch(Checkpoint):
    """SIGKILL this process at the end of the training epoch named by ``$PROBES_TEST_KILL_AFTER_EPOCH``
    (0-based; unset: never), after the checkpoint callbacks listed before it."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if os.environ.get(KILL_ENV) == str(trainer.current_epoch):
            os.kill(os.getpid(), signal.SIGKILL)


def run_train(args: list[str], kill_after: int | None = None) -> subprocess.CompletedProcess:
    """``python train.py <args>`` in the repository (wandb offline); ``kill_after``: the epoch after which
    :class:`KillAfterEpoch` (if the run lists it) kills the process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    env.pop(KILL_ENV, None)
    if kill_after is not None:
        env[KILL_ENV] = str(kill_after)
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)

