"""The hand-labelled attention maps (``<data_dir>/attention_patterns``: maps.npz, labels.json, meta.jsonl).

Split: stratified by label and seeded — within each class the ids (sorted numerically) are
shuffled with ``seed`` and cut into ``fractions`` (default 60/20/20 train/val/test); each split's
share of a class is rounded, and a class with at least 3 maps gets at least one map in val and in
test (the 4 ``block`` maps: 2 / 1 / 1). The three id sets are disjoint and cover every labelled map.

Cross-validation (``folds=k``, ``fold=i``; :mod:`probes.patterns.crossval`): test = fold i of
:func:`stratified_folds` (seeded with ``seed``); the other folds are split into train and validation
in the ratio ``fractions[0] : fractions[1]`` (stratified, seeded; ``fractions: [0.6, 0.2, 0.2]``
keeps a quarter of them for validation, ``[1, 0, 0]`` none). ``fractions: [1, 0, 0]`` without folds
puts every map in train.

Augmentation (train only): ``augment`` is a list of label-preserving transforms from config
(:mod:`probes.patterns.augment`); every training map's variants (the compositions of the transforms
that apply to its label, the map itself included) are preprocessed once up front and one is drawn
uniformly each time the map is sampled. ``ReverseTokens`` (``A[::-1, ::-1]``) keeps every pattern
type; ``Transpose`` keeps diagonal, block and heterogeneous but turns a vertical stripe into a
horizontal one, so it is given only those classes.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from probes.patterns.augment import variants
from probes.patterns.components.cnn import CLASSES, check_map, preprocess, preprocess_many

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def read_patterns(data_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, dict]]:
    """(maps, labels, meta) of a folder in the shared format; meta is {} when meta.jsonl is absent."""
    d = Path(data_dir).expanduser()
    for name in ("maps.npz", "labels.json"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"attention patterns: {d / name} not found (set paths.data_dir or "
                                    f"PROBES_DATA_DIR to the folder holding attention_patterns/)")
    labels = json.loads((d / "labels.json").read_text())
    with np.load(d / "maps.npz", allow_pickle=False) as z:
        maps = {k: check_map(z[k], f"{d / 'maps.npz'}: key {k!r}") for k in z.files}
    missing = sorted(set(labels) - set(maps), key=_id_key)
    if missing:
        raise ValueError(f"{d / 'labels.json'}: {len(missing)} labelled ids have no map in maps.npz, "
                         f"e.g. {missing[:5]}")
    meta = {}
    if (d / "meta.jsonl").is_file():
        for line in (d / "meta.jsonl").read_text().splitlines():
            if line.strip():
                m = json.loads(line)
                meta[str(m["id"])] = m
    return maps, labels, meta


def _id_key(k: str):
    return (0, int(k), "") if k.isdigit() else (1, 0, k)


def stratified_split(labels: dict[str, str], fractions: Sequence[float] = (0.6, 0.2, 0.2),
                     seed: int = 0) -> dict[str, list[str]]:
    """{train, val, test} -> ids; stratified per label, seeded, disjoint, covering all ids."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {list(fractions)}")
    rng = random.Random(seed)
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    by_label: dict[str, list[str]] = {}
    for k in sorted(labels, key=_id_key):
        by_label.setdefault(labels[k], []).append(k)
    for lab in sorted(by_label):
        ids = by_label[lab]
        rng.shuffle(ids)
        n = len(ids)
        n_val, n_test = round(n * fractions[1]), round(n * fractions[2])
        if n >= 3:
            n_val, n_test = max(n_val, 1 if fractions[1] > 0 else 0), max(n_test, 1 if fractions[2] > 0 else 0)
        n_train = n - n_val - n_test
        out["train"] += ids[:n_train]
        out["val"] += ids[n_train:n_train + n_val]
        out["test"] += ids[n_train + n_val:]
    return {s: sorted(v, key=_id_key) for s, v in out.items()}


def stratified_folds(labels: dict[str, str], k: int, seed: int = 0) -> list[list[str]]:
    """``k`` disjoint folds covering every id; per class the ids (sorted) are shuffled with ``seed`` and
    dealt round-robin, continuing where the previous class stopped (fold sizes differ by at most 1)."""
    if k < 2:
        raise ValueError(f"folds must be >= 2, got {k}")
    rng = random.Random(seed)
    folds: list[list[str]] = [[] for _ in range(k)]
    by_label: dict[str, list[str]] = {}
    for key in sorted(labels, key=_id_key):
        by_label.setdefault(labels[key], []).append(key)
    start = 0
    for lab in sorted(by_label):
        ids = by_label[lab]
        rng.shuffle(ids)
        for j, key in enumerate(ids):
            folds[(start + j) % k].append(key)
        start = (start + len(ids)) % k
    return [sorted(f, key=_id_key) for f in folds]


class _MapDataset(Dataset):
    """``x``: per map, its preprocessed variants (V_i, C, size, size), the map itself first (V_i = 1 without
    augmentation); one variant is drawn uniformly each time the map is sampled."""

    def __init__(self, x: list[torch.Tensor], y: list[int], index: list[int]):
        self.x, self.y, self.index = x, y, index

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        v = self.x[i]  # (V, C, size, size)
        return v[random.randrange(len(v))] if len(v) > 1 else v[0], self.y[i], self.index[i]


