"""A killed parent takes its extraction child with it, and no temporary folder outlives either: a real
``kill -9`` of a parent process (a subprocess of the test) while its child extracts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from probes.extract import runner
from tests.conftest import ROOT, write_chain_splits

PARENT = textwrap.dedent("""
    import sys
    from hydra.utils import instantiate
    from probes.extract.attention_caches import ensure_caches
    from tests.conftest import chain_overrides, compose_train
    data, tmp = sys.argv[1], sys.argv[2]
    from pathlib import Path
    cfg = compose_train(chain_overrides(Path(data), Path(tmp)) + ["+extract.trainer.enable_progress_bar=false"])
    ensure_caches(cfg.encoder, instantiate(cfg.data.treebank), ["train"], cfg.extract, cfg.paths.cache_dir, child=True)
    print("done")
""")


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _gone(pid: int, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # a zombie has ended (its parent, here the test's init, reaps it)
            return True
        time.sleep(0.2)
    return False


def _empty(folder: Path, timeout: float) -> bool:
    end = time.time() + timeout
    while list(folder.iterdir()):
        if time.time() > end:
            return False
        time.sleep(0.2)
    return True


def test_kill_9_of_the_parent_ends_the_child_and_removes_the_temporary_folder(tmp_path):
    data = write_chain_splits(tmp_path, sizes=(30000, 5, 5))
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir), WANDB_MODE="offline")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(data), str(tmp_path)], cwd=ROOT, env=env,
                              start_new_session=True)
    try:
        partial = tmp_path / "cache" / "attention"
        end, child = time.time() + 240, None
        while time.time() < end and parent.poll() is None:  # until the child is extracting (its .partial entry)
            kids = _children(parent.pid)
            if kids and list(partial.glob("*.partial")):
                child = kids[0]
                break
            time.sleep(0.2)
        assert child is not None, f"no extraction child seen (parent exit code {parent.poll()})"
        assert [p.name.startswith(f"{runner.TMP_PREFIX}{parent.pid}-") for p in tmpdir.iterdir()] == [True]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(child, 120), "the extraction child outlived its parent"
        # the child removes its request folder itself, without a next start (polled: a loaded machine is slow)
        assert _empty(tmpdir, 120), f"the child left its temporary folder: {list(tmpdir.iterdir())}"
        # and the next extraction's start, which removes folders of dead parents, finds nothing left to remove
        assert runner.clean_stale(tmpdir) == []
        assert list(tmpdir.iterdir()) == [], "a temporary folder outlived the parent and the child"
        assert not list(partial.glob("*/manifest.json")), "the killed extraction left an entry that reads as complete"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_folders_of_dead_parents_are_removed_at_the_next_spawn(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{runner.TMP_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{runner.TMP_PREFIX}{os.getpid()}-def"  # this process's own: kept
    for d in (stale, live):
        d.mkdir()
        (d / "request.pkl").write_bytes(b"x")
    assert runner.clean_stale(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def test_the_child_knows_how_it_will_die():
    how = subprocess.run([sys.executable, "-c", "import os; from probes.extract.runner import die_with_parent; "
                          "print(die_with_parent(os.getppid(), lambda: None))"], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert how.stdout.strip() == ("prctl" if sys.platform.startswith("linux") else "watchdog"), how.stderr


DYING_PARENT = textwrap.dedent("""
    import ctypes, os, subprocess, sys, threading, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]], stdout=subprocess.PIPE)
    child.stdout.readline()  # armed
    print(child.pid, flush=True)
    threading.Thread(target=time.sleep, args=(5,)).start()
    ctypes.CDLL(None).pthread_exit(None)  # the starting thread ends; the process lives on in the other thread
""")
ARMED_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from probes.extract.runner import die_with_parent
    die_with_parent(int(sys.argv[1]), lambda: Path(sys.argv[2]).write_text("removed"))
    print("armed", flush=True)
    while True:
        time.sleep(0.01)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and pthread_exit: Linux")
def test_the_death_signal_of_a_parent_that_still_looks_alive_runs_the_cleanup(tmp_path):
    """The kernel sends the death signal when the parent's starting thread ends, which under kill -9 can come
    before its other threads end: getppid() then still names the parent (one of its threads adopted the child).
    Made deterministic here by ending the parent's main thread alone; the child must still clean up."""
    mark = tmp_path / "on_death"
    parent = subprocess.Popen([sys.executable, "-c", DYING_PARENT, ARMED_CHILD, str(mark)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        child = int(parent.stdout.readline())
        assert _gone(child, 120), "the child outlived its parent's starting thread"
        assert mark.exists() and mark.read_text() == "removed", "the child exited without its cleanup"
    finally:
        parent.kill()
        parent.wait()
