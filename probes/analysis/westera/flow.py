"""``analysis=flow``: gradient flow vs attention (Westera 2019), word level, live encoder.

Any supported encoder family (``ctx.encoder``; the model is reached through :mod:`probes.model.hooks`).
For every sentence ``[CLS] s [SEP]`` (the tokenizer's own special tokens; alone, no padding), every
layer ``n`` (0-based ``layer`` = n - 1 in the files) and every word pair (``t1`` = input / attended,
``t2`` = output / attending):

* ``G``  = ``|| d sum_d h_n(t2)[d] / d h_{n-1}(t1) ||_2`` - gradient flow from the previous layer;
* ``Gstar`` (G*) = the same w.r.t. ``h_0(t1)`` (input of the first block: embedding output after its
  LayerNorm);
* ``A``  = ``t2``'s attention to ``t1`` at layer ``n``, mean over heads.

Scalar reduction (Westera's reference code ``mwestera/bertology`` ``interface_BERT.py``): backward of
the **sum of the hidden units of h_n(t2)** (``layer.backward(mask)`` with a ones mask on token t2),
then the **2-norm over the hidden units** of each input token. All output tokens of a layer are
done in one batched VJP (``torch.func.vjp`` + ``vmap``); see :mod:`probes.measures.gradflow`.

Word pooling = the attention cache's: ``A_word = M_mean A M_sum^T`` (FROM a word: mean over its
pieces; TO a word: sum over its pieces). For G/G* the same matrices are applied to the **gradient
vectors before the norm**: the output word's scalar is the mean of its pieces' scalars, the gradient
w.r.t. an input word is the sum of the gradients w.r.t. its pieces; then the 2-norm. ``[CLS]`` and
``[SEP]`` are kept as words 0 and W-1. Sentences longer than ``max_length`` pieces are skipped.

Sentences: the first ``max_sentences`` of ``split`` in file order (null = all), then, if
``n_sentences`` is set, a seeded random subset of that many of them (the same two parameters as
``flow_correlates``).

Correlations: Spearman's rho and Pearson's r (Westera's ``correlation.py`` uses Pearson over
wordpiece triples of all layers pooled) between G (resp. G*) and A over word pairs, per layer and over all
layers pooled (``scope``), for ``pairs=all`` (every pair incl. self pairs and [CLS]/[SEP]) and
``pairs=words_no_self`` (real words only, t1 != t2). Westera reports rho = .41 for G vs A (BERT-base).
Also the mean over sentences of the per-sentence rho (``per_sentence_mean``).

Outputs: ``flow_pairs.csv`` (sentence, layer, t2/t1 word index, words, distance, G, Gstar, A; 0-based;
word index 0 = the first special token, e.g. [CLS]), ``flow_correlations.csv`` (measure pair, pairs,
scope/layer, rho, p, n), ``flow_layers.csv`` (per-layer means of G, G*, A, self-share),
``flow_layers.png`` (per-layer rho curves), ``flow_scatter.png`` (G vs A, subsampled), ``summary.json``.
"""

from __future__ import annotations

import logging
import random
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from scipy.stats import pearsonr
from tqdm import tqdm

from probes.analysis.plots import layer_ticks
from probes.measures.gradflow import gradient_flow
from probes.model.inputs import encode_words, pooling_matrix
from probes.stats import spearman_rows, spearman_test

log = logging.getLogger(__name__)

MEASURES = ("G", "Gstar", "A")


def select_sentences(n_total: int, max_sentences: int | None = None, n_sentences: int | None = None,
                     seed: int = 0) -> list[int]:
    """Indices (sorted): the first ``max_sentences`` (file order; None = all), then a seeded random
    subset of ``n_sentences`` of those (None = all of them)."""
    idx = list(range(n_total))[:max_sentences]
    if n_sentences is not None and n_sentences < len(idx):
        idx = sorted(random.Random(seed).sample(idx, n_sentences))
    return idx


def sentence_flow(encoder, words_list, device: str = "cpu", max_length: int | None = None, chain: bool = True,
                  chunk_size: int | None = None, level: str = "word", desc: str = "flow"):
    """Yield ``(index, encoded, dict(G, Gstar, A))`` for every sentence (list of words) that fits.

    ``encoder``: :class:`probes.model.load.Encoder` (``.model``, ``.tokenizer``, ``.max_length``);
    ``max_length`` (pieces, special tokens included) defaults to and is capped at ``encoder.max_length``.
    """
    max_length = min(max_length or encoder.max_length, encoder.max_length)
    encoded = encode_words(encoder.tokenizer, [list(w) for w in words_list])
    model = encoder.model.to(device)
    for i, e in enumerate(tqdm(encoded, desc=desc, unit="sent", disable=None)):
        if e.n_pieces > max_length:
            log.warning("sentence %d has %d wordpieces > %d: skipped", i, e.n_pieces, max_length)
            continue
        if level == "word":
            fm = pooling_matrix(e.word_of_piece, e.n_words, "mean")
            tm = pooling_matrix(e.word_of_piece, e.n_words, "sum")
        else:
            fm = tm = None
        ids = torch.tensor(e.input_ids, device=device)
        yield i, e, gradient_flow(model, ids, fm, tm, chain=chain, chunk_size=chunk_size)


