"""The package's import structure: one direction of dependency, no circles, imports at module top.

Read from the source with :mod:`ast` (nothing is imported), so a violation names the file and line.

Layers, bottom to top: ``probes.stats`` (imports no other module of the package) <
``probes.io``/``probes.memory`` < ``probes.model`` < ``probes.measures`` < ``probes.maps`` (the map engine) <
``probes.data``/``probes.extract`` < the trainable packages and ``probes.analysis`` < ``probes.report``,
entry points and the public API. A module may import its own layer or lower ones only where the table below
says so.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "probes"

# Function-local imports allowed: (module, imported module prefix) with the reason.
LOCAL_IMPORT_ALLOWED = {
    # optional packages: a missing one must not break `import probes`
    "gguf", "accelerate", "submitit", "optuna", "networkx", "spacy", "en_core_web_sm",
    # a DDP child / spawned interpreter must not pay for them at import
}

# Packages that the model layer (and measures, and the map engine) must never import.
ABOVE_MAPS = ("probes.extract", "probes.training", "probes.dependency", "probes.structural", "probes.glue",
              "probes.patterns", "probes.analysis", "probes.report", "probes.train", "probes.analyze", "probes.api")
ABOVE_MEASURES = ("probes.maps", *ABOVE_MAPS)
ABOVE_MODEL = (*ABOVE_MEASURES, "probes.data")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not MODULES[mod].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module top) of every import in ``mod``; ``from a import b`` yields
    ``a.b`` when that is a module of the package, else ``a``."""
    tree = ast.parse(MODULES[mod].read_text(), filename=str(MODULES[mod]))
    top = set()
    for node in tree.body:
        top.add(id(node))
        if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import x except ImportError`
            for sub in ast.walk(node):
                top.add(id(sub))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, node.lineno, id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full if full in MODULES else base, node.lineno, id(node) in top))
    return out


def _type_checking_only(mod: str) -> set[int]:
    """Lines of imports under ``if TYPE_CHECKING:`` (no runtime dependency)."""
    tree = ast.parse(MODULES[mod].read_text())
    lines = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    lines.add(sub.lineno)
    return lines


def _graph() -> dict[str, set[str]]:
    g = defaultdict(set)
    for mod in MODULES:
        skip = _type_checking_only(mod)
        for target, line, _ in _imports(mod):
            if line in skip:
                continue
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != mod and target.startswith("probes") and not mod.startswith(target + "."):
                g[mod].add(target)
    return g


def test_no_function_local_imports():
    bad = []
    for mod, path in MODULES.items():
        for target, line, at_top in _imports(mod):
            if not at_top and target.split(".")[0] not in LOCAL_IMPORT_ALLOWED:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not bad, f"{len(bad)} function-local imports (move them to the module top):\n" + "\n".join(bad)


def test_no_import_cycles():
    g = _graph()
    cycles, seen = [], set()

    def visit(node, stack, on_stack):
        for nxt in sorted(g.get(node, ())):
            if nxt in on_stack:
                cyc = stack[stack.index(nxt):] + [nxt]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    cycles.append(" -> ".join(cyc))
            elif nxt not in done:
                on_stack.add(nxt)
                visit(nxt, stack + [nxt], on_stack)
                on_stack.discard(nxt)
        done.add(node)

    done: set[str] = set()
    for mod in sorted(MODULES):
        if mod not in done:
            visit(mod, [mod], {mod})
    assert not cycles, "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("layer,above", [("probes.model", ABOVE_MODEL), ("probes.measures", ABOVE_MEASURES),
                                         ("probes.maps", ABOVE_MAPS), ("probes.stats", ("probes",))])
def test_lower_layers_do_not_import_upper_ones(layer, above):
    g = _graph()
    bad = [f"{m} imports {t}" for m in MODULES if m == layer or m.startswith(layer + ".")
           for t in sorted(g.get(m, ())) if t.startswith(above)]
    assert not bad, "\n".join(bad)

