"""``analysis=clustering``: distances between heads and their 2-D embedding (Clark et al. §5, Fig 6).

Wordpiece level (as Clark, who used wordpiece maps of unlabeled text), live encoder, on the inputs of
``analysis=head_stats`` (``pairs``: by default two consecutive sentences as ``[CLS] A [SEP] B [SEP]``,
Clark's input form; else each sentence alone; sequences longer than ``encoder.max_length`` pieces are
skipped and counted). As Clark's ``head_distances.py``: every attention row is smoothed,
``(1 - s) a + s / T`` with ``smoothing`` s = 0.001, and the distance between heads a and b is the
Jensen-Shannon divergence (nats; per sequence :func:`probes.stats.js_divergence_matrix` x ln 2) of their
smoothed rows summed over every attending token of every sequence (``js`` column; ``js_per_token``
divides by the number of tokens). The symmetric matrix is embedded in 2-D by metric multidimensional
scaling with Clark's settings (scikit-learn ``MDS`` on the precomputed dissimilarities, ``n_init=5``,
``max_iter=1000``, ``eps=1e-10``; seeded here, unseeded there).

Behaviour of a head (colours of the second plot), from the same pass's head_stats-style statistics,
by the rule of Clark's ``General_Analysis.ipynb``: tests in this order, a later match overriding an
earlier one: ``next`` and then ``prev`` when the mean attention to that token is above
``position_threshold`` (0.5, his ``POSITION_THRESHOLD``); ``broad`` when the mean entropy is above
``broad_fraction`` of the uniform-attention entropy (mean log T); ``cls``, ``sep``, ``punct`` when the
mean attention to them is above ``special_threshold`` (0.6, his ``SPECIAL_TOKEN_THRESHOLD``); else
``other``. His broad threshold is 3.8 nats on 128-token segments (uniform entropy ln 128 = 4.85 nats),
so ``broad_fraction`` defaults to 3.8 / ln 128 = 0.783 for inputs of any length.

Decoders (causal LMs): the first token takes [CLS]'s place, named as in ``analysis=head_stats``
(``bos`` / ``first``: the ``cls`` behaviour and column are renamed), and ``broad`` compares with the
causal uniform entropy (row i of T sees i + 1 keys; :func:`probes.analysis.clark.metrics.uniform_row_entropy`).
Smoothing spreads s / T over all T columns as Clark's code, the future ones of a causal row included.

Map kinds: ``extract.maps=<kind>`` clusters that kind's wordpiece maps instead (computed live, rows
normalised to sum 1 so that JS divergence and entropy apply to non-probability kinds such as ``norm``);
per-layer kinds give one point per layer.

Computation (:func:`head_distances`): a batch at a time on the maps' device, with no Python loop over the
sequences of a batch and no map copied to the host: the distances by :class:`probes.maps.reducers.HeadDistances`
(each sequence's own n pieces, smoothed over its own keys, padding masked), the behaviour statistics by
:class:`probes.maps.reducers.HeadStats` (as ``analysis=head_stats``), both over one forward
(:meth:`probes.maps.MapEngine.iter_reduced_batches` for attention; other kinds: the batch's stacked piece maps,
normalised with a mask, handed to the same reducers); sums kept as tensors on the device, one copy at the end.

Files use 0-based layer/head; figures label heads with the paper's 1-based ``layer-head`` names.
Outputs: ``js_distances.csv`` (layer_a, head_a, layer_b, head_b, js, js_per_token; all ordered
pairs incl. a == b), ``head_embedding.csv`` (layer, head, name, x, y, behaviour, and the statistics),
``head_embedding_layers.png``, ``head_embedding_behaviour.png``, ``summary.json``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from sklearn.manifold import MDS

from probes.analysis.clark.head_stats import (SentenceCounts, encode_inputs, first_token_name, fitting,
                                              separator_positions)
from probes.analysis.clark.metrics import HEAD_STATS, JS_SMOOTHING, HeadStatsTotals, PunctFlags, is_causal
from probes.analysis.naming import head_name
from probes.analysis.plots import layer_ticks
from probes.maps import HeadDistances, HeadStats, MapEngine, Reducer, Several
from probes.measures import Measure
from probes.measures.attention import Attention
from probes.model.inputs import Encoded

log = logging.getLogger(__name__)

# Clark's order of tests (a later match overrides an earlier one) and which threshold each uses.
CLARK_ORDER = (("next", "position"), ("prev", "position"), ("broad", "broad"), ("cls", "special"),
               ("sep", "special"), ("punct", "special"))
# Clark's figure colours (his "Pretty colors"); "other" grey as his unlabelled heads.
BEHAVIOUR_COLOURS = {"next": "#e74c3c", "prev": "#3498db", "broad": "#f39c12", "cls": "#9b59b6", "sep": "#59d98e",
                     "punct": "#159d82", "other": "#95a5a6", "first": "#9b59b6", "bos": "#9b59b6"}
CLARK_BROAD_FRACTION = 3.8 / float(np.log(128))  # his 3.8 nats over the uniform entropy of 128 tokens
ROW_SUM_FLOOR = 1e-12  # a row of another kind summing to less is divided by this (an all-zero row stays 0)


def classify_heads(stats: dict[str, np.ndarray], uniform_entropy: float, position_threshold: float = 0.5,
                   special_threshold: float = 0.6, broad_fraction: float = CLARK_BROAD_FRACTION) -> np.ndarray:
    """(L, H) array of behaviour labels by Clark's rule (see the module docstring)."""
    labels = np.full(stats["entropy"].shape, "other", dtype=object)  # (L, H)
    for name, kind in CLARK_ORDER:
        if kind == "broad":
            hit = stats["entropy"] > broad_fraction * uniform_entropy
        else:
            hit = stats[name] > (position_threshold if kind == "position" else special_threshold)
        labels[hit] = name
    return labels


