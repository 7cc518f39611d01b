"""``probes-view sentence="..." [kinds=[attention,alti]] [encoder=...] [out=<file>.html]`` (conf/view.yaml).

One sentence's word maps of one or more kinds as one self-contained HTML page, written atomically (by default
to ``logs/view/<time>/view.html``, as every other output under ``paths.log_dir``; the command prints the full
path): a thin layer over :func:`probes.api.word_maps` and :func:`probes.api.view`. The arguments are Hydra
overrides of ``conf/view.yaml``, composed with :func:`probes.config.compose` (no Hydra app runs, so the API
composes its own ``conf/analyze.yaml`` for the extraction settings; ``extract.*`` and ``analysis_device``
overrides are passed on).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.errors import ConfigCompositionException, OverrideParseException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from probes.api import own_errors, view, word_maps
from probes.config import CONF_DIR, compose
from probes.measures import check_kind

PASSED_ON = ("extract.", "analysis_device")


def _list(value, key: str) -> list:
    """``value`` as a list: a scalar becomes one item; anything else is an error naming ``key``."""
    if isinstance(value, ListConfig):
        return list(OmegaConf.to_container(value))
    if isinstance(value, (str, int)):
        return [value]
    raise ValueError(f"conf/view.yaml: {key} must be a value or a list, got {value!r}")


def _sentence(cfg: DictConfig) -> str | list[str]:
    if OmegaConf.is_missing(cfg, "sentence"):
        raise ValueError('conf/view.yaml: sentence is required, e.g. probes-view sentence="The cat sat ."')
    sentence = cfg.sentence
    if isinstance(sentence, ListConfig):
        return [str(w) for w in sentence]
    if not isinstance(sentence, str):
        raise ValueError(f"conf/view.yaml: sentence must be a string or a list of words, got {sentence!r}")
    return sentence


def run(overrides: Sequence[str]) -> Path:
    """Compose conf/view.yaml with ``overrides``, compute the maps of ``kinds`` for ``sentence`` and write the
    page to ``out`` (default: ``<paths.log_dir>/view/<time>/view.html``).

    Args:
        overrides: Hydra overrides, e.g. ``["sentence=The cat sat .", "kinds=[attention,alti]", "encoder=tiny"]``.

    Returns:
        The page's absolute path.
    """
    cfg = compose("view", overrides)
    sentence = _sentence(cfg)
    kinds = [str(k) for k in _list(cfg.kinds, "kinds")]
    for i, k in enumerate(kinds):
        check_kind(k, cfg.extract.measures, name=f"kinds[{i}]")  # the key of conf/view.yaml, before any model
    layers = None if cfg.layers is None else _list(cfg.layers, "layers")
    if layers is not None and not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ValueError(f"conf/view.yaml: layers must be null, a layer or a list of layers (0-based ints), "
                         f"got {layers!r}")
    passed = [o for o in overrides if o.lstrip("+~").startswith(PASSED_ON)]
    with own_errors():  # e.g. ModelNotFetched (a FileNotFoundError naming the fetch command)
        enc = instantiate(cfg.encoder)
    maps = [word_maps(enc, [sentence], kind=k, layers=layers, overrides=passed)[0] for k in kinds]
    title = cfg.title or f"{enc.name}: {' '.join(maps[0].words)}"
    return view(maps, Path(cfg.out).resolve(), title=title)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: ``argv`` (default ``sys.argv[1:]``) are overrides of conf/view.yaml; ``--help``
    prints its header. Prints the page's full path; bad input exits with status 2 and one line naming the key at
    fault (no traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        head = [ln for ln in (CONF_DIR / "view.yaml").read_text().splitlines() if ln.startswith("#")]
        print("\n".join(ln[2:] for ln in head))
        return
    try:
        page = run(args)
    except (ValueError, KeyError, FileNotFoundError, OverrideParseException, ConfigCompositionException) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"probes-view: error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    print(page)


if __name__ == "__main__":
    main()
