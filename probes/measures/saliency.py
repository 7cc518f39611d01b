"""Input attributions of a classifier's prediction, and the rows of the head attribution maps an analysis reads.

* :func:`logit_attributions`: attribution of one class's logit of a sequence classifier to the input
  word embeddings ``x_j`` (``model.get_input_embeddings()``, fed as ``inputs_embeds``; position and type
  embeddings stay in the model): gradient x input ``x * d logit / d x`` (``method="ixg"``) or integrated
  gradients (``"ig"``) with a zero baseline, ``(x - b) * mean_k d logit / d x (b + alpha_k (x - b))`` at the
  Riemann midpoints ``alpha_k = (k - 1/2) / steps`` (captum's ``riemann_middle``). The IG points are one
  batch of ``steps`` sequences (``batch`` at most per forward), one backward per batch.
* :class:`HeadAttributionRows`: the ``grad_attribution`` map kind (:mod:`probes.measures.gradient`)
  restricted to a few rows (receiving positions, e.g. ``[0]`` = [CLS]): per layer one VJP vmapped over
  ``H * len(rows)`` cotangents instead of ``H * T``; the same numbers in those rows (tested).
"""

from __future__ import annotations

import torch

from probes.measures import Measure, per_sentence, sentence_rows
from probes.measures.gradflow import (attribution_distribution, ig_baseline, input_x_gradient, integrated_gradients,
                                      layer_head_scalars_fn, num_layers, word_embeddings)
from probes.model import structure

METHODS = ("ixg", "ig")


def logit_attributions(model: torch.nn.Module, input_ids: torch.Tensor, target: int, method: str = "ixg",
                       steps: int = 20, token_type_ids: torch.Tensor | None = None, batch: int = 32
                       ) -> torch.Tensor:
    """Attribution (T, E) of logit ``target`` of one unpadded sequence ``input_ids`` (T,) to its word embeddings.

    ``token_type_ids`` (T,) or None. ``method``: ``ixg`` | ``ig`` (zero baseline, ``steps`` midpoints).
    """
    if method not in METHODS:
        raise ValueError(f"attribution method must be one of {METHODS}, got {method!r}")
    with torch.inference_mode(False), torch.enable_grad():
        x = word_embeddings(model, input_ids).clone()  # (T, E)
        T = x.shape[0]
        base = torch.zeros_like(x)
        alphas = torch.ones(1) if method == "ixg" else (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
        grad = torch.zeros_like(x)
        for s0 in range(0, len(alphas), batch):
            a = alphas[s0:s0 + batch].to(x.device, x.dtype)  # (S,)
            pts = (base + a[:, None, None] * (x - base)).requires_grad_(True)  # (S, T, E)
            S = pts.shape[0]
            tt = None if token_type_ids is None else token_type_ids.reshape(1, T).expand(S, T)
            inp = structure.model_inputs(model, inputs_embeds=pts, attention_mask=torch.ones(S, T, dtype=torch.long,
                                                                                        device=x.device),
                                     token_type_ids=tt)
            logits = model(**inp).logits  # (S, C)
            (g,) = torch.autograd.grad(logits[:, target].sum(), pts)
            grad += g.sum(0)
        return ((x - base) * grad / len(alphas)).detach()


class HeadAttributionRows(Measure):
    """``grad_attribution`` maps with only ``rows`` filled (the others 0), (B, H, T, T) per layer; a negative
    row counts from each sentence's end (-1: its last piece)."""

    per_head = True

    def __init__(self, rows=(0,), method: str = "ixg", ig_steps: int = 20, chunk_size: int | None = 256):
        if method not in METHODS:
            raise ValueError(f"grad_attribution: method must be one of {METHODS}, got {method!r}")
        self.rows = [int(r) for r in rows]
        self.method, self.ig_steps, self.chunk_size = method, int(ig_steps), chunk_size

    def __call__(self, model, input_ids, attention_mask):
        L = len(structure.attention_sites(model))
        H = int(model.config.num_attention_heads)

        def one(ids: torch.Tensor) -> torch.Tensor:
            n = ids.shape[0]
            rows = sentence_rows(self.rows, n)
            with torch.inference_mode(False), torch.enable_grad():
                out = torch.zeros(L, H, n, n)  # (L, H, n, n)
                ids = ids.clone()
                x = word_embeddings(model, ids)  # (n, E)
                base = ig_baseline(model, ids, "zero") if self.method == "ig" else None
                for layer in range(num_layers(model)):
                    f = layer_head_scalars_fn(model, ids, layer)  # x -> (H, n)

                    def f_rows(x, f=f):
                        return f(x)[:, rows]  # (H, R)

                    if self.method == "ixg":
                        attr = input_x_gradient(f_rows, x, self.chunk_size)  # (H*R, n, E)
                    else:
                        attr = integrated_gradients(f_rows, x, base, self.ig_steps, self.chunk_size)
                    out[layer][:, rows] = attribution_distribution(attr.reshape(H, len(rows), n, -1)).detach().cpu()
            return out

        return per_sentence(one, input_ids, attention_mask, L, H)
