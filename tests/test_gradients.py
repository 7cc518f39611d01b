"""grad_sep: attention gradients on tiny random masked-LM / sequence-classification models."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.analysis.clark import grad_sep as G
from probes.analysis.context import AnalysisContext
from probes.model.load import MissingHeadError, tiny_bert
from probes.model.tiny import tiny_folder

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
    enc = tiny_bert(head="mlm")
    tok = enc.tokenizer
    seqs = [tok("the dog barked loudly at the cat .")["input_ids"], tok("hi")["input_ids"]]
    a = G.MLMObjective(seed=3).mask(seqs, tok)
    b = G.MLMObjective(seed=3).mask(seqs, tok)
    assert a == b
    for s, m, lab in zip(seqs, *a):
        picked = [i for i, l in enumerate(lab) if l != -100]
        assert 1 <= len(picked) and all(0 < i < len(s) - 1 for i in picked)  # never [CLS]/[SEP]
        assert all(m[i] == tok.mask_token_id and lab[i] == s[i] for i in picked)


def _eager_reference(model):
    """The same weights in the plain transformers model with eager attention."""
    from transformers import AutoModelForMaskedLM

    ref = AutoModelForMaskedLM.from_config(copy.deepcopy(model.config), attn_implementation="eager")
    assert ref.config._attn_implementation == "eager"
    ref.load_state_dict(model.state_dict())
    return ref.eval().requires_grad_(False)


def test_attention_gradient_equals_eager_and_dloss_dcontext_dot_values():
    """The retained attention-probability grad equals the plain eager model's (every layer) and is
    exactly dL/dA = dL/dctx_i . V_j (last layer)."""
    enc = tiny_bert(head="mlm")
    model, tok = enc.model, enc.tokenizer
    obj = G.MLMObjective(seed=0)
    items = obj.prepare([dict(ids=tok("the dog barked at the big cat .")["input_ids"]),
                         dict(ids=tok("a cat , sat")["input_ids"])], tok)  # two lengths: padding
    batch = obj.batch(items, tok)
    grads = G.attention_gradients(model, obj, batch, "cpu")
    assert len(grads) == 2 and grads[0].shape == (2, 4, batch.input_ids.shape[1], batch.input_ids.shape[1])
    assert all(p.grad is None for p in model.parameters())  # weights untouched
    # independent computation on the eager reference (hooks in the test only)
    ref = _eager_reference(model)
    layers = ref.bert.encoder.layer
    saved = {"probs": []}

    def vhook(m, a, out):
        saved["v"] = out

    def shook(m, a, out):
        out[0].retain_grad()
        saved["ctx"] = out[0]

    def phook(m, a, out):
        out[1].retain_grad()
        saved["probs"].append(out[1])

    hs = [layers[-1].attention.self.value.register_forward_hook(vhook),
          layers[-1].attention.self.register_forward_hook(shook)]
    hs += [layer.attention.self.register_forward_hook(phook) for layer in layers]
    try:
        with torch.enable_grad():
            emb = ref.get_input_embeddings()(batch.input_ids).detach().requires_grad_(True)
            out = ref(inputs_embeds=emb, attention_mask=batch.attention_mask)
            obj.loss(out, batch).backward()
    finally:
        for h in hs:
            h.remove()
    for g, p in zip(grads, saved["probs"]):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    B, T, D = saved["v"].shape
    H = grads[-1].shape[1]
    v = saved["v"].detach().view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
    dctx = saved["ctx"].grad.reshape(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
    expected = dctx @ v.transpose(-1, -2)  # (B, H, Ti, Tj)
    torch.testing.assert_close(grads[-1], expected, rtol=1e-4, atol=1e-7)
    # a sequence's gradients do not depend on its batch: the short one alone == cropped from the batch
    n = int(batch.attention_mask[1].sum())
    assert n < T
    alone = G.attention_gradients(model, obj, obj.batch(items[1:], tok), "cpu")
    for g, a in zip(grads, alone):
        torch.testing.assert_close(g[1:, :, :n, :n], a, rtol=1e-4, atol=1e-8)


def test_classification_objective_tiny_saved_model(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    enc = tiny_bert()
    cfg = BertConfig(vocab_size=enc.tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "run" / "hf_model")  # a GLUE run folder
    enc.tokenizer.save_pretrained(tmp_path / "run" / "hf_model")
    from probes.data.glue import GlueExample
    examples = [GlueExample("a fine film .", None, 1, 0), GlueExample("dull , dull , dull", None, 0, 1),
                GlueExample("the cat sat .", "a cat was sitting .", 1, 2)]
    obj = G.ClassificationObjective(checkpoint=str(tmp_path / "run"), examples=examples)
    ctx = AnalysisContext(OmegaConf.create(dict(paths=dict(data_dir=str(tmp_path)))), tmp_path / "out", use_wandb=False)
    m = obj.load(ctx)
    assert m.name == "run" and m.max_length == 64
    items = obj.prepare(obj.sequences(ctx, m.tokenizer, "dev", None, 64), m.tokenizer)
    assert items[2]["type_ids"] is not None and set(items[2]["type_ids"]) == {0, 1}  # the pair has token types
    assert len(obj.sequences(ctx, m.tokenizer, "dev", 2, 64)) == 2  # max_sentences = first N examples
    acc = G.compute(m.model, m.tokenizer, obj, items, "cpu", progress=False)
    df = acc.table()
    assert np.isfinite(df.value).all() and (df[df.stat == "mean_abs"].value > 0).all()
    assert acc.n_sequences == 3
    counts = df[df.stat == "count"].set_index(["layer", "target"]).value
    assert counts.loc[(0, "sep")] > 0 and counts.loc[(0, "punct")] > 0
    with pytest.raises(ValueError, match="checkpoint"):
        G.ClassificationObjective().load(ctx)
    with pytest.raises(FileNotFoundError):
        G.ClassificationObjective(checkpoint=str(tmp_path / "missing")).load(ctx)


def test_grad_sep_classification_through_config(tiny_cfg, tmp_path):
    """objectives.classification.checkpoint (GLUE run folder) via Hydra; `split` / `max_sentences` read GLUE."""
    from transformers import BertConfig, BertForSequenceClassification

    enc = tiny_bert()
    cfg = BertConfig(vocab_size=enc.tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2, finetuning_task="sst2")
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "run" / "hf_model")
    enc.tokenizer.save_pretrained(tmp_path / "run" / "hf_model")
    glue = tmp_path / "data" / "glue" / "SST-2"
    glue.mkdir(parents=True)
    (glue / "dev.tsv").write_text("sentence\tlabel\na fine film , really .\t1\ndull , dull .\t0\nok .\t1\n")
    ckpt = f"analysis.objectives.classification.checkpoint={tmp_path / 'run'}"
    c = tiny_cfg("analysis.objective=classification", ckpt, "analysis.max_sentences=2")
    assert "model_path" not in c.analysis.objectives.classification
    ctx = AnalysisContext(c, tmp_path / "out", use_wandb=False)
    df = instantiate(c.analysis)(ctx)
    assert np.isfinite(df.value).all()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["objective"] == "classification" and summary["n_sequences"] == 2 and summary["model"] == "run"
    # a checkpoint fine-tuned on another task is refused
    c = tiny_cfg("analysis.objective=classification", ckpt, "analysis.objectives.classification.task=mrpc")
    with pytest.raises(ValueError, match="sst2"):
        instantiate(c.analysis)(AnalysisContext(c, tmp_path / "out2", use_wandb=False))


@pytest.mark.slow
def test_minilm_without_mlm_head_raises_clear_error(tiny_cfg, tmp_path):
    cfg = tiny_cfg("encoder=minilm")
    with pytest.raises(MissingHeadError, match=r"grad_sep.*no mlm head.*cls\.predictions.*Alternatives"):
        G.load_masked_lm(cfg.encoder)
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    with pytest.raises(MissingHeadError, match="Alternatives"):
        instantiate(cfg.analysis)(ctx)


@pytest.mark.parametrize("encoder", ["tiny", "minilm_random"])
def test_grad_sep_random_weight_encoders_get_a_random_mlm_head(tiny_cfg, tmp_path, encoder):
    """random_init / random_bert / tiny encoders: MLM head drawn like the rest (no _target_ dispatch)."""
    extra = [f"encoder={encoder}"]
    if encoder == "minilm_random":  # the random_init path of load_encoder, MiniLM architecture made tiny
        extra = ["encoder=minilm_random", "analysis.max_sentences=1"]
    cfg = tiny_cfg(*extra)
    m = G.load_masked_lm(cfg.encoder)
    assert type(m.model).__name__.endswith("ForMaskedLM") and m.max_length == (128 if encoder == "tiny" else 512)
    df = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out", use_wandb=False))
    assert np.isfinite(df.value).all() and (df[df.stat == "mean_abs"].value > 0).all()


def test_bert_base_random_config_composes_with_mlm_head():
    """`encoder=bert_base_random` (random_bert) accepts head=mlm (raised ValueError before); built lazily."""
    cfg = _compose(["analysis=grad_sep", "encoder=bert_base_random"])
    enc = instantiate(cfg.encoder, head="mlm", num_hidden_layers=1, hidden_size=48, num_attention_heads=4,
                      intermediate_size=32)
    assert enc.head == "mlm" and type(enc.model).__name__ == "BertForMaskedLM"
    assert enc.name.startswith("bert-base-random")


TINY_FAMILIES = ("roberta", "distilbert", "xlm-roberta")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_grad_sep_other_families(tiny_cfg, tmp_path, family):
    """Byte-level BPE (RoBERTa: </s> is the separator, 'Ġ.' pieces), no token types (DistilBERT),
    SentencePiece (XLM-R): [SEP] and '.'/',' targets found, gradients finite."""
    folder = tiny_folder(family, root=tmp_path / "models")
    cfg = tiny_cfg("encoder=auto", f"encoder.name_or_path={folder}")
    m = G.load_masked_lm(cfg.encoder)
    tok = m.tokenizer
    t = G.Targets(tok)
    from probes.model.inputs import encode_words, pad
    e = encode_words(tok, [["John", ",", "sat", "."]])[0]
    x = pad([e.input_ids], tok.pad_token_id)
    masks = t.masks(x["input_ids"], x["attention_mask"])
    assert masks["sep"][0].tolist() == [False] * (e.n_pieces - 1) + [True]  # the last special only
    assert masks["sep"][0, -1] and e.input_ids[-1] == (tok.sep_token_id or tok.eos_token_id)
    punct = [tok.convert_ids_to_tokens(i) for i, p in zip(e.input_ids, masks["punct"][0].tolist()) if p]
    assert len(punct) == 2 and {p.lstrip("Ġ▁") for p in punct} == {",", "."}, punct
    df = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out", use_wandb=False))
    counts = df[df.stat == "count"].set_index(["layer", "target"]).value
    assert counts.loc[(0, "sep")] > 0 and counts.loc[(0, "punct")] > 0
    assert np.isfinite(df.value).all() and (df[df.stat == "mean_abs"].value > 0).all()
