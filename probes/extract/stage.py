"""Extraction stage: batches by length, the map engine's word maps, an atomic keyed cache entry.

The maps come from the map engine (:class:`probes.maps.MapEngine`: the measure's piece maps of the chosen layers,
pooled to words) and :class:`probes.extract.writer.CacheWriter` writes the entry. On one device in one process the
stage runs its own loop (:func:`predict_loop`: the next batch built in a background thread, the maps written in
another, none of Lightning's per-batch machinery); several devices or processes (DDP: one shard per rank), or a
Trainer with callbacks, plugins or limits of its own, run :class:`AttentionExtractor` through Lightning's predict
loop (:func:`own_loop_device` says which). The entries are byte for byte the same either way. The hidden-state
extraction (:mod:`probes.extract.representations`) runs on the same loop, chosen the same way (:func:`device_loop`,
:func:`choose_loop`).

A split's tokenization is kept for the rest of the process (:func:`encode_split`): extracting it again (another map
kind, precision or layer selection) reuses it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint, ModelSummary, ProgressBar
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.profilers import PassThroughProfiler
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader
from tqdm import tqdm

from probes.extract import cache
from probes.extract.rows import Rows, RowsWriter, check_rows, normalized, row_table, rows_digest, take_rows
from probes.extract.writer import CacheWriter, extraction_peer
from probes.maps import MapEngine, SentenceBatches, encode_all, prefetched
from probes.measures import build
from probes.memory import gc_paused, reusable_heap
from probes.model.frozen import compute_in
from probes.model.inputs import Encoded
from probes.model.load import Encoder
from probes.progress import Progress, ProgressCallback

log = logging.getLogger(__name__)

LOOPS = ("auto", "own", "lightning")  # extract(loop=...): the stage's own loop where it can run, always, or never
# callbacks that do nothing in predict but draw a bar: the stage's own loop draws its own
PASSIVE_CALLBACKS = (CacheWriter, ProgressCallback, ProgressBar, ModelSummary, Checkpoint)
BATCHES_AHEAD = 2  # batches built ahead of the forward (own loop)
KEEP_SPLITS = 3  # tokenized splits kept per tokenizer for reuse (encode_split): train, dev, test

# {tokenizer: {digest of the sentences: their Encoded}}, the last KEEP_SPLITS used first out
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Trainers without callbacks made by plain partial constructors, by the constructor and its arguments (probe_trainer)
_PROBES: dict[str, pl.Trainer] = {}
PLAIN = (str, int, float, bool, type(None))  # argument values a probe Trainer is kept for


def _digest(tokenizer, sentences: Sequence[Sequence[str]]) -> str:
    """sha256 of the sentences' words (unit and record separators between them) and the tokenizer's size (added
    tokens change the pieces)."""
    h = hashlib.sha256(f"{type(tokenizer).__name__}:{len(tokenizer)}\x1d".encode())
    h.update("\x1e".join("\x1f".join(words) for words in sentences).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def encode_split(tokenizer, sentences: list[list[str]]) -> list[Encoded]:
    """:func:`probes.maps.encode_all` of ``sentences``, tokenized once per process and ``tokenizer`` and reused
    after (the last :data:`KEEP_SPLITS` splits per tokenizer; the same :class:`Encoded` objects, not to be
    modified), with Python's garbage collector paused while tokenizing."""
    digest = _digest(tokenizer, sentences)
    kept = _SPLITS.setdefault(tokenizer, OrderedDict())
    if digest in kept:
        kept.move_to_end(digest)
        return list(kept[digest])
    # no collection while tokenizing: its many short-lived lists and tuples are freed before any collection sees
    # them, instead of being promoted to the oldest generation, whose collections scan every object of the process
    # (about 0.25 s with a model loaded, every few splits tokenized: bench/README.md)
    with gc_paused():
        encoded = encode_all(tokenizer, sentences)
    kept[digest] = encoded
    while len(kept) > KEEP_SPLITS:
        kept.popitem(last=False)
    return list(encoded)


def forget_splits() -> None:
    """Drop every kept tokenization (:func:`encode_split`): the next extraction of any split tokenizes it again."""
    _SPLITS.clear()


