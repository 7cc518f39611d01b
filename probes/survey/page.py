"""``python -m probes.survey.page``: the tables and the figure of ``docs/beyond/five-models.md`` from the survey's
records (``docs/results/five_models/<model>/<step>/``).

Each table is written between the page's markers ``<!-- survey:<table> -->`` and ``<!-- /survey:<table> -->``; the
prose around them is left as it is. Layers are shown on a relative-depth axis: attention layer l of L (0-based)
at (l + 1) / L, hidden state k (0 = embeddings) at k / L. ``tests/test_five_models.py`` reads the page and checks
every number against the records on its own.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from probes.config import PROJECT_ROOT  # noqa: E402
from probes.io import atomic_write, atomic_write_text  # noqa: E402

RECORDS = PROJECT_ROOT / "docs" / "results" / "five_models"
PAGE = PROJECT_ROOT / "docs" / "beyond" / "five-models.md"
FIGURE = PROJECT_ROOT / "docs" / "figures" / "five_models_depth.png"
MODELS = ("minilm", "mpnet_base", "smollm2", "gemma3_270m", "qwen2_5_coder_1_5b")
FIRST_STATS = ("cls", "bos", "first")          # head_stats' column of position 0, by what it holds
DEP_RELATIONS = ("all", "det", "nsubj", "obj", "amod", "case", "aux", "advmod", "compound", "nmod:poss", "mark",
                 "cc", "conj", "obl")
COREF_GROUPS = ("all", "pronoun", "proper", "nominal")


class Records:
    """The records of one model: ``<records>/<model>/<step>/<file>``."""

    def __init__(self, root: Path, model: str):
        self.root, self.model = Path(root) / model, model

    def has(self, step: str) -> bool:
        return (self.root / step / "record.json").exists()

    def record(self, step: str) -> dict:
        return json.loads((self.root / step / "record.json").read_text())

    def json(self, step: str, name: str = "summary.json") -> dict:
        return json.loads((self.root / step / name).read_text())

    def csv(self, step: str, name: str) -> pd.DataFrame:
        return pd.read_csv(self.root / step / name)

    def steps(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/record.json"))

    @cached_property
    def meta(self) -> dict:
        """The model's facts and sizes, as its first step's record holds them."""
        return self.record(self.steps()[0])

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def causal(self) -> bool:
        return bool(self.meta["causal"])

    @property
    def weights(self) -> str | None:
        """How the model's weights were stored (``weights`` of its records, read from the model's file by its
        loader, e.g. ``GGUF Q4_K_M (Q4_K 76 %, Q6_K 24 % of the weights), dequantized to float32 at fetch``);
        None: as published. Records written before the field existed are passed over; records that disagree, or
        none holding it, are an error."""
        found = {json.dumps(rec["weights"]) for rec in map(self.record, self.steps()) if "weights" in rec}
        if len(found) != 1:
            raise ValueError(f"{self.root}: the records' weights field is {sorted(found) or 'in none of them'}; "
                             f"rerun a step (python -m probes.survey encoder={self.model} only=[sink] force=true)")
        return json.loads(found.pop())

    def structural(self) -> pd.DataFrame:
        """The structural sweep's finished jobs with their probed ``layer`` (hidden state, 0 = embeddings)."""
        s = self.csv("structural", "summary.csv")
        s = s[s.status == "ok"].copy()
        s["layer"] = s.job.str.extract(r"data\.layer=(\d+)")[0].astype(int)
        return s.sort_values("layer")

    def grad_mean_abs(self) -> tuple[pd.DataFrame, str]:
        """(layer x target mean |dL/dA| of the no-op test, the sink's target: ``first`` or ``sep``)."""
        g = self.csv("grad_sep", "grad_sep.csv")
        g = g[g.stat == "mean_abs"].pivot(index="layer", columns="target", values="value")
        return g, "first" if "first" in g.columns else "sep"


