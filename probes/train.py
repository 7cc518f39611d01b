"""Training entry logic: cache stage, fit, test, metrics.json (called by the top-level train.py)."""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import pytorch_lightning as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from probes.io import atomic_write_text
from probes.memory import peak_rss_mb, reset_peak_rss, set_mmap_threshold

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Build caches (stage 1), train the probe on them, test the best checkpoint; returns flat metrics."""
    reset_peak_rss()
    set_mmap_threshold(cfg.get("malloc_mmap_threshold"))
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()  # stage 1 outside the training Trainer: extract any split not cached yet
    model = instantiate(cfg.probe)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    if cfg.fit:
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
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True))
    rows = [[k, v] for k, v in sorted(metrics.items()) if isinstance(v, float)]
    for lg in loggers:
        if hasattr(lg, "log_table"):
            lg.log_table(key="results", columns=["metric", "value"], data=rows)
    log.info("metrics: %s", json.dumps(metrics, sort_keys=True))
    if loggers and hasattr(loggers[0], "experiment"):
        import wandb

        wandb.finish()
    return metrics


def _floats(d) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}
