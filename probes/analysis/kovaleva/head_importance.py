"""``analysis=head_importance``: head importance (Michel et al. 2019, *Are Sixteen Heads Really Better than
One?*) of a fine-tuned GLUE model, its agreement with Kovaleva et al.'s head disabling, and pruning curves.

* Importance. Every head's output is multiplied by a gate ``xi_h`` (``hooks.attention(model, [],
  gates=xi)``, xi = ones (L, H) with gradients); ``I_h = E |dL/d xi_h|`` with L the task loss (cross-entropy
  on the gold label; STS-B: mean squared error), the expectation over dev batches of ``batch_size``
  examples (as Michel et al.'s code, ``run_bertology.py``: the absolute gradient of each batch's mean
  loss, averaged). ``importance_norm``: each layer's scores divided by their l2 norm (Michel et al.'s
  layer-wise normalisation, used for the ranking; ``normalize_by_layer: false`` ranks raw scores).
* Agreement with disabling (Kovaleva et al. Fig. 8): each head disabled alone (uniform attention,
  :func:`probes.analysis.kovaleva.disable_heads.disable_scores`); Spearman and Pearson correlation of
  ``I_h`` with the metric drop ``-delta`` over the L*H heads.
* Pruning curve: heads removed (gate 0, Michel et al.'s masking) in order of increasing importance,
  and in ``n_random`` seeded random orders, at the shares ``0, step, 2 step, ...`` of all heads; the
  dev metric at each share.

Decoders: as for ``analysis=disable_heads`` (last-token pooling of the checkpoint's
``*ForSequenceClassification``; gates act on each query head, grouped-query attention included).

Outputs, per task: ``head_importance_<task>.csv`` (layer, head, name, importance, importance_norm,
disable_delta), ``pruning_<task>.csv`` (order ∈ {importance, random-k}, share, n_removed, metric,
value), ``head_importance_<task>.png`` (layer x head heatmap), ``pruning_<task>.png``, ``summary.json``.
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
from probes.analysis.kovaleva.disable_heads import disable_scores
from probes.analysis.naming import head_name
from probes.stats import spearman_rows
from probes.data.glue import task_spec
from probes.glue.evaluate import MODEL_KEYS
from probes.glue.metrics import score
from probes.model import hooks, structure

log = logging.getLogger(__name__)


def task_loss(logits: torch.Tensor, labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """Mean cross-entropy (classification) or squared error (regression, num_labels == 1)."""
    if num_labels == 1:
        return torch.nn.functional.mse_loss(logits.squeeze(-1).float(), labels.float())
    return torch.nn.functional.cross_entropy(logits.float(), labels)


def head_importance(model, batches, num_labels: int, device: str = "cpu", progress: bool = True) -> torch.Tensor:
    """(L, H) ``I_h = mean over batches of |dL/d xi_h|`` at xi = 1 (see the module doc)."""
    L, H = int(model.config.num_hidden_layers), int(model.config.num_attention_heads)
    total = torch.zeros(L, H, dtype=torch.float64)
    for b in tqdm(batches, desc="head importance", unit="batch", disable=None if progress else True):
        xi = torch.ones(L, H, device=device, requires_grad=True)  # (L, H) gates
        x = structure.model_inputs(model, **{k: b[k].to(device) for k in MODEL_KEYS if k in b})
        with hooks.attention(model, [], gates=xi) as s:
            loss = task_loss(s.run(**x).logits, b["labels"].to(device), num_labels)
        (g,) = torch.autograd.grad(loss, xi)
        total += g.abs().double().cpu()
    return (total / max(len(batches), 1)).float()


def normalize_by_layer(imp: torch.Tensor) -> torch.Tensor:
    """Michel et al.: each layer's scores divided by their l2 norm. imp (L, H) -> (L, H)."""
    return imp / (imp.norm(dim=-1, keepdim=True) + 1e-20)


@torch.inference_mode()
def evaluate(model, batches, task: str, gates: torch.Tensor, device: str = "cpu") -> dict[str, float]:
    """The task's metrics with head outputs multiplied by ``gates`` (L, H) (0 = removed)."""
    outs, labels = [], []
    with hooks.attention(model, [], gates=gates.to(device)) as s:
        for b in batches:
            x = structure.model_inputs(model, **{k: b[k].to(device) for k in MODEL_KEYS if k in b})
            outs.append(s.run(**x).logits.float().cpu())
            labels.append(b["labels"])
    return score(task, torch.cat(outs), torch.cat(labels))


def removal_orders(imp: torch.Tensor, n_random: int, seed: int) -> dict[str, list[int]]:
    """Flat head indices (l * H + h) in removal order: by increasing importance, and ``n_random`` permutations."""
    K = imp.numel()
    orders = {"importance": torch.argsort(imp.flatten(), stable=True).tolist()}
    g = torch.Generator().manual_seed(seed)
    for k in range(n_random):
        orders[f"random-{k}"] = torch.randperm(K, generator=g).tolist()
    return orders


def pruning_curve(model, batches, task: str, order: list[int], shares, L: int, H: int, device: str = "cpu",
                  desc: str = "pruning") -> list[dict]:
    """Metrics with the first ``round(share * L * H)`` heads of ``order`` removed, for each share."""
    rows = []
    for share in tqdm(shares, desc=desc, unit="share", disable=None):
        n = int(round(share * L * H))
        gates = torch.ones(L * H)
        gates[order[:n]] = 0.0
        for metric, v in evaluate(model, batches, task, gates.view(L, H), device).items():
            rows.append(dict(share=float(share), n_removed=n, metric=metric, value=float(v)))
    return rows


