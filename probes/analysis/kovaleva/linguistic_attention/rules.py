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


def _compile(rule) -> list[list[tuple[str, object]]]:
    """A kind's rule as clauses of (key, wanted) with the wanted values as sets, built once per rule (a word is
    then checked without rebuilding them)."""
    out = []
    for clause in clauses(rule):
        keys = []
        for key, want in clause.items():
            if key == "words":
                want = {w.lower() for w in want}
            elif key not in ("special", "scheme"):
                want = set(want)
            keys.append((key, want))
        out.append(keys)
    return out


def _holds(word: Mapping, clause: list[tuple[str, object]], words: Sequence[Mapping]) -> bool:
    for key, want in clause:
        if key == "special":
            return False  # special tokens are not words
        if key == "scheme":
            ok = word.get("scheme") == want
        elif key == "words":
            ok = str(word.get("text", "")).lower() in want
        elif key == "child_deprel":
            ok = bool(set(word.get("child_deprels", ())) & want)
        elif key == "head_upos":
            h = word.get("head", -1)
            ok = h is not None and h >= 0 and words[h].get("upos") in want
        else:
            ok = word.get(key) in want
        if not ok:
            return False
    return True


def _matches(word: Mapping, compiled: list[list[tuple[str, object]]], words: Sequence[Mapping]) -> bool:
    return any(_holds(word, c, words) for c in compiled)


def _signature(word: Mapping, words: Sequence[Mapping]) -> tuple:
    """Everything of a word that a rule may read (:data:`RULE_KEYS`): its text (lowercased), upos, xpos, deprel,
    child relations, its head's upos, its scheme."""
    h = word.get("head", -1)
    return (str(word.get("text", "")).lower(), word.get("upos"), word.get("xpos"), word.get("deprel"),
            tuple(sorted(word.get("child_deprels", ()))), words[h].get("upos") if h is not None and h >= 0 else None,
            word.get("scheme"))


class _Rule:
    """A compiled rule and what it said of every word :func:`_signature` seen (the examples' words repeat)."""

    def __init__(self, rule):
        self.compiled = _compile(rule)
        self.memo: dict[tuple, bool] = {}

    def matches(self, word: Mapping, words: Sequence[Mapping], signature: tuple) -> bool:
        hit = self.memo.get(signature)
        if hit is None:
            hit = self.memo[signature] = _matches(word, self.compiled, words)
        return hit


_RULES: dict[str, _Rule] = {}


def _rule(rule) -> _Rule:
    """The :class:`_Rule` of a rule (a kind's mapping or list of clauses), one per distinct rule in this process."""
    key = repr(rule)
    if key not in _RULES:
        _RULES[key] = _Rule(rule)
    return _RULES[key]


def word_matches(word: Mapping, rule, words: Sequence[Mapping] = ()) -> bool:
    """Does one word (dict: text, upos, xpos, deprel, head, child_deprels, scheme) satisfy a kind's rule?
    ``words``: the example's words (for ``head_upos``)."""
    return _matches(word, _compile(rule), words)


