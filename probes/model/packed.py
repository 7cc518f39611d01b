"""A BERT-style encoder's frozen forward on packed rows, for a model held in bf16 on a oneDNN CPU.

:func:`probes.model.frozen.held_in` installs :func:`install` on every module of this structure (per module
structure, not per model name): an encoder whose ``layer`` is a list of post-LN blocks, each ``attention.self``
(``query``, ``key``, ``value`` linear layers, ``num_attention_heads``, ``attention_head_size``),
``attention.output`` (``dense``, ``LayerNorm``), ``intermediate`` (``dense`` then an exact GELU) and
``output`` (``dense``, ``LayerNorm``): BERT, RoBERTa, ELECTRA, XLM-R, MiniLM. Other modules keep the generic path.

The hidden states of the real (unpadded) positions are kept as packed rows ``(N, D)`` through LayerNorm, the
linear layers, GELU and the residual sums; only the attention itself (scores, mask, softmax, ``A @ V``) runs
on the padded ``(B, H, T, d)`` layout, through :func:`probes.model.attention_function.finish_attention`, so
every session (capture, stop, interventions on the maps or values) works as on the generic path. Per layer:

* one oneDNN linear on the concatenated Q/K/V weights (``log2(e)/sqrt(d)`` folded into the query's weight and
  bias, in float32 before the cast: scores in base 2), its rows gathered to the padded positions and permuted
  to heads in one copy;
* scores ``Q K^T`` as one bmm, the mask and the largest score subtracted in one float32 pass, ``exp2`` over the
  whole tensor, one row sum and one division into bf16 (:func:`softmax2_rows`);
* the residual sums fused into the output projections (oneDNN ``add`` post-op), GELU into the intermediate one.

Positions that no query may see are the padding: they all take the rows of one more packed row, a copy of the
batch's first real position, so their keys and values are finite and get zero weight (masked), a padding row
of the maps is a distribution over the sentence's keys (the generic path computes it from the padding's own
hidden state; both are pooled out by the extractor), and the encoder's output is zero there. Real rows are the
same computation as the generic path up to bf16 rounding (``tests/test_frozen.py``). The generic forward is
used whenever something could observe or change what this one skips: hooks on the encoder's modules (block
internals, ``output_attentions``, ``layer_parts``), a replaced forward (prefix reuse), gradients, training,
cross-attention or a cache, another attention implementation, or inputs not on the CPU / not in bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from probes.model.attention_function import IMPLEMENTATION, finish_attention

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453  # log2(e), ln(2)
Fp32 = Callable[[nn.Module, str], torch.Tensor]  # (module, parameter name) -> its float32 data


def bert_style_layer(layer: nn.Module, exact_gelu: Callable[[nn.Module], bool]) -> bool:
    """Whether ``layer`` has the post-LN BERT block structure this forward computes (see the module docstring)."""
    att = getattr(layer, "attention", None)
    sa, so = getattr(att, "self", None), getattr(att, "output", None)
    inter, out = getattr(layer, "intermediate", None), getattr(layer, "output", None)
    if not all(isinstance(m, nn.Module) for m in (att, sa, so, inter, out)):
        return False
    linears = [getattr(sa, "query", None), getattr(sa, "key", None), getattr(sa, "value", None),
               getattr(so, "dense", None), getattr(inter, "dense", None), getattr(out, "dense", None)]
    norms = [getattr(so, "LayerNorm", None), getattr(out, "LayerNorm", None)]
    H, d = getattr(sa, "num_attention_heads", None), getattr(sa, "attention_head_size", None)
    return (all(isinstance(m, nn.Linear) for m in linears) and all(isinstance(m, nn.LayerNorm) for m in norms)
            and isinstance(H, int) and isinstance(d, int) and linears[0].out_features == H * d
            and linears[1].out_features == H * d and linears[2].out_features == H * d
            and exact_gelu(getattr(inter, "intermediate_act_fn", None))
            and not getattr(layer, "add_cross_attention", False) and not getattr(layer, "is_decoder", False)
            and not getattr(sa, "is_decoder", False) and not getattr(sa, "is_causal", False)
            and getattr(sa, "position_embedding_type", "absolute") == "absolute"
            and not getattr(layer, "chunk_size_feed_forward", 0))


def bert_style_encoder(m: nn.Module, exact_gelu: Callable[[nn.Module], bool]) -> bool:
    """An encoder module whose ``layer`` is a ``nn.ModuleList`` of :func:`bert_style_layer` blocks."""
    layers = getattr(m, "layer", None)
    if not (isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(bert_style_layer(l, exact_gelu)
                                                                          for l in layers)):
        return False
    shapes = {(l.attention.self.num_attention_heads, l.attention.self.attention_head_size) for l in layers}
    return len(shapes) == 1  # one head layout for the whole encoder (:class:`Rows`)


class PackedLayer:
    """One block's weights, packed once for oneDNN (bf16); see :func:`install`."""

    def __init__(self, layer: nn.Module, fp32: Fp32, dtype: torch.dtype, rows: int):
        sa, so = layer.attention.self, layer.attention.output
        self.attn, self.H, self.d = sa, sa.num_attention_heads, sa.attention_head_size
        scale = float(getattr(sa, "scaling", self.d ** -0.5)) * LOG2E  # scores in base 2 (softmax2_rows)

        def bias(m: nn.Linear, factor: float = 1.0) -> torch.Tensor:
            b = fp32(m, "bias") if m.bias is not None else torch.zeros(m.out_features)
            return b * factor

        def pack(w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), rows)

        w_qkv = torch.cat([fp32(sa.query, "weight") * scale, fp32(sa.key, "weight"), fp32(sa.value, "weight")])
        self.qkv_w = pack(w_qkv)  # (3 H d, D)
        self.qkv_b = torch.cat([bias(sa.query, scale), bias(sa.key), bias(sa.value)]).to(dtype)  # (3 H d,)
        self.proj_w, self.proj_b = pack(fp32(so.dense, "weight")), bias(so.dense).to(dtype)
        inter, out = layer.intermediate.dense, layer.output.dense
        self.inter_w, self.inter_b = pack(fp32(inter, "weight")), bias(inter).to(dtype)
        self.out_w, self.out_b = pack(fp32(out, "weight")), bias(out).to(dtype)
        self.norm1, self.norm2 = so.LayerNorm, layer.output.LayerNorm

    def __call__(self, x: torch.Tensor, rows: "Rows", mask: torch.Tensor | None) -> torch.Tensor:
        """x: (N + 1, D) packed rows (:class:`Rows`); mask: (B, 1, T, T) additive or None. Returns the block's
        output rows (N + 1, D)."""
        B, T, H, d = rows.B, rows.T, self.H, self.d
        qkv = torch.ops.mkldnn._linear_pointwise(x, self.qkv_w, self.qkv_b, "none", [], "")  # (N + 1, 3 H d)
        padded = qkv.index_select(0, rows.row_of).view(B, T, 3, H, d)  # (B, T, 3, H, d)
        heads = padded.permute(2, 0, 3, 1, 4).contiguous()  # (3, B, H, T, d)
        q, k, v = heads[0], heads[1], heads[2]  # (B, H, T, d) each; q scaled by log2(e) / sqrt(d)
        scores = torch.bmm(q.view(B * H, T, d), k.view(B * H, T, d).transpose(1, 2)).view(B, H, T, T)
        probs = softmax2_rows(scores, mask)  # (B, H, T, T)
        out, _ = finish_attention(self.attn, probs, v, mask, heads_first=True)  # (B, H, T, d)
        ctx = out.reshape(-1, d).index_select(0, rows.from_heads).view(-1, H * d)  # (N + 1, H d)
        a = torch.ops.mkldnn._linear_pointwise.binary(ctx, x, self.proj_w, self.proj_b, "add")  # proj + x (N + 1, D)
        a = _layer_norm(a, self.norm1)  # (N + 1, D)
        h = torch.ops.mkldnn._linear_pointwise(a, self.inter_w, self.inter_b, "gelu", [], "none")  # (N + 1, F)
        y = torch.ops.mkldnn._linear_pointwise.binary(h, a, self.out_w, self.out_b, "add")  # out + a (N + 1, D)
        return _layer_norm(y, self.norm2)  # (N + 1, D)


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` without the module call (no hooks run on the packed path)."""
    return nn.functional.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def softmax2_rows(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``2^x / sum 2^x`` over the last dim of ``x = scores + mask`` (scores (B, H, T, T) in base 2, i.e. times
    log2(e); mask (B, 1, T, T) additive or None), computed in float32, returned in the scores' dtype: softmax.

    Short rows (T of 6 to 40 here) make the row-wise kernel slow, so the largest score of the whole tensor is
    subtracted instead of each row's (exp2 over the whole tensor, then one row sum and one division): the same
    softmax while no row's largest score lies far below it; where one does (a row sum under ``1e-30``), the
    row-wise kernel is used. All of it runs in place on one float32 copy of the scores: the largest score is
    subtracted with the mask in one pass, and the division is rounded to the scores' dtype once at the end.
    ``exp2`` rather than ``exp``: torch's CPU ``exp`` is 3-10x slower on inputs whose
    result underflows (the masked keys, scores far below the largest); folding log2(e) into the query's weights
    saves the multiplication."""
    m = scores.max().float()  # () the largest score (a padding key's too: any bound of the real ones will do)
    e = scores.to(torch.float32, copy=True)  # (B, H, T, T) float32, never the scores themselves
    if mask is None:
        e.sub_(m)
    else:  # in place, float32 on float32 (a bf16 + float32 add into a new tensor takes twice as long)
        e.add_(mask.float() - m)  # mask (B, 1, T, T) shifted by the largest score
    e.exp2_()
    z = e.sum(-1, keepdim=True)  # (B, H, T, 1)
    if not bool(z.min() >= 1e-30):
        x = (scores if mask is None else scores + mask).float() * LN2  # (B, H, T, T) natural-log scores
        return torch.softmax(x, dim=-1).to(scores.dtype)
    return e.div_(z).to(scores.dtype)  # (B, H, T, T): divided in float32, rounded once


class Rows:
    """Where the packed rows of a padded batch (B, T) go. The rows are the N real positions (``index``, flat into
    B * T) and one more, a copy of the first real one, that stands for every padding position (so it is as finite
    as a real row; masked keys get zero weight). ``row_of`` (B T,) is the row of each padded position (a gather
    of whole rows, then one permuting copy to heads, is faster than gathering each head's (d,) slice);
    ``from_heads`` ((N + 1) H,) picks, from the heads' output (B, H, T, d) viewed as (B H T, d), each row's (H, d)
    in order."""

    def __init__(self, index: torch.Tensor, B: int, T: int, H: int):
        self.B, self.T, self.N = B, T, int(index.numel())
        self.index = torch.cat([index, index[:1]])  # (N + 1,) padded position of each row
        self.row_of = torch.full((B * T,), self.N, dtype=torch.long)  # (B T,) the row of each padded position
        self.row_of[index] = torch.arange(self.N)
        b, t = self.index // T, self.index % T  # (N + 1,) each
        self.from_heads = ((b.view(-1, 1) * H + torch.arange(H)) * T + t.view(-1, 1)).reshape(-1)  # ((N + 1) H,)


def _observed(modules: list[nn.Module], encoder: nn.Module) -> bool:
    """Whether anything could observe or change the calls of ``modules`` (the encoder's: hooks, a replaced
    forward)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return True
        if "forward" in m.__dict__ and m is not encoder and not isinstance(m, nn.Linear):  # held_in's own aside
            return True
    return False


def _real_positions(mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor | None:
    """(N,) flat indices (into B * T) of the positions some query may see; None when the mask is not a
    (B, 1|H, T, T) additive or boolean tensor (a described mask of blocks, :mod:`probes.model.blockwise`)."""
    if mask is None:
        return torch.arange(B * T)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] != B or mask.shape[-2:] != (T, T):
        return None
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # (B, 1|H, T, T)
    return seen.any(dim=2).any(dim=1).view(-1).nonzero().squeeze(1)  # (N,)


def install(encoder: nn.Module, fp32: Fp32, dtype: torch.dtype, rows: int) -> Callable[[], None]:
    """Give a :func:`bert_style_encoder` module the packed forward (weights packed now, from their float32 data
    ``fp32``); returns the function that restores its own forward."""
    original = encoder.forward
    layers = [PackedLayer(l, fp32, dtype, rows) for l in encoder.layer]
    config = getattr(encoder, "config", None)
    modules = list(encoder.modules())  # (found once: walking the module tree at every forward costs 2 ms)

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs):
        B, T, D = hidden_states.shape if hidden_states.dim() == 3 else (0, 0, 0)
        usable = (hidden_states.dim() == 3 and hidden_states.is_cpu and hidden_states.dtype == dtype
                  and not any(a is not None for a in args) and kwargs.get("encoder_hidden_states") is None
                  and kwargs.get("cache") is None and kwargs.get("past_key_values") is None
                  and not kwargs.get("use_cache") and not encoder.training and not torch.is_grad_enabled()
                  and getattr(config, "_attn_implementation", IMPLEMENTATION) == IMPLEMENTATION
                  and not _observed(modules, encoder))
        index = _real_positions(attention_mask, B, T) if usable else None
        if index is None or not index.numel() or (attention_mask is not None
                                                  and attention_mask.dtype not in (dtype, torch.bool)):
            return original(hidden_states, attention_mask, *args, **kwargs)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=dtype).masked_fill_(~attention_mask,
                                                                                        torch.finfo(dtype).min)
        rows = Rows(index, B, T, layers[0].H)
        x = hidden_states.reshape(B * T, D).index_select(0, rows.index)  # (N + 1, D)
        for layer in layers:
            x = layer(x, rows, attention_mask)
        out = x.new_zeros(B * T, D).index_copy_(0, index, x[:-1]).view(B, T, D)  # (B, T, D), zero at the padding
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=out)

    encoder.forward = forward

    def restore() -> None:
        encoder.__dict__.pop("forward", None)

    return restore
