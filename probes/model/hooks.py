"""Attention capture and head interventions, for every supported family, in one place.

Models are loaded with ``attn_implementation="probes"``: :func:`probes_attention` is registered in
transformers' ``AttentionInterface`` (and the eager mask in ``AttentionMaskInterface``), so every
self-attention layer that goes through the interface calls it. Outside a :class:`Session` it computes
exactly the eager attention (scores, mask, softmax, dropout, ``A @ V``). Inside one it can

* capture each head's probabilities of chosen layers (``(B, H, T, T)``, differentiable, optionally with
  ``retain_grad``) and stop the forward right after the last layer needed;
* replace heads' attention by uniform attention over the keys the mask lets them see (Kovaleva et al.'s
  disabling);
* scale each head's output by a gate (``(L, H)``, e.g. ones with ``requires_grad`` for gradient-based
  head importance);
* keep the per-head value vectors ``(B, H, T, d)`` and outputs ``(B, T, H, d)`` (before the output
  projection);
* keep each block's internals (``internals=True``: block input and output, the heads' output projection,
  the residual sum entering the LayerNorm after it and that LayerNorm's output, ``(B, T, D)`` each; the
  modules are found once per model by :func:`layer_parts`), zero chosen tokens' value vectors in every
  head (``zero_values``, value zeroing), replace block inputs (``block_inputs``) and stop after a block
  (``stop_block``).

DeBERTa-v2/v3 computes disentangled attention itself; :func:`install_adapters` gives its
``DisentangledSelfAttention`` modules a forward that computes the same scores and then goes through the
same code path. Layer indices come from the order in which the attention sites are called in one
forward (found once per model by :func:`attention_sites`), so shared-weight layers (ALBERT) work too.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.pytorch_utils import Conv1D
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, scaled_size_sqrt

from probes.model.inputs import length_batches, pad_encoded

IMPLEMENTATION = "probes"


class StopForward(Exception):
    """Raised after the last layer a session needs; :meth:`Session.run` catches it."""


# ----------------------------------------------------------------------------- the attention function
_ACTIVE: dict[int, "Session"] = {}       # id(attention module) -> session in force
_DISCOVER: list | None = None            # attention modules in call order while discovering


def _real_keys(mask: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1|H, T, T) keys each query may see, from an additive float or a boolean mask."""
    if mask is None:
        return torch.ones_like(w, dtype=torch.bool)
    if mask.dtype == torch.bool:
        real = mask
    else:
        real = torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min / 2)
    while real.dim() < 4:
        real = real.unsqueeze(1)
    return real.expand(w.shape[0], real.shape[1], w.shape[2], w.shape[3])