def map_step(engine: MapEngine, rows: Rows | None = None) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """What an extraction computes of one batch: the engine's word maps (B, L', H', W, W) float16, or with ``rows``
    each sentence's kept rows of them (B, R, L', H', W), taken on the batch's device
    (:func:`probes.extract.rows.take_rows`)."""
    if rows is None:
        return engine.word_maps
    return functools.partial(_kept_rows, engine, *row_table(rows))


def _kept_rows(engine: MapEngine, table: torch.Tensor, counts: torch.Tensor, batch: dict[str, torch.Tensor]
               ) -> torch.Tensor:
    """(B, R, L', H', W) the kept rows of the batch's word maps (:func:`map_step`)."""
    return take_rows(engine.word_maps(batch), batch["index"], table, counts)


class AttentionExtractor(pl.LightningModule):
    """Predict-only LightningModule around a :class:`~probes.maps.MapEngine`: each step is the engine's word maps
    of one batch (or their kept ``rows``: :func:`map_step`), in float16, on the batch's device
    (:class:`~probes.extract.writer.CacheWriter` copies them to the host).

    Args:
        engine: The engine; its model is this module's ``model`` (Lightning moves it to the Trainer's device).
        rows: Each sentence's kept rows (an entry of chosen rows, :mod:`probes.extract.rows`); None: whole maps.
    """

    def __init__(self, engine: MapEngine, rows: Rows | None = None):
        super().__init__()
        self.engine = engine
        self.model = engine.model
        self.step = map_step(engine, rows)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> dict[str, torch.Tensor]:
        maps = self.step(batch)  # (B, L', H', W, W) float16, or (B, R, L', H', W) kept rows
        # on the batch's device: the writer copies them to the host (asynchronously from a GPU)
        return dict(maps=maps, index=batch["index"], n_words=batch["n_words"])


def probe_trainer(trainer: Callable[..., pl.Trainer]) -> pl.Trainer | None:
    """``trainer()`` (no callbacks of the stage's), made once per process for a ``functools.partial`` (Hydra's
    included) whose arguments are plain keywords (strings, numbers, None), and kept: what :func:`own_loop_device`
    reads and the stage's own loop needs (device, precision plugin, bar) without constructing a Trainer per
    extraction (a Trainer scans the installed packages for callbacks: 12-16 ms on a 2-vCPU EPYC). None for any
    other constructor (a function that may add callbacks: the stage builds its Trainer with its callbacks and asks
    that one)."""
    if not isinstance(trainer, functools.partial) or trainer.args or "callbacks" in trainer.keywords \
            or not all(isinstance(v, PLAIN) for v in trainer.keywords.values()):
        return None
    key = repr((type(trainer), trainer.func, sorted(trainer.keywords.items())))
    if key not in _PROBES:
        _PROBES[key] = trainer()
    return _PROBES[key]


def own_loop_device(t: pl.Trainer) -> tuple[torch.device | None, str]:
    """(device, "") when the stage's own loop can stand in for ``t.predict``: one process on one CPU or CUDA
    device, not a rank of a distributed job (a DDP training's ranks keep Lightning's loop, as before the own loop), full or mixed precision (no other precision plugin), every predict batch, no profiler, and no callbacks
    but the stage's and Lightning's bars, summaries and checkpoints (which do nothing in predict); else (None, the
    reason)."""
    if t.world_size != 1 or type(t.strategy) is not SingleDeviceStrategy:
        return None, f"{type(t.strategy).__name__} over {t.world_size} process(es)"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:  # inside a rank of a distributed job (DDP training)
        return None, f"inside a distributed job of {torch.distributed.get_world_size()} processes"
    device = t.strategy.root_device
    if device.type not in ("cpu", "cuda"):
        return None, f"device {device}"
    if type(t.precision_plugin) not in (Precision, MixedPrecision):
        return None, f"precision plugin {type(t.precision_plugin).__name__}"
    if t.limit_predict_batches != 1.0 or t.fast_dev_run:
        return None, "limit_predict_batches or fast_dev_run set"
    if not isinstance(t.profiler, PassThroughProfiler):
        return None, f"profiler {type(t.profiler).__name__}"
    others = [type(c).__name__ for c in t.callbacks if not isinstance(c, PASSIVE_CALLBACKS)]
    if others:
        return None, f"callbacks {others}"
    return device, ""


