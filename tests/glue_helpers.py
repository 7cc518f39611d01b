"""Helpers of the GLUE tests: a fine-tuned model's logits over padded batches."""

from __future__ import annotations

import torch

from probes.glue.evaluate import MODEL_KEYS
from probes.model.structure import model_inputs


@torch.inference_mode()
def logits_and_labels(model, batches, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(N, num_labels) logits of a *ForSequenceClassification model and (N,) labels, in batch order."""
    outs, labels = [], []
    for b in batches:
        out = model(**model_inputs(model, **{k: b[k].to(device) for k in MODEL_KEYS if k in b}))
        outs.append(out.logits.float().cpu())
        labels.append(b["labels"])
    return torch.cat(outs), torch.cat(labels)
