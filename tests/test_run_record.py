"""No record is lost: resuming a run that had finished leaves its folder as it was (and says so); a failed run's
folder holds the error with its traceback in its log file; a format error in the data stops the run before a
wandb run or a provenance file is started."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import chain_overrides, write_chain_splits
from tests.resume_helpers import run_train
from tests.test_glue_train import glue_data  # noqa: F401  (fixture: a synthetic glue/ folder)


def finished_run(root: Path, epochs: int) -> Path:
    """``<root>/run``: a finished run (``attn_only`` on a synthetic chain treebank of 30/10/10 sentences, tiny BERT,
    ``epochs`` epochs, no logger), its data and cache under ``root``."""
    data = write_chain_splits(root, sizes=(30, 10, 10))
    folder = root / "run"
    over = [o for o in chain_overrides(data, root) if not o.startswith("paths.output_dir")]
    r = run_train([*over, f"hydra.run.dir={folder}", "probe=attn_only", f"trainer.max_epochs={epochs}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


def _files(folder: Path) -> dict[Path, bytes]:
    """Every file under ``folder`` but its log, with its bytes."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "train.log"}


def test_resuming_a_finished_run_leaves_its_record(tmp_path):
    run = finished_run(tmp_path, epochs=2)
    record = _files(run)
    assert {"metrics.json", "provenance.json", "precision.json"} <= {p.name for p in record}
    assert (run / "predictions" / "test.conllu") in record
    r = run_train([f"resume={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(run) == record  # metrics (val/*, train/*, test/*), predictions, provenance, checkpoints
    said = f"run {run} had finished (epoch 2 of 2; metrics.json written); its record is left as it was"
    assert said in r.stderr and said in (run / "train.log").read_text()


def _failed_run(args: list[str], folder: Path) -> str:
    """Run ``train.py`` with ``args`` and the wandb logger (offline) into ``folder``, which must fail; its log."""
    r = run_train([*args, "logger=wandb", f"hydra.run.dir={folder}"])
    assert r.returncode != 0
    assert not (folder / "provenance.json").exists() and not (folder / "wandb").exists()
    assert not (folder / "metrics.json").exists()
    return (folder / "train.log").read_text()


def test_a_malformed_conllu_line_fails_before_any_record(tmp_path):
    data = write_chain_splits(tmp_path, sizes=(30, 10, 10))
    train = data / "chain" / "chain-train.conllu"
    lines = train.read_text().split("\n")
    lines[3] = "\t".join(lines[3].split("\t")[:8])  # word 3 of the first sentence: 8 columns, not 10
    train.write_text("\n".join(lines))
    over = [o for o in chain_overrides(data, tmp_path) if o != "logger=none" and not o.startswith("paths.output_dir")]
    log = _failed_run([*over, "probe=attn_only", "trainer.max_epochs=1"], tmp_path / "run")
    assert "Traceback" in log and "ConlluError" in log and f"{train}:4:" in log


def test_a_malformed_glue_line_fails_before_any_record(glue_data, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(glue_data, data)
    train = data / "glue" / "MRPC" / "train.tsv"
    lines = train.read_text(encoding="utf-8").split("\n")
    lines[4] = lines[4].replace("\t", " ", 1)  # 4 columns, not 5
    train.write_text("\n".join(lines), encoding="utf-8")
    log = _failed_run(["experiment=glue_mrpc", "encoder=tiny", f"paths.data_dir={data}", "trainer.accelerator=cpu",
                       "trainer.max_epochs=1", "trainer.enable_progress_bar=false"], tmp_path / "run")
    assert "Traceback" in log and "GlueFormatError" in log and f"{train}:5: expected 5" in log
