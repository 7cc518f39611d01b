"""``analysis=faithfulness``: which map kind to believe about a fine-tuned classifier's prediction.

For every example of a GLUE split (single sentences, or pairs) and every map kind of
:mod:`probes.measures` (``kinds``; built by ``ctx.measure(kind)`` from ``extract.measures``, or from this
analysis's ``measures`` node, which holds row-restricted versions of the expensive kinds: ``flow`` and
``grad_attribution`` computed for row ``row`` only, same numbers), the **importance of each input token for
the prediction** is read from the map: row ``row`` (0 = [CLS] / <s>; -1 = the last piece, the token a
decoder's classifier pools; 0 is refused on a causal model) of layer ``layer`` (every layer is
scored too), averaged over the layer's heads for per-head kinds. Units (``level``): ``word`` (whitespace
words of the GLUE text; a word's importance = the sum over its pieces, as the cache's ``to_words=sum``)
or ``piece``. Special tokens are never units and never removed.

References (``references``, layer 0 in the tables: they read no map): ``ixg`` (gradient x input of the
predicted class's logit w.r.t. the word embeddings, summed over the embedding dimension; signed),
``ig`` (integrated gradients, zero baseline, ``ig_steps`` midpoints as one batch;
:func:`probes.measures.saliency.logit_attributions`), ``loo`` (leave-one-out = the blank-out scores) and
``random`` (uniform scores, seeded per example).

Scores per ranking and example, with c the class predicted on the full input and p its probability:

* ``comprehensiveness`` (DeYoung et al. 2020, AOPC): mean over the bins (``bins``, % of units; k =
  ceil(bin * n / 100), at least 1) of p(x) - p_c(x without its top-k units); higher = more faithful.
* ``sufficiency``: mean over the bins of p(x) - p_c(x with only its top-k units); lower = more faithful.
* ``spearman_blankout`` (Abnar & Zuidema 2020): Spearman over the units between the importance and the
  blank-out score p(x) - p_c(x without that unit).
* ``spearman_grad``: Spearman with ``ixg``.

Removal (``erase``): ``delete`` drops the unit's pieces (Ferrando et al. 2022), ``mask`` replaces each by
the tokenizer's mask token. Ties in a ranking are broken by position. All perturbed inputs of one example
(blank-out and every ranking's bins, duplicates once) go through the classifier in length batches of at
most ``max_tokens`` pieces. AOPC is computed at ``aopc_layers`` (``selected``: the chosen layer; ``all``:
every layer, about L times the perturbed forwards); the Spearman scores at every layer.

Means over examples with 95% percentile-bootstrap intervals (``n_boot`` resamples of the examples,
:func:`probes.stats.bootstrap_mean`; examples where a Spearman is undefined, e.g. one unit, are
left out of that mean and counted in ``n``).

Outputs: ``faithfulness.csv`` (kind x metric at the chosen layer, references and random, with ``_lo``/``_hi``
and the papers' numbers for that kind, ``probes/report/papers.yaml``), ``faithfulness_layers.csv`` (kind,
layer, metric, mean, lo, hi, n), ``faithfulness_examples.csv`` (per example), ``faithfulness_papers.csv``,
``faithfulness.png`` (kinds x metrics), ``faithfulness_layers.png`` (metrics per layer), ``summary.json``
(also the seconds spent per kind).

In code: :func:`compute` (the per-example scores and their means; only the ``.partial.csv`` of a running task
through its ``partial`` writer) -> :func:`tables` -> :func:`save`; the configured entry
:func:`faithfulness_analysis` composes the three.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from probes.analysis.kovaleva.common import checkpoints, load_checkpoint
from probes.analysis.plots import layer_ticks
from probes.stats import bootstrap_mean, spearman_rows
from probes.data.glue import GlueExample, read_glue, task_spec
from probes.glue.export import hf_folder
from probes.io import atomic_write
from probes.measures import Measure, sentence_rows
from probes.measures.saliency import logit_attributions
from probes.model import structure
from probes.model.families import is_causal
from probes.model.fixed_inputs import fixed_inputs
from probes.model.inputs import encode_word_pairs, encode_words, length_batches, pad
from probes.report.build import load_papers

log = logging.getLogger(__name__)

METRICS = ("comprehensiveness", "sufficiency", "spearman_blankout", "spearman_grad")
REFERENCE_LAYER = 0  # the layer column of the references (they read no map)


@dataclass
class ExampleUnits:
    """One example in pieces: ids (T,), token types (T,) or None, the piece positions of every unit."""

    idx: int
    ids: list[int]
    token_types: list[int] | None
    units: list[list[int]]


def make_items(tokenizer, examples: Sequence[GlueExample], level: str, max_length: int | None
               ) -> tuple[list[ExampleUnits], list[int]]:
    """Items of the examples (whitespace words; pairs as the tokenizer joins them); too long ones are skipped
    (their idx returned)."""
    if level not in ("word", "piece"):
        raise ValueError(f"analysis.level must be word or piece, got {level!r}")
    items, skipped = [], []
    for ex in examples:
        a = ex.text_a.split()
        if ex.text_b is not None:
            [enc] = encode_word_pairs(tokenizer, [(a, ex.text_b.split())])
        else:
            [enc] = encode_words(tokenizer, [a])
        if max_length and enc.n_pieces > max_length:
            skipped.append(ex.idx)
            continue
        wop, n = enc.word_of_piece, enc.n_words
        if level == "word":
            units = [[t for t, w in enumerate(wop) if w == k] for k in range(n)]
            units = [u for u in units if u]
        else:
            units = [[t] for t, w in enumerate(wop) if 0 <= w < n]
        items.append(ExampleUnits(ex.idx, list(enc.input_ids), enc.token_type_ids, units))
    return items, skipped


def erased(item: ExampleUnits, removed: Sequence[int], erase: str, mask_id: int | None
           ) -> tuple[list[int], list[int] | None]:
    """``(ids, token types)`` of the item with the units ``removed`` deleted (``delete``) or masked (``mask``)."""
    pos = {t for u in removed for t in item.units[u]}
    tt = item.token_types
    if erase == "delete":
        keep = [t for t in range(len(item.ids)) if t not in pos]
        return [item.ids[t] for t in keep], None if tt is None else [tt[t] for t in keep]
    if erase == "mask":
        return [mask_id if t in pos else i for t, i in enumerate(item.ids)], tt
    raise ValueError(f"analysis.erase must be delete or mask, got {erase!r}")


def top_counts(n_units: int, bins: Sequence[float]) -> list[int]:
    """k of every bin (% of the units): ceil(bin * n / 100), at least 1, at most n."""
    return [min(n_units, max(1, math.ceil(b * n_units / 100 - 1e-9))) for b in bins]


def ranking(scores: np.ndarray) -> np.ndarray:
    """Units from most to least important (ties by position)."""
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


def unit_scores(piece_scores: np.ndarray, units: list[list[int]]) -> np.ndarray:
    """(..., T) piece scores -> (..., U): the sum over each unit's pieces."""
    return np.stack([piece_scores[..., u].sum(-1) for u in units], axis=-1)


