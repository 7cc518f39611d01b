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
