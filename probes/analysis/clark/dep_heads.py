"""``analysis=dep_heads``: which heads find syntactic heads (Clark et al. §4.1, Table 1).

Word level, from the attention cache (attention TO a split word summed over its pieces, FROM it
averaged). A head "predicts" for every word the most-attended other word, ignoring attention to
the word itself and to [CLS]/[SEP] (Clark's ``attn_head_predictor``), in two directions:

* ``dep2head``: the dependent's row (the word the dependent attends to most);
* ``head2dep``: the transposed map (the word that attends most to the dependent).

Decoders (causal LMs; the model layer's family says ``causal``): a word's row covers itself and the
earlier words only, so each (dependent, head) pair is visible in one direction only, and each
direction looks only where it can see (:func:`probes.analysis.clark.metrics.predict_heads`):

* ``dep2head`` predicts from the dependent's row among the words *before* it: it can score the
  pairs whose head precedes the dependent (``det``, ``amod``, ``compound``, ``nsubj``... point the
  other way: their head follows);
* ``head2dep`` predicts from the dependent's column, i.e. among the words *after* it that attend to
  it: it can score the pairs whose head follows the dependent.

Both directions are reported for every head, as for encoders; the best (layer, head, direction)
per relation is taken over both. ``head_before`` in ``dep_table.csv`` is the share of the relation's
pairs whose head precedes the dependent: for a decoder the ceiling of ``dep2head`` (``head2dep``: one
minus it). A word with no candidate in a direction (the first word for dep2head, the last for head2dep)
predicts ROOT, never right. Encoders are unchanged (every word is a candidate in both directions).

A prediction is correct when it is the gold head. Per relation the best (layer, head, direction)
is reported, like the paper's Table 1, against fixed-offset baselines (word j predicts word
j + offset, offsets -3..+2, clipped to ROOT (0) on the left and to the last word on the right, as
Clark's ``offset_predictor``: ``max(0, min(j + offset, n))``; a ROOT prediction is never right here,
since words attached to the root are not scored; offset 0 predicts the word itself and is never
right). Words attached to the root and relations in ``exclude`` (``root``, ``punct``, like the
paper's table) are left out of every row including ``all``; Clark's code kept
them in ``all``. Possessives: as in Clark's code, a ``nmod:poss`` dependent followed by ``'s``/``'``
is scored by the clitic's prediction (``poss_relations``).

UD v2 vs the paper's Stanford Dependencies (the paper used the PTB WSJ converted to SD):

* ``obj`` ~ SD ``dobj``; ``iobj`` = ``iobj``; ``nsubj``/``nsubj:pass`` ~ ``nsubj``/``nsubjpass``;
* ``case`` has no SD counterpart: SD attaches a preposition as ``prep`` to the word the phrase
  modifies and its object as ``pobj`` to the preposition; UD attaches the noun (``obl``/``nmod``)
  to that word and the preposition to the noun as ``case``. So UD ``case`` (dependent = preposition,
  head = its noun) is the reverse of SD ``pobj`` (dependent = noun, head = preposition), and UD
  ``obl``/``nmod`` mixes SD ``prep`` arcs; the possessive ``'s`` (SD ``possessive``) is also ``case``;
* ``compound`` ~ SD ``nn`` (noun compound modifier; UD ``compound`` also covers ``prt`` for
  phrasal verbs as ``compound:prt``); ``nmod:poss`` ~ ``poss``;
* ``aux`` ~ ``aux`` (UD ``aux:pass`` ~ ``auxpass``); ``det``, ``amod``, ``advmod``, ``mark``, ``cc``,
  ``conj``, ``nummod`` (~ ``num``) keep their names; ``cop`` exists in both, but in both schemes the
  copula's head is the predicate; ``xcomp``/``ccomp``/``advcl``/``acl`` (~ ``partmod``/``infmod``/
  ``rcmod`` for ``acl:relcl``) correspond roughly.
* UD makes content words heads (e.g. the predicate of a copular clause, the noun of a PP), SD
  mostly did the same for copulas but not for prepositions, so prepositional rows are not
  comparable one to one.

The same mapping is written to ``relation_map.csv``.

Map kinds: ``extract.maps=<kind>`` (README "Beyond attention weights") scores the maps of that kind from
the same cache the same way: a per-head kind has a "best head", a per-layer kind (rollout, flow,
norm_res_ln, alti, value_zeroing) has one map per layer (``head`` is always 0, named ``<layer>-1``).

Outputs: ``dep_heads.csv`` (relation, layer, head, direction, accuracy, count; 0-based),
``dep_offsets.csv`` (relation, offset, accuracy, count), ``dep_table.csv`` (per relation: count,
best head as layer/head + 1-based name, direction, accuracy, best offset, its accuracy, difference,
``head_before``),
``relation_map.csv``, ``dep_table.png``, ``summary.json``.
"""

