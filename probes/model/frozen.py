"""A frozen model held in a low-precision dtype for inference, weights and activations alike (no casts), and the
compute dtypes of a Lightning precision (:func:`compute_in`).

``with held_in(model, torch.bfloat16): ...`` casts every floating parameter and buffer of ``model`` to
bf16 in place (the same ``Parameter`` objects; their float32 data is put back on exit, bit for bit), so
that the whole forward (embeddings, LayerNorm, residual sums, attention, feed-forward) runs in bf16: no
autocast cast of a weight, of a LayerNorm output (once per Q, K and V), or of a softmax output. The CPU
kernels of LayerNorm, softmax and GELU accumulate bf16 inputs in float32.

On a CPU with oneDNN bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) every ``nn.Linear`` also
runs as oneDNN's linear on a weight reordered once (``_reorder_linear_weight``, at its first call) instead of
at every call, and the GELU of a transformers ``*Intermediate`` block (``dense`` then an exact-erf GELU,
BERT/RoBERTa/ELECTRA/MiniLM) is fused into its ``dense`` projection as a oneDNN post-op. A BERT-style encoder
(:func:`probes.model.packed.bert_style_encoder`, by structure) also gets the forward of
:mod:`probes.model.packed`: hidden states on packed (unpadded) rows, fused Q/K/V, padded only for the attention.

Weights loaded in bfloat16 or float16 (``encoder.dtype``, :mod:`probes.model.load`) are computed in that dtype:
``32-true`` adds no casts (the cache key names the weights' dtype, so such maps never pass for float32 ones) and the
mixed precision of the same dtype holds them as they are; a precision that would round them again to the other half
dtype is refused (:func:`check_compute`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.activations import GELUActivation

from probes.model import packed

LINEAR_PACK_ROWS = 2048  # the batch rows (B * T) oneDNN's weight reorder is tuned for


def packed_linear_supported(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether :func:`held_in` runs ``model``'s linear layers as oneDNN bf16 linears on packed weights."""
    p = next(model.parameters(), None)
    return (dtype == torch.bfloat16 and p is not None and p.device.type == "cpu"
            and not any(q.is_meta for q in model.parameters())  # offloaded layers (encoder.device_map): weights load per call
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _exact_gelu(act: nn.Module) -> bool:
    """An exact (erf) GELU module: ``nn.GELU()`` or transformers' ``GELUActivation`` on ``F.gelu``."""
    if isinstance(act, nn.GELU):
        return act.approximate == "none"
    return type(act) is GELUActivation and getattr(act, "act", None) is nn.functional.gelu


def _packed_forward(linear: nn.Linear, post_op: str) -> callable:
    """``x (..., in) -> (..., out)``: ``linear`` (then GELU when ``post_op == "gelu"``) as one oneDNN call; the
    weight is reordered at the first call (never, for the layers of an encoder on packed rows)."""
    packed_weight: list[torch.Tensor] = []  # the reordered weight, once made
    bias = None if linear.bias is None else linear.bias.detach()
    algorithm = "none" if post_op == "gelu" else ""  # the GELU's approximation: none = erf

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:  # the model was moved after entering (a Trainer on a GPU): the module's own weights
            y = nn.functional.linear(x, linear.weight, linear.bias)
            return nn.functional.gelu(y) if post_op == "gelu" else y
        if not packed_weight:
            packed_weight.append(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), LINEAR_PACK_ROWS))
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed_weight[0], bias, post_op, [],
                                               algorithm)
        return y.view(*x.shape[:-1], y.shape[-1])

    return forward


