"""The bar figures of :mod:`probes.analysis.kovaleva.linguistic_attention` (the layer x head heatmaps are
:func:`probes.analysis.plots.heatmaps`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from probes.analysis.plots import panel_grid


def cls_bars(df: pd.DataFrame):
    """Last layer, attention from [CLS] to each kind: a bar per model (mean over heads), a dot per head."""
    mean = df[df["head"] == -1]
    groups = list(dict.fromkeys(zip(mean.source, mean.model)))
    feats = list(dict.fromkeys(mean.feature))
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(feats) * max(1, len(groups)) / 1.5 + 2), 3.8))
    w = 0.8 / max(1, len(groups))
    x = np.arange(len(feats))
    for g, (src, m) in enumerate(groups):
        d = mean[(mean.source == src) & (mean.model == m)].set_index("feature")
        vals = [d.value.get(f, np.nan) for f in feats]
        ax.bar(x + (g - (len(groups) - 1) / 2) * w, vals, w, label=f"{src} / {m}")
        heads = df[(df.source == src) & (df.model == m) & (df["head"] >= 0)]
        for k, f in enumerate(feats):
            hv = heads[heads.feature == f].value.to_numpy()
            ax.scatter(np.full(len(hv), x[k] + (g - (len(groups) - 1) / 2) * w), hv, s=5, color="k", zorder=3)
    ax.set_xticks(x, feats, rotation=30, ha="right", fontsize=8)
    layer = int(mean.layer.iloc[0]) if len(mean) else 0
    ax.set_ylabel(f"attention from [CLS], layer {layer + 1}")
    ax.set_title("last layer: [CLS] -> token kinds (bar: mean over heads, dots: heads)", fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def change_bars(ch: pd.DataFrame, statistic: str = "all_heads"):
    """Per kind (panel) and source (group): pre-trained vs fine-tuned mean with the fine-tuned interval
    of the paired difference drawn around the fine-tuned bar; * marks a change (interval excludes 0)."""
    d = ch[ch.statistic == statistic]
    kinds = list(dict.fromkeys(d.kind))
    fig, axes = panel_grid(len(kinds), min(4, len(kinds)), 3.4, 2.6)
    for ax, k in zip(axes, kinds):
        e = d[d.kind == k]
        x = np.arange(len(e))
        ax.bar(x - 0.2, e.pretrained, 0.4, label="pre-trained", color="#4c72b0")
        ax.bar(x + 0.2, e.finetuned, 0.4, label="fine-tuned", color="#dd8452")
        err = np.abs(np.vstack([e["diff"] - e.lo, e.hi - e["diff"]]))
        ax.errorbar(x + 0.2, e.finetuned, yerr=err, fmt="none", ecolor="k", elinewidth=0.8, capsize=2)
        for xi, (c, v) in enumerate(zip(e.change, np.maximum(e.pretrained, e.finetuned))):
            if c:
                ax.text(xi, v, "*", ha="center", va="bottom", fontsize=10)
        ax.set_xticks(x, [s.split(":", 1)[-1] for s in e.source], fontsize=7)
        ax.set_title(k, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"pre-trained vs fine-tuned ({'mean over all heads' if statistic == 'all_heads' else 'last layer'};"
                 " bars: 95% paired interval of the change; *: change)", fontsize=8)
    fig.tight_layout()
    return fig
