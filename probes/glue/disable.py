"""Disable attention heads or whole layers (Kovaleva et al. 2019, §5): the selected heads attend
uniformly (1/n) to the n real (unpadded) tokens instead of using their learned attention.

transformers 5 has no `head_mask`, so :class:`AttentionDisabler` registers a forward hook (with
kwargs) on each affected self-attention module (`encoder.layer[i].attention.self`, see
`probes.extract.stage.self_attention_modules`). The hook receives the module's inputs (hidden
states and the additive/boolean attention mask the layer was called with) and its output
`(context, attn_probs)`, recomputes the value vectors `V = value(hidden_states)` and replaces,
for each disabled head h, context[..., h*d:(h+1)*d] by `uniform @ V_h` and attn_probs[:, h] by
`uniform`, where uniform[q, k] = 1/n_real for real keys k (per the mask row of query q), else 0.
Layers without disabled heads get no hook, so with nothing disabled the model is untouched.
The hook is prepended, so transformers' own output-capturing hooks (`output_attentions=True`)
record the uniform probabilities.
Meant for eval mode (the uniform probabilities get no attention dropout).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from probes.extract.stage import self_attention_modules


def real_key_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Boolean (B, 1 | H, 1 | Q, K) mask of the keys each query may attend to, from the mask the
    self-attention module received (None: every token; bool: True = attend; float: additive,
    0 = attend, very negative / -inf = masked)."""
    if attention_mask is None:
        return torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
    m = attention_mask
    if m.dtype == torch.bool:
        real = m
    else:
        real = torch.isfinite(m) & (m > torch.finfo(m.dtype).min / 2)
    while real.dim() < 4:
        real = real.unsqueeze(1)
    return real


def uniform_attention(real: torch.Tensor, length: int, dtype) -> torch.Tensor:
    """(B, 1|H, Q, K) probabilities: 1/n over the real keys of each query row (0 when none)."""
    real = real.expand(*real.shape[:2], length if real.shape[2] == 1 else real.shape[2], real.shape[3])
    u = real.to(dtype)
    return u / u.sum(-1, keepdim=True).clamp(min=1)


class AttentionDisabler:
    """Context manager: `with AttentionDisabler(model, heads={(l, h)}, layers={l}): model(...)`.

    `heads`: 0-based (layer, head) pairs; `layers`: 0-based layers whose heads are all disabled.
    Works on a BERT-family base model or a task model wrapping one (`model.bert`).
    """

    def __init__(self, model: torch.nn.Module, heads: Iterable[tuple[int, int]] = (), layers: Iterable[int] = ()):
        modules = self_attention_modules(model)
        if modules is None:
            raise ValueError(f"{type(model).__name__}: no encoder.layer[i].attention.self modules")
        self.modules = modules
        selected: dict[int, set[int]] = defaultdict(set)
        for layer in layers:
            layer = int(layer)
            self._check_layer(layer)
            selected[layer].update(range(self._num_heads(layer)))
        for layer, head in heads:
            layer, head = int(layer), int(head)
            self._check_layer(layer)
            if not 0 <= head < self._num_heads(layer):
                raise ValueError(f"head {head} out of range 0..{self._num_heads(layer) - 1} (layer {layer})")
            selected[layer].add(head)
        self.selected = {l: sorted(h) for l, h in sorted(selected.items()) if h}
        self._handles = []

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.modules):
            raise ValueError(f"layer {layer} out of range 0..{len(self.modules) - 1}")

    def _num_heads(self, layer: int) -> int:
        m = self.modules[layer]
        return int(getattr(m, "num_attention_heads", None) or m.config.num_attention_heads)

    def __enter__(self):
        for layer, heads in self.selected.items():
            h = self.modules[layer].register_forward_hook(self._hook(heads), with_kwargs=True, prepend=True)
            self._handles.append(h)
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @staticmethod
    def _hook(heads: list[int]):
        idx = torch.tensor(heads)

        def hook(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            context, probs = output[0], output[1]
            B, T = hidden.shape[:2]
            d = module.attention_head_size
            v = module.value(hidden).view(B, T, -1, d).transpose(1, 2)[:, idx]          # (B, h, T, d)
            u = uniform_attention(real_key_mask(mask, B, T, hidden.device), T, v.dtype)  # (B, 1, T, T)
            new = torch.matmul(u, v)                                                     # (B, h, T, d)
            context = context.clone().view(B, T, -1, d)
            context[:, :, idx] = new.transpose(1, 2).to(context.dtype)
            context = context.view(B, T, -1)
            if probs is not None:
                probs = probs.clone()
                probs[:, idx] = u.to(probs.dtype).expand(B, len(heads), T, T)
            return (context, probs, *output[2:])

        return hook


class PrefixCache:
    """Reuse the outputs of the layers below the first disabled one (they cannot change).

    `record(model, inputs)` runs the plain model once and stores the outputs of the embeddings and of
    every encoder layer; inside `with cache.reuse(model, outputs, first_layer)` the embeddings and
    layers `< first_layer` return those stored outputs instead of computing (their `forward` is
    shadowed by an instance attribute), and the rest of the model runs as usual. Used by
    `analysis=disable_heads` to score one disabled head in ~(L - l) / L of a forward pass.
    """

    @staticmethod
    def parts(model):
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        return base.embeddings, list(base.encoder.layer)

    @classmethod
    def record(cls, model, inputs: dict):
        emb, layers = cls.parts(model)
        outs, handles = [None] * (len(layers) + 1), []

        def keep(j):
            def hook(module, args, output):
                outs[j] = output
            return hook

        handles.append(emb.register_forward_hook(keep(0)))
        handles += [layer.register_forward_hook(keep(j + 1)) for j, layer in enumerate(layers)]
        try:
            result = model(**inputs)
        finally:
            for h in handles:
                h.remove()
        return result, outs

    @classmethod
    def reuse(cls, model, outs, first_layer: int):
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            emb, layers = cls.parts(model)
            mods = [emb] + layers[:first_layer]
            for j, m in enumerate(mods):
                m.forward = (lambda o: (lambda *a, **k: o))(outs[j])
            try:
                yield
            finally:
                for m in mods:
                    del m.forward

        return ctx()
