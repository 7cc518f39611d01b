"""Read an offline wandb run back from its ``run-<id>.wandb`` file (no network, no wandb service).

The file is wandb's LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each ``crc32 (uint32) | length (uint16) | type (uint8) | data``, a record
split over FIRST/MIDDLE/LAST chunks when it crosses a block. Each record is a
``wandb.proto.wandb_internal_pb2.Record``. wandb >= 0.19 no longer ships a Python reader
(``wandb.sdk.internal.datastore``), so the framing is read here, checksums included.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from google.protobuf.json_format import MessageToDict
from wandb.proto import wandb_internal_pb2 as pb

HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CRC = {t: zlib.crc32(bytes((t,))) & 0xFFFFFFFF for t in (FULL, FIRST, MIDDLE, LAST)}


def records(path: str | Path) -> Iterator[Any]:
    """Every ``Record`` of a ``.wandb`` file in order; a torn tail (run still writing) ends the scan."""
    data = Path(path).read_bytes()
    if len(data) < HEADER.size:
        raise ValueError(f"{path}: not a wandb run file (shorter than its header)")
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a wandb run file (header {ident!r} {magic:#x} v{version})")
    pos, parts = HEADER.size, []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero-filled rest of a block
            pos += left
            continue
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if len(body) < length:
            return  # torn tail
        if zlib.crc32(body, _CRC.get(kind, 0)) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: checksum mismatch at byte {pos}")
        pos += CHUNK.size + length
        parts.append(body)
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec


@dataclass
class OfflineRun:
    """What a run file holds: identity, config, history rows, summary, environment."""

    path: Path
    run_id: str = ""
    project: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def files_dir(self) -> Path:
        """The run's ``files/`` folder (media such as tables and images)."""
        return self.path.parent / "files"

    def tables(self) -> dict[str, dict]:
        """``{key: table JSON}`` of every wandb Table logged to the history (``columns``, ``data``)."""
        out = {}
        for row in self.history:
            for k, v in row.items():
                if isinstance(v, dict) and v.get("_type") == "table-file":
                    out[k] = json.loads((self.files_dir / v["path"]).read_text())
        return out

    def images(self) -> dict[str, Path]:
        """``{key: PNG path}`` of every wandb Image logged to the history."""
        return {k: self.files_dir / v["path"] for row in self.history for k, v in row.items()
                if isinstance(v, dict) and v.get("_type") == "image-file"}


def _items(items) -> dict[str, Any]:
    """Items to a dict; ``nested_key`` items (a logged Table's fields) become nested dicts."""
    out: dict[str, Any] = {}
    for it in items:
        value = json.loads(it.value_json) if it.value_json else None
        keys = list(it.nested_key) or [it.key]
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return out


def read_run(path: str | Path) -> OfflineRun:
    """Parse one ``run-<id>.wandb`` file into an :class:`OfflineRun`."""
    run = OfflineRun(Path(path))
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.project, run.group, run.job_type = r.run_id, r.project, r.run_group, r.job_type
            run.name, run.tags = r.display_name, list(r.tags)
            run.config.update({k: v.get("value", v) if isinstance(v, dict) else v
                               for k, v in _items(r.config.update).items()})
        elif kind == "config":
            run.config.update({k: v.get("value", v) if isinstance(v, dict) else v
                               for k, v in _items(rec.config.update).items()})
        elif kind == "history":
            run.history.append(_items(rec.history.item))
        elif kind == "summary":
            run.summary.update(_items(rec.summary.update))
        elif kind == "environment":
            run.environment.update(MessageToDict(rec.environment, preserving_proto_field_name=True))
        elif kind == "artifact":
            run.artifacts.append(dict(name=rec.artifact.name, type=rec.artifact.type,
                                      files=[m.path for m in rec.artifact.manifest.contents]))
    return run


def find_runs(folder: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file under ``folder`` (sorted)."""
    return sorted(Path(folder).rglob("run-*.wandb"))
