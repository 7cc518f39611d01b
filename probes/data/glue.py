"""Read the GLUE tasks shipped in `<data_dir>/glue/` (see shared/data/SOURCES.md §6).

`read_glue(task, split, data_dir)` returns a list of `GlueExample`s for task in
{cola, sst2, mrpc, stsb, rte, qqp, qnli, mnli, wnli} (all of Kovaleva et al.'s Table 1) and split in
{train, dev} (CoLA also accepts `in_domain_dev` and `out_of_domain_dev`; its `dev` is GLUE's dev set
= in-domain + out-of-domain, 527 + 516 = 1,043 rows; MNLI accepts `dev_matched` and
`dev_mismatched`, and its `dev` is `dev_matched`, GLUE's validation set).
GLUE test labels are private, so there is no labelled `test` split.

QQP, QNLI, MNLI and WNLI are not shipped with the project's data (size / licence): the user puts
GLUE's official files (the `glue_data/<TASK>/` folders of GLUE's `download_glue_data.py`, or the
zips from gluebenchmark.com) under `<data_dir>/glue/<TASK>/`; a missing file is an error naming
the path and how to get it. Official formats (tab-separated, one header line):
QQP `id qid1 qid2 question1 question2 is_duplicate` (0/1); QNLI `index question sentence label`
(`entailment`/`not_entailment`); MNLI train 12 columns, dev 16 (`index promptID pairID genre
sentence1_binary_parse sentence2_binary_parse sentence1_parse sentence2_parse sentence1 sentence2
label1 [label2..label5] gold_label`, gold label `entailment`/`neutral`/`contradiction`); WNLI
`index sentence1 sentence2 label` (0/1). String labels map to ids as in Hugging Face `glue/<task>`.

File quirks handled here: CoLA has no header (4 columns: source, label, original mark, sentence);
MRPC's header starts with a UTF-8 BOM; RTE labels are the strings `entailment`/`not_entailment`
(mapped to 0/1 as in Hugging Face `glue/rte`: 0 = entailment); STS-B scores are floats in [0, 5] in its last column.
Fields are split on tabs without any quote processing (MRPC and SST-2 contain bare `"`).
Every parse error names the file and the 1-based line number.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

TASKS = ("cola", "sst2", "mrpc", "stsb", "rte", "qqp", "qnli", "mnli", "wnli")


@dataclass(frozen=True)
class GlueExample:
    text_a: str
    text_b: str | None
    label: float | int
    idx: int


@dataclass(frozen=True)
class TaskSpec:
    name: str
    dir: str
    num_labels: int          # 1 = regression (STS-B)
    metrics: tuple[str, ...]  # metric names logged as val/<m>, test/<m>
    main_metric: str          # model selection and the headline number
    pair: bool


TASK_SPECS: dict[str, TaskSpec] = {
    "cola": TaskSpec("cola", "CoLA", 2, ("mcc",), "mcc", False),
    "sst2": TaskSpec("sst2", "SST-2", 2, ("acc",), "acc", False),
    "mrpc": TaskSpec("mrpc", "MRPC", 2, ("f1", "acc"), "f1", True),
    "stsb": TaskSpec("stsb", "STS-B", 1, ("pearson", "spearman"), "pearson", True),
    "rte": TaskSpec("rte", "RTE", 2, ("acc",), "acc", True),
    "qqp": TaskSpec("qqp", "QQP", 2, ("f1", "acc"), "f1", True),
    "qnli": TaskSpec("qnli", "QNLI", 2, ("acc",), "acc", True),
    "mnli": TaskSpec("mnli", "MNLI", 3, ("acc",), "acc", True),
    "wnli": TaskSpec("wnli", "WNLI", 2, ("acc",), "acc", True),
}

RTE_LABELS = {"entailment": 0, "not_entailment": 1}  # Hugging Face `glue/rte` (and `glue/qnli`) convention
MNLI_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}  # Hugging Face `glue/mnli` convention
# tasks whose files the project does not ship: where to get them (named in the missing-file error)
DOWNLOAD_HINT = ("GLUE's official {dir} files (e.g. `python download_glue_data.py --tasks {dir}` from "
                 "https://github.com/nyu-mll/GLUE-baselines, or {dir}.zip from https://gluebenchmark.com/tasks), "
                 "unzipped so that the .tsv files sit in {path}")

_FILES: dict[str, dict[str, list[str]]] = {
    "cola": {"train": ["in_domain_train.tsv"], "dev": ["in_domain_dev.tsv", "out_of_domain_dev.tsv"],
             "in_domain_dev": ["in_domain_dev.tsv"], "out_of_domain_dev": ["out_of_domain_dev.tsv"]},
    "sst2": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "mrpc": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "stsb": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "rte": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "qqp": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "qnli": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
    "mnli": {"train": ["train.tsv"], "dev": ["dev_matched.tsv"], "dev_matched": ["dev_matched.tsv"],
             "dev_mismatched": ["dev_mismatched.tsv"]},
    "wnli": {"train": ["train.tsv"], "dev": ["dev.tsv"]},
}

@dataclass(frozen=True)
class IntLabel:
    """An integer label column restricted to ``allowed``."""

    allowed: tuple[int, ...] = (0, 1)

    def __call__(self, s: str) -> int:
        v = int(s.strip())
        if v not in self.allowed:
            raise ValueError(f"label {s!r} not in {self.allowed}")
        return v


@dataclass(frozen=True)
class NamedLabel:
    """A string label column mapped to ids (``what`` names it in errors)."""

    labels: tuple[tuple[str, int], ...]
    what: str

    def __call__(self, s: str) -> int:
        lab, labels = s.strip(), dict(self.labels)
        if lab not in labels:
            raise ValueError(f"{self.what} {lab!r} not in {sorted(labels)}")
        return labels[lab]


@dataclass(frozen=True)
class ScoreLabel:
    """A float score column within [lo, hi] (STS-B)."""

    lo: float
    hi: float
    what: str

    def __call__(self, s: str) -> float:
        score = float(s)
        if not self.lo <= score <= self.hi:
            raise ValueError(f"{self.what} {score} outside [{self.lo:g}, {self.hi:g}]")
        return score


@dataclass(frozen=True)
class FileFormat:
    """Where a task's fields sit in its tab-separated files (0-based columns; negative = from the end)."""

    text_a: int
    text_b: int | None
    label: int
    parse_label: IntLabel | NamedLabel | ScoreLabel
    idx: int | None = None                 # the file's index column; None: the row number
    header: tuple[str, ...] | None = None  # first columns of the header line; None: no header
    last_header: str | None = None         # the header's last column, where it is checked (MNLI)
    ncols: int | None = None               # columns per row; None: as many as the header has

    def parse(self, c: list[str], row: int) -> GlueExample:
        return GlueExample(c[self.text_a].strip(), None if self.text_b is None else c[self.text_b].strip(),
                           self.parse_label(c[self.label]), row if self.idx is None else int(c[self.idx]))