def aopc(p: float, probs_removed: Sequence[float]) -> float:
    """Mean over the bins of ``p - p_removed``."""
    return float(np.mean([p - q for q in probs_removed]))


class Classifier:
    """Class probabilities of many token sequences, padded in length batches (one forward per batch)."""

    def __init__(self, model, pad_id: int, device: str, max_tokens: int = 8192, max_batch_size: int = 256):
        self.model, self.pad_id, self.device = model, pad_id, device
        self.max_tokens, self.max_batch_size = int(max_tokens), int(max_batch_size)

    @torch.inference_mode()
    def probs(self, seqs: Sequence[tuple[list[int], list[int] | None]]) -> np.ndarray:
        """(N, C) softmax probabilities of ``seqs`` = [(ids, token types or None)]."""
        out = [None] * len(seqs)
        for batch in length_batches([max(len(s[0]), 1) for s in seqs], self.max_tokens, self.max_batch_size):
            types = [seqs[b][1] for b in batch] if any(seqs[b][1] is not None for b in batch) else None
            inp = pad([seqs[b][0] for b in batch], self.pad_id, types)
            inp = {k: v.to(self.device) for k, v in inp.items()}
            logits = self.model(**structure.model_inputs(self.model, **inp)).logits.float()  # (B, C)
            p = logits.softmax(-1).cpu().numpy()
            for j, b in enumerate(batch):
                out[b] = p[j]
        return np.stack(out)


# ----------------------------------------------------------------------------- importances
def map_importance(measure, model, item: ExampleUnits, row: int, device: str) -> np.ndarray:
    """(L, T) importance of every piece read from row ``row`` of each layer's map (mean over heads)."""
    ids = torch.tensor([item.ids], device=device)  # (1, T)
    tt = None if item.token_types is None else torch.tensor([item.token_types], device=device)  # (1, T)
    with fixed_inputs(model, token_type_ids=tt), torch.inference_mode():
        maps = measure(model, ids, torch.ones_like(ids))  # L x (1, H', T, T)
    return torch.stack([m[0, :, row, :].float().mean(0) for m in maps]).double().cpu().numpy()  # (L, T)


