"""Benchmark: the project's attention extractor vs a plain Hugging Face loop, same sentences, one run.

    python bench/extract_speed.py [--encoder minilm|bert-base-random|<hub id or path>] [--split dev]
        [--sentences N] [--device auto|cpu|cuda] [--precision 32-true bf16-mixed ... auto] [--out results.json]
        [--check]

Prints, side by side: the plain loop's tokens/s (transformers forward with ``output_attentions``, one
sentence at a time, fp32), the extractor at each explicit precision and at ``auto`` (and what ``auto``
chose), each as a ratio to the plain loop, and the fraction of this machine's measured matmul throughput
(2048x2048 matmuls on the same threads) that each side's useful FLOPs reach. Each side runs in its own
fresh child process ("spawn"): an untimed warm-up on the first ``--warmup`` sentences, then the fastest of up
to ``--repeats`` timed runs (no new run once ``--budget`` seconds are spent). Timed: tokenization, forward passes, pooling and writing (extractor: the
whole `extract` call, Trainer setup included; `auto`: also choosing the precision, measured as on a first
run). Not timed: imports, model loading, data reading. See bench/README.md.
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
    AVX512-BF16/AMX) is timed at a smaller n when n would take longer than ``budget_s``."""
    import torch
    import torch.nn.functional as F

    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(m: int) -> float:
        a = torch.randn(m, m, device=device).to(dtype)
        b = torch.randn(m, m, device=device).to(dtype)
        sync()
        t0 = time.perf_counter()
        F.linear(a, b)  # a @ b.T
        sync()
        return time.perf_counter() - t0

    m = 256
    t = once(m)
    while m < n and 8 * t < budget_s:  # doubling n costs 8x
        m *= 2
        t = once(m)
    best = min([t] + [once(m) for _ in range(3)])
    return dict(dtype=dtype_name, n=m, flops_per_s=2 * m ** 3 / best)


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


def run_extract(encoder, sentences, device: str, precision: str, cache_dir: str, tag: str):
    from probes.extract.stage import extract

    key = dict(encoder=encoder.name, fingerprint=encoder.fingerprint, dataset="ud_english_ewt", split=tag,
               precision=precision, device=device, n=len(sentences), nonce=uuid.uuid4().hex)
    return extract(encoder, sentences, key, cache_dir, make_trainer("gpu" if device == "cuda" else "cpu", precision))


