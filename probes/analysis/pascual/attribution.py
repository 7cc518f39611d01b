"""``analysis=attribution``: do head outputs depend on the tokens the head attends to? (Pascual et al. 2021)

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
  ``ig_steps`` Riemann-midpoint points.

Both are computed for all ``L * H * T`` targets of a sentence by batched VJPs (``torch.func``; see
:mod:`probes.analysis.westera.gradflow`), which equal captum's ``InputXGradient`` / ``IntegratedGradients
(method="riemann_middle")`` on the same input (checked on ``captum_check`` random targets per run and
in the tests; captum itself would need one call per target).

Distribution over input tokens: ``|attribution|`` summed over the embedding dimension, normalised
to sum 1. It is compared with the same head's attention row ``A[l, h, i, :]``:

* Jensen-Shannon divergence (base 2, in [0, 1]); Spearman rank correlation over the T tokens;
  top-1 agreement (same argmax). Means over positions and sentences, per (method, layer, head) and
  per (method, layer).
* Patterns: the share of positions whose argmax is ``cls`` / ``sep`` / ``self`` / ``prev`` / ``next``
  / ``other`` (precedence in that order), per layer, for the attention and for each attribution.

Sentences: of the first ``max_sentences`` sentences of ``split`` (file order, as in every analysis;
null = the whole split), the ``n_shortest`` shortest (in pieces; ties in file order) with at least
``min_words`` words - the cost grows with T^2 (T targets per head, each a backward over T tokens).
``analysis.n_shortest=30`` is the README's "30 shortest dev sentences" (before the model-layer
refactor that selection was called ``max_sentences``).

Map kinds (``extract.maps=<kind>``, README "Beyond attention weights"): the attribution is compared with
that kind's maps instead of the attention rows (rows normalised to sum 1; the patterns' source is named
after the kind). A per-layer kind (rollout, flow, norm_res_ln, alti, value_zeroing) is compared with the
mean over heads of the heads' attribution distributions (``head`` = 0 in the files). Kinds with a length
bound (flow) keep only sentences within it.

Outputs: ``attribution_heads.csv`` (method, layer, head, js, spearman, top1, n), ``attribution_layers.csv``
(method, layer, means), ``attribution_patterns.csv`` (source, layer, pattern, share),
``attribution_layers.png``, ``attribution_patterns.png``, ``summary.json``.
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from probes.analysis.stats import js_divergence, spearman_rows, top1_agreement
from probes.analysis.westera.gradflow import (PATTERNS, argmax_patterns, attribution_distribution,
                                              captum_head_attribution, head_attributions, hidden_and_attention,
                                              ig_baseline)
from probes.measures import from_config
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)


def compare(dist: np.ndarray, attn: np.ndarray) -> dict[str, np.ndarray]:
    """Per (l, h, i) JS divergence, Spearman and top-1 agreement of ``dist`` vs ``attn`` (both (L, H, T, T))."""
    return dict(js=js_divergence(dist, attn), spearman=spearman_rows(dist, attn), top1=top1_agreement(dist, attn))


def pattern_counts(dist: np.ndarray) -> np.ndarray:
    """(L, len(PATTERNS)) counts of argmax patterns over heads and positions."""
    pat = argmax_patterns(dist)  # (L, H, T)
    return np.stack([np.bincount(p.ravel(), minlength=len(PATTERNS)) for p in pat])


def figure_layers(layers: pd.DataFrame):
    import matplotlib.pyplot as plt
    from probes.analysis import plots  # noqa: F401

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    for ax, col, lab in zip(axes, ("js", "spearman", "top1"), ("JS divergence", "Spearman rho", "top-1 agreement")):
        for m, g in layers.groupby("method"):
            ax.plot(g.layer + 1, g[col], marker="o", label=m)
        ax.set_xlabel("layer")
        ax.set_title(f"{lab}: attribution vs attention", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure_patterns(pat: pd.DataFrame):
    import matplotlib.pyplot as plt
    from probes.analysis import plots  # noqa: F401

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


def attribution(ctx, *, split: str = "dev", max_sentences: int | None = None, n_shortest: int | None = 50,
                min_words: int = 5, methods=("ixg", "ig"), ig_steps: int = 20, baseline: str = "zero",
                chunk_size: int | None = 256, captum_check: int = 2, num_threads: int | None = None,
                seed: int = 0) -> pd.DataFrame:
    """Attribution vs attention for every head; save the tables and figures; return the per-layer table."""
    t0 = time.time()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    enc = ctx.encoder
    sents = ctx.sentences(split, max_sentences)  # first max_sentences, file order
    encoded = encode_words(enc.tokenizer, [list(s.words) for s in sents])
    order = select_shortest([s.n for s in sents], [e.n_pieces for e in encoded], n_shortest, min_words,
                            enc.max_length)
    model = enc.model.to(ctx.device)
    pad_id = enc.tokenizer.pad_token_id if enc.tokenizer.pad_token_id is not None else 0
    kind, measure = from_config(ctx.cfg.extract)
    if measure.max_pieces:  # e.g. flow
        order = [i for i in order if encoded[i].n_pieces <= measure.max_pieces]
    L, H = enc.num_layers, measure.heads(enc.num_heads)
    methods = list(methods)
    sums = {m: {k: np.zeros((L, H)) for k in ("js", "spearman", "top1", "n", "n_rho")} for m in methods}
    pats = {src: np.zeros((L, len(PATTERNS))) for src in [kind, *methods]}
    rng = random.Random(seed)
    checks = []
    for k, i in enumerate(tqdm(order, desc="attribution", unit="sent", disable=None)):
        ids = torch.tensor(encoded[i].input_ids, device=ctx.device)
        if kind == "attention":
            _, attn = hidden_and_attention(model, ids)
            attn = attn.cpu().numpy()  # (L, H, T, T)
        else:
            attn = kind_maps(measure, model, ids)  # (L, H', T, T), rows sum to 1
        pats[kind] += pattern_counts(attn)
        base = ig_baseline(model, ids, baseline, pad_id)  # (T, E)
        for m in methods:
            dist = head_attributions(model, ids, m, ig_steps, chunk_size, base).cpu().numpy()  # (L, H, T, T)
            if attn.shape[1] != dist.shape[1]:  # per-layer kind: against the head-mean attribution
                dist = dist.mean(1, keepdims=True)  # (L, 1, T, T)
            c = compare(dist, attn)
            s = sums[m]
            s["js"] += c["js"].sum(-1)
            s["top1"] += c["top1"].sum(-1)
            s["spearman"] += np.nansum(c["spearman"], -1)
            s["n_rho"] += np.isfinite(c["spearman"]).sum(-1)
            s["n"] += c["js"].shape[-1]
            pats[m] += pattern_counts(dist)
            if k < captum_check:  # one random target per method and sentence vs captum
                l, h, p = rng.randrange(L), rng.randrange(H), rng.randrange(len(ids))
                if H != enc.num_heads:
                    h = rng.randrange(enc.num_heads)
                    dist = head_attributions(model, ids, m, ig_steps, chunk_size, base).cpu().numpy()
                ref = attribution_distribution(captum_head_attribution(model, ids, l, h, p, m, ig_steps, base))
                checks.append(dict(method=m, sentence=i, layer=l, head=h, pos=p,
                                   max_abs_diff=float(np.abs(ref.cpu().numpy() - dist[l, h, p]).max())))
    rows = []
    for m in methods:
        s = sums[m]
        for l in range(L):
            for h in range(H):
                rows.append(dict(method=m, layer=l, head=h, js=s["js"][l, h] / s["n"][l, h],
                                 spearman=s["spearman"][l, h] / max(s["n_rho"][l, h], 1),
                                 top1=s["top1"][l, h] / s["n"][l, h], n=int(s["n"][l, h])))
    heads = pd.DataFrame(rows)
    layers = pd.DataFrame([dict(method=m, layer=l, js=sums[m]["js"][l].sum() / sums[m]["n"][l].sum(),
                                spearman=sums[m]["spearman"][l].sum() / max(sums[m]["n_rho"][l].sum(), 1),
                                top1=sums[m]["top1"][l].sum() / sums[m]["n"][l].sum(), n=int(sums[m]["n"][l].sum()))
                           for m in methods for l in range(L)])
    prow = []
    for src, cnt in pats.items():
        for l in range(L):
            tot = cnt[l].sum()
            for j, name in enumerate(PATTERNS):
                prow.append(dict(source=src, layer=l, pattern=name, share=cnt[l, j] / tot if tot else np.nan,
                                 count=int(cnt[l, j])))
    pat = pd.DataFrame(prow)
    ctx.save_table(heads, "attribution_heads")
    ctx.save_table(layers, "attribution_layers")
    ctx.save_table(pat, "attribution_patterns")
    if checks:
        ctx.save_table(pd.DataFrame(checks), "attribution_captum_check")
    ctx.save_figure(figure_layers(layers), "attribution_layers")
    ctx.save_figure(figure_patterns(pat), "attribution_patterns")
    trend = {}
    for m, g in layers.groupby("method"):
        trend[m] = {c: float(np.corrcoef(g.layer, g[c])[0, 1]) for c in ("js", "spearman", "top1")}
    ctx.log_summary(dict(
        analysis="attribution", maps=kind, split=split, encoder=enc.name, model_type=enc.model_type, device=ctx.device,
        max_sentences=max_sentences, n_shortest=n_shortest, min_words=min_words, n_sentences=len(order),
        mean_pieces=float(np.mean([encoded[i].n_pieces for i in order])) if order else None,
        methods=methods, ig_steps=ig_steps, baseline=baseline, seconds=round(time.time() - t0, 1),
        per_layer={m: {c: [round(float(v), 4) for v in g[c]] for c in ("js", "spearman", "top1")}
                   for m, g in layers.groupby("method")},
        depth_trend_pearson_r=trend,
        patterns={src: {name: [round(float(v), 3) for v in pat[(pat.source == src) & (pat.pattern == name)].share]
                        for name in PATTERNS} for src in pats},
        captum_max_abs_diff=max((c["max_abs_diff"] for c in checks), default=None)))
    log.info("attribution: %d sentences in %.1fs", len(order), time.time() - t0)
    return layers
