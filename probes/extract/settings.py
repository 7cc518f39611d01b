"""The ``extract`` config node as one object: pooling, length policy, precision, map kind, batching, Trainer.

Every place that extracts (the attention and hidden-state caches of a treebank split, the maps of an
analysis's own sentences) reads its settings through :class:`ExtractSettings`, so the precision is
resolved, the Trainer made and the settings passed to the stage in one way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from probes.config import plain
from probes.extract.precision import Precision, check_precision, record, resolve_precision
from probes.measures import Measure, build, check_kind


@dataclass(frozen=True)
class ExtractSettings:
    """The settings of ``conf/extract/default.yaml`` (one field per key; see that file for their meaning).

    Built with :meth:`from_config`; the mappings (``measures``, ``trainer``) are plain resolved dicts and
    are not to be modified (use :meth:`replace`).
    """

    from_words: str  # attention FROM a split word: mean | sum | first over its pieces
    to_words: str  # attention TO a split word
    max_length: int | None  # wordpieces incl. specials; None: the encoder's usable length
    long_sentences: str  # skip | error
    layers: list[int] | None  # 0-based layers to extract (None: all); part of the key when set
    precision: Precision  # a Lightning precision, or auto (measured, :mod:`probes.extract.precision`)
    precision_margin: float  # auto: the speed-up over 32-true another precision needs to be chosen
    maps: str  # the map kind, one of ``measures``
    measures: Mapping[str, Mapping[str, Any]]  # {kind: {_target_: ..., options}}
    max_tokens: int  # wordpieces per batch
    max_batch_size: int  # sentences per batch
    max_pairs: int | None  # batch size * longest^2 per batch (attention maps); None: no bound
    attention_budget_mb: float  # whole maps of a batch above this: attention in blocks of rows (probes.maps.engine)
    num_workers: int  # DataLoader processes
    trainer: Mapping[str, Any]  # the extraction Trainer's node (``_target_`` and arguments, no precision)

    @classmethod
    def from_config(cls, node: ExtractSettings | DictConfig | Mapping) -> ExtractSettings:
        """From the ``extract`` node (a DictConfig, resolved) or a plain mapping with the same keys; an
        :class:`ExtractSettings` is returned as is. Every key of ``conf/extract/default.yaml`` is required; an
        unknown ``precision`` is an error naming ``extract.precision`` and the allowed values."""
        if isinstance(node, ExtractSettings):
            return node
        if not isinstance(node, DictConfig):
            node = OmegaConf.create(dict(node))
        values = plain(node)
        names = [f.name for f in dataclasses.fields(cls)]
        missing, unknown = [n for n in names if n not in values], sorted(set(values) - set(names))
        if missing or unknown:
            raise ValueError(f"extract settings: missing keys {missing}, unknown keys {unknown} "
                             f"(conf/extract/default.yaml lists every key: {', '.join(names)})")
        check_precision(values["precision"])  # before any model is loaded or child process started
        return cls(**{n: values[n] for n in names})

    def replace(self, **changes) -> ExtractSettings:
        """A copy with ``changes`` (e.g. ``max_length`` and ``long_sentences`` for sentences made to fit)."""
        return dataclasses.replace(self, **changes)

    @property
    def accelerator(self) -> str:
        """The extraction Trainer's accelerator (``trainer.accelerator``; ``auto`` when unset)."""
        return str(self.trainer.get("accelerator", "auto"))

    def resolve_precision(self, encoder, sentences: Sequence[Sequence[str]] | None = None,
                          cache_dir: str | Path | None = None, lookup_only: bool = False) -> str | None:
        """The precision to extract with (:func:`probes.extract.precision.resolve_precision`: ``auto`` is
        measured on ``sentences``, or only looked up with ``lookup_only``, then None when not measured yet)."""
        return resolve_precision(self.precision, self.accelerator, encoder, sentences=sentences,
                                 cache_dir=cache_dir, lookup_only=lookup_only, margin=self.precision_margin)

    def precision_record(self, encoder=None, cache_dir: str | Path | None = None) -> dict:
        """What a run folder records about the precision (:func:`probes.extract.precision.record`: requested,
        resolved, how it was decided, the measurement's timings and margin); measures and loads nothing."""
        return record(self.precision, self.accelerator, encoder, cache_dir, margin=self.precision_margin)

    def make_trainer(self, precision: str) -> Callable[..., pl.Trainer]:
        """A partial Trainer constructor (``trainer`` node at ``precision``); the stage adds its callbacks."""
        return instantiate(dict(self.trainer), precision=precision, _partial_=True)

    def max_length_for(self, encoder) -> int:
        """``max_length``, or the encoder's usable length when it is None (the value in the cache key)."""
        return self.max_length or encoder.max_length

    def layers_for(self, encoder) -> list[int]:
        """The 0-based layers to extract from ``encoder`` (all when ``layers`` is None), checked: an error
        naming ``extract.layers`` for an index outside the model or a repeated one."""
        L = int(encoder.num_layers)
        if self.layers is None:
            return list(range(L))
        layers = [int(l) for l in self.layers]
        bad = [l for l in layers if not 0 <= l < L]
        if bad or not layers or len(set(layers)) != len(layers):
            raise ValueError(f"extract.layers={list(self.layers)}: expected distinct 0-based layers of "
                             f"{encoder.name} in 0..{L - 1} (it has {L} layers; null = all)"
                             + (f"; out of range: {bad}" if bad else ""))
        return layers

    def layer_key(self, encoder) -> dict:
        """The layers' part of a cache key: ``{"layers": [...]}``, the stored layers in order (:meth:`layers_for`;
        ``layers=None`` and the list of every layer give the same key)."""
        return {"layers": self.layers_for(encoder)}

    def map_key(self) -> dict:
        """The map kind's part of a cache key: ``{"maps": {"kind": kind, **its measure node}}``."""
        check_kind(self.maps, self.measures)
        return {"maps": dict(kind=self.maps, **self.measures[self.maps])}

    def measure(self) -> Measure:
        """The :class:`~probes.measures.Measure` of ``maps``."""
        return build(self.maps, self.measures)

    def batching(self) -> dict:
        """``max_tokens``, ``max_batch_size``, ``max_pairs``, ``num_workers``, ``attention_budget_mb`` (not part of any
        cache key)."""
        return dict(max_tokens=self.max_tokens, max_batch_size=self.max_batch_size, max_pairs=self.max_pairs,
                    num_workers=self.num_workers, attention_budget_mb=self.attention_budget_mb)
