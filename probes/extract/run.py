"""Cache stage: (encoder, treebank split, extraction settings) -> complete attention cache entry."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from probes.data.conllu import Sentence
from probes.data.sources import Treebank
from probes.model.load import Encoder
from probes.extract.cache import FORMAT_VERSION, AttentionCache
from probes.extract.stage import extract, resolve_precision

log = logging.getLogger(__name__)


def cache_key(encoder: Encoder, treebank: Treebank, split: str, settings: dict, precision: str,
              max_sentences: int | None) -> dict:
    """Everything that changes the cached maps; its hash names the cache entry."""
    return dict(
        format_version=FORMAT_VERSION, encoder=encoder.name, revision=encoder.fingerprint,
        dataset=treebank.name, split=split, data_sha256=treebank.file_sha256(split),
        max_sentences=max_sentences, from_words=settings["from_words"], to_words=settings["to_words"],
        max_length=settings["max_length"] or encoder.max_length, long_sentences=settings["long_sentences"],
        precision=precision, storage="float16",
    )


def ensure_cache(encoder: Encoder, treebank: Treebank, split: str, extract_cfg: DictConfig | dict,
                 cache_dir: str, max_sentences: int | None = None) -> tuple[AttentionCache, list[Sentence]]:
    """Read the split, extract its attention maps unless cached, return (cache, sentences)."""
    from hydra.utils import instantiate

    cfg = OmegaConf.to_container(extract_cfg, resolve=True) if isinstance(extract_cfg, DictConfig) else dict(extract_cfg)
    sentences = treebank.read(split)[:max_sentences]
    trainer_cfg = cfg.pop("trainer")
    precision = resolve_precision(cfg.pop("precision"), trainer_cfg.get("accelerator", "auto"))
    key = cache_key(encoder, treebank, split, cfg, precision, max_sentences)
    trainer = instantiate(trainer_cfg, precision=precision, _partial_=True)
    cache = extract(encoder, [list(s.words) for s in sentences], key, cache_dir, trainer, **cfg)
    return cache, sentences


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the caches of `cfg.splits` for `cfg.encoder` on `cfg.data` (stage 1 of training)."""
    from hydra.utils import instantiate

    encoder = instantiate(cfg.encoder)
    treebank = instantiate(cfg.data.treebank)
    out = {}
    for split in cfg.splits:
        cache, _ = ensure_cache(encoder, treebank, split, cfg.extract, cfg.paths.cache_dir,
                                cfg.data.get("max_sentences", {}).get(split))
        out[split] = str(cache.path)
        log.info("%s: %s (%d sentences, %.1f MB)", split, cache.path, len(cache), cache.manifest["bytes"] / 1e6)
    return out
