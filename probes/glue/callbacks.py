"""Lightning callbacks for GLUE fine-tuning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytorch_lightning as pl
import torch

log = logging.getLogger(__name__)


class HFExport(pl.Callback):
    """At the end of fit, save the best checkpoint's weights (or the final ones when there is no
    checkpoint) as a Hugging Face `*ForSequenceClassification` folder via `SequenceClassifier.export_hf`."""

    def __init__(self, dirpath: str, use_best: bool = True):
        self.dirpath, self.use_best = Path(dirpath), use_best

    def on_fit_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return
        state = None
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if self.use_best and ckpt:
            state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
            log.info("exporting the best checkpoint %s", ckpt)
        pl_module.export_hf(self.dirpath, state_dict=state)


class ProgressLog(pl.Callback):
    """Plain log lines (`<run dir>/train.log`) every `every_n_steps` training steps and after each
    validation: step/total, epoch, loss, elapsed and estimated remaining time. The progress bar
    stays on; this is for runs whose output goes to a file."""

    def __init__(self, every_n_steps: int = 20):
        self.every = max(1, int(every_n_steps))
        self.t0 = None

    def on_train_start(self, trainer, pl_module) -> None:
        import time

        self.t0 = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        step = trainer.global_step
        if step % self.every or self.t0 is None:
            return
        total = int(trainer.estimated_stepping_batches)
        el = time.time() - self.t0
        loss = trainer.callback_metrics.get("train/loss_step")
        log.info("step %d/%d (epoch %d) loss %s, %.0fs elapsed, ~%.0fs left", step, total, trainer.current_epoch,
                 f"{float(loss):.4f}" if loss is not None else "-", el, el / max(step, 1) * (total - step))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        vals = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        log.info("epoch %d validation: %s", trainer.current_epoch, vals)