def predict_loop(engine: MapEngine, data: SentenceBatches, writer: CacheWriter, t: pl.Trainer,
                 device: torch.device, lines: ProgressCallback, num_workers: int = 0,
                 overlap: bool = True, rows: Rows | None = None) -> None:
    """What ``t.predict(AttentionExtractor(engine, rows), DataLoader(data))`` does on one device: :func:`device_loop`
    of the engine's model and :func:`map_step`."""
    device_loop(engine.model, map_step(engine, rows), data, writer, t, device, lines, num_workers, overlap)


def device_loop(model: torch.nn.Module, step: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                data: SentenceBatches, writer: CacheWriter, t: pl.Trainer, device: torch.device,
                lines: ProgressCallback, num_workers: int = 0, overlap: bool = True) -> None:
    """What ``t.predict`` of a module whose predict step is ``step`` does on one device, as a plain loop (every
    extraction's own loop: attention maps, :func:`predict_loop`, and hidden states,
    :func:`probes.extract.representations.extract_hidden`): ``model`` moved to ``device`` and put in eval mode (its
    modules' modes and the CPU put back at the end, as Lightning's loop and teardown do), under inference mode and
    ``t``'s precision context; each batch built ahead in a background thread (page-locked on a GPU; in
    ``num_workers`` loader processes when > 0), ``step``'s output for it (the batch's padded blocks, on the device)
    written by ``writer`` in another (``overlap``; else each step in turn, in this thread: on a 2-vCPU EPYC under
    load, two torch threads took 1.2-4x the CPU time that way, bench/README.md). A progress bar on a terminal when
    ``t`` has one, and ``lines``' progress lines in the log otherwise (:class:`probes.progress.Progress`). An error
    leaves the entry ``.partial``."""
    gpu = device.type == "cuda"
    modes = {m: m.training for m in model.modules()}
    if num_workers:
        batches = DataLoader(data, batch_size=None, num_workers=num_workers, pin_memory=gpu)
    elif overlap:
        batches = prefetched((data.build(b) for b in range(len(data))), depth=BATCHES_AHEAD)
    else:
        batches = (data.build(b) for b in range(len(data)))
    inputs = ("input_ids", "attention_mask", "token_type_ids", "from_mat", "to_mat")  # index, n_words stay here
    try:
        if any(x.device != device for x in [*model.parameters(), *model.buffers()]):
            model.to(device)
        if any(modes.values()):
            model.eval()
        with torch.inference_mode() if t.predict_loop.inference_mode else torch.no_grad(), \
                torch.cuda.device(device) if gpu else contextlib.nullcontext(), \
                Progress(lines.desc or "predict", len(data), "batches", lines.every_s, lines.enabled) as counter, \
                tqdm(total=len(data), desc=lines.desc, unit="batch",
                     disable=None if t.progress_bar_callback is not None else True) as bar:
            writer.open(background=overlap)
            try:
                for batch in batches:
                    on = {k: v.to(device, non_blocking=gpu) if k in inputs else v for k, v in batch.items()}
                    with t.precision_plugin.predict_step_context():
                        out = step(on)  # (B, ...) the batch's padded blocks, on the device
                    writer.put(out, batch["index"], batch["n_words"])
                    counter.update()
                    bar.update()
                writer.close()
            except BaseException:
                writer.abandon()
                raise
    finally:
        if not num_workers:
            batches.close()  # stops the thread building batches ahead
        for m, training in modes.items():
            m.training = training
        if gpu:  # on the CPU, as Lightning's teardown leaves it
            model.cpu()
            torch.cuda.empty_cache()


