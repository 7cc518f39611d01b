"""A callback for tests/test_resume.py: a real ``kill -9`` of the training process right after an epoch's
checkpoints are written (listed after them, it runs after them)."""

from __future__ import annotations

import os
import signal

from pytorch_lightning.callbacks import Checkpoint

KILL_ENV = "PROBES_TEST_KILL_AFTER_EPOCH"


class KillAfterEpoch(Checkpoint):
    """SIGKILL this process at the end of the training epoch named by ``$PROBES_TEST_KILL_AFTER_EPOCH``
    (0-based; unset: never), after the checkpoint callbacks listed before it."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if os.environ.get(KILL_ENV) == str(trainer.current_epoch):
            os.kill(os.getpid(), signal.SIGKILL)
