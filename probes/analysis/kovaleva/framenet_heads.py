"""``analysis=framenet_heads``: Kovaleva et al. 2019 §4.1 (Fig 3) — are there heads for semantic relations?

For every link between a frame-evoking lexical unit (the target) and one of its core frame elements
in FrameNet 1.7 full-text annotation (:mod:`probes.data.framenet`), per head: the maximum absolute
attention weight between the target's wordpieces and the frame element's wordpieces, in both
directions — target -> FE (target tokens as queries) and FE -> target — and the larger of the two
(the link's score); averaged over all links. Discontinuous targets and frame elements count all
their pieces; links whose target and frame element share a word are left out.

Baseline: random span pairs with the same shape as each link — both spans shifted together by a
non-zero number of words that keeps them inside the same sentence, so lengths, gaps and order are
those of the real link — scored the same way; by default every such shift is scored and averaged
(the expectation of one random placement, no sampling noise), ``baseline_samples=k`` draws k at
random instead. A head that tracks the relation scores well above its baseline; a positional head
scores about the same on both. Links filling their sentence have no shift and no baseline (counted).

The authors' notebook (text-machine-lab/dark-secrets-of-BERT, ``visualize_attention.ipynb``) differs:
it reads the lexicographic example sentences of every LU (not full text), keeps sentences of at most
12 tokens with one target and frame elements of at most 3 tokens not next to the target, pools all
core FEs of a sentence into one source list, and takes attention from FE tokens to target tokens
only (our ``fe_to_target``), pairing the i-th source with the i-th target token rather than all
pairs. ``max_sentence_words`` / ``max_element_words`` apply the first two filters.

Maps come from :meth:`probes.maps.MapEngine.iter_piece_map_batches` (whole sentences ``[CLS] words [SEP]``, no
truncation; longer sentences are skipped and counted); every link and shift of a batch is scored at once on the
maps' device (:func:`probes.maps.spans.block_max`). ``checkpoint``: fine-tuned GLUE model(s)
(path or ``{task: path}``) analysed next to the pre-trained ``encoder``.

Outputs: ``framenet_heads.csv`` (model, layer, head (0-based), name (1-based), score, target_to_fe,
fe_to_target, baseline, baseline_target_to_fe, baseline_fe_to_target, difference, n_links,
n_baseline), ``framenet_heads.png`` (per model: links, random spans, difference), ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from probes.analysis.kovaleva.common import FINETUNED, PRETRAINED, checkpoints, load_checkpoint
from probes.analysis.naming import head_name
from probes.analysis.plots import layer_head_axes
from probes.analysis.tables import layer_head_frame
from probes.data.framenet import read_framenet
from probes.maps import MapEngine
from probes.maps.spans import Spans, block_max, positions_of, weighted_sums
from probes.measures.attention import Attention
from probes.model.families import usable_max_length
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)


def pieces_of(word_of_piece: Sequence[int], words: Sequence[int]) -> list[int]:
    """Positions of the wordpieces of ``words`` (word indices) in a ``[CLS] ... [SEP]`` sequence."""
    want = set(words)
    return [t for t, w in enumerate(word_of_piece) if w in want]


def span_scores(attn: torch.Tensor, a: Sequence[int], b: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Max |attention| from pieces ``a`` to pieces ``b`` and from ``b`` to ``a``: two (L, H) tensors.

    attn: (L, H, T, T) maps of one sequence (rows = queries)."""
    a_t, b_t = torch.as_tensor(list(a)), torch.as_tensor(list(b))
    m = attn.abs()                                                  # (L, H, T, T)
    a_to_b = m[:, :, a_t][:, :, :, b_t].amax(dim=(-2, -1))          # (L, H)
    b_to_a = m[:, :, b_t][:, :, :, a_t].amax(dim=(-2, -1))          # (L, H)
    return a_to_b, b_to_a


def shifts(target: Sequence[int], element: Sequence[int], n_words: int) -> list[int]:
    """Non-zero word offsets that move both spans together and keep every word inside the sentence."""
    lo, hi = min(min(target), min(element)), max(max(target), max(element))
    return [s for s in range(-lo, n_words - hi) if s != 0]


