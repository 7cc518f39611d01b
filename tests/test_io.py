"""Files written by the project get the permissions of the user's umask (not mkstemp's 0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from probes.extract import cache as C
from probes.io import atomic_write, atomic_write_text, umask


@pytest.fixture
def with_umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_(mask: int) -> None:
        os.umask(mask)

    yield set_
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_follow_the_umask(tmp_path, with_umask, mask, expected):
    with_umask(mask)
    assert umask() == mask
    atomic_write_text(tmp_path / "metrics.json", "{}")
    atomic_write(tmp_path / "a.npy", lambda tmp: np.save(open(tmp, "wb"), np.zeros(3)))
    assert mode(tmp_path / "metrics.json") == expected and mode(tmp_path / "a.npy") == expected
    assert (tmp_path / "metrics.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    def fail(tmp):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "x.txt", fail)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600)])
def test_cache_files_follow_the_umask(tmp_path, with_umask, mask, expected):
    with_umask(mask)
    part, final = tmp_path / "e.partial", tmp_path / "e"
    part.mkdir()
    w = C.ShardWriter(part, 0)
    w.write(0, np.zeros((1, 1, 3, 3), dtype=np.float16))
    w.close()
    C.finalize(part, final, dict(format_version=C.FORMAT_VERSION, key={}, n_sentences=1, skipped=[],
                                 num_layers=1, layers=[0], num_heads=1))
    assert {p.name: mode(p) for p in final.iterdir()} == {n: expected for n in ("maps-r0.f16", "index-r0.npy",
                                                                               "manifest.json")}
    assert C.AttentionCache(final)[0].shape == (1, 1, 3, 3)
