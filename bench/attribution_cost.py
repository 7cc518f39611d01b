"""Benchmark: cost per sentence of the head-output attributions (``analysis=attribution``), old path vs new.

    python bench/attribution_cost.py [--encoder minilm|<hub id or path>] [--split dev] [--pieces 20]
        [--sentences 1] [--methods ixg ig hta] [--ig-steps 20] [--chunk-size 1024] [--old-chunk-size 256]
        [--threads N] [--out f.json]

Sentences: the first ``--sentences`` of the split (file order) with exactly ``--pieces`` wordpieces
([CLS]/[SEP] included). For each sentence and method, in one run and interleaved (old, then new, on the
same sentence), both paths compute all ``L * H * T`` head-output attribution distributions:

* *old*: ``tests.reference.head_attributions_stepwise`` - the code before the IG points were batched: per
  layer and per IG step one forward of the truncated model on one point, one ``vjp`` and ``vmap`` over
  the ``H * T`` targets in chunks of ``--old-chunk-size`` (the old default 256);
* *new*: ``probes.measures.gradflow.head_attributions`` / ``hta_attributions`` - the IG points one batch
  dimension of the forward and of every backward, ``--chunk-size`` (targets x points) backward passes per batch.

Timed: everything from the word embeddings to the (L, H, T, T) distributions. Two clocks: wall and the
process's CPU time (all threads); on a shared machine the CPU time is the steadier one. Also printed: the
estimated GFLOPs (``head_attribution_gflops``) and the rate they imply, the max abs difference between the
two paths (they must agree to float rounding), the load average and the measured matmul rate of the
backward's largest product ((4800, 384) x (384, 1536), ``F.linear``) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.measure_cost import DEFAULT_DATA_DIR, load, load_average  # noqa: E402


def matmul_gflops() -> float:
    """Measured fp32 GFLOP/s of ``F.linear((4800, 384), (1536, 384))`` (best of 5 after a warm-up)."""
    import torch

    x, w = torch.randn(4800, 384), torch.randn(1536, 384)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4800 * 384 * 1536 / best / 1e9


def timed(fn):
    """(result, wall seconds, CPU seconds) of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--pieces", type=int, default=20)
    ap.add_argument("--sentences", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["ixg", "ig", "hta"], choices=["ixg", "ig", "hta"])
    ap.add_argument("--ig-steps", type=int, default=20)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--old-chunk-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR") or str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from probes.measures.gradflow import head_attribution_gflops, head_attributions, hta_attributions
    from probes.model.inputs import encode_words
    from tests.reference import head_attributions_stepwise

    if args.threads:
        torch.set_num_threads(args.threads)
    enc, words, _ = load(args.encoder, args.split, args.data_dir)
    model = enc.model.eval()
    ids_all = []
    for start in range(0, len(words), 200):  # encode in slices until enough sentences of the length are found
        for e in encode_words(enc.tokenizer, words[start:start + 200]):
            if e.n_pieces == args.pieces:
                ids_all.append(torch.tensor(e.input_ids))
        if len(ids_all) >= args.sentences:
            break
    ids_all = ids_all[:args.sentences]
    if not ids_all:
        raise SystemExit(f"no {args.split} sentence with {args.pieces} pieces")
    L = int(model.config.num_hidden_layers)
    load_before, mm_before = load_average(), matmul_gflops()
    rows = []
    for m in args.methods:
        pts = args.ig_steps if m == "ig" else 1
        gflop = sum(head_attribution_gflops(model, args.pieces, l, pts) for l in range(L))
        r = dict(method=m, gflop=gflop, old_s=0.0, old_cpu=0.0, new_s=0.0, new_cpu=0.0, max_abs_diff=0.0)
        for ids in ids_all:
            old, s, c = timed(lambda: head_attributions_stepwise(model, ids, m, args.ig_steps, args.old_chunk_size))
            r["old_s"], r["old_cpu"] = r["old_s"] + s, r["old_cpu"] + c
            if m == "hta":
                new, s, c = timed(lambda: hta_attributions(model, ids, args.chunk_size))
            else:
                new, s, c = timed(lambda: head_attributions(model, ids, m, args.ig_steps, args.chunk_size))
            r["new_s"], r["new_cpu"] = r["new_s"] + s, r["new_cpu"] + c
            r["max_abs_diff"] = max(r["max_abs_diff"], float((old - new).abs().max()))
            print(f"  {m}: old {r['old_s']:.1f} s, new {r['new_s']:.1f} s (so far), load {load_average()}", flush=True)
        n = len(ids_all)
        for k in ("old_s", "old_cpu", "new_s", "new_cpu"):
            r[k] /= n
        rows.append(r)
    info = (f"{enc.name}, {args.split}: {len(ids_all)} sentence(s) of {args.pieces} pieces; cpu, fp32, "
            f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; load average "
            f"{load_before} before, {load_average()} after; matmul {mm_before:.0f} GFLOP/s before, "
            f"{matmul_gflops():.0f} after")
    print("\n" + info)
    print(f"{'method':>6} | {'GFLOP':>6} | {'old s/sent':>10} | {'new s/sent':>10} | {'x faster':>8} | "
          f"{'old CPU s':>9} | {'new CPU s':>9} | {'x (CPU)':>7} | {'new GFLOP/s':>11} | {'max |diff|':>10}")
    for r in rows:
        r["speedup"], r["cpu_speedup"] = r["old_s"] / r["new_s"], r["old_cpu"] / r["new_cpu"]
        m = r["method"] + (f"{args.ig_steps}" if r["method"] == "ig" else "")
        print(f"{m:>6} | {r['gflop']:6.0f} | {r['old_s']:10.1f} | {r['new_s']:10.1f} | {r['speedup']:8.2f} | "
              f"{r['old_cpu']:9.1f} | {r['new_cpu']:9.1f} | {r['cpu_speedup']:7.2f} | "
              f"{r['gflop'] / r['new_s']:11.1f} | {r['max_abs_diff']:10.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(info=info, args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
