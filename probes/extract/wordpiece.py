"""Wordpiece tokenization of pre-split words and wordpiece -> word attention pooling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# How attention *from* a split word (rows) and *to* a split word (columns) is pooled over its
# pieces. Clark et al.: rows are averaged (mean), columns are summed (sum), so rows still sum to 1.
POOLINGS = ("mean", "sum", "first")


@dataclass
class Encoded:
    """One sentence in wordpieces: ids with [CLS]/[SEP] and the word of every piece."""

    input_ids: list[int]  # (T,)
    word_of_piece: list[int]  # (T,) -1 for [CLS], 0..n-1 for words, n for [SEP]
    n_words: int

    @property
    def n_pieces(self) -> int:
        return len(self.input_ids)


def encode_sentences(tokenizer, sentences: list[list[str]]) -> list[Encoded]:
    """Tokenize pre-split words; a word with no pieces (e.g. a control character) becomes [UNK]."""
    out = tokenizer(sentences, is_split_into_words=True, add_special_tokens=True)
    encoded = []
    for b, words in enumerate(sentences):
        ids = out["input_ids"][b]
        wids = out.word_ids(b)
        if len({w for w in wids if w is not None}) != len(words):
            ids, wids = _encode_word_by_word(tokenizer, words)
        n = len(words)
        word_of_piece = [-1 if i == 0 else (n if w is None else w) for i, w in enumerate(wids)]
        encoded.append(Encoded(list(ids), word_of_piece, n))
    return encoded


def _encode_word_by_word(tokenizer, words: list[str]) -> tuple[list[int], list[int | None]]:
    pieces = tokenizer(words, add_special_tokens=False)["input_ids"]
    ids, wids = [tokenizer.cls_token_id], [None]
    for w, p in enumerate(pieces):
        p = p or [tokenizer.unk_token_id]
        ids += p
        wids += [w] * len(p)
    return ids + [tokenizer.sep_token_id], wids + [None]


def pooling_matrix(word_of_piece: list[int], n_words: int, mode: str) -> torch.Tensor:
    """(W, T) matrix M with word attention = M_from @ A @ M_to^T; W = n_words + 2 ([CLS], words, [SEP])."""
    if mode not in POOLINGS:
        raise ValueError(f"unknown pooling '{mode}', expected one of {POOLINGS}")
    T, W = len(word_of_piece), n_words + 2
    rows = torch.tensor([w + 1 for w in word_of_piece])  # (T,) row of each piece; [CLS] -> 0
    m = torch.zeros(W, T)
    if mode == "first":
        first = torch.full((W,), -1, dtype=torch.long)
        for t in range(T - 1, -1, -1):
            first[rows[t]] = t
        m[torch.arange(W), first] = 1.0
        return m
    m[rows, torch.arange(T)] = 1.0
    if mode == "mean":
        m = m / m.sum(dim=1, keepdim=True)
    return m


def pool_attention(attn: torch.Tensor, from_mat: torch.Tensor, to_mat: torch.Tensor) -> torch.Tensor:
    """Word-level attention.

    attn: (B, K, T, T) wordpiece attention (K = layers * heads); from_mat, to_mat: (B, W, T).
    Returns (B, K, W, W).
    """
    return from_mat.unsqueeze(1) @ attn @ to_mat.unsqueeze(1).transpose(-1, -2)