def first_stat(by_layer: pd.DataFrame) -> str:
    """The head statistics' column of position 0 (``cls``, ``bos`` or ``first``)."""
    found = [s for s in FIRST_STATS if s in set(by_layer.stat)]
    if len(found) != 1:
        raise ValueError(f"head_stats_by_layer.csv: expected one of {FIRST_STATS}, found {found}")
    return found[0]


def per_layer(by_layer: pd.DataFrame, stat: str) -> pd.Series:
    """Mean over heads of ``stat`` per layer (0-based index)."""
    return by_layer[by_layer.stat == stat].set_index("layer")["mean"].sort_index()


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


# ------------------------------------------------------------------------------------------------ tables
def models_table(recs: list[Records]) -> str:
    """Each model: kind, layers x heads, its weights as stored, own loss, sentence counts, wall time of its steps."""
    rows = []
    for r in recs:
        sizes = r.meta["sizes"]
        wall = sum(r.record(s)["wall_time_s"] for s in r.steps())
        loss = r.json("grad_sep")["objective"] if r.has("grad_sep") else "–"
        heads = r.meta["num_heads"]
        rows.append([r.name, "decoder" if r.causal else "encoder", f"{r.num_layers} x {heads}",
                     r.weights or "as published", loss, f"{sizes['train']} / {sizes['dev']} / {sizes['test']}",
                     f"{sizes['clustering']} / {sizes['grad']} / {sizes['windows']}", f"{wall / 60:.1f}"])
    return table(["model", "kind", "layers x heads", "weights", "own loss", "sentences train / dev / test",
                  "clustering / no-op test / sink windows", "wall time (min)"], rows)


def attention_table(recs: list[Records]) -> str:
    """Clark's Figure 1 and 4 per model: attention to position 0, [SEP], '. ,' and the entropy, mean over layers."""
    rows = []
    for r in recs:
        d = r.csv("head_stats", "head_stats_by_layer.csv")
        first = first_stat(d)
        f = per_layer(d, first)
        sep = per_layer(d, "sep") if "sep" in set(d.stat) else None
        ent = per_layer(d, "entropy")
        rows.append([r.name, first, f"{f.mean():.2f}", f"{f.max():.2f} ({f.idxmax() + 1})",
                     f"{sep.mean():.2f}" if sep is not None else "–", f"{per_layer(d, 'punct').mean():.2f}",
                     f"{ent.iloc[0]:.2f}", f"{ent.iloc[-1]:.2f}"])
    return table(["model", "position 0", "to position 0 (mean)", "max (layer)", "to [SEP]", "to . ,",
                  "entropy layer 1", "entropy last layer"], rows)


def sink_table(recs: list[Records]) -> str:
    """Gu et al.'s sink rate (alpha > threshold per window, averaged over windows, layers and heads), the share of
    heads whose alpha averaged over the windows exceeds the threshold, and the layers whose own rate exceeds 1/2."""
    rows = []
    for r in recs:
        s = r.json("sink")
        d = r.csv("sink", "sink_by_layer.csv").sort_values("layer")
        most = d[d.sink_rate > 0.5]
        rows.append([r.name, str(s["first_token"]), pct(s["sink_rate"]), pct(s["share_mean_alpha_above"]),
                     f"{len(most)} of {len(d)}", str(int(most.layer.min()) + 1) if len(most) else "–",
                     f"{d.mean_alpha.mean():.2f}"])
    return table(["model", "position 0 (first window)", "sink rate (%)", "heads with mean α > 0.3 (%)",
                  "layers with a sink rate above 50 %", "first such layer", "mean attention to it"], rows)


