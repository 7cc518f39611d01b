"""head_stats accounts for every input sentence (read, unpaired, in a sequence too long), counted here
independently from the CoNLL-U text this test writes, on a tiny random decoder (probes/model/tiny.py); a decoder's
separator panels name the token they show in place of [SEP]."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.clark.head_stats import titles
from probes.analysis.context import AnalysisContext
from probes.model import tiny
from probes.model.load import load_encoder
from tests.conftest import ROOT

LONG = "the cat sat on the mat and the dog saw it .".split() * 20   # 240 words: past the tiny models' 128 positions
# (document, words) in file order; the test reads the first MAX_SENTENCES, which cuts the last document
DOCS = [("d1", "The dog barked .".split()), ("d1", "A cat sat .".split()), ("d1", "It rained .".split()),
        ("d2", "Hello there .".split()), ("d2", LONG),
        ("d3", "Good night .".split()),
        ("d4", "One more .".split()), ("d4", "Two more .".split()), ("d4", "Three more .".split()),
        ("d4", "Four more .".split())]
MAX_SENTENCES = 9


def conllu(docs) -> str:
    """CoNLL-U of (document, words) sentences: ``# newdoc id`` where the document changes; word 1 the root."""
    out, last = [], None
    for k, (doc, words) in enumerate(docs):
        if doc != last:
            out.append(f"# newdoc id = {doc}")
            last = doc
        out.append(f"# sent_id = s{k + 1}")
        out += [f"{i}\t{w}\t{w.lower()}\tX\t_\t_\t{0 if i == 1 else 1}\t{'root' if i == 1 else 'dep'}\t_\t_"
                for i, w in enumerate(words, 1)]
        out.append("")
    return "\n".join(out) + "\n"


def expected(docs, pairs: bool, too_long) -> dict:
    """The counts by plain loops: per document (consecutive sentences), pairs (1, 2), (3, 4), ... and an odd last
    sentence unpaired; a sequence is skipped when ``too_long(sentences)``."""
    seqs, unpaired = [], 0
    if pairs:
        by_doc: dict[str, list[list[str]]] = {}
        for doc, words in docs:
            by_doc.setdefault(doc, []).append(words)
        for sents in by_doc.values():
            seqs += [sents[i:i + 2] for i in range(0, len(sents) - 1, 2)]
            unpaired += len(sents) % 2
    else:
        seqs = [[words] for _, words in docs]
    skipped = [s for s in seqs if too_long(s)]
    return dict(n_input_sentences=len(docs), n_unpaired=unpaired, n_skipped=len(skipped),
                n_skipped_sentences=sum(map(len, skipped)), n_sequences=len(seqs) - len(skipped),
                n_sentences=sum(len(s) for s in seqs if not too_long(s)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny.tiny_folder("llama", root=tmp_path_factory.mktemp("models"))


def run(tmp_path, folder, *extra) -> dict:
    """summary.json of head_stats on the first MAX_SENTENCES of :data:`DOCS`, with the encoder's max_length."""
    (tmp_path / "data" / "ud_english_ewt").mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(conllu(DOCS))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            "analysis=head_stats", "encoder=auto", f"encoder.name_or_path={folder}",
            f"paths.data_dir={tmp_path / 'data'}", f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
            "data.treebank.download=false", "analysis_device=cpu", f"analysis.max_sentences={MAX_SENTENCES}", *extra])
    out = tmp_path / "out"
    ctx = AnalysisContext(cfg, out, use_wandb=False)
    instantiate(cfg.analysis)(ctx)
    return dict(json.loads((out / "summary.json").read_text()), max_length=ctx.encoder.max_length)


@pytest.fixture(scope="module")
def decoder_runs(tmp_path_factory, llama) -> dict[bool, dict]:
    """pairs -> the tiny decoder's summary."""
    return {pairs: run(tmp_path_factory.mktemp(f"pairs_{pairs}"), llama, f"analysis.pairs={str(pairs).lower()}")
            for pairs in (True, False)}


@pytest.mark.parametrize("pairs", [True, False])
def test_every_input_sentence_is_accounted_for_on_a_tiny_decoder(decoder_runs, llama, pairs):
    summary = decoder_runs[pairs]
    tok = load_encoder(str(llama)).tokenizer
    limit = summary["max_length"]
    pieces = lambda words: len(tok(" ".join(words))["input_ids"])  # noqa: E731  the words as running text
    assert pieces(LONG) > limit and all(pieces(w) < limit // 4 for _, w in DOCS if w is not LONG)
    want = expected(DOCS[:MAX_SENTENCES], pairs, lambda seq: any(w is LONG for w in seq))
    assert {k: summary[k] for k in want} == want
    assert want["n_unpaired"] == (3 if pairs else 0) and want["n_skipped_sentences"] == (2 if pairs else 1)
    assert summary["n_input_sentences"] == (summary["n_sentences"] + summary["n_unpaired"]
                                            + summary["n_skipped_sentences"])
    assert set(summary["sentences_left_out"]) == {"n_unpaired", "n_skipped_sentences"}
    assert str(limit) in summary["sentences_left_out"]["n_skipped_sentences"]


def test_decoder_separator_panels_name_their_token(decoder_runs, llama):
    """Pair input on a decoder: the separator is its EOS between the sentences (no [SEP]); the summary names it
    and the note says what the panels show; single input has no separator."""
    summary = decoder_runs[True]
    tok = load_encoder(str(llama)).tokenizer
    assert tok.sep_token is None and summary["separator_token"] == tok.eos_token
    note = summary["separator_note"]
    assert "[SEP]" in note and tok.eos_token in note and "BOS" in note  # llama's tokenizer adds a BOS
    t = titles(tok.eos_token)
    assert all("[SEP]" not in t[k] and tok.eos_token in t[k] for k in ("sep", "sep_sep", "rest_sep"))
    assert titles()["sep_sep"] == "[SEP] -> [SEP]"
    assert decoder_runs[False]["separator_token"] is None and decoder_runs[False]["separator_note"] is None


def test_encoder_pairs_keep_sep(tmp_path):
    """A tiny BERT on pair input: the same accounting; its separator is [SEP], no note."""
    summary = run(tmp_path, tiny.tiny_folder("bert", root=tmp_path / "models"), "analysis.pairs=true")
    assert summary["separator_token"] == "[SEP]" and summary["separator_note"] is None
    want = expected(DOCS[:MAX_SENTENCES], True, lambda seq: any(w is LONG for w in seq))
    assert {k: summary[k] for k in want} == want
