"""``analysis=head_stats``: surface-level attention statistics per head (Clark et al. §3, Figs 1, 2, 4).

Wordpiece level, live encoder. Input (``pairs``): by default Clark's form, two consecutive treebank
sentences of one document as one sequence ``[CLS] A [SEP] B [SEP]`` (the tokenizer's own pair form,
e.g. ``<s> A </s></s> B </s>``; :func:`probes.model.inputs.encode_word_pairs`; pairs (1, 2), (3, 4),
... of each document, a document's odd last sentence is left out), so that attention from [SEP] to
[SEP] and from the other tokens to [SEP] can be told apart (Fig 2's middle panel); ``pairs: false``
reads each sentence alone as ``[CLS] s [SEP]``. [CLS] / [SEP] stand for the family's first special
token and its separators. Sequences longer than ``encoder.max_length`` pieces are skipped. ``summary.json``
accounts for every input sentence (:class:`SentenceCounts`): ``n_input_sentences = n_sentences +
n_unpaired + n_skipped_sentences`` (read; without a pair partner; in a skipped sequence), with the reasons
under ``sentences_left_out``. For every head (0-based ``layer``, ``head`` in files; 1-based
``layer-head`` in figures), averaged over the attending tokens of a sequence and then over sequences,
as Clark's ``General_Analysis.ipynb`` (:func:`probes.analysis.clark.metrics.sentence_head_stats`):

* ``prev`` / ``self`` / ``next``: attention to the previous token / itself / the next token;
* ``cls`` / ``sep``: total attention to [CLS] / to the separators;
* ``sep_sep`` / ``rest_sep``: total attention to the separators from a separator / from any other token;
* ``punct``: total attention to ``.`` and ``,`` pieces (Clark's definition, marker ``##``/``Ġ``/``▁``
  stripped; :func:`probes.analysis.clark.metrics.is_period_comma`);
* ``entropy``: mean entropy (nats) of the heads' attention rows, smoothed as Clark's code
  (0.9999 a + 0.0001 / T); ``cls_entropy``: entropy of the row of [CLS] alone;
* ``uniform_entropy``: the Fig 4 reference, mean over sequences of log T (the entropy of uniform
  attention); the same value is repeated on every (layer, head) row so the table stays tidy.

Decoders (causal LMs: the model layer's family says ``causal``; a token's row covers itself and the
earlier tokens only): position 0 takes the place of [CLS]. Its column is named for what it is:
``bos`` when the sequences start with a special token the tokenizer adds (Llama-style BOS), ``first``
when they start with the first word (SmolLM2's GGUF tokenizer and GPT-2 add none); ``bos_entropy`` /
``first_entropy`` are left out (row 0 sees only itself: entropy 0), ``next`` too (a causal row never
sees the next token: 0 by construction), and the separator columns when no sequence holds a separator
(a decoder's tokenizer adds none at the end). A decoder has no [SEP]: its pair input is ``[BOS] A <sep> B``
with one separator token between the sentences (its EOS, or its SEP token where it has one:
:func:`probes.model.inputs.pair_separator`), which the separator columns then measure; the figures name that
token in place of [SEP] and say so in a note, and ``summary.json`` gives it (``separator_token``). Rows
before it cannot see it (they count 0). ``uniform_entropy`` is then the mean over rows of
log(i + 1), the entropy of uniform attention over the i + 1 keys row i sees. The sink of decoders
("attention sink", Xiao et al. 2023) is the ``first``/``bos`` column; ``summary.json`` names the
column (``first_token``) and gives its mean per layer (``per_layer_mean``).

Documents (``documents``: a name of ``conf/analyze.yaml``'s ``documents``, e.g. ``gum``, ``litbank``): each whole
document is one sequence (its running text with the tokenizer's own specials,
:func:`probes.data.documents.encode_document`), the same statistics per document averaged over documents; those
longer than ``encoder.max_length`` pieces are skipped and named in ``summary.json`` (``n_input_documents =
n_documents + n_skipped_documents``). A decoder such as SmolLM2 reads GUM's documents whole.

Computation: the attention is reduced on the maps' device a batch at a time
(:class:`probes.maps.reducers.HeadStats` through :meth:`probes.maps.MapEngine.iter_reduced_batches`: masks built
per batch, sums kept as tensors, one copy at the end; no map is copied to the host, no Python loop over the
sequences of a batch); a batch whose whole maps exceed ``extract.attention_budget_mb`` (documents) in blocks of
query rows. The per-sentence reference :func:`probes.analysis.clark.metrics.sentence_head_stats` gives the same
numbers (tests/test_head_stats_reducer.py).

Outputs: ``head_stats.csv`` (layer, head, stat, value), ``head_stats_by_layer.csv`` (layer, stat,
mean/min/max over heads), ``head_stats_heatmaps.png``, ``head_stats_layers.png``, ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from probes.analysis import plots
from probes.analysis.clark.metrics import HEAD_STATS, HeadStatsTotals, PunctFlags, is_causal, punct_positions
from probes.analysis.naming import head_name
from probes.data.documents import DocumentSource, encode_document
from probes.maps import HeadStats, MapEngine
from probes.measures.attention import Attention
from probes.model.families import is_byte_level
from probes.model.inputs import Encoded, encode_word_pairs, encode_words, pair_separator

log = logging.getLogger(__name__)


def stats_table(stats: dict[str, np.ndarray], uniform_entropy: float | None = None) -> pd.DataFrame:
    """Tidy (layer, head, stat, value) rows from stat -> (L, H) arrays; 0-based layer/head."""
    rows = []
    for k, v in stats.items():
        L, H = v.shape
        for l in range(L):
            for h in range(H):
                rows.append((l, h, k, float(v[l, h])))
        if uniform_entropy is not None and k == "entropy":
            rows += [(l, h, "uniform_entropy", float(uniform_entropy)) for l in range(L) for h in range(H)]
    return pd.DataFrame(rows, columns=["layer", "head", "stat", "value"])


def by_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Mean/min/max over heads of each stat per layer."""
    return (df.groupby(["layer", "stat"], sort=True)["value"].agg(["mean", "min", "max"]).reset_index())


