"""Benchmark: the project's attention extractor vs a plain Hugging Face loop, same sentences, one run.

    python bench/extract_speed.py [--encoder minilm|bert-base-random|<hub id or path>] [--split dev]
        [--sentences N] [--device auto|cpu|cuda] [--precision 32-true bf16-mixed ... auto] [--rounds R]
        [--loop auto|own|lightning ...] [--cache-dir DIR] [--threads N] [--out results.json] [--check]

Prints, side by side: the plain loop's tokens/s (transformers forward with ``output_attentions``, one
sentence at a time, fp32), the extractor at each explicit precision and at ``auto`` (and what ``auto``
chose), each as a ratio to the plain loop, and the fraction of this machine's measured matmul throughput
in the side's compute dtype (2048x2048 matmuls on the same threads, fp32 and bf16) that each side's useful
FLOPs reach. Each side runs in its own spawned process, loaded and warmed up (untimed, on the first
``--warmup`` sentences) before any timing; then up to ``--rounds`` rounds each time the matmul peaks and run
every side once, in a rotated order, so that the machine's load falls on all of them alike; each side's
fastest run and each dtype's best peak are reported. Timed: tokenization, forward passes, pooling and
writing (extractor: the whole `extract` call, Trainer setup included; `auto`: also choosing the precision,
measured as on a first run). Not timed: imports, model loading, data reading. Below the table, where each
extractor side's CPU time goes (:mod:`probes.maps.timing`: tokenizing, batching, the forward's matmuls, softmax and
other operators, pooling, device->host copies, writing, the rest per batch), the host work outside the forward per
1,000 sentences (with and without tokenizing, which a process's later extraction of the same split reuses; also
measured directly, by extractions that replay the recorded word maps instead of computing them), the
host-only share a GPU would leave, and the extraction's rate into the cache beside the cache folder's own write rate,
measured after every timed run in the same folder (the entry's bytes in the writer's block size, one fsync). Every
timed run tokenizes (the kept tokenization is dropped before it). ``--loop`` runs the extraction through the stage's
own loop (``auto``, ``own``) or Lightning's predict loop (``lightning``), one side each. See bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"

from probes.maps.timing import measuring, op_groups, stage  # noqa: E402  (after the repository is on the path)


# ----------------------------------------------------------------------------- loading (not timed)

def load_words(split: str, n: int | None, data_dir: str) -> list[list[str]]:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("fetch", overrides=["treebank=ewt", f"paths.data_dir={data_dir}"])
    words = [list(s.words) for s in instantiate(cfg.treebank).read(split)]
    return words[:n] if n else words


def load_bench_encoder(spec: str):
    """`minilm`: packaged all-MiniLM-L6-v2; `bert-base-random`: bert-base shape, random weights (seed 0)."""
    from probes.model.load import load_encoder, load_packaged, random_bert

    if spec == "minilm":
        return load_packaged(name="minilm")
    if spec == "bert-base-random":
        return random_bert(prefix="bert-base-random")  # 12 layers x 12 heads, hidden 768, seed 0
    return load_encoder(spec)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    return device


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    importlib.import_module("pytorch_lightning")  # it sets its loggers' levels on import: import first, then quiet
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# ----------------------------------------------------------------------------- FLOPs and matmul peak

def flops_per_sentence(config, T: int, extraction: bool) -> float:
    """Useful FLOPs of one sentence of T pieces (multiply-add = 2): per layer Q, K, V and output
    projections 8 d^2 T, feed-forward 4 d f T, scores and A @ V 4 T^2 d. The extractor stops after the
    last layer's attention, so it skips that layer's output projection and feed-forward block."""
    d = int(config.hidden_size)
    f = int(getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", 4 * d))
    L = int(config.num_hidden_layers)
    attn = 6 * d * d * T + 4 * T * T * d  # Q, K, V; Q K^T; A V
    rest = 2 * d * d * T + 4 * d * f * T  # output projection; feed-forward
    return L * attn + (L - 1 if extraction else L) * rest


def matmul_peak(device: str, dtype_name: str, n: int = 2048, budget_s: float = 3.0) -> dict:
    """Best-of-3 FLOP/s of an n x n matmul (``F.linear``, the kernel path of the model's projections; after
    one warm-up) on the threads torch uses. A dtype the hardware only emulates (bf16 without
    AVX512-BF16/AMX) is timed at a smaller n when n would take longer than ``budget_s`` (CPU seconds on a CPU)."""
    import torch
    import torch.nn.functional as F

    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    cpu = []  # CPU seconds of each timed matmul

    def once(m: int) -> float:
        a = torch.randn(m, m, device=device).to(dtype)
        b = torch.randn(m, m, device=device).to(dtype)
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        F.linear(a, b)  # a @ b.T
        sync()
        cpu.append(time.process_time() - c0)
        return time.perf_counter() - t0

    m = 256
    t = once(m)
    # doubling n costs 8x; on a CPU the size follows the matmul's CPU time, which other processes change little
    while m < n and 8 * (t if device == "cuda" else cpu[-1]) < budget_s:
        m *= 2
        t = once(m)
    cpu.clear()
    best = min([t] + [once(m) for _ in range(3)])
    return dict(dtype=dtype_name, n=m, flops_per_s=2 * m ** 3 / best, flops_per_cpu_s=2 * m ** 3 / min(cpu))


PEAK_DTYPE = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16", "16-true": "fp16"}


# ----------------------------------------------------------------------------- the sides

def plain_loop(model, tokenizer, sentences, device: str, max_length: int, keep_fp32: bool = False):
    """One sentence at a time through the model; every layer's map copied to numpy (fp16).

    Returns (n_sentences, lengths, map_bytes, maps) where maps holds fp32 (L, H, T, T) arrays only
    when keep_fp32 (for --check)."""
    import numpy as np
    import torch

    lengths, n_bytes, kept = [], 0, []
    with torch.inference_mode():
        for words in sentences:
            enc = tokenizer(words, is_split_into_words=True, return_tensors="pt")
            T = enc["input_ids"].shape[1]
            if T > max_length:  # the extractor skips these too (long_sentences="skip")
                kept.append(None)
                continue
            if device != "cpu":
                enc = {k: v.to(device) for k, v in enc.items()}
            out = model(**enc, output_attentions=True)
            maps = [a[0].float().cpu().numpy().astype(np.float16) for a in out.attentions]  # L x (H, T, T)
            n_bytes += sum(m.nbytes for m in maps)
            if keep_fp32:
                kept.append(np.stack([a[0].float().cpu().numpy() for a in out.attentions]))
            lengths.append(T)
    return len(lengths), lengths, n_bytes, kept


def make_trainer(accelerator: str, precision: str):
    import pytorch_lightning as pl

    return functools.partial(pl.Trainer, accelerator=accelerator, devices=1, precision=precision, logger=False,
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)


def run_extract(encoder, sentences, device: str, precision: str, cache_dir: str, tag: str, loop: str = "auto"):
    from probes.extract.stage import extract

    key = dict(encoder=encoder.name, fingerprint=encoder.fingerprint, dataset="ud_english_ewt", split=tag,
               precision=precision, device=device, n=len(sentences), nonce=uuid.uuid4().hex)
    return extract(encoder, sentences, key, cache_dir, make_trainer("gpu" if device == "cuda" else "cpu", precision),
                   loop=loop)


def folder_write_rate(folder: str | Path, n_bytes: int, block: int) -> dict:
    """What the cache folder takes: ``n_bytes`` written to a new file in ``folder`` in ``block``-byte writes (the
    cache writer's pattern: one write per batch), then one ``fsync``, as the entry's shard is; wall seconds and MB/s
    (the file is removed after)."""
    block = max(1, min(int(block), int(n_bytes)))
    data = memoryview(os.urandom(block))
    path = Path(folder) / f"write-rate-{uuid.uuid4().hex}.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = int(n_bytes)
        while left > 0:
            left -= f.write(data[:min(block, left)])
        f.flush()
        os.fsync(f.fileno())
    wall = time.perf_counter() - t0
    path.unlink()
    return dict(bytes=int(n_bytes), block=block, wall_s=wall, mb_per_s=n_bytes / wall / 1e6)


def child(side: str, args: dict, precision: str | None, commands, results) -> None:
    """A worker in a fresh spawned process: loads its side, warms up (untimed), puts ``ready``, then runs one
    timed run per ``run`` command from ``commands`` (putting its wall and CPU seconds on ``results``) until
    ``stop`` (then puts its totals). Every side lives while the others run, so the parent can interleave them."""
    try:
        _quiet()
        import torch

        from probes.extract.precision import resolve_precision

        if args.get("threads"):
            torch.set_num_threads(args["threads"])
        device = resolve_device(args["device"])
        loop = args.get("loop", "auto")
        sentences = load_words(args["split"], args["sentences"], args["data_dir"])
        encoder = load_bench_encoder(args["encoder"])
        encoder.model  # weights may load lazily on first access: load them before the clock starts
        res = dict(side=side, device=device, n_input=len(sentences), threads=torch.get_num_threads())
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        warm = sentences[:args.get("warmup", 0)]
        out: dict = {}
        with tempfile.TemporaryDirectory(prefix="extract-bench-", dir=args.get("cache_dir")) as tmp:
            if side == "plain":
                model = encoder.model.to(device)  # fp32 on either device
                plain_loop(model, encoder.tokenizer, warm, device, encoder.max_length)  # untimed warm-up

                def run() -> None:
                    out["r"] = plain_loop(model, encoder.tokenizer, sentences, device, encoder.max_length)
            else:
                from probes.extract.precision import candidates

                if warm:  # untimed warm-up (auto: at its first candidate, so the timed run still chooses)
                    first = candidates(device)[0] if precision == "auto" else precision
                    run_extract(encoder, warm, device, first, tmp, args["split"] + "-warmup", loop)

                def forget() -> None:  # untimed: every timed run tokenizes, as a process's first extraction of a split
                    from probes.extract.stage import forget_splits

                    forget_splits()

                def after() -> None:  # untimed: the cache folder's write rate, measured beside each run
                    m = out["cache"].manifest
                    out["folder"] = folder_write_rate(tmp, int(m["bytes"]), int(m["bytes"]) // max(1, out["batches"]))

                def run() -> None:
                    store = tempfile.mkdtemp(dir=tmp)  # auto: an empty precision.json, as on a first run
                    c0, t0 = time.process_time(), time.perf_counter()
                    chosen = resolve_precision(precision, "gpu" if device == "cuda" else "cpu", encoder, sentences,
                                               cache_dir=store, margin=args["precision_margin"])
                    out.setdefault("choose_s", []).append(time.perf_counter() - t0)
                    out["choose_cpu_s"] = time.process_time() - c0
                    with measuring() as times:  # the engine's and the writer's stages, in CPU and wall seconds
                        if "cache" in out:  # the previous run's entry: free the disk before writing the next
                            with stage("bench: removing the previous entry"):
                                shutil.rmtree(out["cache"].path, ignore_errors=True)
                        out["cache"] = run_extract(encoder, sentences, device, chosen, tmp, args["split"], loop)
                    out["stages"] = times.as_dict()
                    out["batches"] = out["stages"].get("forward", {}).get("calls", 1)
                    out["chosen"] = chosen

            results.put(dict(side=side, ready=True))
            while commands.get() == "run":
                if side != "plain":
                    forget()
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                run()
                sync()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if side != "plain":
                    after()
                results.put(dict(side=side, wall_s=wall, cpu_s=cpu, stages=out.pop("stages", None),
                                 choose_cpu_s=out.pop("choose_cpu_s", 0.0), folder=out.pop("folder", None)))

            res["peak_rss_kib"] = peak_rss_kib()  # of the timed runs (the profiled and host-only runs come after)
            if side == "plain":
                n_sent, lengths, n_bytes, _ = out["r"]
                res.update(precision="32-true", sentences=n_sent, tokens=sum(lengths), map_bytes=n_bytes,
                           flops=sum(flops_per_sentence(encoder.config, T, False) for T in lengths), cache_bytes=None)
            else:
                from probes.model.inputs import encode_words

                cache = out["cache"]
                m = cache.manifest
                res["profile"] = profiled_run(encoder, sentences, device, out["chosen"], tmp, args["split"], loop)
                res["host_only"] = host_only_run(encoder, sentences, device, out["chosen"], tmp, args["split"], loop)
                lengths = [e.n_pieces for i, e in enumerate(encode_words(encoder.tokenizer, sentences)) if i in cache]
                res.update(precision=out["chosen"], requested=precision, loop=loop, choose_s=min(out["choose_s"]),
                           choose_s_per_run=out["choose_s"],
                           sentences=m["n_sentences"] - len(m["skipped"]), tokens=int(m["n_pieces"]),
                           flops=sum(flops_per_sentence(encoder.config, T, True) for T in lengths),
                           cache_bytes=int(m["bytes"]), map_bytes=None)
        if device == "cuda":
            res["gpu_peak_alloc_bytes"] = int(torch.cuda.max_memory_allocated())
        results.put(res)
    except BaseException as e:  # report, don't hang the parent
        import traceback

        results.put(dict(side=side, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))


def profiled_run(encoder, sentences, device: str, precision: str, tmp: str, split: str, loop: str = "auto") -> dict:
    """One more extraction (at the chosen precision, untimed by the rounds) under ``torch.profiler``: the operators'
    self time per stage and group (:func:`probes.maps.timing.op_groups`), which splits the forward's CPU time into
    matmuls, softmax, the other operators, and Python and dispatch between them."""
    import torch

    from probes.extract.stage import forget_splits

    acts = [torch.profiler.ProfilerActivity.CPU]
    forget_splits()
    c0 = time.process_time()
    with measuring() as times, torch.profiler.profile(activities=acts) as prof:
        cache = run_extract(encoder, sentences, device, precision, tmp, split + "-profiled", loop)
    cpu = time.process_time() - c0
    shutil.rmtree(cache.path, ignore_errors=True)
    return dict(cpu_s=cpu, stages=times.as_dict(), groups=op_groups(prof.events()))


def host_only_run(encoder, sentences, device: str, precision: str, tmp: str, split: str, loop: str = "auto",
                  repeats: int = 5) -> dict:
    """The host's work beside the forward, measured directly: one extraction records the engine's word maps of every
    batch (forward and pooling), then ``repeats`` extractions replay them instead of computing them (everything else
    as in a timed run: the Trainer, tokenizing, batching, the loop, copies, writing, finishing), each tokenizing the
    split as a first extraction does, and ``repeats`` more reusing the tokenization (a later extraction of the split in
    the process); the least process CPU time of each (every run's kept: their mean includes the garbage collections
    that the least may have missed), and the stages of the least."""
    import torch

    from probes.extract.stage import forget_splits
    from probes.maps import MapEngine

    recorded: dict[tuple, torch.Tensor] = {}
    compute = MapEngine.word_maps

    def record(self, batch, *args, **kwargs):
        maps = compute(self, batch, *args, **kwargs)  # (B, L', H', W, W)
        recorded[tuple(batch["index"].tolist())] = maps.clone()
        return maps

    def replay(self, batch, *args, **kwargs):
        return recorded[tuple(batch["index"].tolist())]

    def runs(forget: bool) -> tuple[list[float], dict]:
        best, stages, cpus = float("inf"), {}, []
        for _ in range(repeats):
            if forget:
                forget_splits()
            c0 = time.process_time()
            with measuring() as times:
                cache = run_extract(encoder, sentences, device, precision, tmp, split + "-host", loop)
            cpu = time.process_time() - c0
            shutil.rmtree(cache.path, ignore_errors=True)
            cpus.append(cpu)
            if cpu < best:
                best, stages = cpu, times.as_dict()
        return cpus, stages

    try:
        MapEngine.word_maps = record
        shutil.rmtree(run_extract(encoder, sentences, device, precision, tmp, split + "-record", loop).path)
        MapEngine.word_maps = replay
        first, first_stages = runs(forget=True)
        reused, reused_stages = runs(forget=False)
    finally:
        MapEngine.word_maps = compute
    return dict(repeats=repeats, cpu_s=min(first), cpus_s=first, stages=first_stages,
                cpu_s_tokenization_reused=min(reused), cpus_s_tokenization_reused=reused,
                stages_tokenization_reused=reused_stages)


def machine_busy_s() -> float:
    """Busy CPU-seconds of the whole machine since boot (all but idle and iowait; steal included)."""
    try:
        j = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(j[:8]) - j[3] - j[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Worker:
    """The parent's handle on one :func:`child`."""

    def __init__(self, side: str, args: dict, precision: str | None = None, loop: str = "auto"):
        ctx = mp.get_context("spawn")
        self.side, self.precision, self.loop = side, precision, loop
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=child, args=(side, dict(args, loop=loop), precision, self.commands,
                                                       self.results))
        self.process.start()
        self.walls: list[float] = []
        self.cpus: list[float] = []  # CPU seconds of the side's process during each run
        self.others: list[float] = []
        self.stages: list[dict | None] = []  # each run's stage times (extractor sides)
        self.choose_cpu: list[float] = []
        self.folders: list[dict | None] = []  # the cache folder's write rate measured after each run

    @property
    def name(self) -> str:
        if self.side == "plain":
            return "plain"
        return f"extract({self.precision}" + (f", {self.loop} loop)" if self.loop != "auto" else ")")

    def get(self) -> dict:
        res = self.results.get()
        if "error" in res:
            sys.stderr.write(res["traceback"])
            raise SystemExit(f"{self.name} failed: {res['error']}")
        return res

    def run_once(self) -> float:
        """One timed run; records its wall time and the share of the machine's CPU others used meanwhile."""
        busy0 = machine_busy_s()
        self.commands.put("run")
        r = self.get()
        busy = machine_busy_s() - busy0
        self.walls.append(r["wall_s"])
        self.cpus.append(r["cpu_s"])
        self.stages.append(r.get("stages"))
        self.choose_cpu.append(r.get("choose_cpu_s", 0.0))
        self.folders.append(r.get("folder"))
        self.others.append(max(0.0, busy - r["cpu_s"]) / (r["wall_s"] * (os.cpu_count() or 1)))
        return r["wall_s"]

    def finish(self) -> dict:
        self.commands.put("stop")
        res = self.get()
        self.process.join()
        best = min(range(len(self.walls)), key=self.walls.__getitem__)
        least = min(range(len(self.cpus)), key=self.cpus.__getitem__)  # the run whose stages are reported
        rates = [f for f in self.folders if f]  # the folder's rate measured right after the fastest run is reported
        return dict(res, wall_s=self.walls[best], walls_s=self.walls, cpu_s=self.cpus[least], cpus_s=self.cpus,
                    others_cpu_fraction=self.others[best], others_cpu_fractions=self.others,
                    stages=self.stages[least], choose_cpu_s=self.choose_cpu[least],
                    folder_write=self.folders[best] if rates else None, folder_writes=self.folders)


