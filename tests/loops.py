"""What the tests of the extraction stage's own loop share (tests/test_extract_loop.py for attention maps,
tests/test_hidden_loop.py for hidden states): the sentences and batch bounds, the trainer, an entry's files, the
loop's worker threads, a method made to fail at its third call, and a build made to fail at its third batch."""

from __future__ import annotations

import functools
import threading

import pytorch_lightning as pl

from probes.extract import cache
from tests.conftest import WORDS

# words the tiny tokenizers split into several pieces, so that pooling over pieces matters
LONG_WORDS = ["unbelievably", "tokenization", "reconsidered", "householders", "quickest"]
VOCAB = WORDS + LONG_WORDS
# 1 to 14 words: length batches of several lengths (padding); the last (and a few others) longer than MAX_LENGTH
# pieces: skipped
SENTS = [[VOCAB[(i * 7 + k * 3) % len(VOCAB)] for k in range(1 + i % 14)] for i in range(45)] + [LONG_WORDS * 6]
MAX_LENGTH = 24  # pieces, specials included
MAX_TOKENS = 96  # pieces per batch: several batches
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def files(entry) -> dict[str, bytes]:
    """{file name: bytes} of a complete entry."""
    return {p.name: p.read_bytes() for p in sorted(entry.path.iterdir())}


def worker_threads() -> list[str]:
    """The loop's threads still alive (the batch builder, the cache writer)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(("batches-ahead", "cache-writer"))]


class Boom(Exception):
    """A failure raised inside the code under test (a disk gone)."""


def fail_third_call(monkeypatch, owner, name: str, error, calls: list) -> None:
    """Replace the method ``owner.name`` so that its third call raises ``error`` (the first two run it); each call
    appends the name of the thread it ran on to ``calls``."""
    original = getattr(owner, name)

    def failing(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def fail_third_batch(monkeypatch, where: str, owner, name: str) -> tuple[list, type]:
    """Make a build fail in its third batch: ``where="writer thread"``, a failing disk in the batch's write
    (``ShardWriter.write_many``); else Ctrl-C in its forward (``owner.name``). Returns the calls (the thread of
    each, :func:`fail_third_call`) and the exception the build raises."""
    calls: list = []
    if where == "writer thread":
        fail_third_call(monkeypatch, cache.ShardWriter, "write_many", Boom("disk gone"), calls)
        return calls, Boom
    fail_third_call(monkeypatch, owner, name, KeyboardInterrupt, calls)
    return calls, KeyboardInterrupt
