"""Cache stage: (encoder, treebank split, extraction settings) -> complete attention cache entry.

:func:`ensure_cache` extracts in this process; :func:`ensure_caches` extracts whatever is missing in a
child process, so the caller (the training job) never holds the encoder's weights or the
extraction's buffers and its peak memory is that of training alone.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from probes.data.conllu import Sentence
from probes.data.sources import Treebank
from probes.extract.cache import FORMAT_VERSION, AttentionCache, entry_dir
from probes.extract.precision import resolve_precision
from probes.model.load import Encoder

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
        **({"maps": dict(kind=settings["maps"], **settings["measures"][settings["maps"]])} if settings.get("maps", "attention") != "attention" else {}),
    )


def _settings(extract_cfg: DictConfig | Mapping) -> dict:
    return OmegaConf.to_container(extract_cfg, resolve=True) if isinstance(extract_cfg, DictConfig) \
        else json.loads(json.dumps(dict(extract_cfg)))


def _precision(cfg: dict, encoder: Encoder, cache_dir: str, sentences=None, lookup_only: bool = False) -> str | None:
    return resolve_precision(cfg["precision"], cfg["trainer"].get("accelerator", "auto"), encoder,
                             sentences=sentences, cache_dir=cache_dir, lookup_only=lookup_only)


def _build(encoder: Encoder, treebank: Treebank, split: str, cfg: dict, cache_dir: str, max_sentences: int | None,
           words: list[list[str]]) -> AttentionCache:
    """Resolve the precision, key the entry, extract ``words`` unless cached."""
    from hydra.utils import instantiate

    from probes.extract.stage import extract

    cfg = dict(cfg)
    trainer_cfg = cfg.pop("trainer")
    precision = resolve_precision(cfg.pop("precision"), trainer_cfg.get("accelerator", "auto"), encoder,
                                  sentences=words, cache_dir=cache_dir)
    key = cache_key(encoder, treebank, split, cfg, precision, max_sentences)
    trainer = instantiate(trainer_cfg, precision=precision, _partial_=True)
    return extract(encoder, words, key, cache_dir, trainer, **cfg)


def ensure_cache(encoder: Encoder, treebank: Treebank, split: str, extract_cfg: DictConfig | dict,
                 cache_dir: str, max_sentences: int | None = None) -> tuple[AttentionCache, list[Sentence]]:
    """Read the split, extract its attention maps in this process unless cached, return (cache, sentences)."""
    sentences = treebank.read(split)[:max_sentences]
    cache = _build(encoder, treebank, split, _settings(extract_cfg), cache_dir, max_sentences,
                   [list(s.words) for s in sentences])
    return cache, sentences


def cached_path(encoder: Encoder, treebank: Treebank, split: str, extract_cfg: DictConfig | dict, cache_dir: str,
                max_sentences: int | None = None) -> Path | None:
    """The complete cache entry of ``split`` if it exists, found without loading the encoder's weights
    (None also when ``precision=auto`` has not been measured on this machine yet)."""
    cfg = _settings(extract_cfg)
    precision = _precision(cfg, encoder, cache_dir, lookup_only=True)
    if precision is None:
        return None
    path = entry_dir(cache_dir, cache_key(encoder, treebank, split, cfg, precision, max_sentences))
    return path if (path / "manifest.json").exists() else None


def _child(payload: str, result: str) -> None:
    """Child process (``python -m probes.extract.run PAYLOAD RESULT``): build the caches of the pickled
    request; write {"paths": {split: path}} (or {"error", "traceback"}) to ``result``."""
    import pickle

    from hydra.utils import instantiate

    from probes.io import atomic_write_text

    req = pickle.loads(Path(payload).read_bytes())
    logging.basicConfig(level=req["log_level"], format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        encoder, tb, out = instantiate(req["encoder_cfg"]), req["treebank"], {}
        for s in req["splits"]:
            n = req["max_sentences"].get(s)
            words = [list(x.words) for x in tb.read(s)[:n]]  # the Sentence objects are not kept
            out[s] = str(_build(encoder, tb, s, req["extract_cfg"], req["cache_dir"], n, words).path)
            del words
        atomic_write_text(result, json.dumps(dict(paths=out)))
    except BaseException as e:
        atomic_write_text(result, json.dumps(dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())))
        raise


def ensure_caches(encoder: DictConfig | Mapping | Encoder, treebank: Treebank, splits: Sequence[str],
                  extract_cfg: DictConfig | Mapping, cache_dir: str,
                  max_sentences: Mapping[str, int | None] | None = None, child: bool = True
                  ) -> dict[str, AttentionCache]:
    """``{split: cache}`` for every split; the missing caches are extracted first.

    ``encoder``: its Hydra config (``cfg.encoder``; instantiated here lazily, so only its config and
    tokenizer are loaded) or an :class:`Encoder`. With ``child=True`` and a config, extraction runs in a
    child interpreter (``python -m probes.extract.run``) that loads the weights, measures ``precision=auto`` if
    needed, writes the caches and exits; this process only opens the finished entries, so its peak memory
    never includes the encoder or the extraction. With an ``Encoder`` object (not picklable) or
    ``child=False`` it extracts here and releases the weights after. Sentences are not returned (read
    them one split at a time: ``treebank.read(split)[:max_sentences[split]]``, as the cache was built).
    """
    from hydra.utils import instantiate

    max_sentences = dict(max_sentences or {})
    splits = list(dict.fromkeys(splits))
    enc = encoder if isinstance(encoder, Encoder) else instantiate(encoder)
    paths = {s: cached_path(enc, treebank, s, extract_cfg, cache_dir, max_sentences.get(s)) for s in splits}
    missing = [s for s in splits if paths[s] is None]
    for s in splits:
        if s not in missing:
            log.info("attention cache hit: %s", paths[s])
    if missing and child and not isinstance(encoder, Encoder):
        paths.update(_spawn(encoder, treebank, missing, extract_cfg, cache_dir, max_sentences))
    elif missing:
        for s in missing:
            paths[s] = ensure_cache(enc, treebank, s, extract_cfg, cache_dir, max_sentences.get(s))[0].path
        enc.release()
    return {s: AttentionCache(paths[s]) for s in splits}


def _spawn(encoder_cfg, treebank: Treebank, splits: list[str], extract_cfg, cache_dir: str,
           max_sentences: dict) -> dict[str, Path]:
    """Run :func:`_child` in a fresh interpreter (``python -m probes.extract.run``: nothing of this process,
    not even its ``__main__``, is re-imported); its {split: path}, or its error raised here."""
    import pickle
    import subprocess
    import sys

    req = dict(encoder_cfg=_settings(encoder_cfg), treebank=treebank, splits=list(splits),
               extract_cfg=_settings(extract_cfg), cache_dir=str(cache_dir), max_sentences=dict(max_sentences),
               log_level=logging.getLogger().getEffectiveLevel())
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the `probes` package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="probes-extract-") as tmp:
        payload, result = Path(tmp) / "request.pkl", Path(tmp) / "result.json"
        payload.write_bytes(pickle.dumps(req))
        log.info("extracting %s in a child process (the encoder is loaded there, not here)", ", ".join(splits))
        rc = subprocess.run([sys.executable, "-m", "probes.extract.run", str(payload), str(result)], env=env).returncode
        res = json.loads(result.read_text()) if result.exists() else {}
    if rc == 0 and "paths" in res:
        return {s: Path(v) for s, v in res["paths"].items()}
    raise RuntimeError(f"attention extraction in the child process failed (exit code {rc}): "
                       f"{res.get('error', 'no result written (killed?)')}\n{res.get('traceback', '')}")


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


if __name__ == "__main__":  # the child of :func:`ensure_caches`
    import sys

    _child(sys.argv[1], sys.argv[2])
