"""The three new analyses end to end in process (tiny encoder, hand-made CoNLL-U with Entity= coreference);
flow and attribution also on tiny DistilBERT and ALBERT (``encoder=tiny_family``)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.context import AnalysisContext

CONF = Path(__file__).resolve().parents[1] / "conf"

# Two GUM-style sentences: "Mary" (cluster 1) ... "she" (cluster 1); "the dog" (2) ... "it" (2).
GUM = """\
# newdoc id = doc1
# global.Entity = GRP-etype-infstat-salience-centering-minspan-link-identity
# sent_id = doc1-1
1\tMary\tMary\tPROPN\t_\t_\t2\tnsubj\t_\tEntity=(1-person-new-_-_-1-_-_)
2\tsaid\tsay\tVERB\t_\t_\t0\troot\t_\t_
3\tthat\tthat\tSCONJ\t_\t_\t5\tmark\t_\t_
4\tshe\tshe\tPRON\tPRP\t_\t5\tnsubj\t_\tEntity=(1-person-giv-_-_-1-_-_)
5\tlikes\tlike\tVERB\t_\t_\t2\tccomp\t_\t_
6\tthe\tthe\tDET\t_\t_\t7\tdet\t_\tEntity=(2-animal-new-_-_-2-_-_
7\tdog\tdog\tNOUN\tNN\t_\t5\tobj\t_\tEntity=2)
8\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_

# sent_id = doc1-2
1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\tEntity=(3-object-new-_-_-2-_-_
2\thouse\thouse\tNOUN\tNN\t_\t4\tnsubj\t_\tEntity=3)
3\tthat\tthat\tPRON\t_\t_\t4\tnsubj\t_\t_
4\tsees\tsee\tVERB\t_\t_\t0\troot\t_\t_
5\tit\tit\tPRON\tPRP\t_\t4\tobj\t_\tEntity=(2-animal-giv-_-_-1-_-_)
6\tquickly\tquickly\tADV\t_\t_\t4\tadvmod\t_\t_
7\t.\t.\tPUNCT\t_\t_\t4\tpunct\t_\t_

"""

# A third sentence for Westera's coreference items (noun NN/NNS ... pronoun PRP/PRP$, a word between):
# dog (2) ... its (2) is coreferent; cats (4) ... its is not; house (3) ... it (2) in sentence 2 is not.
GUM3 = GUM + """\
# sent_id = doc1-3
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\tEntity=(2-animal-giv-_-_-2-_-_
2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\tEntity=2)
3\tbarked\tbark\tVERB\tVBD\t_\t0\troot\t_\t_
4\tand\tand\tCCONJ\tCC\t_\t7\tcc\t_\t_
5\tcats\tcat\tNOUN\tNNS\t_\t7\tnsubj\t_\tEntity=(4-animal-new-_-_-1-_-_)
6\tthen\tthen\tADV\tRB\t_\t7\tadvmod\t_\t_
7\tsaw\tsee\tVERB\tVBD\t_\t3\tconj\t_\t_
8\tits\tits\tPRON\tPRP$\t_\t9\tnmod:poss\t_\tEntity=(2-animal-giv-_-_-1-_-_)
9\ttail\ttail\tNOUN\tNN\t_\t7\tobj\t_\t_
10\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

