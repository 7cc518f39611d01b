"""Documents as input (issue 42): readers, the Python API's pooled maps and head statistics of a whole document,
the long_context analysis, and the refusal of a document longer than the model reads.

The reference is independent: the model's own tokenizer on the raw running text (:func:`tests.reference.text_pieces`),
a plain eager forward with ``output_attentions=True`` and statistics / pooling by explicit loops; nothing from
:mod:`probes.data.documents`, :mod:`probes.maps` or :mod:`probes.api`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import probes
from probes.data.documents import (Document, encode_document, read_conllu_documents, read_litbank_documents,
                                   read_text_document, running_text)
from probes.model.tiny import tiny_folder
from tests import reference
from tests.conftest import require_shared

DOCS = [("d1", [["The", "cat", "sat", "on", "the", "mat", "."], ["It", "was", "warm", ",", "and", "quiet", "."]]),
        ("d2", [["Dogs", "bark", "loudly", "at", "night", "."], ["Nobody", "sleeps", "."],
                ["The", "unbelievably", "quick", "fox", "jumped", "."]]),
        ("d3", [["Hello", "there", "!"], ["A", "wheel", "-", "chair", "rolled", "by", "."]])]


def conllu_text(docs) -> str:
    """A CoNLL-U file of the documents (# newdoc id), words only."""
    out = []
    for doc_id, sents in docs:
        out.append(f"# newdoc id = {doc_id}")
        for k, words in enumerate(sents):
            out.append(f"# sent_id = {doc_id}-{k + 1}")
            out += [f"{i + 1}\t{w}\t_\t_\t_\t_\t{i}\t{'root' if i == 0 else 'dep'}\t_\t_" for i, w in enumerate(words)]
            out.append("")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_folder("llama", root=tmp_path_factory.mktemp("tiny-docs"), max_positions=256)
    enc = probes.load_encoder(str(folder))
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return enc, eager, AutoTokenizer.from_pretrained(folder)


def eager_attention(model, ids) -> np.ndarray:
    """(L, H, T, T) float64 of a plain eager forward."""
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return torch.stack(att)[:, 0].double().numpy()


def sentence_groups(wids, sentences) -> list[list[int]]:
    """Pieces of every sentence: a word's pieces go to its sentence, specials before the words to the first and
    after them to the last."""
    sent_of_word = [k for k, s in enumerate(sentences) for _ in s]
    groups = [[] for _ in sentences]
    seen = False
    for t, w in enumerate(wids):
        if w is None:
            groups[-1 if seen else 0].append(t)
        else:
            seen = True
            groups[sent_of_word[w]].append(t)
    return groups


def loop_stats(att: np.ndarray, s: float = 1e-4) -> dict[str, np.ndarray]:
    """(L, H) first-token share, smoothed entropy and mean distance, and (L, H, K) distance histogram, by loops."""
    L, H, T, _ = att.shape
    edges = [0, 1] + [2 ** k for k in range(1, 17)]
    out = {k: np.zeros((L, H)) for k in ("cls", "entropy", "distance")}
    out["hist"] = np.zeros((L, H, len(edges)))
    for l in range(L):
        for h in range(H):
            a = att[l, h]
            out["cls"][l, h] = sum(a[i, 0] for i in range(T)) / T
            ent = dist = 0.0
            for i in range(T):
                for j in range(T):
                    p = (1 - s) * a[i, j] + s / T
                    ent -= p * math.log(p)
                    dist += a[i, j] * abs(i - j)
                    b = max(k for k, e in enumerate(edges) if abs(i - j) >= e)
                    out["hist"][l, h, b] += a[i, j] / T
            out["entropy"][l, h], out["distance"][l, h] = ent / T, dist / T
    return out


def test_readers(tmp_path):
    d = Document.from_sentences([["The", "cat", "."], "It  rains"], name="x")
    assert d.text == "The cat . It rains" and d.sentence_texts() == ["The cat .", "It rains"]
    assert Document.from_text("  one text. two  ").sentence_texts() == ["one text. two"]
    assert Document.from_text("A b. C d.", ["A b.", "C d."]).sentences == ((0, 4), (5, 9))
    with pytest.raises(ValueError, match="sentence 1"):
        Document.from_text("A b. C d.", ["A b.", "E f."])
    path = tmp_path / "t.conllu"
    path.write_text(conllu_text(DOCS))
    docs = read_conllu_documents(path)
    assert [x.name for x in docs] == ["d1", "d2", "d3"]
    assert docs[1].sentence_texts() == [" ".join(s) for s in DOCS[1][1]]
    txt = tmp_path / "t.txt"
    txt.write_text("First line here.\n\nSecond one.\n")
    assert read_text_document(txt).sentence_texts() == ["First line here.", "Second one."]
    assert read_text_document(txt, lines=False).n_sentences == 1


def test_litbank_documents():
    folder = require_shared("litbank_coref/conll", "LitBank")
    (doc,) = read_litbank_documents(folder, max_files=1)
    assert doc.n_sentences > 10 and doc.text.startswith(doc.sentence_texts()[0])


@pytest.mark.parametrize("budget", [1024, 0.01])  # whole maps; blocks of query rows
def test_document_maps_and_stats_match_eager_loops(tiny, budget):
    enc, eager, tok = tiny
    sentences = [w for _, sents in DOCS for w in sents]
    words = [w for s in sentences for w in s]
    ids, wids = reference.text_pieces(tok, words)
    att = eager_attention(eager, ids)  # (L, H, T, T)
    over = [f"extract.attention_budget_mb={budget}"]
    doc = Document.from_sentences(sentences)
    got = probes.document_maps(enc, doc, unit="sentence", device="cpu", overrides=over)
    want = reference.pool_by_loops(att, sentence_groups(wids, sentences))
    assert got.maps.shape == want.shape == (2, 4, len(sentences), len(sentences)) and got.n_pieces == len(ids)
    np.testing.assert_allclose(got.maps, want, atol=2e-5)
    words_maps = probes.document_maps(enc, doc, unit="word", layers=[1], device="cpu", overrides=over)
    want_w, labels = reference.eager_word_maps(eager, tok, words)
    assert words_maps.labels == labels
    np.testing.assert_allclose(words_maps.maps[0], want_w[1], atol=2e-5)
    spans = probes.document_maps(enc, doc, unit=5, device="cpu", overrides=over)
    T = len(ids)
    np.testing.assert_allclose(spans.maps, reference.pool_by_loops(att, [list(range(a, min(a + 5, T)))
                                                                         for a in range(0, T, 5)]), atol=2e-5)
    df = probes.document_stats(enc, doc, device="cpu", overrides=over)
    ref = loop_stats(att)
    for row in df.itertuples():
        for k in ("cls", "entropy", "distance"):
            assert getattr(row, k) == pytest.approx(ref[k][row.layer, row.head], rel=1e-4, abs=1e-6), (k, row)
        hist = [getattr(row, c) for c in df.columns if c.startswith("hist_")]
        np.testing.assert_allclose(hist, ref["hist"][row.layer, row.head], atol=1e-6)


def test_too_long_document_refused_before_forward(tiny):
    enc, _, _ = tiny
    calls = []
    hook = enc.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"document 'long one' has (\d+) pieces .* above the 256 "):
            probes.document_stats(enc, Document.from_text("the cat sat " * 200, name="long one"), device="cpu")
    finally:
        hook.remove()
    assert not calls


