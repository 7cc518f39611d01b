"""Training entry logic: cache stage, fit, test, metrics.json (called by the top-level train.py).

Multi-process training (``trainer.devices=N trainer.strategy=ddp``, ``trainer.num_nodes``): Lightning's
launcher starts ranks 1..N-1 by running the same command line again, which under Hydra would compose
the config anew and open a run folder per process (in a multirun: a whole new sweep). Rank 0 therefore
writes its resolved config to ``<run dir>/.ddp_config.yaml`` and names it in ``PROBES_DDP_CONFIG``
before the processes start; ``train.py`` in a started rank (``LOCAL_RANK`` > 0 with that variable set)
skips Hydra and trains from that file (:func:`run_ddp_rank`), so a DDP run has one folder, one
``metrics.json`` (written by rank 0) and one wandb run (Lightning logs from rank 0 only). Ranks started by
SLURM (submitit) get the job's config from the launcher and need none of this.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import resource
from pathlib import Path

import pytorch_lightning as pl
import wandb
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from probes.io import atomic_write_text
from probes.memory import peak_rss_mb, reset_peak_rss, set_mmap_threshold
from probes.report.provenance import write_provenance

log = logging.getLogger(__name__)

DDP_CONFIG_ENV = "PROBES_DDP_CONFIG"


def objective(metrics: dict, name: str) -> float:
    """The value a sweeper optimises: ``metrics[name]`` (``optimized_metric`` of the config)."""
    if name not in metrics:
        raise KeyError(f"optimized_metric '{name}' is not among this run's metrics: "
                       f"{sorted(k for k, v in metrics.items() if isinstance(v, float))}")
    return float(metrics[name])


def run_ddp_rank() -> bool:
    """In a DDP rank started by Lightning's launcher (``LOCAL_RANK`` > 0 and ``PROBES_DDP_CONFIG`` set by
    rank 0): train from rank 0's resolved config, without Hydra; returns False in any other process."""
    path = os.environ.get(DDP_CONFIG_ENV)
    if not path or int(os.environ.get("LOCAL_RANK", "0")) == 0:
        return False
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    train(OmegaConf.load(path))
    return True


def _share_config_with_ranks(cfg: DictConfig, trainer: pl.Trainer, out: Path) -> Path | None:
    """Rank 0 of a multi-process run that Lightning launches: the resolved config for the other ranks."""
    if trainer.world_size == 1 or trainer.global_rank != 0 or os.environ.get(DDP_CONFIG_ENV):
        return None
    if not isinstance(getattr(trainer.strategy, "launcher", None), _SubprocessScriptLauncher) or \
            trainer.strategy.cluster_environment.creates_processes_externally:
        return None  # ranks started by SLURM / torchrun, or spawned (ddp_spawn): they share this config already
    path = out / ".ddp_config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    os.environ[DDP_CONFIG_ENV] = str(path)
    return path


def _standard_process_start() -> None:
    """In a joblib worker (``hydra/launcher=joblib``) the default multiprocessing context is loky's, which
    data-loader workers cannot use: back to the platform's default start method."""
    if mp.get_start_method(allow_none=True) == "loky":
        mp.set_start_method(None, force=True)


def train(cfg: DictConfig) -> dict[str, float]:
    """Build caches (stage 1), train the probe on them, test the best checkpoint; returns flat metrics.

    A probe without trainable parameters (``probe=right_branching``) is scored without fitting, as with
    ``fit=false`` (logged): its validation and test scores, no checkpoint."""
    _standard_process_start()
    reset_peak_rss()
    set_mmap_threshold(cfg.get("malloc_mmap_threshold"))
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()  # stage 1 outside the training Trainer: extract any split not cached yet
    model = instantiate(cfg.probe)
    model.build(datamodule)  # parts sized by the data, so that `trainable` sees every parameter
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    out = Path(cfg.paths.output_dir)
    shared = _share_config_with_ranks(cfg, trainer, out)
    try:
        return _fit_and_test(cfg, datamodule, model, trainer, loggers, out)
    finally:
        if shared is not None:
            os.environ.pop(DDP_CONFIG_ENV, None)
            shared.unlink(missing_ok=True)


def _fit_and_test(cfg: DictConfig, datamodule, model, trainer: pl.Trainer, loggers: list, out: Path
                  ) -> dict[str, float]:
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    fit = cfg.fit
    if fit and not model.trainable():
        log.info("%s has no trainable parameters: scored without fitting (as with fit=false)", cfg.probe._target_)
        fit = False
    if fit:
        trainer.fit(model, datamodule=datamodule)
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None
        metrics = _floats(trainer.callback_metrics)
    else:
        ckpt = None
        metrics = _floats(trainer.validate(model, datamodule=datamodule)[0])
    if cfg.test:
        metrics.update(_floats(trainer.test(model, datamodule=datamodule, ckpt_path=ckpt or None)[0]))
    if ckpt:
        metrics["best_checkpoint"] = ckpt
    metrics.update(getattr(datamodule, "summary", dict)())
    metrics["sys/peak_rss_mb"] = peak_rss_mb()  # this job's peak, also within a multirun
    # largest child process (data-loader workers; forked, so most of their pages are shared with this one)
    metrics["sys/peak_rss_children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if trainer.world_size > 1:
        metrics["sys/world_size"] = float(trainer.world_size)
    if not trainer.is_global_zero:  # DDP: rank 0 writes the run's files (the metrics are synced)
        return metrics
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True))
    # commit, machine, command, environment and what the run read: every run, with or without a logger
    inputs = dict(data_dir=str(cfg.paths.data_dir), cache_dir=str(cfg.paths.cache_dir))
    if hasattr(datamodule, "provenance"):
        inputs.update(datamodule.provenance())
    write_provenance(out, inputs)
    rows = [[k, v] for k, v in sorted(metrics.items()) if isinstance(v, float)]
    for lg in loggers:
        if hasattr(lg, "log_table"):
            lg.log_table(key="results", columns=["metric", "value"], data=rows)
    log.info("metrics: %s", json.dumps(metrics, sort_keys=True))
    if loggers and hasattr(loggers[0], "experiment"):
        wandb.finish()
    return metrics


def _floats(d) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}
