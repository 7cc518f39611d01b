"""Per-layer figures number their layers readably: every layer up to 16, fewer integer labels that do not overlap
for deep models (SmolLM2's 30 layers), through the one helper :func:`probes.analysis.plots.layer_ticks`."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from probes.analysis import plots  # noqa: E402
from probes.analysis.beyond.faithfulness import METRICS, layers_figure  # noqa: E402
from probes.analysis.clark import grad_sep  # noqa: E402
from probes.analysis.kovaleva.disable_heads import layer_bars  # noqa: E402
from probes.analysis.kovaleva.pattern_types import stacked_bars  # noqa: E402
from probes.analysis.pascual.attribution import figure_layers  # noqa: E402
from probes.analysis.westera.flow import curve_figure  # noqa: E402
from probes.structural.figure import METRICS as STRUCTURAL  # noqa: E402
from probes.structural.figure import layer_figure  # noqa: E402

H = 9


def drawn(axis) -> list:
    """The major tick labels drawn on ``axis`` (inside the view, visible, non-empty; left/bottom or right/top)."""
    axis.figure.canvas.draw()
    lo, hi = sorted(axis.get_view_interval())
    return [label for t in axis.get_major_ticks() if lo - 1e-9 <= t.get_loc() <= hi + 1e-9
            for label in (t.label1, t.label2) if label.get_visible() and label.get_text()]


def shown(axis) -> list[str]:
    """The texts of :func:`drawn`."""
    return [label.get_text() for label in drawn(axis)]


def assert_readable(axis, n_layers: int, first: int = 1) -> None:
    """At most 16 labels, each a layer number of first..first + n_layers - 1 (every one when there are at most 16;
    else evenly spaced, the first within a step of the first layer), no two labels overlapping."""
    labels = drawn(axis)
    numbers = [int(label.get_text()) for label in labels]  # integers, or ValueError
    layers = list(range(first, first + n_layers))
    assert len(numbers) <= 16 and set(numbers) <= set(layers) and numbers == sorted(numbers)
    if n_layers <= 16:
        assert numbers == layers
    else:
        steps = set(np.diff(numbers[1:]))
        assert len(numbers) >= 5 and len(steps) == 1 and numbers[0] - first < steps.pop()
    renderer = axis.figure.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    for a, b in zip(boxes, boxes[1:]):
        assert not a.overlaps(b), (a, b)


@pytest.mark.parametrize("n_layers", [6, 30])
def test_layer_curves_and_heatmaps(n_layers):
    stats = {k: np.random.default_rng(0).random((n_layers, H)) for k in ("prev", "self")}
    fig = plots.layer_curves(stats, groups=[["prev", "self"]], ylabels=["avg. attention"])
    assert_readable(fig.axes[0].xaxis, n_layers)
    plt.close(fig)
    fig = plots.heatmaps(stats)
    assert_readable(fig.axes[0].yaxis, n_layers)  # rows 0..L-1 named 1..L
    assert [int(s) for s in shown(fig.axes[0].xaxis)] == list(range(1, H + 1))  # heads untouched
    plt.close(fig)


def test_helper_itself():
    """Labels, a 0-based axis (0 = embeddings) and a colorbar; bad arguments fail."""
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(range(31), range(31))
    assert plots.layer_ticks(ax, 0, 30) == [0, *range(2, 31, 2)]
    assert_readable(ax.xaxis, 31, first=0)
    cbar = fig.colorbar(ax.scatter(range(30), range(30), c=np.arange(1, 31)), ax=ax)
    plots.layer_ticks(cbar.ax, 1, 30, axis="y")
    assert_readable(cbar.ax.yaxis, 30)
    assert plots.layer_ticks(ax, 1, 12) == list(range(1, 13))
    assert plots.layer_ticks(ax, 1, 30) == list(range(2, 31, 2))
    assert plots.layer_ticks(ax, 1, 48) == [1, 5, 10, 15, 20, 25, 30, 35, 40, 45]
    for bad in (dict(first=3, last=2), dict(first=1, last=5, axis="z"), dict(first=1, last=5, max_labels=1)):
        with pytest.raises(ValueError):
            plots.layer_ticks(ax, **bad)
    plt.close(fig)


def _grad_sep(L):
    return grad_sep.figure(pd.DataFrame([dict(target=t, stat=s, layer=l, value=0.1 * l) for t in ("sep", "other")
                                         for s in ("mean_abs", "mean") for l in range(L)]))


def _layer_bars(L):
    rows = [dict(condition="none", metric="accuracy", layer=-1, value=0.8, delta=0.0)]
    rows += [dict(condition="layer", metric="accuracy", layer=l, value=0.7, delta=-0.1) for l in range(L)]
    return layer_bars(pd.DataFrame(rows), "accuracy", "mrpc")


def _attribution(L):
    return figure_layers(pd.DataFrame([dict(kind="attention", method="ixg", layer=l, js=0.1, spearman=0.2, top1=0.3,
                                            pattern_agree=0.4) for l in range(L)]))


def _faithfulness(L):
    rows = [dict(kind="attention", layer=l + 1, metric=m, mean=0.1, lo=0.0, hi=0.2) for l in range(L) for m in METRICS]
    rows += [dict(kind="random", layer=0, metric=m, mean=0.1, lo=0.0, hi=0.2) for m in METRICS]
    return layers_figure(pd.DataFrame(rows), ["attention"], ["random"], "t")


def _pattern_types(L):
    return stacked_bars(pd.DataFrame([dict(task="mrpc", model="pre-trained", layer=l, pattern=p, share=0.5)
                                      for l in range(L) for p in ("vertical", "diagonal")]),
                        ["vertical", "diagonal"], by_layer=True)


def _flow(L):
    return curve_figure(pd.DataFrame([dict(pairs=p, scope="layer", measure=m, layer=l, rho=0.3)
                                      for p in ("all", "words_no_self") for m in ("G", "Gstar") for l in range(L)]))


@pytest.mark.parametrize("make", [_grad_sep, _layer_bars, _attribution, _faithfulness, _pattern_types, _flow])
@pytest.mark.parametrize("n_layers", [6, 30])
def test_per_layer_figures(make, n_layers):
    """Each analysis's per-layer figure: every axis labelled as layers is readable."""
    fig = make(n_layers)
    axes = [ax for ax in fig.axes if "layer" in ax.get_xlabel()]
    assert axes
    for ax in axes:
        assert_readable(ax.xaxis, n_layers)
    plt.close(fig)


@pytest.mark.parametrize("layers", [list(range(0, 7)), list(range(0, 31)), list(range(0, 31, 3))])
def test_structural_layer_figure(layers):
    """The structural probe's per-layer panels (0 = embeddings): labels readable on a narrow panel, whether every
    layer of a deep model or every third one was probed."""
    key = next(iter(STRUCTURAL))
    fig = layer_figure({key: {l: 0.01 * (l % 5) for l in layers}})
    axis = fig.axes[0].xaxis
    numbers = [int(t) for t in shown(axis)]
    assert 2 <= len(numbers) <= 8 and set(numbers) <= set(range(layers[0], layers[-1] + 1))
    if len(layers) <= 8:
        assert numbers == layers
    renderer = fig.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in drawn(axis)]
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    plt.close(fig)
