"""wandb runs that line up in the dashboard: group, job type and name from the Hydra job.

- ``group``: the sweep in a multirun (the name of its sweep folder, shared by all its jobs), the
  experiment (else ``task_name``) in a single run.
- ``job_type``: what ran: ``probe``/``glue``/``patterns`` for training (from the package of
  ``probe._target_`` through ``job_types``), the analysis name for analyses.
- ``name``: the job's overrides (``experiment=table3_attn_glove encoder=minilm_random``), without
  ``hydra.*``/``paths.*``; the task name when there are none.
- config: the resolved config flattened to dotted keys (``probe.optimizer.lr``).

:class:`WandbRunLogger` is the training logger (``conf/logger/wandb.yaml``); analyses call
:func:`init_run` through :class:`probes.analysis.context.AnalysisContext`, and record what they read with
:func:`analysis_inputs` (the ``inputs`` of their ``provenance.json``, as training runs record theirs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import wandb
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from pytorch_lightning.loggers import WandbLogger

from probes.config import plain
from probes.report.provenance import write_provenance

log = logging.getLogger(__name__)

NAME_SKIP = ("hydra.", "paths.")  # overrides that say where, not what
NAME_MAX = 128


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


def _hydra():
    try:
        return HydraConfig.get()
    except Exception:  # not inside a Hydra job (tests composing configs)
        return None


def run_identity(task_name: str) -> dict[str, str]:
    """``group`` and ``name`` of the current Hydra job (see module doc); plain ``task_name`` outside Hydra."""
    hc = _hydra()
    if hc is None:
        return dict(group=task_name, name=task_name)
    if hc.mode == RunMode.MULTIRUN:
        group = Path(str(hc.sweep.dir)).name
    else:
        group = hc.runtime.choices.get("experiment") or task_name
    overrides = [str(o) for o in hc.overrides.task if not str(o).lstrip("+~").startswith(NAME_SKIP)]
    name = " ".join(overrides)[:NAME_MAX] or task_name
    return dict(group=str(group), name=name)


def init_run(cfg_plain: dict, *, project: str, mode: str, job_type: str, task_name: str,
             dir: str | Path, tags=(), group: str | None = None, name: str | None = None):
    """``wandb.init`` with this project's identity and the flattened config (analyses)."""
    ident = run_identity(task_name)
    return wandb.init(project=project, mode=mode, dir=str(dir), job_type=job_type, tags=list(tags),
                      group=group or ident["group"], name=name or ident["name"], config=flatten(cfg_plain),
                      reinit="finish_previous")


def analysis_inputs(cfg, data_dir, cache_dir, treebank=None, encoder=None) -> dict[str, Any]:
    """What an analysis read, for its ``provenance.json``: the data and cache folders; the treebank's file
    of the analysis's ``split`` (every split's file on disk when it names no split of the treebank) with
    its sha256; the encoder's name and weights fingerprint; the ``analysis.checkpoint`` it was given.

    ``treebank``/``encoder``: the ones the analysis built or was given (None: it read none)."""
    inputs: dict[str, Any] = dict(data_dir=str(data_dir), cache_dir=str(cache_dir))
    if treebank is not None:
        split = (cfg.get("analysis") or {}).get("split")
        splits = [split] if split in treebank.splits else [s for s in treebank.splits if treebank.path(s).is_file()]
        inputs["data_files"] = {s: dict(path=str(treebank.path(s)), sha256=treebank.file_sha256(s)) for s in splits}
    if encoder is not None:
        inputs["encoder"] = dict(name=encoder.name, fingerprint=encoder.fingerprint)
    checkpoint = (cfg.get("analysis") or {}).get("checkpoint")
    if checkpoint is not None:
        inputs["checkpoint"] = plain(checkpoint, resolve=False)
    return inputs


class WandbRunLogger(WandbLogger):
    """Lightning's WandbLogger with the project's group/job type/name, a flat config, provenance and
    optional artifacts (the checkpoints and the files matching ``prediction_files``)."""

    def __init__(self, *, save_dir: str, project: str, mode: str, task_name: str, target: str,
                 job_types: Mapping[str, str], group: str | None = None, name: str | None = None,
                 tags=(), artifacts: bool = False, prediction_files=(), **kwargs: Any):
        package = target.split(".")[1] if target.startswith("probes.") else target.split(".")[0]
        ident = run_identity(task_name)
        self.job_type = job_types.get(package, package)
        self._artifacts = bool(artifacts)
        self._prediction_files = list(prediction_files)
        self._logged_files: set[tuple[str, float]] = set()
        super().__init__(save_dir=save_dir, project=project, mode=mode, group=group or ident["group"],
                         name=name or ident["name"], job_type=self.job_type, tags=list(tags),
                         log_model=self._artifacts, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # Lightning's default; wandb warns about the key at any value
            self._wandb_init.pop("anonymous", None)
        write_provenance(save_dir)

    def log_hyperparams(self, params) -> None:
        """The resolved config, flattened to dotted keys."""
        if not isinstance(params, Mapping):
            params = vars(params)
        super().log_hyperparams(flatten(params))

    def finalize(self, status: str) -> None:
        super().finalize(status)  # checkpoints as artifacts when log_model (= artifacts) is on
        if status != "success" or not self._artifacts or self._experiment is None:
            return
        root = Path(self.save_dir)
        files = sorted({p for pat in self._prediction_files for p in root.glob(pat) if p.is_file()})
        new = [p for p in files if (str(p), p.stat().st_mtime) not in self._logged_files]
        if not new:
            return
        art = wandb.Artifact(f"predictions-{self.experiment.id}", type="predictions")
        for p in files:
            art.add_file(str(p), name=str(p.relative_to(root)))
            self._logged_files.add((str(p), p.stat().st_mtime))
        self.experiment.log_artifact(art)
        log.info("logged %d prediction files as a wandb artifact", len(files))
