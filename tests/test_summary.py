"""Multirun summary of any task: columns are the metrics the jobs wrote, the paper value where named."""

import json

from omegaconf import OmegaConf

from probes.summary import collect, summarize


def _job(root, name, metrics, overrides, paper=None):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(metrics))
    OmegaConf.save(OmegaConf.create(overrides), d / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"paper": paper} if paper else {}), d / ".hydra" / "config.yaml")


def test_glue_and_probe_jobs_get_their_own_columns(tmp_path):
    _job(tmp_path, "0", {"val/uas_best": 0.64, "test/uas": 0.639, "sys/peak_rss_mb": 580.0, "epoch": 4},
         ["experiment=table3_attn_glove"], {"value": 77, "source": "Clark et al."})
    _job(tmp_path, "1", {"val/f1_best": 0.843, "test/f1": 0.843, "test/acc": 0.76}, ["experiment=glue_mrpc"])
    columns, rows = collect(tmp_path)
    assert columns == ["val/f1_best", "val/uas_best", "test/acc", "test/f1", "test/uas"]
    assert rows[0]["job"] == "experiment=table3_attn_glove" and rows[0]["paper"] == 77
    assert rows[1]["test/f1"] == 0.843 and "test/uas" not in rows[1]
    md, text = summarize(tmp_path)
    lines = md.splitlines()
    assert lines[2].startswith("| experiment=table3_attn_glove | - | 64.0 | - | - | 63.9 | 77 |")
    assert lines[3] == "| experiment=glue_mrpc | 84.3 | - | 76.0 | 84.3 | - | - |"
    assert text.splitlines()[0] == "job,val/f1_best,val/uas_best,test/acc,test/f1,test/uas,paper"
