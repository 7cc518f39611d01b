"""Where the Hydra configs live (``conf/`` beside the package) and composing them without a Hydra app.

The command-line entry points (``train.py``, ``python -m probes.analyze``, ``probes-fetch``) and the
Python API compose the same files, so a notebook and the CLI see one set of defaults.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

import probes.resolvers  # noqa: F401  (${unique_now:...} in conf/hydra)

# The repository root: conf/ and (by default) data/, logs/ and .cache/ live here.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"


def conf_dir() -> Path:
    """``conf/`` of this checkout; a clear error when the package was installed without it."""
    if not (CONF_DIR / "train.yaml").is_file():
        raise FileNotFoundError(
            f"the Hydra configs are not at {CONF_DIR}: install probes from a checkout "
            "(`pip install -e .` in the repository), which keeps conf/ beside the package")
    return CONF_DIR


def compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with command-line style ``overrides`` (``["encoder=tiny", ...]``).

    ``${hydra:...}`` interpolations stay unresolved (there is no running Hydra app); ``PROJECT_ROOT`` is set
    to the repository root for ``paths.root_dir`` as the entry points do.
    """
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