def pair_rows(sid: int, words: list[str], flow: dict[str, torch.Tensor],
              specials: tuple[str, str] = ("[CLS]", "[SEP]")) -> pd.DataFrame:
    """Tidy rows (one per layer x t2 x t1) of one sentence's word-level flow (``flow`` values (L, W, W));
    ``specials``: labels of the first and last special token."""
    L, W, _ = flow["A"].shape
    toks = [specials[0], *words, specials[1]]
    lay, t2, t1 = np.meshgrid(np.arange(L), np.arange(W), np.arange(W), indexing="ij")
    df = pd.DataFrame(dict(sentence=sid, layer=lay.ravel(), t2=t2.ravel(), t1=t1.ravel()))
    df["word2"] = np.array(toks, dtype=object)[df.t2.to_numpy()]
    df["word1"] = np.array(toks, dtype=object)[df.t1.to_numpy()]
    df["distance"] = (df.t2 - df.t1).abs()
    df["special"] = (df.t1 == 0) | (df.t1 == W - 1) | (df.t2 == 0) | (df.t2 == W - 1)
    for m in MEASURES:
        if m in flow:
            df[m] = flow[m].numpy().ravel()
    return df


def correlations(df: pd.DataFrame, measures=("G", "Gstar"), against: str = "A") -> pd.DataFrame:
    """Spearman rho (and Pearson r, the measure of Westera's ``correlation.py``) of each measure vs
    ``against`` per layer, all layers pooled; per-sentence mean of rho."""
    subsets = {"all": df, "words_no_self": df[(~df.special) & (df.t1 != df.t2)]}
    rows = []
    for m in measures:
        if m not in df:
            continue
        for pairs, d in subsets.items():
            groups = [("all_layers", -1, d), *(("layer", int(l), g) for l, g in d.groupby("layer"))]
            for scope, layer, g in groups:
                r, p = spearman_test(g[m], g[against]) if len(g) > 2 else (np.nan, np.nan)
                pr = pearsonr(g[m], g[against])[0] if len(g) > 2 else np.nan
                rows.append(dict(measure=m, against=against, pairs=pairs, scope=scope, layer=layer,
                                 rho=float(r), p=float(p), pearson=float(pr), n=len(g)))
            # mean of per-sentence rho (all layers pooled within the sentence)
            rs = [float(spearman_rows(g[m], g[against])) for _, g in d.groupby("sentence") if len(g) > 2]
            rows.append(dict(measure=m, against=against, pairs=pairs, scope="per_sentence_mean", layer=-1,
                             rho=float(np.nanmean(rs)) if rs else np.nan, p=np.nan, n=len(rs)))
    return pd.DataFrame(rows)


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per layer, over real-word pairs: the mean of each measure and the share of its mass on self pairs."""
    d = df[~df.special]
    out = d.groupby("layer")[[m for m in MEASURES if m in d]].mean().add_prefix("mean_")
    self_rows = d[d.t1 == d.t2].groupby("layer")[[m for m in MEASURES if m in d]].sum()
    tot = d.groupby("layer")[[m for m in MEASURES if m in d]].sum()
    out = out.join((self_rows / tot).add_prefix("self_share_"))
    return out.reset_index()


def curve_figure(corr: pd.DataFrame):
    """Per-layer Spearman rho of G and G* vs A, for all pairs and for real words without self pairs."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, pairs in zip(axes, ("all", "words_no_self")):
        c = corr[(corr.pairs == pairs) & (corr.scope == "layer")]
        for m, g in c.groupby("measure"):
            ax.plot(g.layer + 1, g.rho, marker="o", label=f"{'G*' if m == 'Gstar' else m} vs A")
        ax.axhline(0.41, ls=":", c="grey", lw=1, label="Westera G vs A (.41)")
        ax.set_xlabel("layer")
        if len(c):
            layer_ticks(ax, int(c.layer.min()) + 1, int(c.layer.max()) + 1)
        ax.set_title(f"pairs: {pairs}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Spearman rho")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def scatter_figure(df: pd.DataFrame, max_points: int = 5000, seed: int = 0):
    """G vs A of at most ``max_points`` real-word pairs (seeded subsample), coloured by layer."""
    d = df[~df.special]
    if len(d) > max_points:
        d = d.sample(max_points, random_state=seed)
    L = int(df.layer.max()) + 1
    fig, ax = plt.subplots(figsize=(5, 4))
    sc = ax.scatter(d.A, d.G, c=d.layer + 1, s=3, alpha=0.5, cmap="viridis", vmin=1, vmax=L)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_yscale("log")
    ax.set_xlabel("A (head-mean attention t2 -> t1)")
    ax.set_ylabel("G = ||d sum h_n(t2) / d h_{n-1}(t1)||")
    layer_ticks(fig.colorbar(sc, ax=ax, label="layer").ax, 1, L, axis="y")
    ax.set_title(f"{len(d)} word pairs (no [CLS]/[SEP])", fontsize=9)
    fig.tight_layout()
    return fig


