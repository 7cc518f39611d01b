"""``analysis=pattern_types``: Kovaleva et al. 2019 §3, Figure 2 — how often each attention pattern type occurs.

For each task in ``task`` (one GLUE task or a list) its ``split`` examples (first ``max_examples``
that are ``min_length``..``max_length`` wordpieces long; the CNN was trained on maps of 12 to 64)
are encoded as the labelled maps were (``[CLS] a [SEP] b [SEP]`` for pairs, the model's own
tokenizer, :func:`probes.model.inputs.encode_texts`); every head's full wordpiece map (live, from
:func:`probes.model.hooks.iter_attention`) is classified by the trained CNN (``classifier``, a
``.ckpt`` of ``python train.py experiment=patterns`` or its run folder). Done for the pre-trained
``encoder``, and for the fine-tuned model ``checkpoint`` when given (a GLUE run folder, its
``hf_model`` folder or a ``.ckpt``; ``{task: path}`` for several tasks; same vocabulary as ``encoder``).

Shares are over all (example, layer, head) maps: share(pattern) = #maps of that type / #maps.

Outputs: ``pattern_types.csv`` (task, model, pattern, count, share, n_examples), ``pattern_types_by_layer.csv``
(task, model, layer (0-based), pattern, count, share), ``pattern_types_by_head.csv`` (task, model,
layer, head, name (1-based), pattern, share), ``pattern_types.png`` (stacked bars, one per task x
model, Figure 2), ``pattern_types_by_layer.png`` (stacked bars per layer), ``summary.json``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pandas as pd

from probes.analysis.kovaleva.common import FINETUNED, checkpoint_for, variants
from probes.analysis.naming import head_name
from probes.data.glue import read_glue, task_spec
from probes.model.hooks import iter_attention
from probes.model.inputs import Encoded, encode_texts

log = logging.getLogger(__name__)

COLORS = {"vertical": "#4c72b0", "diagonal": "#dd8452", "vertical+diagonal": "#55a868", "block": "#c44e52",
          "heterogeneous": "#8172b3"}


def encode_glue(tokenizer, examples, min_length: int = 0, max_length: int | None = None
                ) -> tuple[list[Encoded], int]:
    """GLUE examples (``.text_a``, ``.text_b``) as the model's tokenizer makes them, no truncation,
    those of ``min_length``..``max_length`` pieces; and the number skipped."""
    items, skipped = [], 0
    for e in examples:
        enc = encode_texts(tokenizer, e.text_a, e.text_b)
        if enc.n_pieces < min_length or (max_length is not None and enc.n_pieces > max_length):
            skipped += 1
            continue
        items.append(enc)
    return items, skipped


def classify_heads(classifier, model, items: list[Encoded], device: str = "cpu", max_tokens: int = 4096,
                   progress: bool = True, desc: str = "pattern_types", pad_id: int = 0) -> np.ndarray:
    """(L, H, n_classes) counts: how many examples' maps of each head fall in each class."""
    counts = None
    for _, attn in iter_attention(model, items, pad_id, device=device, max_tokens=max_tokens, desc=desc,
                                  progress=progress):
        L, H, T, _ = attn.shape  # (L, H, T, T)
        pred = classifier.predict_maps(list(attn.reshape(L * H, T, T).cpu().numpy())).reshape(L, H)
        if counts is None:
            counts = np.zeros((L, H, len(classifier.classes)), dtype=np.int64)
        np.add.at(counts, (np.arange(L)[:, None], np.arange(H)[None, :], pred), 1)
    if counts is None:
        raise ValueError("no example to classify (all filtered by length?)")
    return counts


def tables(results: dict[tuple[str, str], np.ndarray], classes, n_examples: dict) -> tuple[pd.DataFrame, ...]:
    rows, lrows, hrows = [], [], []
    for (task, variant), c in results.items():
        total = c.sum()
        for k, p in enumerate(classes):
            rows.append(dict(task=task, model=variant, pattern=p, count=int(c[..., k].sum()),
                             share=float(c[..., k].sum() / total), n_examples=n_examples[task]))
        L, H, _ = c.shape
        for l in range(L):
            lt = c[l].sum()
            for k, p in enumerate(classes):
                lrows.append(dict(task=task, model=variant, layer=l, pattern=p, count=int(c[l, :, k].sum()),
                                  share=float(c[l, :, k].sum() / lt)))
            for h in range(H):
                ht = c[l, h].sum()
                for k, p in enumerate(classes):
                    hrows.append(dict(task=task, model=variant, layer=l, head=h, name=head_name(l, h), pattern=p,
                                      share=float(c[l, h, k] / ht)))
    return pd.DataFrame(rows), pd.DataFrame(lrows), pd.DataFrame(hrows)


