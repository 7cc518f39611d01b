"""Training entry logic: cache stage, fit, test, metrics.json (called by the top-level train.py).

Multi-process training (``trainer.devices=N trainer.strategy=ddp``, ``trainer.num_nodes``): Lightning's
launcher starts ranks 1..N-1 by running the same command line again, which under Hydra would compose
the config anew and open a run folder per process (in a multirun: a whole new sweep). Rank 0 therefore
writes its resolved config to ``<run dir>/.ddp_config.yaml`` and names it in ``PROBES_DDP_CONFIG``
before the processes start; ``train.py`` in a started rank (``LOCAL_RANK`` > 0 with that variable set)
skips Hydra and trains from that file (:func:`run_ddp_rank`), so a DDP run has one folder, one
``metrics.json`` (written by rank 0) and one wandb run (Lightning logs from rank 0 only). Ranks started by
SLURM (submitit) get the job's config from the launcher and need none of this.

Resuming (``python train.py resume=<run folder>``, :func:`resume_from_argv`): every run writes
``checkpoints/last.ckpt`` at the end of each epoch (:class:`probes.training.callbacks.LastCheckpoint`); a killed
run continues in its own folder from that file, with the config it was started with (``.hydra/config.yaml``),
and writes its outputs there (atomically, over those of the killed run). A run that had finished (its
``metrics.json`` written) is left as it was: its record (metrics, predictions, provenance) is not rewritten.
Checkpoints are loaded weights-only (:mod:`probes.training.checkpoint`): a ``last.ckpt`` holding more than tensors
and plain values is refused, naming the file, before anything in it could run.

A run's record: every stage's data is read and checked before a logger exists (a format error stops the run
before a wandb run or a ``provenance.json`` is started), and a run that fails logs its traceback into its log file
(``<run dir>/train.log``, Hydra's job log; a resumed run's appends to it), not onto the terminal: there
``train.py`` (:func:`reported`) prints one message, the error and the log file holding its traceback, and exits
with status 1 (``HYDRA_FULL_ERROR=1``: the traceback on the terminal too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing as mp
import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytorch_lightning as pl
import wandb
from hydra.utils import instantiate
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from probes.config import check_types, plain
from probes.extract.settings import ExtractSettings
from probes.io import atomic_write_text
from probes.memory import peak_rss_mb, reset_peak_rss, set_mmap_threshold
from probes.report.provenance import write_provenance
from probes.stats import seed_everything
from probes.training.callbacks import LAST, LastCheckpoint
from probes.training.checkpoint import load_checkpoint, refuse_unsafe

log = logging.getLogger(__name__)

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job log format
DDP_CONFIG_ENV = "PROBES_DDP_CONFIG"
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # "1": Hydra raises a job's error on, with its traceback, instead of printing it
LOGGED_NOTE = "the traceback is in "  # the note a failure gets once its traceback is in the run's log file
PRECISION_FILE = "precision.json"
METRICS_FILE = "metrics.json"  # written last by a run that finished: its result


class NonFiniteMetricsError(FloatingPointError):
    """A run ended with NaN or infinite metrics (the message names them); nothing is written as its result."""


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
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    train(OmegaConf.load(path))
    return True


def resume_from_argv(argv: list[str] | None = None) -> bool:
    """``train.py resume=<run folder>``: continue that run (:func:`resume`) and return True; False when the
    command line has no ``resume=`` (a plain Hydra run). ``resume`` takes no other argument: the run goes on
    with the config it was started with."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = [a for a in argv if a.startswith("resume=")]
    if not given or given[0] in ("resume=null", "resume="):
        return False
    others = [a for a in argv if a not in given]
    if others or len(given) > 1:
        raise SystemExit(f"resume=<run folder> takes no other arguments (the run continues with the config it was "
                         f"started with, <folder>/.hydra/config.yaml); got also {others or given[1:]}")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    resume(given[0].split("=", 1)[1])
    return True


