"""Run folders are unique even for two runs started in the same second (``${unique_now:}``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from probes.resolvers import unique_now
from tests.conftest import ROOT


def _run_dirs(config_name: str, overrides: list[str]) -> tuple[str, str]:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    return OmegaConf.select(cfg, "hydra.run.dir"), OmegaConf.select(cfg, "hydra.sweep.dir")


def test_two_composes_in_the_same_second_get_two_run_folders():
    a, b = _run_dirs("train", []), _run_dirs("train", [])
    assert a[0] != b[0] and a[1] != b[1]
    stamp = re.compile(r"/runs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}-%d$" % os.getpid())
    assert stamp.search(a[0]) and stamp.search(b[0])


def test_one_config_resolves_one_folder():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    first = cfg.hydra.run.dir
    time.sleep(0.01)  # a later resolution (the run reads its folder many times) gives the same folder: cached
    assert OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"] == first and first.endswith(f"-{os.getpid()}")


def test_two_processes_in_the_same_microsecond_differ_by_pid():
    code = "import probes.resolvers as r; print(r.unique_now('%Y'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout.strip() for _ in range(2)}
    assert len({o.rsplit("-", 1)[1] for o in outs}) == 2  # two processes: two pids
    assert unique_now("%Y").rsplit("-", 1)[1] == str(os.getpid())
