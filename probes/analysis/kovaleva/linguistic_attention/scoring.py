"""Stage 1 of :mod:`probes.analysis.kovaleva.linguistic_attention`: the scores of one example, their
accumulation over examples, the pre-trained vs fine-tuned change and :func:`compute` (no file written)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from probes.analysis.kovaleva.common import FINETUNED, PRETRAINED, checkpoint_for, variants
from probes.analysis.kovaleva.linguistic_attention.examples import (ExampleSelection, LabelledExample,
                                                                    glue_items, load_spacy, treebank_items)
from probes.analysis.kovaleva.linguistic_attention.rules import KindRules, check_relation, clauses, rule_matrix
from probes.data.glue import read_glue, task_spec
from probes.maps import MapEngine
from probes.maps.spans import Spans, block_max, column_reduce, concat_ranges, positions_of, segment_max
from probes.measures.attention import Attention
from probes.memory import gc_paused
from probes.model.families import usable_max_length
from probes.stats import resamples

log = logging.getLogger(__name__)


def example_scores(attn: np.ndarray, groups: Mapping[str, list[list[int]]],
                   piece_pooling: str = "max") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """kind -> ((L, H) received attention, (L, H) attention from [CLS]) for one example; kinds without a
    qualifying token are absent. ``attn``: (L, H, T, T), rows = from."""
    if piece_pooling not in ("sum", "max"):
        raise ValueError(f"piece_pooling must be sum or max, got {piece_pooling!r}")
    T = attn.shape[-1]
    received = attn.sum(axis=2) / T        # (L, H, T): (1/T) sum_i A[i, j]
    from_cls = attn[:, :, 0, :]             # (L, H, T)
    pool = np.sum if piece_pooling == "sum" else np.max
    out = {}
    for name, gs in groups.items():
        if not gs:
            continue
        r = np.stack([pool(received[..., g], axis=-1) for g in gs], -1).max(-1)  # (L, H)
        c = np.stack([pool(from_cls[..., g], axis=-1) for g in gs], -1).max(-1)  # (L, H)
        out[name] = (r, c)
    return out


def pair_scores(attn: np.ndarray, pairs: Sequence[tuple[list[int], list[int]]]) -> np.ndarray | None:
    """(L, H) largest A[i, j], i a source piece and j a target piece of one pair, over all pairs; None if
    there is none. ``attn``: (L, H, T, T)."""
    if not pairs:
        return None
    return np.stack([attn[:, :, s][:, :, :, t].reshape(*attn.shape[:2], -1).max(-1) for s, t in pairs], -1).max(-1)


class FeatureAccumulator:
    """Per kind, the (L, H) scores of every counted example (``missing``: zero -> an example without the
    kind counts 0; skip -> it is left out); [CLS]-row scores only over examples that have the kind. Examples come
    one at a time (:meth:`add`) or as a batch (:meth:`add_batch`); both keep them in the order they came."""

    def __init__(self, features: Sequence[str], missing: Mapping[str, str] | str = "skip"):
        self.features = list(features)
        self.missing = {f: (missing if isinstance(missing, str) else missing.get(f, "skip")) for f in self.features}
        for f, m in self.missing.items():
            if m not in ("zero", "skip"):
                raise ValueError(f"missing must be 'zero' or 'skip' (kind {f}), got {m!r}")
        # per kind, chunks of counted examples: (n, L, H) float64 scores, or an int: n examples scored 0 before the
        # shape was known; (n,) their indices; (m, L, H) [CLS]-row scores of those that have the kind
        self._scores: dict[str, list[np.ndarray | int]] = {f: [] for f in self.features}
        self._index: dict[str, list[np.ndarray]] = {f: [] for f in self.features}
        self._cls: dict[str, list[np.ndarray]] = {f: [] for f in self.features}
        self.present = {f: 0 for f in self.features}  # kind -> examples that have it
        self.n_examples = 0
        self.shape = None

    def add(self, scores: Mapping[str, tuple[np.ndarray, np.ndarray] | np.ndarray | None], index: int | None = None
            ) -> None:
        """One example's scores: kind -> ((L, H) received, (L, H) from [CLS]) or (L, H) or None (absent)."""
        k = self.n_examples if index is None else index
        self.n_examples += 1
        for f in self.features:
            s = scores.get(f)
            r, c = (s if isinstance(s, tuple) else (s, None)) if s is not None else (None, None)
            if r is not None:
                self.shape = np.shape(r)
                self._keep(f, np.asarray(r, dtype=np.float64)[None], np.array([k]))
                if c is not None:
                    self._cls[f].append(np.asarray(c, dtype=np.float64)[None])
            elif self.missing[f] == "zero":
                self._keep(f, 1, np.array([k]), present=0)

    def add_batch(self, scores: np.ndarray, has: np.ndarray, cls: np.ndarray | None = None,
                  index: np.ndarray | None = None) -> None:
        """N examples at once, as N calls of :meth:`add`: ``scores`` (N, F, L, H) of the F kinds in
        :attr:`features` order, ``has`` (N, F) bool (False: the example lacks the kind, its scores unread),
        ``cls`` (N, F, L, H) [CLS]-row scores or None, ``index`` (N,) the examples' indices (None: the next N)."""
        N, F = has.shape
        if scores.shape[:2] != (N, F) or F != len(self.features):
            raise ValueError(f"expected scores (N, {len(self.features)}, L, H) and has (N, {len(self.features)}), "
                             f"got {scores.shape} and {has.shape}")
        index = np.arange(self.n_examples, self.n_examples + N) if index is None else np.asarray(index)
        self.n_examples += N
        if N == 0:
            return
        self.shape = scores.shape[2:]
        for i, f in enumerate(self.features):
            h = has[:, i]  # (N,)
            if self.missing[f] == "zero":  # every example, 0 where the kind is absent
                self._keep(f, np.where(h[:, None, None], scores[:, i], 0.0).astype(np.float64), index,
                           present=int(h.sum()))
            elif h.any():
                self._keep(f, scores[h, i].astype(np.float64), index[h], present=int(h.sum()))
            if cls is not None and h.any():
                self._cls[f].append(cls[h, i].astype(np.float64))

    def _keep(self, f: str, scores: np.ndarray | int, index: np.ndarray, present: int | None = None) -> None:
        self._scores[f].append(scores)
        self._index[f].append(index)
        self.present[f] += len(index) if present is None else present

    @property
    def count(self) -> dict[str, int]:
        """kind -> number of examples counted in its mean."""
        return {f: sum(len(i) for i in self._index[f]) for f in self.features}

    def per_example(self, f: str) -> tuple[np.ndarray, np.ndarray] | None:
        """((N_f, L, H) scores, (N_f,) example indices) of kind ``f``, in the order they came, or None when no
        example counts."""
        if not self._scores[f] or self.shape is None:
            return None
        s = np.concatenate([np.zeros((c, *self.shape)) if isinstance(c, int) else c for c in self._scores[f]])
        return s, np.concatenate(self._index[f])

    def cls_per_example(self, f: str) -> np.ndarray | None:
        """(M_f, L, H) [CLS]-row scores of the examples that have kind ``f``, in the order they came, or None."""
        return np.concatenate(self._cls[f]) if self._cls[f] else None

    def mean(self, f: str) -> np.ndarray | None:
        """(L, H) mean over the counted examples, or None when none counts."""
        pe = self.per_example(f)
        return None if pe is None else pe[0].mean(0)

    def cls_mean(self, f: str) -> np.ndarray | None:
        """(L, H) mean [CLS]-row score over the examples that have kind ``f``, or None."""
        c = self.cls_per_example(f)
        return None if c is None else c.mean(0)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of mean(b - a) over examples resampled with replacement (a, b: (N,) paired)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)  # (N,)
    if len(d) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.concatenate([d[idx].mean(1) for idx in resamples(len(d), n_boot, rng, n_boot)])  # (n_boot,)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class ModelScores:
    """The scores of one model on one source's examples."""

    source: str                     # glue:<TASK> | treebank:<name>
    model: str                      # pre-trained | fine-tuned
    kinds: FeatureAccumulator       # received attention and [CLS] row per kind
    relations: FeatureAccumulator   # token-to-token per relation
    n_skipped: int                  # examples outside the length range
    checkpoint: str | None          # the fine-tuned model's path

    def kind_means(self) -> dict[str, np.ndarray]:
        """kind -> (L, H) mean received attention, for the kinds some example counts."""
        means = {f: self.kinds.mean(f) for f in self.kinds.features}
        return {f: m for f, m in means.items() if m is not None}

    def relation_means(self) -> dict[str, np.ndarray]:
        """relation -> (L, H) mean token-to-token attention, for the relations some example counts."""
        means = {r: self.relations.mean(r) for r in self.relations.features}
        return {r: m for r, m in means.items() if m is not None}

    def n_with_pair(self) -> dict[str, int]:
        """relation -> number of examples with a linked pair."""
        return dict(self.relations.present)


