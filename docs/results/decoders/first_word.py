"""Massive activations in SmolLM2's word vectors, from the structural probe's hidden-state caches.

python docs/results/decoders/first_word.py <setting>=<train entry>,<dev entry> ... --out first_word.csv

For each setting (a pair of hidden-state cache entries: train and dev, `data.hidden.layers` of the sweep) and
each stored layer: the mean L2 norm of the first word's vector and of the other words' vectors over the first
50 dev sentences; the per-dimension standard deviation over every train word (the moments `data.standardize`
uses) and its three largest dimensions; and, on the first 500 train sentences, the median norm of the
standardized vectors of the first word and of the other words.
"""
from __future__ import annotations

import argparse
import csv
import sys

import numpy as np

from probes.extract.representations import RepresentationCache


def moments(cache: RepresentationCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and standard deviation (D,) of ``layer`` over every word of the entry (float64 sums)."""
    total, total_sq, n = 0.0, 0.0, 0
    for i in range(len(cache)):
        if i not in cache:
            continue
        h = cache.layer(i, layer).astype(np.float64)  # (n, D)
        total, total_sq, n = total + h.sum(0), total_sq + (h * h).sum(0), n + len(h)
    mean = total / n
    return mean, np.sqrt(np.maximum(total_sq / n - mean * mean, 0.0))


def rows(setting: str, train: RepresentationCache, dev: RepresentationCache):
    dev_ids = [i for i in range(len(dev)) if i in dev][:50]
    train_ids = [i for i in range(len(train)) if i in train][:500]
    for layer in train.layers:
        first = [np.linalg.norm(dev.layer(i, layer)[0].astype(np.float64)) for i in dev_ids]
        other = np.concatenate([np.linalg.norm(dev.layer(i, layer)[1:].astype(np.float64), axis=1) for i in dev_ids])
        mean, std = moments(train, layer)
        z = [(train.layer(i, layer).astype(np.float64) - mean) / np.maximum(std, 1e-6) for i in train_ids]
        zf = [np.linalg.norm(x[0]) for x in z]
        zo = np.concatenate([np.linalg.norm(x[1:], axis=1) for x in z])
        top = np.argsort(-std)[:3]
        yield dict(setting=setting, layer=layer, first_norm_dev50=float(np.mean(first)),
                   other_norm_dev50=float(np.mean(other)), max_std=float(std.max()),
                   top_std_dims=" ".join(str(int(d)) for d in top),
                   first_zs_median_train500=float(np.median(zf)), other_zs_median_train500=float(np.median(zo)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("settings", nargs="+", help="name=<train entry dir>,<dev entry dir>")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = []
    for s in a.settings:
        name, dirs = s.split("=", 1)
        train, dev = (RepresentationCache(d) for d in dirs.split(","))
        for r in rows(name, train, dev):
            print(r, file=sys.stderr)
            out.append(r)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)


if __name__ == "__main__":
    main()
