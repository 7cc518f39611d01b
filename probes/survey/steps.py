"""One step of the survey: a command of the project's own entry points, its record kept under ``docs/results``.

A :class:`Step` is a command line of ``python -m probes.analyze``, ``python train.py`` or ``probes-view``
(``entry``, a key of the survey's ``entries``) with its arguments; placeholders in braces are filled from the
model being surveyed (:class:`ModelFacts`: ``{model}``, ``{objective}``, ``{layers}``, ...). It runs in a child
process into its own run folder, and the files it names (``keep``) are copied with a ``record.json`` (command,
date, machine, wall time, commit, load average, the model's facts and ``weights``: how its weights were stored)
into ``<records_dir>/<model>/<step>/``, written whole or not at all (a temporary folder renamed into place). A
step whose record holds the same command and sizes is not run again, so an interrupted survey resumes where it
stopped.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from probes.machine import cpu_description
from probes.report.provenance import git_commit

RECORD = "record.json"


@dataclass(frozen=True)
class ModelFacts:
    """What the steps' placeholders may name about the model surveyed (read from its config, no weights)."""

    model: str            # the encoder's config name (conf/encoder/<model>.yaml)
    name: str             # the model's own name
    num_layers: int       # L (hidden states 0..L)
    num_heads: int
    causal: bool          # a decoder: rows see themselves and earlier tokens only
    objective: str        # the model's own loss for the no-op test (grad_sep's objective key)
    layers: str           # the layers the structural probe reads, comma-separated (relative depths)
    overrides: tuple[str, ...] = ()   # encoder.* overrides given to the survey, passed to every step
    weights: str | None = None        # how the weights were stored, read from the model's file by its loader
    #                                   (e.g. "GGUF Q4_1 (Q4_1 79 %, Q8_0 21 % of the weights), dequantized to
    #                                   float32 at fetch"); None: as published

    def fill(self, text: str, sizes: Mapping[str, Any]) -> str:
        """``text`` with ``{model}``, ``{objective}``, ``{layers}``, ``{num_layers}`` and ``{sizes.<key>}`` filled."""
        try:
            return text.format(model=self.model, objective=self.objective, layers=self.layers,
                               num_layers=self.num_layers, sizes=SimpleNamespace(**sizes))
        except (KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"conf/survey.yaml: unknown placeholder in {text!r}: {e}") from e


@dataclass(frozen=True)
class Entry:
    """A program the steps run: its argv, the arguments every step of it gets, and the argument that sends its
    output to a folder ``{dir}``."""

    argv: Sequence[str]     # the program, e.g. [python, train.py]
    args: Sequence[str]     # arguments of every step, after ``-m``
    run_dir: str            # e.g. ``hydra.run.dir={dir}``
    sweep_dir: str = ""     # a multirun's folder argument, e.g. ``hydra.sweep.dir={dir}``; empty: none

    def where(self, run_dir: Path, multirun: bool) -> str:
        """The argument that sends a run's output into ``run_dir``."""
        template = self.sweep_dir if multirun else self.run_dir
        if not template:
            raise ValueError(f"conf/survey.yaml: entry {list(self.argv)} has no multirun (no sweep_dir)")
        return template.format(dir=run_dir)


@dataclass
class Step:
    """A survey step: ``entry`` (key of ``entries``) + ``args``; ``keep``: files of its run folder to record."""

    entry: str
    args: Sequence[str]
    keep: Sequence[str]
    multirun: bool = False       # a Hydra multirun (``-m``): the folder is the sweep folder
    env: Mapping[str, str] = field(default_factory=dict)

    def command(self, entries: Mapping[str, Entry], facts: ModelFacts, sizes: Mapping[str, Any]) -> list[str]:
        """The child's argv without its run folder: the entry, ``-m`` for a multirun, ``encoder=<model>``, the
        survey's encoder overrides and the filled ``args``."""
        if self.entry not in entries:
            raise ValueError(f"conf/survey.yaml: entry {self.entry!r} is not one of entries ({sorted(entries)})")
        args = [facts.fill(str(a), sizes) for a in self.args]
        entry = entries[self.entry]
        return [*map(str, entry.argv), *(["-m"] if self.multirun else []), *map(str, entry.args),
                f"encoder={facts.model}", *facts.overrides, *args]


def display(argv: Sequence[str]) -> str:
    """``argv`` as a shell command, the interpreter shown as ``python``."""
    return " ".join(shlex.quote("python" if a == sys.executable else a) for a in argv)


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def recorded(record_dir: Path, command: str, sizes: Mapping[str, Any]) -> bool:
    """``record_dir`` holds a record of ``command`` run with the survey's ``sizes`` (the step is done)."""
    f = record_dir / RECORD
    if not f.exists():
        return False
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return rec.get("command") == command and rec.get("sizes") == dict(sizes)


def run_step(name: str, step: Step, argv: list[str], where: str, run_dir: Path, record_dir: Path,
             extra: Mapping[str, Any], cwd: Path) -> dict[str, Any]:
    """Run ``argv`` + ``where`` (the run-folder argument) in a child process (its output to ``<run_dir>.log``),
    then record ``step.keep`` with ``record.json`` (the command: ``argv``) into ``record_dir`` (replaced whole).
    A failing child or a missing file is an error naming the step, the log and the file; nothing is recorded
    then."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    logfile = run_dir.with_name(run_dir.name + ".log")
    load_before = load_average()
    t0 = time.time()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0))
    with open(logfile, "w") as out:
        rc = subprocess.run([*argv, where], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **dict(step.env)}).returncode
    wall = time.time() - t0
    if rc != 0:
        tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"survey step {name!r} failed (exit {rc}): {display(argv)}\nlog: {logfile}\n{tail}")
    missing = [k for k in step.keep if not (run_dir / k).exists()]
    if missing:
        raise FileNotFoundError(f"survey step {name!r}: {run_dir} has no {missing} (conf/survey.yaml steps.{name}.keep)")
    record = dict(command=display(argv), step=name, date=started, wall_time_s=round(wall, 1),
                  machine=cpu_description(), cpus=os.cpu_count(), load_average=f"{load_before} -> {load_average()}",
                  commit=git_commit(), run_folder=str(run_dir), **extra)
    tmp = record_dir.with_name(f".{record_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k in step.keep:
        (tmp / k).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run_dir / k, tmp / k)
    (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    old = record_dir.with_name(f".{record_dir.name}.old-{os.getpid()}")
    if record_dir.exists():
        record_dir.rename(old)
    tmp.rename(record_dir)
    shutil.rmtree(old, ignore_errors=True)
    return record