def gradient_scores(method: str):
    """``f(model, item, target, device, ig_steps, seed) -> (T,)``: the signed attribution of the target logit
    per piece (summed over the embedding dimension)."""
    def f(model, item: ExampleUnits, target: int, device: str, ig_steps: int, seed: int) -> np.ndarray:
        tt = None if item.token_types is None else torch.tensor(item.token_types, device=device)
        attr = logit_attributions(model, torch.tensor(item.ids, device=device), target, method, ig_steps, tt)
        return attr.sum(-1).double().cpu().numpy()  # (T,)
    return f


def random_scores(model, item: ExampleUnits, target: int, device: str, ig_steps: int, seed: int) -> np.ndarray:
    """(T,) uniform scores, seeded by ``seed`` and the example's idx."""
    return np.random.default_rng([seed, item.idx]).random(len(item.ids))


# the references computed from the input (``loo`` comes from the blank-out forwards)
REFERENCES = {"ixg": gradient_scores("ixg"), "ig": gradient_scores("ig"), "random": random_scores}
REFERENCE_NAMES = (*REFERENCES, "loo")


# ----------------------------------------------------------------------------- one example
@dataclass
class ExampleScores:
    """What one example gives: the prediction, blank-out, every ranking's unit scores and the metric rows."""

    predicted: int
    p: float
    blankout: np.ndarray                      # (U,)
    scores: dict[tuple[str, int], np.ndarray]  # (kind, layer) -> (U,) importance; references at layer 0
    rows: list[dict]                           # one per (kind, layer): the metrics


def _timed(timing: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0
    return out


def score_example(item: ExampleUnits, model, measures: dict, clf: Classifier, *, references: Sequence[str], row: int,
                  erase: str, mask_id: int | None, bins: Sequence[float], aopc_layers: Sequence[int],
                  ig_steps: int, seed: int, device: str, timing: dict | None = None) -> ExampleScores:
    """Importances, blank-out and metrics of one item (see the module doc). ``aopc_layers``: 1-based.

    One batched pass of the classifier over the blank-out inputs and every ranking's bins; the
    leave-one-out ranking, known only from blank-out, needs a second one for its bins."""
    timing = {} if timing is None else timing
    U = len(item.units)
    p0 = clf.probs([(item.ids, item.token_types)])[0]
    c = int(p0.argmax())
    p = float(p0[c])
    scores: dict[tuple[str, int], np.ndarray] = {}
    for kind, measure in measures.items():
        imp = unit_scores(_timed(timing, kind, map_importance, measure, model, item, row, device), item.units)
        for layer in range(imp.shape[0]):  # (L, U)
            scores[(kind, layer + 1)] = imp[layer]
    ixg = unit_scores(_timed(timing, "ixg", REFERENCES["ixg"], model, item, c, device, ig_steps, seed), item.units)
    for ref in references:
        if ref in REFERENCES:
            scores[(ref, REFERENCE_LAYER)] = ixg if ref == "ixg" else unit_scores(
                _timed(timing, ref, REFERENCES[ref], model, item, c, device, ig_steps, seed), item.units)
    ks = top_counts(U, bins)
    prob: dict[frozenset, float] = {}

    def plan(s: np.ndarray) -> tuple[list[frozenset], list[frozenset]]:
        order = [int(u) for u in ranking(s)]
        return [frozenset(order[:k]) for k in ks], [frozenset(order[k:]) for k in ks]

    def run(keys) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in prob]
        if new:
            prob.update(zip(new, clf.probs([erased(item, sorted(k), erase, mask_id) for k in new])[:, c]))

    t0 = time.perf_counter()
    plans = {key: plan(s) for key, s in scores.items() if key[1] in aopc_layers or key[1] == REFERENCE_LAYER}
    blank_keys = [frozenset([u]) for u in range(U)]
    run(blank_keys + [k for comp, suff in plans.values() for k in comp + suff])
    blank = np.array([p - prob[k] for k in blank_keys])  # (U,)
    if "loo" in references:
        scores[("loo", REFERENCE_LAYER)] = blank
        plans[("loo", REFERENCE_LAYER)] = plan(blank)
        run([k for k in sum(plans[("loo", REFERENCE_LAYER)], [])])
    timing["perturbations"] = timing.get("perturbations", 0.0) + time.perf_counter() - t0
    rows = []
    for (kind, layer), s in scores.items():
        r = dict(example=item.idx, kind=kind, layer=layer, n_units=U, predicted=c, p=p,
                 comprehensiveness=np.nan, sufficiency=np.nan,
                 spearman_blankout=float(spearman_rows(s, blank)) if U > 1 else np.nan,
                 spearman_grad=float(spearman_rows(s, ixg)) if U > 1 else np.nan)
        if (kind, layer) in plans:
            comp, suff = plans[(kind, layer)]
            r["comprehensiveness"] = aopc(p, [prob[k] for k in comp])
            r["sufficiency"] = aopc(p, [prob[k] for k in suff])
        rows.append(r)
    return ExampleScores(c, p, blank, scores, rows)


