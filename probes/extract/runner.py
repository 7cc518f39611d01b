"""One way to get a cache entry of any kind: key it, find it, or build it (here or in a child process).

A *cache kind* says what an entry stores (its folder, its key fields, how it is built and opened):
:class:`probes.extract.stage.AttentionMaps` (word-level maps of any map kind) and
:class:`probes.extract.representations.HiddenStates` (per-word hidden states of chosen layers). A *source*
says which sentences: :class:`TreebankSplit` (the first ``max_sentences`` of a treebank split) or
:class:`WordLists` (any word lists, e.g. an analysis's document segments, named by the caller's fields).
Every entry is keyed by :func:`probes.extract.cache.cache_key` and extracted with the settings of one
:class:`~probes.extract.settings.ExtractSettings`.

:func:`build` makes one entry in this process; :func:`ensure` returns the entries of several sources and,
given the encoder's config, builds the missing ones in a child interpreter (``python -m
probes.extract.runner``: it loads the weights, resolves ``precision=auto``, writes the entries and exits), so
the calling process (a training job) never holds the encoder's weights or the extraction's buffers. Kinds and
sources are plain picklable objects: the child receives them as they are, nothing is chosen by name. The child
logs to stderr and appends to the parent's log files (Hydra's run log), so its lines, the extraction's progress
(:mod:`probes.progress`) among them, are in the run's log.

The child dies with its parent: on Linux the kernel sends it SIGTERM when the parent dies (``prctl``
``PR_SET_PDEATHSIG``), elsewhere a watchdog thread polls the parent's pid; either way it removes the request's
temporary folder (``$TMPDIR/probes-extract-<parent pid>-*``) before exiting (the signal comes when the parent's
starting thread ends, which under ``kill -9`` can be before its other threads: the parent then still looks alive
by ``getppid()``, so a parent whose main thread is a zombie counts as gone, and the child looks again at exit).
The parent removes that folder on every exit path it lives through (result, error, SIGTERM/SIGHUP, Ctrl-C: the
child is stopped first), and folders left by a parent killed outright (``kill -9``) whose pid is gone are also
removed at the next spawn.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

from probes.config import plain
from probes.extract import cache
from probes.extract.settings import ExtractSettings
from probes.io import atomic_write_text
from probes.model.load import Encoder

if TYPE_CHECKING:
    from probes.data.sources import Treebank

log = logging.getLogger(__name__)


class CacheKind(Protocol):
    """What a cache entry stores; implemented by :class:`~probes.extract.stage.AttentionMaps` and
    :class:`~probes.extract.representations.HiddenStates`."""

    folder: str  # entries live in <cache_dir>/<folder>/
    what: str  # in log lines and errors: "attention", "hidden-state"

    def key_fields(self, encoder: Encoder, settings: ExtractSettings) -> dict:
        """The kind's part of the cache key."""

    def build(self, encoder: Encoder, sentences: list[list[str]], key: dict, cache_dir: str | Path,
              trainer: Callable[..., pl.Trainer], settings: ExtractSettings) -> Any:
        """Write (or reuse) the entry for ``key``; returns its reader."""

    def open(self, path: str | Path) -> Any:
        """The reader of the complete entry at ``path``."""


@dataclass(frozen=True)
class TreebankSplit:
    """The first ``max_sentences`` sentences (file order; None: all) of ``split`` of ``treebank``."""

    treebank: Treebank
    split: str
    max_sentences: int | None = None

    @property
    def label(self) -> str:
        """The split's name (log lines)."""
        return self.split

    def key_fields(self, settings: ExtractSettings) -> dict:
        """Dataset, split, the file's sha256, ``max_sentences`` and the long-sentence policy (which of them are kept)."""
        return dict(dataset=self.treebank.name, split=self.split, data_sha256=self.treebank.file_sha256(self.split),
                    max_sentences=self.max_sentences, long_sentences=settings.long_sentences)

    def words(self) -> list[list[str]]:
        """The sentences as word lists (the Sentence objects are not kept)."""
        return [list(s.words) for s in self.treebank.read(self.split)[:self.max_sentences]]


