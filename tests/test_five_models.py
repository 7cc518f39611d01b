"""docs/beyond/five-models.md equals the survey's records, and the survey command runs, records and resumes.

The page's tables are parsed from the Markdown and every number is recomputed here from the record files
(``docs/results/five_models/<model>/<step>/``) with plain ``csv``/``json`` reads and loops, rounded as printed.
The survey itself (``python -m probes.survey``, ``conf/survey.yaml``) runs on a tiny random BERT with a few
sentences: its records, their commands, the skip of a recorded step and its errors.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import yaml
from hydra import compose, initialize_config_dir

import probes.resolvers  # noqa: F401  (registers ${python:}, as the command's entry does)
from probes.survey import run_survey
from tests.conftest import ROOT, require_shared, shared_data_dir

PAGE = ROOT / "docs" / "beyond" / "five-models.md"
RECORDS = ROOT / "docs" / "results" / "five_models"
MODELS = ("minilm", "mpnet_base", "smollm2", "gemma3_270m", "qwen2_5_coder_1_5b")
STEPS = ("head_stats", "sink", "grad_sep", "dep_heads", "coref_heads", "clustering", "table3_attn_only",
         "table3_attn_glove", "structural", "view")
RECORD_KEYS = {"command", "date", "machine", "wall_time_s", "commit", "sizes", "name", "num_layers"}


# ---------------------------------------------------------------------------------------------- reading
def block(name: str) -> list[list[str]]:
    """The rows (cells) of the table between the page's markers of ``name``, header first, separator dropped."""
    text = PAGE.read_text()
    m = re.search(rf"<!-- survey:{name} -->\n(.*?)<!-- /survey:{name} -->", text, re.S)
    assert m, f"{PAGE.name}: no block {name}"
    lines = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    assert len(rows) >= 2 and set("".join(rows[1])) <= set("-: "), f"{name}: not a table"
    return [rows[0], *rows[2:]]


def rows_by_first(name: str) -> dict[str, list[str]]:
    return {r[0]: r for r in block(name)[1:]}


def read_rows(model: str, step: str, file: str) -> list[dict[str, str]]:
    with open(RECORDS / model / step / file, newline="") as f:
        return list(csv.DictReader(f))


def read_json(model: str, step: str, file: str = "summary.json") -> dict:
    return json.loads((RECORDS / model / step / file).read_text())


def record(model: str, step: str) -> dict:
    return read_json(model, step, "record.json")


def shown(cell: str, value: float, decimals: int) -> bool:
    """``cell`` is ``value`` rounded to ``decimals`` places (either way at an exact half)."""
    if not re.fullmatch(r"-?\d+\.\d{%d}" % decimals, cell):
        return False
    return abs(float(cell) - value) <= 0.5 * 10 ** -decimals + 1e-9


def layer_means(model: str, stat: str) -> list[float]:
    """Mean over heads per layer of one head statistic, layers in order."""
    rows = sorted((int(r["layer"]), float(r["mean"])) for r in read_rows(model, "head_stats", "head_stats_by_layer.csv")
                  if r["stat"] == stat)
    return [v for _, v in rows]


def names() -> dict[str, str]:
    return {m: record(m, "head_stats")["name"] for m in MODELS}


# ---------------------------------------------------------------------------------------------- records
@pytest.mark.parametrize("model", MODELS)
def test_every_step_has_a_record(model):
    for step in STEPS:
        rec = record(model, step)
        assert RECORD_KEYS <= set(rec), f"{model}/{step}: record.json lacks {RECORD_KEYS - set(rec)}"
        assert f"encoder={model}" in rec["command"].split(), rec["command"]
        assert rec["wall_time_s"] > 0


def weights(model: str) -> str | None:
    """The ``weights`` field of the model's records (the sink step's, rerun since the field exists); every other
    record that holds it agrees."""
    want = record(model, "sink")["weights"]
    for s in STEPS:
        assert record(model, s).get("weights", want) == want, (model, s)
    return want


def test_models_table():
    rows, n = rows_by_first("models"), names()
    assert set(rows) == set(n.values())
    for m in MODELS:
        r, rec = rows[n[m]], record(m, "head_stats")
        assert r[1] == ("decoder" if rec["causal"] else "encoder")
        assert r[2] == f"{rec['num_layers']} x {rec['num_heads']}"
        assert r[3] == (weights(m) or "as published")
        assert r[4] == read_json(m, "grad_sep")["objective"]
        sizes = rec["sizes"]
        assert r[5] == f"{sizes['train']} / {sizes['dev']} / {sizes['test']}"
        assert r[6] == f"{sizes['clustering']} / {sizes['grad']} / {sizes['windows']}"
        assert shown(r[7], sum(record(m, s)["wall_time_s"] for s in STEPS) / 60, 1), (m, r[7])
        for s in STEPS:  # every step of a model ran with the same sizes
            assert record(m, s)["sizes"] == sizes, (m, s)


