"""The example notebook docs/examples/quickstart.ipynb runs top to bottom (nbclient, kernel python3)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "docs" / "examples" / "quickstart.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """Every cell runs without error in a fresh kernel (this checkout's probes; files under tmp_path), the
    maps, the figure and both analysis tables are shown, in well under two minutes."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("PROJECT_ROOT", str(tmp_path))  # logs/ and .cache/ of the analyses under tmp_path
    monkeypatch.delenv("PROBES_CACHE_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.time()
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.time() - t0
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    kinds = [{k for o in c.outputs for k in o.get("data", {})} for c in code]
    assert "(6, 12, 8, 8) float32" in "".join(o.get("text", "") for o in code[1].outputs)
    assert any("image/png" in k for k in kinds)  # the heatmap
    assert sum("text/html" in k for k in kinds) >= 4  # the DataFrames: one head, rollout, head_stats, dep_table
    assert (tmp_path / "my.conllu").is_file() and len(list((tmp_path / "logs" / "api").iterdir())) == 2
    assert seconds < 120, f"the notebook took {seconds:.0f}s"
