"""``analysis=flow_correlates``: what the flow measures pick up (Westera 2019), on GUM (``data=gum``).

Flow per sentence and layer as :mod:`probes.analysis.westera.flow` (word level; ``G``, ``Gstar`` = G*, ``A``;
``measure[layer, t2, t1]`` = flow from input word t1 to output word t2), any encoder family. Sentences:
the first ``max_sentences`` of ``split`` (file order; null = all), of which a seeded random subset of
``n_sentences`` (paper: 500; null = all) - the same two parameters as ``flow``. Real words only (the
special tokens and t1 == t2 left out).

Two contrasts, each per layer and per measure, with token distance controlled for by **OLS**
(pure numpy/scipy, :func:`probes.stats.ols`; statsmodels is not installed/needed):

* ``open_class``: all pairs (t1, t2); indicator = t1's gold UPOS is open-class (``open_upos``, default
  NOUN VERB ADJ ADV PROPN) vs closed-class (``closed_upos``, default the UD closed classes ADP AUX
  CCONJ DET NUM PART PRON SCONJ; other tags - PUNCT, SYM, X, INTJ - are left out);
* ``coref``: pairs t1 = noun (``noun_upos``: NOUN, PROPN), t2 = pronoun (PRON) of the same sentence;
  indicator = coreferent, i.e. t1 and t2 are head words of mentions of one and the same GUM entity
  (MISC ``Entity=`` read by :func:`probes.data.coref.read_gum_coref`, document-level clusters,
  singletons included as non-coreferent material; heads = tree heads of the mention spans).

Model per (contrast, measure, layer, transform): ``y ~ 1 + indicator + log(distance) + log(n_words)
+ t1_before_t2``, ``y`` = the measure (``raw``) or its natural log (``log``). Reported: coefficient of
the indicator, classical SE/t/p (Student t) and cluster-robust (CR1, by sentence) SE/z/p (pairs of a
sentence are not independent), the coefficient in SDs of y (``coef_std``), n pairs, n positives, and
the raw group means.

``level``: ``piece`` (default; Westera's level: the flow matrices are wordpiece x wordpiece, and the
word pairs of the OLS contrasts above are the mean over the two words' pieces, his ``group_merger=mean``)
or ``word`` (the cache pooling of ``analysis=flow``: the project's variant).

``original: true`` adds Westera's own tests (:mod:`probes.analysis.westera.original`, from the same flow
matrices): the Pearson/Spearman correlation of G (G*) with A over all (layer, t1, t2) triples of the
level (``westera_correlation.csv``; his .41 is Pearson, wordpieces, 500 GUM dev items); per-token
outgoing balance averaged over the pieces of a sentence's open- vs closed-class words and of each of
his eight POS groups, Welch t-tests per layer and pooled (``westera_classes.csv``); coreference
items = a noun (XPOS NN/NNS) before a pronoun (XPOS PRP/PRP$) with material between, y = mean flow from
the noun's pieces to the pronoun's, Welch t-tests coref vs not (``westera_coref_ttests.csv``) and OLS
``y ~ 1 + coref + distance + coref x distance`` over item x layer rows (his model) and per layer
(``westera_coref_ols.csv``; classical and sentence-clustered SEs); ``flow_westera.png``.

Outputs: ``flow_correlates.csv`` (one row per contrast x measure x layer x transform x term),
``flow_correlates_effects.csv`` (the indicator rows only + group means), ``flow_correlates.png``
(per-layer z of the indicator, cluster-robust), ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from probes.analysis.plots import layer_ticks
from probes.analysis.westera.original import (CLOSED_TAGS, NOUN_XPOS, OPEN_TAGS, POS_GROUPS, PRON_XPOS, class_balances,
                                              coref_items, coref_tests, group_tests, pair_mean, pearson_spearman,
                                              word_positions)
from probes.stats import ols
from probes.analysis.westera.flow import select_sentences, sentence_flow
from probes.data.coref import read_gum_coref
from probes.model.inputs import pooling_matrix
from probes.progress import progress

log = logging.getLogger(__name__)

OPEN_UPOS = ("NOUN", "VERB", "ADJ", "ADV", "PROPN")
CLOSED_UPOS = ("ADP", "AUX", "CCONJ", "DET", "NUM", "PART", "PRON", "SCONJ")
CONTROLS = ("log_distance", "log_n_words", "t1_before_t2")


def head_clusters(sentences, path) -> list[list[set[str]]]:
    """Per sentence of ``sentences`` (a whole split, file order), per word: the entity clusters of the
    mentions whose head is that word (empty set: heads no mention)."""
    docs = read_gum_coref(path, sentences)
    out: list[list[set[str]]] = []
    for d in docs:
        heads = defaultdict(set)
        for m in d.mentions:
            heads[m.head].add(m.cluster)
        for off, s in zip(d.offsets, d.sentences):
            out.append([set(heads.get(off + j, ())) for j in range(len(s.words))])
    if len(out) != len(sentences) or any(len(c) != s.n for c, s in zip(out, sentences)):
        raise ValueError("coreference documents do not line up with the treebank sentences")
    return out


def pair_table(sid: int, upos, clusters, flow: dict[str, torch.Tensor], open_upos, closed_upos, noun_upos,
               pron_upos) -> pd.DataFrame:
    """Rows for every (layer, t2, t1) real-word pair, t1 != t2, with both contrasts' indicators."""
    L, W, _ = flow["A"].shape
    n = W - 2
    lay, t2, t1 = np.meshgrid(np.arange(L), np.arange(n), np.arange(n), indexing="ij")
    keep = (t1 != t2).ravel()
    lay, t2, t1 = lay.ravel()[keep], t2.ravel()[keep], t1.ravel()[keep]
    df = pd.DataFrame(dict(sentence=sid, layer=lay, t2=t2, t1=t1))
    up = np.asarray(upos, dtype=object)
    df["upos1"], df["upos2"] = up[t1], up[t2]
    df["distance"] = np.abs(t2 - t1)
    df["log_distance"] = np.log(df.distance)
    df["log_n_words"] = np.log(n)
    df["t1_before_t2"] = (t1 < t2).astype(float)
    df["open1"] = np.where(np.isin(up[t1], list(open_upos)), 1.0, np.where(np.isin(up[t1], list(closed_upos)), 0.0,
                                                                           np.nan))
    noun_pron = np.isin(up[t1], list(noun_upos)) & np.isin(up[t2], list(pron_upos))
    coref = np.array([bool(clusters[a] & clusters[b]) for a, b in zip(t1, t2)])
    df["noun_pron"] = noun_pron
    df["coreferent"] = np.where(noun_pron, coref.astype(float), np.nan)
    for m in ("G", "Gstar", "A"):
        if m in flow:
            df[m] = flow[m].numpy()[lay, t2 + 1, t1 + 1]
    return df


