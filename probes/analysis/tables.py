"""Tidy tables shared by the analyses: one row per (layer, head), 0-based indices plus the 1-based name."""

from __future__ import annotations

import numpy as np
import pandas as pd

from probes.analysis.naming import head_name


def layer_head_frame(values: dict[str, np.ndarray], **constants) -> pd.DataFrame:
    """Rows ``layer, head, name, <constants...>, <value columns...>`` from (L, H) matrices of equal shape."""
    arrays = {k: np.asarray(v) for k, v in values.items()}
    L, H = next(iter(arrays.values())).shape
    layer, head = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
    df = pd.DataFrame(dict(layer=layer.ravel(), head=head.ravel()))
    df.insert(2, "name", [head_name(l, h) for l, h in zip(df["layer"], df["head"])])
    for k, v in constants.items():
        df[k] = v
    for k, v in arrays.items():
        if v.shape != (L, H):
            raise ValueError(f"{k}: shape {v.shape}, expected {(L, H)}")
        df[k] = v.ravel()
    return df
