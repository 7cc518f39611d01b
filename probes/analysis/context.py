"""The object every analysis receives: config, output folder, lazy data/model access, outputs.

An analysis is a plain function ``fn(ctx, *, split, max_sentences, **params)``; its Hydra node
(``conf/analysis/<name>.yaml``) names it with ``_target_`` and ``_partial_: true``, and
:func:`run_analysis` instantiates that node and calls it with one :class:`AnalysisContext`. Both the
command line (``python -m probes.analyze``) and the Python API (:func:`probes.analyze`) go through
:func:`run_analysis`; from Python, :meth:`AnalysisContext.create` builds a context without a Hydra app
and takes ready objects (an encoder, a treebank) in place of the config's nodes.

Outputs: :meth:`AnalysisContext.save_table` writes a tidy CSV (and a wandb Table: every analysis's
tables land in the dashboard from here, none of them calls wandb itself),
:meth:`~AnalysisContext.save_figure` a PNG (and a wandb Image), :meth:`~AnalysisContext.log_summary`
merges scalars into ``summary.json`` (and the wandb run summary). Every file is written to a
temporary name in the output folder and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import wandb
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from probes.config import CONF_DIR, check_types, compose, plain
from probes.data.sources import Treebank
from probes.extract.attention_caches import ensure_cache
from probes.extract.settings import ExtractSettings
from probes.io import atomic_write
from probes.measures import build, from_config
from probes.model.load import Encoder
from probes.report.provenance import write_provenance
from probes.report.tracking import analysis_inputs, init_run
from probes.stats import seed_everything

log = logging.getLogger(__name__)

# Tables larger than this are written as CSV but not uploaded to wandb as a Table.
WANDB_TABLE_MAX_ROWS = 50_000


def resolve_device(want: str | None) -> str:
    """``auto`` (or None) -> ``cuda`` when available, else ``cpu``; any other device name as given."""
    want = str(want or "auto")
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return want


class AnalysisContext:
    """Config + output folder + lazy encoder/treebank/cache + writers (CSV/PNG/JSON, wandb).

    Args:
        cfg: The composed ``analyze`` config (``conf/analyze.yaml``).
        output_dir: Folder for the tables, figures and ``summary.json`` (created).
        use_wandb: Log to wandb; None: as ``cfg.logger.use_wandb`` says.
        name: The analysis name (its config name); None: ``cfg.analysis_name``.
        encoder: A ready :class:`~probes.model.load.Encoder` in place of ``cfg.encoder``.
        treebank: A ready :class:`~probes.data.sources.Treebank` in place of ``cfg.data.treebank``.
        figures: False: figures are not written (each analysis still builds and closes them).

    Every table, figure and summary value saved stays in memory too (``tables``, ``figures``,
    ``summary``), for :class:`AnalysisResult`.
    """

    def __init__(self, cfg: DictConfig, output_dir: str | os.PathLike, use_wandb: bool | None = None,
                 name: str | None = None, *, encoder: Encoder | None = None, treebank: Treebank | None = None,
                 figures: bool = True):
        check_types(cfg)  # wrong types in overrides: an error naming the key, before any folder or file
        self.cfg = cfg
        self._name = name
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        logger_cfg = cfg.get("logger") or {}
        self.use_wandb = bool(logger_cfg.get("use_wandb", False)) if use_wandb is None else use_wandb
        self.write_figures = bool(figures)
        if encoder is not None:  # ready objects take the place of the cached properties below
            self.__dict__["encoder"] = encoder
        if treebank is not None:
            self.__dict__["treebank"] = treebank
        self._wandb_run = None
        self._summary: dict[str, Any] = {}
        self.files: list[Path] = []
        self.tables: dict[str, pd.DataFrame] = {}
        self.figures: dict[str, Path] = {}
        self.t0 = time.time()
        write_provenance(self.output_dir)  # commit, machine, command (read by `python -m probes.report`)

    @classmethod
    def create(cls, name: str, output_dir: str | os.PathLike, *, encoder: Encoder | None = None,
               treebank: Treebank | None = None,
               overrides: Sequence[str] = (), params: Mapping[str, Any] | None = None, use_wandb: bool = False,
               figures: bool = True) -> "AnalysisContext":
        """A context for ``conf/analysis/<name>.yaml`` without a Hydra app (the Python API's path).

        Args:
            name: The analysis config name (``head_stats``, ``dep_heads``, ...).
            output_dir: Folder for the outputs (created).
            encoder: A ready encoder in place of the config's ``encoder`` node (None: the config's).
            treebank: A ready treebank in place of ``data.treebank`` (None: the config's).
            overrides: Command-line style overrides of ``conf/analyze.yaml`` (``["extract.maps=rollout"]``).
            params: Values for the analysis node (``{"max_sentences": 20}`` sets ``analysis.max_sentences``);
                an unknown key is an error naming the node's keys.
            use_wandb: Log to wandb (off by default from Python).
            figures: Write the figures.

        Returns:
            The context; run the analysis with :func:`run_analysis` (``run_analysis(ctx.cfg, ctx.output_dir,
            context=ctx)``) or call ``hydra.utils.instantiate(ctx.cfg.analysis)(ctx)``.
        """
        cfg = analysis_config(name, overrides, params)
        return cls(cfg, output_dir, use_wandb=use_wandb, name=name, encoder=encoder, treebank=treebank,
                   figures=figures)

    def seconds(self) -> float:
        """Wall time since the analysis started, rounded to 0.1 s."""
        return round(time.time() - self.t0, 1)

    # ----------------------------------------------------------------- lazy inputs
    @cached_property
    def encoder(self):
        """The frozen encoder of ``cfg.encoder`` (built on first access), or the one given to the constructor."""
        enc = instantiate(self.cfg.encoder)
        log.info("encoder %s: %d layers x %d heads", enc.name, enc.num_layers, enc.num_heads)
        return enc

    @cached_property
    def treebank(self):
        """The treebank of ``cfg.data.treebank``, or the one given to the constructor."""
        return instantiate(self.cfg.data.treebank)

    def sentences(self, split: str, max_sentences: int | None = None):
        """The first ``max_sentences`` sentences of ``split`` (file order); all when None."""
        return self.treebank.read(split)[:max_sentences]

    def cache(self, split: str, max_sentences: int | None = None):
        """``(AttentionCache, sentences)`` of the word-level maps of ``split``, extracted if missing."""
        return ensure_cache(self.encoder, self.treebank, split, self.cfg.extract, self.cfg.paths.cache_dir,
                            max_sentences)

    @property
    def device(self) -> str:
        """``analysis_device``: ``auto`` is cuda when available, else cpu."""
        return resolve_device(self.cfg.get("analysis_device"))

    # ----------------------------------------------------------------- wandb
    @property
    def wandb_run(self):
        """The wandb run (started on first use; None when wandb is switched off).

        Group, job type (the analysis name) and run name as for training runs
        (:mod:`probes.report.tracking`); the resolved config flattened to dotted keys.
        """
        if not self.use_wandb:
            return None
        if self._wandb_run is None:
            lc = self.cfg.logger
            try:
                config = plain(self.cfg)
            except Exception:  # e.g. ${hydra:...} outside a Hydra app
                config = plain(self.cfg, resolve=False)
            self._wandb_run = init_run(
                config, project=lc.get("project", "probes"), mode=lc.get("mode", "offline"),
                job_type=self.name, task_name=str(self.cfg.get("task_name") or "analyze"),
                dir=self.output_dir, tags=list(lc.get("tags") or []), group=lc.get("group"), name=lc.get("name"))
        return self._wandb_run

    @property
    def name(self) -> str:
        """The analysis name = its config name (``conf/analysis/<name>.yaml``): the ``name`` argument, else
        ``cfg.analysis_name`` (set by ``conf/analyze.yaml`` from Hydra's choice), else the function's name."""
        if self._name:
            return self._name
        try:
            name = self.cfg.get("analysis_name")
        except Exception:  # ${hydra:...} outside a Hydra app (a config composed by hand)
            name = None
        if name:
            return str(name)
        return str(self.cfg.analysis._target_).rsplit(".", 1)[-1]

    # ----------------------------------------------------------------- settings the analyses read
    @property
    def data_dir(self) -> Path:
        """Root of the data files (``paths.data_dir``: ``PROBES_DATA_DIR`` or ``<repo>/data``)."""
        return Path(self.cfg.paths.data_dir)

    @property
    def cache_dir(self) -> Path:
        """Root of the caches (``paths.cache_dir``: ``PROBES_CACHE_DIR`` or ``<repo>/.cache/probes``)."""
        return Path(self.cfg.paths.cache_dir)

    @property
    def seed(self) -> int:
        """The run's seed (``seed``, 0 when absent)."""
        return int(self.cfg.get("seed", 0) or 0)

    @property
    def extract_cfg(self) -> DictConfig:
        """The ``extract`` node (pooling, precision, map kinds); an empty node when absent."""
        return self.cfg.get("extract") or OmegaConf.create({})

    def measure(self, kind: str | None = None):
        """``(kind, Measure)``: the map kind ``kind`` (default: ``extract.maps``, attention when unset) built
        from ``extract.measures``."""
        if kind is None:
            return from_config(self.extract_cfg)
        return kind, build(kind, self.extract_cfg.get("measures"))

    def precision_record(self) -> dict:
        """Write ``<output_dir>/precision.json``: the extraction precision of ``extract`` (requested, resolved, how
        it was decided and its timings; :func:`probes.extract.precision.record`, with the encoder the analysis
        built, if any); returns it. Nothing is measured or loaded."""
        try:
            settings = ExtractSettings.from_config(self.extract_cfg)
        except ValueError as e:  # a config without a full extract node (composed by hand)
            record = dict(precision=None, decided_by=f"no extract settings ({e})")
        else:
            record = settings.precision_record(self.__dict__.get("encoder"), self.cache_dir)
        path = self.output_dir / "precision.json"
        text = json.dumps(record, indent=1, sort_keys=True, default=str)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
        return record

    def finish(self) -> None:
        """Close the wandb run, if one was started."""
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    # ----------------------------------------------------------------- outputs
    def save_table(self, df, name: str) -> Path:
        """Write ``df`` to ``<output_dir>/<name>.csv`` (atomic), keep it in ``tables`` and log it as a wandb Table."""
        path = self.output_dir / f"{name}.csv"
        atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))
        self.files.append(path)
        self.tables[name] = df.reset_index(drop=True)
        log.info("wrote %s (%d rows)", path, len(df))
        run = self.wandb_run
        if run is not None and len(df) <= WANDB_TABLE_MAX_ROWS:
            run.log({f"{name}": wandb.Table(dataframe=df.reset_index(drop=True))})
        return path

    def save_figure(self, fig, name: str, dpi: int = 120) -> Path | None:
        """Write ``fig`` to ``<output_dir>/<name>.png`` (atomic), keep its path in ``figures``, log it as a wandb
        Image, close it; with ``figures=False`` only close it (None is returned)."""
        if not self.write_figures:
            plt.close(fig)
            return None
        path = self.output_dir / f"{name}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
        self.files.append(path)
        self.figures[name] = path
        run = self.wandb_run
        if run is not None:
            run.log({f"fig/{name}": wandb.Image(str(path))})
        plt.close(fig)
        log.info("wrote %s", path)
        return path

    def log_summary(self, values: dict[str, Any]) -> Path:
        """Merge ``values`` into ``<output_dir>/summary.json`` (atomic) and the wandb run summary."""
        values = {k: _jsonable(v) for k, v in values.items()}
        self._summary.update(values)
        path = self.output_dir / "summary.json"
        text = json.dumps(self._summary, indent=1, sort_keys=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
        if path not in self.files:
            self.files.append(path)
        run = self.wandb_run
        if run is not None:
            run.summary.update(values)
        return path


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


@dataclass
class AnalysisResult:
    """What one analysis run produced.

    Attributes:
        name: The analysis (config) name.
        output_dir: The folder holding the files.
        tables: Table name -> the tidy DataFrame written as ``<output_dir>/<name>.csv``.
        figures: Figure name -> its PNG (empty with ``figures=False``).
        summary: The contents of ``summary.json``.
        value: What the analysis function returned (most return their main table).
    """

    name: str
    output_dir: Path
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Path] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    value: Any = None

    def __repr__(self) -> str:
        return (f"AnalysisResult({self.name!r}, output_dir={str(self.output_dir)!r}, tables={list(self.tables)}, "
                f"figures={list(self.figures)})")