# ----------------------------------------------------------------------------- --check

def check(args: dict, precisions: list[str], n: int = 50) -> dict:
    """Extractor's 32-true cache vs word-pooled plain-loop maps; other precisions vs the 32-true cache."""
    import numpy as np
    import torch

    from probes.model.inputs import encode_words, pool_attention, pooling_matrix

    _quiet()
    device = resolve_device(args["device"])
    sentences = load_words(args["split"], n, args["data_dir"])
    encoder = load_bench_encoder(args["encoder"])
    out: dict = dict(n_sentences=len(sentences))
    with tempfile.TemporaryDirectory(prefix="extract-check-") as tmp:
        caches = {p: run_extract(encoder, sentences, device, p, tmp, args["split"] + "-check")
                  for p in dict.fromkeys(["32-true", *precisions])}
        encoder.model.to("cpu")  # the Trainer may have moved it
        _, _, _, plain = plain_loop(encoder.model, encoder.tokenizer, sentences, "cpu", encoder.max_length,
                                    keep_fp32=True)
        encoded = encode_words(encoder.tokenizer, sentences)
        diff, mismatched = 0.0, 0
        for i, (e, a) in enumerate(zip(encoded, plain)):
            if a is None or i not in caches["32-true"]:
                continue
            if a.shape[-1] != e.n_pieces:  # plain tokenization differs from encode_words' fallback
                mismatched += 1
                continue
            L, H, T, _ = a.shape
            fm = pooling_matrix(e.word_of_piece, e.n_words, "mean")[None]
            tm = pooling_matrix(e.word_of_piece, e.n_words, "sum")[None]
            W = e.n_words + 2
            words = pool_attention(torch.from_numpy(a).reshape(1, L * H, T, T), fm, tm).reshape(L, H, W, W)
            diff = max(diff, float(np.abs(caches["32-true"][i].astype(np.float32) - words.numpy()).max()))
        out["fp32_cache_vs_plain_max_abs"] = diff
        out["fp32_ok"] = diff <= 2e-3
        out["tokenization_mismatches"] = mismatched
        for p, c in caches.items():
            if p == "32-true":
                continue
            d = max(float(np.abs(c[i].astype(np.float32) - caches["32-true"][i].astype(np.float32)).max())
                    for i in range(len(sentences)) if i in c)
            out[f"{p}_vs_fp32_max_abs"] = d
    return out


