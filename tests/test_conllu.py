"""CoNLL-U reader/writer."""

from pathlib import Path

import pytest

from probes.data.conllu import ConlluError, read_conllu, write_conllu_with_heads
from tests.conftest import require_shared

SAMPLE = """\
# newdoc id = doc1
# sent_id = s1
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\tSpaceAfter=No
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

# sent_id = s2
# text = Sue likes tea and Bob coffee
1\tSue\tSue\tPROPN\tNNP\t_\t2\tnsubj\t_\t_
2\tlikes\tlike\tVERB\tVBZ\t_\t0\troot\t_\t_
3\ttea\ttea\tNOUN\tNN\t_\t2\tobj\t_\t_
4\tand\tand\tCCONJ\tCC\t_\t5\tcc\t_\t_
5\tBob\tBob\tPROPN\tNNP\t_\t2\tconj\t_\t_
5.1\tlikes\tlike\tVERB\tVBZ\t_\t_\t_\t2:conj\t_
6\tcoffee\tcoffee\tNOUN\tNN\t_\t5\torphan\t_\t_

"""


def _write(tmp_path: Path, text: str, name: str = "x.conllu") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_parse_sample(tmp_path):
    s1, s2 = read_conllu(_write(tmp_path, SAMPLE))
    assert s1.sent_id == "s1" and s1.text == "I don't know." and s1.doc_id == "doc1" and s1.line_no == 1
    assert s1.words == ("I", "do", "n't", "know", ".")
    assert s1.upos == ("PRON", "AUX", "PART", "VERB", "PUNCT")
    assert s1.heads == (4, 4, 4, 0, 4)
    assert s1.deprels == ("nsubj", "aux", "advmod", "root", "punct")
    assert s1.misc == ("_", "_", "_", "SpaceAfter=No", "_")
    assert s1.n == 5 and len(s1.lines) == 9
    assert s2.words == ("Sue", "likes", "tea", "and", "Bob", "coffee")
    assert s2.heads == (2, 0, 2, 5, 2, 5)
    assert s2.deprels == ("nsubj", "root", "obj", "cc", "conj", "orphan")
    assert s2.upos == ("PROPN", "VERB", "NOUN", "CCONJ", "PROPN", "NOUN")
    assert s2.doc_id == "doc1" and s2.line_no == 11 and len(s2.lines) == 9


def test_no_trailing_blank_line(tmp_path):
    sents = read_conllu(_write(tmp_path, SAMPLE.rstrip("\n")))
    assert [s.n for s in sents] == [5, 6]


def _corrupt(lineno: int, new: str) -> str:
    lines = SAMPLE.split("\n")
    lines[lineno - 1] = new
    return "\n".join(lines)


@pytest.mark.parametrize("lineno,new,what", [
    (4, "1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_", "columns"),  # 9 columns
    (7, "3\tn't\tnot\tPART\tRB\t_\tfour\tadvmod\t_\t_", "HEAD"),  # non-integer head
    (8, "4\tknow\tknow\tVERB\tVB\t_\t9\troot\t_\t_", "out of range"),  # head > n
    (13, "4\tSue\tSue\tPROPN\tNNP\t_\t2\tnsubj\t_\t_", "consecutive"),  # first id 4, not 1
    (17, "6\tBob\tBob\tPROPN\tNNP\t_\t2\tconj\t_\t_", "consecutive"),  # 4 then 6
    (5, "2-1\tdon't\t_\t_\t_\t_\t_\t_\t_\t_", "range"),
])
def test_malformed(tmp_path, lineno, new, what):
    p = _write(tmp_path, _corrupt(lineno, new), "bad.conllu")
    with pytest.raises(ConlluError) as ei:
        read_conllu(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:{lineno}: "), msg
    assert "bad.conllu" in msg and what in msg


def test_block_without_words(tmp_path):
    p = _write(tmp_path, SAMPLE + "# sent_id = s3\n# text = nothing\n\n")
    with pytest.raises(ConlluError, match=r"x\.conllu:21: .*no word"):
        read_conllu(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.conllu"):
        read_conllu(tmp_path / "nope.conllu")


def test_write_with_heads_round_trip(tmp_path):
    sents = read_conllu(_write(tmp_path, SAMPLE))
    pred = [[2, 0, 2, 2, 2], (0, 1, 1, 1, 1, 1)]
    out = write_conllu_with_heads(sents, pred, tmp_path / "out" / "pred.conllu")
    assert [p.name for p in out.parent.iterdir()] == ["pred.conllu"]  # no temp file left
    back = read_conllu(out)
    assert [list(s.heads) for s in back] == [list(h) for h in pred]
    for a, b in zip(sents, back):
        assert (a.words, a.upos, a.deprels, a.misc, a.sent_id, a.text, a.doc_id) == \
               (b.words, b.upos, b.deprels, b.misc, b.sent_id, b.text, b.doc_id)
        assert len(a.lines) == len(b.lines)
        for la, lb in zip(a.lines, b.lines):
            ca, cb = la.split("\t"), lb.split("\t")
            if ca[0].isdigit():
                assert ca[:6] + ca[7:] == cb[:6] + cb[7:]
            else:  # comments, multiword ranges, empty nodes: verbatim
                assert la == lb
    text = out.read_text(encoding="utf-8")
    assert "2-3\tdon't\t_" in text and "5.1\tlikes\tlike\tVERB\tVBZ\t_\t_\t_\t2:conj\t_" in text
    assert text.endswith("\n\n") and text.count("\n\n") == 2


def test_write_wrong_length(tmp_path):
    sents = read_conllu(_write(tmp_path, SAMPLE))
    with pytest.raises(ValueError, match="s2"):
        write_conllu_with_heads(sents, [[4, 4, 4, 0, 4], [0, 1]], tmp_path / "p.conllu")
    assert not (tmp_path / "p.conllu").exists()


def _data_dir() -> Path:
    return require_shared("ud_english_ewt").parent


@pytest.mark.slow
@pytest.mark.parametrize("rel,n_sents,n_words", [
    ("ud_english_ewt/en_ewt-ud-dev.conllu", 2001, 25147),
    ("ud_english_gum/en_gum-ud-dev.conllu", 1575, 28119),
])
def test_real_dev_counts(rel, n_sents, n_words):
    sents = read_conllu(_data_dir() / rel)
    assert len(sents) == n_sents
    assert sum(s.n for s in sents) == n_words
    assert all(s.sent_id and s.doc_id for s in sents)
