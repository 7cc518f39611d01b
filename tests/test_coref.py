"""Coreference readers, segmentation, baselines and the coref_heads analysis (tiny random BERT)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.clark import coref_heads as A
from probes.analysis.context import AnalysisContext
from probes.data.coref import (CorefDocument, CorefError, CorefSentence, heuristic_head,
                               parse_entity_field, pronoun_features, read_conll2012, read_gum_coref, read_ontogum)
from probes.extract.cache import AttentionCache
from probes.model.load import tiny_bert
from tests.conftest import require_shared

REPO = Path(__file__).resolve().parents[1]

# doc d1: "John saw his dog ." "He liked the dog ." "It barked ."
# clusters: 1 = John / his / He; 2 = his dog / the dog / It; 5 = a (made-up) singleton 'saw' that
# without_singletons() drops. 'his' is a one-word mention nested in 'his dog' (same line).
CONLLU = """\
# newdoc id = d1
# global.Entity = GRP-etype-infstat-salience-centering-minspan-link-identity
# sent_id = d1-1
1\tJohn\tJohn\tPROPN\t_\tNumber=Sing\t2\tnsubj\t_\tEntity=(1-person-new-x-x-1-coref)
2\tsaw\tsee\tVERB\t_\t_\t0\troot\t_\tEntity=(5-event-new-x-x-1-sgl)
3\this\the\tPRON\t_\tNumber=Sing\t4\tnmod:poss\t_\tEntity=(2-object-new-x-x-2-coref(1-person-giv-x-x-1-ana)
4\tdog\tdog\tNOUN\t_\tNumber=Sing\t2\tobj\t_\tEntity=2)
5\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_

# sent_id = d1-2
1\tHe\the\tPRON\t_\tNumber=Sing\t2\tnsubj\t_\tEntity=(1-person-giv-x-x-1-ana)
2\tliked\tlike\tVERB\t_\t_\t0\troot\t_\t_
3\tthe\tthe\tDET\t_\t_\t4\tdet\t_\tEntity=(2-object-giv-x-x-2-coref
4\tdog\tdog\tNOUN\t_\tNumber=Sing\t2\tobj\t_\tEntity=2)
5\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_

# sent_id = d1-3
1\tIt\tit\tPRON\t_\tNumber=Sing\t2\tnsubj\t_\tEntity=(2-object-giv-x-x-1-ana)
2\tbarked\tbark\tVERB\t_\t_\t0\troot\t_\t_
3\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_

"""

# multi-line span across a sentence break (cluster 7 opens in sentence 1, closes in sentence 2)
CONLLU_CROSS = """\
# newdoc id = d2
# sent_id = d2-1
1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\tEntity=(7-object-new-x-x-2-coref
2\tbox\tbox\tNOUN\t_\t_\t0\troot\t_\t_

# sent_id = d2-2
1\there\there\tADV\t_\t_\t0\troot\t_\tEntity=7)