# ----------------------------------------------------------------------------- reporting

def cpu_model() -> str:
    """lscpu's "Model name" (the same string /proc/cpuinfo gives)."""
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                                 env=dict(os.environ, LC_ALL="C")).stdout
            for line in out.splitlines():
                if line.strip().startswith("Model name:"):
                    return line.split(":", 1)[1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    from probes.extract.precision import cpu_name

    return cpu_name()


def machine() -> dict:
    import torch

    from probes.extract.precision import cpu_has_bf16
    from probes.machine import cpu_description

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(cpu=cpu_model(), cpu_description=cpu_description(), cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__,
                cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_native_bf16=cpu_has_bf16(),
                gpu=gpu, python=platform.python_version(), loadavg_1min_at_start=os.getloadavg()[0])


def table(rows: list[dict], peaks: dict) -> str:
    base = rows[0]["tokens_per_s"]
    head = ["side", "precision", "tok/s", "x plain", "GFLOP/s", "of matmul peak", "wall s", "CPU s",
            "of peak (CPU time)", "peak RSS MiB", "others' CPU"]
    body = []
    for r in rows:
        name = "plain HF loop" if r["side"] == "plain" else (
            f"extract auto -> {r['precision']}" if r.get("requested") == "auto" else "extract") + (
            f" ({r['loop']} loop)" if r.get("loop", "auto") != "auto" else "")
        peak = peaks.get(PEAK_DTYPE.get(r["precision"], ""))
        frac = f"{r['flops'] / r['wall_s'] / peak['flops_per_s']:.0%} ({peak['dtype']})" if peak else "-"
        body.append([name, r["precision"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base:.2f}",
                     f"{r['flops'] / r['wall_s'] / 1e9:.1f}", frac, f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}",
                     f"{r['flops'] / r['cpu_s'] / peak['flops_per_cpu_s']:.0%}" if peak else "-",
                     f"{r['peak_rss_kib'] / 1024:.0f}", f"{r['others_cpu_fraction']:.0%}"])
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * x for x in w]), *map(fmt, body)])