@dataclass
class LinguisticResult:
    """What :func:`compute` returns: the scores of every (source, model) and the change rows."""

    selection: ExampleSelection
    rules: KindRules
    sources: list[str]              # the source labels, in order
    runs: list[ModelScores]         # per source, the pre-trained model then the fine-tuned one
    changes: list[dict]             # linguistic_change rows (pre-trained vs fine-tuned)


class _ExamplePlan:
    """The piece groups of every example's kinds and the (source, target) pieces of every relation pair, built
    for all examples at once on the host before the maps stream (the groups and pairs
    :func:`~probes.analysis.kovaleva.linguistic_attention.rules.feature_groups` and
    :func:`~probes.analysis.kovaleva.linguistic_attention.rules.relation_pairs` give each example, in another order
    within it).

    Groups: rows of (span, kind index), example ``k``'s rows ``group_starts[k]:group_stops[k]``; pairs: rows of
    (source span, target span, relation index), example ``k``'s ``pair_starts[k]:pair_stops[k]``; ``has_kind``
    (N, K) / ``has_pair`` (N, R): whether example ``k`` has a group of a kind / a pair of a relation. Spans: one
    per word of every example (its pieces; word ``g`` of all examples' words is span ``g``), then one per special
    piece a kind picks."""

    def __init__(self, items: Sequence[LabelledExample], tok, rules: KindRules):
        kinds, relations = rules.names, list(rules.relations.values())
        n, K, R = len(items), len(kinds), len(relations)
        n_words = np.array([len(it.words) for it in items], dtype=np.int64)  # (N,)
        word_start = np.cumsum(n_words) - n_words  # (N,) first global word of each example
        example_of_word = np.repeat(np.arange(n), n_words)  # (W,)
        # every piece: its example, position and global word (-1: a special)
        n_pieces = np.array([len(it.word_of_piece) for it in items], dtype=np.int64)  # (N,)
        example_of_piece = np.repeat(np.arange(n), n_pieces)  # (P,)
        position = np.arange(int(n_pieces.sum())) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)  # (P,)
        wop = np.fromiter((w if w is not None else -1 for it in items for w in it.word_of_piece), np.int64,
                          count=int(n_pieces.sum()))  # (P,)
        real = wop >= 0
        word = np.where(real, word_start[example_of_piece] + wop, -1)  # (P,) global word
        count = np.bincount(word[real], minlength=int(n_words.sum()))  # (W,) pieces of each word
        present = count > 0  # (W,) words with pieces
        self.spans = Spans()
        self.spans.extend(position[real][np.argsort(word[real], kind="stable")], count)  # span g: word g's pieces

        # groups: (example, kind, span) rows
        rules_of = [rules.features[name] for name in kinds]
        special = [next((c["special"] for c in clauses(r) if "special" in c), None) for r in rules_of]
        for rel in relations:
            check_relation(rel)
        ends = [[rel["source"]] + ([rel["target"]] if rel.get("target") else []) for rel in relations]
        every = rule_matrix([it.words for it in items], rules_of + [e for pair in ends for e in pair])
        every &= present[:, None]  # (W, K + the relations' rules): words with pieces only
        matches = every[:, :K]  # (W, K)
        matches[:, [sp is not None for sp in special]] = False  # a special kind picks its special pieces only
        g, f = np.nonzero(matches)  # word-major
        ex, kind, span = [example_of_word[g]], [f], [g]
        ids = np.fromiter((t for it in items for t in it.input_ids), np.int64, count=int(n_pieces.sum()))  # (P,)
        for k_, sp in enumerate(special):
            if sp is None:
                continue
            at = np.nonzero(ids == (tok.cls_token_id if sp == "cls" else tok.sep_token_id))[0]  # (m,) pieces
            ex.append(example_of_piece[at])
            kind.append(np.full(len(at), k_, dtype=np.int64))
            span.append(self.spans.extend(position[at], np.ones(len(at), dtype=np.int64)))
        ex, kind, span = (np.concatenate(x).astype(np.int64) for x in (ex, kind, span))
        order = np.argsort(ex, kind="stable")
        self.group_span, self.group_kind = span[order], kind[order]
        self.group_stops = np.cumsum(np.bincount(ex, minlength=n))
        self.group_starts = self.group_stops - np.bincount(ex, minlength=n)
        self.has_kind = np.zeros((n, K), dtype=bool)
        self.has_kind[ex, kind] = True

        # relation pairs: (example, relation, source span, target span) rows
        heads = np.fromiter((w.get("head", -1) if w.get("head") is not None else -1 for it in items for w in it.words),
                            np.int64, count=int(n_words.sum()))  # (W,) local head, -1: none
        head = np.where((heads >= 0) & (heads < n_words[example_of_word]), word_start[example_of_word] + heads, -1)
        ex, rel, src, tgt = [], [], [], []
        column = K
        for r, relation in enumerate(relations):
            link = relation.get("link", "head")
            m = every[:, column:column + len(ends[r])]  # (W, 1 or 2) source (, target)
            column += len(ends[r])
            if link == "head":
                ok = m[:, 0] & (head >= 0)
                ok[ok] &= present[head[ok]]
                if m.shape[1] > 1:
                    ok[ok] &= m[head[ok], 1]
                a = np.nonzero(ok)[0]
                b = head[a]
            else:  # link "any": a target rule (check_relation)
                s_words, t_words = np.nonzero(m[:, 0])[0], np.nonzero(m[:, 1])[0]
                t_count = np.bincount(example_of_word[t_words], minlength=n)  # (N,)
                t_start = np.cumsum(t_count) - t_count
                e = example_of_word[s_words]
                a = np.repeat(s_words, t_count[e])
                b = t_words[concat_ranges(t_start[e], t_start[e] + t_count[e])]
                a, b = a[a != b], b[a != b]
            if relation.get("reverse"):
                a, b = b, a
            ex.append(example_of_word[a])
            rel.append(np.full(len(a), r, dtype=np.int64))
            src.append(a)
            tgt.append(b)
        if ex:
            ex, rel, src, tgt = (np.concatenate(x).astype(np.int64) for x in (ex, rel, src, tgt))
        else:
            ex = rel = src = tgt = np.zeros(0, dtype=np.int64)
        order = np.argsort(ex, kind="stable")
        self.pair_src, self.pair_tgt, self.pair_rel = src[order], tgt[order], rel[order]
        self.pair_stops = np.cumsum(np.bincount(ex, minlength=n))
        self.pair_starts = self.pair_stops - np.bincount(ex, minlength=n)
        self.has_pair = np.zeros((n, R), dtype=bool)
        self.has_pair[ex, rel] = True


