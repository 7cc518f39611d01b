"""Benchmark: the project's attention extractor vs a plain Hugging Face loop, same sentences, one run.

    python bench/extract_speed.py [--encoder minilm|bert-base-random|<hub id or path>] [--split dev]
        [--max-sentences N] [--device auto|cpu|cuda] [--precision auto 32-true ...] [--out results.json]
        [--check]

Each side runs in its own fresh child process ("spawn"), so peak RSS is per side. Timed: tokenization,
forward passes, pooling and writing (for the extractor: the whole `extract` call, Trainer setup
included). Not timed: imports, model loading, data reading. See bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


# ----------------------------------------------------------------------------- loading (not timed)

def load_words(split: str, max_sentences: int | None, data_dir: str) -> list[list[str]]:
    from probes.data.sources import load_treebank

    sents = load_treebank("ewt", data_dir).read(split)
    words = [list(s.words) for s in sents]
    return words[:max_sentences] if max_sentences else words


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
    import pytorch_lightning  # noqa: F401  (it sets its loggers' levels on import)
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# ----------------------------------------------------------------------------- the two sides

def plain_loop(model, tokenizer, sentences, device: str, max_length: int, keep_fp32: bool = False):
    """One sentence at a time through the model; every layer's map copied to numpy (fp16).

    Returns (n_sentences, n_tokens, map_bytes, maps) where maps holds fp32 (L, H, T, T) arrays only
    when keep_fp32 (for --check).
    """
    import numpy as np
    import torch

    n_sent = n_tok = n_bytes = 0
    kept = []
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
            n_sent += 1
            n_tok += T
    return n_sent, n_tok, n_bytes, kept


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

        device = resolve_device(args["device"])
        sentences = load_words(args["split"], args["max_sentences"], args["data_dir"])
        encoder = load_bench_encoder(args["encoder"])
        encoder.model  # weights may load lazily on first access: load them before the clock starts
        res = dict(side=side, device=device, n_input=len(sentences))
        if side == "plain":
            model = encoder.model.to(device)  # fp32 on either device
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            n_sent, n_tok, n_bytes, _ = plain_loop(model, encoder.tokenizer, sentences, device, encoder.max_length)
            sync()
            wall = time.perf_counter() - t0
            res.update(precision="32-true", wall_s=wall, sentences=n_sent, tokens=n_tok, map_bytes=n_bytes,
                       cache_bytes=None)
        else:
            with tempfile.TemporaryDirectory(prefix="extract-bench-") as tmp:
                t0 = time.perf_counter()
                cache = run_extract(encoder, sentences, device, precision, tmp, args["split"])
                wall = time.perf_counter() - t0
                m = cache.manifest
                res.update(precision=precision, wall_s=wall, sentences=m["n_sentences"] - len(m["skipped"]),
                           tokens=int(m["n_pieces"]), cache_bytes=int(m["bytes"]), map_bytes=None)
        res["peak_rss_kib"] = peak_rss_kib()
        if device == "cuda":
            res["gpu_peak_alloc_bytes"] = int(torch.cuda.max_memory_allocated())
        queue.put(res)
    except BaseException as e:  # report, don't hang the parent
        import traceback

        queue.put(dict(side=side, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))


def run_child(side: str, args: dict, precision: str | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(side, args, precision, q))
    p.start()
    res = q.get()
    p.join()
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

def machine() -> dict:
    import torch

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                gpu=gpu, python=platform.python_version(), loadavg_1min_at_start=os.getloadavg()[0])


def table(rows: list[dict]) -> str:
    base = rows[0]["tokens_per_s"]
    head = ["side", "precision", "device", "sent/s", "tok/s", "x plain", "peak RSS MiB", "cache MiB"]
    body = []
    for r in rows:
        body.append([
            "plain HF loop" if r["side"] == "plain" else "extract()",
            r["precision"], r["device"], f"{r['sentences_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base:.2f}", f"{r['peak_rss_kib'] / 1024:.0f}",
            "-" if r["cache_bytes"] is None else f"{r['cache_bytes'] / 2**20:.1f}",
        ])
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([fmt(head), fmt(["-" * x for x in w]), *map(fmt, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm", help="minilm | bert-base-random | hub id | local folder")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--max-sentences", type=int, default=None, help="first N sentences (default: all)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", nargs="+", default=["auto", "32-true"],
                    help="extractor precisions, each a separate run (auto -> resolve_precision)")
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR") or str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=None, help="write results as JSON")
    ap.add_argument("--check", action="store_true",
                    help="also verify the first 50 sentences: 32-true cache vs pooled plain loop (<= 2e-3)")
    a = ap.parse_args(argv)

    from probes.extract.stage import resolve_precision

    device = resolve_device(a.device)
    precisions = list(dict.fromkeys(resolve_precision(p, "gpu" if device == "cuda" else "cpu") for p in a.precision))
    args = dict(encoder=a.encoder, split=a.split, max_sentences=a.max_sentences, device=a.device,
                data_dir=a.data_dir)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores (torch threads {info['torch_threads']}), "
          f"torch {info['torch']}, GPU: {info['gpu'] or 'none'}; load average {info['loadavg_1min_at_start']:.2f}")
    print(f"encoder: {a.encoder}; data: UD EWT {a.split}"
          + (f", first {a.max_sentences} sentences" if a.max_sentences else "")
          + f"; extractor precisions: {', '.join(precisions)}"
          + ("; plain loop: model on GPU in fp32" if device == "cuda" else "; plain loop: fp32"), flush=True)

    rows = [run_child("plain", args)]
    print(f"  plain loop done: {rows[0]['wall_s']:.1f} s", flush=True)
    for p in precisions:
        rows.append(run_child("extract", args, p))
        print(f"  extract({p}) done: {rows[-1]['wall_s']:.1f} s", flush=True)
    for r in rows:
        r["sentences_per_s"] = r["sentences"] / r["wall_s"]
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["ratio_tokens_per_s_vs_plain"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    print()
    print(table(rows))
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1) + 1:
        print(f"note: 1-min load average {load:.2f} at the end; other processes may have slowed these timings")
    print(f"({rows[0]['sentences']} sentences, {rows[0]['tokens']} wordpieces incl. [CLS]/[SEP]; "
          f"the plain loop made {rows[0]['map_bytes'] / 2**20:.1f} MiB of wordpiece-level fp16 maps, not written)")
    result = dict(machine=info, encoder=a.encoder, split=a.split, max_sentences=a.max_sentences, rows=rows)

    if a.check:
        c = check(args, precisions)
        result["check"] = c
        print(f"\ncheck ({c['n_sentences']} sentences): 32-true cache vs word-pooled plain loop: "
              f"max |diff| = {c['fp32_cache_vs_plain_max_abs']:.2e} "
              f"({'OK' if c['fp32_ok'] else 'FAIL'}, tolerance 2e-3)"
              + (f", {c['tokenization_mismatches']} sentences tokenized differently (skipped)"
                 if c["tokenization_mismatches"] else ""))
        for p in precisions:
            if p != "32-true":
                print(f"check: {p} cache vs 32-true cache: max |diff| = {c[f'{p}_vs_fp32_max_abs']:.2e}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0 if not a.check or result["check"]["fp32_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
