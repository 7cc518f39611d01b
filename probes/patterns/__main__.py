"""``python -m probes.patterns classify --checkpoint CKPT --maps FILE.npz --out FILE.json``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from probes.patterns.classify import classify_file

    try:
        result = classify_file(args.checkpoint, args.maps, args.out, args.device, args.batch_size)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = Counter(result.values())
    print(f"wrote {args.out}: {len(result)} maps; " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