@dataclass(frozen=True)
class WordLists:
    """Word lists made by the caller (e.g. document segments), named in the key by ``fields`` (``dataset``,
    ``split``, ``data_sha256`` and whatever else decides them, e.g. how they were made).

    They are made to fit ``max_length``, so they are extracted with ``long_sentences=error`` and the policy
    is not part of their key.
    """

    sentences: list[list[str]]
    fields: Mapping[str, Any]

    @property
    def label(self) -> str:
        """``<dataset>/<split>`` (log lines)."""
        return f"{self.fields['dataset']}/{self.fields['split']}"

    def key_fields(self, settings: ExtractSettings) -> dict:
        """``fields``; an error unless ``settings.long_sentences`` is ``error``."""
        if settings.long_sentences != "error":
            raise ValueError(f"word lists ({self.label}) are extracted with long_sentences=error (they are made to "
                             f"fit max_length; the policy is not part of their key), got {settings.long_sentences!r}")
        return dict(self.fields)

    def words(self) -> list[list[str]]:
        """The word lists."""
        return [list(s) for s in self.sentences]


def entry_path(encoder: Encoder, kind: CacheKind, source, settings: ExtractSettings, cache_dir: str | Path,
               precision: str) -> Path:
    """Where the entry of ``source`` for ``kind`` extracted at ``precision`` lives (complete or not)."""
    return cache.entry_dir(cache_dir, cache.cache_key(encoder, source, kind, settings, precision), kind.folder)


def intact(path: Path) -> bool:
    """Whether the entry at ``path`` is complete and intact (:func:`probes.extract.cache.verify`, once per
    process). A damaged entry is moved aside (:func:`probes.extract.cache.set_aside`, logged) under its build
    lock, so that it is rebuilt, and False is returned."""
    if not cache.is_complete(path):
        return False
    try:
        cache.verify(path)
        return True
    except cache.CacheDamaged as e:
        log.warning("%s", e)
    with cache.build_lock(path) as missing:  # another process may be rebuilding it: look again under the lock
        if missing:
            return False
        try:
            cache.verify(path, force=True)
            return True
        except cache.CacheDamaged as e:
            cache.set_aside(path, f"{e.file} damaged")
            return False


def cached(encoder: Encoder, kind: CacheKind, source, settings: ExtractSettings | DictConfig | Mapping,
           cache_dir: str | Path) -> Path | None:
    """The complete, intact entry of ``source`` if it exists, found without loading the encoder's weights (None
    also when ``precision=auto`` has not been measured on this machine yet, or when the entry was damaged:
    it is then moved aside, see :func:`intact`)."""
    settings = ExtractSettings.from_config(settings)
    precision = settings.resolve_precision(encoder, cache_dir=cache_dir, lookup_only=True)
    if precision is None:
        return None
    path = entry_path(encoder, kind, source, settings, cache_dir, precision)
    return path if intact(path) else None


def build(encoder: Encoder, kind: CacheKind, source, settings: ExtractSettings | DictConfig | Mapping,
          cache_dir: str | Path, words: list[list[str]] | None = None):
    """Read ``source``'s sentences (``words``: already read by the caller), resolve the precision on them, key
    the entry and build it in this process unless it is complete and intact; returns the kind's reader."""
    settings = ExtractSettings.from_config(settings)
    words = source.words() if words is None else words
    precision = settings.resolve_precision(encoder, sentences=words, cache_dir=cache_dir)
    key = cache.cache_key(encoder, source, kind, settings, precision)
    intact(cache.entry_dir(cache_dir, key, kind.folder))  # a damaged entry is moved aside, then built again
    return kind.build(encoder, words, key, cache_dir, settings.make_trainer(precision), settings)


