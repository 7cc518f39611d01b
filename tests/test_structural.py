"""Structural probes (Hewitt & Manning 2019): gold trees, metrics on hand-made trees and against slow
re-implementations of their reporter, the L1 loss, and training end to end on tiny models of two families."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from conftest import WORDS, chain_overrides, compose_train, write_chain_splits
from probes.structural.components.probes import DepthProbe, DistanceProbe
from probes.structural.metrics import UUAS, DepthSpearman, DistanceSpearman, RootAccuracy, mst_edges
from probes.structural.module import DistanceProbeModule
from probes.structural.trees import depths, distances

# "The dog barked loudly ." : The <- dog <- barked (root) -> loudly ; "." -> barked
HEADS = np.array([2, 3, 0, 3, 3])
PUNCT = np.array([False, False, False, False, True])
GOLD_DIST = np.array([[0, 1, 2, 3, 3],
                      [1, 0, 1, 2, 2],
                      [2, 1, 0, 1, 1],
                      [3, 2, 1, 0, 2],
                      [3, 2, 1, 2, 0]])


def test_tree_distances_and_depths_by_hand():
    assert (distances(HEADS) == GOLD_DIST).all()
    assert depths(HEADS).tolist() == [2, 1, 0, 1, 1]
    with pytest.raises(ValueError, match="cycle"):
        distances(np.array([2, 1, 0]), "x.conllu:7")
    with pytest.raises(ValueError, match="x.conllu:7: head outside"):
        depths(np.array([5, 0]), "x.conllu:7")


def _batch(*mats):
    return torch.tensor(np.stack(mats), dtype=torch.float32)


def test_uuas_by_hand():
    # predicted: "The" attached to "barked" instead of "dog"; "." (punctuation) is never an edge
    pred = GOLD_DIST.astype(float).copy()
    pred[0, 1] = pred[1, 0] = 5.0
    pred[0, 2] = pred[2, 0] = 0.5
    pred[4, :] = pred[:, 4] = 0.1  # punctuation close to everything: ignored
    m = UUAS()
    m.update(_batch(pred), _batch(GOLD_DIST), torch.tensor([PUNCT]), torch.tensor([5]))
    # gold edges without punctuation: (0,1) (1,2) (2,3); predicted: (0,2) (1,2) (2,3) -> 2 of 3
    assert m.compute().item() == pytest.approx(2 / 3)
    m.update(_batch(GOLD_DIST), _batch(GOLD_DIST), torch.tensor([PUNCT]), torch.tensor([5]))  # pooled: 5 of 6
    assert m.compute().item() == pytest.approx(5 / 6)


def _reporter_mst(matrix, punct):
    """Slow re-implementation of the reporter's ``prims_matrix_to_edges`` (all pairs, dict order, UnionFind)."""
    parents = list(range(len(matrix)))

    def find(i):
        while parents[i] != i:
            i = parents[i]
        return i

    pairs = {}
    for i, line in enumerate(matrix):
        for j, d in enumerate(line):
            if not punct[i] and not punct[j]:
                pairs[(i, j)] = d
    edges = []
    for (i, j), _ in sorted(pairs.items(), key=lambda x: x[1]):
        if find(i) != find(j):
            parents[find(i)] = j
            edges.append((i, j))
    return {tuple(sorted(e)) for e in edges}


def test_mst_matches_the_reporters_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        m = rng.integers(0, 4, size=(n, n)).astype(float)  # many ties
        m = np.minimum(m, m.T)
        punct = rng.random(n) < 0.2
        assert mst_edges(m, ~punct) == _reporter_mst(m, punct)


def _slow_spearman_by_length(rows_by_sentence):
    """Reporter's averaging: mean per length of all correlations, then mean over lengths 5-50."""
    by_len = defaultdict(list)
    for n, rhos in rows_by_sentence:
        by_len[n].extend(rhos)
    return np.mean([np.mean(by_len[n]) for n in range(5, 51) if n in by_len])


