"""Caches that cannot lie: every file of an entry has its size and CRC-32 in the manifest, written while the
shards were written; a damaged entry (bytes overwritten in place, a truncated shard, a missing index) is an
error naming the entry, the file and the command that rebuilds it, or, where the runner ensures the entry,
is moved aside and rebuilt byte for byte; a manifest without checksums is damaged too."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate

from probes.extract import cache as C
from probes.extract import runner
from probes.extract.attention_caches import ATTENTION, ensure_caches
from probes.extract.representations import HiddenStates
from probes.extract.runner import TreebankSplit
from tests.conftest import chain_overrides, compose_train, write_chain_splits

REBUILD = "python -m probes.extract encoder=tiny data=ewt 'splits=[train]'"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A train attention entry of the chain treebank (tiny encoder, 32-true) large enough for a 64 KiB
    overwrite, and the config it was built with."""
    tmp = tmp_path_factory.mktemp("integrity")
    data = write_chain_splits(tmp, sizes=(400, 5, 5))
    cfg = compose_train(chain_overrides(data, tmp) + ["+extract.trainer.enable_progress_bar=false"])
    os.environ[C.COMMAND_ENV] = REBUILD  # as the runner sets it for its child: recorded in the manifest
    try:
        caches = ensure_caches(cfg.encoder, instantiate(cfg.data.treebank), ["train"], cfg.extract,
                               cfg.paths.cache_dir, child=False)
    finally:
        del os.environ[C.COMMAND_ENV]
    path = caches["train"].path
    return cfg, path, {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.fixture
def entry(built, tmp_path):
    """A fresh copy of the built entry (same folder layout) that a test may damage; nothing verified yet."""
    cfg, path, files = built
    dest = tmp_path / "cache" / "attention" / path.name
    dest.mkdir(parents=True)
    for name, data in files.items():
        (dest / name).write_bytes(data)
    return dest


def test_manifest_lists_every_file_with_the_checksum_of_its_bytes(built):
    _, path, files = built
    sums = json.loads(files["manifest.json"])["checksums"]
    assert set(sums) == {"maps-r0.f16", "index-r0.npy"} == set(files) - {"manifest.json"}  # no sidecar left
    for name, rec in sums.items():
        assert rec == dict(bytes=len(files[name]), crc32=f"{zlib.crc32(files[name]):08x}")
    assert len(files["maps-r0.f16"]) > 4 * 65536
    assert C.verify(path, force=True) is True


def test_a_single_flipped_byte_changes_the_checksum(entry, tmp_path):
    shard = entry / "maps-r0.f16"
    before = C.file_checksum(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    after = C.file_checksum(shard)
    assert after[0] == before[0] and after[1] != before[1]
    with pytest.raises(C.CacheDamaged, match="maps-r0.f16 has other bytes"):
        C.verify(entry)


def _overwrite(path: Path) -> None:
    """64 KiB in the middle of the shard replaced by other bytes of the same size (file size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(np.full(65536 // 2, np.nan, dtype=np.float16).tobytes())


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


@pytest.mark.parametrize("damage,file,problem", [
    (_overwrite, "maps-r0.f16", "has other bytes than were written"),
    (_truncate, "maps-r0.f16", "truncated"),
    (Path.unlink, "index-r0.npy", "is missing"),
], ids=["overwritten-64KiB", "truncated", "index-missing"])
def test_a_damaged_entry_is_an_error_naming_it_and_the_rebuild_command(entry, damage, file, problem):
    size = (entry / "maps-r0.f16").stat().st_size
    damage(entry / file)
    if damage is _overwrite:
        assert (entry / file).stat().st_size == size
    with pytest.raises(C.CacheDamaged) as e:
        C.AttentionCache(entry)
    msg = str(e.value)
    assert str(entry) in msg and file in msg and problem in msg
    assert f"rm -r {entry}\n  {REBUILD}" in msg
    assert e.value.entry == entry and e.value.file == file


@pytest.mark.parametrize("damage", [_overwrite, _truncate], ids=["overwritten-64KiB", "truncated"])
def test_the_runner_moves_a_damaged_entry_aside_and_rebuilds_it(built, damage, tmp_path, caplog):
    cfg, path, files = built
    cache_dir = Path(cfg.paths.cache_dir)
    damage(path / "maps-r0.f16")
    C._VERIFIED.clear()  # as in a new process
    caplog.set_level(logging.WARNING)
    (rebuilt,) = runner.ensure(cfg.encoder, ATTENTION, [TreebankSplit(instantiate(cfg.data.treebank), "train")],
                               cfg.extract, cache_dir, child=False)
    assert rebuilt.path == path
    aside = list(path.parent.glob(f"{path.name}.damaged-*"))
    assert len(aside) == 1 and "moved damaged cache entry" in caplog.text and str(aside[0]) in caplog.text
    for name in ("maps-r0.f16", "index-r0.npy"):  # the same bytes as the first build
        assert (path / name).read_bytes() == files[name], name
    assert json.loads((path / "manifest.json").read_text())["checksums"] == json.loads(files["manifest.json"])["checksums"]
    shutil.rmtree(aside[0])


def test_an_entry_without_checksums_is_damaged(entry):
    manifest = json.loads((entry / "manifest.json").read_text())
    del manifest["checksums"]
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(C.CacheDamaged, match="manifest.json lists no checksums") as e:
        C.AttentionCache(entry)
    assert e.value.entry == entry and e.value.file == "manifest.json"


def test_a_shard_truncated_after_opening_is_an_error_not_a_crash(entry):
    """A shard cut short after the entry was opened and verified: reading the sentence beyond the cut, whole or a
    few rows of it (a memory map would fault past the file's end), is CacheDamaged naming the sentence; the
    sentences before it still read."""
    cache = C.AttentionCache(entry)
    last = max(range(len(cache)), key=lambda i: cache._where[i, 1] if i in cache else -1)
    first = min((i for i in range(len(cache)) if i in cache), key=lambda i: cache._where[i, 1])
    whole = np.asarray(cache[first])  # (L, H, W, W)
    _truncate(entry / "maps-r0.f16")
    for read in (lambda: cache[last], lambda: cache.rows(last, [0, 1])):
        with pytest.raises(C.CacheDamaged, match=f"truncated at sentence {last}"):
            read()
    np.testing.assert_array_equal(cache.rows(first, [2, 0]), whole[:, :, [2, 0]].transpose(2, 0, 1, 3))


def test_hidden_state_entries_have_checksums_too(built, tmp_path):
    cfg, _, _ = built
    tb = instantiate(cfg.data.treebank)
    enc = instantiate(cfg.encoder)
    cache = runner.build(enc, HiddenStates(None, "mean"), TreebankSplit(tb, "dev"), cfg.extract, tmp_path / "c")
    sums = cache.manifest["checksums"]
    assert set(sums) == {"maps-r0.f16", "index-r0.npy"}
    assert sums["maps-r0.f16"]["crc32"] == C.file_checksum(cache.path / "maps-r0.f16")[1]
    _truncate(cache.path / "maps-r0.f16")
    C._VERIFIED.clear()
    with pytest.raises(C.CacheDamaged, match="maps-r0.f16 has .* bytes.*truncated"):
        HiddenStates(None, "mean").open(cache.path)


def test_build_command_reuses_the_training_overrides(monkeypatch):
    monkeypatch.delenv(C.COMMAND_ENV, raising=False)
    monkeypatch.setattr("sys.argv", ["/x/train.py", "experiment=smoke", "encoder=minilm", "-m"])
    assert C.build_command(dict(split="dev")) == "python -m probes.extract experiment=smoke encoder=minilm 'splits=[dev]'"
    monkeypatch.setattr("sys.argv", ["/x/probes/analyze.py", "analysis=coref_heads"])
    assert C.build_command({}) == "python -m probes.analyze analysis=coref_heads"
    monkeypatch.setenv(C.COMMAND_ENV, "python train.py a=b")
    assert C.build_command(dict(split="dev")) == "python train.py a=b"
