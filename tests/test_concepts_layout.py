"""The layout table of docs/concepts.md against the tree: every package and top-level module of ``probes/`` is
named, every path the table names exists, and every ``probes.x.y`` name and ``probes/...`` path of the page
(prose, code spans, Mermaid diagrams) is in the code.

What the table must hold (section ``## Layout``, a ``| path | what |`` table):

* every top-level package ``probes/<pkg>/`` and every top-level module ``probes/<name>.py`` (names not starting
  with ``_``) in the path column of a row, once;
* every deeper package (``probes/analysis/clark/``, ``probes/dependency/components/``) either in the path
  column or under a path the table names (``components/scorers.py`` in the row of ``probes/dependency/``);
* every path it names exists: path-column entries from the repository root; in the "what" column the code
  spans that are paths (ending in ``.py``, ``.yaml`` or ``/``, no placeholder such as ``<name>``) from the root
  when they start with a top-level entry of the repository (``probes/``, ``conf/``, ``docs/``), else from the
  row's folder.

Modules added inside a package need no new row; a new package does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "concepts.md"
CODE = re.compile(r"`([^`\n]+)`")
MERMAID = re.compile(r"^```mermaid\n(.*?)^```", re.M | re.S)
DOTTED = re.compile(r"(?<![\w./])probes(?:\.[A-Za-z_]\w*)+")
SLASHED = re.compile(r"(?<![\w./])probes/[^\s`\"(),;]*")
PLACEHOLDER = re.compile(r"[<>*{}\[\]]")


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside a code span does not split."""
    out, cur, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def layout_rows(text: str) -> list[tuple[list[str], str]]:
    """(paths of the path column, the "what" cell) of every row of the table under ``## Layout``."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert len(rows) > 2 and cells(rows[0])[:2] == ["path", "what"], "no `| path | what |` table under ## Layout"
    return [(CODE.findall(c[0]), c[1]) for c in map(cells, rows[2:])]


def is_path(token: str) -> bool:
    """A code span of the "what" column that names a file or folder of the repository."""
    return (not PLACEHOLDER.search(token) and " " not in token and "=" not in token
            and (token.endswith((".py", ".yaml")) or token.endswith("/")))


def packages(root: Path) -> list[str]:
    """Every package folder under ``probes/`` as ``probes/a/b/``."""
    return sorted(str(p.parent.relative_to(root)) + "/" for p in (root / "probes").rglob("__init__.py")
                  if not any(part.startswith(("_", ".")) for part in p.parent.relative_to(root).parts))


def top_level(root: Path) -> list[str]:
    """The top-level packages and modules of ``probes/``: ``probes/<pkg>/`` and ``probes/<name>.py``."""
    pkg = root / "probes"
    mods = [f"probes/{p.name}" for p in pkg.glob("*.py") if not p.name.startswith("_")]
    dirs = [f"probes/{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_")]
    return sorted(mods + dirs)


def layout_errors(text: str, root: Path) -> list[str]:
    """What the layout table gets wrong about the tree under ``root`` (empty when it matches)."""
    rows = layout_rows(text)
    errors, named, column = [], set(), []
    entries = {p.name for p in root.iterdir()}
    for paths, what in rows:
        column += paths
        base = next((p for p in paths if p.endswith("/")), "")
        for p in paths:
            if not (root / p).exists():
                errors.append(f"the path column names {p}, which does not exist")
            named.add(p)
        for token in filter(is_path, CODE.findall(what)):
            full = token if token.split("/", 1)[0] in entries else base + token
            if not (root / full).exists():
                errors.append(f"the row of {', '.join(paths)} names `{token}` ({full}), which does not exist")
            named.add(full)
    for p in sorted({p for p in column if column.count(p) > 1}):
        errors.append(f"{p} is in the path column of more than one row")
    for p in top_level(root):
        if p not in column:
            errors.append(f"{p} has no row: add it to the path column of a row")
    for p in packages(root):
        if not any(n == p or n.startswith(p) for n in named):
            errors.append(f"the package {p} is not named: give it a row or name one of its files in its parent's row")
    return errors


def _module_file(root: Path, dotted: str) -> Path | None:
    rel = Path(*dotted.split("."))
    for p in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def _top_names(path: Path) -> dict[str, ast.AST | None]:
    """Names bound at the top of a module (classes with their node, for their members) and those of ``__all__``."""
    tree = ast.parse(path.read_text())
    out: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node if isinstance(node, ast.ClassDef) else None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out.update({n.id: None for n in ast.walk(t) if isinstance(n, ast.Name)})
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                out.update({e.value: None for e in ast.walk(node.value) if isinstance(e, ast.Constant)
                            and isinstance(e.value, str)})
    return out


def _class_members(node: ast.ClassDef) -> set[str]:
    out = set()
    for sub in node.body:
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(sub.name)
        elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
            for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def name_error(root: Path, dotted: str) -> str | None:
    """Why ``probes.a.b.name`` does not resolve in the source under ``root`` (None when it does): the longest
    prefix that is a module, then a name bound at its top, then (for a class defined there) one of its members."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(root, ".".join(parts[:i]))
        if path is not None:
            break
    else:
        return f"{dotted}: no module {parts[0]}"
    rest = parts[i:]
    if not rest:
        return None
    names = _top_names(path)
    if rest[0] not in names:
        return f"{dotted}: {'.'.join(parts[:i])} has no {rest[0]}"
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in _class_members(node):
        return f"{dotted}: {rest[0]} has no member {rest[1]}"
    return None