def pair_indices(doc_ids: Sequence) -> list[tuple[int, int]]:
    """Consecutive sentences of one document as pairs (0, 1), (2, 3), ... counted within each document
    (``doc_ids``: one per sentence, in file order; None is a document of its own like any value); a
    document's odd last sentence has no partner and is left out."""
    pairs, i = [], 0
    while i + 1 < len(doc_ids):
        if doc_ids[i] == doc_ids[i + 1]:
            pairs.append((i, i + 1))
            i += 2
        else:
            i += 1
    return pairs


def encode_inputs(tokenizer, sentences, pairs: bool) -> tuple[list[Encoded], list[tuple[int, ...]]]:
    """The encoded sequences of the treebank ``sentences`` and the sentence indices each holds:
    ``pairs``: :func:`pair_indices` joined as ``[CLS] A [SEP] B [SEP]``; else each alone."""
    if pairs:
        idx = pair_indices([s.doc_id for s in sentences])
        return encode_word_pairs(tokenizer, [(sentences[a].words, sentences[b].words) for a, b in idx]), idx
    return encode_words(tokenizer, [list(s.words) for s in sentences]), [(i,) for i in range(len(sentences))]


def separator_positions(e: Encoded) -> list[bool]:
    """(T,) the separators of an encoded sequence: every special token after position 0 ([SEP] / </s>)."""
    return [w == e.n_words for w in e.word_of_piece]


def fitting(encoded: Sequence[Encoded], limit: int) -> list[int]:
    """Indices of the encoded sequences of at most ``limit`` pieces; how many are left out is logged."""
    keep = [i for i, e in enumerate(encoded) if e.n_pieces <= limit]
    if len(keep) < len(encoded):
        log.warning("%d of %d sequences exceed %d wordpieces and are skipped", len(encoded) - len(keep),
                    len(encoded), limit)
    return keep


def sequence_attention(encoder, encoded: Sequence[Encoded], device: str = "cpu", max_tokens: int = 4096,
                       max_batch_size: int = 64, desc: str = "attention"
                       ) -> Iterator[tuple[int, torch.Tensor, list[bool], list[bool]]]:
    """Yield ``(index, attn (L, H, T, T) float32 on device, punct (T,), sep (T,))`` for every encoded
    sequence that fits ``encoder.max_length`` pieces, in length-batch order; longer ones are skipped
    (logged). ``index``: the sequence's position in ``encoded``."""
    tok = encoder.tokenizer
    keep = fitting(encoded, encoder.max_length)
    byte_level = is_byte_level(tok)
    items = [encoded[i] for i in keep]
    engine = MapEngine(encoder.model, Attention(), tokenizer=tok, device=device, max_tokens=max_tokens,
                       max_batch_size=max_batch_size, max_pairs=None)
    for k, attn in engine.iter_piece_maps(items, desc=desc):
        yield keep[k], attn, punct_positions(tok, items[k].input_ids, byte_level), separator_positions(items[k])