def batch_scores(maps: torch.Tensor, lengths: torch.Tensor, positions: Sequence[int], plan: _ExamplePlan,
                 n_kinds: int, n_relations: int, piece_pooling: str = "max") -> torch.Tensor:
    """The scores of one batch of examples at once, on the maps' device: (B, 2K + R, L, H) float32, per example
    its K kinds' received attention, their [CLS]-row scores and its R relations' token-to-token scores
    (:func:`example_scores` and :func:`pair_scores` of each example; -inf where it has no group / pair).

    maps: (B, L, H, T, T), padded entries 0; lengths: (B,) pieces of each example."""
    B, L, H, T, _ = maps.shape
    received = maps.sum(3) / lengths.to(maps.device, maps.dtype)[:, None, None, None]  # (B, L, H, T)
    from_cls = maps[:, :, :, 0, :]                                                   # (B, L, H, T)
    rows, slot = positions_of(positions, plan.group_starts, plan.group_stops)        # (G,) groups, (G,) entries
    pooled = column_reduce(torch.stack([received, from_cls], 1), slot, plan.spans.masks(plan.group_span[rows], T),
                           "sum" if piece_pooling == "sum" else "max")               # (G, 2, L, H)
    kinds = segment_max(pooled, slot * n_kinds + plan.group_kind[rows], B * n_kinds)   # (B*K, 2, L, H)
    kinds = kinds.view(B, n_kinds, 2, L, H).transpose(1, 2).reshape(B, 2 * n_kinds, L, H)  # (B, 2K, L, H)
    rows, slot = positions_of(positions, plan.pair_starts, plan.pair_stops)          # (P,) pairs, (P,) entries
    best = block_max(maps, slot, plan.spans.masks(plan.pair_src[rows], T),
                     plan.spans.masks(plan.pair_tgt[rows], T))                       # (P, L, H)
    pairs = segment_max(best, slot * n_relations + plan.pair_rel[rows], B * n_relations)  # (B*R, L, H)
    return torch.cat([kinds, pairs.view(B, n_relations, L, H)], 1)                   # (B, 2K + R, L, H)