"""

CONLL2012 = """\
#begin document (doc1); part 0
doc1\t0\t0\tThe\t_\t_\t_\t_\t_\t_\t_\t_\t(0
doc1\t0\t1\tLord\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t2\tChancellor\t_\t_\t_\t_\t_\t_\t_\t_\t0)
doc1\t0\t3\tsat\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t4\tin\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t5\tLincoln\t_\t_\t_\t_\t_\t_\t_\t_\t(1|(2)
doc1\t0\t6\t's\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t7\tInn\t_\t_\t_\t_\t_\t_\t_\t_\t1)
doc1\t0\t8\t.\t_\t_\t_\t_\t_\t_\t_\t_\t

doc1\t0\t0\tHe\t_\t_\t_\t_\t_\t_\t_\t_\t(0)
doc1\t0\t1\tleft\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t2\tthe\t_\t_\t_\t_\t_\t_\t_\t_\t(1
doc1\t0\t3\tinn\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t4\tof\t_\t_\t_\t_\t_\t_\t_\t_\t
doc1\t0\t5\tLincoln\t_\t_\t_\t_\t_\t_\t_\t_\t(2)1)
doc1\t0\t6\t.\t_\t_\t_\t_\t_\t_\t_\t_\t
#end document
"""

ONTOGUM = """\
# begin document d1
0\tJohn\t(1)
1\tsaw\t_
2\this\t(2(1)
3\tdog\t2)
4\t.\t_
5\tHe\t(1)
6\tliked\t_
7\tthe\t(2
8\tdog\t2)
9\t.\t_
10\tIt\t(2)
11\tbarked\t_
12\t.\t_
# end document
"""


def _spans(doc):
    w = doc.words
    return [(m.cluster, " ".join(w[m.start:m.end + 1]), w[m.head], m.mtype) for m in doc.mentions]


def test_entity_field_parsing():
    ev = parse_entity_field("(7-abstract-new-nnnss-cf6-2-coref(3-abstract-giv:act-sssss-cf1-1-coref)")
    assert [(k, c) for k, c, _ in ev] == [("open", "7"), ("single", "3")]
    assert ev[0][2][1] == "abstract"
    assert [(k, c) for k, c, _ in parse_entity_field("7)6)5)4)")] == [("close", c) for c in "7654"]
    assert [(k, c) for k, c, _ in parse_entity_field("3)(5-x-y)")] == [("close", "3"), ("single", "5")]


def test_gum_entity_reader(tmp_path):
    p = tmp_path / "gum.conllu"
    p.write_text(CONLLU + CONLLU_CROSS)
    docs = read_gum_coref(p)
    assert [d.doc_id for d in docs] == ["d1", "d2"]
    d1 = docs[0]
    assert _spans(d1) == [("1", "John", "John", "proper"), ("5", "saw", "saw", "nominal"),
                          ("1", "his", "his", "pronoun"), ("2", "his dog", "dog", "nominal"),
                          ("1", "He", "He", "pronoun"), ("2", "the dog", "dog", "nominal"),
                          ("2", "It", "It", "pronoun")]
    assert [m.etype for m in d1.mentions][:4] == ["person", "event", "person", "object"]
    assert d1.offsets == [0, 5, 10]
    # singletons go
    assert "5" not in {m.cluster for m in d1.without_singletons().mentions}
    assert len(d1.without_singletons().mentions) == 6
    # a span over two lines and a sentence break; head = the word whose head is outside the span
    (m,) = docs[1].mentions
    assert (m.start, m.end, docs[1].words[m.head]) == (0, 2, "box")


def test_gum_reader_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.conllu"
    p.write_text(CONLLU.replace("Entity=(1-person-new-x-x-1-coref)", "Entity=9)"))
    with pytest.raises(CorefError, match=r"bad\.conllu:4: .*cluster 9"):
        read_gum_coref(p)


def test_conll2012_reader(tmp_path):
    p = tmp_path / "lit.conll"
    p.write_text(CONLL2012)
    (doc,) = read_conll2012(p)
    assert doc.doc_id == "doc1"
    assert [len(s.words) for s in doc.sentences] == [9, 7]
    assert _spans(doc) == [
        ("0", "The Lord Chancellor", "Chancellor", "proper"), ("2", "Lincoln", "Lincoln", "proper"),
        ("1", "Lincoln 's Inn", "Inn", "proper"), ("0", "He", "He", "pronoun"),
        ("1", "the inn of Lincoln", "inn", "nominal"), ("2", "Lincoln", "Lincoln", "proper")]
    bad = tmp_path / "bad.conll"
    bad.write_text(CONLL2012.replace("\t0)\n", "\t9)\n"))
    with pytest.raises(CorefError, match=r"bad\.conll:4: closes cluster 9"):
        read_conll2012(bad)


def test_heuristic_head():
    w = "the old man with a stick".split()
    assert w[heuristic_head(w, 0, 5)] == "man"
    w = "his father 's house".split()
    assert w[heuristic_head(w, 0, 3)] == "house"


def test_ontogum_alignment(tmp_path):
    ud = tmp_path / "ud.conllu"
    ud.write_text(CONLLU)
    og = tmp_path / "og.conll"
    og.write_text(ONTOGUM)
    (doc,) = read_ontogum(og, ud)
    assert [len(s.words) for s in doc.sentences] == [5, 5, 3]  # sentences from UD
    assert _spans(doc) == [("1", "John", "John", "proper"), ("1", "his", "his", "pronoun"),
                           ("2", "his dog", "dog", "nominal"), ("1", "He", "He", "pronoun"),
                           ("2", "the dog", "dog", "nominal"), ("2", "It", "It", "pronoun")]
    og.write_text(ONTOGUM.replace("12\t.\t_\n", ""))
    with pytest.raises(CorefError, match="og.conll:1: document d1 has 12 tokens, UD GUM has 13"):
        read_ontogum(og, ud)


def _doc(tmp_path):
    p = tmp_path / "gum.conllu"
    p.write_text(CONLLU)
    return read_gum_coref(p)[0].without_singletons()


def test_baselines_on_handmade_document(tmp_path):
    doc = _doc(tmp_path)
    seg = A.Segment(0, 0, 3, 0, 13, 20)
    items = {(it.head, it.mtype): it for it in A.segment_items(doc, seg, 0)}
    words = doc.words
    # evaluated mentions: his (ant John), He (ants John, his), the dog (ant his dog), It (ants his dog, the dog)
    assert sorted(words[h] for h, _ in items) == ["He", "It", "dog", "his"]
    he = items[(5, "pronoun")]
    assert he.antecedent_heads == {0, 2}
    assert words[he.predictions["nearest"]] == "dog"  # 'his dog' is the nearest preceding mention
    assert he.predictions["head_match"] == 3  # no earlier 'he' -> nearest
    assert he.predictions["rule_based"] == 2  # pronoun agreement: "his dog" is typed object (inanimate) -> 'his'
    the_dog = items[(8, "nominal")]
    assert the_dog.predictions["head_match"] == 3 and the_dog.predictions["nearest"] == 5
    it = items[(10, "pronoun")]
    assert words[it.predictions["nearest"]] == "dog" and it.predictions["nearest"] == 8
    acc = A.CorefAccumulator(1, 1)
    acc.add(None, list(items.values()))
    assert acc.count == {"all": 4, "pronoun": 3, "proper": 0, "nominal": 1}
    # nearest: his->John ok, He->dog wrong, the dog->He wrong, It->the dog ok
    assert acc.baseline_accuracy("all", "nearest") == 0.5
    assert acc.baseline_accuracy("nominal", "head_match") == 1.0


def _baselines_by_loops(doc, seg):
    """(head, antecedent heads, predictions) of every evaluated mention of ``seg``, segment-local, by plain loops
    over the document's mentions: candidates = earlier mentions of the segment (by (start, end)) with another head;
    each rule scans them from the closest, comparing lowercased strings joined from the document's words."""
    words = doc.words
    number = [n for s in doc.sentences for n in (s.number or (None,) * len(s.words))]

    def feats(m):
        if m.mtype == "pronoun":
            person, num, gender = pronoun_features(words[m.head])
            return person, num, None if gender is None else gender in ("m", "f")
        return 3, {"Sing": "sg", "Plur": "pl"}.get(number[m.head] or ""), (
            None if m.etype in (None, "animal") else m.etype == "person")

    def agree(a, b):
        return all(x is None or y is None or x == y for x, y in zip(a, b))

    def text(m):
        return " ".join(words[m.start:m.end + 1]).lower()

    inside = sorted([m for m in doc.mentions if seg.word_start <= m.start and m.end < seg.word_end],
                    key=lambda m: (m.start, m.end))
    out = []
    for k, m in enumerate(inside):
        cands = [c for c in inside[:k] if c.head != m.head]
        ants = {c.head for c in cands if c.cluster == m.cluster}
        if not ants:
            continue
        near = cands[-1].head
        same_head = [c.head for c in cands if words[c.head].lower() == words[m.head].lower()]
        rule = ([c.head for c in cands if text(c) == text(m)] or same_head
                or ([c.head for c in cands if agree(feats(c), feats(m))] if m.mtype == "pronoun" else [])
                or [near])[-1]
        o = seg.word_start
        out.append((m.head - o, {a - o for a in ants},
                    dict(nearest=near - o, head_match=(same_head or [near])[-1] - o, rule_based=rule - o)))
    return out


def test_baselines_equal_plain_loops_on_gum_documents():
    """The baselines and antecedents of segment_items on real GUM dev documents, in segments of 7 sentences and
    whole, equal plain loops over the mentions written here."""
    gum = require_shared("ud_english_gum")
    docs = [d.without_singletons() for d in read_gum_coref(gum / "en_gum-ud-dev.conllu")[:4]]
    n = 0
    for i, doc in enumerate(docs):
        off = doc.offsets + [len(doc.words)]
        for size in (7, len(doc.sentences)):
            for a in range(0, len(doc.sentences), size):
                b = min(a + size, len(doc.sentences))
                seg = A.Segment(i, a, b, off[a], off[b], 0)
                got = [(it.head, set(it.antecedent_heads), it.predictions) for it in A.segment_items(doc, seg, a)]
                assert got == _baselines_by_loops(doc, seg), (doc.doc_id, a, b)
                n += len(got)
    assert n > 500  # 776 mentions


def test_synthetic_attention_to_antecedent_scores_100(tmp_path):
    doc = _doc(tmp_path)
    seg = A.Segment(0, 0, 3, 0, 13, 20)
    items = A.segment_items(doc, seg, 0)
    L, H, W = 2, 3, 13 + 2
    rng = np.random.default_rng(0)
    attn = rng.random((L, H, W, W)).astype(np.float32)
    attn /= attn.sum(-1, keepdims=True)
    for it in items:  # head (1, 2) attends hard to an antecedent head (+ a lot to itself and [SEP])
        row = np.zeros(W, dtype=np.float32)
        row[1 + min(it.antecedent_heads)] = 0.3
        row[1 + it.head] = 0.4
        row[W - 1] = 0.3
        attn[1, 2, 1 + it.head] = row
    acc = A.CorefAccumulator(L, H)
    acc.add(attn, items)
    heads, table = A.tables(acc)
    assert acc.head_accuracy("all")[1, 2] == 1.0
    best = table[table.method == "best_head"].iloc[0]
    assert (best.layer, best["head"], best["name"], best["all"]) == (1, 2, "2-3", 1.0)
    assert set(heads.columns) == {"layer", "head", "mention_type", "accuracy", "count"}


def test_segmentation_never_splits_and_respects_limit():
    enc = tiny_bert()
    rng = np.random.default_rng(0)
    vocab = "the cat unbelievably saw antidisestablishmentarianism a dog , . ran quickly".split()
    sents = [CorefSentence(tuple(rng.choice(vocab, size=int(rng.integers(1, 25))))) for _ in range(60)]
    doc = CorefDocument("d", sents, [])
    (pieces,) = A.sentence_pieces(enc.tokenizer, [doc])
    max_len = 64
    segs, too_long = A.segment_document(pieces, max_len, 0, [len(s.words) for s in sents])
    covered = [i for g in segs for i in range(g.first_sentence, g.last_sentence)]
    assert sorted(covered + too_long) == list(range(len(sents)))  # every sentence once, whole
    from probes.model.inputs import encode_words
    for g in segs:
        words = [w for s in sents[g.first_sentence:g.last_sentence] for w in s.words]
        n = encode_words(enc.tokenizer, [words])[0].n_pieces
        assert n == g.n_pieces <= max_len
        assert g.word_end - g.word_start == len(words)
    for i in too_long:
        assert pieces[i] + 2 > max_len
    # greedy: a segment could not have taken the next sentence
    for a, b in zip(segs, segs[1:]):
        if b.first_sentence == a.last_sentence:
            assert a.n_pieces + pieces[b.first_sentence] > max_len
    segs, too_long = A.segment_document([10, 70, 10], 64)
    assert too_long == [1] and [(g.first_sentence, g.last_sentence) for g in segs] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_segments_of_byte_level_decoders_fit_as_encoded(family, tmp_path):
    """A decoder's byte-level BPE gives a sentence that follows another a leading space and adds 0 or 1
    special tokens (not [CLS]/[SEP]): segments are measured as the cache encodes them, so each fits."""
    from transformers import AutoTokenizer
    from probes.model.tiny import tiny_folder
    tok = AutoTokenizer.from_pretrained(str(tiny_folder(family, root=tmp_path)))

    def n_pieces(words):  # the model's own tokenizer on the running text, specials included
        return len(tok(" ".join(words))["input_ids"])

    rng = np.random.default_rng(1)
    vocab = "The cat unbelievably saw antidisestablishmentarianism a dog , . ran quickly".split()
    sents = [CorefSentence(tuple(rng.choice(vocab, size=int(rng.integers(1, 25))))) for _ in range(60)]
    doc = CorefDocument("d", sents, [])
    (pieces,) = A.sentence_pieces(tok, [doc])
    n_special = n_pieces(sents[0].words) - pieces[0]
    assert n_special == (1 if family == "llama" else 0)
    max_len = 40
    segs, too_long = A.segment_document(pieces, max_len, 0, [len(s.words) for s in sents],
                                        A.segment_length(tok, doc))
    covered = [i for g in segs for i in range(g.first_sentence, g.last_sentence)]
    assert sorted(covered + too_long) == list(range(len(sents))) and len(segs) > 5
    for g in segs:
        words = [w for s in sents[g.first_sentence:g.last_sentence] for w in s.words]
        assert n_pieces(words) == g.n_pieces <= max_len
    for a, b in zip(segs, segs[1:]):  # greedy: the next sentence would not have fit
        if b.first_sentence == a.last_sentence:
            words = [w for s in sents[a.first_sentence:b.first_sentence + 1] for w in s.words]
            assert n_pieces(words) > max_len


def _compose(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=overrides)


def test_coref_heads_end_to_end_tiny(tmp_path):
    data = tmp_path / "data" / "ud_english_gum"
    data.mkdir(parents=True)
    (data / "en_gum-ud-dev.conllu").write_text(CONLLU + CONLLU_CROSS)
    cfg = _compose(["analysis=coref_heads", "encoder=tiny", f"paths.data_dir={tmp_path / 'data'}",
                    f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
                    "analysis.gum.download=false", "analysis.gum.sha256=null", "extract.precision=32-true",
                    "extract.trainer.accelerator=cpu", "analysis.max_length=8"])
    ctx = AnalysisContext(cfg, tmp_path / "out", use_wandb=False)
    table = instantiate(cfg.analysis)(ctx)
    assert list(table.method) == ["best_head", "best_head_pronoun", "best_head_proper", "best_head_nominal",
                                  "nearest", "head_match", "rule_based"]
    heads = pd.read_csv(tmp_path / "out" / "coref_heads.csv")
    assert len(heads) == 2 * 4 * 4 and heads.accuracy.between(0, 1).all()
    # with 8 wordpieces each sentence is its own segment, so only 'his' (antecedent John) is evaluated
    assert heads["count"].max() == 1
    for f in ("coref_table.csv", "coref_mentions.csv", "coref_heads.png", "summary.json"):
        assert (tmp_path / "out" / f).is_file()


@pytest.mark.slow
def test_real_gum_dev_reader():
    p = require_shared("ud_english_gum/en_gum-ud-dev.conllu", "GUM dev")
    docs = read_gum_coref(p)
    assert len(docs) == 30
    assert sum(len(d.mentions) for d in docs) == 7897


@pytest.mark.slow
def test_real_ontogum_and_litbank_readers():
    og = require_shared("gum_coref_ontogum/ontogum_dev.conll", "OntoGUM dev")
    docs = read_ontogum(og, require_shared("ud_english_gum/en_gum-ud-dev.conllu", "GUM dev"))
    assert len(docs) == 30 and sum(len(d.mentions) for d in docs) == 3818  # SOURCES.md: 3,818 openings
    from probes.data.coref import read_litbank
    lit = read_litbank(require_shared("litbank_coref/conll", "LitBank"), max_files=5)
    assert len(lit) == 5 and all(d.mentions for d in lit)


def test_mention_rows_cache_gives_the_whole_maps_results(tmp_path):
    """Real GUM dev documents: the default cache of the mention heads' rows only and a cache of whole maps give the
    same three tables, byte for byte, from entries of their own keys, the rows' a fraction of the size."""
    gum = require_shared("ud_english_gum/en_gum-ud-dev.conllu", "GUM dev")
    tables = {}
    for only in (True, False):
        cfg = _compose(["analysis=coref_heads", "encoder=tiny", f"paths.data_dir={gum.parent.parent}",
                        f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false", "extract.precision=32-true",
                        "extract.trainer.accelerator=cpu", "analysis.max_documents=2", "analysis.max_length=64",
                        f"analysis.mention_rows_only={only}"])
        ctx = AnalysisContext(cfg, tmp_path / str(only), use_wandb=False)
        instantiate(cfg.analysis)(ctx)
        tables[only] = {f: (tmp_path / str(only) / f).read_bytes()
                        for f in ("coref_heads.csv", "coref_table.csv", "coref_mentions.csv")}
    assert tables[True] == tables[False]
    assert pd.read_csv(tmp_path / "True" / "coref_heads.csv")["count"].max() > 20  # mentions were scored
    entries = {e.kept_rows is not None: e for e in map(AttentionCache, (tmp_path / "cache" / "attention").iterdir())}
    assert set(entries) == {True, False}
    assert entries[True].manifest["bytes"] < entries[False].manifest["bytes"] / 2
    for only in (True, False):
        summary = json.loads((tmp_path / str(only) / "summary.json").read_text())
        assert summary["mention_rows_only"] is only and summary["cache"] == str(entries[only].path)
        assert summary["cache_bytes"] == entries[only].manifest["bytes"]
