"""Benchmark: attention of one long text, every layer pooled to its sentences plus the head statistics, by whole
maps and by blocks of query rows (issue 42), side by side at each length, in one run.

    python bench/long_context.py [--encoder gemma3_270m] [--lengths 2048 16384] [--paths bare full whole blocks]
        [--layers all] [--budget-mb 1024 [64 ...]] [--device cpu|cuda] [--threads N] [--data-dir DIR] [--out f.json]
    python bench/long_context.py --encoder qwen2_5_coder_1_5b --lengths 32768 --prepare DIR  # ids and config only
    python bench/long_context.py --inputs DIR --random-init --device cuda --paths bare blocks # where no weights go

The text: whole documents of UD GUM train (``--source gum``; or ``ewt``: UD EWT train), in file order, as one
running text cut after the last whole sentence that keeps it within the length (the model's own tokenizer, its
specials included), built as ``analysis=long_context`` builds it (:func:`probes.data.documents.read_conllu_documents`,
:func:`~probes.data.documents.running_text`: each sentence's words joined by single spaces). Units: the text's sentences (the first special goes
with the first sentence, a last special with the last); punctuation: the ``.`` and ``,`` pieces; separator: the last
piece (:class:`probes.maps.reducers.HeadStats`' default).

Paths, each in its own fresh process (so that each peak is its own), the model loaded and warmed up on the text's
first 64 pieces before the clock starts:

* ``bare``: the model's forward alone (transformers' ``sdpa`` attention, no maps): the time per piece to compare with.
* ``full``: the whole-map path as the analyses use it until now: every layer's (H, T, T) maps kept
  (``MapEngine.iter_piece_maps``), then pooled to sentences (``pool_layers``) and
  :func:`probes.analysis.clark.metrics.sentence_head_stats`. Skipped, with the reason, when its maps cannot fit.
* ``whole``: the map engine's whole-map path with reducers: one layer's whole (H, T, T) map at a time, handed to
  :class:`~probes.maps.reducers.Pool` (sentences) and :class:`~probes.maps.reducers.HeadStats` as one block.
* ``blocks``: the map engine in blocks of query rows sized to ``--budget-mb`` (``extract.attention_budget_mb``; one
  run per value), the same reducers block by block: no whole map, no whole mask.

Reported per length and path: seconds (the maps only; loading, reading the text and the warm-up not timed), ms per
piece, the process's resident high-water mark (``ru_maxrss``, model loading included) and the high-water mark of its
own anonymous memory, peak GPU memory on CUDA (``torch.cuda.max_memory_allocated``), and the largest difference of
its sentence maps and statistics from the other paths'. ``--prepare DIR`` writes the texts' ids and units and the
model's config (no weights, no tokenizer) so that ``--inputs DIR --random-init`` runs on a machine without the
weights or the data (a randomly initialised model of the same shape; times and memory are the shape's).
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
SOURCES = {"gum": "ud_english_gum/en_gum-ud-train.conllu", "ewt": "ud_english_ewt/en_ewt-ud-train.conllu"}
PATHS = ("bare", "full", "whole", "blocks")
WARMUP = 64  # pieces of the warm-up forward
GIB = 2 ** 30
SAFE = 0.75  # a path runs only where its maps need at most this share of the memory available (a shared machine)


def peak_rss_gib() -> float:
    """The process's resident high-water mark (``ru_maxrss``, KiB on Linux), GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


# ----------------------------------------------------------------------------- the text
def make_text(tokenizer, docs, length: int) -> dict:
    """One running text of whole documents within ``length`` pieces, built as ``analysis=long_context`` builds it
    (:func:`probes.data.documents.running_text`, :func:`~probes.data.documents.encode_document`): ids, word of every
    piece, the sentence of every piece, punctuation flags."""
    from probes.data.documents import encode_document, running_text

    doc = running_text(tokenizer, docs, length)
    de = encode_document(tokenizer, doc)
    e = de.encoded
    return dict(ids=e.input_ids, word_of_piece=e.word_of_piece, n_words=e.n_words, sentence=de.sentence_of_piece,
                n_sentences=doc.n_sentences, punct=de.punct, n_pieces=de.n_pieces)


