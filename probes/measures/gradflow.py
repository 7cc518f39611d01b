"""Gradient maths: gradient flow (Westera 2019) and head-output attributions (Pascual et al. 2021).

The ``grad_attribution`` map kind (:mod:`probes.measures.gradient`) and the ``flow``,
``flow_correlates`` and ``attribution`` analyses share these functions.

Everything here takes plain tensors / any encoder of a supported family (BERT, DistilBERT, ALBERT,
DeBERTa-v2, ...; base or task model) and one sentence at a time (no padding, so a sentence's numbers
never depend on what it is batched with). The model is reached only through the model-access layer
(:mod:`probes.model.hooks`): attention maps from an attention session, per-layer functions from
:func:`~probes.model.structure.block_function`, head outputs from a session with ``values=True``.

Gradient flow (:func:`gradient_flow`)
-------------------------------------
For layer ``n`` (1-based: layer ``n`` maps ``h_{n-1}`` to ``h_n``; ``h_0`` = the input of the first
block, i.e. the model's ``hidden_states[0]``: the embedding output after its LayerNorm, after ALBERT's
embedding projection) and positions ``t1`` (input), ``t2`` (output):

* ``G_n(t1, t2)  = || d s_n(t2) / d h_{n-1}(t1) ||_2``
* ``G*_n(t1, t2) = || d s_n(t2) / d h_0(t1) ||_2``

with the scalar ``s_n(t2) = sum_d h_n(t2)[d]`` - **the reduction of Westera's reference code**
(``mwestera/bertology``, ``interface_BERT.apply_bert_get_gradients``): it calls
``layer.backward(mask)`` with ``mask`` = ones on all hidden units of output token ``t2`` and zeros
elsewhere (= the gradient of the *sum* of ``h_n(t2)``'s units), then takes ``np.linalg.norm(grad,
axis=-1)``, the 2-norm over the hidden units of each input token. (His code runs the model in
``train()`` mode, i.e. with dropout; we use the frozen model in eval mode, deterministic.)

All output positions at once: the gradients of the ``T`` scalars are the vector-Jacobian products of
the block function (``structure.block_function``: block ``n``'s output as a function of its input hidden
states) with the ``T`` cotangents ``e_t2 (x) 1_D``; ``torch.func.vjp`` linearises the block once and
``torch.func.vmap`` applies the VJP to all cotangents in one batched backward pass. ``G*`` chains the
same per-layer VJP functions down to ``h_0`` (``n`` batched passes for layer ``n``), so a sentence
costs ``L`` linearisations and ``L (L + 1) / 2`` batched VJPs. The tests check it against an
independent reference: one plain forward and one ``autograd.grad`` per output token.

Word-level pooling (the cache's: attention FROM a word = mean over its pieces, TO a word = sum over its
pieces): it is applied to the **gradient vectors, before the norm** - the cotangent of output word
``w2`` is the mean over its pieces (``M_from[w2] (x) 1_D``, so the scalar is the mean over ``w2``'s
pieces of ``s_n``), and the gradient w.r.t. input word ``w1`` is the sum of the gradients w.r.t. its
pieces (``M_to[w1]``; = the gradient for one perturbation added to every piece of ``w1``); then the
2-norm over ``D``. Both are exact linear maps of the piece-level Jacobian, so with identity pooling
matrices this is the piece-level G. The first and last special tokens are words 0 and ``W - 1``.

Head attributions (:func:`head_attributions`)
---------------------------------------------
For every layer ``l``, head ``h`` and position ``i`` the head's output is ``o_{l,h,i}`` (``d_h``
units, ``A V`` before the attention output projection: ``s.output[l]`` of a ``hooks.attention(...,
values=True)`` session). It is reduced to the scalar ``sum_k o_{l,h,i}[k]`` (the same sum reduction
as above), and its attribution to input token ``j`` is taken over the **word-embedding vectors**
``x_j`` (``model.get_input_embeddings()(ids)``, fed as ``inputs_embeds``; position/type embeddings
and the embedding LayerNorm stay in the model):

* gradient x input: ``x_j * d s / d x_j``;
* integrated gradients with a zero baseline (all word embeddings 0, position/type embeddings
  unchanged): ``x_j * mean_k d s / d x_j (alpha_k x)`` with ``alpha_k = (k - 1/2) / steps``
  (Riemann midpoint rule, ``steps`` points), the same as captum's ``method="riemann_middle"``;
* gradient norm (:func:`hta_attributions`): ``|| d s / d x_j ||_2`` over the embedding dimension, no
  input factor (the reduction of Brunner et al.'s Hidden Token Attribution).

All ``H * T`` targets of a layer are done by one forward of the model stopped after that layer's
attention (``stop=True``) on all the points at once (the ``steps`` IG interpolation points as the batch
dimension; one point for gradient x input), one ``vjp``, and ``vmap`` over the one-hot cotangents, each
repeated over the points and the points' gradients summed inside (:func:`summed_jacobian_rows`): the
``H * T * steps`` backward passes run as batches of ``chunk_size`` (targets x points) sequences. The
arithmetic is the same as one backward per target and step (the slow reference in the tests); only
the batching is new, and large batches are what make it fast on a CPU (per-op overheads).
Cost: for layer ``l`` every target's backward goes through ``l`` blocks, so a sentence of ``T`` pieces
costs about ``steps * H * T * sum_l l`` block backwards of ``T`` tokens - quadratic in ``T``
(:func:`head_attribution_gflops`). The distribution over input tokens is ``|attr|`` summed over the
embedding dimension, normalised to sum 1 (:func:`attribution_distribution`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import vjp, vmap

from probes.model import hooks, structure


def _inputs(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Batch-of-one model inputs of one unpadded sentence: ``input_ids``, ``attention_mask`` (1, T)."""
    ids = input_ids.unsqueeze(0)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def num_layers(model: torch.nn.Module) -> int:
    """The model's number of layers (``config.num_hidden_layers``)."""
    return int(model.config.num_hidden_layers)


