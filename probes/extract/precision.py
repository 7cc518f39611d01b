"""`extract.precision=auto`: the fastest precision on this machine for this model shape, measured once.

On first use for a key (CPU model / GPU name, torch version, threads, device, model shape) one real batch is
timed at each candidate precision (CPU: ``32-true``, plus ``bf16-mixed`` where the CPU has native bf16; GPU:
``16-mixed``, ``bf16-mixed`` where supported, ``32-true``), the candidates interleaved (A B A B ...) for a few
rounds within about a second (:func:`measure`), and each candidate's minimum compared (:func:`decide`):
``32-true`` is kept unless another candidate is at least ``extract.precision_margin`` (1.3) times faster, so a
busy machine does not tip the choice. The decision, its timings and margin are remembered in
``<cache_dir>/precision.json`` (read-measure-write under a file lock, atomic rename) and reused after;
:func:`record` returns what a run folder records about it. The resolved precision is part of every cache key:
set ``extract.precision=32-true`` (or ``bf16-mixed``) to pin it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal, get_args

import torch
from lightning_fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

from probes.io import atomic_write_text
from probes.maps import MapEngine, encode_all
from probes.measures.attention import Attention
from probes.model.frozen import check_compute, compute_in, computes_in
from probes.model.inputs import Encoded

try:  # not on every platform: `locked` then does not lock
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

log = logging.getLogger(__name__)

STORE = "precision.json"
# What extract.precision accepts: auto, or a precision the Lightning Trainer takes as a string (Lightning's own lists,
# which its Trainer checks against; ``32`` etc. are its aliases of ``32-true`` etc.)
PRECISIONS = ("auto", *get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_STR_ALIAS))
Precision = Literal[PRECISIONS]  # the type of ExtractSettings.precision (probes.config.check_types reads it)
_SAID: set[str] = set()  # devices whose single-candidate decision was logged


def check_precision(precision) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a ValueError naming ``extract.precision`` and the
    allowed values (before any model is loaded: Lightning would say it only when the extraction Trainer starts)."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    raise ValueError(f"extract.precision={precision!r} is not a precision: expected one of {', '.join(PRECISIONS)} "
                     "(auto: measured once per machine and model shape; conf/extract/default.yaml)")


def device_of(accelerator: str | None) -> str:
    """``cuda`` or ``cpu``: where a Trainer with this accelerator runs the model."""
    acc = str(accelerator or "auto").lower()
    if acc in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower than fp32."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        with contextlib.suppress(Exception):
            if fn is not None and fn():
                return True
    return False


def candidates(device: str) -> list[str]:
    """Precisions worth trying on ``device``, most likely fastest first (ties go to the earlier)."""
    if device == "cuda":
        return ["16-mixed", *(["bf16-mixed"] if torch.cuda.is_bf16_supported() else []), "32-true"]
    return ["32-true", *(["bf16-mixed"] if cpu_has_bf16() else [])]


def candidates_for(device: str, weights: torch.dtype = torch.float32) -> list[str]:
    """:func:`candidates` that compute on weights of dtype ``weights`` (``encoder.dtype``;
    :func:`probes.model.frozen.computes_in`)."""
    return [c for c in candidates(device) if computes_in(c, weights) is not None]


def cpu_name() -> str:
    """The CPU's model name (lscpu / /proc/cpuinfo), else platform.processor()."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown-cpu"


def shape_of(config) -> dict:
    """What of the model's architecture sets its cost: family, layers, heads, hidden and feed-forward sizes."""
    inter = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    return dict(model_type=str(getattr(config, "model_type", "")), layers=int(config.num_hidden_layers),
                heads=int(config.num_attention_heads), hidden=int(config.hidden_size),
                intermediate=None if inter is None else int(inter))


def precision_key(config, device: str) -> dict:
    """The key a remembered decision is valid for."""
    key = dict(cpu=cpu_name(), torch=torch.__version__, device=device, **shape_of(config))
    if device == "cuda":
        key["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        key["threads"] = torch.get_num_threads()
    return key


def key_string(key: dict) -> str:
    """The store's entry name of a decision key: ``k=v`` pairs sorted by name, joined by ``;``."""
    return ";".join(f"{k}={key[k]}" for k in sorted(key))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Exclusive lock on ``<path>.lock`` (fcntl); unlocked where there is no fcntl or the folder is read-only
    (concurrent writers may then both measure; the atomic rename still keeps the file whole)."""
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_store(path: Path) -> dict:
    """The stored decisions (``{}`` when the file is missing or unreadable)."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s (%s); it will be rewritten", path, e)
        return {}