def resume_config(folder: str | os.PathLike) -> DictConfig:
    """The config a training run in ``folder`` was started with (``.hydra/config.yaml``), its output folder set
    to ``folder`` and ``resume`` to it; an error naming what is missing (folder, config, checkpoint)."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"resume={folder}: no such run folder")
    config = folder / ".hydra" / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"resume={folder}: {config} is missing (the config the run was started with, "
                                "written by `python train.py` into every run folder): cannot resume")
    last_checkpoint(folder)
    cfg = OmegaConf.load(config)
    with open_dict(cfg):
        cfg.paths.output_dir = str(folder)  # in place of ${hydra:runtime.output_dir} (also if the folder moved)
        cfg.resume = str(folder)
    return cfg


def last_checkpoint(folder: str | os.PathLike) -> Path:
    """``<folder>/checkpoints/last.ckpt``; an error when the run wrote none (killed in its first epoch, or
    ``fit=false``)."""
    path = Path(folder) / "checkpoints" / LAST
    if not path.is_file():
        raise FileNotFoundError(f"resume={folder}: no checkpoint to resume from ({path} is missing: the run was "
                                "killed before the end of its first epoch, or did not train); start it again")
    return path


def resume(folder: str | os.PathLike) -> dict[str, float]:
    """Continue the killed training run in ``folder`` from its ``checkpoints/last.ckpt`` with the config it was
    started with; its outputs (metrics, predictions, provenance) are written into ``folder``. A run that had
    finished (its ``metrics.json`` written) is left as it was (logged): its metrics are returned.

    ``last.ckpt`` is read weights-only first (:func:`probes.training.checkpoint.load_checkpoint`): a file holding
    more than tensors and plain values is refused with an error naming it, logged to ``<folder>/train.log``."""
    cfg = resume_config(folder)
    hydra_yaml = Path(cfg.resume) / ".hydra" / "hydra.yaml"
    if hydra_yaml.is_file() and not HydraConfig.initialized():  # the job's Hydra record (choices, overrides)
        try:
            record = OmegaConf.load(hydra_yaml).hydra
            # the keys HydraConf has: Hydra 1.3 writes an `env` node that its own HydraConf lacks
            known = [f.name for f in dataclasses.fields(HydraConf) if f.name in record]
            node = OmegaConf.merge(OmegaConf.structured(HydraConf), OmegaConf.masked_copy(record, known))
            HydraConfig.instance().set_config(OmegaConf.create({"hydra": node}))
        except Exception as e:  # a record of another Hydra version: provenance names the resume command only
            log.warning("could not read %s (%s): provenance records the resume command only", hydra_yaml, e)
    handler = logging.FileHandler(Path(cfg.resume) / "train.log")  # Hydra's job log, appended to
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    try:
        with failure_logged():
            ckpt = last_checkpoint(cfg.resume)
            state = load_checkpoint(ckpt, map_location="cpu", mmap=True)  # refused unless weights-only
        epoch = state.get("epoch") if isinstance(state, dict) else None
        del state  # its tensors map the file
        done = f"epoch {epoch + 1 if isinstance(epoch, int) else '?'} of {cfg.trainer.get('max_epochs')}"
        metrics = Path(cfg.resume) / METRICS_FILE
        if metrics.is_file():
            log.info("run %s had finished (%s; %s written); its record is left as it was", cfg.resume, done,
                     METRICS_FILE)
            return json.loads(metrics.read_text())
        log.info("resuming %s from %s (%s)", cfg.resume, ckpt, done)
        return train(cfg)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


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


@contextmanager
def failure_logged() -> Iterator[None]:
    """An exception raised within is logged with its traceback and raised on: into the run's log files only (the
    root logger's file handlers: Hydra's ``<run dir>/train.log``, a resumed run's), noted on the exception
    (``LOGGED_NOTE``) for the one message :func:`reported` prints; with no log file, as a plain error record (on
    the console). Logged once, also through nested blocks."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        if not getattr(e, "_probes_logged", False):
            e._probes_logged = True
            files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
            if not files:  # e.g. a DDP rank > 0: the console's
                log.exception("the run failed: %s", type(e).__name__)
                e.add_note(LOGGED_NOTE + "the log above")
                raise
            record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "the run failed: %s: %s",
                                    (type(e).__name__, _message(e)), (type(e), e, e.__traceback__))
            for h in files:
                if record.levelno >= h.level:
                    h.handle(record)
            e.add_note(LOGGED_NOTE + ", ".join(h.baseFilename for h in files))
        raise


def _message(e: BaseException) -> str:
    """An exception's message (a KeyError's without the quotes ``str`` adds)."""
    return str(e.args[0]) if isinstance(e, KeyError) and len(e.args) == 1 else str(e)


def failure_message(e: BaseException) -> str:
    """The one message on the terminal for an error of ``train.py``: Hydra's compact errors (a bad override) as
    Hydra words them; any other as ``<type>: <message>`` with the log file that holds its traceback, or, when
    none does, how to see it."""
    if isinstance(e, CompactHydraException):
        cause = e.__cause__
        return str(e) + (f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else "")
    notes = getattr(e, "__notes__", [])
    text = f"{type(e).__name__}: {_message(e)}".rstrip()
    if not any(n.startswith(LOGGED_NOTE) for n in notes):
        notes = [*notes, f"(set {FULL_ERROR_ENV}=1 for the traceback)"]
    return "\n".join([text, *notes])


