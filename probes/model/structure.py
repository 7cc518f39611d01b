"""Where a model's parts are, found by running it: any family, no module names.

The attention module of every layer (:func:`attention_sites`, in call order, so shared-weight layers
(ALBERT) work too), the transformer blocks (:func:`blocks`), each layer's output projection and the
LayerNorm / RMSNorm after it (:func:`layer_parts`, checked numerically), and helpers on them: the inputs a
model's forward takes (:func:`model_inputs`), one block as a function of its input hidden states
(:func:`block_function`), a projection's weight, an RMS norm's gain and a norm's epsilon. What is found is
kept on the model itself (a :class:`Structure` in its ``__dict__``), once per model object.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from probes.model.attention_function import listening, prepare
from probes.model.load import input_device

STRUCTURE = "_probes_structure"  # instance attribute of a model: its Structure


class StopForward(Exception):
    """Raised to end a model's forward early (after the last layer or block needed); caught by whoever runs it."""


class Structure:
    """What discovery found in one model (kept as ``model.__dict__[STRUCTURE]``).

    sites: the attention module of every layer, in layer order; parts: per layer, its :class:`LayerParts`;
    projections: per layer, the first linear layer after the attention function (None where none was found),
    set by :func:`layer_parts` also when the parts are not defined. None until found."""

    def __init__(self):
        self.sites: list[nn.Module] | None = None
        self.parts: list[LayerParts] | None = None
        self.projections: list[nn.Module | None] | None = None


def structure(model: nn.Module) -> Structure:
    """The :class:`Structure` kept on ``model`` (a new, empty one the first time)."""
    found = model.__dict__.get(STRUCTURE)
    if found is None:
        found = model.__dict__[STRUCTURE] = Structure()
    return found


class CallOrder:
    """Attention listener that appends each attention module to ``events`` as it is called."""

    def __init__(self, events: list):
        self.events = events

    def attend(self, module: nn.Module, weights: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """weights (B, H, T, T), value (B, H, T, d) -> (weights @ value (B, H, T, d), weights)."""
        self.events.append(module)
        return torch.matmul(weights, value), weights


def model_inputs(model: nn.Module, **inputs) -> dict:
    """``inputs`` without None values and without keys the model's forward does not take
    (DistilBERT has no ``token_type_ids``)."""
    params = inspect.signature(model.forward).parameters
    anykw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in inputs.items() if v is not None and (k in params or (anykw and k != "token_type_ids"))}


@torch.no_grad()
def attention_sites(model: nn.Module) -> list[nn.Module]:
    """The attention module of every layer, in layer order (a shared module appears once per layer)."""
    found = structure(model)
    if found.sites is not None:
        return found.sites
    prepare(model)
    device = input_device(model)  # a model placed across devices: its main device
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    sites: list[nn.Module] = []
    with listening(model.modules(), CallOrder(sites)):
        model(**model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids)))
    L = int(model.config.num_hidden_layers)
    if len(sites) != L:
        raise ValueError(f"{type(model).__name__}: found {len(sites)} attention calls in a forward, expected "
                         f"{L} (config.num_hidden_layers); is this an encoder of a supported family?")
    found.sites = sites
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
                    kwargs = {**kwargs, hidden_key(kwargs): x}
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


def hidden_key(kwargs: dict) -> str:
    """The name under which a block's forward got its hidden states as a keyword argument."""
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


def output_projections(model: nn.Module) -> list[nn.Module]:
    """Per layer, the heads' output projection (:func:`layer_parts`' ``proj``), also for blocks whose residual
    shape the decompositions do not cover (GPT-NeoX's parallel residual): what the ``norm`` kind needs."""
    try:
        return [p.proj for p in layer_parts(model)]
    except ValueError:
        projs = structure(model).projections
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
    found = structure(model)
    if found.parts is not None:
        return found.parts
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
            lambda mod, a, k: events.append(("block_in", a[0] if a else k[hidden_key(k)])), with_kwargs=True))
        handles.append(m.register_forward_hook(
            lambda mod, a, k, o: events.append(("block_out", o[0] if isinstance(o, (tuple, list)) else o)),
            with_kwargs=True))
    device = input_device(model)  # a model placed across devices: its main device
    vocab = int(getattr(model.config, "vocab_size", 100))
    ids = (torch.arange(7, device=device).unsqueeze(0) * 7 + 5) % vocab  # (1, 7) arbitrary real tokens
    was_training = model.training
    model.eval()  # no dropout between the projection and the residual sum
    try:
        # each attention module joins the events as it is called; exact residual check even in mixed precision
        with listening(model.modules(), CallOrder(events)), torch.autocast(device.type, enabled=False):
            model(**model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids)))
    finally:
        model.train(was_training)
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
    found.projections = proj
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
    found.parts = parts
    return parts
