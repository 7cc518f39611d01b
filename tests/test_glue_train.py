"""GLUE fine-tuning through `probes.train.train` with the real conf/ (tiny random BERT, synthetic
GLUE files), the Hugging Face export, and the two Kovaleva analyses on the result."""

import json
import random

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.context import AnalysisContext
from probes.analysis.kovaleva.finetune_cosine import attention_cosine
from probes.glue.evaluate import make_batches
from probes.glue.export import load_finetuned
from probes.model.load import tiny_bert
from probes.train import train
from tests.conftest import ROOT, compose_train
from tests.glue_helpers import logits_and_labels

WORDS = "the a cat dog saw liked house runs quickly big small red and of to in".split()


def _sent(rng, n=None):
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(3, 9))) + "."


@pytest.fixture(scope="module")
def glue_data(tmp_path_factory):
    """A synthetic `glue/` folder: MRPC (BOM header) and STS-B, 40 train / 16 dev pairs."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    mrpc, stsb = root / "glue" / "MRPC", root / "glue" / "STS-B"
    mrpc.mkdir(parents=True)
    stsb.mkdir(parents=True)
    for split, n in (("train", 40), ("dev", 16)):
        lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        slines = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
        for i in range(n):
            a = _sent(rng)
            same = i % 2
            b = a if same else _sent(rng)
            lines.append(f"{same}\t{i}\t{i + 1000}\t{a}\t{b}")
            slines.append(f"{i}\tg\tf\t2012\t{i:04d}\tnone\tnone\t{a}\t{b}\t{5.0 * same:.3f}")
        (mrpc / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (stsb / f"{split}.tsv").write_text("\n".join(slines) + "\n")
    return root


def _overrides(task, data_dir, out):
    return [f"experiment=glue_{task}", "encoder=tiny", "logger=none", f"paths.data_dir={data_dir}",
            f"paths.output_dir={out}", "trainer.max_epochs=2", "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "data.batch_size=8",
            "probe.optimizer.lr=1e-3"]


@pytest.fixture(scope="module")
def mrpc_run(glue_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mrpc_run")
    metrics = train(compose_train(_overrides("mrpc", glue_data, out)))
    return out, metrics


def test_mrpc_writes_metrics_and_hf_model(mrpc_run, glue_data):
    out, metrics = mrpc_run
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == metrics
    for k in ("val/f1", "val/acc", "val/f1_best", "test/f1", "test/acc", "test/loss", "train/loss"):
        assert isinstance(saved[k], float), k
    for k in ("val/f1", "val/acc", "val/f1_best", "test/f1", "test/acc"):
        assert 0.0 <= saved[k] <= 1.0, k
    assert saved["data/n_train"] == 40 and saved["data/n_dev"] == 16
    assert saved["best_checkpoint"].endswith(".ckpt")
    # hf_model: loadable by AutoModelForSequenceClassification, same logits as the best Lightning checkpoint
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(out / "hf_model"))
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.num_labels == 2
    enc = instantiate(compose_train(_overrides("mrpc", glue_data, out)).encoder)
    ft_hf = load_finetuned(out / "hf_model")
    ft_ckpt = load_finetuned(saved["best_checkpoint"], encoder=enc)
    assert ft_hf.task == ft_ckpt.task == "mrpc"
    from probes.data.glue import read_glue

    batches = make_batches(ft_hf.tokenizer, read_glue("mrpc", "dev", glue_data), "mrpc", batch_size=5)
    a, labels = logits_and_labels(ft_hf.model, batches)
    b, _ = logits_and_labels(ft_ckpt.model, batches)
    torch.testing.assert_close(a, b)
    # test/* is the dev score of the best checkpoint (GLUE test labels are private)
    from probes.glue.metrics import score

    assert score("mrpc", a, labels)["acc"] == pytest.approx(saved["test/acc"], abs=1e-6)


@pytest.mark.parametrize("key,says", [("lr", r"'lr'.*probe\.optimizer\.lr"),
                                      ("weight_decay", r"'weight_decay'.*probe\.optimizer\.weight_decay"),
                                      ("bogus", r"'bogus', which SequenceClassifier does not take")])
def test_checkpoint_with_a_key_the_classifier_does_not_take_is_an_error(mrpc_run, glue_data, tmp_path, key, says):
    """The run's own checkpoint loads; the same checkpoint with an optimizer setting (or any other key) among its
    hyper_parameters is an error naming the file, the key and, for optimizer settings, the config key."""
    out, metrics = mrpc_run
    ckpt = torch.load(metrics["best_checkpoint"], map_location="cpu", weights_only=True)
    assert not {"lr", "weight_decay", "adam_eps"} & set(ckpt["hyper_parameters"])
    ckpt["hyper_parameters"][key] = 2e-5
    path = tmp_path / "old.ckpt"
    torch.save(ckpt, path)
    enc = instantiate(compose_train(_overrides("mrpc", glue_data, out)).encoder)
    with pytest.raises(ValueError, match=f"{path}: hyper_parameters holds {says}"):
        load_finetuned(path, encoder=enc)


def test_stsb_regression_metrics(glue_data, tmp_path):
    m = train(compose_train(_overrides("stsb", glue_data, tmp_path / "out") + ["trainer.max_epochs=1"]))
    for k in ("val/pearson", "val/spearman", "val/pearson_best", "test/pearson", "test/spearman"):
        assert -1.0 <= m[k] <= 1.0, k
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(tmp_path / "out" / "hf_model"))
    assert hf.num_labels == 1 and hf.problem_type == "regression"


def test_frozen_baseline_trains_only_the_head(glue_data, tmp_path):
    cfg = compose_train(_overrides("mrpc", glue_data, tmp_path / "out") + ["trainer.max_epochs=1"])
    before = instantiate(cfg.probe)
    cfg = compose_train(_overrides("mrpc", glue_data, tmp_path / "out2")[1:] +
                        ["experiment=glue_mrpc_frozen", "trainer.max_epochs=1"])
    assert cfg.probe.freeze_encoder and cfg.task_name == "glue_mrpc_frozen"
    m = train(cfg)
    state = torch.load(m["best_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    for k, v in before.encoder.state_dict().items():
        assert torch.equal(state[f"encoder.{k}"], v), k
    assert not torch.equal(state["head.weight"], before.head.weight)


@pytest.mark.parametrize("family", ["distilbert", "roberta"])
def test_other_families_fine_tune(glue_data, tmp_path, family):
    """Any family: DistilBERT (no pooler, no token types) needs pooling=cls, and the error names the option;
    RoBERTa (pooler, no classifier Linear) exports the encoder + head.pt."""
    over = [o for o in _overrides("mrpc", glue_data, tmp_path / "out") if not o.startswith("encoder=")]
    over += ["encoder=tiny_family", f"encoder.family={family}", f"paths.cache_dir={tmp_path / 'cache'}",
             "trainer.max_epochs=1"]
    if family == "distilbert":
        from hydra.errors import InstantiationException

        with pytest.raises((ValueError, InstantiationException), match="probe.pooling=cls"):
            instantiate(compose_train(over).probe)
        over.append("probe.pooling=cls")
    m = train(compose_train(over))
    assert 0.0 <= m["val/f1_best"] <= 1.0 and 0.0 <= m["test/acc"] <= 1.0
    assert (tmp_path / "out" / "hf_model" / "head.pt").is_file()
    state = torch.load(m["best_checkpoint"], map_location="cpu", weights_only=True)
    assert state["hyper_parameters"]["pooling"] == ("cls" if family == "distilbert" else "pooler")


def test_experiment_variants_compose():
    for task in ("cola", "sst2", "mrpc", "stsb", "rte"):
        for v in ("", "_frozen", "_random"):
            cfg = compose_train([f"experiment=glue_{task}{v}", "logger=none", "paths.output_dir=/tmp/x"])
            assert cfg.data.task == task and cfg.probe.task == task and cfg.trainer.max_epochs == 3
            assert cfg.callbacks.model_checkpoint.monitor == f"val/{cfg.data.main_metric}"
            assert "predictions" not in cfg.callbacks
            assert cfg.probe.freeze_encoder == (v == "_frozen")
            assert bool(cfg.encoder.get("random_init")) == (v == "_random")
    assert compose_train(["experiment=glue_sst2", "logger=none"]).data.max_train_examples == 8000


# ------------------------------------------------------------------ analyses


def _analyze(analysis, *extra):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=[f"analysis={analysis}", "encoder=tiny", *extra])


def test_cosine_of_a_model_with_itself_is_one():
    enc = tiny_bert(num_hidden_layers=2, num_attention_heads=4)
    from probes.data.glue import GlueExample

    ex = [GlueExample(_sent(random.Random(i)), _sent(random.Random(i + 100)), i % 2, i) for i in range(7)]
    batches = make_batches(enc.tokenizer, ex, "mrpc", batch_size=3)  # padded batches
    m, n = attention_cosine(enc.model, enc.model, batches, progress=False)
    assert n == 7 and m.shape == (2, 4) and (m == 1.0).all()
    other = tiny_bert(num_hidden_layers=2, num_attention_heads=4, seed=5)
    m2, _ = attention_cosine(enc.model, other.model, batches, progress=False)
    assert (m2 < 1.0).all() and (m2 > 0.0).all()


def test_analyses_on_the_finetuned_model(mrpc_run, glue_data, tmp_path):
    out, _ = mrpc_run
    cfg = _analyze("disable_heads", f"paths.data_dir={glue_data}", f"analysis.checkpoint={out}",
                   "analysis.batch_size=5")
    df = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "dis", use_wandb=False))
    L, H = 2, 4  # conf/encoder/tiny.yaml
    assert len(df[df.metric == "f1"]) == 1 + L * H + L
    saved = pd.read_csv(tmp_path / "dis" / "disable_heads_mrpc.csv")
    assert set(saved.condition) == {"none", "head", "layer"} and (saved[saved.condition == "none"].delta == 0).all()
    assert (tmp_path / "dis" / "disable_heads_mrpc.png").exists() and (tmp_path / "dis" / "disable_layers_mrpc.png").exists()
    summary = json.loads((tmp_path / "dis" / "summary.json").read_text())
    assert summary["tasks"]["mrpc"]["n_heads"] == L * H

    cfg = _analyze("finetune_cosine", f"paths.data_dir={glue_data}", f"analysis.checkpoint={out / 'hf_model'}",
                   "analysis.task=mrpc")
    df = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "cos", use_wandb=False))
    assert len(df) == L * H and ((df.cosine > 0) & (df.cosine <= 1.0 + 1e-12)).all()
    assert (df.cosine < 1.0).any()  # lr 1e-3 for 2 epochs moved the weights
    assert (tmp_path / "cos" / "finetune_cosine.png").exists()
    with pytest.raises(ValueError, match="fine-tuned on mrpc"):
        cfg = _analyze("finetune_cosine", f"paths.data_dir={glue_data}", f"analysis.checkpoint={out}",
                       "analysis.task=rte")
        instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "cos2", use_wandb=False))


def test_layer_decay_profiles(mrpc_run, glue_data, tmp_path):
    """analysis=layer_decay: the decay read from the export, weight change against the two weight files
    compared by name (an independent BertModel layer rule), attention change = 1 - finetune_cosine."""
    from safetensors.torch import load_file

    out, _ = mrpc_run
    other = tmp_path / "d125"
    train(compose_train(_overrides("mrpc", glue_data, other) + ["probe.layer_decay=1.25"]))
    cfg = _analyze("layer_decay", f"paths.data_dir={glue_data}", f"analysis.runs=[{out},{other}]")
    ctx = AnalysisContext(cfg, tmp_path / "ld", use_wandb=False)
    df = instantiate(cfg.analysis)(ctx)
    L = 2  # conf/encoder/tiny.yaml
    assert sorted(set(df.decay)) == [1.0, 1.25] and set(df.task) == {"mrpc"}
    assert sorted(set(df.layer)) == list(range(L + 2)) and int(df.block.sum()) == 2 * L
    runs = pd.read_csv(tmp_path / "ld" / "layer_decay_runs.csv")
    assert list(runs.decay) == [1.0, 1.25] and "val/f1" in runs.columns

    pre = {k: v.double() for k, v in ctx.encoder.model.state_dict().items()}
    for run, decay in ((out, 1.0), (other, 1.25)):
        tuned = load_file(str(run / "hf_model" / "model.safetensors"))
        d2, n2 = [0.0] * (L + 2), [0.0] * (L + 2)
        for k, w in pre.items():
            if not any(k == n for n, _ in ctx.encoder.model.named_parameters()):
                continue  # buffers (position ids)
            layer = 0 if k.startswith("embeddings.") else L + 1 if k.startswith("pooler.") else int(k.split(".")[2]) + 1
            d2[layer] += float(((tuned["bert." + k].double() - w) ** 2).sum())
            n2[layer] += float((w ** 2).sum())
        got = df[df.decay == decay].sort_values("layer").weight_change.to_numpy()
        assert got == pytest.approx([(a / b) ** 0.5 for a, b in zip(d2, n2)], rel=1e-9)
        assert (got > 0).all()
        grads = pd.read_csv(run / "grad_norms.csv")
        last = grads[(grads.epoch == grads.epoch.max()) & grads.group.str.startswith("layer_")]
        assert df[df.decay == decay].sort_values("layer").grad_norm.to_numpy() == pytest.approx(last["mean"].to_numpy())
    cos = _analyze("finetune_cosine", f"paths.data_dir={glue_data}", f"analysis.checkpoint={other}")
    c = instantiate(cos.analysis)(AnalysisContext(cos, tmp_path / "cos", use_wandb=False))
    per_layer = 1 - c.groupby("layer").cosine.mean().to_numpy()
    blocks = df[(df.decay == 1.25) & df.block].sort_values("layer")
    assert blocks.attention_change.to_numpy() == pytest.approx(per_layer, abs=1e-12)
    assert (tmp_path / "ld" / "layer_decay.png").exists()
    with pytest.raises(FileNotFoundError, match="probe.layer_decay"):
        cfg = _analyze("layer_decay", f"paths.data_dir={glue_data}", f"analysis.runs=[{tmp_path}]")
        instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "bad", use_wandb=False))