# stages reported, in order: (label, stage names of probes.maps.timing summed into it)
STAGE_ROWS = [("tokenizing", ("tokenize",)), ("batching (padding, pooling matrices)", ("batch",)),
              ("pooling to words", ("pool",)), ("device->host copies", ("to host",)),
              ("writing the cache (slices, CRC-32, writes)", ("write",)),
              ("finishing the entry (fsync, index, manifest, rename)", ("finalize",)),
              ("bench: removing the previous run's entry", ("bench: removing the previous entry",))]
REST = "the loop, the Trainer, Python per batch (the rest)"  # Lightning's predict loop or the stage's own
FORWARD_ROWS = [("forward: matmuls (projections, scores, A @ V)", "matmul"),
                ("forward: softmax", "softmax"),
                ("forward: the rest (LayerNorm, GELU, adds, copies, masks)", "other"),
                ("forward: Python and dispatch between operators", "python")]
HOST_ONLY = ("tokenizing", "batching", "device->host", "writing", "finishing", "forward: Python", REST, "choosing")
# what the host does besides the engine's forward and word pooling (which a GPU runs) and the bench's own clean-up
OUTSIDE = ("tokenizing", "batching", "device->host", "writing", "finishing", REST)
BEHIND = ("batching", "writing")  # host work that the GPU path runs in background threads


