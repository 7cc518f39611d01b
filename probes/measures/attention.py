"""``attention``: the attention probabilities themselves, per head (the cache's original maps)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probes.measures import Measure
from probes.model import hooks, structure


class Attention(Measure):
    """alpha^{l,h}_{ij}: softmax attention of every head, (B, H, T, T) per layer, in the compute dtype; only the
    layers asked for are captured and the forward stops after the last of them (the last layer's output projection
    and feed-forward block, which no map depends on, are never computed). The one kind that can also be reduced
    block by block (:meth:`reduce`): long sequences need no whole map."""

    per_head = True
    mixed_precision = True  # the frozen model held in a mixed precision's compute dtype (no autocast casts)

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        return self.layer_maps(model, input_ids, attention_mask, range(len(structure.attention_sites(model))))

    def layer_maps(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
                   token_type_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``len(layers) x (B, H, T, T)``: the probabilities of ``layers`` (0-based, in that order); token_type_ids
        (B, T): the segments of sentence pairs, for models that take them."""
        layers = list(layers)
        with hooks.attention(model, layers=layers, stop=True) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return [s.probs[l] for l in layers]

    def reduce(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
               reducer: hooks.Reducer, rows_per_block: int | None = None,
               token_type_ids: torch.Tensor | None = None) -> None:
        """Hand the probabilities of ``layers`` to ``reducer`` (``reducer.update(layer, probs (B, H, q, c), rows,
        cols)``) instead of keeping them: in blocks of ``rows_per_block`` query rows (no whole map is made), or
        each layer's whole map as one block (None); the forward stops after the last of ``layers``."""
        with hooks.attention(model, layers=list(layers), stop=True, reduce=reducer,
                             rows_per_block=rows_per_block) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