def finish_attention(module: nn.Module, weights: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     heads_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared tail of every family: interventions on ``weights`` (B, H, T, T), then ``weights @ value``.

    value: (B, H, T, d). Returns (output (B, T, H, d), or (B, H, T, d) with ``heads_first``, weights (B, H, T, T))."""
    if _DISCOVER is not None:
        _DISCOVER.append(module)
    session = _ACTIVE.get(id(module))
    layer = session._next_layer(module) if session is not None else None
    if layer is not None:
        weights = session._edit(layer, weights, mask)
        value = session._edit_value(layer, value)
    out = torch.matmul(weights, value)  # (B, H, T, d)
    if layer is not None:
        out = session._after(layer, weights, value, out)
    return (out if heads_first else out.transpose(1, 2).contiguous()), weights


def probes_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with the session's capture and interventions, as transformers' ``eager_attention_forward``
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


# ----------------------------------------------------------------------------- DeBERTa-v2 adapter
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


def install_adapters(model: nn.Module) -> nn.Module:
    """Route attention modules that bypass AttentionInterface through :func:`finish_attention` (idempotent)."""
    for m in model.modules():
        if isinstance(m, DisentangledSelfAttention) and "forward" not in m.__dict__:
            m.forward = _deberta_forward.__get__(m)
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


# ----------------------------------------------------------------------------- sites and blocks
_SITES: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def model_inputs(model: nn.Module, **inputs) -> dict:
    """``inputs`` without None values and without keys the model's forward does not take
    (DistilBERT has no ``token_type_ids``)."""
    params = inspect.signature(model.forward).parameters
    anykw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in inputs.items() if v is not None and (k in params or (anykw and k != "token_type_ids"))}


@torch.no_grad()
def attention_sites(model: nn.Module) -> list[nn.Module]:
    """The attention module of every layer, in layer order (a shared module appears once per layer)."""
    global _DISCOVER
    if model in _SITES:
        return _SITES[model]
    prepare(model)
    device = next(model.parameters()).device
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    _DISCOVER = []
    try:
        model(**model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids)))
        sites = list(_DISCOVER)
    finally:
        _DISCOVER = None
    L = int(model.config.num_hidden_layers)
    if len(sites) != L:
        raise ValueError(f"{type(model).__name__}: found {len(sites)} attention calls in a forward, expected "
                         f"{L} (config.num_hidden_layers); is this an encoder of a supported family?")
    _SITES[model] = sites
    return sites


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks called once per layer (an ``nn.ModuleList`` of num_hidden_layers modules;
    ALBERT: its layer groups, each called num_hidden_layers / groups times)."""
    L = int(model.config.num_hidden_layers)
    for m in model.base_model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == L and len(m) and not isinstance(m[0], nn.Linear):
            return list(m)
    groups = getattr(getattr(model.base_model, "encoder", None), "albert_layer_groups", None)
    if groups is not None:
        return list(groups)
    raise ValueError(f"{type(model).__name__}: no list of {L} transformer blocks found")


def block_function(model: nn.Module, layer: int, **inputs):
    """``f(x (B, T, D)) -> (B, T, D)``: the output of block ``layer`` when its input hidden states are
    ``x`` (the model runs up to that block with ``inputs``; masks and positions come from them)."""
    mods = blocks(model)
    calls_per = int(model.config.num_hidden_layers) // len(mods)
    target = mods[layer // calls_per]
    inputs = model_inputs(model, **inputs)

    def f(x: torch.Tensor) -> torch.Tensor:
        count, result = [0], []

        def pre(module, args, kwargs):
            if module is target and count[0] == layer:
                if args:
                    args = (x, *args[1:])
                else:
                    key = next(k for k in ("hidden_states", "hidden_state", "x") if k in kwargs)
                    kwargs = {**kwargs, key: x}
                return args, kwargs
            return None

        def post(module, args, kwargs, output):
            if count[0] == layer:
                result.append(output[0] if isinstance(output, (tuple, list)) else output)
                raise StopForward
            count[0] += 1

        handles = []
        for m in mods:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        try:
            model(**inputs)
        except StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        return result[0]

    return f


# ----------------------------------------------------------------------------- sessions
class Session:
    """What one ``with attention(model, ...)`` block captures and changes; see :func:`attention`."""

    def __init__(self, model: nn.Module, capture: Iterable[int] | None, stop: bool, uniform, gates, values: bool,
                 retain_grad: bool, internals: bool = False, block_inputs: dict | None = None,
                 zero_values=None, stop_block: int | None = None, block_io: bool = False):
        self.model = model
        self.sites = attention_sites(model)
        L = len(self.sites)
        self.capture = sorted(set(range(L) if capture is None else (int(l) for l in capture)))
        for l in self.capture:
            _check(l, L, "layer")
        self.stop_after = max(self.capture) if (stop and self.capture) else None
        self.uniform = {}
        for l, heads in (uniform or {}).items():
            _check(int(l), L, "layer")
            self.uniform[int(l)] = sorted({int(h) for h in heads})
        self.gates = gates  # (L, H) or None
        self.values = values
        self.retain_grad = retain_grad
        self.probs: dict[int, torch.Tensor] = {}    # layer -> (B, H, T, T)
        self.value: dict[int, torch.Tensor] = {}    # layer -> (B, H, T, d)
        self.output: dict[int, torch.Tensor] = {}   # layer -> (B, T, H, d) head outputs before the projection
        self._calls: dict[int, int] = {}
        self._layers: dict[int, list[int]] = {}
        for l, m in enumerate(self.sites):
            self._layers.setdefault(id(m), []).append(l)
        # block internals (see attention(): internals, block_inputs, zero_values, stop_block)
        self.internals = internals
        self.block_inputs = {int(l): x for l, x in (block_inputs or {}).items()}  # layer -> (B, T, D)
        self.zero_values = zero_values  # (B, T) bool, or {layer: (B, T) bool}
        self.stop_block = stop_block
        for l in list(self.block_inputs) + ([stop_block] if stop_block is not None else []):
            _check(l, L, "layer")
        self.block_input: dict[int, torch.Tensor] = {}    # layer -> (B, T, D) hidden states entering the block
        self.block_output: dict[int, torch.Tensor] = {}   # layer -> (B, T, D) hidden states leaving the block
        self.proj_output: dict[int, torch.Tensor] = {}    # layer -> (B, T, D) output projection of the heads (+ bias)
        self.residual_sum: dict[int, torch.Tensor] = {}   # layer -> (B, T, D) block input + proj_output (norm input)
        self.norm_output: dict[int, torch.Tensor] = {}    # layer -> (B, T, D) output of the norm after proj
        self.norm_input: dict[int, torch.Tensor] = {}     # layer -> (B, T, D) its input, sub-layer norms only
        self._last_layer = -1
        self._block_calls = 0
        self.keep_blocks = internals or block_io
        self._need_blocks = self.keep_blocks or bool(self.block_inputs) or stop_block is not None
        self.parts = layer_parts(model) if internals else None

    # called from finish_attention
    def _next_layer(self, module) -> int:
        k = id(module)
        layers = self._layers[k]
        n = self._calls.get(k, 0)
        self._calls[k] = n + 1
        return layers[n % len(layers)]

    def _edit(self, layer: int, w: torch.Tensor, mask) -> torch.Tensor:
        heads = self.uniform.get(layer)
        if heads:
            H = w.shape[1]
            for h in heads:
                _check(h, H, "head")
            real = _real_keys(mask, w).to(w.dtype)  # (B, 1|H, T, T)
            u = real / real.sum(-1, keepdim=True).clamp(min=1)
            sel = torch.zeros(H, dtype=torch.bool, device=w.device)
            sel[heads] = True
            w = torch.where(sel.view(1, H, 1, 1), u.expand_as(w), w)
        if layer in self.capture:
            if self.retain_grad and w.requires_grad:
                w.retain_grad()
            self.probs[layer] = w
        return w

    def _edit_value(self, layer: int, value: torch.Tensor) -> torch.Tensor:
        """Zero the value vectors (B, H, T, d) of the positions ``zero_values`` marks (Mohebbi et al. 2023)."""
        self._last_layer = layer
        z = self.zero_values
        if isinstance(z, dict):
            z = z.get(layer)
        if z is None:
            return value
        keep = (~z.to(torch.bool)).to(value.dtype)  # (B, T)
        return value * keep[:, None, :, None]

    def _after(self, layer: int, w, value, out):
        if self.gates is not None:
            out = out * self.gates[layer].to(out.dtype).view(1, -1, 1, 1)
        if self.values:
            self.value[layer] = value
            self.output[layer] = out.transpose(1, 2)
        if self.stop_after is not None and layer == self.stop_after:
            raise StopForward
        return out

    def reset(self) -> None:
        """Forget what the last forward captured (called before each :meth:`run`)."""
        self.probs, self.value, self.output, self._calls = {}, {}, {}, {}
        self.block_input, self.block_output, self.proj_output, self.residual_sum, self.norm_output = {}, {}, {}, {}, {}
        self.norm_input = {}
        self._block_calls, self._last_layer = 0, -1

    def _begin(self) -> None:
        """Start of a model forward: layer counters back to 0."""
        self._calls.clear()
        self._block_calls, self._last_layer = 0, -1

    # block hooks (installed by attention() when internals / block_inputs / stop_block are used)
    def _block_pre(self, module, args, kwargs):
        layer = self._block_calls
        x = args[0] if args else kwargs[_hidden_key(kwargs)]
        if layer in self.block_inputs:
            x = self.block_inputs[layer].to(dtype=x.dtype, device=x.device)
            if args:
                args = (x, *args[1:])
            else:
                kwargs = {**kwargs, _hidden_key(kwargs): x}
        if self.keep_blocks:
            self.block_input[layer] = x
        return args, kwargs

    def _block_post(self, module, args, kwargs, output):
        layer = self._block_calls
        self._block_calls += 1
        if self.keep_blocks or self.stop_block is not None:
            self.block_output[layer] = output[0] if isinstance(output, (tuple, list)) else output
        if self.stop_block is not None and layer == self.stop_block:
            raise StopForward

    def _proj_post(self, module, args, output):
        l = self._last_layer
        if l >= 0 and l not in self.proj_output and self.parts[l].proj is module:
            self.proj_output[l] = output

    def _norm_post(self, module, args, output):
        l = self._last_layer
        if l >= 0 and l in self.proj_output and l not in self.residual_sum and self.parts[l].norm is module:
            self.norm_output[l] = output
            if self.parts[l].sub_norm:  # the norm acts on the heads' output; the residual is added after it
                self.norm_input[l] = args[0]
                self.residual_sum[l] = self.block_input[l] + output
            else:
                self.residual_sum[l] = args[0]

    def run(self, **inputs):
        """One forward of the model (keys it does not take are dropped); None when stopped early."""
        self.reset()
        try:
            return self.model(**model_inputs(self.model, **inputs))
        except StopForward:
            return None

    def attentions(self) -> torch.Tensor:
        """Captured maps stacked: (B, L', H, T, T) for the captured layers in order."""
        return torch.stack([self.probs[l] for l in self.capture], dim=1)


def _check(i: int, n: int, what: str) -> None:
    if not 0 <= i < n:
        raise ValueError(f"{what} {i} out of range 0..{n - 1}")


@contextmanager
def attention(model: nn.Module, layers: Iterable[int] | None = None, *, stop: bool = False,
              uniform: dict[int, Iterable[int]] | None = None, gates: torch.Tensor | None = None,
              values: bool = False, retain_grad: bool = False, internals: bool = False,
              block_inputs: dict[int, torch.Tensor] | None = None, zero_values=None, stop_block: int | None = None,
              block_io: bool = False):
    """``with attention(model, layers=[...], stop=True) as s: s.run(**batch); s.probs[l]`` (B, H, T, T).

    layers: 0-based layers to capture (None: all; [] none). stop: end the forward after the last of
    them. uniform: {layer: heads} attending uniformly to the keys they may see. gates: (L, H) factors on
    each head's output. values: keep per-head values (B, H, T, d) and outputs (B, T, H, d).
    retain_grad: keep ``.grad`` of the captured probabilities after ``backward()``.

    Block internals (any family; the parts are found by :func:`layer_parts`):
    internals: keep per layer ``block_input``, ``block_output``, ``proj_output`` (the heads' output
    projection, bias included), ``residual_sum`` (block input + proj_output, the input of the LayerNorm
    that follows; with a sub-layer norm (Gemma 2/3, OLMo 2) block input + that norm's output) and
    ``norm_output`` (and ``norm_input`` for sub-layer norms), each (B, T, D); ``s.parts[l]`` names the modules.
    block_io: keep ``block_input`` and ``block_output`` only (no search for the parts).
    block_inputs: {layer: (B, T, D)} hidden states that replace the input of that block (the blocks
    below still run; their output is discarded). zero_values: (B, T) bool, or {layer: (B, T) bool}:
    the value vectors of the marked positions are zero in every head (value zeroing). stop_block: end
    the forward right after that block.
    """
    session = Session(model, layers, stop, uniform, gates, values, retain_grad, internals, block_inputs,
                      zero_values, stop_block, block_io)
    keys = {id(m) for m in session.sites}
    clash = keys & _ACTIVE.keys()
    if clash:
        raise RuntimeError("another attention session is active on this model")
    for k in keys:
        _ACTIVE[k] = session
    handles = [model.register_forward_pre_hook(lambda *_: session._begin())]
    if session._need_blocks:
        for m in dict.fromkeys(blocks(model)):
            handles.append(m.register_forward_pre_hook(session._block_pre, with_kwargs=True))
            handles.append(m.register_forward_hook(session._block_post, with_kwargs=True))
    if internals:
        for m in dict.fromkeys(p.proj for p in session.parts):  # shared layers (ALBERT): one hook per module
            handles.append(m.register_forward_hook(session._proj_post))
        for m in dict.fromkeys(p.norm for p in session.parts):
            handles.append(m.register_forward_hook(session._norm_post))
    try:
        yield session
    finally:
        for h in handles:
            h.remove()
        for k in keys:
            _ACTIVE.pop(k, None)


# ----------------------------------------------------------------------------- block internals
def _hidden_key(kwargs: dict) -> str:
    return next(k for k in ("hidden_states", "hidden_state", "x") if k in kwargs)


def _is_layer_norm(m: nn.Module) -> bool:
    """LayerNorm or RMSNorm modules (``nn.LayerNorm``, ``nn.RMSNorm``, transformers' ``*LayerNorm``/``*RMSNorm``)."""
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or (
        type(m).__name__.endswith(("LayerNorm", "RMSNorm")) and hasattr(m, "weight"))


def _is_linear(m: nn.Module) -> bool:
    """``nn.Linear`` or GPT-2's ``Conv1D`` (a linear layer with its weight stored transposed)."""
    return isinstance(m, (nn.Linear, Conv1D))


def projection_weight(proj: nn.Module) -> torch.Tensor:
    """The weight of a linear layer as (out, in): ``nn.Linear.weight``; GPT-2's ``Conv1D`` stores (in, out)."""
    return proj.weight.t() if isinstance(proj, Conv1D) else proj.weight


def rms_gain(norm: nn.Module) -> torch.Tensor | None:
    """(D,) the gain g of an RMS norm, ``norm(z) = g * z / sqrt(mean(z^2) + eps)`` (Llama: weight; Gemma:
    1 + weight), read from the module by normalising a vector of ones; None for a norm of another form."""
    w = norm.weight
    ones = torch.ones(1, w.shape[-1], dtype=torch.float32, device=w.device)
    eps = norm_eps(norm)
    g = (norm(ones.to(w.dtype)).float() * (1.0 + eps) ** 0.5)[0]  # (D,)
    z = torch.linspace(-2.0, 3.0, w.shape[-1], device=w.device)[None]  # (1, D) a test vector with mean != 0
    expected = g * z / (z.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return g if torch.allclose(norm(z.to(w.dtype)).float(), expected, atol=1e-4, rtol=1e-3) else None


def norm_eps(norm: nn.Module) -> float:
    """The epsilon of a LayerNorm module (``eps`` or ``variance_epsilon``)."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__}: no eps / variance_epsilon attribute")
    return float(eps)


class LayerParts:
    """The modules of one layer's attention sub-layer that the decompositions need (see :func:`layer_parts`).

    proj: the output projection applied to the concatenated head outputs (``nn.Linear`` or GPT-2's ``Conv1D``,
    H*d -> D; :func:`projection_weight`);
    norm: the first LayerNorm / RMSNorm called after it, whose input is the residual sum (block input + proj),
    or, with ``sub_norm``, the projection's output itself;
    post_ln: True when the block is post-LN (BERT: the sub-layer's output is ``norm(sum)``), False when
    it is pre-LN (ModernBERT, GPT-2, Llama: the residual stream carries the sum itself; ``norm`` normalises
    the feed-forward input);
    sub_norm: True when ``norm`` is an RMS norm of the heads' output before the residual is added (Gemma 2/3,
    OLMo 2: ``x + norm(proj)``); ``gain`` is then its (D,) gain (:func:`rms_gain`)."""

    def __init__(self, proj: nn.Module, norm: nn.Module, post_ln: bool, sub_norm: bool = False,
                 gain: torch.Tensor | None = None):
        self.proj, self.norm, self.post_ln, self.sub_norm, self.gain = proj, norm, post_ln, sub_norm, gain

    def __repr__(self) -> str:
        return (f"LayerParts(proj={type(self.proj).__name__}, norm={type(self.norm).__name__}, post_ln={self.post_ln}, "
                f"sub_norm={self.sub_norm})")


_PARTS: "weakref.WeakKeyDictionary[nn.Module, list[LayerParts]]" = weakref.WeakKeyDictionary()
_PROJS: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def output_projections(model: nn.Module) -> list[nn.Module]:
    """Per layer, the heads' output projection (:func:`layer_parts`' ``proj``), also for blocks whose residual
    shape the decompositions do not cover (GPT-NeoX's parallel residual): what the ``norm`` kind needs."""
    try:
        return [p.proj for p in layer_parts(model)]
    except ValueError:
        projs = _PROJS.get(model)
        if projs is None or any(p is None for p in projs):
            raise
        return projs


@torch.no_grad()
def layer_parts(model: nn.Module) -> list[LayerParts]:
    """Per layer, the output projection and LayerNorm of its attention sub-layer, found once per model
    by call order in one forward (any family, shared layers included):

    * proj: the first ``nn.Linear`` (or ``Conv1D``) called after the layer's attention function returns;
    * norm: the first LayerNorm / RMSNorm called after proj; its input must equal block input + proj output
      (the residual connection), checked here; or (a sub-layer norm, Gemma 2/3 and OLMo 2) it is an RMS norm
      of proj's output, and the next norm or linear layer then reads block input + its output (checked);
    * post_ln: the block's output is the output of the last LayerNorm it calls.

    A parallel-residual block (GPT-NeoX: ``x + attn(ln1(x)) + mlp(ln2(x))``) has neither shape: ValueError.

    Raises ValueError naming the layer when the model does not have this shape (then the
    decomposition-based measures cannot be defined for it)."""
    if model in _PARTS:
        return _PARTS[model]
    global _DISCOVER
    sites = attention_sites(model)
    L = len(sites)
    mods = blocks(model)
    events: list = []
    handles = []
    for m in model.modules():
        if _is_linear(m):
            handles.append(m.register_forward_hook(lambda mod, a, o: events.append(("linear", mod, o, a[0]))))
        elif _is_layer_norm(m):
            handles.append(m.register_forward_hook(lambda mod, a, o: events.append(("norm", mod, a[0], o))))
    for m in dict.fromkeys(mods):
        handles.append(m.register_forward_pre_hook(
            lambda mod, a, k: events.append(("block_in", a[0] if a else k[_hidden_key(k)])), with_kwargs=True))
        handles.append(m.register_forward_hook(
            lambda mod, a, k, o: events.append(("block_out", o[0] if isinstance(o, (tuple, list)) else o)),
            with_kwargs=True))
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 100))
    ids = (torch.arange(7, device=device).unsqueeze(0) * 7 + 5) % vocab  # (1, 7) arbitrary real tokens
    _DISCOVER = events  # finish_attention appends each attention module as it is called
    was_training = model.training
    model.eval()  # no dropout between the projection and the residual sum
    try:
        with torch.autocast(device.type, enabled=False):  # exact residual check even inside mixed precision
            model(**model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids)))
    finally:
        model.train(was_training)
        _DISCOVER = None
        for h in handles:
            h.remove()
    layer, state, block = -1, None, -1
    proj, proj_out, norm, norm_in = [None] * L, [None] * L, [None] * L, [None] * L
    norm_out, after = [None] * L, [None] * L  # the norm's output; the input of the next norm / linear layer
    block_in, post = [None] * L, [None] * L
    last_norm_out = None
    for e in events:
        if isinstance(e, nn.Module):
            layer, state = layer + 1, "proj"
        elif e[0] == "block_in":
            block, last_norm_out = block + 1, None
            if block < L:
                block_in[block] = e[1]
        elif e[0] == "block_out":
            if 0 <= block < L:
                post[block] = last_norm_out is not None and last_norm_out.shape == e[1].shape \
                    and torch.equal(last_norm_out, e[1])
        elif state == "after" and e[0] in ("linear", "norm") and 0 <= layer < L:
            after[layer], state = e[3] if e[0] == "linear" else e[2], None
        elif e[0] == "linear" and state == "proj" and 0 <= layer < L:
            proj[layer], proj_out[layer], state = e[1], e[2], "norm"
        if not isinstance(e, nn.Module) and e[0] == "norm":
            last_norm_out = e[3]
            if state == "norm" and 0 <= layer < L:
                norm[layer], norm_in[layer], norm_out[layer], state = e[1], e[2], e[3], "after"
    name = type(model).__name__
    _PROJS[model] = proj
    parts = []
    for l in range(L):
        if proj[l] is None or norm[l] is None or block_in[l] is None or post[l] is None:
            raise ValueError(f"{name}: layer {l}: no output projection / LayerNorm after the attention function or "
                             "no transformer block found; residual/LayerNorm decompositions (norm_res_ln, alti) "
                             "are not defined for this model")
        if torch.allclose(norm_in[l], block_in[l] + proj_out[l], atol=1e-4, rtol=1e-3):
            parts.append(LayerParts(proj[l], norm[l], bool(post[l])))
            continue
        gain = rms_gain(norm[l]) if torch.equal(norm_in[l], proj_out[l]) else None
        if gain is not None and after[l] is not None and after[l].shape == block_in[l].shape and \
                torch.allclose(after[l], block_in[l] + norm_out[l], atol=1e-4, rtol=1e-3):
            parts.append(LayerParts(proj[l], norm[l], False, sub_norm=True, gain=gain))
            continue
        raise ValueError(f"{name}: layer {l}: the input of {type(norm[l]).__name__} is not block input + output "
                         "projection, nor is it an RMS norm of the projection added to the block input (no plain "
                         "residual connection around attention, e.g. GPT-NeoX's parallel residual); "
                         "residual/LayerNorm decompositions (norm_res_ln, alti) are not defined for this model")
    _PARTS[model] = parts
    return parts