def test_dspr_and_nspr_match_scipy_averaged_by_length():
    rng = np.random.default_rng(1)
    dist_m, depth_m = DistanceSpearman(), DepthSpearman()
    dist_rows, depth_rows = [], []
    for n in (3, 5, 5, 7, 12):  # length 3 is outside 5-50: not averaged
        heads = np.array([0] + [int(rng.integers(1, j + 1)) for j in range(1, n)])  # a random tree
        gold, depth = distances(heads).astype(float), depths(heads).astype(float)
        pred = gold + rng.random((n, n)) * 2
        pdepth = depth + rng.random(n) * 2
        dist_m.update(_batch(pred), _batch(gold), torch.tensor([n]))
        depth_m.update(_batch(pdepth), _batch(depth), torch.tensor([n]))
        dist_rows.append((n, [spearmanr(p, g).correlation for p, g in zip(pred, gold)]))
        depth_rows.append((n, [spearmanr(pdepth, depth).correlation]))
    assert dist_m.compute().item() == pytest.approx(_slow_spearman_by_length(dist_rows), abs=1e-6)
    assert depth_m.compute().item() == pytest.approx(_slow_spearman_by_length(depth_rows), abs=1e-6)


def test_root_accuracy_skips_punctuation():
    m = RootAccuracy()
    gold = torch.tensor([depths(HEADS)], dtype=torch.float32)  # root: word 2
    # least deep is "." (punctuation, skipped), then "barked": correct
    m.update(torch.tensor([[2.0, 1.0, 0.5, 1.0, 0.1]]), gold, torch.tensor([PUNCT]), torch.tensor([5]))
    # least deep non-punctuation word is "dog": wrong
    m.update(torch.tensor([[2.0, 0.2, 0.5, 1.0, 0.1]]), gold, torch.tensor([PUNCT]), torch.tensor([5]))
    assert m.compute().item() == pytest.approx(0.5)


def test_probes_and_l1_loss_match_hewitt_manning():
    torch.manual_seed(0)
    h = torch.randn(3, 6, 8)  # (B, N, D)
    lengths = torch.tensor([6, 4, 2])
    dist_probe, depth_probe = DistanceProbe(8, rank=5), DepthProbe(8)
    assert depth_probe.rank == 8  # rank null = full
    t = h @ dist_probe.proj  # their TwoWordPSDProbe: explicit differences
    diffs = t.unsqueeze(2) - t.unsqueeze(1)  # (B, N, N, k)
    assert torch.allclose(dist_probe(h), diffs.pow(2).sum(-1), atol=1e-5)
    gold = torch.full((3, 6, 6), -1.0)
    for b, n in enumerate(lengths.tolist()):
        gold[b, :n, :n] = torch.tensor(distances(np.array([0] + list(range(1, n)))), dtype=torch.float32)
    pred = dist_probe(h)
    # their L1DistanceLoss: mask -1 labels, sum per sentence, / length^2, / number of sentences
    mask = (gold != -1).float()
    ref = ((pred * mask - gold * mask).abs().sum((1, 2)) / lengths.pow(2).float()).sum() / 3
    module = DistanceProbeModule(probe=None, optimizer=None)
    assert module.loss(pred, gold, lengths).item() == pytest.approx(ref.item(), rel=1e-6)


# ----------------------------------------------------------------------------- end to end
def _position_chain(path: Path, n_sentences: int, seed: int) -> None:
    """Chain trees (word j's head is word j - 1) whose j-th word is always WORDS[j - 1]; '.' at the end."""
    rng = random.Random(seed)
    lines = []
    for s in range(n_sentences):
        n = rng.randint(4, 11)
        lines.append(f"# sent_id = s{s}")
        for j in range(1, n + 1):
            w, upos = (".", "PUNCT") if j == n else (WORDS[j - 1], "X")
            lines.append(f"{j}\t{w}\t{w}\t{upos}\t_\t_\t{j - 1}\t{'root' if j == 1 else 'dep'}\t_\t_")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("structural")
    write_chain_splits(root, (60, 20, 20), writer=_position_chain)
    return root


def _run(root: Path, name: str, extra: list[str]) -> dict:
    from probes.train import train

    over = chain_overrides(root / "data", root) + [f"paths.output_dir={root / name}", "data.extract_in_child=false",
                                                   "data.num_workers=0", "trainer.enable_progress_bar=false"]
    return train(compose_train(over + extra))


def test_distance_probe_learns_a_chain_treebank(chain_dir):
    m = _run(chain_dir, "distance", ["experiment=table3_structural", "data.layer=0", "trainer.max_epochs=12",
                                     "probe.optimizer.lr=0.01", "probe.scheduler=null", "data.batch_size=10"])
    assert m["test/uuas"] > 0.95
    assert m["val/uuas_best"] >= m["val/uuas"] - 1e-9
    assert 0 < m["data/train_cache_mb"] and m["test/dspr"] > 0.8