@contextmanager
def held_in(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """Inside the block every floating parameter and buffer of ``model`` is held in ``dtype`` (see the module
    docstring; bf16 on a oneDNN CPU: packed linear layers, fused GELU); everything is restored on exit.
    For inference only: the packed linear layers keep the weights they were entered with."""
    saved: list[tuple[nn.Module, str, bool, torch.Tensor]] = []  # (module, name, is parameter, original data)
    patched: list[nn.Module] = []  # linear layers whose forward was replaced
    acts: list[tuple[nn.Module, nn.Module]] = []  # (*Intermediate block, its GELU) fused into its dense layer
    restores: list = []  # functions restoring the encoders given the packed-rows forward
    offloaded: list[tuple[nn.Module, str, nn.Parameter]] = []  # (module, name, meta parameter) replaced in dtype
    try:
        for m in model.modules():
            for table, is_param in ((m._parameters, True), (m._buffers, False)):
                for name, t in list(table.items()):
                    if t is None or not t.is_floating_point() or t.dtype == dtype:  # a tied one: cast already
                        continue
                    if is_param and t.is_meta:  # offloaded (encoder.device_map): loaded per call in its dtype
                        offloaded.append((m, name, t))
                        table[name] = nn.Parameter(t.data.to(dtype), requires_grad=t.requires_grad)
                        continue
                    saved.append((m, name, is_param, t.data))
                    if is_param:
                        t.data = t.data.to(dtype)
                    else:
                        table[name] = t.to(dtype)
        if packed_linear_supported(model, dtype):
            fp32 = {(id(m), name): data for m, name, is_param, data in saved if is_param}
            for m in model.modules():  # BERT-style encoders: packed rows (probes.model.packed), before the GELU fusion
                if packed.bert_style_encoder(m, _exact_gelu):
                    restores.append(packed.install(m, lambda mod, name: fp32.get(
                        (id(mod), name), getattr(mod, name).detach()).float(), dtype, LINEAR_PACK_ROWS))
            fused = set()
            for m in model.modules():
                act = getattr(m, "intermediate_act_fn", None)
                dense = getattr(m, "dense", None)
                if type(m).__name__.endswith("Intermediate") and isinstance(dense, nn.Linear) and _exact_gelu(act):
                    dense.forward = _packed_forward(dense, "gelu")
                    acts.append((m, act))
                    m.intermediate_act_fn = nn.Identity()
                    fused.add(dense)
                    patched.append(dense)
            for m in model.modules():
                if isinstance(m, nn.Linear) and m not in fused and "forward" not in m.__dict__:
                    m.forward = _packed_forward(m, "none")
                    patched.append(m)
        yield model
    finally:
        for restore in restores:
            restore()
        for m in patched:
            m.__dict__.pop("forward", None)
        for m, act in acts:
            m.intermediate_act_fn = act
        for m, name, is_param, data in reversed(saved):
            if is_param:
                m._parameters[name].data = data
            else:
                m._buffers[name] = data
        for m, name, param in reversed(offloaded):
            m._parameters[name] = param


# ----------------------------------------------------------------------------- compute dtypes of a precision
LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # autocast's compute dtype
HELD = {"bf16-mixed": torch.bfloat16}  # mixed precisions whose attention extraction holds the whole model in it
HALF = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "bf16": torch.bfloat16,
        "16-mixed": torch.float16, "16-true": torch.float16, "16": torch.float16}
NO_CAST = ("32-true", "32")  # precisions that compute in the weights' own dtype


def computes_in(precision: str, weights: torch.dtype) -> torch.dtype | None:
    """The dtype a forward under ``precision`` computes in on ``weights`` of that dtype; None when it cannot be
    honoured: half weights (``encoder.dtype``) under a precision of the other half dtype, or of float64 (the
    weights would be rounded twice, or widened after rounding).

    Float32 weights: the precision's own dtype. bfloat16 or float16 weights: their dtype, under ``32-true``
    (no casts) or the mixed and true precisions of that same dtype."""
    precision = str(precision)
    if weights == torch.float32:
        return HALF.get(precision, torch.float64 if precision.startswith("64") else torch.float32)
    if precision in NO_CAST or HALF.get(precision) == weights:
        return weights
    return None


def check_compute(weights: torch.dtype, precision: str) -> torch.dtype:
    """:func:`computes_in`, or a ValueError naming ``extract.precision`` and ``encoder.dtype`` and what fits."""
    dtype = computes_in(precision, weights)
    if dtype is None:
        name = str(weights).removeprefix("torch.")
        fits = "bf16-mixed" if weights == torch.bfloat16 else "16-mixed"
        raise ValueError(f"extract.precision={precision} does not go with encoder.dtype={name}: the weights are held "
                         f"in {name}, and this precision would compute in another dtype after rounding them; use "
                         f"extract.precision=32-true or {fits} (both compute in {name}), or encoder.dtype=float32")
    return dtype


def weights_dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating parameters (the first one's; float32 without any)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@contextmanager
def linears_in(model: nn.Module, precision: str) -> Iterator[None]:
    """Inside the block, every ``nn.Linear``'s weight and bias are held in the compute dtype of a mixed
    ``precision`` (``bf16-mixed``, ``16-mixed``; other precisions: nothing changes); restored after.

    Autocast casts a float32 weight to the compute dtype at every call (its cast cache only keeps leaves
    that require grad); a weight already in that dtype is used as it is, so the results are bit-identical
    while each weight is cast once per extraction instead of once per batch and layer."""
    dtype = LOW_PRECISION.get(str(precision))
    saved = []  # (module, fp32 weight, fp32 bias)
    if dtype is not None:
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32:
                saved.append((m, m.weight, m.bias))
                m.weight = nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
                if m.bias is not None:
                    m.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
    try:
        yield
    finally:
        for m, w, b in saved:
            m.weight, m.bias = w, b


@contextmanager
def compute_in(model: nn.Module, precision: str) -> Iterator[torch.dtype]:
    """The frozen attention forward's dtypes under a Lightning ``precision``; yields the dtype to pool words in.

    bf16-mixed: the whole model held in bf16 (:func:`held_in`: no casts; oneDNN packed linear layers on a CPU,
    BERT-style encoders on packed rows, :mod:`probes.model.packed`) and words pooled in bf16 (matmuls accumulate
    in float32); 16-mixed: the linear layers' weights in float16 (:func:`linears_in`); others: nothing changes.
    Pooling in float32 unless held. Weights in bfloat16 or float16 are checked against the precision first
    (:func:`check_compute`: a ValueError naming ``extract.precision`` and ``encoder.dtype``)."""
    check_compute(weights_dtype_of(model), precision)
    dtype = HELD.get(str(precision))
    if dtype is None:
        with linears_in(model, precision):
            yield torch.float32
    else:
        with held_in(model, dtype):
            yield dtype
