"""``analysis=pattern_types``: Kovaleva et al. 2019 §3, Figure 2 — how often each attention pattern type occurs.

For each task in ``task`` (one GLUE task or a list) its ``split`` examples (first ``max_examples``
that are ``min_length``..``max_length`` wordpieces long; the CNN was trained on maps of 12 to 64)
are encoded as the labelled maps were (``[CLS] a [SEP] b [SEP]`` for pairs, the model's own
tokenizer, :func:`probes.model.inputs.encode_texts`); every head's full wordpiece map (live, batch by batch on the
device, :func:`head_predictions`) is classified by the trained CNN (``classifier``, a
``.ckpt`` of ``python train.py experiment=patterns`` or its run folder). Done for the pre-trained
``encoder``, and for the fine-tuned model ``checkpoint`` when given (a GLUE run folder, its
``hf_model`` folder or a ``.ckpt``; ``{task: path}`` for several tasks; same vocabulary as ``encoder``).

Shares are over all (example, layer, head) maps: share(pattern) = #maps of that type / #maps (``share``,
the classifier's raw output). **Corrected shares** (``corrected``): the classifier errs, and its errors are
measured by the stratified cross-validation of ``python -m probes.patterns crossval`` (``confusion``: its
``confusion.csv`` or report folder; rows = gold, columns = predicted). With C[i, j] = P(predicted j | gold i)
(rows of the classes with at least ``min_support`` labelled maps; block, with 4, cannot be estimated and
is assumed absent), the observed shares q satisfy q = C^T p; p is the solution on the simplex
(non-negative least squares with the sum-to-one row weighted by 1000, then renormalised;
:func:`correct_shares`). Intervals (95%, percentile bootstrap, ``n_boot``): examples of the task are
resampled (with their 72 maps) AND the cross-validation predictions are resampled (so C varies), the
correction re-solved each time. A pre-trained vs fine-tuned **shift** of a pattern is the difference of
the two corrected shares on the same resampled examples and matrices; it is called a shift
(``shift=True`` in ``pattern_types_shift.csv``) only when its interval excludes 0.

``cache`` (a folder, e.g. ``${paths.cache_dir}/pattern_types``; null = off): every (task, model)'s
predicted class of every example's map of every head is stored there under a key of everything it depends
on (task, split, length range, the classifier file, the model: the encoder config, or the fine-tuned
folder's files with sizes and times); a run asking for the first N examples reuses a stored run of N or
more, so a five-task command after per-task runs only re-does the bootstrap.

Outputs: ``pattern_types.csv`` (task, model, pattern, count, share, share_lo/hi, corrected,
corrected_lo/hi, n_examples), ``pattern_types_shift.csv`` (task, pattern, diff, lo, hi, shift),
``pattern_types_raw.png`` (stacked raw shares), ``pattern_types_by_layer.csv``
(task, model, layer (0-based), pattern, count, share), ``pattern_types_by_head.csv`` (task, model,
layer, head, name (1-based), pattern, share), ``pattern_types.png`` (corrected shares with intervals per
task and model, Figure 2), ``pattern_types_by_layer.png`` (raw stacked bars per layer), ``summary.json``.

In code: :func:`compute` (counts, shares, intervals; only the prediction cache is written) -> :func:`tables` ->
:func:`save`; the configured entry :func:`pattern_types` composes the three.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from scipy.optimize import nnls

from probes.analysis.kovaleva.common import FINETUNED, PRETRAINED, checkpoint_for, variants
from probes.analysis.naming import head_name
from probes.analysis.plots import layer_ticks
from probes.config import plain
from probes.data.glue import read_glue, task_spec
from probes.extract.cache import cache_key_hash
from probes.io import atomic_write
from probes.maps import MapEngine, pad_id_of
from probes.measures.attention import Attention
from probes.model.inputs import Encoded, encode_texts
from probes.patterns.module import load_classifier
from probes.stats import resamples

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


def head_predictions(classifier, model, items: list[Encoded], device: str = "cpu", max_tokens: int = 4096,
                     progress: bool = True, desc: str = "pattern_types", pad_id: int = 0) -> np.ndarray:
    """(N, L, H) class index of every example's map of every head (in ``items`` order).

    Batch by batch on the maps' device (:meth:`probes.maps.MapEngine.iter_piece_map_batches`, (B, L, H, T, T)
    padded maps): the batch's maps preprocessed and classified by the CNN together, whatever their lengths
    (:func:`classify_batch`; the preprocessing of training and of ``predict_maps``, to the rounding of the resize);
    only the (B, L, H) class indices come to the host."""
    pred = None
    engine = MapEngine(model, Attention(), pad_id=pad_id, device=device, max_tokens=max_tokens, max_batch_size=64,
                       max_pairs=None)
    for positions, lengths, maps in engine.iter_piece_map_batches(items, desc=desc, progress=progress):
        if pred is None:
            pred = np.zeros((len(items), *maps.shape[1:3]), dtype=np.int16)
        pred[positions] = classify_batch(classifier, maps, lengths).cpu().numpy()
    if pred is None:
        raise ValueError("no example to classify (all filtered by length?)")
    return pred


def classify_batch(classifier, maps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L, H) long class of every head's map of a padded batch, on the maps' device: maps (B, L, H, T, T), the
    sentence b's at ``[b, :, :, :lengths[b], :lengths[b]]``; the sentences of all lengths classified together
    (:meth:`~probes.patterns.module.PatternClassifier.predict_padded`)."""
    B, L, H, T, _ = maps.shape
    return classifier.predict_padded(maps.reshape(B, L * H, T, T), lengths).to(maps.device).view(B, L, H)


