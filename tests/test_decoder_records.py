"""The SmolLM2 results on docs/beyond/decoders.md equal the tracked records of the runs that made them.

Every record under docs/results/decoders/ is a pair ``<name>.csv`` (the run's own table, copied as is) and
``<name>.json`` (command, date, machine, wall time, commit). For each one, the page's table of that result is
parsed and every number shown is compared with the record, rounded as printed (a value exactly half-way
between two printed digits may be shown either way). Numbers beside them that were measured before the
running-text fix (columns or rows saying "before the fix") are not compared: they have no record."""

from __future__ import annotations

import csv
import json
import re
from functools import partial
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "beyond" / "decoders.md"
RECORDS = ROOT / "docs" / "results" / "decoders"
RECORD_KEYS = {"command", "date", "machine", "wall_time_s", "commit", "weights"}
SMOLLM2_NODE = ROOT / "conf" / "model" / "smollm2.yaml"  # the pinned GGUF file the runs read

# The paragraph that opens each result's section on the page (the tables up to the next bold paragraph).
ANCHORS = {
    "dep_heads": "**Heads as dependency classifiers** (`python -m probes.analyze encoder=smollm2",
    "head_stats": "**The sink: attention to the first token per layer**",
    "grad_sep": "**The no-op test** (`python -m probes.analyze encoder=smollm2",
    "table3": "**Table 3's attention rows**",
    "structural": "**The structural probe per layer**",
    "structural_raw": "**The structural probe per layer**",
    "structural_standardized": "**The structural probe per layer**",
    "structural_bos_raw": "**The structural probe per layer**",
    "first_word": "**The structural probe per layer**",
    "map_kinds": "**Map kinds on SmolLM2**",
    "sst2": "**Result: dev accuracy",
    "faithfulness_sst2": "**Which map to believe about SmolLM2's prediction**",
}


# ---------------------------------------------------------------------------------------------- page parsing

def section(text: str, anchor: str) -> str:
    """The page from ``anchor`` to the next paragraph that opens in bold, or the next heading."""
    assert anchor in text, f"{PAGE.name}: no section {anchor!r}"
    rest = text.split(anchor, 1)[1]
    return re.split(r"\n\n\*\*|\n#+ ", rest, maxsplit=1)[0]


def cell(c: str) -> str:
    """A table cell as text: bold marks removed, footnote marks stripped, the typographic minus made ASCII."""
    return c.replace("*", "").strip().strip("†").strip().replace("−", "-")


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of ``text``: (header cells, rows of cells), the separator line dropped."""
    tables, block = [], []
    for ln in [*text.splitlines(), ""]:
        if ln.startswith("|"):
            block.append([cell(c) for c in ln.strip().strip("|").split("|")])
            continue
        if block:
            assert len(block) >= 2 and set("".join(block[1])) <= set("-: "), f"not a table: {block[:2]}"
            tables.append((block[0], block[2:]))
        block = []
    return tables


def close(shown: str, value: float, decimals: int) -> bool:
    """``shown`` is ``value`` rounded to ``decimals`` places (either way at an exact half)."""
    if not re.fullmatch(r"-?\d+" + (r"\.\d{%d}" % decimals if decimals else ""), shown):
        return False
    return abs(float(shown) - value) <= 0.5 * 10 ** -decimals + 1e-9


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------- comparisons

def dep_heads_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's dep_heads table (SmolLM2's columns and the offsets) against the run's ``dep_table.csv``."""
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "relation"]
    assert len(tables) == 1, f"expected one dep_heads table, found {len(tables)}"
    head, body = tables[0]
    i_head = head.index("SmolLM2 best head")
    col = {"count": head.index("count"), "before": head.index("head before"), "acc": i_head + 1,
           "offset": head.index("best offset"), "offset_acc": head.index("offset accuracy")}
    assert head[col["acc"]] == "accuracy", head
    rec = {r["relation"]: r for r in rows}
    bad = [] if any(r[0] == "all" for r in body) else ["the row `all` is not shown"]
    for r in body:
        rel = r[0]
        if rel not in rec:
            bad.append(f"{rel}: shown but not in the record")
            continue
        x = rec[rel]
        best = f"{x['name']} {x['direction']}"
        checks = [("count", col["count"], r[col["count"]] == x["count"], x["count"]),
                  ("head before", col["before"], close(r[col["before"]], float(x["head_before"]), 2), x["head_before"]),
                  ("best head", i_head, r[i_head] == best, best),
                  ("accuracy", col["acc"], close(r[col["acc"]], 100 * float(x["accuracy"]), 1), x["accuracy"]),
                  ("best offset", col["offset"], r[col["offset"]].lstrip("+") == x["best_offset"], x["best_offset"]),
                  ("offset accuracy", col["offset_acc"],
                   close(r[col["offset_acc"]], 100 * float(x["offset_accuracy"]), 1), x["offset_accuracy"])]
        bad += [f"{rel}: {what} shows {r[i]!r}, the record has {want}" for what, i, ok, want in checks if not ok]
    return bad