def _plan(items: list[LabelledExample], tok, rules: KindRules) -> _ExamplePlan:
    """The examples' plan, built with the garbage collector paused (its many small objects: no collection scanning
    the whole process meanwhile)."""
    with gc_paused():
        return _ExamplePlan(items, tok, rules)


def _run_one(ctx, items: list[LabelledExample], model, tok, rules: KindRules, max_tokens: int, desc: str,
             plan: _ExamplePlan | None = None) -> tuple[FeatureAccumulator, FeatureAccumulator]:
    """Accumulators of one model over ``items``: kinds (received + [CLS] row) and relations; ``plan``: the items'
    plan (:func:`_plan`) when it was built already (None: built here).

    The groups and pairs of every example are planned on the host first; each batch of maps
    (:meth:`probes.maps.MapEngine.iter_piece_map_batches`) is scored at once on its device (:func:`batch_scores`),
    and the (B, 2K + R, L, H) scores are copied to the host once, at the end, in the order the examples came."""
    if rules.piece_pooling not in ("sum", "max"):
        raise ValueError(f"piece_pooling must be sum or max, got {rules.piece_pooling!r}")
    acc = FeatureAccumulator(rules.names, rules.missing)
    racc = FeatureAccumulator(list(rules.relations), rules.relation_missing)
    engine = MapEngine(model, Attention(), tokenizer=tok, device=ctx.device, max_tokens=max_tokens,
                       max_batch_size=64, max_pairs=None)
    plan = _plan(items, tok, rules) if plan is None else plan
    K, R = len(rules.names), len(rules.relations)
    order, scores = [], []
    for positions, lengths, maps in engine.iter_piece_map_batches([it.encoded for it in items], desc=desc):
        order += positions
        scores.append(batch_scores(maps, lengths, positions, plan, K, R, rules.piece_pooling))  # (B, 2K + R, L, H)
    if not order:
        return acc, racc
    every = torch.cat(scores).cpu().numpy()  # (N, 2K + R, L, H), in the order the examples came
    order = np.asarray(order)  # (N,)
    acc.add_batch(every[:, :K], plan.has_kind[order], every[:, K:2 * K], order)
    racc.add_batch(every[:, 2 * K:], plan.has_pair[order], None, order)
    return acc, racc


