"""Dependency-probe data: cached word-level attention + gold heads + GloVe vectors, batched by length."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import Dataset

from probes.data.conllu import Sentence
from probes.data.glove import vector_rows
from probes.extract.attention_caches import ensure_caches
from probes.extract.cache import AttentionCache
from probes.training.datamodule import LoadedSplit, TreebankDataModule
from probes.training.module import count_nonfinite

log = logging.getLogger(__name__)


@dataclass
class SplitData(LoadedSplit):
    """One split as compact per-sentence arrays, plus each sentence's rows in the word-vector table."""

    words: list[tuple[str, ...]] | None = None  # until the GloVe rows are attached, then dropped
    glove_ids: list[np.ndarray] | None = None  # per sentence (n,) row in the vector table, 0 = no vector


class DependencySplit(Dataset):
    """Items of one split: the sentence's cached maps (L, H, n + 2, n + 2), heads, punctuation, GloVe rows, and
    ``nonfinite``: how many NaN/inf values the maps held as read (counted here, in the loader's worker where there
    is one, on the float32 copy just made; :meth:`probes.training.module.ProbeModule.check_batch` reads it)."""

    def __init__(self, split: SplitData):
        self.split = split

    def __len__(self) -> int:
        return len(self.split.indices)

    def __getitem__(self, k: int) -> dict:
        i = self.split.indices[k]
        maps = self.split.cache[i].astype(np.float32)  # (L, H, W, W), W = n + 2, stored float16
        return dict(index=i, maps=torch.from_numpy(maps), nonfinite=count_nonfinite(maps),
                    heads=torch.from_numpy(self.split.heads[i].astype(np.int64)),
                    punct=torch.from_numpy(self.split.punct[i]), glove=torch.from_numpy(self.split.glove_ids[i]))

    def length(self, k: int) -> int:
        """Number of words of item k."""
        return len(self.split.heads[self.split.indices[k]])


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest sentence N and lay the maps out as probe features.

    F = 2K features per (dependent j, candidate i): K = layers x heads maps of attention j -> i,
    then the same K maps of attention i -> j. [CLS] and [SEP] become the ROOT features. Items that carry
    ``nonfinite`` (the dataset's) give the batch ``nonfinite`` (B,): every float tensor here is made of their maps.
    """
    B, N = len(items), max(len(it["heads"]) for it in items)
    L, H = items[0]["maps"].shape[:2]
    K = L * H
    feats = torch.zeros(B, 2 * K, N, N)  # (B, F, N, N) [b, f, j, i]
    root_cls = torch.zeros(B, 2 * K, N)  # (B, F, N) attention j -> [CLS], then [CLS] -> j
    root_sep = torch.zeros(B, 2 * K, N)  # (B, F, N) attention j -> [SEP], then [SEP] -> j
    heads = torch.full((B, N), -100, dtype=torch.long)  # (B, N) gold head, 0 = ROOT, -100 = padding
    punct = torch.zeros(B, N, dtype=torch.bool)  # (B, N)
    glove = torch.zeros(B, N, dtype=torch.long)  # (B, N) row in the vector table
    lengths = torch.zeros(B, dtype=torch.long)  # (B,)
    for b, it in enumerate(items):
        n = len(it["heads"])
        m = it["maps"].reshape(K, n + 2, n + 2)
        words = m[:, 1:-1, 1:-1]  # (K, n, n)
        feats[b, :K, :n, :n] = words
        feats[b, K:, :n, :n] = words.transpose(-1, -2)
        root_cls[b, :K, :n], root_cls[b, K:, :n] = m[:, 1:-1, 0], m[:, 0, 1:-1]
        root_sep[b, :K, :n], root_sep[b, K:, :n] = m[:, 1:-1, -1], m[:, -1, 1:-1]
        heads[b, :n], punct[b, :n], glove[b, :n], lengths[b] = it["heads"], it["punct"], it["glove"], n
    batch = dict(index=torch.tensor([it["index"] for it in items]), feats=feats, root_cls=root_cls,
                 root_sep=root_sep, heads=heads, punct=punct, glove=glove, lengths=lengths)
    if all("nonfinite" in it for it in items):
        batch["nonfinite"] = torch.tensor([it["nonfinite"] for it in items])  # (B,) NaN/inf values as read
    return batch


class DependencyDataModule(TreebankDataModule):
    """Cached word-level attention maps of every split (:func:`probes.extract.attention_caches.ensure_caches`) and the
    GloVe rows of their words; everything else as :class:`probes.training.datamodule.TreebankDataModule`.

    Args:
        glove: config of the word vectors (``conf/glove``), or None for a zero table (attention-only scorers).
        Others: see :class:`~probes.training.datamodule.TreebankDataModule` (``conf/data/treebank_probe.yaml``).
    """

    collate = staticmethod(collate)

    def __init__(self, name: str, treebank: DictConfig, encoder: DictConfig, glove: DictConfig | None,
                 extract: DictConfig, cache_dir: str, splits: DictConfig, max_sentences: DictConfig,
                 batch_size: int = 16, max_pairs: int = 10000, num_workers: int = 0, seed: int = 0,
                 extract_in_child: bool = True):
        super().__init__(name, treebank, encoder, extract, cache_dir, splits, max_sentences, batch_size, max_pairs,
                         num_workers, seed, extract_in_child)
        self.glove_cfg = glove
        self.vectors: torch.Tensor | None = None  # (V + 1, d) row 0 = zero vector for words without one
        self.num_layers = self.num_heads = None

    def build_caches(self, splits: list[str]) -> dict[str, AttentionCache]:
        """Word-level attention caches (:func:`probes.extract.attention_caches.ensure_caches`)."""
        return ensure_caches(self.encoder_cfg, self.treebank, splits, self.extract_cfg, self.cache_dir,
                             self.max_sentences, child=self.extract_in_child)

    def make_split(self, stage: str, split: str, sentences: list[Sentence], common: dict) -> SplitData:
        """The split with its words (replaced by GloVe rows in :meth:`finish`)."""
        return SplitData(**common, words=[x.words for x in sentences])

    def finish(self, loaded: dict[str, SplitData]) -> None:
        """The encoder's map shape (the same in every split) and the word-vector table."""
        # maps per sentence as stored: (L, H) for per-head kinds, (L, 1) for per-layer ones (rollout, alti, ...)
        shapes = {(d.cache.num_layers, d.cache.num_heads) for d in loaded.values()}
        if len(shapes) != 1:
            raise ValueError(f"{self.name}: the splits' caches store different map shapes {sorted(shapes)}")
        self.num_layers, self.num_heads = shapes.pop()
        self._attach_vectors(loaded)

    def _attach_vectors(self, loaded: dict[str, SplitData]) -> None:
        """Compact table of the GloVe rows these splits use (cached); missing words map to row 0 (zeros)."""
        if self.glove_cfg is None:
            for d in loaded.values():
                d.glove_ids, d.words = [np.zeros(len(w), dtype=np.int64) for w in d.words], None
            self.vectors = torch.zeros(1, 1)
            return
        vocab = sorted({w for d in loaded.values() for words in d.words for w in words})
        ids, table = vector_rows(instantiate(self.glove_cfg), vocab, Path(self.cache_dir) / "vectors")
        id_of = dict(zip(vocab, ids.tolist()))  # word -> row in the compact table (0 = no vector)
        for stage, d in loaded.items():
            d.glove_ids = [np.array([id_of[w] for w in words], dtype=np.int64) for words in d.words]
            total, missing = sum(len(x) for x in d.glove_ids), sum(int((x == 0).sum()) for x in d.glove_ids)
            d.words = None
            log.info("%s/%s: %d of %d words (%.1f%%) have no GloVe vector and get the zero vector",
                     self.name, stage, missing, total, 100 * missing / max(total, 1))
        self.vectors = torch.from_numpy(table)

    @property
    def num_maps(self) -> int:
        """Attention maps per sentence: layers x heads of the encoder (from its config)."""
        return self.num_layers * self.num_heads

    @property
    def word_dim(self) -> int:
        """Dimension of the word vectors."""
        return self.vectors.shape[1]

    def scorer_sizes(self) -> dict[str, int]:
        """``num_maps`` (attention maps per sentence) and ``word_dim`` (word-vector dimension)."""
        return dict(num_maps=self.num_maps, word_dim=self.word_dim)

    def dataset(self, stage: str) -> DependencySplit:
        """The items of ``stage``."""
        return DependencySplit(self.data[stage])
