"""docs/beyond/long-context.md equals its records: every number of the page's tables is recomputed here from the
per-head tables of ``docs/results/long_context/<model>/`` (the mean over heads of each layer at each length) with
plain ``csv``/``json`` reads and loops, rounded as printed; the records name their command, machine and load. The
coreference tables of whole documents (``docs/results/long_coref/<model>/``: accuracy by antecedent distance, by
mention type, the run's summary) are recomputed from the mention rows of ``long_coref_mentions.csv``."""

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
    assert len(rows) == sum(len(json.loads((RECORDS / m / "summary.json").read_text())["texts"]) for m in MODELS)
    model = {"SmolLM2-135M": "smollm2", "Gemma-3-270m": "gemma3_270m", "Qwen2.5-Coder-1.5B": "qwen2_5_coder_1_5b"}
    for name, pieces, seconds, rss in rows:
        texts = json.loads((RECORDS / model[name] / "summary.json").read_text())["texts"]
        (t,) = [t for t in texts.values() if t["n_pieces"] == int(pieces.replace(",", ""))]
        assert (f"{t['seconds']:.1f}", f"{t['peak_rss_gib']:.2f}") == (seconds, rss)


# ----------------------------------------------------------------------------- coreference heads on whole documents
COREF = ROOT / "docs" / "results" / "long_coref"
COREF_MODELS = sorted(p.name for p in COREF.iterdir() if (p / "record.json").is_file()) if COREF.is_dir() else []
BASELINE_COLUMNS = ("nearest", "head_match", "rule_based")


def doubling_bucket(d: int) -> tuple[int, int]:
    """(lo, hi) of the bucket 1, 2-3, 4-7, ... that holds the distance d >= 1."""
    lo = 1
    while 2 * lo <= d:
        lo *= 2
    return lo, 2 * lo - 1


def percent(hits: list[bool]) -> str:
    return f"{100 * sum(hits) / len(hits):.1f}"


def test_the_page_shows_every_coref_record():
    assert COREF_MODELS, f"no records under {COREF}"
    text = PAGE.read_text()
    for model in COREF_MODELS:
        for unit in ("words", "pieces"):
            assert f"<!-- table:long_coref_{model}_{unit} -->" in text
        assert f"../figures/long_coref_{model}.png" in text
        assert (ROOT / "docs" / "figures" / f"long_coref_{model}.png").is_file()


@pytest.mark.parametrize("model", COREF_MODELS)
@pytest.mark.parametrize("unit", ["words", "pieces"])
def test_coref_tables_recomputed_from_the_records(model, unit):
    """Each row: the bucket, its mentions, the accuracy (%) of the head best on all mentions and of each baseline,
    and how many of its mentions have an antecedent in their 128- / 512-piece segment; from the mention rows."""
    mentions = list(csv.DictReader(open(COREF / model / "long_coref_mentions.csv")))
    heads = [r for r in csv.DictReader(open(COREF / model / "long_coref.csv")) if r["unit"] == unit]
    overall = [r for r in heads if r["bucket"] == "all"]
    best = max(overall, key=lambda r: float(r["accuracy"]))  # the first of the best, in (layer, head) order
    name = f"{int(best['layer']) + 1}-{int(best['head']) + 1}"
    summary = json.loads((COREF / model / "summary.json").read_text())
    assert summary["best_head"]["name"] == name
    groups: dict[tuple[int, int], list[dict]] = {}
    for m in mentions:
        groups.setdefault(doubling_bucket(int(m[f"distance_{unit}"])), []).append(m)
    want = []
    for key, ms in [(None, mentions), *sorted(groups.items())]:
        label = "all" if key is None else (str(key[0]) if key[0] == key[1] else f"{key[0]}-{key[1]}")
        cells = [label, f"{len(ms):,}", percent([m["best_head"] == "True" for m in ms])]
        cells += [percent([m[b] == "True" for m in ms]) for b in BASELINE_COLUMNS]
        cells += [f"{sum(m[f'within_{s}'] == 'True' for m in ms):,}" for s in (128, 512)]
        want.append(cells)
        # the best head's accuracy in the per-head table agrees with its hits in the mention rows
        if key is not None:
            (row,) = [r for r in heads
                      if r["bucket"] == label and (r["layer"], r["head"]) == (best["layer"], best["head"])]
            assert int(row["count"]) == len(ms)
            assert float(row["accuracy"]) == pytest.approx(sum(m["best_head"] == "True" for m in ms) / len(ms))
    table = page_table(f"long_coref_{model}_{unit}")
    assert table[0] == [f"distance ({unit})", "mentions", f"best head {name}", "nearest", "head_match", "rule_based",
                        "in a 128-piece segment", "in a 512-piece segment"]
    assert table[1:] == want