def first_token_name(tokenizer, encoded: Sequence[Encoded], causal: bool) -> str:
    """Name of the column of attention to position 0: ``cls`` (bidirectional encoders: [CLS] / <s>),
    ``bos`` (causal, every sequence starts with a special token), ``first`` (causal, no BOS: the first word)."""
    if not causal:
        return "cls"
    special = set(tokenizer.all_special_ids)
    return "bos" if encoded and all(e.input_ids[0] in special for e in encoded) else "first"


def output_stats(stats: dict[str, np.ndarray], first: str, causal: bool, has_sep: bool) -> dict[str, np.ndarray]:
    """The reported statistics (module doc): ``cls`` renamed to ``first``; for causal models without
    the columns that are constant by construction (``next``, the entropy of row 0) and, with no
    separator in any sequence, without the separator columns."""
    drop = ({"next", "cls_entropy"} if causal else set()) | (set() if has_sep else {"sep", "sep_sep", "rest_sep"})
    out = {}
    for k in HEAD_STATS:
        if k not in drop:
            out[k.replace("cls", first) if k.startswith("cls") else k] = stats[k]
    return out


@dataclass(frozen=True)
class SentenceCounts:
    """Where every input sentence went (``summary.json``):
    ``n_input_sentences = n_sentences + n_unpaired + n_skipped_sentences``."""

    n_input_sentences: int      # the sentences given: the first max_sentences of the split
    n_sentences: int            # in the sequences read
    n_unpaired: int             # pairs: without a partner, a document's odd last sentence (single input: 0)
    n_skipped_sentences: int    # in the sequences longer than encoder.max_length pieces
    n_sequences: int            # sequences read (pairs, or single sentences)
    n_skipped: int              # sequences longer than encoder.max_length pieces, not read

    @classmethod
    def of(cls, n_input: int, members: Sequence[tuple[int, ...]], too_long: Sequence[int], read: Sequence[int]
           ) -> SentenceCounts:
        """The counts of ``n_input`` sentences encoded as sequences of ``members`` (the sentence indices of each,
        :func:`encode_inputs`), of which the indices ``too_long`` were skipped and ``read`` were read; a sentence
        or sequence that none of these accounts for is an error."""
        used = [i for m in members for i in m]
        if len(set(used)) != len(used) or not set(used) <= set(range(n_input)):
            raise RuntimeError(f"head_stats: the sequences' sentences {used} are not distinct sentences of "
                               f"0..{n_input - 1}")
        if sorted([*too_long, *read]) != list(range(len(members))):
            raise RuntimeError(f"head_stats: of {len(members)} sequences, {len(read)} were read and {len(too_long)} "
                               f"skipped as too long; the rest are unaccounted for")
        return cls(n_input_sentences=n_input, n_sentences=sum(len(members[k]) for k in read),
                   n_unpaired=n_input - len(used), n_skipped_sentences=sum(len(members[k]) for k in too_long),
                   n_sequences=len(read), n_skipped=len(too_long))

    def summary(self, pairs: bool, max_sentences: int | None, max_length: int) -> dict:
        """The ``summary.json`` entries: the counts and, under ``sentences_left_out``, why sentences were left out
        (``pairs``, ``max_sentences``: the analysis's keys; ``max_length``: the encoder's)."""
        cut = f" (among the first {max_sentences}: a document cut there may end early)" if max_sentences else ""
        unpaired = ("pair input joins the sentences (1, 2), (3, 4), ... of each document; a document's odd last "
                    f"sentence has no partner{cut}") if pairs else "none: single input reads every sentence alone"
        return dict(vars(self), sentences_left_out=dict(
            n_unpaired=unpaired,
            n_skipped_sentences=f"in the n_skipped sequences longer than encoder.max_length = {max_length} pieces"))


