"""Documents: running text with its sentences, read from a string, a list of sentences, a treebank's documents
(CoNLL-U ``# newdoc id``), LitBank (CoNLL-2012) or a text file, and encoded by the model's own tokenizer.

A :class:`Document` is its text and the character span of every sentence (the units maps are pooled to). Sentences
given as words are joined by single spaces, and sentences by single spaces, into one running text (the rule of
:func:`probes.model.inputs.encode_words`). :func:`encode_document` runs the model's own tokenizer on the whole
text (its special tokens included) and gives every piece to the sentence and the word (whitespace-separated
token) its first non-space character lies in; the first special token goes with the first sentence and a last
special with the last. :func:`running_text` joins whole documents (in order) and cuts the text after the last
whole sentence that keeps it within a number of pieces (long-context analyses, ``bench/long_context.py``).
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from probes.data.conllu import read_conllu
from probes.data.coref import read_litbank
from probes.model.inputs import Encoded

PUNCT = frozenset({".", ","})  # the pieces HeadStats' ``punct`` counts (Clark et al.'s punctuation)


@dataclass(frozen=True)
class Document:
    """One document as running text.

    Attributes:
        text: The running text.
        sentences: (start, end) character span of every sentence, in order, non-overlapping.
        name: How messages name it (a doc id, a file, ``"text"``).
    """

    text: str
    sentences: tuple[tuple[int, int], ...]
    name: str = "text"

    def __post_init__(self):
        if not self.text.strip():
            raise ValueError(f"document {self.name!r} is empty")
        end = 0
        for k, (a, b) in enumerate(self.sentences):
            if not end <= a < b <= len(self.text):
                raise ValueError(f"document {self.name!r}: sentence {k} spans characters {a}..{b}, expected "
                                 f"{end} <= start < end <= {len(self.text)} (in order, not overlapping)")
            end = b
        if not self.sentences:
            raise ValueError(f"document {self.name!r} has no sentence")

    @property
    def n_sentences(self) -> int:
        return len(self.sentences)

    def sentence_texts(self) -> list[str]:
        """The text of every sentence."""
        return [self.text[a:b] for a, b in self.sentences]

    @classmethod
    def from_text(cls, text: str, sentences: Sequence[str] | None = None, name: str = "text") -> Document:
        """A string: one sentence (the whole text) unless ``sentences`` (their texts, in order, each found in
        ``text`` after the one before) are given."""
        if not isinstance(text, str):
            raise TypeError(f"document {name!r}: expected a string, got {type(text).__name__}")
        if sentences is None:
            stripped = text.strip()
            start = text.index(stripped[:1]) if stripped else 0
            return cls(text, ((start, start + len(stripped)),), name)
        spans, at = [], 0
        for k, s in enumerate(sentences):
            s = s.strip()
            i = text.find(s, at) if s else -1
            if i < 0:
                raise ValueError(f"document {name!r}: sentence {k} ({s[:40]!r}) is not in the text after character "
                                 f"{at}")
            spans.append((i, i + len(s)))
            at = i + len(s)
        return cls(text, tuple(spans), name)

    @classmethod
    def from_sentences(cls, sentences: Sequence[str | Sequence[str]], name: str = "text") -> Document:
        """Sentences (strings, or lists of words joined by single spaces) joined by single spaces."""
        if isinstance(sentences, str):
            raise TypeError("sentences must be a list of sentences; for one text use Document.from_text")
        texts = []
        for k, s in enumerate(sentences):
            t = s if isinstance(s, str) else " ".join(str(w) for w in s)
            t = " ".join(t.split())
            if not t:
                raise ValueError(f"document {name!r}: sentence {k} is empty")
            texts.append(t)
        if not texts:
            raise ValueError(f"document {name!r} has no sentence")
        spans, at = [], 0
        for t in texts:
            spans.append((at, at + len(t)))
            at += len(t) + 1
        return cls(" ".join(texts), tuple(spans), name)


def join_documents(docs: Sequence[Document], name: str | None = None) -> Document:
    """Documents, in order, joined by single spaces into one running text (their sentences kept)."""
    if not docs:
        raise ValueError("no documents to join")
    parts, spans, at = [], [], 0
    for d in docs:
        parts.append(d.text)
        spans.extend((a + at, b + at) for a, b in d.sentences)
        at += len(d.text) + 1
    return Document(" ".join(parts), tuple(spans), name or "+".join(d.name for d in docs))


def read_conllu_documents(path: str | os.PathLike) -> list[Document]:
    """The documents of a CoNLL-U file in file order (``# newdoc id`` boundaries; sentences before any ``newdoc``
    form one document named after the file), each sentence its words joined by single spaces."""
    groups: list[tuple[str, list[Sequence[str]]]] = []
    for s in read_conllu(path, trees=False):
        doc_id = s.doc_id or Path(path).name
        if not groups or groups[-1][0] != doc_id or any(line.startswith("# newdoc") for line in s.lines):
            groups.append((doc_id, []))
        groups[-1][1].append(s.words)
    if not groups:
        raise ValueError(f"{path}: no sentences")
    return [Document.from_sentences(sents, name=doc_id) for doc_id, sents in groups]


def read_litbank_documents(conll_dir: str | os.PathLike, max_files: int | None = None) -> list[Document]:
    """LitBank's documents (every ``*.conll`` of ``conll_dir``, sorted by file name; the first ``max_files``),
    sentences from its blank lines (:func:`probes.data.coref.read_litbank`)."""
    return [Document.from_sentences([s.words for s in d.sentences], name=d.doc_id)
            for d in read_litbank(conll_dir, max_files)]


def read_text_document(path: str | os.PathLike, lines: bool = True) -> Document:
    """A UTF-8 text file as one document: each non-blank line a sentence (``lines``), or the whole file one
    sentence."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if not lines:
        return Document.from_text(text, name=str(path))
    sents = [line for line in text.splitlines() if line.strip()]
    if not sents:
        raise ValueError(f"{path}: no text")
    return Document.from_sentences(sents, name=str(path))


