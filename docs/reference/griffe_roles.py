"""A griffe extension for the API reference: the Sphinx roles of the docstrings (``:func:`name```,
``:class:`~a.b.C```, ``:mod:`.sibling```) rendered as code that links to the object's entry where the reference
has one (an optional autorefs link: a name without an entry stays plain code, no warning).

Loaded by mkdocstrings (``extensions`` in mkdocs.yml); the docstrings themselves are Google style.
"""

from __future__ import annotations

import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const):`([^`]+)`")


def _target(obj: griffe.Object, name: str) -> str:
    """The full path ``name`` refers to from ``obj``: absolute, relative to the module (``.sibling``), or a name
    in ``obj``'s scope or its module's."""
    if name.startswith("."):
        module = obj if obj.is_module else obj.module
        base = module.path if module.is_init_module else module.path.rpartition(".")[0]
        dots = len(name) - len(name.lstrip("."))
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{name.lstrip('.')}"
    head, _, rest = name.partition(".")
    for scope in (obj, obj.module):
        try:
            full = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            continue
        return f"{full}.{rest}" if rest else full
    return name


def rewrite(obj: griffe.Object, text: str) -> str:
    """``text`` with every Sphinx role replaced by an optional cross-reference around a code span."""

    def one(m: re.Match) -> str:
        ref = m.group(1).strip()
        title, _, explicit = ref.partition(" <")
        if explicit:  # :func:`title <target>`
            ref = explicit.rstrip(">")
        short = ref.startswith("~")
        ref = ref.lstrip("~")
        shown = title if explicit else (ref.rpartition(".")[2] if short else ref.lstrip("."))
        target = _target(obj, ref.rstrip("()"))
        return (f'<autoref identifier="{html.escape(target)}" optional>'
                f"<code>{html.escape(shown)}</code></autoref>")

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once its object is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ROLE.search(obj.docstring.value):
            obj.docstring.value = rewrite(obj, obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self.on_object(obj=pkg)  # the top package is not among the objects of on_object
