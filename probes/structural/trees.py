"""Gold tree quantities from a sentence's heads: word-to-word path lengths and depths (ROOT not a node)."""

from __future__ import annotations

import numpy as np


def ancestors(heads: np.ndarray, where: str = "sentence") -> np.ndarray:
    """(n, n) bool A[i, a]: word a is word i or one of its ancestors. heads: (n,) 1-based, 0 = root.

    A cycle or a head outside 0..n is an error naming ``where``."""
    heads = np.asarray(heads, dtype=np.int64)
    n = len(heads)
    if ((heads < 0) | (heads > n)).any():
        raise ValueError(f"{where}: head outside 0..{n}: {heads.tolist()}")
    A = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j, steps = i, 0
        while True:
            A[i, j] = True
            if heads[j] == 0:
                break
            j = int(heads[j]) - 1
            steps += 1
            if steps > n:
                raise ValueError(f"{where}: heads contain a cycle: {heads.tolist()}")
    return A


def depths(heads: np.ndarray, where: str = "sentence") -> np.ndarray:
    """(n,) number of edges from each word to the root word (the root word: 0)."""
    return ancestors(heads, where).sum(1) - 1


def distances(heads: np.ndarray, where: str = "sentence") -> np.ndarray:
    """(n, n) number of edges on the tree path between words i and j.

    d(i, j) = depth_i + depth_j - 2 depth_lca, with depth_lca + 1 = the number of shared ancestors."""
    A = ancestors(heads, where).astype(np.int64)  # (n, n)
    d = A.sum(1) - 1  # (n,) depths
    shared = A @ A.T  # (n, n) common ancestors (self included)
    return d[:, None] + d[None, :] - 2 * (shared - 1)