HEAD_STATS_ROWS = {"to the first token": "first", "to previous token": "prev", "entropy (nats)": "entropy"}


def head_stats_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's per-layer SmolLM2 tables (layers 1-based) against ``head_stats_by_layer.csv`` (0-based, mean
    over the heads)."""
    rec = {(int(r["layer"]), r["stat"]): float(r["mean"]) for r in rows}
    n_layers = 1 + max(layer for layer, _ in rec)
    bad, shown_layers = [], set()
    for head, body in md_tables(text):
        if head[0] != "SmolLM2 layer":
            continue
        layers = [int(c) for c in head[1:]]
        shown_layers |= set(layers)
        for r in body:
            if r[0] not in HEAD_STATS_ROWS:
                continue  # e.g. a row measured before the fix
            stat = HEAD_STATS_ROWS[r[0]]
            for layer, c in zip(layers, r[1:]):
                want = rec[(layer - 1, stat)]
                if not close(c, want, 2):
                    bad.append(f"layer {layer} {stat}: shows {c}, the record has {want:.4f}")
    if shown_layers != set(range(1, n_layers + 1)):
        bad.append(f"layers shown {sorted(shown_layers)}, the record has 1..{n_layers}")
    return bad


GRAD_SEP_ROWS = {"to the first token": "first", "to . / ,": "punct", "to other tokens": "other"}


def grad_sep_mismatches(text: str, rows: list[dict[str, str]], head_stats: list[dict[str, str]] | None = None
                        ) -> list[str]:
    """The page's no-op table (mean |dL/dalpha| x 1e-3, layers 1-based) against ``grad_sep.csv`` (0-based);
    its row of attention to the first token against the head statistics' record when there is one."""
    rec = {(int(r["layer"]), r["target"]): float(r["value"]) for r in rows if r["stat"] == "mean_abs"}
    first = {int(r["layer"]): float(r["mean"]) for r in head_stats or [] if r["stat"] == "first"}
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "layer"]
    assert len(tables) == 1, f"expected one grad_sep table, found {len(tables)}"
    head, body = tables[0]
    layers = [int(c) for c in head[1:]]
    bad = []
    for r in body:
        label = r[0].replace("`", "")
        if label in GRAD_SEP_ROWS:
            for layer, c in zip(layers, r[1:]):
                want = 1e3 * rec[(layer - 1, GRAD_SEP_ROWS[label])]
                if not close(c, want, 1):
                    bad.append(f"layer {layer} {label}: shows {c}, the record has {want:.2f}")
        elif "from the head statistics" in label and first:
            for layer, c in zip(layers, r[1:]):
                if not close(c, first[layer - 1], 2):
                    bad.append(f"layer {layer} first-token attention: shows {c}, head_stats has {first[layer - 1]:.4f}")
    return bad


TABLE3_METRICS = ("val/uas_best", "test/uas", "test/uas_nopunct")


