"""Sentences to padded batches: encoding in chunks, the long-sentence policy, length batches bounded in pieces and
attention pairs, and the word pooling matrices of a batch."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from probes.model.inputs import Encoded, encode_words, pad_encoded, pooling_matrix

log = logging.getLogger(__name__)

LONG_SENTENCES = ("skip", "error")  # what happens to a sentence longer than the limit


def encode_all(tokenizer, sentences: list[list[str]], chunk: int = 1024) -> list[Encoded]:
    """:func:`~probes.model.inputs.encode_words` in chunks (the tokenizer's batch output for a whole treebank is
    large)."""
    return [e for k in range(0, len(sentences), chunk) for e in encode_words(tokenizer, sentences[k:k + chunk])]


def select(encoded: list[Encoded], max_length: int, long_sentences: str) -> tuple[list[int], list[int]]:
    """(kept indices, too-long indices) under the long-sentence policy.

    Args:
        encoded: The encoded sentences.
        max_length: The most pieces a sentence may have, special tokens included.
        long_sentences: ``skip`` (left out, counted in the log) or ``error`` (a ValueError naming the first).
    """
    if long_sentences not in LONG_SENTENCES:
        raise ValueError(f"extract.long_sentences must be 'skip' or 'error', got '{long_sentences}'")
    too_long = [i for i, e in enumerate(encoded) if e.n_pieces > max_length]
    if too_long and long_sentences == "error":
        raise ValueError(f"{len(too_long)} sentences exceed {max_length} wordpieces (first: #{too_long[0]}); "
                         "set extract.long_sentences=skip to leave them out")
    if too_long:
        log.warning("%d of %d sentences exceed %d wordpieces and are left out of the cache (policy: skip)",
                    len(too_long), len(encoded), max_length)
    skipped = set(too_long)
    return [i for i in range(len(encoded)) if i not in skipped], too_long


def split_by_pairs(batches: list[list[int]], lengths: list[int], max_pairs: int | None) -> list[list[int]]:
    """Split length batches so that none holds more than ``max_pairs`` attention pairs (B * T^2): bounds the
    retained (B, H, T, T) maps of long sentences (memory) and keeps them cache-sized (speed); None or 0: as given."""
    if not max_pairs:
        return batches
    out = []
    for b in batches:
        T = max(lengths[i] for i in b)
        n = -(-len(b) * T * T // max_pairs)  # ceil: number of parts
        size = -(-len(b) // n)
        out += [b[k:k + size] for k in range(0, len(b), size)]
    return out


def pooling_matrices(items: list[Encoded], mode: str, T: int) -> torch.Tensor:
    """(B, W, T) word pooling matrices of a padded batch, W = most words + 2 (zero rows/columns pad);
    item k's block equals ``pooling_matrix(word_of_piece, n_words, mode)`` (built in one scatter)."""
    B, W = len(items), max(e.n_words for e in items) + 2
    out = torch.zeros(B, W, T)  # (B, W, T)
    if mode not in ("mean", "sum"):
        for k, e in enumerate(items):
            out[k, :e.n_words + 2, :e.n_pieces] = pooling_matrix(e.word_of_piece, e.n_words, mode)
        return out
    n = torch.tensor([e.n_pieces for e in items])  # (B,)
    b = torch.repeat_interleave(torch.arange(B), n)  # (N,) item of each piece
    t = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # (N,) its position
    w = torch.tensor([x for e in items for x in e.word_of_piece]) + 1  # (N,) its row: first special -> 0
    out[b, w, t] = 1.0
    if mode == "mean":
        out /= out.sum(-1, keepdim=True).clamp(min=1.0)
    return out


def make_batch(items: list[Encoded], indices: list[int], from_pool: str, to_pool: str, pad_id: int
               ) -> dict[str, torch.Tensor]:
    """One padded batch: input_ids, attention_mask (B, T) (and token_type_ids (B, T) when an item has them); from_mat,
    to_mat (B, W, T); index, n_words (B,)."""
    batch = pad_encoded(items, pad_id)  # input_ids, attention_mask (, token_type_ids): (B, T) each
    T = batch["input_ids"].shape[1]
    return dict(batch, from_mat=pooling_matrices(items, from_pool, T), to_mat=pooling_matrices(items, to_pool, T),
                index=torch.tensor(indices), n_words=torch.tensor([e.n_words for e in items]))


class SentenceBatches(Dataset):
    """Each item is one padded batch of sentences (DataLoader with batch_size=None); pooling matrices are
    built here, i.e. in the loader's workers when num_workers > 0.

    Args:
        encoded: The sentences of the batches.
        indices: The index each of them is stored under (a batch's ``index``).
        batches: Positions in ``encoded`` of each batch's sentences.
        from_pool, to_pool: Pooling of the rows and of the columns (``mean``, ``sum``, ``first``).
        pad_id: The id padded positions hold.
    """

    def __init__(self, encoded: list[Encoded], indices: list[int], batches: list[list[int]],
                 from_pool: str, to_pool: str, pad_id: int):
        self.encoded, self.indices, self.batches = encoded, indices, batches
        self.from_pool, self.to_pool, self.pad_id = from_pool, to_pool, pad_id

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        return make_batch([self.encoded[i] for i in self.batches[b]], [self.indices[i] for i in self.batches[b]],
                          self.from_pool, self.to_pool, self.pad_id)
