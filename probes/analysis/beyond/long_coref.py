"""``analysis=long_coref``: Clark et al.'s coreference heads (§4.2) on whole documents read as one sequence.

Does the head that best selects antecedents still find them when they are hundreds of pieces back? The
``coref_heads`` analysis reads documents in segments of whole sentences packed up to the encoder's length (512
pieces for BERT); a long-context decoder (SmolLM2-135M: 8,192 pieces) reads a whole LitBank excerpt (about 2,000
words) at once. Here every document is one :class:`~probes.analysis.clark.coref_heads.Segment`, and accuracy is
reported by the distance from each mention to its nearest antecedent.

Inputs: the documents of ``source`` (:func:`probes.analysis.clark.coref_heads.load_documents`: ``litbank`` by
default, the first ``max_documents`` files by name; ``gum`` / ``ontogum`` the ``split``), singletons dropped. The
evaluated mentions, their antecedent head words and the nearest / head_match / rule_based baselines are those of
:func:`~probes.analysis.clark.coref_heads.segment_items` on the whole document: a mention with at least one earlier
mention of its cluster whose head word differs. A document is encoded as the model layer encodes words
(:func:`probes.model.inputs.encode_words`: one running text, words joined by single spaces); one longer than the
model's usable length (:func:`probes.model.families.usable_max_length`) or without an evaluated mention is skipped,
with the reason in summary.json.

Maps: no (T, T) map and no full word map. The attention of the chosen layers (``layers``) is reduced as it is
computed (:class:`probes.maps.MapEngine` ``iter_reduced``; whole maps within ``extract.attention_budget_mb``,
blocks of query rows beyond it) by a :class:`~probes.maps.reducers.Pool` whose rows are the evaluated mentions'
head words only (each row the mean over the word's pieces, ``extract.from_words``; every other piece left out) and
whose columns are the words (:func:`~probes.maps.reducers.word_units`: the first special token, the words, the
last special; each the sum over its pieces, ``extract.to_words``): (L', H, M, n + 2) per document, M the distinct
head words. Every document's reduced maps are checked to fit the memory before the first forward
(:meth:`probes.maps.MapEngine.check_fits`). A head predicts the word its row attends to most among the document's
words, the mention's own word excluded (as :func:`~probes.analysis.clark.coref_heads.head_predictions`: the
specials excluded, the first word on ties); it is right when that word heads one of the mention's antecedents.

Distances: from the mention's head word to its nearest antecedent head word (the closest one; on a tie the earlier),
in words and in pieces (between the two words' first pieces); buckets of doubling width (1, 2-3, 4-7, ...;
:func:`distance_bucket`). For each length S of ``segment_lengths``, ``within_S``: whether the mention's head word
and one of its antecedent head words lie in one segment of ``coref_heads``' greedy packing of whole sentences into
S pieces of this model (:func:`~probes.analysis.clark.coref_heads.segment_document`), i.e. whether the segment
setting of the original could have scored the mention at all; summary.json also counts the mentions that
``coref_heads`` itself evaluates at S.

A causal decoder's row sees only the pieces up to its own: a mention whose every antecedent head word follows its
head word (a nested or cataphoric antecedent) cannot be found by any head; they are counted
(``antecedent_before`` False) and kept, as ``coref_heads`` keeps them.

Outputs: ``long_coref.csv`` (unit, bucket, lo, hi, layer, head, accuracy, count; 0-based layer/head; bucket
``all``: every mention), ``long_coref_by_distance.csv`` (unit, bucket, lo, hi, count, ``best_head`` the accuracy of
the head best on all mentions, ``nearest``, ``head_match``, ``rule_based``, ``bucket_best`` / ``bucket_best_name``
the best head of that bucket alone, ``within_S`` the mentions inside an S-piece segment), ``long_coref_mentions.csv``
(one row per evaluated mention), ``long_coref.png`` (accuracy against distance, log axis, with the bucket counts;
the share of mentions within each segment length) and ``summary.json`` (documents run and skipped with the
reasons, per-document pieces, mentions, seconds and the reduced maps' bytes, the best head, accuracy per mention
type, the peak resident memory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from probes.analysis.beyond.long_context import peak_rss_gib
from probes.analysis.clark.coref_heads import (BASELINES, GROUPS, MENTION_TYPES, EvaluatedMention, Segment,
                                               load_documents, segment_document, segment_items, segment_length,
                                               sentence_pieces)
from probes.analysis.clark.metrics import is_causal
from probes.analysis.naming import head_name
from probes.data.coref import CorefDocument
from probes.maps import MapEngine
from probes.maps.reducers import Pool, given_units, word_units
from probes.model.families import usable_max_length
from probes.model.inputs import Encoded, encode_words

log = logging.getLogger(__name__)

UNITS = ("words", "pieces")  # the distances the tables are bucketed by
ALL = GROUPS[0]  # "all": the bucket (and mention group) of every mention


def distance_bucket(d: int) -> int:
    """The doubling bucket of a distance ``d >= 1``: k with 2^k <= d < 2^(k+1) (1 -> 0, 2-3 -> 1, 4-7 -> 2, ...)."""
    if int(d) < 1:
        raise ValueError(f"distance {d}: expected >= 1 (an antecedent has another head word)")
    return int(d).bit_length() - 1


def bucket_bounds(k: int) -> tuple[int, int]:
    """(lowest, highest) distance of bucket ``k``: (2^k, 2^(k+1) - 1)."""
    return 2 ** k, 2 ** (k + 1) - 1


def bucket_label(k: int) -> str:
    """``"1"``, ``"2-3"``, ``"4-7"``, ...: the distances of bucket ``k``."""
    lo, hi = bucket_bounds(k)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def nearest_antecedent(head: int, antecedents: Sequence[int]) -> int:
    """The antecedent head word closest to ``head`` (the earlier one on a tie)."""
    return min(antecedents, key=lambda a: (abs(head - a), a > head))


def first_pieces(item: Encoded) -> list[int]:
    """(n,) the position of every word's first piece."""
    first = [-1] * item.n_words
    for t, w in enumerate(item.word_of_piece):
        if 0 <= w < item.n_words and first[w] < 0:
            first[w] = t
    return first


