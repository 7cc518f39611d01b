"""Per-family conventions of BERT-family encoders, read from the model's config and tokenizer.

Only what differs between families lives here: how many position embeddings are usable
(RoBERTa-style models offset positions by ``padding_idx + 1``: 514 positions, 512 usable), whether
pre-split words need a prefix space (byte-level BPE), and which families do not go through
transformers' attention interface (DeBERTa-v2/v3's disentangled attention: adapter in
:mod:`probes.model.hooks`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# model_type -> families whose position ids start after the padding index (create_position_ids_from_input_ids).
POSITION_OFFSET_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "longformer", "xlm-roberta-xl",
                                   "data2vec-text", "mpnet", "luke"})


@dataclass(frozen=True)
class Family:
    """A model's type, usable sequence length and sizes (from its config)."""

    model_type: str
    max_length: int      # usable wordpieces per sequence, special tokens included
    num_layers: int
    num_heads: int


def usable_max_length(config) -> int:
    """Longest input the position embeddings allow: RoBERTa's 514 positions hold 512 tokens."""
    n = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in POSITION_OFFSET_TYPES:
        n -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    return n


def family(config) -> Family:
    """The conventions of the model described by ``config`` (sizes always from the config)."""
    return Family(str(config.model_type), usable_max_length(config), int(config.num_hidden_layers),
                  int(config.num_attention_heads))


def is_byte_level(tokenizer) -> bool:
    """True for byte-level BPE tokenizers (RoBERTa, ModernBERT, GPT-2 style), which need
    ``add_prefix_space=True`` to tokenize pre-split words as they appear inside running text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    return "ByteLevel" in json.dumps(pre)