def reference_running_text(tok, path: Path, length: int) -> list[list[str]]:
    """The sentences (word lists) of the CoNLL-U file's documents, in order, while the joined text stays within
    ``length`` pieces of the tokenizer (its specials included)."""
    sents = []
    for block in path.read_text().split("\n\n"):
        words = [line.split("\t")[1] for line in block.splitlines() if line and not line.startswith("#")]
        if words:
            sents.append(words)
    kept = []
    for s in sents:
        if len(tok(" ".join(w for x in kept + [s] for w in x))["input_ids"]) > length:
            break
        kept.append(s)
    return kept


def test_long_context_analysis_matches_eager_loops(tiny, tmp_path):
    enc, eager, tok = tiny
    path = tmp_path / "docs.conllu"
    path.write_text(conllu_text(DOCS * 4))
    res = probes.analyze("long_context", encoder=enc, output_dir=tmp_path / "out", figures=True,
                         overrides=[f"documents.gum.path={path}", "extract.attention_budget_mb=0.01",
                                    "analysis_device=cpu"], lengths=[40, 120, 1000])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["skipped"] == {"1000": "above llama's usable length of 256 pieces".replace(
        "llama", enc.name)} and summary["lengths_run"] == [40, 120]
    rows = list(csv.DictReader(open(tmp_path / "out" / "long_context.csv")))
    by_layer = list(csv.DictReader(open(tmp_path / "out" / "long_context_by_layer.csv")))
    hist = list(csv.DictReader(open(tmp_path / "out" / "distance_hist.csv")))
    assert (tmp_path / "out" / "long_context.png").is_file()
    for length in (40, 120):
        sents = reference_running_text(tok, path, length)
        ids, _ = reference.text_pieces(tok, [w for s in sents for w in s])
        ref = loop_stats(eager_attention(eager, ids))
        mine = [r for r in rows if int(r["length"]) == length]
        assert len(mine) == 8 and all(int(r["n_pieces"]) == len(ids) for r in mine)
        assert summary["texts"][str(length)]["n_sentences"] == len(sents)
        for r in mine:
            for k in ("cls", "entropy", "distance"):
                assert float(r[k]) == pytest.approx(ref[k][int(r["layer"]), int(r["head"])], rel=1e-4, abs=1e-6)
        for r in (r for r in by_layer if int(r["length"]) == length):
            for k in ("cls", "entropy", "distance"):
                assert float(r[k]) == pytest.approx(ref[k][int(r["layer"])].mean(), rel=1e-4, abs=1e-6)
        edges = [0, 1] + [2 ** k for k in range(1, 17)]
        for r in (r for r in hist if int(r["length"]) == length):
            b = edges.index(int(r["bin"]))
            assert float(r["share"]) == pytest.approx(ref["hist"][int(r["layer"]), :, b].mean(), abs=1e-6)