def _pieces_of(word_of_piece: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, w in enumerate(word_of_piece):
        if w is not None and w >= 0:
            out.setdefault(int(w), []).append(j)
    return out


def word_signatures(words: Sequence[Mapping]) -> list[tuple]:
    """What a rule may read of each word of one example (computed once, handed to :func:`feature_groups` and
    :func:`relation_pairs`, whose rules remember their answer per signature)."""
    return [_signature(w, words) for w in words]


_NO_HEAD = object()  # the head upos of a word without a head: in no rule's wanted values


def rule_matrix(words_of: Sequence[Sequence[Mapping]], rules: Sequence) -> np.ndarray:
    """(W, len(rules)) bool: does each word of every example (``words_of``: the examples' words; W of them in all,
    example by example) satisfy each rule, as :func:`word_matches` (a ``special`` clause never matches a word).

    Vectorised over the words: every label a rule may read (:data:`RULE_KEYS`) is coded once per word as an integer
    (text lowercased, upos, xpos, deprel, scheme, the head's upos; the child relations as (word, code) pairs), and
    each clause is a conjunction of ``isin`` tests on the codes."""
    flat = [(w, words) for words in words_of for w in words]
    W = len(flat)

    def coded(values) -> tuple[np.ndarray, dict]:
        table: dict = {}
        return np.fromiter((table.setdefault(v, len(table)) for v in values), np.int64, count=W), table

    def head_upos(w: Mapping, words: Sequence[Mapping]):
        h = w.get("head", -1)
        return words[h].get("upos") if h is not None and h >= 0 else _NO_HEAD

    fields = {"words": coded(str(w.get("text", "")).lower() for w, _ in flat),
              "head_upos": coded(head_upos(w, words) for w, words in flat)}
    child_word, child_code, child_table = [], [], {}
    for i, (w, _) in enumerate(flat):
        for d in w.get("child_deprels", ()):
            child_word.append(i)
            child_code.append(child_table.setdefault(d, len(child_table)))
    child_word, child_code = np.asarray(child_word, dtype=np.int64), np.asarray(child_code, dtype=np.int64)

    def field(key: str) -> tuple[np.ndarray, dict]:
        if key not in fields:
            fields[key] = coded(w.get(key) for w, _ in flat)
        return fields[key]

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
                ok = isin(*fields["words"], {str(x).lower() for x in want})
            elif key == "child_deprel":
                ok = np.zeros(W, dtype=bool)
                ok[child_word[isin(child_code, child_table, set(want))]] = True
            elif key == "head_upos":
                ok = isin(*fields["head_upos"], set(want))
            else:
                ok = isin(*field(key), set(want))
            m &= ok
        return m

    out = np.zeros((W, len(rules)), dtype=bool)  # (W, R)
    for r, rule in enumerate(rules):
        for clause in clauses(rule):
            out[:, r] |= clause_mask(clause)
    return out


def feature_groups(input_ids: Sequence[int], word_of_piece: Sequence[int], words: Sequence[Mapping],
                   features: Mapping, cls_id: int, sep_id: int, signatures: Sequence[tuple] | None = None
                   ) -> dict[str, list[list[int]]]:
    """kind -> list of piece-index groups (one group per qualifying word; [CLS]/[SEP] one piece each);
    ``signatures``: :func:`word_signatures` of ``words`` (None: computed here)."""
    pieces_of = _pieces_of(word_of_piece)
    signature = signatures if signatures is not None else word_signatures(words)
    out: dict[str, list[list[int]]] = {}
    for name, rule in features.items():
        cl = clauses(rule)
        special = next((c["special"] for c in cl if "special" in c), None)
        if special is not None:
            tid = cls_id if special == "cls" else sep_id
            out[name] = [[j] for j, t in enumerate(input_ids) if t == tid]
        else:
            r = _rule(rule)
            out[name] = [pieces_of[w] for w in sorted(pieces_of) if r.matches(words[w], words, signature[w])]
    return out


def relation_pairs(word_of_piece: Sequence[int], words: Sequence[Mapping], relation: Mapping,
                   signatures: Sequence[tuple] | None = None) -> list[tuple[list[int], list[int]]]:
    """(source pieces, target pieces) of every linked word pair of one relation (see the package doc);
    ``signatures``: :func:`word_signatures` of ``words`` (None: computed here)."""
    pieces_of = _pieces_of(word_of_piece)
    present = sorted(pieces_of)
    signature = signatures if signatures is not None else word_signatures(words)
    source = _rule(relation["source"])
    target = _rule(relation["target"]) if relation.get("target") else None
    src = [w for w in present if source.matches(words[w], words, signature[w])]
    pairs = []
    if relation.get("link", "head") == "head":
        for w in src:
            h = words[w].get("head", -1)
            if h is None or h < 0 or h not in pieces_of:
                continue
            if target is not None and not target.matches(words[h], words, signature[h]):
                continue
            pairs.append((w, h))
    elif relation["link"] == "any":
        tgt = [w for w in present if _rule(relation["target"]).matches(words[w], words, signature[w])]
        pairs = [(a, b) for a in src for b in tgt if a != b]
    else:
        raise ValueError(f"relation link must be 'head' or 'any', got {relation['link']!r}")
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
        miss = {f: (plain(missing_by_feature) or {}).get(f, missing) for f in features}
        return cls(feature_set, features, rels, piece_pooling, miss, relation_missing)