def mds_embedding(dist: np.ndarray, seed: int = 0, n_init: int = 5, max_iter: int = 1000,
                  eps: float = 1e-10) -> tuple[np.ndarray, float]:
    """2-D metric MDS of a precomputed dissimilarity matrix (defaults: Clark's ``n_init=5, max_iter=1000,
    eps=1e-10``); returns (coords (K, 2), stress)."""
    params = inspect.signature(MDS).parameters
    kw = dict(n_components=2, n_init=n_init, max_iter=max_iter, eps=eps, random_state=seed)
    if "metric_mds" in params:  # scikit-learn >= 1.8: `dissimilarity` renamed `metric`
        kw.update(metric="precomputed", metric_mds=True)
    else:
        kw.update(dissimilarity="precomputed")
    if "init" in params:
        kw.update(init="random")
    mds = MDS(**kw)
    coords = mds.fit_transform(dist)
    return coords, float(mds.stress_)


def kruskal_stress(dist: np.ndarray, coords: np.ndarray) -> float:
    """Kruskal's stress-1 of an embedding: sqrt(sum (d_ij - |x_i - x_j|)^2 / sum d_ij^2), pairs i < j."""
    emb = np.linalg.norm(coords[:, None] - coords[None], axis=-1)
    iu = np.triu_indices(len(dist), 1)
    den = float((dist[iu] ** 2).sum())
    return float(np.sqrt(((dist[iu] - emb[iu]) ** 2).sum() / den)) if den > 0 else 0.0


def _scatter(emb: pd.DataFrame, colour_by: str, title: str):
    fig, ax = plt.subplots(figsize=(7, 6))
    if colour_by == "layer":
        sc = ax.scatter(emb.x, emb.y, c=emb.layer + 1, cmap="viridis", s=30)
        layer_ticks(fig.colorbar(sc, ax=ax, label="layer").ax, 1, int(emb.layer.max()) + 1, axis="y")
    else:
        for b, g in emb.groupby(colour_by, sort=True):
            ax.scatter(g.x, g.y, s=30, label=f"{b} ({len(g)})", color=BEHAVIOUR_COLOURS.get(b))
        ax.legend(fontsize=8, title="behaviour")
    for _, r in emb.iterrows():
        ax.annotate(r["name"], (r.x, r.y), fontsize=5, alpha=0.7, xytext=(2, 2), textcoords="offset points")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    return fig


@dataclass
class HeadDistanceTotals:
    """What :func:`head_distances` gathers over the sequences read."""

    js: torch.Tensor  # (K, K) float64 on the maps' device: JS divergences (nats) summed over every sequence's rows
    stats: HeadStatsTotals  # the behaviour statistics (mean over sequences)
    read: list[int]  # indices of the sequences read (the others were longer than the encoder's or measure's limit)
    n_tokens: int  # pieces of the sequences read


