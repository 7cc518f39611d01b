"""Hewitt & Manning's (2019) evaluation as torchmetrics Metrics, following their reporter
(john-hewitt/structural-probes, ``reporter.py``):

* UUAS: minimum spanning tree (Kruskal, pairs in row-major order, stable sort by distance) of the
  predicted distances and of the gold distances, punctuation words left out of both; the share of gold
  edges found, pooled over the corpus (``prims_matrix_to_edges``, ``report_uuas_and_tikz``).
* DSpr.: for each word, the Spearman correlation of its row of predicted and gold distances (all words,
  punctuation included), averaged per sentence length, then over the lengths 5-50 present.
* Root accuracy: the least deep non-punctuation word (predicted) is the gold root (``get_nopunct_argmin``).
* NSpr.: Spearman correlation of predicted and gold depths per sentence, averaged as DSpr.

Punctuation: their PTB reporter drops the XPOS tags ``'' , . : `` -LRB- -RRB-``; here a word is
punctuation when its UPOS is PUNCT (EWT: the same tags plus HYPH and NFP). Spearman correlations that are
undefined (a constant row) are left out of the averages (the reporter would average in a NaN).
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics import Metric

from probes.dependency.metrics import UAS as Rate  # correct / total counts, summed over processes
from probes.stats import spearman_rows

SPEARMAN_LENGTHS = (5, 50)  # sentence lengths averaged over (inclusive), as in the reporter


def mst_edges(dist: np.ndarray, keep: np.ndarray) -> set[tuple[int, int]]:
    """Undirected edges (i < j) of the minimum spanning tree of ``dist`` (n, n) over the words with ``keep`` (n,).

    Kruskal over the pairs i < j in row-major order, stably sorted by distance: the reporter's order
    (its self-pairs and (j, i) duplicates never join two components)."""
    idx = np.flatnonzero(keep)
    if len(idx) < 2:
        return set()
    iu, ju = np.triu_indices(len(idx), k=1)
    i, j = idx[iu], idx[ju]
    order = np.argsort(dist[i, j], kind="stable")
    parent = {int(a): int(a) for a in idx}

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    edges = set()
    for k in order:
        a, b = int(i[k]), int(j[k])
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
            edges.add((a, b))
            if len(edges) == len(idx) - 1:
                break
    return edges


def _numpy(*ts: torch.Tensor) -> list[np.ndarray]:
    return [t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy() for t in ts]


class UUAS(Rate):
    """Undirected unlabelled attachment score of the MST of predicted distances (punctuation left out)."""

    def update(self, pred: torch.Tensor, gold: torch.Tensor, punct: torch.Tensor, lengths: torch.Tensor) -> None:
        """pred, gold: (B, N, N) predicted and gold distances; punct: (B, N) bool; lengths: (B,)."""
        pred, gold, punct, lengths = _numpy(pred, gold, punct, lengths)
        correct = total = 0
        for p, g, pu, n in zip(pred, gold, punct, lengths):
            keep = ~pu[:n]
            gold_edges = mst_edges(g[:n, :n], keep)
            correct += len(gold_edges & mst_edges(p[:n, :n], keep))
            total += len(gold_edges)
        self.correct += correct
        self.total += total


class _LengthAveragedSpearman(Metric):
    """Spearman correlations summed per sentence length 0..50; compute = mean over lengths 5-50 of the
    per-length means (lengths with no correlation are left out)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        hi = SPEARMAN_LENGTHS[1] + 1
        self.add_state("sums", default=torch.zeros(hi, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", default=torch.zeros(hi, dtype=torch.float64), dist_reduce_fx="sum")

    def _add(self, n: int, rhos: np.ndarray) -> None:
        rhos = rhos[np.isfinite(rhos)]
        if SPEARMAN_LENGTHS[0] <= n <= SPEARMAN_LENGTHS[1] and len(rhos):
            self.sums[n] += float(rhos.sum())
            self.counts[n] += len(rhos)

    def compute(self) -> torch.Tensor:
        lo = SPEARMAN_LENGTHS[0]
        have = self.counts[lo:] > 0
        if not bool(have.any()):
            return torch.tensor(float("nan"))
        return (self.sums[lo:][have] / self.counts[lo:][have]).mean().float()


class DistanceSpearman(_LengthAveragedSpearman):
    """DSpr.: per-word Spearman of predicted vs gold distance rows, averaged per length, then over 5-50."""

    def update(self, pred: torch.Tensor, gold: torch.Tensor, lengths: torch.Tensor) -> None:
        """pred, gold: (B, N, N); lengths: (B,)."""
        pred, gold, lengths = _numpy(pred, gold, lengths)
        for p, g, n in zip(pred, gold, lengths):
            self._add(int(n), spearman_rows(p[:n, :n], g[:n, :n]))


class DepthSpearman(_LengthAveragedSpearman):
    """NSpr.: per-sentence Spearman of predicted vs gold depths, averaged per length, then over 5-50."""

    def update(self, pred: torch.Tensor, gold: torch.Tensor, lengths: torch.Tensor) -> None:
        """pred, gold: (B, N); lengths: (B,)."""
        pred, gold, lengths = _numpy(pred, gold, lengths)
        for p, g, n in zip(pred, gold, lengths):
            self._add(int(n), spearman_rows(p[None, :n], g[None, :n]))


class RootAccuracy(Rate):
    """Share of sentences whose least deep non-punctuation word (predicted) is the gold root."""

    def update(self, pred: torch.Tensor, gold: torch.Tensor, punct: torch.Tensor, lengths: torch.Tensor) -> None:
        """pred, gold: (B, N) predicted and gold depths (gold root: depth 0); punct: (B, N); lengths: (B,)."""
        pred, gold, punct, lengths = _numpy(pred, gold, punct, lengths)
        correct = 0
        for p, g, pu, n in zip(pred, gold, punct, lengths):
            p, pu = p[:n], pu[:n]
            guess = int(np.argmin(np.where(pu, np.inf, p))) if (~pu).any() else int(np.argmin(p))
            correct += int(g[guess] == 0)
        self.correct += correct
        self.total += len(lengths)
