"""``analysis=attribution``: do head outputs depend on the tokens the head attends to? (Pascual et al. 2021)

Pascual, Brunner and Wattenhofer (EACL 2021, "Telling BERT's full story: from local attention to global
aggregation") use "gradient attribution to analyze how the output of an attention head depends on the input
tokens" and report "a significant mismatch between attention and attribution distributions, caused by the
mixing of context inside the model", quantified, with "some patterns that persist across all layers
despite the mixing" (their abstract, aclanthology.org/2021.eacl-main.9). Their paper body and any code
were not available to this project (README "Attention versus gradients"), so the exact reduction of the
head output, the attribution method and the comparison measures below are the project's, named as such.

Wordpiece level, live encoder (``ctx.encoder``, any supported family: BERT, DistilBERT, ALBERT,
DeBERTa-v2, ...), each sentence alone as ``[CLS] s [SEP]`` (the tokenizer's own special tokens). For
every layer ``l``, head ``h`` and position ``i``, the head's output is ``o_{l,h,i}`` = ``(A V)`` of
that head before the attention output projection (``s.output[l]`` of a
``probes.model.hooks.attention(..., values=True)`` session), reduced to the scalar
``sum_k o_{l,h,i}[k]``; its attribution to every input token ``j`` is taken on the **word-embedding
vectors** (``model.get_input_embeddings()(ids)``, fed as ``inputs_embeds``) by

* ``ixg`` - gradient x input;
* ``ig``  - integrated gradients, baseline ``zero`` (all word embeddings 0; position/type embeddings
  kept) or ``pad`` (the pad token's embedding except at the first and last special token),
  ``ig_steps`` Riemann-midpoint points;
* ``hta`` - the gradient's 2-norm over the embedding dimension, no input factor: the reduction of
  Brunner et al.'s (2020) Hidden Token Attribution, the same group's earlier gradient measure
  (:func:`probes.measures.gradflow.hta_attributions`), as an option closer to that lineage.

All are computed for all ``L * H * T`` targets of a sentence by batched VJPs (``torch.func``; the IG
points are one batch dimension, see :mod:`probes.measures.gradflow`), which equal captum's
``InputXGradient`` / ``IntegratedGradients(method="riemann_middle")`` on the same input (checked on
``captum_check`` random targets per run and in the tests; captum itself would need one call per target);
``hta`` is checked in the tests against one ``autograd.grad`` per target.

Distribution over input tokens: ``|attribution|`` summed over the embedding dimension, normalised
to sum 1. It is compared with the same head's map row (attention: ``A[l, h, i, :]``):

* Jensen-Shannon divergence (base 2, in [0, 1]); Spearman rank correlation over the T tokens;
  top-1 agreement (same argmax). Means over positions and sentences, per (kind, method, layer, head)
  and per (kind, method, layer).
* Patterns: the share of positions whose argmax is ``cls`` / ``sep`` / ``self`` / ``prev`` / ``next``
  / ``other`` (precedence in that order), per layer, for each map kind and for each attribution.
* Pattern persistence per head: the head's dominant argmax pattern (the most frequent over all its
  positions and sentences) in the map and in the attribution; ``pattern_agree`` = the share of a
  layer's heads where the two are the same (the "patterns that persist despite the mixing").

Map kinds (``extract.maps=<kind>``, README "Beyond attention weights"): ``analysis.kinds=[attention,
rollout, ...]`` compares the attribution, computed **once** per sentence and method, with every listed
kind; null = the one kind ``extract.maps``. Each kind's maps come from its ``probes.measures`` object
(``extract.measures.<kind>``, the objects the extraction stage runs), at piece level, rows normalised to
sum 1. A per-layer kind (rollout, flow, norm_res_ln, alti, value_zeroing) is compared with the mean
over heads of the heads' attribution distributions (``head`` = 0 in the files). Kinds with a length
bound (flow) take only the sentences within it (``n`` in the tables; the summary lists the counts).
``grad_attribution`` against the same ``method`` is the attribution itself (JS 0, top-1 1): trivial.

Sentences: of the first ``max_sentences`` sentences of ``split`` (file order, as in every analysis;
null = the whole split), the ``n_shortest`` shortest (in pieces; ties in file order) with at least
``min_words`` words - the cost grows with T^2 (T targets per head, each a backward over T tokens), and
``ig`` costs ``ig_steps`` times ``ixg``. The run logs the estimated GFLOPs first; one progress bar
(weighted by those estimates, so its ETA holds across sentence lengths) moves after every batch of
backward passes. Measured costs per sentence: ``bench/attribution_cost.py``, docs/papers/pascual.md.

Outputs: ``attribution_heads.csv`` (kind, method, layer, head, name, js, spearman, top1, n, map_pattern,
attr_pattern), ``attribution_layers.csv`` (kind, method, layer, means, pattern_agree, n),
``attribution_patterns.csv`` (source, layer, pattern, share, count), ``attribution_layers.png``,
``attribution_patterns.png``, ``attribution_heads.png`` (per-head top-1 agreement), ``summary.json``.

In code: :func:`compute` (the running sums, no file written) -> :func:`tables` -> :func:`save`; the configured
entry :func:`attribution` composes the three.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from captum.attr import InputXGradient, IntegratedGradients
from tqdm import tqdm

from probes.analysis.plots import layer_head_figure, layer_ticks
from probes.stats import js_divergence, spearman_rows, top1_agreement
from probes.analysis.tables import layer_head_frame
from probes.measures.gradflow import (attribution_distribution, head_attribution_gflops, head_attributions,
                                      hta_attributions, ig_baseline, word_embeddings)
from probes.model import hooks
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)

PATTERNS = ("self", "prev", "next", "cls", "sep", "other")
"""Names of the argmax patterns of a map row, indexed by :func:`argmax_patterns`."""


def argmax_patterns(dist: np.ndarray) -> np.ndarray:
    """Pattern of each row's argmax, for ``dist`` (..., T, T) with rows = positions i of ``[CLS] ... [SEP]``.

    Returns an int array (..., T) indexing :data:`PATTERNS`; precedence ``cls`` (j = 0), ``sep``
    (j = T - 1), ``self`` (j = i), ``prev`` (j = i - 1), ``next`` (j = i + 1), else ``other``.
    """
    dist = np.asarray(dist)
    T = dist.shape[-1]
    j = dist.argmax(-1)
    i = np.broadcast_to(np.arange(T), j.shape)
    out = np.full(j.shape, PATTERNS.index("other"))
    for name, cond in (("next", j == i + 1), ("prev", j == i - 1), ("self", j == i), ("sep", j == T - 1),
                       ("cls", j == 0)):  # later assignments win: cls > sep > self > prev > next
        out = np.where(cond, PATTERNS.index(name), out)
    return out


def captum_head_attribution(model: torch.nn.Module, input_ids: torch.Tensor, layer: int, head: int, pos: int,
                            method: str = "ig", steps: int = 20, baseline: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """One target's raw attribution (T, E) with captum (``IntegratedGradients`` with
    ``method="riemann_middle"`` / ``InputXGradient``) on the word-embedding input - the reference the
    batched :func:`head_attributions` is checked against. The forward function runs the full model
    (all layers captured, no early stop), batched over IG steps."""
    H = int(model.config.num_attention_heads)

    def forward(x):  # (B, T, E) -> (B, L*H*T)
        with hooks.attention(model, values=True) as s:
            s.run(inputs_embeds=x, attention_mask=torch.ones(x.shape[:2], dtype=torch.long, device=x.device))
            out = torch.stack([s.output[l] for l in s.capture], 1)  # (B, L, T, H, d)
        return out.sum(-1).transpose(2, 3).reshape(x.shape[0], -1)  # (B, L*H*T)

    x = word_embeddings(model, input_ids).unsqueeze(0).clone()  # (1, T, E)
    T = x.shape[1]
    target = (layer * H + head) * T + pos
    if method in ("ixg", "input_x_gradient"):
        attr = InputXGradient(forward).attribute(x, target=target)
    else:
        b = torch.zeros_like(x) if baseline is None else baseline.unsqueeze(0)
        attr = IntegratedGradients(forward).attribute(x, baselines=b, target=target, n_steps=steps,
                                                      method="riemann_middle")
    return attr[0].detach()


CAPTUM_CHECKED = ("ixg", "ig")  # methods re-done with captum on ``captum_check`` targets


def head_distributions(model, ids: torch.Tensor, method: str, ig_steps: int, chunk_size: int | None,
                       base: torch.Tensor, progress=None) -> torch.Tensor:
    """(L, H, T, T) attribution distributions of one sentence by ``method`` (``ixg``, ``ig`` or ``hta``);
    ``progress(layer, share)`` after each batch of backward passes (share of the layer's targets done)."""
    if method == "hta":
        return hta_attributions(model, ids, chunk_size, progress=progress)
    return head_attributions(model, ids, method, ig_steps, chunk_size, base, progress=progress)


def method_points(method: str, ig_steps: int) -> int:
    """Points per target of ``method``: ``ig_steps`` for ``ig``, else 1."""
    return int(ig_steps) if method == "ig" else 1


def work_gflops(model, n_pieces: list[int], methods, ig_steps: int) -> np.ndarray:
    """(n_sentences, n_methods, L) estimated GFLOPs of every sentence, method and layer
    (:func:`probes.measures.gradflow.head_attribution_gflops`): the progress bar's weights."""
    L = int(model.config.num_hidden_layers)
    return np.array([[[head_attribution_gflops(model, n, l, method_points(m, ig_steps)) for l in range(L)]
                      for m in methods] for n in n_pieces])


def compare(dist: np.ndarray, attn: np.ndarray) -> dict[str, np.ndarray]:
    """Per (l, h, i) JS divergence, Spearman and top-1 agreement of ``dist`` vs ``attn`` (both (L, H, T, T))."""
    return dict(js=js_divergence(dist, attn), spearman=spearman_rows(dist, attn), top1=top1_agreement(dist, attn))


def head_pattern_counts(dist: np.ndarray) -> np.ndarray:
    """(L, H, len(PATTERNS)) counts of the argmax patterns of every head's rows (``dist`` (L, H, T, T))."""
    pat = argmax_patterns(dist)  # (L, H, T)
    return (pat[..., None] == np.arange(len(PATTERNS))).sum(-2)


def pattern_counts(dist: np.ndarray) -> np.ndarray:
    """(L, len(PATTERNS)) counts of argmax patterns over heads and positions."""
    return head_pattern_counts(dist).sum(1)


def dominant_pattern_agreement(map_counts: np.ndarray, attr_counts: np.ndarray) -> np.ndarray:
    """(L, H) bool: the most frequent argmax pattern of each head (counts (L, H, P); ties: first in
    :data:`PATTERNS`) is the same in the map and in the attribution."""
    return map_counts.argmax(-1) == attr_counts.argmax(-1)


def figure_layers(layers: pd.DataFrame):
    """Per-layer JS, Spearman, top-1 and pattern agreement of every (kind, method) comparison."""
    cols = ("js", "spearman", "top1", "pattern_agree")
    labs = ("JS divergence", "Spearman rho", "top-1 agreement", "heads with the same dominant pattern")
    fig, axes = plt.subplots(1, len(cols), figsize=(14.5, 3.4))
    for ax, col, lab in zip(axes, cols, labs):
        for (kind, m), g in layers.groupby(["kind", "method"], sort=False):
            ax.plot(g.layer + 1, g[col], marker="o", label=f"{kind} vs {m}")
        ax.set_xlabel("layer")
        layer_ticks(ax, int(layers.layer.min()) + 1, int(layers.layer.max()) + 1)
        ax.set_title(f"{lab}: map vs attribution", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def figure_heads(heads: pd.DataFrame):
    """Per-head top-1 agreement (layer x head) of every per-head kind and method."""
    mats = {}
    for (kind, m), g in heads.groupby(["kind", "method"], sort=False):
        if g["head"].nunique() > 1:
            mats[f"top-1: {kind} vs {m}"] = g.pivot(index="layer", columns="head", values="top1").to_numpy()
    return layer_head_figure(mats, ncols=2, vmin=0, vmax=1, annotate="{:.2f}") if mats else None


def figure_patterns(pat: pd.DataFrame):
    """Stacked shares of the argmax patterns per layer, one panel per source (map kind or method)."""
    sources = list(dict.fromkeys(pat.source))
    fig, axes = plt.subplots(1, len(sources), figsize=(3.6 * len(sources), 3.3), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, src in zip(axes, sources):
        p = pat[pat.source == src].pivot(index="layer", columns="pattern", values="share")[list(PATTERNS)]
        bottom = np.zeros(len(p))
        for name in PATTERNS:
            ax.bar(p.index + 1, p[name], bottom=bottom, label=name)
            bottom += p[name].to_numpy()
        ax.set_title(f"argmax of {src}", fontsize=9)
        ax.set_xlabel("layer")
        layer_ticks(ax, int(p.index.min()) + 1, int(p.index.max()) + 1)
    axes[0].set_ylabel("share of positions")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def select_shortest(n_words: list[int], n_pieces: list[int], n_shortest: int | None, min_words: int,
                    max_length: int) -> list[int]:
    """Indices of the ``n_shortest`` shortest sentences (pieces; ties in file order) with ``>= min_words``
    words that fit in ``max_length`` pieces (None = all of them), shortest first."""
    ok = (i for i in range(len(n_words)) if n_words[i] >= min_words and n_pieces[i] <= max_length)
    return sorted(ok, key=lambda i: (n_pieces[i], i))[:n_shortest]


def kind_maps(measure, model, ids: torch.Tensor) -> np.ndarray:
    """(L, H', T, T) maps of one sentence (1-D ids) of any kind, rows normalised to sum 1."""
    with torch.inference_mode():
        maps = torch.stack(measure(model, ids[None], torch.ones_like(ids)[None]), dim=1)[0].float()  # (L, H', T, T)
    return (maps / maps.sum(-1, keepdim=True).clamp(min=1e-12)).cpu().numpy()


class _Acc:
    """Running sums of one (kind, method) comparison: per (layer, head) sums and pattern counts."""

    def __init__(self, L: int, H: int):
        self.s = {k: np.zeros((L, H)) for k in ("js", "spearman", "top1", "n", "n_rho")}
        self.map_pat = np.zeros((L, H, len(PATTERNS)))  # (L, H', P) argmax patterns of the map
        self.attr_pat = np.zeros((L, H, len(PATTERNS)))  # (L, H', P) of the attribution it is compared with

    def add(self, dist: np.ndarray, maps: np.ndarray) -> None:
        """``dist``, ``maps``: (L, H', T, T) of one sentence."""
        c = compare(dist, maps)
        self.s["js"] += c["js"].sum(-1)
        self.s["top1"] += c["top1"].sum(-1)
        self.s["spearman"] += np.nansum(c["spearman"], -1)
        self.s["n_rho"] += np.isfinite(c["spearman"]).sum(-1)
        self.s["n"] += c["js"].shape[-1]
        self.map_pat += head_pattern_counts(maps)
        self.attr_pat += head_pattern_counts(dist)

    def heads(self) -> dict[str, np.ndarray]:
        s, n = self.s, np.maximum(self.s["n"], 1)
        return dict(js=s["js"] / n, spearman=s["spearman"] / np.maximum(s["n_rho"], 1), top1=s["top1"] / n,
                    n=s["n"].astype(int))

    def layers(self) -> dict[str, np.ndarray]:
        s, n = self.s, np.maximum(self.s["n"].sum(1), 1)
        agree = dominant_pattern_agreement(self.map_pat, self.attr_pat)  # (L, H')
        out = dict(js=s["js"].sum(1) / n, spearman=s["spearman"].sum(1) / np.maximum(s["n_rho"].sum(1), 1),
                   top1=s["top1"].sum(1) / n, pattern_agree=agree.mean(1))
        empty = s["n"].sum(1) == 0  # (L,) no sentence within the kind's length bound
        out = {k: np.where(empty, np.nan, v) for k, v in out.items()}
        return dict(out, n=s["n"].sum(1).astype(int))


@dataclass(frozen=True)
class AttributionSettings:
    """The analysis node's keys (conf/analysis/attribution.yaml): which sentences, which attribution methods,
    which map kinds."""

    split: str = "dev"
    max_sentences: int | None = None    # first N sentences of the split (file order); None = all
    n_shortest: int | None = 50         # of those, the N shortest with >= min_words words; None = all
    min_words: int = 5
    methods: tuple[str, ...] = ("ixg", "ig")
    ig_steps: int = 20
    baseline: str = "zero"              # zero | pad: the IG baseline
    chunk_size: int | None = 1024       # backward passes per batch
    captum_check: int = 2               # first N sentences: one random target per method re-done with captum
    num_threads: int | None = None      # torch CPU threads; None = torch's default
    kinds: tuple[str, ...] | None = None  # map kinds compared with the attribution; None = extract.maps
    seed: int = 0


@dataclass
class AttributionResult:
    """What :func:`compute` returns: the running sums of every (kind, method) comparison and the pattern counts."""

    settings: AttributionSettings
    kinds: list[str]                    # the map kinds compared, in order
    num_layers: int
    order: list[int]                    # the sentences used (indices into the first max_sentences), shortest first
    n_pieces: list[int]                 # pieces of each sentence of ``order``
    comparisons: dict[tuple[str, str], _Acc]   # (kind, method) -> sums
    patterns: dict[str, np.ndarray]     # map kind or method -> (L, len(PATTERNS)) argmax pattern counts
    n_used: dict[str, int]              # kind -> sentences within its length bound
    checks: list[dict]                  # captum re-computations: max |diff| of one target each
    work: np.ndarray                    # (N, M, L) estimated GFLOPs per sentence, method and layer


@dataclass
class AttributionTables:
    """The analysis's tables (``attribution_<name>.csv``); ``captum_check`` is None when nothing was checked."""

    heads: pd.DataFrame
    layers: pd.DataFrame
    patterns: pd.DataFrame
    captum_check: pd.DataFrame | None


def compute(ctx, settings: AttributionSettings) -> AttributionResult:
    """Attribution distributions of every chosen sentence compared with every map kind (no files written).

    Args:
        ctx: The analysis context (encoder, sentences, device, map kinds).
        settings: The analysis's settings.

    Returns:
        The running sums, pattern counts and captum checks.
    """
    st = settings
    if st.num_threads:
        torch.set_num_threads(int(st.num_threads))
    enc = ctx.encoder
    sents = ctx.sentences(st.split, st.max_sentences)  # first max_sentences, file order
    encoded = encode_words(enc.tokenizer, [list(s.words) for s in sents])
    order = select_shortest([s.n for s in sents], [e.n_pieces for e in encoded], st.n_shortest, st.min_words,
                            enc.max_length)
    model = enc.model.to(ctx.device)
    pad_id = enc.tokenizer.pad_token_id if enc.tokenizer.pad_token_id is not None else 0
    if st.kinds:
        kinds = [str(k) for k in st.kinds]
        measures = dict(ctx.measure(k) for k in kinds)
    else:
        kind, measure = ctx.measure()
        kinds, measures = [kind], {kind: measure}
    L, NH = enc.num_layers, enc.num_heads
    methods = list(st.methods)
    ig_steps = st.ig_steps
    acc = {(k, m): _Acc(L, measures[k].heads(NH)) for k in kinds for m in methods}
    pats = {src: np.zeros((L, len(PATTERNS))) for src in [*kinds, *methods]}
    n_used = dict.fromkeys(kinds, 0)
    rng = random.Random(st.seed)
    checks = []
    n_pieces = [encoded[i].n_pieces for i in order]
    work = work_gflops(model, n_pieces, methods, ig_steps)  # (N, M, L) GFLOPs
    log.info("attribution: %d sentences (%d pieces, longest %d), methods %s, ig_steps %d: about %.0f GFLOP of "
             "backward passes (%s per method; cost grows with pieces^2); progress weighted by it",
             len(order), sum(n_pieces), max(n_pieces, default=0),
             methods, ig_steps, work.sum(), ", ".join(f"{m} {w:.0f}" for m, w in zip(methods, work.sum((0, 2)))))
    bar = tqdm(total=round(float(work.sum()), 1), desc="attribution", unit="GFLOP", disable=False, mininterval=10,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} GFLOP [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
    for k, i in enumerate(order):
        ids = torch.tensor(encoded[i].input_ids, device=ctx.device)  # (T,)
        n = len(ids)
        maps = {}
        for kind in kinds:
            mx = measures[kind].max_pieces
            if mx is None or n <= mx:  # e.g. flow: only sentences within its bound
                maps[kind] = kind_maps(measures[kind], model, ids)  # (L, H', T, T), rows sum to 1
                pats[kind] += pattern_counts(maps[kind])
                n_used[kind] += 1
        base = ig_baseline(model, ids, st.baseline, pad_id)  # (T, E)
        for mi, m in enumerate(methods):
            bar.set_postfix_str(f"sentence {k + 1}/{len(order)} ({n} pieces), {m}", refresh=False)
            dist = head_distributions(model, ids, m, ig_steps, st.chunk_size, base,
                                      progress=lambda l, share, k=k, mi=mi: bar.update(float(work[k, mi, l]) * share)
                                      ).cpu().numpy()  # (L, H, T, T)
            pats[m] += pattern_counts(dist)
            for kind, mp in maps.items():  # the one attribution against every kind
                acc[kind, m].add(dist if mp.shape[1] == dist.shape[1] else dist.mean(1, keepdims=True), mp)
            if k < st.captum_check and m in CAPTUM_CHECKED:  # one random target per method and sentence vs captum
                l, h, p = rng.randrange(L), rng.randrange(NH), rng.randrange(n)
                ref = attribution_distribution(captum_head_attribution(model, ids, l, h, p, m, ig_steps, base))
                checks.append(dict(method=m, sentence=i, layer=l, head=h, pos=p,
                                   max_abs_diff=float(np.abs(ref.cpu().numpy() - dist[l, h, p]).max())))
    bar.close()
    return AttributionResult(st, kinds, L, order, n_pieces, acc, pats, n_used, checks, work)


def tables(result: AttributionResult) -> AttributionTables:
    """The per-head, per-layer and pattern tables of ``result`` (see the module doc for their columns)."""
    L = result.num_layers
    hrows, lrows = [], []
    for (kind, m), a in result.comparisons.items():
        df = layer_head_frame(a.heads(), kind=kind, method=m)
        df["map_pattern"] = [PATTERNS[j] for j in a.map_pat.argmax(-1).ravel()]
        df["attr_pattern"] = [PATTERNS[j] for j in a.attr_pat.argmax(-1).ravel()]
        hrows.append(df)
        lrows.append(pd.DataFrame(dict(kind=kind, method=m, layer=np.arange(L), **a.layers())))
    heads = pd.concat(hrows, ignore_index=True)[["kind", "method", "layer", "head", "name", "js", "spearman", "top1",
                                                 "n", "map_pattern", "attr_pattern"]]
    prow = []
    for src, cnt in result.patterns.items():
        for l in range(L):
            tot = cnt[l].sum()
            for j, name in enumerate(PATTERNS):
                prow.append(dict(source=src, layer=l, pattern=name, share=cnt[l, j] / tot if tot else np.nan,
                                 count=int(cnt[l, j])))
    return AttributionTables(heads=heads, layers=pd.concat(lrows, ignore_index=True), patterns=pd.DataFrame(prow),
                             captum_check=pd.DataFrame(result.checks) if result.checks else None)


def summary(ctx, result: AttributionResult, frames: AttributionTables) -> dict:
    """The summary.json values of a run (without its seconds)."""
    st, kinds, layers, pat = result.settings, result.kinds, frames.layers, frames.patterns
    methods, enc = list(st.methods), ctx.encoder

    def means(g):  # per-layer values and their mean over layers
        return {c: dict(per_layer=[round(float(v), 4) for v in g[c]], mean=round(float(g[c].mean()), 4))
                for c in ("js", "spearman", "top1", "pattern_agree")}

    trend = {f"{kind}/{m}": {c: float(np.corrcoef(g.layer, g[c])[0, 1]) if g[c].std() > 0 else None
                             for c in ("js", "spearman", "top1")}
             for (kind, m), g in layers.groupby(["kind", "method"], sort=False)}
    return dict(
        analysis="attribution", maps=kinds[0] if len(kinds) == 1 else kinds, kinds=kinds, split=st.split,
        encoder=enc.name, model_type=enc.model_type, device=ctx.device,
        max_sentences=st.max_sentences, n_shortest=st.n_shortest, min_words=st.min_words,
        n_sentences=len(result.order), n_sentences_per_kind=result.n_used,
        mean_pieces=float(np.mean(result.n_pieces)) if result.order else None,
        methods=methods, ig_steps=st.ig_steps, baseline=st.baseline,
        estimated_gflop={m: round(float(w), 1) for m, w in zip(methods, result.work.sum((0, 2)))},
        chunk_size=st.chunk_size,
        per_layer={m: {c: [round(float(v), 4) for v in g[c]] for c in ("js", "spearman", "top1")}
                   for m, g in layers[layers.kind == kinds[0]].groupby("method")},
        comparison={f"{kind}/{m}": means(g) for (kind, m), g in layers.groupby(["kind", "method"], sort=False)},
        depth_trend_pearson_r=trend,
        patterns={src: {name: [round(float(v), 3) for v in pat[(pat.source == src) & (pat.pattern == name)].share]
                        for name in PATTERNS} for src in result.patterns},
        captum_max_abs_diff=max((c["max_abs_diff"] for c in result.checks), default=None))


def save(ctx, result: AttributionResult, frames: AttributionTables, started: float) -> None:
    """Stage 3, :class:`probes.analysis.stages.Save` (arguments and contract there): ``attribution_heads``,
    ``attribution_layers``, ``attribution_patterns`` .csv (``attribution_captum_check.csv`` when Captum was
    compared) and .png (the heads' figure only when some kind has per-head maps); the summary is
    :func:`summary`."""
    ctx.save_table(frames.heads, "attribution_heads")
    ctx.save_table(frames.layers, "attribution_layers")
    ctx.save_table(frames.patterns, "attribution_patterns")
    if frames.captum_check is not None:
        ctx.save_table(frames.captum_check, "attribution_captum_check")
    ctx.save_figure(figure_layers(frames.layers), "attribution_layers")
    ctx.save_figure(figure_patterns(frames.patterns), "attribution_patterns")
    fig = figure_heads(frames.heads)
    if fig is not None:
        ctx.save_figure(fig, "attribution_heads")
    ctx.log_summary(dict(summary(ctx, result, frames), seconds=round(time.time() - started, 1)))
    log.info("attribution: %d sentences, kinds %s, in %.1fs", len(result.order), result.kinds, time.time() - started)


def attribution(ctx, *, split: str = "dev", max_sentences: int | None = None, n_shortest: int | None = 50,
                min_words: int = 5, methods=("ixg", "ig"), ig_steps: int = 20, baseline: str = "zero",
                chunk_size: int | None = 1024, captum_check: int = 2, num_threads: int | None = None,
                kinds=None, seed: int = 0) -> pd.DataFrame:
    """Attribution vs each map kind for every head (the keys: :class:`AttributionSettings`, the module doc);
    save the tables and figures; return the per-layer table."""
    started = time.time()
    settings = AttributionSettings(split=split, max_sentences=max_sentences, n_shortest=n_shortest,
                                   min_words=min_words, methods=tuple(methods), ig_steps=ig_steps, baseline=baseline,
                                   chunk_size=chunk_size, captum_check=captum_check, num_threads=num_threads,
                                   kinds=tuple(kinds) if kinds else None, seed=seed)
    result = compute(ctx, settings)
    frames = tables(result)
    save(ctx, result, frames, started)
    return frames.layers