def table3_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's Table 3 rows (SmolLM2 dev, test, test no punct.) against the record's jobs, one per experiment."""
    rec = {}
    for r in rows:
        m = re.search(r"(?:^| )experiment=(\S+)", r["job"])
        assert m, f"job {r['job']!r} names no experiment= override"
        rec[m.group(1)] = r
    shown = {}
    for head, body in md_tables(text):
        for r in body:
            m = re.search(r"`experiment=(table3_\w+) encoder=smollm2`", r[0])
            if m:
                shown[m.group(1)] = r[1:4]
    bad = [f"{e}: in the record but not shown" for e in sorted(set(rec) - set(shown))]
    for e, cells in shown.items():
        if e not in rec:
            bad.append(f"{e}: shown but not in the record")
            continue
        if rec[e].get("status", "ok") != "ok":
            bad.append(f"{e}: the job's status is {rec[e]['status']!r}")
        for c, m in zip(cells, TABLE3_METRICS):
            if not close(c, 100 * float(rec[e][m]), 1):
                bad.append(f"{e} {m}: shows {c}, the record has {rec[e][m]}")
    return bad


# The row of each structural record's setting: structural (encoder.bos=true data.standardize=true), raw (neither),
# standardized (data.standardize=true), BOS raw (encoder.bos=true).
STRUCTURAL_ROWS = {"structural": "BOS + standardized", "structural_raw": "raw",
                   "structural_standardized": "standardized", "structural_bos_raw": "BOS, raw"}
STRUCTURAL_ROW = STRUCTURAL_ROWS["structural"]


def structural_mismatches(text: str, rows: list[dict[str, str]], row: str = STRUCTURAL_ROW) -> list[str]:
    """The page's SmolLM2 structural-probe row of the recorded setting, test UUAS (DSpr.) per layer, against the
    sweep's ``summary.csv`` (one job per ``data.layer=N``)."""
    rec = {}
    for r in rows:
        m = re.search(r"(?:^| )data\.layer=(\d+)", r["job"])
        assert m, f"job {r['job']!r} names no data.layer= override"
        rec[int(m.group(1))] = r
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "SmolLM2 layer"]
    assert len(tables) == 1, f"expected one SmolLM2 structural table, found {len(tables)}"
    head, body = tables[0]
    layers = [int(c) for c in head[1:]]
    shown = [r for r in body if r[0] == row]
    assert len(shown) == 1, f"expected one row {row!r}, found {len(shown)}"
    bad = []
    for layer, c in zip(layers, shown[0][1:]):
        if c in ("", "-"):
            if layer in rec:
                bad.append(f"layer {layer}: in the record but not shown")
            continue
        if layer not in rec:
            bad.append(f"layer {layer}: shows {c}, not in the record")
            continue
        m = re.fullmatch(r"(\S+) \((\S+)\)", c)
        x = rec[layer]
        if rec[layer].get("status", "ok") != "ok":
            bad.append(f"layer {layer}: the job's status is {x['status']!r}")
        if not (m and close(m.group(1), 100 * float(x["test/uuas"]), 1)
                and close(m.group(2), 100 * float(x["test/dspr"]), 1)):
            bad.append(f"layer {layer}: shows {c!r}, the record has UUAS {x['test/uuas']} DSpr. {x['test/dspr']}")
    bad += [f"layer {layer}: in the record but not a column" for layer in sorted(set(rec) - set(layers))]
    return bad


