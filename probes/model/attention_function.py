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

Blocks of query rows (:mod:`probes.model.blockwise`): a listener that asks for them (``block_rows``) gets each
layer's probabilities as blocks of rows (:class:`probes.model.blockwise.Block`, ``attend_blocks``) and computes
``A @ V`` block by block; the whole ``(B, H, T, T)`` map (and mask) is never made. Each family's rules (scaling,
grouped-query heads, soft-capping, the mask, the position biases of DeBERTa and MPNet, softmax, dropout) are one
function of the rows and keys (``probs(rows, cols, mask)`` below), which the whole map (all rows and keys) and
the blocks both call: :func:`attend` chooses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, scaled_size_sqrt
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

from probes.model.blockwise import Block, Probs, RowMask, probes_mask, row_blocks, whole_mask

IMPLEMENTATION = "probes"
LISTENER = "_probes_listener"  # instance attribute of a module while something listens to its attention calls


class Listener(Protocol):
    """What an attention module reports its calls to (set with :func:`listening`)."""

    def attend(self, module: nn.Module, weights: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """weights (B, H, T, T), value (B, H, T, d) -> (output (B, H, T, d), weights as used (B, H, T, T))."""


class BlockListener(Listener, Protocol):
    """A listener that may take a layer's attention in blocks of query rows."""

    def block_rows(self, module: nn.Module, batch: int, heads: int, queries: int) -> int | None:
        """Query rows per block for this call of ``module``, or None for the whole map (:meth:`Listener.attend`)."""

    def attend_blocks(self, module: nn.Module, blocks: Iterator[Block], value: torch.Tensor) -> torch.Tensor:
        """The layer's output (B, H, T, d) from its blocks (each asked for after the one before is done with) and
        the values (B, H, T, d): each block's ``probs @ value[:, :, lo:hi]`` in its rows."""


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


def attend(module: nn.Module, probs: Probs, value: torch.Tensor, mask: torch.Tensor | RowMask | None,
           heads_first: bool = False, queries: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's attention from its family's rules ``probs(rows, cols, mask) -> (B, H, rows, cols)``: the whole map
    through :func:`finish_attention`, or, where ``module``'s listener asks for blocks (``block_rows``), block by
    block through its ``attend_blocks`` (:func:`probes.model.blockwise.row_blocks`; no whole map: the weights
    returned are None).

    Args:
        module: the attention module.
        probs: the family's probabilities of query rows ``rows`` over keys ``cols`` given that part of the mask.
        value: (B, H, T, d) value vectors, one per query head.
        mask: the mask the model made: a tensor (B, 1|H, T|1, K) boolean or additive, a
            :class:`~probes.model.blockwise.RowMask`, or None.
        heads_first: return the output as (B, H, T, d) instead of (B, T, H, d).
        queries: the number of query rows (None: T, the keys'); blocks need as many as there are keys.

    Returns:
        (output (B, T, H, d), or (B, H, T, d) with ``heads_first``, weights (B, H, T, T) or None)."""
    B, H, T, _ = value.shape
    Q = T if queries is None else int(queries)
    listener = listener_of(module)
    rows = listener.block_rows(module, B, H, Q) if hasattr(listener, "block_rows") else None
    if rows is None:
        m = whole_mask(mask, T)  # (B, 1|H, Q|1, T) or None
        return finish_attention(module, probs(slice(0, Q), slice(0, T), m), value, m, heads_first)
    if Q != T:
        raise ValueError(f"{type(module).__name__}: attention in blocks needs self-attention without a cache "
                         f"({Q} queries, {T} keys)")
    out = listener.attend_blocks(module, row_blocks(probs, mask, T, T, int(rows)), value)  # (B, H, T, d)
    return (out if heads_first else out.transpose(1, 2).contiguous()), None


def probes_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | RowMask | None, scaling: float | None = None,
                     dropout: float = 0.0, softcap: float | None = None, **kwargs
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager attention ending in :func:`finish_attention`, as transformers' ``eager_attention_forward``
    (Llama, Gemma 2, GPT-2, ...): query (B, H, T, d), key and value (B, H_kv, T, d); in blocks of query rows
    where the module's listener asks for them (:func:`attend`).

    Grouped-query attention: each key/value head serves ``H / H_kv`` consecutive query heads (``repeat_kv``;
    ``module.num_key_value_groups`` where the module has it), so maps and values are per query head.
    ``softcap`` (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask. The mask (causal,
    sliding window, padding) comes from transformers' eager mask (its rows only, for blocks); ``sliding_window``
    itself is only for kernels that build their own mask."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention sinks (s_aux) are not supported by the "
                                  "project's attention function")
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    key, value = repeat_kv(module, query, key), repeat_kv(module, query, value)  # (B, H, T, d)

    def probs(rows: slice, cols: slice, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, rows, cols) probabilities; mask (B, 1|H, rows, cols) boolean or additive, or None."""
        w = torch.matmul(query[:, :, rows], key[:, :, cols].transpose(2, 3)) * scaling  # (B, H, q, c)
        if softcap is not None:
            w = torch.tanh(w / softcap) * softcap
        if mask is not None:
            if mask.dtype == torch.bool:
                w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            else:
                w = w + mask
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        return nn.functional.dropout(w, p=dropout, training=module.training)

    return attend(module, probs, value, attention_mask, queries=query.shape[2])


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
    AttentionMaskInterface.register(IMPLEMENTATION, probes_mask)


def _deberta_forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                     relative_pos=None, rel_embeddings=None):
    """DisentangledSelfAttention.forward (transformers 5) with the tail replaced by :func:`attend`: scores
    ``q k^T / scale`` plus the disentangled position bias (computed for the whole sequence, at most 512
    positions, and cut to a block's rows), the boolean mask, softmax."""
    if query_states is None:
        query_states = hidden_states
    H = self.num_attention_heads
    q = self.transpose_for_scores(self.query_proj(query_states), H)  # (B*H, T, d)
    k = self.transpose_for_scores(self.key_proj(hidden_states), H)
    v = self.transpose_for_scores(self.value_proj(hidden_states), H)
    scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
    scale = scaled_size_sqrt(q, scale_factor)
    rel = None
    if self.relative_attention:
        rel = self.disentangled_attention_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings), scale_factor)
    mask = attention_mask.bool()  # (B, 1, T, T)

    def probs(rows: slice, cols: slice, m: torch.Tensor) -> torch.Tensor:
        """(B, H, rows, cols) probabilities; m (B, 1, rows, cols) boolean."""
        scores = torch.bmm(q[:, rows], k[:, cols].transpose(-1, -2) / scale.to(dtype=q.dtype))  # (B*H, q, c)
        if rel is not None:
            scores = scores + rel[:, rows, cols]
        scores = scores.view(-1, H, scores.size(-2), scores.size(-1))  # (B, H, q, c)
        scores = scores.masked_fill(~m, torch.finfo(q.dtype).min)
        return self.dropout(nn.functional.softmax(scores, dim=-1))

    out, probs_used = attend(self, probs, v.view(-1, H, v.size(-2), v.size(-1)), mask,
                             queries=q.size(-2))  # (B, T, H, d)
    context = out.reshape(out.shape[0], out.shape[1], -1)
    return (context, probs_used if output_attentions else None)


def _mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward (transformers 5) with the tail through :func:`attend`: scores
    ``q k^T / sqrt(d)`` plus the encoder's relative position bias (B, H, T, T; at most 512 positions, cut to a
    block's rows) plus the additive mask."""
    shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    q = self.q(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)
    k = self.k(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)
    v = self.v(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, d)

    def probs(rows: slice, cols: slice, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, rows, cols) probabilities; mask (B, 1, rows|1, cols) boolean or additive, or None."""
        scores = torch.matmul(q[:, :, rows], k[:, :, cols].transpose(-1, -2))  # (B, H, q, c)
        scores = scores / math.sqrt(self.attention_head_size)
        if position_bias is not None:
            scores = scores + position_bias[:, :, rows, cols]  # (B, H, q, c)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask  # (B, 1, q|1, c) additive
        return self.dropout(nn.functional.softmax(scores, dim=-1))  # (B, H, q, c)

    out, probs_used = attend(self, probs, v, attention_mask, queries=q.size(-2))  # (B, T, H, d)
    o = self.o(out.reshape(*out.shape[:2], self.all_head_size))  # (B, T, D)
    return (o, probs_used) if output_attentions else (o,)


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
