"""wandb dashboards: a two-job training multirun and an analysis, offline, read back from the .wandb files."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.data.sources import sha256_file
from probes.report.tracking import flatten
from probes.report.wandb_files import find_runs, read_run
from tests.conftest import ROOT, TINY_CONLLU, chain_overrides, compose_train


def _start(args, tmp_path, name):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true")
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log


def _wait(proc_log, tmp_path, name):
    proc, log = proc_log
    rc = proc.wait(timeout=600)
    log.close()
    assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": {},
                                                                               "f": None}


@pytest.mark.slow
def test_multirun_and_analysis_runs_read_back(chain_data, tmp_path):
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith(("paths.output_dir", "logger="))]
    # job 0: artifacts off (the default), job 1: checkpoints and predictions as artifacts
    train = _start(["train.py", "-m", "logger.wandb.artifacts=false,true", "trainer.max_epochs=1", "logger=wandb",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", *over], tmp_path, "train")
    (tmp_path / "tiny" / "ud_english_ewt").mkdir(parents=True)
    (tmp_path / "tiny" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    analysis = _start(["-m", "probes.analyze", "analysis=head_stats", "encoder=tiny",
                       f"paths.data_dir={tmp_path / 'tiny'}", f"paths.cache_dir={tmp_path / 'acache'}",
                       "data.treebank.download=false", "extract.precision=32-true",
                       f"hydra.run.dir={tmp_path / 'analysis'}"], tmp_path, "analysis")
    _wait(train, tmp_path, "train")
    _wait(analysis, tmp_path, "analysis")

    # training: one group (the sweep folder), job type "probe", names from the overrides, flat config
    files = find_runs(tmp_path / "sweep")
    assert len(files) == 2
    runs = [read_run(f) for f in files]
    assert {r.group for r in runs} == {"sweep"}
    assert {r.job_type for r in runs} == {"probe"}
    assert [r.name.split()[0].lower() for r in runs] == ["logger.wandb.artifacts=false", "logger.wandb.artifacts=true"]
    for r in runs:
        assert r.config["probe._target_"] == "probes.dependency.module.DependencyProbe"
        assert "probe.optimizer.lr" in r.config and "encoder._target_" in r.config and "probe" not in r.config
        # per-epoch and best metrics, and the test metrics equal metrics.json
        assert any("val/uas" in row and "epoch" in row for row in r.history)
        metrics = json.loads((r.path.parents[2] / "metrics.json").read_text())
        assert r.summary["test/uas"] == pytest.approx(metrics["test/uas"])
        assert r.summary["val/uas_best"] == pytest.approx(metrics["val/uas_best"])
        table = r.tables()["results"]
        assert table["columns"] == ["metric", "value"]
        assert dict(table["data"])["test/uas"] == pytest.approx(metrics["test/uas"])
        assert r.environment["git"]["commit"]
        prov = json.loads((r.path.parents[2] / "provenance.json").read_text())
        assert prov["command"].startswith("python train.py ") and "trainer.max_epochs=1" in prov["command"]
        assert prov["commit"].split("+")[0] == r.environment["git"]["commit"]

    kinds = [{a["type"]: a["files"] for a in r.artifacts} for r in runs]
    assert "model" not in kinds[0] and "predictions" not in kinds[0]
    assert kinds[1]["model"] == ["model.ckpt"] and kinds[1]["predictions"] == ["predictions/test.conllu"]
    assert compose_train([]).logger.wandb.artifacts is False  # off by default

    # analysis: job type = its name, its tidy tables as wandb Tables equal to its CSVs, figures as images
    (a,) = [read_run(f) for f in find_runs(tmp_path / "analysis")]
    assert a.job_type == "head_stats" and a.group == "analyze"
    assert a.name.startswith("analysis=head_stats encoder=tiny")
    assert a.config["analysis._target_"] == "probes.analysis.clark.head_stats.head_stats"
    tables = a.tables()
    csv = pd.read_csv(tmp_path / "analysis" / "head_stats.csv")
    assert tables["head_stats"]["columns"] == list(csv.columns)
    got = pd.DataFrame(tables["head_stats"]["data"], columns=tables["head_stats"]["columns"])
    pd.testing.assert_frame_equal(got, csv, check_dtype=False, atol=1e-6)
    assert a.images()["fig/head_stats_heatmaps"].stat().st_size > 1000
    assert a.summary["analysis"] == "head_stats"
    prov = json.loads((tmp_path / "analysis" / "provenance.json").read_text())
    assert prov["command"].startswith("python -m probes.analyze analysis=head_stats")
    # what the analysis read: the treebank file of its split with its sha256, the encoder's weights fingerprint
    dev = tmp_path / "tiny" / "ud_english_ewt" / "en_ewt-ud-dev.conllu"
    assert prov["inputs"]["data_files"] == {"dev": dict(path=str(dev), sha256=sha256_file(dev))}
    assert prov["inputs"]["encoder"]["fingerprint"] == instantiate(OmegaConf.load(ROOT / "conf" / "encoder" /
                                                                                 "tiny.yaml")).fingerprint


def test_reader_rejects_other_files(tmp_path):
    p = tmp_path / "run-x.wandb"
    p.write_bytes(b"not a run file")
    with pytest.raises(ValueError, match="not a wandb run file"):
        read_run(p)