def ensure(encoder: DictConfig | Mapping | Encoder, kind: CacheKind, sources: Sequence,
           settings: ExtractSettings | DictConfig | Mapping, cache_dir: str | Path, child: bool = True) -> list:
    """The readers of the entries of ``sources`` (same order); the missing entries are built first.

    ``encoder``: its Hydra config (instantiated here, which loads its config and tokenizer only) or an
    :class:`~probes.model.load.Encoder`. With ``child=True`` and a config, the missing entries are built in a
    child interpreter and this process only opens them; with an ``Encoder`` (not picklable) or ``child=False``
    they are built here and the weights released after.
    """
    settings = ExtractSettings.from_config(settings)
    enc = encoder if isinstance(encoder, Encoder) else instantiate(encoder)
    paths = [cached(enc, kind, s, settings, cache_dir) for s in sources]
    missing = [i for i, p in enumerate(paths) if p is None]
    for p in paths:
        if p is not None:
            log.info("%s cache hit: %s", kind.what, p)
    if missing and child and not isinstance(encoder, Encoder):
        built = _spawn(encoder, kind, [sources[i] for i in missing], settings, cache_dir)
        for i, p in zip(missing, built):
            paths[i] = p
    elif missing:
        for i in missing:
            paths[i] = build(enc, kind, sources[i], settings, cache_dir).path
        enc.release()
    return [kind.open(p) for p in paths]


TMP_PREFIX = "probes-extract-"  # + <parent pid>-<random>: the request folder of one child
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale(root: str | Path | None = None) -> list[Path]:
    """Remove the request folders (``<root>/probes-extract-<pid>-*``, root: the temporary folder) of parents
    that are gone (killed outright); returns them."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        pid = d.name[len(TMP_PREFIX):].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.info("removed %s, left by extraction parent %s that is gone", d, pid)
    return removed


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """In the main thread: SIGTERM and SIGHUP raise SystemExit while the block runs (so ``finally`` clauses
    stop the child and remove the temporary folder); the previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job log format


