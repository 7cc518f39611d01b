"""Dependency-probe scorers (Clark et al. 2019, section 6): logits over candidate heads.

Every scorer maps a collated batch (see `probes.datamodule.collate`) to logits (B, N, N + 1):
row j is dependent word j, column 0 is ROOT and column i + 1 is word i.
K = encoder layers x heads; both attention directions give F = 2K features per word pair.
"""

from __future__ import annotations

import torch
from torch import nn


def attention_features(batch: dict[str, torch.Tensor], root_start: torch.Tensor,
                       root_end: torch.Tensor) -> torch.Tensor:
    """(B, N, N + 1, 2K) features: [dependent -> candidate, candidate -> dependent] attention.

    ROOT's feature is root_start * attention to [CLS] + root_end * attention to [SEP] (Clark et al.).
    """
    a = batch["attn"]  # (B, K, N, N) from row word to column word
    dep_to_cand = a  # (B, K, N, N) [b, k, j, i] = attention j -> i
    cand_to_dep = a.transpose(-1, -2)  # (B, K, N, N) [b, k, j, i] = attention i -> j
    root_fwd = root_start * batch["to_cls"] + root_end * batch["to_sep"]  # (B, K, N)
    root_bwd = root_start * batch["from_cls"] + root_end * batch["from_sep"]  # (B, K, N)
    fwd = torch.cat([root_fwd.unsqueeze(-1), dep_to_cand], dim=-1)  # (B, K, N, N + 1)
    bwd = torch.cat([root_bwd.unsqueeze(-1), cand_to_dep], dim=-1)  # (B, K, N, N + 1)
    return torch.cat([fwd, bwd], dim=1).permute(0, 2, 3, 1)  # (B, N, N + 1, 2K)


def pair_vectors(vectors: torch.Tensor, glove: torch.Tensor) -> torch.Tensor:
    """(B, N, N + 1, 2d): [v_dependent, v_candidate]; ROOT's candidate half is zero.

    vectors: (V, d) frozen table; glove: (B, N) row ids.
    """
    v = vectors[glove]  # (B, N, d)
    B, N, d = v.shape
    cand = torch.cat([v.new_zeros(B, 1, d), v], dim=1)  # (B, N + 1, d)
    dep = v.unsqueeze(2).expand(B, N, N + 1, d)
    return torch.cat([dep, cand.unsqueeze(1).expand(B, N, N + 1, d)], dim=-1)


def distance_features(n_words: int, lengths: torch.Tensor) -> torch.Tensor:
    """(B, N, N + 1, 8) Clark et al.'s distance features: signed relative distances, offsets 0, +-1, +-2, ROOT."""
    N = n_words
    j = torch.arange(N, device=lengths.device).view(N, 1)
    i = torch.arange(N, device=lengths.device).view(1, N)
    n = lengths.view(-1, 1, 1).clamp(min=1).float()  # (B, 1, 1)
    ahead = ((i - j).clamp(min=0).float() / n)  # (B, N, N) how far the candidate is ahead
    behind = ((j - i).clamp(min=0).float() / n)  # (B, N, N)
    eye = [(i - j == k).float().expand_as(ahead) for k in (0, 1, -1, 2, -2)]
    words = torch.stack([ahead, behind, *eye], dim=-1)  # (B, N, N, 7)
    words = torch.cat([words.new_zeros(*words.shape[:2], 1, 7), words], dim=2)  # (B, N, N + 1, 7)
    root = torch.zeros(*words.shape[:3], 1, device=words.device)
    root[:, :, 0] = 1.0
    return torch.cat([words, root], dim=-1)  # (B, N, N + 1, 8)


class AttentionOnly(nn.Module):
    """logit(j, i) = sum_k w_k a^k_{j->i} + u_k a^k_{i->j}: one weight per head and direction."""

    def __init__(self, num_maps: int, word_dim: int | None = None):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(2 * num_maps))  # (2K,)
        self.root_start = nn.Parameter(torch.ones(()))
        self.root_end = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        feats = attention_features(batch, self.root_start, self.root_end)  # (B, N, N + 1, 2K)
        return feats @ self.weights  # (B, N, N + 1)


class AttentionGlove(nn.Module):
    """Weights depend on the word pair: logit(j, i) = sum_f [W (v_j + v_i) + b]_f feature_f(j, i)."""

    def __init__(self, num_maps: int, word_dim: int):
        super().__init__()
        self.weights = nn.Linear(2 * word_dim, 2 * num_maps)
        nn.init.zeros_(self.weights.weight)
        nn.init.zeros_(self.weights.bias)
        self.root_start = nn.Parameter(torch.ones(()))
        self.root_end = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        feats = attention_features(batch, self.root_start, self.root_end)  # (B, N, N + 1, 2K)
        w = self.weights(pair_vectors(vectors, batch["glove"]))  # (B, N, N + 1, 2K)
        return (w * feats).sum(-1)  # (B, N, N + 1)


class DistanceGlove(nn.Module):
    """Baseline without attention: MLP(tanh, hidden) over [distance features, v_j, v_i]."""

    def __init__(self, num_maps: int, word_dim: int, hidden: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8 + 2 * word_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, batch: dict[str, torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
        N = batch["heads"].shape[1]
        x = torch.cat([distance_features(N, batch["lengths"]), pair_vectors(vectors, batch["glove"])], -1)
        return self.mlp(x).squeeze(-1)  # (B, N, N + 1)


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
