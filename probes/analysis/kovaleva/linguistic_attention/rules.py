"""Token kinds and token-to-token relations of :mod:`probes.analysis.kovaleva.linguistic_attention`: the rules
over word labels (the package doc) and the piece groups they pick in one example."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from probes.config import plain

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


_NO_HEAD = object()  # the head upos of a word without a head: in no rule's wanted values


def rule_matrix(words_of: Sequence[Sequence[Mapping]], rules: Sequence) -> np.ndarray:
    """(W, len(rules)) bool: does each word of every example (``words_of``: the examples' words; W of them in all,
    example by example) satisfy each rule. A rule is a list of clauses (:func:`clauses`) and holds when one clause
    does; a clause holds when every key does: ``upos`` / ``xpos`` / ``deprel`` (the word's label is one of those
    given), ``words`` (its text, lowercased, is one of them), ``child_deprel`` (one of its children has one of those
    relations), ``head_upos`` (it has a head, whose upos is one of them), ``scheme`` (its label scheme equals the
    one given); a ``special`` clause never holds for a word.

    Vectorised over the words: every label a rule reads is coded once per word as an integer (the child relations
    as (word, code) pairs), and each clause is a conjunction of ``isin`` tests on the codes."""
    flat = [(w, words) for words in words_of for w in words]
    W = len(flat)

    def head_upos(w: Mapping, words: Sequence[Mapping]):
        h = w.get("head", -1)
        return words[h].get("upos") if h is not None and h >= 0 else _NO_HEAD

    label = {"words": lambda w, words: str(w.get("text", "")).lower(), "head_upos": head_upos}
    fields: dict[str, tuple[np.ndarray, dict]] = {}

    def field(key: str) -> tuple[np.ndarray, dict]:
        """(W,) the code of every word's ``key`` label, and the code of every value (coded when a rule reads it)."""
        if key not in fields:
            table: dict = {}
            read = label.get(key, lambda w, words: w.get(key))
            fields[key] = (np.fromiter((table.setdefault(read(w, words), len(table)) for w, words in flat), np.int64,
                                       count=W), table)
        return fields[key]

    child_word, child_code, child_table = [], [], {}
    for i, (w, _) in enumerate(flat):
        for d in w.get("child_deprels", ()):
            child_word.append(i)
            child_code.append(child_table.setdefault(d, len(child_table)))
    child_word, child_code = np.asarray(child_word, dtype=np.int64), np.asarray(child_code, dtype=np.int64)

    def isin(codes: np.ndarray, table: dict, wanted) -> np.ndarray:
        return np.isin(codes, [table[v] for v in wanted if v in table])

    def clause_mask(clause: Mapping) -> np.ndarray:
        m = np.ones(W, dtype=bool)
        for key, want in clause.items():
            if key == "special":
                return np.zeros(W, dtype=bool)  # special tokens are not words
            if key == "scheme":
                codes, table = field("scheme")
                try:
                    ok = codes == table[want] if want in table else np.zeros(W, dtype=bool)
                except TypeError:  # an unhashable wanted value equals no word's scheme
                    ok = np.zeros(W, dtype=bool)
            elif key == "words":
                ok = isin(*field("words"), {str(x).lower() for x in want})
            elif key == "child_deprel":
                ok = np.zeros(W, dtype=bool)
                ok[child_word[isin(child_code, child_table, set(want))]] = True
            else:  # upos, xpos, deprel, head_upos
                ok = isin(*field(key), set(want))
            m &= ok
        return m

    out = np.zeros((W, len(rules)), dtype=bool)  # (W, R)
    for r, rule in enumerate(rules):
        for clause in clauses(rule):
            out[:, r] |= clause_mask(clause)
    return out


def word_matches(word: Mapping, rule, words: Sequence[Mapping] = ()) -> bool:
    """Does one word (dict: text, upos, xpos, deprel, head, child_deprels, scheme) satisfy a kind's rule
    (:func:`rule_matrix`)? ``words``: the example's words (for ``head_upos``)."""
    at = next((k for k, w in enumerate(words) if w is word), None)
    example = list(words) if at is not None else [*words, word]
    return bool(rule_matrix([example], [rule])[len(words) if at is None else at, 0])


