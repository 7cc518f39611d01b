import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probes.data.conllu import read_conllu
from probes.train import train
from tests.conftest import ROOT, chain_overrides, compose_train


@pytest.mark.parametrize("probe", ["attn_only", "attn_glove", "distance_glove"])
def test_train_writes_metrics_and_predictions(probe, chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + [f"probe={probe}", "trainer.max_epochs=2"])
    metrics = train(cfg)
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved == metrics
    prov = json.loads((tmp_path / "out" / "provenance.json").read_text())  # written with logger=none too
    assert {"commit", "machine", "command"} <= set(prov) and prov["machine"]
    assert set(prov["environment"]) >= {"PROBES_DATA_DIR", "PROBES_CACHE_DIR"}
    inputs = prov["inputs"]  # what the run read: data files with their sha256, cache entries with their keys
    assert Path(inputs["cache_dir"]) == Path(cfg.paths.cache_dir) and inputs["data_dir"] == str(cfg.paths.data_dir)
    for split in ("train", "dev", "test"):
        f = inputs["data_files"][split]
        assert f["sha256"] == hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest()
    assert set(inputs["caches"]) == {"train", "val", "test"}
    for stage, split in (("train", "train"), ("val", "dev"), ("test", "test")):
        entry = inputs["caches"][stage]
        assert Path(entry["path"]).is_dir() and Path(entry["path"]).parent.parent == Path(cfg.paths.cache_dir)
        assert entry["key"]["data_sha256"] == inputs["data_files"][split]["sha256"]
        assert entry["key"]["precision"] and entry["key"]["encoder"]
    for k in ("val/uas", "val/uas_best", "test/uas", "test/uas_nopunct", "train/loss"):
        assert 0.0 <= saved[k] <= (1.0 if "uas" in k else 100.0), k
    hp = torch.load(saved["best_checkpoint"], map_location="cpu", weights_only=True)["hyper_parameters"]
    assert hp["monitor"] == "val/uas" and hp["mode"] == "max" and "scorer" not in hp  # save_hyperparameters
    pred = read_conllu(tmp_path / "out" / "predictions" / "test.conllu", trees=False)  # argmax heads
    gold = read_conllu(chain_data / "chain" / "chain-test.conllu")
    assert [s.words for s in pred] == [s.words for s in gold]
    correct = sum(p == g for s, t in zip(pred, gold) for p, g in zip(s.heads, t.heads))
    assert abs(correct / sum(s.n for s in gold) - saved["test/uas"]) < 1e-6  # file agrees with the metric


def test_distance_probe_learns_the_chain(chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + ["probe=distance_glove", "trainer.max_epochs=8",
                                                                 "data.batch_size=8"])
    assert train(cfg)["test/uas"] > 0.95  # every head is the previous word: distance features suffice


def test_right_branching_needs_no_training(chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + ["experiment=table3_right_branching"])
    m = train(cfg)
    # chain heads point left, right-branching points right: only the root can be right when n == 1
    assert m["test/uas"] < 0.05 and "best_checkpoint" not in m


def test_multirun_over_probes(chain_data, tmp_path):
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.output_dir")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "train.py", "-m", "probe=attn_only,attn_glove", "trainer.max_epochs=1",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}", *over], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp_path / "sweep").glob("*/metrics.json"))
    assert len(runs) == 2 and all("test/uas" in json.loads(p.read_text()) for p in runs)
    md = (tmp_path / "sweep" / "summary.md").read_text().splitlines()
    assert "val/uas_best" in md[0] and "test/uas" in md[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md[2:]}
    assert set(rows) == {"probe=attn_only", "probe=attn_glove"}
    for line in rows.values():  # every metric column holds a number, none is a dash
        cells = [c.strip() for c in line.strip("| ").split(" | ")]
        assert all(c != "-" for c in cells[1:-1]), line
    assert (tmp_path / "sweep" / "summary.csv").read_text().startswith("job,")


