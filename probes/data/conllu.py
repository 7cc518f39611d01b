"""CoNLL-U reading (validated) and writing with predicted heads; plain text (one sentence per line) reading."""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from probes.io import atomic_write_text

__all__ = ["ConlluError", "Sentence", "read_conllu", "read_text", "sentence_from_words", "write_conllu_with_heads"]

N_COLS = 10


class ConlluError(ValueError):
    """Malformed CoNLL-U; message is ``"{path}:{lineno}: <problem>"``."""


@dataclass(frozen=True)
class Sentence:
    """One sentence block; word-level fields are aligned with ``words``."""

    sent_id: str | None
    text: str | None
    words: tuple[str, ...]  # (n,) syntactic words (multiword parts, no empty nodes)
    upos: tuple[str, ...]  # (n,)
    xpos: tuple[str, ...]  # (n,) XPOS column (language-specific tag, e.g. PTB)
    heads: tuple[int, ...]  # (n,) 0 = root, else 1-based word index
    deprels: tuple[str, ...]  # (n,)
    misc: tuple[str, ...]  # (n,) MISC column
    lines: tuple[str, ...]  # raw block lines incl. comments, no newline
    doc_id: str | None
    line_no: int  # 1-based line of the block start

    @property
    def n(self) -> int:
        return len(self.words)


def _int(s: str) -> int | None:
    return int(s) if s.isascii() and s.isdigit() else None


class _Block:
    __slots__ = ("start", "lines", "sent_id", "text", "words", "upos", "xpos", "heads",
                 "head_lines", "deprels", "misc", "range_end")

    def __init__(self, start: int):
        self.start = start
        self.lines: list[str] = []
        self.sent_id: str | None = None
        self.text: str | None = None
        self.words: list[str] = []
        self.upos: list[str] = []
        self.xpos: list[str] = []
        self.heads: list[int] = []
        self.head_lines: list[int] = []
        self.deprels: list[str] = []
        self.misc: list[str] = []
        self.range_end = 0


def _tree_problem(heads: Sequence[int], lines: Sequence[int]) -> tuple[int, str] | None:
    """``(line, problem)`` when ``heads`` (1-based, 0 = root, each in range and not its own) do not form one
    tree: no root, a second root, or a cycle; None when they do."""
    roots = [i for i, h in enumerate(heads) if h == 0]  # 0-based words
    if not roots:
        return lines[0], "sentence has no root (no word with HEAD 0)"
    if len(roots) > 1:
        return lines[roots[1]], (f"sentence has {len(roots)} roots (words {', '.join(str(i + 1) for i in roots)} "
                                 f"have HEAD 0); expected exactly one")
    state = [0] * (len(heads) + 1)  # per word (1-based): 0 unseen, 1 on the current path, 2 reaches the root
    state[0] = 2
    for i in range(1, len(heads) + 1):
        path, j = [], i
        while state[j] == 0:
            state[j] = 1
            path.append(j)
            j = heads[j - 1]
        if state[j] == 1:
            cycle = path[path.index(j):]
            return lines[j - 1], f"cycle in the heads: words {' -> '.join(map(str, cycle + [j]))}"
        for k in path:
            state[k] = 2
    return None