def _changes(source: str, pre: ModelScores, ft: ModelScores, rules: KindRules, n_boot: int, seed: int
             ) -> list[dict]:
    """linguistic_change rows of one source: per kind and relation, the fine-tuned minus pre-trained mean
    (all heads, last layer) with its paired bootstrap interval over the examples both models counted."""
    rows = []
    for kind_names, which in ((rules.names, 0), (list(rules.relations), 1)):
        for f in kind_names:
            a_acc, b_acc = (pre.relations, ft.relations) if which else (pre.kinds, ft.kinds)
            pe_a, pe_b = a_acc.per_example(f), b_acc.per_example(f)  # ((N, L, H), (N,)) each
            if pe_a is None or pe_b is None:
                continue
            if not np.array_equal(pe_a[1], pe_b[1]):
                raise RuntimeError(f"{source} {f}: the two models counted different examples")
            for stat, sl in (("all_heads", slice(None)), ("last_layer", slice(-1, None))):
                a, b = pe_a[0][:, sl].mean((1, 2)), pe_b[0][:, sl].mean((1, 2))  # (N,)
                lo, hi = paired_bootstrap(a, b, n_boot, seed)
                rows.append(dict(source=source, kind=f, type="relation" if which else "feature", statistic=stat,
                                 pretrained=float(a.mean()), finetuned=float(b.mean()),
                                 diff=float(b.mean() - a.mean()), lo=lo, hi=hi, change=bool(lo > 0 or hi < 0),
                                 n_examples=len(a)))
    return rows


