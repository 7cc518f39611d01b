"""Benchmark: extraction cost of every map kind relative to attention, same sentences, one run.

    python bench/measure_cost.py [--encoder minilm|<hub id or path>] [--split dev] [--sentences N]
        [--max-pieces 32] [--kinds attention rollout ...] [--repeats 2] [--device auto|cpu|cuda] [--out f.json]

The sentences: the first ``--sentences`` of the split (file order) with at most ``--max-pieces`` wordpieces
(flow's bound, so every kind runs on the same sentences). Each kind (``conf/extract/default.yaml``,
``measures``) runs the extractor's own step (``probes.maps.MapEngine.word_maps``: the measure on padded
length batches, then word pooling to float16) over all of them, in fp32 under inference mode, after an
untimed warm-up on one sentence; the best of ``--repeats`` passes is kept. Timed: forwards, the measure, pooling.
Not timed: tokenization, batching, model loading. Two clocks: wall time and the process's CPU time
(``time.process_time``, all its threads). On a machine shared with other jobs the wall time depends on
the contention each kind happened to meet; the CPU time much less so (run with one thread,
``OMP_NUM_THREADS=1``, to compare like with like). Prints both, sentences/s and both ratios to
``attention`` side by side, and the load average before and after; ``--out`` writes the same as JSON.
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
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


def load(encoder_spec: str, split: str, data_dir: str):
    """(encoder, sentences as word lists, extract config as a dict) from the project's conf/."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    enc_over = ["encoder=minilm"] if encoder_spec == "minilm" else ["encoder=auto", f"encoder.name_or_path={encoder_spec}"]
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("analyze", overrides=[*enc_over, f"paths.data_dir={data_dir}", "paths.cache_dir=/tmp"])
    words = [list(s.words) for s in instantiate(cfg.data.treebank).read(split)]
    return instantiate(cfg.encoder), words, OmegaConf.to_container(cfg.extract, resolve=True)


def time_kind(extractor, batches, warm, repeats: int) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) of ``repeats`` passes over ``batches`` after a warm-up."""
    import torch

    with torch.inference_mode():
        extractor.word_maps(warm)  # warm-up: one sentence
        wall = cpu = float("inf")
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            for b in batches:
                extractor.word_maps(b)
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def load_average() -> list[float]:
    """1-, 5- and 15-minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--sentences", type=int, default=100)
    ap.add_argument("--max-pieces", type=int, default=32)
    ap.add_argument("--kinds", nargs="+", default=None, help="default: every kind in conf/extract/default.yaml")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR") or str(DEFAULT_DATA_DIR))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from probes.maps import MapEngine, encode_all, make_batch, pad_id_of, split_by_pairs
    from probes.measures import build
    from probes.model.inputs import length_batches

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    enc, words, xcfg = load(args.encoder, args.split, args.data_dir)
    encoded = encode_all(enc.tokenizer, words)
    keep = [i for i, e in enumerate(encoded) if e.n_pieces <= args.max_pieces][:args.sentences]
    items = [encoded[i] for i in keep]
    lengths = [e.n_pieces for e in items]
    groups = split_by_pairs(length_batches(lengths, xcfg["max_tokens"], xcfg["max_batch_size"]), lengths,
                            xcfg["max_pairs"])
    pad = pad_id_of(enc.tokenizer)
    batches = [{k: v.to(device) for k, v in make_batch([items[i] for i in g], g, xcfg["from_words"],
                                                       xcfg["to_words"], pad).items()} for g in groups]
    warm = {k: v.to(device) for k, v in make_batch(items[:1], [0], xcfg["from_words"], xcfg["to_words"], pad).items()}
    model = enc.model.to(device).eval()
    kinds = args.kinds or list(xcfg["measures"])
    results = {}
    load_before = load_average()
    for kind in kinds:
        measure = build(kind, xcfg["measures"])
        ex = MapEngine(model, measure)
        sec, cpu = time_kind(ex, batches, warm, args.repeats)
        results[kind] = dict(seconds=sec, cpu_seconds=cpu, sentences_per_s=len(items) / sec, load=load_average())
        print(f"{kind:>18}: {sec:8.2f} s wall  {cpu:8.2f} s CPU  {len(items) / sec:8.2f} sent/s  "
              f"load {results[kind]['load']}", flush=True)
    base = results.get("attention", {}).get("seconds")
    base_cpu = results.get("attention", {}).get("cpu_seconds")
    n_pieces = sum(lengths)
    print(f"\n{enc.name}, {args.split}: first {len(items)} sentences with <= {args.max_pieces} pieces "
          f"({n_pieces} pieces, mean {n_pieces / max(len(items), 1):.1f}); {device}, fp32, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"load average {load_before} before, {load_average()} after")
    print(f"{'kind':>18} | {'wall s':>8} | {'CPU s':>8} | {'sent/s':>8} | {'x attn (wall)':>13} | {'x attn (CPU)':>12}")
    for kind, r in results.items():
        r["ratio_to_attention"] = r["seconds"] / base if base else float("nan")
        r["cpu_ratio_to_attention"] = r["cpu_seconds"] / base_cpu if base_cpu else float("nan")
        print(f"{kind:>18} | {r['seconds']:8.2f} | {r['cpu_seconds']:8.2f} | {r['sentences_per_s']:8.2f} | "
              f"{r['ratio_to_attention']:13.1f} | {r['cpu_ratio_to_attention']:12.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(encoder=enc.name, split=args.split, n_sentences=len(items),
                                                  n_pieces=n_pieces, max_pieces=args.max_pieces, device=device,
                                                  threads=torch.get_num_threads(), load_before=load_before,
                                                  load_after=load_average(), results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