def count_predictions(pred: np.ndarray, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, H, C) counts per head and (N, C) counts per example of (N, L, H) class indices."""
    onehot = np.eye(n_classes, dtype=np.int64)[pred]  # (N, L, H, C)
    return onehot.sum(0), onehot.sum((1, 2))


def classify_heads(classifier, model, items: list[Encoded], device: str = "cpu", max_tokens: int = 4096,
                   progress: bool = True, desc: str = "pattern_types", pad_id: int = 0,
                   per_example: bool = False):
    """(L, H, n_classes) counts: how many examples' maps of each head fall in each class; with
    ``per_example`` also the (N, n_classes) counts of every example (in ``items`` order)."""
    pred = head_predictions(classifier, model, items, device, max_tokens, progress, desc, pad_id)
    counts, ex = count_predictions(pred, len(classifier.classes))
    return (counts, ex) if per_example else counts


def read_confusion(path, classes) -> np.ndarray:
    """(C, C) counts (rows = gold, columns = predicted) from ``crossval``'s confusion.csv (or its folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "confusion.csv"
    if not p.is_file():
        raise FileNotFoundError(f"confusion matrix not found: {p} (run `python -m probes.patterns crossval "
                                f"--out DIR` and set analysis.confusion=DIR)")
    df = pd.read_csv(p).set_index("gold")
    missing = [c for c in classes if c not in df.index or c not in df.columns]
    if missing:
        raise ValueError(f"{p}: classes {missing} missing (expected rows and columns {list(classes)})")
    return df.loc[list(classes), list(classes)].to_numpy(dtype=np.float64)


def read_cv_predictions(path, classes) -> tuple[np.ndarray, np.ndarray] | None:
    """(gold, predicted) class indices of ``crossval``'s predictions.csv next to confusion.csv, or None."""
    p = Path(path).expanduser()
    p = (p if p.is_dir() else p.parent) / "predictions.csv"
    if not p.is_file():
        return None
    df = pd.read_csv(p, dtype={"id": str})
    idx = {c: i for i, c in enumerate(classes)}
    return df.gold.map(idx).to_numpy(), df.predicted.map(idx).to_numpy()


def correct_shares(observed: np.ndarray, confusion: np.ndarray, estimable: np.ndarray) -> np.ndarray:
    """Shares p on the simplex with ``confusion_rows^T p ~= observed``: rows of the ``estimable`` gold classes
    (row-normalised counts, columns = all predicted classes); other classes get 0. NNLS with a heavily
    weighted sum-to-one row, then renormalised."""
    C = confusion[estimable] / np.maximum(confusion[estimable].sum(1, keepdims=True), 1e-12)  # (K, C)
    lam = 1e3
    A = np.vstack([C.T, lam * np.ones((1, C.shape[0]))])  # (C + 1, K)
    b = np.concatenate([observed, [lam]])
    x, _ = nnls(A, b)
    x = x / max(x.sum(), 1e-12)
    out = np.zeros(len(observed))
    out[estimable] = x
    return out


