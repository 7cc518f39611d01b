"""Shared maths of the gradient-flow (Westera 2019) and gradient-attribution (Pascual et al. 2021) analyses.

Everything here takes plain tensors / a HF ``BertModel`` and one sentence at a time (no padding, so no
attention mask is needed and a sentence's numbers never depend on what it is batched with).

Gradient flow (:func:`gradient_flow`)
-------------------------------------
For layer ``n`` (1-based: layer ``n`` maps ``h_{n-1}`` to ``h_n``; ``h_0`` = embedding output, i.e. the
model's ``hidden_states[0]`` after the embedding LayerNorm) and positions ``t1`` (input), ``t2`` (output):

* ``G_n(t1, t2)  = || d s_n(t2) / d h_{n-1}(t1) ||_2``
* ``G*_n(t1, t2) = || d s_n(t2) / d h_0(t1) ||_2``

with the scalar ``s_n(t2) = sum_d h_n(t2)[d]`` - **the reduction of Westera's reference code**
(``mwestera/bertology``, ``interface_BERT.apply_bert_get_gradients``): it calls
``layer.backward(mask)`` with ``mask`` = ones on all hidden units of output token ``t2`` and zeros
elsewhere (= the gradient of the *sum* of ``h_n(t2)``'s units), then takes ``np.linalg.norm(grad,
axis=-1)``, the 2-norm over the hidden units of each input token. (His code runs the model in
``train()`` mode, i.e. with dropout; we use the frozen model in eval mode, deterministic.)

All output positions at once: the gradients of the ``T`` scalars are the vector-Jacobian products of
the layer function with the ``T`` cotangents ``e_t2 (x) 1_D``; ``torch.func.vjp`` linearises the layer
once and ``torch.func.vmap`` applies the VJP to all cotangents in one batched backward pass. ``G*``
chains the same per-layer VJP functions down to ``h_0`` (``n`` batched passes for layer ``n``), so a
sentence costs ``L`` linearisations and ``L (L + 1) / 2`` batched VJPs.

Word-level pooling (the cache's: attention FROM a word = mean over its pieces, TO a word = sum over its
pieces): it is applied to the **gradient vectors, before the norm** - the cotangent of output word
``w2`` is the mean over its pieces (``M_from[w2] (x) 1_D``, so the scalar is the mean over ``w2``'s
pieces of ``s_n``), and the gradient w.r.t. input word ``w1`` is the sum of the gradients w.r.t. its
pieces (``M_to[w1]``; = the gradient for one perturbation added to every piece of ``w1``); then the
2-norm over ``D``. Both are exact linear maps of the piece-level Jacobian, so with identity pooling
matrices this is the piece-level G. ``[CLS]`` and ``[SEP]`` are words 0 and ``W - 1`` as in the cache.

Head attributions (:func:`head_attributions`)
---------------------------------------------
For every layer ``l``, head ``h`` and position ``i`` the head's output is its context vector slice
``c_{l,h,i}`` (``d_h`` units, before the attention output projection; captured from the
self-attention module's output). It is reduced to the scalar ``sum_k c_{l,h,i}[k]`` (the same
sum reduction as above), and its attribution to input token ``j`` is taken over the **word-embedding
vectors** ``x_j`` (output of ``embeddings.word_embeddings``; position/type embeddings and the embedding
LayerNorm stay in the model):

* gradient x input: ``x_j * d s / d x_j``;
* integrated gradients with a zero baseline (all word embeddings 0, position/type embeddings
  unchanged): ``x_j * mean_k d s / d x_j (alpha_k x)`` with ``alpha_k = (k - 1/2) / steps``
  (Riemann midpoint rule, ``steps`` points), the same as captum's ``method="riemann_middle"``.

All ``L * H * T`` targets of a sentence are done by one ``vjp`` per (IG step) and ``vmap`` over the
one-hot cotangents (in chunks). The distribution over input tokens is
``|attr|`` summed over the embedding dimension, normalised to sum 1 (:func:`attribution_distribution`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.func import vjp, vmap

# --------------------------------------------------------------------------- model plumbing


def bert_base(model: torch.nn.Module) -> torch.nn.Module:
    """The ``BertModel`` inside a task model (or the model itself)."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def encoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = bert_base(model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no encoder.layer (BERT-family encoder expected)")
    return list(layers)