def head_rows(item: Encoded, heads: Sequence[int]) -> list[int]:
    """(T,) the row unit of every piece: the index in ``heads`` of the word it belongs to, -1 for every other
    piece (the specials, the words that head no evaluated mention)."""
    row_of = {h: r for r, h in enumerate(heads)}
    return [row_of.get(w, -1) for w in item.word_of_piece]


def row_predictions(pooled: np.ndarray, heads: Sequence[int]) -> np.ndarray:
    """Most-attended word of each row, as :func:`~probes.analysis.clark.coref_heads.head_predictions`: pooled (L',
    H, M, n + 2) (columns: first special, words, last special), row r the word ``heads[r]``; the specials and the
    row's own word ignored. Returns (L', H, M) word indices."""
    cols = pooled[..., 1:pooled.shape[-1] - 1].astype(np.float32)  # (L', H, M, n)
    cols[:, :, np.arange(len(heads)), np.asarray(heads, dtype=int)] = -np.inf
    return cols.argmax(-1)


def segment_of_words(tokenizer, doc: CorefDocument, length: int) -> tuple[np.ndarray, int]:
    """((n,) the segment of every word under ``coref_heads``' packing of whole sentences into ``length`` pieces
    (-1: a sentence longer than that, in no segment), the mentions ``coref_heads`` evaluates at that length)."""
    (pieces,) = sentence_pieces(tokenizer, [doc])
    segs, _ = segment_document(pieces, length, 0, [len(s.words) for s in doc.sentences],
                               segment_length(tokenizer, doc))
    of = np.full(len(doc.words), -1, dtype=int)  # (n,)
    for k, g in enumerate(segs):
        of[g.word_start:g.word_end] = k
    return of, sum(len(segment_items(doc, g, k)) for k, g in enumerate(segs))