def test_smoke_sweep_scores_the_untrained_probe_without_fit_false(chain_data, tmp_path):
    """`python train.py -m experiment=smoke probe=attn_only,right_branching`: the parameter-free row is scored
    without fitting (no `fit=false` needed), the trained row is fitted; both rows get their metrics."""
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.output_dir")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "train.py", "-m", "experiment=smoke", "probe=attn_only,right_branching",
                        "data.extract_in_child=false", f"hydra.sweep.dir={sweep}", *over], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = json.loads((sweep / "0_attn_only_tiny" / "metrics.json").read_text())
    untrained = json.loads((sweep / "1_right_branching_tiny" / "metrics.json").read_text())
    assert trained["best_checkpoint"].endswith(".ckpt") and 0.0 <= trained["test/uas"] <= 1.0
    assert trained["val/uas_best"] >= trained["val/uas"] - 1e-9 and "train/loss" in trained
    # chain heads point to the previous word, right-branching to the next one (the root only for n = 1): 0 right
    assert untrained["test/uas"] == 0.0 and untrained["val/uas"] == 0.0 and untrained["val/uas_best"] == 0.0
    assert "best_checkpoint" not in untrained and "train/loss" not in untrained
    assert "no trainable parameters: scored without fitting" in (sweep / "1_right_branching_tiny" / "train.log").read_text()
    md = (sweep / "summary.md").read_text().splitlines()
    head = [c.strip() for c in md[0].strip("| ").split(" | ")]
    rows = {r["job"]: r for r in (dict(zip(head, (c.strip() for c in line.strip("| ").split(" | ")))) for line in md[2:])}
    assert set(rows) == {"probe=attn_only", "probe=right_branching"}
    assert rows["probe=right_branching"]["status"] == "ok" and rows["probe=right_branching"]["test/uas"] == "0.0"
    assert rows["probe=attn_only"]["status"] == "ok" and rows["probe=attn_only"]["test/uas"] == f"{100 * trained['test/uas']:.1f}"


def test_checkpoint_callbacks_read_the_probes_monitor():
    """One key per probe config: the module's tracked best and the kept checkpoint follow ``probe.monitor``."""
    for experiment, monitor in (("table3_attn_glove", "val/uas"), ("table3_hidden_directed", "val/uas"),
                                ("table3_structural", "val/uuas"), ("structural_depth", "val/root_acc"),
                                ("glue_cola", "val/mcc")):
        cfg = compose_train([f"experiment={experiment}", "logger=none", "paths.output_dir=/tmp/x"])
        assert cfg.probe.monitor == monitor and cfg.probe.mode == "max", experiment
        ckpt = cfg.callbacks.model_checkpoint
        assert (ckpt.monitor, ckpt.mode) == (monitor, "max"), experiment
        assert cfg.optimized_metric == f"{monitor}_best", experiment
    cfg = compose_train(["experiment=patterns", "logger=none", "paths.output_dir=/tmp/x", "probe.mode=min"])
    assert cfg.callbacks.model_checkpoint.monitor is None  # no validation split: the last epoch is kept
    assert cfg.probe.monitor == "val/macro_f1" and cfg.callbacks.model_checkpoint.mode == "min"


def test_mmap_threshold_is_set_on_glibc():
    import platform

    from probes.memory import set_mmap_threshold

    assert set_mmap_threshold(None) is False
    if platform.libc_ver()[0] == "glibc":
        assert set_mmap_threshold(1 << 18) is True


REUSABLE_HEAP_SCRIPT = """
import ctypes, ctypes.util, json, resource, torch
from probes.memory import reusable_heap, set_mmap_threshold

def faults(mib, n=10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = torch.ones(mib << 20, dtype=torch.uint8)  # every page written (numpy would ask for huge pages)
        del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

assert set_mmap_threshold(1 << 18)
out = dict(fixed=faults(8))
with reusable_heap() as applied:
    out["applied"] = applied
    faults(8)  # the heap grows to hold them
    out["inside"] = faults(8)
ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
# larger than any free chunk the heap holds now, so the threshold alone decides: mapped each time (256 KiB
# back) or taken from the heap and kept there (the block's 64 MiB still in force)
out["after"] = faults(24)
print(json.dumps(out))
"""


def test_reusable_heap_keeps_batch_buffers_and_puts_the_threshold_back():
    """Inside `reusable_heap` a freed batch-sized buffer is reused (no new page faults); outside, under the fixed
    256 KiB threshold train.py sets, every such buffer is mapped and faulted in anew (in a fresh process: the
    test process's own heap may hold free chunks that big)."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc malloc only")
    r = subprocess.run([sys.executable, "-c", REUSABLE_HEAP_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    n = json.loads(r.stdout.strip().splitlines()[-1])
    assert n["fixed"] >= 10 * 1000  # 2,048 pages of 4 KiB each time
    assert n["applied"] and n["inside"] < n["fixed"] / 20
    assert n["after"] >= 10 * 6144 / 2  # the fixed threshold is back: 24 MiB mapped and faulted in anew each time


def test_peak_rss_reset_per_job():
    import numpy as np

    from probes.memory import peak_rss_mb, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs on this system")
    base = peak_rss_mb()
    a = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
    assert peak_rss_mb() > base + 150
    del a
    assert reset_peak_rss() and peak_rss_mb() < base + 100