def _pieces_of(word_of_piece: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, w in enumerate(word_of_piece):
        if w is not None and w >= 0:
            out.setdefault(int(w), []).append(j)
    return out


def feature_groups(input_ids: Sequence[int], word_of_piece: Sequence[int], words: Sequence[Mapping],
                   features: Mapping, cls_id: int, sep_id: int) -> dict[str, list[list[int]]]:
    """kind -> list of piece-index groups (one group per qualifying word, :func:`rule_matrix`; [CLS]/[SEP] one piece
    each)."""
    pieces_of = _pieces_of(word_of_piece)
    names = list(features)
    matches = rule_matrix([words], [features[name] for name in names])  # (n, K)
    out: dict[str, list[list[int]]] = {}
    for k, name in enumerate(names):
        special = next((c["special"] for c in clauses(features[name]) if "special" in c), None)
        if special is not None:
            tid = cls_id if special == "cls" else sep_id
            out[name] = [[j] for j, t in enumerate(input_ids) if t == tid]
        else:
            out[name] = [pieces_of[w] for w in sorted(pieces_of) if matches[w, k]]
    return out


def check_relation(relation: Mapping, where: str = "relation") -> None:
    """A ValueError naming ``where`` unless ``relation`` has a source rule, a link ``head`` or ``any`` (``any``
    with a target rule) and rules of known keys (:func:`clauses`)."""
    if "source" not in relation:
        raise ValueError(f"{where}: no source rule")
    link = relation.get("link", "head")
    if link not in ("head", "any"):
        raise ValueError(f"{where}.link must be 'head' or 'any', got {link!r}")
    if link == "any" and not relation.get("target"):
        raise ValueError(f"{where}: a relation of link 'any' needs a target rule")
    for end in ("source", "target"):
        if relation.get(end):
            clauses(relation[end])  # unknown rule keys


def relation_pairs(word_of_piece: Sequence[int], words: Sequence[Mapping], relation: Mapping
                   ) -> list[tuple[list[int], list[int]]]:
    """(source pieces, target pieces) of every linked word pair of one relation (see the package doc;
    :func:`rule_matrix`)."""
    check_relation(relation)
    pieces_of = _pieces_of(word_of_piece)
    present = sorted(pieces_of)
    link = relation.get("link", "head")
    ends = [relation["source"]] + ([relation["target"]] if relation.get("target") else [])
    matches = rule_matrix([words], ends)  # (n, 1 or 2) source (, target)
    src = [w for w in present if matches[w, 0]]
    pairs = []
    if link == "head":
        for w in src:
            h = words[w].get("head", -1)
            if h is None or h < 0 or h not in pieces_of:
                continue
            if len(ends) > 1 and not matches[h, 1]:
                continue
            pairs.append((w, h))
    else:
        tgt = [w for w in present if matches[w, 1]]
        pairs = [(a, b) for a in src for b in tgt if a != b]
    if relation.get("reverse"):
        pairs = [(b, a) for a, b in pairs]
    return [(pieces_of[a], pieces_of[b]) for a, b in pairs]


@dataclass(frozen=True)
class KindRules:
    """The token kinds and token-to-token relations scored, and how (see the package doc)."""

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
        ``feature_sets`` / ``relations``: this module's Kovaleva and project sets / :data:`KOVALEVA_RELATIONS`)."""
        sets = plain(feature_sets) or {"kovaleva": KOVALEVA_FEATURES, "project": PROJECT_FEATURES}
        if features is None:
            if feature_set not in sets:
                raise ValueError(f"analysis.feature_set={feature_set!r} is not in analysis.feature_sets "
                                 f"({sorted(sets)})")
            features = sets[feature_set]
        features = {k: clauses(v) for k, v in plain(features).items()}
        rels = {k: dict(v) for k, v in (plain(relations) if relations is not None else KOVALEVA_RELATIONS).items()}
        for name, rel in rels.items():  # refused here, before any model is loaded
            check_relation(rel, f"analysis.relations.{name}")
        miss = {f: (plain(missing_by_feature) or {}).get(f, missing) for f in features}
        return cls(feature_set, features, rels, piece_pooling, miss, relation_missing)