def bootstrap_shares(per_example: dict[str, np.ndarray], confusion: np.ndarray | None, cv, estimable,
                     n_boot: int = 1000, seed: int = 0) -> dict[str, np.ndarray]:
    """{variant: (n_boot, 2, C)} raw and corrected shares over resampled examples (the same resample for
    every variant: they share the examples) and, when ``cv`` (gold, predicted) is given, resampled
    cross-validation predictions (the same confusion matrix for every variant of a replicate)."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(per_example.values())))
    C = len(estimable)
    out = {v: np.zeros((n_boot, 2, C)) for v in per_example}
    for b, (i,) in enumerate(resamples(n, n_boot, rng)):  # i: (n,)
        conf = confusion
        if cv is not None:
            (j,) = next(resamples(len(cv[0]), 1, rng))  # (len(cv[0]),)
            conf = np.zeros((C, C))
            np.add.at(conf, (cv[0][j], cv[1][j]), 1)
        for v, ex in per_example.items():
            c = ex[i].sum(0).astype(np.float64)
            q = c / c.sum()
            out[v][b, 0] = q
            out[v][b, 1] = correct_shares(q, conf, estimable) if conf is not None else np.nan
    return out


def _file_stamp(path) -> list:
    """[(relative name, size, mtime_ns)] of a file, or of the files of a folder (two levels deep)."""
    p = Path(path).expanduser().resolve()
    files = [p] if p.is_file() else sorted(f for f in list(p.glob("*")) + list(p.glob("*/*")) if f.is_file()
                                           and f.suffix in (".safetensors", ".bin", ".ckpt", ".json", ".txt"))
    return [str(p)] + [(f.name if f == p else str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns)
                       for f in files]


def load_cached(cache_dir, key: str, n: int | None):
    """((n, L, H) predictions, n_skipped) of the first ``n`` examples (None: all) stored under ``key``, or None
    when not stored or fewer stored than asked."""
    if cache_dir is None:
        return None
    p = Path(cache_dir) / f"{key}.npz"
    if not p.is_file():
        return None
    with np.load(p) as z:
        if "pred" not in z.files:  # no stored predictions: recompute
            return None
        pred, complete = z["pred"], bool(z["complete"])
        if (n is None and not complete) or (n is not None and len(pred) < n and not complete):
            return None
        return pred[:n], int(z["n_skipped"])


def save_cached(cache_dir, key: str, pred: np.ndarray, n_skipped: int, complete: bool) -> None:
    """Store (N, L, H) predictions of the first N examples; ``complete``: N is every example in the length range."""
    if cache_dir is None:
        return
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    if (d / f"{key}.npz").is_file():
        with np.load(d / f"{key}.npz") as z:
            if len(z["pred"]) >= len(pred) or bool(z["complete"]):
                return  # a longer (or complete) prefix is stored already

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name
            np.savez(f, pred=pred, n_skipped=n_skipped, complete=complete)

    atomic_write(d / f"{key}.npz", write)


def layer_head_tables(counts: dict[tuple[str, str], np.ndarray], classes) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(by layer, by head) share tables of the (L, H, C) counts of every (task, model)."""
    lrows, hrows = [], []
    for (task, variant), c in counts.items():
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
    return pd.DataFrame(lrows), pd.DataFrame(hrows)