class PatternDataModule(pl.LightningDataModule):
    """The labelled maps, preprocessed once, split stratified (or into cross-validation folds); see the module
    docstring and ``conf/data/patterns.yaml`` (size, resize and channels come from the probe's config)."""

    def __init__(self, data_dir: str, classes: Sequence[str] = CLASSES, size: int = 32, resize: str = "area",
                 channels: Sequence[str] = ("max",), fractions: Sequence[float] = (0.6, 0.2, 0.2), seed: int = 0,
                 batch_size: int = 32, augment: Sequence | Mapping = (), num_workers: int = 0, folds: int | None = None,
                 fold: int = 0):
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.classes = tuple(classes)
        self.size, self.resize, self.channels = int(size), resize, tuple(channels)
        self.fractions, self.seed = tuple(fractions), int(seed)
        self.batch_size, self.num_workers = int(batch_size), int(num_workers)
        # a mapping {name: transform} (the config, so overrides can add or drop one by name) or a list
        self.augment = list((augment.values() if hasattr(augment, "values") else augment) or ())
        for t in self.augment:
            bad = sorted(set(getattr(t, "classes", None) or ()) - set(self.classes))
            if not (callable(t) and hasattr(t, "applies")):
                raise ValueError(f"data.augment: {t!r} is not an augmentation (probes.patterns.augment)")
            if bad:
                raise ValueError(f"data.augment: {t!r} names classes {bad} not in classes {list(self.classes)}")
        self.folds, self.fold = (None if folds is None else int(folds)), int(fold)
        if self.folds is not None and not 0 <= self.fold < self.folds:
            raise ValueError(f"fold must be in 0..{self.folds - 1}, got {self.fold}")
        self.ids: list[str] | None = None
        self.split_ids: dict[str, list[str]] = {}
        self.datasets: dict[str, _MapDataset] = {}
        self.train_class_counts: list[int] | None = None

    def prepare_data(self) -> None:
        for name in ("maps.npz", "labels.json"):
            if not (self.data_dir / name).is_file():
                raise FileNotFoundError(f"attention patterns: {self.data_dir / name} not found (set "
                                        f"paths.data_dir or PROBES_DATA_DIR to the folder holding attention_patterns/)")

    def _prep(self, a: np.ndarray) -> torch.Tensor:
        return preprocess(a, self.size, self.resize, self.channels)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        maps, labels, _ = read_patterns(self.data_dir)
        unknown = sorted(set(labels.values()) - set(self.classes))
        if unknown:
            raise ValueError(f"{self.data_dir / 'labels.json'}: labels {unknown} not in classes {list(self.classes)}")
        if self.folds is None:
            self.split_ids = stratified_split(labels, self.fractions, self.seed)
        else:
            parts = stratified_folds(labels, self.folds, self.seed)
            rest = {k: labels[k] for j, f in enumerate(parts) if j != self.fold for k in f}
            kept = self.fractions[0] + self.fractions[1]
            if self.fractions[0] <= 0:
                raise ValueError(f"data.fractions {list(self.fractions)}: with folds the train share must be > 0")
            inner = stratified_split(rest, (self.fractions[0] / kept, self.fractions[1] / kept, 0.0), self.seed)
            self.split_ids = {"train": inner["train"], "val": inner["val"], "test": parts[self.fold]}
        self.ids = [k for s in SPLITS for k in self.split_ids[s]]
        pos = {k: i for i, k in enumerate(self.ids)}
        cls = {c: i for i, c in enumerate(self.classes)}
        for s in SPLITS:
            ids = self.split_ids[s]
            augs = self.augment if s == "train" else []
            vs = [variants(maps[k], labels[k], augs) for k in ids]
            flat = preprocess_many([v for m in vs for v in m], self.size, self.resize, self.channels)
            x = list(torch.split(flat, [len(m) for m in vs])) if vs else []  # per map (V, C, size, size)
            y = [cls[labels[k]] for k in ids]
            self.datasets[s] = _MapDataset(x, y, [pos[k] for k in ids])
        counts = Counter(labels[k] for k in self.split_ids["train"])
        self.train_class_counts = [counts.get(c, 0) for c in self.classes]
        log.info("attention patterns: %s", {s: dict(Counter(labels[k] for k in self.split_ids[s])) for s in SPLITS})

    def summary(self) -> dict[str, float]:
        """Maps per split (``data/n_train`` ...), reported in ``metrics.json``."""
        if not self.split_ids:
            return {}
        return {f"data/n_{s}": float(len(v)) for s, v in self.split_ids.items()}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(self.datasets[split], batch_size=self.batch_size, shuffle=shuffle,
                          num_workers=self.num_workers, collate_fn=_collate,
                          generator=torch.Generator().manual_seed(self.seed) if shuffle else None)

    def train_dataloader(self):
        return self._loader("train", True)

    def val_dataloader(self):
        return self._loader("val", False)

    def test_dataloader(self):
        return self._loader("test", False)


def _collate(items):
    x, y, i = zip(*items)
    return torch.stack(x), torch.tensor(y, dtype=torch.long), torch.tensor(i, dtype=torch.long)
