"""Attention-cache entries that keep chosen rows of each sentence's word maps.

An analysis that scores a few words of each sentence (coref_heads: the mention heads' rows) asks for an entry of those
rows only (:class:`probes.extract.stage.AttentionMaps` with ``rows``). The maps are computed whole, as for any entry;
each batch's chosen rows are taken on the device (:func:`take_rows`, from a table of them made once) and only they
are copied to the host and written, sentence i as one (R_i, L, H, W_i) float16 block (:class:`RowsWriter`), R_i its
rows in increasing order (the manifest's ``rows``). The rows are those of the whole-map entry of the same sentences,
bit for bit; sentence i takes R_i / W_i of the bytes of its whole maps (coref_heads on GUM dev, MiniLM: 13% of the
entry). :meth:`probes.extract.cache.AttentionCache.rows` reads either kind of entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from probes.extract import cache
from probes.extract.writer import CacheWriter

Rows = tuple[tuple[int, ...], ...]  # per sentence, the kept rows: positions 0..W-1 of its word map ([CLS] at 0)


def normalized(rows: Sequence[Sequence[int]]) -> Rows:
    """Each sentence's rows in increasing order, once each (the form keyed and stored)."""
    return tuple(tuple(sorted({int(r) for r in rs})) for rs in rows)


def rows_digest(rows: Rows) -> str:
    """The 16 hex digits of the rows in the cache key: sha256 of their JSON."""
    return hashlib.sha256(json.dumps([list(r) for r in rows]).encode()).hexdigest()[:16]


def check_rows(rows: Rows, sentences: Sequence[Sequence[str]]) -> None:
    """A ValueError, before any work, unless ``rows`` has one list per sentence, each row a position of its word map
    (0..n + 1 for n words: [CLS], the words, [SEP])."""
    if len(rows) != len(sentences):
        raise ValueError(f"rows: {len(rows)} lists of rows for {len(sentences)} sentences (one per sentence)")
    for i, (rs, words) in enumerate(zip(rows, sentences)):
        bad = [r for r in rs if not 0 <= r <= len(words) + 1]
        if bad:
            raise ValueError(f"rows of sentence {i}: row {bad[0]} is outside its word map's 0..{len(words) + 1} "
                             f"({len(words)} words, [CLS] at 0)")


def row_table(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """((N, R_max) long: each sentence's kept rows, then zeros; (N,) long: how many it keeps), made once per entry
    for :func:`take_rows`."""
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)  # (N,)
    table = torch.zeros((len(rows), int(counts.max()) if len(rows) else 0), dtype=torch.long)  # (N, R_max)
    for i, r in enumerate(rows):
        table[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return table, counts


def take_rows(maps: torch.Tensor, index: torch.Tensor, table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(B, R, L, H, W): of a batch's word maps ``maps`` (B, L, H, W, W), sentence ``index[b]``'s kept rows at
    ``[b, :R_b]`` (``table``, ``counts``: :func:`row_table`; R the batch's most; the rows beyond a sentence's own
    repeat its row 0), on the maps' device."""
    index = index.cpu()
    R = int(counts[index].max()) if len(index) else 0
    at = table[index, :R].to(maps.device)  # (B, R)
    batch = torch.arange(len(index), device=maps.device)[:, None]  # (B, 1)
    return maps[batch, :, :, at]  # (B, R, L, H, W): the broadcast indices first, then the sliced dimensions


class RowShardWriter(cache.ShardWriter):
    """A shard of blocks (R, L, H, W) float16: sentence i's kept rows; the index's third column is W."""

    def index_size(self, sentence_index: int, block: np.ndarray) -> int:
        assert block.dtype == np.float16 and block.ndim == 4, \
            f"sentence {sentence_index}: expected float16 rows (R, L, H, W), got {block.dtype} {block.shape}"
        return block.shape[-1]


class RowsWriter(CacheWriter):
    """:class:`~probes.extract.writer.CacheWriter` of an entry of chosen rows: each batch's (B, R, L, H, W) rows
    (:func:`take_rows`) written as sentence i's (R_i, L, H, n_i + 2) block.

    Args:
        final_dir, manifest: As :class:`~probes.extract.writer.CacheWriter`'s.
        rows: Each sentence's kept rows (:func:`normalized`).
    """

    def __init__(self, final_dir: Path, manifest: dict, rows: Rows, **kw):
        super().__init__(final_dir, manifest, **kw)
        self.rows = rows

    def new_shard(self, rank: int) -> cache.ShardWriter:
        return RowShardWriter(self.partial_dir, rank)

    def blocks(self, maps: np.ndarray, index: list[int], n_words: list[int]) -> list[tuple[int, np.ndarray]]:
        """(sentence index, (R_i, L, H, n + 2) block) of each sentence of a batch's ``maps`` (B, R, L, H, W)."""
        return [(i, maps[k, :len(self.rows[i]), :, :, : n + 2]) for k, (i, n) in enumerate(zip(index, n_words))]
