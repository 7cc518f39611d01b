"""Experiment dashboards and the paper report.

- :mod:`probes.report.tracking`: wandb runs grouped by sweep, typed by what ran, named by overrides.
- :mod:`probes.report.provenance`: commit, machine and command of a run (``provenance.json``).
- :mod:`probes.report.wandb_files`: offline ``.wandb`` files read back.
- :mod:`probes.report.runs`: run folders labelled by what their provenance says they read, and grouped.
- ``python -m probes.report PATH... [--out DIR]``: ``report.html`` + ``report.md`` from run folders,
  every table and figure of the four papers beside the paper's numbers (``papers.yaml``), and every run,
  grouped by experiment/analysis, encoder and the data files read, newest first.
"""

from __future__ import annotations

import os
from pathlib import Path

from probes.io import atomic_write_text
from probes.report.build import build
from probes.report.provenance import readable
from probes.report.render import markdown, page
from probes.report.runs import find_runs


def write_report(paths, out: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Find the runs under ``paths``, build every section, write ``report.md`` and ``report.html`` into
    ``out`` (default: the first path); returns both paths."""
    paths = [Path(p) for p in paths]
    runs = find_runs(paths)  # raises FileNotFoundError for a missing folder, before anything is written
    out_dir = Path(out) if out is not None else paths[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    papers = build(runs)
    sources = [str(p) for p in paths]
    md = atomic_write_text(out_dir / "report.md", markdown(papers, runs, sources, out_dir))
    html = atomic_write_text(out_dir / "report.html", page(papers, runs, sources, out_dir))
    return readable(md), readable(html)
