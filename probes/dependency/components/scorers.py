"""Dependency-probe scorers (Clark et al. 2019, section 6): logits over candidate heads.

Every scorer maps a collated batch (see `probes.dependency.datamodule.collate`) to logits (B, N, N + 1):
row j is dependent word j, column 0 is ROOT and column i + 1 is word i.
F = 2K attention features per pair (K = encoder layers x heads, both directions); ROOT's feature
is root_start * attention to/from [CLS] + root_end * attention to/from [SEP] (Clark et al.).
"""

from __future__ import annotations

import torch
from torch import nn


def root_features(batch: dict[str, torch.Tensor], root_start: torch.Tensor, root_end: torch.Tensor) -> torch.Tensor:
    """(B, F, N) ROOT's features: ``root_start`` x attention to/from [CLS] + ``root_end`` x to/from [SEP]."""
    return root_start * batch["root_cls"] + root_end * batch["root_sep"]  # (B, F, N)


class AttentionOnly(nn.Module):
    """logit(j, i) = sum_k w_k a^k_{j->i} + u_k a^k_{i->j}: one weight per head and direction."""

    def __init__(self, num_maps: int, word_dim: int | None = None):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(2 * num_maps))  # (F,)
        self.root_start = nn.Parameter(torch.ones(()))
        self.root_end = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        words = torch.einsum("f,bfji->bji", self.weights, batch["feats"])  # (B, N, N)
        root = torch.einsum("f,bfj->bj", self.weights, root_features(batch, self.root_start, self.root_end))
        return torch.cat([root.unsqueeze(-1), words], dim=-1)  # (B, N, N + 1)


class AttentionGlove(nn.Module):
    """Head weights conditioned on the word pair: w(j, i) = W [v_j ; v_i] + b, logit = sum_f w_f feature_f.

    W [v_j ; v_i] is computed as W_dep v_j + W_cand v_i, so no (B, N, N, 2d) pair tensor is built;
    ROOT's candidate vector is zero, as in Clark et al.
    """

    def __init__(self, num_maps: int, word_dim: int):
        super().__init__()
        self.dep = nn.Linear(word_dim, 2 * num_maps)  # W_dep and b
        self.cand = nn.Linear(word_dim, 2 * num_maps, bias=False)  # W_cand
        for p in self.parameters():
            nn.init.zeros_(p)
        self.root_start = nn.Parameter(torch.ones(()))
        self.root_end = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        v = vectors[batch["glove"]]  # (B, N, d)
        w_dep, w_cand = self.dep(v), self.cand(v)  # (B, N, F) each
        feats = batch["feats"]  # (B, F, N, N)
        words = torch.einsum("bjf,bfji->bji", w_dep, feats) + torch.einsum("bif,bfji->bji", w_cand, feats)
        root = torch.einsum("bjf,bfj->bj", w_dep, root_features(batch, self.root_start, self.root_end))
        return torch.cat([root.unsqueeze(-1), words], dim=-1)  # (B, N, N + 1)


def distance_features(n_words: int, lengths: torch.Tensor) -> torch.Tensor:
    """(B, N, N + 1, 8) Clark et al.'s distance features: relative distance ahead/behind, offsets 0, +-1, +-2, ROOT."""
    N = n_words
    j = torch.arange(N, device=lengths.device).view(N, 1)
    i = torch.arange(N, device=lengths.device).view(1, N)
    n = lengths.view(-1, 1, 1).clamp(min=1).float()  # (B, 1, 1)
    ahead = (i - j).clamp(min=0).float() / n  # (B, N, N) how far the candidate is ahead
    behind = (j - i).clamp(min=0).float() / n  # (B, N, N)
    eye = [(i - j == k).float().expand_as(ahead) for k in (0, 1, -1, 2, -2)]
    words = torch.stack([ahead, behind, *eye], dim=-1)  # (B, N, N, 7)
    words = torch.cat([words.new_zeros(*words.shape[:2], 1, 7), words], dim=2)  # (B, N, N + 1, 7)
    root = torch.zeros(*words.shape[:3], 1, device=words.device)
    root[:, :, 0] = 1.0
    return torch.cat([words, root], dim=-1)  # (B, N, N + 1, 8)


class DistanceGlove(nn.Module):
    """Baseline without attention: MLP(tanh, hidden) over [distance features ; v_j ; v_i]."""

    def __init__(self, num_maps: int, word_dim: int, hidden: int = 256):
        super().__init__()
        self.dist = nn.Linear(8, hidden)
        self.dep = nn.Linear(word_dim, hidden, bias=False)
        self.cand = nn.Linear(word_dim, hidden, bias=False)
        self.out = nn.Linear(hidden, 1)

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        v = vectors[batch["glove"]]  # (B, N, d)
        B, N, _ = v.shape
        cand = torch.cat([self.cand.weight.new_zeros(B, 1, self.cand.out_features), self.cand(v)], 1)  # (B, N + 1, h)
        h = self.dist(distance_features(N, batch["lengths"])) + self.dep(v).unsqueeze(2) + cand.unsqueeze(1)
        return self.out(torch.tanh(h)).squeeze(-1)  # (B, N, N + 1)


class RightBranching(nn.Module):
    """Parameter-free baseline: each word's head is the next word; the last word is the root."""

    def __init__(self, num_maps: int | None = None, word_dim: int | None = None):
        super().__init__()

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        B, N = batch["heads"].shape
        j = torch.arange(N, device=batch["heads"].device)
        target = torch.where(j.view(1, N) + 1 < batch["lengths"].view(B, 1), j + 2, 0)  # (B, N) column
        logits = torch.full((B, N, N + 1), -1e4, device=target.device)
        return logits.scatter(-1, target.unsqueeze(-1), 0.0)
