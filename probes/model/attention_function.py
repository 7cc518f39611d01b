"""The project's attention function and the adapters that route every family through it.

Models are loaded with ``attn_implementation="probes"``: :func:`probes_attention` is registered in
transformers' ``AttentionInterface`` (and the eager mask in ``AttentionMaskInterface``), so every
self-attention layer that goes through the interface calls it. Two families compute attention inline:
DeBERTa-v2/v3 (disentangled attention, ``DisentangledSelfAttention``) and MPNet (a relative position bias
added to the scores, ``MPNetSelfAttention``); :func:`install_adapters` gives those modules a forward
(:data:`ADAPTERS`) that computes the same scores and then goes through the same tail, :func:`finish_attention`.

:func:`finish_attention` computes ``A @ V``; an attention module that has a listener (:func:`listening`:
an attention session of :mod:`probes.model.hooks`, or module discovery of :mod:`probes.model.structure`)
hands it the probabilities and values instead, and the listener returns the output. Without one it is
exactly the eager attention (scores, mask, softmax, dropout, ``A @ V``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, scaled_size_sqrt
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

IMPLEMENTATION = "probes"
LISTENER = "_probes_listener"  # instance attribute of a module while something listens to its attention calls


class Listener(Protocol):
    """What an attention module reports its calls to (set with :func:`listening`)."""

    def attend(self, module: nn.Module, weights: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """weights (B, H, T, T), value (B, H, T, d) -> (output (B, H, T, d), weights as used (B, H, T, T))."""


def listener_of(module: nn.Module) -> Listener | None:
    """The listener set on ``module``, or None."""
    return module.__dict__.get(LISTENER)


@contextmanager
def listening(modules: Iterable[nn.Module], listener: Listener) -> Iterator[None]:
    """Within the block, the attention calls of ``modules`` go to ``listener``; each module's earlier
    listener (if any) is restored on exit."""
    earlier = {m: listener_of(m) for m in modules}  # a shared module appears once
    for m in earlier:
        m.__dict__[LISTENER] = listener
    try:
        yield
    finally:
        for m, before in earlier.items():
            if before is None:
                m.__dict__.pop(LISTENER, None)
            else:
                m.__dict__[LISTENER] = before


def finish_attention(module: nn.Module, weights: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     heads_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared tail of every family: ``weights @ value``, through ``module``'s listener when it has one.

    Args:
        module: the attention module that computed ``weights``.
        weights: (B, H, T, T) attention probabilities.
        value: (B, H, T, d) value vectors.
        mask: the mask the scores were given (additive float or boolean, (B, 1|H, T, T)), or None.
        heads_first: return the output as (B, H, T, d) instead of (B, T, H, d).

    Returns:
        (output (B, T, H, d), or (B, H, T, d) with ``heads_first``, weights (B, H, T, T))."""
    listener = listener_of(module)
    if listener is None:
        out = torch.matmul(weights, value)  # (B, H, T, d)
    else:
        out, weights = listener.attend(module, weights, value, mask)  # (B, H, T, d), (B, H, T, T)
    return (out if heads_first else out.transpose(1, 2).contiguous()), weights


def probes_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention ending in :func:`finish_attention`, as transformers' ``eager_attention_forward``
    (Llama, Gemma 2, GPT-2, ...): query (B, H, T, d), key and value (B, H_kv, T, d).

    Grouped-query attention: each key/value head serves ``H / H_kv`` consecutive query heads (``repeat_kv``;
    ``module.num_key_value_groups`` where the module has it), so maps and values are per query head.
    ``softcap`` (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask. The mask (causal,
    sliding window, padding) comes from transformers' eager mask; ``sliding_window`` itself is only for
    kernels that build their own mask."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention sinks (s_aux) are not supported by the "
                                  "project's attention function")
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    key, value = repeat_kv(module, query, key), repeat_kv(module, query, value)  # (B, H, T, d)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, T)
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            w = w.masked_fill(~attention_mask, torch.finfo(w.dtype).min)
        else:
            w = w + attention_mask[..., : key.shape[-2]]
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = nn.functional.dropout(w, p=dropout, training=module.training)
    return finish_attention(module, w, value, attention_mask)