# ----------------------------------------------------------------------------- tables and figures
def summarize(examples: pd.DataFrame, n_boot: int, seed: int) -> pd.DataFrame:
    """(kind, layer, metric, mean, lo, hi, n): means over examples with bootstrap intervals."""
    long = examples.melt(id_vars=["example", "kind", "layer"], value_vars=list(METRICS), var_name="metric")
    wide = long.pivot_table(index="example", columns=["kind", "layer", "metric"], values="value", dropna=False,
                            aggfunc="first")
    mean, lo, hi, n = bootstrap_mean(wide.to_numpy(), n_boot, seed)
    out = pd.DataFrame(list(wide.columns), columns=["kind", "layer", "metric"])
    out["mean"], out["lo"], out["hi"], out["n"] = mean, lo, hi, n
    return out[out.n > 0].reset_index(drop=True)


def paper_numbers() -> list[dict]:
    """The papers' numbers of this analysis (``probes/report/papers.yaml``, section ``analysis: faithfulness``)."""
    for paper in load_papers():
        for sec in paper["sections"]:
            if sec.get("analysis") == "faithfulness":
                return [dict(x) for x in sec.get("numbers") or []]
    return []


def main_table(layers: pd.DataFrame, kinds: Sequence[str], references: Sequence[str], layer: int,
               papers: list[dict]) -> pd.DataFrame:
    """kind x metric (with ``_lo``/``_hi``) at ``layer`` for the map kinds, the references at layer 0."""
    rows = []
    for kind in [*kinds, *references]:
        at = REFERENCE_LAYER if kind in references else layer
        d = layers[(layers.kind == kind) & (layers.layer == at)].set_index("metric")
        r = dict(kind=kind, layer=at)
        for m in METRICS:
            r[m] = d["mean"].get(m, np.nan)
            r[f"{m}_lo"], r[f"{m}_hi"] = d["lo"].get(m, np.nan), d["hi"].get(m, np.nan)
        r["n"] = int(d["n"].max()) if len(d) else 0
        r["paper"] = "; ".join(f"{x['metric']} {x['value']} ({x['source']}, {x['model']})" for x in papers
                               if x["kind"] == kind)
        rows.append(r)
    return pd.DataFrame(rows)