# ----------------------------------------------------------------------------- one measurement (child process)
def load_model(args):
    """The encoder: a conf/encoder name (real weights) or a folder; random weights of its shape with
    ``--random-init`` (from ``--inputs``: the config alone)."""
    from hydra.utils import instantiate

    from probes.config import compose
    from probes.model.load import load_encoder

    if args.inputs:
        shape = Path(args.inputs) / "shape"
        return load_encoder(str(shape), random_init=True, seed=0) if args.random_init else None
    cfg = compose("analyze", [f"encoder={args.encoder}"] + (["encoder.random_init=true"] if args.random_init else []))
    return instantiate(cfg.encoder)


def sentence_matrix(unit: list[int], S: int, mode: str):
    """(1, S, T) pooling matrix of the sentences: ``mean`` rows, ``sum`` columns."""
    import torch

    m = torch.zeros(1, S, len(unit))
    m[0, torch.tensor(unit), torch.arange(len(unit))] = 1.0
    return m / m.sum(-1, keepdim=True).clamp(min=1) if mode == "mean" else m


def child(args) -> None:
    import numpy as np
    import torch

    from probes.analysis.clark.metrics import sentence_head_stats
    from probes.maps import MapEngine, pool_layers
    from probes.maps.engine import available_bytes
    from probes.maps.reducers import HeadStats, Pool, Several, given_units
    from probes.measures.attention import Attention
    from probes.model.inputs import Encoded

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    text = json.loads(Path(args.text).read_text())
    anon = AnonPeak()
    enc = load_model(args)  # the weights load at enc.model, after the check below
    L, H, T = enc.num_layers, enc.num_heads, text["n_pieces"]
    layers = list(range(L)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    e = Encoded(text["ids"], text["word_of_piece"], text["n_words"])
    warm = Encoded(text["ids"][:WARMUP], text["word_of_piece"][:WARMUP], text["n_words"])
    out = dict(path=args.child, pieces=T, layers=len(layers), heads=H, threads=torch.get_num_threads(),
               device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    free = available_bytes(device)
    # the maps and their copies at once (full: measured 13.7 GiB peak for 4.5 GiB of maps, SmolLM2 at 2,034 pieces)
    need = {"full": 3 * len(layers) * H * T * T * 4, "whole": 8 * H * T * T * 4}.get(args.child, 0)
    if need > SAFE * free:
        which = "all layers" if args.child == "full" else "one layer"
        out["skipped"] = (f"needs about {need / GIB:,.1f} GiB of maps ({which} x {H} heads x {T}^2 float32 and their "
                          f"copies); {free / GIB:,.1f} GiB available, of which {SAFE:.0%} may be used")
        print("RESULT " + json.dumps(out), flush=True)
        return
    model = enc.model.to(device).eval()

    def reducer(n: int) -> Several:
        """Sentences and head statistics of the text's first n pieces."""
        unit = text["sentence"][:n]
        return Several(sentences=Pool(given_units([unit], [max(unit) + 1])),
                       stats=HeadStats(punct=lambda k, x: text["punct"][:n]))

    budget = {"whole": 1e12, "blocks": args.budget_mb}.get(args.child, args.budget_mb)
    engine = MapEngine(model, Attention(), layers, tokenizer=enc.tokenizer, attention_budget_mb=budget)

    def run(item: Encoded):
        if args.child == "bare":
            model.set_attn_implementation("sdpa")
            with torch.inference_mode():
                model(input_ids=torch.tensor([item.input_ids], device=device))
            return None
        if args.child == "full":
            ((_, attn),) = list(engine.iter_piece_maps([item], progress=False))  # (L', H, T, T)
            n = item.n_pieces
            unit = text["sentence"][:n]
            S = max(unit) + 1
            pooled = pool_layers(list(attn[:, None]), sentence_matrix(unit, S, "mean").to(device),
                                 sentence_matrix(unit, S, "sum").to(device), torch.float32)[0]
            sep = [False] * n
            sep[-1] = True
            stats = sentence_head_stats(attn, text["punct"][:n], sep)
            return dict(sentences=pooled, stats={k: v.double() for k, v in stats.items()})
        ((_, res),) = list(engine.iter_reduced([item], reducer(item.n_pieces), progress=False))
        return res

    run(warm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    res = run(e)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    out["seconds"] = time.perf_counter() - t0
    out["rows_per_block"] = engine.rows_per_block(1, T) if args.child in ("whole", "blocks") else None
    out.update(peak_rss_gib=peak_rss_gib(), anon_peak_gib=anon.read() / 1024)
    if res is not None and args.save:
        arrays = {"sentences": res["sentences"].float().cpu().numpy()}
        arrays.update({f"stat_{k}": v.cpu().numpy() for k, v in res["stats"].items()})
        np.savez(args.save, **arrays)
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- the parent
def prepare(args, lengths: list[int]) -> dict:
    """{length: text} from the data and the model's tokenizer, and the model's config (``--prepare``: written)."""
    if args.inputs:
        folder = Path(args.inputs)
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("text-*.json")
                if int(p.stem.split("-")[1]) in lengths}
    from hydra.utils import instantiate

    from probes.config import compose
    from probes.data.documents import read_conllu_documents

    enc = instantiate(compose("analyze", [f"encoder={args.encoder}"]).encoder)
    docs = read_conllu_documents(Path(args.data_dir) / SOURCES[args.source])
    texts = {n: make_text(enc.tokenizer, docs, n) for n in lengths}
    if args.prepare:
        folder = Path(args.prepare)
        (folder / "shape").mkdir(parents=True, exist_ok=True)
        enc.config.to_json_file(str(folder / "shape" / "config.json"))
        enc.tokenizer.save_pretrained(str(folder / "shape"))
        for n, t in texts.items():
            (folder / f"text-{n}.json").write_text(json.dumps(t))
        (folder / "meta.json").write_text(json.dumps(dict(encoder=args.encoder, source=args.source)))
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="gemma3_270m", help="a conf/encoder name (default gemma3_270m)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--layers", default="all", help="'all' or 0-based layers, comma-separated")
    p.add_argument("--budget-mb", type=float, nargs="+", default=None,
                   help="blocks: extract.attention_budget_mb, one blocks run per value (default: "
                        "conf/extract/default.yaml's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--source", default="gum", choices=sorted(SOURCES))
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--random-init", action="store_true", help="random weights of the model's shape")
    p.add_argument("--prepare", help="write the texts and the model's config (no weights) into this folder")
    p.add_argument("--inputs", help="read the texts and the config written by --prepare (implies the shape only)")
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--text", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.budget_mb is None:
        from probes.config import compose
        args.budget_mb = [float(compose("analyze").extract.attention_budget_mb)]
    if args.child:
        args.budget_mb = args.budget_mb[0]
        return child(args)
    if args.inputs and not args.random_init:
        p.error("--inputs holds no weights: add --random-init")

    import numpy as np

    if args.inputs:  # the names the prepared folder was made with
        meta = json.loads((Path(args.inputs) / "meta.json").read_text())
        args.encoder, args.source = meta["encoder"], meta["source"]
    texts = prepare(args, args.lengths)
    missing = sorted(set(args.lengths) - set(texts))
    if missing:
        p.error(f"no text of {missing} pieces in {args.inputs}: prepare them with --prepare")
    if args.prepare:
        print(f"wrote {sorted(texts)} and the config of {args.encoder} into {args.prepare}")
        return
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        for n in args.lengths:
            text_file = Path(tmp) / f"text-{n}.json"
            text_file.write_text(json.dumps(texts[n]))
            saved = {}
            runs = [(path, budget) for path in args.paths for budget in (args.budget_mb if path == "blocks" else
                                                                         args.budget_mb[:1])]
            for path, budget in runs:
                name = path if path != "blocks" or len(args.budget_mb) == 1 else f"blocks@{budget:g}"
                save = Path(tmp) / f"{n}-{name}.npz"
                cmd = [sys.executable, __file__, "--child", path, "--text", str(text_file), "--save", str(save),
                       "--encoder", args.encoder, "--layers", args.layers, "--budget-mb", str(budget),
                       "--device", args.device, "--threads", str(args.threads)]
                cmd += ["--random-init"] if args.random_init else []
                cmd += ["--inputs", args.inputs] if args.inputs else []
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
                line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
                if done.returncode != 0 or line is None:
                    tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                    why = "killed (out of memory?)" if done.returncode == -9 else tail
                    rows.append(dict(path=name, pieces=texts[n]["n_pieces"], length=n,
                                     error=f"exit {done.returncode}: {why}"))
                    continue
                row = json.loads(line[len("RESULT "):])
                row.update(length=n, path=name, budget_mb=budget if path == "blocks" else None)
                print(f"{name} at {texts[n]['n_pieces']} pieces: " + ", ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                    if k in ("seconds", "rows_per_block", "peak_rss_gib", "gpu_peak_gib", "skipped")), flush=True)
                if save.exists():
                    saved[name] = dict(np.load(save))
                rows.append(row)
            for row in rows:  # the largest difference from the other paths' results
                if row.get("length") != n or row["path"] not in saved:
                    continue
                mine = saved[row["path"]]
                for other, theirs in saved.items():
                    if other == row["path"]:
                        continue
                    maps = float(np.abs(mine["sentences"].astype(np.float64) - theirs["sentences"]).max())
                    stats = max(float(np.nanmax(np.abs(mine[k] - theirs[k]) / np.maximum(np.abs(theirs[k]), 1e-6)))
                                for k in mine if k.startswith("stat_") and k in theirs)
                    row[f"max_diff_vs_{other}"] = [maps, stats]
    load1 = os.getloadavg()
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    print(f"encoder={args.encoder}{' (random weights of its shape)' if args.random_init else ''}; layers "
          f"{args.layers}; one text of UD {args.source.upper()} train documents; blocks' budget "
          f"{', '.join(f'{b:g}' for b in args.budget_mb)} MiB; "
          f"{'GPU: ' + gpu if gpu else 'CPU: ' + cpu_description()}, {os.cpu_count()} logical CPUs, load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'pieces':>7} {'path':<12} {'seconds':>8} {'ms/piece':>9} {'rows/blk':>8} {'peak RSS GiB':>13} "
          f"{'anon GiB':>9} {'GPU GiB':>8}  vs other paths: max |diff| of the sentence maps / largest relative "
          f"difference of a statistic")
    for r in rows:
        head = f"{r['pieces']:7d} {r['path']:<12}"
        if "error" in r or "skipped" in r:
            print(f"{head} {'failed: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']}")
            continue
        diffs = ", ".join(f"{k[len('max_diff_vs_'):]} {v[0]:.1e} / {v[1]:.1e}" for k, v in r.items()
                          if k.startswith("max_diff_vs_"))
        gpu_peak = f"{r['gpu_peak_gib']:8.2f}" if "gpu_peak_gib" in r else f"{'':8}"
        print(f"{head} {r['seconds']:8.1f} {1000 * r['seconds'] / r['pieces']:9.3f} "
              f"{str(r.get('rows_per_block') or ''):>8} {r['peak_rss_gib']:13.2f} {r['anon_peak_gib']:9.2f} "
              f"{gpu_peak}  {diffs}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(encoder=args.encoder, random_init=args.random_init,
                                                  machine=gpu or cpu_description(), load=[load0[0], load1[0]],
                                                  budget_mb=args.budget_mb, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