def analysis_config(name: str, overrides: Sequence[str] = (), params: Mapping[str, Any] | None = None) -> DictConfig:
    """``conf/analyze.yaml`` composed with ``analysis=<name>`` and ``overrides``, ``params`` set on the
    ``analysis`` node (an unknown key is an error naming the known ones) and ``analysis_name`` = ``name``."""
    try:
        cfg = compose("analyze", [f"analysis={name}", *overrides])
    except Exception as e:  # hydra's MissingConfigException / override errors
        known = sorted(p.stem for p in (CONF_DIR / "analysis").glob("*.yaml"))
        raise ValueError(f"cannot compose analysis {name!r} with overrides {list(overrides)}: {e} "
                         f"(analyses: {', '.join(known)})") from None
    node = cfg.analysis
    for key, value in (params or {}).items():
        if key not in node:
            params_known = sorted(k for k in node if not str(k).startswith("_"))
            raise KeyError(f"analysis {name!r} has no parameter {key!r} (conf/analysis/{name}.yaml: "
                           f"{', '.join(params_known)})")
        node[key] = value
    with open_dict(cfg):
        cfg.analysis_name = name
    return cfg


def run_analysis(cfg: DictConfig, output_dir: str | os.PathLike, *, context: AnalysisContext | None = None,
                 **context_args: Any) -> AnalysisResult:
    """Instantiate ``cfg.analysis`` (a partial function) and call it with one context; the one path of the
    command line and the Python API.

    Args:
        cfg: The composed ``analyze`` config.
        output_dir: Folder for the outputs.
        context: A context already built (e.g. by :meth:`AnalysisContext.create`); None: a new one.
        **context_args: :class:`AnalysisContext` keyword arguments for the new one (``use_wandb``, ``name``,
            ``encoder``, ``treebank``, ``figures``).

    Returns:
        The tables, figures and summary the analysis saved, and its return value.
    """
    if context is None:
        check_types(cfg)  # wrong types in overrides: an error naming the key, before any work
    seed_everything(int(cfg.get("seed", 0)))
    ctx = context if context is not None else AnalysisContext(cfg, output_dir, **context_args)
    fn = instantiate(cfg.analysis)
    try:
        value = fn(ctx)
        ctx.log_summary({"seconds": ctx.seconds(), "seed": int(cfg.get("seed", 0))})
        inputs = analysis_inputs(  # what it read: the treebank and encoder it built, if any
            ctx.cfg, ctx.data_dir, ctx.cache_dir, ctx.__dict__.get("treebank"), ctx.__dict__.get("encoder"))
        precision = ctx.precision_record()
        if precision.get("precision"):
            inputs["precision"] = precision["precision"]
        write_provenance(ctx.output_dir, inputs)
        return AnalysisResult(ctx.name, ctx.output_dir, dict(ctx.tables), dict(ctx.figures), dict(ctx._summary), value)
    finally:
        ctx.finish()
