"""Extraction stage on Lightning's predict loop: batches by length, shards under DDP, atomic cache.

Attention comes from the model layer (:func:`probes.model.hooks.attention`, stopped after the last
layer); inputs, length batches and word pooling from :mod:`probes.model.inputs`.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, Dataset

from probes.extract import cache as C
from probes.io import naming_full_disk
from probes.measures import build
from probes.memory import reusable_heap
from probes.model import hooks
from probes.model.frozen import held_in
from probes.model.inputs import Encoded, encode_words, length_batches, pad_encoded, pooling_matrix
from probes.model.load import Encoder
from probes.progress import ProgressCallback

log = logging.getLogger(__name__)


def pooling_matrices(items: list[Encoded], mode: str, T: int) -> torch.Tensor:
    """(B, W, T) word pooling matrices of a padded batch, W = most words + 2 (zero rows/columns pad);
    item k's block equals ``pooling_matrix(word_of_piece, n_words, mode)`` (built in one scatter)."""
    B, W = len(items), max(e.n_words for e in items) + 2
    out = torch.zeros(B, W, T)  # (B, W, T)
    if mode not in ("mean", "sum"):
        for k, e in enumerate(items):
            out[k, :e.n_words + 2, :e.n_pieces] = pooling_matrix(e.word_of_piece, e.n_words, mode)
        return out
    n = torch.tensor([e.n_pieces for e in items])  # (B,)
    b = torch.repeat_interleave(torch.arange(B), n)  # (N,) item of each piece
    t = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # (N,) its position
    w = torch.tensor([x for e in items for x in e.word_of_piece]) + 1  # (N,) its row: first special -> 0
    out[b, w, t] = 1.0
    if mode == "mean":
        out /= out.sum(-1, keepdim=True).clamp(min=1.0)
    return out


def make_batch(items: list[Encoded], indices: list[int], from_pool: str, to_pool: str, pad_id: int
               ) -> dict[str, torch.Tensor]:
    """One padded batch: input_ids, attention_mask (B, T); from_mat, to_mat (B, W, T); index, n_words (B,)."""
    batch = pad_encoded(items, pad_id)  # input_ids, attention_mask: (B, T) each
    T = batch["input_ids"].shape[1]
    return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                from_mat=pooling_matrices(items, from_pool, T), to_mat=pooling_matrices(items, to_pool, T),
                index=torch.tensor(indices), n_words=torch.tensor([e.n_words for e in items]))


class SentenceBatches(Dataset):
    """Each item is one padded batch of sentences (DataLoader with batch_size=None); pooling matrices are
    built here, i.e. in the loader's workers when num_workers > 0."""

    def __init__(self, encoded: list[Encoded], indices: list[int], batches: list[list[int]],
                 from_pool: str, to_pool: str, pad_id: int):
        self.encoded, self.indices, self.batches = encoded, indices, batches
        self.from_pool, self.to_pool, self.pad_id = from_pool, to_pool, pad_id

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        return make_batch([self.encoded[i] for i in self.batches[b]], [self.indices[i] for i in self.batches[b]],
                          self.from_pool, self.to_pool, self.pad_id)


LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # autocast's compute dtype
HELD = {"bf16-mixed": torch.bfloat16}  # mixed precisions whose attention extraction holds the whole model in it


@contextlib.contextmanager
def linears_in(model: torch.nn.Module, precision: str) -> Iterator[None]:
    """Inside the block, every ``nn.Linear``'s weight and bias are held in the compute dtype of a mixed
    ``precision`` (``bf16-mixed``, ``16-mixed``; other precisions: nothing changes); restored after.

    Autocast casts a float32 weight to the compute dtype at every call (its cast cache only keeps leaves
    that require grad); a weight already in that dtype is used as it is, so the results are bit-identical
    while each weight is cast once per extraction instead of once per batch and layer."""
    dtype = LOW_PRECISION.get(str(precision))
    saved = []  # (module, fp32 weight, fp32 bias)
    if dtype is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32:
                saved.append((m, m.weight, m.bias))
                m.weight = torch.nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
                if m.bias is not None:
                    m.bias = torch.nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
    try:
        yield
    finally:
        for m, w, b in saved:
            m.weight, m.bias = w, b


