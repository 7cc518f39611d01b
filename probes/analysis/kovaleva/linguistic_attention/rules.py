"""Token kinds and token-to-token relations of :mod:`probes.analysis.kovaleva.linguistic_attention`: the rules
over word labels (the package doc) and the piece groups they pick in one example."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    """(source pieces, target pieces) of every linked word pair of one relation (see the package doc)."""
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