def read_conllu(path: str | os.PathLike, trees: bool = True) -> list[Sentence]:
    """Read and validate a CoNLL-U file into sentences.

    Every word line has 10 columns, word ids are consecutive from 1, every HEAD is in 0..n and not the word
    itself; with ``trees``, the words of every annotated sentence also form one tree (exactly one word with
    HEAD 0, no cycle). A sentence whose DEPRELs are all ``_`` carries no tree (as :func:`sentence_from_words`
    writes it) and is not checked as one.

    Args:
        path: The ``.conllu`` file (UTF-8).
        trees: Check that each sentence is a tree; False for files of predicted heads (a probe's argmax heads
            need not form trees).

    Returns:
        One :class:`Sentence` per block, in file order (multiword-token lines and empty nodes left out).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConlluError: A malformed line or a byte that is not UTF-8; the message starts with ``path:line:``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CoNLL-U file not found: {path}")
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    try:
        raw = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        col = e.start - data.rfind(b"\n", 0, e.start)
        raise ConlluError(f"{path}:{lineno}: byte {data[e.start:e.start + 1]!r} at column {col} is not UTF-8 "
                          f"({e.reason}); CoNLL-U files are UTF-8") from None
    del data

    out: list[Sentence] = []
    checked: list[int] = []  # annotated sentences (index in out): checked as trees after the last block
    sizes: list[int] = []  # their numbers of words
    flat_heads: list[int] = []  # their HEAD columns, one after the other
    doc_id: str | None = None
    blk: _Block | None = None

    def err(lineno: int, what: str) -> ConlluError:
        return ConlluError(f"{path}:{lineno}: {what}")

    def finish(b: _Block) -> None:
        n = len(b.words)
        if n == 0:
            raise err(b.start, "sentence block has no word lines")
        if b.range_end > n:
            raise err(b.start, f"multiword token range ends at {b.range_end} but sentence has {n} words")
        for i, (h, ln) in enumerate(zip(b.heads, b.head_lines), start=1):
            if h > n:
                raise err(ln, f"HEAD {h} out of range 0..{n}")
            if h == i:
                raise err(ln, f"word {i} is its own head")
        if trees and b.deprels.count("_") != n:  # annotated: checked as a tree after the last block
            checked.append(len(out))
            sizes.append(n)
            flat_heads.extend(b.heads)
        out.append(Sentence(
            sent_id=b.sent_id, text=b.text, words=tuple(b.words), upos=tuple(b.upos), xpos=tuple(b.xpos),
            heads=tuple(b.heads), deprels=tuple(b.deprels), misc=tuple(b.misc),
            lines=tuple(b.lines), doc_id=doc_id, line_no=b.start,
        ))

    for lineno, line in enumerate(raw, start=1):
        if not line.strip():
            if blk is not None:
                finish(blk)
                blk = None
            continue
        if blk is None:
            blk = _Block(lineno)
        blk.lines.append(line)
        if line[0] == "#":
            key, eq, val = line[1:].partition("=")
            key = key.strip()
            if key == "sent_id" and eq:
                blk.sent_id = val.strip()
            elif key == "text" and eq:
                blk.text = val.strip()
            elif key == "newdoc id" and eq:
                doc_id = val.strip()
            elif key == "newdoc":
                doc_id = None
            continue
        cols = line.split("\t")
        if len(cols) != N_COLS:
            raise err(lineno, f"expected {N_COLS} tab-separated columns, got {len(cols)}")
        tid = cols[0]
        n_prev = len(blk.words)
        if "-" in tid:
            a, _, b = tid.partition("-")
            ia, ib = _int(a), _int(b)
            if ia is None or ib is None or ia >= ib:
                raise err(lineno, f"invalid multiword token range {tid!r}")
            if ia != n_prev + 1:
                raise err(lineno, f"multiword token range {tid!r} does not start at next word id {n_prev + 1}")
            blk.range_end = ib
            continue
        if "." in tid:
            a, _, b = tid.partition(".")
            if _int(a) is None or _int(b) is None or int(a) != n_prev:
                raise err(lineno, f"invalid empty node id {tid!r}")
            continue
        i = _int(tid)
        if i is None:
            raise err(lineno, f"invalid word id {tid!r}")
        if i != n_prev + 1:
            raise err(lineno, f"word id {i} is not consecutive (expected {n_prev + 1})")
        h = _int(cols[6])
        if h is None:
            raise err(lineno, f"HEAD {cols[6]!r} is not a non-negative integer")
        blk.words.append(cols[1])
        blk.upos.append(cols[3])
        blk.xpos.append(cols[4])
        blk.heads.append(h)
        blk.head_lines.append(lineno)
        blk.deprels.append(cols[7])
        blk.misc.append(cols[9])
    if blk is not None:
        finish(blk)
    if checked:
        k = _first_non_tree(flat_heads, sizes)
        if k is not None:
            sent = out[checked[k]]
            lines = [sent.line_no + i for i, line in enumerate(sent.lines) if _is_word_line(line)]  # (n,)
            line, problem = _tree_problem(sent.heads, lines)
            raise err(line, f"{problem} (sentence starting at line {sent.line_no}"
                            f"{'' if sent.sent_id is None else ', sent_id ' + sent.sent_id})")
    return out


def _first_non_tree(heads: list[int], sizes: list[int]) -> int | None:
    """The index of the first sentence whose heads do not form one tree, or None; ``heads`` are the sentences'
    HEAD columns one after the other (each in 0..n, none its own word), ``sizes`` their word counts.

    Vectorised: by pointer jumping every word reaches its root within ``log2(max n) + 1`` steps unless it
    lies on (or under) a cycle."""
    H = np.asarray(heads, dtype=np.int64)  # (N,) all words' heads
    size = np.asarray(sizes, dtype=np.int64)  # (S,)
    sid = np.repeat(np.arange(len(size)), size)  # (N,) each word's sentence
    start = np.cumsum(size) - size  # (S,) first word of each sentence in H
    total = len(H)
    up = np.append(np.where(H == 0, total, start[sid] + H - 1), total)  # (N + 1,) parent; `total` = above the roots
    for _ in range(int(size.max()).bit_length() + 1):
        up = up[up]
    roots = np.bincount(sid[H == 0], minlength=len(size))  # (S,)
    stuck = np.bincount(sid[up[:total] != total], minlength=len(size))  # (S,) words that never reach a root
    bad = (roots != 1) | (stuck > 0)  # (S,)
    return int(np.argmax(bad)) if bad.any() else None


def _is_word_line(line: str) -> bool:
    if not line or line[0] == "#":
        return False
    tid = line.split("\t", 1)[0]
    return tid.isascii() and tid.isdigit()


def write_conllu_with_heads(
    sentences: Sequence[Sentence],
    heads: Iterable[Sequence[int]],
    path: str | os.PathLike,
) -> Path:
    """Write ``sentences`` with HEAD (column 7) of word lines set to ``heads``; atomic."""
    path = Path(path)
    heads = list(heads)
    if len(heads) != len(sentences):
        raise ValueError(f"got {len(heads)} head sequences for {len(sentences)} sentences")
    chunks: list[str] = []
    for s, hs in zip(sentences, heads):
        hs = [int(h) for h in hs]
        if len(hs) != s.n:
            raise ValueError(
                f"sentence {s.sent_id!r} (line {s.line_no}): got {len(hs)} heads for {s.n} words")
        bad = [h for h in hs if not 0 <= h <= s.n]
        if bad:
            raise ValueError(f"sentence {s.sent_id!r} (line {s.line_no}): head {bad[0]} out of range 0..{s.n}")
        k = 0
        for line in s.lines:
            if _is_word_line(line):
                cols = line.split("\t")
                cols[6] = str(hs[k])
                k += 1
                line = "\t".join(cols)
            chunks.append(line + "\n")
        chunks.append("\n")
    atomic_write_text(path, "".join(chunks))
    return path


def sentence_from_words(words: Sequence[str], sent_id: str | None = None) -> Sentence:
    """A :class:`Sentence` of plain words without annotation (UPOS/XPOS/DEPREL ``_``, every HEAD 0), whose
    ``lines`` are its CoNLL-U block (so :func:`write_conllu_with_heads` can write it).

    Args:
        words: The words (non-empty, no tab or newline inside a word).
        sent_id: Its ``# sent_id`` comment (none when None).

    Returns:
        The sentence (``line_no`` 0: it comes from no file).
    """
    words = tuple(str(w) for w in words)
    if not words:
        raise ValueError(f"sentence {sent_id!r} has no words")
    bad = [w for w in words if not w or any(c in w for c in "\t\n\r")]
    if bad:
        raise ValueError(f"sentence {sent_id!r}: word {bad[0]!r} is empty or holds a tab or newline")
    n = len(words)
    lines = ([f"# sent_id = {sent_id}"] if sent_id is not None else []) + [f"# text = {' '.join(words)}"]
    lines += [f"{i}\t{w}\t_\t_\t_\t_\t0\t_\t_\t_" for i, w in enumerate(words, start=1)]
    return Sentence(sent_id=sent_id, text=" ".join(words), words=words, upos=("_",) * n, xpos=("_",) * n,
                    heads=(0,) * n, deprels=("_",) * n, misc=("_",) * n, lines=tuple(lines), doc_id=None, line_no=0)


def read_text(path: str | os.PathLike) -> list[list[str]]:
    """Read a plain-text file with one sentence per line, split on whitespace; blank lines are skipped.

    Args:
        path: The text file (UTF-8).

    Returns:
        The sentences as lists of words, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    with open(path, encoding="utf-8-sig") as f:
        return [line.split() for line in f if line.strip()]