@dataclass
class Prepared:
    """One document ready for its forward: its encoding, evaluated mentions and their head words (rows)."""

    index: int
    doc: CorefDocument
    encoded: Encoded
    items: list[EvaluatedMention]
    heads: list[int]  # (M,) distinct head words of the items, ascending: the rows of the pooled map
    rows: list[int]  # (T,) the row unit of every piece
    mentions: list[dict]  # one row of long_coref_mentions per item (without the heads' hits)
    segment_evaluated: dict[int, int]  # S -> mentions coref_heads evaluates at S


def prepare(tokenizer, doc: CorefDocument, index: int, encoded: Encoded, items: list[EvaluatedMention],
            segment_lengths: Sequence[int]) -> Prepared:
    """Rows, distances and segment flags of one document's evaluated mentions."""
    heads = sorted({it.head for it in items})
    first = first_pieces(encoded)
    segs = {int(s): segment_of_words(tokenizer, doc, int(s)) for s in segment_lengths}
    words = doc.words
    mentions = []
    for it in items:
        ants = sorted(it.antecedent_heads)
        a = nearest_antecedent(it.head, ants)
        dw, dp = abs(it.head - a), abs(first[it.head] - first[a])
        row = dict(doc_id=it.doc_id, head_word=it.head, word=words[it.head], mention_type=it.mtype,
                   n_antecedents=len(ants), antecedent=a, antecedent_word=words[a], distance_words=dw,
                   distance_pieces=dp, bucket_words=bucket_label(distance_bucket(dw)),
                   bucket_pieces=bucket_label(distance_bucket(dp)), antecedent_before=min(ants) < it.head)
        for s, (of, _) in segs.items():
            row[f"within_{s}"] = bool(of[it.head] >= 0 and any(of[x] == of[it.head] for x in ants))
        row.update({b: it.predictions[b] in it.antecedent_heads for b in BASELINES})
        mentions.append(row)
    return Prepared(index, doc, encoded, items, heads, head_rows(encoded, heads), mentions,
                    {s: n for s, (_, n) in segs.items()})


def mention_pool(engine: MapEngine, rows: Sequence[Sequence[int]]) -> Pool:
    """The reducer of documents whose pieces have the row units ``rows`` (one list per document, in the order the
    engine is given them; :func:`head_rows`): rows pooled ``extract.from_words``, word columns
    (:func:`~probes.maps.reducers.word_units`) ``extract.to_words``."""
    return Pool(rows=given_units(rows), cols=word_units, from_units=engine.from_words, to_units=engine.to_words)


def document_predictions(engine: MapEngine, p: Prepared) -> np.ndarray:
    """(L', H, M) the most-attended word of each of the document's head-word rows (:func:`row_predictions`) for every
    layer of ``engine`` and head, from one forward over the whole document whose attention is reduced as it is
    computed (whole maps or blocks of query rows, ``extract.attention_budget_mb``). Empty or non-finite maps raise."""
    ((_, pooled),) = list(engine.iter_reduced([p.encoded], mention_pool(engine, [p.rows]), desc=p.doc.doc_id,
                                              progress=False))
    pooled = pooled.float().cpu().numpy()  # (L', H, M, n + 2)
    if pooled.size == 0 or not np.isfinite(pooled).all():
        raise RuntimeError(f"long_coref: empty or non-finite pooled attention on document {p.doc.doc_id} "
                           f"({p.encoded.n_pieces} pieces)")
    return row_predictions(pooled, p.heads)