def page_errors(text: str, root: Path) -> list[str]:
    """Names and paths of the page's code spans and diagrams that are not in the code under ``root``."""
    spans = CODE.findall(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)) + MERMAID.findall(text)
    errors = []
    for span in spans:
        for dotted in DOTTED.findall(span):
            err = name_error(root, dotted.rstrip("."))
            if err:
                errors.append(err)
        for path in SLASHED.findall(span):
            path = path.rstrip(".")
            if not PLACEHOLDER.search(path) and not (root / path).exists():
                errors.append(f"{path} does not exist")
    return sorted(set(errors))


def test_layout_table_matches_the_tree():
    errors = layout_errors(PAGE.read_text(), ROOT)
    assert not errors, "docs/concepts.md, ## Layout:\n" + "\n".join(errors)


def test_names_and_paths_of_the_page_exist():
    errors = page_errors(PAGE.read_text(), ROOT)
    assert not errors, "docs/concepts.md names what the code does not have:\n" + "\n".join(errors)


def _depths(block: str) -> dict[str, int]:
    """Each node's label with its depth along the solid arrows of a Mermaid flowchart (roots at 0)."""
    labels = dict(re.findall(r'(\w+)\["(.*?)"\]', block))
    chains = [[s.strip() for s in re.sub(r'--\s*"[^"]*"\s*-->', "-->", line).split("-->")]
              for line in block.splitlines() if "-->" in line and "-." not in line]  # a --> b -- "label" --> c
    edges = [(a, b) for ids in chains for a, b in zip(ids, ids[1:])]
    depth = {n: 0 for n in labels}
    for _ in labels:  # longest path from a root: relax as often as there are nodes
        for a, b in edges:
            depth[b] = max(depth[b], depth[a] + 1)
    return {labels[n]: d for n, d in depth.items()}


