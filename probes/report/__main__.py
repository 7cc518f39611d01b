"""``python -m probes.report PATH... [--out DIR]``: the paper report from run folders."""

from __future__ import annotations

import argparse
import logging
import sys

from probes.report import write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m probes.report", description=__doc__)
    ap.add_argument("paths", nargs="+", help="run folders: multirun folder(s), single runs or a whole logs/")
    ap.add_argument("--out", help="folder for report.html and report.md (default: the first PATH)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        md, html = write_report(args.paths, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {html}\nwrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
