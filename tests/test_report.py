"""`python -m probes.report`: Table 3 and an analysis from real tiny runs, side-by-side encoders, provenance,
every run listed, grouped by what it read and newest first, labels from provenance (never config names), the
commands of what is not run yet, the README's Table 3 against the record of its runs, and the page in headless
Chromium."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.data.sources import Treebank, sha256_file
from probes.model.load import tiny_bert
from probes.report import write_report
from probes.report.build import load_papers, pct
from probes.report.provenance import git_commit, write_provenance
from probes.report.render import RULE, RUNS_HEAD
from probes.report.runs import UNKNOWN, pinned_files
from probes.report.tracking import analysis_inputs
from tests.conftest import ROOT, TINY_CONLLU, chain_overrides, find_browser, write_chain_treebank

TABLE3 = next(s for p in load_papers() for s in p["sections"] if s["key"] == "clark_table3")
COLS = TABLE3["columns"]


def _sweep_runs(base: Path):
    return sorted(p.parent for p in base.glob("*/metrics.json"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two Table 3 rows x two tiny encoders (one multirun); head_stats on a synthetic treebank in a folder named
    like EWT's (``analysis``), on one's own CoNLL-U file (``analysis_chain``) and a copy of the first without
    its provenance file (``analysis_noprov``)."""
    t = tmp_path_factory.mktemp("report")
    (t / "data" / "chain").mkdir(parents=True)
    for split, n, seed in (("train", 60, 0), ("dev", 20, 1), ("test", 20, 2)):
        write_chain_treebank(t / "data" / "chain" / f"chain-{split}.conllu", n, seed)
    (t / "tiny" / "ud_english_ewt").mkdir(parents=True)
    (t / "tiny" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    over = [o for o in chain_overrides(t / "data", t) if not o.startswith(("paths.output_dir", "encoder="))]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    train = subprocess.Popen(
        [sys.executable, "train.py", "-m", "experiment=table3_right_branching,table3_attn_only",
         "encoder=tiny,tiny_family", "trainer.max_epochs=1", f"hydra.sweep.dir={t / 'sweep'}", *over],
        cwd=ROOT, env=env, stdout=open(t / "train.log", "w"), stderr=subprocess.STDOUT)
    analyze = [sys.executable, "-m", "probes.analyze", "analysis=head_stats", "encoder=tiny", "logger.use_wandb=false",
               f"paths.data_dir={t / 'tiny'}", f"paths.cache_dir={t / 'acache'}", "extract.precision=32-true"]
    chain = subprocess.Popen(
        [*analyze, "data=conllu", f"data.treebank.files.dev={t / 'data' / 'chain' / 'chain-dev.conllu'}",
         f"hydra.run.dir={t / 'analysis_chain'}"], cwd=ROOT, env=env, stdout=open(t / "chain.log", "w"),
        stderr=subprocess.STDOUT)
    analysis = subprocess.run([*analyze, "data.treebank.download=false", f"hydra.run.dir={t / 'analysis'}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    assert chain.wait(timeout=600) == 0, (t / "chain.log").read_text()[-3000:]
    assert train.wait(timeout=600) == 0, (t / "train.log").read_text()[-3000:]
    shutil.copytree(t / "analysis", t / "analysis_noprov")
    (t / "analysis_noprov" / "provenance.json").unlink()
    return t


ANALYSES = ("analysis", "analysis_chain", "analysis_noprov")


def test_papers_file_is_the_experiments_paper_values():
    """Table 3's paper numbers in papers.yaml equal the `paper:` of each experiment config."""
    for row in TABLE3["experiments"]:
        exp = OmegaConf.load(ROOT / "conf" / "experiment" / f"{row['experiment']}.yaml")
        assert exp.paper.value == row["paper"], row["experiment"]


def _md_rows(md: str, section_title: str) -> tuple[list[str], dict[str, list[str]]]:
    block = md.split(f"### {section_title}", 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("|")]
    split = lambda ln: [c.strip() for c in ln.strip("|").split(" | ")]  # noqa: E731
    rows = {}
    for ln in lines[2:]:
        cells = split(ln)
        m = re.search(r"`([\w-]+)`\)$", cells[0])
        if m:
            rows[m.group(1)] = cells
    return split(lines[0]), rows


def _md_block(md: str, title: str) -> str:
    """The text of the Markdown section ``title`` (``### title`` or ``## title``) up to the next heading."""
    return re.split(r"\n##+ ", md.split(f"# {title}\n", 1)[1], maxsplit=1)[0]


def _runs_table(block: str) -> list[dict[str, str]]:
    """The rows of the runs table (header :data:`RUNS_HEAD`) in a section's Markdown, as dicts."""
    lines = [ln for ln in block.splitlines() if ln.startswith("| group | run |")]
    assert len(lines) == 1, block
    rows = block.split(lines[0], 1)[1].splitlines()[2:]
    rows = rows[:next((i for i, ln in enumerate(rows) if not ln.startswith("|")), len(rows))]
    split = lambda ln: [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])]  # noqa: E731
    out = [dict(zip(RUNS_HEAD, split(ln))) for ln in rows]
    assert all(len(r) == len(RUNS_HEAD) for r in out), rows
    return out


def _hand_run(folder: Path, finished: float, layer_means: tuple[float, float], inputs: dict | None,
              kind: str = "analysis") -> Path:
    """A finished run folder as the entry points leave it: ``.hydra/`` whose config names EWT
    (``data=ewt``, ``data.name=ud_english_ewt``) whatever was read, the outputs, ``provenance.json`` with
    ``inputs`` (None: no provenance file); its output written at ``finished``."""
    (folder / ".hydra").mkdir(parents=True)
    choices = dict(encoder="tiny", data="ewt")
    cfg = dict(encoder={"_target_": "probes.model.load.tiny_bert"}, data=dict(name="ud_english_ewt"))
    if kind == "analysis":
        choices["analysis"] = "head_stats"
        cfg["analysis"] = {"_target_": "probes.analysis.clark.head_stats.head_stats", "_partial_": True, "split": "dev"}
        out = folder / "summary.json"
        (folder / "head_stats_by_layer.csv").write_text(
            "layer,stat,mean\n" + "".join(f"{layer},{stat},{m + d}\n" for layer, m in enumerate(layer_means)
                                           for stat, d in (("cls", 0.0), ("sep", 0.5))))
        out.write_text(json.dumps(dict(analysis="head_stats", seconds=1.0)))
    else:
        choices["experiment"] = "smoke"
        cfg["probe"] = {"_target_": "probes.dependency.module.DependencyProbe"}
        out = folder / "metrics.json"
        out.write_text(json.dumps({"val/uas_best": layer_means[0], "test/uas": layer_means[1]}))
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    (folder / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(
        dict(hydra=dict(runtime=dict(choices=choices), job=dict(name="analyze" if kind == "analysis" else "train"))))))
    (folder / ".hydra" / "overrides.yaml").write_text("- analysis=head_stats\n- encoder=tiny\n" if kind == "analysis"
                                                      else "- experiment=smoke\n")
    if inputs is not None:
        write_provenance(folder, inputs)
    os.utime(out, (finished, finished))
    return folder


