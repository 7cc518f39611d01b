"""``analysis=layer_decay``: does the top layers' attention change (Kovaleva et al. 2019, Fig 5) follow
the learning-rate profile, the gradient profile, or neither?

Reads GLUE fine-tuning runs trained with different ``probe.layer_decay`` (encoder layer l at
lr * decay^(L - l)) and sets three per-layer profiles side by side for each run:

* attention change: 1 - cos(pre-trained map, fine-tuned map) per head on dev examples, mean over the
  layer's heads (:func:`probes.analysis.kovaleva.finetune_cosine.attention_cosine`);
* gradient norm: the run's ``grad_norms.csv`` (callback ``GradNormLog``), mean over the last epoch's
  optimizer steps of each layer's gradient L2 norm;
* weight change: ||W_tuned - W_pre|| / ||W_pre|| over each layer's parameters (layers as in
  :func:`probes.model.layers.parameter_layers`: 0 = embeddings, 1..L blocks, L + 1 = output side).

Each run's task and decay come from its ``.hydra/config.yaml`` (``data.task``, ``probe.layer_decay``),
its dev metrics from ``metrics.json``. Outputs: ``layer_decay.csv`` (task, decay, layer 0..L+1,
attention_change (blocks only), grad_norm, weight_change), ``layer_decay_runs.csv`` (task, decay,
dev metrics, run), ``layer_decay.png`` (rows: the three profiles; columns: tasks; one line per decay).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from probes.analysis.kovaleva.common import glue_batches, load_checkpoint
from probes.analysis.kovaleva.finetune_cosine import attention_cosine
from probes.analysis.plots import layer_ticks
from probes.model.layers import parameter_layers
from probes.glue.export import EXPORT_INFO, hf_folder

log = logging.getLogger(__name__)


def run_setting(run: str | Path) -> tuple[str, float]:
    """(task, layer_decay) of a GLUE run folder: its exported ``hf_model/glue_task.json``, or for runs
    exported before the decay was recorded there, the run's ``.hydra/config.yaml``."""
    folder = hf_folder(run)
    info_path = folder / EXPORT_INFO if folder is not None else Path(run) / "hf_model" / EXPORT_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    hydra_cfg = Path(run) / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(hydra_cfg) if hydra_cfg.exists() else OmegaConf.create()
    task = info.get("task") or OmegaConf.select(cfg, "data.task")
    decay = info.get("layer_decay", OmegaConf.select(cfg, "probe.layer_decay"))
    if task is None or decay is None:
        raise FileNotFoundError(f"{run}: neither {info_path} nor {hydra_cfg} gives the task and probe.layer_decay "
                                f"(not a GLUE run folder of `python train.py experiment=glue_<task>`)")
    return str(task), float(decay)


@torch.no_grad()
def weight_change(pre: torch.nn.Module, tuned: torch.nn.Module) -> dict[int, float]:
    """``{layer: ||W_tuned - W_pre|| / ||W_pre||}`` over each layer's parameters (layer numbering of
    :func:`probes.model.layers.parameter_layers`); both models must have the same parameter names."""
    layer_of = parameter_layers(pre)
    theirs = dict(tuned.named_parameters())
    diff: dict[int, float] = {}
    norm: dict[int, float] = {}
    for name, p in pre.named_parameters():
        if name not in theirs:
            raise KeyError(f"parameter {name} of the pre-trained encoder is missing in the fine-tuned one")
        q = theirs[name]
        if q.shape != p.shape:
            raise ValueError(f"parameter {name}: shape {tuple(q.shape)} vs {tuple(p.shape)}")
        l = layer_of[name]
        diff[l] = diff.get(l, 0.0) + float(((q.double() - p.double()) ** 2).sum())
        norm[l] = norm.get(l, 0.0) + float((p.double() ** 2).sum())
    return {l: (diff[l] / norm[l]) ** 0.5 for l in sorted(diff) if norm[l] > 0}


