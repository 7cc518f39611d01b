"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Files are created with the permissions of the user's umask (``0o666 & ~umask``, as ``open()`` gives), so
metrics, tables, figures and manifests are as readable as any other file the user writes.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask (read from ``/proc/self/status`` where it is there, so no other thread ever sees it
    changed; else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a new file under the current umask: ``0o666 & ~umask``."""
    return 0o666 & ~umask()


def _temp_beside(path: Path) -> str:
    """Create an empty temporary file beside ``path`` (exclusively, mode ``0o666 & ~umask``); its name."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the kernel applies the umask
            return str(tmp)
        except FileExistsError:
            continue


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)` on a temporary file beside `path`, fsync it, give it the umask's mode
    (:func:`file_mode`), rename it onto `path`."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), file_mode())  # also when `write` replaced the file by one of another mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write` of ``text`` (UTF-8, ``\\n`` line ends)."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8", newline="\n"))
