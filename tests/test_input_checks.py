"""Bad input is an error naming the file and line (or the setting) before any extraction or training starts:
CoNLL-U trees (one root, no cycle, heads in range), bytes that are not UTF-8, an empty treebank split, a GLUE
file with a header and no rows. Every file here is written by the test."""

import re
from pathlib import Path

import pytest

from probes.data.conllu import ConlluError, read_conllu
from probes.data.glue import GlueFormatError, read_glue
from probes.train import train
from tests.conftest import chain_overrides, compose_train, write_chain_splits


def _sentence(heads: list[int], sent_id: str = "s1") -> str:
    """A CoNLL-U block whose word j (1-based) has HEAD ``heads[j - 1]`` (DEPREL ``root`` for HEAD 0)."""
    rows = [f"# sent_id = {sent_id}"]
    rows += [f"{j}\tw{j}\tw{j}\tX\t_\t_\t{h}\t{'root' if h == 0 else 'dep'}\t_\t_" for j, h in enumerate(heads, 1)]
    return "\n".join(rows) + "\n\n"


def test_two_roots_and_cycle_lines(tmp_path):
    p = tmp_path / "roots.conllu"
    p.write_text(_sentence([0, 1]) + _sentence([0, 1, 0], "s2"))  # s2: comment at line 5, words at 6, 7, 8
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(p))}:8: sentence has 2 roots .*sent_id s2"):
        read_conllu(p)
    p = tmp_path / "cycle.conllu"
    p.write_text(_sentence([0, 3, 4, 2], "c"))  # words 2 -> 3 -> 4 -> 2 at lines 3, 4, 5
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(p))}:3: cycle in the heads: words 2 -> 3 -> 4 -> 2"):
        read_conllu(p)
    p.write_text(_sentence([2, 3, 1], "c"))
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(p))}:2: sentence has no root"):
        read_conllu(p)
    assert len(read_conllu(p, trees=False)) == 1  # files of predicted heads are read without the tree check


def test_head_out_of_range_names_its_line(tmp_path):
    p = tmp_path / "range.conllu"
    p.write_text(_sentence([0, 1]) + _sentence([0, 1, 9], "s2"))  # s2's word 3 at line 8
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(p))}:8: HEAD 9 out of range 0\.\.3"):
        read_conllu(p)


def test_unannotated_sentences_are_not_trees(tmp_path):
    """Plain sentences (every DEPREL ``_``, every HEAD 0, as ``sentence_from_words`` writes them) still read."""
    p = tmp_path / "plain.conllu"
    p.write_text("".join(f"{j}\tw\t_\t_\t_\t_\t0\t_\t_\t_\n" for j in (1, 2, 3)) + "\n")
    assert read_conllu(p)[0].heads == (0, 0, 0)


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_non_utf8_byte_names_file_and_line(tmp_path, bom):
    p = tmp_path / "latin1.conllu"
    text = _sentence([0, 1]) + _sentence([0, 1], "s2")
    p.write_bytes(bom + text.replace("w2\tw2", "w2\tcaf\u00e9", 1).replace("s2", "s\u00e92").encode("latin-1"))
    # first bad byte: the second word of s1 (line 3)
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(p))}:3: byte b'\\xe9' at column 9 is not UTF-8"):
        read_conllu(p)


def _chain(tmp_path: Path, dev_text: str | None) -> tuple[list[str], Path]:
    data = write_chain_splits(tmp_path, sizes=(20, 5, 5))
    if dev_text is not None:
        (data / "chain" / "chain-dev.conllu").write_text(dev_text)
    return chain_overrides(data, tmp_path) + ["trainer.max_epochs=1"], tmp_path / "cache"


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("manifest.json")] if cache.exists() else []


def test_empty_dev_split_fails_before_extraction(tmp_path):
    overrides, cache = _chain(tmp_path, "\n\n")  # blank lines only
    dev = tmp_path / "data" / "chain" / "chain-dev.conllu"
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(dev))}: no sentences.*data\.treebank\.files\.dev"):
        train(compose_train(overrides))
    assert _entries(cache) == []  # not even the train split's entry was built


def test_bad_tree_in_train_fails_before_extraction(tmp_path):
    overrides, cache = _chain(tmp_path, None)
    bad = tmp_path / "data" / "chain" / "chain-train.conllu"
    bad.write_text(bad.read_text() + _sentence([0, 3, 2], "loop"))
    with pytest.raises(ConlluError, match=rf"^{re.escape(str(bad))}:\d+: cycle in the heads.*sent_id loop"):
        train(compose_train(overrides))
    assert _entries(cache) == []


def test_chain_reads_and_caches_as_before(tmp_path):
    """The check does not stop good data: the same run with a valid dev file builds its three entries."""
    overrides, cache = _chain(tmp_path, None)
    train(compose_train(overrides))
    assert len(_entries(cache)) == 3


def _rte(tmp_path: Path, dev: str) -> Path:
    d = tmp_path / "glue" / "RTE"
    d.mkdir(parents=True)
    head = "index\tsentence1\tsentence2\tlabel\n"
    (d / "train.tsv").write_text(head + "0\tA cat.\tAn animal.\tentailment\n1\tA dog.\tA cat.\tnot_entailment\n")
    (d / "dev.tsv").write_text(dev)
    return d / "dev.tsv"


def test_glue_header_only_dev_is_an_error(tmp_path):
    dev = _rte(tmp_path, "index\tsentence1\tsentence2\tlabel\n")
    with pytest.raises(GlueFormatError, match=rf"^{re.escape(str(dev))}: no examples \(the file has only a header\)"):
        read_glue("rte", "dev", tmp_path)
    assert len(read_glue("rte", "train", tmp_path)) == 2


def test_glue_header_only_dev_fails_before_training(tmp_path):
    dev = _rte(tmp_path, "index\tsentence1\tsentence2\tlabel\n")
    out = tmp_path / "out"
    cfg = compose_train(["experiment=glue_rte", "encoder=tiny", "logger=none", f"paths.data_dir={tmp_path}",
                         f"paths.output_dir={out}", "trainer.max_epochs=1", "trainer.accelerator=cpu",
                         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"])
    with pytest.raises(GlueFormatError, match=rf"^{re.escape(str(dev))}: no examples"):
        train(cfg)
    assert not (out / "hf_model").exists() and not list(out.rglob("*.ckpt"))


def test_glue_bad_rows_and_bytes_name_file_and_line(tmp_path):
    dev = _rte(tmp_path, "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tA.\tB.\n")
    with pytest.raises(GlueFormatError, match=rf"^{re.escape(str(dev))}:3: expected 4 tab-separated columns, found 3"):
        read_glue("rte", "dev", tmp_path)
    dev.write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tperhaps\n")
    with pytest.raises(GlueFormatError, match=rf"^{re.escape(str(dev))}:2: RTE label 'perhaps'"):
        read_glue("rte", "dev", tmp_path)
    dev.write_bytes(b"index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tcaf\xe9.\tB.\tentailment\n")
    with pytest.raises(GlueFormatError, match=rf"^{re.escape(str(dev))}:3: byte b'\\xe9' is not UTF-8"):
        read_glue("rte", "dev", tmp_path)
