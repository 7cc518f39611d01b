"""Stage 3 of :mod:`probes.analysis.kovaleva.linguistic_attention`: the files of a run."""

from __future__ import annotations

import time

import numpy as np

from probes.analysis.kovaleva.common import PRETRAINED
from probes.analysis.kovaleva.linguistic_attention.figures import change_bars, cls_bars
from probes.analysis.kovaleva.linguistic_attention.scoring import LinguisticResult, ModelScores
from probes.analysis.kovaleva.linguistic_attention.tabulation import LinguisticTables
from probes.analysis.naming import head_name
from probes.analysis.plots import heatmaps


def _best(m: np.ndarray) -> str:
    """``"<layer>-<head>: <value>"`` of the largest entry of an (L, H) matrix."""
    l, h = np.unravel_index(np.argmax(m), m.shape)
    return f"{head_name(int(l), int(h))}: {m[l, h]:.4f}"


def run_summary(run: ModelScores) -> dict:
    """The summary.json entry of one (source, model) run."""
    acc, heat, theat = run.kinds, run.kind_means(), run.relation_means()
    return dict(
        n_examples=acc.n_examples, n_skipped_length=run.n_skipped, checkpoint=run.checkpoint,
        examples_counted={f: acc.count[f] for f in acc.features},
        mean_over_heads={f: round(float(v.mean()), 5) for f, v in heat.items()},
        best_head={f: _best(v) for f, v in heat.items()},
        cls_last_layer={f: round(float(acc.cls_mean(f)[-1].mean()), 5) for f in acc.features
                        if acc.cls_mean(f) is not None},
        token_to_token_last_layer={r: round(float(v[-1].mean()), 5) for r, v in theat.items()},
        token_to_token_best_last_layer={r: f"{head_name(v.shape[0] - 1, int(np.argmax(v[-1])))}: "
                                           f"{float(v[-1].max()):.4f}" for r, v in theat.items()},
        examples_with_pair=run.n_with_pair())


def save(ctx, result: LinguisticResult, frames: LinguisticTables, started: float) -> None:
    """Stage 3, :class:`probes.analysis.stages.Save` (arguments and contract there): ``linguistic_attention``,
    ``cls_last_layer``, ``token_to_token`` and ``linguistic_change`` .csv; per (source, model) the heatmaps
    ``linguistic_attention[_<task>][_finetuned].png`` and ``token_to_token[...].png`` (the task when there are
    several, the variant after the pre-trained one); ``cls_last_layer.png`` when some kind has a [CLS] row;
    ``linguistic_change[_last_layer].png`` with a fine-tuned model; the summary holds the rules and
    :func:`run_summary` of every run."""
    ctx.save_table(frames.attention, "linguistic_attention")
    ctx.save_table(frames.cls_last_layer, "cls_last_layer")
    ctx.save_table(frames.token_to_token, "token_to_token")
    ctx.save_table(frames.change, "linguistic_change")
    several = len(result.sources) > 1
    for run in result.runs:
        variant = run.model
        suffix = (("_" + run.source.split(":", 1)[-1]) if several else "") + (
            "" if variant == PRETRAINED else "_" + variant.replace("-", ""))
        heat, theat = run.kind_means(), run.relation_means()
        if heat:
            ctx.save_figure(heatmaps(heat, {f: f"to {f} ({variant})" for f in heat}, ncols=3),
                            f"linguistic_attention{suffix}")
        if theat:
            ctx.save_figure(heatmaps(theat, {r: f"{r} ({variant})" for r in theat}, ncols=3), f"token_to_token{suffix}")
    if len(frames.cls_last_layer):
        ctx.save_figure(cls_bars(frames.cls_last_layer), "cls_last_layer")
    if len(frames.change):
        ctx.save_figure(change_bars(frames.change, "all_heads"), "linguistic_change")
        ctx.save_figure(change_bars(frames.change, "last_layer"), "linguistic_change_last_layer")
    sel, rules = result.selection, result.rules
    ctx.log_summary(dict(analysis="linguistic_attention", source=sel.source, split=sel.split,
                         encoder=ctx.encoder.name, feature_set=rules.feature_set, features=rules.features,
                         relations=rules.relations, piece_pooling=rules.piece_pooling, missing=rules.missing,
                         relation_missing=rules.relation_missing,
                         spacy_model=sel.spacy_model if sel.source == "glue" else None,
                         changes=[f"{r['source']}/{r['kind']}/{r['statistic']}: {r['diff']:+.4f} "
                                  f"[{r['lo']:+.4f}, {r['hi']:+.4f}]" for r in result.changes if r["change"]],
                         results={f"{run.source}/{run.model}": run_summary(run) for run in result.runs},
                         seconds=round(time.time() - started, 1)))
