"""The span reductions of :mod:`probes.maps.spans` and the two analyses that score spans a batch at a time
(``framenet_heads``' link and baseline scores, ``linguistic_attention``'s token kinds and token-to-token relations),
against plain per-sentence loops written here.

The references are independent of the code under test: the model's own tokenizer on the raw sentence
(:func:`tests.reference.text_pieces`), one eager forward with ``output_attentions=True`` per sentence
(:func:`tests.reference.eager_maps`), every piece set picked from the word labels by hand and every maximum or sum
taken by explicit loops over rows and columns. Batches hold sentences of different lengths (small ``max_tokens``:
padding in every batch), on an encoder and a decoder; sentences longer than the model reads are skipped on both
sides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import probes
from probes.analysis.kovaleva.framenet_heads import head_link_scores
from probes.analysis.kovaleva.linguistic_attention import KindRules, compute
from probes.analysis.kovaleva.linguistic_attention.examples import ExampleSelection
from probes.data.conllu import read_conllu
from probes.data.framenet import FrameLink, FrameSentence
from probes.maps import MapEngine
from probes.maps.spans import Spans, block_max, column_reduce, concat_ranges, positions_of, segment_max
from probes.measures.attention import Attention
from probes.model.inputs import encode_words
from probes.model.tiny import tiny_folder
from tests import reference

MAX_POSITIONS = 40
LONG = " ".join(["very"] * 45) + " long ."  # above MAX_POSITIONS pieces


# ----------------------------------------------------------------------------------------------- the primitives
@pytest.mark.parametrize("N", [40, 4])  # blocks covering most entries of the maps (copied first), or a few
def test_block_and_column_reductions_equal_loops(N):
    rng = np.random.default_rng(N)
    B, L, H, T = 3, 2, 3, 7
    maps = torch.from_numpy(rng.normal(size=(B, L, H, T, T)).astype(np.float32))
    index = rng.integers(0, B, N)
    rows, cols = rng.random((N, T)) < 0.3, rng.random((N, T)) < 0.4
    rows[0], cols[1] = False, False  # empty blocks
    a = maps.numpy()
    for max_elements in (10 ** 6, 7):  # one chunk; chunks ending inside a triple
        got = block_max(maps, index, rows, cols, absolute=True, fill=-1.0, max_elements=max_elements)  # (N, L, H)
        plain = block_max(maps, torch.from_numpy(index), torch.from_numpy(rows), torch.from_numpy(cols),
                          max_elements=max_elements)
        for n in range(N):
            want, want_plain = np.full((L, H), -1.0), np.full((L, H), -np.inf)
            for i in range(T):
                for j in range(T):
                    if rows[n, i] and cols[n, j]:
                        want = np.maximum(want, np.abs(a[index[n], :, :, i, j]))
                        want_plain = np.maximum(want_plain, a[index[n], :, :, i, j])
            np.testing.assert_array_equal(got[n].numpy(), want.astype(np.float32))
            np.testing.assert_array_equal(plain[n].numpy(), want_plain.astype(np.float32))
        vec = maps[:, :, :, 0, :]  # (B, L, H, T)
        sums = column_reduce(vec, index, cols, "sum", max_elements=max_elements)  # (N, L, H)
        maxs = column_reduce(vec, index, cols, "max", fill=0.5, max_elements=max_elements)
        for n in range(N):
            total, best = np.zeros((L, H), np.float32), None
            for j in range(T):
                if cols[n, j]:
                    v = a[index[n], :, :, 0, j]
                    total = total + v
                    best = v if best is None else np.maximum(best, v)
            np.testing.assert_allclose(sums[n].numpy(), total, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(maxs[n].numpy(), np.full((L, H), 0.5, np.float32) if best is None else best)
    seg = segment_max(torch.arange(12.0).view(6, 2), [2, 0, 2, 2, 0, 3], 5)  # (5, 2)
    np.testing.assert_array_equal(seg.numpy(), [[8, 9], [-np.inf, -np.inf], [6, 7], [10, 11], [-np.inf, -np.inf]])
    with pytest.raises(ValueError, match="sum or max"):
        column_reduce(vec, index, cols, "mean")
    assert block_max(maps, np.zeros(0, int), np.zeros((0, T), bool), np.zeros((0, T), bool)).shape == (0, L, H)


def test_spans_masks_and_ranges():
    spans = Spans()
    assert spans.add([2, 0]) == 0 and spans.add([]) == 1
    ids = spans.add_many(np.array([[True, False, True, True], [False, False, False, False]]))
    np.testing.assert_array_equal(ids, [2, 3])
    np.testing.assert_array_equal(spans.sizes(np.arange(4)), [2, 0, 3, 0])
    np.testing.assert_array_equal(spans.masks(np.array([2, 0, 1]), 5),
                                  [[1, 0, 1, 1, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(concat_ranges([3, 0, 5], [5, 0, 7]), [3, 4, 5, 6])
    rows, slot = positions_of([2, 0], np.array([0, 2, 2]), np.array([2, 2, 5]))
    np.testing.assert_array_equal(rows, [2, 3, 4, 0, 1])
    np.testing.assert_array_equal(slot, [0, 0, 0, 1, 1])


# ------------------------------------------------------------------------------------------------- the models
@pytest.fixture(scope="module", params=["bert", "llama"])  # an encoder; a decoder (causal, a BOS, no separator)
def model(request, tmp_path_factory):
    folder = tiny_folder(request.param, root=tmp_path_factory.mktemp("spans"), max_positions=MAX_POSITIONS)
    enc = probes.load_encoder(str(folder))
    eager = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    return enc, eager, AutoTokenizer.from_pretrained(str(folder))


def _maps(eager, tok, words):
    """(ids, word of every piece or None, (L, H, T, T) float64 eager maps) of one sentence as running text."""
    ids, wids = reference.text_pieces(tok, words)
    return ids, wids, reference.eager_maps(eager, {"input_ids": ids})


def _block_max(att, rows, cols, absolute=False):
    """(L, H) max of att[:, :, i, j] over i in rows, j in cols, by loops."""
    best = None
    for i in rows:
        for j in cols:
            v = np.abs(att[:, :, i, j]) if absolute else att[:, :, i, j]
            best = v if best is None else np.maximum(best, v)
    return best


# ------------------------------------------------------------------------------------------------- framenet
SENTENCES = [  # (words, [(target words, element words)])
    ("Kim looked the word up in a big dictionary .", [((1, 4), (0,)), ((1, 4), (2, 3)), ((7,), (8,))]),
    ("The meeting will take place on Monday .", [((3, 4), (0, 1)), ((3,), (3, 4))]),  # the second overlaps
    ("What , she asked , is the answer ?", [((3,), (2,)), ((3,), (0, 5, 6, 7))]),  # a discontinuous element
    ("Dogs bark .", [((1,), (0,)), ((0,), (1, 2))]),  # the second fills the sentence: no shift, no baseline
    (LONG, [((0,), (1,))]),  # too long for the model: skipped
    ("A wheel rolled by , slowly , in the dark night .", [((2,), (0, 1)), ((2, 3), (9, 10))]),
]


def _frame_sentences():
    out = []
    for k, (text, links) in enumerate(SENTENCES):
        words = text.split()
        frame_links = [FrameLink("F", "x.v", f"E{j}", "Core", (), (), t, e) for j, (t, e) in enumerate(links)]
        out.append(FrameSentence(str(k), "d", text, words, [(0, 0)] * len(words), frame_links))
    return out


def _in_sentence_shifts(words_of_link, n_words):
    return [d for d in range(-n_words, n_words) if d and all(0 <= w + d < n_words for w in words_of_link)]


@pytest.mark.parametrize("samples", [None, 3])
def test_framenet_link_scores_equal_a_per_sentence_loop(model, samples):
    enc, eager, tok = model
    sentences = _frame_sentences()
    got = head_link_scores(enc.model, enc.tokenizer, sentences, "cpu", baseline_samples=samples, seed=5,
                           max_tokens=48)  # a few sentences per batch: padding in every one
    # the baseline draws follow the order the maps come in: the engine's length batches
    read = [s for s in sentences if len(reference.text_pieces(tok, s.words)[0]) <= MAX_POSITIONS]
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, max_tokens=48, max_batch_size=64,
                       max_pairs=None)
    order = [read[k] for b in engine.batches(encode_words(enc.tokenizer, [s.words for s in read])) for k in b]
    rng = np.random.default_rng(5)
    L, H = enc.model.config.num_hidden_layers, enc.model.config.num_attention_heads
    sums = {k: np.zeros((L, H)) for k in ("t2f", "f2t", "score", "paired", "b_t2f", "b_f2t", "baseline")}
    n = n_paired = overlap = no_shift = 0
    for s in order:
        ids, wids, att = _maps(eager, tok, s.words)
        pieces = lambda words: [t for t, w in enumerate(wids) if w in set(words)]  # noqa: E731
        for link in s.links:
            if set(link.target) & set(link.element):
                overlap += 1
                continue
            t2f = _block_max(att, pieces(link.target), pieces(link.element), absolute=True)
            f2t = _block_max(att, pieces(link.element), pieces(link.target), absolute=True)
            sums["t2f"] += t2f
            sums["f2t"] += f2t
            sums["score"] += np.maximum(t2f, f2t)
            n += 1
            ds = _in_sentence_shifts(link.target + link.element, len(s.words))
            if not ds:
                no_shift += 1
                continue
            if samples is not None:
                ds = rng.choice(ds, size=samples, replace=True)
            shifted = [(_block_max(att, pieces([w + d for w in link.target]), pieces([w + d for w in link.element]),
                                   absolute=True),
                        _block_max(att, pieces([w + d for w in link.element]), pieces([w + d for w in link.target]),
                                   absolute=True)) for d in ds]
            sums["b_t2f"] += np.mean([a for a, _ in shifted], 0)
            sums["b_f2t"] += np.mean([b for _, b in shifted], 0)
            sums["baseline"] += np.mean([np.maximum(a, b) for a, b in shifted], 0)
            sums["paired"] += np.maximum(t2f, f2t)
            n_paired += 1
    assert got["skipped_long"] == len(sentences) - len(read) == 1 and got["n_sentences"] == len(read)
    assert (got["n_links"], got["n_baseline"], got["skipped_overlap"], got["no_baseline"]) == (n, n_paired, overlap,
                                                                                               no_shift)
    assert overlap == 1 and no_shift == 1
    for key, want in (("score", sums["score"] / n), ("target_to_fe", sums["t2f"] / n),
                      ("fe_to_target", sums["f2t"] / n), ("baseline", sums["baseline"] / n_paired),
                      ("baseline_target_to_fe", sums["b_t2f"] / n_paired),
                      ("baseline_fe_to_target", sums["b_f2t"] / n_paired),
                      ("difference", (sums["paired"] - sums["baseline"]) / n_paired)):
        assert got[key].shape == (L, H) and got[key].dtype == np.float64
        np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-6, err_msg=key)


# ----------------------------------------------------------------------------------------------- linguistic
CONLLU_ROWS = [  # (word, UPOS, head (1-based, 0 root), deprel) per sentence
    [("The", "DET", 2, "det"), ("dog", "NOUN", 5, "nsubj"), ("did", "AUX", 5, "aux"), ("not", "PART", 5, "advmod"),
     ("see", "VERB", 0, "root"), ("it", "PRON", 5, "obj"), (".", "PUNCT", 5, "punct")],
    [("Cats", "NOUN", 2, "nsubj"), ("sleep", "VERB", 0, "root"), ("!", "PUNCT", 2, "punct")],
    [("very", "ADV", 46, "advmod")] * 45 + [("long", "ADJ", 0, "root"), (".", "PUNCT", 46, "punct")],  # skipped
    [("She", "PRON", 2, "nsubj"), ("gave", "VERB", 0, "root"), ("the", "DET", 4, "det"), ("cat", "NOUN", 2, "obj"),
     ("its", "PRON", 6, "nmod:poss"), ("dinner", "NOUN", 2, "obl"), ("and", "CCONJ", 9, "cc"),
     ("never", "ADV", 9, "advmod"), ("slept", "VERB", 2, "conj"), (".", "PUNCT", 2, "punct")],
    [("Yes", "INTJ", 0, "root"), (".", "PUNCT", 1, "punct")],
    [("A", "DET", 2, "det"), ("wheel", "NOUN", 3, "nsubj"), ("rolled", "VERB", 0, "root"), ("by", "ADV", 3, "advmod"),
     ("in", "ADP", 7, "case"), ("the", "DET", 7, "det"), ("night", "NOUN", 3, "obl"), (".", "PUNCT", 3, "punct")],
]
FEATURES = {"[CLS]": [{"special": "cls"}], "[SEP]": [{"special": "sep"}], "nouns": [{"upos": ["NOUN", "PROPN"]}],
            "verbs": [{"upos": ["VERB"]}], "negation": [{"words": ["not", "never"]}]}
RELATIONS = {"subject->verb": {"source": [{"deprel": ["nsubj"]}], "target": None, "link": "head"},
             "verb->subject": {"source": [{"deprel": ["nsubj"]}], "target": None, "link": "head", "reverse": True},
             "noun->pronoun": {"source": [{"upos": ["NOUN"]}], "target": [{"upos": ["PRON"]}], "link": "any"}}


def _conllu() -> str:
    out = []
    for k, rows in enumerate(CONLLU_ROWS):
        out.append(f"# sent_id = s{k}")
        out += [f"{i + 1}\t{w}\t_\t{u}\t_\t_\t{h}\t{d}\t_\t_" for i, (w, u, h, d) in enumerate(rows)]
        out.append("")
    return "\n".join(out) + "\n"


def _kind_groups(rows, ids, wids, tok):
    """kind -> piece groups of one sentence, by hand: [CLS] / [SEP] each of their pieces, a word kind each
    qualifying word's pieces."""
    pieces = lambda w: [t for t, x in enumerate(wids) if x == w]  # noqa: E731
    out = {"[CLS]": [[t] for t, i in enumerate(ids) if tok.cls_token_id is not None and i == tok.cls_token_id],
           "[SEP]": [[t] for t, i in enumerate(ids) if tok.sep_token_id is not None and i == tok.sep_token_id]}
    out["nouns"] = [pieces(w) for w, r in enumerate(rows) if r[1] in ("NOUN", "PROPN")]
    out["verbs"] = [pieces(w) for w, r in enumerate(rows) if r[1] == "VERB"]
    out["negation"] = [pieces(w) for w, r in enumerate(rows) if r[0].lower() in ("not", "never")]
    return out


