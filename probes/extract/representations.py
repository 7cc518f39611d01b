"""Keyed on-disk cache of per-word hidden states (the structural probes' input), beside the attention cache.

Layout of one entry `<cache_dir>/hidden/<encoder>-<dataset>-<split>-<hash>/` (the attention cache's pieces:
same key hash, shard writer, build lock, `finalize` with its atomic rename):
  manifest.json        key, stored layers, hidden size, shard list, skipped sentences (written last)
  maps-r<rank>.f16     float16 states of the sentences that rank wrote, back to back
  index-r<rank>.npy    (N_r, 3) int64 rows: sentence index, element offset, number of words n
A sentence with n words is stored as (L', n, D): L' = the stored layers in increasing order (0 = embedding
output, l = output of layer l), one row per word, pieces pooled to words (`mean` over the word's pieces,
or its `first` piece; part of the key). Readers copy one sentence (or one layer of it) with `os.pread`.

:func:`ensure_hidden_caches` builds missing entries in a child process (``python -m
probes.extract.representations``), so a training process never holds the encoder.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from probes.extract import cache as C
from probes.extract.stage import CacheWriter, SentenceBatches, _extraction_peer, encode_all, select
from probes.model.hidden import check_layers, hidden_states
from probes.model.inputs import Encoded, length_batches
from probes.model.load import Encoder

log = logging.getLogger(__name__)

HIDDEN_FORMAT = 1  # layout version of this cache (on top of the attention cache's FORMAT_VERSION)
POOLINGS = ("mean", "first")  # pieces -> word: mean over the word's pieces (Hewitt & Manning) or its first piece


def hidden_entry_dir(cache_dir: str | Path, key: dict) -> Path:
    """``<cache_dir>/hidden/<encoder>-<dataset>-<split>-<hash of key>`` (named as attention entries are)."""
    return Path(cache_dir) / "hidden" / C.entry_dir(cache_dir, key).name


def hidden_key(encoder: Encoder, treebank, split: str, layers: list[int], pooling: str, settings: Mapping,
               precision: str, max_sentences: int | None) -> dict:
    """Everything that changes the stored states; its hash names the entry."""
    return dict(format_version=C.FORMAT_VERSION, hidden_format=HIDDEN_FORMAT, kind="hidden",
                encoder=encoder.name, revision=encoder.fingerprint, dataset=treebank.name, split=split,
                data_sha256=treebank.file_sha256(split), max_sentences=max_sentences, layers=list(layers),
                pooling=pooling, max_length=settings.get("max_length") or encoder.max_length,
                long_sentences=settings["long_sentences"], precision=precision, storage="float16")


class HiddenShardWriter(C.ShardWriter):
    """:class:`~probes.extract.cache.ShardWriter` for (L', n, D) blocks (index rows: sentence, offset, n)."""

    def write(self, sentence_index: int, states: np.ndarray) -> None:
        """states: (L', n, D) float16."""
        assert states.dtype == np.float16 and states.ndim == 3
        self._f.write(memoryview(np.ascontiguousarray(states)).cast("B"))
        self._rows.append((sentence_index, self._offset, states.shape[1]))
        self._offset += states.size


class RepresentationCache(C.AttentionCache):
    """Read-only view of a complete hidden-state entry; states are read lazily, one sentence at a time."""

    def __init__(self, path: str | Path):
        if not (Path(path) / "manifest.json").exists():
            raise FileNotFoundError(f"no complete hidden-state cache at {path} (missing manifest.json)")
        super().__init__(path)
        self.layers: list[int] = list(self.manifest["layers"])
        self.dim: int = int(self.manifest["dim"])

    def position(self, layer: int) -> int:
        """Where ``layer`` sits among the stored layers; an error naming them when it is not stored."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not in hidden-state cache {self.path} (stored: {self.layers}); "
                           "add it to data.hidden.layers")
        return self.layers.index(layer)

    def _read(self, i: int, first: int, count: int) -> np.ndarray:
        shard, offset, n = (int(v) for v in self._where[i])
        if shard < 0:
            raise KeyError(f"sentence {i} is not in cache {self.path} (skipped: longer than the encoder's maximum)")
        if self._fds is None:
            self._fds = [os.open(self.path / s, os.O_RDONLY) for s in self.manifest["shards"]]
        block = n * self.dim
        nbytes = 2 * count * block
        buf = os.pread(self._fds[shard], nbytes, 2 * (offset + first * block))
        if len(buf) != nbytes:
            raise OSError(f"{self.path / self.manifest['shards'][shard]}: truncated at sentence {i}")
        return np.frombuffer(buf, dtype=np.float16).reshape(count, n, self.dim)

    def __getitem__(self, i: int) -> np.ndarray:
        """(L', n, D) float16 states of sentence i (every stored layer)."""
        return self._read(i, 0, len(self.layers))

    def layer(self, i: int, layer: int) -> np.ndarray:
        """(n, D) float16 states of sentence i at ``layer`` (only that layer is read from disk)."""
        return self._read(i, self.position(layer), 1)[0]


# ----------------------------------------------------------------------------- extraction
class HiddenExtractor(pl.LightningModule):
    """Runs the frozen encoder and pools the chosen layers' hidden states to words; predict only."""

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        super().__init__()
        self.model, self.layers = model, layers

    def word_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, L', W - 2, D) float16 word states of a :func:`~probes.extract.stage.make_batch` batch."""
        states = hidden_states(self.model, self.layers, input_ids=batch["input_ids"],
                               attention_mask=batch["attention_mask"])  # {l: (B, T, D)}
        pool = batch["from_mat"][:, 1:-1]  # (B, W - 2, T): word rows only (specials dropped)
        with torch.autocast(pool.device.type, enabled=False):
            return torch.stack([pool @ states[l].float() for l in self.layers], 1).half()  # (B, L', W - 2, D)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> dict[str, torch.Tensor]:
        return dict(maps=self.word_states(batch).cpu(), index=batch["index"].cpu(), n_words=batch["n_words"].cpu())


class HiddenCacheWriter(CacheWriter):
    """The attention cache's writer (partial folder, per-rank shards, finalize) with (L', n, D) blocks."""

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_predict_start(trainer, pl_module)
        self.shard.close()  # replace the square-map shard opened above (same file names) by ours
        self.shard = HiddenShardWriter(self.partial_dir, trainer.global_rank)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        states = prediction["maps"].numpy()  # (B, L', N, D) float16
        if states.shape[-1] != self.manifest["dim"]:
            raise RuntimeError(f"hidden states of size {states.shape[-1]}, the model config says {self.manifest['dim']}")
        for k, (i, n) in enumerate(zip(prediction["index"].tolist(), prediction["n_words"].tolist())):
            self.shard.write(i, states[k, :, :n])


def extract_hidden(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
                   trainer: Callable[..., pl.Trainer], **settings) -> RepresentationCache:
    """Write (or reuse) the entry for ``key`` (its ``layers`` and ``pooling``); ``trainer``: a partial Trainer.

    As the attention cache: exactly one process builds an entry under the entry's build lock
    (:func:`probes.extract.cache.build_lock`); the others wait and read it. Settings: see :func:`_extract_hidden`.
    """
    final_dir = hidden_entry_dir(cache_dir, key)
    if C.is_complete(final_dir):
        log.info("hidden-state cache hit: %s", final_dir)
        return RepresentationCache(final_dir)
    if _extraction_peer(trainer):  # rank > 0 of a multi-process extraction: its rank 0 holds the lock
        return _extract_hidden(encoder, sentences, key, cache_dir, trainer, **settings)
    with C.build_lock(final_dir) as build_here:
        if not build_here:
            log.info("hidden-state cache built by another process: %s", final_dir)
            return RepresentationCache(final_dir)
        return _extract_hidden(encoder, sentences, key, cache_dir, trainer, **settings)


def _extract_hidden(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
                    trainer: Callable[..., pl.Trainer], max_length: int | None = None, long_sentences: str = "skip",
                    max_tokens: int = 4096, max_batch_size: int = 128, num_workers: int = 0,
                    encoded: list[Encoded] | None = None, **_ignored) -> RepresentationCache:
    """Build the entry. Sentences run in length batches (``max_tokens`` pieces, ``max_batch_size`` sentences)
    on Lightning's predict loop (the GPU when the trainer has one; one shard per rank under DDP). Settings
    that only concern attention maps (``from_words``, ``to_words``, ``max_pairs``) are ignored."""
    final_dir = hidden_entry_dir(cache_dir, key)
    if key["pooling"] not in POOLINGS:
        raise ValueError(f"data.hidden.pooling must be one of {POOLINGS}, got '{key['pooling']}'")
    layers = check_layers(encoder.model, key["layers"])
    max_length = max_length or encoder.max_length
    encoded = encoded if encoded is not None else encode_all(encoder.tokenizer, sentences)
    keep, too_long = select(encoded, max_length, long_sentences)
    kept = [encoded[i] for i in keep]
    batches = length_batches([e.n_pieces for e in kept], max_tokens, max_batch_size)
    pad_id = encoder.tokenizer.pad_token_id
    data = SentenceBatches(kept, keep, batches, key["pooling"], key["pooling"], 0 if pad_id is None else pad_id)
    dim = int(encoder.config.hidden_size)  # DistilBERT's `dim` too (transformers' attribute map)
    manifest = dict(format_version=C.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=encoder.num_layers, num_heads=encoder.num_heads, layers=layers, dim=dim,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L', n, D): stored layers (0 = embedding output), words, hidden size")
    writer = HiddenCacheWriter(final_dir, manifest)
    t = trainer(callbacks=[writer])
    loader = DataLoader(data, batch_size=None, num_workers=num_workers, persistent_workers=False, pin_memory=False)
    log.info("extracting hidden states of layers %s: %d sentences, %d batches -> %s", layers, len(kept),
             len(batches), final_dir)
    t.predict(HiddenExtractor(encoder.model, layers), loader, return_predictions=False)
    return RepresentationCache(final_dir)


# ----------------------------------------------------------------------------- cache stage
def _settings(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else json.loads(json.dumps(dict(cfg)))


def _resolved(encoder: Encoder, treebank, split: str, extract_cfg: dict, hidden_cfg: dict, cache_dir: str,
              max_sentences: int | None, words: list[list[str]] | None) -> tuple[dict, dict | None]:
    """(key, partial-trainer settings); None precision when ``auto`` is not measured yet and ``words`` is None."""
    from probes.extract.precision import resolve_precision

    cfg = dict(extract_cfg)
    trainer_cfg = cfg.pop("trainer")
    precision = resolve_precision(cfg.pop("precision"), trainer_cfg.get("accelerator", "auto"), encoder,
                                  sentences=words, cache_dir=cache_dir, lookup_only=words is None)
    if precision is None:
        return {}, None
    layers = list(range(encoder.num_layers + 1)) if hidden_cfg.get("layers") is None else \
        sorted({int(l) for l in hidden_cfg["layers"]})
    key = hidden_key(encoder, treebank, split, layers, hidden_cfg["pooling"], cfg, precision, max_sentences)
    return key, dict(trainer_cfg=trainer_cfg, precision=precision, settings=cfg)


def build_hidden_cache(encoder: Encoder, treebank, split: str, extract_cfg, hidden_cfg, cache_dir: str,
                       max_sentences: int | None = None) -> RepresentationCache:
    """Read the split and extract its hidden states in this process unless cached."""
    from hydra.utils import instantiate

    words = [list(s.words) for s in treebank.read(split)[:max_sentences]]
    key, run = _resolved(encoder, treebank, split, _settings(extract_cfg), _settings(hidden_cfg), cache_dir,
                         max_sentences, words)
    trainer = instantiate(run["trainer_cfg"], precision=run["precision"], _partial_=True)
    return extract_hidden(encoder, words, key, cache_dir, trainer, **run["settings"])


def cached_hidden_path(encoder: Encoder, treebank, split: str, extract_cfg, hidden_cfg, cache_dir: str,
                       max_sentences: int | None = None) -> Path | None:
    """The complete entry of ``split`` if it exists (found without loading the encoder's weights)."""
    key, run = _resolved(encoder, treebank, split, _settings(extract_cfg), _settings(hidden_cfg), cache_dir,
                         max_sentences, None)
    if run is None:
        return None
    path = hidden_entry_dir(cache_dir, key)
    return path if C.is_complete(path) else None


def ensure_hidden_caches(encoder, treebank, splits: Sequence[str], extract_cfg, hidden_cfg, cache_dir: str,
                         max_sentences: Mapping[str, int | None] | None = None, child: bool = True
                         ) -> dict[str, RepresentationCache]:
    """``{split: cache}``; missing entries are built first, in a child interpreter when ``encoder`` is a
    config and ``child`` (so this process never loads the weights), else here (weights released after)."""
    from hydra.utils import instantiate

    max_sentences = dict(max_sentences or {})
    splits = list(dict.fromkeys(splits))
    enc = encoder if isinstance(encoder, Encoder) else instantiate(encoder)
    paths = {s: cached_hidden_path(enc, treebank, s, extract_cfg, hidden_cfg, cache_dir, max_sentences.get(s))
             for s in splits}
    missing = [s for s in splits if paths[s] is None]
    for s in splits:
        if s not in missing:
            log.info("hidden-state cache hit: %s", paths[s])
    if missing and child and not isinstance(encoder, Encoder):
        paths.update(_spawn(encoder, treebank, missing, extract_cfg, hidden_cfg, cache_dir, max_sentences))
    elif missing:
        for s in missing:
            paths[s] = build_hidden_cache(enc, treebank, s, extract_cfg, hidden_cfg, cache_dir,
                                          max_sentences.get(s)).path
        enc.release()
    return {s: RepresentationCache(paths[s]) for s in splits}


def _spawn(encoder_cfg, treebank, splits: list[str], extract_cfg, hidden_cfg, cache_dir: str,
           max_sentences: dict) -> dict[str, Path]:
    """Run :func:`_child` in a fresh interpreter; its {split: path}, or its error raised here."""
    import pickle
    import subprocess
    import sys

    req = dict(encoder_cfg=_settings(encoder_cfg), treebank=treebank, splits=list(splits),
               extract_cfg=_settings(extract_cfg), hidden_cfg=_settings(hidden_cfg), cache_dir=str(cache_dir),
               max_sentences=dict(max_sentences), log_level=logging.getLogger().getEffectiveLevel())
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="probes-hidden-") as tmp:
        payload, result = Path(tmp) / "request.pkl", Path(tmp) / "result.json"
        payload.write_bytes(pickle.dumps(req))
        log.info("extracting hidden states of %s in a child process", ", ".join(splits))
        rc = subprocess.run([sys.executable, "-m", "probes.extract.representations", str(payload), str(result)],
                            env=env).returncode
        res = json.loads(result.read_text()) if result.exists() else {}
    if rc == 0 and "paths" in res:
        return {s: Path(v) for s, v in res["paths"].items()}
    raise RuntimeError(f"hidden-state extraction in the child process failed (exit code {rc}): "
                       f"{res.get('error', 'no result written (killed?)')}\n{res.get('traceback', '')}")


def _child(payload: str, result: str) -> None:
    """Child process: build the requested entries; write {"paths": {split: path}} or {"error", "traceback"}."""
    import pickle

    from hydra.utils import instantiate

    from probes.io import atomic_write_text

    req = pickle.loads(Path(payload).read_bytes())
    logging.basicConfig(level=req["log_level"], format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        encoder, out = instantiate(req["encoder_cfg"]), {}
        for s in req["splits"]:
            out[s] = str(build_hidden_cache(encoder, req["treebank"], s, req["extract_cfg"], req["hidden_cfg"],
                                            req["cache_dir"], req["max_sentences"].get(s)).path)
        atomic_write_text(result, json.dumps(dict(paths=out)))
    except BaseException as e:
        atomic_write_text(result, json.dumps(dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())))
        raise


if __name__ == "__main__":  # the child of :func:`ensure_hidden_caches`
    import sys

    _child(sys.argv[1], sys.argv[2])