def test_running_text_cuts_at_sentence_ends(tiny, tmp_path):
    _, _, tok = tiny
    path = tmp_path / "docs.conllu"
    path.write_text(conllu_text(DOCS * 3))
    docs = read_conllu_documents(path)
    for length in (30, 77, 150):
        doc = running_text(tok, docs, length)
        want = reference_running_text(tok, path, length)
        assert doc.text == " ".join(" ".join(s) for s in want)
        assert doc.n_sentences == len(want) and encode_document(tok, doc).n_pieces <= length


def document_loops(tok, eager, path: Path) -> tuple[list[dict], list[str]]:
    """(the loop statistics of every document of a CoNLL-U file read whole as one sequence - the tokenizer on its
    running text, one eager forward -, their names), the reference of head_stats' and sink's ``documents``."""
    docs, names = [], []
    for line in path.read_text().splitlines():
        if line.startswith("# newdoc id = "):
            names.append(line.split("= ", 1)[1])
            docs.append([])
        elif line and not line.startswith("#"):
            docs[-1].append(line.split("\t")[1])
    out = []
    for words in docs:
        ids, _ = reference.text_pieces(tok, words)
        out.append(dict(loop_stats(eager_attention(eager, ids)), n=len(ids)))
    return out, names


@pytest.mark.parametrize("budget", [1024, 0.01])  # whole maps; blocks of query rows
def test_head_stats_and_sink_on_documents_match_eager_loops(tiny, tmp_path, budget):
    """``analysis.documents``: head_stats' first-token share and entropy, and sink's alpha, of whole documents (each
    one sequence) equal plain loops over an eager forward of each document's running text, averaged over the
    documents; a document above the model's length is skipped and counted."""
    enc, eager, tok = tiny
    long_doc = ("long", [["The", "cat", "sat", "on", "the", "mat", "."]] * 40)  # above the 256 pieces it reads
    path = tmp_path / "docs.conllu"
    path.write_text(conllu_text(DOCS + [long_doc]))
    short = tmp_path / "short.conllu"
    short.write_text(conllu_text(DOCS))
    ref, names = document_loops(tok, eager, short)
    overrides = [f"documents.gum.path={path}", f"extract.attention_budget_mb={budget}", "analysis_device=cpu"]
    res = probes.analyze("head_stats", encoder=enc, output_dir=tmp_path / "hs", figures=False, overrides=overrides,
                         documents="gum")
    s = res.summary
    assert (s["input"], s["n_input_documents"], s["n_documents"], s["n_skipped_documents"]) == ("documents", 4, 3, 1)
    assert list(s["skipped"]) == ["long"] and s["skipped"]["long"] > 256
    table = res.tables["head_stats"]
    first = s["first_token"]
    for stat, mine in (("cls", first), ("entropy", "entropy")):
        want = np.mean([r[stat] for r in ref], axis=0)  # (L, H) mean over documents
        got = table[table.stat == mine].pivot(index="layer", columns="head", values="value").to_numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert s["uniform_entropy"] == pytest.approx(np.mean([np.mean(np.log(np.arange(1, r["n"] + 1))) for r in ref]))

    res = probes.analyze("sink", encoder=enc, output_dir=tmp_path / "sink", figures=False, overrides=overrides,
                         documents="gum", threshold=0.2)
    s = res.summary
    assert (s["n_documents"], s["n_skipped_documents"], s["n_windows"]) == (3, 1, 3)
    alpha = np.stack([r["cls"] for r in ref])  # (N, L, H)
    assert s["sink_rate"] == pytest.approx(float((alpha > 0.2).mean()))
    sink = res.tables["sink"]
    np.testing.assert_allclose(sink.alpha.to_numpy(), alpha.mean(0).reshape(-1), rtol=1e-5, atol=1e-7)


def test_documents_key_errors_name_the_key(tiny, tmp_path):
    enc, _, _ = tiny
    for name in ("head_stats", "sink"):
        with pytest.raises(ValueError, match=r"analysis.documents='gun': expected one of \['ewt', 'gum', 'litbank'\]"):
            probes.analyze(name, encoder=enc, output_dir=tmp_path / name, figures=False, documents="gun",
                           overrides=["analysis_device=cpu"])
