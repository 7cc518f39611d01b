"""Benchmark: memory and maps of a model's weights in float32, bfloat16 and float16 (``encoder.dtype``).

    python bench/weights_dtype.py [--encoder qwen2_5_coder_1_5b] [--sentences 20] [--split dev]
        [--dtypes float32 bfloat16 float16] [--threads N] [--out f.json]

For each dtype a fresh process (``python bench/weights_dtype.py --child DTYPE``) loads the encoder
(``conf/encoder/<encoder>.yaml`` with ``encoder.dtype=DTYPE``) and computes the attention word maps of the first
``--sentences`` sentences of UD EWT ``--split`` (``probes.word_maps``, ``extract.precision=32-true``: the forward
computes in the weights' dtype). Reported per dtype: the seconds to load and to compute the maps, the process's
resident memory after loading, its high-water mark (``ru_maxrss``) after loading and after the maps, and the
largest and mean absolute difference of its word maps from the float32 ones (every layer, head, row and column of
every sentence). A dtype whose process fails is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from probes.memory import AnonPeak  # noqa: E402
from probes.machine import cpu_description  # noqa: E402

DEFAULT_DATA_DIR = os.environ.get("PROBES_DATA_DIR") or str(REPO_ROOT.parent / "shared" / "data")


def rss_mib() -> float:
    """The process's resident memory now (``/proc/self/statm``), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    """The process's resident high-water mark (``ru_maxrss``, KiB on Linux), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> None:
    """Load the encoder in ``args.child``, compute the word maps, save them to ``args.maps`` and print one JSON line."""
    import numpy as np
    import torch
    from hydra.utils import instantiate

    import probes
    from probes.config import compose

    if args.threads:
        torch.set_num_threads(args.threads)
    words = [s.words for s in probes.read_conllu(Path(args.data_dir) / "ud_english_ewt" /
                                                 f"en_ewt-ud-{args.split}.conllu")][:args.sentences]
    anon = AnonPeak()
    t0 = time.perf_counter()
    enc = instantiate(compose("analyze", [f"encoder={args.encoder}", f"++encoder.dtype={args.child}"]).encoder)
    model = enc.model  # the weights load here
    load_s = time.perf_counter() - t0
    out = dict(dtype=args.child, weights=str(next(model.parameters()).dtype), load_s=load_s, rss_loaded_mib=rss_mib(),
               peak_loaded_mib=peak_mib(), anon_peak_loaded_mib=anon.read())
    t0 = time.perf_counter()
    maps = probes.word_maps(enc, words, device="cpu", overrides=["extract.precision=32-true"], progress=False)
    out.update(maps_s=time.perf_counter() - t0, peak_mib=peak_mib(), anon_peak_mib=anon.read(), sentences=len(words),
               threads=torch.get_num_threads())
    np.savez(args.maps, *[m.maps for m in maps])
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="qwen2_5_coder_1_5b")
    p.add_argument("--sentences", type=int, default=20)
    p.add_argument("--split", default="dev")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--maps", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    import numpy as np

    rows = []
    with tempfile.TemporaryDirectory(prefix="weights-dtype-") as tmp:
        for dtype in args.dtypes:
            maps = Path(tmp) / f"{dtype}.npz"
            cmd = [sys.executable, __file__, "--child", dtype, "--maps", str(maps), "--encoder", args.encoder,
                   "--sentences", str(args.sentences), "--split", args.split, "--threads", str(args.threads),
                   "--data-dir", args.data_dir]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                rows.append(dict(dtype=dtype, error=(done.stderr.strip().splitlines() or ["?"])[-1]))
                continue
            row = json.loads(line[len("RESULT "):])
            row["maps"] = str(maps)
            rows.append(row)
        ref = next((r for r in rows if r["dtype"] == "float32" and "error" not in r), None)
        base = None if ref is None else np.load(ref["maps"])
        for r in rows:
            if "error" in r or base is None:
                continue
            m = np.load(r.pop("maps"))
            diffs = [np.abs(m[k].astype(np.float64) - base[k].astype(np.float64)) for k in base.files]
            r["max_abs_diff"] = float(max(d.max() for d in diffs))
            r["mean_abs_diff"] = float(sum(d.sum() for d in diffs) / sum(d.size for d in diffs))
            r["share_over_0.05"] = float(sum((d > 0.05).sum() for d in diffs) / sum(d.size for d in diffs))
        for r in rows:
            r.pop("maps", None)

    load = os.getloadavg()
    print(f"encoder={args.encoder}, attention word maps of the first {args.sentences} UD EWT {args.split} sentences "
          f"(extract.precision=32-true); CPU: {cpu_description()}, {os.cpu_count()} logical CPUs, load average "
          f"{load[0]:.1f}")
    head = (f"{'weights':<9} {'load s':>7} {'maps s':>7} {'RSS loaded MiB':>15} {'peak loading MiB':>17} "
            f"{'peak MiB':>9} {'anon peak MiB':>14} {'max |diff|':>11} {'mean |diff|':>12} {'|diff|>0.05':>12}")
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['dtype']:<9} failed: {r['error']}")
            continue
        print(f"{r['dtype']:<9} {r['load_s']:7.1f} {r['maps_s']:7.1f} {r['rss_loaded_mib']:15,.0f} "
              f"{r['peak_loaded_mib']:17,.0f} {r['peak_mib']:9,.0f} {r['anon_peak_mib']:14,.0f} "
              f"{r.get('max_abs_diff', float('nan')):11.2e} {r.get('mean_abs_diff', float('nan')):12.2e} "
              f"{r.get('share_over_0.05', float('nan')):12.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(encoder=args.encoder, cpu=cpu_description(), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