class DocumentSource:
    """Where whole documents come from (a config object: ``conf/analysis/long_context.yaml``'s ``sources``); read
    on :meth:`read`.

    Args:
        reader: ``conllu`` (:func:`read_conllu_documents`), ``litbank`` (:func:`read_litbank_documents`) or
            ``text`` (:func:`read_text_document`).
        path: The file (or LitBank's folder of ``*.conll``).
    """

    READERS = {"conllu": read_conllu_documents, "litbank": read_litbank_documents,
               "text": lambda p: [read_text_document(p)]}

    def __init__(self, reader: str, path: str | os.PathLike):
        if reader not in self.READERS:
            raise ValueError(f"reader {reader!r}: expected one of {sorted(self.READERS)}")
        self.reader, self.path = reader, Path(path)

    def read(self) -> list[Document]:
        """The documents, in order."""
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such file or folder (documents, reader {self.reader})")
        return self.READERS[self.reader](self.path)

    def __repr__(self) -> str:
        return f"DocumentSource({self.reader!r}, {str(self.path)!r})"


@dataclass
class EncodedDocument:
    """A document in the model's pieces.

    Attributes:
        document: The document.
        encoded: The pieces (specials included); ``word_of_piece``: -1 the first special(s), 0..n-1 the words
            (whitespace-separated tokens), n the last special(s).
        sentence_of_piece: (T,) the sentence of every piece (specials: first / last sentence).
        punct: (T,) whether a piece reads ``.`` or ``,`` (:data:`PUNCT`).
        words: The words' texts.
    """

    document: Document
    encoded: Encoded
    sentence_of_piece: list[int]
    punct: list[bool]
    words: list[str]

    @property
    def n_pieces(self) -> int:
        return self.encoded.n_pieces


def encode_document(tokenizer, doc: Document) -> EncodedDocument:
    """``doc`` through the model's own (fast) tokenizer with its special tokens, every piece given to the sentence
    and word of its first non-space character (module doc)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__}: documents need a fast (tokenizers) tokenizer, whose character "
                        "offsets map pieces to sentences")
    enc = tokenizer(doc.text, add_special_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True,
                    verbose=False)
    ids, offsets, special = list(enc["input_ids"]), enc["offset_mapping"], enc["special_tokens_mask"]
    word_spans = [m.span() for m in re.finditer(r"\S+", doc.text)]
    word_starts = [a for a, _ in word_spans]
    sent_starts = [a for a, _ in doc.sentences]
    text = doc.text
    n_words, S = len(word_spans), doc.n_sentences
    word_of_piece, sentence, punct, seen_text = [], [], [], False
    for (a, b), sp in zip(offsets, special):
        if sp:
            word_of_piece.append(n_words if seen_text else -1)
            sentence.append(S - 1 if seen_text else 0)
            punct.append(False)
            continue
        seen_text = True
        c = min(a, len(text) - 1)  # a piece of no characters (a lone space marker): the character it stands before
        while c < b - 1 and text[c].isspace():
            c += 1
        word_of_piece.append(max(0, bisect.bisect_right(word_starts, c) - 1))
        sentence.append(max(0, bisect.bisect_right(sent_starts, c) - 1))
        punct.append(text[a:b].strip() in PUNCT)
    if not seen_text:
        raise ValueError(f"document {doc.name!r}: the tokenizer gives no piece of its text")
    return EncodedDocument(doc, Encoded(ids, word_of_piece, n_words), sentence, punct,
                           [text[a:b] for a, b in word_spans])


def running_text(tokenizer, docs: Sequence[Document], length: int, name: str | None = None) -> Document:
    """Whole documents, in order, joined into one running text (:func:`join_documents`) and cut after the last
    whole sentence that keeps it within ``length`` pieces of the model's own tokenizer (its specials included).
    The text runs on into a document only as far as its whole sentences fit; documents are read until the text
    reaches ``length``."""
    if int(length) < 1:
        raise ValueError(f"length must be >= 1 piece, got {length}")
    chosen, total = [], 0
    for d in docs:  # a first guess from the documents' own lengths
        chosen.append(d)
        total += len(tokenizer(d.text, add_special_tokens=False, verbose=False)["input_ids"])
        if total > length:
            break
    if not chosen:
        raise ValueError("no documents")
    whole = join_documents(chosen)
    enc = encode_document(tokenizer, whole)
    n = len(whole.sentences)
    # the last sentence whose pieces all lie within the first ``length`` pieces (specials after it added back)
    last_of = {}
    for t, s in enumerate(enc.sentence_of_piece):
        last_of[s] = t
    trail = sum(1 for w in enc.encoded.word_of_piece if w == enc.encoded.n_words)
    keep = n
    while keep > 1 and last_of.get(keep - 1, 0) + 1 + trail > length:
        keep -= 1
    while True:  # confirm on the cut text itself (the pieces at the cut may differ): drop sentences while over
        end = whole.sentences[keep - 1][1]
        doc = Document(whole.text[:end], whole.sentences[:keep], name or f"{length} pieces of {len(chosen)} documents")
        n_pieces = len(tokenizer(doc.text, add_special_tokens=True, verbose=False)["input_ids"])
        if n_pieces <= length or keep == 1:
            break
        keep -= 1
    if n_pieces > length:
        raise ValueError(f"the first sentence of {chosen[0].name!r} alone has {n_pieces} pieces, above {length}")
    return doc
