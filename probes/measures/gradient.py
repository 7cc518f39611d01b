"""``grad_attribution``: gradient attribution of every head's output to the input tokens, as maps (per head).

The attribution Pascual et al.'s analysis computes (:func:`probes.measures.gradflow.head_attributions`):
for head h of layer l and position i, the scalar ``sum_k o^{l,h}_i[k]`` of the head's output (A V before
the output projection) attributed to the input word embeddings by gradient x input (``method=ixg``) or
integrated gradients (``ig``, ``ig_steps`` Riemann-midpoint points, zero baseline); ``|attr|`` summed over
the embedding dimension and normalised to sum 1 over the input tokens j. Each sentence alone (no
padding); gradients are enabled inside the extraction's inference mode. Cost: per layer one forward
(``ig``: on the ``ig_steps`` points as one batch) and one vmapped VJP over the H * n targets of a
sentence of n pieces (``ig``: times ``ig_steps``), ``chunk_size`` (targets x points) backward passes per
batch; about quadratic in n (:func:`probes.measures.gradflow.head_attribution_gflops`).
"""

from __future__ import annotations

import torch

from probes.measures import Measure, per_sentence
from probes.measures.gradflow import head_attributions, ig_baseline
from probes.model import structure


class GradAttribution(Measure):
    """Attribution distributions, (B, H, T, T) per layer."""

    per_head = True

    def __init__(self, method: str = "ixg", ig_steps: int = 20, chunk_size: int | None = 1024):
        if method not in ("ixg", "ig"):
            raise ValueError(f"grad_attribution: method must be ixg or ig, got {method!r}")
        self.method, self.ig_steps, self.chunk_size = method, int(ig_steps), chunk_size

    def __call__(self, model, input_ids, attention_mask):
        L = len(structure.attention_sites(model))
        H = int(model.config.num_attention_heads)

        def one(ids: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode(False), torch.enable_grad():
                ids = ids.clone()
                base = ig_baseline(model, ids, "zero") if self.method == "ig" else None
                return head_attributions(model, ids, self.method, self.ig_steps, self.chunk_size, base)  # (L, H, n, n)

        return per_sentence(one, input_ids, attention_mask, L, H)
