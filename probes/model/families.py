"""Per-family conventions of encoders and causal LMs, read from the model's config and tokenizer.

Only what differs between families lives here: how many position embeddings are usable
(RoBERTa-style models offset positions by ``padding_idx + 1``: 514 positions, 512 usable), whether
pre-split words need a prefix space (byte-level BPE), and which families do not go through
transformers' attention interface (DeBERTa-v2/v3's disentangled attention, MPNet's relative position
bias: adapters in :mod:`probes.model.attention_function`).

Causal LMs (:func:`is_causal`: transformers has a causal-LM class for the config and no masked-LM one) read
each sequence as ``[BOS] pieces`` where their tokenizer adds a BOS (Llama, Gemma, Phi-3) and as ``pieces``
where it adds none (GPT-2, GPT-NeoX, Qwen, OLMo 2); :func:`set_bos` adds or removes it on request (the
encoder option ``bos``: null = as the tokenizer does). :func:`set_padding` gives tokenizers without a pad
token their EOS as pad (right padding: with a causal mask the real tokens never see the pads).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import processors
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

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
    causal: bool = False  # a causal LM (each token sees itself and earlier tokens only)


def usable_max_length(config) -> int:
    """Longest input the position embeddings allow: RoBERTa's 514 positions hold 512 tokens."""
    n = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in POSITION_OFFSET_TYPES:
        n -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    return n


def family(config) -> Family:
    """The conventions of the model described by ``config`` (sizes always from the config)."""
    return Family(str(config.model_type), usable_max_length(config), int(config.num_hidden_layers),
                  int(config.num_attention_heads), is_causal(config))


def is_causal(config) -> bool:
    """A causal LM: transformers has a causal-LM class for this config type and no masked-LM one (BERT has
    both and is an encoder; GPT-2, Llama, ... have only the causal one)."""
    t = type(config)
    return t in MODEL_FOR_CAUSAL_LM_MAPPING and t not in MODEL_FOR_MASKED_LM_MAPPING


def special_ids(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before the first word, ids after the last word) that the tokenizer adds to one text:
    ([CLS], [SEP]) for BERT, ([BOS], []) for Llama, ([], []) for GPT-2."""
    enc = tokenizer("a b", add_special_tokens=True)
    ids, seq = list(enc["input_ids"]), enc.sequence_ids()
    words = [i for i, s in enumerate(seq) if s is not None]
    return ids[:words[0]], ids[words[-1] + 1:]


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its BOS token in front of a sequence."""
    first, _ = special_ids(tokenizer)
    return tokenizer.bos_token_id is not None and first[:1] == [tokenizer.bos_token_id]


def set_bos(tokenizer, add: bool):
    """``tokenizer`` with its post-processor changed so that it adds (``add``) or does not add a BOS token in
    front of every sequence, its other special tokens kept; unchanged when it already does what is asked.
    A tokenizer without a BOS token cannot add one (a clear error)."""
    if adds_bos(tokenizer) == bool(add):
        return tokenizer
    if add and tokenizer.bos_token_id is None:
        raise ValueError(f"{type(tokenizer).__name__} has no BOS token, so encoder.bos=true cannot add one; "
                         "use encoder.bos=null (as the tokenizer does)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__}: encoder.bos needs a fast (tokenizers) tokenizer")
    first, last = special_ids(tokenizer)
    first = [tokenizer.bos_token_id, *first] if add else first[1:]
    tokens = {i: t for i, t in zip(first + last, tokenizer.convert_ids_to_tokens(first + last))}

    def seq(ids, type_id):
        return [f"{tokens[i]}:{type_id}" for i in ids]

    single = " ".join([*seq(first, 0), "$A:0", *seq(last, 0)])
    pair = " ".join([*seq(first, 0), "$A:0", *seq(last, 0), "$B:1", *seq(last, 1)])
    post = [processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(t, i) for i, t in tokens.items()])]
    if "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("post_processor") or {}):
        post.insert(0, processors.ByteLevel(trim_offsets=True))
    backend.post_processor = processors.Sequence(post)
    return tokenizer


def set_padding(tokenizer, config=None):
    """Right padding, and the EOS token as pad token where the tokenizer has none (GPT-2, Llama); the config's
    ``pad_token_id`` set from the tokenizer where missing (sequence classification finds the last real token
    by it). Returns the tokenizer."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if config is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def is_byte_level(tokenizer) -> bool:
    """True for byte-level BPE tokenizers (RoBERTa, ModernBERT, GPT-2 style), which need
    ``add_prefix_space=True`` to tokenize pre-split words as they appear inside running text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    return "ByteLevel" in json.dumps(pre)
