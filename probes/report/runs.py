"""Run folders as the report sees them: training runs (``metrics.json``) and analyses (``summary.json``),
each labelled by what its ``provenance.json`` says it read (:class:`Label`), never by config names.

Runs are grouped by what ran (experiment or analysis), the encoder (name and weights fingerprint) and the
data files read (paths and sha256): :attr:`Run.group`, :func:`group_runs` (newest run first in a group).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from probes.config import CONF_DIR, plain
from probes.report.provenance import read_provenance

UNKNOWN = "unknown"  # a field the run's provenance does not record
SPLIT_ORDER = {"train": 0, "dev": 1, "validation": 1, "test": 2}


# overrides that choose what ran and where its files and logs go, not how it computes
RANDOM = " (random init)"
IDENTITY = ("experiment=", "analysis=", "encoder=", "data=", "paths.", "hydra.", "logger", "tags=")


@cache
def pinned_files(conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """``{sha256: "<treebank> <split>"}`` of every file pinned in ``conf/treebank/*.yaml`` (the official
    downloads): a file read with one of these digests is that file, whatever its path."""
    out = {}
    for path in sorted((conf_dir / "treebank").glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        for split, sha in (node.get("sha256") or {}).items():
            out[str(sha).lower()] = f"{node.get('name', path.stem)} {split}"
    return out


@dataclass(frozen=True)
class DataFile:
    """One data file a run read: its split, its path (relative to the run's data folder when under it,
    else as recorded), its sha256 and, when that digest is a pinned file's, which one."""

    split: str
    path: str
    sha256: str
    pinned: str | None = None

    @property
    def short(self) -> str:
        """``<file name>@<first 8 hex of sha256>``."""
        return f"{Path(self.path).name}@{self.sha256[:8]}"


@dataclass(frozen=True)
class Label:
    """What a run read, from its provenance: the data files, the data folder, the encoder's weights
    fingerprint and the precision; :data:`UNKNOWN` where the provenance records nothing."""

    files: tuple[DataFile, ...] = ()
    data_dir: str = UNKNOWN
    fingerprint: str = UNKNOWN
    precision: str = UNKNOWN

    @property
    def data(self) -> str:
        """The files read, ``dir/{a@sha8, b@sha8}`` per folder, then ``= pinned <treebank> <splits>`` when
        their digests are pinned files'; :data:`UNKNOWN` when none is recorded."""
        return self._describe(folders=True)

    @property
    def data_short(self) -> str:
        """:attr:`data` without the folders (column headings)."""
        return self._describe(folders=False)

    def _describe(self, folders: bool) -> str:
        if not self.files:
            return UNKNOWN
        by_dir: dict[str, list[str]] = {}
        for f in self.files:
            by_dir.setdefault(str(Path(f.path).parent) if folders else ".", []).append(f.short)
        parts = [(f"{d}/" if d != "." else "") + (names[0] if len(names) == 1 else "{" + ", ".join(names) + "}")
                 for d, names in by_dir.items()]
        pins: dict[str, list[str]] = {}
        for f in self.files:
            if f.pinned:
                name, _, split = f.pinned.rpartition(" ")
                pins.setdefault(name, []).append(split)
        pinned = "; ".join(f"{n} {'/'.join(s)}" for n, s in pins.items())
        return ", ".join(parts) + (f" = pinned {pinned}" if pinned else "")

    @property
    def data_key(self) -> tuple:
        """The identity of the data read: sorted ``(path, sha256)`` pairs; ``(UNKNOWN,)`` when not recorded."""
        return tuple(sorted((f.path, f.sha256) for f in self.files)) or (UNKNOWN,)


def _text(v: Any) -> str | None:
    """A recorded value as text (mappings ``k=v, ...``, lists joined); None for nothing recorded."""
    if v is None or v == "" or v == {} or v == []:
        return None
    if isinstance(v, Mapping):
        items = [(k, _text(x)) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))]
        return ", ".join(f"{k}={x}" for k, x in items if x is not None) or None
    if isinstance(v, (list, tuple, set)):
        items = [t for t in (_text(x) for x in v) if t is not None]
        return ", ".join(dict.fromkeys(items)) or None
    return str(v)


def _relative(path: str, data_dir: str | None) -> str:
    """``path`` relative to ``data_dir`` when it lies under it (no file-system access), else as given."""
    if data_dir:
        rel = os.path.relpath(os.path.normpath(path), os.path.normpath(data_dir))
        if not rel.startswith(".."):
            return rel
    return path


def read_label(prov: Mapping[str, Any]) -> Label:
    """The :class:`Label` of a provenance record (``provenance.json`` as :func:`read_provenance` returns it).

    Data files: ``inputs.data_files`` (``{split: {path, sha256}}``); data folder: ``inputs.data_dir`` (not the
    ``PROBES_DATA_DIR`` of the environment record, which ``paths.data_dir`` may override); weights fingerprint: ``inputs.encoder.fingerprint``, else the ``revision``
    of the cache entries read (``inputs.caches.<stage>.key``); precision: ``precision`` of the record or of
    its inputs, else that of the cache entries read. Anything else, or a missing field, is :data:`UNKNOWN`.
    """
    prov = prov if isinstance(prov, Mapping) else {}
    inputs = prov.get("inputs") if isinstance(prov.get("inputs"), Mapping) else {}
    data_dir = _text(inputs.get("data_dir"))
    pins = pinned_files()
    files = []
    recorded = inputs.get("data_files")
    for split, f in (recorded.items() if isinstance(recorded, Mapping) else ()):
        f = f if isinstance(f, Mapping) else {}
        sha = _text(f.get("sha256")) or UNKNOWN
        path = _text(f.get("path"))
        files.append(DataFile(str(split), _relative(path, data_dir) if path else UNKNOWN, sha, pins.get(sha.lower())))
    files.sort(key=lambda f: (SPLIT_ORDER.get(f.split, len(SPLIT_ORDER)), f.split))
    caches = inputs.get("caches") if isinstance(inputs.get("caches"), Mapping) else {}
    keys = [c["key"] for c in caches.values() if isinstance(c, Mapping) and isinstance(c.get("key"), Mapping)]
    enc = inputs.get("encoder") if isinstance(inputs.get("encoder"), Mapping) else {}
    fingerprint = _text(enc.get("fingerprint")) or _text([k.get("revision") for k in keys])
    precision = _text(prov.get("precision")) or _text(inputs.get("precision")) or \
        _text([k.get("precision") for k in keys])
    return Label(tuple(files), data_dir or UNKNOWN, fingerprint or UNKNOWN, precision or UNKNOWN)


@dataclass
class Run:
    """One run folder: what ran (experiment or analysis), on which encoder, what it read, and its numbers."""

    path: Path
    kind: str                 # "train" | "analysis"
    name: str                 # the experiment (training) or the analysis name
    encoder: str              # the encoder config's name (its weights: label.fingerprint)
    label: Label              # what the run read, from its provenance
    values: dict[str, Any]    # metrics.json (training) or summary.json (analysis)
    finished: float           # mtime of metrics.json / summary.json
    provenance: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @property
    def data(self) -> str:
        """The data files read (:attr:`Label.data`), :data:`UNKNOWN` when not recorded."""
        return self.label.data

    @property
    def group(self) -> tuple:
        """What makes runs comparable: kind, experiment/analysis, encoder and weights fingerprint, data read."""
        return (self.kind, self.name, self.encoder, self.label.fingerprint, self.label.data_key)

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
    return plain(OmegaConf.load(hydra_yaml).hydra.runtime.choices, resolve=False)


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
    cfg = plain(OmegaConf.load(cfg_path), resolve=False)
    choices = _choices(run_dir)
    enc = encoder_name(cfg.get("encoder") or {}, choices.get("encoder"))
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
    prov = read_provenance(run_dir)
    return Run(run_dir, kind, str(name), enc, read_label(prov), values, f.stat().st_mtime, prov, overrides)


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


def newest_first(runs) -> list[Run]:
    """``runs`` newest first (the time ``metrics.json``/``summary.json`` was written; ties by folder)."""
    return sorted(runs, key=lambda r: (-r.finished, str(r.path)))


def group_runs(runs) -> list[list[Run]]:
    """``runs`` in groups of equal :attr:`Run.group`, each newest first; groups ordered by their newest run."""
    groups: dict[tuple, list[Run]] = {}
    for r in newest_first(runs):
        groups.setdefault(r.group, []).append(r)
    return list(groups.values())