def select_links(sentences, max_sentence_words: int | None = None, max_element_words: int | None = None):
    """Sentences of at most ``max_sentence_words`` words whose links are kept when their frame
    element has at most ``max_element_words`` words (None: no limit); sentences left without links dropped."""
    out = []
    for s in sentences:
        if max_sentence_words is not None and len(s.words) > max_sentence_words:
            continue
        links = [l for l in s.links if max_element_words is None or len(l.element) <= max_element_words]
        if links:
            out.append(replace(s, links=links))
    return out


class _LinkPlan:
    """The span pairs of every link, built once on the host before the maps stream.

    A link contributes its own pair (target, element) and one pair per shift of its baseline. Per pair: its target
    and element spans (:class:`~probes.maps.spans.Spans` ids) and three weights: 1 for the link's own pair in the
    sum over all links, 1 for it in the sum over the links with a baseline, 1/S for each of its S shifted pairs in
    the baseline sum (each link weighs the same). Item ``k``'s pairs are rows ``starts[k]:stops[k]``."""

    def __init__(self, n_items: int):
        self.spans = Spans()
        self._target: list[np.ndarray] = []
        self._element: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self.n_pairs = 0
        self.starts = np.zeros(n_items, dtype=np.int64)
        self.stops = np.zeros(n_items, dtype=np.int64)
        self.n_links = self.n_paired = self.skipped_overlap = self.no_baseline = 0

    def add_sentence(self, k: int, sentence, enc, baseline_samples: int | None, rng) -> None:
        """The pairs of sentence ``k`` (its links in order; the baseline shifts drawn from ``rng`` here)."""
        wop = np.asarray(enc.word_of_piece) + 1                   # (T,) word + 1: the specials are 0 and n + 1
        self.starts[k] = self.n_pairs
        for link in sentence.links:
            if not link.target or not link.element or set(link.target) & set(link.element):
                self.skipped_overlap += 1
                continue
            options = shifts(link.target, link.element, len(sentence.words))
            self.n_links += 1
            if not options:
                self.no_baseline += 1
            else:
                self.n_paired += 1
                if baseline_samples is not None:
                    options = rng.choice(options, size=baseline_samples, replace=True)
            d = np.concatenate([[0], np.asarray(options, dtype=np.int64)])     # (1 + S,) the link, its shifts
            for words, ids in ((link.target, self._target), (link.element, self._element)):
                w = np.zeros((len(d), len(sentence.words) + 2), dtype=bool)     # (1 + S, n + 2) words + 1
                w[np.arange(len(d))[:, None], np.asarray(words)[None, :] + d[:, None] + 1] = True
                ids.append(self.spans.add_many(w[:, wop]))                      # (1 + S, T) pieces
            weights = np.zeros((len(d), 3))                                     # (1 + S, 3)
            weights[0, 0] = 1.0
            if len(d) > 1:
                weights[0, 1] = 1.0
                weights[1:, 2] = 1.0 / (len(d) - 1)
            self._weights.append(weights)
            self.n_pairs += len(d)
        self.stops[k] = self.n_pairs

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(target span ids (P,), element span ids (P,), weights (P, 3)) of every pair."""
        cat = lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape)  # noqa: E731
        return (cat(self._target, 0).astype(np.int64), cat(self._element, 0).astype(np.int64),
                cat(self._weights, (0, 3)))


def head_link_scores(model, tokenizer, sentences, device: str = "cpu", baseline_samples: int | None = None,
                     seed: int = 0, max_tokens: int = 4096, desc: str = "framenet") -> dict:
    """Mean link scores and baseline scores of one model over ``sentences`` (:class:`FrameSentence`).

    Baseline of a link: the mean score over every same-shape shift of its two spans
    (``baseline_samples=None``, the expectation of a random placement) or over that many shifts drawn
    at random (seeded); every link weighs the same in the mean over links.

    The span pairs of every link and shift are planned on the host before the maps stream; each batch of maps
    (:meth:`probes.maps.MapEngine.iter_piece_map_batches`) is reduced at once on its device
    (:func:`probes.maps.spans.block_max` over all its pairs, both directions), into running float64 sums there.

    Returns ``dict(score, target_to_fe, fe_to_target, baseline, baseline_target_to_fe,
    baseline_fe_to_target, difference`` (each (L, H) numpy; difference = score - baseline over the
    links that have a baseline), ``n_links, n_baseline, n_sentences, skipped_long, skipped_overlap,
    no_baseline)``."""
    limit = usable_max_length(model.config)
    sents = [s for s in sentences if s.links and s.words]
    encoded = encode_words(tokenizer, [s.words for s in sents])
    keep = [k for k, e in enumerate(encoded) if e.n_pieces <= limit]
    skipped_long = len(sents) - len(keep)
    rng = np.random.default_rng(seed)
    engine = MapEngine(model, Attention(), tokenizer=tokenizer, device=device, max_tokens=max_tokens,
                       max_batch_size=64, max_pairs=None)
    items = [encoded[k] for k in keep]
    plan = _LinkPlan(len(items))
    for j in (j for b in engine.batches(items) for j in b):  # the order the maps come in: the baseline draws keep it
        plan.add_sentence(j, sents[keep[j]], items[j], baseline_samples, rng)
    target, element, weights = plan.arrays()  # (P,), (P,), (P, 3)
    sums = None  # (3, 3, L, H) float64: [all links, links with a baseline, baselines] x [t2f, f2t, both]
    for positions, _, maps in engine.iter_piece_map_batches(items, desc=desc):  # maps: (B, L, H, T, T)
        rows, slot = positions_of(positions, plan.starts, plan.stops)  # (n,) pair ids, (n,) batch entries
        if not len(rows):
            continue
        T = maps.shape[-1]
        t_mask, e_mask = plan.spans.masks(target[rows], T), plan.spans.masks(element[rows], T)  # (n, T) each
        both_ways = block_max(maps, np.concatenate([slot, slot]), np.concatenate([t_mask, e_mask]),
                              np.concatenate([e_mask, t_mask]), absolute=True)  # (2n, L, H)
        t2f, f2t = both_ways.split(len(rows))  # (n, L, H) each
        batch = weighted_sums(torch.stack([t2f, f2t, torch.maximum(t2f, f2t)], 1), weights[rows])  # (3, 3, L, H)
        sums = batch if sums is None else sums + batch
    if plan.n_links == 0:
        raise ValueError("framenet_heads: no usable link (every sentence too long, or no core frame element)")
    means = sums.cpu().numpy()  # (3, 3, L, H)
    out = dict(zip(("target_to_fe", "fe_to_target", "score"), means[0] / plan.n_links))
    if plan.n_paired:
        out.update(zip(("baseline_target_to_fe", "baseline_fe_to_target", "baseline"), means[2] / plan.n_paired))
        out["difference"] = means[1, 2] / plan.n_paired - out["baseline"]  # over the same links
    else:
        out.update({k: np.full_like(out["score"], np.nan) for k in ("baseline", "baseline_target_to_fe",
                                                                    "baseline_fe_to_target", "difference")})
    out = {k: out[k] for k in ("score", "target_to_fe", "fe_to_target", "baseline", "baseline_target_to_fe",
                               "baseline_fe_to_target", "difference")}
    out.update(n_links=plan.n_links, n_baseline=plan.n_paired, n_sentences=len(keep), skipped_long=skipped_long,
               skipped_overlap=plan.skipped_overlap, no_baseline=plan.no_baseline)
    return out


def figure(results: dict[str, dict]):
    """Per model one row: link score, random-span baseline (same colour scale), difference."""
    models = list(results)
    L, H = results[models[0]]["score"].shape
    hi = max(float(np.nanmax(np.maximum(r["score"], r["baseline"]))) for r in results.values())
    fig, axes = plt.subplots(len(models), 3, figsize=(3 * (0.3 * H + 1.8), len(models) * (0.35 * L + 1.6)),
                             squeeze=False)
    for row, m in zip(axes, models):
        r = results[m]
        diff = r["difference"]
        lim = max(float(np.nanmax(np.abs(diff))), 1e-6)
        layer_head_axes(row[0], r["score"], vmin=0, vmax=hi, title=f"{m}: LU-core FE links (n={r['n_links']})")
        layer_head_axes(row[1], r["baseline"], vmin=0, vmax=hi, title=f"{m}: random span pairs")
        layer_head_axes(row[2], diff, cmap="RdBu_r", vmin=-lim, vmax=lim, title=f"{m}: links - random")
    fig.tight_layout()
    return fig


def framenet_heads(ctx, *, max_sentences: int | None = 2000, documents: list[str] | None = None,
                   core_types: list[str] | None = ("Core", "Core-Unexpressed"), baseline_samples: int | None = None,
                   max_sentence_words: int | None = None, max_element_words: int | None = None,
                   checkpoint=None, max_tokens: int = 4096, top: int = 5) -> pd.DataFrame:
    """Link and random-span scores of every head for the encoder (and ``checkpoint``); saves table and figure."""
    t0 = time.time()
    keep = tuple(core_types) if core_types is not None else None
    sentences = read_framenet(ctx.data_dir, list(documents) if documents else None, max_sentences, keep)
    sentences = select_links(sentences, max_sentence_words, max_element_words)
    n_links = sum(len(s.links) for s in sentences)
    log.info("framenet_heads: %d sentences, %d LU -> FE links", len(sentences), n_links)
    models = {PRETRAINED: (ctx.encoder.model, ctx.encoder.tokenizer)}
    if checkpoint:
        for task, path in checkpoints(checkpoint).items():
            ft = load_checkpoint(ctx, path, task, compare=True)
            models[f"{FINETUNED} ({ft.task})" if ft.task else FINETUNED] = (ft.model, ft.tokenizer)
    results, frames, summary = {}, [], {}
    for label, (model, tok) in models.items():
        r = head_link_scores(model, tok, sentences, ctx.device, baseline_samples, ctx.seed, max_tokens, desc=label)
        results[label] = r
        values = {k: r[k] for k in ("score", "target_to_fe", "fe_to_target", "baseline", "baseline_target_to_fe",
                                    "baseline_fe_to_target", "difference")}
        frames.append(layer_head_frame(values, model=label, n_links=r["n_links"], n_baseline=r["n_baseline"]))
        order = np.argsort(-r["score"], axis=None)[:top]
        dorder = np.argsort(-np.nan_to_num(values["difference"], nan=-np.inf), axis=None)[:top]
        H = r["score"].shape[1]
        summary[label] = dict(
            n_links=r["n_links"], n_sentences=r["n_sentences"], skipped_long=r["skipped_long"],
            skipped_overlap=r["skipped_overlap"], no_baseline=r["no_baseline"], n_baseline=r["n_baseline"],
            mean_score=float(r["score"].mean()), mean_baseline=float(np.nanmean(r["baseline"])),
            top_heads={head_name(i // H, i % H): round(float(r["score"].flat[i]), 4) for i in order},
            top_over_baseline={head_name(i // H, i % H): round(float(values["difference"].flat[i]), 4) for i in dorder})
        log.info("framenet_heads %s: %d links, best head %s (%.3f)", label, r["n_links"],
                 head_name(order[0] // H, order[0] % H), r["score"].flat[order[0]])
    df = pd.concat(frames, ignore_index=True)
    ctx.save_table(df, "framenet_heads")
    ctx.save_figure(figure(results), "framenet_heads")
    ctx.log_summary(dict(analysis="framenet_heads", encoder=ctx.encoder.name, n_sentences_read=len(sentences),
                         n_links_read=n_links, core_types=list(keep) if keep else None,
                         baseline_samples=baseline_samples, max_sentence_words=max_sentence_words,
                         max_element_words=max_element_words, models=summary, seconds=round(time.time() - t0, 1)))
    return df
