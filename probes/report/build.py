"""The report's content: every section of ``papers.yaml`` filled from the runs, beside the paper's numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from probes.report.runs import Run, newest_first

PAPERS = Path(__file__).with_name("papers.yaml")


def load_papers(path: str | Path = PAPERS) -> list[dict]:
    """The papers and their sections (``papers.yaml``)."""
    try:
        return yaml.safe_load(Path(path).read_text())["papers"]
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a papers file with a top-level 'papers' list ({e})") from e


@dataclass
class Section:
    """One table/figure of a paper as reproduced by the runs (``runs`` empty: not run yet): the numbers of
    the newest run of each column (:attr:`shown`), every run of the section in :attr:`runs`."""

    key: str
    paper: str
    what: str
    source: str
    command: str
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)       # the paper's findings in words
    warnings: list[str] = field(default_factory=list)    # runs that are not the plain configuration
    figures: list[tuple[str, Path]] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)        # every run of this section
    shown: list[Run] = field(default_factory=list)       # the runs whose numbers the table shows
    values: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (row, column, encoder) -> value


def pct(v) -> str:
    """A rate in [0, 1] as percent with one decimal (the README's format); '-' for missing."""
    return "-" if v is None or pd.isna(v) else f"{100 * float(v):.1f}"


def _columns(runs: list[Run], base: bool = False) -> dict[str, list[Run]]:
    """Runs by column, in the order of the labels: the encoder (``base``: without the random-init mark) and the
    data read; the label is the encoder's name, with the files read (names @ sha256) where one encoder read
    several sets of files (they are never merged)."""
    enc = (lambda r: r.base_encoder) if base else (lambda r: r.encoder)  # noqa: E731
    datas: dict[str, dict[tuple, None]] = {}
    for r in newest_first(runs):
        datas.setdefault(enc(r), {})[r.label.data_key] = None
    out: dict[str, list[Run]] = {}
    for r in sorted(newest_first(runs), key=lambda r: (enc(r), r.label.data_short)):  # columns by name
        label = enc(r) if len(datas[enc(r)]) == 1 else f"{enc(r)} · {r.label.data_short}"
        out.setdefault(label, []).append(r)
    return out


def _newest(runs: list[Run], key) -> dict:
    """The run shown per ``key``: the newest (the others are listed under the section)."""
    out = {}
    for r in newest_first(runs):
        out.setdefault(key(r), r)
    return out


def train_section(spec: dict, paper: str, runs: list[Run]) -> Section:
    """Rows = experiments, one block of metric columns per encoder, the paper's number last."""
    sec = Section(spec["key"], paper, spec["what"], spec.get("paper_source", ""), spec["command"])
    rows = spec["experiments"]
    wanted = {r["experiment"] for r in rows}
    mine = [r for r in runs if r.kind == "train" and r.name in wanted]
    groups = _columns(mine, base=True)  # the random-init row is an experiment of its own
    latest = {g: _newest(rs, lambda r: r.name) for g, rs in groups.items()}
    cols = spec["columns"]
    sec.header = ["row (experiment)"] + [f"{c} ({g})" if len(groups) > 1 else c for g in groups for c in cols] + \
        ["paper"]
    for row in rows:
        metrics = row.get("metrics") or spec["metrics"]
        cells = [f"{row['label']} (`{row['experiment']}`)"]
        for g in groups:
            run = latest[g].get(row["experiment"])
            for c, m in zip(cols, metrics):
                v = None if run is None or m is None else run.values.get(m)
                if v is not None:
                    sec.values[(row["experiment"], c, g)] = float(v)
                cells.append(pct(v))
        cells.append(str(row.get("paper", "-")))
        sec.rows.append(cells)
    sec.runs = mine
    sec.shown = [r for g in latest.values() for r in g.values()]
    return sec


def _fmt_frame(df: pd.DataFrame, spec: dict) -> pd.DataFrame:
    digits = int(spec.get("digits", 3))
    percent = set(spec.get("percent") or [])

    def f(col, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not pd.isna(v):
            if spec.get("percent_all") or col in percent:
                return pct(v)
            return str(int(v)) if float(v).is_integer() and abs(v) >= 1 else f"{v:.{digits}g}" if abs(v) < 1e-2 \
                else f"{v:.{digits}f}"
        return "-" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)
    return pd.DataFrame({c: [f(c, v) for v in df[c]] for c in df.columns}, index=df.index)


def analysis_frame(run: Run, spec: dict) -> pd.DataFrame:
    """The run's table as ``spec`` shapes it: index = row keys, columns = values (strings)."""
    names = sorted(p.stem for p in run.path.glob(f"{spec['glob']}.csv")) if "glob" in spec else [spec["name"]]
    frames = [pd.read_csv(run.csv(n)) for n in names if run.csv(n).exists()]
    if not frames:
        raise FileNotFoundError(f"{run.path}: none of {names} written")
    df = pd.concat(frames, ignore_index=True)
    if spec.get("query"):
        df = df.query(spec["query"])
    index = list(spec.get("index") or [])
    if spec.get("melt"):
        df = df.melt(id_vars=[c for c in df.columns if c not in spec["melt"]], value_vars=spec["melt"],
                     var_name="measure", value_name="value")
    if "columns" in spec:  # pivot: mean over everything else (e.g. heads of a layer)
        col = spec["columns"]
        df = df.pivot_table(index=index, columns=col, values=spec["value"], aggfunc="mean")
        df.columns = [f"{col} {c + 1 if spec.get('one_based') else c}" for c in df.columns]
    elif index:
        df = df.set_index(index)[list(spec.get("values") or [c for c in df.columns if c not in index])]
    else:
        df = df.head(int(spec.get("max_rows", 40)))
    if spec.get("rows") and index:
        keep = [r for r in spec["rows"] if r in df.index]
        df = df.loc[keep]
    return _fmt_frame(df, spec)


def _key(idx) -> str:
    return " / ".join(map(str, idx)) if isinstance(idx, tuple) else str(idx)


def analysis_section(spec: dict, paper: str, runs: list[Run]) -> Section:
    """The analysis's table per encoder side by side (or its summary scalars), its figures, the paper."""
    sec = Section(spec["key"], paper, spec["what"], spec.get("paper_source", ""), spec["command"])
    mine = [r for r in runs if r.kind == "analysis" and r.name == spec["analysis"]]
    groups = _columns(mine)
    latest = {g: _newest(rs, lambda r: 0)[0] for g, rs in groups.items()}
    sec.runs = mine
    sec.shown = list(latest.values())
    paper_vals = {str(k): str(v) for k, v in (spec.get("paper") or {}).items()}
    frames = {}
    for g, run in latest.items():
        if "table" in spec:
            frames[g] = analysis_frame(run, spec["table"])
        else:  # no table: the run's scalar summary
            flat = {k: v for k, v in run.values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            frames[g] = _fmt_frame(pd.DataFrame({"value": flat}).rename_axis("summary"), spec)
        sec.figures += [(f"{g}: {p.stem}", p) for p in run.figures()]
    if frames:
        if len(frames) == 1:
            (df,) = frames.values()
        else:
            df = pd.concat({g: f for g, f in frames.items()}, axis=1)
            df.columns = [f"{c} ({g})" for g, c in df.columns]
            df = df.fillna("-")
        keys = [_key(i) for i in df.index]
        used = set()
        papers = []
        for k in keys:
            papers.append(paper_vals.get(k, "-"))
            used.add(k)
        index_names = [n or "" for n in df.index.names]
        sec.header = [" / ".join(index_names)] + list(df.columns) + ["paper"]
        sec.rows = [[k, *map(str, row), p] for k, row, p in zip(keys, df.itertuples(index=False), papers)]
        sec.notes = [f"{k}: {v}" if k != "summary" else v for k, v in paper_vals.items() if k not in used]
    else:
        sec.notes = [f"{k}: {v}" if k != "summary" else v for k, v in paper_vals.items()]
    return sec


def _flag_overrides(sec: Section) -> Section:
    for r in sec.shown:
        if r.extra_overrides:
            extra = " ".join(r.extra_overrides)
            extra = extra if len(extra) <= 160 else extra[:159] + "…"
            sec.warnings.append(f"{r.encoder} ({r.path.name}) ran with further overrides: `{extra}`")
    return sec


def build(runs: list[Run], papers: list[dict] | None = None) -> list[tuple[dict, list[Section]]]:
    """Every paper with its sections filled from ``runs``."""
    out = []
    for paper in papers or load_papers():
        secs = [_flag_overrides(train_section(s, paper["title"], runs) if "experiments" in s
                                else analysis_section(s, paper["title"], runs)) for s in paper["sections"]]
        out.append((paper, secs))
    return out