def reduce_maps(reducer: Reducer, maps: torch.Tensor, layers: Sequence[int], positions: Sequence[int],
                items: Sequence[Encoded]):
    """``reducer``'s batch results of a batch's whole piece maps (B, L', H', T, T) (padded rows and keys of any
    value), each layer handed over as one block, as the engine hands whole attention maps."""
    B, _, H, T, _ = maps.shape
    reducer.start(layers, H, positions, items, T, maps.device)
    for j, layer in enumerate(layers):
        reducer.update(layer, maps[:, j], (0, T), (0, T))
    return reducer.batch_results()


def _normalised_batches(engine: MapEngine, items: Sequence[Encoded], reducer: Reducer, desc: str):
    """Yield ``(positions, batch results)`` of ``reducer`` on the engine's piece maps of every batch of ``items``
    (a kind without ``reduce``; :meth:`~probes.maps.MapEngine.iter_piece_map_batches`, padded entries 0), each row
    normalised to sum 1 over the sequence's own keys."""
    for positions, _, maps in engine.iter_piece_map_batches(items, desc):  # maps: (B, L', H', T, T)
        maps.div_(maps.sum(-1, keepdim=True).clamp_(min=ROW_SUM_FLOOR))
        yield positions, reduce_maps(reducer, maps, engine.layers, positions, [items[k] for k in positions])


def head_distances(encoder, encoded: Sequence[Encoded], measure: Measure | None = None, device: str = "cpu",
                   smoothing: float = JS_SMOOTHING, max_tokens: int = 4096, max_batch_size: int = 64,
                   desc: str = "clustering", dtype: torch.dtype = torch.float32) -> HeadDistanceTotals:
    """Clustering's computation: the JS distances between all heads and their behaviour statistics over the encoded
    sequences that fit (longer ones are skipped, logged), batch by batch on the maps' device
    (:class:`~probes.maps.reducers.HeadDistances` and :class:`~probes.maps.reducers.HeadStats` over one forward).

    Args:
        encoder: The encoder (``model``, ``tokenizer``, ``max_length``).
        encoded: The sequences (:func:`~probes.analysis.clark.head_stats.encode_inputs`).
        measure: The map kind; None: attention, reduced as the engine computes it (no normalisation). Another
            kind's piece maps have their rows normalised to sum 1.
        device: Where the model and the maps run.
        smoothing: Clark's smoothing of the rows before the JS divergence.
        max_tokens, max_batch_size: Pieces and sequences per batch.
        desc: The progress bar's label.
        dtype: The distances' arithmetic (:class:`~probes.maps.reducers.HeadDistances`): float32 (each row's JS
            to about 1e-7 nats; relative to the distance of two nearly identical heads more), float64 exact to
            rounding at 2.3 times float32's CPU time.
    """
    tok = encoder.tokenizer
    punct = PunctFlags(tok)
    reducer = Several(stats=HeadStats(sep=lambda k, e: separator_positions(e), punct=lambda k, e: punct(e.input_ids),
                                      stats=HEAD_STATS),
                      js=HeadDistances(smoothing, dtype=dtype))
    engine = MapEngine(encoder.model, Attention() if measure is None else measure, tokenizer=tok, device=device,
                       max_tokens=max_tokens, max_batch_size=max_batch_size, max_pairs=None)
    keep = fitting(encoded, encoder.max_length if measure is None else engine.limit())
    items = [encoded[i] for i in keep]
    batches = (engine.iter_reduced_batches(items, reducer, desc=desc) if measure is None else
               _normalised_batches(engine, items, reducer, desc))
    stats, js = HeadStatsTotals(is_causal(encoder)), None
    for positions, batch in batches:
        stats.add_batch(batch["stats"], [items[k].n_pieces for k in positions])
        total = batch["js"].sum(0)  # (K, K)
        js = total if js is None else js + total
    if js is None:
        K = len(engine.layers) * engine.num_heads
        js = torch.zeros(K, K, dtype=torch.float64)
    return HeadDistanceTotals(js, stats, keep, sum(e.n_pieces for e in items))


