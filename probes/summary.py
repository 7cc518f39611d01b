"""Summary of a multirun, for any task: a Hydra callback that tabulates the jobs' ``metrics.json``.

One row per job folder of the sweep (named by the overrides that tell it apart), one column per
metric the jobs wrote (``*_best`` and ``test/*`` scores; losses, ``sys/*`` and counts left out), a
``status`` column (``ok``, or ``failed: <error>`` for a job whose task raised or that wrote no
``metrics.json``) and the paper's value where the job's config names one (``paper: {value: 77,
source: ...}`` in an experiment config). Markdown (``summary.md``) and CSV (``summary.csv``) in the
sweep folder, the folder that holds the jobs.

The sweep folder is pinned when the multirun starts: ``hydra.sweep.dir`` resolves in the multirun's
own config (``task_name`` of the base config, the time of the start) and is handed to every job as a
Hydra override, so jobs whose experiment sets another ``task_name`` (``experiment=glob(table3_*)``)
still run in that one folder, under any launcher (basic, joblib, submitit). The summary is rewritten
after every job (under a file lock: parallel jobs finish at once) and again when the multirun ends, so
the rows of finished jobs survive a failed or killed job, or a sweep that stops early.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from filelock import FileLock
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from probes.io import atomic_write_text

STATUS_FILE = "job_status.json"  # written by the callback at the end of every job: {"status", "error"}


def _overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path) if not str(o).startswith("hydra.")] if path.exists() else []


def _job_names(jobs: list[Path]) -> list[str]:
    """Each job named by the overrides that tell it apart from the sweep's other jobs (its folder name if none)."""
    overrides = [_overrides(j) for j in jobs]
    shared = set.intersection(*map(set, overrides)) if len(jobs) > 1 else set()
    return [" ".join(o for o in ov if o not in shared) or j.name for j, ov in zip(jobs, overrides)]


def _is_reported(key: str, value: Any) -> bool:
    """Scores: ``*_best`` and ``test/*`` numbers, not losses or ``sys/*`` measurements."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("sys/") and \
        not key.endswith("/loss") and (key.endswith("_best") or key.startswith("test/"))


def _natural(part: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", part) if t)


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The job folders of a sweep, at any depth (``hydra.sweep.subdir`` may nest them): those with Hydra's
    ``.hydra/`` record or a ``metrics.json``; in natural order of their paths (job 2 before job 10)."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    found = {p.parent for p in root.rglob(".hydra") if p.is_dir()} | {p.parent for p in root.rglob("metrics.json")}
    jobs = [j for j in found if j != root and ".submitit" not in j.relative_to(root).parts]
    return sorted(jobs, key=lambda j: tuple(_natural(x) for x in j.relative_to(root).parts))


def _status(job: Path, final: bool) -> str:
    if (job / "metrics.json").exists():
        return "ok"
    status = json.loads((job / STATUS_FILE).read_text()) if (job / STATUS_FILE).exists() else {}
    if status.get("status") == JobStatus.FAILED.name:
        return f"failed: {status.get('error') or 'error'}"
    # no metrics and no failure record: killed (or, while the sweep runs, not finished yet)
    return "failed: no metrics.json" if final else "running (no metrics.json yet)"


def collect(sweep_dir: str | Path, final: bool = True) -> tuple[list[str], list[dict[str, Any]]]:
    """(metric columns, rows) of every job under ``sweep_dir``; a job without metrics keeps its row,
    with a ``status`` saying why (``final=False``: a job with neither metrics nor a failure record may
    still be running)."""
    rows, columns = [], []
    jobs = job_dirs(sweep_dir)
    for job, name in zip(jobs, _job_names(jobs)):
        path = job / "metrics.json"
        metrics = json.loads(path.read_text()) if path.exists() else {}
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml") if (job / ".hydra" / "config.yaml").exists() else {}
        paper = (cfg.get("paper") or {}) if cfg else {}
        row = dict(job=name, status=_status(job, final), paper=paper.get("value"))
        for k, v in metrics.items():
            if _is_reported(k, v):
                row[k] = float(v)
                if k not in columns:
                    columns.append(k)
        rows.append(row)
    columns.sort(key=lambda k: (not k.startswith("val/"), k))
    return columns, rows


def summarize(sweep_dir: str | Path, final: bool = True) -> tuple[str, str]:
    """(Markdown table, CSV text) of :func:`collect`; rates in [0, 1] are shown x100 in the Markdown."""
    columns, rows = collect(sweep_dir, final)
    head = ["job", *columns, "status", "paper"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["job"]] + [_fmt(r.get(c)) for c in columns] + \
            [r["status"].replace("|", "/"), "-" if r["paper"] is None else str(r["paper"])]
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


def write_summary(sweep_dir: str | Path, final: bool = True) -> str:
    """Write ``summary.md`` and ``summary.csv`` in ``sweep_dir`` (under a lock beside them); the Markdown."""
    sweep = Path(sweep_dir)
    sweep.mkdir(parents=True, exist_ok=True)
    with FileLock(str(sweep / ".summary.lock")):
        md, text = summarize(sweep, final)
        atomic_write_text(sweep / "summary.md", md)
        atomic_write_text(sweep / "summary.csv", text)
    return md


def _quote(value: str) -> str:
    """A Hydra override value in single quotes (backslashes and quotes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def pin_sweep_dir(config: DictConfig) -> Path:
    """Resolve ``hydra.sweep.dir`` once in the multirun's config and hand it to every job as an override;
    the folder is created at once (a sweeper may keep its state there, e.g. Optuna's SQLite study)."""
    sweep = Path(str(config.hydra.sweep.dir)).absolute()
    sweep.mkdir(parents=True, exist_ok=True)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.sweep.dir = str(sweep)
        kept = [o for o in config.hydra.overrides.hydra if not str(o).startswith("hydra.sweep.dir=")]
        config.hydra.overrides.hydra = kept + [f"hydra.sweep.dir={_quote(str(sweep))}"]
    return sweep


class SummaryCallback(Callback):
    """Pins the sweep folder, records each job's status, writes ``summary.md``/``summary.csv`` there."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Pin the sweep folder for every job (:func:`pin_sweep_dir`)."""
        pin_sweep_dir(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """Record the job's status and rewrite the sweep's summary."""
        if config.hydra.mode != RunMode.MULTIRUN:
            return  # a single run has no sweep folder
        out = Path(config.hydra.runtime.output_dir)
        error = None
        if job_return.status == JobStatus.FAILED:
            e = job_return._return_value
            error = f"{type(e).__name__}: {e}".splitlines()[0][:200] if e is not None else "error"
        atomic_write_text(out / STATUS_FILE, json.dumps(dict(status=job_return.status.name, error=error)))
        write_summary(config.hydra.sweep.dir, final=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the final summary of the sweep."""
        sweep = Path(config.hydra.sweep.dir)
        md = write_summary(sweep, final=True)
        print(f"\n{sweep / 'summary.md'}:\n{md}")