_RTE = NamedLabel(tuple(RTE_LABELS.items()), "RTE label")
FORMATS: dict[str, FileFormat] = {
    "cola": FileFormat(3, None, 1, IntLabel(), ncols=4),  # no header: source, label, original mark, sentence
    "sst2": FileFormat(0, None, 1, IntLabel(), header=("sentence", "label"), ncols=2),
    "mrpc": FileFormat(3, 4, 0, IntLabel(), header=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"), ncols=5),
    "stsb": FileFormat(7, 8, 9, ScoreLabel(0.0, 5.0, "STS-B score"), idx=0,
                       header=("index", "genre", "filename", "year", "old_index", "source1", "source2",
                               "sentence1", "sentence2", "score"), ncols=10),
    "rte": FileFormat(1, 2, 3, _RTE, idx=0, header=("index", "sentence1", "sentence2", "label"), ncols=4),
    "qqp": FileFormat(3, 4, 5, IntLabel(), idx=0, header=("id", "qid1", "qid2", "question1", "question2",
                                                          "is_duplicate"), ncols=6),
    "qnli": FileFormat(1, 2, 3, NamedLabel(tuple(RTE_LABELS.items()), "QNLI label"), idx=0,
                       header=("index", "question", "sentence", "label"), ncols=4),
    # MNLI: 12 columns in train, 16 in the dev files; the gold label is the last column of both
    "mnli": FileFormat(8, 9, -1, NamedLabel(tuple(MNLI_LABELS.items()), "MNLI gold label"), idx=0,
                       header=("index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                               "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
                               "sentence2", "label1"), last_header="gold_label"),
    "wnli": FileFormat(1, 2, 3, IntLabel(), idx=0, header=("index", "sentence1", "sentence2", "label"), ncols=4),
}


class GlueFormatError(ValueError):
    pass


def task_spec(task: str) -> TaskSpec:
    key = task.lower().replace("-", "")
    if key not in TASK_SPECS:
        raise ValueError(f"unknown GLUE task '{task}'; expected one of {', '.join(TASKS)}")
    return TASK_SPECS[key]


def glue_files(task: str, split: str, data_dir: str | Path) -> list[Path]:
    spec = task_spec(task)
    splits = _FILES[spec.name]
    if split not in splits:
        hint = " (GLUE test labels are private; use dev)" if split == "test" else ""
        raise ValueError(f"GLUE task '{spec.name}' has no split '{split}'; expected one of "
                         f"{', '.join(splits)}{hint}")
    base = Path(data_dir).expanduser() / "glue" / spec.dir
    return [base / f for f in splits[split]]


def missing_file_message(task: str, split: str, path: Path) -> str:
    """The error text for a missing GLUE file: the path, and how to provide it."""
    spec = task_spec(task)
    how = DOWNLOAD_HINT.format(dir=spec.dir, path=path.parent)
    return (f"GLUE {spec.name}/{split}: file not found: {path} (set paths.data_dir or PROBES_DATA_DIR to "
            f"the folder holding glue/; this task needs {how})")


def read_glue(task: str, split: str, data_dir: str | Path) -> list[GlueExample]:
    """Examples of one GLUE task split; `idx` is the file's index column (RTE, STS-B) or the row number."""
    spec = task_spec(task)
    out: list[GlueExample] = []
    for path in glue_files(task, split, data_dir):
        if not path.is_file():
            raise FileNotFoundError(missing_file_message(spec.name, split, path))
        out.extend(_read_file(spec.name, path, start_idx=len(out)))
    return out


def _read_file(task: str, path: Path, start_idx: int) -> list[GlueExample]:
    fmt = FORMATS[task]
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data  # MRPC's header has a BOM
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise GlueFormatError(f"{path}:{lineno}: byte {data[e.start:e.start + 1]!r} is not UTF-8 "
                              f"({e.reason})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 0
    if fmt.header is not None:
        if not lines:
            raise GlueFormatError(f"{path}:1: empty file, expected a header")
        header = lines[0].rstrip("\r").split("\t")
        want = list(fmt.header)
        if header[: len(want)] != want:
            raise GlueFormatError(f"{path}:1: unexpected header {header!r}; expected {want!r}")
        if fmt.last_header is not None and header[-1] != fmt.last_header:
            raise GlueFormatError(f"{path}:1: the last header column is {header[-1]!r}; expected "
                                  f"{fmt.last_header!r}")
        first = 1
    ncols = fmt.ncols or len(lines[0].rstrip("\r").split("\t"))
    out = []
    for lineno in range(first + 1, len(lines) + 1):
        line = lines[lineno - 1].rstrip("\r")
        if not line.strip():
            continue
        cols = line.split("\t")
        where = f"{path}:{lineno}"
        if len(cols) != ncols:
            raise GlueFormatError(f"{where}: expected {ncols} tab-separated columns, found {len(cols)}")
        row = start_idx + len(out)
        try:
            out.append(fmt.parse(cols, row))
        except (ValueError, KeyError) as e:
            raise GlueFormatError(f"{where}: {e}") from None
    if not out:
        raise GlueFormatError(f"{path}: no examples (the file has {'only a header' if first else 'no rows'}); "
                              f"GLUE {task} needs at least one row")
    return out
