"""Callbacks: test-split predictions written as CoNLL-U."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch.distributed as dist

from probes.data.conllu import write_conllu_with_heads


class ConlluPredictionWriter(pl.Callback):
    """Collects test predictions and writes `<dirpath>/test.conllu` with column 7 = predicted head."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.preds: dict[int, list[int]] = {}

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.preds = {}

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        for i, p, n in zip(outputs["index"].tolist(), outputs["pred"].tolist(), outputs["lengths"].tolist()):
            self.preds[i] = p[:n]

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if trainer.world_size > 1:  # DDP: each rank scored its own sentences; rank 0 writes them all
            parts = [None] * trainer.world_size
            dist.all_gather_object(parts, self.preds)
            self.preds = {i: p for part in parts for i, p in part.items()}
        if not trainer.is_global_zero:
            return
        sentences = trainer.datamodule.sentences("test")
        kept = [i for i in range(len(sentences)) if i in self.preds]  # too-long sentences are not scored
        path = write_conllu_with_heads([sentences[i] for i in kept], [self.preds[i] for i in kept],
                                       self.dirpath / "test.conllu")
        pl_module.print(f"test predictions: {path} ({len(kept)} sentences)")
