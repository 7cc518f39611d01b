"""Norm-based measures and ALTI: the attention sub-layer output decomposed into one vector per source token.

Per layer, with the head values ``v^h_j`` (B, H, T, d; value projection with its bias, from
``hooks.attention(values=True)``) and the output projection ``W_O`` (D, H*d) of the layer
(:func:`probes.model.structure.layer_parts`), the transformed vectors are ``f^h(x_j) = v^h_j W_O^h``
(D,; the output bias left out) and the attention sub-layer output before the residual is
``z_i = sum_j sum_h alpha^h_ij f^h(x_j) + b_O``.

* ``norm`` (Kobayashi et al. 2020, *Attention is Not Only a Weight*; reference: ``weighted_norm`` in
  github.com/gorokoba560/norm-analysis-of-transformer): ``||alpha^h_ij f^h(x_j)||_2`` per head,
  computed as ``alpha^h_ij ||f^h(x_j)||`` (alpha >= 0).
* ``norm_res_ln`` (Kobayashi et al. 2021, *Incorporating Residual and Normalization Layers into Analysis
  of Masked Language Models*; reference ``post_ln_norm``, "AttnResLn-N"), per layer: with
  ``S_ij = sum_h alpha^h_ij f^h(x_j) + [i = j] x_i`` (x = the block input, the residual), post-LN blocks
  ``T_i(x_j) = gamma * (S_ij - mean(S_ij)) / sqrt(Var(r_i) + eps)``, r_i = the LayerNorm's actual input
  (``sum_j T_i(x_j)`` + the bias terms is exactly the LayerNorm's output); the map is ``||T_i(x_j)||_2``.
  Pre-LN blocks (ModernBERT, GPT-2, Llama and the other pre-norm RMSNorm decoders) have no norm between the
  sum and the residual stream: ``T_i(x_j) = S_ij`` ("AttnRes-N"). Blocks with an RMS norm on the attention
  output before the residual (Gemma 2/3, OLMo 2: ``x + norm(z)``, ``norm(z) = g * z / rms(z)``) are linear in
  the sources once the actual ``rms(z_i)`` is fixed, as LayerNorm's scale above:
  ``T_i(x_j) = g * sum_h alpha^h_ij f^h(x_j) / rms(z_i) + [i = j] x_i``. Parallel-residual blocks
  (GPT-NeoX) have no such decomposition here (a clear error from :func:`probes.model.structure.layer_parts`).
* ``alti`` (Ferrando et al. 2022, *Measuring the Mixing of Contextual Information in the Transformer*;
  reference: ``get_contributions`` + ``normalize_contributions(scaling="min_sum", resultant_norm=...)`` +
  ``compute_joint_attention`` in github.com/mt-upc/transformer-contributions), per layer: with the same
  ``T_i(x_j)`` and the actual sub-layer output ``y_i`` (post-LN: the LayerNorm's output; pre-LN: the
  residual sum ``x_i + z_i``; sub-layer norm: ``x_i + norm(z_i)``), ``c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)``, rows normalised to
  sum 1; with ``rollout=True`` (default, "ALTI") the contributions are rolled out through the layers
  without adding the residual again: ``R_1 = C_1``, ``R_l = C_l R_{l-1}``.

Differences from the references: the LayerNorm scale uses ``sqrt(Var + eps)`` (the LayerNorm's own
formula; the ALTI code uses ``std(x + eps)``), and ``pairwise_distance``'s 1e-6 offset is left out;
both change values by far less than the cache's float16 resolution.
"""

from __future__ import annotations

import torch

from probes.measures import Measure, joint_maps
from probes.model import hooks, structure


def transformed(value: torch.Tensor, proj: torch.nn.Module) -> torch.Tensor:
    """f^h(x_j) = v^h_j W_O^h: value (B, H, T, d), proj Linear (D, H*d) -> (B, H, T, D)."""
    B, H, T, d = value.shape
    W = structure.projection_weight(proj).float()  # (D, H*d)
    if W.shape[1] != H * d:
        raise ValueError(f"output projection takes {W.shape[1]} inputs, expected H*d = {H * d}")
    return torch.einsum("bhtk,ehk->bhte", value.float(), W.view(W.shape[0], H, d))