def breakdown(row: dict, peak: dict | None) -> dict:
    """Where the side's least-CPU run went: ``rows`` [(label, CPU s)] summing to its CPU time, the forward split by
    the profiled run's operator shares, and the host-only part (what a GPU leaves to the host)."""
    st, prof = row.get("stages") or {}, row.get("profile") or {}
    cpu = lambda names: sum(st.get(n, {}).get("cpu_s", 0.0) for n in names)  # noqa: E731
    rows = []
    if row.get("requested") == "auto":
        rows.append(("choosing the precision (auto, once per machine and shape)", row.get("choose_cpu_s", 0.0)))
    rows += [(label, cpu(names)) for label, names in STAGE_ROWS[:2]]
    forward = cpu(["forward"])
    g = (prof.get("groups") or {}).get("forward", {})
    ops = {k: g.get(k, 0.0) for k in ("matmul", "softmax", "other")}
    ops["python"] = max(0.0, g.get("range", 0.0) - sum(ops.values()))
    total_ops = sum(ops.values())
    rows += [(label, forward * ops[k] / total_ops if total_ops else 0.0) for label, k in FORWARD_ROWS]
    rows += [(label, cpu(names)) for label, names in STAGE_ROWS[2:]]
    rest = row["cpu_s"] - sum(c for _, c in rows)
    n_batches = st.get("forward", {}).get("calls", 0)
    rows.append((REST, rest))
    matmul_s = dict(rows)[FORWARD_ROWS[0][0]]
    writes = [st.get(n, {}) for n in ("write", "finalize")]
    write_wall = sum(w.get("wall_s", 0.0) for w in writes)
    host = sum(c for label, c in rows if label.startswith(HOST_ONLY))
    main = host - sum(c for label, c in rows if label.startswith(BEHIND))  # what the GPU path leaves on the main thread
    per_k = 1000 / max(1, row["sentences"])
    outside = sum(c for label, c in rows if label.startswith(OUTSIDE))
    tokenizing = dict(rows).get(STAGE_ROWS[0][0], 0.0)
    folder = row.get("folder_write") or {}
    into_cache = (row.get("cache_bytes") or 0) / row["wall_s"] / 1e6  # the entry's bytes over the run's wall time
    direct = row.get("host_only") or {}
    return dict(rows=rows,
                host_only_measured_cpu_s_per_1000_sentences=direct["cpu_s"] * per_k if direct else None,
                host_only_measured_tokenization_reused_cpu_s_per_1000_sentences=(
                    direct["cpu_s_tokenization_reused"] * per_k if direct else None),
                outside_forward_cpu_s=outside, outside_forward_cpu_s_per_1000_sentences=outside * per_k,
                outside_forward_without_tokenizing_cpu_s_per_1000_sentences=(outside - tokenizing) * per_k,
                tokenizing_cpu_s_per_1000_sentences=tokenizing * per_k,
                extraction_into_cache_mb_per_s=into_cache, folder_write_mb_per_s=folder.get("mb_per_s"),
                extraction_of_folder_rate=into_cache / folder["mb_per_s"] if folder.get("mb_per_s") else None,
                n_batches=n_batches, rest_per_batch_s=rest / max(1, n_batches),
                matmul_cpu_s=matmul_s,
                matmul_fraction_of_peak=(row["flops"] / matmul_s / peak["flops_per_cpu_s"]
                                         if peak and matmul_s > 0 else None),
                host_cpu_s=host, host_cpu_s_per_1000_sentences=host * per_k,
                host_bound_tokens_per_s=row["tokens"] / host if host > 0 else None,
                main_thread_cpu_s=main, main_thread_cpu_s_per_1000_sentences=main * per_k,
                main_thread_bound_tokens_per_s=row["tokens"] / main if main > 0 else None,
                write_wall_s=write_wall, write_mb_per_s=(row.get("cache_bytes") or 0) / write_wall / 1e6
                if write_wall > 0 else None,
                profiled_cpu_s=prof.get("cpu_s"))


