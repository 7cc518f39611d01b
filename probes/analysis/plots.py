"""Matplotlib figures (the backend is matplotlib's own choice: Agg without a display, inline in a notebook);
heads are labelled with the paper's 1-based names."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np

MAX_LAYER_LABELS = 16  # the most layer numbers an axis shows (SmolLM2's 30 layers: 2, 4, ..., 30)
STAT_TITLES = dict(prev="to previous token", self="to self", next="to next token", cls="to [CLS]",
                   sep="to [SEP]", punct="to punctuation", entropy="entropy (nats)",
                   cls_entropy="entropy from [CLS] (nats)")


def _nice_steps():
    """1, 2, 5, 10, 20, 50, ..."""
    yield 1
    scale = 1
    while True:
        for m in (2, 5, 10):
            yield m * scale
        scale *= 10


def layer_ticks(ax, first: int, last: int, *, axis: str = "x", shift: float = 0, max_labels: int = MAX_LAYER_LABELS,
                **text) -> list[int]:
    """Readable integer layer ticks on ``ax``'s ``axis`` (``"x"`` / ``"y"``; a colorbar's ``cbar.ax`` too).

    ``first``..``last``: the layer numbers as the figure names them (1-based, or 0 = the embeddings), each at data
    position ``number + shift`` (an image's row ``l`` is layer ``l + 1``: ``shift=-1``). Every layer is labelled
    when there are at most ``max_labels``; else the multiples of the smallest step of 2, 5, 10, 20, 50, ... that
    keeps the labels within ``max_labels`` (and ``first`` where the next label is over half a step away), with an
    unlabelled minor tick on every layer. ``text``: the labels' properties (``fontsize=6``). Returns the labelled
    layer numbers."""
    if last < first or max_labels < 2 or axis not in ("x", "y"):
        raise ValueError(f"layer_ticks: need first <= last, max_labels >= 2 and axis x or y, got first={first}, "
                         f"last={last}, max_labels={max_labels}, axis={axis!r}")
    for step in _nice_steps():  # ends: a step above last - first leaves at most two labels
        start = -(-first // step) * step  # the first multiple of step from first on
        labelled = ([first] if 2 * (start - first) > step else []) + list(range(start, last + 1, step))
        if len(labelled) <= max_labels:
            break
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    set_ticks([l + shift for l in labelled], [str(l) for l in labelled], **text)
    if step > 1:
        set_ticks([l + shift for l in range(first, last + 1)], minor=True)
    return labelled


def layer_head_axes(ax, m: np.ndarray, *, cmap: str = "viridis", vmin=None, vmax=None, annotate: str | None = None,
                    title: str = "", colorbar: bool = True):
    """Draw one (L, H) layer x head matrix on ``ax`` with 1-based ``layer``/``head`` ticks (layer 1 at the top).

    annotate: a format such as ``"{:.2f}"`` writes each cell's value. Returns the image."""
    L, H = m.shape
    im = ax.imshow(m, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
    if annotate:
        lo, hi = im.get_clim()
        for l in range(L):
            for h in range(H):
                if np.isfinite(m[l, h]):
                    light = (m[l, h] - lo) / max(hi - lo, 1e-12) < 0.5
                    ax.text(h, l, annotate.format(m[l, h]), ha="center", va="center", fontsize=5,
                            color="w" if light and cmap == "viridis" else "k")
    ax.set_xticks(range(H), [str(h + 1) for h in range(H)], fontsize=6)
    layer_ticks(ax, 1, L, axis="y", shift=-1, fontsize=6)
    ax.set_xlabel("head", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    if title:
        ax.set_title(title, fontsize=8)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return im


def word_map_axes(ax, m: np.ndarray, labels, *, cmap: str | None = None, vmin=None, vmax=None, title: str = "",
                  colorbar: bool = True):
    """Draw one (R, R) word-level map on ``ax``: rows = from (y, top to bottom), columns = to (x), both ticked
    with ``labels``. ``cmap`` None: ``Blues`` from 0 for a map without negative values, else ``RdBu_r``
    centred on 0. Returns the image."""
    R = len(labels)
    if m.shape != (R, R):
        raise ValueError(f"a word map of {R} labels must be ({R}, {R}), got {m.shape}")
    if cmap is None:
        signed = np.nanmin(m) < 0
        cmap = "RdBu_r" if signed else "Blues"
        top = float(np.nanmax(np.abs(m))) or 1.0
        vmin = (-top if signed else 0.0) if vmin is None else vmin
        vmax = top if vmax is None else vmax
    im = ax.imshow(m, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    size = 8 if R <= 20 else 6 if R <= 40 else 4
    ax.set_xticks(range(R), labels, rotation=90, fontsize=size)
    ax.set_yticks(range(R), labels, fontsize=size)
    ax.set_xlabel("to", fontsize=8)
    ax.set_ylabel("from", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return im


def figure_note(fig, note: str | None, fontsize: float = 8) -> None:
    """Write ``note`` under the figure's panels (after its layout), wrapped to the figure's width; the saved
    image (``bbox_inches="tight"``) grows to hold it. None: nothing."""
    if note:
        width = max(40, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))  # characters of about 0.6 em
        fig.text(0.5, 0, textwrap.fill(note, width), ha="center", va="top", fontsize=fontsize)


def panel_grid(n: int, ncols: int, width: float, height: float):
    """``(fig, axes)``: a grid of ``n`` panels, ``ncols`` a row, each ``width`` x ``height`` inches; the grid's
    unused cells are switched off and ``axes`` lists the ``n`` used ones in row order."""
    nrows = int(np.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def layer_head_figure(matrices: dict[str, np.ndarray], ncols: int = 4, **kw):
    """One :func:`layer_head_axes` panel per named (L, H) matrix; ``kw`` as there (title = the name)."""
    L, H = next(iter(matrices.values())).shape
    fig, axes = panel_grid(len(matrices), min(ncols, len(matrices)), 0.3 * H + 1.8, 0.35 * L + 1.6)
    for ax, (k, m) in zip(axes, matrices.items()):
        layer_head_axes(ax, m, title=k, **kw)
    fig.tight_layout()
    return fig


def heatmaps(stats: dict[str, np.ndarray], titles: dict[str, str] | None = None, ncols: int = 4,
             note: str | None = None):
    """One layer x head heatmap per stat; axes labelled 1-based (layer 1 at the top); ``note``: :func:`figure_note`."""
    titles = titles or STAT_TITLES
    L, H = next(iter(stats.values())).shape
    fig, axes = panel_grid(len(stats), ncols, 3.2, 0.35 * L + 1.6)
    for ax, (k, v) in zip(axes, stats.items()):
        entropy_like = "entropy" in k
        layer_head_axes(ax, v, vmin=None if entropy_like else 0,
                        vmax=None if entropy_like else max(1e-6, float(np.nanmax(v))), title=titles.get(k, k))
    fig.tight_layout()
    figure_note(fig, note)
    return fig


def layer_curves(stats: dict[str, np.ndarray], groups: list[list[str]], ylabels: list[str],
                 hlines: list[dict[str, float] | None] | None = None, titles: dict[str, str] | None = None,
                 note: str | None = None):
    """Per-layer mean over heads (line) with every head (dots); one panel per group of stats (each (L, H));
    ``note``: :func:`figure_note`."""
    titles = titles or STAT_TITLES
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for g, (ax, keys) in enumerate(zip(axes[0], groups)):
        for k in keys:
            v = stats[k]
            L, H = v.shape
            layers = np.arange(1, L + 1)
            line, = ax.plot(layers, v.mean(1), marker="o", label=titles.get(k, k))
            ax.scatter(np.repeat(layers, H) + np.tile(np.linspace(-0.15, 0.15, H), L), v.reshape(-1),
                       s=6, alpha=0.35, color=line.get_color())
        for name, y in ((hlines or [None] * len(groups))[g] or {}).items():
            ax.axhline(y, ls="--", color="gray", lw=1)
            ax.text(1, y, name, fontsize=7, va="bottom", color="gray")
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabels[g])
        layer_ticks(ax, 1, max(stats[k].shape[0] for k in keys))
        ax.legend(fontsize=7)
    fig.tight_layout()
    figure_note(fig, note)
    return fig