def heatmap_figure(table: pd.DataFrame, title: str):
    """Kinds (rows) x metrics (columns), each column coloured on its own scale, annotated with the means."""
    vals = table[list(METRICS)].to_numpy(dtype=float)  # (K, 4)
    lo, hi = np.nanmin(vals, 0), np.nanmax(vals, 0)
    norm = (vals - lo) / np.where(hi > lo, hi - lo, 1.0)
    norm[:, 1] = 1 - norm[:, 1]  # sufficiency: lower is better
    fig, ax = plt.subplots(figsize=(7, 0.42 * len(table) + 1.6))
    ax.imshow(np.nan_to_num(norm, nan=0.5), cmap="viridis", aspect="auto", vmin=0, vmax=1)
    for i in range(vals.shape[0]):
        for j in range(vals.shape[1]):
            ax.text(j, i, "-" if np.isnan(vals[i, j]) else f"{vals[i, j]:.3f}", ha="center", va="center",
                    color="w" if norm[i, j] < 0.5 else "k", fontsize=8)
    ax.set_xticks(range(len(METRICS)), ["comprehensiveness ↑", "sufficiency ↓", "ρ blank-out ↑", "ρ ∇×input ↑"],
                  fontsize=8)
    ax.set_yticks(range(len(table)), [f"{k} (L{l})" if l else k for k, l in zip(table.kind, table.layer)],
                  fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def layers_figure(layers: pd.DataFrame, kinds: Sequence[str], references: Sequence[str], title: str):
    """One panel per metric: each map kind across the layers, the references as horizontal lines; every panel
    spans the same layers (AOPC may be scored at the selected layer only), on whole-number ticks."""
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
    scored = layers.layer[layers.layer > 0]  # the references' rows are layer 0
    for ax, m in zip(axes, METRICS):
        if len(scored):
            ax.set_xlim(scored.min() - 0.5, scored.max() + 0.5)
            layer_ticks(ax, int(scored.min()), int(scored.max()))
        d = layers[layers.metric == m]
        for kind in kinds:
            k = d[d.kind == kind].sort_values("layer")
            if len(k):
                ax.plot(k.layer, k["mean"], marker="o", ms=3, label=kind)
                ax.fill_between(k.layer, k.lo, k.hi, alpha=0.12)
        for j, ref in enumerate(references):
            r = d[d.kind == ref]
            if len(r):
                ax.axhline(float(r["mean"].iloc[0]), ls=["--", ":", "-.", (0, (1, 3))][j % 4], color="k", lw=1,
                           label=ref)
        ax.set_xlabel("layer")
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the analysis
@dataclass(frozen=True)
class ExampleChoice:
    """Which fine-tuned models and which of their GLUE examples (the analysis node's keys of the same names)."""

    checkpoint: object = None           # GLUE run dir | <run>/hf_model | .ckpt; or {task: path}
    task: str | None = None             # None: read from the checkpoint
    split: str = "dev"
    first_example: int = 0              # 0-based
    max_examples: int | None = None     # N examples from first_example; None = all
    max_length: int | None = 128        # pieces incl. specials; longer examples are skipped


@dataclass(frozen=True)
class Scoring:
    """How the rankings are read and scored (the analysis node's keys of the same names; see the module doc)."""

    kinds: tuple[str, ...] = ("attention", "rollout")
    references: tuple[str, ...] = ("ixg", "ig", "loo", "random")
    layer: int | None = None            # 1-based layer of the main table; None = the last
    row: int = 0                        # the map row read: 0 = [CLS] / <s>, -1 = the last piece
    level: str = "word"                 # word | piece
    erase: str = "delete"               # delete | mask
    bins: tuple[float, ...] = (1, 5, 10, 20, 50)  # % of the units removed / kept
    aopc_layers: str = "selected"       # selected | all
    ig_steps: int = 20
    max_tokens: int = 8192              # pieces per classifier batch
    seed: int = 0

    def __post_init__(self):
        unknown = [r for r in self.references if r not in REFERENCE_NAMES]
        if unknown:
            raise ValueError(f"analysis.references: unknown {unknown} ({' | '.join(REFERENCE_NAMES)})")
        if self.aopc_layers not in ("selected", "all"):
            raise ValueError(f"analysis.aopc_layers must be selected or all, got {self.aopc_layers!r}")
        if self.erase not in ("delete", "mask"):
            raise ValueError(f"analysis.erase must be delete or mask, got {self.erase!r}")


@dataclass
class TaskFaithfulness:
    """The scores of one fine-tuned model on its task's examples."""

    task: str
    checkpoint: str                     # the model's folder
    suffix: str                         # of the file names: _<task> when several models are scored
    layer: int                          # the 1-based layer of the main table
    aopc_layers: list[int]              # the 1-based layers scored with AOPC
    n_examples: int
    n_skipped: int                      # examples longer than max_length
    accuracy: float                     # of the predictions on the full inputs
    seconds: dict[str, float]           # per kind / reference / the perturbations
    examples: pd.DataFrame              # one row per (example, kind, layer): the metrics
    layers: pd.DataFrame                # (kind, layer, metric, mean, lo, hi, n)


@dataclass
class FaithfulnessResult:
    """What :func:`compute` returns."""

    examples: ExampleChoice
    scoring: Scoring
    tasks: list[TaskFaithfulness]       # one per checkpoint, in order
    papers: list[dict]                  # the papers' numbers (probes/report/papers.yaml)


@dataclass
class TaskTables:
    """The tables of one checkpoint (``<name><suffix>.csv``)."""

    suffix: str
    main: pd.DataFrame                  # faithfulness
    layers: pd.DataFrame                # faithfulness_layers
    examples: pd.DataFrame              # faithfulness_examples


@dataclass
class FaithfulnessTables:
    """The analysis's tables: per checkpoint, and the papers' numbers (None when there are none)."""

    tasks: list[TaskTables]
    papers: pd.DataFrame | None


def partial_writer(output_dir) -> Callable[[str, list[dict] | None], None]:
    """``f(suffix, rows)``: write the rows so far to ``faithfulness_examples<suffix>.partial.csv`` in
    ``output_dir`` (a stopped run keeps them); ``rows`` None removes the file."""
    def write(suffix: str, rows: list[dict] | None) -> None:
        path = Path(output_dir) / f"faithfulness_examples{suffix}.partial.csv"
        if rows is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write(path, lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))
    return write


