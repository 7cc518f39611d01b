"""Progress lines when no one watches a terminal (probes.progress): done/total, rate and ETA at a steady interval in
the log, from loops, Lightning's fit and predict, the extraction child and a real training run's log file."""

import functools
import logging
import os
import re
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from probes import progress as P
from probes.extract.stage import extract
from probes.model.load import tiny_bert
from tests.conftest import ROOT, WORDS, chain_overrides

LINE = re.compile(r"^(?P<desc>[\w ]+): (?P<done>[\d,]+)/(?P<total>[\d,]+) (?P<unit>\w+) \((?P<pct>[\d.]+)%\)"
                  r"(, epoch \d+/\d+)?, (?P<rate>[\d.,]+ \w+/s|[\d.,]+ s/\w+), elapsed \w+, ETA \w+$")


class Clock:
    """A fake monotonic clock moved by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog, logger="probes.progress") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_lines_at_the_interval_with_done_total_rate_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="probes.progress")
    clock = Clock()
    p = P.Progress("extraction", 100, "batches", every_s=30, enabled=True, clock=clock)
    for _ in range(100):  # one batch every 2 s: a line every 15 batches (30 s)
        clock.t += 2.0
        p.update()
    p.close()
    lines = _lines(caplog)
    assert len(lines) == 100 * 2 // 30 + 1  # six at the interval, then the closing line
    first = LINE.match(lines[0])
    assert first, lines[0]
    assert (first["done"], first["total"], first["unit"], first["pct"]) == ("15", "100", "batches", "15.0")
    assert first["rate"] == "2.0 s/batch" and lines[0].endswith("elapsed 30s, ETA 2m50s")  # 85 left at 2 s each
    assert [LINE.match(x)["done"] for x in lines[:-1]] == ["15", "30", "45", "60", "75", "90"]
    assert lines[-1] == "extraction: done 100/100 batches in 3m20s (2.0 s/batch)"


def test_fast_loops_log_rates_per_second_and_the_wrapper_counts_every_item(caplog):
    caplog.set_level(logging.INFO, logger="probes.progress")
    got = list(P.progress(range(5), "flow", unit="sentences", every_s=0, enabled=True))
    assert got == list(range(5))
    lines = _lines(caplog)
    assert len(lines) == 6 and all(LINE.match(x) for x in lines[:5]), lines
    assert [LINE.match(x)["done"] for x in lines[:5]] == ["1", "2", "3", "4", "5"]
    assert "sentences/s" in lines[0] and lines[-1].startswith("flow: done 5/5 sentences in ")


def test_a_loop_that_fails_says_where_it_stopped(caplog):
    caplog.set_level(logging.INFO, logger="probes.progress")
    with pytest.raises(RuntimeError):
        with P.Progress("fit", 10, "batches", every_s=1e9, enabled=True) as p:
            p.update(3)
            raise RuntimeError("boom")
    (line,) = _lines(caplog)
    assert line.startswith("fit: stopped at 3/10 batches in ")


def test_nothing_is_logged_on_a_terminal(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="probes.progress")
    monkeypatch.setattr(P, "watched", lambda: True)
    for _ in P.progress(range(3), "quiet", every_s=0):
        pass
    assert _lines(caplog) == []
    monkeypatch.setattr(P, "watched", lambda: False)
    for _ in P.progress(range(3), "loud", every_s=0):
        pass
    assert len(_lines(caplog)) == 4


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)
    assert P.interval() == P.EVERY_S == 30.0 and P.interval(0.5) == 0.5
    monkeypatch.setenv(P.ENV, "0.25")
    assert P.interval() == 0.25 and P.interval(2) == 2
    monkeypatch.setenv(P.ENV, "inf")
    assert P.interval() == float("inf")
    monkeypatch.setenv(P.ENV, "soon")
    with pytest.raises(ValueError, match="PROBES_PROGRESS_S: expected seconds"):
        P.interval()
    with pytest.raises(ValueError, match="every_s: expected seconds"):
        P.ProgressCallback(every_s=-1)


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return self.layer(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_logs_fit_over_all_epochs_and_predict(caplog):
    caplog.set_level(logging.INFO, logger="probes.progress")
    data = DataLoader(torch.randn(12, 2), batch_size=3)  # 4 batches
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[P.ProgressCallback(every_s=0, enabled=True, desc="maps")])
    trainer.fit(_Tiny(), data)
    trainer.predict(trainer.lightning_module, data)
    lines = _lines(caplog)
    fit = [LINE.match(x) for x in lines if x.startswith("fit: ") and "done" not in x]
    assert [m["done"] for m in fit] == [str(k) for k in range(1, 9)] and {m["total"] for m in fit} == {"8"}
    assert "epoch 1/2" in lines[0] and any("epoch 2/2" in x for x in lines)
    assert "fit: done 8/8 batches in " in "\n".join(lines)
    pred = [LINE.match(x) for x in lines if x.startswith("maps: ") and "done" not in x]
    assert [m["done"] for m in pred] == ["1", "2", "3", "4"] and pred[-1]["pct"] == "100.0"


def test_extraction_stage_logs_its_batches(tmp_path, caplog, monkeypatch):
    """The attention cache stage (Lightning's predict loop) logs its progress (pytest's captured stdout is not a
    terminal)."""
    monkeypatch.setenv(P.ENV, "0")
    caplog.set_level(logging.INFO, logger="probes.progress")
    sents = [[WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i % 5)] for i in range(12)]
    trainer = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    cache = extract(tiny_bert(), sents, dict(encoder="tiny", dataset="s", split="p"), tmp_path, trainer, max_tokens=24)
    assert len(cache) == 12
    lines = [x for x in _lines(caplog) if x.startswith("attention extraction: ")]
    counts = [LINE.match(x) for x in lines[:-1]]
    assert all(counts) and len(counts) >= 3, lines
    assert counts[-1]["done"] == counts[-1]["total"] and lines[-1].startswith("attention extraction: done ")


def test_training_run_without_a_terminal_logs_progress_into_its_log_file(chain_data, tmp_path):
    """`python train.py` with stdout and stderr not a terminal (captured, as under nohup or SLURM): the run's
    train.log holds the extraction child's progress lines and those of fit (done/total, rate, ETA)."""
    run = tmp_path / "run"
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.output_dir")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", **{P.ENV: "0"})
    r = subprocess.run([sys.executable, "train.py", "probe=attn_only", "trainer.max_epochs=2", *over,
                        "data.extract_in_child=true", "extract.max_tokens=256", f"hydra.run.dir={run}",
                        f"paths.output_dir={run}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (run / "train.log").read_text()
    body = [x.split(" - ", 1)[1] for x in text.splitlines() if "[probes.progress][INFO]" in x]
    extraction = [LINE.match(x) for x in body if x.startswith("attention extraction: ") and "done" not in x]
    assert extraction and all(extraction), body
    assert sum(x.startswith("attention extraction: done ") for x in body) == 3  # train, dev, test: in the child
    assert "in a child process" in text
    fit = [LINE.match(x) for x in body if x.startswith("fit: ") and "done" not in x]
    assert fit and all(fit), body
    assert fit[-1]["done"] == fit[-1]["total"] and int(fit[-1]["total"].replace(",", "")) > 2
    assert any(x.startswith("fit: done ") for x in body) and any(x.startswith("test: done ") for x in body)