CONTRASTS = {"open_class": "open1", "coref": "coreferent"}


def regressions(df: pd.DataFrame, measures=("G", "Gstar", "A"), transforms=("raw", "log")) -> pd.DataFrame:
    """OLS of each measure (``raw`` or ``log``) on each contrast's indicator and :data:`CONTROLS`, per layer."""
    rows = []
    for contrast, ind in CONTRASTS.items():
        d0 = df[df[ind].notna()]
        for m in measures:
            if m not in d0:
                continue
            for layer, d in d0.groupby("layer"):
                for tr in transforms:
                    y = d[m].to_numpy(dtype=np.float64)
                    if tr == "log":
                        y = np.log(np.maximum(y, 1e-30))
                    x = d[[ind, *CONTROLS]].to_numpy(dtype=np.float64)
                    pos = int(d[ind].sum())
                    base = dict(contrast=contrast, measure=m, layer=int(layer), transform=tr, n_pos=pos,
                                mean_pos=float(d.loc[d[ind] == 1, m].mean()) if pos else np.nan,
                                mean_neg=float(d.loc[d[ind] == 0, m].mean()), sd_y=float(np.std(y)))
                    if pos == 0 or pos == len(d) or len(d) < 10:
                        rows.append(dict(base, term=ind, coef=np.nan))
                        continue
                    for r in ols(y, x, [ind, *CONTROLS], groups=d.sentence.to_numpy()):
                        r["coef_std"] = r["coef"] / base["sd_y"] if base["sd_y"] > 0 else np.nan
                        rows.append(dict(base, **r))
    return pd.DataFrame(rows)