def _relation_pairs(rows, wids):
    pieces = lambda w: [t for t, x in enumerate(wids) if x == w]  # noqa: E731
    subj = [(w, r[2] - 1) for w, r in enumerate(rows) if r[3] == "nsubj" and r[2] > 0]
    nouns = [w for w, r in enumerate(rows) if r[1] == "NOUN"]
    prons = [w for w, r in enumerate(rows) if r[1] == "PRON"]
    return {"subject->verb": [(pieces(a), pieces(b)) for a, b in subj],
            "verb->subject": [(pieces(b), pieces(a)) for a, b in subj],
            "noun->pronoun": [(pieces(a), pieces(b)) for a in nouns for b in prons if a != b]}


class _Context:
    """What compute reads of an analysis context: the encoder, the device and the treebank's sentences."""

    def __init__(self, enc, sentences):
        self.encoder, self.device, self._sentences = enc, "cpu", sentences

    def sentences(self, split, max_examples):
        return self._sentences


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_linguistic_scores_equal_a_per_sentence_loop(model, pooling, tmp_path):
    enc, eager, tok = model
    path = tmp_path / "dev.conllu"
    path.write_text(_conllu())
    sentences = read_conllu(path)
    rules = KindRules.from_config(feature_set="x", feature_sets=None, features=FEATURES, piece_pooling=pooling,
                                  missing="zero", missing_by_feature={"negation": "skip"}, relations=RELATIONS,
                                  relation_missing="zero")
    selection = ExampleSelection(source="treebank", split="dev", tasks=["mrpc"], max_examples=None, min_length=0,
                                 max_length=None, spacy_model="", treebank_name="t")
    # batches of at most 48 pieces: a few sentences each, padding in every batch
    run = compute(_Context(enc, sentences), selection, rules, max_tokens=48).runs[0]

    L, H = enc.model.config.num_hidden_layers, enc.model.config.num_attention_heads
    want = {f: {} for f in FEATURES}
    want_cls = {f: {} for f in FEATURES}
    want_rel = {r: {} for r in RELATIONS}
    k = 0
    for rows in CONLLU_ROWS:
        words = [r[0] for r in rows]
        if len(reference.text_pieces(tok, words)[0]) > MAX_POSITIONS:
            continue
        ids, wids, att = _maps(eager, tok, words)
        T = len(ids)
        received = np.zeros((L, H, T))
        for j in range(T):
            for i in range(T):
                received[:, :, j] += att[:, :, i, j]
        received /= T
        for f, groups in _kind_groups(rows, ids, wids, tok).items():
            if not groups:
                continue
            pool = (lambda v, g: sum(v[:, :, j] for j in g)) if pooling == "sum" else \
                (lambda v, g: np.max([v[:, :, j] for j in g], 0))
            want[f][k] = np.max([pool(received, g) for g in groups], 0)
            want_cls[f][k] = np.max([pool(att[:, :, 0, :], g) for g in groups], 0)
        for r, pairs in _relation_pairs(rows, wids).items():
            if pairs:
                want_rel[r][k] = np.max([_block_max(att, a, b) for a, b in pairs], 0)
        k += 1
    assert run.n_skipped == len(CONLLU_ROWS) - k == 1 and run.kinds.n_examples == k
    for f in FEATURES:
        absent_counts = rules.missing[f] == "zero"
        pe = run.kinds.per_example(f)
        idx = list(range(k)) if absent_counts else sorted(want[f])
        if not idx:
            assert pe is None, f
            continue
        scores, index = pe
        assert sorted(index.tolist()) == idx, f
        for s, i in zip(scores, index):
            np.testing.assert_allclose(s, want[f].get(i, np.zeros((L, H))), rtol=1e-5, atol=1e-6, err_msg=f)
        cls = run.kinds.cls_per_example(f)  # only the examples that have the kind, in the order they came
        have = [i for i in index if i in want[f]]
        assert (cls is None and not have) or len(cls) == len(have), f
        for s, i in zip(cls if have else [], have):
            np.testing.assert_allclose(s, want_cls[f][i], rtol=1e-5, atol=1e-6, err_msg=f)
    assert run.kinds.count["negation"] == 2 and run.kinds.count["nouns"] == k
    for r in RELATIONS:
        scores, index = run.relations.per_example(r)
        assert sorted(index.tolist()) == list(range(k))
        for s, i in zip(scores, index):
            np.testing.assert_allclose(s, want_rel[r].get(i, np.zeros((L, H))), rtol=1e-5, atol=1e-6, err_msg=r)
        assert run.n_with_pair()[r] == len(want_rel[r]) > 0

