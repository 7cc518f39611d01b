"""Dependency-probe data: cached word-level attention + gold heads + GloVe vectors, batched by length."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from probes.data.conllu import Sentence
from probes.data.glove import vector_rows
from probes.extract.cache import AttentionCache
from probes.extract.run import ensure_caches

log = logging.getLogger(__name__)

PUNCT_UPOS = "PUNCT"


@dataclass
class SplitData:
    """One split as compact per-sentence arrays; full `Sentence`s are kept only for the test split."""

    cache: AttentionCache
    heads: list[np.ndarray]  # per sentence (n,) int16 gold head, 0 = ROOT
    punct: list[np.ndarray]  # per sentence (n,) bool, UPOS PUNCT
    words: list[tuple[str, ...]] | None  # until the GloVe rows are attached, then dropped
    indices: list[int]  # sentences present in the cache (too-long ones are skipped)
    sentences: list[Sentence] | None = None
    glove_ids: list[np.ndarray] | None = None  # per sentence (n,) row in the vector table, 0 = no vector


class DependencySplit(Dataset):
    def __init__(self, split: SplitData):
        self.split = split

    def __len__(self) -> int:
        return len(self.split.indices)

    def __getitem__(self, k: int) -> dict:
        i = self.split.indices[k]
        maps = self.split.cache[i]  # (L, H, W, W) float16, W = n + 2
        return dict(index=i, maps=torch.from_numpy(maps.astype(np.float32)),
                    heads=torch.from_numpy(self.split.heads[i].astype(np.int64)),
                    punct=torch.from_numpy(self.split.punct[i]), glove=torch.from_numpy(self.split.glove_ids[i]))

    def length(self, k: int) -> int:
        return len(self.split.heads[self.split.indices[k]])


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest sentence N and lay the maps out as probe features.

    F = 2K features per (dependent j, candidate i): K = layers x heads maps of attention j -> i,
    then the same K maps of attention i -> j. [CLS] and [SEP] become the ROOT features.
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
    return dict(index=torch.tensor([it["index"] for it in items]), feats=feats, root_cls=root_cls,
                root_sep=root_sep, heads=heads, punct=punct, glove=glove, lengths=lengths)


class LengthBatchSampler(BatchSampler):
    """Batches of similar length under a (batch_size, pairs) budget; shuffled per epoch when training.

    Under DDP Lightning re-creates it with its ``DistributedSampler`` as ``sampler`` (a ``BatchSampler``
    subclass built in a ``*_dataloader`` hook); rank r of R then keeps batches r, r + R, ... of the same
    global order: training pads the order by repeating its first batches so that every rank takes the same
    number of steps, evaluation never repeats one, so each sentence is scored exactly once.
    """

    def __init__(self, lengths: list[int], batch_size: int, max_pairs: int, shuffle: bool, seed: int = 0,
                 sampler: Sampler | None = None):
        self.lengths, self.batch_size, self.max_pairs, self.shuffle, self.seed = lengths, batch_size, max_pairs, shuffle, seed
        self.sampler, self.drop_last = sampler, False
        self.epoch = 0

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.lengths)), key=lambda k: (self.lengths[k], rng.random() if self.shuffle else k))
        batches, cur = [], []
        for k in order:
            n = self.lengths[k]
            if cur and (len(cur) >= self.batch_size or (len(cur) + 1) * n * (n + 1) > self.max_pairs):
                batches.append(cur)
                cur = []
            cur.append(k)
        batches += [cur] if cur else []
        if self.shuffle:
            rng.shuffle(batches)
            self.epoch += 1
        if isinstance(self.sampler, DistributedSampler) and self.sampler.num_replicas > 1:
            rank, world = self.sampler.rank, self.sampler.num_replicas
            if self.shuffle:  # training: the same number of steps on every rank
                batches += batches[:-len(batches) % world]
            batches = batches[rank::world]
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class DependencyDataModule(pl.LightningDataModule):
    """Builds (or reuses) the attention caches in `prepare_data`, then serves them lazily."""

    def __init__(self, name: str, treebank: DictConfig, encoder: DictConfig, glove: DictConfig | None,
                 extract: DictConfig, cache_dir: str, splits: DictConfig, max_sentences: DictConfig,
                 batch_size: int = 16, max_pairs: int = 10000, num_workers: int = 0, seed: int = 0,
                 extract_in_child: bool = True):
        super().__init__()
        self.extract_in_child = extract_in_child  # missing caches are built in a child process (peak memory)
        self.name, self.cache_dir = name, cache_dir
        self.treebank = instantiate(treebank)
        self.encoder_cfg, self.glove_cfg, self.extract_cfg = encoder, glove, extract
        self.splits = dict(splits)  # stage name (train/val/test) -> treebank split (train/dev/test)
        self.max_sentences = dict(max_sentences or {})
        self.batch_size, self.max_pairs, self.num_workers, self.seed = batch_size, max_pairs, num_workers, seed
        self.data: dict[str, SplitData] = {}
        self.keep_sentences = {"test"}  # the CoNLL-U prediction writer needs the full test sentences
        self.vectors: torch.Tensor | None = None  # (V + 1, d) row 0 = zero vector for words without one
        self.num_layers = self.num_heads = None

    def prepare_data(self) -> None:
        """Stage 1: extract whatever split is not cached yet (a no-op when all are)."""
        self._load_caches()

    def _load_caches(self) -> dict:
        if self.data:
            return self.data
        caches = ensure_caches(self.encoder_cfg, self.treebank, list(self.splits.values()), self.extract_cfg,
                               self.cache_dir, self.max_sentences, child=self.extract_in_child)
        loaded = {}
        for stage, split in self.splits.items():
            cache, sentences = caches[split], self.treebank.read(split)[:self.max_sentences.get(split)]
            indices = [i for i in range(len(sentences)) if i in cache]
            if len(indices) < len(sentences):
                log.warning("%s/%s: %d sentences longer than the encoder's maximum are not scored",
                            self.name, split, len(sentences) - len(indices))
            loaded[stage] = SplitData(
                cache, heads=[np.asarray(x.heads, dtype=np.int16) for x in sentences],
                punct=[np.asarray([u == PUNCT_UPOS for u in x.upos]) for x in sentences],
                words=[x.words for x in sentences], indices=indices,
                sentences=sentences if stage in self.keep_sentences else None)
            del sentences
        # maps per sentence as stored: (L, H) for per-head kinds, (L, 1) for per-layer ones (rollout, alti, ...)
        shapes = {(c.num_layers, c.num_heads) for c in caches.values()}
        if len(shapes) != 1:
            raise ValueError(f"{self.name}: the splits' caches store different map shapes {sorted(shapes)}")
        self.num_layers, self.num_heads = shapes.pop()
        self._attach_vectors(loaded)
        self.data = loaded
        return loaded

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
        return self.vectors.shape[1]

    def setup(self, stage: str | None = None) -> None:
        self._load_caches()

    def _loader(self, stage: str, shuffle: bool) -> DataLoader:
        ds = DependencySplit(self.data[stage])
        sampler = LengthBatchSampler([ds.length(k) for k in range(len(ds))], self.batch_size, self.max_pairs,
                                     shuffle, self.seed)
        return DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def summary(self) -> dict[str, float]:
        """Cache sizes on disk (MB), reported next to the run's peak RSS."""
        return {f"data/{stage}_cache_mb": d.cache.manifest["bytes"] / 2**20 for stage, d in self.data.items()}

    def sentences(self, stage: str) -> list[Sentence]:
        if self.data[stage].sentences is None:
            raise KeyError(f"full sentences are kept only for {sorted(self.keep_sentences)}, not '{stage}'")
        return self.data[stage].sentences