def stacked_bars(df: pd.DataFrame, classes, by_layer: bool = False):
    """Raw shares as stacked bars: one bar per task x model, or (``by_layer``) one panel per task x model with
    a bar per layer."""
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
            ax.bar([l + 1 for l in layers], 100 * v, bottom=100 * bottom, label=p, color=COLORS.get(p))
            bottom += v
        if layers:
            layer_ticks(ax, int(layers[0]) + 1, int(layers[-1]) + 1, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(f"{t} ({m})", fontsize=8)
    axes[0][0].set_ylabel("share of maps (%)")
    axes[0][-1].legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class PatternTypesSettings:
    """The analysis node's keys (conf/analysis/pattern_types.yaml; see the module doc)."""

    classifier: str                     # the pattern CNN: .ckpt of experiment=patterns or its run folder
    encoder: dict                       # the encoder's config node: names the pre-trained model's cache entries
    checkpoint: object = None           # fine-tuned GLUE model: a path or {task: path}
    tasks: tuple[str, ...] = ("mrpc",)
    split: str = "dev"
    max_examples: int | None = 1000     # first N examples within the length range; None = all
    min_length: int = 12
    max_length: int | None = 64
    max_tokens: int = 4096              # per forward batch
    confusion: str | None = None        # crossval report folder or its confusion.csv
    min_support: int = 5                # classes with fewer labelled maps are not estimable
    n_boot: int = 1000
    seed: int = 0
    cache: str | None = None            # folder of the stored per-head predictions; None = off


@dataclass
class ModelPatterns:
    """One model's pattern counts on one task, with the raw and corrected shares and their intervals."""

    task: str
    model: str                          # pre-trained | fine-tuned
    counts: np.ndarray                  # (L, H, C) maps per head and class
    per_example: np.ndarray             # (N, C) maps per example and class
    n_skipped: int                      # examples outside the length range
    checkpoint: str | None              # the fine-tuned model's path
    shares: np.ndarray                  # (C,) raw shares
    corrected: np.ndarray               # (C,) corrected shares (NaN without a confusion matrix)
    lo: np.ndarray                      # (2, C) 2.5% percentiles of the raw and corrected shares
    hi: np.ndarray                      # (2, C) 97.5% percentiles


@dataclass
class TaskShift:
    """The pre-trained vs fine-tuned difference of the corrected shares of one task: its 95% interval."""

    task: str
    lo: np.ndarray                      # (C,)
    hi: np.ndarray                      # (C,)


@dataclass
class PatternTypesResult:
    """What :func:`compute` returns."""

    settings: PatternTypesSettings
    classes: list[str]
    estimable: np.ndarray               # (C,) bool: classes the correction estimates
    corrected: bool                     # a confusion matrix was given
    models: list[ModelPatterns]         # per task, the pre-trained model then the fine-tuned one
    shifts: list[TaskShift]             # the tasks with a fine-tuned model


@dataclass
class PatternTypesTables:
    """The analysis's tables (``pattern_types[_<name>].csv``)."""

    overall: pd.DataFrame
    shift: pd.DataFrame
    by_layer: pd.DataFrame
    by_head: pd.DataFrame


def _predictions(ctx, st: PatternTypesSettings, classifier, task: str, examples, variant: str, model, tok,
                 tuned: str | None, encoder_cfg) -> tuple[np.ndarray, int]:
    """((N, L, H) predicted classes, n_skipped) of one model on one task, from the cache when stored there."""
    key = cache_key_hash(dict(task=task, split=st.split, min_length=st.min_length, max_length=st.max_length,
                              classifier=_file_stamp(st.classifier), encoder=encoder_cfg,
                              model=_file_stamp(tuned) if variant == FINETUNED else "encoder"))
    hit = load_cached(st.cache, key, st.max_examples)
    if hit is not None:
        pred, skipped = hit
        log.info("pattern_types %s %s: %d examples from the cache %s/%s.npz", task, variant, len(pred), st.cache, key)
        return pred, skipped
    items, skipped = encode_glue(tok, examples, st.min_length, st.max_length)
    complete = st.max_examples is None or len(items) <= st.max_examples
    items = items[:st.max_examples]
    log.info("pattern_types %s %s: %d examples (%d outside %s..%s wordpieces)", task, variant, len(items), skipped,
             st.min_length, st.max_length)
    pred = head_predictions(classifier, model, items, ctx.device, st.max_tokens, desc=f"{task} {variant}",
                            pad_id=pad_id_of(tok))  # (N, L, H)
    save_cached(st.cache, key, pred, skipped, complete)
    return pred, skipped


def compute(ctx, settings: PatternTypesSettings) -> PatternTypesResult:
    """Every task's and model's pattern counts, shares, corrected shares and intervals. Writes nothing under
    the output folder; the per-head predictions are read from and stored in ``settings.cache``.

    Args:
        ctx: The analysis context (encoder, data, device).
        settings: The analysis's settings.

    Returns:
        The counts and shares of every (task, model) and the shift intervals.
    """
    st = settings
    classifier = load_classifier(st.classifier, ctx.device)
    classes = list(classifier.classes)
    conf = cv = None
    if st.confusion is not None:
        conf = read_confusion(st.confusion, classes)
        cv = read_cv_predictions(st.confusion, classes)
    else:
        log.warning("pattern_types: no analysis.confusion given: shares are NOT corrected for the classifier's errors")
    estimable = (conf.sum(1) >= st.min_support) if conf is not None else np.ones(len(classes), bool)
    encoder_cfg = plain(st.encoder)
    models, shifts = [], []
    for t in st.tasks:
        spec = task_spec(t)
        examples = read_glue(spec.name, st.split, ctx.data_dir)
        tuned = checkpoint_for(st.checkpoint, spec.name)
        found = {}
        for variant, (model, tok) in variants(ctx, tuned, spec.name).items():
            pred, skipped = _predictions(ctx, st, classifier, spec.name, examples, variant, model, tok, tuned,
                                         encoder_cfg)
            c, ex = count_predictions(pred, len(classes))  # (L, H, C), (N, C)
            found[variant] = (c, ex, skipped)
        boot = bootstrap_shares({v: ex for v, (_, ex, _) in found.items()}, conf, cv, estimable, st.n_boot, st.seed)
        for variant, (c, ex, skipped) in found.items():
            q = ex.sum(0) / ex.sum()  # (C,)
            p = correct_shares(q, conf, estimable) if conf is not None else np.full(len(classes), np.nan)
            lo, hi = np.percentile(boot[variant], [2.5, 97.5], axis=0)  # (2, C) each
            models.append(ModelPatterns(spec.name, variant, c, ex, skipped, tuned if variant == FINETUNED else None,
                                        q, p, lo, hi))
        if FINETUNED in found:
            d = boot[FINETUNED][:, 1] - boot[PRETRAINED][:, 1]  # (n_boot, C)
            lo, hi = np.percentile(d, [2.5, 97.5], axis=0)
            shifts.append(TaskShift(spec.name, lo, hi))
    return PatternTypesResult(st, classes, estimable, conf is not None, models, shifts)


def tables(result: PatternTypesResult) -> PatternTypesTables:
    """The overall, shift, by-layer and by-head tables of ``result`` (see the module doc for their columns)."""
    classes, estimable = result.classes, result.estimable
    rows = []
    corrected = {}  # (task, model) -> per class the corrected share written (NaN where not estimable)
    for m in result.models:
        corrected[(m.task, m.model)] = [float(m.corrected[k]) if estimable[k] else np.nan for k in range(len(classes))]
        for k, name in enumerate(classes):
            rows.append(dict(task=m.task, model=m.model, pattern=name, count=int(m.per_example[:, k].sum()),
                             share=float(m.shares[k]), share_lo=float(m.lo[0, k]), share_hi=float(m.hi[0, k]),
                             corrected=corrected[(m.task, m.model)][k],
                             corrected_lo=float(m.lo[1, k]) if estimable[k] else np.nan,
                             corrected_hi=float(m.hi[1, k]) if estimable[k] else np.nan,
                             n_examples=len(m.per_example)))
    shifts = []
    for s in result.shifts:
        point, base = corrected[(s.task, FINETUNED)], corrected[(s.task, PRETRAINED)]
        for k, name in enumerate(classes):
            if not estimable[k] or not result.corrected:
                continue
            shifts.append(dict(task=s.task, pattern=name, pretrained=base[k], finetuned=point[k],
                               diff=point[k] - base[k], lo=float(s.lo[k]), hi=float(s.hi[k]),
                               shift=bool(s.lo[k] > 0 or s.hi[k] < 0)))
    by_layer, by_head = layer_head_tables({(m.task, m.model): m.counts for m in result.models}, classes)
    return PatternTypesTables(
        overall=pd.DataFrame(rows),
        shift=pd.DataFrame(shifts, columns=["task", "pattern", "pretrained", "finetuned", "diff", "lo", "hi", "shift"]),
        by_layer=by_layer, by_head=by_head)


def save(ctx, result: PatternTypesResult, frames: PatternTypesTables, started: float) -> None:
    """Stage 3, :class:`probes.analysis.stages.Save` (arguments and contract there): ``pattern_types``,
    ``pattern_types_shift``, ``pattern_types_by_layer``, ``pattern_types_by_head`` .csv; ``pattern_types.png``
    (corrected shares), ``pattern_types_raw.png``, ``pattern_types_by_layer.png``; the summary holds the
    shifts and per (task, model) the shares and the corrected ones."""
    st, classes = result.settings, result.classes
    ctx.save_table(frames.overall, "pattern_types")
    ctx.save_table(frames.shift, "pattern_types_shift")
    ctx.save_table(frames.by_layer, "pattern_types_by_layer")
    ctx.save_table(frames.by_head, "pattern_types_by_head")
    ctx.save_figure(share_bars(frames.overall, classes), "pattern_types")
    ctx.save_figure(stacked_bars(frames.overall, classes), "pattern_types_raw")
    ctx.save_figure(stacked_bars(frames.by_layer, classes, by_layer=True), "pattern_types_by_layer")
    runs = {f"{m.task}/{m.model}": dict(
        n_examples=len(m.per_example), n_skipped_length=m.n_skipped, n_maps=int(m.counts.sum()),
        checkpoint=m.checkpoint, shares={n: round(float(v), 4) for n, v in zip(classes, m.shares)},
        corrected={n: (round(float(v), 4) if e else None) for n, v, e in zip(classes, m.corrected, result.estimable)})
        for m in result.models}
    ctx.log_summary(dict(analysis="pattern_types", split=st.split, encoder=ctx.encoder.name,
                         classifier=str(st.classifier), confusion=None if st.confusion is None else str(st.confusion),
                         n_boot=st.n_boot, estimable=[c for c, e in zip(classes, result.estimable) if e],
                         shifts=[f"{r['task']}/{r['pattern']}: {r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]"
                                 for r in frames.shift.to_dict("records") if r["shift"]],
                         results=runs, seconds=round(time.time() - started, 1)))


def pattern_types(ctx, *, classifier=None, checkpoint=None, task: str | list[str] = "mrpc", split: str = "dev",
                  max_examples: int | None = 1000, min_length: int = 12, max_length: int | None = 64,
                  max_tokens: int = 4096, confusion=None, min_support: int = 5, n_boot: int = 1000,
                  seed: int = 0, cache=None, encoder=None) -> pd.DataFrame:
    """The analysis (the keys: :class:`PatternTypesSettings`, the module doc). ``classifier``: the pattern CNN
    (.ckpt of ``experiment=patterns`` or its run folder); ``checkpoint``: optional fine-tuned GLUE model (path, or
    {task: path}); ``confusion``: the CNN's cross-validation report (folder or confusion.csv of ``python -m
    probes.patterns crossval``); ``encoder``: the encoder's config node (``${encoder}``), part of the cache key of
    the pre-trained model.

    Returns:
        The ``pattern_types.csv`` table.
    """
    if classifier is None:
        raise ValueError("set analysis.classifier=<.ckpt of `python train.py experiment=patterns` or its run folder> "
                         "(analysis.checkpoint names the optional fine-tuned GLUE model)")
    if encoder is None:
        raise ValueError("analysis.encoder is not set (conf/analysis/pattern_types.yaml sets it to ${encoder}, the "
                         "encoder's config node, which names the pre-trained model's cache entries)")
    started = time.time()
    settings = PatternTypesSettings(
        classifier=classifier, encoder=encoder, checkpoint=checkpoint,
        tasks=(task,) if isinstance(task, str) else tuple(task), split=split, max_examples=max_examples,
        min_length=min_length, max_length=max_length, max_tokens=max_tokens, confusion=confusion,
        min_support=min_support, n_boot=n_boot, seed=seed, cache=cache)
    result = compute(ctx, settings)
    frames = tables(result)
    save(ctx, result, frames, started)
    return frames.overall


def share_bars(df: pd.DataFrame, classes):
    """Figure 2: corrected shares (raw where no correction) with 95% intervals, one group per task x model."""
    use = "corrected" if df.corrected.notna().any() else "share"
    groups = list(dict.fromkeys(zip(df.task, df.model)))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) + 2.5), 4))
    width = 0.8 / len(classes)
    for k, p in enumerate(classes):
        d = [df[(df.task == t) & (df.model == m) & (df.pattern == p)].iloc[0] for t, m in groups]
        v = np.array([r[use] for r in d], dtype=float)
        lo = np.array([r[f"{use}_lo"] for r in d], dtype=float)
        hi = np.array([r[f"{use}_hi"] for r in d], dtype=float)
        x = np.arange(len(groups)) + (k - (len(classes) - 1) / 2) * width
        ax.bar(x, 100 * np.nan_to_num(v), width, color=COLORS.get(p), label=p)
        ok = np.isfinite(v)
        ax.errorbar(x[ok], 100 * v[ok], yerr=100 * np.abs(np.vstack([v - lo, hi - v])[:, ok]), fmt="none",
                    ecolor="black", elinewidth=0.8, capsize=2)
    ax.set_xticks(range(len(groups)), [f"{t}\n{m}" for t, m in groups], fontsize=8)
    ax.set_ylabel(f"{'corrected ' if use == 'corrected' else ''}share of maps (%)")
    ax.set_title("attention pattern types, all heads (95% intervals)", fontsize=9)
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    return fig
