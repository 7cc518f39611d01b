"""Figures the pages quote from a single run are checked against the tracked record of that run, as
tests/test_report.py does for Table 3: the README's resume check against docs/results/resume/smoke.json
(written by docs/results/resume/run.sh)."""

from __future__ import annotations

import json
import re

from tests.conftest import ROOT

README = ROOT / "README.md"
RESUME_RECORD = ROOT / "docs" / "results" / "resume" / "smoke.json"
QUOTED = ("val/uas_best", "test/uas", "test/uas_nopunct")  # the metrics the README prints, in that order


def _resume_paragraph(text: str) -> str:
    """The README's resume paragraph: from the resume command's explanation to the record's test."""
    start = text.index("A killed run goes on where it stopped")
    return text[start:text.index("tests/test_records.py", start)]


def quoted_resume(text: str) -> dict[str, str]:
    """``metric -> value`` as the README prints them (``val/uas_best 56.45, test/uas 53.91, ...``)."""
    para = " ".join(_resume_paragraph(text).split())
    found = {m: re.search(rf"{re.escape(m)} (\d+\.\d+)\b", para) for m in QUOTED}
    missing = [m for m, f in found.items() if not f]
    assert not missing, f"README's resume paragraph quotes no value for {missing}"
    return {m: f.group(1) for m, f in found.items()}


def resume_mismatches(text: str, record: dict) -> list[str]:
    """Every way the README's resume paragraph differs from the record (empty: they agree)."""
    para = " ".join(_resume_paragraph(text).split())
    resumed, alone = record["metrics"]["resumed"], record["metrics"]["alone"]
    bad = []
    for m, shown in quoted_resume(text).items():
        want = f"{100 * resumed[m]:.2f}"
        if shown != want:
            bad.append(f"{m}: the README shows {shown}, the resumed run gave {want}")
    n = re.search(r"all (\d+) of its metrics", para)
    if not n or int(n.group(1)) != len(record["equal"]):
        bad.append(f"the README counts {n.group(1) if n else 'no'} equal metrics, the record {len(record['equal'])}")
    for what in (record["date"], record["commit"][:7], f"= {record['precision']['extract']['precision']}",
                 "docs/results/resume/smoke.json"):
        if what not in para:
            bad.append(f"the README's resume paragraph does not name {what!r}")
    return bad


def test_resume_record_is_a_resume_that_ended_as_the_run_left_alone():
    """The record itself: the killed run died by SIGKILL after epoch 0's checkpoints without metrics, was
    resumed from its last.ckpt, and every metric but the sys/ measurements equals the run left alone."""
    record = json.loads(RESUME_RECORD.read_text())
    killed = record["killed"]
    assert killed["exit_status"] in (137, -9) and not killed["metrics_json_left"]
    assert set(killed["checkpoints_left"]) == {"best-epoch=0.ckpt", "last.ckpt"}  # the first epoch's
    assert record["resumed_from"].endswith("checkpoints/last.ckpt")
    assert "resume=" in record["commands"]["resumed"]
    assert "PROBES_TEST_KILL_AFTER_EPOCH=0" in record["commands"]["killed"]
    resumed, alone = record["metrics"]["resumed"], record["metrics"]["alone"]
    scores = sorted(k for k in alone if "/" in k and not k.startswith("sys/"))
    assert set(resumed) == set(alone) and scores == record["equal"]
    assert {k: resumed[k] for k in scores} == {k: alone[k] for k in scores}
    assert all(k.startswith("sys/") for k in record["differ"])
    assert record["precision"]["extract"]["precision"] == record["precision"]["trainer"] == "32-true"


def test_readme_resume_check_is_the_record():
    """The README's resume figures (the three scores, how many metrics were equal, the date, commit and
    precision) are those of docs/results/resume/smoke.json."""
    assert RESUME_RECORD.is_file(), (
        f"{RESUME_RECORD.relative_to(ROOT)} is missing: run docs/results/resume/run.sh to make it")
    bad = resume_mismatches(README.read_text(), json.loads(RESUME_RECORD.read_text()))
    assert not bad, f"README.md against {RESUME_RECORD.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_resume_comparison_finds_a_difference():
    """The checker itself: a score one digit off, a wrong count and a missing date are each reported."""
    record = json.loads(RESUME_RECORD.read_text())
    text = README.read_text()
    assert resume_mismatches(text, record) == []
    shown = quoted_resume(text)["test/uas"]
    off = f"{float(shown) + 0.01:.2f}"
    para = _resume_paragraph(text)
    wrong = text.replace(para, para.replace(f"test/uas {shown}", f"test/uas {off}"))
    assert resume_mismatches(wrong, record) == [
        f"test/uas: the README shows {off}, the resumed run gave {shown}"]
    n = len(record["equal"])
    assert resume_mismatches(text.replace(f"all {n} of its metrics", f"all {n + 1} of its metrics"), record) == [
        f"the README counts {n + 1} equal metrics, the record {n}"]
    assert resume_mismatches(text.replace(record["date"], "2026-01-01"), record) == [
        f"the README's resume paragraph does not name {record['date']!r}"]


KOVALEVA = ROOT / "docs" / "papers" / "kovaleva.md"
MRPC_RECORD = ROOT / "docs" / "results" / "kovaleva" / "mrpc.json"


def mrpc_cell(text: str) -> tuple[str, str]:
    """(F1, acc) of the fine-tuned MRPC cell of Kovaleva et al.'s Table 1 on the page (``**84.3 / 76.0**``)."""
    row = next(line for line in text.splitlines() if line.startswith("| MRPC | F1 / acc |"))
    m = re.match(r"\| MRPC \| F1 / acc \| \*\*(\d+\.\d) / (\d+\.\d)\*\* \|", row)
    assert m, f"no fine-tuned F1 / acc in the MRPC row: {row}"
    return m.group(1), m.group(2)


def test_kovaleva_mrpc_cell_is_its_record():
    record = json.loads(MRPC_RECORD.read_text())
    metrics = record["metrics"]
    want = (f"{100 * metrics['val/f1_best']:.1f}", f"{100 * metrics['val/acc']:.1f}")
    assert mrpc_cell(KOVALEVA.read_text()) == want
    assert metrics["val/f1"] == metrics["val/f1_best"]  # the last epoch is the best: its acc is the best epoch's
    assert record["command"].startswith("python train.py experiment=glue_mrpc ")
    assert "kovaleva/mrpc.json" in KOVALEVA.read_text()


def test_kovaleva_mrpc_check_catches_a_wrong_cell():
    text = KOVALEVA.read_text().replace("**84.3 / 76.0**", "**84.3 / 76.1**")
    record = json.loads(MRPC_RECORD.read_text())["metrics"]
    assert mrpc_cell(text) != (f"{100 * record['val/f1_best']:.1f}", f"{100 * record['val/acc']:.1f}")