def first_word_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's table of the first word's and the other words' vectors (per setting and layer) against the
    record of ``first_word.py``."""
    rec = {(r["setting"], int(r["layer"])): r for r in rows}
    text = "\n".join(ln.strip() for ln in text.splitlines())  # the table sits inside a list item
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "setting" and "layer" in t[0]]
    assert len(tables) == 1, f"expected one first-word table, found {len(tables)}"
    head, body = tables[0]
    cols = {"first word's norm": ("first_norm_dev50", 0), "other words' norm": ("other_norm_dev50", 0),
            "largest std": ("max_std", 0), "first word, standardized": ("first_zs_median_train500", 1),
            "other words, standardized": ("other_zs_median_train500", 1)}
    bad = []
    assert {c for c in cols} <= set(head), head
    for r in body:
        key = (r[0], int(r[1]))
        if key not in rec:
            bad.append(f"{key}: shown but not in the record")
            continue
        for c, (field, decimals) in cols.items():
            shown = r[head.index(c)].replace(",", "")
            if not close(shown, float(rec[key][field]), decimals):
                bad.append(f"{key} {c}: shows {shown}, the record has {rec[key][field]}")
        if "dimension" in head and r[head.index("dimension")] != rec[key]["top_std_dims"].split()[0]:
            bad.append(f"{key} dimension: shows {r[head.index('dimension')]}, the record has {rec[key]['top_std_dims']}")
    return bad


def map_kinds_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's map-kinds table (SmolLM2's dependency and probe columns) and the sentence and dependent counts
    in its paragraph against the record (one row per kind)."""
    rec = {r["kind"]: r for r in rows}
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "kind"]
    assert len(tables) == 1, f"expected one map-kinds table, found {len(tables)}"
    head, body = tables[0]
    i_dep, i_probe = head.index("SmolLM2 dependency, best map: all (map)"), head.index("SmolLM2 attn-only probe, dev UAS")
    bad, shown = [], set()
    for r in body:
        kind = r[0].strip("`")
        shown.add(kind)
        if kind not in rec:
            bad.append(f"{kind}: shown but not in the record")
            continue
        x = rec[kind]
        m = re.fullmatch(r"(\S+) \((\S+) (\w+)\)", r[i_dep])
        if not (m and close(m.group(1), 100 * float(x["dep_accuracy"]), 1) and m.group(2) == x["dep_name"]
                and m.group(3) == x["dep_direction"]):
            bad.append(f"{kind}: dependency shows {r[i_dep]!r}, the record has {x['dep_accuracy']} "
                       f"({x['dep_name']} {x['dep_direction']})")
        if not close(r[i_probe], 100 * float(x["probe_dev_uas"]), 1):
            bad.append(f"{kind}: probe shows {r[i_probe]}, the record has {x['probe_dev_uas']}")
    bad += [f"{k}: in the record but not shown" for k in sorted(set(rec) - shown)]
    att = rec.get("attention")
    flat = " ".join(text.split())  # line breaks as spaces
    m = re.search(r"(\d+) of the first 100 dev sentences fit in 32 pieces.*?SmolLM2: ([\d,]+) dependents, best offset "
                  r"\+(\d+) at ([\d.]+)", flat)
    if att and not (m and int(m.group(1)) == int(att["n_sentences"]) and int(m.group(2).replace(",", "")) ==
                    int(att["dep_count"]) and m.group(3) == att["best_offset"]
                    and close(m.group(4), 100 * float(att["offset_accuracy"]), 1)):
        bad.append(f"the counts in the paragraph ({m.groups() if m else 'not found'}) differ from the record's "
                   f"{att['n_sentences']} sentences, {att['dep_count']} dependents, +{att['best_offset']} at "
                   f"{att['offset_accuracy']}")
    return bad