"""


def _cfg(tmp_path, analysis, *extra, text=GUM):
    for sub, name in (("ud_english_gum", "en_gum-ud-dev.conllu"), ("ud_english_ewt", "en_ewt-ud-dev.conllu")):
        (tmp_path / "data" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / sub / name).write_text(text)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="analyze", overrides=[
            f"analysis={analysis}", "encoder=tiny", f"paths.data_dir={tmp_path / 'data'}",
            f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false", "data.treebank.download=false",
            "data.treebank.sha256=null", *extra])


def _run(cfg, out):
    ctx = AnalysisContext(cfg, out)
    res = instantiate(cfg.analysis)(ctx)
    return res, json.loads((out / "summary.json").read_text())


def test_flow_end_to_end(tmp_path):
    cfg = _cfg(tmp_path, "flow")
    assert cfg.analysis._target_ == "probes.analysis.westera.flow.flow" and cfg.analysis._partial_
    corr, summ = _run(cfg, tmp_path / "out")
    assert summ["n_sentences"] == 2 and len(summ["rho_G_A_per_layer"]) == 2
    pairs = pd.read_csv(tmp_path / "out" / "flow_pairs.csv")
    assert len(pairs) == 2 * (10 ** 2 + 9 ** 2)  # layers x (words + [CLS] + [SEP])^2
    assert {"flow_layers.png", "flow_scatter.png", "flow_correlations.csv"} <= {p.name for p in (tmp_path / "out").iterdir()}


def test_flow_correlates_end_to_end(tmp_path):
    cfg = _cfg(tmp_path, "flow_correlates", "data=gum", "analysis.n_sentences=null", "analysis.save_pairs=true")
    eff, summ = _run(cfg, tmp_path / "out")
    assert summ["n_sentences"] == 2
    # sentence 1: nouns Mary, dog x pronoun she -> Mary~she coreferent; sentence 2: house, that/it -> none
    assert summ["n_noun_pron_pairs"] == 2 + 2 * 1 and summ["n_coreferent_pairs"] == 1
    pairs = pd.read_csv(tmp_path / "out" / "flow_correlates_pairs.csv")
    co = pairs[(pairs.coreferent == 1) & (pairs.layer == 0)]
    assert list(zip(co.t1, co.t2)) == [(0, 3)]
    assert set(eff.contrast) == {"open_class", "coref"}
    assert summ["level"] == "piece" and summ["westera"]["level"] == "piece"


def test_flow_correlates_westera_original(tmp_path):
    """Westera's own tests at piece level: items, balances and the coref item means against a direct
    recomputation from the raw piece-level flow."""
    import numpy as np

    from probes.analysis.westera import original as W
    from probes.analysis.westera.flow import sentence_flow

    cfg = _cfg(tmp_path, "flow_correlates", "data=gum", "analysis.n_sentences=null", text=GUM3)
    out = tmp_path / "out"
    _, summ = _run(cfg, out)
    w = summ["westera"]
    # items: dog(1) -> its(7) coref, cats(4) -> its(7) not, house -> it (sentence 2) not
    assert (w["n_coref_items"], w["n_nocoref_items"]) == (1, 2)
    ols = pd.read_csv(out / "westera_coref_ols.csv")
    assert {"coref", "distance", "coref_x_distance"} <= set(ols.term)
    ctx = AnalysisContext(cfg, tmp_path / "again")
    s = ctx.sentences("dev")[2]
    _, e, fl = next(iter(sentence_flow(ctx.encoder, [s.words], "cpu", level="piece")))
    G, A = fl["G"].numpy(), fl["A"].numpy()  # (L, T, T) [t2, t1]
    pieces = [[t for t, wp in enumerate(e.word_of_piece) if wp == i] for i in range(s.n)]
    L, T = G.shape[0], G.shape[1]
    slow_pair = [np.mean([G[l, b, a] for a in pieces[1] for b in pieces[7]]) for l in range(L)]
    assert np.allclose(W.pair_mean(G, pieces[1], pieces[7]), slow_pair)
    tt = pd.read_csv(out / "westera_coref_ttests.csv")
    coref_mean = tt[(tt.measure == "G") & (tt.layer >= 0)].sort_values("layer").mean_coref.to_numpy()
    assert np.allclose(coref_mean, slow_pair, rtol=1e-4)  # the one coreferent item is dog -> its
    opened = [p for i, u in enumerate(s.upos) if u in W.OPEN_TAGS for p in pieces[i]]
    slow_open = [np.mean([sum(A[l, t2, t1] for t2 in range(T)) for t1 in opened]) for l in range(L)]
    cls = W.class_balances(A, W.word_positions(e.word_of_piece, e.n_words, "piece"), s.upos,
                           {"open": W.OPEN_TAGS, "closed": W.CLOSED_TAGS})
    assert np.allclose(cls["open"], slow_open)
    tests = pd.read_csv(out / "westera_classes.csv")
    assert set(tests.test) == {"open_closed", "pos"} and len(tests[tests.test == "pos"].groupby(["a", "b"])) == 28
    corr = pd.read_csv(out / "westera_correlation.csv")
    assert corr.pearson.between(-1, 1).all() and set(corr.measure) == {"G", "Gstar"}
    assert (out / "flow_westera.png").is_file()


def test_attribution_end_to_end(tmp_path):
    cfg = _cfg(tmp_path, "attribution", "analysis.ig_steps=3", "analysis.min_words=3")
    layers, summ = _run(cfg, tmp_path / "out")
    assert summ["n_sentences"] == 2 and summ["captum_max_abs_diff"] < 1e-5
    assert set(layers.method) == {"ixg", "ig"} and layers.js.between(0, 1).all()
    pat = pd.read_csv(tmp_path / "out" / "attribution_patterns.csv")
    assert set(pat.source) == {"attention", "ixg", "ig"}
    assert pat.groupby(["source", "layer"]).share.sum().round(6).eq(1).all()


@pytest.mark.parametrize("family", ["distilbert", "albert"])
def test_flow_and_attribution_other_families(tmp_path, family):
    enc = ["encoder=tiny_family", f"encoder.family={family}", f"encoder.root={tmp_path / 'models'}"]
    corr, summ = _run(_cfg(tmp_path, "flow", *enc), tmp_path / "flow")
    assert summ["model_type"] == family and summ["n_sentences"] == 2 and len(summ["rho_G_A_per_layer"]) == 2
    pairs = pd.read_csv(tmp_path / "flow" / "flow_pairs.csv")
    assert len(pairs) == 2 * (10 ** 2 + 9 ** 2) and pairs[["G", "Gstar", "A"]].notna().all().all()
    layers, summ = _run(_cfg(tmp_path, "attribution", *enc, "analysis.ig_steps=2", "analysis.min_words=3"),
                        tmp_path / "attr")
    assert summ["model_type"] == family and summ["n_sentences"] == 2 and summ["captum_max_abs_diff"] < 1e-5
    assert set(layers.method) == {"ixg", "ig"} and layers.js.between(0, 1).all()
