"""Per-layer curve of a structural-probe sweep (Hewitt & Manning's Figure 2 style):
``python -m probes.structural.figure <sweep dir> [<sweep dir> ...] --out docs/figures/structural_layers.png``.

Reads every job's ``metrics.json`` and its layer (``.hydra/config.yaml``: ``data.layer``) and draws one
panel per metric found (dev UUAS, DSpr, root accuracy, NSpr) over the layers, best dev layer marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf

from probes.analysis.plots import layer_ticks, plt
from probes.io import atomic_write

PANEL_LAYER_LABELS = 8  # the most layer numbers one narrow panel labels
METRICS = {"val/uuas_best": "UUAS (dev, best epoch)", "test/uuas": "UUAS (test)", "test/dspr": "DSpr. (test)",
           "val/root_acc_best": "root accuracy (dev, best epoch)", "test/root_acc": "root accuracy (test)",
           "test/nspr": "NSpr. (test)"}


def collect(sweep_dirs: list[str | Path]) -> dict[str, dict[int, float]]:
    """``{metric: {layer: value}}`` over the jobs under ``sweep_dirs`` (multirun folders, or single run folders;
    a later job overrides an earlier one)."""
    out: dict[str, dict[int, float]] = {}
    for sweep in sweep_dirs:
        for m in [*Path(sweep).glob("metrics.json"), *sorted(Path(sweep).glob("*/metrics.json"))]:
            cfg = OmegaConf.load(m.parent / ".hydra" / "config.yaml")
            layer = int(cfg.data.layer)
            for k, v in json.loads(m.read_text()).items():
                if k in METRICS:
                    out.setdefault(k, {})[layer] = float(v)
    if not out:
        raise FileNotFoundError(f"no jobs with structural-probe metrics under {[str(s) for s in sweep_dirs]}")
    return out


def layer_figure(values: dict[str, dict[int, float]], title: str = ""):
    """One panel per metric: value (x100) over layers 0..L (0 = embedding output), the best layer marked."""
    keys = [k for k in METRICS if k in values]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        layers = sorted(values[k])
        ys = [100 * values[k][l] for l in layers]
        ax.plot(layers, ys, marker="o")
        best = layers[max(range(len(ys)), key=ys.__getitem__)]
        ax.axvline(best, color="grey", ls=":", lw=1)
        if len(layers) <= PANEL_LAYER_LABELS:
            ax.set_xticks(layers)  # the layers probed, each labelled
        else:  # many layers on a narrow panel: thinned labels (probes.analysis.plots.layer_ticks)
            layer_ticks(ax, layers[0], layers[-1], max_labels=PANEL_LAYER_LABELS)
        ax.set_xlabel("layer (0 = embeddings)", fontsize=8)
        ax.set_title(METRICS[k], fontsize=9)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> Path:
    """Draw the figure of the sweeps named in ``argv``; returns the PNG written."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", help="multirun folders of `python train.py -m ... 'data.layer=range(...)'` (or single runs)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    fig = layer_figure(collect(a.sweeps), a.title)
    out = atomic_write(a.out, lambda tmp: fig.savefig(tmp, dpi=150, format="png"))
    print(out)
    return Path(out)


if __name__ == "__main__":
    main()
