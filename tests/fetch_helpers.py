"""Wheels made in a test, for the fetch tests' local package index (tests/test_fetch_model.py,
tests/test_model_integrity.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel ``<name>-<version>-py3-none-any.whl`` holding ``files``; it requires a package that does
    not exist, so a fetch that installed dependencies would fail."""
    dist = f"{name}-{version}.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 f"Requires-Dist: a-package-that-does-not-exist\n".encode(),
            f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**files, **meta}.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", "")
    return path
