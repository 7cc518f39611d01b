"""What produced a run and what it read: commit, machine, command, the environment variables that set the data
and cache folders, and (training runs) the data files with their sha256 and the cache entries with their keys
(encoder and weights fingerprint, data sha256, precision). Written as ``provenance.json`` into the run folder.

Training runs get it from the wandb logger (``conf/logger/wandb.yaml``), analyses from their context.
:func:`read_provenance` reads a run folder's ``provenance.json``, else the environment
record of the run's offline wandb file (commit, host, CPU, arguments), else ``.hydra/``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from probes.io import atomic_write_text
from probes.machine import cpu_model
from probes.report.wandb_files import read_run

FILE = "provenance.json"
# Environment variables that decide what a run reads or where it writes.
ENV_VARS = ("PROBES_DATA_DIR", "PROBES_CACHE_DIR", "PROJECT_ROOT", "WANDB_MODE", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS")
ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = ROOT) -> str | None:
    """``<sha>`` of HEAD, ``<sha>+dirty`` with uncommitted changes to tracked files; None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """Host, CPU model and cores, GPU (when torch sees one), torch and Python versions."""
    out: dict[str, Any] = dict(host=platform.node(), cpu=cpu_model(), cores=os.cpu_count(),
                               python=platform.python_version())
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    return out


def job_command() -> tuple[str, str]:
    """(the command that reruns this job alone, the command line that launched the process)."""
    launched = " ".join(shlex.quote(a) for a in ["python", *_program(), *sys.argv[1:]])
    try:
        hc = HydraConfig.get()
        task = [str(o) for o in hc.overrides.task]
    except Exception:  # not inside a Hydra job
        return launched, launched
    return " ".join(shlex.quote(a) for a in ["python", *_program(), *task]), launched


def _program() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m pkg.mod
        return ["-m", spec.name.removesuffix(".__main__")]
    prog = Path(sys.argv[0])
    try:
        return [str(prog.resolve().relative_to(ROOT))]
    except ValueError:
        return [str(prog)]


def collect() -> dict[str, Any]:
    """Provenance of the current process (and Hydra job, if any)."""
    command, launched = job_command()
    return dict(commit=git_commit(), machine=machine(), command=command, launched_by=launched,
                started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                environment={v: os.environ.get(v) for v in ENV_VARS})


def readable(path: Path) -> Path:
    """Give ``path`` the umask's usual mode (the atomic writer's temp files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
    return path


def write_provenance(folder: str | os.PathLike, inputs: dict[str, Any] | None = None) -> Path:
    """Write :func:`collect` to ``<folder>/provenance.json`` (atomic); ``inputs``: what the run read (the
    training entry passes the data folders, data files and cache entries), kept under ``"inputs"``."""
    record = collect()
    if inputs:
        record["inputs"] = inputs
    return readable(atomic_write_text(Path(folder) / FILE, json.dumps(record, indent=1, sort_keys=True, default=str)))


def read_provenance(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Provenance of a finished run folder, from the best source it has (``source`` names it)."""
    run_dir = Path(run_dir)
    if (run_dir / FILE).exists():
        return dict(json.loads((run_dir / FILE).read_text()), source=FILE)
    out: dict[str, Any] = dict(commit=None, machine={}, command=None, source=None)
    overrides = run_dir / ".hydra" / "overrides.yaml"
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    if overrides.exists():
        task = [str(o) for o in OmegaConf.load(overrides)]
        prog = "train.py"
        if hydra_yaml.exists():
            name = OmegaConf.load(hydra_yaml).hydra.job.get("name")
            prog = "-m probes.analyze" if name == "analyze" else "train.py"
        out.update(command=" ".join(["python", prog, *(shlex.quote(t) for t in task)]), source=".hydra")
    wandb_files = sorted(run_dir.glob("wandb/*run-*/run-*.wandb"))
    if wandb_files:
        try:
            env = read_run(wandb_files[-1]).environment
        except (ValueError, OSError):
            env = {}
        if env:
            out["commit"] = (env.get("git") or {}).get("commit")
            out["machine"] = dict(host=env.get("host"), cpu=(env.get("cpu") or {}).get("model"),
                                  cores=env.get("cpu_count"), python=env.get("python"),
                                  gpu=(env.get("gpu") or None))
            out["launched_by"] = " ".join(["python", env.get("code_path") or env.get("program", "?"),
                                           *map(shlex.quote, env.get("args") or [])])
            out["started_utc"] = env.get("started_at")
            out["source"] = "wandb environment record"
    return out