def _score_task(ctx, want_task: str | None, path, choice: ExampleChoice, scoring: Scoring, measures: dict,
                several: bool, n_boot: int, log_every: int, partial) -> TaskFaithfulness:
    """The scores of one checkpoint (see :func:`compute`); ``several``: one of several (the files get its task)."""
    ft = load_checkpoint(ctx, path, want_task, require_task=True)
    suffix = f"_{ft.task}" if several else ""
    spec = task_spec(ft.task)
    if spec.num_labels < 2:
        raise ValueError(f"{ft.path}: {ft.task} is a regression task; faithfulness needs a classifier")
    model = ft.model.to(ctx.device).eval()
    L = int(model.config.num_hidden_layers)
    sel = L if scoring.layer is None else int(scoring.layer)
    if not 1 <= sel <= L:
        raise ValueError(f"analysis.layer={scoring.layer} out of range 1..{L} (1-based; null = the last)")
    row = scoring.row
    if is_causal(model.config) and int(row) == 0:
        raise ValueError(f"analysis.row=0 reads the first token's row, which on the causal model of {ft.path} "
                         "sees only itself; use analysis.row=-1, the last token (the one its classifier pools)")
    mask_id = ft.tokenizer.mask_token_id
    if scoring.erase == "mask" and mask_id is None:
        raise ValueError(f"analysis.erase=mask: the tokenizer of {ft.path} has no mask token")
    split, first = choice.split, choice.first_example
    examples = read_glue(ft.task, split, ctx.data_dir)
    examples = examples[first:None if choice.max_examples is None else first + choice.max_examples]
    items, skipped = make_items(ft.tokenizer, examples, scoring.level, choice.max_length)
    if not items:
        raise ValueError(f"no {ft.task} {split} example of at most {choice.max_length} pieces")
    short = [it for it in items if not sentence_rows([int(row)], len(it.ids))]
    if short:
        raise ValueError(f"analysis.row={row}: {len(short)} {ft.task} {split} examples have no such row "
                         f"(the shortest has {min(len(it.ids) for it in short)} pieces); 0 = the first piece, "
                         "-1 = the last")
    log.info("faithfulness: %s %s, %d examples (%d longer than %s pieces skipped), %s level, %d kinds",
             ft.task, split, len(items), len(skipped), choice.max_length, scoring.level, len(scoring.kinds))
    clf = Classifier(model, ft.tokenizer.pad_token_id, ctx.device, scoring.max_tokens)
    aopc_at = list(range(1, L + 1)) if scoring.aopc_layers == "all" else [sel]
    rows, timing, correct = [], {}, 0
    labels = {ex.idx: ex.label for ex in examples}
    t_loop = time.time()
    for i, item in enumerate(tqdm(items, desc=f"faithfulness {ft.task}", unit="ex", disable=None)):
        if i and i % log_every == 0:  # the bar is off without a terminal: a line with the estimate
            el = time.time() - t_loop
            log.info("faithfulness %s: %d/%d examples, %.0f s elapsed, ~%.0f s left", ft.task, i, len(items), el,
                     el / i * (len(items) - i))
            if partial is not None:
                partial(suffix, rows)
        es = score_example(item, model, measures, clf, references=list(scoring.references), row=row,
                           erase=scoring.erase, mask_id=mask_id, bins=scoring.bins, aopc_layers=aopc_at,
                           ig_steps=scoring.ig_steps, seed=scoring.seed, device=ctx.device, timing=timing)
        correct += int(es.predicted == labels[item.idx])
        rows += es.rows
    ex_df = pd.DataFrame(rows)
    if partial is not None:
        partial(suffix, None)
    for m in METRICS:
        v = ex_df[m].to_numpy(dtype=float)
        if np.isinf(v).any():
            raise FloatingPointError(f"faithfulness: non-finite {m} values")
    return TaskFaithfulness(ft.task, ft.path, suffix, sel, aopc_at, len(items), len(skipped), correct / len(items),
                            timing, ex_df, summarize(ex_df, n_boot, scoring.seed))


def compute(ctx, choice: ExampleChoice, scoring: Scoring, measures: dict[str, Measure], *, n_boot: int = 1000,
            log_every: int = 25, partial: Callable[[str, list[dict] | None], None] | None = None
            ) -> FaithfulnessResult:
    """The per-example scores and their means of every checkpoint.

    Args:
        ctx: The analysis context (device, data, map kinds).
        choice: Which models and examples.
        scoring: How the rankings are read and scored.
        measures: Kind -> its measure, for every kind of ``scoring.kinds``.
        n_boot: Bootstrap resamples of the examples.
        log_every: A log line with the time left every N examples.
        partial: Called with the rows so far every ``log_every`` examples and with None at the end of a
            checkpoint (:func:`partial_writer`); None: nothing is written.

    Returns:
        The scores of every checkpoint and the papers' numbers.
    """
    by_task = checkpoints(choice.checkpoint, choice.task)
    tasks = [_score_task(ctx, want_task, path, choice, scoring, measures, len(by_task) > 1, n_boot, log_every,
                         partial) for want_task, path in by_task.items()]
    return FaithfulnessResult(choice, scoring, tasks, paper_numbers())


def tables(result: FaithfulnessResult) -> FaithfulnessTables:
    """The main, per-layer and per-example tables of every checkpoint of ``result``, and the papers' numbers."""
    kinds, refs = list(result.scoring.kinds), list(result.scoring.references)
    return FaithfulnessTables(
        tasks=[TaskTables(t.suffix, main_table(t.layers, kinds, refs, t.layer, result.papers), t.layers, t.examples)
               for t in result.tasks],
        papers=pd.DataFrame(result.papers) if result.papers else None)


