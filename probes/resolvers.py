"""OmegaConf resolvers of the project's configs, registered on import (the entry points import this module
before Hydra composes ``conf/``).

``${unique_now:FORMAT}``: the time in ``FORMAT`` (as Hydra's ``${now:FORMAT}``) followed by ``_<microseconds>-<pid>``,
so that two runs started in the same second, even on two hosts sharing the log folder, get different folders;
cached like ``${now:}`` (one value per format for the whole run, its sweep jobs included).

``${python:}``: the interpreter running this process (``sys.executable``), for configs that start child processes.
"""

from __future__ import annotations

import datetime
import os
import sys

from omegaconf import OmegaConf


def unique_now(pattern: str) -> str:
    """``datetime.now().strftime(pattern)`` + ``_<microseconds, 6 digits>-<process id>`` (sorts as the time)."""
    now = datetime.datetime.now()
    return f"{now.strftime(pattern)}_{now.microsecond:06d}-{os.getpid()}"


def register() -> None:
    """Register the resolvers (again: replaced, so that importing twice is harmless)."""
    OmegaConf.register_new_resolver("unique_now", unique_now, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("python", lambda: sys.executable, replace=True)


register()
