"""No code runs from a checkpoint: a crafted pickle (its ``__reduce__`` creates a marker file) given as an analysis's
fine-tuned ``.ckpt``, as a copied run folder's ``checkpoints/last.ckpt`` to ``python train.py resume=<folder>``, or
as an export folder's ``head.pt`` is refused with an error naming the file, and the marker is never created; the
files the project writes load weights-only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from probes.glue.export import EncoderWithHead, load_finetuned
from probes.model.load import tiny_bert
from probes.training.checkpoint import UnsafeCheckpointError, load_checkpoint
from probes.training.module import plain
from tests.resume_helpers import run_train
from tests.test_run_record import finished_run


class Marker:
    """Unpickled, it calls ``open(path, "w")``: the marker file appears (what any code in a pickle could do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def craft(path: Path, marker: Path, content: dict) -> Path:
    """``content`` saved with torch.save at ``path``, a :class:`Marker` for ``marker`` under ``"payload"``."""
    torch.save({**content, "payload": Marker(marker)}, path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished tiny training run (two epochs) to copy."""
    return finished_run(tmp_path_factory.mktemp("finished"), epochs=2)


def test_the_crafted_file_runs_code_when_unpickled(tmp_path):
    """The control: torch.load(weights_only=False) of the crafted file creates the marker."""
    marker = tmp_path / "marker"
    torch.load(craft(tmp_path / "x.ckpt", marker, {}), weights_only=False)
    assert marker.exists()


def test_an_analysis_checkpoint_is_refused(tmp_path):
    """``analysis.checkpoint=<file>.ckpt`` (linguistic_attention, faithfulness, grad_sep): :func:`load_finetuned`."""
    marker = tmp_path / "marker"
    ckpt = craft(tmp_path / "best.ckpt", marker, dict(state_dict={}, hyper_parameters=dict(task="mrpc")))
    with pytest.raises(UnsafeCheckpointError, match=f"{ckpt}: refused to load .*Unsupported global"):
        load_finetuned(ckpt, encoder=tiny_bert())
    assert not marker.exists()


def _export_folder(folder: Path, head: dict) -> Path:
    """A tiny BERT saved as a bare encoder (``BertModel``) + ``head.pt`` holding ``head``, the way
    :func:`probes.glue.export.export_hf` saves families without a compatible classification head."""
    enc = tiny_bert()
    enc.base.save_pretrained(folder)
    enc.tokenizer.save_pretrained(folder)
    (folder / "glue_task.json").write_text(json.dumps(dict(task="mrpc", num_labels=2, pooling="cls")))
    torch.save(head, folder / "head.pt")
    return folder


def test_a_crafted_head_pt_is_refused(tmp_path):
    marker = tmp_path / "marker"
    folder = _export_folder(tmp_path / "hf_model", dict(weight=torch.zeros(2, 32), bias=Marker(marker)))
    with pytest.raises(UnsafeCheckpointError, match=f"{folder / 'head.pt'}: refused to load"):
        load_finetuned(folder)
    assert not marker.exists()


def test_a_genuine_head_pt_loads(tmp_path):
    head = torch.nn.Linear(32, 2)
    folder = _export_folder(tmp_path / "hf_model", head.state_dict())
    ft = load_finetuned(folder)
    assert isinstance(ft.model, EncoderWithHead) and ft.task == "mrpc"
    torch.testing.assert_close(ft.model.head.weight, head.weight.detach())


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "killed"])
def test_resume_refuses_a_crafted_last_ckpt(finished, run, tmp_path):
    """A copied run folder (finished, or as a killed run: no metrics.json) whose ``last.ckpt`` is the genuine
    checkpoint plus a crafted object: ``python train.py resume=<copy>`` fails naming the file, in its stderr and in
    the folder's ``train.log``; nothing in it ran and the folder's record is unchanged."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    if not finished:
        (copy / "metrics.json").unlink()
    last = copy / "checkpoints" / "last.ckpt"
    marker = tmp_path / "marker"
    craft(last, marker, torch.load(last, map_location="cpu", weights_only=True))
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != "train.log"}
    r = run_train([f"resume={copy}"])
    assert r.returncode != 0
    assert not marker.exists()
    assert f"{last}: refused to load" in r.stderr, r.stderr[-3000:]
    log = (copy / "train.log").read_text()
    assert f"{last}: refused to load" in log and "Traceback" in log
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != "train.log"} == before


def test_the_project_checkpoints_load_weights_only(run):
    """``last.ckpt`` and the best checkpoint of a real run: tensors and plain values only."""
    for path in sorted((run / "checkpoints").glob("*.ckpt")):
        state = load_checkpoint(path, map_location="cpu", mmap=True)
        assert state["hyper_parameters"]["monitor"] == "val/uas" and "probes" in state


def test_hyperparameters_are_saved_as_plain_values():
    from omegaconf import OmegaConf

    value = OmegaConf.create({"a": [1, {"b": Path("/x")}], "c": (2, 3)})
    assert plain(value) == {"a": [1, {"b": "/x"}], "c": [2, 3]}
    assert plain((Path("p"), 1.0)) == ("p", 1.0)