def save(ctx, result: FaithfulnessResult, frames: FaithfulnessTables, started: float) -> None:
    """Stage 3, :class:`probes.analysis.stages.Save` (arguments and contract there): per checkpoint
    ``faithfulness[_<task>]``, ``faithfulness_layers[...]``, ``faithfulness_examples[...]`` .csv and the
    ``faithfulness[...]`` / ``faithfulness_layers[...]`` .png, with ``faithfulness_papers.csv`` when the
    papers' numbers are known; the summary holds per task the settings, timing and main table."""
    sc, split = result.scoring, result.examples.split
    summary = {}
    for t, tab in zip(result.tasks, frames.tasks):
        ctx.save_table(tab.main, f"faithfulness{t.suffix}")
        ctx.save_table(tab.layers, f"faithfulness_layers{t.suffix}")
        ctx.save_table(tab.examples, f"faithfulness_examples{t.suffix}")
        if frames.papers is not None:
            ctx.save_table(frames.papers, "faithfulness_papers")
        what = f"{t.task} {split}, {t.n_examples} examples, {sc.level} level, erase={sc.erase}"
        ctx.save_figure(heatmap_figure(tab.main, f"{what}: layer {t.layer} row {sc.row}"), f"faithfulness{t.suffix}")
        ctx.save_figure(layers_figure(tab.layers, list(sc.kinds), list(sc.references), what),
                        f"faithfulness_layers{t.suffix}")
        summary[t.task] = dict(checkpoint=t.checkpoint, n_examples=t.n_examples, skipped_too_long=t.n_skipped,
                               accuracy=t.accuracy, layer=t.layer, row=sc.row, level=sc.level, erase=sc.erase,
                               bins=list(sc.bins), aopc_layers=t.aopc_layers, ig_steps=sc.ig_steps,
                               seconds_per_kind={k: round(v, 1) for k, v in t.seconds.items()},
                               table={r["kind"]: {m: r[m] for m in METRICS} for r in tab.main.to_dict("records")})
    ctx.log_summary(dict(analysis="faithfulness", split=split, tasks=summary, seconds=round(time.time() - started, 1)))


def faithfulness_analysis(ctx, *, checkpoint=None, task: str | None = None, split: str = "dev",
                          max_examples: int | None = None, first_example: int = 0, max_length: int | None = 128,
                          kinds: Sequence[str] = ("attention", "rollout"), measures=None,
                          references: Sequence[str] = ("ixg", "ig", "loo", "random"), layer: int | None = None,
                          row: int = 0, level: str = "word", erase: str = "delete",
                          bins: Sequence[float] = (1, 5, 10, 20, 50), aopc_layers: str = "selected",
                          ig_steps: int = 20, n_boot: int = 1000, max_tokens: int = 8192,
                          log_every: int = 25, seed: int = 0) -> pd.DataFrame:
    """The faithfulness table of every checkpoint (the keys: :class:`ExampleChoice`, :class:`Scoring`, the module
    doc; ``measures``: kinds built from this node instead of ``extract.measures``); returns the last one's main
    table."""
    started = time.time()
    scoring = Scoring(kinds=tuple(str(k) for k in kinds), references=tuple(str(r) for r in references), layer=layer,
                      row=row, level=level, erase=erase, bins=tuple(bins), aopc_layers=aopc_layers, ig_steps=ig_steps,
                      max_tokens=max_tokens, seed=seed)
    choice = ExampleChoice(checkpoint=checkpoint, task=task, split=split, first_example=first_example,
                           max_examples=max_examples, max_length=max_length)
    own = dict(measures or {})  # Hydra has built them already (recursive instantiation); plain nodes are built here
    own = {k: v if isinstance(v, Measure) else instantiate(v) for k, v in own.items()}
    built = {k: own[k] if k in own else ctx.measure(k)[1] for k in scoring.kinds}
    result = compute(ctx, choice, scoring, built, n_boot=n_boot, log_every=log_every,
                     partial=partial_writer(ctx.output_dir))
    frames = tables(result)
    save(ctx, result, frames, started)
    return frames.tasks[-1].main if frames.tasks else None


# ----------------------------------------------------------------------------- runs over parts of a split
SETTINGS = ("checkpoint", "layer", "row", "level", "erase", "bins", "aopc_layers", "ig_steps")