def sst2_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The fine-tune's dev accuracy and loss in the page's result paragraph against its ``metrics.json``."""
    rec = {r["metric"]: float(r["value"]) for r in rows}
    m = re.match(r" ([\d.]+)\*\* \(`val/acc` ([\d.]+), dev loss ([\d.]+)", text)
    if not m:
        return ["no `**Result: dev accuracy N** (`val/acc` N, dev loss N` in the section"]
    bad = []
    for shown, key, scale, decimals in ((m.group(1), "val/acc", 100, 1), (m.group(2), "val/acc", 1, 3),
                                        (m.group(3), "val/loss", 1, 3)):
        if not close(shown, scale * rec[key], decimals):
            bad.append(f"{key}: shows {shown}, the record has {rec[key]}")
    return bad


FAITHFULNESS_ROWS = {"∇×input": "ixg", "integrated gradients": "ig", "leave-one-out": "loo", "random": "random"}
FAITHFULNESS_COLS = {"comprehensiveness ↑": "comprehensiveness", "sufficiency ↓": "sufficiency",
                     "Spearman blank-out ↑": "spearman_blankout", "Spearman ∇×input ↑": "spearman_grad"}


def faithfulness_mismatches(text: str, rows: list[dict[str, str]]) -> list[str]:
    """The page's faithfulness table (value [95 % interval] per kind and metric) against the analysis's table."""
    rec = {r["kind"]: r for r in rows}
    tables = [t for t in md_tables(text) if t[0] and t[0][0] == "kind" and "sufficiency ↓" in t[0]]
    assert len(tables) == 1, f"expected one faithfulness table, found {len(tables)}"
    head, body = tables[0]
    bad, shown = [], set()
    for r in body:
        kind = FAITHFULNESS_ROWS.get(r[0], r[0].strip("`"))
        shown.add(kind)
        if kind not in rec:
            bad.append(f"{kind}: shown but not in the record")
            continue
        for c, field in FAITHFULNESS_COLS.items():
            cellv = r[head.index(c)]
            if cellv == "1":  # a reference against itself
                continue
            m = re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", cellv)
            want = [float(rec[kind][field + s]) for s in ("", "_lo", "_hi")]
            if not (m and all(close(g, w, 3) for g, w in zip(m.groups(), want))):
                bad.append(f"{kind} {field}: shows {cellv!r}, the record has {want}")
    bad += [f"{k}: in the record but not shown" for k in sorted(set(rec) - shown)]
    return bad


CHECKS = {"dep_heads": dep_heads_mismatches, "head_stats": head_stats_mismatches, "grad_sep": grad_sep_mismatches,
          "table3": table3_mismatches, "first_word": first_word_mismatches, "map_kinds": map_kinds_mismatches,
          "sst2": sst2_mismatches, "faithfulness_sst2": faithfulness_mismatches,
          **{name: partial(structural_mismatches, row=row) for name, row in STRUCTURAL_ROWS.items()}}


def records() -> list[str]:
    return sorted(p.stem for p in RECORDS.glob("*.csv"))


# ---------------------------------------------------------------------------------------------- tests

def test_there_are_records():
    assert records(), f"no records under {RECORDS.relative_to(ROOT)}"


@pytest.mark.parametrize("name", records())
def test_record_is_complete(name):
    """Each table has its JSON: the command that made it, when, where, how long and on which code."""
    meta = RECORDS / f"{name}.json"
    assert meta.is_file(), f"{meta.relative_to(ROOT)} is missing"
    info = json.loads(meta.read_text())
    assert RECORD_KEYS <= set(info), f"{meta.name} lacks {sorted(RECORD_KEYS - set(info))}"
    assert "encoder=smollm2" in info["command"], info["command"]
    assert read_csv(RECORDS / f"{name}.csv"), f"{name}.csv is empty"
    quantization = weights_quantization(info["weights"])
    assert quantization.lower() in yaml.safe_load(SMOLLM2_NODE.read_text())["file"].lower(), (
        f"{meta.name}: weights {info['weights']!r}, but {SMOLLM2_NODE.relative_to(ROOT)} pins another file")


def weights_quantization(weights: str) -> str:
    """The file type a record's ``weights`` names (``GGUF Q4_1 (Q4_1 79 %, Q8_0 21 % of the weights), dequantized
    to float32 on load`` -> ``Q4_1``); its tensor types' shares add up to about 100 %."""
    m = re.fullmatch(r"GGUF (\S+) \(((?:\w+ \d+ %(?:, )?)+) of the weights\), "
                     r"dequantized to float32 (on load|at fetch)", weights)
    assert m, f"weights {weights!r} is not 'GGUF <file type> (<type> <n> %, ... of the weights), dequantized to ...'"
    assert abs(sum(int(x) for x in re.findall(r"(\d+) %", m.group(2))) - 100) <= 2, weights
    return m.group(1)