def _layer_fn(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """(T, D) -> (T, D): one encoder layer on one unpadded sentence."""

    def f(h: torch.Tensor) -> torch.Tensor:
        out = layer(h.unsqueeze(0))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.squeeze(0)

    return f


@torch.no_grad()
def hidden_and_attention(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(hidden states h_0..h_L each (T, D), attention (L, H, T, T))`` of one sentence (1-D ids)."""
    base = bert_base(model)
    out = base(input_ids=input_ids.unsqueeze(0), output_hidden_states=True, output_attentions=True)
    hs = [h[0] for h in out.hidden_states]
    attn = torch.stack([a[0] for a in out.attentions]).float()
    return hs, attn


# --------------------------------------------------------------------------- gradient flow


def gradient_flow(model: torch.nn.Module, input_ids: torch.Tensor, from_mat: torch.Tensor | None = None,
                  to_mat: torch.Tensor | None = None, chain: bool = True, chunk_size: int | None = None,
                  ) -> dict[str, torch.Tensor]:
    """G, G* and head-mean attention of one sentence, pooled to words.

    ``input_ids``: (T,) with [CLS]/[SEP]; ``from_mat``/``to_mat``: (W, T) pooling matrices of
    :func:`probes.model.inputs.pooling_matrix` (``mean`` / ``sum``); None = identity (pieces).
    Returns float32 CPU tensors ``G`` (L, W, W), ``Gstar`` (L, W, W) (only if ``chain``) and ``A``
    (L, W, W) (head mean of ``M_from A M_to^T``); all indexed ``[layer, output/from t2, input/to t1]``,
    the orientation of an attention map (row = attending token).
    """
    device = input_ids.device
    hs, attn = hidden_and_attention(model, input_ids)
    T, D = hs[0].shape
    eye = torch.eye(T, device=device)
    fm = eye if from_mat is None else from_mat.to(device=device, dtype=hs[0].dtype)
    tm = eye if to_mat is None else to_mat.to(device=device, dtype=hs[0].dtype)
    layers = encoder_layers(model)
    vjp_fns = []
    for n, layer in enumerate(layers):
        _, fn = vjp(_layer_fn(layer), hs[n])
        vjp_fns.append(fn)
    # cotangents: output word w2 = mean over its pieces, all hidden units -> (W, T, D)
    cot = fm[:, :, None].expand(-1, -1, D).contiguous()

    def pull(fn, c):
        return vmap(lambda v: fn(v)[0], chunk_size=chunk_size)(c)

    def pool_norm(g):  # (W, T, D) -> (W, W): sum over the input word's pieces, then 2-norm over D
        return torch.linalg.vector_norm(torch.einsum("atd,bt->abd", g, tm), dim=-1)

    G, Gs = [], []
    for n in range(len(layers)):
        g = pull(vjp_fns[n], cot)
        G.append(pool_norm(g))
        if chain:
            for m in range(n - 1, -1, -1):
                g = pull(vjp_fns[m], g)
            Gs.append(pool_norm(g))
    A = (fm @ attn.to(device) @ tm.T).mean(dim=1)  # (L, W, W)
    out = dict(G=torch.stack(G).float().cpu(), A=A.float().cpu())
    if chain:
        out["Gstar"] = torch.stack(Gs).float().cpu()
    return out


def gradient_flow_loop(model: torch.nn.Module, input_ids: torch.Tensor, chain: bool = False) -> torch.Tensor:
    """Reference G (or G* when ``chain``) at piece level with one ``autograd.grad`` per output token (tests).

    Westera's loop: for every layer and output token ``t2``, backward of ``sum_d h_n(t2)`` to
    ``h_{n-1}`` (``h_0`` when ``chain``), 2-norm over the hidden units. Returns (L, T, T) [t2, t1].
    """
    base = bert_base(model)
    with torch.enable_grad():
        emb = base.embeddings(input_ids=input_ids.unsqueeze(0)).detach().requires_grad_(True)
        h, inputs, outputs = emb, [], []
        for layer in encoder_layers(model):
            x = h if chain else h.detach().requires_grad_(True)
            out = layer(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            inputs.append(emb if chain else x)
            outputs.append(out)
            h = out
        res = []
        for x, y in zip(inputs, outputs):
            T = y.shape[1]
            rows = []
            for t2 in range(T):
                (g,) = torch.autograd.grad(y[0, t2].sum(), x, retain_graph=True)
                rows.append(torch.linalg.vector_norm(g[0], dim=-1))
            res.append(torch.stack(rows))
    return torch.stack(res).detach()


# --------------------------------------------------------------------------- head attributions


def _context_capture(model: torch.nn.Module):
    """Forward hooks on every ``attention.self`` that collect its context output (B, T, H*d_h)."""
    from probes.extract.stage import self_attention_modules

    mods = self_attention_modules(model)
    if mods is None:
        raise ValueError("no BERT-style self-attention modules found")
    store: list[torch.Tensor] = []

    def hook(_m, _inp, out):
        store.append(out[0] if isinstance(out, (tuple, list)) else out)

    return mods, store, hook


def head_scalars_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x (T, D) word embeddings -> s (L, H, T)``, ``s[l, h, i] = sum_k c_{l,h,i}[k]`` (see module doc)."""
    base = bert_base(model)
    H = base.config.num_attention_heads
    mods, store, hook = _context_capture(model)
    token_type = torch.zeros_like(input_ids).unsqueeze(0)

    def f(x: torch.Tensor) -> torch.Tensor:
        store.clear()
        handles = [m.register_forward_hook(hook) for m in mods]
        try:
            base(inputs_embeds=x.unsqueeze(0), token_type_ids=token_type)
        finally:
            for hd in handles:
                hd.remove()
        ctx = torch.stack([c[0] for c in store])  # (L, T, H*d_h)
        L, T, HD = ctx.shape
        store.clear()
        return ctx.reshape(L, T, H, HD // H).sum(-1).permute(0, 2, 1)  # (L, H, T)

    return f


def word_embeddings(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return bert_base(model).embeddings.word_embeddings(input_ids)


def jacobian_rows(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(x), J)`` with ``J[k] = d f(x).flatten()[k] / d x`` (K, *x.shape) by one vjp + vmap over one-hots."""
    y, fn = vjp(f, x)
    K = y.numel()
    eye = torch.eye(K, device=x.device, dtype=y.dtype).reshape(K, *y.shape)
    J = vmap(lambda v: fn(v)[0], chunk_size=chunk_size)(eye)
    return y.detach(), J


def input_x_gradient(f, x: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Gradient x input of every output unit of ``f`` w.r.t. ``x``: (K, *x.shape)."""
    _, J = jacobian_rows(f, x, chunk_size)
    return J * x


def integrated_gradients(f, x: torch.Tensor, baseline: torch.Tensor | None = None, steps: int = 20,
                         chunk_size: int | None = None) -> torch.Tensor:
    """IG (Riemann midpoint, ``steps`` points) of every output unit of ``f``: (K, *x.shape)."""
    baseline = torch.zeros_like(x) if baseline is None else baseline
    acc = None
    for k in range(steps):
        alpha = (k + 0.5) / steps
        _, J = jacobian_rows(f, baseline + alpha * (x - baseline), chunk_size)
        acc = J if acc is None else acc + J
    return (x - baseline) * acc / steps


def layer_head_scalars_fn(model: torch.nn.Module, input_ids: torch.Tensor, layer: int
                          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x (T, D) -> s (H, T)`` for one layer: the model truncated after ``encoder.layer[layer].attention.self``.

    Runs the embeddings (``inputs_embeds=x``, token type 0) and layers ``0..layer-1``, then the layer's
    self-attention module, and sums its context output (the tensor a forward hook on that module
    captures, see :func:`head_scalars_fn`) over each head's ``d_h`` units. Same numbers as
    :func:`head_scalars_fn` ``[layer]`` (tested); the truncation saves the backward through later layers.
    """
    base = bert_base(model)
    H = base.config.num_attention_heads
    layers = encoder_layers(model)
    token_type = torch.zeros_like(input_ids).unsqueeze(0)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = base.embeddings(inputs_embeds=x.unsqueeze(0), token_type_ids=token_type)
        for m in range(layer):
            out = layers[m](h)
            h = out[0] if isinstance(out, (tuple, list)) else out
        ctx = layers[layer].attention.self(h)[0][0]  # (T, H*d_h)
        T, HD = ctx.shape
        return ctx.reshape(T, H, HD // H).sum(-1).T  # (H, T)

    return f


def ig_baseline(model: torch.nn.Module, input_ids: torch.Tensor, kind: str = "zero", pad_id: int = 0) -> torch.Tensor:
    """IG baseline in word-embedding space: ``zero`` = all zeros; ``pad`` = [PAD]'s word embedding at
    every position but the first ([CLS]) and last ([SEP]), which keep their own embeddings."""
    x = word_embeddings(model, input_ids)
    if kind == "zero":
        return torch.zeros_like(x)
    if kind == "pad":
        b = word_embeddings(model, torch.full_like(input_ids, pad_id))
        b[0], b[-1] = x[0], x[-1]
        return b
    raise ValueError(f"unknown baseline {kind!r} (zero | pad)")


def head_attributions(model: torch.nn.Module, input_ids: torch.Tensor, method: str = "ig", steps: int = 20,
                      chunk_size: int | None = 256, baseline: torch.Tensor | None = None) -> torch.Tensor:
    """Attribution distributions of every head output over the input tokens, (L, H, T_out, T_in).

    One truncated model per layer (:func:`layer_head_scalars_fn`); ``|attr|`` summed over the
    embedding dimension and normalised (:func:`attribution_distribution`); see the module doc.
    """
    x = word_embeddings(model, input_ids)
    out = []
    for layer in range(len(encoder_layers(model))):
        f = layer_head_scalars_fn(model, input_ids, layer)
        if method in ("ixg", "input_x_gradient"):
            attr = input_x_gradient(f, x, chunk_size)
        elif method in ("ig", "integrated_gradients"):
            attr = integrated_gradients(f, x, baseline, steps, chunk_size)
        else:
            raise ValueError(f"unknown attribution method {method!r} (ig | ixg)")
        T = x.shape[0]
        H = attr.shape[0] // T
        out.append(attribution_distribution(attr.reshape(H, T, *x.shape)))
    return torch.stack(out).detach()


def captum_head_attribution(model: torch.nn.Module, input_ids: torch.Tensor, layer: int, head: int, pos: int,
                            method: str = "ig", steps: int = 20, baseline: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """One target's raw attribution (T, D) with captum (``IntegratedGradients`` with
    ``method="riemann_middle"`` / ``InputXGradient``) on the word-embedding input - the reference the
    batched :func:`head_attributions` is checked against. The forward function runs the full model
    with forward hooks on every ``attention.self`` (:func:`head_scalars_fn`), batched over IG steps."""
    from captum.attr import InputXGradient, IntegratedGradients

    base = bert_base(model)
    H = base.config.num_attention_heads
    mods, store, hook = _context_capture(model)

    def forward(x):  # (B, T, D) -> (B, L*H*T)
        store.clear()
        handles = [m.register_forward_hook(hook) for m in mods]
        try:
            base(inputs_embeds=x, token_type_ids=torch.zeros(x.shape[:2], dtype=torch.long, device=x.device))
        finally:
            for hd in handles:
                hd.remove()
        ctx = torch.stack(list(store), 1)  # (B, L, T, H*d_h)
        store.clear()
        B, L, T, HD = ctx.shape
        return ctx.reshape(B, L, T, H, HD // H).sum(-1).permute(0, 1, 3, 2).reshape(B, -1)

    x = word_embeddings(model, input_ids).unsqueeze(0).clone()
    T = x.shape[1]
    target = (layer * H + head) * T + pos
    if method in ("ixg", "input_x_gradient"):
        attr = InputXGradient(forward).attribute(x, target=target)
    else:
        b = torch.zeros_like(x) if baseline is None else baseline.unsqueeze(0)
        attr = IntegratedGradients(forward).attribute(x, baselines=b, target=target, n_steps=steps,
                                                      method="riemann_middle")
    return attr[0].detach()


def attribution_distribution(attr: torch.Tensor) -> torch.Tensor:
    """``|attr|`` summed over the last (embedding) dim, normalised to sum 1 over the token dim (-2 before)."""
    mass = attr.abs().sum(-1)
    total = mass.sum(-1, keepdim=True)
    return torch.where(total > 0, mass / total.clamp_min(1e-30), torch.full_like(mass, 1.0 / mass.shape[-1]))


# --------------------------------------------------------------------------- comparison helpers


PATTERNS = ("self", "prev", "next", "cls", "sep", "other")


def argmax_patterns(dist: np.ndarray) -> np.ndarray:
    """Pattern of each row's argmax, for ``dist`` (..., T, T) with rows = positions i of ``[CLS] ... [SEP]``.

    Returns an int array (..., T) indexing :data:`PATTERNS`; precedence ``cls`` (j = 0), ``sep``
    (j = T - 1), ``self`` (j = i), ``prev`` (j = i - 1), ``next`` (j = i + 1), else ``other``.
    """
    dist = np.asarray(dist)
    T = dist.shape[-1]
    j = dist.argmax(-1)
    i = np.broadcast_to(np.arange(T), j.shape)
    out = np.full(j.shape, PATTERNS.index("other"))
    for name, cond in (("next", j == i + 1), ("prev", j == i - 1), ("self", j == i), ("sep", j == T - 1),
                       ("cls", j == 0)):  # later assignments win: cls > sep > self > prev > next
        out = np.where(cond, PATTERNS.index(name), out)
    return out
