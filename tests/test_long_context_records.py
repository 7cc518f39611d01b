"""docs/beyond/long-context.md equals its records: every number of the page's tables is recomputed here from the
per-head tables of ``docs/results/long_context/<model>/`` (the mean over heads of each layer at each length) with
plain ``csv``/``json`` reads and loops, rounded as printed; the records name their command, machine and load."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "beyond" / "long-context.md"
RECORDS = ROOT / "docs" / "results" / "long_context"
MODELS = sorted(p.name for p in RECORDS.iterdir() if (p / "record.json").is_file()) if RECORDS.is_dir() else []
STATS = (("first-token share", "cls", 3), ("entropy", "entropy", 2), ("distance", "distance", 0))


def page_table(model: str) -> list[list[str]]:
    """The cells of the page's table of ``model`` (between its markers), header first, separator dropped."""
    text = PAGE.read_text()
    m = re.search(rf"<!-- table:{model} -->(.*?)<!-- /table:{model} -->", text, re.S)
    assert m, f"{PAGE}: no table of {model}"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(1).strip().splitlines()]
    return [rows[0]] + rows[2:]


def test_the_page_shows_every_recorded_model():
    assert MODELS, f"no records under {RECORDS}"
    text = PAGE.read_text()
    for model in MODELS:
        assert f"<!-- table:{model} -->" in text
        assert f"../figures/long_context_{model}.png" in text
        assert (ROOT / "docs" / "figures" / f"long_context_{model}.png").is_file()


@pytest.mark.parametrize("model", MODELS)
def test_tables_recomputed_from_the_records(model):
    heads = list(csv.DictReader(open(RECORDS / model / "long_context.csv")))
    sums: dict[tuple[int, int], dict[str, float]] = {}
    count: dict[tuple[int, int], int] = {}
    pieces: dict[int, int] = {}
    for r in heads:
        key = (int(r["length"]), int(r["layer"]))
        pieces[int(r["length"])] = int(r["n_pieces"])
        count[key] = count.get(key, 0) + 1
        acc = sums.setdefault(key, {k: 0.0 for _, k, _ in STATS})
        for _, k, _ in STATS:
            acc[k] += float(r[k])
    lengths = sorted(pieces)
    layers = sorted({l for _, l in sums})
    table = page_table(model)
    want_head = ["layer"] + [f"{name} @ {pieces[n]}" for name, _, _ in STATS for n in lengths]
    assert table[0] == want_head
    assert [int(row[0]) for row in table[1:]] == [l + 1 for l in layers]
    for row in table[1:]:
        l = int(row[0]) - 1
        want = [f"{sums[(n, l)][k] / count[(n, l)]:.{d}f}" for _, k, d in STATS for n in lengths]
        assert row[1:] == want, (model, l)


@pytest.mark.parametrize("model", MODELS)
def test_records_are_complete(model):
    rec = json.loads((RECORDS / model / "record.json").read_text())
    summary = json.loads((RECORDS / model / "summary.json").read_text())
    assert {"command", "date", "wall_time_s", "machine", "cpus", "load_average", "name"} <= set(rec)
    assert f"encoder={model}" in rec["command"] and "analysis=long_context" in rec["command"]
    assert rec["lengths_run"] == summary["lengths_run"] and rec["skipped"] == summary["skipped"]
    by_layer = list(csv.DictReader(open(RECORDS / model / "long_context_by_layer.csv")))
    assert sorted({int(r["length"]) for r in by_layer}) == summary["lengths_run"]
    for n, t in summary["texts"].items():
        assert t["n_pieces"] <= int(n) and t["seconds"] > 0


def test_cost_table_is_the_records():
    text = PAGE.read_text()
    rows = re.findall(r"^\| (SmolLM2-135M|Gemma-3-270m|Qwen2.5-Coder-1.5B) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert len(rows) == 8
    model = {"SmolLM2-135M": "smollm2", "Gemma-3-270m": "gemma3_270m", "Qwen2.5-Coder-1.5B": "qwen2_5_coder_1_5b"}
    for name, pieces, seconds, rss in rows:
        texts = json.loads((RECORDS / model[name] / "summary.json").read_text())["texts"]
        (t,) = [t for t in texts.values() if t["n_pieces"] == int(pieces.replace(",", ""))]
        assert (f"{t['seconds']:.1f}", f"{t['peak_rss_gib']:.2f}") == (seconds, rss)
