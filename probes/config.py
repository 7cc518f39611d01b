"""Where the Hydra configs live (``conf/`` beside the package) and composing them without a Hydra app.

The command-line entry points (``train.py``, ``python -m probes.analyze``, ``probes-fetch``) and the
Python API compose the same files, so a notebook and the CLI see one set of defaults.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import get_object
import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

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


def plain(value: Any, resolve: bool = True) -> Any:
    """``value`` as plain Python values, recursively: the one conversion of configs to dicts.

    Args:
        value: An omegaconf container (read as dicts and lists), a dataclass instance (a dict of its fields),
            a mapping (a dict), a list or tuple (kept as such), a path (its string), a numpy scalar (the Python
            number), or anything else (returned as it is).
        resolve: Resolve the interpolations of omegaconf containers.

    Returns:
        The plain value: what a pickle, a JSON file and a weights-only checkpoint load all read.
    """
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=resolve)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v, resolve) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v, resolve) for v in value]
    if isinstance(value, tuple):  # a named tuple too: its class would not load
        return tuple(plain(v, resolve) for v in value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


# ----------------------------------------------------------------------------- types of config values
class ConfigTypeError(TypeError):
    """Config values of the wrong type (the message names every key, what it expects and what it got)."""


# Nodes without a `_target_` that are read into a dataclass (its fields' annotations type their keys).
NODE_SCHEMAS = {"extract": "probes.extract.settings.ExtractSettings"}
# Keys of the entry configs' root that no `_target_` receives: their types (train.yaml, analyze.yaml).
ROOT_TYPES: dict[str, Any] = {"seed": int, "fit": bool, "test": bool, "optimized_metric": str,
                              "splits": list[str], "malloc_mmap_threshold": int | None, "resume": str | None,
                              "analysis_device": str | None}


def check_types(cfg: DictConfig) -> None:
    """Check every value of ``cfg`` that a ``_target_`` receives against the target's signature, and the root
    keys of :data:`ROOT_TYPES`; raise one :class:`ConfigTypeError` naming each wrong key, e.g.
    ``analysis.max_sentences: expected int or null, got 'five' (str)``.

    A parameter's type is its annotation (for a class, the annotation of that parameter in every ``__init__``
    of its bases that has it), else the type of its default (``True``: bool, ``(1, 2)``: a list, ...); only
    the plain types of a config (bool, int, float, str, null, lists, mappings, ``Literal``) are checked, so an
    annotation of another class never rejects a value. A value that cannot be resolved here (``${hydra:...}``
    outside a Hydra app) is not checked."""
    errors: list[str] = []
    for key, want in ROOT_TYPES.items():
        if key in cfg:
            _check_value(cfg, key, key, want, errors)
    for key, schema in NODE_SCHEMAS.items():
        if isinstance(cfg.get(key), DictConfig):
            _check_value(cfg, key, key, get_object(schema), errors)
    _walk(cfg, "", errors)
    if errors:
        raise ConfigTypeError("wrong types in the config (check the overrides):\n  " + "\n  ".join(errors))


def _walk(node: DictConfig, prefix: str, errors: list[str]) -> None:
    target = node.get("_target_") if "_target_" in node else None
    types = _param_types(target) if isinstance(target, str) else {}
    for key in node:
        key = str(key)
        path = f"{prefix}{key}"
        if key in types:
            _check_value(node, key, path, types[key], errors)
        try:
            child = node._get_node(key)
        except Exception:
            continue
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_interpolation():
            _walk(child, f"{path}.", errors)
        elif isinstance(child, ListConfig) and not child._is_missing() and not child._is_interpolation():
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _walk(item, f"{path}[{i}].", errors)


def _check_value(node: DictConfig, key: str, path: str, want: Any, errors: list[str]) -> None:
    try:
        value = node[key]
    except Exception:  # ${hydra:...} outside Hydra, a missing value (???): checked where it is used
        return
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            value = plain(value)
        except Exception:
            return
        if isinstance(value, dict) and "_target_" in value:
            return  # an object built from its node
    errors.extend(_problems(value, want, path))


def _problems(value: Any, want: Any, path: str) -> list[str]:
    """The errors of ``value`` against ``want``: a mapping's or list's items are named by their own key."""
    if isinstance(want, _AllOf):
        return list(dict.fromkeys(e for w in want for e in _problems(value, w, path)))
    if dataclasses.is_dataclass(want) and isinstance(value, dict):  # a node read into a dataclass
        hints = typing.get_type_hints(want)
        return [e for f in dataclasses.fields(want) if f.name in value
                for e in _problems(value[f.name], hints[f.name], f"{path}.{f.name}")]
    origin, args = typing.get_origin(want), typing.get_args(want)
    base = origin or want
    if isinstance(value, dict) and len(args) == 2 and base in (dict, collections.abc.Mapping,
                                                               collections.abc.MutableMapping):
        return [e for k, v in value.items() for e in _problems(v, args[1], f"{path}.{k}")]
    if origin in (typing.Union, types.UnionType) and isinstance(value, dict):
        fits = [a for a in args if (typing.get_origin(a) or a) in (dict, collections.abc.Mapping,
                                                                   collections.abc.MutableMapping)]
        if len(fits) == 1:
            return _problems(value, fits[0], path)
    if _matches(value, want):
        return []
    return [f"{path}: expected {_describe(want)}, got {value!r} ({type(value).__name__})"]


def _param_types(target: str) -> dict[str, Any]:
    """Parameter name -> the types its value must have (several: one per ``__init__`` up a class's bases)."""
    try:
        obj = get_object(target)
    except Exception:  # an unknown target: instantiate names it
        return {}
    fns = [c.__dict__["__init__"] for c in inspect.getmro(obj) if "__init__" in c.__dict__] \
        if inspect.isclass(obj) else [obj]
    out: dict[str, list] = {}
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        for name, p in params.items():
            want = _annotation(fn, p)
            if want is not None:
                out.setdefault(name, []).append(want)
    return {k: _AllOf(v) for k, v in out.items()}


class _AllOf(tuple):
    """Types a value must match all of (one parameter's annotations up a class's bases)."""


def _annotation(fn, p: inspect.Parameter) -> Any:
    """The parameter's type: its annotation (a string one resolved in the function's module by
    :func:`typing.get_type_hints`; one that does not resolve counts as none), else the type of its default;
    None when neither says anything checkable."""
    ann = p.annotation
    if isinstance(ann, str):
        holder = types.SimpleNamespace(__annotations__={p.name: ann})
        try:
            ann = typing.get_type_hints(holder, globalns=vars(sys.modules[fn.__module__]), include_extras=True)[p.name]
        except Exception:  # a name the module imports only for type checkers
            ann = inspect.Parameter.empty
    if ann is not inspect.Parameter.empty:
        return ann
    d = p.default
    if isinstance(d, bool):
        return bool
    if isinstance(d, (int, float, str)):
        return type(d)
    if isinstance(d, (tuple, list)):
        return list
    return None


def _matches(value: Any, want: Any) -> bool:
    if isinstance(want, _AllOf):
        return all(_matches(value, w) for w in want)
    if want is Any or want is inspect.Parameter.empty:
        return True
    if want is None or want is type(None):
        return value is None
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is typing.Annotated:
        return _matches(value, args[0])
    if want is bool:
        return isinstance(value, bool)
    if dataclasses.is_dataclass(want):
        return isinstance(value, dict)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is str:
        return isinstance(value, str)
    if want in (Path, os.PathLike):
        return isinstance(value, (str, os.PathLike))
    base = origin or want
    if base in (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection) \
            or base is ListConfig:
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args and (base is not tuple or len(args) == 2 and args[1] is Ellipsis) else None
        return item is None or all(_matches(v, item) for v in value)
    if base in (dict, collections.abc.Mapping, collections.abc.MutableMapping) or base is DictConfig:
        if not isinstance(value, dict):
            return False
        return len(args) != 2 or all(_matches(v, args[1]) for v in value.values())
    if isinstance(value, (dict, list)) or not inspect.isclass(base):
        return True  # a node or list given to another class (or a typing construct): not checked here
    return isinstance(value, base)  # a plain value must be of the annotated class


def _describe(want: Any) -> str:
    if isinstance(want, _AllOf):
        return " and ".join(dict.fromkeys(_describe(w) for w in want))
    if want is None or want is type(None):
        return "null"
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    plain = {list: "a list", tuple: "a list", dict: "a mapping", collections.abc.Sequence: "a list",
             collections.abc.Mapping: "a mapping"}
    if origin is not None:
        return plain.get(origin, getattr(origin, "__name__", str(want)))
    return plain.get(want, getattr(want, "__name__", str(want)))
