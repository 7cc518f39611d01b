"""Write the report as Markdown (``report.md``) and as one self-contained HTML page (``report.html``,
figures embedded as base64 PNGs)."""

from __future__ import annotations

import base64
import html
import os
import re
import time
from pathlib import Path

from probes.report.runs import UNKNOWN, Run, group_runs

CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}th,td{border:1px solid #bbb;padding:3px 7px}
th{background:#eef}td{text-align:right}td:first-child,td:last-child,.prov td{text-align:left}
.missing{color:#a40}.prov{font-size:12px;color:#444}code{background:#f4f4f4;padding:0 3px}
.rule{font-size:13px;color:#333;background:#f8f8f0;padding:4px 8px}
img{max-width:100%;border:1px solid #ddd;margin:4px 0}figure{margin:.5em 0}figcaption{font-size:12px;color:#555}
"""


def _commit(p: dict) -> str:
    c = p.get("commit")
    return c[:12] + ("+dirty" if c.endswith("+dirty") else "") if c else UNKNOWN


def _machine(p: dict) -> str:
    m = p.get("machine") or {}
    parts = [m.get("cpu"), f"{m['cores']} cores" if m.get("cores") else None, m.get("gpu") or "no GPU",
             f"torch {m['torch']}" if m.get("torch") else None, m.get("host")]
    return ", ".join(str(x) for x in parts if x) if m else UNKNOWN


RULE = ("Every run found is listed. Runs are grouped by what ran (experiment or analysis), the encoder (its name "
        "and weights fingerprint) and the data files it read (path relative to the data folder, @ the first 8 hex "
        "digits of the sha256; `= pinned <treebank> <split>` when the sha256 is that of a file pinned in "
        "`conf/treebank/`), all as the run's `provenance.json` records them: a field it does not record shows "
        "as `unknown`. Groups are ordered by their newest run, and within a group the newest run comes first "
        "(by the time its metrics.json or summary.json was written). A table's numbers come from the newest run "
        "of each column (encoder, and the data read where one encoder read several); the other runs are "
        "listed under it.")
RUNS_HEAD = ["group", "run", "what ran", "encoder", "weights", "data read", "data dir", "precision", "command",
             "commit", "machine", "finished (UTC)", "run folder"]


def runs_rows(runs: list[Run], shown: list[Run], out_dir: Path) -> list[list[str]]:
    """One row per run, grouped and ordered as :data:`RULE` says; ``run``: shown above, newest or older."""
    shown_paths = {r.path for r in shown}
    rows = []
    for g, group in enumerate(group_runs(runs), start=1):
        for i, r in enumerate(group):
            p, lab = r.provenance, r.label
            state = "shown above" if r.path in shown_paths else ("newest" if i == 0 else "older")
            rows.append([str(g), state, f"{r.kind} {r.name}", r.encoder, lab.fingerprint, lab.data, lab.data_dir,
                         lab.precision, p.get("command") or UNKNOWN, _commit(p), _machine(p),
                         time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.finished)),
                         os.path.relpath(r.path, out_dir)])
    return rows


def other_runs(papers, runs: list[Run]) -> list[Run]:
    """The runs that no section of the papers uses (listed at the end of the report)."""
    used = {r.path for _, secs in papers for s in secs for r in s.runs}
    return [r for r in runs if r.path not in used]


# ---------------------------------------------------------------- Markdown
def _md_table(header, rows) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(esc, r)) + " |" for r in rows]


def markdown(papers, runs: list[Run], sources: list[str], out_dir: Path) -> str:
    lines = [f"# Report: the papers' tables and figures from {len(runs)} runs", "",
             f"Run folders: {', '.join(f'`{s}`' for s in sources)}. Written "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python -m probes.report`.", "",
             f"Runs: {RULE}", ""]
    missing = [s for _, secs in papers for s in secs if not s.runs]
    others = other_runs(papers, runs)
    for paper, secs in papers:
        lines += [f"## {paper['title']}", ""]
        for s in secs:
            lines += [f"### {s.what}", ""]
            if not s.runs:
                lines += [f"Not run yet: `{s.command}`", ""]
                if s.notes:
                    lines += [f"Paper: {'; '.join(s.notes)}", ""]
                continue
            lines += _md_table(s.header, s.rows) + [""]
            if s.notes:
                lines += [f"Paper: {'; '.join(s.notes)}", ""]
            lines += [f"Paper's numbers: {s.source}. Command: `{s.command}`", ""]
            lines += [f"Note: {w}" for w in s.warnings] + ([""] if s.warnings else [])
            for cap, path in s.figures:
                lines += [f"![{cap}]({os.path.relpath(path, out_dir)})", ""]
            lines += [f"Runs ({len(s.runs)}):", ""] + _md_table(RUNS_HEAD, runs_rows(s.runs, s.shown, out_dir)) + [""]
    if others:
        lines += ["## Other runs", "", "Runs that no table or figure above uses.", ""] + \
            _md_table(RUNS_HEAD, runs_rows(others, [], out_dir)) + [""]
    if missing:
        lines += ["## Not run yet", ""] + [f"- {s.what}: `{s.command}`" for s in missing] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- HTML
def _h(s) -> str:
    """Escaped text; `code` spans become <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(s)))


def _html_table(header, rows, cls="") -> str:
    head = "".join(f"<th>{_h(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_h(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _img(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def page(papers, runs: list[Run], sources: list[str], out_dir: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>probes report</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Report: the papers' tables and figures from {len(runs)} runs</h1>",
             f"<p>Run folders: {', '.join(f'<code>{_h(s)}</code>' for s in sources)}. Written "
             f"{_h(time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))} by <code>python -m probes.report</code>.</p>",
             f"<p class='rule'>Runs: {_h(RULE)}</p>"]
    missing = [s for _, secs in papers for s in secs if not s.runs]
    others = other_runs(papers, runs)
    for paper, secs in papers:
        parts.append(f"<h2>{_h(paper['title'])}</h2>")
        for s in secs:
            parts.append(f"<section id='{_h(s.key)}'><h3>{_h(s.what)}</h3>")
            if not s.runs:
                parts.append(f"<p class='missing'>Not run yet: <code>{_h(s.command)}</code></p>")
                if s.notes:
                    parts.append(f"<p>Paper: {_h('; '.join(s.notes))}</p>")
                parts.append("</section>")
                continue
            parts.append(_html_table(s.header, s.rows, "result"))
            if s.notes:
                parts.append(f"<p>Paper: {_h('; '.join(s.notes))}</p>")
            parts.append(f"<p>Paper's numbers: {_h(s.source)}. Command: <code>{_h(s.command)}</code></p>")
            parts += [f"<p class='missing'>Note: {_h(w)}</p>" for w in s.warnings]
            for cap, path in s.figures:
                parts.append(f"<figure><img alt='{_h(cap)}' src='{_img(path)}'><figcaption>{_h(cap)}</figcaption>"
                             "</figure>")
            parts.append(f"<div class='prov'>Runs ({len(s.runs)}):" +
                         _html_table(RUNS_HEAD, runs_rows(s.runs, s.shown, out_dir)) + "</div></section>")
    if others:
        parts.append("<h2>Other runs</h2><p>Runs that no table or figure above uses.</p><div class='prov'>" +
                     _html_table(RUNS_HEAD, runs_rows(others, [], out_dir)) + "</div>")
    if missing:
        parts.append("<h2>Not run yet</h2><ul>" + "".join(
            f"<li>{_h(s.what)}: <code>{_h(s.command)}</code></li>" for s in missing) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
