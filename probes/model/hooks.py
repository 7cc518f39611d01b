"""Attention sessions: capture and head interventions inside one ``with attention(model, ...)`` block.

Inside a :class:`Session` (the attention modules' listener, :mod:`probes.model.attention_function`) the
project's attention function can

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
  modules are found once per model by :func:`probes.model.structure.layer_parts`), zero chosen tokens' value
  vectors in every head (``zero_values``, value zeroing), replace block inputs (``block_inputs``) and stop
  after a block (``stop_block``).

Long sequences (``rows_per_block``): each layer's attention is computed in blocks of query rows
(:mod:`probes.model.blockwise`), and the probabilities of the captured layers go, block by block, to a reducer
(``reduce``: ``update(layer, probs (B, H, q, c), rows, cols)``, e.g. :mod:`probes.maps.reducers`) instead of being
kept; the whole ``(B, H, T, T)`` map and mask are never made. Uniform heads, gates, value zeroing, values,
internals and early stops work as on the whole map; keeping whole maps (``probs``) and ``retain_grad`` are refused.
A reducer also works without blocks: it then gets each captured layer's whole map as one block.

Layer indices come from the order in which the attention sites are called in one forward
(:func:`probes.model.structure.attention_sites`), so shared-weight layers (ALBERT) work too. While a session
is active it is set on the model's attention modules; a second session on the same model is an error.

A model placed across devices (``encoder.device_map``) runs each layer on its own device: what a session keeps is
gathered to the device of the forward's inputs, so ``probs``, values and internals of all layers sit on one device
as for a model on one device. A tensor that requires grad stays on its layer's device (a copy would be cut off
from the graph: its ``.grad`` never set, ``autograd.grad`` unable to reach it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Protocol

import torch
from torch import nn

from probes.model.attention_function import listener_of, listening
from probes.model.blockwise import Block, compact_masks
from probes.model.structure import StopForward, attention_sites, blocks, hidden_key, layer_parts, model_inputs


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


class Reducer(Protocol):
    """What a session hands the captured layers' probabilities to when it does not keep them
    (:mod:`probes.maps.reducers`)."""

    def update(self, layer: int, probs: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """probs (B, H, b - a, hi - lo) of model layer ``layer`` (0-based), query rows ``rows = (a, b)``, keys
        ``cols = (lo, hi)`` (every other key has probability 0 for these rows)."""


# ----------------------------------------------------------------------------- sessions
class Session:
    """What one ``with attention(model, ...)`` block captures and changes; see :func:`attention`.

    Args:
        model: a model on the project's attention path.
        layers: 0-based layers whose probabilities (B, H, T, T) are captured (None: all; [] none).
        stop: end the forward after the last captured layer.
        uniform: {layer: heads} attending uniformly to the keys they may see.
        gates: (L, H) factors on each head's output, or None.
        values: keep per-head values (B, H, T, d) and outputs (B, T, H, d).
        retain_grad: keep ``.grad`` of the captured probabilities after ``backward()``.
        internals: keep each block's internals (see :func:`attention`), each (B, T, D).
        block_inputs: {layer: (B, T, D)} hidden states that replace the input of that block.
        zero_values: (B, T) bool, or {layer: (B, T) bool}: positions whose value vectors are zeroed.
        stop_block: end the forward right after that block.
        block_io: keep ``block_input`` and ``block_output`` (B, T, D) only.
        reduce: the captured layers' probabilities go to ``reduce.update`` (whole maps or blocks) and are not kept.
        rows_per_block: compute every layer's attention in blocks of this many query rows (None: whole maps);
            needs ``reduce`` when layers are captured.
    """

    def __init__(self, model: nn.Module, *, layers: Iterable[int] | None = None, stop: bool = False,
                 uniform: dict[int, Iterable[int]] | None = None, gates: torch.Tensor | None = None,
                 values: bool = False, retain_grad: bool = False, internals: bool = False,
                 block_inputs: dict[int, torch.Tensor] | None = None,
                 zero_values: torch.Tensor | dict[int, torch.Tensor] | None = None, stop_block: int | None = None,
                 block_io: bool = False, reduce: Reducer | None = None, rows_per_block: int | None = None):
        self.model = model
        self.sites = attention_sites(model)
        L = len(self.sites)
        self.capture = sorted(set(range(L) if layers is None else (int(l) for l in layers)))
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
        self.device: torch.device | None = None  # where the forward's inputs are: what is kept is gathered there
        self.keep_blocks = internals or block_io
        self._need_blocks = self.keep_blocks or bool(self.block_inputs) or stop_block is not None
        self.parts = layer_parts(model) if internals else None
        self.reduce = reduce
        self.rows_per_block = None if rows_per_block is None else int(rows_per_block)
        if self.rows_per_block is not None:
            if self.rows_per_block < 1:
                raise ValueError(f"rows_per_block must be >= 1, got {rows_per_block}")
            if retain_grad:
                raise ValueError("retain_grad needs the whole maps; attention in blocks (rows_per_block) never "
                                 "makes them")
            if self.capture and reduce is None:
                raise ValueError("attention in blocks (rows_per_block) keeps no whole maps: give a reducer "
                                 "(reduce=...) for the captured layers, or capture none (layers=[])")

    def attend(self, module: nn.Module, weights: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention modules' listener (called from ``finish_attention``): the session's interventions and
        capture around ``weights @ value``. weights (B, H, T, T), value (B, H, T, d) -> (output (B, H, T, d),
        weights as used (B, H, T, T))."""
        layer = self._next_layer(module)
        weights = self._edit(layer, weights, mask)
        value = self._edit_value(layer, value)
        out = torch.matmul(weights, value)  # (B, H, T, d)
        return self._after(layer, weights, value, out), weights

    def block_rows(self, module: nn.Module, batch: int, heads: int, queries: int) -> int | None:
        """Query rows per block (``rows_per_block``), or None for whole maps."""
        return self.rows_per_block

    def attend_blocks(self, module: nn.Module, blocks: Iterator[Block], value: torch.Tensor) -> torch.Tensor:
        """The listener of a layer computed in blocks (:func:`probes.model.attention_function.attend`): per block
        the interventions on its probabilities, the reducer, ``probs @ value[:, :, lo:hi]``; value (B, H, T, d) ->
        output (B, H, T, d)."""
        layer = self._next_layer(module)
        value = self._edit_value(layer, value)  # (B, H, T, d)
        out = torch.empty_like(value)  # (B, H, T, d)
        for block in blocks:
            a, b = block.rows
            lo, hi = block.cols
            w = self._edit_block(layer, block)  # (B, H, b - a, hi - lo)
            out[:, :, a:b] = torch.matmul(w, value[:, :, lo:hi])
            del w, block
        return self._after(layer, None, value, out)

    def _edit_block(self, layer: int, block: Block) -> torch.Tensor:
        """:meth:`_edit` of one block: uniform heads over the keys its rows may see, then the reducer."""
        w = self._uniform(layer, block.probs, block.mask)  # (B, H, q, c)
        if layer in self.capture:
            self.reduce.update(layer, self._gather(w), block.rows, block.cols)
        return w

    def _next_layer(self, module) -> int:
        k = id(module)
        layers = self._layers[k]
        n = self._calls.get(k, 0)
        self._calls[k] = n + 1
        return layers[n % len(layers)]

    def _edit(self, layer: int, w: torch.Tensor, mask) -> torch.Tensor:
        w = self._uniform(layer, w, mask)
        if layer in self.capture:
            if self.reduce is not None:  # on the inputs' device, as what a session keeps
                self.reduce.update(layer, self._gather(w), (0, w.shape[-2]), (0, w.shape[-1]))
                return w
            if self.retain_grad and w.requires_grad:
                w.retain_grad()
            self.probs[layer] = self._gather(w)
        return w

    def _uniform(self, layer: int, w: torch.Tensor, mask) -> torch.Tensor:
        """``w`` (B, H, q, c) with the ``uniform`` heads of ``layer`` attending uniformly to the keys they may see
        (mask (B, 1|H, q|1, c) or None)."""
        heads = self.uniform.get(layer)
        if heads:
            H = w.shape[1]
            for h in heads:
                _check(h, H, "head")
            real = _real_keys(mask, w).to(w.dtype)  # (B, 1|H, q, c)
            u = real / real.sum(-1, keepdim=True).clamp(min=1)
            sel = torch.zeros(H, dtype=torch.bool, device=w.device)
            sel[heads] = True
            w = torch.where(sel.view(1, H, 1, 1), u.expand_as(w), w)
        return w

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the inputs' device (layers of a placed model run on several); as it is when it is there
        already, when the device is unknown, or when ``t`` requires grad (see the module docstring)."""
        if self.device is None or t.device == self.device or t.requires_grad:
            return t
        return t.to(self.device)

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
            self.value[layer] = self._gather(value)
            self.output[layer] = self._gather(out.transpose(1, 2))
        if self.stop_after is not None and layer == self.stop_after:
            raise StopForward
        return out

    def reset(self) -> None:
        """Forget what the last forward captured (called before each :meth:`run`)."""
        self.probs, self.value, self.output, self._calls = {}, {}, {}, {}
        self.block_input, self.block_output, self.proj_output, self.residual_sum, self.norm_output = {}, {}, {}, {}, {}
        self.norm_input = {}
        self._block_calls, self._last_layer = 0, -1

    def _begin(self, module=None, args=(), kwargs=None) -> None:
        """Start of a model forward (the model's forward pre-hook): layer counters back to 0, the inputs' device
        noted (that of the first tensor among ``args`` and ``kwargs``)."""
        self._calls.clear()
        self._block_calls, self._last_layer = 0, -1
        first = next((v for v in (*args, *(kwargs or {}).values()) if isinstance(v, torch.Tensor)), None)
        self.device = None if first is None else first.device

    # block hooks (installed by attention() when internals / block_inputs / stop_block are used)
    def _block_pre(self, module, args, kwargs):
        layer = self._block_calls
        x = args[0] if args else kwargs[hidden_key(kwargs)]
        if layer in self.block_inputs:
            x = self.block_inputs[layer].to(dtype=x.dtype, device=x.device)
            if args:
                args = (x, *args[1:])
            else:
                kwargs = {**kwargs, hidden_key(kwargs): x}
        if self.keep_blocks:
            self.block_input[layer] = self._gather(x)
        return args, kwargs

    def _block_post(self, module, args, kwargs, output):
        layer = self._block_calls
        self._block_calls += 1
        if self.keep_blocks or self.stop_block is not None:
            self.block_output[layer] = self._gather(output[0] if isinstance(output, (tuple, list)) else output)
        if self.stop_block is not None and layer == self.stop_block:
            raise StopForward

    def _proj_post(self, module, args, output):
        l = self._last_layer
        if l >= 0 and l not in self.proj_output and self.parts[l].proj is module:
            self.proj_output[l] = self._gather(output)

    def _norm_post(self, module, args, output):
        l = self._last_layer
        if l >= 0 and l in self.proj_output and l not in self.residual_sum and self.parts[l].norm is module:
            self.norm_output[l] = self._gather(output)
            if self.parts[l].sub_norm:  # the norm acts on the heads' output; the residual is added after it
                self.norm_input[l] = self._gather(args[0])
                self.residual_sum[l] = self._gather(self.block_input[l].to(output.device) + output)
            else:
                self.residual_sum[l] = self._gather(args[0])

    def run(self, **inputs):
        """One forward of the model (keys it does not take are dropped); None when stopped early."""
        self.reset()
        try:
            with compact_masks() if self.rows_per_block is not None else nullcontext():
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
              block_io: bool = False, reduce: Reducer | None = None, rows_per_block: int | None = None):
    """``with attention(model, layers=[...], stop=True) as s: s.run(**batch); s.probs[l]`` (B, H, T, T).

    layers: 0-based layers to capture (None: all; [] none). stop: end the forward after the last of
    them. uniform: {layer: heads} attending uniformly to the keys they may see. gates: (L, H) factors on
    each head's output. values: keep per-head values (B, H, T, d) and outputs (B, T, H, d).
    retain_grad: keep ``.grad`` of the captured probabilities after ``backward()``.

    Block internals (any family; the parts are found by :func:`probes.model.structure.layer_parts`):
    internals: keep per layer ``block_input``, ``block_output``, ``proj_output`` (the heads' output
    projection, bias included), ``residual_sum`` (block input + proj_output, the input of the LayerNorm
    that follows; with a sub-layer norm (Gemma 2/3, OLMo 2) block input + that norm's output) and
    ``norm_output`` (and ``norm_input`` for sub-layer norms), each (B, T, D); ``s.parts[l]`` names the modules.
    block_io: keep ``block_input`` and ``block_output`` only (no search for the parts).
    block_inputs: {layer: (B, T, D)} hidden states that replace the input of that block (the blocks
    below still run; their output is discarded). zero_values: (B, T) bool, or {layer: (B, T) bool}:
    the value vectors of the marked positions are zero in every head (value zeroing). stop_block: end
    the forward right after that block.

    Long sequences: ``rows_per_block`` computes every layer's attention in blocks of that many query rows (no
    whole map, no whole mask); ``reduce`` gets the captured layers' probabilities (``reduce.update(layer, probs
    (B, H, q, c), (a, b), (lo, hi))``, whole maps as one block without ``rows_per_block``) instead of ``s.probs``.
    """
    session = Session(model, layers=layers, stop=stop, uniform=uniform, gates=gates, values=values,
                      retain_grad=retain_grad, internals=internals, block_inputs=block_inputs,
                      zero_values=zero_values, stop_block=stop_block, block_io=block_io, reduce=reduce,
                      rows_per_block=rows_per_block)
    if any(listener_of(m) is not None for m in session.sites):
        raise RuntimeError("another attention session is active on this model")
    handles = [model.register_forward_pre_hook(session._begin, with_kwargs=True)]
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
        with listening(session.sites, session):
            yield session
    finally:
        for h in handles:
            h.remove()