@torch.inference_mode()
def iter_attention(model: nn.Module, items, pad_id: int, device: str = "cpu", layers: Iterable[int] | None = None,
                   max_tokens: int = 4096, max_batch_size: int = 64, desc: str = "attention", progress: bool = True):
    """Yield ``(k, (L', H, T_k, T_k) float32 maps)`` for every :class:`~probes.model.inputs.Encoded` ``items[k]``.

    Items are run in length batches (right-padded; padded keys get zero attention, so cropping a map
    to the item's own length equals running it alone), in batch order, on ``device``; the forward
    stops after the last layer in ``layers`` (None: all).
    """
    model = model.to(device)
    batches = length_batches([it.n_pieces for it in items], max_tokens, max_batch_size)
    with attention(model, layers, stop=True) as s, \
            tqdm(total=len(items), desc=desc, unit="seq", disable=None if progress else True) as bar:
        for batch in batches:
            its = [items[b] for b in batch]
            s.run(**{k: v.to(device) for k, v in pad_encoded(its, pad_id).items()})
            attn = s.attentions().float()  # (B, L', H, T, T)
            for j, (k, it) in enumerate(zip(batch, its)):
                t = it.n_pieces
                yield k, attn[j, :, :, :t, :t]
            bar.update(len(its))


class PrefixCache:
    """Reuse the outputs of the blocks below the first changed layer (they cannot change).

    ``outs = PrefixCache.record(model, inputs)`` runs the plain model once and returns ``(result,
    outputs)``, the outputs of the embeddings and of every block; inside ``with PrefixCache.reuse(model,
    outputs, first_layer)`` the embeddings and blocks ``< first_layer`` return those stored outputs
    without computing, and the rest of the model runs as usual. Used by head disabling to score a
    change in layer l in about (L - l) / L of a forward. Not for shared-weight blocks (ALBERT).
    """

    @staticmethod
    def parts(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
        mods = blocks(model)
        if len(mods) != int(model.config.num_hidden_layers):
            raise ValueError(f"{type(model).__name__}: blocks are shared across layers; prefix reuse needs one per layer")
        emb = getattr(model.base_model, "embeddings", None)
        if emb is None:
            raise ValueError(f"{type(model).__name__}: no embeddings module")
        return emb, mods

    @classmethod
    def supported(cls, model: nn.Module) -> bool:
        try:
            cls.parts(model)
            return True
        except ValueError:
            return False

    @classmethod
    def record(cls, model: nn.Module, inputs: dict):
        emb, mods = cls.parts(model)
        outs, handles = [None] * (len(mods) + 1), []

        def keep(j):
            def hook(module, args, output):
                outs[j] = output
            return hook

        handles.append(emb.register_forward_hook(keep(0)))
        handles += [m.register_forward_hook(keep(j + 1)) for j, m in enumerate(mods)]
        try:
            result = model(**model_inputs(model, **inputs))
        finally:
            for h in handles:
                h.remove()
        return result, outs

    @classmethod
    @contextmanager
    def reuse(cls, model: nn.Module, outs: list, first_layer: int):
        emb, mods = cls.parts(model)
        shadowed = [emb] + mods[:first_layer]
        for j, m in enumerate(shadowed):
            m.forward = (lambda o: (lambda *a, **k: o))(outs[j])
        try:
            yield
        finally:
            for m in shadowed:
                del m.forward
