"""``attention``: the attention probabilities themselves, per head (the cache's original maps)."""

from __future__ import annotations

import torch

from probes.measures import Measure
from probes.model import hooks


class Attention(Measure):
    """alpha^{l,h}_{ij}: softmax attention of every head, (B, H, T, T) per layer; the forward stops after the
    last layer's attention."""

    per_head = True

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        L = len(hooks.attention_sites(model))
        with hooks.attention(model, layers=range(L), stop=True) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask)
            return [s.probs[l] for l in range(L)]
