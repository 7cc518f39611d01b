"""``python -m probes.patterns classify --checkpoint CKPT --maps FILE.npz --out FILE.json``;
``python -m probes.patterns crossval [--folds 5] [--repeats 1] [--out DIR] [hydra overrides]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from probes.patterns.classify import classify_file
from probes.patterns.crossval import compose, cross_validate


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand (``classify`` or ``crossval``); returns the exit status (2 on a bad input)."""
    parser = argparse.ArgumentParser(prog="python -m probes.patterns",
                                     description="Attention-map pattern types (Kovaleva et al. 2019 §3).")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("classify", help="classify every map of an .npz with a trained pattern CNN")
    c.add_argument("--checkpoint", required=True,
                   help="Lightning .ckpt of `python train.py experiment=patterns` (or its run folder)")
    c.add_argument("--maps", required=True, help=".npz with one square float array per key (the map id)")
    c.add_argument("--out", required=True, help="JSON file to write: {map id: label}")
    c.add_argument("--device", default="cpu")
    c.add_argument("--batch-size", type=int, default=512)
    v = sub.add_parser("crossval", help="stratified k-fold cross-validation of experiment=patterns over all "
                                        "labelled maps (per-class scores with 95%% intervals)")
    v.add_argument("--folds", type=int, default=5)
    v.add_argument("--repeats", type=int, default=1, help="repeat with other fold assignments (seed + r)")
    v.add_argument("--out", default=None, help="report folder (default logs/patterns_cv/<time>)")
    v.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples for the F1 intervals")
    v.add_argument("--only-folds", type=int, nargs="+", default=None,
                   help="score only these fold indices (a fixed, cheaper subset of the same folds)")
    v.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    v.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml + experiment=patterns")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "crossval":
        return _crossval(args)
    try:
        result = classify_file(args.checkpoint, args.maps, args.out, args.device, args.batch_size)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = Counter(result.values())
    print(f"wrote {args.out}: {len(result)} maps; " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


def _crossval(args) -> int:
    out = Path(args.out or Path("logs") / "patterns_cv" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    logging.getLogger("probes").setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = compose(args.overrides, out)
        s = cross_validate(cfg, out, folds=args.folds, repeats=args.repeats, n_boot=args.n_boot,
                           only_folds=args.only_folds)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: s[k] for k in ("accuracy", "accuracy_ci_wilson", "macro_f1", "macro_f1_ci",
                                        "macro_f1_supported", "macro_f1_supported_ci",
                                        "per_fold_macro_f1_supported_mean_sd", "seconds")}, indent=1))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
