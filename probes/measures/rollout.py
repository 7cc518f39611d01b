"""``rollout`` and ``flow`` (Abnar & Zuidema 2020, *Quantifying Attention Flow in Transformers*), per layer.

Both start from the residual-augmented head-mean attention of each layer, as the reference code
(github.com/samiraabnar/attention_flow, ``compute_joint_attention(add_residual=True)``):
``Â_l = (mean_h A_l^h + I) / rowsum`` (= 0.5 A + 0.5 I for real rows).

* rollout: ``R_1 = Â_1``, ``R_l = Â_l R_{l-1}``: row i of R_l is how much position i of layer l's output
  draws on each input token.
* flow: the layered graph with one node per (layer, position), layer-0 nodes the input tokens, an edge
  from (l, i) to (l-1, j) of capacity ``Â_l[i, j]``; ``F_l[i, j]`` = the maximum flow from (l, i) to input
  node (0, j), each row normalised to sum 1 (``compute_flows`` in the reference, which uses networkx's
  Edmonds-Karp). Here scipy's C max-flow (``scipy.sparse.csgraph.maximum_flow``, Dinic) on integer
  capacities ``round(Â * scale)`` (default 1e9: each capacity within 5e-10 of its real value; scipy's
  capacities are int32, which holds 1e9 x a row of Â, whose entries are at most 1).
  Cost: L * T^2 max-flow problems per sentence, the one for layer l on l T^2 edges, i.e. O(L^2 T^4)
  edge visits or worse; sentences longer than ``max_pieces`` (default 32 wordpieces incl. specials) are
  left out of the cache (the extraction's long-sentence policy).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from probes.measures import Measure, joint_maps, sentence_rows
from probes.measures.attention import Attention


def augmented(probs: list[torch.Tensor]) -> torch.Tensor:
    """(L, B, T, T) residual-augmented head-mean attention from L x (B, H, T, T) probabilities."""
    a = torch.stack([p.float().mean(1) for p in probs])  # (L, B, T, T)
    a = a + torch.eye(a.shape[-1], device=a.device)
    return a / a.sum(-1, keepdim=True)


class Rollout(Measure):
    """Attention rollout R_l, (B, 1, T, T) per layer."""

    per_head = False

    def __call__(self, model, input_ids, attention_mask):
        r = joint_maps(augmented(Attention()(model, input_ids, attention_mask)))  # (L, B, T, T)
        return list(r.unsqueeze(2))


def flow_maps(aug: np.ndarray, scale: float = 1e9, rows=None) -> np.ndarray:
    """Attention flow of one sentence: aug (L, n, n) residual-augmented maps -> (L, n, n) row-normalised flows
    (``rows``: only those rows of every layer, the others 0; negative rows count from the end; None: all)."""
    L, n, _ = aug.shape
    N = (L + 1) * n
    if float(np.max(aug, initial=0.0)) * scale > np.iinfo(np.int32).max:
        raise ValueError(f"flow: scale={scale:g} overflows scipy's int32 capacities (largest entry "
                         f"{float(np.max(aug)):.3g}); lower extract.measures.flow.scale")
    cap = np.zeros((N, N), dtype=np.int32)  # node (l, i) = l * n + i; edges go one layer down
    for l in range(1, L + 1):
        cap[l * n:(l + 1) * n, (l - 1) * n:l * n] = np.rint(aug[l - 1] * scale).astype(np.int32)
    out = np.zeros((L, n, n))
    for l in range(1, L + 1):
        g = csr_matrix(cap[:(l + 1) * n, :(l + 1) * n])  # nodes above layer l cannot be reached
        for i in (range(n) if rows is None else sentence_rows(rows, n)):
            for j in range(n):
                out[l - 1, i, j] = maximum_flow(g, l * n + i, j).flow_value
        out[l - 1] /= np.maximum(out[l - 1].sum(-1, keepdims=True), 1)
    return out


class Flow(Measure):
    """Attention flow F_l, (B, 1, T, T) per layer; sentences of at most ``max_pieces`` pieces. ``rows``: only
    those rows (e.g. ``[0]``, the first special token's, ``[-1]`` each sentence's last piece: L * n max-flow
    problems instead of L * n^2), the others 0; None: all."""

    per_head = False

    def __init__(self, max_pieces: int = 32, scale: float = 1e9, rows=None):
        self.max_pieces, self.scale = int(max_pieces), float(scale)
        self.rows = None if rows is None else [int(r) for r in rows]

    def __call__(self, model, input_ids, attention_mask):
        aug = augmented(Attention()(model, input_ids, attention_mask)).cpu().numpy()  # (L, B, T, T)
        L = aug.shape[0]
        B, T = input_ids.shape
        out = torch.zeros(L, B, 1, T, T, device=input_ids.device)
        for b, n in enumerate(attention_mask.sum(-1).tolist()):
            n = int(n)
            if n > self.max_pieces:
                raise ValueError(f"flow: a sequence of {n} pieces exceeds max_pieces={self.max_pieces} "
                                 "(extract.measures.flow.max_pieces)")
            out[:, b, 0, :n, :n] = torch.from_numpy(flow_maps(aug[:, b, :n, :n], self.scale, self.rows)).to(out.device)
        return list(out)
