"""Label-preserving augmentations of an attention map for the pattern CNN (``conf/data/patterns.yaml: augment``).

Each augmentation is an object from config (``_target_``) with ``applies(label) -> bool`` and
``__call__(a) -> a'`` on one (T, T) map (rows = from/query, columns = to/key). The datamodule builds,
for every training map, all variants reachable by the augmentations that apply to its label
(the identity, each one, their compositions) once up front, and draws one uniformly per epoch.

Which class survives which transform (the labelling guide, ``attention_patterns/GUIDE.md``):

==================  =====================  ===========================
class               reversed token order   transposed (rows <-> cols)
==================  =====================  ===========================
vertical            vertical               horizontal: NOT a class
diagonal            diagonal               diagonal (prev <-> next)
vertical+diagonal   vertical+diagonal      horizontal+diagonal: NOT
block               block                  block
heterogeneous       heterogeneous          heterogeneous
==================  =====================  ===========================

So :class:`ReverseTokens` applies to every class and :class:`Transpose` only to the classes named in
its ``classes`` (``[diagonal, block, heterogeneous]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ReverseTokens:
    """Reverse the token order, ``A[::-1, ::-1]``: a column stays a column, the main diagonal stays the main
    diagonal (previous-token <-> next-token), blocks stay blocks. ``classes``: None = every class."""

    def __init__(self, classes: Sequence[str] | None = None):
        self.classes = None if classes is None else frozenset(str(c) for c in classes)

    def applies(self, label: str) -> bool:
        return self.classes is None or label in self.classes

    def __call__(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a[::-1, ::-1])  # (T, T)

    def __repr__(self) -> str:
        return f"ReverseTokens(classes={sorted(self.classes) if self.classes else None})"


class Transpose:
    """Swap query and key (``A.T``); only for the classes in ``classes`` (a vertical stripe would become a
    horizontal one, which no class describes). The transposed map's columns, not rows, sum to 1; the CNN sees
    maps scaled by their maximum, so that does not show."""

    def __init__(self, classes: Sequence[str]):
        if not classes:
            raise ValueError("Transpose: name the classes it keeps (e.g. [diagonal, block, heterogeneous])")
        self.classes = frozenset(str(c) for c in classes)

    def applies(self, label: str) -> bool:
        return label in self.classes

    def __call__(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.T)  # (T, T)

    def __repr__(self) -> str:
        return f"Transpose(classes={sorted(self.classes)})"


def variants(a: np.ndarray, label: str, augmentations: Sequence) -> list[np.ndarray]:
    """The map and every composition of the augmentations that apply to ``label`` (in config order, each at
    most once): 1, 2, 4, ... (T, T) maps, the original first."""
    out = [a]
    for t in augmentations:
        if t.applies(label):
            out += [t(v) for v in out]
    return out