@pytest.mark.parametrize("model", MODELS)
def test_the_decoders_weights_are_their_gguf_quantization(model):
    """Each decoder's record names the quantization read from its GGUF file's header, the one its pinned file
    name (conf/model/<model>.yaml, chosen from the package by hand) names too; the encoders' weights are as
    published."""
    w = weights(model)
    if not record(model, "sink")["causal"]:
        assert w is None
        return
    m = re.fullmatch(r"GGUF (\S+) \((?:\w+ \d+ %(?:, )?)+ of the weights\), dequantized to float32 at fetch", w or "")
    assert m, (model, w)
    node = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    assert node["file"].endswith(".gguf") and m.group(1).lower() in node["file"].lower(), (model, w, node["file"])


def test_attention_table():
    rows, n = rows_by_first("attention"), names()
    for m in MODELS:
        r = rows[n[m]]
        stats = {x["stat"] for x in read_rows(m, "head_stats", "head_stats_by_layer.csv")}
        first = [s for s in ("cls", "bos", "first") if s in stats]
        assert r[1] == first[0]
        f = layer_means(m, first[0])
        assert shown(r[2], mean(f), 2), (m, r[2], mean(f))
        top = max(range(len(f)), key=lambda i: f[i])
        assert r[3] == f"{f[top]:.2f} ({top + 1})" or shown(r[3].split()[0], f[top], 2) and r[3].endswith(f"({top + 1})")
        assert (r[4] == "–") == ("sep" not in stats)
        if "sep" in stats:
            assert shown(r[4], mean(layer_means(m, "sep")), 2)
        assert shown(r[5], mean(layer_means(m, "punct")), 2)
        e = layer_means(m, "entropy")
        assert shown(r[6], e[0], 2) and shown(r[7], e[-1], 2)


def test_sink_table():
    """Gu et al.'s rate from each head's share of windows above 0.3 (sink.csv ``windows_above``: every head has
    the same number of windows, so the mean of the shares is the mean over windows, layers and heads), the share of
    heads whose mean alpha is above 0.3, and the layers whose own rate exceeds 1/2."""
    rows, n = rows_by_first("sink"), names()
    for m in MODELS:
        r, s = rows[n[m]], read_json(m, "sink")
        heads = read_rows(m, "sink", "sink.csv")
        assert s["threshold"] == 0.3 and s["window"] == 64 and s["n_windows"] == 100
        assert "sail-sg/Attention-Sink" in s["sink_rate_definition"]
        for x in heads:  # a share of 100 windows
            assert abs(100 * float(x["windows_above"]) - round(100 * float(x["windows_above"]))) < 1e-6, x
        rate = mean(float(x["windows_above"]) for x in heads)
        share = sum(float(x["alpha"]) > 0.3 for x in heads) / len(heads)
        assert abs(s["sink_rate"] - rate) < 1e-9 and abs(s["share_mean_alpha_above"] - share) < 1e-9, m
        assert shown(r[2], 100 * rate, 1), (m, r[2], rate)
        assert shown(r[3], 100 * share, 1), (m, r[3], share)
        per_layer: dict[int, list[dict[str, str]]] = {}
        for x in heads:
            per_layer.setdefault(int(x["layer"]), []).append(x)
        layer_rate = {l: mean(float(x["windows_above"]) for x in h) for l, h in per_layer.items()}
        for x in read_rows(m, "sink", "sink_by_layer.csv"):
            assert abs(float(x["sink_rate"]) - layer_rate[int(x["layer"])]) < 1e-9, (m, x)
        most = [l for l in sorted(layer_rate) if layer_rate[l] > 0.5]
        assert r[4] == f"{len(most)} of {len(per_layer)}"
        assert r[5] == (str(most[0] + 1) if most else "–")
        assert shown(r[6], mean(mean(float(x["alpha"]) for x in h) for h in per_layer.values()), 2)


