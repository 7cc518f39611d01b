"""Caches under concurrency: exactly one process builds an entry, the others wait and read it; a killed
builder is taken over; the entry equals one built alone, and so does a probe trained on it."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra.utils import instantiate

from probes.extract.attention_caches import ATTENTION, ensure_caches
from probes.extract.cache import build_lock
from probes.extract.runner import TreebankSplit, entry_path
from probes.extract.settings import ExtractSettings
from probes.train import train
from tests.conftest import ROOT, chain_overrides, compose_train, write_chain_splits

SPLITS = ("train", "dev", "test")


def _overrides(chain_data: Path, tmp: Path, cache: Path) -> list[str]:
    return [o for o in chain_overrides(chain_data, tmp) if not o.startswith(("paths.output_dir", "paths.cache_dir"))] \
        + [f"paths.cache_dir={cache}", f"paths.log_dir={tmp / 'logs'}"]


def _entries(cfg) -> dict[str, Path]:
    enc, tb = instantiate(cfg.encoder), instantiate(cfg.data.treebank)
    settings = ExtractSettings.from_config(cfg.extract)
    return {s: entry_path(enc, ATTENTION, TreebankSplit(tb, s), settings, cfg.paths.cache_dir, "32-true")
            for s in SPLITS}


def _extract_process(over: list[str], log: Path) -> subprocess.Popen:
    """`python -m probes.extract` (the three splits) with its output in ``log``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    return subprocess.Popen([sys.executable, "-m", "probes.extract", *over], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_for(text: str, log: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while text not in log.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode} before '{text}':\n{log.read_text()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"no '{text}' after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _same_entry(a: Path, b: Path) -> None:
    assert (a / "manifest.json").exists() and (b / "manifest.json").exists()
    files = sorted(p.name for p in a.iterdir() if p.name != "manifest.json")
    assert files == sorted(p.name for p in b.iterdir() if p.name != "manifest.json") and files
    for name in files:  # float16 maps and offsets index, byte for byte
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Caches built by one process alone (the reference) and the chain treebank they come from."""
    tmp = tmp_path_factory.mktemp("alone")
    write_chain_splits(tmp)
    cfg = compose_train(_overrides(tmp / "data", tmp, tmp / "cache"))
    ensure_caches(cfg.encoder, instantiate(cfg.data.treebank), list(SPLITS), cfg.extract, cfg.paths.cache_dir,
                  child=False)
    return tmp / "data", _entries(cfg)


def test_two_processes_build_one_entry(alone, tmp_path):
    """Both start while the entry is locked (so both are waiting at once); one builds, the other reads."""
    data, reference = alone
    over = _overrides(data, tmp_path, tmp_path / "cache")
    entries = _entries(compose_train(over))
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with build_lock(entries["train"]) as build_here:
        assert build_here
        procs = [_extract_process(over, log) for log in logs]
        for p, log in zip(procs, logs):
            _wait_for("waiting for another process building", log, p)
    assert [p.wait(timeout=600) for p in procs] == [0, 0], [log.read_text()[-3000:] for log in logs]
    text = "".join(log.read_text() for log in logs)
    assert text.count("attention cache built by another process") >= 1  # at least one split was read, not built
    assert text.count("extracting attention:") == len(SPLITS)  # every split built exactly once
    for s in SPLITS:
        _same_entry(entries[s], reference[s])
    assert not list((tmp_path / "cache" / "attention").glob("*.partial"))
    # a probe trained on the shared entries scores exactly what it scores on the entries built alone
    scores = []
    for cache in (tmp_path / "cache", reference["train"].parents[1]):
        cfg = compose_train(_overrides(data, tmp_path, cache) + [f"paths.output_dir={tmp_path / cache.name}",
                                                                  "trainer.max_epochs=1", "probe=attn_only"])
        m = train(cfg)
        scores.append((m["val/uas_best"], m["test/uas"], m["test/uas_nopunct"]))
    assert scores[0] == scores[1]


def test_killed_builder_is_taken_over(alone, tmp_path, caplog):
    """A builder dies holding the lock with a half-written entry: the waiting builder (here a thread of this
    process) gets the lock and builds the entry anew."""
    data, reference = alone
    cfg = compose_train(_overrides(data, tmp_path, tmp_path / "cache"))
    entry = _entries(cfg)["train"]
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pathlib import Path\nfrom probes.extract.cache import build_lock\n"
        f"entry = Path({str(entry)!r})\n"
        "with build_lock(entry):\n"
        "    part = entry.with_name(entry.name + '.partial'); part.mkdir(parents=True)\n"
        "    (part / 'maps-r0.f16').write_bytes(b'half-written')\n"
        "    print('held', flush=True); time.sleep(600)\n")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    result = {}

    def build():
        try:
            result["cache"] = ensure_caches(cfg.encoder, instantiate(cfg.data.treebank), ["train"], cfg.extract,
                                            cfg.paths.cache_dir, child=False)["train"]
        except BaseException as e:  # noqa: BLE001  (reported by the assertion below)
            result["error"] = e

    caplog.set_level(logging.INFO)
    try:
        assert holder.stdout.readline().strip() == "held"
        builder = threading.Thread(target=build)
        builder.start()
        t0 = time.monotonic()
        while "waiting for another process building" not in caplog.text:
            assert builder.is_alive() and time.monotonic() - t0 < 300, (result, caplog.text[-2000:])
            time.sleep(0.1)
        assert not (entry / "manifest.json").exists()
        os.kill(holder.pid, signal.SIGKILL)  # the builder dies: the kernel releases its lock
        holder.wait(timeout=60)
        builder.join(timeout=600)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert "error" not in result, result
    assert result["cache"].path == entry
    assert "removing incomplete cache from an interrupted run" in caplog.text
    _same_entry(entry, reference["train"])
    assert not entry.with_name(entry.name + ".partial").exists()
