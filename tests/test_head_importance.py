"""Head importance (Michel et al. 2019) through the model layer's head gates, on a tiny BERT fine-tuned for a
few steps on synthetic MRPC: the gate gradients against a direct implementation (a separately loaded eager
model whose self-attention outputs are scaled per head in the test), pruning, and the analysis end to end."""

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from probes.analysis.context import run_analysis
from probes.analysis.kovaleva.head_importance import (evaluate, head_importance, normalize_by_layer,
                                                      pruning_curve, removal_orders, task_loss)
from probes.data.glue import read_glue
from probes.glue.evaluate import MODEL_KEYS, make_batches
from probes.glue.export import load_finetuned
from probes.model import hooks
from probes.train import train
from tests.conftest import ROOT, compose_train

WORDS = "the a cat dog saw liked house runs quickly big small red and of to in".split()


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(data dir with synthetic MRPC, hf_model folder of a tiny BERT fine-tuned for 3 steps)."""
    root = tmp_path_factory.mktemp("hi")
    rng = random.Random(0)
    mrpc = root / "data" / "glue" / "MRPC"
    mrpc.mkdir(parents=True)
    for split, n in (("train", 24), ("dev", 12)):
        lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(n):
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) + "."
            b = a if i % 2 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) + "."
            lines.append(f"{i % 2}\t{i}\t{i + 1000}\t{a}\t{b}")
        (mrpc / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = root / "run"
    train(compose_train(["experiment=glue_mrpc", "encoder=tiny", "logger=none", f"paths.data_dir={root / 'data'}",
                         f"paths.output_dir={out}", "trainer.max_epochs=1", "trainer.accelerator=cpu",
                         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                         "data.batch_size=8", "probe.optimizer.lr=1e-3"]))
    return root / "data", out / "hf_model"


def _batches(data, ft, n=12):
    return make_batches(ft.tokenizer, read_glue("mrpc", "dev", data)[:n], "mrpc", 64, 4)


def reference_importance(folder, batches) -> np.ndarray:
    """|dL/dxi| averaged over batches, xi scaling each head's slice of the self-attention output (eager model)."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    total = np.zeros((L, H))
    for b in batches:
        xi = torch.ones(L, H, requires_grad=True)

        def gate(l):
            def hook(module, args, out):
                ctx = out[0]  # (B, T, H*d)
                B, T, _ = ctx.shape
                return (ctx.view(B, T, H, -1) * xi[l].view(1, 1, H, 1)).view(B, T, -1), *out[1:]
            return hook

        hs = [model.bert.encoder.layer[l].attention.self.register_forward_hook(gate(l)) for l in range(L)]
        try:
            logits = model(**{k: b[k] for k in MODEL_KEYS if k in b}).logits
            (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, b["labels"]), xi)
        finally:
            for h in hs:
                h.remove()
        total += g.abs().numpy()
    return total / len(batches)


def test_importance_equals_direct_gate_gradients(finetuned):
    data, folder = finetuned
    ft = load_finetuned(folder)
    batches = _batches(data, ft)
    imp = head_importance(ft.model.eval(), batches, 2, progress=False)
    np.testing.assert_allclose(imp.numpy(), reference_importance(folder, batches), rtol=1e-4, atol=1e-8)
    assert (imp > 0).all()
    n = normalize_by_layer(imp)
    torch.testing.assert_close(n.norm(dim=-1), torch.ones(imp.shape[0]))


def test_pruning_orders_and_curve(finetuned):
    data, folder = finetuned
    ft = load_finetuned(folder)
    model, batches = ft.model.eval(), _batches(data, ft)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    imp = torch.rand(L, H, generator=torch.Generator().manual_seed(0))
    orders = removal_orders(imp, 2, 0)
    assert imp.flatten()[orders["importance"]].diff().ge(0).all()
    assert sorted(orders["random-0"]) == list(range(L * H)) and orders["random-0"] != orders["random-1"]
    rows = pruning_curve(model, batches, "mrpc", orders["importance"], [0.0, 0.5, 1.0], L, H)
    full = evaluate(model, batches, "mrpc", torch.ones(L, H))
    assert {r["metric"]: r["value"] for r in rows if r["share"] == 0.0} == pytest.approx(full)
    # every head removed: the heads' outputs are zero, so the logits equal a forward with zero gates
    with torch.inference_mode(), hooks.attention(model, [], gates=torch.zeros(L, H)) as s:
        b = batches[0]
        zero = s.run(**{k: b[k] for k in MODEL_KEYS if k in b}).logits
    with torch.inference_mode(), hooks.attention(model, [], gates=torch.ones(L, H)) as s:
        one = s.run(**{k: b[k] for k in MODEL_KEYS if k in b}).logits
    assert not torch.allclose(zero, one)
    assert task_loss(one, b["labels"], 2) > 0


def test_head_importance_analysis_end_to_end(finetuned, tmp_path):
    from hydra import compose, initialize_config_dir

    data, folder = finetuned
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            "analysis=head_importance", "encoder=tiny", f"paths.data_dir={data}", f"paths.cache_dir={tmp_path}",
            "logger.use_wandb=false", f"analysis.checkpoint={folder}", "analysis.share_step=0.25",
            "analysis.max_share=1.0", "analysis.n_random=2", "analysis.batch_size=4"])
    run_analysis(cfg, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["tasks"]["mrpc"]
    imp = pd.read_csv(tmp_path / "out" / "head_importance_mrpc.csv")
    curve = pd.read_csv(tmp_path / "out" / "pruning_mrpc.csv")
    assert len(imp) == 2 * 4 and imp.importance.gt(0).all() and imp.disable_delta.notna().all()
    assert set(summary["pruning"]) == {"importance", "random-0", "random-1"}
    assert all(len(v) == 5 for v in summary["pruning"].values())
    assert -1 <= summary["importance_vs_disable_drop"]["spearman"] <= 1 or np.isnan(
        summary["importance_vs_disable_drop"]["spearman"])
    f1 = curve[(curve.metric == "f1") & (curve.share == 0.0)].value
    assert f1.nunique() == 1  # nothing removed: every order starts from the same model
    assert (tmp_path / "out" / "pruning_mrpc.png").is_file()