from __future__ import annotations

import logging
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from probes.analysis.cached import word_map_batches
from probes.analysis.clark.metrics import DIRECTIONS, DepAccumulator, is_causal
from probes.analysis.naming import head_name, model_layers

log = logging.getLogger(__name__)

RELATION_MAP = [
    # UD v2 relation, paper (Stanford Dependencies) relation, note
    ("det", "det", "same"),
    ("obj", "dobj", "renamed"),
    ("iobj", "iobj", "same"),
    ("nsubj", "nsubj", "same"),
    ("nsubj:pass", "nsubjpass", "renamed"),
    ("case", "prep / pobj / possessive", "UD: preposition -> its noun; SD: noun -(pobj)-> preposition -(prep)-> modified word"),
    ("obl", "prep (+pobj)", "UD attaches the PP's noun to the verb; SD attached the preposition"),
    ("nmod", "prep (+pobj)", "as obl, for nominal heads"),
    ("nmod:poss", "poss", "renamed; Clark scored it through the following 's"),
    ("compound", "nn", "noun compounds"),
    ("compound:prt", "prt", "phrasal-verb particle"),
    ("aux", "aux", "same"),
    ("aux:pass", "auxpass", "renamed"),
    ("amod", "amod", "same"),
    ("advmod", "advmod", "same"),
    ("mark", "mark", "same"),
    ("cop", "cop", "same"),
    ("conj", "conj", "same"),
    ("cc", "cc", "same"),
    ("nummod", "num", "renamed"),
    ("acl:relcl", "rcmod", "renamed"),
    ("acl", "partmod / infmod", "merged"),
    ("xcomp", "xcomp", "same"),
    ("ccomp", "ccomp", "same"),
    ("advcl", "advcl", "same"),
    ("root", "root", "excluded from the table"),
    ("punct", "punct", "excluded from the table"),
]


def relation_map() -> pd.DataFrame:
    """:data:`RELATION_MAP` as a table (ud_relation, paper_relation, note)."""
    return pd.DataFrame(RELATION_MAP, columns=["ud_relation", "paper_relation", "note"])


def evaluate(cache, sentences, num_layers: int, num_heads: int, offsets=(-3, -2, -1, 0, 1, 2),
             exclude=("root", "punct"), poss_relations=("nmod:poss",), strip_subtypes: bool = False,
             progress: bool = True, causal: bool = False, device: str = "cpu",
             batch_mb: float | None = None) -> DepAccumulator:
    """Run :class:`DepAccumulator` over the cached sentences (skipped ones are left out) a batch at a time on
    ``device`` (:func:`probes.analysis.cached.word_map_batches`: at most ``batch_mb`` MiB of maps per batch, None:
    its default for the device; the gold trees prepared once,
    :class:`~probes.analysis.clark.metrics.DepLabels`); ``causal``: the decoders'
    direction rule (module doc)."""
    acc = DepAccumulator(num_layers, num_heads, offsets, exclude, poss_relations, strip_subtypes, causal)
    labels = acc.labels([(s.words, s.heads, s.deprels) for s in sentences]).to(device)
    for batch, maps, _ in word_map_batches(cache, range(len(sentences)), [len(s.words) for s in sentences], device,
                                           batch_mb, desc="dep_heads", progress=progress):
        acc.add_batch(maps, labels, torch.as_tensor(batch, device=maps.device))  # maps: (B, L, H, W, W)
    return acc


def require_trees(ctx, split: str, max_sentences: int | None, exclude=("root", "punct"),
                  strip_subtypes: bool = False) -> None:
    """An error, before anything is extracted, when the sentences have no word to score: no gold head other than
    the root outside ``exclude`` (plain sentences, as ``probes.analyze(..., sentences=[...])`` writes them, have
    every HEAD 0 and no relation)."""
    excluded = set(exclude)
    for s in ctx.sentences(split, max_sentences):
        for h, r in zip(s.heads, s.deprels):
            if h != 0 and (r.split(":")[0] if strip_subtypes else r) not in excluded:
                return
    try:
        where = f" ({ctx.treebank.path(split)})"
    except Exception:  # a treebank without files of its own
        where = ""
    raise ValueError(
        f"dep_heads needs dependency trees: no word of split {split!r}{where} has a gold head other than the root "
        f"outside the relations {sorted(excluded)}. Plain sentences (probes.analyze(..., sentences=[...])) carry no "
        "trees (every HEAD 0); give a CoNLL-U treebank instead: probes.analyze('dep_heads', "
        "treebank=probes.treebank(dev='trees.conllu')) or data=conllu on the command line")