def test_grad_sep_table():
    rows, n = rows_by_first("grad_sep"), names()
    for m in MODELS:
        r = rows[n[m]]
        vals: dict[str, list[float]] = {}
        for x in read_rows(m, "grad_sep", "grad_sep.csv"):
            if x["stat"] == "mean_abs":
                vals.setdefault(x["target"], []).append(float(x["value"]))
        sink = "first" if "first" in vals else "sep"
        assert r[1] == read_json(m, "grad_sep")["objective"]
        assert r[2] == {"first": "first token", "sep": "[SEP]"}[sink]
        for cell, t in zip(r[3:6], (sink, "punct", "other")):
            want = mean(vals[t])
            assert re.fullmatch(r"\d\.\d\de-\d\d", cell) and abs(float(cell) - want) <= 0.0051 * 10 ** math.floor(
                math.log10(want)), (m, t, cell, want)
        assert shown(r[6], mean(vals[sink]) / mean(vals["other"]), 2)
        L = len(vals["other"])
        lo, hi = L // 4, 3 * L // 4  # the middle half of the layers, 0-based [lo, hi)
        assert shown(r[7], mean(vals[sink][lo:hi]) / mean(vals["other"][lo:hi]), 2), (m, r[7])


def test_dep_heads_table():
    head, *body = block("dep_heads")
    n = names()
    assert head[1:] == [n[m] for m in MODELS]
    assert body and body[0][0] == "all"
    for r in body:
        for m, cell in zip(MODELS, r[1:]):
            x = {row["relation"]: row for row in read_rows(m, "dep_heads", "dep_table.csv")}[r[0]]
            got = re.fullmatch(r"(\d+\.\d) \((\d+-\d+)\) / (\d+\.\d)", cell)
            assert got, (m, r[0], cell)
            assert shown(got.group(1), 100 * float(x["accuracy"]), 1)
            assert got.group(2) == x["name"]
            assert shown(got.group(3), 100 * float(x["offset_accuracy"]), 1)


def test_coref_table():
    rows, n = rows_by_first("coref_heads"), names()
    for m in MODELS:
        r = rows[n[m]]
        t = {x["method"]: x for x in read_rows(m, "coref_heads", "coref_table.csv")}
        assert r[1] == t["best_head"]["name"]
        for cell, g in zip(r[2:6], ("all", "pronoun", "proper", "nominal")):
            assert shown(cell, 100 * float(t["best_head"][g]), 1), (m, g, cell)
        for cell, method in zip(r[6:9], ("nearest", "head_match", "rule_based")):
            assert shown(cell, 100 * float(t[method]["all"]), 1), (m, method, cell)
        assert r[9] == str(int(float(t["best_head"]["n_all"])))
        assert r[10] == str(read_json(m, "coref_heads")["n_long_sentences"])


def test_probes_table():
    rows, n = rows_by_first("probes"), names()
    for m in MODELS:
        r = rows[n[m]]
        assert shown(r[1], 100 * read_json(m, "table3_attn_only", "metrics.json")["test/uas"], 1)
        assert shown(r[2], 100 * read_json(m, "table3_attn_glove", "metrics.json")["test/uas"], 1)
        jobs = [x for x in read_rows(m, "structural", "summary.csv") if x["status"] == "ok"]
        best = max(jobs, key=lambda x: float(x["val/uuas_best"]))
        layer = int(re.search(r"data\.layer=(\d+)", best["job"]).group(1))
        L = record(m, "structural")["num_layers"]
        assert r[3] == f"{layer} of {L} ({layer / L:.2f})"
        assert shown(r[4], 100 * float(best["test/uuas"]), 1)
        assert r[5] == str(len(jobs)) and len(jobs) >= 5


def test_clustering_table():
    rows, n = rows_by_first("clustering"), names()
    for m in MODELS:
        r, s = rows[n[m]], read_json(m, "clustering")
        assert shown(r[1], 100 * s["nearest_neighbour_same_layer"], 1)
        assert shown(r[2], 100 * s["nearest_neighbour_same_layer_chance"], 1)
        counts = dict(c.rsplit(" ", 1) for c in r[3].split(", "))
        emb = read_rows(m, "clustering", "head_embedding.csv")
        want: dict[str, int] = {}
        for x in emb:
            want[x["behaviour"]] = want.get(x["behaviour"], 0) + 1
        assert {k: int(v) for k, v in counts.items()} == want


def test_views_linked_and_self_contained():
    head, *body = block("views")
    n = names()
    for m, r in zip(MODELS, body):
        assert r[0] == n[m]
        link = re.search(r"\]\(([^)]+)\)", r[1]).group(1)
        html = (PAGE.parent / link).resolve()
        assert html == (RECORDS / m / "view" / "view.html").resolve()
        text = html.read_text()
        assert "<html" in text.lower() and not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
        assert f"{n[m]}: " in text  # the view's title names the model


