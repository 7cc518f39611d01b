"""``analysis=coref_heads``: which heads find coreferent antecedents (Clark et al. §4.2, Table 2).

Antecedent selection accuracy: for every coreferent mention with an antecedent in the same segment,
does the mention's **head word** attend most (ignoring itself, [CLS] and [SEP], as in ``dep_heads``)
to the head word of one of its antecedents? Word level, from an attention cache of document
segments (attention TO a split word summed over its pieces, FROM it averaged; ``conf/extract``).

Data (``source``): ``gum`` (default; UD GUM CoNLL-U MISC ``Entity=``, GUM scheme), ``ontogum``
(OntoGUM = GUM converted to the OntoNotes/CoNLL-2012 scheme, aligned to UD GUM for sentences and
trees) or ``litbank`` (LitBank CoNLL-2012, no trees: heuristic head words, no official split, so
the first ``max_documents`` files in file-name order; ``null`` = all 100). See
:mod:`probes.data.coref` for formats, head words and mention types. Clusters with a single mention
(singletons, annotated in GUM only) are dropped before anything else, so mentions and baseline
candidates are the CoNLL-2012-style coreferent mentions.

Segments: BERT reads at most ``encoder.max_length`` wordpieces (512 for BERT/MiniLM). Each document
is cut into segments of **consecutive whole sentences packed greedily**: a sentence is added to the
current segment while ``[CLS] + pieces + [SEP]`` stays within ``max_length``, else it starts a new
segment; a sentence is never split (a single sentence longer than the limit is left out and
counted). A mention is evaluated when it lies inside one segment and at least one earlier mention of
its cluster (antecedent, ordered by (start, end)) with a different head word lies in the same segment.

Baselines (same mentions; candidates = the earlier coreferent mentions of the segment with a head
word other than the mention's own; each predicts a candidate's head word, right when that word is the
head of one of the mention's antecedents):

* ``nearest``: the closest preceding mention (largest (start, end));
* ``head_match``: the closest preceding mention whose head word equals the mention's (lowercased),
  else ``nearest``;
* ``rule_based`` (after Lee et al. 2011, as in Clark): (1) closest mention with the same string
  (lowercased), (2) closest with the same head word, (3) for pronouns only: closest mention agreeing
  in person, number and gender/animacy where both are known (pronoun lexicon, UD ``Number`` of the
  head, GUM entity type: ``person`` is animate, other types except ``animal`` inanimate), (4) nearest.

Decoders (causal LMs): nothing changes. The only direction scored is the mention's row, and every
antecedent precedes its mention, so each pair is in the part of the map a causal row sees (unlike
``dep_heads``, where half the pairs point forward; see its module doc).

Cache: by default (``mention_rows_only``) the entry keeps only the rows scored, each segment's mention heads' rows of
its maps (:func:`mention_rows`, :mod:`probes.extract.rows`), keyed by them; the maps are computed whole and the rows
are those of the whole-map entry, bit for bit, so the results are the same.

Map kinds: ``extract.maps=<kind>`` scores that kind's maps (cached under their own key; per-layer kinds
have head 0 only); a kind with a length bound (flow) makes segments no longer than it.

Outputs: ``coref_heads.csv`` (layer, head, mention_type, accuracy, count; 0-based),
``coref_table.csv`` (Table 2: one row per method - the best head overall and its 1-based name, the
best head of each mention type, the three baselines - columns all/pronoun/proper/nominal and the
counts), ``coref_mentions.csv`` (one row per evaluated mention: document, mention type, baseline
hits), ``coref_heads.png``, ``summary.json``.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from probes.analysis import plots
from probes.analysis.cached import word_row_batches
from probes.analysis.clark.metrics import most_attended, most_attended_rows
from probes.analysis.naming import head_name, model_layers
from probes.data.coref import (CorefDocument, Mention, pronoun_features, read_gum_coref, read_litbank,
                               read_ontogum)
from probes.extract import runner
from probes.extract.runner import WordLists
from probes.extract.settings import ExtractSettings
from probes.extract.stage import AttentionMaps
from probes.model.families import special_ids
from probes.model.inputs import encode_words

log = logging.getLogger(__name__)

MENTION_TYPES = ("pronoun", "proper", "nominal")
GROUPS = ("all",) + MENTION_TYPES
SEGMENT_FORMAT = 1  # bump when the segmentation rule changes (part of the cache key)


# ----------------------------------------------------------------------------- segmentation
@dataclass(frozen=True)
class Segment:
    doc: int  # document index
    first_sentence: int  # sentence range [first_sentence, last_sentence)
    last_sentence: int
    word_start: int  # document-level word range [word_start, word_end)
    word_end: int
    n_pieces: int  # wordpieces incl. the special tokens ([CLS] and [SEP])


def sentence_pieces(tokenizer, docs: list[CorefDocument]) -> list[list[int]]:
    """Wordpieces of every sentence without the tokenizer's special tokens, tokenized from its words as the
    cache does."""
    first, last = special_ids(tokenizer)
    flat = [list(s.words) for d in docs for s in d.sentences]
    enc = encode_words(tokenizer, flat) if flat else []
    out, k = [], 0
    for d in docs:
        out.append([enc[k + i].n_pieces - len(first) - len(last) for i in range(len(d.sentences))])
        k += len(d.sentences)
    return out


def segment_length(tokenizer, doc: CorefDocument) -> Callable[[int, int], int]:
    """``length(a, b)``: the pieces, special tokens included, of sentences ``a .. b-1`` of ``doc`` read as one
    running text (as the cache encodes a segment; a byte-level BPE gives a sentence that follows another a
    leading space, so its pieces are not always those it has alone)."""
    def length(a: int, b: int) -> int:
        return encode_words(tokenizer, [[w for s in doc.sentences[a:b] for w in s.words]])[0].n_pieces
    return length


def segment_document(pieces: list[int], max_length: int, doc: int = 0,
                     sentence_words: list[int] | None = None,
                     length: Callable[[int, int], int] | None = None) -> tuple[list[Segment], list[int]]:
    """Greedy packing of whole sentences into segments of <= max_length pieces incl. the special tokens.

    ``pieces[i]``: wordpieces of sentence i without specials; ``sentence_words[i]``: its words
    (defaults to ``pieces``, only used for the word offsets); ``length(a, b)``: pieces of sentences a..b-1 as
    one sequence with its specials (:func:`segment_length`; default: their ``pieces`` summed + 2, [CLS]/[SEP]).
    Returns (segments, too_long sentences).
    """
    words = sentence_words if sentence_words is not None else pieces
    length = length or (lambda a, b: int(sum(pieces[a:b])) + 2)
    offsets = np.concatenate([[0], np.cumsum(words)]).astype(int)
    segs, too_long = [], []
    cur = None
    for i in range(len(pieces)):
        if length(i, i + 1) > max_length:
            too_long.append(i)
            if cur is not None:
                segs.append((cur, i))
            cur = None
            continue
        if cur is not None and length(cur, i + 1) > max_length:
            segs.append((cur, i))
            cur = None
        if cur is None:
            cur = i
    if cur is not None:
        segs.append((cur, len(pieces)))
    return [Segment(doc, a, b, int(offsets[a]), int(offsets[b]), length(a, b)) for a, b in segs], too_long


# ----------------------------------------------------------------------------- mention features
@dataclass
class SegmentMentions:
    """The mentions inside a segment, sorted by (start, end), with what the baselines compare, computed once per
    mention: ``head_word`` its head word and ``text`` its words, lowercased; ``feats`` (person, number, animacy),
    None where unknown (pronoun lexicon; otherwise person 3, UD ``Number`` of the head, GUM entity type:
    ``person`` animate, other types except ``animal`` inanimate). The candidates of mention k are the mentions
    before it whose head word (position) differs from its own (:meth:`latest`)."""

    mentions: list[Mention]
    head_word: list[str]
    text: list[str]
    feats: list[tuple]

    def __post_init__(self):
        self._heads = [m.head for m in self.mentions]
        self._by: dict[str, dict[str, list[int]]] = {}
        for key in ("head_word", "text"):  # value -> the mentions holding it, ascending
            groups: dict[str, list[int]] = {}
            for k, v in enumerate(getattr(self, key)):
                groups.setdefault(v, []).append(k)
            self._by[key] = groups

    @classmethod
    def of(cls, doc: CorefDocument, seg: Segment) -> SegmentMentions:
        sents = doc.sentences[seg.first_sentence:seg.last_sentence]
        words = [w for s in sents for w in s.words]  # the segment's words (local index = document index - start)
        number = [n for s in sents for n in (s.number or (None,) * len(s.words))]
        o = seg.word_start
        inside = sorted((m for m in doc.mentions if seg.word_start <= m.start and m.end < seg.word_end),
                        key=lambda m: (m.start, m.end))
        feats = []
        for m in inside:
            if m.mtype == "pronoun":
                person, num, gender = pronoun_features(words[m.head - o])
                anim = None if gender is None else gender in ("m", "f")
            else:
                person, num = 3, {"Sing": "sg", "Plur": "pl"}.get(number[m.head - o] or "")
                anim = None if m.etype in (None, "animal") else m.etype == "person"
            feats.append((person, num, anim))
        return cls(inside, [words[m.head - o].lower() for m in inside],
                   [" ".join(words[m.start - o:m.end + 1 - o]).lower() for m in inside], feats)

    def latest(self, k: int, among: Iterable[int] | None = None) -> int | None:
        """The closest candidate of mention k (None: none): among ``among`` (indices before k, closest first), else
        among all mentions before k."""
        h = self._heads[k]
        for c in (range(k - 1, -1, -1) if among is None else among):
            if self._heads[c] != h:
                return c
        return None

    def same(self, key: str, k: int) -> Iterator[int]:
        """The mentions before k with the same ``key`` (``head_word`` or ``text``) as k, closest first."""
        group = self._by[key][getattr(self, key)[k]]
        return (group[j] for j in range(bisect.bisect_left(group, k) - 1, -1, -1))


def _agree(a: tuple, b: tuple) -> bool:
    return all(x is None or y is None or x == y for x, y in zip(a, b))


# ----------------------------------------------------------------------------- baselines
# Each chooses a candidate of mention k of a segment's :class:`SegmentMentions` (one exists).
def nearest(k: int, ms: SegmentMentions) -> int:
    """The closest preceding candidate."""
    return ms.latest(k)


def head_match(k: int, ms: SegmentMentions) -> int:
    """The closest candidate with the same head word (lowercased), else :func:`nearest`."""
    c = ms.latest(k, ms.same("head_word", k))
    return nearest(k, ms) if c is None else c


def rule_based(k: int, ms: SegmentMentions) -> int:
    """The closest candidate with the same text, else the same head word (lowercased), else (pronouns only) agreeing
    in person, number and animacy where both are known, else :func:`nearest`."""
    for key in ("text", "head_word"):
        c = ms.latest(k, ms.same(key, k))
        if c is not None:
            return c
    if ms.mentions[k].mtype == "pronoun":
        c = ms.latest(k, (c for c in range(k - 1, -1, -1) if _agree(ms.feats[k], ms.feats[c])))
        if c is not None:
            return c
    return nearest(k, ms)


BASELINE_RULES = dict(nearest=nearest, head_match=head_match, rule_based=rule_based)
BASELINES = tuple(BASELINE_RULES)


# ----------------------------------------------------------------------------- evaluation
@dataclass
class EvaluatedMention:
    """One evaluated mention of one segment (segment-local word indices, 0 = first word)."""

    doc_id: str
    segment: int
    head: int
    mtype: str
    antecedent_heads: frozenset[int]
    predictions: dict[str, int]  # baseline -> predicted local word


def segment_items(doc: CorefDocument, seg: Segment, seg_index: int) -> list[EvaluatedMention]:
    """The mentions of ``seg`` that have an antecedent (different head) in it, with baseline predictions."""
    ms = SegmentMentions.of(doc, seg)
    inside, o = ms.mentions, seg.word_start
    items, cluster_heads = [], {}  # cluster -> the head words of its mentions so far
    for k, m in enumerate(inside):
        seen = cluster_heads.setdefault(m.cluster, [])
        ants = frozenset(h - o for h in seen if h != m.head)
        seen.append(m.head)
        if not ants:
            continue
        items.append(EvaluatedMention(doc.doc_id, seg_index, m.head - o, m.mtype, ants,
                                      {b: inside[rule(k, ms)].head - o for b, rule in BASELINE_RULES.items()}))
    return items


def document_items(docs: list[CorefDocument], segments: list[Segment]) -> list[list[EvaluatedMention]]:
    """:func:`segment_items` of every segment (segment i: its position in ``segments``)."""
    return [segment_items(docs[g.doc], g, i) for i, g in enumerate(segments)]


def mention_rows(items: Sequence[Sequence[EvaluatedMention]]) -> tuple[tuple[int, ...], ...]:
    """Per segment, the rows of its word map that :func:`evaluate` scores: its evaluated mentions' head words
    (position head + 1, [CLS] at 0), increasing, once each (none: a segment without such mentions)."""
    return tuple(tuple(sorted({it.head + 1 for it in its})) for its in items)


def head_predictions(attn: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Most-attended word (local index) of each mention head for every (layer, head).

    attn: (L, H, W, W) word-level map with [CLS] first and [SEP] last; heads: (M,) local word
    indices. Attention to the word itself, [CLS] and [SEP] is ignored (:func:`~probes.analysis.clark.metrics.
    most_attended`). Returns (L, H, M).
    """
    a = torch.as_tensor(np.asarray(attn, dtype=np.float32))[None]  # (1, L, H, W, W)
    pred = most_attended(a, torch.tensor([a.shape[-1] - 2]))[0] - 1  # (L, H, n) 0-based
    return pred[..., torch.as_tensor(np.asarray(heads, dtype=np.int64))].numpy()