def capture(model, input_ids, attention_mask) -> hooks.Session:
    """One forward with probabilities, values and block internals of every layer."""
    L = len(structure.attention_sites(model))
    with hooks.attention(model, layers=range(L), values=True, internals=True, stop_block=L - 1) as s:
        s.run(input_ids=input_ids, attention_mask=attention_mask)
    return s


def decomposed(s: hooks.Session, l: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer l's ``(T_i(x_j) (B, T, T, D), y_i (B, T, D))`` (see the module doc)."""
    part = s.parts[l]
    f = transformed(s.value[l], part.proj)  # (B, H, T, D)
    S = torch.einsum("bhij,bhjd->bijd", s.probs[l].float(), f)  # (B, T, T, D)
    x = s.block_input[l].float()  # (B, T, D)
    if part.sub_norm:  # x + g * z / rms(z), z = the projection's output (the norm's input)
        z = s.norm_input[l].float()  # (B, T, D)
        inv = (z.pow(2).mean(-1) + structure.norm_eps(part.norm)).rsqrt()  # (B, T)
        S = S * inv[:, :, None, None] * part.gain.float()
    idx = torch.arange(S.shape[1], device=S.device)
    S[:, idx, idx] += x
    if not part.post_ln:
        return S, s.residual_sum[l].float()
    r = s.residual_sum[l].float()  # (B, T, D) the LayerNorm's input
    scale = (r.var(-1, unbiased=False) + structure.norm_eps(part.norm)).rsqrt()  # (B, T)
    gamma = part.norm.weight.float()  # (D,)
    Tv = (S - S.mean(-1, keepdim=True)) * scale[:, :, None, None] * gamma
    return Tv, s.norm_output[l].float()


class Norm(Measure):
    """||alpha^h_ij f^h(x_j)||, (B, H, T, T) per layer (Kobayashi et al. 2020)."""

    per_head = True

    def __call__(self, model, input_ids, attention_mask):
        L = len(structure.attention_sites(model))
        with hooks.attention(model, layers=range(L), values=True, stop=True) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask)
        projs = structure.output_projections(model)
        out = []
        for l in range(L):
            fnorm = transformed(s.value[l], projs[l]).norm(dim=-1)  # (B, H, T)
            out.append(s.probs[l].float() * fnorm[:, :, None, :])  # (B, H, T, T)
        return out


class NormResLn(Measure):
    """||T_i(x_j)|| with residual and LayerNorm, (B, 1, T, T) per layer (Kobayashi et al. 2021)."""

    per_head = False

    def __call__(self, model, input_ids, attention_mask):
        s = capture(model, input_ids, attention_mask)
        return [decomposed(s, l)[0].norm(dim=-1).unsqueeze(1) for l in range(len(s.sites))]


def alti_contributions(Tv: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised: Tv (B, T, T, D), y (B, T, D) -> (B, T, T)."""
    d = (Tv - y[:, :, None, :]).abs().sum(-1)  # (B, T, T)
    c = (y.abs().sum(-1, keepdim=True) - d).clamp(min=0)
    return c / c.sum(-1, keepdim=True).clamp(min=1e-12)


class Alti(Measure):
    """ALTI contributions (``rollout=False``) or their rollout (default), (B, 1, T, T) per layer."""

    per_head = False

    def __init__(self, rollout: bool = True):
        self.rollout = bool(rollout)

    def __call__(self, model, input_ids, attention_mask):
        s = capture(model, input_ids, attention_mask)
        c = torch.stack([alti_contributions(*decomposed(s, l)) for l in range(len(s.sites))])  # (L, B, T, T)
        if self.rollout:
            c = joint_maps(c)
        return list(c.unsqueeze(2))
