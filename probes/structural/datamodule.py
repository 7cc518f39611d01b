"""Structural-probe data: one layer's cached word vectors + gold tree distances, depths and heads.

Same conventions as the attention probes' datamodule (:mod:`probes.dependency.datamodule`): caches built
in `prepare_data` (in a child process), compact per-sentence arrays, sentences read lazily from the
cache (only the chosen layer, `os.pread`) in length-bucketed batches. Batches also carry what
:class:`probes.dependency.module.DependencyProbe` reads (``heads``, ``punct``, ``lengths``, ``index``), so
the directed probe trains on the same data (``num_maps``, ``word_dim``, ``vectors``, ``sentences``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from probes.data.conllu import Sentence
from probes.dependency.datamodule import PUNCT_UPOS, DependencyDataModule, LengthBatchSampler
from probes.extract.representations import RepresentationCache, ensure_hidden_caches
from probes.structural.trees import depths, distances

log = logging.getLogger(__name__)


@dataclass
class HiddenSplit:
    """One split: the cache, per-sentence gold heads and punctuation, the kept sentence indices."""

    cache: RepresentationCache
    heads: list[np.ndarray]  # per sentence (n,) int16 gold head, 0 = ROOT
    punct: list[np.ndarray]  # per sentence (n,) bool, UPOS PUNCT
    indices: list[int]  # sentences present in the cache (too-long ones are skipped)
    where: list[str]  # per sentence "file:line" for errors
    sentences: list[Sentence] | None = None


class HiddenDataset(Dataset):
    def __init__(self, split: HiddenSplit, layer: int):
        self.split, self.layer = split, layer

    def __len__(self) -> int:
        return len(self.split.indices)

    def __getitem__(self, k: int) -> dict:
        i = self.split.indices[k]
        heads = self.split.heads[i].astype(np.int64)
        h = self.split.cache.layer(i, self.layer)  # (n, D) float16
        return dict(index=i, hidden=torch.from_numpy(h.astype(np.float32)), heads=torch.from_numpy(heads),
                    punct=torch.from_numpy(self.split.punct[i]),
                    distances=torch.from_numpy(distances(heads, self.split.where[i])),
                    depths=torch.from_numpy(depths(heads, self.split.where[i])))

    def length(self, k: int) -> int:
        return len(self.split.heads[self.split.indices[k]])


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest sentence N: hidden (B, N, D) zeros; distances (B, N, N) and depths (B, N) -1 on
    padding; heads (B, N) -100 on padding; punct (B, N); lengths, index (B,)."""
    B, N, D = len(items), max(len(it["heads"]) for it in items), items[0]["hidden"].shape[1]
    hidden = torch.zeros(B, N, D)  # (B, N, D)
    dist = torch.full((B, N, N), -1.0)  # (B, N, N)
    depth = torch.full((B, N), -1.0)  # (B, N)
    heads = torch.full((B, N), -100, dtype=torch.long)  # (B, N)
    punct = torch.zeros(B, N, dtype=torch.bool)  # (B, N)
    lengths = torch.zeros(B, dtype=torch.long)  # (B,)
    for b, it in enumerate(items):
        n = len(it["heads"])
        hidden[b, :n], dist[b, :n, :n], depth[b, :n] = it["hidden"], it["distances"], it["depths"]
        heads[b, :n], punct[b, :n], lengths[b] = it["heads"], it["punct"], n
    return dict(index=torch.tensor([it["index"] for it in items]), hidden=hidden, distances=dist, depths=depth,
                heads=heads, punct=punct, lengths=lengths)


class StructuralDataModule(pl.LightningDataModule):
    """Builds (or reuses) the hidden-state caches in `prepare_data`, then serves layer ``layer`` lazily.

    hidden: ``{layers: null | [l, ...], pooling: mean | first}``: the layers stored in the cache (null: all,
    0..L) and the piece -> word pooling; both are part of the cache key. ``layer`` must be one of them.
    """

    def __init__(self, name: str, treebank: DictConfig, encoder: DictConfig, extract: DictConfig,
                 hidden: DictConfig, layer: int, cache_dir: str, splits: DictConfig, max_sentences: DictConfig,
                 batch_size: int = 20, max_pairs: int = 10000, num_workers: int = 0, seed: int = 0,
                 extract_in_child: bool = True):
        super().__init__()
        self.name, self.cache_dir, self.layer = name, cache_dir, int(layer)
        self.treebank = instantiate(treebank)
        self.encoder_cfg, self.extract_cfg, self.hidden_cfg = encoder, extract, hidden
        self.splits = dict(splits)  # stage name (train/val/test) -> treebank split (train/dev/test)
        self.max_sentences = dict(max_sentences or {})
        self.batch_size, self.max_pairs, self.num_workers, self.seed = batch_size, max_pairs, num_workers, seed
        self.extract_in_child = extract_in_child
        self.data: dict[str, HiddenSplit] = {}
        self.keep_sentences = {"test"}
        self.vectors = torch.zeros(1, 1)  # no word-vector table (DependencyProbe's interface)
        self.num_maps = None  # no attention maps (DependencyProbe's interface)

    def prepare_data(self) -> None:
        """Stage 1: extract whatever split is not cached yet (a no-op when all are)."""
        self._load()

    def setup(self, stage: str | None = None) -> None:
        self._load()

    def _load(self) -> dict[str, HiddenSplit]:
        if self.data:
            return self.data
        caches = ensure_hidden_caches(self.encoder_cfg, self.treebank, list(self.splits.values()), self.extract_cfg,
                                      self.hidden_cfg, self.cache_dir, self.max_sentences, child=self.extract_in_child)
        for stage, split in self.splits.items():
            cache, sentences = caches[split], self.treebank.read(split)[:self.max_sentences.get(split)]
            cache.position(self.layer)  # a clear error now if the layer is not stored
            indices = [i for i in range(len(sentences)) if i in cache]
            if len(indices) < len(sentences):
                log.warning("%s/%s: %d sentences longer than the encoder's maximum are not scored",
                            self.name, split, len(sentences) - len(indices))
            path = self.treebank.path(split)
            self.data[stage] = HiddenSplit(
                cache, heads=[np.asarray(x.heads, dtype=np.int16) for x in sentences],
                punct=[np.asarray([u == PUNCT_UPOS for u in x.upos]) for x in sentences], indices=indices,
                where=[f"{path}:{x.line_no}" for x in sentences],
                sentences=sentences if stage in self.keep_sentences else None)
            del sentences
        return self.data

    @property
    def dim(self) -> int:
        """Hidden size of the cached states (the encoder config's)."""
        return next(iter(self.data.values())).cache.dim

    @property
    def word_dim(self) -> int:  # DependencyProbe's name for the scorer's input size
        return self.dim

    def _loader(self, stage: str, shuffle: bool) -> DataLoader:
        ds = HiddenDataset(self.data[stage], self.layer)
        sampler = LengthBatchSampler([ds.length(k) for k in range(len(ds))], self.batch_size, self.max_pairs,
                                     shuffle, self.seed)
        return DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    # the attention probes' datamodule's loaders, cache sizes and test sentences work on these splits too
    train_dataloader = DependencyDataModule.train_dataloader
    val_dataloader = DependencyDataModule.val_dataloader
    test_dataloader = DependencyDataModule.test_dataloader
    summary = DependencyDataModule.summary
    sentences = DependencyDataModule.sentences
