"""Layer-wise learning rates (`probe.layer_decay`) and per-layer gradient norms (`GradNormLog`) of GLUE
fine-tuning, on tiny random models with the real conf/."""

from __future__ import annotations

import random

import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from probes.glue.callbacks import group_grad_norms, layer_groups
from probes.model.layers import parameter_layers
from probes.model.tiny import FAMILIES
from tests.conftest import compose_train

WORDS = "the a cat dog saw liked house runs quickly big small red and of to in".split()
LR = 2e-5  # conf/probe/sequence_classifier.yaml


@pytest.fixture(scope="module")
def mrpc_dir(tmp_path_factory):
    """A synthetic glue/MRPC folder: 24 train / 8 dev pairs."""
    root = tmp_path_factory.mktemp("data")
    d = root / "glue" / "MRPC"
    d.mkdir(parents=True)
    rng = random.Random(0)
    for split, n in (("train", 24), ("dev", 8)):
        lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(n):
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) + "."
            b = a if i % 2 else " ".join(rng.choice(WORDS) for _ in range(4)) + "."
            lines.append(f"{i % 2}\t{i}\t{i + 100}\t{a}\t{b}")
        (d / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _cfg(data_dir, out, *extra):
    return compose_train(["experiment=glue_mrpc", "encoder=tiny", "logger=none", f"paths.data_dir={data_dir}",
                          f"paths.output_dir={out}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
                          "trainer.enable_model_summary=false", "data.batch_size=8", *extra])


def _bert_layer(name: str, L: int) -> int:
    """Independent rule for BertModel names: embeddings 0, encoder.layer.i -> i + 1, pooler L + 1."""
    if name.startswith("embeddings."):
        return 0
    if name.startswith("encoder.layer."):
        return int(name.split(".")[2]) + 1
    assert name.startswith("pooler."), name
    return L + 1


def test_group_lrs_follow_the_formula(mrpc_dir, tmp_path):
    decay = 0.5
    module = instantiate(_cfg(mrpc_dir, tmp_path, f"probe.layer_decay={decay}", "probe.scheduler=null").probe)
    L = module.hf_config.num_hidden_layers
    opt = module.configure_optimizers()
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in module.encoder.named_parameters():
        layer = _bert_layer(name, L)
        assert lr_of[id(p)] == pytest.approx(LR * decay ** max(L - layer, 0), rel=1e-12), name
        no_decay = name.endswith(("bias", "LayerNorm.weight"))
        assert wd_of[id(p)] == (0.0 if no_decay else 0.01), name
    for p in module.head.parameters():
        assert lr_of[id(p)] == LR
    assert len(lr_of) == len(list(module.parameters()))  # every parameter in exactly one group
    assert sorted({round(g["lr"] / LR, 12) for g in opt.param_groups}) == sorted(
        {round(decay ** k, 12) for k in range(L + 1)})


def test_decay_one_builds_todays_groups(mrpc_dir, tmp_path):
    module = instantiate(_cfg(mrpc_dir, tmp_path, "probe.scheduler=null").probe)
    assert module.hparams.layer_decay == 1.0  # the config default
    opt = module.configure_optimizers()
    # layer_decay=1: four groups: encoder (decayed, not decayed), head (decayed, not decayed)
    nd = ("bias", "LayerNorm.weight")
    expect = []
    for m in (module.encoder, module.head):
        named = list(m.named_parameters())
        expect.append(([p for n, p in named if not n.endswith(nd)], 0.01))
        expect.append(([p for n, p in named if n.endswith(nd)], 0.0))
    assert len(opt.param_groups) == 4
    for g, (params, wd) in zip(opt.param_groups, expect):
        assert [id(p) for p in g["params"]] == [id(p) for p in params]
        assert g["lr"] == LR and g["weight_decay"] == wd and "layer" not in g


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_layer_for_every_parameter(family, tmp_path):
    from probes.model.tiny import tiny_encoder

    enc = tiny_encoder(family, root=tmp_path, num_layers=3)
    base = enc.base
    layers = parameter_layers(base)
    L = base.config.num_hidden_layers
    assert set(layers) == {n for n, _ in base.named_parameters()}
    assert set(layers.values()) <= set(range(L + 2))
    assert min(layers.values()) == 0 and max(layers.values()) >= L  # embeddings and the top block
    emb = [n for n in layers if n.startswith("embeddings.")]
    assert emb and all(layers[n] == 0 for n in emb)
    if family != "albert":  # ALBERT's one shared layer group belongs to its last layer, L
        assert {layers[n] for n in layers if 0 < layers[n] <= L} == set(range(1, L + 1))
    else:
        assert {layers[n] for n in layers if 0 < layers[n] <= L} == {L}


def _weights(run):
    ckpt = next((run / "checkpoints").glob("*.ckpt"))
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def test_grad_norms_by_layer_and_csv(mrpc_dir, tmp_path):
    from probes.train import train

    train(_cfg(mrpc_dir, tmp_path / "run", "probe.layer_decay=1.25", "trainer.max_epochs=2"))
    # decay 1 (the default): the callback only reads gradients (its layer lookup draws no random
    # numbers), so the same run without it ends with exactly the same weights
    train(_cfg(mrpc_dir, tmp_path / "d1", "trainer.max_epochs=2"))
    train(_cfg(mrpc_dir, tmp_path / "plain", "trainer.max_epochs=2", "~callbacks.grad_norms"))
    assert (tmp_path / "d1" / "grad_norms.csv").exists() and not (tmp_path / "plain" / "grad_norms.csv").exists()
    a, b = _weights(tmp_path / "d1"), _weights(tmp_path / "plain")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], v) for k, v in _weights(tmp_path / "run").items())  # 1.25 trains differently
    df = pd.read_csv(tmp_path / "run" / "grad_norms.csv")
    L = 2  # conf/encoder/tiny.yaml
    groups = [f"layer_{l}" for l in range(L + 2)] + ["head"]
    assert list(df.group[df.epoch == 0]) == groups and list(df.group[df.epoch == 1]) == groups
    assert (df.steps == 3).all()  # 24 examples / batch 8
    assert (df["mean"] > 0).all() and (df["max"] >= df["mean"]).all()

    # the norms themselves, against the parameters' gradients summed by name
    module = instantiate(_cfg(mrpc_dir, tmp_path, "probe.layer_decay=0.8").probe)
    batch = dict(input_ids=torch.randint(5, 50, (3, 7)), attention_mask=torch.ones(3, 7, dtype=torch.long),
                 token_type_ids=torch.zeros(3, 7, dtype=torch.long))
    module.loss(module(**batch), torch.tensor([0, 1, 1])).backward()
    labelled = layer_groups(module)
    got = group_grad_norms([ps for _, _, ps in labelled])
    assert [lab for lab, _, _ in labelled] == groups
    sq = {g: 0.0 for g in groups}
    for n, p in module.encoder.named_parameters():
        sq[f"layer_{_bert_layer(n, L)}"] += float((p.grad.double() ** 2).sum())
    sq["head"] = sum(float((p.grad.double() ** 2).sum()) for p in module.head.parameters())
    torch.testing.assert_close(got, torch.tensor([sq[g] ** 0.5 for g in groups], dtype=torch.float64))