def remembered(path: Path, key: dict, cands: Sequence[str], margin: float) -> str | None:
    """The stored decision for ``key`` if it was made among the same candidates with the same margin (a
    stored decision without a margin is measured again)."""
    rec = read_store(path).get(key_string(key))
    if isinstance(rec, dict) and rec.get("candidates") == list(cands) and rec.get("precision") in cands \
            and rec.get("margin") == margin:
        return rec["precision"]
    return None


BASELINE = "32-true"  # full precision: left only for a clear margin


def decide(timings: Mapping[str, float], cands: Sequence[str], margin: float) -> tuple[str, float | None]:
    """The decision rule on measured times (seconds per token, the minimum over the rounds): ``32-true`` unless
    the fastest other candidate is at least ``margin`` times faster (then that one); without ``32-true`` among
    ``cands``, the fastest (ties to the earlier). Returns (choice, speed-up of the fastest other candidate over
    ``32-true``, None without it)."""
    cands = list(cands)
    others = [c for c in cands if c != BASELINE]
    if BASELINE not in cands or not others:
        return min(cands, key=lambda c: timings[c]), None
    fastest = min(others, key=lambda c: timings[c])
    ratio = timings[BASELINE] / timings[fastest] if timings[fastest] > 0 else float("inf")
    return (fastest if ratio >= margin else BASELINE), ratio