def choose_loop(trainer: Callable[..., pl.Trainer], loop: str, callbacks: list[pl.Callback],
                caller: str = "extract") -> tuple[pl.Trainer, torch.device | None, str]:
    """(Trainer, device, reason) of an extraction: the device of the stage's own loop (``loop`` ``auto`` where
    :func:`own_loop_device` allows it, ``own``: a ValueError naming ``caller`` and the reason where it cannot) with
    the kept probe Trainer (:func:`probe_trainer`) or one made without ``callbacks``; or None, the reason, and a Trainer
    with ``callbacks`` (the writer first) for Lightning's predict loop (``lightning``, or where the own loop cannot
    run)."""
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r}: expected one of {LOOPS}")
    t = probe_trainer(trainer) if loop != "lightning" else None
    if t is None:
        t = trainer(callbacks=callbacks)
    device, why = own_loop_device(t) if loop != "lightning" else (None, "loop=lightning")
    if device is None and loop == "own":
        raise ValueError(f"{caller}(loop='own'): this Trainer needs Lightning's predict loop ({why})")
    if device is None and callbacks[0] not in t.callbacks:  # the probe: Lightning's loop needs the callbacks
        t = trainer(callbacks=callbacks)
    return t, device, why


def checked_rows(rows: Sequence[Sequence[int]] | None, sentences: Sequence[Sequence[str]], key: dict) -> Rows | None:
    """``rows`` :func:`~probes.extract.rows.normalized` (None: whole maps); a ValueError unless they are rows of the
    sentences' word maps (:func:`~probes.extract.rows.check_rows`) and ``key`` names them by their digest."""
    if rows is None:
        return None
    rows = normalized(rows)
    check_rows(rows, sentences)
    if key.get("rows") != rows_digest(rows):  # an entry of other rows, or of whole maps, under the same key
        raise ValueError(f"key {cache.cache_key_hash(key)}: an entry of chosen rows is keyed by their digest "
                         f"(rows={rows_digest(rows)}), the key has rows={key.get('rows')}")
    return rows