def test_the_page_names_the_quantization():
    """The page says, before any result, that the SmolLM2 it reads is the 4-bit GGUF file the records name, with
    their words."""
    found = {json.loads((RECORDS / f"{n}.json").read_text())["weights"] for n in records()}
    assert len(found) == 1, found
    weights = found.pop()
    intro = " ".join(PAGE.read_text().split("## Results", 1)[0].split())  # line breaks as spaces
    assert f"`{weights}`" in intro and f"type {weights_quantization(weights)}" in intro and "4-bit" in intro


@pytest.mark.parametrize("name", records())
def test_page_shows_the_record(name):
    """The page's table of each recorded result equals the record, number by number, and links to it."""
    assert name in CHECKS, f"no comparison for the record {name}: add one to {Path(__file__).name}"
    text = PAGE.read_text()
    part = section(text, ANCHORS[name])
    assert f"results/decoders/{name}.csv" in part, f"the {name} section does not link to its record"
    rows = read_csv(RECORDS / f"{name}.csv")
    extra = {}
    if name == "grad_sep" and (RECORDS / "head_stats.csv").is_file():
        extra["head_stats"] = read_csv(RECORDS / "head_stats.csv")
    bad = CHECKS[name](part, rows, **extra)
    assert not bad, f"{PAGE.relative_to(ROOT)} against {RECORDS.relative_to(ROOT)}/{name}.csv:\n" + "\n".join(bad)


def test_a_difference_is_found():
    """The comparisons report a number one off in its last printed digit, a wrong head and a missing layer."""
    dep = [{"relation": "all", "count": "10", "name": "8-7", "direction": "head2dep", "accuracy": "0.385",
            "best_offset": "1", "offset_accuracy": "0.337", "head_before": "0.825"}]
    table = ("| relation | count | head before | SmolLM2 best head | accuracy | MiniLM best head | accuracy | best offset "
             "| offset accuracy |\n|---|---|---|---|---|---|---|---|---|\n"
             "| all | 10 | {hb} | {head} | {acc} | 3-9 dep2head | 44.7 | +1 | 33.7 |\n")
    assert dep_heads_mismatches(table.format(hb="0.83", head="8-7 head2dep", acc="38.5"), dep) == []
    assert dep_heads_mismatches(table.format(hb="0.82", head="8-7 head2dep", acc="38.5"), dep) == []  # a half
    assert len(dep_heads_mismatches(table.format(hb="0.83", head="8-7 head2dep", acc="38.6"), dep)) == 1
    assert len(dep_heads_mismatches(table.format(hb="0.83", head="12-5 head2dep", acc="38.5"), dep)) == 1
    assert len(dep_heads_mismatches(table.format(hb="0.83", head="8-7 head2dep", acc="38"), dep)) == 1
    hs = [{"layer": str(i), "stat": s, "mean": "0.5"} for i in range(2) for s in ("first", "prev", "entropy")]
    t = "| SmolLM2 layer | 1 | 2 |\n|---|---|---|\n| to the first token | 0.50 | {x} |\n| glued | 9 | 9 |\n"
    assert head_stats_mismatches(t.format(x="0.50"), hs) == []
    assert len(head_stats_mismatches(t.format(x="0.51"), hs)) == 1
    assert head_stats_mismatches("| SmolLM2 layer | 1 |\n|---|---|\n| entropy (nats) | 0.50 |\n", hs) == \
        ["layers shown [1], the record has 1..2"]
    t3 = [{"job": "experiment=table3_attn_only encoder=smollm2", "val/uas_best": "0.51", "test/uas": "0.505",
           "test/uas_nopunct": "0.5249", "status": "ok"}]
    row = "| row | dev | test | no punct |\n|---|---|---|---|\n| x (`experiment=table3_attn_only encoder=smollm2`) | {} |\n"
    assert table3_mismatches(row.format("51.0 | 50.5 | 52.5"), t3) == []
    assert len(table3_mismatches(row.format("51.0 | 50.5 | 52.4"), t3)) == 1
    assert table3_mismatches("", t3) == ["table3_attn_only: in the record but not shown"]
    st = [{"job": "data.layer=3", "test/uuas": "0.5091", "test/dspr": "0.652", "status": "ok"}]
    tab = ("| SmolLM2 layer | 0 | 3 |\n|---|---|---|\n| BOS + standardized, glued words (before the fix) | 1.0 (2.0) | "
           "3.0 (4.0) |\n| BOS + standardized | {} | {} |\n")
    assert structural_mismatches(tab.format("", "**50.9** (65.2)"), st) == []
    assert structural_mismatches(tab.format("", "50.9 (65.3)"), st) == ["layer 3: shows '50.9 (65.3)', the record has "
                                                                       "UUAS 0.5091 DSpr. 0.652"]
    assert structural_mismatches(tab.format("1.0 (2.0)", "50.9 (65.2)"), st) == \
        ["layer 0: shows 1.0 (2.0), not in the record"]
    assert structural_mismatches(tab.format("", "-"), st) == ["layer 3: in the record but not shown"]


