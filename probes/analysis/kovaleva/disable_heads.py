"""``analysis=disable_heads``: Kovaleva et al. 2019 §5 (Figs 8-9) — disable one attention head, or
one whole layer, of a fine-tuned GLUE model and measure the task metric on the dev set.

"Disabling" = the head's attention is replaced by uniform attention over the real tokens
(``probes.model.hooks.attention(model, [], uniform={layer: [heads]})``; Kovaleva et al. also set the
head's attention to uniform). The model is scored with nothing disabled, with each single
(layer, head) disabled, and with each layer's heads all disabled. Needs ``analysis.checkpoint`` (an
``hf_model`` folder or a run folder holding one, or a Lightning ``.ckpt`` built on ``encoder``);
several at once as a {task: path} mapping.

Decoders (causal LMs) work the same way: their ``*ForSequenceClassification`` (Llama, Qwen, GPT-2, ...)
pools the last real token of each right-padded row (the checkpoint's config needs a ``pad_token_id``),
and a disabled head's "uniform over the real tokens" is uniform over the keys its causal row sees
(itself and the earlier tokens). Checked in ``tests/test_decoder_analyses.py`` on a tiny Llama.

``reuse_prefix`` (default): the outputs of the layers below the disabled one cannot change, so they
are taken from the plain run (``probes.model.prefix_cache.PrefixCache``) and only layers >= l are computed;
exact. Models whose blocks are shared across layers (ALBERT) always run in full.

Outputs, per task: ``disable_heads_<task>.csv`` (tidy: task, condition ∈ {none, head, layer},
layer, head (-1 for a whole layer / none), name (1-based `layer-head`, `L<l>`, `none`), metric,
value, baseline, delta = value - baseline), ``disable_heads_<task>.png`` (layer x head heatmap of
the change of the main metric, 1-based axes), ``disable_layers_<task>.png`` (bar per layer),
``summary.json``.
"""

from __future__ import annotations

import logging
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from probes.analysis import plots
from probes.analysis.kovaleva.common import checkpoints, glue_batches, load_checkpoint
from probes.analysis.naming import head_name
from probes.data.glue import task_spec
from probes.glue.evaluate import MODEL_KEYS
from probes.glue.metrics import score
from probes.model import hooks, structure
from probes.model.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


def disabled(condition: str, layer: int, head: int, num_heads: int) -> dict[int, list[int]]:
    """The ``uniform`` argument of :func:`probes.model.hooks.attention` for one condition:
    ``none`` -> {}, ``head`` -> {layer: [head]}, ``layer`` -> {layer: all heads}."""
    if condition == "none":
        return {}
    if condition == "head":
        return {layer: [head]}
    if condition == "layer":
        return {layer: list(range(num_heads))}
    raise ValueError(f"condition must be none, head or layer, got {condition!r}")


def disable_scores(model, batches, task: str, num_layers: int, num_heads: int, device="cpu",
                   heads: bool = True, layers: bool = True, progress: bool = True,
                   reuse_prefix: bool = True) -> pd.DataFrame:
    """Tidy scores for: nothing disabled, each single head, each whole layer (0-based indices).

    `reuse_prefix`: compute only layers >= l when layer l is touched (`PrefixCache`); exact."""
    conditions = [("none", -1, -1)]
    if heads:
        conditions += [("head", l, h) for l in range(num_layers) for h in range(num_heads)]
    if layers:
        conditions += [("layer", l, -1) for l in range(num_layers)]
    if reuse_prefix and not PrefixCache.supported(model):
        log.info("disable_heads: %s shares blocks across layers; running every condition in full",
                 type(model).__name__)
        reuse_prefix = False
    rows, base = [], None
    with torch.inference_mode():
        inputs = [structure.model_inputs(model, **{k: b[k].to(device) for k in MODEL_KEYS if k in b}) for b in batches]
        labels = torch.cat([b["labels"] for b in batches])
        plain, prefix = zip(*(PrefixCache.record(model, x) for x in inputs)) if reuse_prefix else ((), ())
    for cond, l, h in tqdm(conditions, desc=f"disable_heads {task}", unit="cond", disable=None if progress else True):
        outs = []
        with hooks.attention(model, [], uniform=disabled(cond, l, h, num_heads)) as s, torch.inference_mode():
            for i, x in enumerate(inputs):
                if cond == "none" and reuse_prefix:
                    outs.append(plain[i].logits)
                elif reuse_prefix:  # layers < l are unchanged: reuse their outputs from the plain run
                    with PrefixCache.reuse(model, prefix[i], l):
                        outs.append(s.run(**x).logits)
                else:
                    outs.append(s.run(**x).logits)
        logits = torch.cat(outs).float().cpu()  # (N, num_labels)
        values = score(task, logits, labels)
        if base is None:
            base = values
        name = "none" if cond == "none" else (head_name(l, h) if cond == "head" else f"L{l + 1}")
        for metric, v in values.items():
            rows.append(dict(task=task, condition=cond, layer=l, head=h, name=name, metric=metric, value=v,
                             baseline=base[metric], delta=v - base[metric]))
    return pd.DataFrame(rows)