def extract(encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
            trainer: Callable[..., pl.Trainer], **settings) -> cache.AttentionCache:
    """Write (or reuse) the cache entry for `key` (settings: see :func:`_extract`; ``rows`` checked first,
    :func:`checked_rows`); `trainer` is a partial Trainer constructor. Exactly one process builds an entry
    (:func:`probes.extract.cache.build_lock`): the others wait and read it, and take the build over if its builder
    dies."""
    if settings.get("rows") is not None:
        settings["rows"] = checked_rows(settings["rows"], sentences, key)  # normalized for _extract
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
    loop: str = "auto",
    rows: Rows | None = None,
) -> cache.AttentionCache:
    """Write (or reuse) the cache entry for `key`; `trainer` is a partial Trainer constructor.

    ``encoded``: the sentences already through :func:`encode_words` (saves tokenizing twice; None: :func:`encode_split`,
    which reuses this process's earlier tokenization of the same sentences).
    ``maps``: the map kind, built from ``measures[maps]`` (:mod:`probes.measures`).
    ``layers``: the 0-based layers stored, in order (None: all); the manifest lists them.
    ``loop``: ``auto`` (the stage's own loop where :func:`own_loop_device` allows it, else Lightning's predict),
    ``own`` (an error naming the reason where it cannot) or ``lightning``; the entry is the same.
    ``rows``: per sentence, the rows of its word map kept (positions 0..n + 1, [CLS] at 0; an entry of chosen rows,
    :mod:`probes.extract.rows`), as :func:`extract` checked and normalized them (:func:`checked_rows`); None: whole
    maps."""
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r}: expected one of {LOOPS}")
    final_dir = cache.entry_dir(cache_dir, key)
    if cache.is_complete(final_dir):
        log.info("attention cache hit: %s", final_dir)
        return cache.AttentionCache(final_dir)
    engine = MapEngine(encoder.model, build(maps, measures), layers, from_words=from_words, to_words=to_words,
                       tokenizer=encoder.tokenizer, max_length=max_length, max_tokens=max_tokens,
                       max_batch_size=max_batch_size, max_pairs=max_pairs, attention_budget_mb=attention_budget_mb,
                       kind=maps)
    encoded = encoded if encoded is not None else encode_split(encoder.tokenizer, sentences)
    keep, too_long = engine.select(encoded, long_sentences)
    kept = [encoded[i] for i in keep]
    batches = engine.batches(kept)
    manifest = dict(format_version=cache.FORMAT_VERSION, key=key, n_sentences=len(sentences), skipped=too_long,
                    num_layers=len(engine.layers), layers=engine.layers, num_heads=engine.num_heads, maps=maps,
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L, H, W, W), L = len(layers), W = words + 2: [CLS], words, [SEP]; rows attend to columns "
                           "(H = 1 for per-layer map kinds)")
    if rows is not None:  # an entry of chosen rows: sentence i's rows[i] of its maps
        manifest.update(layout="(R, L, H, W), R = len(rows[i]): the kept rows of the (L, H, W, W) word maps, "
                               "W = words + 2: [CLS], words, [SEP]; rows attend to columns (H = 1 for per-layer map "
                               "kinds)", rows=[list(r) for r in rows])
    writer = CacheWriter(final_dir, manifest) if rows is None else RowsWriter(final_dir, manifest, rows)
    # progress lines in the run's log when no one watches a terminal (the Lightning bar shows it there)
    lines = ProgressCallback(desc=f"{maps} extraction")
    t, device, why = choose_loop(trainer, loop, [writer, lines])
    log.info("extracting attention: %d sentences, %d batches -> %s (%s)", len(kept), len(batches), final_dir,
             f"own loop on {device}" if device is not None else f"Lightning's predict loop: {why}")
    log.info("map kind: %s", maps)
    # attention: the model held in a mixed precision's compute dtype (compute_in); other map kinds read weights
    # themselves, so they keep them as loaded
    precision = str(t.precision) if engine.measure.mixed_precision else "32-true"
    with compute_in(encoder.model, precision) as engine.pool_dtype, \
            reusable_heap():  # the batches' buffers reused, not faulted in again at every batch
        if device is None:
            loader = DataLoader(engine.dataset(kept, keep, batches,
                                               device=t.strategy.root_device if not num_workers else None),
                                batch_size=None, num_workers=num_workers, persistent_workers=False, pin_memory=False)
            t.predict(AttentionExtractor(engine, rows), loader, return_predictions=False)
        elif batches:  # (no batch: nothing written, as Lightning's loop skips an empty loader)
            data = SentenceBatches(kept, keep, batches, engine.from_words, engine.to_words, engine.pad_id,
                                   pin=device.type == "cuda" and not num_workers)
            predict_loop(engine, data, writer, t, device, lines, num_workers, rows=rows)
    return cache.AttentionCache(final_dir)


@dataclass(frozen=True)
class AttentionMaps:
    """The attention-cache kind (:mod:`probes.extract.runner`): word-level maps of the map kind ``extract.maps``,
    pooled ``from_words`` / ``to_words``, in ``<cache_dir>/attention``; with ``rows`` (per sentence of the source,
    positions 0..n + 1 of its word map) only those rows of each sentence's maps (:mod:`probes.extract.rows`)."""

    rows: Rows | None = None

    folder = "attention"
    what = "attention"

    def __post_init__(self):
        if self.rows is not None:
            object.__setattr__(self, "rows", normalized(self.rows))

    def key_fields(self, encoder: Encoder, settings) -> dict:
        """Pooling, the stored layers, and the map kind with its options; the kept rows' digest when there are
        some (:func:`probes.extract.rows.rows_digest`)."""
        return dict(from_words=settings.from_words, to_words=settings.to_words, **settings.layer_key(encoder),
                    **settings.map_key(), **({} if self.rows is None else dict(rows=rows_digest(self.rows))))

    def build(self, encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
              trainer: Callable[..., pl.Trainer], settings) -> cache.AttentionCache:
        """:func:`extract` with the settings' pooling, length policy, batching and map kind."""
        return extract(encoder, sentences, key, cache_dir, trainer, from_words=settings.from_words,
                       to_words=settings.to_words, max_length=settings.max_length,
                       long_sentences=settings.long_sentences, maps=settings.maps, measures=settings.measures,
                       layers=settings.layers_for(encoder), rows=self.rows, **settings.batching())

    def open(self, path: str | Path) -> cache.AttentionCache:
        """The complete entry at ``path``."""
        return cache.AttentionCache(path)

