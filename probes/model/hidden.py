"""Hidden states of chosen layers, for every supported family (the representation side of the model layer).

Layer 0 is the embedding output, layer l (1..L) the output of transformer block l, as in the
``hidden_states`` tuple transformers returns; L comes from the model config. Layer L is what transformers
returns last: after the final norm for families that have one (ModernBERT, the causal LMs), the block's
output otherwise. Causal LMs: position t's state depends on tokens <= t only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from probes.model.structure import model_inputs


def layer_list(num_layers: int, layers: Iterable[int] | None, model_name: str = "the model") -> list[int]:
    """Sorted distinct layers of a model with ``num_layers`` blocks (None: all, 0..L); a clear error for one
    out of 0..L. Needs no weights (the hidden-state cache key is computed from it)."""
    L = int(num_layers)
    out = sorted({int(l) for l in (range(L + 1) if layers is None else layers)})
    bad = [l for l in out if not 0 <= l <= L]
    if bad or not out:
        raise ValueError(f"hidden-state layers {bad or '[]'} out of range 0..{L} (0 = embedding output, "
                         f"{L} = last layer of {model_name})")
    return out


def check_layers(model: nn.Module, layers: Iterable[int] | None) -> list[int]:
    """Sorted distinct layers (None: all, 0..L, L from the model config); a clear error for one out of 0..L."""
    return layer_list(model.config.num_hidden_layers, layers, type(model).__name__)


def hidden_states(model: nn.Module, layers: Iterable[int] | None = None, **inputs) -> dict[int, torch.Tensor]:
    """``{layer: (B, T, D)}`` hidden states of the base encoder (any head is not run).

    inputs: ``input_ids``, ``attention_mask`` (B, T) and optionally ``token_type_ids``; keys the model
    does not take are dropped.
    """
    layers = check_layers(model, layers)
    base = model.base_model
    out = base(**model_inputs(base, **inputs), output_hidden_states=True)
    states = out.hidden_states  # (L + 1) x (B, T, D)
    L = int(model.config.num_hidden_layers)
    if len(states) != L + 1:
        raise ValueError(f"{type(base).__name__} returned {len(states)} hidden states, expected {L + 1} "
                         "(embedding output + one per layer)")
    return {l: states[l] for l in layers}
