"""Pinned data files: resolve under a data dir, download on first use, verify sha256."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tqdm import tqdm

from probes.data.conllu import ConlluError, Sentence, read_conllu

__all__ = ["ChecksumError", "Treebank", "ensure_file", "sha256_file"]

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0
CHUNK = 1 << 20


class ChecksumError(ValueError):
    """Downloaded bytes do not match the pinned sha256."""


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _missing(path: Path, url: str | None, rel: str | None, dataset: str | None, why: str) -> FileNotFoundError:
    rel = rel or path.name
    dataset = dataset or "<dataset>"
    src = f" (source: {url})" if url else " (no download URL configured)"
    return FileNotFoundError(
        f"data file not found: {path}{src}; {why}. To provide it, set PROBES_DATA_DIR to a folder "
        f"containing {rel}, or run `python -m probes.data.fetch treebank=<name>` (conf/treebank/<name>.yaml) with internet")


def ensure_file(
    path: str | os.PathLike,
    url: str | None,
    sha256: str | None,
    download: bool = True,
    *,
    rel: str | None = None,
    dataset: str | None = None,
) -> Path:
    """Return ``path``, downloading it from ``url`` (verified against ``sha256``) if missing.

    ``rel``/``dataset`` only improve the error message (path relative to the data dir, CLI name).
    """
    path = Path(path)
    if path.is_file():
        return path
    if not url:
        raise _missing(path, url, rel, dataset, "no URL to download from")
    if not download:
        raise _missing(path, url, rel, dataset, "download is disabled")

    part = path.with_suffix(path.suffix + ".part")
    log.warning("downloading %s -> %s", url, path)
    h = hashlib.sha256()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp, open(part, "wb") as f:
            total = resp.headers.get("Content-Length")
            with tqdm(total=int(total) if total else None, unit="B", unit_scale=True,
                      unit_divisor=1024, desc=path.name, leave=False, disable=None) as bar:
                while chunk := resp.read(CHUNK):
                    f.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as e:
        part.unlink(missing_ok=True)
        raise _missing(path, url, rel, dataset, f"download failed: {e}") from e
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    digest = h.hexdigest()
    if sha256 is not None and digest != sha256.lower():
        part.unlink(missing_ok=True)
        raise ChecksumError(f"sha256 mismatch for {url}: expected {sha256}, got {digest} (not saved to {path})")
    if sha256 is None:
        log.warning("no pinned sha256 for %s; downloaded file %s has sha256 %s", url, path, digest)
    os.replace(part, path)
    log.info("saved %s (sha256 %s)", path, digest)
    return path


class Treebank:
    """A CoNLL-U treebank with named splits under ``data_dir/subdir`` (Hydra-instantiable).

    A file given as an absolute path is used as it is (one's own files: :meth:`from_files`,
    ``conf/treebank/conllu.yaml``). A split whose file is None is declared but not given: reading it is an
    error naming the setting.

    Args:
        name: Dataset name (part of cache keys).
        data_dir: Root of the data files.
        subdir: Folder of this treebank under ``data_dir``.
        files: Split -> file name under ``data_dir/subdir`` (or an absolute path; None: not given).
        urls: Split -> download URL (missing files are fetched from it).
        sha256: Split -> pinned sha256 of the downloaded file.
        download: Download missing files that have a URL.
    """

    def __init__(
        self,
        name: str,
        data_dir: str | os.PathLike,
        subdir: str,
        files: Mapping[str, str | None],
        urls: Mapping[str, str] | None = None,
        sha256: Mapping[str, str] | None = None,
        download: bool = True,
    ):
        self.name = name
        self.data_dir = Path(data_dir).expanduser()
        self.subdir = subdir
        self.unset = [str(k) for k, v in files.items() if v is None]  # declared splits without a file
        self.files = {str(k): str(v) for k, v in files.items() if v is not None}
        self.urls = {str(k): str(v) for k, v in (urls or {}).items()}
        self.sha256 = {str(k): str(v) for k, v in (sha256 or {}).items()}
        self.download = bool(download)
        self._digests: dict[str, str] = {}

    @classmethod
    def from_files(cls, name: str = "conllu", **files: str | os.PathLike | None) -> "Treebank":
        """A treebank of one's own CoNLL-U files, one keyword per split (no download, no pinned digest).

        Args:
            name: Dataset name (part of cache keys; the files' sha256 is part of them too).
            **files: Split -> path, e.g. ``train="a.conllu", dev="b.conllu"``; None entries are left out.

        Returns:
            The treebank (paths made absolute; each file must exist).

        Raises:
            FileNotFoundError: A file does not exist (the message names the split and the path).
            ValueError: No file given.
        """
        paths = {k: Path(v).expanduser().resolve() for k, v in files.items() if v is not None}
        if not paths:
            raise ValueError("no CoNLL-U file given: pass one path per split, e.g. dev='my.conllu'")
        for split, p in paths.items():
            if not p.is_file():
                raise FileNotFoundError(f"treebank {name!r}: {split} file not found: {p}")
        return cls(name, Path(paths[next(iter(paths))].anchor), "", {k: str(v) for k, v in paths.items()},
                   download=False)

    def __repr__(self) -> str:
        return f"Treebank({self.name!r}, {str(self.data_dir / self.subdir)!r}, splits={list(self.files)})"

    @property
    def splits(self) -> list[str]:
        """The splits that have a file."""
        return list(self.files)

    def _check(self, split: str) -> None:
        if split in self.unset:
            raise FileNotFoundError(
                f"treebank {self.name!r}: no file given for split {split!r}; set files.{split} "
                f"(command line: data.treebank.files.{split}=/abs/path/{split}.conllu; Python: "
                f"probes.treebank({split}=...))")
        if split not in self.files:
            raise KeyError(f"{self.name}: unknown split {split!r}; known splits: {sorted(self.files)}")

    def path(self, split: str) -> Path:
        """Local path of ``split`` (may not exist yet)."""
        self._check(split)
        return self.data_dir / self.subdir / self.files[split]

    def ensure(self, split: str) -> Path:
        """Local path of ``split``, downloading it if missing and allowed."""
        self._check(split)
        path = self.path(split)
        if not self.urls.get(split) and not path.is_file():
            where = "" if Path(self.files[split]).is_absolute() else f" under {self.data_dir / self.subdir}"
            raise FileNotFoundError(
                f"treebank {self.name!r}: {split} file not found: {path} (files.{split}={self.files[split]!r}{where}, "
                f"no download URL; command line: data.treebank.files.{split}=/abs/path/{split}.conllu, or "
                f"PROBES_DATA_DIR for a configured treebank)")
        return ensure_file(path, self.urls.get(split), self.sha256.get(split), self.download,
                           rel=f"{self.subdir}/{self.files[split]}", dataset=self.name)

    def read(self, split: str) -> list[Sentence]:
        """The sentences of ``split`` (the file downloaded first if missing and allowed), checked as trees
        (:func:`probes.data.conllu.read_conllu`).

        Raises:
            ConlluError: A malformed file (``path:line:``), or one with no sentence (naming the file and the
                setting ``files.<split>``).
        """
        path = self.ensure(split)
        sentences = read_conllu(path)
        if not sentences:
            raise ConlluError(f"{path}: no sentences: the {split} split of treebank {self.name!r} is empty "
                              f"(files.{split}={self.files[split]!r}; command line: data.treebank.files.{split})")
        return sentences

    def fetch(self) -> dict[str, Path]:
        """Ensure all splits are present."""
        return {s: self.ensure(s) for s in self.files}

    def file_sha256(self, split: str) -> str:
        """sha256 of the local file of ``split`` (memoised)."""
        if split not in self._digests:
            self._digests[split] = sha256_file(self.ensure(split))
        return self._digests[split]