@pytest.mark.parametrize("model", COREF_MODELS)
def test_coref_summary_table_and_record(model):
    rec = json.loads((COREF / model / "record.json").read_text())
    summary = json.loads((COREF / model / "summary.json").read_text())
    mentions = list(csv.DictReader(open(COREF / model / "long_coref_mentions.csv")))
    assert {"command", "date", "wall_time_s", "machine", "cpus", "load_average", "name", "max_rss_gib"} <= set(rec)
    assert f"encoder={model}" in rec["command"] and "analysis=long_coref" in rec["command"]
    assert rec["documents_run"] == summary["n_documents"] == len({m["doc_id"] for m in mentions})
    assert rec["skipped"] == summary["skipped"]
    pieces = [d["n_pieces"] for d in summary["documents"].values()]
    seconds = [d["seconds"] for d in summary["documents"].values()]
    want = [f"{len(pieces)}", f"{len(mentions):,}", f"{min(pieces):,}-{max(pieces):,}",
            *(f"{sum(m[f'within_{s}'] != 'True' for m in mentions):,}" for s in (128, 512)),
            f"{sum(seconds) / len(seconds):.1f}", f"{rec['wall_time_s']:,}", f"{rec['max_rss_gib']:.2f}"]
    table = page_table(f"long_coref_{model}_summary")
    assert table[0] == ["documents", "mentions", "pieces per document", "antecedent outside its 128-piece segment",
                        "antecedent outside its 512-piece segment", "seconds per document", "wall time (s)",
                        "peak RSS GiB"]
    assert table[1:] == [want]


@pytest.mark.parametrize("model", COREF_MODELS)
def test_coref_types_table_recomputed_from_the_records(model):
    """Per mention type, nearest antecedent nearer / farther than 128 words: the mentions and the accuracy (%) of
    the best head and of each baseline, from the mention rows."""
    mentions = list(csv.DictReader(open(COREF / model / "long_coref_mentions.csv")))
    name = json.loads((COREF / model / "summary.json").read_text())["best_head"]["name"]
    want = []
    for mtype in ("pronoun", "proper", "nominal"):
        for label, far in (("< 128 words", False), (">= 128 words", True)):
            ms = [m for m in mentions if m["mention_type"] == mtype and (int(m["distance_words"]) >= 128) == far]
            want.append([mtype, label, f"{len(ms):,}",
                         *(percent([m[c] == "True" for m in ms]) for c in ("best_head", *BASELINE_COLUMNS))])
    table = page_table(f"long_coref_{model}_types")
    assert table[0] == ["mention type", "nearest antecedent", "mentions", f"best head {name}", "nearest",
                        "head_match", "rule_based"]
    assert table[1:] == want


# ----------------------------------------------------------------------------- SmolLM2 on three sources
SOURCES = (("GUM", RECORDS / "smollm2"), ("EWT", RECORDS / "sources" / "smollm2_ewt"),
           ("LitBank", RECORDS / "sources" / "smollm2_litbank"))


def test_sources_table_recomputed_from_the_records():
    """Every cell of the page's sources table: per length, the mean over layers 1-12 / 13-30 (1-based) and heads of
    the per-head records, and the text's pieces and documents from summary.json."""
    text = PAGE.read_text()
    m = re.search(r"<!-- table:smollm2_sources -->(.*?)<!-- /table:smollm2_sources -->", text, re.S)
    assert m, "no sources table"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(1).strip().splitlines()][2:]
    want = []
    for name, folder in SOURCES:
        rec = json.loads((folder / "record.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
        assert rec["lengths_run"] == summary["lengths_run"] and "encoder=smollm2" in rec["command"]
        assert summary["source"] == name.lower() and {"machine", "date", "load_average"} <= set(rec)
        heads = list(csv.DictReader(open(folder / "long_context.csv")))
        for n in summary["lengths_run"]:
            at = [r for r in heads if int(r["length"]) == n]
            low, high = [r for r in at if int(r["layer"]) < 12], [r for r in at if int(r["layer"]) >= 12]
            t = summary["texts"][str(n)]

            def mean(rs, k):
                return sum(float(r[k]) for r in rs) / len(rs)

            want.append([name, f"{t['n_pieces']:,}", str(t["n_documents"]), f"{mean(low, 'cls'):.3f}",
                         f"{mean(high, 'cls'):.3f}", f"{mean(at, 'entropy'):.2f}", f"{mean(low, 'distance'):.0f}",
                         f"{mean(high, 'distance'):.0f}"])
    assert rows == want
