"""Keyed on-disk cache of per-word hidden states (the structural probes' input), beside the attention cache.

Layout of one entry `<cache_dir>/hidden/<encoder>-<dataset>-<split>-<hash>/` (the attention cache's pieces:
same key hash, shard writer, build lock, `finalize` with its atomic rename):
  manifest.json        key, stored layers, hidden size, shard list, skipped sentences (written last)
  maps-r<rank>.f16     float16 states of the sentences that rank wrote, back to back
  index-r<rank>.npy    (N_r, 3) int64 rows: sentence index, element offset, number of words n
Every file's size and CRC-32 are in the manifest and checked when the entry is first opened in a process
(:func:`probes.extract.cache.verify`).
A sentence with n words is stored as (L', n, D): L' = the stored layers in increasing order (0 = embedding
output, l = output of layer l), one row per word, pieces pooled to words (`mean` over the word's pieces,
or its `first` piece; part of the key). Readers copy one sentence (or one layer of it) with `os.pread`.

Extraction runs on the attention stage's own loop on one device in one process (:func:`probes.extract.stage.
device_loop`: batches built ahead, each batch's states written as one contiguous write in a background thread, the
split's tokenization reused), on Lightning's predict loop otherwise (several devices, a rank of a distributed job:
:func:`probes.extract.stage.choose_loop`); the entries are byte for byte the same either way.

The cache kind is :class:`HiddenStates` (keyed, found, built and run in a child process by
:mod:`probes.extract.runner`); :func:`ensure_hidden_caches` builds missing entries in a child process, so a
training process never holds the encoder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from probes.config import plain
from probes.extract import cache
from probes.extract import runner
from probes.extract import stage
from probes.extract.runner import TreebankSplit
from probes.extract.settings import ExtractSettings
from probes.extract.writer import CacheWriter, extraction_peer
from probes.maps import SentenceBatches, pad_id_of, select
from probes.memory import reusable_heap
from probes.model.hidden import check_layers, hidden_states, layer_list
from probes.model.inputs import Encoded, length_batches
from probes.model.load import Encoder
from probes.progress import ProgressCallback

log = logging.getLogger(__name__)

HIDDEN_FORMAT = 1  # layout version of this cache (on top of the attention cache's FORMAT_VERSION)
POOLINGS = ("mean", "first")  # pieces -> word: mean over the word's pieces (Hewitt & Manning) or its first piece


def hidden_entry_dir(cache_dir: str | Path, key: dict) -> Path:
    """``<cache_dir>/hidden/<encoder>-<dataset>-<split>-<hash of key>`` (named as attention entries are)."""
    return cache.entry_dir(cache_dir, key, HiddenStates.folder)


class HiddenShardWriter(cache.ShardWriter):
    """:class:`~probes.extract.cache.ShardWriter` for (L', n, D) blocks (index rows: sentence, offset, n)."""

    def index_size(self, sentence_index: int, block: np.ndarray) -> int:
        """n, the words of ``block`` ((L', n, D) float16; an assertion error for anything else)."""
        assert block.dtype == np.float16 and block.ndim == 3, \
            f"sentence {sentence_index}: expected float16 states (L', n, D), got {block.dtype} {block.shape}"
        return block.shape[1]


class RepresentationCache(cache.CacheEntry):
    """A hidden-state entry: sentence i with n words is (L', n, D); states are read lazily, one sentence (or one
    layer of it) at a time."""

    what = "hidden-state"

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.num_layers = self.manifest["num_layers"]  # the encoder's layers (not the stored ones: ``layers``)
        self.num_heads = self.manifest["num_heads"]
        self.layers: list[int] = list(self.manifest["layers"])  # stored layers, increasing (0 = embedding output)
        self.dim: int = int(self.manifest["dim"])

    def position(self, layer: int) -> int:
        """Where ``layer`` sits among the stored layers; an error naming them when it is not stored."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not in hidden-state cache {self.path} (stored: {self.layers}); "
                           "add it to data.hidden.layers")
        return self.layers.index(layer)

    def _layers(self, i: int, first: int, count: int) -> np.ndarray:
        """(count, n, D) float16 states of sentence i at stored positions ``first`` .. ``first + count - 1``."""
        shard, offset, n = self._locate(i)
        block = n * self.dim
        return self._read(i, shard, offset + first * block, (count, n, self.dim))

    def __getitem__(self, i: int) -> np.ndarray:
        """(L', n, D) float16 states of sentence i (every stored layer)."""
        return self._layers(i, 0, len(self.layers))

    def layer(self, i: int, layer: int) -> np.ndarray:
        """(n, D) float16 states of sentence i at ``layer`` (only that layer is read from disk)."""
        return self._layers(i, self.position(layer), 1)[0]


# ----------------------------------------------------------------------------- extraction
class HiddenExtractor(pl.LightningModule):
    """Runs the frozen encoder and pools the chosen layers' hidden states to words; predict only (Lightning's
    predict loop; the stage's own loop calls :meth:`word_states`)."""

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        super().__init__()
        self.model, self.layers = model, layers

    def word_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, L', W - 2, D) float16 word states of a :func:`~probes.maps.make_batch` batch."""
        states = hidden_states(self.model, self.layers, input_ids=batch["input_ids"],
                               attention_mask=batch["attention_mask"])  # {l: (B, T, D)}
        pool = batch["from_mat"][:, 1:-1]  # (B, W - 2, T): word rows only (specials dropped)
        with torch.autocast(pool.device.type, enabled=False):
            return torch.stack([pool @ states[l].float() for l in self.layers], 1).half()  # (B, L', W - 2, D)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> dict[str, torch.Tensor]:
        # on the batch's device: the writer copies them to the host (asynchronously from a GPU)
        return dict(maps=self.word_states(batch), index=batch["index"], n_words=batch["n_words"])


class HiddenCacheWriter(CacheWriter):
    """The attention cache's writer (partial folder, per-rank shards, background writes, finalize; Lightning's hooks
    and the stage's own loop) with (L', n, D) blocks."""

    def new_shard(self, rank: int) -> HiddenShardWriter:
        return HiddenShardWriter(self.partial_dir, rank)

    def blocks(self, maps: np.ndarray, index: list[int], n_words: list[int]) -> list[tuple[int, np.ndarray]]:
        """(sentence, (L', n, D) states) of each sentence of a batch's (B, L', N, D) float16 states."""
        if maps.shape[-1] != self.manifest["dim"]:
            raise RuntimeError(f"hidden states of size {maps.shape[-1]}, the model config says {self.manifest['dim']}")
        return [(i, maps[k, :, :n]) for k, (i, n) in enumerate(zip(index, n_words))]


def extract_hidden(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
                   trainer: Callable[..., pl.Trainer], **settings) -> RepresentationCache:
    """Write (or reuse) the entry for ``key`` (its ``layers`` and ``pooling``); ``trainer``: a partial Trainer.

    As the attention cache: exactly one process builds an entry under the entry's build lock
    (:func:`probes.extract.cache.build_lock`); the others wait and read it. Settings: see :func:`_extract_hidden`.
    """
    final_dir = hidden_entry_dir(cache_dir, key)
    if cache.is_complete(final_dir):
        log.info("hidden-state cache hit: %s", final_dir)
        return RepresentationCache(final_dir)
    if extraction_peer(trainer):  # rank > 0 of a multi-process extraction: its rank 0 holds the lock
        return _extract_hidden(encoder, sentences, key, cache_dir, trainer, **settings)
    with cache.build_lock(final_dir) as build_here:
        if not build_here:
            log.info("hidden-state cache built by another process: %s", final_dir)
            return RepresentationCache(final_dir)
        return _extract_hidden(encoder, sentences, key, cache_dir, trainer, **settings)


def _extract_hidden(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
                    trainer: Callable[..., pl.Trainer], max_length: int | None = None, long_sentences: str = "skip",
                    max_tokens: int = 4096, max_batch_size: int = 128, num_workers: int = 0,
                    encoded: list[Encoded] | None = None, loop: str = "auto") -> RepresentationCache:
    """Build the entry. Sentences run in length batches (``max_tokens`` pieces, ``max_batch_size`` sentences),
    on the attention stage's own loop where it can run (one device, one process: :func:`probes.extract.stage.
    device_loop`), else on Lightning's predict loop (several devices; one shard per rank under DDP; a rank of a
    distributed job); ``loop`` as in :func:`probes.extract.stage.extract` (``auto``, ``own``, ``lightning``), the
    entry the same. ``encoded``: the sentences already encoded (None: :func:`probes.extract.stage.encode_split`,
    which reuses this process's earlier tokenization of the same sentences)."""
    if loop not in stage.LOOPS:
        raise ValueError(f"loop={loop!r}: expected one of {stage.LOOPS}")
    final_dir = hidden_entry_dir(cache_dir, key)
    if key["pooling"] not in POOLINGS:
        raise ValueError(f"data.hidden.pooling must be one of {POOLINGS}, got '{key['pooling']}'")
    layers = check_layers(encoder.model, key["layers"])
    max_length = max_length or encoder.max_length
    encoded = encoded if encoded is not None else stage.encode_split(encoder.tokenizer, sentences)
    keep, too_long = select(encoded, max_length, long_sentences)
    kept = [encoded[i] for i in keep]
    batches = length_batches([e.n_pieces for e in kept], max_tokens, max_batch_size)
    dim = int(encoder.config.hidden_size)  # DistilBERT's `dim` too (transformers' attribute map)
    manifest = dict(format_version=cache.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=encoder.num_layers, num_heads=encoder.num_heads, layers=layers, dim=dim,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L', n, D): stored layers (0 = embedding output), words, hidden size")
    writer = HiddenCacheWriter(final_dir, manifest)
    lines = ProgressCallback(desc="hidden-state extraction")  # progress lines in the log (no terminal to watch)
    t, device, why = stage.choose_loop(trainer, loop, [writer, lines], caller="extract_hidden")
    extractor = HiddenExtractor(encoder.model, layers)
    log.info("extracting hidden states of layers %s: %d sentences, %d batches -> %s (%s)", layers, len(kept),
             len(batches), final_dir,
             f"own loop on {device}" if device is not None else f"Lightning's predict loop: {why}")
    pad = pad_id_of(encoder.tokenizer)
    with reusable_heap():  # the batches' buffers reused, not faulted in again at every batch
        if device is None:
            gpu = t.strategy.root_device.type == "cuda" and not num_workers  # next batch built during the forward
            data = SentenceBatches(kept, keep, batches, key["pooling"], key["pooling"], pad, ahead=gpu, pin=gpu)
            loader = DataLoader(data, batch_size=None, num_workers=num_workers, persistent_workers=False,
                                pin_memory=False)
            t.predict(extractor, loader, return_predictions=False)
        elif batches:  # (no batch: nothing written, as Lightning's loop skips an empty loader)
            data = SentenceBatches(kept, keep, batches, key["pooling"], key["pooling"], pad,
                                   pin=device.type == "cuda" and not num_workers)
            stage.device_loop(encoder.model, extractor.word_states, data, writer, t, device, lines, num_workers)
    return RepresentationCache(final_dir)


# ----------------------------------------------------------------------------- cache kind
@dataclass(frozen=True)
class HiddenStates:
    """The hidden-state cache kind (:mod:`probes.extract.runner`): per-word states of ``layers`` (None: all,
    0..L) pooled by ``pooling`` (``data.hidden`` of ``conf/data/hidden_probe.yaml``), in ``<cache_dir>/hidden``."""

    layers: tuple[int, ...] | None
    pooling: str

    folder = "hidden"
    what = "hidden-state"

    @classmethod
    def from_config(cls, hidden_cfg: HiddenStates | DictConfig | Mapping) -> HiddenStates:
        """From the ``hidden`` node (``layers``, ``pooling``); a :class:`HiddenStates` is returned as is."""
        if isinstance(hidden_cfg, HiddenStates):
            return hidden_cfg
        if isinstance(hidden_cfg, DictConfig):
            hidden_cfg = plain(hidden_cfg)
        layers = hidden_cfg["layers"]
        return cls(None if layers is None else tuple(int(l) for l in layers), str(hidden_cfg["pooling"]))

    def stored_layers(self, encoder: Encoder) -> list[int]:
        """The layers an entry stores, sorted and distinct (None: 0..L); an error for one out of 0..L."""
        return layer_list(encoder.num_layers, self.layers, encoder.name)

    def key_fields(self, encoder: Encoder, settings: ExtractSettings) -> dict:
        """The cache's layout version, the stored layers and the pooling."""
        return dict(hidden_format=HIDDEN_FORMAT, kind="hidden", layers=self.stored_layers(encoder),
                    pooling=self.pooling)

    def build(self, encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
              trainer: Callable[..., pl.Trainer], settings: ExtractSettings) -> RepresentationCache:
        """:func:`extract_hidden` with the settings' length policy and batch budget (``max_pairs`` and the
        attention pooling do not apply)."""
        return extract_hidden(encoder, sentences, key, cache_dir, trainer, max_length=settings.max_length,
                              long_sentences=settings.long_sentences, max_tokens=settings.max_tokens,
                              max_batch_size=settings.max_batch_size, num_workers=settings.num_workers)

    def open(self, path: str | Path) -> RepresentationCache:
        """The complete entry at ``path``."""
        return RepresentationCache(path)


# ----------------------------------------------------------------------------- cache stage
def build_hidden_cache(encoder: Encoder, treebank, split: str, extract_cfg, hidden_cfg, cache_dir: str | Path,
                       max_sentences: int | None = None) -> RepresentationCache:
    """Read the split and extract its hidden states in this process unless cached."""
    return runner.build(encoder, HiddenStates.from_config(hidden_cfg), TreebankSplit(treebank, split, max_sentences),
                        extract_cfg, cache_dir)


def cached_hidden_path(encoder: Encoder, treebank, split: str, extract_cfg, hidden_cfg, cache_dir: str | Path,
                       max_sentences: int | None = None) -> Path | None:
    """The complete entry of ``split`` if it exists (found without loading the encoder's weights)."""
    return runner.cached(encoder, HiddenStates.from_config(hidden_cfg), TreebankSplit(treebank, split, max_sentences),
                         extract_cfg, cache_dir)


def ensure_hidden_caches(encoder, treebank, splits: Sequence[str], extract_cfg, hidden_cfg, cache_dir: str | Path,
                         max_sentences: Mapping[str, int | None] | None = None, child: bool = True
                         ) -> dict[str, RepresentationCache]:
    """``{split: cache}``; missing entries are built first, in a child interpreter when ``encoder`` is a
    config and ``child`` (so this process never loads the weights), else here (weights released after)."""
    max_sentences = dict(max_sentences or {})
    splits = list(dict.fromkeys(splits))
    sources = [TreebankSplit(treebank, s, max_sentences.get(s)) for s in splits]
    caches = runner.ensure(encoder, HiddenStates.from_config(hidden_cfg), sources, extract_cfg, cache_dir, child=child)
    return dict(zip(splits, caches))