def heatmap(df: pd.DataFrame, metric: str, num_layers: int, num_heads: int, task: str):
    """Layer x head map of the change of ``metric`` (x100) when each head alone is disabled."""
    d = df[(df.condition == "head") & (df.metric == metric)]
    m = np.full((num_layers, num_heads), np.nan)
    m[d["layer"].to_numpy(), d["head"].to_numpy()] = d["delta"].to_numpy()
    base = float(df[(df.condition == "none") & (df.metric == metric)].value.iloc[0])
    m = 100 * m  # percentage points
    lim = max(1e-6, float(np.nanmax(np.abs(m))))
    fig, ax = plt.subplots(figsize=(0.5 * num_heads + 2, 0.45 * num_layers + 1.5))
    plots.layer_head_axes(ax, m, cmap="RdBu", vmin=-lim, vmax=lim, annotate="{:+.1f}",
                          title=f"{task}: change in dev {metric} when one head is disabled\n"
                                f"(baseline {100 * base:.1f}; x100)")
    fig.tight_layout()
    return fig


def layer_bars(df: pd.DataFrame, metric: str, task: str):
    """One bar per layer: the change of ``metric`` (x100) when the whole layer is disabled."""
    d = df[(df.condition == "layer") & (df.metric == metric)].sort_values("layer")
    base = float(df[(df.condition == "none") & (df.metric == metric)].value.iloc[0])
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(d) + 2), 3.2))
    colors = ["tab:red" if v < 0 else "tab:blue" for v in d.delta]
    ax.bar(d.layer + 1, 100 * d.delta, color=colors)
    ax.axhline(0, color="k", lw=0.6)
    plots.layer_ticks(ax, int(d.layer.min()) + 1, int(d.layer.max()) + 1)
    ax.set_xlabel("disabled layer")
    ax.set_ylabel(f"change in dev {metric} (x100)")
    ax.set_title(f"{task}: whole layer disabled (baseline {100 * base:.1f})", fontsize=9)
    fig.tight_layout()
    return fig


def disable_heads(ctx, *, checkpoint=None, task: str | None = None, split: str = "dev",
                  max_examples: int | None = None, batch_size: int = 64, max_length: int = 128,
                  heads: bool = True, layers: bool = True, reuse_prefix: bool = True) -> pd.DataFrame:
    """Score every checkpoint with nothing, each head and each layer disabled; save tables and figures;
    returns the tidy scores of all tasks."""
    t0 = time.time()
    frames, summary = [], {}
    for want_task, path in checkpoints(checkpoint, task).items():
        ft = load_checkpoint(ctx, path, want_task, require_task=True)
        model = ft.model.to(ctx.device)
        L, H = model.config.num_hidden_layers, model.config.num_attention_heads
        examples, batches = glue_batches(ctx, ft, split, max_examples, max_length, batch_size)
        log.info("disable_heads: %s, %d %s examples, %d layers x %d heads", ft.task, len(examples), split, L, H)
        df = disable_scores(model, batches, ft.task, L, H, ctx.device, heads, layers, reuse_prefix=reuse_prefix)
        main = task_spec(ft.task).main_metric
        ctx.save_table(df, f"disable_heads_{ft.task}")
        if heads:
            ctx.save_figure(heatmap(df, main, L, H, ft.task), f"disable_heads_{ft.task}")
        if layers:
            ctx.save_figure(layer_bars(df, main, ft.task), f"disable_layers_{ft.task}")
        d = df[df.metric == main]
        hd, ly = d[d.condition == "head"], d[d.condition == "layer"]
        s = dict(checkpoint=ft.path, n_examples=len(examples), metric=main,
                 baseline=float(d[d.condition == "none"].value.iloc[0]))
        if len(hd):
            s.update(best_head=hd.loc[hd.value.idxmax(), "name"], best_head_value=float(hd.value.max()),
                     worst_head=hd.loc[hd.value.idxmin(), "name"], worst_head_value=float(hd.value.min()),
                     n_heads_improving=int((hd.delta > 0).sum()), n_heads=len(hd))
        if len(ly):
            s.update(layers={r["name"]: round(float(r.value), 4) for _, r in ly.iterrows()})
        summary[ft.task] = s
        frames.append(df)
    ctx.log_summary(dict(analysis="disable_heads", split=split, tasks=summary, seconds=round(time.time() - t0, 1)))
    return pd.concat(frames, ignore_index=True)