def compute(ctx, selection: ExampleSelection, rules: KindRules, *, checkpoint=None, n_boot: int = 1000,
            seed: int = 0, max_tokens: int = 4096) -> LinguisticResult:
    """Scores of every source and model (no files written).

    Args:
        ctx: The analysis context (encoder, data, device).
        selection: Which examples of which source.
        rules: The kinds and relations scored, and how.
        checkpoint: Optional fine-tuned GLUE model (path, or {task: path} picked by task).
        n_boot: Paired bootstrap replicates of the pre-trained vs fine-tuned change.
        seed: Seed of the bootstrap.
        max_tokens: Pieces per forward batch.

    Returns:
        The accumulators of every (source, model) and the change rows.
    """
    if selection.source == "treebank":
        sources = [(f"treebank:{selection.treebank_name}", None)]
        sentences = ctx.sentences(selection.split, selection.max_examples)
    else:
        nlp = load_spacy(selection.spacy_model)
        sources = [(f"glue:{task_spec(t).name}", task_spec(t).name) for t in selection.tasks]
    runs, changes = [], []
    for label, tname in sources:
        # treebank: one path, or the entry of the first task in a {task: path} mapping
        tuned = checkpoint_for(checkpoint, tname or selection.tasks[0])
        if tname:
            examples = read_glue(tname, selection.split, ctx.data_dir)
        models = variants(ctx, tuned, tname)  # the fine-tuned model has the encoder's vocabulary (checked)
        tok = ctx.encoder.tokenizer
        if tname is None:
            items = treebank_items(tok, sentences)
            limit = selection.max_length or usable_max_length(ctx.encoder.model.config)
            skipped = sum(1 for it in items if not (selection.min_length <= it.n <= limit))
            items = [it for it in items if selection.min_length <= it.n <= limit]
        else:
            items, skipped = glue_items(tok, examples, nlp, selection.min_length, selection.max_length,
                                        selection.max_examples)
        by_model = {}
        plan = _plan(items, tok, rules)  # one for every model: they share the encoder's vocabulary
        for variant, (model, tok) in models.items():
            acc, racc = _run_one(ctx, items, model, tok, rules, max_tokens, f"linguistic {label} {variant}", plan)
            for f in rules.names:
                if acc.mean(f) is None:
                    log.warning("linguistic_attention %s: no example has a token of kind %s", label, f)
            by_model[variant] = ModelScores(label, variant, acc, racc, skipped,
                                            tuned if variant == FINETUNED else None)
            log.info("linguistic_attention %s %s: %d examples", label, variant, acc.n_examples)
        runs += by_model.values()
        if FINETUNED in by_model:
            changes += _changes(label, by_model[PRETRAINED], by_model[FINETUNED], rules, n_boot, seed)
    return LinguisticResult(selection, rules, [label for label, _ in sources], runs, changes)
