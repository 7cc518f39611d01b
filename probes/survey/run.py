"""Run the survey's steps for one model (:func:`run_survey`), with the facts the steps need (:func:`model_facts`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from probes.config import PROJECT_ROOT, plain
from probes.survey.steps import RECORD, ModelFacts, Step, display, recorded, run_step

log = logging.getLogger(__name__)


def depth_layers(num_layers: int, n: int) -> list[int]:
    """Layers at ``n`` evenly spaced relative depths of hidden states 0..L: ``round(k L / (n - 1))``, distinct."""
    if n < 2:
        raise ValueError(f"conf/survey.yaml: structural_depths must be at least 2, got {n}")
    return sorted({round(k * num_layers / (n - 1)) for k in range(n)})


def model_facts(cfg: DictConfig, model: str, overrides: Sequence[str] = ()) -> ModelFacts:
    """The surveyed model's facts from its config alone (``cfg.encoder`` built, weights not loaded)."""
    if model not in cfg.own_loss:
        raise ValueError(f"conf/survey.yaml own_loss: no entry for encoder={model} (the no-op test needs the "
                         f"model's own loss: one of the keys of conf/analysis/grad_sep.yaml objectives)")
    enc = instantiate(cfg.encoder)
    layers = depth_layers(enc.num_layers, int(cfg.structural_depths))
    return ModelFacts(model=model, name=enc.name, num_layers=enc.num_layers, num_heads=enc.num_heads,
                      causal=bool(enc.causal), objective=str(cfg.own_loss[model]),
                      layers=",".join(map(str, layers)), overrides=tuple(overrides), weights=enc.weights)


def run_survey(cfg: DictConfig, model: str, overrides: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Run ``cfg.steps`` (or ``cfg.only``) for ``model`` (``conf/encoder/<model>.yaml``; ``overrides``: the
    ``encoder.*`` overrides passed to every step) with ``cfg.sizes`` updated by ``cfg.model_sizes[model]``;
    returns step -> record. Steps with a record of the same
    command are skipped unless ``cfg.force``. A failing step is logged and the next one runs; the survey then
    raises, naming every failed step."""
    steps: dict[str, Step] = {k: instantiate(v) for k, v in cfg.steps.items()}
    entries = {k: instantiate(v) for k, v in cfg.entries.items()}
    names = list(steps) if cfg.only is None else list(cfg.only)
    unknown = [n for n in names if n not in steps]
    if unknown:
        raise ValueError(f"conf/survey.yaml only: {unknown} are not steps ({list(steps)})")
    facts = model_facts(cfg, model, overrides)
    extra_sizes = plain(cfg.model_sizes.get(model) or {})
    unknown = sorted(set(extra_sizes) - set(cfg.sizes))
    if unknown:
        raise ValueError(f"conf/survey.yaml model_sizes.{model}: {unknown} are not keys of sizes ({list(cfg.sizes)})")
    sizes = {**plain(cfg.sizes), **extra_sizes}
    records_dir, work_dir = Path(cfg.records_dir) / model, Path(cfg.work_dir) / model
    argvs = {n: steps[n].command(entries, facts, sizes) for n in names}  # every placeholder checked up front
    extra = dict(model=model, name=facts.name, num_layers=facts.num_layers, num_heads=facts.num_heads,
                 causal=facts.causal, weights=facts.weights, sizes=sizes)
    out, failed = {}, []
    for n in tqdm(names, desc=f"survey {model}", unit="step", disable=None):
        argv, record_dir = argvs[n], records_dir / n
        if not cfg.force and recorded(record_dir, display(argv), sizes):
            log.info("survey %s/%s: recorded, skipped (%s)", model, n, record_dir)
            out[n] = json.loads((record_dir / RECORD).read_text())
            continue
        run_dir = work_dir / n
        log.info("survey %s/%s: %s", model, n, display(argv))
        where = entries[steps[n].entry].where(run_dir, steps[n].multirun)
        try:
            out[n] = run_step(n, steps[n], argv, where, run_dir, record_dir, extra, cwd=PROJECT_ROOT)
        except (RuntimeError, FileNotFoundError) as e:  # the other steps still run; the survey fails at the end
            log.error("%s", e)
            failed.append(str(e))
            continue
        log.info("survey %s/%s: %.0f s", model, n, out[n]["wall_time_s"])
    if failed:
        raise RuntimeError(f"survey {model}: {len(failed)} of {len(names)} steps failed:\n" + "\n".join(failed))
    return out
