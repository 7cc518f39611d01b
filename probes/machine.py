"""The machine a number was measured on: the CPU's model name and its description (family, model, matrix
extensions), read from /proc/cpuinfo. Light to import (the standard library only), so benchmarks on a machine
without the project's reporting dependencies can name their CPU too."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """:func:`cpu_model` with the family/model numbers and the matrix extensions it has (AVX-512, AVX512-BF16,
    AMX), from /proc/cpuinfo (the model name alone elsewhere)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        return cpu_model()
    flags = set(info.get("flags", "").split())
    has = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
           if flag in flags] or ["AVX2" if "avx2" in flags else "no AVX2"]
    return (f"{cpu_model()} (family {info.get('cpu family', '?')} model {info.get('model', '?')}; "
            f"{', '.join(has)})")