@contextmanager
def reported() -> Iterator[None]:
    """``train.py``'s command line: an error raised within ends the process with status 1 after one message on
    stderr (:func:`failure_message`; its traceback is in the run's log file, :func:`failure_logged`), in
    place of Hydra's report, which prints the traceback (Hydra raises the error on while ``HYDRA_FULL_ERROR=1``
    is set here). A user's own ``HYDRA_FULL_ERROR=1``: the traceback on the terminal as Hydra does."""
    if os.environ.get(FULL_ERROR_ENV) == "1":
        yield
        return
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        yield
    except Exception as e:
        print(failure_message(e), file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        os.environ.pop(FULL_ERROR_ENV, None)


def train(cfg: DictConfig) -> dict[str, float]:
    """Build caches (stage 1), train the probe on them, test the best checkpoint; returns flat metrics.

    A probe without trainable parameters (``probe=right_branching``) is scored without fitting, as with
    ``fit=false`` (logged): its validation and test scores, no checkpoint. Every stage's data is read (the
    datamodule's ``setup``) before the loggers are made, so a format error in it stops the run before a wandb run
    or a provenance file is started; a failure is logged with its traceback (the run folder's log file)."""
    with failure_logged():
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, float]:
    _standard_process_start()
    check_types(cfg)  # wrong types in overrides: an error naming the key, before any work
    reset_peak_rss()
    set_mmap_threshold(cfg.get("malloc_mmap_threshold"))
    seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()  # stage 1 outside the training Trainer: extract any split not cached yet
    model = instantiate(cfg.probe)
    model.build(datamodule)  # parts sized by the data, so that `trainable` sees every parameter
    # every stage's data read and checked now, not in Lightning's `setup` (which then finds it read): a format error
    # stops the run before a logger starts a wandb run or writes provenance.json
    for stage in ("fit" if cfg.fit and model.trainable() else "validate", *(["test"] if cfg.test else [])):
        datamodule.setup(stage)
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
        lg.log_hyperparams(plain(cfg))

    fit = cfg.fit
    if fit and not model.trainable():
        log.info("%s has no trainable parameters: scored without fitting (as with fit=false)", cfg.probe._target_)
        fit = False
    resume_from = cfg.get("resume")
    if resume_from and not fit:
        raise ValueError(f"resume={resume_from}: this run does not train (fit=false or no trainable parameters)")
    if fit:
        if resume_from and not any(isinstance(c, LastCheckpoint) for c in trainer.callbacks):
            raise ValueError(f"resume={resume_from}: the run's callbacks have no last_checkpoint "
                             "(probes.training.callbacks.LastCheckpoint), so it cannot go on saving its state")
        ckpt_path = str(last_checkpoint(resume_from)) if resume_from else None
        with refuse_unsafe(ckpt_path):  # the full state, weights-only (tensors and plain values)
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None
        metrics = _floats(trainer.callback_metrics)
    else:
        ckpt = None
        metrics = _floats(trainer.validate(model, datamodule=datamodule)[0])
    if cfg.test:
        with refuse_unsafe(ckpt):  # a resumed run's best checkpoint is named by its last.ckpt
            metrics.update(_floats(trainer.test(model, datamodule=datamodule, ckpt_path=ckpt or None,
                                                weights_only=True)[0]))
    if ckpt:
        metrics["best_checkpoint"] = ckpt
    metrics.update(getattr(datamodule, "summary", dict)())
    metrics["sys/peak_rss_mb"] = peak_rss_mb()  # this job's peak, also within a multirun
    # largest child process (data-loader workers; forked, so most of their pages are shared with this one)
    metrics["sys/peak_rss_children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if trainer.world_size > 1:
        metrics["sys/world_size"] = float(trainer.world_size)
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:  # a run never ends as a result with NaN or infinite numbers
        raise NonFiniteMetricsError(f"non-finite metrics {bad} (run folder {out}): no metrics.json written; "
                                    f"all metrics: {json.dumps(metrics, sort_keys=True, default=str)}")
    if not trainer.is_global_zero:  # DDP: rank 0 writes the run's files (the metrics are synced)
        return metrics
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / METRICS_FILE, json.dumps(metrics, indent=1, sort_keys=True))
    # commit, machine, command, environment and what the run read: every run, with or without a logger
    inputs = dict(data_dir=str(cfg.paths.data_dir), cache_dir=str(cfg.paths.cache_dir))
    if hasattr(datamodule, "provenance"):
        inputs.update(datamodule.provenance())
    precision = precision_record(cfg, trainer)
    atomic_write_text(out / PRECISION_FILE, json.dumps(precision, indent=1, sort_keys=True, default=str))
    if precision.get("extract", {}).get("precision"):
        inputs["precision"] = precision["extract"]["precision"]
    if cfg.get("resume"):
        inputs["resumed_from"] = str(last_checkpoint(cfg.resume))
    write_provenance(out, inputs)
    rows = [[k, v] for k, v in sorted(metrics.items()) if isinstance(v, float)]
    for lg in loggers:
        if hasattr(lg, "log_table"):
            lg.log_table(key="results", columns=["metric", "value"], data=rows)
    log.info("metrics: %s", json.dumps(metrics, sort_keys=True))
    if loggers and hasattr(loggers[0], "experiment"):
        wandb.finish()
    return metrics


def precision_record(cfg: DictConfig, trainer: pl.Trainer) -> dict:
    """The run's ``precision.json``: the training Trainer's precision and, for a run on cached maps (a data node
    with ``encoder`` and ``extract``), the extraction precision's decision and timings
    (:func:`probes.extract.precision.record`; the encoder's config is read, not its weights)."""
    out: dict = dict(trainer=str(trainer.precision))
    data = cfg.get("data") or {}
    if data.get("extract") is not None and data.get("encoder") is not None:
        settings = ExtractSettings.from_config(data.extract)
        out["extract"] = settings.precision_record(instantiate(data.encoder), cfg.paths.cache_dir)
    return out


def _floats(d) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}
