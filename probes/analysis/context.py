"""The object every analysis receives: config, output folder, lazy data/model access, outputs.

An analysis is a plain function ``fn(ctx, *, split, max_sentences, **params)``; its Hydra node
(``conf/analysis/<name>.yaml``) names it with ``_target_`` and ``_partial_: true``, and
:func:`run_analysis` instantiates that node and calls it with one :class:`AnalysisContext`.

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
import random
import time
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from probes.io import atomic_write

log = logging.getLogger(__name__)

# Tables larger than this are written as CSV but not uploaded to wandb as a Table.
WANDB_TABLE_MAX_ROWS = 50_000


def _to_plain(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # e.g. ${hydra:...} outside a Hydra app
        return OmegaConf.to_container(cfg, resolve=False)


class AnalysisContext:
    """Config + output folder + lazy encoder/treebank/cache + writers (CSV/PNG/JSON, wandb)."""

    def __init__(self, cfg: DictConfig, output_dir: str | os.PathLike, use_wandb: bool | None = None,
                 name: str | None = None):
        self.cfg = cfg
        self._name = name
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        logger_cfg = cfg.get("logger") or {}
        self.use_wandb = bool(logger_cfg.get("use_wandb", False)) if use_wandb is None else use_wandb
        self._wandb_run = None
        self._summary: dict[str, Any] = {}
        self.files: list[Path] = []
        self.t0 = time.time()
        from probes.report.provenance import write_provenance

        write_provenance(self.output_dir)  # commit, machine, command (read by `python -m probes.report`)

    def seconds(self) -> float:
        """Wall time since the analysis started, rounded to 0.1 s."""
        return round(time.time() - self.t0, 1)

    # ----------------------------------------------------------------- lazy inputs
    @cached_property
    def encoder(self):
        """The frozen encoder of ``cfg.encoder`` (built on first access)."""
        from hydra.utils import instantiate

        enc = instantiate(self.cfg.encoder)
        log.info("encoder %s: %d layers x %d heads", enc.name, enc.num_layers, enc.num_heads)
        return enc

    @cached_property
    def treebank(self):
        """The treebank of ``cfg.data.treebank``."""
        from hydra.utils import instantiate

        return instantiate(self.cfg.data.treebank)

    def sentences(self, split: str, max_sentences: int | None = None):
        """The first ``max_sentences`` sentences of ``split`` (file order); all when None."""
        return self.treebank.read(split)[:max_sentences]

    def cache(self, split: str, max_sentences: int | None = None):
        """``(AttentionCache, sentences)`` of the word-level maps of ``split``, extracted if missing."""
        from probes.extract.run import ensure_cache

        return ensure_cache(self.encoder, self.treebank, split, self.cfg.extract, self.cfg.paths.cache_dir,
                            max_sentences)

    @property
    def device(self) -> str:
        import torch

        want = (self.cfg.get("analysis_device") or "auto")
        if want == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return want

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
            from probes.report.tracking import init_run

            lc = self.cfg.logger
            self._wandb_run = init_run(
                _to_plain(self.cfg), project=lc.get("project", "probes"), mode=lc.get("mode", "offline"),
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
        from probes.measures import build, from_config

        if kind is None:
            return from_config(self.extract_cfg)
        return kind, build(kind, self.extract_cfg.get("measures"))

    def finish(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    # ----------------------------------------------------------------- outputs
    def save_table(self, df, name: str) -> Path:
        """Write ``df`` to ``<output_dir>/<name>.csv`` (atomic) and log it as a wandb Table."""
        path = self.output_dir / f"{name}.csv"
        atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))
        self.files.append(path)
        log.info("wrote %s (%d rows)", path, len(df))
        run = self.wandb_run
        if run is not None and len(df) <= WANDB_TABLE_MAX_ROWS:
            import wandb

            run.log({f"{name}": wandb.Table(dataframe=df.reset_index(drop=True))})
        return path

    def save_figure(self, fig, name: str, dpi: int = 120) -> Path:
        """Write ``fig`` to ``<output_dir>/<name>.png`` (atomic), log it as a wandb Image, close it."""
        import matplotlib.pyplot as plt

        path = self.output_dir / f"{name}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
        self.files.append(path)
        run = self.wandb_run
        if run is not None:
            import wandb

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


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_analysis(cfg: DictConfig, output_dir: str | os.PathLike) -> Any:
    """Instantiate ``cfg.analysis`` (a partial function) and call it with a fresh context."""
    from hydra.utils import instantiate

    seed_everything(int(cfg.get("seed", 0)))
    ctx = AnalysisContext(cfg, output_dir)
    fn = instantiate(cfg.analysis)
    try:
        result = fn(ctx)
        ctx.log_summary({"seconds": ctx.seconds(), "seed": int(cfg.get("seed", 0))})
        return result
    finally:
        ctx.finish()