def test_the_new_comparisons_find_a_difference():
    """The map-kinds, SST-2, faithfulness and first-word comparisons report a number one off in its last digit."""
    mk = [{"kind": "attention", "dep_accuracy": "0.393", "dep_name": "8-7", "dep_direction": "head2dep",
           "probe_dev_uas": "0.404", "n_sentences": "67", "dep_count": "984", "best_offset": "1",
           "offset_accuracy": "0.358"}]
    page = ("67 of the first 100 dev sentences fit in 32 pieces (SmolLM2: 984\ndependents, best offset +1 at 35.8)\n\n"
            "| kind | SmolLM2 dependency, best map: all (map) | SmolLM2 attn-only probe, dev UAS |\n|---|---|---|\n"
            "| `attention` | {} | {} |\n")
    assert map_kinds_mismatches(page.format("39.3 (8-7 head2dep)", "40.4"), mk) == []
    assert len(map_kinds_mismatches(page.format("39.3 (8-7 head2dep)", "40.5"), mk)) == 1
    assert len(map_kinds_mismatches(page.format("39.3 (12-5 head2dep)", "40.4"), mk)) == 1
    assert len(map_kinds_mismatches(page.replace("984", "985").format("39.3 (8-7 head2dep)", "40.4"), mk)) == 1
    sst = [{"metric": "val/acc", "value": "0.8429"}, {"metric": "val/loss", "value": "0.3593"}]
    assert sst2_mismatches(" 84.3** (`val/acc` 0.843, dev loss 0.359; x", sst) == []
    assert len(sst2_mismatches(" 84.4** (`val/acc` 0.843, dev loss 0.359; x", sst)) == 1
    fa = [{"kind": "random", **{f + s: v for f in FAITHFULNESS_COLS.values() for s, v in
                                (("", "0.093"), ("_lo", "0.05"), ("_hi", "0.145"))}}]
    row = "| kind | " + " | ".join(FAITHFULNESS_COLS) + " |\n|---|---|---|---|---|\n| random | {} |\n"
    assert faithfulness_mismatches(row.format(" | ".join(["0.093 [0.050, 0.145]"] * 4)), fa) == []
    assert len(faithfulness_mismatches(row.format(" | ".join(["0.093 [0.050, 0.146]"] * 4)), fa)) == 4
    fw = [{"setting": "raw", "layer": "3", "first_norm_dev50": "667.4", "other_norm_dev50": "94.1",
           "max_std": "163.8", "top_std_dims": "507 260 247", "first_zs_median_train500": "42.15",
           "other_zs_median_train500": "21.67"}]
    t = ("  | setting | layer | first word's norm | other words' norm | largest std | dimension | first word, standardized "
         "| other words, standardized |\n  |---|---|---|---|---|---|---|---|\n  | raw | 3 | {} | 94 | 164 | {} | 42.2 | 21.7 |\n")
    assert first_word_mismatches(t.format("667", "507"), fw) == []
    assert len(first_word_mismatches(t.format("668", "507"), fw)) == 1
    assert len(first_word_mismatches(t.format("667", "247"), fw)) == 1