def flow(ctx, *, split: str = "dev", max_sentences: int | None = 100, n_sentences: int | None = None,
         seed: int = 0, chain: bool = True, level: str = "word", chunk_size: int | None = None,
         max_length: int | None = None, num_threads: int | None = None, scatter_points: int = 5000,
         save_pairs: bool = True) -> pd.DataFrame:
    """Compute G, G*, A for the sentences, save tables and figures; return the correlation table."""
    t0 = time.time()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    sents = ctx.sentences(split, max_sentences)
    idx = select_sentences(len(sents), None, n_sentences, seed)
    chosen = [sents[i] for i in idx]
    tok = ctx.encoder.tokenizer
    parts = []
    for k, e, fl in sentence_flow(ctx.encoder, [s.words for s in chosen], ctx.device, max_length, chain,
                                  chunk_size, level):
        pieces = tok.convert_ids_to_tokens(e.input_ids)
        words = list(chosen[k].words) if level == "word" else pieces[1:-1]
        parts.append(pair_rows(idx[k], words, fl, (pieces[0], pieces[-1])))
    if not parts:
        raise ValueError(f"flow: no sentence of {split} fits (max_length {max_length or ctx.encoder.max_length})")
    df = pd.concat(parts, ignore_index=True)
    seconds = time.time() - t0
    corr = correlations(df)
    if save_pairs:
        ctx.save_table(df, "flow_pairs")
    ctx.save_table(corr, "flow_correlations")
    lt = layer_table(df)
    ctx.save_table(lt, "flow_layers")
    ctx.save_figure(curve_figure(corr), "flow_layers")
    ctx.save_figure(scatter_figure(df, scatter_points, seed), "flow_scatter")

    def pick(m, pairs, scope, col="rho"):
        c = corr[(corr.measure == m) & (corr.pairs == pairs) & (corr.scope == scope)]
        if c.empty:
            return None
        return [round(float(r), 4) for r in c[col]] if scope == "layer" else round(float(c[col].iloc[0]), 4)

    ctx.log_summary(dict(
        analysis="flow", split=split, encoder=ctx.encoder.name, model_type=ctx.encoder.model_type, level=level,
        device=ctx.device, max_sentences=max_sentences, n_sentences_sampled=n_sentences,
        n_sentences=int(df.sentence.nunique()), n_pairs_per_layer=int((df.layer == 0).sum()),
        seconds=round(seconds, 1), reduction="G = ||d sum_d h_n(t2)[d] / d h_{n-1}(t1)||_2 (Westera)",
        rho_G_A_all=pick("G", "all", "all_layers"), rho_Gstar_A_all=pick("Gstar", "all", "all_layers"),
        rho_G_A_words=pick("G", "words_no_self", "all_layers"),
        rho_Gstar_A_words=pick("Gstar", "words_no_self", "all_layers"),
        rho_G_A_per_layer=pick("G", "all", "layer"), rho_Gstar_A_per_layer=pick("Gstar", "all", "layer"),
        rho_G_A_words_per_layer=pick("G", "words_no_self", "layer"),
        rho_Gstar_A_words_per_layer=pick("Gstar", "words_no_self", "layer"),
        rho_G_A_per_sentence_mean=pick("G", "all", "per_sentence_mean"),
        pearson_G_A_all=pick("G", "all", "all_layers", "pearson"),
        pearson_Gstar_A_all=pick("Gstar", "all", "all_layers", "pearson"),
        pearson_G_A_per_layer=pick("G", "all", "layer", "pearson"),
        pearson_Gstar_A_per_layer=pick("Gstar", "all", "layer", "pearson")))
    log.info("flow: %d sentences in %.1fs", df.sentence.nunique(), seconds)
    return corr
