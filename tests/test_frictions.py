"""A newcomer's frictions (issue 41): a failed ``train.py`` run prints one message, its traceback only in the run's
log; the Python API raises the project's own exceptions, naming the arguments the caller wrote; ``probes-view``
writes under ``logs/``; a run shows no library noise it cannot act on; ``dir(probes)`` is the public API."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from hydra.errors import InstantiationException

import probes
import probes.api
from probes import quiet
from probes.measures import build
from probes.model.fetched import ModelNotFetched
from probes.report.view import main as view_main
from probes.report.view import run as view_run
from probes.train import reported, train
from tests.conftest import ROOT, chain_overrides, compose_train

BAD = "trainer.max_epochs: expected int or null, got 'five' (str)"


# ----------------------------------------------------------------------------- 3: one message, traceback in the log
def _train_py(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "train.py", *args, "logger=none", f"paths.log_dir={tmp_path / 'logs'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_failed_run_prints_one_message_and_logs_its_traceback(tmp_path):
    r = _train_py(["experiment=smoke", "trainer.max_epochs=five"], tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    terminal = r.stdout + r.stderr
    assert "Traceback" not in terminal and terminal.count(BAD) == 1, terminal[-3000:]
    assert r.stderr.count(BAD) == 1
    [log] = (tmp_path / "logs").glob("smoke/runs/*/train.log")
    assert f"the traceback is in {log}" in r.stderr  # where to look
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") == 1 and text.count(BAD) == 2  # the record, its traceback
    assert "raise ConfigTypeError" in text


def test_a_bad_key_prints_hydras_message_alone(monkeypatch, capsys):
    """``train.py``'s report of an override Hydra cannot compose (the same exception as on its command line):
    Hydra's words and the key's, exit status 1, and ``HYDRA_FULL_ERROR`` as it was."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e, reported():
        compose_train(["experiment=smoke", "trainer.no_such_key=1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "HYDRA_FULL_ERROR" not in os.environ
    assert err.startswith("Could not override 'trainer.no_such_key'.") and err.count("Could not override") == 1
    assert "Key 'no_such_key' is not in struct" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- 4: the project's own exceptions
@pytest.fixture
def no_models(tmp_path, monkeypatch) -> Path:
    """An empty cache folder (models_dir = <it>/models): no real model is fetched there."""
    monkeypatch.setenv("PROBES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_an_unfetched_model_raises_model_not_fetched(no_models):
    with pytest.raises(ModelNotFetched, match=r"run `probes-fetch model=gemma3_270m`") as e:
        probes.load_encoder("gemma3_270m")
    assert not isinstance(e.value, InstantiationException) and str(no_models) in str(e.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_arg'"):  # any error of a config's target
        probes.load_encoder("tiny", no_such_arg=1)


def test_analyze_with_an_unfetched_encoder_raises_model_not_fetched(no_models, tmp_path):
    with pytest.raises(ModelNotFetched, match="probes-fetch model=gemma3_270m"):
        probes.analyze("head_stats", sentences=["The cat sat ."], overrides=["encoder=gemma3_270m"],
                       output_dir=tmp_path / "out", figures=False)


def test_the_view_command_names_the_fetch_command(no_models, capsys):
    with pytest.raises(SystemExit) as e:
        view_main(["encoder=gemma3_270m", "sentence=a b"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("probes-view: error: model 'gemma3_270m' is not in ")
    assert "probes-fetch model=gemma3_270m" in err


# ----------------------------------------------------------------------------- 5: errors name the caller's words
def test_word_maps_errors_name_the_arguments(no_models):
    # the kind is checked before any model loads: an unfetched encoder is not reached
    with pytest.raises(KeyError) as e:
        probes.word_maps("gemma3_270m", ["a b"], kind="atention")
    assert e.value.args[0].startswith("kind='atention' is not one of extract.measures: attention, rollout")
    with pytest.raises(ValueError, match=r"^device='cdua' is not a device"):
        probes.word_maps("gemma3_270m", ["a b"], device="cdua")
    with pytest.raises(ValueError, match=r"^extract\.to_words='firts' is not a pooling"):  # the key of overrides
        probes.word_maps("gemma3_270m", ["a b"], overrides=["extract.to_words=firts"])
    enc = probes.load_encoder("tiny")  # 2 layers
    for layers in ([5], "0", [0.5], True, []):
        with pytest.raises(ValueError, match=r"^layers must be a layer or a list of layers in 0\.\.1 \(the encoder "
                                             r"has 2 layers\), got "):
            probes.word_maps(enc, ["a b"], layers=layers)


def test_the_command_lines_keep_naming_their_keys(tmp_path):
    with pytest.raises(KeyError) as e:
        build("atention", {"attention": {"_target_": "probes.measures.attention.Attention"}})
    assert e.value.args[0] == "extract.maps='atention' is not one of extract.measures: attention"
    with pytest.raises(KeyError) as e:
        view_run(["encoder=tiny", "sentence=a b", "kinds=[attention,atention]", f"out={tmp_path / 'v.html'}"])
    assert e.value.args[0].startswith("kinds[1]='atention' is not one of extract.measures: attention, rollout")
    assert not (tmp_path / "v.html").exists()


# ----------------------------------------------------------------------------- 8: probes-view writes under logs/
def test_probes_view_writes_under_logs_and_prints_the_full_path(tmp_path, monkeypatch, capsys):
    root, cwd = tmp_path / "checkout", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.setenv("PROJECT_ROOT", str(root))  # paths.root_dir: logs/ is <root>/logs
    monkeypatch.chdir(cwd)
    view_main(["encoder=tiny", "sentence=The cat sat .", "analysis_device=cpu", "extract.precision=32-true"])
    printed = Path(capsys.readouterr().out.strip())
    assert printed.is_absolute() and printed.is_file() and printed.name == "view.html"
    assert printed.parent.parent == root / "logs" / "view"  # logs/view/<time>/view.html
    assert list(cwd.iterdir()) == []


# ----------------------------------------------------------------------------- 9: no noise; the namespace
NOISE = ("💡 Tip", "LeafSpec", "anonymous setting")
NOISY = """
import logging, sys
import pytorch_lightning as pl
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.utilities._pytree import _tree_flatten
logging.getLogger("pytorch_lightning").setLevel(logging.INFO)
if sys.argv[1] == "probes":
    import probes  # its filters
    from probes.report.tracking import WandbRunLogger as Logger
    kw = dict(task_name="t", target="probes.dependency.module.DependencyProbe", job_types={})
else:
    Logger, kw = WandbLogger, {}
pl.Trainer(logger=False, accelerator="cpu", enable_checkpointing=False)
_tree_flatten({"a": [1, 2]})
Logger(save_dir=sys.argv[2], project="p", mode="disabled", **kw).experiment.finish()
"""


def test_a_run_shows_none_of_the_libraries_noise(tmp_path):
    """Lightning's tip, torch's LeafSpec deprecation in Lightning and wandb's ``anonymous`` warning, as plain
    Lightning and wandb show them, are gone after ``import probes`` (and with the project's wandb logger); the
    rest of Lightning's messages stay."""
    def run(which: str) -> str:
        r = subprocess.run([sys.executable, "-c", NOISY, which, str(tmp_path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, WANDB_SILENT="false"))
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout + r.stderr
    plain, ours = run("plain"), run("probes")
    assert all(n in plain for n in NOISE), plain[-3000:]  # the check can fail
    assert not any(n in ours for n in NOISE), ours[-3000:]
    assert "GPU available" in ours  # filtered narrowly


def test_training_warns_of_nothing_the_project_causes(chain_data, tmp_path):
    """A tiny run (extraction in this process, fit, test): no warning about batch indices (the cache writer) or a
    batch size, no LeafSpec deprecation, and the last checkpoint saved with its state stated (no
    ```weights_only` was not set``)."""
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + [
        "probe=attn_only", "trainer.max_epochs=1", "data.extract_in_child=false"])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.install()  # as on `import probes` in a run's process
            train(cfg)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    for noise in ("Couldn't infer the batch indices", "infer the `batch_size`", "LeafSpec", "weights_only` was not set",
                  "💡 Tip"):
        assert not any(noise in s for s in said), [s for s in said if noise in s]
    assert (tmp_path / "out" / "checkpoints" / "last.ckpt").is_file()


def test_the_package_namespace_is_the_public_api():
    names = dir(probes)
    assert names == sorted(probes.__all__)
    assert not any(isinstance(getattr(probes, n), types.ModuleType) for n in names)
    assert "importlib" not in names and "api" not in names  # probes.api is imported above
