"""Sweeps through train.py: Optuna TPE (hparams_search=probe_optuna) in a SQLite study that survives a kill and
goes on with two parallel trials under the joblib launcher; a two-job multirun under submitit_local; each
summarised in its sweep folder."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT, chain_overrides, write_chain_splits

ENV = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Chain treebank and one cache folder shared by this module's sweeps (the first sweep builds it)."""
    tmp = tmp_path_factory.mktemp("sweeps")
    write_chain_splits(tmp, (60, 20, 20))
    return tmp


def _overrides(chain, tmp):
    return [o for o in chain_overrides(chain / "data", chain) if not o.startswith("paths.output_dir")] + \
        ["data.extract_in_child=false", f"paths.log_dir={tmp / 'logs'}", "trainer.max_epochs=1"]


def _summary_rows(sweep):
    md = (sweep / "summary.md").read_text().splitlines()
    head = [c.strip() for c in md[0].strip("| ").split(" | ")]
    return [dict(zip(head, (c.strip() for c in line.strip("| ").split(" | ")))) for line in md[2:]]


def test_optuna_search_resumes_after_a_kill_with_parallel_trials(chain, tmp_path):
    import optuna

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hparams_search=probe_optuna", "probe=attn_only", "data.batch_size=16",
           f"hydra.sweep.dir={sweep}", "hydra.sweeper.sampler.n_startup_trials=2", *_overrides(chain, tmp_path)]
    # first start: 3 trials asked, killed while the second runs
    p = subprocess.Popen(cmd + ["hydra.sweeper.n_trials=3"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while not list(sweep.glob("*/1/.hydra")):  # trial 0 is finished and told once trial 1's folder exists
        assert p.poll() is None and time.monotonic() - t0 < 300, "the sweep stopped before its second trial"
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    storage, name = f"sqlite:///{sweep / 'optuna.db'}", "train-probe_optuna"
    first = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.state.name for t in first] == ["COMPLETE", "RUNNING"]  # the killed trial never reported
    assert not (sweep / "optimization_results.yaml").exists()
    # rerun on the same folder: the same study goes on with two more trials, run at once by two joblib workers
    r = subprocess.run(cmd + ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", "hydra/launcher=joblib",
                              "hydra.launcher.n_jobs=2"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.number for t in trials] == [0, 1, 2, 3] and trials[0].params == first[0].params
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(done) == 3 and {"probe.optimizer.lr", "probe.optimizer.weight_decay"} <= set(done[0].params)
    assert all(3e-4 <= t.params["probe.optimizer.lr"] <= 0.1 for t in done)
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == max(t.value for t in done)
    assert dict(best.best_params) == max(done, key=lambda t: t.value).params
    for t in done:  # each trial's objective is the val/uas_best its run wrote
        runs = [json.loads(m.read_text()) for m in sweep.glob("*/*/metrics.json")]
        assert any(abs(m["val/uas_best"] - t.value) < 1e-9 for m in runs)
    rows = _summary_rows(sweep)  # one row per trial of both starts; the killed one marked failed
    assert [r["status"] for r in rows] == ["ok", "failed: no metrics.json", "ok", "ok"]
    assert rows[2]["val/uas_best"] != "-" and rows[3]["val/uas_best"] != "-"  # both parallel trials summarised


@pytest.mark.parametrize("launcher", ["submitit_local", "joblib"])
def test_two_job_multirun_under_launcher(chain, tmp_path, launcher):
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "train.py", "-m", f"hydra/launcher={launcher}",
                        "experiment=table3_attn_only,table3_right_branching", f"hydra.sweep.dir={sweep}",
                        *_overrides(chain, tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["job"]: row for row in _summary_rows(sweep)}
    assert set(rows) == {"experiment=table3_attn_only", "experiment=table3_right_branching"}
    for name, row in rows.items():
        saved = json.loads(next(sweep.glob(f"*{name.split('table3_')[1]}*/metrics.json")).read_text())
        assert row["status"] == "ok" and row["test/uas"] == f"{100 * saved['test/uas']:.1f}"
    if launcher == "submitit_local":
        assert list((sweep / ".submitit").iterdir())  # submitit's own job folders