def effect_figure(eff: pd.DataFrame, transform: str = "log"):
    """Per-layer cluster-robust z of each contrast's indicator, one panel per contrast."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, (contrast, title) in zip(axes, (("open_class", "open- vs closed-class t1"),
                                            ("coref", "coreferent vs not (noun -> pronoun)"))):
        e = eff[(eff.contrast == contrast) & (eff.transform == transform)]
        for m, g in e.groupby("measure"):
            ax.plot(g.layer + 1, g.z_cluster, marker="o", label="G*" if m == "Gstar" else m)
        ax.axhline(0, c="grey", lw=0.8)
        for z in (-1.96, 1.96):
            ax.axhline(z, c="grey", lw=0.8, ls=":")
        ax.set_xlabel("layer")
        if len(e):
            layer_ticks(ax, int(e.layer.min()) + 1, int(e.layer.max()) + 1)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"z of indicator ({transform} measure, cluster-robust)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def flow_correlates(ctx, *, split: str = "dev", max_sentences: int | None = None, n_sentences: int | None = 500,
                    seed: int = 0, open_upos=OPEN_UPOS, closed_upos=CLOSED_UPOS, noun_upos=("NOUN", "PROPN"),
                    pron_upos=("PRON",), chain: bool = True, chunk_size: int | None = None,
                    max_length: int | None = None, num_threads: int | None = None,
                    transforms=("raw", "log"), save_pairs: bool = False, level: str = "piece",
                    original: bool = True, open_tags=OPEN_TAGS, closed_tags=CLOSED_TAGS,
                    pos_groups=POS_GROUPS, noun_xpos=NOUN_XPOS, pron_xpos=PRON_XPOS) -> pd.DataFrame:
    """Flow on a seeded random subset of the first ``max_sentences`` sentences of GUM ``split``; OLS of each
    measure on the contrasts; save and return the effects."""
    t0 = time.time()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    sents = ctx.sentences(split)  # the whole split: coreference clusters are read per document
    clusters = head_clusters(sents, ctx.treebank.path(split))
    idx = select_sentences(len(sents), max_sentences, n_sentences, seed)
    chosen = [sents[i] for i in idx]
    if level not in ("piece", "word"):
        raise ValueError(f"analysis.level must be piece or word, got {level!r}")
    parts, orig = [], _Original(level, open_tags, closed_tags, pos_groups, noun_xpos, pron_xpos) if original else None
    flows = sentence_flow(ctx.encoder, [s.words for s in chosen], ctx.device, max_length, chain, chunk_size, level,
                          desc="flow_correlates")  # a tqdm bar on a terminal; progress lines in the log elsewhere
    for k, e, fl in progress(flows, "flow_correlates", total=len(chosen), unit="sentences"):
        s = chosen[k]
        if s.n < 2:
            continue
        fl = {m: v.numpy() for m, v in fl.items()}  # (L, X, X) [t2, t1], X = pieces or words + 2
        if orig is not None:
            orig.add(idx[k], s, clusters[idx[k]], e, fl)
        if level == "piece":  # word pairs = mean over both words' pieces (Westera's group_merger=mean)
            mm = pooling_matrix(e.word_of_piece, e.n_words, "mean").numpy()  # (W, T)
            fl = {m: np.einsum("at,ltu,bu->lab", mm, v, mm) for m, v in fl.items()}  # (L, W, W)
        parts.append(pair_table(idx[k], s.upos, clusters[idx[k]], {m: torch.from_numpy(v) for m, v in fl.items()},
                                open_upos, closed_upos, noun_upos, pron_upos))
    if not parts:
        raise ValueError(f"flow_correlates: no usable sentence in {split}")
    df = pd.concat(parts, ignore_index=True)
    seconds_flow = time.time() - t0
    reg = regressions(df, transforms=tuple(transforms))
    eff = reg[reg.term.isin(list(CONTRASTS.values()))].reset_index(drop=True)
    if save_pairs:
        ctx.save_table(df, "flow_correlates_pairs")
    ctx.save_table(reg, "flow_correlates")
    ctx.save_table(eff, "flow_correlates_effects")
    ctx.save_figure(effect_figure(eff, "log" if "log" in transforms else transforms[0]), "flow_correlates")
    westera = orig.finish(ctx, tuple(m for m in ("G", "Gstar", "A") if m in df)) if orig is not None else None
    l0 = df[df.layer == 0]
    summ = {}
    for _, r in eff.iterrows():
        summ.setdefault(f"{r['contrast']}/{r['measure']}/{r['transform']}", []).append(
            dict(layer=int(r["layer"]), coef=round(float(r["coef"]), 5), coef_std=round(float(r.get("coef_std", np.nan)), 4),
                 z_cluster=round(float(r.get("z_cluster", np.nan)), 2),
                 p_cluster=float(r.get("p_cluster", np.nan)), t=round(float(r.get("t", np.nan)), 2)))
    ctx.log_summary(dict(
        analysis="flow_correlates", split=split, encoder=ctx.encoder.name, model_type=ctx.encoder.model_type,
        seed=seed, max_sentences=max_sentences,
        n_sentences=int(df.sentence.nunique()), n_pairs_per_layer=int(len(l0)),
        n_open_class_pairs=int((l0.open1 == 1).sum()), n_closed_class_pairs=int((l0.open1 == 0).sum()),
        n_noun_pron_pairs=int(l0.coreferent.notna().sum()), n_coreferent_pairs=int((l0.coreferent == 1).sum()),
        model="y ~ 1 + indicator + log(distance) + log(n_words) + t1_before_t2; OLS, CR1 by sentence",
        level=level, seconds=round(time.time() - t0, 1), seconds_flow=round(seconds_flow, 1), effects=summ,
        westera=westera))
    log.info("flow_correlates: %d sentences in %.1fs", df.sentence.nunique(), time.time() - t0)
    return eff


class _Original:
    """Collects, sentence by sentence, what Westera's own tests need (see :mod:`.original`)."""

    def __init__(self, level, open_tags, closed_tags, pos_groups, noun_xpos, pron_xpos):
        self.level = level
        self.classes = {"open": tuple(open_tags), "closed": tuple(closed_tags)}
        self.pos = {g: (g,) for g in pos_groups}
        self.noun_xpos, self.pron_xpos = tuple(noun_xpos), tuple(pron_xpos)
        self.flat: dict[str, list[np.ndarray]] = defaultdict(list)  # measure -> (L, X*X) per sentence
        self.class_rows: list[dict] = []
        self.coref_rows: list[dict] = []

    def add(self, sid: int, s, clusters, e, fl: dict[str, np.ndarray]) -> None:
        for m, v in fl.items():
            self.flat[m].append(v.reshape(v.shape[0], -1))
        pos = word_positions(e.word_of_piece, e.n_words, self.level)
        L = next(iter(fl.values())).shape[0]
        for kind, groups in (("open_closed", self.classes), ("pos", self.pos)):
            vals = {m: class_balances(v, pos, s.upos, groups) for m, v in fl.items()}
            for g in groups:
                for layer in range(L):
                    self.class_rows.append(dict(kind=kind, sentence=sid, layer=layer, group=g,
                                                **{m: float(vals[m][g][layer]) for m in fl}))
        for n_i, (i, j, coref) in enumerate(coref_items(s.xpos, clusters, self.noun_xpos, self.pron_xpos)):
            vals = {m: pair_mean(v, pos[i], pos[j]) for m, v in fl.items()}
            for layer in range(L):
                self.coref_rows.append(dict(sentence=sid, item=n_i, noun=i, pronoun=j, layer=layer,
                                            coref=int(coref), distance=j - i,
                                            **{m: float(vals[m][layer]) for m in fl}))

    def finish(self, ctx, measures) -> dict:
        corr_rows = []
        flat = {m: np.concatenate(v, axis=1) for m, v in self.flat.items()}  # (L, N)
        for m in [x for x in measures if x != "A"]:
            L = flat[m].shape[0]
            for layer in [-1, *range(L)]:
                x = flat[m].ravel() if layer < 0 else flat[m][layer]
                a = flat["A"].ravel() if layer < 0 else flat["A"][layer]
                corr_rows.append(dict(measure=m, against="A", level=self.level, layer=layer,
                                      **pearson_spearman(x, a)))
        corr = pd.DataFrame(corr_rows)
        cls = pd.DataFrame(self.class_rows)
        tests = pd.concat([group_tests(cls[cls.kind == kind], m, list(groups), kind)
                           for kind, groups in (("open_closed", self.classes), ("pos", self.pos)) for m in measures],
                          ignore_index=True)
        items = pd.DataFrame(self.coref_rows)
        ct, co = [], []
        if len(items) and items.coref.nunique() == 2:
            for m in measures:
                t, o = coref_tests(items, m)
                ct.append(t)
                co.append(o)
        ctt = pd.concat(ct, ignore_index=True) if ct else pd.DataFrame()
        col = pd.concat(co, ignore_index=True) if co else pd.DataFrame()
        ctx.save_table(corr, "westera_correlation")
        ctx.save_table(tests, "westera_classes")
        ctx.save_table(ctt, "westera_coref_ttests")
        ctx.save_table(col, "westera_coref_ols")
        ctx.save_figure(_westera_figure(tests, ctt), "flow_westera")
        out = dict(level=self.level,
                   correlation={f"{r.measure}/layer{r.layer}": dict(pearson=round(r.pearson, 4),
                                                                   spearman=round(r.spearman, 4))
                                for r in corr.itertuples()},
                   n_coref_items=int(items[items.layer == 0].coref.sum()) if len(items) else 0,
                   n_nocoref_items=int((items[items.layer == 0].coref == 0).sum()) if len(items) else 0)
        oc = tests[(tests.test == "open_closed") & (tests.a == "open") & (tests.b == "closed")]
        per_layer = lambda d: {m: dict(layers=[round(float(v), 2) for v in g[g.layer >= 0].sort_values("layer").t],  # noqa: E731
                                       pooled=round(float(g[g.layer == -1].t.iloc[0]), 2))
                               for m, g in d.groupby("measure")}
        out["open_vs_closed_t"] = per_layer(oc)
        if len(ctt):
            out["coref_t"] = per_layer(ctt)
        if len(col):
            pooled = col[(col.layer == -1) & col.term.isin(["coref", "coref_x_distance"])]
            out["coref_ols_pooled"] = {f"{r.measure}/{r.term}": dict(coef=r.coef, t=round(r.t, 2), z_cluster=round(r.z_cluster, 2))
                                       for r in pooled.itertuples()}
        return out


def _westera_figure(tests: pd.DataFrame, ctt: pd.DataFrame):
    """Welch t per layer: open vs closed class balance, and coref vs not (noun -> pronoun)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    oc = tests[(tests.test == "open_closed") & (tests.layer >= 0)]
    for m, g in oc.groupby("measure"):
        axes[0].plot(g.layer + 1, g.t, marker="o", label="G*" if m == "Gstar" else m)
    axes[0].set_title("open vs closed class: balance (Welch t)", fontsize=9)
    if len(ctt):
        c = ctt[ctt.layer >= 0]
        for m, g in c.groupby("measure"):
            axes[1].plot(g.layer + 1, g.t, marker="o", label="G*" if m == "Gstar" else m)
    axes[1].set_title("noun -> pronoun: coref vs not (Welch t)", fontsize=9)
    layers = tests.layer[tests.layer >= 0]
    for ax in axes:
        ax.axhline(0, c="grey", lw=0.8)
        for z in (-1.96, 1.96):
            ax.axhline(z, c="grey", lw=0.8, ls=":")
        ax.set_xlabel("layer")
        if len(layers):
            layer_ticks(ax, int(layers.min()) + 1, int(layers.max()) + 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("t")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
