import pytest
import torch
from torchmetrics import MaxMetric, MinMetric

from probes.dependency.components.scorers import (AttentionGlove, AttentionOnly, DistanceGlove, RightBranching,
                                                 distance_features)
from probes.dependency.datamodule import collate
from probes.dependency.metrics import UAS
from probes.dependency.module import DependencyProbe
from probes.training.module import NonFiniteLossError


def item(n, K=(2, 3), heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    maps = torch.softmax(torch.randn(*K, n + 2, n + 2, generator=g), -1)  # (L, H, W, W)
    heads = torch.tensor(heads if heads is not None else [0] + list(range(1, n)))
    return dict(index=seed, maps=maps, heads=heads, punct=torch.zeros(n, dtype=torch.bool),
                glove=torch.arange(1, n + 1))


def test_uas_metric_counts_masked_words():
    m = UAS()
    m.update(torch.tensor([[2, 0, 2, 9]]), torch.tensor([[2, 0, 1, -100]]), torch.tensor([[True, True, True, False]]))
    m.update(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([[True]]))
    assert m.compute().item() == 0.5  # 2 of 4 scored words


def test_collate_splits_special_tokens_and_pads():
    a, b = item(3, seed=1), item(5, seed=2)
    batch = collate([a, b])
    assert batch["feats"].shape == (2, 12, 5, 5) and batch["root_cls"].shape == (2, 12, 5)
    m = a["maps"].reshape(6, 5, 5)
    assert torch.equal(batch["feats"][0, :6, :3, :3], m[:, 1:4, 1:4])
    assert torch.equal(batch["feats"][0, 6:, :3, :3], m[:, 1:4, 1:4].transpose(-1, -2))
    assert torch.equal(batch["root_sep"][0, :6, :3], m[:, 1:4, 4]) and torch.equal(batch["root_cls"][0, 6:, :3], m[:, 0, 1:4])
    assert batch["heads"][0].tolist() == [0, 1, 2, -100, -100] and batch["lengths"].tolist() == [3, 5]


def test_attention_only_with_one_head_predicts_its_argmax():
    batch = collate([item(6, seed=3)])
    probe = AttentionOnly(num_maps=6)
    with torch.no_grad():
        probe.weights.zero_()
        probe.weights[4] = 10.0  # map k=4, dependent -> candidate direction
        probe.root_start.zero_()
        probe.root_end.zero_()
    logits = probe(batch, torch.zeros(1, 1))  # (1, N, N + 1)
    words = batch["feats"][0, 4]  # (N, N)
    assert torch.equal(logits[0, :, 1:].argmax(-1), words.argmax(-1))


def test_glove_probe_equals_linear_map_of_concatenated_pair():
    batch = collate([item(4, seed=6)])
    vectors = torch.randn(5, 3)
    probe = AttentionGlove(num_maps=6, word_dim=3)
    for p in probe.parameters():
        torch.nn.init.normal_(p)
    logits = probe(batch, vectors)[0]  # (N, N + 1)
    W = torch.cat([probe.dep.weight, probe.cand.weight], 1)  # (F, 2d) acting on [v_j ; v_i]
    v = vectors[batch["glove"][0]]
    root = probe.root_start * batch["root_cls"][0] + probe.root_end * batch["root_sep"][0]  # (F, N)
    for j in range(4):
        w_root = W @ torch.cat([v[j], torch.zeros(3)]) + probe.dep.bias
        assert torch.isclose(logits[j, 0], w_root @ root[:, j], atol=1e-4)
        for i in range(4):
            w = W @ torch.cat([v[j], v[i]]) + probe.dep.bias
            assert torch.isclose(logits[j, i + 1], w @ batch["feats"][0, :, j, i], atol=1e-4)


def test_glove_probes_shapes_and_right_branching():
    batch = collate([item(4, seed=4), item(6, seed=5)])
    vectors = torch.randn(7, 5)
    for cls in (AttentionGlove, DistanceGlove):
        assert cls(num_maps=6, word_dim=5)(batch, vectors).shape == (2, 6, 7)
    pred = RightBranching()(batch, vectors).argmax(-1)
    assert pred[0, :4].tolist() == [2, 3, 4, 0]  # next word, last word -> ROOT
    assert pred[1].tolist() == [2, 3, 4, 5, 6, 0]


def test_distance_features_match_definition():
    f = distance_features(3, torch.tensor([3]))[0]  # (N, N + 1, 8)
    assert f[:, 0, 7].tolist() == [1, 1, 1] and f[:, 1:, 7].sum() == 0  # ROOT indicator
    assert torch.isclose(f[0, 3, 0], torch.tensor(2 / 3))  # word 3 is 2 ahead of word 1, / length
    assert torch.isclose(f[2, 1, 1], torch.tensor(2 / 3))  # word 1 is 2 behind word 3
    assert f[1, 2, 2] == 1 and f[1, 3, 3] == 1 and f[1, 1, 4] == 1  # offsets 0, +1, -1


def test_monitor_and_mode_come_from_the_arguments():
    probe = DependencyProbe(scorer=AttentionOnly, monitor="val/uas_nopunct", mode="min")
    assert isinstance(probe.val_best, MinMetric) and probe.hparams.monitor == "val/uas_nopunct"
    assert isinstance(DependencyProbe(scorer=AttentionOnly).val_best, MaxMetric)
    with pytest.raises(ValueError, match=r"probe.monitor.*\['val/uas', 'val/uas_nopunct'\]"):
        DependencyProbe(scorer=AttentionOnly, monitor="val/las")
    with pytest.raises(ValueError, match="probe.mode"):
        DependencyProbe(scorer=AttentionOnly, mode="maximum")


def test_parameter_free_scorer_is_not_trainable():
    batch = collate([item(4, seed=1)])
    for scorer, trainable in ((RightBranching, False), (AttentionOnly, True)):
        probe = DependencyProbe(scorer=scorer)
        probe.scorer = scorer(num_maps=6)
        assert probe.trainable() == trainable
        probe.register_buffer("vectors", torch.zeros(1, 1), persistent=False)
        assert probe(batch).shape == (1, 4, 5)


def test_non_finite_loss_names_the_batch():
    probe = DependencyProbe(scorer=AttentionOnly)
    probe.scorer = AttentionOnly(num_maps=6)
    probe.register_buffer("vectors", torch.zeros(1, 1), persistent=False)
    batch = collate([item(5, seed=3), item(3, seed=8)])
    assert torch.isfinite(probe.training_step(batch, 7))
    with torch.no_grad():
        probe.scorer.weights[2] = float("nan")
    with pytest.raises(NonFiniteLossError, match=r"train loss is nan in epoch 0, batch 7 \(sentences \[3, 8\]\)"):
        probe.training_step(batch, 7)