def heatmap(imp: np.ndarray, task: str):
    """Layer x head map of the (layer-normalised) importance."""
    fig, ax = plt.subplots(figsize=(0.5 * imp.shape[1] + 2, 0.45 * imp.shape[0] + 1.5))
    plots.layer_head_axes(ax, imp, cmap="viridis", annotate="{:.2f}",
                          title=f"{task}: head importance (Michel et al.), layer-normalised")
    fig.tight_layout()
    return fig


def curve_figure(df: pd.DataFrame, metric: str, task: str):
    """Pruning curves: ``metric`` against the share of heads removed, by importance and at random."""
    d = df[df.metric == metric]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    imp = d[d.order == "importance"]
    ax.plot(100 * imp.share, 100 * imp.value, marker="o", label="by importance (least first)")
    rnd = d[d.order.str.startswith("random")].groupby("share").value
    if len(rnd.groups):
        m, lo, hi = rnd.mean(), rnd.min(), rnd.max()
        ax.plot(100 * m.index, 100 * m.values, marker="s", label=f"random order (mean of {d.order.nunique() - 1})")
        ax.fill_between(100 * m.index, 100 * lo.values, 100 * hi.values, alpha=0.2)
    ax.set_xlabel("heads removed (%)")
    ax.set_ylabel(f"dev {metric} (x100)")
    ax.set_title(f"{task}: pruning heads", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def head_importance_analysis(ctx, *, checkpoint=None, task: str | None = None, split: str = "dev",
                             max_examples: int | None = None, batch_size: int = 32, max_length: int = 128,
                             normalize_layers: bool = True, disable: bool = True, share_step: float = 0.1,
                             max_share: float = 0.9, n_random: int = 3, seed: int = 0) -> pd.DataFrame:
    """Importance, agreement with disabling and pruning curves for every checkpoint; returns the importance table."""
    t0 = time.time()
    frames, summary = [], {}
    shares = np.round(np.arange(0.0, max_share + 1e-9, share_step), 6)
    for want_task, path in checkpoints(checkpoint, task).items():
        ft = load_checkpoint(ctx, path, want_task, require_task=True)
        model = ft.model.to(ctx.device).eval()
        spec = task_spec(ft.task)
        L, H = int(model.config.num_hidden_layers), int(model.config.num_attention_heads)
        examples, batches = glue_batches(ctx, ft, split, max_examples, max_length, batch_size)
        log.info("head_importance: %s, %d %s examples, %d layers x %d heads", ft.task, len(examples), split, L, H)
        imp = head_importance(model, batches, spec.num_labels, ctx.device)  # (L, H)
        imp_n = normalize_by_layer(imp)
        rank = imp_n if normalize_layers else imp
        df = pd.DataFrame(dict(task=ft.task, layer=np.repeat(np.arange(L), H), head=np.tile(np.arange(H), L),
                               name=[head_name(l, h) for l in range(L) for h in range(H)],
                               importance=imp.flatten().numpy(), importance_norm=imp_n.flatten().numpy()))
        main = spec.main_metric
        s = dict(checkpoint=ft.path, n_examples=len(examples), metric=main, batch_size=batch_size,
                 normalize_layers=normalize_layers,
                 most_important=df.loc[int(np.argmax(rank.flatten())), "name"],
                 least_important=df.loc[int(np.argmin(rank.flatten())), "name"])
        if disable:
            dis = disable_scores(model, batches, ft.task, L, H, ctx.device, heads=True, layers=False)
            d = dis[(dis.condition == "head") & (dis.metric == main)].sort_values(["layer", "head"])
            df["disable_delta"] = d.delta.to_numpy()
            drop = -df.disable_delta.to_numpy()
            for col in ("importance", "importance_norm"):
                rho = spearman_rows(df[col].to_numpy()[None], drop[None])[0]
                r = float(np.corrcoef(df[col], drop)[0, 1]) if np.std(drop) > 0 and df[col].std() > 0 else float("nan")
                s[f"{col}_vs_disable_drop"] = dict(spearman=float(rho), pearson=r)
        rows = []
        for name, order in removal_orders(rank, n_random, seed).items():
            for r in pruning_curve(model, batches, ft.task, order, shares, L, H, ctx.device, f"pruning {name}"):
                rows.append(dict(task=ft.task, order=name, **r))
        curve = pd.DataFrame(rows)
        m = curve[curve.metric == main]
        s["pruning"] = {o: [round(float(v), 4) for v in g.sort_values("share").value] for o, g in m.groupby("order")}
        s["shares"] = [float(x) for x in shares]
        ctx.save_table(df, f"head_importance_{ft.task}")
        ctx.save_table(curve, f"pruning_{ft.task}")
        ctx.save_figure(heatmap(imp_n.numpy(), ft.task), f"head_importance_{ft.task}")
        ctx.save_figure(curve_figure(curve, main, ft.task), f"pruning_{ft.task}")
        summary[ft.task] = s
        frames.append(df)
    ctx.log_summary(dict(analysis="head_importance", split=split, tasks=summary, seconds=round(time.time() - t0, 1)))
    return pd.concat(frames, ignore_index=True)
