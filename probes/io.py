"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)` on a temporary file beside `path`, fsync it, rename it onto `path`."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8", newline="\n"))
