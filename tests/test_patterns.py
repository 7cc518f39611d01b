"""Pattern CNN (Kovaleva et al. 2019 §3): preprocessing, overfitting a handful of maps, the stratified
split and folds, `python train.py experiment=patterns` (all maps) and the held-out variant on a small
synthetic set, `python -m probes.patterns crossval` (scores against a direct recomputation), the classify
CLI, the share correction, and `analysis=pattern_types` on a tiny random BERT."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.errors import InstantiationException

from probes.patterns.__main__ import main as patterns_main
from probes.patterns.datamodule import PatternDataModule, stratified_split
from probes.patterns.components.cnn import CLASSES, preprocess, preprocess_many
from probes.patterns.module import PatternClassifier, load_classifier
from tests.conftest import ROOT, compose_train, require_shared


def synthetic_map(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """A row-stochastic (n, n) map of one pattern type (plus a little noise)."""
    a = rng.random((n, n)) * 0.05
    if kind == "vertical":
        a[:, 0] += 1.0
        a[:, -1] += 0.5
    elif kind == "diagonal":
        a[np.arange(n), np.arange(n)] += 1.0
    elif kind == "vertical+diagonal":
        a[:, 0] += 1.0
        a[np.arange(n), np.arange(n)] += 1.0
    elif kind == "block":
        h = n // 2
        a[:h, :h] += 0.5
        a[h:, h:] += 0.5
    else:  # heterogeneous
        a += rng.random((n, n)) ** 4
    return (a / a.sum(1, keepdims=True)).astype(np.float32)


def write_pattern_folder(d: Path, per_class: int = 6, seed: int = 0) -> dict[str, str]:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    maps, labels = {}, {}
    i = 0
    for kind in CLASSES:
        for _ in range(per_class):
            maps[str(i)] = synthetic_map(kind, int(rng.integers(12, 40)), rng).astype(np.float16)
            labels[str(i)] = kind
            i += 1
    np.savez(d / "maps.npz", **maps)
    (d / "labels.json").write_text(json.dumps(labels))
    return labels


def test_preprocess_scales_by_max_and_resizes():
    a = np.zeros((12, 12), np.float32)
    a[:, 0] = 0.25
    x = preprocess(a, size=32, resize="area", channels=("max", "sqrt"))
    assert x.shape == (1, 2, 32, 32)
    assert float(x[0, 0].max()) == pytest.approx(1.0)
    assert torch.all(x[0, 0, :, 0] > 0.99) and float(x[0, 0, :, 8:].max()) == 0.0  # column 0 stays a column
    big = np.eye(64, dtype=np.float32)
    y = preprocess(big, size=32)[0, 0]
    assert torch.allclose(torch.diagonal(y), torch.full((32,), 0.5))  # area: 2x2 averages keep the diagonal
    batch = preprocess_many([a, big, a], size=16)
    assert batch.shape == (3, 1, 16, 16) and torch.equal(batch[0], batch[2])


def test_cnn_overfits_a_handful_of_maps():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    kinds = [CLASSES[i % len(CLASSES)] for i in range(10)]
    maps = [synthetic_map(k, int(rng.integers(12, 50)), rng) for k in kinds]
    module = PatternClassifier(dropout=0.0, class_weighting="none")
    x = module.preprocess(maps)
    y = torch.tensor([CLASSES.index(k) for k in kinds])
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    module.train()
    for _ in range(40):
        opt.zero_grad()
        loss = module._loss(module(x), y)
        loss.backward()
        opt.step()
    assert module.predict_labels(maps) == kinds


def _labels_like_real() -> dict[str, str]:
    counts = {"vertical": 258, "vertical+diagonal": 100, "heterogeneous": 51, "diagonal": 37, "block": 4}
    labels, i = {}, 0
    for k, n in counts.items():
        for _ in range(n):
            labels[str(i)] = k
            i += 1
    return labels


def _check_split(split: dict[str, list[str]], labels: dict[str, str], fractions=(0.6, 0.2, 0.2)):
    sets = [set(split[s]) for s in ("train", "val", "test")]
    assert sum(len(s) for s in sets) == len(labels)
    assert set().union(*sets) == set(labels)
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    total = Counter(labels.values())
    for s, frac in zip(("train", "val", "test"), fractions):
        c = Counter(labels[k] for k in split[s])
        for cls, n in total.items():
            assert abs(c.get(cls, 0) - frac * n) <= 1, (s, cls, c.get(cls, 0), n)
            if n >= 3:
                assert c.get(cls, 0) >= 1, (s, cls)


def test_stratified_split_is_disjoint_stratified_and_seeded():
    labels = _labels_like_real()
    a = stratified_split(labels, (0.6, 0.2, 0.2), seed=0)
    _check_split(a, labels)
    assert a == stratified_split(labels, (0.6, 0.2, 0.2), seed=0)
    assert a != stratified_split(labels, (0.6, 0.2, 0.2), seed=1)
    with pytest.raises(ValueError):
        stratified_split(labels, (0.5, 0.2, 0.2))


@pytest.mark.slow
def test_datamodule_split_on_shared_maps():
    d = require_shared("attention_patterns/maps.npz", "shared attention patterns").parent
    labels = json.loads((d / "labels.json").read_text())
    dm = PatternDataModule(str(d), seed=0)
    dm.prepare_data()
    dm.setup("fit")
    _check_split(dm.split_ids, labels)
    assert len(dm.ids) == len(labels) == 450
    x, y, i = next(iter(dm.val_dataloader()))
    assert x.shape[1:] == (1, 32, 32) and float(x.amax()) <= 1.0
    assert dm.train_class_counts == [Counter(labels[k] for k in dm.split_ids["train"])[c] for c in CLASSES]


_FAST = ["logger=none", "trainer.max_epochs=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "data.batch_size=8"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """`python train.py experiment=patterns` (every map in train, last epoch kept) in-process on a 30-map
    synthetic folder (2 epochs)."""
    from probes.train import train

    tmp = tmp_path_factory.mktemp("patterns")
    write_pattern_folder(tmp / "data" / "attention_patterns")
    cfg = compose_train(["experiment=patterns", f"paths.data_dir={tmp / 'data'}", f"paths.output_dir={tmp / 'out'}",
                         *_FAST])
    metrics = train(cfg)
    return tmp, metrics


def test_release_experiment_trains_on_every_map(trained_run):
    tmp, metrics = trained_run
    ckpt = Path(metrics["best_checkpoint"])
    assert ckpt.is_file() and ckpt.parent == tmp / "out" / "checkpoints" and ckpt.name == "final-1.ckpt"
    assert metrics["data/n_train"] == 30 and metrics["data/n_val"] == 0 and metrics["data/n_test"] == 0
    assert "train/macro_f1" in metrics and not any(k.startswith("test/") for k in metrics)


def test_held_out_variant_writes_checkpoint_and_per_class(tmp_path):
    from probes.train import train

    write_pattern_folder(tmp_path / "data" / "attention_patterns")
    out = tmp_path / "out"
    metrics = train(compose_train(["experiment=patterns", f"paths.data_dir={tmp_path / 'data'}",
                                   f"paths.output_dir={out}", *_FAST, "data.fractions=[0.6,0.2,0.2]", "test=true",
                                   "trainer.limit_val_batches=1.0", "callbacks.model_checkpoint.monitor=val/macro_f1"]))
    ckpt = Path(metrics["best_checkpoint"])
    assert ckpt.is_file() and ckpt.parent == out / "checkpoints"
    assert {"test/macro_f1", "test/acc", "val/macro_f1_best", "test/f1_block", "test/recall_diagonal"} <= set(metrics)
    per = pd.read_csv(out / "per_class.csv")
    assert list(per["class"]) == [*CLASSES, "macro", "accuracy"]
    assert per.set_index("class").loc[list(CLASSES), "support"].tolist() == [1] * 5  # 20% of 6 per class
    assert (out / "metrics.json").is_file() and (out / "test_predictions.csv").is_file()
    preds = pd.read_csv(out / "test_predictions.csv", dtype={"id": str})
    assert len(preds) == 5 and set(preds.gold) == set(CLASSES)


def test_stratified_folds_cover_every_id_once():
    from probes.patterns.datamodule import stratified_folds

    labels = _labels_like_real()
    folds = stratified_folds(labels, 5, seed=0)
    ids = [k for f in folds for k in f]
    assert sorted(ids) == sorted(labels) and len(ids) == len(set(ids))
    assert max(map(len, folds)) - min(map(len, folds)) <= 1
    for cls, n in Counter(labels.values()).items():
        per = [sum(labels[k] == cls for k in f) for f in folds]
        assert max(per) - min(per) <= 1, (cls, per)
    assert folds == stratified_folds(labels, 5, seed=0) and folds != stratified_folds(labels, 5, seed=1)
    dm = PatternDataModule("unused", folds=5, fold=2)
    assert dm.folds == 5 and dm.fold == 2
    with pytest.raises(ValueError, match="fold"):
        PatternDataModule("unused", folds=5, fold=5)


def test_scores_and_intervals_against_direct_computation():
    from probes.patterns.crossval import report, wilson

    rng = np.random.default_rng(0)
    gold = rng.integers(0, 3, 200)
    pred = np.where(rng.random(200) < 0.8, gold, rng.integers(0, 3, 200))
    per, summary, cm = report(gold, pred, ["a", "b", "c"], n_boot=200, seed=0, min_support=5)
    for k, name in enumerate("abc"):  # direct per-class counts
        tp = int(((gold == k) & (pred == k)).sum())
        prec, rec = tp / (pred == k).sum(), tp / (gold == k).sum()
        row = per.set_index("class").loc[name]
        assert row.precision == pytest.approx(prec) and row.recall == pytest.approx(rec)
        assert row.f1 == pytest.approx(2 * prec * rec / (prec + rec))
        assert row.recall_lo < rec < row.recall_hi and row.f1_lo <= row.f1 <= row.f1_hi
    assert summary["accuracy"] == pytest.approx((gold == pred).mean())
    # Wilson interval, textbook form: 8 of 10 -> (0.4902, 0.9433)
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)


def test_crossval_cli_on_synthetic_maps(tmp_path, capsys):
    write_pattern_folder(tmp_path / "data" / "attention_patterns", per_class=4)
    out = tmp_path / "cv"
    rc = patterns_main(["crossval", "--folds", "2", "--n-boot", "50", "--out", str(out), f"paths.data_dir={tmp_path / 'data'}",
                        "trainer.max_epochs=2", "trainer.accelerator=cpu", "data.batch_size=8"])
    assert rc == 0
    pred = pd.read_csv(out / "predictions.csv", dtype={"id": str})
    labels = json.loads((tmp_path / "data" / "attention_patterns" / "labels.json").read_text())
    assert sorted(pred.id) == sorted(labels) and set(pred.fold) == {0, 1}   # every map predicted once
    assert (pred.gold == pred.id.map(labels)).all()
    cm = pd.read_csv(out / "confusion.csv").set_index("gold")
    assert int(cm.to_numpy().sum()) == len(labels) and list(cm.columns) == list(CLASSES)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == pytest.approx((pred.gold == pred.predicted).mean())
    assert summary["n_maps"] == 20 and summary["block_rule"]["pair_maps"] == 0   # no meta.jsonl here


def test_correct_shares_inverts_a_known_confusion():
    from probes.analysis.kovaleva.pattern_types import correct_shares

    conf = np.array([[80, 10, 10, 0], [20, 70, 10, 0], [5, 5, 90, 0], [1, 1, 1, 1]], float)  # last: too few
    est = conf.sum(1) >= 5
    p = np.array([0.5, 0.3, 0.2, 0.0])
    C = conf / conf.sum(1, keepdims=True)
    q = C.T @ p
    assert np.allclose(correct_shares(q, conf, est), p, atol=1e-4)
    # observed shares that no mixture produces: still a point on the simplex
    r = correct_shares(np.array([0.0, 0.0, 0.0, 1.0]), conf, est)
    assert r.min() >= 0 and r.sum() == pytest.approx(1.0) and r[3] == 0


def test_classify_cli_writes_every_id(trained_run, tmp_path, capsys):
    tmp, metrics = trained_run
    rng = np.random.default_rng(3)
    maps = {f"m{i}": synthetic_map(CLASSES[i % 5], 10 + 3 * i, rng) for i in range(7)}
    np.savez(tmp_path / "maps.npz", **maps)
    out = tmp_path / "sub" / "labels.json"
    rc = patterns_main(["classify", "--checkpoint", metrics["best_checkpoint"], "--maps", str(tmp_path / "maps.npz"),
                        "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert list(result) == list(maps) and set(result.values()) <= set(CLASSES)
    assert not list(out.parent.glob(".*tmp"))
    # the run folder works as --checkpoint too and gives the same labels
    rc = patterns_main(["classify", "--checkpoint", str(tmp / "out"), "--maps", str(tmp_path / "maps.npz"),
                        "--out", str(tmp_path / "again.json")])
    assert rc == 0 and json.loads((tmp_path / "again.json").read_text()) == result


@pytest.mark.parametrize("bad,msg", [(np.zeros((3, 4), np.float32), "not square"),
                                     (np.zeros((0, 0), np.float32), "empty"),
                                     (np.zeros(5, np.float32), "square 2-D")])
def test_classify_cli_names_file_and_key_of_a_bad_array(trained_run, tmp_path, capsys, bad, msg):
    _, metrics = trained_run
    np.savez(tmp_path / "bad.npz", good=np.eye(5, dtype=np.float32), broken=bad)
    out = tmp_path / "out.json"
    rc = patterns_main(["classify", "--checkpoint", metrics["best_checkpoint"], "--maps", str(tmp_path / "bad.npz"),
                        "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "'broken'" in err and "bad.npz" in err and msg in err
    assert not out.exists()


def test_load_classifier_roundtrip(trained_run):
    _, metrics = trained_run
    m = load_classifier(metrics["best_checkpoint"])
    assert m.classes == CLASSES and not m.training
    assert m.predict_maps([np.eye(20, dtype=np.float32)]).shape == (1,)


RTE_DEV = ("index\tsentence1\tsentence2\tlabel\n"
           "0\tThe dog did not see the cat today.\tA dog saw nothing at all.\tentailment\n"
           "1\tShe likes apples and pears very much.\tShe hates fruit.\tnot_entailment\n"
           "2\tToo short.\tNo.\tentailment\n")


def test_pattern_types_analysis_on_tiny_bert(trained_run, tmp_path):
    from hydra import compose, initialize_config_dir

    from probes.analysis.context import run_analysis

    _, metrics = trained_run
    conf_dir = tmp_path / "cv"   # a cross-validation report: confusion.csv (+ predictions.csv)
    conf_dir.mkdir()
    m = np.diag([20, 10, 10, 3, 10])  # block: 3 labelled maps, fewer than min_support
    m[0, 2] = m[2, 0] = m[4, 0] = m[1, 2] = 2
    cm = pd.DataFrame(m, index=pd.Index(CLASSES, name="gold"), columns=CLASSES)
    cm.reset_index().to_csv(conf_dir / "confusion.csv", index=False)
    d = tmp_path / "data" / "glue" / "RTE"
    d.mkdir(parents=True)
    (d / "dev.tsv").write_text(RTE_DEV)
    # a "fine-tuned" model: the tiny BERT saved as a Hugging Face folder
    from probes.model.load import tiny_bert

    enc = tiny_bert(max_position_embeddings=128)
    ft = tmp_path / "ft" / "hf_model"
    enc.model.save_pretrained(ft)
    enc.tokenizer.save_pretrained(ft)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            "analysis=pattern_types", "encoder=tiny", f"paths.data_dir={tmp_path / 'data'}", "logger.use_wandb=false",
            f"analysis.classifier={metrics['best_checkpoint']}", "analysis.task=rte", "analysis_device=cpu",
            f"analysis.checkpoint={ft.parent}", "analysis.min_length=16", f"analysis.confusion={conf_dir}",
            "analysis.n_boot=50", f"paths.cache_dir={tmp_path / 'cache'}"])
    out = tmp_path / "out"
    run_analysis(cfg, out)
    df = pd.read_csv(out / "pattern_types.csv")
    L, H = cfg.encoder.num_hidden_layers, cfg.encoder.num_attention_heads
    # the per-head predictions were cached (one file per model); a second run reads them and agrees exactly
    cached = sorted((tmp_path / "cache" / "pattern_types").glob("*.npz"))
    assert len(cached) == 2
    for f in cached:  # poison the cache: the second run must take its numbers from these files
        z = dict(np.load(f))
        assert z["pred"].shape == (2, L, H) and bool(z["complete"])
        z["pred"] = z["pred"] * 0
        with open(f, "wb") as fh:
            np.savez(fh, **z)
    cfg.analysis.max_examples = 1  # a prefix of the stored examples: read, not recomputed
    run_analysis(cfg, tmp_path / "out2")
    again = pd.read_csv(tmp_path / "out2" / "pattern_types.csv")
    assert (again[again.pattern == CLASSES[0]].share == 1).all() and (again["count"].sum() == 2 * L * H)
    assert set(df.model) == {"pre-trained", "fine-tuned"} and set(df.pattern) == set(CLASSES)
    assert df.groupby("model").share.sum().round(6).eq(1).all()
    L, H = cfg.encoder.num_hidden_layers, cfg.encoder.num_attention_heads
    assert df.groupby("model")["count"].sum().eq(2 * L * H).all()   # 2 examples pass the length filter
    # same weights as the encoder: identical classifications before and after "fine-tuning"
    p = df.pivot(index="pattern", columns="model", values="count")
    assert (p["pre-trained"] == p["fine-tuned"]).all()
    by_layer = pd.read_csv(out / "pattern_types_by_layer.csv")
    assert sorted(by_layer.layer.unique()) == list(range(L))
    assert (out / "pattern_types.png").is_file() and (out / "pattern_types_by_layer.png").is_file()
    # corrected shares: block (3 labelled maps < 5) not estimable, the rest on the simplex with intervals
    assert df[df.pattern == "block"].corrected.isna().all()
    c = df[df.pattern != "block"]
    assert c.groupby("model").corrected.sum().round(6).eq(1).all()
    assert ((c.corrected_lo <= c.corrected + 1e-9) & (c.corrected <= c.corrected_hi + 1e-9)).all()
    shift = pd.read_csv(out / "pattern_types_shift.csv")
    assert len(shift) == 4 and (shift["diff"].abs() < 1e-12).all() and not shift["shift"].any()  # same weights
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["rte/pre-trained"]["n_skipped_length"] == 1


def test_augmentations_keep_the_label_of_each_class():
    from probes.patterns.augment import ReverseTokens, Transpose, variants

    rng = np.random.default_rng(0)
    a = rng.random((7, 7)).astype(np.float32)
    augs = [ReverseTokens(), Transpose(["diagonal", "block", "heterogeneous"])]
    v = variants(a, "diagonal", augs)   # identity, reversed, transposed, reversed then transposed
    expected = [a, a[::-1, ::-1], a.T, a[::-1, ::-1].T]
    assert len(v) == 4 and all(np.array_equal(x, y) for x, y in zip(v, expected))
    for label in ("vertical", "vertical+diagonal"):   # a transposed stripe would be horizontal: never made
        got = variants(a, label, augs)
        assert len(got) == 2 and np.array_equal(got[1], a[::-1, ::-1])
        assert not any(np.array_equal(x, a.T) for x in got)
    col = np.zeros((6, 6), np.float32)
    col[:, 0] = 1
    rev = ReverseTokens()(col)
    assert np.array_equal(rev[:, -1], np.ones(6)) and rev[:, :-1].sum() == 0   # a column stays a column
    with pytest.raises(ValueError, match="classes"):
        Transpose([])


def test_datamodule_augment_from_config_and_bad_class_named(tmp_path):
    from hydra.utils import instantiate

    write_pattern_folder(tmp_path / "data" / "attention_patterns", per_class=6)
    tr = "+data.augment.transpose._target_=probes.patterns.augment.Transpose"
    cfg = compose_train(["experiment=patterns", f"paths.data_dir={tmp_path / 'data'}", tr,
                         "+data.augment.transpose.classes=[diagonal,block,heterogeneous]"])
    dm = instantiate(cfg.data)
    dm.setup("fit")
    n_var = {CLASSES[y]: len(x) for x, y in zip(dm.datasets["train"].x, dm.datasets["train"].y)}
    assert n_var == {"vertical": 2, "vertical+diagonal": 2, "diagonal": 4, "block": 4, "heterogeneous": 4}
    x, _, _ = next(iter(dm.train_dataloader()))
    assert x.shape[1:] == (2, 32, 32)
    bad = compose_train(["experiment=patterns", f"paths.data_dir={tmp_path / 'data'}", tr,
                         "+data.augment.transpose.classes=[diagonal,horizontal]"])
    with pytest.raises(InstantiationException, match=r"data\.augment.*horizontal"):
        instantiate(bad.data)


def test_folds_with_an_inner_validation_split(tmp_path):
    from probes.patterns.datamodule import stratified_folds

    labels = write_pattern_folder(tmp_path / "attention_patterns", per_class=8)
    parts = stratified_folds(labels, 4, seed=3)
    dm = PatternDataModule(str(tmp_path / "attention_patterns"), folds=4, fold=1, seed=3, fractions=(0.6, 0.2, 0.2))
    dm.setup("fit")
    tr, va, te = (set(dm.split_ids[s]) for s in ("train", "val", "test"))
    assert te == set(parts[1]) and not (tr & va) and not (te & (tr | va)) and tr | va | te == set(labels)
    for cls in CLASSES:   # 6 non-test maps per class: train:val = 0.6:0.2, i.e. 1.5 (rounded 2) in val
        assert sum(labels[k] == cls for k in va) == 2, cls
    assert len(dm.datasets["val"]) == len(va) == 10
    dm_all = PatternDataModule(str(tmp_path / "attention_patterns"), folds=4, fold=1, seed=3, fractions=(1, 0, 0))
    dm_all.setup("fit")
    assert not dm_all.split_ids["val"] and set(dm_all.split_ids["train"]) == tr | va


def test_crossval_with_inner_validation_keeps_the_best_epoch(tmp_path):
    write_pattern_folder(tmp_path / "data" / "attention_patterns", per_class=6)
    out = tmp_path / "cv"
    rc = patterns_main(["crossval", "--folds", "3", "--only-folds", "0", "2", "--n-boot", "20", "--out", str(out),
                        f"paths.data_dir={tmp_path / 'data'}", "trainer.max_epochs=3", "trainer.accelerator=cpu",
                        "data.batch_size=8", "data.fractions=[0.6,0.2,0.2]", "trainer.limit_val_batches=1.0",
                        "callbacks.model_checkpoint.monitor=val/macro_f1"])
    assert rc == 0
    pred = pd.read_csv(out / "predictions.csv", dtype={"id": str})
    assert set(pred.fold) == {0, 2} and len(pred) == 20   # folds of 10 maps; fold 1 left out
    per_fold = pd.read_csv(out / "per_fold.csv")
    assert list(per_fold.fold) == [0, 2] and per_fold.epoch.between(0, 2).all()
    for row in per_fold.to_dict("records"):   # per-fold accuracy recomputed from the predictions
        g = pred[pred.fold == row["fold"]]
        assert row["accuracy"] == pytest.approx((g.gold == g.predicted).mean())
        ckpt = [p for p in (out / f"fold_0_{row['fold']}" / "checkpoints").glob("*.ckpt")   # the kept epoch's
                if p.name != "last.ckpt"]                                                  # (besides resume's)
        assert len(ckpt) == 1 and ckpt[0].name == f"final-{row['epoch']}.ckpt"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["only_folds"] == [0, 2] and summary["n_maps"] == 20
