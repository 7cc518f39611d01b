"""Classify every map of an ``.npz`` (shared format: one square float array per key) with a trained CNN.

``python -m probes.patterns classify --checkpoint CKPT --maps FILE.npz --out FILE.json``
writes a JSON object {map id: label} (keys in the file's order), atomically (temporary file in
the output folder, then renamed). Every array is checked first; an empty, non-square, non-2-D or
non-finite array is an error naming the file and the key, and nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from probes.io import atomic_write_text
from probes.patterns.components.cnn import check_map
from probes.patterns.module import load_classifier


def read_maps(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{key: (T, T) float32} of an .npz; ValueError naming file and key for a bad array."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"maps file not found: {p}")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (zipfile/pickle errors)
        raise ValueError(f"{p}: not a readable .npz file ({e})") from None
    if not hasattr(z, "files"):
        raise ValueError(f"{p}: expected an .npz archive of arrays, got a single array")
    with z:
        if not z.files:
            raise ValueError(f"{p}: the archive holds no arrays")
        out = {}
        for k in z.files:
            try:
                a = z[k]
            except ValueError as e:  # object arrays need pickle
                raise ValueError(f"{p}: key {k!r}: cannot read array ({e})") from None
            out[k] = check_map(a, f"{p}: key {k!r}")
    return out


def classify_file(checkpoint: str | os.PathLike, maps: str | os.PathLike, out: str | os.PathLike,
                  device: str = "cpu", batch_size: int = 512) -> dict[str, str]:
    """Classify every map of ``maps`` with the CNN of ``checkpoint``; writes and returns {map id: label}."""
    arrays = read_maps(maps)  # validate before loading the model
    model = load_classifier(checkpoint, device)
    keys = list(arrays)
    labels = model.predict_labels([arrays[k] for k in keys], batch_size)
    result = dict(zip(keys, labels))
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    return result