def clustering(ctx, *, split: str = "dev", max_sentences: int | None = None, pairs: bool = True,
               smoothing: float = JS_SMOOTHING, max_tokens: int = 4096, max_batch_size: int = 64,
               position_threshold: float = 0.5, special_threshold: float = 0.6,
               broad_fraction: float = CLARK_BROAD_FRACTION, mds_n_init: int = 5,
               mds_max_iter: int = 1000, mds_eps: float = 1e-10) -> pd.DataFrame:
    """Compute JS distances between all heads, embed them, save tables and plots; returns the embedding."""
    t0 = time.time()
    enc = ctx.encoder
    kind, measure = ctx.measure()
    L, H = enc.num_layers, measure.heads(enc.num_heads)
    K = L * H
    sentences = ctx.sentences(split, max_sentences)
    encoded, members = encode_inputs(enc.tokenizer, sentences, pairs)
    first = first_token_name(enc.tokenizer, encoded, is_causal(enc))  # cls | bos | first
    totals = head_distances(enc, encoded, None if kind == "attention" else measure, ctx.device, smoothing, max_tokens,
                            max_batch_size)
    stats_acc, read, n_tokens = totals.stats, totals.read, totals.n_tokens
    read_set = set(read)  # the sequences not read were longer than the encoder's (or the measure's) limit
    counts = SentenceCounts.of(len(sentences), members, [k for k in range(len(encoded)) if k not in read_set], read)
    dist = totals.js.cpu().numpy()  # (K, K) JS divergences in nats, summed over tokens: the one copy to the host
    if dist.shape != (K, K):
        raise RuntimeError(f"clustering: distances of {dist.shape[0]} heads, expected {L} layers x {H} maps = {K}")
    la, ha = np.divmod(np.arange(K), H)
    js = pd.DataFrame(dict(layer_a=np.repeat(la, K), head_a=np.repeat(ha, K), layer_b=np.tile(la, K),
                           head_b=np.tile(ha, K), js=dist.reshape(-1), js_per_token=dist.reshape(-1) / max(n_tokens, 1)))
    ctx.save_table(js, "js_distances")

    coords, stress = mds_embedding(dist, seed=ctx.seed, n_init=mds_n_init, max_iter=mds_max_iter,
                                   eps=mds_eps)
    stats = stats_acc.result()
    labels = classify_heads(stats, stats_acc.uniform_entropy, position_threshold, special_threshold, broad_fraction)
    labels[labels == "cls"] = first
    emb = pd.DataFrame(dict(layer=la, head=ha, name=[head_name(l, h) for l, h in zip(la, ha)],
                            x=coords[:, 0], y=coords[:, 1], behaviour=labels.reshape(-1)))
    for k in ("prev", "next", "self", "cls", "sep", "punct", "entropy"):
        emb[first if k == "cls" else k] = stats[k].reshape(-1)
    ctx.save_table(emb, "head_embedding")
    ctx.save_figure(_scatter(emb, "layer", f"{enc.name}: MDS of JS distances, coloured by layer"),
                    "head_embedding_layers")
    ctx.save_figure(_scatter(emb, "behaviour", f"{enc.name}: MDS of JS distances, coloured by behaviour"),
                    "head_embedding_behaviour")

    # How layered is the space: mean distance within vs between layers, nearest neighbour's layer.
    same = la[:, None] == la[None, :]
    off_diag = ~np.eye(K, dtype=bool)
    nn = np.where(off_diag, dist, np.inf).argmin(1)
    ctx.log_summary(dict(
        analysis="clustering", split=split, encoder=enc.name, maps=kind, level="wordpiece", js_unit="nats",
        input="pair" if pairs else "single", causal=stats_acc.causal, first_token=first, smoothing=smoothing,
        **counts.summary(pairs, max_sentences, enc.max_length),
        n_tokens=n_tokens, mds_stress=stress,
        mds_stress1=kruskal_stress(dist, coords),
        mean_js_per_token_same_layer=float(dist[same & off_diag].mean() / max(n_tokens, 1)) if L * H > L else None,
        mean_js_per_token_other_layer=float(dist[~same].mean() / max(n_tokens, 1)) if L > 1 else None,
        nearest_neighbour_same_layer=float((la[nn] == la).mean()),
        nearest_neighbour_same_layer_chance=float((H - 1) / max(K - 1, 1)),
        behaviour_counts={str(k): int(v) for k, v in emb.behaviour.value_counts().items()},
        position_threshold=position_threshold, special_threshold=special_threshold, broad_fraction=broad_fraction,
        uniform_entropy=stats_acc.uniform_entropy, seconds=round(time.time() - t0, 1)))
    log.info("clustering: %d sequences, %d heads in %.1fs", stats_acc.n, K, time.time() - t0)
    return emb
