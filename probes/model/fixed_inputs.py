"""Inputs that every forward of a model receives while a block is open (e.g. a sentence pair's token types).

Code that calls a model with ``input_ids`` and ``attention_mask`` only (the map measures, the gradient
maths) would run a sentence pair with all token types 0, i.e. not the input the classifier was tuned on.
``with fixed_inputs(model, token_type_ids=tt): ...`` adds ``tt`` to every forward of ``model`` inside the
block that does not pass that key itself, where the call's batch matches: ``tt`` is (1, T) or (B, T) and
the call's ``input_ids`` (B', T) / ``inputs_embeds`` (B', T, E) has the same T and B' = B (or tt's B = 1,
expanded to B'). A forward of another length (e.g. the model layer's own 3-token probe) is left alone; a key
the model's forward does not take (DistilBERT: no ``token_type_ids``) is never added.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn


def _takes(model: nn.Module, key: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return key in params


@contextmanager
def fixed_inputs(model: nn.Module, **tensors: torch.Tensor | None):
    """Add ``tensors`` ({key: (1 | B, T)}; None values ignored) to the model's forwards inside the block."""
    extra = {k: v for k, v in tensors.items() if v is not None and _takes(model, k)}

    def pre(module, args, kwargs):
        ref = kwargs.get("input_ids")
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None and args:
            ref = args[0]
        if ref is None:
            return None
        B, T = ref.shape[:2]
        new = dict(kwargs)
        for k, v in extra.items():
            if new.get(k) is None and v.shape[-1] == T and v.shape[0] in (1, B):
                new[k] = v.to(ref.device).expand(B, T)
        return args, new

    handle = model.register_forward_pre_hook(pre, with_kwargs=True) if extra else None
    try:
        yield model
    finally:
        if handle is not None:
            handle.remove()