def test_standardized_states_use_the_train_moments_and_still_learn(chain_dir):
    from hydra.utils import instantiate

    over = chain_overrides(chain_dir / "data", chain_dir) + ["data.extract_in_child=false", "data.num_workers=0"]
    cfg = compose_train(over + ["experiment=table3_structural", "data.layer=1", "data.standardize=true"])
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    train = dm.data["train"]
    raw = np.concatenate([train.cache.layer(i, 1).astype(np.float64) for i in train.indices])  # (words, D)
    np.testing.assert_allclose(dm.shift, raw.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dm.scale, raw.std(0), rtol=1e-4, atol=1e-6)
    served = torch.cat([dm.dataset("train")[k]["hidden"] for k in range(len(train.indices))]).double()
    np.testing.assert_allclose(served.mean(0).numpy(), 0, atol=1e-4)
    np.testing.assert_allclose(served.std(0, unbiased=False).numpy(), 1, atol=1e-3)
    dev = dm.data["val"]  # the other splits use the train moments, not their own
    item = dm.dataset("val")[0]["hidden"].numpy()
    np.testing.assert_allclose(item, (dev.cache.layer(dev.indices[0], 1) - dm.shift) / dm.scale, rtol=1e-5, atol=1e-5)
    m = _run(chain_dir, "standardized", ["experiment=table3_structural", "data.layer=0", "trainer.max_epochs=12",
                                         "probe.optimizer.lr=0.01", "probe.scheduler=null", "data.batch_size=10",
                                         "data.standardize=true"])
    assert m["test/uuas"] > 0.95


def test_standardize_must_be_a_boolean(chain_dir):
    from hydra.utils import instantiate

    cfg = compose_train(chain_overrides(chain_dir / "data", chain_dir) + ["experiment=table3_structural",
                                                                         "data.standardize=yes please"])
    with pytest.raises(Exception, match="data.standardize must be true or false"):
        instantiate(cfg.data)


@pytest.mark.parametrize("family", ["roberta"])
def test_depth_and_directed_probes_on_another_family(chain_dir, family):
    enc = ["encoder=tiny_family", f"encoder.family={family}", f"encoder.root={chain_dir / 'models'}",
           "data.layer=2", "trainer.max_epochs=2", "data.hidden.layers=[0,2]", "data.hidden.pooling=first"]
    depth = _run(chain_dir, "depth", ["experiment=structural_depth"] + enc)
    assert 0 <= depth["test/root_acc"] <= 1 and "val/root_acc_best" in depth and "test/nspr" in depth
    directed = _run(chain_dir, "directed", ["experiment=table3_hidden_directed"] + enc)
    assert 0 <= directed["test/uas"] <= 1 and "val/uas_best" in directed
    assert (chain_dir / "directed" / "predictions" / "test.conllu").exists()


def test_layer_figure_reads_a_sweep(tmp_path):
    import json

    from omegaconf import OmegaConf

    from probes.structural.figure import collect, main

    for layer, uuas in ((0, 0.3), (1, 0.5), (2, 0.4)):
        job = tmp_path / "sweep" / f"{layer}_structural_distance_tiny"
        (job / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create({"data": {"layer": layer}}), job / ".hydra" / "config.yaml")
        (job / "metrics.json").write_text(json.dumps({"val/uuas_best": uuas, "test/dspr": uuas / 2, "sys/x": 1.0}))
    values = collect([tmp_path / "sweep"])
    assert values == {"val/uuas_best": {0: 0.3, 1: 0.5, 2: 0.4}, "test/dspr": {0: 0.15, 1: 0.25, 2: 0.2}}
    out = main([str(tmp_path / "sweep"), "--out", str(tmp_path / "f.png")])
    assert out.stat().st_size > 0
    single = tmp_path / "run"  # a single run's folder adds (or replaces) its layer
    (single / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"data": {"layer": 3}}), single / ".hydra" / "config.yaml")
    (single / "metrics.json").write_text(json.dumps({"val/uuas_best": 0.6}))
    assert collect([tmp_path / "sweep", single])["val/uuas_best"] == {0: 0.3, 1: 0.5, 2: 0.4, 3: 0.6}
    with pytest.raises(FileNotFoundError, match="no jobs"):
        collect([tmp_path / "empty"])