def log_files() -> list[str]:
    """The files this process's root logger writes to (Hydra's ``<run dir>/<job>.log``): the child appends its
    lines there too (its progress included, :mod:`probes.progress`)."""
    return [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def _log_to(files: Sequence[str], level: int) -> None:
    """Log to stderr and append to each of ``files`` (the parent's run log), in the parent's format."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for f in files:
        try:
            handler = logging.FileHandler(f, mode="a")
        except OSError as e:  # the parent's log folder gone: stderr only
            logging.getLogger(__name__).warning("cannot append to the run's log %s (%s)", f, e)
            continue
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(handler)


def _spawn(encoder_cfg: DictConfig | Mapping, kind: CacheKind, sources: list, settings: ExtractSettings,
           cache_dir: str | Path) -> list[Path]:
    """Run :func:`_child` in a fresh interpreter (``python -m probes.extract.runner``: nothing of this
    process, not even its ``__main__``, is re-imported); the entries' paths, or its error raised here. The
    request folder is removed and the child stopped on every way out of here (see the module doc)."""
    req = dict(encoder_cfg=plain(encoder_cfg), kind=kind, sources=list(sources), settings=settings,
               cache_dir=str(cache_dir), log_level=logging.getLogger().getEffectiveLevel(), log_files=log_files())
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the `probes` package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    splits = [s.split for s in sources if isinstance(s, TreebankSplit)]  # the entries' rebuild command (manifest)
    env[cache.COMMAND_ENV] = cache.build_command(dict(split=",".join(splits) if splits else None))
    clean_stale()
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    proc, res = None, {}
    try:
        payload, result = tmp / "request.pkl", tmp / "result.json"
        payload.write_bytes(pickle.dumps(req))
        log.info("extracting %s of %s in a child process (the encoder is loaded there, not here)", kind.what,
                 ", ".join(s.label for s in sources))
        with _signals_raise():
            proc = subprocess.Popen([sys.executable, "-m", "probes.extract.runner", str(payload), str(result),
                                     str(os.getpid())], env=env)
            rc = proc.wait()
        res = json.loads(result.read_text()) if result.exists() else {}
    finally:
        if proc is not None and proc.poll() is None:  # leaving on an exception or a signal: stop the child
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if rc == 0 and "paths" in res:
        return [Path(p) for p in res["paths"]]
    raise RuntimeError(f"{kind.what} extraction in the child process failed (exit code {rc}): "
                       f"{res.get('error', 'no result written (killed?)')}\n{res.get('traceback', '')}")


def _parent_gone(parent: int, wait_s: float = 0.0) -> bool:
    """Whether ``parent`` (pid) has died or is dying: this process was handed to another parent, or the
    parent's main thread has ended (a zombie thread-group leader: ``kill -9`` ends a process's threads one by
    one, and the kernel sends the death signal when the thread that started this process ends, while
    ``getppid()`` still names the parent because one of its other threads adopted this process). Looks again
    for up to ``wait_s`` s (the signal can arrive a moment before the leader is marked a zombie)."""
    end = time.monotonic() + wait_s
    while True:
        if os.getppid() != parent:
            return True
        try:
            state = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                return True
        except (OSError, IndexError):  # no /proc (not Linux): the pid alone
            if not _alive(parent):
                return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def die_with_parent(parent: int, on_death: Callable[[], None], poll_s: float = 1.0) -> str:
    """Make this process end when ``parent`` (pid) dies: SIGTERM from the kernel (Linux ``prctl``
    ``PR_SET_PDEATHSIG``), else a daemon thread that polls the parent pid every ``poll_s`` s and sends SIGTERM
    to this process; SIGTERM runs ``on_death`` (when the parent is gone or dying, :func:`_parent_gone`) and
    exits, and so does any exit of this interpreter after the parent died (``atexit``: a first signal that
    came while the dying parent still looked alive). ``on_death`` runs at most once. Already orphaned: exit
    now. Returns the mechanism (``prctl`` or ``watchdog``)."""
    done = []

    def cleanup(wait_s: float) -> None:
        if not done and _parent_gone(parent, wait_s):
            done.append(True)
            on_death()

    def terminated(signum, frame):
        cleanup(0.2)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, terminated)
    atexit.register(cleanup, 0.0)
    how = "watchdog"
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
                how = "prctl"
    if _parent_gone(parent):  # the parent died (or is dying) before the death signal was armed
        cleanup(0.0)
        raise SystemExit(1)
    if how == "watchdog":
        def watch():
            while os.getppid() == parent and _alive(parent):
                time.sleep(poll_s)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
    return how


def _child(payload: str, result: str, parent: int | None = None) -> None:
    """Child process (``python -m probes.extract.runner PAYLOAD RESULT [PARENT_PID]``): build the entries of the
    pickled request; write ``{"paths": [...]}`` (or ``{"error", "traceback"}``) to ``result``. It logs to stderr and
    appends to the parent's log files (the run's log: its progress lines land there). It dies with ``parent``,
    removing the request folder (the payload's folder) when the parent is gone."""
    if parent is not None:
        die_with_parent(parent, lambda: shutil.rmtree(Path(payload).parent, ignore_errors=True))
    req = pickle.loads(Path(payload).read_bytes())
    _log_to(req.get("log_files", []), req["log_level"])
    try:
        encoder = instantiate(req["encoder_cfg"])
        paths = [str(build(encoder, req["kind"], s, req["settings"], req["cache_dir"]).path) for s in req["sources"]]
        atomic_write_text(result, json.dumps(dict(paths=paths)))
    except BaseException as e:
        if Path(result).parent.is_dir():
            atomic_write_text(result, json.dumps(dict(error=f"{type(e).__name__}: {e}",
                                                      traceback=traceback.format_exc())))
        raise


if __name__ == "__main__":  # the child of :func:`ensure`
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
