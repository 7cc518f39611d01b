"""``value_zeroing`` (Mohebbi et al. 2023, *Quantifying Context Mixing in Transformers*), per layer.

Reference: ``scoring/value_zeroing.py`` of github.com/hmohebbi/ValueZeroing. For layer l and token j,
block l is run again on its original input hidden states with the value vectors of j set to zero in
every head (after the value bias); ``VZ_l[i, j]`` = the cosine distance between position i's new and
original block output, rows normalised to sum 1. In a causal LM zeroing a later token j > i cannot change
position i: those entries, rounding noise of the batched forwards (below 1e-12), are set to 0. ``rollout=True`` rolls the maps out through the
layers without a residual term (their "Value Zeroing + rollout").

Through the model layer: one forward captures every block's input and output; then, per sentence of
n pieces, n copies (one zeroed token each, ``chunk`` copies per forward) run with every block's input
replaced by its original input (``hooks.attention(block_inputs=..., zero_values=...)``), so all layers
are scored in the same forward. Cost: about n + 1 forwards of the sentence (attention: one forward).
"""

from __future__ import annotations

import torch

from probes.measures import Measure, joint_maps, lengths
from probes.model import hooks, structure
from probes.model.families import is_causal


class ValueZeroing(Measure):
    """Value zeroing maps, (B, 1, T, T) per layer."""

    per_head = False

    def __init__(self, rollout: bool = False, chunk: int = 64):
        self.rollout, self.chunk = bool(rollout), int(chunk)

    def __call__(self, model, input_ids, attention_mask):
        L = len(structure.attention_sites(model))
        with hooks.attention(model, layers=[], block_io=True, stop_block=L - 1) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask)
        x = [s.block_input[l] for l in range(L)]  # L x (B, T, D) original block inputs (model dtype)
        y = [s.block_output[l].double() for l in range(L)]  # L x (B, T, D) original block outputs
        B, T = input_ids.shape
        out = torch.zeros(L, B, T, T, device=input_ids.device)  # (L, B, T, T)
        for b, n in enumerate(lengths(attention_mask)):
            for t0 in range(0, n, self.chunk):
                c = min(self.chunk, n - t0)
                zero = torch.zeros(c, n, dtype=torch.bool, device=input_ids.device)  # (c, n)
                zero[torch.arange(c), t0 + torch.arange(c)] = True
                ids = input_ids[b, :n].expand(c, n)
                with hooks.attention(model, layers=[], block_inputs={l: x[l][b, :n].expand(c, n, -1) for l in range(L)},
                                     zero_values=zero, stop_block=L - 1) as z:
                    z.run(input_ids=ids, attention_mask=torch.ones_like(ids))
                for l in range(L):
                    new = z.block_output[l].double()  # (c, n, D)
                    # float64 cosine: the [CLS] rows of middle layers have distances below 1e-4, where a float32
                    # 1 - cos is rounding noise (negative values); negatives clipped at 0 as the reference does
                    dist = (1 - torch.nn.functional.cosine_similarity(new, y[l][b, :n].expand(c, n, -1), dim=-1)
                            ).clamp(min=0)  # (c, n)
                    out[l, b, :n, t0:t0 + c] = dist.T.float()  # rows: position i, columns: zeroed token j
        if is_causal(model.config):  # token i cannot read a later token j: its distance is 0 up to rounding
            out = out * torch.ones(T, T, device=out.device).tril()
        out = out / out.sum(-1, keepdim=True).clamp(min=1e-12)
        if self.rollout:
            out = joint_maps(out)
        return list(out.unsqueeze(2))