# ---------------------------------------------------------------------------------------------- the command
TINY = ("encoder=tiny", "sizes.dev=6", "sizes.train=8", "sizes.test=6")


def survey_env(tmp_path: Path) -> dict[str, str]:
    return {"PROBES_CACHE_DIR": str(tmp_path / "cache"), "WANDB_MODE": "offline",
            "PROBES_DATA_DIR": str(shared_data_dir())}


def survey(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m probes.survey`` on the tiny BERT, its records and run folders under ``tmp_path``."""
    return subprocess.run([sys.executable, "-m", "probes.survey", f"records_dir={tmp_path / 'rec'}",
                           f"work_dir={tmp_path / 'work'}", *TINY, *args],
                          cwd=ROOT, env={**os.environ, **survey_env(tmp_path)}, capture_output=True, text=True,
                          timeout=900)


def survey_here(tmp_path: Path, *args: str) -> dict:
    """:func:`probes.survey.run_survey` in this process on conf/survey.yaml with the same overrides as
    :func:`survey` (what the command's main does; its steps still run as child processes)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="survey", overrides=[f"records_dir={tmp_path / 'rec'}",
                                                       f"work_dir={tmp_path / 'work'}", *TINY, *args])
    return run_survey(cfg, "tiny")


def test_survey_records_and_resumes(tmp_path, monkeypatch, caplog):
    """The command records a step; the same survey again skips it; another size reruns it and replaces its
    record; a failing step is an error naming it, and leaves the earlier record as it was."""
    require_shared("ud_english_ewt")
    p = survey(tmp_path, "only=[head_stats]")
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text())
    assert rec["command"].startswith("python -m probes.analyze ") and "analysis=head_stats" in rec["command"]
    assert "analysis.max_sentences=6" in rec["command"] and "encoder=tiny" in rec["command"]
    assert rec["sizes"]["dev"] == 6 and rec["num_layers"] == 2 and rec["causal"] is False
    assert rec["weights"] is None  # a checkpoint as published (a random tiny BERT here), not a GGUF file
    for f in ("head_stats_by_layer.csv", "head_stats.csv", "summary.json"):
        assert (tmp_path / "rec" / "tiny" / "head_stats" / f).stat().st_size > 0
    with open(tmp_path / "rec" / "tiny" / "head_stats" / "head_stats_by_layer.csv") as f:
        assert {r["layer"] for r in csv.DictReader(f)} == {"0", "1"}
    before = (tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text()
    for k, v in survey_env(tmp_path).items():  # the steps' child processes read them
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="probes.survey.run"):
        out = survey_here(tmp_path, "only=[head_stats]")
    assert "recorded, skipped" in caplog.text and out["head_stats"] == json.loads(before)
    assert (tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text() == before
    survey_here(tmp_path, "only=[head_stats]", "+model_sizes.tiny.dev=5")  # another command: run again, replaced
    assert "analysis.max_sentences=5" in json.loads(
        (tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text())["command"]
    # a failing step (a child that exits 3, its command changed so that it runs): an error naming it, its earlier
    # record left as it was, no half-written record
    before = (tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text()
    with pytest.raises(RuntimeError, match=r"survey tiny: 1 of 1 steps failed:\nsurvey step 'head_stats' failed "
                                           r"\(exit 3\): python -c 'raise SystemExit\(3\)' "):
        survey_here(tmp_path, "only=[head_stats]",
                    f"entries.analyze.argv=['{sys.executable}','-c','raise SystemExit(3)']")
    assert (tmp_path / "rec" / "tiny" / "head_stats" / "record.json").read_text() == before
    assert sorted(x.name for x in (tmp_path / "rec" / "tiny").iterdir()) == ["head_stats"]


@pytest.mark.parametrize("args, error", [
    (["only=[head_stat]"], "only: ['head_stat'] are not steps"),
    (["~own_loss.tiny"], "own_loss: no entry for encoder=tiny"),
    (["+model_sizes.tiny.dve=3"], "model_sizes.tiny: ['dve'] are not keys of sizes")])
def test_survey_errors_name_the_key(tmp_path, args, error):
    """A wrong key of conf/survey.yaml is an error naming it before any step runs."""
    with pytest.raises(ValueError, match=re.escape(error)):
        survey_here(tmp_path, *args)
    assert not (tmp_path / "rec").exists() and not (tmp_path / "work").exists()