# ----------------------------------------------------------------------------- tables
def accuracy_tables(mentions: pd.DataFrame, hits: np.ndarray, layers: Sequence[int],
                    segment_lengths: Sequence[int]) -> tuple[pd.DataFrame, pd.DataFrame, tuple[int, int]]:
    """(long_coref, long_coref_by_distance, (layer index, head) of the best head on all mentions) of the mentions
    (one row each, :func:`prepare`'s columns) and their heads' hits (N, L', H) bool."""
    N, L, H = hits.shape
    overall = hits.mean(0)  # (L', H)
    bl, bh = np.unravel_index(int(np.argmax(overall)), (L, H))
    per_head, dist_rows = [], []
    for unit in UNITS:
        k_of = np.array([distance_bucket(d) for d in mentions[f"distance_{unit}"]], dtype=int)  # (N,)
        groups = [(ALL, None, None, np.ones(N, dtype=bool))]
        groups += [(bucket_label(k), *bucket_bounds(k), k_of == k) for k in sorted(set(k_of.tolist()))]
        for label, lo, hi, mask in groups:
            n = int(mask.sum())
            acc = hits[mask].mean(0)  # (L', H)
            for i, l in enumerate(layers):
                for h in range(H):
                    per_head.append(dict(unit=unit, bucket=label, lo=lo, hi=hi, layer=int(l), head=h,
                                           accuracy=float(acc[i, h]), count=n))
            ql, qh = np.unravel_index(int(np.argmax(acc)), (L, H))
            row = dict(unit=unit, bucket=label, lo=lo, hi=hi, count=n, best_head=float(acc[bl, bh]))
            row.update({b: float(mentions[b].to_numpy()[mask].mean()) for b in BASELINES})
            row.update(bucket_best=float(acc[ql, qh]), bucket_best_name=head_name(layers[ql], int(qh)))
            row.update({f"within_{s}": int(mentions[f"within_{s}"].to_numpy()[mask].sum()) for s in segment_lengths})
            dist_rows.append(row)
    heads = pd.DataFrame(per_head)
    by_distance = pd.DataFrame(dist_rows)
    for df in (heads, by_distance):
        for c in ("lo", "hi"):  # ints, empty for the bucket of every mention
            df[c] = pd.Series([None if v is None or pd.isna(v) else int(v) for v in df[c]], dtype=object)
    return heads, by_distance, (int(bl), int(bh))


def type_table(mentions: pd.DataFrame, hits: np.ndarray, best: tuple[int, int]) -> dict:
    """Accuracy of the best head and of each baseline per mention group (all, pronoun, proper, nominal) and the
    counts."""
    types = mentions.mention_type.to_numpy()
    masks = {ALL: np.ones(len(types), dtype=bool), **{t: types == t for t in MENTION_TYPES}}  # (N,) each
    out = {"best_head": {g: float(hits[m, best[0], best[1]].mean()) if m.any() else None for g, m in masks.items()}}
    out.update({b: {g: float(mentions[b].to_numpy()[m].mean()) if m.any() else None for g, m in masks.items()}
                for b in BASELINES})
    out["count"] = {g: int(m.sum()) for g, m in masks.items()}
    return out