def repeat_kv(module: nn.Module, query: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Key or value heads (B, H_kv, T, d) repeated for the query heads (B, H, T, d): query head h reads key/value
    head ``h // (H / H_kv)``, as transformers' ``repeat_kv``."""
    n = query.shape[1] // x.shape[1]
    if n * x.shape[1] != query.shape[1]:
        raise ValueError(f"{type(module).__name__}: {query.shape[1]} query heads are not a multiple of "
                         f"{x.shape[1]} key/value heads")
    groups = getattr(module, "num_key_value_groups", n)
    if groups != n:
        raise ValueError(f"{type(module).__name__}: num_key_value_groups={groups}, but the shapes give {n}")
    if n == 1:
        return x
    B, K, T, d = x.shape
    return x[:, :, None].expand(B, K, n, T, d).reshape(B, K * n, T, d)


def register() -> None:
    """Register :func:`probes_attention` as ``attn_implementation="probes"`` (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, probes_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)


def _deberta_forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                     relative_pos=None, rel_embeddings=None):
    """DisentangledSelfAttention.forward (transformers 5) with the tail replaced by :func:`finish_attention`."""
    if query_states is None:
        query_states = hidden_states
    H = self.num_attention_heads
    q = self.transpose_for_scores(self.query_proj(query_states), H)  # (B*H, T, d)
    k = self.transpose_for_scores(self.key_proj(hidden_states), H)
    v = self.transpose_for_scores(self.value_proj(hidden_states), H)
    scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
    scale = scaled_size_sqrt(q, scale_factor)
    scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(dtype=q.dtype))  # (B*H, T, T)
    if self.relative_attention:
        rel = self.disentangled_attention_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings), scale_factor)
        if rel is not None:
            scores = scores + rel
    scores = scores.view(-1, H, scores.size(-2), scores.size(-1))  # (B, H, T, T)
    mask = attention_mask.bool()
    scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
    probs = self.dropout(nn.functional.softmax(scores, dim=-1))
    out, probs = finish_attention(self, probs, v.view(-1, H, v.size(-2), v.size(-1)), mask)  # (B, T, H, d)
    context = out.reshape(out.shape[0], out.shape[1], -1)
    return (context, probs if output_attentions else None)


def _mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward (transformers 5) with ``A @ V`` through :func:`finish_attention`: scores
    ``q k^T / sqrt(d)`` plus the encoder's relative position bias (B, H, T, T) plus the additive mask."""
    shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    q = self.q(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)
    k = self.k(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)
    v = self.v(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, T, T)
    scores = scores / math.sqrt(self.attention_head_size)
    if position_bias is not None:
        scores = scores + position_bias  # (B, H, T, T)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask  # (B, 1, T, T) additive
    probs = self.dropout(nn.functional.softmax(scores, dim=-1))  # (B, H, T, T)
    out, probs = finish_attention(self, probs, v, attention_mask)  # (B, T, H, d)
    o = self.o(out.reshape(*out.shape[:2], self.all_head_size))  # (B, T, D)
    return (o, probs) if output_attentions else (o,)


# attention module class -> the forward that routes it through finish_attention
ADAPTERS = ((DisentangledSelfAttention, _deberta_forward), (MPNetSelfAttention, _mpnet_forward))


def install_adapters(model: nn.Module) -> nn.Module:
    """Route attention modules that bypass AttentionInterface (:data:`ADAPTERS`) through
    :func:`finish_attention` (idempotent)."""
    for m in model.modules():
        if "forward" in m.__dict__:
            continue
        for cls, forward in ADAPTERS:
            if isinstance(m, cls):
                m.forward = forward.__get__(m)
                break
    return model


def prepare(model: nn.Module) -> nn.Module:
    """Make ``model`` (any transformers encoder or task model) use the project's attention path."""
    register()
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION:
        if hasattr(model, "set_attn_implementation"):
            try:
                model.set_attn_implementation(IMPLEMENTATION)
            except (ValueError, KeyError):
                model.config._attn_implementation = IMPLEMENTATION
        else:
            model.config._attn_implementation = IMPLEMENTATION
    return install_adapters(model)