@torch.no_grad()
def hidden_and_attention(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(hidden states h_0..h_L each (T, D), attention (L, H, T, T))`` of one sentence (1-D ids), one forward."""
    with hooks.attention(model) as s:
        out = s.run(**_inputs(input_ids), output_hidden_states=True)
        attn = s.attentions()[0].float()  # (L, H, T, T)
    hs = [h[0] for h in out.hidden_states]  # L + 1 x (T, D)
    return hs, attn


def block_functions(model: torch.nn.Module, input_ids: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Per layer ``n``: ``f_n(x (T, D)) -> (T, D)``, block ``n``'s output when its input hidden states are ``x``."""
    inputs = _inputs(input_ids)
    fns = []
    for n in range(num_layers(model)):
        f = structure.block_function(model, n, **inputs)  # (1, T, D) -> (1, T, D)
        fns.append(lambda x, f=f: f(x.unsqueeze(0)).squeeze(0))
    return fns


# --------------------------------------------------------------------------- gradient flow


def gradient_flow(model: torch.nn.Module, input_ids: torch.Tensor, from_mat: torch.Tensor | None = None,
                  to_mat: torch.Tensor | None = None, chain: bool = True, chunk_size: int | None = None,
                  ) -> dict[str, torch.Tensor]:
    """G, G* and head-mean attention of one sentence, pooled to words.

    ``input_ids``: (T,) with the special tokens; ``from_mat``/``to_mat``: (W, T) pooling matrices of
    :func:`probes.model.inputs.pooling_matrix` (``mean`` / ``sum``); None = identity (pieces).
    Returns float32 CPU tensors ``G`` (L, W, W), ``Gstar`` (L, W, W) (only if ``chain``) and ``A``
    (L, W, W) (head mean of ``M_from A M_to^T``); all indexed ``[layer, output/from t2, input/to t1]``,
    the orientation of an attention map (row = attending token).
    """
    device = input_ids.device
    hs, attn = hidden_and_attention(model, input_ids)  # L + 1 x (T, D), (L, H, T, T)
    T, D = hs[0].shape
    eye = torch.eye(T, device=device, dtype=hs[0].dtype)
    fm = eye if from_mat is None else from_mat.to(device=device, dtype=hs[0].dtype)  # (W, T)
    tm = eye if to_mat is None else to_mat.to(device=device, dtype=hs[0].dtype)  # (W, T)
    fns = block_functions(model, input_ids)
    vjp_fns = []
    for n, f in enumerate(fns):
        _, fn = vjp(f, hs[n])  # linearise block n at its actual input
        vjp_fns.append(fn)
    # cotangents: output word w2 = mean over its pieces, all hidden units -> (W, T, D)
    cot = fm[:, :, None].expand(-1, -1, D).contiguous()

    def pull(fn, c):  # (W, T, D) cotangents -> (W, T, D) gradients w.r.t. the block input
        return vmap(lambda v: fn(v)[0], chunk_size=chunk_size)(c)

    def pool_norm(g):  # (W, T, D) -> (W, W): sum over the input word's pieces, then 2-norm over D
        return torch.linalg.vector_norm(torch.einsum("atd,bt->abd", g, tm), dim=-1)

    G, Gs = [], []
    for n in range(len(fns)):
        g = pull(vjp_fns[n], cot)
        G.append(pool_norm(g))
        if chain:
            for m in range(n - 1, -1, -1):
                g = pull(vjp_fns[m], g)
            Gs.append(pool_norm(g))
    A = (fm @ attn.to(device=device, dtype=fm.dtype) @ tm.T).mean(dim=1)  # (L, W, W)
    out = dict(G=torch.stack(G).float().cpu(), A=A.float().cpu())
    if chain:
        out["Gstar"] = torch.stack(Gs).float().cpu()
    return out


# --------------------------------------------------------------------------- head attributions


def _head_scalars(out: torch.Tensor) -> torch.Tensor:
    """Head outputs (B, T, H, d) -> per-head scalars (B, H, T): the sum over each head's d units."""
    return out.sum(-1).transpose(1, 2)


def word_embeddings(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The input (word) embeddings ``model.get_input_embeddings()(ids)``: (T, E)."""
    with torch.no_grad():
        return model.get_input_embeddings()(input_ids)


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
    """``x (T, E) -> s (H, T)`` (or a batch of inputs ``(S, T, E) -> (S, H, T)``) for one layer: the model
    stopped right after layer ``layer``'s attention.

    Runs the model on ``inputs_embeds=x`` in a ``hooks.attention(layers=[layer], stop=True,
    values=True)`` session and sums the head outputs ``s.output[layer]`` (S, T, H, d) over each head's
    ``d`` units. Same numbers as the full model's head outputs at ``layer`` (tested); the early stop saves
    the forward and backward through later layers.
    """
    def f(x: torch.Tensor) -> torch.Tensor:
        xb = x if x.dim() == 3 else x.unsqueeze(0)  # (S, T, E)
        mask = torch.ones(xb.shape[:2], dtype=input_ids.dtype, device=xb.device)  # (S, T)
        with hooks.attention(model, layers=[layer], stop=True, values=True) as s:
            s.run(inputs_embeds=xb, attention_mask=mask)
            out = s.output[layer]  # (S, T, H, d)
        sc = _head_scalars(out)  # (S, H, T)
        return sc if x.dim() == 3 else sc[0]

    return f


def summed_jacobian_rows(f: Callable[[torch.Tensor], torch.Tensor], points: torch.Tensor,
                         chunk_size: int | None = 1024, progress: Callable[[float], None] | None = None
                         ) -> torch.Tensor:
    """``sum_s d f(points)[s].flatten()[k] / d points[s]`` for every output unit k: (K, *points.shape[1:]).

    ``f`` maps a batch of S points (S, ...) to (S, *out) with each row depending on its own point only (a
    model forward on a batch of unpadded sentences). One forward on all S points, one ``vjp``, and
    ``vmap`` over the K one-hot cotangents (each repeated over the S points, the S gradients summed inside):
    the K backward passes over S points run as batches of ``chunk_size`` (targets x points) sequences
    (None: all at once). With S = 1 these are the Jacobian rows at one point; with the IG points, the
    Riemann sum of IG. ``progress(share)`` after each batch with the share of the K targets it did.
    """
    y, fn = vjp(f, points)
    S = y.shape[0]
    K = y[0].numel()
    eye = torch.eye(K, device=points.device, dtype=y.dtype).reshape(K, 1, *y.shape[1:])
    step = K if chunk_size is None else max(1, int(chunk_size) // S)
    pull = vmap(lambda v: fn(v)[0].sum(0))  # (k, S, *out) cotangents -> (k, *points.shape[1:])
    parts = []
    for a in range(0, K, step):
        parts.append(pull(eye[a:a + step].expand(-1, S, *y.shape[1:])))
        if progress is not None:
            progress((min(a + step, K) - a) / K)
    return torch.cat(parts)  # (K, *points.shape[1:])


def ig_points(x: torch.Tensor, baseline: torch.Tensor | None, steps: int) -> torch.Tensor:
    """The ``steps`` Riemann-midpoint points ``b + (k - 1/2) / steps * (x - b)``, k = 1..steps: (steps, *x.shape)."""
    b = torch.zeros_like(x) if baseline is None else baseline.to(x)
    alphas = (torch.arange(steps, device=x.device, dtype=x.dtype) + 0.5) / steps  # (S,)
    return b + alphas.reshape(-1, *([1] * x.dim())) * (x - b)


def head_attribution_gflops(model: torch.nn.Module, n_pieces: int, layer: int, points: int = 1) -> float:
    """Estimated GFLOPs of :func:`summed_jacobian_rows` for ``layer``'s ``H * T`` head scalars of a sentence of
    ``T = n_pieces`` over ``points`` points (IG steps; 1 for ``ixg``/``hta``): each target's backward through
    ``layer`` blocks (``8 D^2 T + 4 D F T + 4 T^2 D`` each, the forward's matmul count) and the Q/K/V part of
    its own layer's attention. For progress bars and benchmarks (a weight, not a measurement)."""
    c = model.config
    D, F, H, T = int(c.hidden_size), int(getattr(c, "intermediate_size", 4 * c.hidden_size)), \
        int(c.num_attention_heads), int(n_pieces)
    block = 8 * D * D * T + 4 * D * F * T + 4 * T * T * D
    attn = 6 * D * D * T + 4 * T * T * D
    return points * H * T * (layer * block + attn) / 1e9


def ig_baseline(model: torch.nn.Module, input_ids: torch.Tensor, kind: str = "zero", pad_id: int = 0) -> torch.Tensor:
    """IG baseline in word-embedding space (T, E): ``zero`` = all zeros; ``pad`` = the pad token's
    embedding at every position but the first and last (special tokens), which keep their own."""
    x = word_embeddings(model, input_ids)
    if kind == "zero":
        return torch.zeros_like(x)
    if kind == "pad":
        b = word_embeddings(model, torch.full_like(input_ids, pad_id))
        b[0], b[-1] = x[0], x[-1]
        return b
    raise ValueError(f"unknown baseline {kind!r} (zero | pad)")


def _layer_progress(progress: Callable[[int, float], None] | None, layer: int) -> Callable[[float], None] | None:
    """``share -> progress(layer, share)`` (None if no ``progress``)."""
    return None if progress is None else (lambda share: progress(layer, share))


def head_attributions(model: torch.nn.Module, input_ids: torch.Tensor, method: str = "ig", steps: int = 20,
                      chunk_size: int | None = 1024, baseline: torch.Tensor | None = None,
                      progress: Callable[[int, float], None] | None = None) -> torch.Tensor:
    """Attribution distributions of every head output over the input tokens, (L, H, T_out, T_in).

    One truncated model per layer (:func:`layer_head_scalars_fn`); ``ig``: the ``steps`` interpolation
    points are one batch of the forward and of every backward (:func:`summed_jacobian_rows`), not a loop.
    ``|attr|`` summed over the embedding dimension and normalised (:func:`attribution_distribution`); see
    the module doc. ``progress(layer, share)`` after each batch of backward passes, with the share of that
    layer's targets it did (for progress bars).
    """
    x = word_embeddings(model, input_ids)  # (T, E)
    T = x.shape[0]
    if method in ("ixg", "input_x_gradient"):
        points, scale = x.unsqueeze(0), x  # (1, T, E), (T, E)
    elif method in ("ig", "integrated_gradients"):
        b = torch.zeros_like(x) if baseline is None else baseline.to(x)
        points, scale = ig_points(x, b, steps), (x - b) / steps  # (S, T, E), (T, E)
    else:
        raise ValueError(f"unknown attribution method {method!r} (ig | ixg)")
    out = []
    for layer in range(num_layers(model)):
        f = layer_head_scalars_fn(model, input_ids, layer)
        J = summed_jacobian_rows(f, points, chunk_size, _layer_progress(progress, layer))  # (H*T, T, E)
        attr = J * scale
        out.append(attribution_distribution(attr.reshape(-1, T, *x.shape)))  # (H, T, T)
    return torch.stack(out).detach()  # (L, H, T, T)


def attribution_distribution(attr: torch.Tensor) -> torch.Tensor:
    """``|attr|`` summed over the last (embedding) dim, normalised to sum 1 over the token dim (-2 before)."""
    mass = attr.abs().sum(-1)
    total = mass.sum(-1, keepdim=True)
    return torch.where(total > 0, mass / total.clamp_min(1e-30), torch.full_like(mass, 1.0 / mass.shape[-1]))


def hta_attributions(model: torch.nn.Module, input_ids: torch.Tensor, chunk_size: int | None = 1024,
                     progress: Callable[[int, float], None] | None = None) -> torch.Tensor:
    """``method=hta``: gradient-norm attribution of every head output, (L, H, T_out, T_in).

    ``||d s_{l,h,i} / d x_j||_2`` (2-norm over the embedding dimension, no multiplication by the input),
    normalised over ``j``; ``s_{l,h,i} = sum_k o_{l,h,i}[k]`` and ``x_j`` the word embeddings as for ``ixg``.
    This is the reduction of Hidden Token Attribution (Brunner et al. 2020, the same group's earlier
    measure) as a public reimplementation computes it (gradient of the summed output units, 2-norm, share
    of the sum); whether Pascual et al. use it for heads could not be checked
    (:mod:`probes.analysis.pascual.attribution`).
    """
    x = word_embeddings(model, input_ids)  # (T, E)
    T = x.shape[0]
    out = []
    for layer in range(num_layers(model)):
        f = layer_head_scalars_fn(model, input_ids, layer)
        J = summed_jacobian_rows(f, x.unsqueeze(0), chunk_size, _layer_progress(progress, layer))  # (H*T, T, E)
        mass = torch.linalg.vector_norm(J, dim=-1).reshape(-1, T, T)  # (H, T, T)
        out.append(mass / mass.sum(-1, keepdim=True).clamp_min(1e-30))
    return torch.stack(out).detach()  # (L, H, T, T)