def figure(by_distance: pd.DataFrame, best_name: str, encoder: str, segment_lengths: Sequence[int]):
    """Accuracy against the antecedent distance in words and in pieces (log axis; the best head and the baselines;
    each bucket's count under its label) and the share of each piece bucket within an S-piece segment."""
    fig, axes = plt.subplots(1, len(UNITS) + 1, figsize=(5.6 * (len(UNITS) + 1), 4.2), squeeze=False)
    lines = [("best_head", f"best head {best_name}"), *((b, b) for b in BASELINES)]
    for ax, unit in zip(axes[0], UNITS):
        d = by_distance[(by_distance.unit == unit) & (by_distance.bucket != ALL)].sort_values("lo")
        x = d.lo.astype(float).to_numpy()
        for col, label in lines:
            ax.plot(x, 100 * d[col].to_numpy(dtype=float), marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{b}\n({n})" for b, n in zip(d.bucket, d["count"])], fontsize=6, rotation=45)
        ax.minorticks_off()
        ax.set_ylim(0, 100)
        ax.set_xlabel(f"distance to the nearest antecedent ({unit}; mentions)", fontsize=8)
        ax.set_ylabel("antecedent selection accuracy (%)", fontsize=8)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    d = by_distance[(by_distance.unit == "pieces") & (by_distance.bucket != ALL)].sort_values("lo")
    x = d.lo.astype(float).to_numpy()
    for s in segment_lengths:
        ax.plot(x, 100 * d[f"within_{s}"].to_numpy(dtype=float) / d["count"].to_numpy(dtype=float), marker="o", ms=3,
                label=f"{s}-piece segments")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, list(d.bucket), fontsize=6, rotation=45)
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel("distance to the nearest antecedent (pieces)", fontsize=8)
    ax.set_ylabel("mentions with an antecedent in their segment (%)", fontsize=8)
    ax.legend(fontsize=7)
    fig.suptitle(f"{encoder}: coreference heads on whole documents", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- entry point
def _check_args(max_documents, segment_lengths, layers, num_layers: int) -> None:
    """Errors naming the config key, before any document is read."""
    if max_documents is not None and int(max_documents) < 1:
        raise ValueError(f"analysis.max_documents={max_documents}: expected a number >= 1, or null for all")
    if not segment_lengths or any(int(s) < 3 for s in segment_lengths):
        raise ValueError(f"analysis.segment_lengths={list(segment_lengths or [])}: expected segment lengths of at "
                         "least 3 pieces (e.g. [128, 512])")
    if layers is not None and (not list(layers) or any(not 0 <= int(l) < num_layers for l in layers)):
        raise ValueError(f"analysis.layers={list(layers)}: expected 0-based layers in 0..{num_layers - 1}, or null "
                         "for all")


def long_coref(ctx, *, gum=None, source: str = "litbank", split: str = "dev", max_documents: int | None = None,
               segment_lengths: Sequence[int] = (128, 512), layers: Sequence[int] | None = None,
               ontogum_dir: str = "gum_coref_ontogum", litbank_dir: str = "litbank_coref/conll") -> pd.DataFrame:
    """Score every head on antecedent selection across whole documents, by antecedent distance (module doc);
    save the tables, the figure and the summary; return long_coref_by_distance.

    Args:
        ctx: The analysis context.
        gum: The UD GUM treebank (``source=gum|ontogum``).
        source: ``litbank`` | ``gum`` | ``ontogum``.
        split: The GUM / OntoGUM split (LitBank has none).
        max_documents: The first N documents (LitBank: files by name); None: all.
        segment_lengths: Segment lengths S (pieces) whose ``within_S`` flags are computed.
        layers: 0-based layers; None: all.
        ontogum_dir, litbank_dir: Folders under ``paths.data_dir``.
    """
    t0 = time.time()
    encoder = ctx.encoder
    tok = encoder.tokenizer
    _check_args(max_documents, segment_lengths, layers, int(encoder.model.config.num_hidden_layers))
    segment_lengths = [int(s) for s in segment_lengths]
    docs, dataset, split, digest = load_documents(ctx, gum, source, split, max_documents, ontogum_dir, litbank_dir)
    limit = usable_max_length(encoder.model.config)
    engine = MapEngine.from_config(ctx.extract_cfg, encoder.model, kind="attention", layers=layers,
                                   tokenizer=tok, device=ctx.device, max_length=None)
    todo, skipped = [], {}
    for i, doc in enumerate(docs):
        items = segment_items(doc, Segment(i, 0, len(doc.sentences), 0, len(doc.words), 0), i)
        if not items:
            skipped[doc.doc_id] = "no mention with an antecedent of another head word"
            continue
        (encoded,) = encode_words(tok, [doc.words])
        if encoded.n_pieces > limit:
            skipped[doc.doc_id] = (f"{encoded.n_pieces} pieces, above {encoder.name}'s usable length of {limit} "
                                   "pieces")
            continue
        todo.append(prepare(tok, doc, i, encoded, items, segment_lengths))
    for doc_id, why in skipped.items():
        log.info("long_coref: document %s skipped: %s", doc_id, why)
    if not todo:
        raise ValueError(f"long_coref: no document of {dataset} ({len(docs)} read) can be scored: "
                         f"{dict(list(skipped.items())[:5])}")
    device = torch.device(ctx.device)
    whole = mention_pool(engine, [p.rows for p in todo])
    state = {}
    for k, p in enumerate(todo):  # refuse what cannot fit, before any forward
        engine.check_fits(whole, [k], [p.encoded], device)
        state[k] = whole.nbytes(engine.layers, engine.num_heads, [k], [p.encoded])
    rows, hits, preds, per_doc = [], [], [], {}
    for k, p in enumerate(tqdm(todo, desc="long_coref", unit="doc", disable=None)):
        t1 = time.time()
        pred = document_predictions(engine, p)  # (L', H, M)
        row_of = {h: r for r, h in enumerate(p.heads)}
        for it, m in zip(p.items, p.mentions):
            preds.append(pred[:, :, row_of[it.head]])  # (L', H)
            hits.append(np.isin(preds[-1], sorted(it.antecedent_heads)))  # (L', H)
            rows.append(m)
        per_doc[p.doc.doc_id] = dict(n_words=len(p.doc.words), n_pieces=p.encoded.n_pieces, n_mentions=len(p.items),
                                     n_head_words=len(p.heads), seconds=round(time.time() - t1, 1),
                                     reduced_bytes=int(state[k]),
                                     rows_per_block=engine.rows_per_block(1, p.encoded.n_pieces),
                                     segment_evaluated={str(s): n for s, n in p.segment_evaluated.items()})
        log.info("long_coref: %s, %d pieces, %d mentions in %.1fs", p.doc.doc_id, p.encoded.n_pieces, len(p.items),
                 time.time() - t1)
    hits = np.stack(hits)  # (N, L', H)
    mentions = pd.DataFrame(rows)
    heads, by_distance, (bl, bh) = accuracy_tables(mentions, hits, engine.layers, segment_lengths)
    best_name = head_name(engine.layers[bl], bh)
    mentions["best_head_prediction"] = np.stack(preds)[:, bl, bh]
    mentions["best_head"] = hits[:, bl, bh]
    ctx.save_table(heads, "long_coref")
    ctx.save_table(by_distance, "long_coref_by_distance")
    ctx.save_table(mentions, "long_coref_mentions")
    ctx.save_figure(figure(by_distance, best_name, encoder.name, segment_lengths), "long_coref")
    n = len(mentions)
    ctx.log_summary(dict(
        analysis="long_coref", encoder=encoder.name, causal=is_causal(encoder), source=source, dataset=dataset,
        split=split, data_sha256=digest, usable_max_length=limit, layers=list(engine.layers),
        attention_budget_mb=float(ctx.extract_cfg.attention_budget_mb), n_documents_read=len(docs),
        n_documents=len(todo), n_skipped=len(skipped), skipped=skipped, documents=per_doc, n_mentions=n,
        n_antecedent_after=int((~mentions.antecedent_before).sum()),
        within={str(s): int(mentions[f"within_{s}"].sum()) for s in segment_lengths},
        outside={str(s): int(n - mentions[f"within_{s}"].sum()) for s in segment_lengths},
        segment_evaluated={str(s): sum(p.segment_evaluated[s] for p in todo) for s in segment_lengths},
        best_head=dict(layer=int(engine.layers[bl]), head=bh, name=best_name, accuracy=float(hits[:, bl, bh].mean())),
        table=type_table(mentions, hits, (bl, bh)), peak_rss_gib=round(peak_rss_gib(), 2),
        seconds=round(time.time() - t0, 1)))
    log.info("long_coref: %d documents, %d mentions, best head %s (%.3f) in %.1fs", len(todo), n, best_name,
             hits[:, bl, bh].mean(), time.time() - t0)
    return by_distance
