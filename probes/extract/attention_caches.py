"""The attention caches of treebank splits: (encoder, treebank split, extraction settings) -> complete attention
cache entry, and :func:`run`, the stage's command (``python -m probes.extract``).

:func:`ensure_cache` extracts in this process; :func:`ensure_caches` extracts whatever is missing in a
child process, so the caller (the training job) never holds the encoder's weights or the
extraction's buffers and its peak memory is that of training alone. Both go through
:mod:`probes.extract.runner` with the attention kind (:class:`~probes.extract.stage.AttentionMaps`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from probes.config import check_types
from probes.data.conllu import Sentence
from probes.data.sources import Treebank
from probes.extract import runner
from probes.extract.cache import AttentionCache
from probes.extract.runner import TreebankSplit
from probes.extract.settings import ExtractSettings
from probes.extract.stage import AttentionMaps
from probes.model.load import Encoder

log = logging.getLogger(__name__)

ATTENTION = AttentionMaps()


def ensure_cache(encoder: Encoder, treebank: Treebank, split: str, extract_cfg: ExtractSettings | DictConfig | Mapping,
                 cache_dir: str | Path, max_sentences: int | None = None) -> tuple[AttentionCache, list[Sentence]]:
    """Read the split, extract its attention maps in this process unless cached, return (cache, sentences)."""
    sentences = treebank.read(split)[:max_sentences]
    cache = runner.build(encoder, ATTENTION, TreebankSplit(treebank, split, max_sentences), extract_cfg, cache_dir,
                         words=[list(s.words) for s in sentences])
    return cache, sentences


def cached_path(encoder: Encoder, treebank: Treebank, split: str, extract_cfg: ExtractSettings | DictConfig | Mapping,
                cache_dir: str | Path, max_sentences: int | None = None) -> Path | None:
    """The complete cache entry of ``split`` if it exists, found without loading the encoder's weights
    (None also when ``precision=auto`` has not been measured on this machine yet)."""
    return runner.cached(encoder, ATTENTION, TreebankSplit(treebank, split, max_sentences), extract_cfg, cache_dir)


def ensure_caches(encoder: DictConfig | Mapping | Encoder, treebank: Treebank, splits: Sequence[str],
                  extract_cfg: ExtractSettings | DictConfig | Mapping, cache_dir: str | Path,
                  max_sentences: Mapping[str, int | None] | None = None, child: bool = True
                  ) -> dict[str, AttentionCache]:
    """``{split: cache}`` for every split; the missing caches are extracted first (:func:`probes.extract.runner.ensure`).

    ``encoder``: its Hydra config (``cfg.encoder``; only its config and tokenizer are loaded here) or an
    :class:`Encoder`. With ``child=True`` and a config, extraction runs in a child interpreter that loads the
    weights, measures ``precision=auto`` if needed, writes the caches and exits; this process only opens the
    finished entries. With an ``Encoder`` object or ``child=False`` it extracts here and releases the weights
    after. Sentences are not returned (read them one split at a time:
    ``treebank.read(split)[:max_sentences[split]]``, as the cache was built).
    """
    max_sentences = dict(max_sentences or {})
    splits = list(dict.fromkeys(splits))
    sources = [TreebankSplit(treebank, s, max_sentences.get(s)) for s in splits]
    return dict(zip(splits, runner.ensure(encoder, ATTENTION, sources, extract_cfg, cache_dir, child=child)))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the caches of `cfg.splits` for `cfg.encoder` on `cfg.data` (stage 1 of training)."""
    check_types(cfg)  # wrong overrides (extract.precision=bogus, ...): an error naming the key, before any work
    encoder = instantiate(cfg.encoder)
    treebank = instantiate(cfg.data.treebank)
    settings = ExtractSettings.from_config(cfg.extract)
    out = {}
    for split in cfg.splits:
        cache, _ = ensure_cache(encoder, treebank, split, settings, cfg.paths.cache_dir,
                                cfg.data.get("max_sentences", {}).get(split))
        out[split] = str(cache.path)
        log.info("%s: %s (%d sentences, %.1f MB)", split, cache.path, len(cache), cache.manifest["bytes"] / 1e6)
    return out
