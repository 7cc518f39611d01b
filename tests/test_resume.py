"""Runs that resume: a training run killed (SIGKILL) after its first epoch's checkpoint, continued with
``python train.py resume=<run folder>``, ends where the same run left alone ends; clear errors for a folder
without a run, a config or a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from probes.train import last_checkpoint, resume_config, resume_from_argv
from tests.conftest import chain_overrides, write_chain_splits
from tests.resume_helpers import run_train as _train
from tests.test_glue_train import glue_data  # noqa: F401  (fixture: a synthetic glue/ folder)
from tests.test_patterns import write_pattern_folder

KILL = "+callbacks.zz_kill={_target_: tests.resume_helpers.KillAfterEpoch}"  # listed last: runs after last.ckpt


def _run_args(chain_data: Path, tmp_path: Path, folder: Path, extra: list[str]) -> list[str]:
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.output_dir")]
    return [*over, f"hydra.run.dir={folder}", KILL, *extra]


@pytest.mark.parametrize("extra", [["probe=attn_glove", "trainer.max_epochs=3"]])
def test_a_killed_run_resumed_ends_as_the_run_left_alone(extra, chain_data, tmp_path):
    killed, alone = tmp_path / "killed", tmp_path / "alone"
    r = _train(_run_args(chain_data, tmp_path, killed, extra), kill_after=0)  # SIGKILL after epoch 0
    assert r.returncode == -9, r.stderr[-3000:]
    assert (killed / "checkpoints" / "last.ckpt").is_file() and not (killed / "metrics.json").exists()
    assert torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 0
    r = _train([f"resume={killed}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(_run_args(chain_data, tmp_path, alone, extra))
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, left = (json.loads((d / "metrics.json").read_text()) for d in (killed, alone))
    assert torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 2  # went on to the end
    for k in ("val/uas_best", "test/uas", "test/uas_nopunct"):
        assert abs(resumed[k] - left[k]) <= 0.005, (k, resumed[k], left[k])  # within 0.5 UAS
    # the same batches, generator states and best-so-far: the same numbers
    assert {k: resumed[k] for k in left if "/" in k and not k.startswith("sys/")} == \
        {k: left[k] for k in left if "/" in k and not k.startswith("sys/")}
    assert Path(resumed["best_checkpoint"]).parent == killed / "checkpoints"
    prov = json.loads((killed / "provenance.json").read_text())
    assert prov["inputs"]["resumed_from"] == str(killed / "checkpoints" / "last.ckpt")
    assert "resume=" in prov["launched_by"]
    assert "trainer.max_epochs=3" in prov["command"]  # the job's own command, from its Hydra record
    precision = json.loads((killed / "precision.json").read_text())
    assert precision["trainer"] == "32-true" and precision["extract"]["precision"] == "32-true"
    assert precision["extract"]["decided_by"] == "config"


def test_resume_errors_name_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        resume_config(tmp_path / "nowhere")
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\.hydra/config\.yaml is missing"):
        resume_config(tmp_path / "run")
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("seed: 0\npaths: {output_dir: x}\n")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint to resume from .*last\.ckpt is missing"):
        resume_config(tmp_path / "run")
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    cfg = resume_config(tmp_path / "run")
    assert cfg.paths.output_dir == str((tmp_path / "run").resolve()) == cfg.resume
    assert last_checkpoint(tmp_path / "run").name == "last.ckpt"


def test_resume_takes_no_other_overrides(tmp_path):
    """train.py's command line goes through resume_from_argv first (the resume tests above run it): another
    argument beside resume= is a SystemExit with a message (exit status 1), before anything is read."""
    with pytest.raises(SystemExit, match="takes no other arguments") as e:
        resume_from_argv([f"resume={tmp_path}", "trainer.max_epochs=9"])
    assert isinstance(e.value.code, str)  # a message: Python exits with status 1
    with pytest.raises(SystemExit, match="takes no other arguments"):
        resume_from_argv([f"resume={tmp_path}", f"resume={tmp_path}"])
    assert resume_from_argv(["trainer.max_epochs=9"]) is False  # no resume=: a plain Hydra run


_COMMON = ["logger=none", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
           "trainer.enable_model_summary=false", "trainer.max_epochs=2"]


def _experiment_args(name: str, tmp_path: Path, glue: Path) -> list[str]:
    """Overrides of a tiny run of each other trainable package (synthetic data under ``tmp_path``)."""
    if name == "patterns":
        write_pattern_folder(tmp_path / "data" / "attention_patterns")
        return ["experiment=patterns", f"paths.data_dir={tmp_path / 'data'}", "data.batch_size=8", *_COMMON]
    if name == "glue_mrpc":
        return ["experiment=glue_mrpc", "encoder=tiny", f"paths.data_dir={glue}", "data.batch_size=8",
                "probe.optimizer.lr=1e-3", *_COMMON]
    data = write_chain_splits(tmp_path, sizes=(60, 20, 20))
    over = [o for o in chain_overrides(data, tmp_path) if not o.startswith("paths.output_dir")]
    return [*over, "experiment=table3_structural", "data.layer=0", "data.num_workers=0", *_COMMON]


@pytest.mark.parametrize("name", ["patterns", "glue_mrpc", "table3_structural"])
def test_the_other_trainable_packages_resume(name, glue_data, tmp_path):  # noqa: F811
    """The pattern CNN, GLUE fine-tuning and the structural probe: killed after epoch 0 of 2, resumed from
    ``last.ckpt``, they train the remaining epoch only (the same optimizer steps as the run left alone) and write
    the same metrics. Their numbers are not compared: their loaders shuffle and augment from generators of their
    own (the pattern CNN's train accuracy on 30 synthetic maps differed by 2 maps)."""
    args = _experiment_args(name, tmp_path, glue_data)
    killed, alone = tmp_path / "killed", tmp_path / "alone"
    r = _train([*args, f"hydra.run.dir={killed}", KILL], kill_after=0)
    assert r.returncode == -9, r.stderr[-3000:]
    assert torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 0
    r = _train([f"resume={killed}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train([*args, f"hydra.run.dir={alone}", KILL])
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] for d in (killed, alone)]
    assert steps[0] == steps[1] > 0
    resumed, left = (json.loads((d / "metrics.json").read_text()) for d in (killed, alone))
    numbers = [k for k in left if "/" in k and not k.startswith(("sys/", "data/"))]
    assert numbers and all(isinstance(resumed.get(k), float) for k in numbers)
