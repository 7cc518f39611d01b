"""grad_sep: attention gradients on a tiny random BertForMaskedLM / BertForSequenceClassification."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.analysis import gradients as G
from probes.analysis.context import AnalysisContext
from probes.model.load import tiny_bert

REPO = Path(__file__).resolve().parents[1]

CONLLU = """\
# sent_id = s1
1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tbarked\tbark\tVERB\t_\t_\t0\troot\t_\t_
4\t.\t.\tPUNCT\t_\t_\t3\tpunct\t_\t_

# sent_id = s2
1\tJohn\tJohn\tPROPN\t_\t_\t3\tnsubj\t_\t_
2\t,\t,\tPUNCT\t_\t_\t1\tpunct\t_\t_
3\tsat\tsit\tVERB\t_\t_\t0\troot\t_\t_
4\tunbelievably\tunbelievably\tADV\t_\t_\t3\tadvmod\t_\t_
5\t.\t.\tPUNCT\t_\t_\t3\tpunct\t_\t_

"""


def _compose(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=overrides)


@pytest.fixture
def tiny_cfg(tmp_path):
    (tmp_path / "data" / "ud_english_ewt").mkdir(parents=True)
    (tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(CONLLU)

    def make(*extra):
        return _compose(["analysis=grad_sep", "encoder=tiny", f"paths.data_dir={tmp_path / 'data'}",
                         f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
                         "data.treebank.download=false", "analysis_device=cpu", *extra])
    return make


def test_grad_sep_mlm_tiny_end_to_end(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    assert isinstance(instantiate(cfg.analysis.objectives.mlm), G.MLMObjective)
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    df = instantiate(cfg.analysis)(ctx)
    assert set(df.columns) == {"layer", "target", "stat", "value"}
    assert sorted(df.layer.unique()) == [0, 1]
    assert set(df.target) == set(G.TARGETS) and set(df.stat) == {"mean_abs", "mean", "count"}
    assert np.isfinite(df.value).all()
    ma = df[df.stat == "mean_abs"]
    assert (ma.value > 0).all()
    counts = df[df.stat == "count"].set_index(["layer", "target"]).value
    assert counts.loc[(0, "sep")] > 0 and counts.loc[(0, "punct")] > 0
    assert (tmp_path / "out" / "grad_sep.csv").is_file() and (tmp_path / "out" / "grad_sep.png").is_file()


def test_mlm_masking_is_seeded_and_masks_non_special():
    enc = tiny_bert(masked_lm=True)
    tok = enc.tokenizer
    seqs = [tok("the dog barked loudly at the cat .")["input_ids"], tok("hi")["input_ids"]]
    a = G.MLMObjective(seed=3).mask(seqs, tok)
    b = G.MLMObjective(seed=3).mask(seqs, tok)
    assert a == b
    for s, m, lab in zip(seqs, *a):
        picked = [i for i, l in enumerate(lab) if l != -100]
        assert 1 <= len(picked) and all(0 < i < len(s) - 1 for i in picked)  # never [CLS]/[SEP]
        assert all(m[i] == tok.mask_token_id and lab[i] == s[i] for i in picked)


def test_hook_gradient_equals_dloss_dcontext_dot_values():
    """The retained attention-probability grad is exactly dL/dA = dL/dctx_i . V_j (last layer)."""
    enc = tiny_bert(masked_lm=True)
    model, tok = enc.model, enc.tokenizer
    obj = G.MLMObjective(seed=0)
    items = obj.prepare([tok("the dog barked at the big cat .")["input_ids"]], tok)
    batch = obj.batch(items, tok)
    grads = G.attention_gradients(model, obj, batch, "cpu")
    # independent computation for the last layer
    attn_self = G.attention_modules(model)[-1]
    saved = {}

    def vhook(m, a, out):
        saved["v"] = out

    def shook(m, a, out):
        out[0].retain_grad()
        saved["ctx"] = out[0]

    hs = [attn_self.value.register_forward_hook(vhook), attn_self.register_forward_hook(shook)]
    try:
        with torch.enable_grad():
            emb = model.get_input_embeddings()(batch.input_ids).detach().requires_grad_(True)
            out = model(inputs_embeds=emb, attention_mask=batch.inputs["attention_mask"])
            obj.loss(out, batch).backward()
    finally:
        for h in hs:
            h.remove()
    B, T, D = saved["v"].shape
    H = grads[-1].shape[1]
    v = saved["v"].detach().view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
    dctx = saved["ctx"].grad.reshape(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
    expected = dctx @ v.transpose(-1, -2)  # (B, H, Ti, Tj)
    torch.testing.assert_close(grads[-1], expected, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # weights untouched


def test_classification_objective_tiny_saved_model(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    enc = tiny_bert()
    cfg = BertConfig(vocab_size=enc.tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2, attn_implementation="eager")
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "clf")
    enc.tokenizer.save_pretrained(tmp_path / "clf")
    from probes.data.glue import GlueExample
    examples = [GlueExample("a fine film .", None, 1, 0), GlueExample("dull , dull , dull", None, 0, 1),
                GlueExample("the cat sat .", "a cat was sitting .", 1, 2)]
    obj = G.ClassificationObjective(model_path=str(tmp_path / "clf"), examples=examples)
    ctx = AnalysisContext(OmegaConf.create(dict(paths=dict(data_dir=str(tmp_path)))), tmp_path / "out", use_wandb=False)
    model, tok, name = obj.load(ctx)
    items = obj.prepare(obj.sequences(ctx, tok, "dev", None, 64), tok)
    acc = G.compute(model, tok, obj, items, "cpu", progress=False)
    df = acc.table()
    assert np.isfinite(df.value).all() and (df[df.stat == "mean_abs"].value > 0).all()
    assert acc.n_sequences == 3
    with pytest.raises(ValueError, match="model_path"):
        G.ClassificationObjective().load(ctx)


@pytest.mark.slow
def test_minilm_without_mlm_head_raises_clear_error(tiny_cfg, tmp_path):
    cfg = tiny_cfg("encoder=minilm")
    with pytest.raises(G.MissingMLMHeadError, match=r"no masked-LM head.*cls\.predictions.*Alternatives"):
        G.load_masked_lm(cfg.encoder)
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    with pytest.raises(G.MissingMLMHeadError):
        instantiate(cfg.analysis)(ctx)