def grad_table(recs: list[Records]) -> str:
    """The no-op test: mean |dLoss/dA| per target (mean over layers), the sink's ratio to the rest, and that ratio
    in the middle half of the layers (L // 4 .. 3 L // 4 - 1, 0-based)."""
    rows = []
    for r in recs:
        g, sink = r.grad_mean_abs()
        m = {t: g[t].mean() for t in (sink, "punct", "other")}
        mid = g.iloc[len(g) // 4:3 * len(g) // 4]  # the middle half of the layers
        ratio_mid = mid[sink].mean() / mid["other"].mean()
        rows.append([r.name, r.json("grad_sep")["objective"], "first token" if sink == "first" else "[SEP]",
                     f"{m[sink]:.2e}", f"{m['punct']:.2e}", f"{m['other']:.2e}",
                     f"{m[sink] / m['other']:.2f}", f"{ratio_mid:.2f}"])
    return table(["model", "loss", "sink target", "to the sink", "to . ,", "to other", "sink / other",
                  "sink / other, middle layers"], rows)


def dep_table(recs: list[Records]) -> str:
    """Clark's Table 1: per relation, each model's best head accuracy (name) / best offset accuracy."""
    tabs = {r.name: r.csv("dep_heads", "dep_table.csv").set_index("relation") for r in recs}
    rels = [x for x in DEP_RELATIONS if all(x in t.index for t in tabs.values())]
    rows = []
    for rel in rels:
        row = [rel]
        for t in tabs.values():
            x = t.loc[rel]
            row.append(f"{pct(x.accuracy)} ({x['name']}) / {pct(x.offset_accuracy)}")
        rows.append(row)
    return table(["relation", *tabs], rows)


def coref_table(recs: list[Records]) -> str:
    """Clark's Table 2: the best head against the baselines, accuracy (%) by mention kind."""
    rows = []
    for r in recs:
        t = r.csv("coref_heads", "coref_table.csv").set_index("method")
        best = t.loc["best_head"]
        rows.append([r.name, str(best["name"]), *(pct(best[g]) for g in COREF_GROUPS),
                     *(pct(t.loc[m, "all"]) for m in ("nearest", "head_match", "rule_based")), str(int(best.n_all)),
                     str(r.json("coref_heads")["n_long_sentences"])])
    return table(["model", "best head", "all", "pronoun", "proper", "nominal", "nearest", "head match", "rules",
                  "mentions", "sentences left out (> 128 pieces)"], rows)


def probe_table(recs: list[Records]) -> str:
    """Table 3: test UAS of the attention probes; the structural probe's best layer (dev) and its test UUAS."""
    rows = []
    for r in recs:
        a = r.json("table3_attn_only", "metrics.json")
        g = r.json("table3_attn_glove", "metrics.json")
        s = r.structural()
        best = s.loc[s["val/uuas_best"].idxmax()]
        rows.append([r.name, pct(a["test/uas"]), pct(g["test/uas"]),
                     f"{int(best.layer)} of {r.num_layers} ({best.layer / r.num_layers:.2f})",
                     pct(best["test/uuas"]), str(len(s))])
    return table(["model", "attention only: test UAS", "attention + GloVe: test UAS", "structural: best layer",
                  "structural: test UUAS", "layers probed"], rows)


def clustering_table(recs: list[Records]) -> str:
    """Clark's Figure 6: how layered the head space is, and the heads' behaviours."""
    rows = []
    for r in recs:
        s = r.json("clustering")
        counts = ", ".join(f"{k} {v}" for k, v in sorted(s["behaviour_counts"].items(), key=lambda kv: -kv[1]))
        rows.append([r.name, pct(s["nearest_neighbour_same_layer"]), pct(s["nearest_neighbour_same_layer_chance"]),
                     counts])
    return table(["model", "nearest head in the same layer (%)", "chance (%)", "behaviours (heads)"], rows)


def views_table(recs: list[Records], page: Path) -> str:
    """Links to each model's HTML view of one sentence."""
    rows = []
    for r in recs:
        html = r.root / "view" / "view.html"
        rows.append([r.name, f"[attention, layers x heads]({Path('..') / html.relative_to(page.parent.parent)})"])
    return table(["model", "view"], rows)


TABLES: dict[str, Callable[[list[Records]], str]] = {
    "models": models_table, "attention": attention_table, "sink": sink_table, "grad_sep": grad_table,
    "dep_heads": dep_table, "coref_heads": coref_table, "probes": probe_table, "clustering": clustering_table}


# ------------------------------------------------------------------------------------------------ figure
def depth_figure(recs: list[Records]):
    """Six panels against relative depth, one line per model."""
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    panels = [("attention to position 0", axes[0, 0]), ("attention to . , ([SEP] dashed)", axes[0, 1]),
              ("sink rate: share of (window, head) with α > 0.3", axes[0, 2]),
              ("attention entropy (nats)", axes[1, 0]), ("no-op test: |dL/dA| sink / other", axes[1, 1]),
              ("structural probe: test UUAS", axes[1, 2])]
    for r in recs:
        L = r.num_layers
        d = r.csv("head_stats", "head_stats_by_layer.csv")
        depth = lambda idx: (pd.Index(idx) + 1) / L  # noqa: E731
        f = per_layer(d, first_stat(d))
        line = axes[0, 0].plot(depth(f.index), f.values, marker=".", label=r.name)[0]
        p = per_layer(d, "punct")
        axes[0, 1].plot(depth(p.index), p.values, marker=".", color=line.get_color())
        if "sep" in set(d.stat):
            s = per_layer(d, "sep")
            axes[0, 1].plot(depth(s.index), s.values, ls="--", color=line.get_color())
        if r.has("sink"):
            k = r.csv("sink", "sink_by_layer.csv").sort_values("layer")
            axes[0, 2].plot(depth(k.layer), k.sink_rate, marker=".", color=line.get_color())
        e = per_layer(d, "entropy")
        axes[1, 0].plot(depth(e.index), e.values, marker=".", color=line.get_color())
        if r.has("grad_sep"):
            g, sink = r.grad_mean_abs()
            axes[1, 1].plot(depth(g.index), g[sink] / g["other"], marker=".", color=line.get_color())
        if r.has("structural"):
            s = r.structural()
            axes[1, 2].plot(s.layer / L, s["test/uuas"], marker=".", color=line.get_color())
    for title, ax in panels:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("relative depth")
        ax.set_xlim(0, 1.02)
    axes[1, 1].axhline(1, color="grey", lw=0.6)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ page
def fill_block(text: str, name: str, body: str, page: Path) -> str:
    """``text`` with the block between ``<!-- survey:name -->`` and ``<!-- /survey:name -->`` set to ``body``."""
    pattern = re.compile(rf"(<!-- survey:{re.escape(name)} -->\n)(.*?)(<!-- /survey:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"{page}: no block <!-- survey:{name} --> ... <!-- /survey:{name} -->")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def write_page(records: Path = RECORDS, page: Path = PAGE, figure: Path = FIGURE,
               models: Sequence[str] = MODELS) -> Path:
    """Fill ``page``'s tables from ``records`` for ``models`` (missing records: an error naming them); draw
    ``figure``."""
    recs = [Records(records, m) for m in models]
    missing = [f"{r.model}/{s}" for r in recs for s in ("head_stats", "sink", "grad_sep", "dep_heads", "coref_heads",
                                                         "clustering", "table3_attn_only", "table3_attn_glove",
                                                         "structural", "view") if not r.has(s)]
    if missing:
        raise FileNotFoundError(f"{records}: no record of {missing} (run python -m probes.survey -m)")
    text = page.read_text()
    for name, fn in TABLES.items():
        text = fill_block(text, name, fn(recs), page)
    text = fill_block(text, "views", views_table(recs, page), page)
    fig = depth_figure(recs)
    atomic_write(figure, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return atomic_write_text(page, text)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m probes.survey.page [--records DIR] [--page FILE] [--figure FILE] [--models m ...]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--figure", type=Path, default=FIGURE)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    a = p.parse_args(argv)
    print(write_page(a.records, a.page, a.figure, a.models))


if __name__ == "__main__":
    main()
