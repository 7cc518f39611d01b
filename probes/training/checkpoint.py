"""Reading checkpoints without running code from them.

A ``.ckpt`` or ``head.pt`` is a pickle, and unpickling one may call anything it names. Every checkpoint this project
reads is therefore loaded weights-only (``torch.load(weights_only=True)``: tensors and plain Python values), also
where Lightning loads it (``trainer.fit`` / ``trainer.test`` with ``weights_only=True``). The files the project
writes hold nothing else (hyperparameters as plain values, :func:`probes.config.plain`; the random
generators' states as tensors and numbers), so no global needs allow-listing; a file that holds anything else
was written by other code or altered, and is refused with :class:`UnsafeCheckpointError` naming it.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint that a weights-only load refuses (the message names the file); nothing in it was run."""


def _reason(error: BaseException) -> str:
    """The weights-only unpickler's own reason (``Unsupported global: GLOBAL io.open``), else the error's text."""
    text = str(error)
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global|\n\n|$)", text, flags=re.S)
    return " ".join((m.group(1) if m else text).split())[:300]


@contextmanager
def refuse_unsafe(path: str | os.PathLike | None) -> Iterator[None]:
    """Within: a weights-only load of ``path`` that fails to unpickle raises :class:`UnsafeCheckpointError` naming
    the file (e.g. around ``trainer.fit(ckpt_path=path, weights_only=True)``); ``path`` None or empty (no
    checkpoint read within): errors pass unchanged."""
    if not path:
        yield
        return
    try:
        yield
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if "WeightsUnpickler error" not in str(e):
            raise UnsafeCheckpointError(f"{path}: not a readable checkpoint ({_reason(e)})") from None
        raise UnsafeCheckpointError(
            f"{path}: refused to load this checkpoint: it holds more than tensors and plain values "
            f"({_reason(e)}), and unpickling it could run code. The checkpoints this project writes hold nothing "
            "else: this file was written by other code or altered. Nothing in it was run.") from None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device, mmap: bool) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; :class:`UnsafeCheckpointError` naming the file when it holds
    anything else. ``mmap``: map the tensors' storage instead of reading it (a cheap look at a big file; files in
    torch's zip format, the default since torch 1.6; others are read)."""
    with refuse_unsafe(path):
        return torch.load(path, map_location=map_location, weights_only=True,
                          mmap=mmap and zipfile.is_zipfile(path))