def measure(cands: Sequence[str], time_fn: Callable[[str], float], budget_s: float = 0.6, min_rounds: int = 2,
            max_rounds: int = 8, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Time the candidates interleaved (A B A B ...; one untimed warm-up call each first), ``min_rounds`` rounds
    and more while the next round fits in ``budget_s`` seconds (``max_rounds`` at most); every timing of each
    candidate (``time_fn(c)``: seconds per token of one batch). Interleaving exposes every candidate to the
    same machine load; the decision takes each one's minimum."""
    cands = list(cands)
    start = clock()
    for c in cands:
        time_fn(c)
    samples: dict[str, list[float]] = {c: [] for c in cands}
    t0 = clock()
    for r in range(max_rounds):
        for c in cands:
            samples[c].append(float(time_fn(c)))
        now = clock()
        if r + 1 >= min_rounds and now - start + (now - t0) / (r + 1) > budget_s:
            break
    return samples


def choose(key: dict, cands: Sequence[str], time_fn: Callable[[str], float], path: str | Path | None, *,
           margin: float, budget_s: float = 0.6, clock: Callable[[], float] = time.perf_counter) -> str:
    """The remembered decision for ``key`` (made among the same candidates with the same ``margin``), else
    :func:`measure` then :func:`decide`, stored under ``path`` (None: not stored) with the timings."""
    cands = list(cands)
    if len(cands) == 1:
        return cands[0]
    path = None if path is None else Path(path)
    with (locked(path) if path is not None else contextlib.nullcontext()):
        if path is not None and (hit := remembered(path, key, cands, margin)) is not None:
            return hit
        t0 = clock()
        samples = measure(cands, time_fn, budget_s=budget_s, clock=clock)
        seconds = clock() - t0
        timings = {c: min(v) for c, v in samples.items()}
        best, ratio = decide(timings, cands, margin)
        log.info("extract.precision=auto -> %s (measured on %s in %.2f s, %d rounds interleaved, best of each: %s; "
                 "32-true is left only for a %.2fx speed-up)", best, key_string(key), seconds,
                 len(samples[cands[0]]),
                 ", ".join(f"{c} {1 / t:,.0f} tokens/s" if t > 0 else f"{c} ?" for c, t in timings.items()), margin)
        if path is not None:
            store = read_store(path)
            store[key_string(key)] = dict(
                precision=best, candidates=cands, key=key, margin=margin, speedup=ratio, timings=timings,
                samples=samples, rounds=len(samples[cands[0]]), seconds=round(seconds, 3),
                measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            try:
                atomic_write_text(path, json.dumps(store, indent=1, sort_keys=True) + "\n")
            except OSError as e:
                log.warning("could not remember the precision decision in %s (%s); it will be measured again", path, e)
    return best


def record(precision: str, accelerator: str = "auto", encoder=None, cache_dir: str | Path | None = None, *,
           margin: float | None = None) -> dict:
    """What a run folder records about the extraction precision (nothing is measured or loaded): the requested
    and resolved precision, how it was decided (``config``, ``only candidate``, ``measured``, ``not measured``)
    and, for a measured decision, its stored record (key, candidates, margin, timings, speed-up, when)."""
    out = dict(requested=str(precision))
    if precision != "auto":
        return dict(out, precision=str(precision), decided_by="config")
    device = device_of(accelerator)
    cands = candidates_for(device, getattr(encoder, "dtype", torch.float32))
    out.update(device=device, cpu=cpu_name(), candidates=cands, margin=margin)
    if len(cands) == 1:
        return dict(out, precision=cands[0], decided_by="only candidate")
    if encoder is None or cache_dir is None:
        return dict(out, precision=None, decided_by="not measured")
    key = precision_key(encoder.config, device)
    path = Path(cache_dir) / STORE
    rec = read_store(path).get(key_string(key))
    if margin is not None and remembered(path, key, cands, margin) is None:
        return dict(out, precision=None, decided_by="not measured", key=key, store=str(path))
    return dict(out, **(rec or {}), decided_by="measured", store=str(path))


# ----------------------------------------------------------------------------- timing one batch
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


def precision_timer(encoder, encoded: list[Encoded], device: str, tokens: int = 128, from_words: str = "mean",
                    to_words: str = "sum") -> Callable[[str], float] | None:
    """``f(precision) -> seconds per token`` of one batch of attention word maps (the extraction step:
    :meth:`probes.maps.MapEngine.word_maps` and the copy to the CPU) under that precision's compute dtypes
    (:func:`probes.model.frozen.compute_in`) and autocast, on one batch of ~``tokens`` pieces from the sentences
    around the median length (the same batch at every call, so that :func:`measure` compares like with like).
    None when there are no sentences to time.

    On a CPU the batch runs on one thread and its CPU time is measured (``time.thread_time``): the time the
    work itself takes, which other processes competing for the cores do not change (wall time with several
    threads under load varies threefold, mostly threads waiting for each other). On a GPU: wall time
    between two synchronisations."""
    batches = timing_batches(encoded, encoder.max_length, tokens, 1)
    if not batches:
        return None
    engine = MapEngine(encoder.model.to(device), Attention(), from_words=from_words, to_words=to_words,
                       tokenizer=encoder.tokenizer)
    batch = {k: v.to(device) for k, v in engine.batch(batches[0], range(len(batches[0]))).items()}
    n_tokens = int(batch["attention_mask"].sum())

    def time_fn(precision: str) -> float:
        if device == "cuda":
            with compute_in(engine.model, precision) as engine.pool_dtype, torch.inference_mode(), \
                    autocast(precision, device):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.word_maps(batch).cpu()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / n_tokens
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with compute_in(engine.model, precision) as engine.pool_dtype, torch.inference_mode(), \
                    autocast(precision, device):
                t0 = time.thread_time()
                engine.word_maps(batch).cpu()
                return (time.thread_time() - t0) / n_tokens
        finally:
            torch.set_num_threads(threads)

    return time_fn


def resolve_precision(precision: str, accelerator: str = "auto", encoder=None, sentences=None,
                      cache_dir: str | Path | None = None, encoded=None, lookup_only: bool = False, *,
                      margin: float | None = None) -> str | None:
    """The Lightning precision to extract with; ``auto`` measured (see module doc).

    ``encoder`` (an :class:`~probes.model.load.Encoder`) and ``sentences`` (word lists) or ``encoded``
    give the batches to time; ``cache_dir`` holds the remembered decisions. ``lookup_only``: return None
    instead of measuring (nothing is loaded). ``margin``: the speed-up over ``32-true`` that another candidate
    needs to be chosen (``extract.precision_margin``; required for ``auto``). Without an encoder, ``auto`` is
    the first candidate (``32-true`` on a CPU, ``16-mixed`` on a GPU), unmeasured.
    """
    weights = getattr(encoder, "dtype", torch.float32)  # encoder.dtype: the precisions that compute on them
    if check_precision(precision) != "auto":
        check_compute(weights, str(precision))
        return str(precision)
    if margin is None:
        raise ValueError("extract.precision=auto needs extract.precision_margin (the speed-up over 32-true that "
                         "another precision must show to be chosen; conf/extract/default.yaml)")
    device = device_of(accelerator)
    cands = candidates_for(device, weights)
    if len(cands) == 1:
        if device not in _SAID:
            _SAID.add(device)
            log.info("extract.precision=auto -> %s, the only candidate on this %s (%s; no native bf16)",
                     cands[0], device, cpu_name())
        return cands[0]
    if encoder is None:
        log.warning("extract.precision=auto without an encoder to measure: using %s", cands[0])
        return cands[0]
    key = precision_key(encoder.config, device)
    path = None if cache_dir is None else Path(cache_dir) / STORE
    if path is not None:
        hit = remembered(path, key, cands, margin)
        if hit is not None or lookup_only:
            return hit
    elif lookup_only:
        return None
    if encoded is None:  # a spread-out sample is enough to find a batch around the median length
        sentences = list(sentences or [])
        encoded = encode_all(encoder.tokenizer, [list(s) for s in sentences[::max(1, len(sentences) // 500)]])
    timer = precision_timer(encoder, encoded, device)
    if timer is None:  # nothing to time
        return cands[0]
    return choose(key, cands, timer, path, margin=margin)