def child(side: str, args: dict, precision: str | None, queue) -> None:
    """Runs in a fresh spawned process; puts one result dict on `queue`."""
    try:
        _quiet()
        import torch

        from probes.extract.precision import resolve_precision

        device = resolve_device(args["device"])
        sentences = load_words(args["split"], args["sentences"], args["data_dir"])
        encoder = load_bench_encoder(args["encoder"])
        encoder.model  # weights may load lazily on first access: load them before the clock starts
        res = dict(side=side, device=device, n_input=len(sentences), threads=torch.get_num_threads())
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        warm = sentences[:args.get("warmup", 0)]
        repeats, budget = max(1, args.get("repeats", 1)), args.get("budget_s", 0.0)

        def best_of(run) -> list[float]:
            """Wall times of up to `repeats` timed runs, stopping once `budget` seconds are spent."""
            walls = []
            while len(walls) < repeats and (not walls or sum(walls) < budget):
                walls.append(run())
            return walls

        if side == "plain":
            model = encoder.model.to(device)  # fp32 on either device
            plain_loop(model, encoder.tokenizer, warm, device, encoder.max_length)  # untimed warm-up
            out = {}

            def run() -> float:
                sync()
                t0 = time.perf_counter()
                out["r"] = plain_loop(model, encoder.tokenizer, sentences, device, encoder.max_length)
                sync()
                return time.perf_counter() - t0

            walls = best_of(run)
            n_sent, lengths, n_bytes, _ = out["r"]
            res.update(precision="32-true", wall_s=min(walls), walls_s=walls, sentences=n_sent, tokens=sum(lengths),
                       map_bytes=n_bytes, flops=sum(flops_per_sentence(encoder.config, T, False) for T in lengths),
                       cache_bytes=None)
        else:
            from probes.extract.precision import candidates
            from probes.model.inputs import encode_words

            with tempfile.TemporaryDirectory(prefix="extract-bench-") as tmp:
                if warm:  # untimed warm-up (auto: at its first candidate, so the timed run still chooses)
                    first = candidates(device)[0] if precision == "auto" else precision
                    run_extract(encoder, warm, device, first, tmp, args["split"] + "-warmup")
                out = {}

                def run() -> float:
                    store = tempfile.mkdtemp(dir=tmp)  # auto: an empty precision.json, as on a first run
                    t0 = time.perf_counter()
                    chosen = resolve_precision(precision, "gpu" if device == "cuda" else "cpu", encoder, sentences,
                                               cache_dir=store, margin=args["precision_margin"])
                    out["choose_s"] = time.perf_counter() - t0
                    out["cache"] = run_extract(encoder, sentences, device, chosen, tmp, args["split"])
                    out["chosen"] = chosen
                    return time.perf_counter() - t0

                walls = best_of(run)
                cache = out["cache"]
                m = cache.manifest
                lengths = [e.n_pieces for i, e in enumerate(encode_words(encoder.tokenizer, sentences)) if i in cache]
            res.update(precision=out["chosen"], requested=precision, choose_s=out["choose_s"], wall_s=min(walls),
                       walls_s=walls, sentences=m["n_sentences"] - len(m["skipped"]), tokens=int(m["n_pieces"]),
                       flops=sum(flops_per_sentence(encoder.config, T, True) for T in lengths),
                       cache_bytes=int(m["bytes"]), map_bytes=None)
        res["peak_rss_kib"] = peak_rss_kib()
        if device == "cuda":
            res["gpu_peak_alloc_bytes"] = int(torch.cuda.max_memory_allocated())
        queue.put(res)
    except BaseException as e:  # report, don't hang the parent
        import traceback

        queue.put(dict(side=side, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine since boot, CPU-seconds of this process and its waited-for
    children): their difference over an interval is what other processes used."""
    busy = 0.0
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        j = [int(x) for x in f]
        busy = (sum(j[:8]) - j[3] - j[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_child(side: str, args: dict, precision: str | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(side, args, precision, q))
    (busy0, ours0), t0 = cpu_seconds(), time.time()
    p.start()
    res = q.get()
    p.join()
    (busy1, ours1), wall = cpu_seconds(), time.time() - t0
    res["others_cpu_fraction"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (wall * (os.cpu_count() or 1))
    if "error" in res:
        sys.stderr.write(res["traceback"])
        raise SystemExit(f"{side} ({precision or 'fp32'}) failed: {res['error']}")
    return res


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

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(cpu=cpu_model(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_native_bf16=cpu_has_bf16(),
                gpu=gpu, python=platform.python_version(), loadavg_1min_at_start=os.getloadavg()[0])


def table(rows: list[dict], peaks: dict) -> str:
    base = rows[0]["tokens_per_s"]
    head = ["side", "precision", "tok/s", "x plain", "GFLOP/s", "of matmul peak", "wall s", "peak RSS MiB",
            "others' CPU"]
    body = []
    for r in rows:
        name = "plain HF loop" if r["side"] == "plain" else (
            f"extract auto -> {r['precision']}" if r.get("requested") == "auto" else "extract")
        peak = peaks.get(PEAK_DTYPE.get(r["precision"], ""))
        frac = f"{r['flops'] / r['wall_s'] / peak['flops_per_s']:.0%} ({peak['dtype']})" if peak else "-"
        body.append([name, r["precision"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base:.2f}",
                     f"{r['flops'] / r['wall_s'] / 1e9:.1f}", frac, f"{r['wall_s']:.1f}",
                     f"{r['peak_rss_kib'] / 1024:.0f}", f"{r['others_cpu_fraction']:.0%}"])
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * x for x in w]), *map(fmt, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm", help="minilm | bert-base-random | hub id | local folder")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--sentences", "--max-sentences", type=int, default=1000, dest="sentences",
                    help="first N sentences of the split (0: all; default 1000)")
    ap.add_argument("--warmup", type=int, default=100, help="untimed warm-up on the first N sentences in each child")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per side, the fastest reported (default 3; fewer once --budget is spent)")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timed runs per side before repeating stops")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", nargs="+", default=None,
                    help="extractor precisions, each a separate run (default: every explicit candidate of the "
                         "device - cpu: 32-true bf16-mixed; cuda: 16-mixed bf16-mixed 32-true - then auto)")
    ap.add_argument("--precision-margin", type=float, default=1.3,
                    help="auto: the speed-up over 32-true another precision needs (extract.precision_margin)")
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR") or str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=None, help="write results as JSON")
    ap.add_argument("--check", action="store_true",
                    help="also verify the first 50 sentences: 32-true cache vs pooled plain loop (<= 2e-3)")
    a = ap.parse_args(argv)

    import torch

    device = resolve_device(a.device)
    precisions = a.precision or (["16-mixed", *(["bf16-mixed"] if torch.cuda.is_bf16_supported() else []), "32-true"]
                                 if device == "cuda" else ["32-true", "bf16-mixed"]) + ["auto"]
    args = dict(encoder=a.encoder, split=a.split, sentences=a.sentences or None, device=a.device, data_dir=a.data_dir,
                warmup=a.warmup, repeats=a.repeats, budget_s=a.budget, precision_margin=a.precision_margin)
    info = machine()
    print(f"machine: CPU {info['cpu']} ({info['cores']} logical CPUs, torch threads {info['torch_threads']}, "
          f"{info['cpu_capability']}, native bf16: {'yes' if info['cpu_native_bf16'] else 'no'}), "
          f"GPU: {info['gpu'] or 'none'}, torch {info['torch']}; load average {info['loadavg_1min_at_start']:.2f}")
    print(f"encoder: {a.encoder}; data: UD EWT {a.split}" + (f", first {a.sentences} sentences" if a.sentences else "")
          + f"; device {device}; plain loop: fp32, one sentence at a time; each side: untimed warm-up on the first "
          f"{a.warmup} sentences, then the fastest of up to {a.repeats} timed runs (no new run after {a.budget:g} s)",
          flush=True)

    peaks = {}
    for dt in (["fp32", "fp16", "bf16"] if device == "cuda" else ["fp32", "bf16"]):
        peaks[dt] = matmul_peak(device, dt)
    print("matmul peak (best of 3, after warm-up): " + ", ".join(
        f"{p['dtype']} {p['flops_per_s'] / 1e9:.1f} GFLOP/s ({p['n']}x{p['n']})" for p in peaks.values()), flush=True)

    rows = [run_child("plain", args)]
    print(f"  plain loop done: {', '.join(f'{w:.1f}' for w in rows[0]['walls_s'])} s", flush=True)
    for p in precisions:
        rows.append(run_child("extract", args, p))
        extra = f" (chose {rows[-1]['precision']} in {rows[-1]['choose_s']:.1f} s)" if p == "auto" else ""
        print(f"  extract({p}) done: {', '.join(f'{w:.1f}' for w in rows[-1]['walls_s'])} s{extra}", flush=True)
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["ratio_tokens_per_s_vs_plain"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        peak = peaks.get(PEAK_DTYPE.get(r["precision"], ""))
        r["fraction_of_matmul_peak"] = r["flops"] / r["wall_s"] / peak["flops_per_s"] if peak else None
    print()
    print(table(rows, peaks))
    others = max(r["others_cpu_fraction"] for r in rows)
    print(f"({rows[0]['sentences']} sentences, {rows[0]['tokens']} wordpieces incl. specials. GFLOP/s: useful FLOPs "
          f"only (no padding; the extractor's without the last layer's output projection and feed-forward block). "
          f"others' CPU: share of the machine's CPU time other processes used while that side ran"
          + (f"; up to {others:.0%}: these timings are slowed by them, the one-sentence loop most" if others > 0.1
             else "") + ")")
    result = dict(machine=info, encoder=a.encoder, split=a.split, sentences=a.sentences, matmul_peak=peaks, rows=rows)

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