def compute(encoder, sentences, device: str = "cpu", pairs: bool = True, **batching
            ) -> tuple[HeadStatsTotals, int, int]:
    """(:class:`~probes.analysis.clark.metrics.HeadStatsTotals` over the sequences that fit, their number of
    sentences, the number of sequences) of the treebank ``Sentence`` objects (:func:`encode_inputs`)."""
    acc, n_sentences, counts, _ = _compute(encoder, sentences, device, pairs, **batching)
    return acc, n_sentences, counts.n_sequences + counts.n_skipped


def sequence_stats(encoder, encoded: Sequence[Encoded], device: str = "cpu", max_tokens: int = 4096,
                   max_batch_size: int = 64, desc: str = "head_stats", attention_budget_mb: float = 1024
                   ) -> tuple[HeadStatsTotals, list[int], bool]:
    """(the statistics of every encoded sequence that fits ``encoder.max_length`` pieces averaged over them, the
    indices of those read, whether any holds a separator). The attention is reduced batch by batch on the maps'
    device (:class:`probes.maps.reducers.HeadStats`, :meth:`probes.maps.MapEngine.iter_reduced_batches`): masks
    built per batch, sums kept as tensors, one copy to the host at the end; no map leaves the device. A batch whose
    whole maps exceed ``attention_budget_mb`` (``extract.attention_budget_mb``; documents) is reduced in blocks of
    query rows."""
    tok = encoder.tokenizer
    keep = fitting(encoded, encoder.max_length)
    items = [encoded[i] for i in keep]
    punct = PunctFlags(tok)
    reducer = HeadStats(sep=lambda k, e: separator_positions(e), punct=lambda k, e: punct(e.input_ids),
                        stats=HEAD_STATS)
    engine = MapEngine(encoder.model, Attention(), tokenizer=tok, device=device, max_tokens=max_tokens,
                       max_batch_size=max_batch_size, max_pairs=None, attention_budget_mb=attention_budget_mb)
    acc = HeadStatsTotals(is_causal(encoder))
    for positions, batch in engine.iter_reduced_batches(items, reducer, desc=desc):
        acc.add_batch(batch, [items[k].n_pieces for k in positions])
    any_sep = any(e.n_words in e.word_of_piece for e in items)  # separators: the specials after position 0
    return acc, keep, any_sep


def _compute(encoder, sentences, device: str, pairs: bool, **batching
             ) -> tuple[HeadStatsTotals, int, SentenceCounts, tuple[str, bool]]:
    """(statistics, sentences read, their :class:`SentenceCounts`, (first-token column name, whether any sequence
    holds a separator)) of :func:`compute`."""
    causal = is_causal(encoder)
    encoded, members = encode_inputs(encoder.tokenizer, sentences, pairs)
    too_long = [k for k, e in enumerate(encoded) if e.n_pieces > encoder.max_length]  # sequence_stats skips them
    acc, read, any_sep = sequence_stats(encoder, encoded, device, **batching)
    counts = SentenceCounts.of(len(sentences), members, too_long, read)
    return acc, counts.n_sentences, counts, (first_token_name(encoder.tokenizer, encoded, causal), any_sep)


FIRST_TITLES = {"first": "to the first token", "bos": "to BOS"}


def separator_token(tokenizer, causal: bool) -> str:
    """The separator token the ``sep`` columns measure: [SEP] / ``</s>`` of an encoder's pair template; a decoder's
    one token between the sentences of a pair (:func:`probes.model.inputs.pair_separator`: its EOS, or its SEP)."""
    sep = pair_separator(tokenizer) if causal else None
    return tokenizer.convert_ids_to_tokens(sep[0]) if sep else str(tokenizer.sep_token)


def titles(separator: str | None = None) -> dict[str, str]:
    """Panel titles of the statistics (the plots' defaults plus Fig 2's [SEP] panel and decoders' first token);
    ``separator``: a decoder's separator token, named in place of [SEP]."""
    if separator is None:
        sep = dict(sep="to [SEP] (all separators)", sep_sep="[SEP] -> [SEP]", rest_sep="other -> [SEP]")
    else:
        sep = dict(sep=f"to {separator} (between A and B)", sep_sep=f"{separator} -> {separator}",
                   rest_sep=f"other -> {separator}")
    return {**plots.STAT_TITLES, **sep, "punct": "to . or ,", **FIRST_TITLES}


