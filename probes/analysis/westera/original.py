"""Westera 2019's own measures and tests (``mwestera/bertology``: ``experiment.py``, ``data_utils.py``,
``interface_BERT.py``, ``correlation.py``), applied to flow matrices of any level.

Conventions of the reference code, reproduced here:

* weights are kept as ``(layer, input t1, output t2)`` (gradients transposed; attention = the head mean
  transposed, ``compute_MAT``); this project's flow matrices are ``(L, t2, t1)``, so ``w = flow.T``;
* **token groups** (a word, all words of a class) are merged with ``group_merger=mean``
  (``merge_grouped_tokens``): a group's value is the mean over the group's wordpieces, of the rows
  (inputs) and of the columns (outputs) - "each word's piece-level gradient norms averaged";
* **balance** of a token (``--balance``) = ``np.nansum(w[layer], axis=1)``: the sum of its weights to all
  output tokens of the sentence ([CLS]/[SEP] included), i.e. its total outgoing influence; then
  merged over the pieces of a group with the mean;
* the G vs A correlation (``correlation.py``): **Pearson** over every (layer, t1, t2) wordpiece triple
  of all items pooled (specials included), and per layer;
* tests: Welch t-tests (``ttest_ind(equal_var=False)``) between groups or factor levels per layer and over
  all layers pooled; coreference: ``sm.OLS(y ~ 1 + coref + distance + coref*distance)`` over the item x
  layer rows (``distance`` in words, as in ``ontonotes_dev_info_NN-PRP.csv``).

Word classes (``data_utils.CONLLU_tags``): open = ADJ ADV INTJ NOUN PROPN VERB, closed = ADP AUX CCONJ
DET NUM (other tags belong to neither). POS groups of ``en_gum-ud-dev_POS.csv``: ADJ ADV NOUN PRON VERB
AUX DET PROPN. Coreference items (``ontonotes_dev_info_NN-PRP.csv``): a noun (XPOS NN/NNS) before a
pronoun (XPOS PRP/PRP$) with at least one word between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np
import pandas as pd
from scipy.stats import pearsonr, ttest_ind

from probes.stats import ols, spearman_rows

OPEN_TAGS = ("ADJ", "ADV", "INTJ", "NOUN", "PROPN", "VERB")
CLOSED_TAGS = ("ADP", "AUX", "CCONJ", "DET", "NUM")
POS_GROUPS = ("ADJ", "ADV", "NOUN", "PRON", "VERB", "AUX", "DET", "PROPN")
NOUN_XPOS = ("NN", "NNS")
PRON_XPOS = ("PRP", "PRP$")


def word_positions(word_of_piece: Sequence[int], n_words: int, level: str) -> list[list[int]]:
    """Per word, its rows in the flow matrix: its pieces (``piece``) or its own row w+1 (``word``)."""
    if level == "word":
        return [[w + 1] for w in range(n_words)]
    pos: list[list[int]] = [[] for _ in range(n_words)]
    for t, w in enumerate(word_of_piece):
        if 0 <= w < n_words:
            pos[w].append(t)
    return pos


def balance(flow: np.ndarray) -> np.ndarray:
    """(L, X) outgoing influence of every token: sum over outputs t2 of flow[l, t2, t1]; ``flow`` (L, X, X)."""
    return np.nansum(flow, axis=1)


def group_mean(values: np.ndarray, positions: list[int]) -> np.ndarray:
    """(L,) mean over the positions of a group of (L, X) values; NaN when the group is empty."""
    if not positions:
        return np.full(values.shape[0], np.nan)
    return values[:, positions].mean(1)


def pair_mean(flow: np.ndarray, inputs: list[int], outputs: list[int]) -> np.ndarray:
    """(L,) mean of flow[l, t2, t1] over t1 in ``inputs`` and t2 in ``outputs`` (merge_grouped_tokens, mean)."""
    return flow[:, outputs][:, :, inputs].mean((1, 2))


def class_balances(flow: np.ndarray, positions: list[list[int]], tags: Sequence[str],
                   groups: dict[str, Sequence[str]]) -> dict[str, np.ndarray]:
    """{group: (L,) mean balance over the pieces of the sentence's words whose tag is in the group}."""
    b = balance(flow)  # (L, X)
    return {g: group_mean(b, [p for w, t in enumerate(tags) if t in members for p in positions[w]])
            for g, members in groups.items()}


def coref_items(xpos: Sequence[str], clusters: Sequence[set], noun_xpos=NOUN_XPOS, pron_xpos=PRON_XPOS
                ) -> list[tuple[int, int, bool]]:
    """(noun word, pronoun word, coreferent) for every noun before a pronoun with material between."""
    out = []
    for j, pj in enumerate(xpos):
        if pj not in pron_xpos:
            continue
        for i in range(j - 1):  # i < j - 1: at least one word between
            if xpos[i] in noun_xpos:
                out.append((i, j, bool(clusters[i] & clusters[j])))
    return out


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Welch's t and two-sided p (scipy ttest_ind, equal_var=False), NaNs dropped."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) < 2 or len(b) < 2:
        return float("nan"), float("nan")
    r = ttest_ind(a, b, equal_var=False)
    return float(r.statistic), float(r.pvalue)


def group_tests(df: pd.DataFrame, measure: str, groups: Sequence[str], test: str) -> pd.DataFrame:
    """Welch t-tests between every pair of groups (g1 listed first), per layer and pooled (layer = -1);
    ``df``: one row per (sentence, layer, group) with the group's value in ``measure``."""
    rows = []
    for g1, g2 in combinations(groups, 2):
        for layer, d in [*df.groupby("layer"), (-1, df)]:
            a = d.loc[d.group == g1, measure].to_numpy()
            b = d.loc[d.group == g2, measure].to_numpy()
            t, p = welch(a, b)
            rows.append(dict(test=test, measure=measure, a=g1, b=g2, layer=int(layer), t=t, p=p,
                             mean_a=float(np.nanmean(a)) if np.isfinite(a).any() else np.nan,
                             mean_b=float(np.nanmean(b)) if np.isfinite(b).any() else np.nan,
                             n_a=int(np.isfinite(a).sum()), n_b=int(np.isfinite(b).sum())))
    return pd.DataFrame(rows)


def coref_tests(items: pd.DataFrame, measure: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(Welch t-tests coref vs not per layer and pooled, OLS y ~ 1 + coref + distance + coref x distance
    over all item x layer rows and per layer); ``items``: one row per (item, layer)."""
    t_rows = []
    for layer, d in [*items.groupby("layer"), (-1, items)]:
        a, b = d.loc[d.coref == 1, measure].to_numpy(), d.loc[d.coref == 0, measure].to_numpy()
        t, p = welch(a, b)
        t_rows.append(dict(test="coref_vs_nocoref", measure=measure, layer=int(layer), t=t, p=p,
                           mean_coref=float(np.mean(a)) if len(a) else np.nan,
                           mean_nocoref=float(np.mean(b)) if len(b) else np.nan, n_coref=len(a), n_nocoref=len(b)))
    o_rows = []
    names = ["coref", "distance", "coref_x_distance"]
    for layer, d in [(-1, items), *items.groupby("layer")]:
        if d.coref.nunique() < 2 or len(d) <= 4:  # 4 coefficients
            continue
        x = np.column_stack([d.coref.to_numpy(float), d.distance.to_numpy(float),
                             (d.coref * d.distance).to_numpy(float)])
        for r in ols(d[measure].to_numpy(np.float64), x, names, groups=d.sentence.to_numpy()):
            o_rows.append(dict(measure=measure, layer=int(layer), **r))
    return pd.DataFrame(t_rows), pd.DataFrame(o_rows)


def pearson_spearman(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Pearson's r and Spearman's rho of ``x`` and ``y`` over their jointly finite entries, and that count."""
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return dict(pearson=np.nan, spearman=np.nan, n=len(x))
    return dict(pearson=float(pearsonr(x, y)[0]), spearman=float(spearman_rows(x, y)), n=int(len(x)))
