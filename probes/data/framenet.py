"""FrameNet 1.7 full-text annotation (the release's ``fulltext/*.xml``, or NLTK's ``framenet_v17`` folder).

Each ``<sentence>`` of a full-text document holds its ``<text>`` and ``<annotationSet>`` elements: the
first (``status="UNANN"``) carries the part-of-speech layer (``PENN`` or ``BNC``) whose labels are the
sentence's tokens; every other set with a ``luName`` / ``frameName`` annotates one frame-evoking
lexical unit: a ``Target`` layer (one label per piece of the target, several for a discontinuous
target such as "take ... off") and ``FE`` layers (rank 1 is the primary annotation; a frame element
with several labels is discontinuous; labels without ``start`` are null instantiations). Label
offsets are 0-based character positions with an **inclusive** ``end`` (NLTK's reader uses
``end + 1``). Whether a frame element is core comes from the frame's ``frame/<Frame>.xml``
(``<FE name=... coreType="Core">``), else from a ``coreType`` attribute on the label itself.

Character spans become word spans through the tokens of the POS layer (a regular-expression
tokenizer when a sentence has none): a word belongs to a span when they share a character.

The release: request FrameNet 1.7 from https://framenet.icsi.berkeley.edu (data download) and
unpack it, or with NLTK ``python -m nltk.downloader framenet_v17`` (``~/nltk_data/corpora/framenet_v17``);
then ``${paths.data_dir}/framenet`` must hold (or link to) the folder with ``fulltext/`` and ``frame/``.
"""

from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

NS = "{http://framenet.icsi.berkeley.edu}"
CORE_TYPES = ("Core", "Core-Unexpressed")
POS_LAYERS = ("PENN", "BNC")
# where the release may sit below ${data_dir}/framenet
LAYOUTS = (".", "framenet_v17", "fndata-1.7")
HOW_TO_GET = ("FrameNet 1.7 is licensed data that is not downloaded automatically: request it from "
              "https://framenet.icsi.berkeley.edu (data download) and unpack it there, or run "
              "`python -m nltk.downloader framenet_v17` and link ~/nltk_data/corpora/framenet_v17 to that "
              "path; the folder must hold fulltext/*.xml and frame/*.xml")
_WORD = re.compile(r"\w+(?:[-'’]\w+)*|[^\w\s]")


@dataclass(frozen=True)
class FrameLink:
    """One lexical unit -> core frame element link of a sentence (spans: sorted word indices)."""

    frame: str
    lu: str
    fe: str
    core_type: str
    target_chars: tuple[tuple[int, int], ...]    # (start, end exclusive) per target piece
    element_chars: tuple[tuple[int, int], ...]   # (start, end exclusive) per frame-element piece
    target: tuple[int, ...]                      # word indices of the target
    element: tuple[int, ...]                     # word indices of the frame element
    annotation_id: str = ""


@dataclass
class FrameSentence:
    """A full-text sentence: its words (with character spans) and its core-FE links."""

    id: str
    document: str
    text: str
    words: list[str]
    word_chars: list[tuple[int, int]]            # (start, end exclusive) per word
    links: list[FrameLink] = field(default_factory=list)


def _tag(elt) -> str:
    return elt.tag[len(NS):] if elt.tag.startswith(NS) else elt.tag


def _children(elt, name: str):
    return [c for c in elt if _tag(c) == name]


def framenet_root(data_dir: str | Path) -> Path:
    """The folder holding ``fulltext/`` under ``<data_dir>/framenet`` (itself, or ``framenet_v17/`` /
    ``fndata-1.7/`` inside it); FileNotFoundError naming the path and how to obtain the release."""
    base = Path(data_dir).expanduser() / "framenet"
    for sub in LAYOUTS:
        root = (base / sub).resolve()
        if (root / "fulltext").is_dir() and any((root / "fulltext").glob("*.xml")):
            return root
    raise FileNotFoundError(f"FrameNet 1.7 full-text annotation not found: no {base}/fulltext/*.xml "
                            f"(also tried {', '.join(str(base / s / 'fulltext') for s in LAYOUTS[1:])}). {HOW_TO_GET}")


class CoreTypes:
    """``coreType`` of (frame, FE) from ``frame/<Frame>.xml``, read once per frame on demand."""

    def __init__(self, frame_dir: Path | None):
        self.frame_dir = frame_dir
        self._frames: dict[str, dict[str, str] | None] = {}

    def get(self, frame: str, fe: str) -> str | None:
        if frame not in self._frames:
            self._frames[frame] = self._read(frame)
        types = self._frames[frame]
        return None if types is None else types.get(fe)

    def _read(self, frame: str) -> dict[str, str] | None:
        if self.frame_dir is None:
            return None
        path = self.frame_dir / f"{frame}.xml"
        if not path.is_file():
            return None
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise ValueError(f"{path}: not well-formed XML ({e})") from e
        return {fe.get("name"): fe.get("coreType") for fe in _children(root, "FE")}


def tokenize(text: str) -> list[tuple[int, int]]:
    """(start, end exclusive) of words and punctuation marks, for sentences without a POS layer."""
    return [m.span() for m in _WORD.finditer(text)]


