"""``analysis=finetune_cosine``: Kovaleva et al. 2019 §4.3 (Fig 5) — how much does fine-tuning change
each head's attention? Per head, the cosine similarity between the flattened (wordpiece x
wordpiece) attention maps of the pre-trained encoder (`encoder`, e.g. minilm) and of the
fine-tuned model on the same dev example, averaged over the examples.

Maps are compared over the real tokens only (padded query rows and key columns are dropped,
which equals running each example unpadded). Needs `analysis.checkpoint` (an `hf_model` folder,
a run folder holding one, or a `.ckpt`); several tasks at once as a {task: path} mapping.

Outputs: ``finetune_cosine.csv`` (task, layer, head (0-based), name (1-based), cosine, n_examples),
``finetune_cosine.png`` (one layer x head heatmap per task), ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from probes.analysis import plots
from probes.analysis.kovaleva.common import checkpoints, glue_batches, load_checkpoint
from probes.analysis.naming import head_name
from probes.glue.evaluate import MODEL_KEYS
from probes.model import hooks

log = logging.getLogger(__name__)


def _maps(session, inputs: dict) -> torch.Tensor:
    """(B, L, H, T, T) maps of every layer of one padded batch (the forward stops after the last)."""
    session.run(**inputs)
    return session.attentions()


@torch.inference_mode()
def attention_cosine(model_a, model_b, batches, device="cpu", progress: bool = True) -> tuple[np.ndarray, int]:
    """(L, H) mean over examples of cos(flattened map of model_a, of model_b); and the example count.

    Maps come from :func:`probes.model.hooks.attention` (all layers, forward stopped after the last).
    Computed in float64 as dot / sqrt(|a|^2 |b|^2), so a model compared with itself gives exactly 1.
    """
    total, n = None, 0
    same = model_b is model_a
    with hooks.attention(model_a, stop=True) as sa, \
            (hooks.attention(model_b, stop=True) if not same else nullcontext()) as sb:
        for b in tqdm(batches, desc="finetune_cosine", unit="batch", disable=None if progress else True):
            inputs = {k: b[k].to(device) for k in MODEL_KEYS if k in b}
            att_a = _maps(sa, inputs)                                               # (B, L, H, T, T)
            att_b = att_a if same else _maps(sb, inputs)
            if att_a.shape != att_b.shape:
                raise ValueError(f"the two models differ in layers or heads: {tuple(att_a.shape[1:3])} vs "
                                 f"{tuple(att_b.shape[1:3])}")
            real = inputs["attention_mask"].to(torch.float64)
            pair = real[:, None, :, None] * real[:, None, None, :]                  # (B, 1, T, T)
            a = att_a.to(torch.float64) * pair[:, None]                             # (B, L, H, T, T)
            c = att_b.to(torch.float64) * pair[:, None]
            dot = (a * c).flatten(3).sum(-1)                                        # (B, L, H)
            norm = torch.sqrt((a * a).flatten(3).sum(-1) * (c * c).flatten(3).sum(-1))
            cos = (dot / norm).sum(0)                                               # (L, H)
            total = cos if total is None else total + cos
            n += a.shape[0]
    return (total / n).cpu().numpy(), n


def heatmaps(values: dict[str, np.ndarray]):
    """One layer x head map of the cosines per task."""
    k = len(values)
    L, H = next(iter(values.values())).shape
    fig, axes = plt.subplots(1, k, figsize=((0.45 * H + 1.8) * k, 0.4 * L + 1.6), squeeze=False)
    for ax, (task, m) in zip(axes[0], values.items()):
        plots.layer_head_axes(ax, m, vmin=min(0.0, float(m.min())), vmax=1.0, annotate="{:.2f}",
                              title=f"{task}: cos(pre-trained, fine-tuned)")
    fig.tight_layout()
    return fig


def finetune_cosine(ctx, *, checkpoint=None, task: str | None = None, split: str = "dev",
                    max_examples: int | None = None, batch_size: int = 32, max_length: int = 128) -> pd.DataFrame:
    """Per task, the per-head cosine between pre-trained and fine-tuned maps; saves table and figure."""
    t0 = time.time()
    pre = ctx.encoder.model.to(ctx.device)
    rows, maps, summary = [], {}, {}
    for want_task, path in checkpoints(checkpoint, task).items():
        ft = load_checkpoint(ctx, path, want_task, compare=True, require_task=True)  # the encoder's vocabulary
        tuned = ft.model.to(ctx.device)
        _, batches = glue_batches(ctx, ft, split, max_examples, max_length, batch_size)
        m, n = attention_cosine(pre, tuned, batches, ctx.device)
        maps[ft.task] = m
        for l in range(m.shape[0]):
            for h in range(m.shape[1]):
                rows.append(dict(task=ft.task, layer=l, head=h, name=head_name(l, h), cosine=float(m[l, h]),
                                 n_examples=n))
        lo = np.unravel_index(int(np.argmin(m)), m.shape)
        summary[ft.task] = dict(checkpoint=ft.path, n_examples=n, mean=float(m.mean()),
                                per_layer=[round(float(x), 4) for x in m.mean(1)],
                                least_similar=head_name(*lo), least_similar_cosine=float(m[lo]))
        log.info("finetune_cosine %s: mean %.3f over %d examples", ft.task, m.mean(), n)
    df = pd.DataFrame(rows)
    ctx.save_table(df, "finetune_cosine")
    ctx.save_figure(heatmaps(maps), "finetune_cosine")
    ctx.log_summary(dict(analysis="finetune_cosine", split=split, encoder=ctx.encoder.name, tasks=summary,
                         seconds=round(time.time() - t0, 1)))
    return df
