"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Files are created with the permissions of the user's umask (``0o666 & ~umask``, as ``open()`` gives), so
metrics, tables, figures and manifests are as readable as any other file the user writes. A full disk (or an
exceeded quota) while writing is a :class:`DiskFullError` naming the file and the space left
(:func:`naming_full_disk`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; disk quota exceeded


class DiskFullError(OSError):
    """No space left (or the quota exceeded) while writing a file; the message names the file, the folder's
    free space and what to do; ``errno`` is the failed write's, ``path`` the file or folder."""

    def __init__(self, code: int, message: str, path: str | os.PathLike | None = None):
        super().__init__(code, message)
        self.path = None if path is None else Path(path)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing folder); None when unknown."""
    p = Path(path).expanduser().absolute()
    for folder in (p, *p.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def naming_full_disk(path: str | os.PathLike, what: str = "writing") -> Iterator[None]:
    """Inside the block, an ``OSError`` of a full disk or an exceeded quota (ENOSPC, EDQUOT) is re-raised as a
    :class:`DiskFullError` naming ``path`` (the file or folder being written), ``what`` was done, and the free
    space left there; other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as e:
        if e.errno not in FULL:
            raise
        reason = "disk quota exceeded" if e.errno == errno.EDQUOT else "no space left on the device"
        raise DiskFullError(e.errno, f"{what} {path}: {reason} ({_size(free_bytes(path))} free there); free some "
                                     "space or point the output (paths.cache_dir, paths.log_dir) at a larger disk",
                            path) from e


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
    (:func:`file_mode`), rename it onto `path`. A full disk: :class:`DiskFullError` naming `path` (the temporary
    file removed)."""
    path = Path(path).expanduser()
    with naming_full_disk(path):
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
