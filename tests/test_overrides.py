"""Wrong types in overrides are one clear error naming each config key, before any work: checked against the
signatures of the `_target_`s that receive them (analyses, datamodules, probes, optimizers, the Trainer), the
`extract` node's dataclass and the root keys, on the real conf/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import probes
from probes.config import ConfigTypeError, check_types, compose
from probes.train import train
from tests.conftest import ROOT, chain_overrides, compose_train

CONF = ROOT / "conf"


@pytest.mark.parametrize("experiment", [None, *sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))])
def test_every_experiment_as_shipped_passes(experiment):
    check_types(compose("train", [f"experiment={experiment}"] if experiment else []))


@pytest.mark.parametrize("analysis", sorted(p.stem for p in (CONF / "analysis").glob("*.yaml")))
def test_every_analysis_as_shipped_passes(analysis):
    check_types(compose("analyze", [f"analysis={analysis}"]))


@pytest.mark.parametrize("override, message", [
    ("trainer.max_epochs=five", "trainer.max_epochs: expected int or null, got 'five' (str)"),
    ("data.batch_size=2.5", "data.batch_size: expected int, got 2.5 (float)"),
    ("data.max_sentences.train=five", "data.max_sentences.train: expected int or null, got 'five' (str)"),
    ("seed=x", "seed: expected int, got 'x' (str)"),
    ("probe.optimizer.lr=abc", "probe.optimizer.lr: expected float or Tensor, got 'abc' (str)"),
    ("extract.precision_margin=big", "extract.precision_margin: expected float, got 'big' (str)"),
    ("extract.max_length=long", "extract.max_length: expected int or null, got 'long' (str)"),
    ("fit=maybe", "fit: expected bool, got 'maybe' (str)"),
])
def test_training_overrides_of_the_wrong_type_name_the_key(override, message):
    with pytest.raises(ConfigTypeError) as e:
        check_types(compose("train", [override]))
    assert message in str(e.value)


def test_every_wrong_key_is_named_at_once():
    with pytest.raises(ConfigTypeError) as e:
        check_types(compose("train", ["trainer.max_epochs=five", "data.batch_size=many"]))
    assert "trainer.max_epochs:" in str(e.value) and "data.batch_size:" in str(e.value)


def test_right_types_in_other_spellings_pass():
    check_types(compose("train", ["trainer.max_epochs=3", "data.max_sentences.train=10", "probe.optimizer.lr=1",
                                  "extract.precision_margin=2", "trainer.devices=[0]", "trainer.max_epochs=null"]))


@pytest.mark.parametrize("analysis", ["linguistic_attention", "pattern_types"])
def test_documented_list_and_mapping_values_pass(analysis):
    """The values the analysis configs document (a list of tasks, a {task: path} mapping) are not type errors."""
    check_types(compose("analyze", [f"analysis={analysis}", "analysis.task=[rte,mrpc]",
                                    "analysis.checkpoint={rte: a, mrpc: b}"]))
    with pytest.raises(ConfigTypeError, match="analysis.task"):
        check_types(compose("analyze", [f"analysis={analysis}", "analysis.task=3"]))


def test_training_stops_before_any_cache_is_built(chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + ["data.max_sentences.train=five"])
    with pytest.raises(ConfigTypeError, match=r"data\.max_sentences\.train: expected int or null, got 'five'"):
        train(cfg)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_analysis_parameter_of_the_wrong_type_from_python(tmp_path):
    with pytest.raises(ConfigTypeError, match=r"analysis\.max_sentences: expected int or null, got 'five' \(str\)"):
        probes.analyze("head_stats", max_sentences="five", output_dir=tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))  # no provenance, table or figure written
    with pytest.raises(ConfigTypeError, match=r"analysis\.min_count: expected int, got 'x'"):
        probes.analyze("dep_heads", min_count="x", output_dir=tmp_path / "out")
    with pytest.raises(ConfigTypeError, match=r"analysis\.offsets: expected a list, got 3 \(int\)"):  # from the default
        probes.analyze("dep_heads", offsets=3, output_dir=tmp_path / "out")


def test_analysis_command_line_names_the_key(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "-m", "probes.analyze", "analysis=head_stats", "analysis.max_sentences=five",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "analysis.max_sentences: expected int or null, got 'five' (str)" in r.stderr
    assert "slice indices" not in r.stderr
    assert not list(Path(tmp_path / "run").glob("*.csv"))
