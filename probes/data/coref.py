"""Coreference documents: GUM CoNLL-U ``Entity=`` (CorefUD), OntoGUM and LitBank CoNLL-2012 brackets.

A :class:`CorefDocument` holds its sentences (words, UPOS and UD trees where there are any) and its
mentions, each with a cluster id, a document-level word span (inclusive, may cross sentences), an
entity type (GUM only), its head word and its mention type.

Formats (see ``shared/data/SOURCES.md``):

* GUM (:func:`read_gum_coref`): CoNLL-U MISC ``Entity=``. ``(7-abstract-new-...`` opens a mention of
  cluster 7 whose fields follow ``# global.Entity = GRP-etype-...``; ``7)`` closes the most recent
  open mention of cluster 7; ``(3-abstract-...)`` is a one-word mention; several per word. Mentions may
  span lines (and sentences). Discontinuous parts (``[1/2]``) are read as separate mentions.
* CoNLL-2012 (:func:`read_conll2012`): last column ``(12`` / ``12)`` / ``(12)`` joined by ``|``;
  ``#begin document`` / ``#end document`` blocks. OntoGUM has 3 columns (index, word, coref) and no
  sentence breaks, so :func:`read_ontogum` aligns each document to the UD GUM words of the same doc
  (sentences, UPOS and trees from UD); LitBank has 12+ columns and blank lines between sentences.

Head words (:func:`tree_head`, :func:`heuristic_head`): with a dependency tree, the span word whose
head lies outside the span (or is the root); ties -> the leftmost. Without one (LitBank), the span is
cut before its first word (after the first) that is a preposition, a comma, a relative/complementiser
word or a participle-like ``-ing`` word, and the last alphanumeric word of that prefix is the head
(a trailing possessive ``'s`` is skipped): "the Lord Chancellor" -> Chancellor, "the old man with a
stick" -> man.

Mention types (:func:`mention_type`): pronoun if the head's UPOS is PRON (or, without UPOS, the head
is in :data:`PRONOUNS`); proper if the head's UPOS is PROPN (without UPOS: the head is capitalised and
either not sentence-initial or the span has another capitalised word); else nominal.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from probes.data.conllu import read_conllu

log = logging.getLogger(__name__)

__all__ = ["CorefError", "CorefSentence", "Mention", "CorefDocument", "parse_entity_field", "read_gum_coref",
           "read_conll2012", "read_ontogum", "read_litbank", "tree_head", "heuristic_head", "mention_type",
           "PRONOUNS", "pronoun_features"]


class CorefError(ValueError):
    """Malformed coreference annotation; message is ``"{path}:{lineno}: <problem>"``."""


# pronoun -> (person, number, gender); number "sg"/"pl"/None, gender "m"/"f"/"n"/None
_PRON_TABLE = {
    **{w: (1, "sg", None) for w in ("i", "me", "my", "mine", "myself")},
    **{w: (1, "pl", None) for w in ("we", "us", "our", "ours", "ourselves")},
    **{w: (2, None, None) for w in ("you", "your", "yours", "yourself", "yourselves", "thou", "thee", "thy",
                                    "thine", "ye")},
    **{w: (3, "sg", "m") for w in ("he", "him", "his", "himself")},
    **{w: (3, "sg", "f") for w in ("she", "her", "hers", "herself")},
    **{w: (3, "sg", "n") for w in ("it", "its", "itself")},
    **{w: (3, "pl", None) for w in ("they", "them", "their", "theirs", "themselves")},
    **{w: (3, None, None) for w in ("this", "that", "these", "those", "who", "whom", "whose", "which",
                                    "one", "oneself", "what")},
}
PRONOUNS = frozenset(_PRON_TABLE)


def pronoun_features(word: str) -> tuple[int | None, str | None, str | None]:
    """(person, number, gender) of a pronoun from the closed list; (None, None, None) if unknown."""
    w = word.lower()
    if w in ("these", "those"):
        return 3, "pl", None
    if w in ("this", "that"):
        return 3, "sg", None
    return _PRON_TABLE.get(w, (None, None, None))


@dataclass(frozen=True)
class CorefSentence:
    words: tuple[str, ...]
    upos: tuple[str, ...] | None = None  # None: no POS (LitBank)
    heads: tuple[int, ...] | None = None  # UD heads, 0 = root, else 1-based in the sentence; None: no tree
    number: tuple[str | None, ...] | None = None  # FEATS Number= (Sing/Plur) per word where known


@dataclass(frozen=True)
class Mention:
    cluster: str
    start: int  # document-level word index (inclusive)
    end: int  # inclusive
    head: int  # document-level word index of the head word
    mtype: str  # pronoun | proper | nominal
    etype: str | None = None  # entity type (GUM: person, place, ...)

    @property
    def key(self) -> tuple[int, int]:
        return (self.start, self.end)


@dataclass
class CorefDocument:
    doc_id: str
    sentences: list[CorefSentence]
    mentions: list[Mention] = field(default_factory=list)  # sorted by (start, end)

    @property
    def words(self) -> list[str]:
        return [w for s in self.sentences for w in s.words]

    @property
    def offsets(self) -> list[int]:
        """Document-level index of the first word of each sentence."""
        out, k = [], 0
        for s in self.sentences:
            out.append(k)
            k += len(s.words)
        return out

    def clusters(self) -> dict[str, list[Mention]]:
        d: dict[str, list[Mention]] = defaultdict(list)
        for m in self.mentions:
            d[m.cluster].append(m)
        return dict(d)

    def without_singletons(self) -> "CorefDocument":
        """The same document with only the mentions of clusters that have at least two mentions."""
        size = Counter(m.cluster for m in self.mentions)
        return CorefDocument(self.doc_id, self.sentences, [m for m in self.mentions if size[m.cluster] > 1])


# ----------------------------------------------------------------------------- heads and types
def _doc_heads(sentences: list[CorefSentence]) -> list[int] | None:
    """Document-level head index of every word (-1 = root); None if any sentence has no tree."""
    if any(s.heads is None for s in sentences):
        return None
    out, k = [], 0
    for s in sentences:
        out.extend(-1 if h == 0 else k + h - 1 for h in s.heads)
        k += len(s.words)
    return out


def tree_head(start: int, end: int, heads: list[int]) -> int:
    """The word of ``[start, end]`` whose head is outside the span (root counts); ties: the leftmost."""
    for i in range(start, end + 1):
        if not start <= heads[i] <= end:
            return i
    return start  # a cycle cannot happen in a tree; keep the leftmost to be safe


_CUT = frozenset("of in on at by for with from to into about after before under over between through during "
                 "without within against among , ; : ( -- who whom whose which that where when".split())


def heuristic_head(words: list[str], start: int, end: int) -> int:
    """Head without a tree: last alphanumeric word before the first cut word (see module doc)."""
    stop = end
    for i in range(start + 1, end + 1):
        w = words[i].lower()
        if w in _CUT or (w.endswith("ing") and len(w) > 4 and i > start + 1):
            stop = i - 1
            break
    for i in range(stop, start - 1, -1):
        w = words[i].lower()
        if any(c.isalnum() for c in w) and w not in ("'s", "'", "s"):
            return i
    return stop


def mention_type(words: list[str], upos: list[str] | None, head: int, start: int, end: int,
                 sentence_starts: set[int]) -> str:
    if upos is not None:
        if upos[head] == "PRON":
            return "pronoun"
        return "proper" if upos[head] == "PROPN" else "nominal"
    w = words[head]
    if w.lower() in PRONOUNS and start == end:
        return "pronoun"
    caps = [i for i in range(start, end + 1) if words[i][:1].isupper()]
    if w[:1].isupper() and (head not in sentence_starts or len(caps) > 1):
        return "proper"
    return "nominal"


def _make_mentions(sentences: list[CorefSentence], spans: list[tuple[str, int, int, str | None]]) -> list[Mention]:
    words = [w for s in sentences for w in s.words]
    upos = None if any(s.upos is None for s in sentences) else [u for s in sentences for u in s.upos]
    heads = _doc_heads(sentences)
    starts, k = set(), 0
    for s in sentences:
        starts.add(k)
        k += len(s.words)
    out = []
    for cluster, a, b, etype in sorted(set(spans), key=lambda t: (t[1], t[2], t[0])):
        h = tree_head(a, b, heads) if heads is not None else heuristic_head(words, a, b)
        out.append(Mention(cluster, a, b, h, mention_type(words, upos, h, a, b, starts), etype))
    return out


# ----------------------------------------------------------------------------- GUM (CorefUD Entity=)
_ENTITY_RE = re.compile(r"\(([^()]+)\)|\(([^()]+)|([^()]+)\)")


def parse_entity_field(value: str) -> list[tuple[str, str, list[str]]]:
    """Events of one ``Entity=`` value, in order: ``("open"|"single"|"close", cluster, fields)``."""
    events, pos = [], 0
    value = value.strip()
    while pos < len(value):
        m = _ENTITY_RE.match(value, pos)
        if m is None:
            raise ValueError(f"cannot parse Entity value {value!r} at character {pos}")
        single, opened, closed = m.groups()
        body = single if single is not None else opened if opened is not None else closed
        fields = body.split("-")
        cid = re.sub(r"\[.*?\]", "", fields[0])
        if not cid:
            raise ValueError(f"empty cluster id in Entity value {value!r}")
        kind = "single" if single is not None else "open" if opened is not None else "close"
        events.append((kind, cid, fields))
        pos = m.end()
    return events


def _misc_entity(misc: str) -> str | None:
    for part in misc.split("|"):
        if part.startswith("Entity="):
            return part[len("Entity="):]
    return None


def _feat(feats: str, name: str) -> str | None:
    for kv in feats.split("|"):
        k, _, v = kv.partition("=")
        if k == name:
            return v
    return None


def read_gum_coref(path: str | os.PathLike, sentences=None) -> list[CorefDocument]:
    """Documents of a CoNLL-U file with MISC ``Entity=`` (all mentions, singletons included)."""
    path = Path(path)
    sentences = read_conllu(path) if sentences is None else sentences
    docs: list[CorefDocument] = []
    by_doc: dict[str, list] = {}
    order: list[str] = []
    for s in sentences:
        d = s.doc_id or "_"
        if d not in by_doc:
            by_doc[d] = []
            order.append(d)
        by_doc[d].append(s)
    for d in order:
        sents = by_doc[d]
        etype_pos = 1
        csents, spans = [], []
        stacks: dict[str, list[tuple[int, str | None, int]]] = defaultdict(list)
        k = 0
        for s in sents:
            numbers = []
            for j, line in enumerate(s.lines):
                if line.startswith("#"):
                    key, _, val = line[1:].partition("=")
                    if key.strip() == "global.Entity":
                        names = val.strip().split("-")
                        etype_pos = names.index("etype") if "etype" in names else 1
                    continue
                cols = line.split("\t")
                if not cols[0].isdigit():
                    continue
                lineno = s.line_no + j
                numbers.append(_feat(cols[5], "Number"))
                ent = _misc_entity(cols[9])
                if ent:
                    try:
                        events = parse_entity_field(ent)
                    except ValueError as e:
                        raise CorefError(f"{path}:{lineno}: {e}") from None
                    for kind, cid, fields in events:
                        et = fields[etype_pos] if len(fields) > etype_pos else None
                        if kind == "single":
                            spans.append((cid, k, k, et))
                        elif kind == "open":
                            stacks[cid].append((k, et, lineno))
                        else:
                            if not stacks[cid]:
                                raise CorefError(f"{path}:{lineno}: Entity closes cluster {cid} that has no open mention")
                            a, et0, _ = stacks[cid].pop()
                            spans.append((cid, a, k, et0))
                k += 1
            csents.append(CorefSentence(tuple(s.words), tuple(s.upos), tuple(s.heads), tuple(numbers)))
        for cid, st in stacks.items():
            if st:
                raise CorefError(f"{path}:{st[-1][2]}: mention of cluster {cid} opened here is never closed "
                                 f"(document {d})")
        docs.append(CorefDocument(d, csents, _make_mentions(csents, spans)))
    return docs


# ----------------------------------------------------------------------------- CoNLL-2012 brackets
@dataclass
class _RawDoc:
    doc_id: str
    sentences: list[list[str]]
    spans: list[tuple[str, int, int, str | None]]
    line_no: int


_BRACKET_RE = re.compile(r"\(([\w.]+)\)|\(([\w.]+)|([\w.]+)\)")


def _parse_brackets(value: str, k: int, stacks, spans, where: str) -> None:
    if value in ("", "_", "-"):
        return
    # "|"-separated parts (LitBank "(100|99)"); OntoGUM writes "4)3)" and "(5(6)" without separators
    items = []
    for part in value.split("|"):
        pos = 0
        while pos < len(part):
            m = _BRACKET_RE.match(part, pos)
            if m is None:
                raise CorefError(f"{where}: cannot parse coreference field {value!r}")
            pos = m.end()
            items.append(m.groups())
    for single, opened, closed in items:
        if single is not None:
            spans.append((single, k, k, None))
        elif opened is not None:
            stacks[opened].append((k, where))
        else:
            if not stacks[closed]:
                raise CorefError(f"{where}: closes cluster {closed} that has no open mention")
            a, _ = stacks[closed].pop()
            spans.append((closed, a, k, None))


def _read_conll2012_raw(path: Path) -> list[_RawDoc]:
    if not path.is_file():
        raise FileNotFoundError(f"CoNLL-2012 file not found: {path}")
    docs: list[_RawDoc] = []
    cur: _RawDoc | None = None
    stacks: dict[str, list] = defaultdict(list)
    k = 0
    word_col: int | None = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            where = f"{path}:{lineno}"
            if line.startswith("#"):
                body = line[1:].strip()
                if body.startswith("begin document"):
                    if cur is not None:
                        raise CorefError(f"{where}: '#begin document' inside document {cur.doc_id}")
                    name = body[len("begin document"):].strip()
                    m = re.match(r"\((.*?)\);?\s*(?:part\s+(\d+))?", name)
                    if m:
                        name = m.group(1) + (f"_part{int(m.group(2))}" if m.group(2) and int(m.group(2)) else "")
                    cur = _RawDoc(name, [[]], [], lineno)
                    stacks, k = defaultdict(list), 0
                elif body.startswith("end document"):
                    if cur is None:
                        raise CorefError(f"{where}: '#end document' without '#begin document'")
                    for cid, st in stacks.items():
                        if st:
                            raise CorefError(f"{st[-1][1]}: mention of cluster {cid} opened here is never closed")
                    cur.sentences = [s for s in cur.sentences if s]
                    docs.append(cur)
                    cur = None
                continue
            if not line.strip():
                if cur is not None and cur.sentences[-1]:
                    cur.sentences.append([])
                continue
            if cur is None:
                raise CorefError(f"{where}: token line outside a '#begin document' block")
            cols = line.split("\t")
            if word_col is None:
                if len(cols) == 3:
                    word_col = 1
                elif len(cols) >= 12:
                    word_col = 3
                else:
                    raise CorefError(f"{where}: expected 3 (OntoGUM) or 12+ (CoNLL-2012) tab-separated "
                                     f"columns, got {len(cols)}")
            if len(cols) < word_col + 2:
                raise CorefError(f"{where}: expected at least {word_col + 2} columns, got {len(cols)}")
            cur.sentences[-1].append(cols[word_col])
            _parse_brackets(cols[-1].strip(), k, stacks, cur.spans, where)
            k += 1
    if cur is not None:
        raise CorefError(f"{path}:{cur.line_no}: document {cur.doc_id} has no '#end document'")
    return docs


def read_conll2012(path: str | os.PathLike) -> list[CorefDocument]:
    """Documents of a CoNLL-2012-style file, sentences from its blank lines, no trees (heuristic heads)."""
    out = []
    for r in _read_conll2012_raw(Path(path)):
        sents = [CorefSentence(tuple(s)) for s in r.sentences]
        out.append(CorefDocument(r.doc_id, sents, _make_mentions(sents, r.spans)))
    return out


def read_litbank(conll_dir: str | os.PathLike, max_files: int | None = None) -> list[CorefDocument]:
    """LitBank: every ``*.conll`` of ``conll_dir`` in sorted file-name order (first ``max_files``)."""
    files = sorted(Path(conll_dir).glob("*.conll"))[:max_files]
    if not files:
        raise FileNotFoundError(f"no *.conll files in {conll_dir}")
    return [d for f in files for d in read_conll2012(f)]


def read_ontogum(conll_path: str | os.PathLike, ud_path: str | os.PathLike) -> list[CorefDocument]:
    """OntoGUM CoNLL (3 columns) aligned to the UD GUM CoNLL-U of the same split (sentences, trees).

    Each OntoGUM document must have exactly the words of the UD document with the same id; a word
    that differs (SOURCES.md: one token of GUM_news_iodine is empty in OntoGUM) is logged and the UD
    word is kept; a different word count is an error naming the file and line.
    """
    conll_path = Path(conll_path)
    ud = read_conllu(ud_path)
    ud_docs: dict[str, list] = defaultdict(list)
    for s in ud:
        ud_docs[s.doc_id].append(s)
    out = []
    for r in _read_conll2012_raw(conll_path):
        if r.doc_id not in ud_docs:
            raise CorefError(f"{conll_path}:{r.line_no}: document {r.doc_id} not found in {ud_path}")
        usents = ud_docs[r.doc_id]
        uwords = [w for s in usents for w in s.words]
        cwords = [w for s in r.sentences for w in s]
        if len(uwords) != len(cwords):
            raise CorefError(f"{conll_path}:{r.line_no}: document {r.doc_id} has {len(cwords)} tokens, "
                             f"UD GUM has {len(uwords)} words")
        diff = [i for i, (a, b) in enumerate(zip(uwords, cwords)) if a != b]
        if diff:
            log.warning("%s: %s: %d token(s) differ from UD GUM (first: #%d %r vs UD %r); UD words kept",
                        conll_path, r.doc_id, len(diff), diff[0], cwords[diff[0]], uwords[diff[0]])
        sents = []
        for s in usents:
            numbers = []
            for line in s.lines:
                cols = line.split("\t")
                if not line.startswith("#") and cols[0].isdigit():
                    numbers.append(_feat(cols[5], "Number"))
            sents.append(CorefSentence(tuple(s.words), tuple(s.upos), tuple(s.heads), tuple(numbers)))
        out.append(CorefDocument(r.doc_id, sents, _make_mentions(sents, r.spans)))
    return out