def _int(label, key: str, where: str) -> int:
    try:
        return int(label.get(key))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: label {label.get('name')!r} has no integer {key}= ({label.get(key)!r})") from None


def _spans(layer, text: str, where: str) -> list[tuple[str, int, int, dict]]:
    """(name, start, end exclusive, attributes) of the overt labels of a layer, checked against the text."""
    out = []
    for lab in _children(layer, "label"):
        if lab.get("start") is None:
            continue  # null instantiation (itype=CNI/DNI/INI) or an empty label
        s, e = _int(lab, "start", where), _int(lab, "end", where) + 1
        if not 0 <= s < e <= len(text):
            raise ValueError(f"{where}: label {lab.get('name')!r} [{s}, {e - 1}] outside the text of {len(text)} "
                             f"characters")
        out.append((lab.get("name"), s, e, dict(lab.attrib)))
    return out


def _words_of(chars: tuple[tuple[int, int], ...], word_chars: list[tuple[int, int]]) -> tuple[int, ...]:
    """Indices of the words sharing at least one character with any of the spans."""
    return tuple(i for i, (ws, we) in enumerate(word_chars) if any(ws < e and s < we for s, e in chars))


def read_fulltext(path: str | Path, core_types: CoreTypes | None = None, keep: tuple[str, ...] | None = CORE_TYPES
                  ) -> list[FrameSentence]:
    """Sentences of one ``fulltext/*.xml`` file with their LU -> FE links.

    keep: core types whose frame elements become links (None: every frame element). A frame element
    whose core type is unknown (no frame file, no ``coreType`` on the label) is an error when ``keep``
    is set."""
    path = Path(path)
    core_types = core_types or CoreTypes(None)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ValueError(f"{path}: not well-formed XML ({e})") from e
    if _tag(root) != "fullTextAnnotation":
        raise ValueError(f"{path}: root element is <{_tag(root)}>, expected <fullTextAnnotation> (FrameNet full text)")
    sentences = []
    for sent in _children(root, "sentence"):
        sid = sent.get("ID", "?")
        where = f"{path} sentence ID={sid}"
        texts = _children(sent, "text")
        if not texts:
            raise ValueError(f"{where}: no <text>")
        text = texts[0].text or ""
        sets = _children(sent, "annotationSet")
        word_chars = None
        for aset in sets:  # the POS layer of the unannotated set gives the tokens
            for layer in _children(aset, "layer"):
                if layer.get("name") in POS_LAYERS and word_chars is None:
                    word_chars = [(s, e) for _, s, e, _ in _spans(layer, text, where)]
        word_chars = sorted(set(word_chars)) if word_chars else tokenize(text)
        fs = FrameSentence(sid, path.stem, text, [text[s:e] for s, e in word_chars], word_chars)
        for aset in sets:
            frame, lu = aset.get("frameName"), aset.get("luName")
            if not frame or not lu:
                continue  # the POS set, or a construction annotation
            layers = _children(aset, "layer")
            target = tuple(sorted((s, e) for layer in layers if layer.get("name") == "Target"
                                  for _, s, e, _ in _spans(layer, text, where)))
            if not target:
                continue
            pieces: dict[str, list] = {}
            for layer in layers:
                if layer.get("name") == "FE" and layer.get("rank", "1") == "1":
                    for name, s, e, attrs in _spans(layer, text, where):
                        pieces.setdefault(name, []).append((s, e, attrs.get("coreType")))
            for fe, parts in pieces.items():
                ctype = core_types.get(frame, fe) or next((c for _, _, c in parts if c), None)
                if keep is not None:
                    if ctype is None:
                        raise ValueError(f"{where}: core type of frame element {fe!r} of frame {frame!r} unknown: "
                                         f"no frame/{frame}.xml defines it and the label has no coreType=")
                    if ctype not in keep:
                        continue
                chars = tuple(sorted((s, e) for s, e, _ in parts))
                fs.links.append(FrameLink(frame, lu, fe, ctype or "", target, chars, _words_of(target, word_chars),
                                          _words_of(chars, word_chars), aset.get("ID", "")))
        sentences.append(fs)
    return sentences


def read_framenet(data_dir: str | Path, documents: list[str] | None = None, max_sentences: int | None = None,
                  keep: tuple[str, ...] | None = CORE_TYPES) -> list[FrameSentence]:
    """Sentences of every ``fulltext/*.xml`` under ``<data_dir>/framenet`` (sorted by file name; or
    only the named ``documents`` stems), with their links; the first ``max_sentences`` (None: all)."""
    root = framenet_root(data_dir)
    frame_dir = root / "frame" if (root / "frame").is_dir() else None
    if frame_dir is None:
        log.warning("%s has no frame/ folder: core types come from the labels' coreType attributes", root)
    files = sorted((root / "fulltext").glob("*.xml"))
    if documents:
        want = set(documents)
        files = [f for f in files if f.stem in want]
        missing = want - {f.stem for f in files}
        if missing:
            raise FileNotFoundError(f"{root / 'fulltext'}: no document(s) {sorted(missing)}")
    core = CoreTypes(frame_dir)
    out: list[FrameSentence] = []
    for f in files:
        out += read_fulltext(f, core, keep)
        if max_sentences is not None and len(out) >= max_sentences:
            return out[:max_sentences]
    return out