def test_page_has_the_two_diagrams():
    blocks = MERMAID.findall(PAGE.read_text())
    assert len(blocks) == 2 and all(b.lstrip().startswith("flowchart") for b in blocks)
    # the packages, top to bottom along the "imports" arrows (tests/test_layering.py's order)
    depths = _depths(blocks[0])
    order = [["probes/api.py", "probes.report", "train.py"], ["probes.training", "probes.dependency",
             "probes.structural", "probes.glue", "probes.patterns", "probes.analysis"],
             ["probes.data", "probes.extract"], ["probes.maps"], ["probes.measures"], ["probes.model"],
             ["probes.io", "probes.memory"], ["probes.stats"]]
    found = [{next((d for label, d in depths.items() if name in label), None) for name in layer} for layer in order]
    assert all(len(f) == 1 and None not in f for f in found), list(zip(order, found))
    assert [f.pop() for f in found] == list(range(len(order)))
    # the path of a sentence, in order
    path = _depths(blocks[1])
    steps = ["words", "probes.model.inputs", "probes.maps", "probes.measures", "probes.model<", "word pooling",
             "probes.extract", "datamodules"]
    at = [next((d for label, d in path.items() if step in label + "<"), None) for step in steps]
    assert None not in at and at == sorted(at), list(zip(steps, at))


@pytest.fixture
def tree(tmp_path) -> Path:
    """A small repository: probes/ with a top-level module, two packages (one with a sub-package), conf/."""
    for f in ("probes/__init__.py", "probes/io.py", "probes/model/__init__.py", "probes/model/load.py",
              "probes/glue/__init__.py", "probes/glue/components/__init__.py", "probes/glue/components/head.py",
              "conf/x.yaml"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("class Encoder:\n    def forward(self):\n        pass\n\ndef load_encoder():\n    pass\n"
                                  if f.endswith("load.py") else "")
    return tmp_path


TABLE = """# T

## Layout

| path | what |
|---|---|
| `probes/io.py` | writes |
| `probes/model/` | `load.py` (`head=a|b`), `inputs.py` |
| `probes/glue/` | `components/head.py`, runs write `checkpoints/last.ckpt` |
| `conf/` | `conf/x.yaml`, `conf/<name>.yaml` |

## Next
"""


def test_layout_check_sees_what_is_wrong(tree):
    """The checker itself: a missing module, a package without a row, an unnamed sub-package, a path that does
    not exist, a duplicate row; placeholders, runtime paths and pipes in code spans are left alone."""
    assert layout_errors(TABLE, tree) == ["the row of probes/model/ names `inputs.py` (probes/model/inputs.py), "
                                          "which does not exist"]
    (tree / "probes/model/inputs.py").write_text("")
    assert layout_errors(TABLE, tree) == []
    (tree / "probes/maps").mkdir()
    (tree / "probes/maps/__init__.py").write_text("")
    (tree / "probes/summary.py").write_text("")
    (tree / "probes/model/capture").mkdir()
    (tree / "probes/model/capture/__init__.py").write_text("")
    (tree / "probes/model/capture/sites.py").write_text("")  # a module inside a named package: no row needed
    table = TABLE.replace("| `conf/` |", "| `probes/gone/` | gone |\n| `probes/io.py` | again |\n| `conf/` |")
    assert layout_errors(table, tree) == [
        "the path column names probes/gone/, which does not exist",
        "probes/io.py is in the path column of more than one row",
        "probes/maps/ has no row: add it to the path column of a row",
        "probes/summary.py has no row: add it to the path column of a row",
        "the package probes/maps/ is not named: give it a row or name one of its files in its parent's row",
        "the package probes/model/capture/ is not named: give it a row or name one of its files in its parent's row",
    ]


def test_name_check_sees_stale_names(tree):
    text = ("`probes.model.load.load_encoder` and `probes.model.load.Encoder.forward` resolve, `python -m "
            "probes.glue` too; `probes.model.hooks.attention`, `probes.model.load.Encoder.backward` and "
            "`probes/models/components` do not, `probes/analysis/<paper>/` is a placeholder\n"
            "```mermaid\nflowchart TB\n    a[\"probes.io\"] --> b[\"probes.gone\"]\n```\n")
    assert page_errors(text, tree) == [
        "probes.gone: probes has no gone",
        "probes.model.hooks.attention: probes.model has no hooks",
        "probes.model.load.Encoder.backward: Encoder has no member backward",
        "probes/models/components does not exist",
    ]
