"""Run folders as the report sees them: training runs (``metrics.json``) and analyses (``summary.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from probes.report.provenance import read_provenance


# overrides that choose what ran and where its files and logs go, not how it computes
RANDOM = " (random init)"
IDENTITY = ("experiment=", "analysis=", "encoder=", "data=", "paths.", "hydra.", "logger", "tags=")


@dataclass
class Run:
    """One run folder: what ran (experiment or analysis), on which encoder and data, and its numbers."""

    path: Path
    kind: str                 # "train" | "analysis"
    name: str                 # the experiment (training) or the analysis name
    encoder: str
    data: str
    values: dict[str, Any]    # metrics.json (training) or summary.json (analysis)
    finished: float           # mtime of metrics.json / summary.json
    provenance: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @property
    def extra_overrides(self) -> list[str]:
        """Overrides beyond choosing the experiment/analysis, encoder and data (and where files go):
        such a run is not the configuration the paper's table describes, and the report says so."""
        return [o for o in self.overrides if not o.lstrip("+~").startswith(IDENTITY)]

    @property
    def base_encoder(self) -> str:
        """The encoder's name without the random-init mark (Table 3's random row is its own experiment)."""
        return self.encoder.removesuffix(RANDOM)

    def csv(self, name: str) -> Path:
        return self.path / f"{name}.csv"

    def figures(self) -> list[Path]:
        return sorted(self.path.glob("*.png"))


def _choices(run_dir: Path) -> dict[str, Any]:
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    if not hydra_yaml.exists():
        return {}
    return dict(OmegaConf.to_container(OmegaConf.load(hydra_yaml).hydra.runtime.choices))


def encoder_name(enc: dict, choice: str | None) -> str:
    """The encoder's own name (``encoder.name``), else its hub id/folder, else the config choice (+ family)."""
    if enc.get("name"):
        name = str(enc["name"])
    elif enc.get("name_or_path"):
        name = Path(str(enc["name_or_path"])).name
    else:
        name = "-".join(str(x) for x in (choice or "encoder", enc.get("family")) if x)
    return name + (RANDOM if enc.get("random_init") else "")


def load_run(run_dir: Path) -> Run | None:
    """The :class:`Run` of ``run_dir``; None when it is not a finished run of this project."""
    cfg_path = run_dir / ".hydra" / "config.yaml"
    if not cfg_path.exists():
        return None
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False)
    choices = _choices(run_dir)
    enc = encoder_name(cfg.get("encoder") or {}, choices.get("encoder"))
    data = str((cfg.get("data") or {}).get("name") or choices.get("data") or "?")
    if (run_dir / "metrics.json").exists() and "probe" in cfg:
        kind, f = "train", run_dir / "metrics.json"
        name = choices.get("experiment") or str(cfg.get("task_name") or "train")
    elif (run_dir / "summary.json").exists() and "analysis" in cfg:
        kind, f = "analysis", run_dir / "summary.json"
        name = choices.get("analysis") or str(cfg["analysis"]["_target_"]).rsplit(".", 1)[-1]
    else:
        return None
    try:
        values = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    ov = run_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(ov)] if ov.exists() else []
    return Run(run_dir, kind, str(name), enc, data, values, f.stat().st_mtime, read_provenance(run_dir), overrides)


def find_runs(paths) -> list[Run]:
    """Every run folder under ``paths`` (multirun folders, single runs or a whole ``logs/``)."""
    seen, runs = set(), []
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"no such run folder: {root}")
        candidates = [root] if (root / ".hydra").is_dir() else []
        candidates += [p.parent.parent for p in root.rglob(".hydra/config.yaml") if "wandb" not in p.parts]
        for d in candidates:
            d = d.resolve()
            if d in seen:
                continue
            seen.add(d)
            run = load_run(d)
            if run is not None:
                runs.append(run)
    return sorted(runs, key=lambda r: r.finished)
