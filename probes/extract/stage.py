"""Extraction stage on Lightning's predict loop: batches by length, shards under DDP, atomic cache.

The maps come from the map engine (:class:`probes.maps.MapEngine`: the measure's piece maps of the chosen layers,
pooled to words); :class:`AttentionExtractor` runs it as a predict-only LightningModule and
:class:`probes.extract.writer.CacheWriter` writes each rank's shard of the entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from probes.extract import cache
from probes.extract.writer import CacheWriter, extraction_peer
from probes.maps import MapEngine, encode_all
from probes.measures import build
from probes.memory import reusable_heap
from probes.model.frozen import compute_in
from probes.model.inputs import Encoded
from probes.model.load import Encoder
from probes.progress import ProgressCallback

log = logging.getLogger(__name__)


class AttentionExtractor(pl.LightningModule):
    """Predict-only LightningModule around a :class:`~probes.maps.MapEngine`: each step is the engine's word maps
    of one batch, in float16, on the batch's device (:class:`~probes.extract.writer.CacheWriter` copies them to
    the host).

    Args:
        engine: The engine; its model is this module's ``model`` (Lightning moves it to the Trainer's device).
    """

    def __init__(self, engine: MapEngine):
        super().__init__()
        self.engine = engine
        self.model = engine.model

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> dict[str, torch.Tensor]:
        maps = self.engine.word_maps(batch)  # (B, L', H', W, W) float16
        # on the batch's device: the writer copies them to the host (asynchronously from a GPU)
        return dict(maps=maps, index=batch["index"], n_words=batch["n_words"])


def extract(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
            trainer: Callable[..., pl.Trainer], **settings) -> cache.AttentionCache:
    """Write (or reuse) the cache entry for `key` (settings: see :func:`_extract`); `trainer` is a partial
    Trainer constructor. Exactly one process builds an entry (:func:`probes.extract.cache.build_lock`): the
    others wait and read it, and take the build over if its builder dies."""
    final_dir = cache.entry_dir(cache_dir, key)
    if cache.is_complete(final_dir):
        log.info("attention cache hit: %s", final_dir)
        return cache.AttentionCache(final_dir)
    if extraction_peer(trainer):  # rank > 0 of a multi-process extraction: its rank 0 holds the lock
        return _extract(encoder, sentences, key, cache_dir, trainer, **settings)
    with cache.build_lock(final_dir) as build_here:
        if not build_here:
            log.info("attention cache built by another process: %s", final_dir)
            return cache.AttentionCache(final_dir)
        return _extract(encoder, sentences, key, cache_dir, trainer, **settings)


def _extract(
    encoder: Encoder,
    sentences: list[list[str]],
    key: dict,
    cache_dir: str | Path,
    trainer: Callable[..., pl.Trainer],
    from_words: str = "mean",
    to_words: str = "sum",
    max_length: int | None = None,
    long_sentences: str = "skip",
    max_tokens: int = 4096,
    max_batch_size: int = 128,
    max_pairs: int | None = 65536,
    num_workers: int = 0,
    attention_budget_mb: float = 1024,
    encoded: list[Encoded] | None = None,
    maps: str = "attention",
    measures: dict | None = None,
    layers: Sequence[int] | None = None,
) -> cache.AttentionCache:
    """Write (or reuse) the cache entry for `key`; `trainer` is a partial Trainer constructor.

    ``encoded``: the sentences already through :func:`encode_words` (saves tokenizing twice).
    ``maps``: the map kind, built from ``measures[maps]`` (:mod:`probes.measures`).
    ``layers``: the 0-based layers stored, in order (None: all); the manifest lists them."""
    final_dir = cache.entry_dir(cache_dir, key)
    if cache.is_complete(final_dir):
        log.info("attention cache hit: %s", final_dir)
        return cache.AttentionCache(final_dir)
    engine = MapEngine(encoder.model, build(maps, measures), layers, from_words=from_words, to_words=to_words,
                       tokenizer=encoder.tokenizer, max_length=max_length, max_tokens=max_tokens,
                       max_batch_size=max_batch_size, max_pairs=max_pairs, attention_budget_mb=attention_budget_mb,
                       kind=maps)
    encoded = encoded if encoded is not None else encode_all(encoder.tokenizer, sentences)
    keep, too_long = engine.select(encoded, long_sentences)
    kept = [encoded[i] for i in keep]
    batches = engine.batches(kept)
    manifest = dict(format_version=cache.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=len(engine.layers), layers=engine.layers, num_heads=engine.num_heads, maps=maps,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L, H, W, W), L = len(layers), W = words + 2: [CLS], words, [SEP]; rows attend to columns "
                           "(H = 1 for per-layer map kinds)")
    writer = CacheWriter(final_dir, manifest)
    # progress lines in the run's log when no one watches a terminal (the Lightning bar shows it there)
    t = trainer(callbacks=[writer, ProgressCallback(desc=f"{maps} extraction")])
    loader = DataLoader(engine.dataset(kept, keep, batches, device=t.strategy.root_device if not num_workers else None),
                        batch_size=None, num_workers=num_workers,
                        persistent_workers=False, pin_memory=False)
    log.info("extracting attention: %d sentences, %d batches -> %s", len(kept), len(batches), final_dir)
    log.info("map kind: %s", maps)
    # attention: the model held in a mixed precision's compute dtype (compute_in); other map kinds read weights
    # themselves, so they keep them as loaded
    precision = str(t.precision) if engine.measure.mixed_precision else "32-true"
    with compute_in(encoder.model, precision) as engine.pool_dtype, \
            reusable_heap():  # the batches' buffers reused, not faulted in again at every batch
        t.predict(AttentionExtractor(engine), loader, return_predictions=False)
    return cache.AttentionCache(final_dir)


@dataclass(frozen=True)
class AttentionMaps:
    """The attention-cache kind (:mod:`probes.extract.runner`): word-level maps of the map kind ``extract.maps``,
    pooled ``from_words`` / ``to_words``, in ``<cache_dir>/attention``."""

    folder = "attention"
    what = "attention"

    def key_fields(self, encoder: Encoder, settings) -> dict:
        """Pooling, the stored layers, and the map kind with its options."""
        return dict(from_words=settings.from_words, to_words=settings.to_words, **settings.layer_key(encoder),
                    **settings.map_key())

    def build(self, encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
              trainer: Callable[..., pl.Trainer], settings) -> cache.AttentionCache:
        """:func:`extract` with the settings' pooling, length policy, batching and map kind."""
        return extract(encoder, sentences, key, cache_dir, trainer, from_words=settings.from_words,
                       to_words=settings.to_words, max_length=settings.max_length,
                       long_sentences=settings.long_sentences, maps=settings.maps, measures=settings.measures,
                       layers=settings.layers_for(encoder), **settings.batching())

    def open(self, path: str | Path) -> cache.AttentionCache:
        """The complete entry at ``path``."""
        return cache.AttentionCache(path)