def stacked_bars(df: pd.DataFrame, classes, by_layer: bool = False):
    import matplotlib.pyplot as plt

    from probes.analysis import plots  # noqa: F401  (Agg backend)

    if not by_layer:
        groups = list(dict.fromkeys(zip(df.task, df.model)))
        fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(groups) + 2.5), 4))
        bottom = np.zeros(len(groups))
        for p in classes:
            v = np.array([df[(df.task == t) & (df.model == m) & (df.pattern == p)].share.sum() for t, m in groups])
            ax.bar(range(len(groups)), 100 * v, bottom=100 * bottom, label=p, color=COLORS.get(p))
            bottom += v
        ax.set_xticks(range(len(groups)), [f"{t}\n{m}" for t, m in groups], fontsize=8)
        ax.set_ylabel("share of maps (%)")
        ax.set_ylim(0, 100)
        ax.set_title("attention pattern types (all heads)", fontsize=9)
        ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
        fig.tight_layout()
        return fig
    groups = list(dict.fromkeys(zip(df.task, df.model)))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 1.8, 3.6), squeeze=False, sharey=True)
    for ax, (t, m) in zip(axes[0], groups):
        d = df[(df.task == t) & (df.model == m)]
        layers = sorted(d.layer.unique())
        bottom = np.zeros(len(layers))
        for p in classes:
            v = np.array([d[(d.layer == l) & (d.pattern == p)].share.sum() for l in layers])
            ax.bar(range(len(layers)), 100 * v, bottom=100 * bottom, label=p, color=COLORS.get(p))
            bottom += v
        ax.set_xticks(range(len(layers)), [str(l + 1) for l in layers], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(f"{t} ({m})", fontsize=8)
    axes[0][0].set_ylabel("share of maps (%)")
    axes[0][-1].legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    return fig


def pattern_types(ctx, *, classifier=None, checkpoint=None, task="mrpc", split: str = "dev",
                  max_examples: int | None = 200, min_length: int = 12, max_length: int | None = 64,
                  max_tokens: int = 4096) -> pd.DataFrame:
    """``classifier``: the pattern CNN (.ckpt of ``experiment=patterns`` or its run folder);
    ``checkpoint``: optional fine-tuned GLUE model (path, or {task: path})."""
    from probes.patterns.module import load_classifier

    if classifier is None:
        raise ValueError("set analysis.classifier=<.ckpt of `python train.py experiment=patterns` or its run folder> "
                         "(analysis.checkpoint names the optional fine-tuned GLUE model)")
    t0 = time.time()
    device = ctx.device
    cnn_path = classifier
    classifier = load_classifier(cnn_path, device)
    tasks = [task] if isinstance(task, str) else list(task)
    results, n_examples, summary = {}, {}, {}
    for t in tasks:
        spec = task_spec(t)
        examples = read_glue(spec.name, split, ctx.cfg.paths.data_dir)
        tuned = checkpoint_for(checkpoint, spec.name)
        for variant, (model, tok) in variants(ctx, tuned, spec.name).items():
            items, skipped = encode_glue(tok, examples, min_length, max_length)
            items = items[:max_examples]
            n_examples[spec.name] = len(items)
            log.info("pattern_types %s %s: %d examples (%d outside %s..%s wordpieces)", spec.name, variant,
                     len(items), skipped, min_length, max_length)
            c = classify_heads(classifier, model, items, device, max_tokens, desc=f"{spec.name} {variant}",
                               pad_id=tok.pad_token_id or 0)
            results[(spec.name, variant)] = c
            share = c.sum((0, 1)) / c.sum()
            summary[f"{spec.name}/{variant}"] = dict(
                n_examples=len(items), n_skipped_length=skipped, n_maps=int(c.sum()),
                shares={p: round(float(s), 4) for p, s in zip(classifier.classes, share)},
                checkpoint=tuned if variant == FINETUNED else None)
    overall, by_layer, by_head = tables(results, classifier.classes, n_examples)
    ctx.save_table(overall, "pattern_types")
    ctx.save_table(by_layer, "pattern_types_by_layer")
    ctx.save_table(by_head, "pattern_types_by_head")
    ctx.save_figure(stacked_bars(overall, classifier.classes), "pattern_types")
    ctx.save_figure(stacked_bars(by_layer, classifier.classes, by_layer=True), "pattern_types_by_layer")
    ctx.log_summary(dict(analysis="pattern_types", split=split, encoder=ctx.encoder.name, classifier=str(cnn_path),
                         results=summary, seconds=round(time.time() - t0, 1)))
    return overall
