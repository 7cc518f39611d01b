"""Batches for analyses of fine-tuned GLUE models: length-sorted, padded dev batches and the model inputs."""

from __future__ import annotations

import torch

from probes.data.glue import GlueExample, task_spec
from probes.glue.datamodule import Collator, tokenize


def make_batches(tokenizer, examples: list[GlueExample], task: str, max_length: int = 128,
                 batch_size: int = 64) -> list[dict[str, torch.Tensor]]:
    """Padded batches in order of length (little padding); each carries `labels` and `idx`."""
    regression = task_spec(task).num_labels == 1
    feats = tokenize(tokenizer, examples, max_length, regression)
    feats.sort(key=lambda f: len(f["input_ids"]))
    collate = Collator(tokenizer.pad_token_id, regression)
    return [collate(feats[i:i + batch_size]) for i in range(0, len(feats), batch_size)]


MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")  # the batch keys a model takes

