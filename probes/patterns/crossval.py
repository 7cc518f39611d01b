"""Stratified k-fold cross-validation of the pattern CNN over all labelled maps (Kovaleva et al. 2019 §3).

``python -m probes.patterns crossval [--folds 5] [--repeats 1] [--out DIR] [hydra overrides ...]`` composes
``conf/train.yaml`` with ``experiment=patterns`` (the recipe of the released checkpoint: same CNN,
optimizer, schedule, epochs, augmentation) plus the overrides. For each repeat r and fold i the labelled
maps are dealt into ``folds`` stratified folds (:func:`probes.patterns.datamodule.stratified_folds`, seed
= ``seed + r``); a fresh CNN
(seed ``seed + r``) is trained on the other folds with the config's trainer and callbacks and predicts
fold i. Without a validation split (``experiment=patterns``: ``data.fractions: [1, 0, 0]``) that is a
fixed number of epochs (the last epoch). With one (``data.fractions: [0.6, 0.2, 0.2]``
``trainer.limit_val_batches=1.0 callbacks.model_checkpoint.monitor=val/macro_f1``, the earlier recipe)
the other folds are split again, train:val 3:1 (stratified), and the epoch the checkpoint callback keeps
on those inner validation maps predicts fold i. Nothing is chosen on the held-out fold; every map is
predicted once per repeat, by a model that never saw it. ``--only-folds`` scores a fixed subset of the
same folds (a cheaper check, ``tests/test_patterns_regression.py``).

Scores over the out-of-fold predictions (repeats pooled): accuracy, per-class precision / recall / F1
with 95% intervals (Wilson score intervals for precision and recall, percentile bootstrap over maps
for F1, macro-F1 and accuracy, ``n_boot`` resamples), macro-F1 over all classes and over the classes
with at least ``min_support`` maps (the four classes that 450 maps can score; block has 4).

Outputs in ``--out``: ``per_class.csv``, ``confusion.csv`` (rows = gold, columns = predicted; counts
over repeats: ``analysis=pattern_types`` reads it to correct shares), ``predictions.csv`` (repeat, fold,
id, gold, predicted), ``per_fold.csv`` (accuracy and supported macro-F1 of each fold, the kept epoch),
``summary.json`` (also the per-fold mean and SD and the block rule's score, :func:`block_rule`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm.auto import tqdm

from probes.config import compose as compose_config
from probes.io import atomic_write, atomic_write_text
from probes.patterns.datamodule import read_patterns, stratified_folds
from probes.patterns.module import load_classifier
from probes.stats import resamples, seed_everything

log = logging.getLogger(__name__)

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion; (nan, nan) for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return float(max(0.0, c - h)), float(min(1.0, c + h))


def confusion(gold: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """(C, C) counts, rows = gold, columns = predicted."""
    cm = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(cm, (gold, pred), 1)
    return cm


def scores_from_confusion(cm: np.ndarray, min_support: int = 5) -> dict[str, np.ndarray | float]:
    """Per-class precision / recall / F1 (0 where undefined, as scikit-learn's zero_division=0),
    accuracy, macro-F1 over all classes and over classes with >= ``min_support`` gold maps."""
    tp = np.diag(cm).astype(float)
    gold, predicted = cm.sum(1).astype(float), cm.sum(0).astype(float)
    prec = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    rec = np.divide(tp, gold, out=np.zeros_like(tp), where=gold > 0)
    f1 = np.divide(2 * prec * rec, prec + rec, out=np.zeros_like(tp), where=(prec + rec) > 0)
    present = gold >= min_support
    return dict(precision=prec, recall=rec, f1=f1, support=gold, accuracy=float(tp.sum() / max(cm.sum(), 1)),
                macro_f1=float(f1[gold > 0].mean()) if (gold > 0).any() else float("nan"),
                macro_f1_supported=float(f1[present].mean()) if present.any() else float("nan"))


def bootstrap(gold: np.ndarray, pred: np.ndarray, n_classes: int, n_boot: int = 2000, seed: int = 0,
              min_support: int = 5) -> dict[str, np.ndarray]:
    """Percentile-bootstrap 95% intervals (resampling maps) of per-class F1, accuracy and both macro-F1s;
    the class set of the supported macro-F1 is fixed by the full sample."""
    full = confusion(gold, pred, n_classes)
    supported = full.sum(1) >= min_support
    n = len(gold)
    f1s, acc, macro, macro_s = [], [], [], []
    for (i,) in resamples(n, n_boot, np.random.default_rng(seed)):  # i: (n,)
        s = scores_from_confusion(confusion(gold[i], pred[i], n_classes), min_support)
        f1s.append(s["f1"])
        acc.append(s["accuracy"])
        macro.append(s["f1"][full.sum(1) > 0].mean())
        macro_s.append(s["f1"][supported].mean() if supported.any() else np.nan)  # no class with min_support maps
    q = lambda a: np.percentile(np.asarray(a), [2.5, 97.5], axis=0)  # noqa: E731
    return dict(f1=q(f1s), accuracy=q(acc), macro_f1=q(macro), macro_f1_supported=q(macro_s))


def report(gold: np.ndarray, pred: np.ndarray, classes: Sequence[str], n_boot: int = 2000, seed: int = 0,
           min_support: int = 5):
    """(per-class DataFrame with intervals, summary dict, confusion matrix) of out-of-fold predictions."""
    C = len(classes)
    cm = confusion(gold, pred, C)
    s = scores_from_confusion(cm, min_support)
    b = bootstrap(gold, pred, C, n_boot, seed, min_support)
    rows = []
    for k, name in enumerate(classes):
        tp = int(cm[k, k])
        p_lo, p_hi = wilson(tp, int(cm[:, k].sum()))
        r_lo, r_hi = wilson(tp, int(cm[k].sum()))
        rows.append({"class": name, "precision": s["precision"][k], "precision_lo": p_lo, "precision_hi": p_hi,
                     "recall": s["recall"][k], "recall_lo": r_lo, "recall_hi": r_hi, "f1": s["f1"][k],
                     "f1_lo": b["f1"][0][k], "f1_hi": b["f1"][1][k], "support": int(cm[k].sum()),
                     "predicted": int(cm[:, k].sum())})
    supported = [c for c, n in zip(classes, cm.sum(1)) if n >= min_support]
    acc_lo, acc_hi = wilson(int(np.trace(cm)), int(cm.sum()))
    summary = dict(n_maps=int(cm.sum()), accuracy=s["accuracy"], accuracy_ci_wilson=[acc_lo, acc_hi],
                   accuracy_ci_bootstrap=list(map(float, b["accuracy"])),
                   macro_f1=s["macro_f1"], macro_f1_ci=list(map(float, b["macro_f1"])),
                   macro_f1_supported=s["macro_f1_supported"],
                   macro_f1_supported_ci=list(map(float, b["macro_f1_supported"])),
                   supported_classes=supported, min_support=min_support, n_boot=n_boot)
    return pd.DataFrame(rows), summary, cm


def block_features(a: np.ndarray, segment_ids: Sequence[int], special: Sequence[bool]) -> tuple[float, float]:
    """(within, spread) of a sentence-pair map over its content tokens (no [CLS]/[SEP] rows or columns):
    ``within`` = share of content->content attention that stays inside the query's own sentence;
    ``spread`` = mean over content rows of the normalised entropy of the row restricted to its own sentence."""
    a = np.asarray(a, dtype=np.float64)  # (T, T)
    keep = ~np.asarray(special, dtype=bool)
    seg = np.asarray(segment_ids)[keep]
    c = a[np.ix_(keep, keep)]  # (T', T')
    same = seg[:, None] == seg[None, :]
    within = float((c * same).sum() / max(c.sum(), 1e-12))
    ents = []
    for i in range(len(c)):
        r = c[i][same[i]]
        if len(r) < 2 or r.sum() <= 0:
            continue
        r = r / r.sum()
        ents.append(float(-(r * np.log(r + 1e-12)).sum() / np.log(len(r))))
    return within, float(np.mean(ents)) if ents else 0.0


def block_rule(maps: dict[str, np.ndarray], labels: dict[str, str], meta: dict[str, dict], within: float = 0.7,
               spread: float = 0.75) -> dict:
    """Score the rule "a sentence-pair map is block when >= ``within`` of its content attention stays in the
    query's sentence and that attention is spread (normalised entropy >= ``spread``)" against the labels of
    the pair maps: how many it calls block, how many of those are labelled block, and block recall."""
    called, hits, pairs = 0, 0, 0
    n_block = sum(1 for k, lab in labels.items() if lab == "block")
    for k, lab in labels.items():
        m = meta.get(k)
        if m is None or max(m["segment_ids"]) == 0:
            continue
        pairs += 1
        special = [t in ("[CLS]", "[SEP]", "<s>", "</s>") for t in m["tokens"]]
        w, s = block_features(maps[k], m["segment_ids"], special)
        if w >= within and s >= spread:
            called += 1
            hits += lab == "block"
    return dict(rule=f"pair map, within-sentence share >= {within}, spread >= {spread}", pair_maps=pairs,
                called_block=called, labelled_block_among_called=hits, labelled_block=n_block,
                precision=hits / called if called else float("nan"), recall=hits / n_block if n_block else float("nan"))


def fold_scores(pred_df: pd.DataFrame, classes: Sequence[str], min_support: int = 5) -> pd.DataFrame:
    """Accuracy and macro-F1 of each (repeat, fold) of out-of-fold predictions (columns repeat, fold, gold,
    predicted); the supported macro-F1's classes are those with >= ``min_support`` maps in all of pred_df."""
    cls = {c: i for i, c in enumerate(classes)}
    C = len(classes)
    supported = confusion(pred_df.gold.map(cls).to_numpy(), pred_df.predicted.map(cls).to_numpy(), C).sum(1)
    supported = supported >= min_support * pred_df.repeat.nunique()
    rows = []
    for (r, i), g in pred_df.groupby(["repeat", "fold"], sort=True):
        s = scores_from_confusion(confusion(g.gold.map(cls).to_numpy(), g.predicted.map(cls).to_numpy(), C))
        rows.append(dict(repeat=int(r), fold=int(i), n_maps=len(g), accuracy=s["accuracy"],
                         macro_f1_supported=float(s["f1"][supported].mean()) if supported.any() else float("nan")))
    return pd.DataFrame(rows)


def cross_validate(cfg, out_dir: str | Path, folds: int = 5, repeats: int = 1, n_boot: int = 2000,
                   min_support: int = 5, progress: bool = True, only_folds: Sequence[int] | None = None) -> dict:
    """Run the cross-validation for a composed ``experiment=patterns`` config; writes the report files.

    The trainer and callbacks are the config's (``trainer.limit_val_batches``, ``callbacks.*``; checkpoints into
    each fold's folder): with a validation split (``data.fractions`` with a val share, validation batches and a
    monitored ``callbacks.model_checkpoint``) the kept epoch is the one the callback keeps, chosen on the
    inner validation maps, never on the held-out fold. ``only_folds``: score just these fold indices (a
    cheaper, fixed subset; the folds are the same as in the full run)."""
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(cfg.data.data_dir)
    maps, labels, meta = read_patterns(data_dir)
    classes = list(cfg.probe.classes)
    unknown = sorted(set(labels.values()) - set(classes))
    if unknown:
        raise ValueError(f"{data_dir / 'labels.json'}: labels {unknown} not in classes {classes}")
    chosen = list(range(folds)) if only_folds is None else sorted({int(i) for i in only_folds})
    if not chosen or not all(0 <= i < folds for i in chosen):
        raise ValueError(f"only_folds must name fold indices in 0..{folds - 1}, got {only_folds}")
    cls = {c: i for i, c in enumerate(classes)}
    rows, kept = [], []
    bar = tqdm(total=len(chosen) * repeats, desc="pattern CNN cross-validation", disable=not progress)
    for r in range(repeats):
        seed = int(cfg.seed) + r
        for i, test_ids in enumerate(stratified_folds(labels, folds, seed)):
            if i not in chosen:
                continue
            fold_dir = out / f"fold_{r}_{i}"
            seed_everything(seed, workers=True)
            dm = instantiate(cfg.data, folds=folds, fold=i, seed=seed)
            model = instantiate(cfg.probe, report_dir=None)
            callbacks = [instantiate(c, **({"dirpath": str(fold_dir / "checkpoints")} if "dirpath" in c else {}))
                         for c in (cfg.get("callbacks") or {}).values()]
            trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=False, enable_progress_bar=False,
                                  enable_model_summary=False, default_root_dir=str(fold_dir))
            trainer.fit(model, datamodule=dm)
            assert dm.split_ids["test"] == test_ids and not set(test_ids) & set(dm.split_ids["val"])
            ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            if ckpt:  # the epoch the checkpoint callback kept (the last one when it monitors nothing)
                model = load_classifier(ckpt)
                kept.append(dict(repeat=r, fold=i, epoch=int(torch.load(ckpt, weights_only=True)["epoch"])))
            pred = model.predict_maps([maps[k] for k in test_ids])
            rows += [dict(repeat=r, fold=i, id=k, gold=labels[k], predicted=classes[p]) for k, p in zip(test_ids, pred)]
            bar.update(1)
    bar.close()
    pred_df = pd.DataFrame(rows)
    gold = pred_df.gold.map(cls).to_numpy()
    pred = pred_df.predicted.map(cls).to_numpy()
    per_class, summary, cm = report(gold, pred, classes, n_boot, int(cfg.seed), min_support)
    per_fold = fold_scores(pred_df, classes, min_support)
    if kept:
        per_fold = per_fold.merge(pd.DataFrame(kept), on=["repeat", "fold"], how="left")
    summary.update(folds=folds, only_folds=None if only_folds is None else chosen, repeats=repeats,
                   epochs=int(cfg.trainer.max_epochs), data_dir=str(data_dir), n_labelled=len(labels),
                   per_fold=per_fold.to_dict("records"),
                   per_fold_macro_f1_supported_mean_sd=[float(per_fold.macro_f1_supported.mean()),
                                                        float(per_fold.macro_f1_supported.std(ddof=1))]
                   if len(per_fold) > 1 else None,
                   seconds=round(time.time() - t0, 1), block_rule=block_rule(maps, labels, meta))
    atomic_write(out / "predictions.csv", lambda tmp: pred_df.to_csv(tmp, index=False))
    atomic_write(out / "per_class.csv", lambda tmp: per_class.to_csv(tmp, index=False))
    atomic_write(out / "per_fold.csv", lambda tmp: per_fold.to_csv(tmp, index=False))
    cm_df = pd.DataFrame(cm, index=pd.Index(classes, name="gold"), columns=classes).reset_index()
    atomic_write(out / "confusion.csv", lambda tmp: cm_df.to_csv(tmp, index=False))
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    log.info("cross-validated pattern CNN (%s):\n%s\nper fold:\n%s", out, per_class.round(3).to_string(index=False),
             per_fold.round(3).to_string(index=False))
    return summary


def compose(overrides: Sequence[str], out_dir: str | Path) -> DictConfig:
    """``conf/train.yaml`` + ``experiment=patterns`` + overrides, with ``paths.output_dir=out_dir``."""
    return compose_config("train", ["experiment=patterns", "logger=none", f"paths.output_dir={out_dir}", *overrides])
