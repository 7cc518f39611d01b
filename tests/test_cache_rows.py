"""Attention-cache entries of chosen rows (``probes.extract.rows``, ``AttentionMaps(rows=...)``): each kept row equals
the independent plain loop's (``tests.reference.plain_entry``: the tokenizer on the running text, a plain eager
forward, pooling by loops) and, bit for bit, the row of the whole-map entry of the same sentences; the own loop and
Lightning's write the same bytes; rows are keyed, checked before any work, and read only through ``rows``."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from probes.extract import runner
from probes.extract.cache import AttentionCache
from probes.extract.rows import normalized, rows_digest
from probes.extract.runner import WordLists
from probes.extract.settings import ExtractSettings
from probes.extract.stage import AttentionMaps, extract
from probes.model.load import load_encoder
from probes.model.tiny import tiny_folder
from tests import reference
from tests.conftest import compose_train
from tests.loops import MAX_LENGTH, MAX_TOKENS, SENTS, TRAINER, files


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_folder(family, root=root, num_layers=2) for family in ("bert", "roberta", "llama")}


def chosen_rows(seed: int = 0) -> list[list[int]]:
    """Per sentence of SENTS, rows drawn at random (unsorted, repeated), [CLS]'s and [SEP]'s among them; every
    fourth sentence none."""
    rng = np.random.default_rng(seed)
    out = []
    for i, s in enumerate(SENTS):
        n = len(s)
        out.append([] if i % 4 == 3 else [int(r) for r in rng.integers(0, n + 2, size=int(rng.integers(1, 4)))]
                   + ([0] if i % 5 == 0 else []) + ([n + 1] if i % 6 == 0 else []))
    return out


def key_for(name: str, rows=None) -> dict:
    return dict(encoder=name, dataset="synthetic", split="dev",
                **({} if rows is None else dict(rows=rows_digest(normalized(rows)))))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_kept_rows_equal_the_plain_loop_and_the_whole_entry(folders, tmp_path, family):
    enc = load_encoder(str(folders[family]))
    rows = chosen_rows()
    got = extract(enc, SENTS, key_for(enc.name, rows), tmp_path / "rows", TRAINER, max_length=MAX_LENGTH,
                  max_tokens=MAX_TOKENS, rows=rows)
    whole = extract(enc, SENTS, key_for(enc.name), tmp_path / "whole", TRAINER, max_length=MAX_LENGTH,
                    max_tokens=MAX_TOKENS)
    want = reference.plain_entry(folders[family], SENTS, MAX_LENGTH)
    assert got.skipped == whole.skipped == [i for i in range(len(SENTS)) if i not in want] and got.skipped
    manifest = json.loads((got.path / "manifest.json").read_text())
    assert manifest["rows"] == [sorted(set(r)) for r in rows]
    for i in want:
        kept = sorted(set(rows[i]))
        if not kept:
            assert got.rows(i, []).shape == (0, enc.num_layers, enc.num_heads, len(SENTS[i]) + 2)
            continue
        asked = rows[i][::-1] + rows[i][:1]  # any order, repeats: as read from the whole entry
        block = got.rows(i, asked)  # (R, L, H, W)
        np.testing.assert_array_equal(block, whole.rows(i, asked), err_msg=f"sentence {i}")
        np.testing.assert_array_equal(block, np.asarray(whole[i]).transpose(2, 0, 1, 3)[asked])
        # float16 storage: rounding 2^-11 relative, of values up to the pieces of a word
        np.testing.assert_allclose(block.astype(np.float32), want[i].transpose(2, 0, 1, 3)[asked], atol=2e-3, rtol=0)
        missing = next(r for r in range(len(SENTS[i]) + 2) if r not in kept) if len(kept) < len(SENTS[i]) + 2 else None
        if missing is not None:
            with pytest.raises(IndexError, match=f"keeps rows .* not row {missing}"):
                got.rows(i, [kept[0], missing])
    with pytest.raises(ValueError, match="keeps chosen rows"):
        got[next(iter(want))]
    assert got.manifest["bytes"] < whole.manifest["bytes"] / 2


def test_own_loop_and_lightnings_write_the_same_rows_entry(folders, tmp_path):
    enc = load_encoder(str(folders["llama"]))  # a decoder: its rows too
    rows = chosen_rows(1)
    trainer = functools.partial(TRAINER, precision="bf16-mixed")
    own = extract(enc, SENTS, key_for(enc.name, rows), tmp_path / "own", trainer, max_length=MAX_LENGTH,
                  max_tokens=MAX_TOKENS, rows=rows, loop="own")
    lightning = extract(enc, SENTS, key_for(enc.name, rows), tmp_path / "lightning", trainer, max_length=MAX_LENGTH,
                        max_tokens=MAX_TOKENS, rows=rows, loop="lightning")
    assert files(own) == files(lightning)  # maps, index and manifest (its checksums included)
    whole = extract(enc, SENTS, key_for(enc.name), tmp_path / "whole", trainer, max_length=MAX_LENGTH,
                    max_tokens=MAX_TOKENS)
    held = [i for i in range(len(SENTS)) if i in whole]
    assert held and held == [i for i in range(len(SENTS)) if i in own]
    for i in held:
        np.testing.assert_array_equal(own.rows(i, rows[i]), whole.rows(i, rows[i]), err_msg=f"sentence {i}")


def test_rows_are_checked_before_any_work_and_keyed(folders, tmp_path):
    enc = load_encoder(str(folders["bert"]))
    rows = chosen_rows()
    bad = [list(r) for r in rows]
    bad[7] = [1, len(SENTS[7]) + 2]
    with pytest.raises(ValueError, match=f"rows of sentence 7: row {len(SENTS[7]) + 2} is outside"):
        extract(enc, SENTS, key_for(enc.name, bad), tmp_path, TRAINER, max_length=MAX_LENGTH, rows=bad)
    with pytest.raises(ValueError, match="one per sentence"):
        extract(enc, SENTS, key_for(enc.name, rows[:-1]), tmp_path, TRAINER, max_length=MAX_LENGTH, rows=rows[:-1])
    with pytest.raises(ValueError, match="keyed by their digest"):  # a key that does not name these rows
        extract(enc, SENTS, key_for(enc.name), tmp_path, TRAINER, max_length=MAX_LENGTH, rows=rows)
    assert not any(tmp_path.iterdir())  # nothing written, not even a folder

    cfg = compose_train(["extract.precision=32-true", "extract.trainer.accelerator=cpu"])
    settings = ExtractSettings.from_config(cfg.extract).replace(max_length=MAX_LENGTH, long_sentences="error")
    source = WordLists([s for s in SENTS if len(s) < 5], dict(dataset="synthetic", split="dev", data_sha256="0"))
    n = len(source.sentences)
    a = [[1]] * n
    paths = {name: runner.entry_path(enc, kind, source, settings, tmp_path, "32-true")
             for name, kind in dict(whole=AttentionMaps(), a=AttentionMaps(a), a_again=AttentionMaps([[1, 1]] * n),
                                    b=AttentionMaps([[2]] * n)).items()}
    assert paths["a"] == paths["a_again"] and len({paths["whole"], paths["a"], paths["b"]}) == 3
    built = runner.build(enc, AttentionMaps(a), source, settings, tmp_path)
    assert built.path == paths["a"] and isinstance(built, AttentionCache) and built.kept_rows is not None