def grad_profile(run: str | Path) -> dict[int, float]:
    """``{layer: mean gradient norm}`` over the last epoch in ``<run>/grad_norms.csv`` (layers only)."""
    path = Path(run) / "grad_norms.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (train with callbacks=glue, which logs gradient norms)")
    g = pd.read_csv(path)
    g = g[(g.epoch == g.epoch.max()) & g.group.str.startswith("layer_")]
    return {int(r.layer): float(r["mean"]) for _, r in g.iterrows()}


def profile_figure(df: pd.DataFrame):
    """3 x (tasks) panels: attention change, gradient norm, weight change per block, one line per decay."""
    tasks = list(dict.fromkeys(df.task))
    rows = [("attention_change", "attention change\n1 - cos"), ("grad_norm", "mean gradient norm"),
            ("weight_change", "weight change\n||dW|| / ||W||")]
    fig, axes = plt.subplots(3, len(tasks), figsize=(3.6 * len(tasks) + 0.8, 7.5), squeeze=False, sharex=True)
    blocks = df[df.block]
    cmap = plt.get_cmap("coolwarm")
    for j, task in enumerate(tasks):
        for d in sorted(set(df.decay)):
            t = blocks[(blocks.task == task) & (blocks.decay == d)].sort_values("layer")
            if t.empty:
                continue
            # one learning rate: black; top layers faster (decay < 1): red; bottom layers faster: blue
            c = "k" if d == 1 else cmap(0.0 if d > 1 else 1.0)
            what = "one lr" if d == 1 else "top layers faster" if d < 1 else "bottom layers faster"
            for i, (col, _) in enumerate(rows):
                axes[i, j].plot(t.layer, t[col], "o-", color=c, label=f"decay {d:g} ({what})")
        axes[0, j].set_title(task, fontsize=10)
        axes[-1, j].set_xlabel("layer (1-based)")
        layer_ticks(axes[-1, j], int(blocks.layer.min()), int(blocks.layer.max()))
    for i, (_, label) in enumerate(rows):
        axes[i, 0].set_ylabel(label, fontsize=9)
        for ax in axes[i]:
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def layer_decay(ctx, *, runs, split: str = "dev", max_examples: int | None = None, batch_size: int = 32,
                max_length: int = 128) -> pd.DataFrame:
    """Attention change, gradient norm and weight change per layer of every run; saves tables and figure."""
    if not runs:
        raise ValueError("set analysis.runs=[<GLUE run dir>, ...] (runs of `python train.py experiment=glue_<task> "
                         "probe.layer_decay=<d>`)")
    pre = ctx.encoder.model.to(ctx.device)
    rows, metas = [], []
    for run in runs:
        task, decay = run_setting(run)
        ft = load_checkpoint(ctx, run, task, compare=True)
        tuned = ft.model.to(ctx.device)
        _, batches = glue_batches(ctx, ft, split, max_examples, max_length, batch_size)
        cos, n = attention_cosine(pre, tuned, batches, ctx.device)                 # (L, H)
        change = 1.0 - cos.mean(1)                                                 # (L,) blocks 1..L
        grads, weights = grad_profile(run), weight_change(pre, ft.base)
        L = cos.shape[0]
        for l in sorted(set(weights) | set(grads)):
            rows.append(dict(task=ft.task, decay=decay, layer=l, block=1 <= l <= L,
                             attention_change=float(change[l - 1]) if 1 <= l <= L else np.nan,
                             grad_norm=grads.get(l, np.nan), weight_change=weights.get(l, np.nan)))
        metrics_path = Path(run) / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        metas.append(dict(task=ft.task, decay=decay, n_examples=n, run=str(run),
                          **{k: v for k, v in metrics.items() if k.startswith("val/") and isinstance(v, float)}))
        log.info("layer_decay %s decay %g: attention change per layer %s", ft.task, decay,
                 " ".join(f"{x:.2e}" for x in change))
    df = pd.DataFrame(rows)
    ctx.save_table(df, "layer_decay")
    ctx.save_table(pd.DataFrame(metas), "layer_decay_runs")
    ctx.save_figure(profile_figure(df), "layer_decay")
    ctx.log_summary(dict(analysis="layer_decay", split=split, encoder=ctx.encoder.name, runs=len(runs),
                         seconds=ctx.seconds()))
    return df
