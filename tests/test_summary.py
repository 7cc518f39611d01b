"""Multirun summary of any task: columns are the metrics the jobs wrote, the paper value where named, a
status per job; written in the folder that holds the jobs, whatever task_name their experiments set."""

import json
import os
import subprocess
import sys

from omegaconf import OmegaConf

from probes.summary import collect, summarize
from tests.conftest import ROOT, chain_overrides


def _job(root, name, metrics, overrides, paper=None):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps(metrics))
    OmegaConf.save(OmegaConf.create(overrides), d / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"paper": paper} if paper else {}), d / ".hydra" / "config.yaml")
    return d


def test_glue_and_probe_jobs_get_their_own_columns(tmp_path):
    _job(tmp_path, "0", {"val/uas_best": 0.64, "test/uas": 0.639, "test/loss": 1.25, "sys/peak_rss_mb": 580.0,
                         "epoch": 4},
         ["experiment=table3_attn_glove"], {"value": 77, "source": "Clark et al."})
    _job(tmp_path, "1", {"val/f1_best": 0.843, "test/f1": 0.843, "test/acc": 0.76}, ["experiment=glue_mrpc"])
    columns, rows = collect(tmp_path)
    assert columns == ["val/f1_best", "val/uas_best", "test/acc", "test/f1", "test/uas"]
    assert rows[0]["job"] == "experiment=table3_attn_glove" and rows[0]["paper"] == 77
    assert rows[1]["test/f1"] == 0.843 and "test/uas" not in rows[1]
    md, text = summarize(tmp_path)
    lines = md.splitlines()
    assert lines[2] == "| experiment=table3_attn_glove | - | 64.0 | - | - | 63.9 | ok | 77 |"
    assert lines[3] == "| experiment=glue_mrpc | 84.3 | - | 76.0 | 84.3 | - | ok | - |"
    assert text.splitlines()[0] == "job,val/f1_best,val/uas_best,test/acc,test/f1,test/uas,status,paper"


def test_failed_and_killed_jobs_keep_their_rows(tmp_path):
    _job(tmp_path, "0_a", {"val/uas_best": 0.5, "test/uas": 0.4}, ["probe=attn_only"])
    failed = _job(tmp_path, "1_b", None, ["probe=attn_glove"])
    (failed / "job_status.json").write_text(json.dumps({"status": "FAILED", "error": "ValueError: bad lr"}))
    _job(tmp_path, "10_c", None, ["probe=distance_glove"])  # killed: neither metrics nor a status record
    _, rows = collect(tmp_path)
    assert [r["job"] for r in rows] == ["probe=attn_only", "probe=attn_glove", "probe=distance_glove"]  # by number
    assert [r["status"] for r in rows] == ["ok", "failed: ValueError: bad lr", "failed: no metrics.json"]
    assert collect(tmp_path, final=False)[1][2]["status"].startswith("running")  # while the sweep still runs
    md = summarize(tmp_path)[0].splitlines()
    assert md[3] == "| probe=attn_glove | - | - | failed: ValueError: bad lr | - |"


def test_multirun_summary_in_the_jobs_folder_with_a_failed_job(chain_data, tmp_path):
    """Experiments that set their own task_name (table3, broken) run in the one sweep folder of the multirun,
    which also holds the summary; the failing job keeps its row, the others their numbers."""
    extra = tmp_path / "extra" / "experiment"
    extra.mkdir(parents=True)
    (extra / "broken.yaml").write_text("# @package _global_\ntask_name: broken\nprobe:\n  optimizer:\n    lr: -1.0\n")
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.output_dir")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "train.py", "-m", "experiment=table3_attn_only,broken",
                        "trainer.max_epochs=1", "data.extract_in_child=false", f"paths.log_dir={tmp_path / 'logs'}",
                        f"hydra.searchpath=[file://{tmp_path / 'extra'}]", *over],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "Invalid learning rate" in r.stderr  # Hydra re-raises the failed job's error
    sweeps = list((tmp_path / "logs").glob("*/multiruns/*"))
    assert [s.parent.parent.name for s in sweeps] == ["train"]  # the multirun's folder, not one per task_name
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == \
        ["0_attn_only_tiny", "1_attn_glove_tiny"]
    md = (sweep / "summary.md").read_text().splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): [c.strip() for c in line.strip("| ").split(" | ")] for line in md[2:]}
    assert set(rows) == {"experiment=table3_attn_only", "experiment=broken"}
    head = [c.strip() for c in md[0].strip("| ").split(" | ")]
    uas = head.index("test/uas")
    saved = json.loads((sweep / "0_attn_only_tiny" / "metrics.json").read_text())
    assert rows["experiment=table3_attn_only"][uas] == f"{100 * saved['test/uas']:.1f}"
    assert rows["experiment=table3_attn_only"][head.index("status")] == "ok"
    assert rows["experiment=broken"][head.index("status")].startswith("failed: ValueError: Invalid learning rate")
    assert rows["experiment=table3_attn_only"][head.index("paper")] == "61"
    assert (sweep / "summary.csv").read_text().count("\n") == 3