def breakdown_table(row: dict, b: dict, peak: dict | None) -> str:
    """The breakdown as text: seconds and shares, with the matmul-peak ratios beside."""
    name = f"extract {row['precision']}" + (" (auto)" if row.get("requested") == "auto" else "") + (
        f" ({row['loop']} loop)" if row.get("loop", "auto") != "auto" else "")
    w = max(len(label) for label, _ in b["rows"])
    profiled = f", that run {b['profiled_cpu_s']:.2f} CPU-s" if b["profiled_cpu_s"] else ""
    lines = [f"where the CPU time of {name} goes (its least-CPU run, {row['cpu_s']:.2f} CPU-s, {b['n_batches']} "
             f"batches; stages timed by thread CPU time, the forward split by one profiled run's operator self "
             f"times{profiled}):",
             f"  {'stage'.ljust(w)}  CPU s   share", f"  {'-' * w}  -----  ------"]
    for label, c in b["rows"]:
        lines.append(f"  {label.ljust(w)}  {c:5.2f}  {c / row['cpu_s']:6.1%}")
    if peak and b["matmul_fraction_of_peak"]:
        lines.append(f"  useful FLOPs over the matmuls' CPU time: {b['matmul_fraction_of_peak']:.0%} of the "
                     f"{peak['dtype']} matmul peak (the whole run: {row['fraction_of_matmul_peak_cpu_time']:.0%}); "
                     f"the rest per batch {1e3 * b['rest_per_batch_s']:.1f} ms")
    lines.append(f"  host work outside the forward (tokenizing, batching, copies, writing, finishing, the loop; not "
                 f"the forward and word pooling, which a GPU runs): "
                 f"{b['outside_forward_cpu_s_per_1000_sentences']:.3f} CPU-s per 1,000 sentences; without tokenizing "
                 f"(reused from the process's earlier extraction of the split) "
                 f"{b['outside_forward_without_tokenizing_cpu_s_per_1000_sentences']:.3f}; tokenizing "
                 f"{b['tokenizing_cpu_s_per_1000_sentences']:.3f} (its main thread's part: the tokenizer's own threads "
                 f"are in the rest)")
    if b["host_only_measured_cpu_s_per_1000_sentences"] is not None:
        h = row["host_only"]
        per_k = lambda cpus: sum(cpus) / len(cpus) * 1000 / max(1, row["sentences"])  # noqa: E731
        tok = h["stages"].get("tokenize", {}).get("cpu_s", 0.0)
        lines.append(f"  measured directly (the forward and pooling replayed from a recorded run, everything else run, "
                     f"least of {h['repeats']}): {b['host_only_measured_cpu_s_per_1000_sentences']:.3f} CPU-s per "
                     f"1,000 sentences (mean {per_k(h['cpus_s']):.3f}), tokenizing "
                     f"{tok * 1000 / max(1, row['sentences']):.3f} of it (its main thread's part); with the split's "
                     f"tokenization reused "
                     f"{b['host_only_measured_tokenization_reused_cpu_s_per_1000_sentences']:.3f} (mean "
                     f"{per_k(h['cpus_s_tokenization_reused']):.3f})")
    lines.append(f"  host-only work (tokenizing, batching, copies, writing, finishing, the forward's Python and "
                 f"dispatch, the loop{', choosing' if row.get('requested') == 'auto' else ''}): "
                 f"{b['host_cpu_s']:.2f} CPU-s, {b['host_cpu_s_per_1000_sentences']:.2f} per 1,000 sentences: "
                 f"on a GPU the host alone allows at most {b['host_bound_tokens_per_s']:,.0f} tok/s without overlap; "
                 f"with batching and writing in background threads (the GPU path) the main thread keeps "
                 f"{b['main_thread_cpu_s_per_1000_sentences']:.2f} CPU-s per 1,000 sentences, at most "
                 f"{b['main_thread_bound_tokens_per_s']:,.0f} tok/s")
    if b["write_mb_per_s"]:
        lines.append(f"  cache written at {b['write_mb_per_s']:.0f} MB/s ({row['cache_bytes'] / 1e6:.1f} MB in "
                     f"{b['write_wall_s']:.2f} s wall, writing and finishing)")
    if b["folder_write_mb_per_s"]:
        f = row["folder_write"]
        lines.append(f"  extraction into the cache {b['extraction_into_cache_mb_per_s']:.1f} MB/s (the entry's "
                     f"{row['cache_bytes'] / 1e6:.1f} MB over the run's {row['wall_s']:.2f} s wall) = "
                     f"{b['extraction_of_folder_rate']:.1%} of the cache folder's write rate measured right after "
                     f"that run, {b['folder_write_mb_per_s']:.0f} MB/s ({f['bytes'] / 1e6:.1f} MB in "
                     f"{f['block'] / 1e6:.2f} MB writes and one fsync, {f['wall_s']:.3f} s)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The bench's arguments (bench/device/check.sh's commands are checked against them by the tests)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm", help="minilm | bert-base-random | hub id | local folder")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--sentences", "--max-sentences", type=int, default=1000, dest="sentences",
                    help="first N sentences of the split (0: all; default 1000)")
    ap.add_argument("--warmup", type=int, default=100, help="untimed warm-up on the first N sentences in each child")
    ap.add_argument("--rounds", "--repeats", type=int, default=3, dest="rounds",
                    help="rounds: each times the matmul peaks and runs every side once, in a rotated order; each "
                         "side's fastest run and each peak's best are reported (default 3)")
    ap.add_argument("--budget", type=float, default=120.0,
                    help="no new round once this many seconds of timed runs are spent (default 120)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every side and the peaks (0: torch's)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", nargs="+", default=None,
                    help="extractor precisions, each a separate run (default: every explicit candidate of the "
                         "device - cpu: 32-true bf16-mixed; cuda: 16-mixed bf16-mixed 32-true - then auto)")
    ap.add_argument("--loop", nargs="+", default=["auto"], choices=["auto", "own", "lightning"],
                    help="the extraction's loop, one side each per precision (extract(loop=...)): auto (the stage's "
                         "own loop on one device), own, lightning (Lightning's predict loop); default auto")
    ap.add_argument("--cache-dir", default=None,
                    help="where each side's cache entries (and the folder's write-rate file) go: a temporary folder "
                         "made inside it (default: the system's temporary folder)")
    ap.add_argument("--precision-margin", type=float, default=1.3,
                    help="auto: the speed-up over 32-true another precision needs (extract.precision_margin)")
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR") or str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=None, help="write results as JSON")
    ap.add_argument("--check", action="store_true",
                    help="also verify the first 50 sentences: 32-true cache vs pooled plain loop (<= 2e-3)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)

    import torch

    device = resolve_device(a.device)
    precisions = a.precision or (["16-mixed", *(["bf16-mixed"] if torch.cuda.is_bf16_supported() else []), "32-true"]
                                 if device == "cuda" else ["32-true", "bf16-mixed"]) + ["auto"]
    if a.threads:
        torch.set_num_threads(a.threads)
    args = dict(encoder=a.encoder, split=a.split, sentences=a.sentences or None, device=a.device, data_dir=a.data_dir,
                warmup=a.warmup, threads=a.threads, precision_margin=a.precision_margin, cache_dir=a.cache_dir)
    info = machine()
    print(f"machine: CPU {info['cpu_description']}, {info['cores']} logical CPUs, torch threads "
          f"{info['torch_threads']} ({info['cpu_capability']}, native bf16: "
          f"{'yes' if info['cpu_native_bf16'] else 'no'}), "
          f"GPU: {info['gpu'] or 'none'}, torch {info['torch']}; load average {info['loadavg_1min_at_start']:.2f}")
    print(f"encoder: {a.encoder}; data: UD EWT {a.split}" + (f", first {a.sentences} sentences" if a.sentences else "")
          + f"; device {device}; plain loop: fp32, one sentence at a time; each side in its own process: untimed "
          f"warm-up on the first {a.warmup} sentences, then up to {a.rounds} rounds (no new round after {a.budget:g} s) "
          f"that time the matmul peaks and run every side once, interleaved; best of the rounds reported", flush=True)

    workers = [Worker("plain", args)] + [Worker("extract", args, p, loop) for p in precisions for loop in a.loop]
    for w in workers:  # loading and warm-up, all at once (untimed)
        w.get()
    dtypes = ["fp32", "fp16", "bf16"] if device == "cuda" else ["fp32", "bf16"]
    peak_runs: dict[str, list[dict]] = {dt: [] for dt in dtypes}
    spent = 0.0
    for r in range(max(1, a.rounds)):
        if r and spent > a.budget:
            break
        for dt in dtypes:  # in this process, while every worker waits
            peak_runs[dt].append(matmul_peak(device, dt))
        order = workers[r % len(workers):] + workers[:r % len(workers)]  # rotated: no side always first
        walls = {w.name: w.run_once() for w in order}
        spent += sum(walls.values())
        print(f"  round {r + 1}: peaks " + ", ".join(f"{dt} {peak_runs[dt][-1]['flops_per_s'] / 1e9:.0f}" for dt in dtypes)
              + " GFLOP/s; " + ", ".join(f"{w.name} {walls[w.name]:.1f} s" for w in workers), flush=True)
    peaks = {dt: max(v, key=lambda p: p["flops_per_s"]) for dt, v in peak_runs.items()}
    for dt, p in peaks.items():
        p["all_flops_per_s"] = [q["flops_per_s"] for q in peak_runs[dt]]
        p["flops_per_cpu_s"] = max(q["flops_per_cpu_s"] for q in peak_runs[dt])
    print("matmul peak (best of the rounds; each round: best of 3 after a warm-up): " + ", ".join(
        f"{p['dtype']} {p['flops_per_s'] / 1e9:.1f} GFLOP/s ({p['n']}x{p['n']}; "
        f"{p['flops_per_cpu_s'] / 1e9:.1f} per CPU-second)" for p in peaks.values()), flush=True)
    rows = [w.finish() for w in workers]
    auto = next((r for r in rows if r.get("requested") == "auto"), None)
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["ratio_tokens_per_s_vs_plain"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        peak = peaks.get(PEAK_DTYPE.get(r["precision"], ""))
        r["fraction_of_matmul_peak"] = r["flops"] / r["wall_s"] / peak["flops_per_s"] if peak else None
        r["fraction_of_matmul_peak_cpu_time"] = r["flops"] / r["cpu_s"] / peak["flops_per_cpu_s"] if peak else None
    if auto:  # its timed runs include choosing (as a first run on a machine does); the extraction alone, per run
        alone = min(w - c for w, c in zip(auto["walls_s"], auto["choose_s_per_run"]))
        peak = peaks.get(PEAK_DTYPE.get(auto["precision"], ""))
        auto["wall_s_without_choice"] = alone
        auto["fraction_of_matmul_peak_without_choice"] = auto["flops"] / alone / peak["flops_per_s"] if peak else None
        print(f"  auto chose {auto['precision']} (fastest choice {auto['choose_s']:.2f} s, paid once per machine and "
              f"model shape; its fastest run less its choice: {alone:.1f} s"
              + (f", {auto['fraction_of_matmul_peak_without_choice']:.0%} of the {peak['dtype']} peak)" if peak else ")"))
    print()
    print(table(rows, peaks))
    others = max(r["others_cpu_fraction"] for r in rows)
    print(f"({rows[0]['sentences']} sentences, {rows[0]['tokens']} wordpieces incl. specials. GFLOP/s: useful FLOPs "
          f"only (no padding; the extractor's without the last layer's output projection and feed-forward block). "
          f"CPU s: the side's process CPU time in its fastest-CPU run; of peak (CPU time): useful FLOPs per CPU-second "
          f"over the matmul's FLOPs per CPU-second, which other processes change little at --threads 1. "
          f"others' CPU: share of the machine's CPU time other processes used while that side ran"
          + (f"; up to {others:.0%}: these timings are slowed by them, the one-sentence loop most" if others > 0.1
             else "") + ")")
    for r in rows[1:]:
        peak = peaks.get(PEAK_DTYPE.get(r["precision"], ""))
        r["breakdown"] = breakdown(r, peak)
        print()
        print(breakdown_table(r, r["breakdown"], peak))
    result = dict(machine=info, encoder=a.encoder, split=a.split, sentences=a.sentences, threads=a.threads or None,
                  rounds=len(peak_runs[dtypes[0]]), matmul_peak=peaks, rows=rows)

    if a.check:
        c = check(args, [p for p in precisions if p != "auto"])
        result["check"] = c
        print(f"\ncheck ({c['n_sentences']} sentences): 32-true cache vs word-pooled plain loop: "
              f"max |diff| = {c['fp32_cache_vs_plain_max_abs']:.2e} "
              f"({'OK' if c['fp32_ok'] else 'FAIL'}, tolerance 2e-3)"
              + (f", {c['tokenization_mismatches']} sentences tokenized differently (skipped)"
                 if c["tokenization_mismatches"] else ""))
        for k, v in c.items():
            if k.endswith("_vs_fp32_max_abs"):
                print(f"check: {k.removesuffix('_vs_fp32_max_abs')} cache vs 32-true cache: max |diff| = {v:.2e}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0 if not a.check or result["check"]["fp32_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
