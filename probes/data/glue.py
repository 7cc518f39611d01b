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

# header (first columns checked) for files that have one
_HEADERS = {
    "sst2": ["sentence", "label"],
    "mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
             "sentence2", "score"],
    "rte": ["index", "sentence1", "sentence2", "label"],
    "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "qnli": ["index", "question", "sentence", "label"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1"],
    "wnli": ["index", "sentence1", "sentence2", "label"],
}
_LAST_HEADER = {"mnli": "gold_label"}
# columns per row; None = as many as the header has (MNLI: 12 in train, 16 in the dev files)
_NCOLS = {"cola": 4, "sst2": 2, "mrpc": 5, "stsb": 10, "rte": 4, "qqp": 6, "qnli": 4, "mnli": None, "wnli": 4}


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
    with open(path, encoding="utf-8-sig", newline="") as f:   # utf-8-sig drops MRPC's BOM
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 0
    if task in _HEADERS:
        if not lines:
            raise GlueFormatError(f"{path}:1: empty file, expected a header")
        header = lines[0].rstrip("\r").split("\t")
        want = _HEADERS[task]
        if header[: len(want)] != want:
            raise GlueFormatError(f"{path}:1: unexpected header {header!r}; expected {want!r}")
        if task in _LAST_HEADER and header[-1] != _LAST_HEADER[task]:
            raise GlueFormatError(f"{path}:1: the last header column is {header[-1]!r}; expected "
                                  f"{_LAST_HEADER[task]!r}")
        first = 1
    ncols = _NCOLS[task] or len(lines[0].rstrip("\r").split("\t"))
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
            out.append(_parse(task, cols, row))
        except (ValueError, KeyError) as e:
            raise GlueFormatError(f"{where}: {e}") from None
    return out


def _int_label(s: str, allowed=(0, 1)) -> int:
    v = int(s.strip())
    if v not in allowed:
        raise ValueError(f"label {s!r} not in {allowed}")
    return v


def _named_label(s: str, labels: dict[str, int], what: str) -> int:
    lab = s.strip()
    if lab not in labels:
        raise ValueError(f"{what} {lab!r} not in {sorted(labels)}")
    return labels[lab]


def _parse(task: str, c: list[str], row: int) -> GlueExample:
    if task == "cola":
        return GlueExample(c[3].strip(), None, _int_label(c[1]), row)
    if task == "sst2":
        return GlueExample(c[0].strip(), None, _int_label(c[1]), row)
    if task == "mrpc":
        return GlueExample(c[3].strip(), c[4].strip(), _int_label(c[0]), row)
    if task == "rte":
        return GlueExample(c[1].strip(), c[2].strip(), _named_label(c[3], RTE_LABELS, "RTE label"), int(c[0]))
    if task == "stsb":
        score = float(c[9])
        if not 0.0 <= score <= 5.0:
            raise ValueError(f"STS-B score {score} outside [0, 5]")
        return GlueExample(c[7].strip(), c[8].strip(), score, int(c[0]))
    if task == "qqp":
        return GlueExample(c[3].strip(), c[4].strip(), _int_label(c[5]), int(c[0]))
    if task == "qnli":
        return GlueExample(c[1].strip(), c[2].strip(), _named_label(c[3], RTE_LABELS, "QNLI label"), int(c[0]))
    if task == "mnli":
        label = _named_label(c[-1], MNLI_LABELS, "MNLI gold label")  # gold_label: last column of train and dev
        return GlueExample(c[8].strip(), c[9].strip(), label, int(c[0]))
    if task == "wnli":
        return GlueExample(c[1].strip(), c[2].strip(), _int_label(c[3]), int(c[0]))
    raise ValueError(task)