def separator_note(name: str, separator: str, first: str) -> str:
    """The figures' note for a decoder's pair input: what its separator panels show instead of [SEP]."""
    form = f"{'BOS ' if first == 'bos' else ''}A {separator} B"
    return (f"{name} is a decoder, without [SEP]: pair input is \"{form}\"; the separator panels show attention "
            f"to {separator}, the one token put between the two sentences (rows before it cannot see it: 0)")


@dataclass(frozen=True)
class DocumentCounts:
    """Where every input document went (``summary.json``, ``documents`` input):
    ``n_input_documents = n_documents + n_skipped_documents``."""

    n_input_documents: int      # the documents given: the first max_documents of the source
    n_documents: int            # read, each as one sequence
    n_skipped_documents: int    # longer than encoder.max_length pieces, not read
    n_sentences: int            # in the documents read
    n_pieces: int               # in the documents read, specials included
    skipped: dict               # name -> pieces of each skipped document

    def summary(self, max_length: int) -> dict:
        return dict(vars(self), documents_left_out=dict(
            n_skipped_documents=f"longer than encoder.max_length = {max_length} pieces (one sequence each)"))


def document_inputs(encoder, documents: str, sources: Mapping[str, DocumentSource], max_documents: int | None,
                    analysis: str) -> tuple[list[Encoded], DocumentCounts]:
    """The whole documents of ``sources[documents]`` (the first ``max_documents``) that fit ``encoder.max_length``
    pieces, each encoded with the tokenizer's specials (:func:`probes.data.documents.encode_document`), and their
    :class:`DocumentCounts`: the ``documents`` input of ``analysis`` (head_stats, sink). The keys are checked and a
    source of which no document fits is refused, naming it, before any forward; skipped documents are logged."""
    if documents not in sources:
        raise ValueError(f"analysis.documents={documents!r}: expected one of {sorted(sources)} (the documents of "
                         "conf/analyze.yaml) or null")
    if max_documents is not None and int(max_documents) < 1:
        raise ValueError(f"analysis.max_documents={max_documents}: expected a positive number or null")
    docs = sources[documents].read()[:max_documents]
    enc = [encode_document(encoder.tokenizer, d) for d in docs]
    keep = [k for k, e in enumerate(enc) if e.n_pieces <= encoder.max_length]
    skipped = {docs[k].name: enc[k].n_pieces for k in range(len(docs)) if k not in set(keep)}
    counts = DocumentCounts(len(docs), len(keep), len(skipped), sum(docs[k].n_sentences for k in keep),
                            sum(enc[k].n_pieces for k in keep), skipped)
    if not keep:
        raise ValueError(f"{analysis}: none of the {len(docs)} documents of {documents!r} fits {encoder.name}'s "
                         f"{encoder.max_length} pieces (shortest: {min(skipped.values())} pieces); use a model that "
                         "reads longer sequences")
    if skipped:
        log.warning("%s: %d of %d documents are longer than %d pieces and are skipped", analysis, len(skipped),
                    len(docs), encoder.max_length)
    return [enc[k].encoded for k in keep], counts


def head_stats(ctx, *, split: str = "dev", max_sentences: int | None = None, pairs: bool = True,
               max_tokens: int = 4096, max_batch_size: int = 64, top_k: int = 3, documents: str | None = None,
               sources: Mapping[str, DocumentSource] | None = None, max_documents: int | None = None
               ) -> pd.DataFrame:
    """Compute, save and plot the per-head statistics; returns the tidy table.

    Args:
        ctx: The analysis context.
        split, max_sentences, pairs: The sentences read (the first N of the split, file order), paired when
            ``pairs``.
        max_tokens, max_batch_size: Pieces and sequences per batch.
        top_k: Heads per statistic listed in summary.json.
        documents: None: sentences (above). A key of ``sources``: its whole documents instead, each one sequence
            (those above ``encoder.max_length`` pieces skipped and counted); ``split``, ``pairs`` and
            ``max_sentences`` are then not used.
        sources: Name -> :class:`~probes.data.documents.DocumentSource` (``documents`` of ``conf/analyze.yaml``).
        max_documents: The first N documents of the source; None: all.
    """
    t0 = time.time()
    if documents is not None:
        return _document_stats(ctx, documents, sources or {}, max_documents, max_tokens, max_batch_size, top_k, t0)
    sentences = ctx.sentences(split, max_sentences)
    acc, _, counts, (first, has_sep) = _compute(ctx.encoder, sentences, ctx.device, pairs, max_tokens=max_tokens,
                                                max_batch_size=max_batch_size)
    _save(ctx, acc, first, has_sep, top_k, dict(split=split, input="pair" if pairs else "single",
                                                **counts.summary(pairs, max_sentences, ctx.encoder.max_length)), t0)
    log.info("head_stats: %d of %d input sentences in %d sequences (%d unpaired, %d in %d sequences too long) "
             "in %.1fs", counts.n_sentences, counts.n_input_sentences, counts.n_sequences, counts.n_unpaired,
             counts.n_skipped_sentences, counts.n_skipped, time.time() - t0)
    return ctx.tables["head_stats"]