def _part(folder: Path) -> tuple[str, dict, dict, pd.DataFrame]:
    """``(task, settings, summary, examples)`` of a finished run, or of a stopped one (its
    ``faithfulness_examples.partial.csv`` and ``.hydra/config.yaml``; ``summary`` then ``{"partial": True}``)."""
    if (folder / "summary.json").exists() and (folder / "faithfulness_examples.csv").exists():
        s = json.loads((folder / "summary.json").read_text())
        [(task, t)] = s["tasks"].items()
        return task, {k: t[k] for k in SETTINGS}, {**t, "seconds": s["seconds"], "split": s.get("split")}, \
            pd.read_csv(folder / "faithfulness_examples.csv")
    partial, cfg = folder / "faithfulness_examples.partial.csv", folder / ".hydra" / "config.yaml"
    if not (partial.exists() and cfg.exists()):
        raise FileNotFoundError(f"{folder}: neither a finished faithfulness run (summary.json, faithfulness_examples.csv)"
                                f" nor a stopped one ({partial.name} and .hydra/config.yaml)")
    a = OmegaConf.load(cfg).analysis
    ex = pd.read_csv(partial)
    if not a.task:
        raise ValueError(f"{cfg}: a stopped run merges only with analysis.task set")
    t = dict(checkpoint=str(hf_folder(a.checkpoint) or a.checkpoint), layer=int(a.layer or ex.layer.max()), row=int(a.row), level=str(a.level),
             erase=str(a.erase), bins=[float(b) if float(b) % 1 else int(b) for b in a.bins],
             aopc_layers=sorted({int(x) for x in ex.layer[ex.comprehensiveness.notna() & (ex.layer > 0)]}),
             ig_steps=int(a.ig_steps))
    return str(a.task), t, {"partial": True, "split": str(a.split), "n_examples": int(ex.example.nunique())}, ex


def merge(folders: Sequence, out_dir, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One run's tables, figures and ``summary.json`` in ``out_dir`` from runs over disjoint parts of one split
    (``analysis.first_example`` / ``max_examples``, one checkpoint each, the same settings); the per-example
    numbers do not depend on the part, so this equals one run over all the examples. A stopped run contributes
    the examples of its ``faithfulness_examples.partial.csv`` (written every ``log_every`` examples).

    ``python -c "from probes.analysis.beyond.faithfulness import merge; merge(['run-a', 'run-b'], 'merged')"``
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [(f, *_part(f)) for f in map(Path, folders)]
    f0, task, t0, s0, _ = parts[0]
    for f, tk, t, _, _ in parts[1:]:
        diff = [k for k in SETTINGS if t.get(k) != t0.get(k)]
        if tk != task or diff:
            raise ValueError(f"{f}: not a part of the run in {f0} (task {tk} vs {task}; settings differ: {diff})")
    ex_df = pd.concat([p[-1] for p in parts], ignore_index=True)
    ids = ex_df.drop_duplicates(["example", "kind", "layer"])
    if len(ids) != len(ex_df):
        raise ValueError(f"merge: the runs {list(map(str, folders))} share examples")
    references = [k for k in dict.fromkeys(ex_df.kind[ex_df.layer == REFERENCE_LAYER])]
    kinds = [k for k in dict.fromkeys(ex_df.kind) if k not in references]
    layers_df = summarize(ex_df, n_boot, seed)
    table = main_table(layers_df, kinds, references, int(t0["layer"]), paper_numbers())
    n = int(ex_df.example.nunique())
    for name, df in (("faithfulness", table), ("faithfulness_layers", layers_df), ("faithfulness_examples", ex_df),
                     ("faithfulness_papers", pd.DataFrame(paper_numbers()))):
        atomic_write(out / f"{name}.csv", lambda tmp, df=df: df.to_csv(tmp, index=False))
    what = f"{task} {s0.get('split', '')}, {n} examples, {t0['level']} level, erase={t0['erase']}"
    for name, fig in (("faithfulness", heatmap_figure(table, f"{what}: layer {t0['layer']} row {t0['row']}")),
                      ("faithfulness_layers", layers_figure(layers_df, kinds, references, what))):
        atomic_write(out / f"{name}.png", lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=120,
                                                                            bbox_inches="tight"))
        plt.close(fig)
    timing = {}
    for *_, s, _ in parts:
        for k, v in (s.get("seconds_per_kind") or {}).items():
            timing[k] = round(timing.get(k, 0.0) + v, 1)
    done = [s for *_, s, _ in parts if not s.get("partial")]
    summary = dict(analysis="faithfulness", split=s0.get("split"),
                   parts=[dict(folder=str(f), examples=int(ex.example.nunique()), stopped=bool(s.get("partial")),
                               seconds=s.get("seconds")) for f, _, _, s, ex in parts],
                   tasks={task: {**t0, "n_examples": n, "seconds_per_kind_finished_parts": timing,
                                 "accuracy_finished_parts": (sum(s["accuracy"] * s["n_examples"] for s in done) /
                                                             sum(s["n_examples"] for s in done)) if done else None,
                                 "table": {r["kind"]: {m: r[m] for m in METRICS} for r in table.to_dict("records")}}})
    text = json.dumps(summary, indent=1, sort_keys=True, default=lambda o: o.item())  # numpy scalars
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(text))
    return table
