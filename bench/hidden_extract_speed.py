"""Benchmark: hidden-state extraction (``probes.extract.representations``) on the stage's own loop against
Lightning's predict loop, same sentences, one run.

    python bench/hidden_extract_speed.py [--encoder minilm|bert-base-random|<folder>] [--sentences 1000]
        [--threads 1] [--rounds 3] [--repeats 5] [--loop own lightning] [--data-dir DIR] [--out results.json]

Each loop runs in its own spawned process: the encoder loaded and warmed up on the first ``--warmup`` sentences
(untimed), then ``--rounds`` timed extractions of every layer's word states (mean pooling, 32-true; each run
tokenizes, the kept tokenization dropped first), the best wall time reported as tokens/s with the process's CPU
seconds and its peak RSS. Then the host's work outside the forward, measured directly: the word states of every
batch are recorded once, and ``--repeats`` extractions replay them instead of running the model (tokenizing, and
with the split's tokenization reused as a later extraction of the same split in the process does), the least
process CPU time per 1,000 sentences reported. The CPU is named beside the numbers. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))


def child(loop: str, args: dict, queue) -> None:
    """One loop's measurements in this (spawned) process, put on ``queue``."""
    warnings.filterwarnings("ignore")
    import logging

    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "transformers", "probes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch

    from extract_speed import load_bench_encoder, load_words, make_trainer
    from probes.extract import representations as R
    from probes.extract.stage import forget_splits

    torch.set_num_threads(args["threads"])
    words = load_words(args["split"], args["sentences"], args["data_dir"])
    enc = load_bench_encoder(args["encoder"])
    tmp = tempfile.mkdtemp(prefix="hidden-bench-")
    layers = list(range(enc.num_layers + 1))

    def run(sents, tag):
        key = dict(encoder=enc.name, dataset="ewt", split=tag, layers=layers, pooling="mean", nonce=uuid.uuid4().hex)
        return R.extract_hidden(enc, sents, key, tmp, make_trainer("cpu", "32-true"), loop=loop)

    shutil.rmtree(run(words[:args["warmup"]], "warm").path)
    walls, cpus = [], []
    manifest = None
    for _ in range(args["rounds"]):
        forget_splits()
        c0, t0 = time.process_time(), time.perf_counter()
        c = run(words, "timed")
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        manifest = c.manifest
        shutil.rmtree(c.path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    recorded, compute = {}, R.HiddenExtractor.word_states

    def record(self, batch):
        out = compute(self, batch)
        recorded[tuple(batch["index"].tolist())] = out.clone()
        return out

    def replay(self, batch):
        return recorded[tuple(batch["index"].tolist())]

    R.HiddenExtractor.word_states = record
    shutil.rmtree(run(words, "record").path)
    R.HiddenExtractor.word_states = replay
    host = {}
    try:
        for reuse in (False, True):
            best = []
            for _ in range(args["repeats"]):
                if not reuse:
                    forget_splits()
                c0 = time.process_time()
                c = run(words, "host")
                best.append(time.process_time() - c0)
                shutil.rmtree(c.path)
            host["tokenization_reused" if reuse else "tokenizing"] = min(best)
    finally:
        R.HiddenExtractor.word_states = compute
        shutil.rmtree(tmp, ignore_errors=True)
    kept = manifest["n_sentences"] - len(manifest["skipped"])
    queue.put(dict(loop=loop, sentences=kept, tokens=manifest["n_pieces"], entry_bytes=manifest.get("bytes"),
                   wall_s=walls, cpu_s=cpus, tokens_per_s=manifest["n_pieces"] / min(walls), peak_rss_mib=round(peak, 1),
                   host_cpu_s_per_1000={k: round(v * 1000 / kept, 3) for k, v in host.items()}))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loop", nargs="+", default=["own", "lightning"], choices=["auto", "own", "lightning"])
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR", str(REPO_ROOT.parent / "shared/data")))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from probes.machine import cpu_description

    print(f"{cpu_description()}; {a.threads} thread(s); {a.encoder}; {a.sentences} sentences of UD EWT {a.split}; "
          f"every layer's word states, mean pooling, 32-true", flush=True)
    ctx = mp.get_context("spawn")
    out = []
    for loop in a.loop:
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(loop, vars(a), q))
        p.start()
        r = q.get()
        p.join()
        out.append(r)
        h = r["host_cpu_s_per_1000"]
        print(f"{loop}: {r['tokens_per_s']:,.0f} tok/s (best of {a.rounds}; CPU-s {min(r['cpu_s']):.2f}), peak RSS "
              f"{r['peak_rss_mib']:,.0f} MiB; host CPU-s per 1,000 sentences outside the forward "
              f"{h['tokenizing']} (tokenizing), {h['tokenization_reused']} (tokenization reused)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(machine=cpu_description(), threads=a.threads, encoder=a.encoder,
                                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), runs=out),
                                          indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