def test_every_run_shown_grouped_newest_first_labelled_from_provenance(tmp_path):
    """Five head_stats runs of one encoder whose configs all say EWT: two on a synthetic treebank in a folder
    named like EWT's (same file), one on another synthetic treebank, one whose provenance records the pinned
    EWT dev file, one without provenance; and a training run no section uses. All are listed, in the groups
    and order the page states; the numbers come from each group's newest run; labels come from provenance."""
    data = tmp_path / "data"
    (data / "ud_english_ewt").mkdir(parents=True)
    (data / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    (tmp_path / "own").mkdir()
    write_chain_treebank(tmp_path / "own" / "chain-dev.conllu", 10, 1)  # one's own file, outside the data folder
    ewt_cfg = OmegaConf.load(ROOT / "conf" / "treebank" / "ewt.yaml")
    ewt_like = Treebank("ud_english_ewt", data, "ud_english_ewt", dict(ewt_cfg.files), download=False)
    chain = Treebank.from_files("chain", dev=tmp_path / "own" / "chain-dev.conllu")
    enc = tiny_bert()
    cfg = OmegaConf.create(dict(analysis=dict(split="dev")))
    ewt_inputs = analysis_inputs(cfg, data, tmp_path / "cache", ewt_like, enc)
    chain_inputs = analysis_inputs(cfg, data, tmp_path / "cache", chain, enc)
    pinned_sha = OmegaConf.to_container(ewt_cfg.sha256)["dev"]
    pinned_inputs = dict(ewt_inputs, data_dir="/elsewhere", precision="32-true", data_files=dict(
        dev=dict(path="/elsewhere/ud_english_ewt/en_ewt-ud-dev.conllu", sha256=pinned_sha)))
    # what analysis_inputs records: the file of the analysis's split with its sha256, the encoder's fingerprint
    assert ewt_inputs["data_files"] == {"dev": dict(path=str(data / "ud_english_ewt" / "en_ewt-ud-dev.conllu"),
                                                    sha256=sha256_file(data / "ud_english_ewt" / "en_ewt-ud-dev.conllu"))}
    assert ewt_inputs["encoder"] == dict(name=enc.name, fingerprint=enc.fingerprint)
    t0 = 1.7e9
    root = tmp_path / "logs"
    folders = dict(
        ewt_old=_hand_run(root / "ewt_old", t0, (0.11, 0.12), ewt_inputs),
        none=_hand_run(root / "none", t0 + 10, (0.41, 0.42), None),
        chain=_hand_run(root / "chain", t0 + 30, (0.31, 0.32), chain_inputs),
        ewt_new=_hand_run(root / "ewt_new", t0 + 60, (0.21, 0.22), ewt_inputs),
        pinned=_hand_run(root / "pinned", t0 + 90, (0.01, 0.02), pinned_inputs),
        smoke=_hand_run(root / "smoke", t0 + 5, (0.5, 0.6), None, kind="train"))
    md_path, html_path = write_report([root], tmp_path / "out")
    md, html = md_path.read_text(), html_path.read_text()
    assert RULE in md and "Every run found is listed" in html and "newest run comes first" in html

    block = _md_block(md, next(s["what"] for p in load_papers() for s in p["sections"] if s.get("analysis") == "head_stats"))
    rows = _runs_table(block)
    assert [Path(r["run folder"]).name for r in rows] == ["pinned", "ewt_new", "ewt_old", "chain", "none"]
    assert [r["group"] for r in rows] == ["1", "2", "2", "3", "4"]
    assert [r["run"] for r in rows] == ["shown above", "shown above", "older", "shown above", "shown above"]
    by = {Path(r["run folder"]).name: r for r in rows}
    ewt_sha = ewt_inputs["data_files"]["dev"]["sha256"]
    chain_sha = chain_inputs["data_files"]["dev"]["sha256"]
    assert ewt_sha != pinned_sha and pinned_files()[pinned_sha] == "ud_english_ewt dev"
    # labels from provenance: the synthetic file is its path and digest, not EWT; the pinned digest is named
    assert by["ewt_new"]["data read"] == by["ewt_old"]["data read"] == f"ud_english_ewt/en_ewt-ud-dev.conllu@{ewt_sha[:8]}"
    assert by["ewt_new"]["data dir"] == str(data)
    assert by["chain"]["data read"] == f"{tmp_path / 'own' / 'chain-dev.conllu'}@{chain_sha[:8]}"  # as recorded
    assert by["pinned"]["data read"] == f"ud_english_ewt/en_ewt-ud-dev.conllu@{pinned_sha[:8]} = pinned ud_english_ewt dev"
    assert by["pinned"]["precision"] == "32-true" and by["ewt_new"]["precision"] == UNKNOWN
    for name in ("ewt_new", "ewt_old", "chain", "pinned"):
        assert by[name]["weights"] == enc.fingerprint and by[name]["encoder"] == "tiny"
    assert by["none"]["data read"] == by["none"]["weights"] == by["none"]["data dir"] == UNKNOWN
    assert by["none"]["command"] == "python -m probes.analyze analysis=head_stats encoder=tiny"  # from .hydra/
    assert all("pinned" not in r["data read"] for n, r in by.items() if n != "pinned")
    assert "ud_english_ewt" not in {c for r in rows for c in r.values()}  # the config's name labels nothing
    # one column block per data read (the two EWT-like runs share one), numbers from the newest run of each
    header = next(ln for ln in block.splitlines() if ln.startswith("| stat |"))
    cells = {ln.split(" | ")[0].strip("| "): [c.strip() for c in ln.strip("|").split(" | ")[1:-1]]
             for ln in block.split(header, 1)[1].splitlines()[2:4]}
    cols = [c.strip() for c in header.strip("|").split(" | ")[1:-1]]
    assert len(cols) == 8 and len({c.split(" (", 1)[1] for c in cols}) == 4
    want = {"pinned": 0.01, "ewt_new": 0.21, "chain": 0.31, "none": 0.41}
    short = dict(pinned=f"en_ewt-ud-dev.conllu@{pinned_sha[:8]} = pinned ud_english_ewt dev",
                 ewt_new=f"en_ewt-ud-dev.conllu@{ewt_sha[:8]}", chain=f"chain-dev.conllu@{chain_sha[:8]}", none=UNKNOWN)
    for name, m in want.items():
        i = cols.index(f"layer 1 (tiny · {short[name]})")
        assert cells["cls"][i:i + 2] == [f"{m:.3f}", f"{m + 0.01:.3f}"], (name, cols)
        assert cells["sep"][i] == f"{m + 0.5:.3f}"
    assert "0.110" not in block.split("Runs (", 1)[0]  # the older run's numbers are not the headline
    # the training run no section uses is listed too
    other = _runs_table(_md_block(md, "Other runs"))
    assert [(Path(r["run folder"]).name, r["what ran"], r["data read"]) for r in other] == \
        [("smoke", "train smoke", UNKNOWN)]
    assert md.startswith(f"# Report: the papers' tables and figures from {len(folders)} runs")


@pytest.mark.slow
def test_report_from_runs(runs, tmp_path):
    md_path, html_path = write_report([runs / "sweep", *(runs / a for a in ANALYSES)], tmp_path / "out")
    md, html = md_path.read_text(), html_path.read_text()
    header, rows = _md_rows(md, TABLE3["what"])
    jobs = _sweep_runs(runs / "sweep")
    assert len(jobs) == 4
    encoders = ["tiny", "tiny_family-bert"]  # no `name` in these configs: the choice (and family)
    assert header[1:-1] == [f"{c} ({e})" for e in encoders for c in COLS]
    for job in jobs:  # every number is metrics.json in percent with one decimal, in its encoder's column
        choices = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.runtime.choices
        metrics = json.loads((job / "metrics.json").read_text())
        cells = rows[choices.experiment]
        e = encoders.index("tiny" if choices.encoder == "tiny" else "tiny_family-bert")
        got = cells[1 + e * len(COLS): 1 + (e + 1) * len(COLS)]
        assert got == [pct(metrics[m]) for m in TABLE3["metrics"]], (job, got)
        assert cells[-1] == str(next(r["paper"] for r in TABLE3["experiments"]
                                     if r["experiment"] == choices.experiment))
    assert all(c == "-" for c in rows["table3_attn_glove"][1:-1])  # not run here
    # provenance: the job's own command, the commit, the machine
    assert "python train.py experiment=table3_attn_only encoder=tiny" in md
    assert git_commit()[:12] in md
    # every training run listed with what it read: the chain files and their digests (the config says data=ewt
    # with data.name=chain: neither labels it), the weights fingerprint and precision of the cache entries read
    tiny = instantiate(OmegaConf.load(ROOT / "conf" / "encoder" / "tiny.yaml"))
    train_rows = _runs_table(_md_block(md, TABLE3["what"]))
    assert sorted(Path(r["run folder"]).name for r in train_rows) == sorted(j.name for j in jobs)
    assert all(r["run"] == "shown above" for r in train_rows) and len({r["group"] for r in train_rows}) == 4
    digests = {s: sha256_file(runs / "data" / "chain" / f"chain-{s}.conllu")[:8] for s in ("train", "dev", "test")}
    for r in train_rows:
        assert r["data read"] == "chain/{" + ", ".join(f"chain-{s}.conllu@{d}" for s, d in digests.items()) + "}"
        assert r["data dir"] == str(runs / "data") and r["precision"] == "32-true"
        assert r["weights"] != UNKNOWN and (r["weights"] == tiny.fingerprint) == (r["encoder"] == "tiny")
    # the analyses: each treebank read is its own column block, the synthetic one in a folder named like EWT's
    # labelled by its file and digest (not as EWT, not as pinned), the one without provenance as unknown
    prov = json.loads((runs / "analysis" / "provenance.json").read_text())
    ewt_like = runs / "tiny" / "ud_english_ewt" / "en_ewt-ud-dev.conllu"
    assert prov["inputs"]["data_files"] == {"dev": dict(path=str(ewt_like), sha256=sha256_file(ewt_like))}
    assert prov["inputs"]["encoder"] == dict(name=tiny.name, fingerprint=tiny.fingerprint)
    head_stats = _md_block(md, "Figures 1, 2 and 4 (§3): attention to [CLS], [SEP] and punctuation, offsets, "
                               "entropy; layer means")
    a_rows = {Path(r["run folder"]).name: r for r in _runs_table(head_stats)}
    assert set(a_rows) == set(ANALYSES) and all(r["run"] == "shown above" for r in a_rows.values())
    assert a_rows["analysis"]["data read"] == f"ud_english_ewt/en_ewt-ud-dev.conllu@{sha256_file(ewt_like)[:8]}"
    chain_dev = runs / "data" / "chain" / "chain-dev.conllu"
    assert a_rows["analysis_chain"]["data read"] == f"{chain_dev}@{sha256_file(chain_dev)[:8]}"
    assert a_rows["analysis_noprov"]["data read"] == a_rows["analysis_noprov"]["weights"] == UNKNOWN
    assert a_rows["analysis"]["weights"] == a_rows["analysis_chain"]["weights"] == tiny.fingerprint
    assert "pinned" not in head_stats
    for data in (f"en_ewt-ud-dev.conllu@{sha256_file(ewt_like)[:8]}", f"chain-dev.conllu@{sha256_file(chain_dev)[:8]}",
                 UNKNOWN):  # its layer table per treebank read, side by side
        assert f"| layer 1 (tiny · {data}) | layer 2 (tiny · {data}) |" in head_stats
    # its figures embedded in the page, with no file links
    assert "head_stats_heatmaps" in html and html.count("data:image/png;base64,") >= 2 * len(ANALYSES)
    assert "<img" in html and 'src="' not in html.replace("src='data:", "")
    # what has not run is listed with its command
    assert "Not run yet: `python -m probes.analyze analysis=dep_heads`" in md
    assert "python -m probes.analyze analysis=coref_heads" in md.split("## Not run yet", 1)[1]


@pytest.mark.slow
def test_cli_writes_into_the_first_path(runs):
    r = subprocess.run([sys.executable, "-m", "probes.report", str(runs / "sweep"), str(runs / "analysis")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (runs / "sweep" / "report.html").exists() and (runs / "sweep" / "report.md").exists()
    bad = subprocess.run([sys.executable, "-m", "probes.report", str(runs / "nowhere")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no such run folder" in bad.stderr


RECORD = ROOT / "docs" / "results" / "table3" / "summary.csv"  # the multirun's own summary.csv, copied as is
TABLE3_PAGES = [ROOT / "README.md", ROOT / "docs" / "papers" / "clark.md"]
HIDDEN_STATE_ROWS = {"table3_structural", "table3_hidden_directed"}  # trained apart, with their own settings


def table3_rows(path: Path) -> dict[str, list[str]]:
    """The Table 3 rows of a page, ``experiment -> [dev, test, test no punct., paper]`` as shown (bold and
    footnote marks stripped): lines ``| label (`table3_x`) | ... |`` of its "Results: Clark et al. Table 3"
    section."""
    text = path.read_text()
    assert "## Results: Clark et al. Table 3" in text, f"{path.name}: no Table 3 section"
    block = text.split("## Results: Clark et al. Table 3", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for ln in block.splitlines():
        m = re.match(r"\| .*\(`(table3_\w+)`\) \|(.*)\|\s*$", ln)
        if m:
            rows[m.group(1)] = [c.strip().strip("*†") for c in m.group(2).split("|")]
    return rows


def read_record(path: Path) -> dict[str, dict[str, str]]:
    """A multirun's ``summary.csv`` (:func:`probes.summary.summarize`): ``experiment -> row``; the job column
    holds the overrides that tell the jobs apart, among them ``experiment=<name>``."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for row in rows:
        m = re.search(r"(?:^| )experiment=(\S+)", row["job"])
        assert m, f"{path}: job {row['job']!r} names no experiment= override"
        assert m.group(1) not in out, f"{path}: two jobs of {m.group(1)}"
        out[m.group(1)] = row
    return out


def table3_mismatches(shown: dict[str, list[str]], record: dict[str, dict[str, str]]) -> list[str]:
    """Every way the shown Table 3 differs from the record of its runs (empty: they agree)."""
    bad = [f"row {e} is in the record but not shown" for e in sorted(set(record) - set(shown))]
    bad += [f"row {e} is shown but not in the record" for e in sorted(set(shown) - set(record) - HIDDEN_STATE_ROWS)]
    for row in TABLE3["experiments"]:
        e = row["experiment"]
        if e not in record or e not in shown:
            continue
        rec = record[e]
        if rec["status"] != "ok":
            bad.append(f"{e}: the job's status is {rec['status']!r}")
        want = [pct(float(rec[m])) if m and rec.get(m) else "-" for m in row.get("metrics", TABLE3["metrics"])]
        if shown[e][:3] != want:
            bad.append(f"{e}: shows {shown[e][:3]}, the runs gave {want}")
        if rec.get("paper") and rec["paper"] != shown[e][-1]:
            bad.append(f"{e}: shows the paper's {shown[e][-1]}, the experiment config says {rec['paper']}")
    return bad


def test_table3_comparison_finds_a_difference(tmp_path):
    """The reader takes the summary as probes.summary writes it ('' for a metric a job lacks), and the
    comparison reports a number that differs by one in the shown decimal, and a row the record lacks."""
    path = tmp_path / "summary.csv"
    path.write_text("job,val/uas_best,val/uuas_best,test/uas,test/uas_nopunct,test/uuas,status,paper\n"
                    "experiment=table3_attn_only extract.precision=32-true,0.53,,0.52704,0.548,,ok,61\n"
                    "experiment=table3_structural,,0.732,,,0.726,ok,80\n")
    record = read_record(path)
    assert set(record) == {"table3_attn_only", "table3_structural"}
    shown = {"table3_attn_only": ["53.0", "52.7", "54.8", "61"], "table3_structural": ["73.2", "72.6", "-", "80"]}
    assert table3_mismatches(shown, record) == []
    assert table3_mismatches({**shown, "table3_attn_only": ["53.0", "52.8", "54.8", "61"]}, record) == \
        ["table3_attn_only: shows ['53.0', '52.8', '54.8'], the runs gave ['53.0', '52.7', '54.8']"]
    assert table3_mismatches({**shown, "table3_attn_glove": ["64.2", "63.9", "65.7", "77"]}, record) == \
        ["row table3_attn_glove is shown but not in the record"]


@pytest.mark.parametrize("page", TABLE3_PAGES, ids=lambda p: p.name)
def test_table3_is_the_record_of_the_runs(page):
    """Table 3 as the README and the Clark et al. page show it (dev, test, test no punct., paper) equals the
    tracked record of the multirun that made it, docs/results/table3/summary.csv, number by number."""
    assert RECORD.is_file(), (
        f"{RECORD.relative_to(ROOT)} is missing: copy there the summary.csv of the multirun that made the table "
        f"(python train.py -m 'experiment=glob(table3_*)')")
    shown = table3_rows(page)
    assert set(shown) == {r["experiment"] for r in TABLE3["experiments"]}, page.name
    for row in TABLE3["experiments"]:
        assert shown[row["experiment"]][-1] == str(row["paper"]), (page.name, row["experiment"])
    bad = table3_mismatches(shown, read_record(RECORD))
    assert not bad, f"{page.relative_to(ROOT)} against {RECORD.relative_to(ROOT)}:\n" + "\n".join(bad)


@pytest.mark.slow
def test_report_renders_in_chromium(runs, tmp_path):
    browser = find_browser()
    _, html = write_report([runs / "sweep", *(runs / a for a in ANALYSES)], tmp_path / "out")
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars"]
    png = tmp_path / "page.png"
    shot = subprocess.run(base + [f"--screenshot={png}", "--window-size=1280,1600", html.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert png.exists(), shot.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(png)  # (H, W, 3|4) floats in [0, 1]
    assert img.shape[0] == 1600 and img.shape[1] == 1280
    dark = (img[..., :3].mean(-1) < 0.5).mean()  # text, table borders and figures
    assert 0.005 < dark < 0.9 and img[..., :3].std() > 0.05
    dom = subprocess.run(base + ["--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=180)
    text = re.sub(r"<[^>]+>", " ", dom.stdout)
    assert "Table 3" in text
    for job in _sweep_runs(runs / "sweep"):
        metrics = json.loads((job / "metrics.json").read_text())
        for m in TABLE3["metrics"]:
            assert f" {pct(metrics[m])} " in text, (job, m)
    assert dom.stdout.count("<img") == sum(len(np.unique([p.name for p in (runs / a).glob("*.png")])) for a in ANALYSES)