class MentionLabels:
    """The evaluated mentions of many segments as flat tensors, prepared once (:class:`CorefAccumulator` reads
    a batch of segments by index, no per-segment Python in its loop): per mention (flat, in segment order)
    ``segment`` its segment (position in the list given), ``head`` its head word (local, 0-based), ``group`` its
    row in :data:`GROUPS` (its mention type); per (mention, antecedent head) pair ``pair_mention``, ``pair_word``."""

    def __init__(self, items: Sequence[Sequence[EvaluatedMention]]):
        seg, head, group, pm, pw = [], [], [], [], []
        for s, its in enumerate(items):
            for it in its:
                pm += [len(head)] * len(it.antecedent_heads)
                pw += sorted(it.antecedent_heads)
                seg.append(s)
                head.append(it.head)
                group.append(GROUPS.index(it.mtype))
        self.segment, self.head, self.group = (torch.tensor(x, dtype=torch.long) for x in (seg, head, group))  # (M,)
        self.pair_mention, self.pair_word = (torch.tensor(x, dtype=torch.long) for x in (pm, pw))  # (A,)
        self.n_segments = len(items)

    def to(self, device: torch.device | str) -> MentionLabels:
        """The tensors moved to ``device`` (in place); returns self."""
        for k in ("segment", "head", "group", "pair_mention", "pair_word"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def batch(self, index: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, head, group, antecedent) of the mentions of the segments ``index`` (B,), in the order of ``index``
        (each segment's mentions in their own order): b (M',) the position of each one's segment in ``index``, head,
        group (M',), antecedent (M', N + 1) bool: column w + 1 is True when local word w heads one of the mention's
        antecedents (column 0: ROOT, never)."""
        where = torch.full((self.n_segments,), -1, dtype=torch.long, device=index.device)
        where[index] = torch.arange(len(index), device=index.device)  # (S,) position in the batch, -1: not in it
        b = where[self.segment]  # (M,)
        mine = (b >= 0).nonzero()[:, 0]  # (M',) the batch's mentions, in segment order
        mine = mine[torch.sort(b[mine], stable=True).indices]  # (M',) in the order of index
        local = torch.full_like(self.segment, -1)
        local[mine] = torch.arange(len(mine), device=index.device)  # (M,) row among them
        pairs = local[self.pair_mention]  # (A,)
        ante = torch.zeros(len(mine), N + 1, dtype=torch.bool, device=index.device)  # (M', N + 1)
        ante[pairs[pairs >= 0], self.pair_word[pairs >= 0] + 1] = True
        return b[mine], self.head[mine], self.group[mine], ante


class CorefAccumulator:
    """Correct counts per (mention type, layer, head) and per baseline: the baselines and the per-mention rows
    from the mentions alone (:meth:`add_mentions`), the heads from the mention heads' rows of the segments' word maps
    a batch at a time (:meth:`add_batch`, sums kept on the maps' device); :meth:`add`: one segment, both."""

    def __init__(self, num_layers: int, num_heads: int):
        self.L, self.H = num_layers, num_heads
        self.base = {g: dict.fromkeys(BASELINES, 0) for g in GROUPS}
        self.count = dict.fromkeys(GROUPS, 0)
        self.rows: list[dict] = []
        self._correct: torch.Tensor | None = None  # (G, L, H) long, G = len(GROUPS), on the maps' device

    def add(self, attn: np.ndarray | None, items: list[EvaluatedMention]) -> None:
        """One segment: its (L, H, W, W) word maps (None: baselines only) and its evaluated mentions."""
        if not items:
            return
        self.add_mentions(items)
        if attn is not None:
            a = torch.as_tensor(np.asarray(attn, dtype=np.float32))  # (L, H, W, W)
            rows = a[:, :, [it.head + 1 for it in items]].permute(2, 0, 1, 3)  # (M, L, H, W) the mention heads' rows
            self.add_batch(rows, torch.tensor([a.shape[-1] - 2]), MentionLabels([items]),
                           torch.zeros(1, dtype=torch.long))

    def add_mentions(self, items: list[EvaluatedMention]) -> None:
        """The counts, baseline hits and rows of ``items`` (no maps)."""
        for it in items:
            hit = {b: it.predictions[b] in it.antecedent_heads for b in BASELINES}
            for g in ("all", it.mtype):
                self.count[g] += 1
                for b in BASELINES:
                    self.base[g][b] += hit[b]
            self.rows.append(dict(doc_id=it.doc_id, segment=it.segment, head_word=it.head, mention_type=it.mtype,
                                  n_antecedents=len(it.antecedent_heads), **hit))

    def add_batch(self, rows: torch.Tensor, n_words: torch.Tensor, labels: MentionLabels, index: torch.Tensor
                  ) -> None:
        """rows: (M', L, H, W) the mention heads' rows (row head + 1) of the word maps of the segments ``index``
        (B,) of ``labels``, in the order of :meth:`MentionLabels.batch` (segment b's n_words[b] words at columns
        1..n_b, padded to W; :func:`~probes.analysis.cached.word_row_batches`); counts every mention whose head
        word's most-attended other word heads one of its antecedents."""
        b, head, group, ante = labels.batch(index, rows.shape[-1] - 2)  # (M',) x 3, (M', N + 1)
        if len(b) != len(rows):
            raise ValueError(f"{len(rows)} rows for the {len(b)} mentions of the batch's segments")
        mention = most_attended_rows(rows, n_words.to(rows.device)[b], head)  # (M', L, H) 1-based
        hit = ante.gather(1, mention.reshape(len(b), -1)).view(len(b), self.L, self.H).long()  # (M', L, H)
        add = torch.zeros(len(GROUPS), self.L, self.H, dtype=torch.long, device=rows.device)  # (G, L, H)
        add.index_add_(0, group, hit)
        add[0] = hit.sum(0)  # all
        self._correct = add if self._correct is None else self._correct + add

    @property
    def correct(self) -> dict[str, np.ndarray]:
        """group -> (L, H) correct predictions of every head."""
        c = (self._correct.cpu().numpy() if self._correct is not None
             else np.zeros((len(GROUPS), self.L, self.H), dtype=np.int64))
        return dict(zip(GROUPS, c))

    def head_accuracy(self, group: str) -> np.ndarray:
        return self.correct[group] / max(1, self.count[group])

    def baseline_accuracy(self, group: str, baseline: str) -> float:
        return self.base[group][baseline] / max(1, self.count[group])


def tables(acc: CorefAccumulator, layers=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(coref_heads, coref_table); ``layers``: the model's layer of each of the accumulator's (a cache's
    ``layers``; None: 0..L-1)."""
    layer_of = model_layers(layers, acc.L)
    rows = []
    for g in GROUPS:
        a = acc.head_accuracy(g)
        for l in range(acc.L):
            for h in range(acc.H):
                rows.append((layer_of[l], h, g, float(a[l, h]), acc.count[g]))
    heads = pd.DataFrame(rows, columns=["layer", "head", "mention_type", "accuracy", "count"])
    trows = []

    def row(method, l, h):
        r = dict(method=method, layer=None if l is None else layer_of[l], head=h,
                 name=None if l is None else head_name(layer_of[l], h))
        for g in GROUPS:
            r[g] = float(acc.head_accuracy(g)[l, h]) if l is not None else acc.baseline_accuracy(g, method)
        return r

    l, h = np.unravel_index(int(np.argmax(acc.head_accuracy("all"))), (acc.L, acc.H))
    trows.append(row("best_head", int(l), int(h)))
    for g in MENTION_TYPES:
        l, h = np.unravel_index(int(np.argmax(acc.head_accuracy(g))), (acc.L, acc.H))
        trows.append(row(f"best_head_{g}", int(l), int(h)))
    for b in BASELINES:
        trows.append(row(b, None, None))
    table = pd.DataFrame(trows)
    for g in GROUPS:
        table[f"n_{g}"] = acc.count[g]
    for c in ("layer", "head"):  # ints, None for the baselines (object column: CSV "" and wandb-friendly)
        table[c] = pd.Series([None if v is None or pd.isna(v) else int(v) for v in table[c]], dtype=object)
    return heads, table


def figure(acc: CorefAccumulator, table: pd.DataFrame):
    """Accuracy of every head (left) and Table 2's methods per mention type (right)."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, max(3.2, 0.4 * acc.L + 1.5)),
                                   gridspec_kw=dict(width_ratios=[1.1, 1]))
    a = 100 * acc.head_accuracy("all")
    plots.layer_head_axes(ax0, a, vmin=0, title=f"antecedent selection accuracy (%), all ({acc.count['all']} mentions)")
    methods = table[table.method.isin(["best_head", *BASELINES])].reset_index(drop=True)
    x = np.arange(len(GROUPS))
    w = 0.8 / len(methods)
    for i, r in methods.iterrows():
        label = f"head {r['name']}" if r.method == "best_head" else r.method
        ax1.bar(x + (i - (len(methods) - 1) / 2) * w, [100 * r[g] for g in GROUPS], w, label=label)
    ax1.set_xticks(x, [f"{g}\n({acc.count[g]})" for g in GROUPS], fontsize=8)
    ax1.set_ylabel("accuracy (%)")
    ax1.set_ylim(0, 100)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- data
def _sha(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def load_documents(ctx, gum, source: str, split: str, max_documents: int | None,
                   ontogum_dir: str = "gum_coref_ontogum", litbank_dir: str = "litbank_coref/conll"):
    """(documents with singletons removed, dataset name, data digest, files); ``gum``: the UD GUM Treebank."""
    data_dir = ctx.data_dir
    if source == "gum":
        tb = gum
        path = tb.ensure(split)
        docs, files, name = read_gum_coref(path), [path], "gum"
    elif source == "ontogum":
        tb = gum
        conll = data_dir / ontogum_dir / f"ontogum_{split}.conll"
        ud = tb.ensure(split)
        docs, files, name = read_ontogum(conll, ud), [conll, ud], "ontogum"
    elif source == "litbank":
        folder = data_dir / litbank_dir
        files = sorted(folder.glob("*.conll"))[:max_documents]
        docs, name = read_litbank(folder, max_documents), "litbank"
        split = "all" if max_documents is None else f"first{max_documents}"
    else:
        raise ValueError(f"analysis.source must be gum, ontogum or litbank, got {source!r}")
    if source != "litbank":
        docs = docs[:max_documents]
    return [d.without_singletons() for d in docs], name, split, _sha(files)


def coref_source(docs, segments, dataset: str, split: str, digest: str, max_documents: int | None) -> WordLists:
    """The segments' word lists, named in the cache key by the documents' data (dataset, split, digest,
    ``max_documents``) and the segmentation rule."""
    words = [[w for s in docs[g.doc].sentences[g.first_sentence:g.last_sentence] for w in s.words] for g in segments]
    return WordLists(words, dict(dataset=f"{dataset}-coref-segments", split=split, data_sha256=digest,
                                 max_documents=max_documents,
                                 segmentation=f"greedy-whole-sentences-v{SEGMENT_FORMAT}"))


def coref_cache(ctx, docs, segments, dataset: str, split: str, digest: str, max_length: int,
                max_documents: int | None, rows: Sequence[Sequence[int]] | None = None):
    """Word-level maps (``extract.maps``) of every segment, or only the rows ``rows`` of each (per segment;
    :func:`mention_rows`: an entry of chosen rows, :mod:`probes.extract.rows`): an attention-cache entry built by
    :func:`probes.extract.runner.build` (segments are made to fit ``max_length``: ``long_sentences=error``)."""
    settings = ExtractSettings.from_config(ctx.extract_cfg).replace(max_length=max_length, long_sentences="error")
    source = coref_source(docs, segments, dataset, split, digest, max_documents)
    return runner.build(ctx.encoder, AttentionMaps(rows), source, settings, ctx.cache_dir)


def document_segments(tokenizer, docs: list[CorefDocument], max_length: int) -> tuple[list[Segment], int]:
    """Every document's segments (:func:`segment_document`: whole sentences within ``max_length`` pieces, specials
    included), in document order, and the number of sentences longer than that (in no segment)."""
    pieces = sentence_pieces(tokenizer, docs)
    segments, n_long = [], 0
    for i, d in enumerate(docs):
        segs, long = segment_document(pieces[i], max_length, i, [len(s.words) for s in d.sentences],
                                      segment_length(tokenizer, d))
        segments += segs
        n_long += len(long)
    return segments, n_long


def evaluate(cache, docs: list[CorefDocument], segments: list[Segment], device: str | torch.device = "cpu",
             progress: bool = True, items: list[list[EvaluatedMention]] | None = None) -> CorefAccumulator:
    """Every head and baseline on the segments' evaluated mentions (``items``, None: :func:`document_items`): the
    heads from the cache's word maps of the segments (entry i: segment i; whole maps, or an entry of their
    :func:`mention_rows`), the mention heads' rows only, a batch of segments at a time on ``device``
    (:func:`~probes.analysis.cached.word_row_batches`, :meth:`CorefAccumulator.add_batch`); a KeyError when a
    segment with mentions is not in the cache."""
    acc = CorefAccumulator(cache.num_layers, cache.num_heads)
    items = document_items(docs, segments) if items is None else items
    for its in items:
        acc.add_mentions(its)
    labels = MentionLabels(items).to(device)
    scored = [i for i, its in enumerate(items) if its]  # segments with a mention to evaluate
    missing = [i for i in scored if i not in cache]
    if missing:
        raise KeyError(f"cache {getattr(cache, 'path', '')}: {len(missing)} segment(s) with mentions to evaluate "
                       f"are not in it (first: {missing[0]}); rebuild it (delete the folder)")
    for batch, rows, n in word_row_batches(cache, scored, [segments[i].word_end - segments[i].word_start
                                                           for i in scored],
                                           [[it.head + 1 for it in items[i]] for i in scored], device,
                                           desc="coref_heads", progress=progress):  # only the mention heads' rows
        acc.add_batch(rows, n, labels, torch.as_tensor(batch, device=rows.device))  # rows: (M', L, H, W)
    return acc


# ----------------------------------------------------------------------------- entry point
def coref_heads(ctx, *, gum, source: str = "gum", split: str = "dev", max_documents: int | None = None,
                max_length: int | None = None, mention_rows_only: bool = True, ontogum_dir: str = "gum_coref_ontogum",
                litbank_dir: str = "litbank_coref/conll") -> pd.DataFrame:
    """Evaluate every head on antecedent selection; save the tables and the figure; return coref_table.

    ``gum``: the UD GUM treebank (``conf/treebank/gum.yaml``; sentences for ``source=gum|ontogum``).
    ``mention_rows_only``: the cache keeps only the rows scored (:func:`mention_rows`; False: whole maps); the
    results are the same."""
    t0 = time.time()
    docs, dataset, split, digest = load_documents(ctx, gum, source, split, max_documents, ontogum_dir, litbank_dir)
    enc = ctx.encoder
    kind, measure = ctx.measure()
    max_length = int(max_length or enc.max_length)
    if measure.max_pieces:  # e.g. flow: segments no longer than the measure accepts
        max_length = min(max_length, measure.max_pieces)
    segments, n_long = document_segments(enc.tokenizer, docs, max_length)
    if n_long:
        log.warning("%d sentences exceed %d wordpieces and are left out of every segment", n_long, max_length)
    log.info("%s/%s: %d documents, %d coreferent mentions, %d segments (<= %d wordpieces)", dataset, split,
             len(docs), sum(len(d.mentions) for d in docs), len(segments), max_length)
    items = document_items(docs, segments)
    cache = coref_cache(ctx, docs, segments, dataset, split, digest, max_length, max_documents,
                        mention_rows(items) if mention_rows_only else None)
    acc = evaluate(cache, docs, segments, ctx.device, items=items)
    heads, table = tables(acc, cache.layers)
    ctx.save_table(heads, "coref_heads")
    ctx.save_table(table, "coref_table")
    ctx.save_table(pd.DataFrame(acc.rows), "coref_mentions")
    ctx.save_figure(figure(acc, table), "coref_heads")
    n_coref = sum(len(d.mentions) for d in docs)
    ctx.log_summary(dict(
        analysis="coref_heads", source=source, dataset=dataset, split=split, encoder=enc.name, maps=kind,
        n_documents=len(docs), n_segments=len(segments), max_length=max_length, n_long_sentences=n_long,
        n_coreferent_mentions=n_coref, counts=dict(acc.count), cache=str(cache.path),
        mention_rows_only=mention_rows_only, cache_bytes=cache.manifest["bytes"],
        seconds=round(time.time() - t0, 1),
        table={r.method: dict(name=r["name"], **{g: round(float(r[g]), 4) for g in GROUPS})
               for _, r in table.iterrows()}))
    log.info("coref_heads: %d mentions, best head %s (%.3f) in %.1fs", acc.count["all"], table.loc[0, "name"],
             table.loc[0, "all"], time.time() - t0)
    return table
