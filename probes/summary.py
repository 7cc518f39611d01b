"""Summary of a multirun, for any task: a Hydra callback that tabulates the jobs' ``metrics.json``.

One row per job folder (named by its overrides), one column per metric the jobs wrote (``*_best``
and ``test/*`` values; ``sys/*`` and counts left out), and the paper's value where the job's config
names one (``paper: {value: 77, source: ...}`` in an experiment config). Markdown (``summary.md``)
and CSV (``summary.csv``) in the sweep folder.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from probes.io import atomic_write_text


def _overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path) if not str(o).startswith("hydra.")] if path.exists() else []


def _job_names(jobs: list[Path]) -> list[str]:
    """Each job named by the overrides that tell it apart from the sweep's other jobs (its folder name if none)."""
    overrides = [_overrides(j) for j in jobs]
    shared = set.intersection(*map(set, overrides)) if len(jobs) > 1 else set()
    return [" ".join(o for o in ov if o not in shared) or j.name for j, ov in zip(jobs, overrides)]


def _is_reported(key: str, value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("sys/") and \
        (key.endswith("_best") or key.startswith("test/"))


def collect(sweep_dir: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(metric columns, rows) of the jobs under ``sweep_dir`` that wrote ``metrics.json``."""
    rows, columns = [], []
    jobs = sorted((m.parent for m in Path(sweep_dir).glob("*/metrics.json")), key=lambda p: p.name)
    for job, name in zip(jobs, _job_names(jobs)):
        metrics = json.loads((job / "metrics.json").read_text())
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml") if (job / ".hydra" / "config.yaml").exists() else {}
        paper = (cfg.get("paper") or {}) if cfg else {}
        row = dict(job=name, paper=paper.get("value"))
        for k, v in metrics.items():
            if _is_reported(k, v):
                row[k] = float(v)
                if k not in columns:
                    columns.append(k)
        rows.append(row)
    columns.sort(key=lambda k: (not k.startswith("val/"), k))
    return columns, rows


def summarize(sweep_dir: str | Path) -> tuple[str, str]:
    """(Markdown table, CSV text) of :func:`collect`; rates in [0, 1] are shown x100 in the Markdown."""
    columns, rows = collect(sweep_dir)
    head = ["job", *columns, "paper"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["job"]] + [_fmt(r.get(c)) for c in columns] + ["-" if r["paper"] is None else str(r["paper"])]
        lines.append("| " + " | ".join(cells) + " |")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=head, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return "\n".join(lines) + "\n", buf.getvalue()


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if -1.0 <= v <= 1.0 else f"{v:.4g}"


class SummaryCallback(Callback):
    """Writes ``<sweep dir>/summary.md`` and ``summary.csv`` when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        md, text = summarize(sweep)
        atomic_write_text(sweep / "summary.md", md)
        atomic_write_text(sweep / "summary.csv", text)
        print(f"\n{sweep / 'summary.md'}:\n{md}")
