"""Every supported family through every stage it supports, on tiny random models loaded as local folders.

Stages: extraction (word maps equal a plain eager fp32 forward pooled to words), a short dependency-probe
training, head_stats, dep_heads, head disabling (hooks and analysis=disable_heads), flow, attribution and
grad_sep (every tiny folder has an MLM head). The reference forward is a separately loaded
``attn_implementation="eager"`` transformers model with ``output_attentions=True``.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pandas as pd
import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModel, AutoModelForSequenceClassification

from probes.analysis.context import run_analysis
from probes.model import hooks
from probes.model.inputs import encode_words, pad_encoded, pool_attention, pooling_matrix
from probes.model.tiny import FAMILIES, tiny_encoder, tiny_folder
from tests import reference
from tests.conftest import ROOT, TINY_CONLLU, chain_overrides, compose_train, require_shared, shared_data_dir

SENTS = [["The", "unbelievably", "quick", "fox", "jumped", "over", "the", "dog", "."],
         ["Hello", "!"], ["A", "cat", ",", "a", "dog", "and", "John", "'s", "mat", "sat", "."] * 2]
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> tiny model folder (built once for the module)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: tiny_folder(f, root=root) for f in FAMILIES}


def reference_word_maps(folder, tokenizer, words) -> np.ndarray:
    """(L, H, W, W) word maps of a plain eager fp32 forward (no hooks, no batching) of the words as running text,
    Clark pooling by explicit loops (:func:`tests.reference.eager_word_maps`: the tokenizer on the joined
    string, nothing from probes.model.inputs)."""
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    return reference.eager_word_maps(model, tokenizer, words)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_extraction_equals_plain_eager_forward(models, family, tmp_path):
    from probes.extract.stage import extract

    enc = tiny_encoder(family, root=models[family].parent.parent)
    assert enc.model_type == family and enc.num_layers == 2 and enc.num_heads == 4
    # live capture through the model layer, batched and padded, pooled in fp32: within 1e-4
    items = encode_words(enc.tokenizer, SENTS)
    with torch.no_grad(), hooks.attention(enc.model, stop=True) as s:
        s.run(**pad_encoded(items, enc.tokenizer.pad_token_id))
    attn = s.attentions()  # (B, L, H, T, T)
    for k, e in enumerate(items):
        T, W = e.n_pieces, e.n_words + 2
        frm = pooling_matrix(e.word_of_piece, e.n_words, "mean")[None]
        to = pooling_matrix(e.word_of_piece, e.n_words, "sum")[None]
        L, H = attn.shape[1:3]
        live = pool_attention(attn[k:k + 1, :, :, :T, :T].reshape(1, L * H, T, T), frm, to)[0].reshape(L, H, W, W)
        np.testing.assert_allclose(live.numpy(), reference_word_maps(models[family], enc.tokenizer, SENTS[k]),
                                   atol=1e-4)
    # the cache stage (float16 storage)
    cache = extract(enc, SENTS, dict(encoder=enc.name, dataset="s", split=family), tmp_path, TRAINER, max_tokens=64)
    for k in range(len(SENTS)):
        np.testing.assert_allclose(cache[k].astype(np.float32),
                                   reference_word_maps(models[family], enc.tokenizer, SENTS[k]), atol=2e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_disabling_is_uniform_over_real_keys(models, family):
    enc = tiny_encoder(family, root=models[family].parent.parent)
    batch = pad_encoded(encode_words(enc.tokenizer, SENTS[:2]), enc.tokenizer.pad_token_id)
    with torch.no_grad():
        with hooks.attention(enc.model) as s:
            plain = s.run(**batch).last_hidden_state
            p_plain = {l: a.clone() for l, a in s.probs.items()}
        with hooks.attention(enc.model, uniform={1: [2]}) as s:
            changed = s.run(**batch).last_hidden_state
    n_real = batch["attention_mask"].sum(1)  # (B,)
    for b in range(2):
        n = int(n_real[b])
        u = s.probs[1][b, 2, :n, :n]
        if family == "modernbert":  # sliding-window layer: uniform over the window each query may see
            assert torch.allclose(u.sum(-1), torch.ones(n))
        else:
            assert torch.allclose(u, torch.full((n, n), 1.0 / n))
        assert torch.all(s.probs[1][b, 2, :n, n:] == 0)
    assert torch.equal(s.probs[1][:, [0, 1, 3]], p_plain[1][:, [0, 1, 3]])  # other heads untouched
    assert torch.equal(s.probs[0], p_plain[0])  # earlier layers untouched
    assert not torch.allclose(changed, plain)


def _analysis_cfg(tmp_path, family, analysis, *extra, data_dir=None):
    if data_dir is None:
        data_dir = tmp_path / "data"
        (data_dir / "ud_english_ewt").mkdir(parents=True, exist_ok=True)
        (data_dir / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=[
            f"analysis={analysis}", "encoder=tiny_family", f"encoder.family={family}",
            f"paths.data_dir={data_dir}", f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
            "data.treebank.download=false", "extract.precision=32-true", "extract.trainer.accelerator=cpu", *extra])


STAGES = {
    "head_stats": [],
    "dep_heads": [],
    "flow": ["analysis.max_sentences=2"],
    "attribution": ["analysis.max_sentences=2", "analysis.n_shortest=2", "analysis.min_words=2",
                    "analysis.ig_steps=2", "analysis.captum_check=1"],
    "grad_sep": ["analysis.max_sentences=2"],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("analysis", list(STAGES))
def test_analysis_runs_on_family(models, family, analysis, tmp_path):
    cfg = _analysis_cfg(tmp_path, family, analysis, *STAGES[analysis],
                        f"encoder.root={models[family].parent.parent}")  # the module's tiny folder, built once
    run_analysis(cfg, tmp_path / "out", figures=family == "bert")  # figures built for all, written for one (PNG)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["analysis"] == analysis  # the analysis that ran is the one asked for
    assert summary.get("n_sentences", summary.get("n_sequences")) > 0
    csvs = list((tmp_path / "out").glob("*.csv"))
    assert csvs and all(len(pd.read_csv(p)) > 0 for p in csvs)
    if analysis == "head_stats":
        df = pd.read_csv(tmp_path / "out" / "head_stats.csv")
        assert set(df.layer) == {0, 1} and set(df["head"]) == {0, 1, 2, 3}
        assert df[df.stat.isin(["cls", "sep", "prev", "next"])].value.between(0, 1).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_dependency_probe_trains_on_family(models, chain_data, tmp_path, family):
    """The attention probe trains on each family's maps; the caches are built in a child interpreter (the default)
    for BERT and in this process for the others (the child receives the encoder's config whatever the family,
    and costs an interpreter's start: tests/test_extract.py compares its caches with this process's)."""
    from probes.train import train

    over = [o for o in chain_overrides(chain_data, tmp_path) if o != "encoder=tiny"]
    cfg = compose_train(over + ["encoder=tiny_family", f"encoder.family={family}", "probe=attn_only",
                                f"encoder.root={models[family].parent.parent}", "trainer.max_epochs=1",
                                "data.max_sentences.train=40",
                                f"data.extract_in_child={str(family == 'bert').lower()}"])
    m = train(cfg)
    assert 0 <= m["test/uas"] <= 1 and 0 <= m["val/uas_best"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_disable_heads_analysis_on_family(models, family, tmp_path):
    require_shared("glue", "shared GLUE data")
    ft = tmp_path / "ft"
    model = AutoModelForSequenceClassification.from_pretrained(str(models[family]), num_labels=2)
    model.save_pretrained(ft)
    tiny_encoder(family, root=models[family].parent.parent).tokenizer.save_pretrained(ft)
    (ft / "glue_task.json").write_text(json.dumps(dict(task="mrpc")))
    cfg = _analysis_cfg(tmp_path, family, "disable_heads", f"analysis.checkpoint={ft}", "analysis.max_examples=8",
                        f"encoder.root={models[family].parent.parent}", data_dir=shared_data_dir())
    run_analysis(cfg, tmp_path / "out", figures=family == "bert")  # figures built for all, written for one (PNG)
    df = pd.read_csv(tmp_path / "out" / "disable_heads_mrpc.csv")
    assert set(df.condition) == {"none", "head", "layer"}
    assert len(df[(df.condition == "head") & (df.metric == "f1")]) == 2 * 4
