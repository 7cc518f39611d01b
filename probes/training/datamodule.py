"""The treebank datamodule base: caches of one encoder over a treebank's splits, served in length batches.

What the attention probes (:mod:`probes.dependency.datamodule`) and the hidden-state probes
(:mod:`probes.structural.datamodule`) share: the stage -> treebank split mapping (``splits``), the first-N
sentence limits (``max_sentences``), the caches built (or reused) in ``prepare_data`` (in a child process
with ``extract_in_child``, so training never holds the encoder's weights), per-sentence gold heads and
punctuation as compact arrays, the sentences too long for the encoder left out (with a warning), the full
sentences kept for the test split only (the CoNLL-U prediction writer), and batches of similar length
under a (``batch_size``, ``max_pairs``) budget (:class:`LengthBatchSampler`). A subclass adds only its cache
kind (:meth:`TreebankDataModule.build_caches`), its per-split data, dataset and collate function, and the
sizes its scorers are built with (:meth:`TreebankDataModule.scorer_sizes`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from probes.data.conllu import Sentence
from probes.extract.cache import CacheEntry

log = logging.getLogger(__name__)

PUNCT_UPOS = "PUNCT"


@dataclass
class LoadedSplit:
    """One split loaded for serving: its cache, per-sentence gold heads and punctuation, the scored sentences;
    full `Sentence`s only for the splits in ``keep_sentences`` (subclasses add their own per-sentence arrays).
    Which sentences an entry was extracted from is :class:`probes.extract.runner.TreebankSplit`."""

    cache: CacheEntry  # the split's cache (AttentionCache, RepresentationCache): ``i in cache``, ``manifest``
    heads: list[np.ndarray]  # per sentence (n,) int16 gold head, 0 = ROOT
    punct: list[np.ndarray]  # per sentence (n,) bool, UPOS PUNCT
    indices: list[int]  # sentences present in the cache (too-long ones are skipped)
    sentences: list[Sentence] | None = None


class LengthBatchSampler(BatchSampler):
    """Batches of similar length under a (batch_size, pairs) budget; shuffled per epoch when training.

    The order of epoch e is drawn from ``seed + e``, e the trainer's epoch (``epoch_of()``; without one, the
    number of times it was iterated), so a run resumed from a checkpoint sees the batches of the run left alone;
    ``len()`` draws nothing.

    Under DDP Lightning re-creates it with its ``DistributedSampler`` as ``sampler`` (a ``BatchSampler``
    subclass built in a ``*_dataloader`` hook); rank r of R then keeps batches r, r + R, ... of the same
    global order: training pads the order by repeating its first batches so that every rank takes the same
    number of steps, evaluation never repeats one, so each sentence is scored exactly once.
    """

    def __init__(self, lengths: list[int], batch_size: int, max_pairs: int, shuffle: bool, seed: int = 0,
                 sampler: Sampler | None = None, epoch_of: Callable[[], int | None] | None = None):
        self.lengths, self.batch_size, self.max_pairs, self.shuffle, self.seed = lengths, batch_size, max_pairs, shuffle, seed
        self.sampler, self.drop_last, self.epoch_of = sampler, False, epoch_of
        self.epoch = 0  # iterations so far (the epoch when epoch_of gives none)

    def current_epoch(self) -> int:
        """The epoch whose order is drawn: ``epoch_of()``, else the iterations so far."""
        e = self.epoch_of() if self.epoch_of is not None else None
        return self.epoch if e is None else int(e)

    def _batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed + epoch)
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
        if isinstance(self.sampler, DistributedSampler) and self.sampler.num_replicas > 1:
            rank, world = self.sampler.rank, self.sampler.num_replicas
            if self.shuffle:  # training: the same number of steps on every rank
                batches += batches[:-len(batches) % world]
            batches = batches[rank::world]
        return batches

    def __iter__(self):
        batches = self._batches(self.current_epoch())
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return len(self._batches(self.current_epoch()))


class TreebankDataModule(pl.LightningDataModule):
    """Builds (or reuses) one encoder's caches over a treebank in `prepare_data`, then serves them lazily.

    Args:
        name: the data's name (log lines, errors).
        treebank: config of a :class:`probes.data.conllu.Treebank` (``conf/treebank``).
        encoder, extract: configs of the encoder and of the extraction (built lazily, where needed).
        cache_dir: root of the caches.
        splits: stage (``train``, ``val``, ``test``) -> treebank split (``train``, ``dev``, ``test``).
        max_sentences: treebank split -> the first N sentences (file order), or null for all.
        batch_size, max_pairs: at most this many sentences and (n x (n + 1)) word pairs per batch.
        num_workers: data-loader processes.
        seed: of the training batches' order.
        extract_in_child: build missing caches in a child process.
    """

    collate: Callable[[list[dict]], dict[str, torch.Tensor]]  # pads a list of items into a batch
    vectors: torch.Tensor | None = None  # (V + 1, d) word-vector rows that batch["glove"] indexes; None: no table

    def __init__(self, name: str, treebank: DictConfig, encoder: DictConfig, extract: DictConfig, cache_dir: str,
                 splits: Mapping[str, str], max_sentences: Mapping[str, int | None] | None, batch_size: int,
                 max_pairs: int, num_workers: int, seed: int, extract_in_child: bool):
        super().__init__()
        self.name, self.cache_dir = name, cache_dir
        self.treebank = instantiate(treebank)
        self.encoder_cfg, self.extract_cfg = encoder, extract
        self.splits = dict(splits)  # stage name (train/val/test) -> treebank split (train/dev/test)
        self.max_sentences = dict(max_sentences or {})
        self.batch_size, self.max_pairs, self.num_workers, self.seed = batch_size, max_pairs, num_workers, seed
        self.extract_in_child = extract_in_child  # missing caches are built in a child process (peak memory)
        self.data: dict[str, LoadedSplit] = {}
        self.keep_sentences = {"test"}  # the CoNLL-U prediction writer needs the full test sentences

    # ------------------------------------------------------------------ what a subclass adds
    def build_caches(self, splits: list[str]) -> dict[str, Any]:
        """Treebank split -> its cache, built where missing (the subclass's cache kind)."""
        raise NotImplementedError

    def check_cache(self, cache: Any) -> None:
        """Raise a clear error now when a split's cache cannot serve this datamodule."""

    def make_split(self, stage: str, split: str, sentences: list[Sentence], common: dict[str, Any]) -> LoadedSplit:
        """The split's data (the subclass's :class:`LoadedSplit`): ``common`` holds the shared fields
        (cache, heads, punct, indices, sentences) and ``sentences`` all of the split's sentences read."""
        raise NotImplementedError

    def finish(self, loaded: dict[str, LoadedSplit]) -> None:
        """After every split is loaded: checks and tables across splits."""

    def dataset(self, stage: str) -> Dataset:
        """The dataset of one stage; its ``length(k)`` is item k's number of words."""
        raise NotImplementedError

    def scorer_sizes(self) -> dict[str, int]:
        """The keyword arguments a dependency scorer is built with (``DependencyProbe.build``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def prepare_data(self) -> None:
        """Stage 1: extract whatever split is not cached yet (a no-op when all are)."""
        self._load()

    def setup(self, stage: str | None = None) -> None:
        self._load()

    def _load(self) -> dict[str, LoadedSplit]:
        if self.data:
            return self.data
        read = self.read_splits()  # in this process, before any cache is built: bad input fails here
        caches = self.build_caches(list(read))
        loaded = {}
        last = {split: stage for stage, split in self.splits.items()}  # the last stage that uses each split
        for stage, split in self.splits.items():
            cache, sentences = caches[split], read[split] if last[split] != stage else read.pop(split)
            self.check_cache(cache)
            indices = [i for i in range(len(sentences)) if i in cache]
            if len(indices) < len(sentences):
                log.warning("%s/%s: %d sentences longer than the encoder's maximum are not scored",
                            self.name, split, len(sentences) - len(indices))
            common = dict(cache=cache, heads=[np.asarray(x.heads, dtype=np.int16) for x in sentences],
                          punct=[np.asarray([u == PUNCT_UPOS for u in x.upos]) for x in sentences], indices=indices,
                          sentences=sentences if stage in self.keep_sentences else None)
            loaded[stage] = self.make_split(stage, split, sentences, common)
            del sentences
        self.finish(loaded)
        self.data = loaded
        return loaded

    def read_splits(self) -> dict[str, list[Sentence]]:
        """Treebank split -> its first ``max_sentences`` sentences, each split read once and checked
        (:meth:`probes.data.sources.Treebank.read`: trees, encoding, an empty file); an error names the file
        and line or the setting, before any extraction or training."""
        out = {}
        for split in dict.fromkeys(self.splits.values()):
            out[split] = self.treebank.read(split)[:self.max_sentences.get(split)]
            if not out[split]:
                raise ValueError(f"{self.name}: no {split} sentences to use: data.max_sentences.{split}="
                                 f"{self.max_sentences.get(split)!r} ({self.treebank.path(split)})")
        return out

    def _loader(self, stage: str, shuffle: bool) -> DataLoader:
        ds = self.dataset(stage)
        sampler = LengthBatchSampler([ds.length(k) for k in range(len(ds))], self.batch_size, self.max_pairs,
                                     shuffle, self.seed, epoch_of=self._trainer_epoch)
        return DataLoader(ds, batch_sampler=sampler, collate_fn=self.collate, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def _trainer_epoch(self) -> int | None:
        """The epoch whose training order is drawn (None outside a Trainer): the fit loop's processed epochs,
        the count Lightning gives samplers (``set_epoch``); unlike ``current_epoch`` it is already right when a
        run resumed from an end-of-epoch checkpoint makes its first iterator."""
        return None if self.trainer is None else self.trainer.fit_loop.epoch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def summary(self) -> dict[str, float]:
        """Cache sizes on disk (MB), reported next to the run's peak RSS."""
        return {f"data/{stage}_cache_mb": d.cache.manifest["bytes"] / 2**20 for stage, d in self.data.items()}

    def provenance(self) -> dict[str, Any]:
        """What this datamodule read: the treebank's files (path, sha256) and every split's cache entry (path and
        key: encoder and weights fingerprint, data sha256, pooling, precision)."""
        files = {split: dict(path=str(self.treebank.path(split)), sha256=self.treebank.file_sha256(split))
                 for split in self.splits.values()}
        caches = {stage: dict(path=str(d.cache.path), key=d.cache.manifest.get("key"))
                  for stage, d in self.data.items()}
        return dict(dataset=self.name, data_files=files, cache_dir=str(self.cache_dir), caches=caches)

    def source(self, stage: str) -> str:
        """Where ``stage``'s inputs are read from (error messages): its cache entry and the command that rebuilds it."""
        d = self.data.get(stage)
        if d is None:
            return f"stage {stage} (not loaded)"
        command = d.cache.manifest.get("command")
        return f"cache entry {d.cache.path}" + (f" (rebuilt by: rm -r {d.cache.path}; {command})" if command else "")

    def sentences(self, stage: str) -> list[Sentence]:
        """The full sentences of ``stage`` (kept for the stages in ``keep_sentences`` only)."""
        if self.data[stage].sentences is None:
            raise KeyError(f"full sentences are kept only for {sorted(self.keep_sentences)}, not '{stage}'")
        return self.data[stage].sentences