def _document_stats(ctx, documents: str, sources: Mapping[str, DocumentSource], max_documents: int | None,
                    max_tokens: int, max_batch_size: int, top_k: int, t0: float) -> pd.DataFrame:
    """head_stats on whole documents (:func:`head_stats`' ``documents``)."""
    encoded, counts = document_inputs(ctx.encoder, documents, sources, max_documents, "head_stats")
    acc, _, has_sep = sequence_stats(ctx.encoder, encoded, ctx.device, max_tokens=max(max_tokens, max(
        e.n_pieces for e in encoded)), max_batch_size=max_batch_size,
        attention_budget_mb=float(ctx.extract_cfg.attention_budget_mb))
    first = first_token_name(ctx.encoder.tokenizer, encoded, acc.causal)
    _save(ctx, acc, first, has_sep, top_k, dict(input="documents", documents=documents,
                                                source_path=str(sources[documents].path), max_documents=max_documents,
                                                **counts.summary(ctx.encoder.max_length)), t0)
    log.info("head_stats: %d of %d documents (%d sentences, %d pieces) in %.1fs", counts.n_documents,
             counts.n_input_documents, counts.n_sentences, counts.n_pieces, time.time() - t0)
    return ctx.tables["head_stats"]


def _save(ctx, acc: HeadStatsTotals, first: str, has_sep: bool, top_k: int, inputs: dict, t0: float) -> None:
    """The tables, figures and summary.json of :func:`head_stats` (``inputs``: what was read, for the summary)."""
    stats = output_stats(acc.result(), first, acc.causal, has_sep)
    df = stats_table(stats, acc.uniform_entropy)
    ctx.save_table(df, "head_stats")
    layer_df = by_layer(df[df.stat != "uniform_entropy"])
    ctx.save_table(layer_df, "head_stats_by_layer")

    separator = separator_token(ctx.encoder.tokenizer, acc.causal) if has_sep else None
    decoder_sep = separator if acc.causal else None  # a decoder's separator is named in place of [SEP]
    note = separator_note(ctx.encoder.name, separator, first) if decoder_sep else None
    ctx.save_figure(plots.heatmaps(stats, titles=titles(decoder_sep), note=note), "head_stats_heatmaps")
    groups = [[first, "sep", "punct"], ["rest_sep", "sep_sep"], ["prev", "self", "next"],
              ["entropy", f"{first}_entropy"]]
    groups = [[k for k in g if k in stats] for g in groups]
    keep = [i for i, g in enumerate(groups) if g]
    ylabels = ["avg. attention", "avg. attention", "avg. attention", "avg. entropy (nats)"]
    hlines = [None, None, None, {"uniform": acc.uniform_entropy}]
    ctx.save_figure(plots.layer_curves(stats, groups=[groups[i] for i in keep], ylabels=[ylabels[i] for i in keep],
                                       hlines=[hlines[i] for i in keep], titles=titles(decoder_sep), note=note),
                    "head_stats_layers")

    top = {}
    for k, v in stats.items():
        flat = np.argsort(-v, axis=None)[:top_k]
        top[k] = [dict(name=head_name(*np.unravel_index(i, v.shape)), value=float(v.flat[i])) for i in flat]
    per_layer = {k: [float(x) for x in v.mean(1)] for k, v in stats.items()}
    ctx.log_summary(dict(analysis="head_stats", encoder=ctx.encoder.name, **inputs, causal=acc.causal,
                         first_token=first, separator_token=separator, separator_note=note,
                         uniform_entropy=acc.uniform_entropy,
                         per_layer_mean=per_layer, top_heads=top, seconds=round(time.time() - t0, 1)))