def tables(acc: DepAccumulator, min_count: int = 100, layers=None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(dep_heads, dep_offsets, dep_table) data frames; relations with >= min_count examples + all.
    ``layers``: the model's layer of each of the accumulator's (a cache's ``layers``; None: 0..L-1)."""
    layer_of = model_layers(layers, acc.L)
    if not acc.count.get("all"):
        raise ValueError(f"dep_heads: no word was scored in the {acc.n_sentences} cached sentences (every gold head "
                         "is the root, or every relation excluded): nothing to tabulate")
    rels = ["all"] + sorted(r for r, c in acc.count.items() if r != "all" and c >= min_count)
    rows, orows, trows = [], [], []
    for r in rels:
        acc_h = acc.head_accuracy(r)  # (2, L, H)
        c = acc.count[r]
        for d, direction in enumerate(DIRECTIONS):
            for l in range(acc.L):
                for h in range(acc.H):
                    rows.append((r, layer_of[l], h, direction, float(acc_h[d, l, h]), c))
        acc_o = acc.offset_accuracy(r)
        for o, a in zip(acc.offsets, acc_o):
            orows.append((r, o, float(a), c))
        d, l, h = np.unravel_index(int(np.argmax(acc_h)), acc_h.shape)
        bo = int(np.argmax(acc_o))
        trows.append(dict(relation=r, count=c, layer=layer_of[l], head=int(h), name=head_name(layer_of[l], h),
                          direction=DIRECTIONS[d], accuracy=float(acc_h[d, l, h]),
                          best_offset=int(acc.offsets[bo]), offset_accuracy=float(acc_o[bo]),
                          difference=float(acc_h[d, l, h] - acc_o[bo]),
                          head_before=float(acc.head_before_share(r))))
    dep = pd.DataFrame(rows, columns=["relation", "layer", "head", "direction", "accuracy", "count"])
    off = pd.DataFrame(orows, columns=["relation", "offset", "accuracy", "count"])
    return dep, off, pd.DataFrame(trows)


def bar_figure(table: pd.DataFrame):
    """Per relation: the best head's accuracy beside the best fixed offset's (bars, named)."""
    t = table.reset_index(drop=True)
    x = np.arange(len(t))
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(t)), 4))
    ax.bar(x - 0.2, 100 * t.accuracy, 0.4, label="best attention head")
    ax.bar(x + 0.2, 100 * t.offset_accuracy, 0.4, label="best fixed offset")
    for i, r in t.iterrows():
        ax.text(i - 0.2, 100 * r.accuracy + 1, r["name"], ha="center", fontsize=6, rotation=90)
        ax.text(i + 0.2, 100 * r.offset_accuracy + 1, f"{r.best_offset:+d}", ha="center", fontsize=6, rotation=90)
    ax.set_xticks(x, [f"{r} ({c})" for r, c in zip(t.relation, t["count"])], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def dep_heads(ctx, *, split: str = "dev", max_sentences: int | None = None, min_count: int = 100,
              offsets=(-3, -2, -1, 0, 1, 2), exclude=("root", "punct"), poss_relations=("nmod:poss",),
              strip_subtypes: bool = False, report_relations=()) -> pd.DataFrame:
    """Evaluate every head on every relation; save the tables and the figure; return dep_table."""
    t0 = time.time()
    require_trees(ctx, split, max_sentences, exclude, strip_subtypes)  # before any extraction
    cache, sentences = ctx.cache(split, max_sentences)
    causal = is_causal(ctx.encoder)
    acc = evaluate(cache, sentences, cache.num_layers, cache.num_heads, list(offsets), list(exclude),
                   list(poss_relations), strip_subtypes, causal=causal, device=ctx.device)
    dep, off, table = tables(acc, min_count, cache.layers)
    ctx.save_table(dep, "dep_heads")
    ctx.save_table(off, "dep_offsets")
    ctx.save_table(table, "dep_table")
    ctx.save_table(relation_map(), "relation_map")
    ctx.save_figure(bar_figure(table), "dep_table")
    report = table[table.relation.isin(["all", *report_relations])] if report_relations else table
    ctx.log_summary(dict(
        analysis="dep_heads", split=split, encoder=ctx.encoder.name, maps=cache.manifest["maps"],
        heads_per_layer=cache.num_heads, causal=causal, n_sentences=acc.n_sentences,
        n_skipped=len(sentences) - acc.n_sentences, cache=str(cache.path), seconds=round(time.time() - t0, 1),
        table={r.relation: dict(count=int(r["count"]), name=r["name"], direction=r.direction,
                                accuracy=round(r.accuracy, 4), best_offset=int(r.best_offset),
                                offset_accuracy=round(r.offset_accuracy, 4),
                                head_before=round(r.head_before, 4))
               for _, r in report.iterrows()}))
    log.info("dep_heads: %d sentences, %d relations in %.1fs", acc.n_sentences, len(table), time.time() - t0)
    return table
