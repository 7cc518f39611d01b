"""Which layer each parameter of an encoder belongs to (layer-wise learning rates, per-layer gradients).

Layers are numbered as in transformers' ``hidden_states``: **0** is the input side (the embeddings
and anything the model computes before its first transformer block, e.g. ALBERT's
``embedding_hidden_mapping_in``, DeBERTa's relative-position embeddings), **1..L** are the blocks
(``L = config.num_hidden_layers``), and **L + 1** is the output side (what runs after the last block:
the pooler, ModernBERT's final norm). A block shared by several layers (ALBERT: one layer group
called L times) belongs to the last layer it computes. The order is found once by running the model
on three tokens with forward hooks, so every family works without knowing its module names.
"""

from __future__ import annotations

import torch
from torch import nn

from probes.model.attention_function import prepare
from probes.model.structure import blocks, model_inputs


@torch.no_grad()
def parameter_layers(model: nn.Module) -> dict[str, int]:
    """``{parameter name (as in model.named_parameters()): layer}`` with layer in 0..L+1 (see the module doc).

    Parameters of blocks get their block's layer; other modules are placed by when they first run in
    a forward relative to the blocks (before the first: 0; after the last: L + 1); parameters of
    modules that never run as a module (e.g. DeBERTa's relative-position table, read as ``.weight``)
    are 0, or L + 1 inside a pooler; a module run between blocks but outside them is 0."""
    L = int(model.config.num_hidden_layers)
    mods = blocks(model)
    calls_per = L // len(mods)
    layer_of: dict[int, int] = {}   # id(parameter) -> layer
    for g, block in enumerate(mods):
        for p in block.parameters():
            layer_of[id(p)] = (g + 1) * calls_per  # last layer the block computes (1-based)

    order: list[nn.Module] = []     # modules in the order their forward starts
    block_ids = {id(m) for m in mods}
    modes = {m: m.training for m in model.modules()}
    handles = [m.register_forward_pre_hook(lambda m, a: order.append(m)) for m in model.modules()]
    try:
        prepare(model)
        model.eval()  # no dropout: the probe forward draws no random numbers (a training run stays the same)
        device = next(model.parameters()).device
        ids = torch.zeros(1, 3, dtype=torch.long, device=device)
        model(**model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids)))
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    block_steps = [i for i, m in enumerate(order) if id(m) in block_ids]
    if not block_steps:
        raise ValueError(f"{type(model).__name__}: none of its transformer blocks ran in a forward")
    last = block_steps[-1]
    # a module's step: first time it runs outside the blocks' own forwards
    inside = set()
    for m in mods:
        inside |= {id(x) for x in m.modules()}
    step: dict[int, int] = {}
    for i, m in enumerate(order):
        if id(m) not in inside:
            step.setdefault(id(m), i)

    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) in layer_of:
            out[name] = layer_of[id(p)]
            continue
        owner = _owner(model, name)
        s = step.get(id(owner))
        if s is not None:
            out[name] = L + 1 if s > last else 0  # before the first block, or shared between blocks
        else:
            out[name] = L + 1 if "pooler" in name.split(".") else 0
    return out


def _owner(model: nn.Module, name: str) -> nn.Module:
    """The module that holds parameter ``name``."""
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model

