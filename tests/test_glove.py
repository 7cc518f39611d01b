"""GloVe loaders and the cached rows of a vocabulary."""


import numpy as np
import pytest

from probes.data.glove import TextGlove, WordVectors, load_kumo, load_text, vector_rows
from tests.conftest import require_shared

TINY = """\
the 0.1 0.2 0.3
cat -1 2.5 1e-3
nan 0 0 0
. . . 7 8 9
"""


def test_load_text_tiny(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY, encoding="utf-8")
    wv = load_text(p, dim=3)
    assert wv.words.to_pylist() == ["the", "cat", "nan", ". . ."]
    assert wv.dim == 3 and wv.vectors.dtype == np.float32 and wv.vectors.shape == (4, 3)
    np.testing.assert_array_equal(wv.vectors[1], np.array([-1, 2.5, 1e-3], dtype=np.float32))
    np.testing.assert_array_equal(wv.vectors[3], [7, 8, 9])
    assert wv.index("the") == 0 and wv.index("The") == 0 and wv.index("dog") == -1
    idx = wv.lookup(["CAT", "dog", "nan", ". . ."])
    assert idx.dtype == np.int64 and idx.tolist() == [1, -1, 2, 3]
    cased = load_text(p, dim=3, lowercase=False)
    assert cased.index("The") == -1 and cased.index("the") == 0


@pytest.mark.parametrize("bad,what", [
    ("cat 1 2\n", "row has 2 values"),
    ("cat 1 2 3 4\n", "row has 4 values"),
    ("cat 1 x 3\n", "non-numeric value 'x'"),
])
def test_load_text_malformed(tmp_path, bad, what):
    p = tmp_path / "bad.txt"
    p.write_text("the 0.1 0.2 0.3\n" + bad + "a 1 1 1\n", encoding="utf-8")
    with pytest.raises(ValueError) as ei:
        load_text(p, dim=3)
    assert str(ei.value).startswith(f"{p}:2: ") and what in str(ei.value)


def test_load_text_dim_mismatch(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY, encoding="utf-8")
    with pytest.raises(ValueError, match=r"tiny\.txt:1: .*expected dim=5"):
        load_text(p, dim=5)
    with pytest.raises(ValueError, match=r"tiny\.txt:1: .*expected dim=2"):
        load_text(p, dim=2)


def test_wordvectors_shape_check():
    with pytest.raises(ValueError):
        WordVectors(words=["a"], vectors=np.zeros((2, 3), np.float32))


def test_kumo_dim_mismatch():
    with pytest.raises(ValueError, match="dim=100"):
        load_kumo(dim=100)


@pytest.mark.slow
def test_kumo_and_shared_text_agree():
    kumo = load_kumo()
    assert kumo.vectors.shape == (400000, 50) and kumo.vectors.dtype == np.float32
    assert kumo.index("the") == 0 and kumo.words[0].as_py() == "the"
    f = require_shared("glove/glove.6B.50d.ewt-gum-top50k.txt", "shared GloVe text")
    text = load_text(f, dim=50)
    assert len(text) == 54943 and text.vectors.shape == (54943, 50)
    np.testing.assert_allclose(text.vectors[text.index("the")], kumo.vectors[0], atol=1e-6)


def test_vector_rows_cached_by_vocab_and_file(tmp_path, monkeypatch):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY, encoding="utf-8")
    src = TextGlove(p, dim=3)
    vocab = ["Cat", "dog", "the"]
    ids, table = vector_rows(src, vocab, tmp_path / "cache")
    assert table.shape == (3, 3) and not table[0].any()  # zero row + 2 found words
    assert ids[1] == 0  # "dog" has no vector
    np.testing.assert_array_equal(table[ids[0]], np.array([-1, 2.5, 1e-3], np.float32))  # lowercased lookup
    np.testing.assert_array_equal(table[ids[2]], np.array([0.1, 0.2, 0.3], np.float32))
    assert len(list((tmp_path / "cache").glob("rows-*.npz"))) == 1

    def no_load():
        raise AssertionError("a cached vocabulary must not load the vectors")

    monkeypatch.setattr(src, "load", no_load)
    ids2, table2 = vector_rows(src, vocab, tmp_path / "cache")
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(table2, table)
    with pytest.raises(AssertionError, match="must not load"):  # another vocabulary is another entry
        vector_rows(src, vocab + ["cat"], tmp_path / "cache")
    p.write_text(TINY.replace("0.1", "0.5"), encoding="utf-8")  # a changed file is another entry
    with pytest.raises(AssertionError, match="must not load"):
        vector_rows(src, vocab, tmp_path / "cache")


def test_text_glove_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        vector_rows(TextGlove(tmp_path / "nope.txt", dim=3), ["a"], tmp_path)