@contextlib.contextmanager
def compute_in(model: torch.nn.Module, precision: str) -> Iterator[torch.dtype]:
    """The frozen attention forward's dtypes under ``precision``; yields the dtype to pool words in.

    bf16-mixed: the whole model held in bf16 (:func:`probes.model.frozen.held_in`: no casts; oneDNN packed
    linear layers on a CPU, BERT-style encoders on packed rows, :mod:`probes.model.packed`) and words pooled in
    bf16 (matmuls accumulate in float32); 16-mixed: the linear layers' weights in float16 (:func:`linears_in`);
    others: nothing changes. Pooling in float32 unless held."""
    dtype = HELD.get(str(precision))
    if dtype is None:
        with linears_in(model, precision):
            yield torch.float32
    else:
        with held_in(model, dtype):
            yield dtype


def pool_layers(probs: list[torch.Tensor], from_mat: torch.Tensor, to_mat: torch.Tensor,
                dtype: torch.dtype = torch.float16, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """Word-level maps, pooled one layer at a time in ``compute`` (no copy of all layers' piece maps).

    probs: L x (B, H, T, T) in any float dtype; from_mat, to_mat: (B, W, T). Returns (B, L, H, W, W) in ``dtype``.
    """
    B, H, T, _ = probs[0].shape
    W = from_mat.shape[1]
    out = torch.empty(B, len(probs), H, W, W, dtype=dtype, device=from_mat.device)  # (B, L, H, W, W)
    frm, to_t = from_mat.unsqueeze(1).to(compute), to_mat.transpose(1, 2).to(compute)  # (B, 1, W, T), (B, T, W)
    for l, a in enumerate(probs):
        # columns first as one (H*T, T) @ (T, W) product per sentence: fewer, larger matmuls
        cols = torch.bmm(a.to(compute).reshape(B, H * T, T), to_t).view(B, H, T, W)  # (B, H, T, W)
        out[:, l] = frm @ cols  # (B, H, W, W)
    return out


class AttentionExtractor(pl.LightningModule):
    """Runs the frozen encoder and pools its attention to words; predict only.

    Probabilities come from the model layer's attention session, which ends the forward right after
    the last layer's attention (the last layer's output projection and feed-forward block, which no
    map depends on, are never computed).
    """

    def __init__(self, model: torch.nn.Module, measure=None, layers: Sequence[int] | None = None):
        super().__init__()
        self.model = model
        # 0-based layers captured, in this order (None: all, from the model config)
        self.layers = list(layers) if layers is not None else list(range(int(model.config.num_hidden_layers)))
        self.measure = measure  # a probes.measures.Measure (extract.maps); None: attention probabilities
        self.pool_dtype = torch.float32  # the dtype words are pooled in (compute_in's)

    def attention_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """L x (B, H, T, T) probabilities of every layer (compute dtype)."""
        with hooks.attention(self.model, layers=self.layers, stop=True) as s:
            s.run(input_ids=input_ids, attention_mask=attention_mask)
            return [s.probs[l] for l in self.layers]

    def attentions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L, H, T, T) piece-level maps."""
        return torch.stack(self.attention_probs(input_ids, attention_mask), dim=1)

    def word_maps(self, batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """(B, L, H', W, W) word-level maps of a :func:`make_batch` batch (pooled in ``pool_dtype``); H' = H, or 1
        for per-layer measures."""
        if self.measure is None:
            probs = self.attention_probs(batch["input_ids"], batch["attention_mask"])
        else:  # L x (B, H', T, T) piece-level maps of the configured kind
            probs = self.measure(self.model, batch["input_ids"], batch["attention_mask"])
            probs = [probs[l] for l in self.layers]  # a measure covers every layer (rollout needs them all)
        with torch.autocast(probs[0].device.type, enabled=False):
            return pool_layers(probs, batch["from_mat"], batch["to_mat"], dtype, self.pool_dtype)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> dict[str, torch.Tensor]:
        maps = self.word_maps(batch)  # (B, L, H, W, W) float16
        return dict(maps=maps.cpu(), index=batch["index"].cpu(), n_words=batch["n_words"].cpu())


class CacheWriter(BasePredictionWriter):
    """Writes each rank's predictions to its own shard; rank 0 finalizes the entry. A full disk is a
    :class:`~probes.io.DiskFullError` naming the entry being written (:func:`probes.io.naming_full_disk`)."""

    def __init__(self, final_dir: Path, manifest: dict):
        super().__init__(write_interval="batch")
        self.final_dir = Path(final_dir)
        self.partial_dir = self.final_dir.with_name(self.final_dir.name + ".partial")
        self.manifest = manifest
        self.shard: C.ShardWriter | None = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            if self.partial_dir.exists():
                log.warning("removing incomplete cache from an interrupted run: %s", self.partial_dir)
                shutil.rmtree(self.partial_dir)
            with naming_full_disk(self.partial_dir, "creating the cache entry"):
                self.partial_dir.mkdir(parents=True)
        trainer.strategy.barrier()
        with naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard = C.ShardWriter(self.partial_dir, trainer.global_rank)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        maps = prediction["maps"].numpy()  # (B, L, H, W, W) float16
        with naming_full_disk(self.shard.data_path, "writing the cache entry's maps"):
            for k, (i, n) in enumerate(zip(prediction["index"].tolist(), prediction["n_words"].tolist())):
                self.shard.write(i, maps[k, :, :, : n + 2, : n + 2])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with naming_full_disk(self.partial_dir, "writing the cache entry"):
            self.shard.close()
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            with naming_full_disk(self.partial_dir, "finishing the cache entry"):
                C.finalize(self.partial_dir, self.final_dir, self.manifest)
        trainer.strategy.barrier()


def autocast(precision: str, device: str):
    """The autocast context Lightning's precision plugin puts around ``predict_step``."""
    if precision in ("bf16-mixed", "16-mixed"):
        return torch.autocast(device, dtype=torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    if precision in ("32-true", "32", 32):
        return contextlib.nullcontext()
    raise ValueError(f"cannot time precision {precision!r}")


def timing_batches(encoded: list[Encoded], max_length: int, tokens: int = 2048, n: int = 4) -> list[list[Encoded]]:
    """``n`` batches of about ``tokens`` pieces each from the sentences around the median length."""
    items = sorted((e for e in encoded if e.n_pieces <= max_length), key=lambda e: e.n_pieces)
    if not items:
        return []
    mid = items[len(items) // 2].n_pieces
    per = max(1, tokens // mid)
    start = max(0, len(items) // 2 - per * n // 2)
    pool = items[start:start + per * n]
    pool = (pool * (per * n // len(pool) + 1))[:per * n]  # repeat when there are few sentences
    return [pool[k * per:(k + 1) * per] for k in range(n)]


def precision_timer(encoder: Encoder, encoded: list[Encoded], device: str, tokens: int = 128,
                    from_words: str = "mean", to_words: str = "sum") -> Callable[[str], float] | None:
    """``f(precision) -> seconds per token`` of one :meth:`AttentionExtractor.predict_step` under that precision's
    autocast, on one batch of ~``tokens`` pieces from the sentences around the median length (the same batch at
    every call, so that :func:`probes.extract.precision.measure` compares like with like). None when there
    are no sentences to time.

    On a CPU the batch runs on one thread and its CPU time is measured (``time.thread_time``): the time the
    work itself takes, which other processes competing for the cores do not change (wall time with several
    threads under load varies threefold, mostly threads waiting for each other). On a GPU: wall time
    between two synchronisations."""
    batches = timing_batches(encoded, encoder.max_length, tokens, 1)
    if not batches:
        return None
    pad_id = encoder.tokenizer.pad_token_id
    batch = {k: v.to(device) for k, v in make_batch(batches[0], list(range(len(batches[0]))), from_words, to_words,
                                                    0 if pad_id is None else pad_id).items()}
    n_tokens = int(batch["attention_mask"].sum())
    ex = AttentionExtractor(encoder.model.to(device))

    def time_fn(precision: str) -> float:
        if device == "cuda":
            with compute_in(ex.model, precision) as ex.pool_dtype, torch.inference_mode(), \
                    autocast(precision, device):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ex.predict_step(batch)
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / n_tokens
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with compute_in(ex.model, precision) as ex.pool_dtype, torch.inference_mode(), \
                    autocast(precision, device):
                t0 = time.thread_time()
                ex.predict_step(batch)
                return (time.thread_time() - t0) / n_tokens
        finally:
            torch.set_num_threads(threads)

    return time_fn


def split_by_pairs(batches: list[list[int]], lengths: list[int], max_pairs: int | None) -> list[list[int]]:
    """Split length batches so that none holds more than ``max_pairs`` attention pairs (B * T^2): bounds the
    retained (B, H, T, T) maps of long sentences (memory) and keeps them cache-sized (speed)."""
    if not max_pairs:
        return batches
    out = []
    for b in batches:
        T = max(lengths[i] for i in b)
        n = -(-len(b) * T * T // max_pairs)  # ceil: number of parts
        size = -(-len(b) // n)
        out += [b[k:k + size] for k in range(0, len(b), size)]
    return out


def encode_all(tokenizer, sentences: list[list[str]], chunk: int = 1024) -> list[Encoded]:
    """:func:`encode_words` in chunks (the tokenizer's batch output for a whole treebank is large)."""
    return [e for k in range(0, len(sentences), chunk) for e in encode_words(tokenizer, sentences[k:k + chunk])]


def select(encoded: list[Encoded], max_length: int, long_sentences: str) -> tuple[list[int], list[int]]:
    """(kept indices, too-long indices) under the long-sentence policy (skip | error)."""
    if long_sentences not in ("skip", "error"):
        raise ValueError(f"extract.long_sentences must be 'skip' or 'error', got '{long_sentences}'")
    too_long = [i for i, e in enumerate(encoded) if e.n_pieces > max_length]
    if too_long and long_sentences == "error":
        raise ValueError(f"{len(too_long)} sentences exceed {max_length} wordpieces (first: #{too_long[0]}); "
                         "set extract.long_sentences=skip to leave them out")
    if too_long:
        log.warning("%d of %d sentences exceed %d wordpieces and are left out of the cache (policy: skip)",
                    len(too_long), len(encoded), max_length)
    skipped = set(too_long)
    return [i for i in range(len(encoded)) if i not in skipped], too_long


def extract(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
            trainer: Callable[..., pl.Trainer], **settings) -> C.AttentionCache:
    """Write (or reuse) the cache entry for `key` (settings: see :func:`_extract`); `trainer` is a partial
    Trainer constructor. Exactly one process builds an entry (:func:`probes.extract.cache.build_lock`): the
    others wait and read it, and take the build over if its builder dies."""
    final_dir = C.entry_dir(cache_dir, key)
    if C.is_complete(final_dir):
        log.info("attention cache hit: %s", final_dir)
        return C.AttentionCache(final_dir)
    if _extraction_peer(trainer):  # rank > 0 of a multi-process extraction: its rank 0 holds the lock
        return _extract(encoder, sentences, key, cache_dir, trainer, **settings)
    with C.build_lock(final_dir) as build_here:
        if not build_here:
            log.info("attention cache built by another process: %s", final_dir)
            return C.AttentionCache(final_dir)
        return _extract(encoder, sentences, key, cache_dir, trainer, **settings)


def _extraction_peer(trainer: Callable[..., pl.Trainer]) -> bool:
    """Whether this process is a rank > 0 of the extraction's own multi-process Trainer (started by
    Lightning's launcher, SLURM or torchrun): the group's rank 0 takes the build lock for all of it."""
    kw = getattr(trainer, "keywords", {})
    if str(kw.get("devices", 1)) == "1" and int(kw.get("num_nodes", 1)) == 1:
        return False
    t = trainer()
    return t.world_size > 1 and t.global_rank > 0


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
    encoded: list[Encoded] | None = None,
    maps: str = "attention",
    measures: dict | None = None,
    layers: Sequence[int] | None = None,
) -> C.AttentionCache:
    """Write (or reuse) the cache entry for `key`; `trainer` is a partial Trainer constructor.

    ``encoded``: the sentences already through :func:`encode_words` (saves tokenizing twice).
    ``maps``: the map kind, built from ``measures[maps]`` (:mod:`probes.measures`).
    ``layers``: the 0-based layers stored, in order (None: all); the manifest lists them."""
    final_dir = C.entry_dir(cache_dir, key)
    if (final_dir / "manifest.json").exists():
        log.info("attention cache hit: %s", final_dir)
        return C.AttentionCache(final_dir)
    measure = build(maps, measures)
    layers = list(range(encoder.num_layers)) if layers is None else [int(l) for l in layers]
    max_length = min(max_length or encoder.max_length, measure.max_pieces or encoder.max_length)
    encoded = encoded if encoded is not None else encode_all(encoder.tokenizer, sentences)
    keep, too_long = select(encoded, max_length, long_sentences)
    kept = [encoded[i] for i in keep]
    lengths = [e.n_pieces for e in kept]
    batches = split_by_pairs(length_batches(lengths, max_tokens, max_batch_size), lengths, max_pairs)
    pad_id = encoder.tokenizer.pad_token_id
    data = SentenceBatches(kept, keep, batches, from_words, to_words, 0 if pad_id is None else pad_id)
    manifest = dict(format_version=C.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=len(layers), layers=layers, num_heads=measure.heads(encoder.num_heads), maps=maps,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L, H, W, W), L = len(layers), W = words + 2: [CLS], words, [SEP]; rows attend to columns "
                           "(H = 1 for per-layer map kinds)")
    writer = CacheWriter(final_dir, manifest)
    # progress lines in the run's log when no one watches a terminal (the Lightning bar shows it there)
    t = trainer(callbacks=[writer, ProgressCallback(desc=f"{maps} extraction")])
    loader = DataLoader(data, batch_size=None, num_workers=num_workers,
                        persistent_workers=False, pin_memory=False)
    log.info("extracting attention: %d sentences, %d batches -> %s", len(kept), len(batches), final_dir)
    log.info("map kind: %s", maps)
    # attention: the model held in a mixed precision's compute dtype (compute_in); other map kinds read weights
    # themselves, so they keep them as loaded
    ex = AttentionExtractor(encoder.model, measure=None if maps == "attention" else measure, layers=layers)
    with compute_in(encoder.model, str(t.precision) if maps == "attention" else "32-true") as ex.pool_dtype, \
            reusable_heap():  # the batches' buffers reused, not faulted in again at every batch
        t.predict(ex, loader, return_predictions=False)
    return C.AttentionCache(final_dir)


@dataclass(frozen=True)
class AttentionMaps:
    """The attention-cache kind (:mod:`probes.extract.runner`): word-level maps of the map kind ``extract.maps``,
    pooled ``from_words`` / ``to_words``, in ``<cache_dir>/attention``."""

    folder = "attention"
    what = "attention"

    def key_fields(self, encoder: Encoder, settings) -> dict:
        """Pooling, the layers when not all, and, for map kinds other than attention, the kind and its options."""
        return dict(from_words=settings.from_words, to_words=settings.to_words, **settings.layer_key(encoder),
                    **settings.map_key())

    def precision_fields(self, settings, precision: str) -> dict:
        """``{"held": "bfloat16", "rows": "packed"}`` for attention maps at bf16-mixed (:func:`compute_in`: the whole
        model and the pooling in bf16, not autocast, and BERT-style encoders on packed rows with base-2 scores,
        :mod:`probes.model.packed`); else ``{}``. Entries of the autocast path have neither field, those of the
        held path before packed rows only ``held``: neither is reused (the field does not depend on the encoder,
        so other families' bf16 entries, whose maps did not change, are rebuilt once too)."""
        held = HELD.get(str(precision))
        if held is None or settings.maps != "attention":
            return {}
        return {"held": str(held).removeprefix("torch."), "rows": "packed"}

    def build(self, encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
              trainer: Callable[..., pl.Trainer], settings) -> C.AttentionCache:
        """:func:`extract` with the settings' pooling, length policy, batching and map kind."""
        return extract(encoder, sentences, key, cache_dir, trainer, from_words=settings.from_words,
                       to_words=settings.to_words, max_length=settings.max_length,
                       long_sentences=settings.long_sentences, maps=settings.maps, measures=settings.measures,
                       layers=settings.layers_for(encoder), **settings.batching())

    def open(self, path: str | Path) -> C.AttentionCache:
        """The complete entry at ``path``."""
        return C.AttentionCache(path)

