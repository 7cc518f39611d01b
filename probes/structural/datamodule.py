"""Structural-probe data: one layer's cached word vectors + gold tree distances, depths and heads.

Shared with the attention probes' datamodule (:class:`probes.training.datamodule.TreebankDataModule`):
caches built in `prepare_data` (in a child process), compact per-sentence arrays, sentences read lazily
from the cache (only the chosen layer, `os.pread`) in length-bucketed batches. Batches also carry what
:class:`probes.dependency.module.DependencyProbe` reads (``heads``, ``punct``, ``lengths``, ``index``), so
the directed probe trains on the same data (its scorer is sized by :meth:`StructuralDataModule.scorer_sizes`;
there is no word-vector table).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from probes.data.conllu import Sentence
from probes.extract.representations import RepresentationCache, ensure_hidden_caches
from probes.structural.trees import depths, distances
from probes.training.datamodule import LoadedSplit, TreebankDataModule

log = logging.getLogger(__name__)


@dataclass
class HiddenSplit(LoadedSplit):
    """One split (:class:`~probes.training.datamodule.LoadedSplit`) plus each sentence's place in the file."""

    where: list[str] = field(default_factory=list)  # per sentence "file:line" for errors


class HiddenDataset(Dataset):
    """Items of one split: the sentence's layer-``layer`` word vectors (n, D) and its gold trees.

    ``shift`` / ``scale`` (D,), when given, standardize every vector: ``(h - shift) / scale``."""

    def __init__(self, split: HiddenSplit, layer: int, shift: np.ndarray | None = None,
                 scale: np.ndarray | None = None):
        self.split, self.layer, self.shift, self.scale = split, layer, shift, scale

    def __len__(self) -> int:
        return len(self.split.indices)

    def __getitem__(self, k: int) -> dict:
        i = self.split.indices[k]
        heads = self.split.heads[i].astype(np.int64)
        h = self.split.cache.layer(i, self.layer).astype(np.float32)  # (n, D)
        if self.shift is not None:
            h = (h - self.shift) / self.scale
        return dict(index=i, hidden=torch.from_numpy(h), heads=torch.from_numpy(heads),
                    punct=torch.from_numpy(self.split.punct[i]),
                    distances=torch.from_numpy(distances(heads, self.split.where[i])),
                    depths=torch.from_numpy(depths(heads, self.split.where[i])))

    def length(self, k: int) -> int:
        """Number of words of item k."""
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


def layer_moments(split: HiddenSplit, layer: int, floor: float = 1e-6) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-dimension mean and standard deviation (D,), float32, of layer ``layer``'s word vectors over every
    word of ``split`` (float64 sums; the deviation floored at ``floor`` so constant dimensions stay finite),
    and the number of words."""
    total, total_sq, count = 0.0, 0.0, 0
    for i in tqdm(split.indices, desc=f"moments of layer {layer}", leave=False, disable=None):
        h = split.cache.layer(i, layer).astype(np.float64)  # (n, D)
        total, total_sq, count = total + h.sum(0), total_sq + (h * h).sum(0), count + len(h)
    if count == 0:
        raise ValueError("no train words to standardize with (data.standardize=true)")
    mean = total / count  # (D,)
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))  # (D,)
    return mean.astype(np.float32), np.maximum(std, floor).astype(np.float32), count


class StructuralDataModule(TreebankDataModule):
    """Builds (or reuses) the hidden-state caches in `prepare_data`, then serves layer ``layer`` lazily.

    Args:
        hidden: ``{layers: null | [l, ...], pooling: mean | first}``: the layers stored in the cache (null:
            all, 0..L) and the piece -> word pooling; both are part of the cache key.
        layer: the layer served; must be one of the stored ones.
        standardize: ``false`` serves the stored states as they are (Hewitt & Manning); ``true`` shifts and
            scales every dimension to mean 0 and standard deviation 1 over the train split's words (the
            statistics of layer ``layer``, computed once in `setup`, logged, and applied to every split).
            Decoders' states carry a few dimensions thousands of times larger than the rest on the first
            word ("massive activations"); standardizing keeps them from swamping the probe's distances.
        Others: see :class:`~probes.training.datamodule.TreebankDataModule` (``conf/data/hidden_probe.yaml``).
    """

    collate = staticmethod(collate)

    def __init__(self, name: str, treebank: DictConfig, encoder: DictConfig, extract: DictConfig,
                 hidden: DictConfig, layer: int, cache_dir: str, splits: DictConfig, max_sentences: DictConfig,
                 batch_size: int = 20, max_pairs: int = 10000, num_workers: int = 0, seed: int = 0,
                 extract_in_child: bool = True, standardize: bool = False):
        super().__init__(name, treebank, encoder, extract, cache_dir, splits, max_sentences, batch_size, max_pairs,
                         num_workers, seed, extract_in_child)
        if not isinstance(standardize, bool):
            raise ValueError(f"data.standardize must be true or false, got {standardize!r}")
        self.layer, self.hidden_cfg, self.standardize = int(layer), hidden, standardize
        self.shift: np.ndarray | None = None  # (D,) train mean of layer `layer`, when standardizing
        self.scale: np.ndarray | None = None  # (D,) train standard deviation (floored), when standardizing

    def build_caches(self, splits: list[str]) -> dict[str, RepresentationCache]:
        """Per-word hidden-state caches (:func:`probes.extract.representations.ensure_hidden_caches`)."""
        return ensure_hidden_caches(self.encoder_cfg, self.treebank, splits, self.extract_cfg, self.hidden_cfg,
                                    self.cache_dir, self.max_sentences, child=self.extract_in_child)

    def check_cache(self, cache: RepresentationCache) -> None:
        """The cache must store ``layer``."""
        cache.position(self.layer)  # a clear error now if the layer is not stored

    def make_split(self, stage: str, split: str, sentences: list[Sentence], common: dict) -> HiddenSplit:
        """The split with each sentence's file and line (errors in its gold tree name them)."""
        path = self.treebank.path(split)
        return HiddenSplit(**common, where=[f"{path}:{x.line_no}" for x in sentences])

    def finish(self, loaded: dict[str, HiddenSplit]) -> None:
        """With ``standardize``: the train split's per-dimension mean and standard deviation of ``layer``."""
        if self.standardize:
            self.shift, self.scale, words = layer_moments(loaded["train"], self.layer)
            log.info("%s: layer %d standardized with the train split's moments (%d words; std %.3g .. %.3g)",
                     self.name, self.layer, words, float(self.scale.min()), float(self.scale.max()))

    @property
    def dim(self) -> int:
        """Hidden size of the cached states (the encoder config's)."""
        return next(iter(self.data.values())).cache.dim

    def scorer_sizes(self) -> dict[str, int]:
        """``word_dim``: the hidden size (the directed probe's input size)."""
        return dict(word_dim=self.dim)

    def dataset(self, stage: str) -> HiddenDataset:
        """The items of ``stage``, layer ``layer``."""
        return HiddenDataset(self.data[stage], self.layer, self.shift, self.scale)
