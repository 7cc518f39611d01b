"""Tiny, randomly initialised encoders of every supported family, with tokenizers made offline.

Each model is a local folder (``save_pretrained`` of the family's masked-LM model plus its tokenizer)
that ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModel(ForMaskedLM)`` load by path, without a hub.
Tokenizers follow each family's convention:

* ``bert``, ``distilbert``, ``electra``: lower-cased WordPiece on the vocab.txt of the packaged
  all-MiniLM-L6-v2 (``[CLS] x [SEP]``). transformers 5 has no ELECTRA tokenizer class
  (``ElectraTokenizerFast`` is an alias of ``BertTokenizer``, the class AutoTokenizer uses for
  ELECTRA), so ELECTRA's folder names ``BertTokenizer``; DistilBERT's names ``DistilBertTokenizer``.
* ``roberta``: byte-level BPE (``<s> x </s>``; ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3,
  ``<mask>`` last) trained with ``tokenizers``, saved with ``add_prefix_space=True`` so that
  pre-split words (``is_split_into_words=True``) are tokenized as inside running text.
* ``xlm-roberta``, ``albert``, ``deberta-v2``: SentencePiece-style Unigram (Metaspace ``"▁"``)
  trained with ``tokenizers``' UnigramTrainer (``sentencepiece`` is not needed: the transformers 5
  classes ``XLMRobertaTokenizer`` / ``AlbertTokenizer`` / ``DebertaV2Tokenizer`` are built from a
  ``(piece, score)`` list). Special tokens as the real checkpoints: XLM-R ``<s> <pad> </s> <unk>``
  first and ``<mask>`` last; ALBERT ``<pad> <unk> [CLS] [SEP] [MASK]`` (lower-cased, like
  albert-base-v2); DeBERTa-v3 ``[PAD] [CLS] [SEP] [UNK]`` first and ``[MASK]`` last.
* ``mpnet``: MPNet's own ``MPNetTokenizer`` (lower-cased WordPiece, ``<s> x </s>``) on MPNet's vocabulary
  layout, ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3, then the packaged MiniLM vocab.txt (``[UNK]`` the
  unknown token, as all-mpnet-base-v2), ``<mask>`` last; ``max_positions + 2`` position embeddings (positions
  start after ``padding_idx`` = 1, as RoBERTa); 32 relative-position buckets (the encoder's fixed count).
* ``modernbert``: byte-level BPE with BERT-style special tokens (``[CLS] x [SEP]``, the specials
  after the pieces as in the real ModernBERT), a ``PreTrainedTokenizerFast`` as the real one, but
  with ``add_prefix_space=True`` (the real one has False) for pre-split words.

Causal LMs (:data:`DECODERS`, saved with their causal-LM head): ``gpt2``, ``llama``, ``qwen2``, ``qwen3``,
``mistral`` (sliding window), ``gemma2`` (attention soft-capping, alternating sliding windows), ``gemma3``
(``gemma3_text``: QK norm, alternating sliding windows), ``phi3`` (fused QKV), ``olmo2`` (QK norm, norms
on the sub-layer outputs), ``gpt_neox`` (parallel residual); grouped-query attention (2 key/value heads
for 4 query heads) wherever the family has it, sliding windows of :data:`DECODER_WINDOW` tokens. Their
tokenizers are byte-level BPE ``PreTrainedTokenizerFast`` without a prefix space (as GPT-2's: a text's first
word reads ``The``, later ones ``Ġcat``) with each family's special tokens and BOS habit: a BOS added in front (``<s>`` for llama/mistral/phi3, ``<bos>`` for the Gemmas) or nothing
(``<|endoftext|>`` as BOS/EOS of gpt2/gpt_neox/qwen/olmo2, not added), no pad token for gpt2, gpt_neox and
llama (as the real ones: :func:`probes.model.families.conventions` sets it when loading).

The default training corpus is the vocabulary of the packaged MiniLM (``##`` stripped) plus the
capitalised forms of its 2000 most frequent whole words (so that cased tokenizers have ``The``);
pass ``corpus`` (strings, e.g. the sentences of the UD EWT train file) to train on text instead.
Everything is deterministic given ``seed`` and ``corpus`` (UnigramTrainer's hash-ordered scores of
rare characters are made canonical).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Iterable

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, PreTrainedTokenizerFast, RobertaTokenizer
from transformers.utils import logging as hf_logging

from probes.model.load import load_encoder, packaged_minilm_path

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "albert", "deberta-v2", "modernbert",
            "mpnet")
FORMAT = 2                     # bump when what build_tiny writes changes (part of tiny_folder's hash)
VOCAB_SIZE = 2000              # trained tokenizers (BPE / Unigram), special tokens included
MODERNBERT_LOCAL_ATTENTION = 8  # total sliding window of ModernBERT's local layers (4 tokens each side)
DEBERTA_POSITION_BUCKETS = 32  # log-bucketed relative positions (deberta-v3 uses 256)
ALBERT_EMBEDDING_SIZE = 16
MPNET_BUCKETS = 32             # MPNet's relative-position buckets (MPNetEncoder.compute_position_bias uses 32)
SIZES = dict(seed=0, num_layers=2, num_heads=4, hidden=32, intermediate=64, max_positions=128)
DECODER_WINDOW = 4             # sliding window (tokens, the query included) of mistral and the Gemmas' local layers
GEMMA2_SOFTCAP = 0.5           # attention logit soft-capping of the tiny gemma2 (real: 50), small so that it acts
KV_HEADS = 2                   # key/value heads of the grouped-query families (query heads: num_heads)

# family -> (model_type, special tokens in id order, BOS/EOS tokens, whether the BOS is added in front, pad or None)
DECODERS = {
    "gpt2": ("gpt2", ["<|endoftext|>"], ("<|endoftext|>", "<|endoftext|>"), False, None),
    "llama": ("llama", ["<unk>", "<s>", "</s>"], ("<s>", "</s>"), True, None),
    "qwen2": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ("<|endoftext|>", "<|endoftext|>"), False,
              "<|endoftext|>"),
    "qwen3": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ("<|endoftext|>", "<|im_end|>"), False,
              "<|endoftext|>"),
    "mistral": ("mistral", ["<unk>", "<s>", "</s>"], ("<s>", "</s>"), True, "<unk>"),
    "gemma2": ("gemma2", ["<pad>", "<eos>", "<bos>", "<unk>"], ("<bos>", "<eos>"), True, "<pad>"),
    "gemma3": ("gemma3_text", ["<pad>", "<eos>", "<bos>", "<unk>"], ("<bos>", "<eos>"), True, "<pad>"),
    "phi3": ("phi3", ["<unk>", "<s>", "</s>", "<|endoftext|>"], ("<s>", "<|endoftext|>"), True, "<|endoftext|>"),
    "olmo2": ("olmo2", ["<|endoftext|>", "<|pad|>"], ("<|endoftext|>", "<|endoftext|>"), False, "<|pad|>"),
    "gpt_neox": ("gpt_neox", ["<|endoftext|>"], ("<|endoftext|>", "<|endoftext|>"), False, None),
}
ALL_FAMILIES = FAMILIES + tuple(DECODERS)

_WORDPIECE_FAMILIES = {"bert", "distilbert", "electra"}


def _check_family(family: str) -> None:
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(ALL_FAMILIES)}")


# --------------------------------------------------------------------------- corpus


def _minilm_dir() -> Path:
    return Path(packaged_minilm_path())


@functools.lru_cache(maxsize=1)
def default_corpus() -> tuple[str, ...]:
    """The MiniLM vocab.txt tokens (``##`` stripped, ``[...]`` specials dropped, first occurrence
    kept) plus the capitalised forms of its first 2000 lower-case whole words."""
    lines = (_minilm_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    words, seen = [], set()
    for tok in lines:
        w = tok[2:] if tok.startswith("##") else tok
        if not w or (w.startswith("[") and w.endswith("]")) or w in seen:
            continue
        seen.add(w)
        words.append(w)
    whole = [t for t in lines if t.isascii() and t.isalpha() and t.islower() and len(t) > 1][:2000]
    words += [w.capitalize() for w in whole if w.capitalize() not in seen]
    return tuple(words)


def _corpus(corpus: Iterable[str] | None) -> tuple[str, ...]:
    return default_corpus() if corpus is None else tuple(str(s) for s in corpus)


def _digest(corpus: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for s in corpus:
        h.update(s.encode("utf-8") + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- tokenizer training


@functools.lru_cache(maxsize=8)
def _train_bpe(corpus: tuple[str, ...], n_pieces: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Byte-level BPE pieces (in id order) and merges trained on ``corpus`` without special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = tuple(p for p, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = tuple(tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"])
    return pieces, merges


@functools.lru_cache(maxsize=8)
def _train_unigram(corpus: tuple[str, ...], n_pieces: int, lowercase: bool) -> tuple[tuple[str, float], ...]:
    """Unigram ``(piece, log-prob)`` pairs (no special tokens) trained on ``corpus`` split at spaces
    with a ``"▁"`` Metaspace prefix (lower-cased, accents stripped as ALBERT when ``lowercase``).

    The trainer appends characters it pruned with scores in hash order and sorts ties in hash order;
    those characters get one floor score, and pieces are sorted by (score, piece), so that the
    result does not depend on the process.
    """
    placeholder = "\u0000unk\u0000"
    tok = Tokenizer(models.Unigram())
    norm = ([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()] if lowercase
            else [normalizers.NFC()])
    tok.normalizer = normalizers.Sequence(norm)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    letters = string.ascii_lowercase if lowercase else string.ascii_letters
    alphabet = list(letters + string.digits + string.punctuation)
    trainer = trainers.UnigramTrainer(vocab_size=n_pieces + 1, special_tokens=[placeholder], unk_token=placeholder,
                                      initial_alphabet=alphabet, show_progress=False, seed_size=10_000,
                                      shrinking_factor=0.5)  # 3x faster than the defaults, as good here
    tok.train_from_iterator(corpus, trainer)
    vocab = [(p, float(s)) for p, s in json.loads(tok.to_str())["model"]["vocab"] if p != placeholder]
    multi = [s for p, s in vocab if len(p) > 1]
    floor = min(multi) if multi else min(s for _, s in vocab)
    # pruned-then-required characters sit at the floor +- 1e-4 * k (hash order): one score for all
    canon = [(p, round(floor, 4) - 1.0 if len(p) == 1 and s < floor + 0.1 else round(s, 6)) for p, s in vocab]
    canon.sort(key=lambda ps: (-ps[1], ps[0]))
    return tuple(canon)


# --------------------------------------------------------------------------- tokenizers per family


def _wordpiece_tokenizer(family: str, max_positions: int):
    cls = {"bert": transformers.BertTokenizer, "distilbert": transformers.DistilBertTokenizer,
           "electra": transformers.BertTokenizer}[family]  # ELECTRA: no own class in transformers 5
    lines = (_minilm_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = {}
    for tok in lines:
        vocab.setdefault(tok, len(vocab))
    return cls(vocab=vocab, do_lower_case=True, model_max_length=max_positions)


def _mpnet_tokenizer(max_positions: int):
    """MPNet's WordPiece tokenizer: ``<s> <pad> </s> <unk>`` first, the MiniLM vocabulary, ``<mask>`` last."""
    lines = (_minilm_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab: dict[str, int] = {}
    for tok in ["<s>", "<pad>", "</s>", "<unk>", *lines, "<mask>"]:
        vocab.setdefault(tok, len(vocab))
    return transformers.MPNetTokenizer(vocab=vocab, do_lower_case=True, unk_token="[UNK]",
                                       model_max_length=max_positions)


def _roberta_tokenizer(corpus: tuple[str, ...], max_positions: int):
    head, tail = ["<s>", "<pad>", "</s>", "<unk>"], ["<mask>"]
    pieces, merges = _train_bpe(corpus, VOCAB_SIZE - len(head) - len(tail))
    vocab = {p: i for i, p in enumerate([*head, *pieces, *tail])}
    return RobertaTokenizer(vocab=vocab, merges=list(merges), add_prefix_space=True, model_max_length=max_positions)


def _modernbert_tokenizer(corpus: tuple[str, ...], max_positions: int):
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    pieces, merges = _train_bpe(corpus, VOCAB_SIZE - len(specials))
    vocab = {p: i for i, p in enumerate([*pieces, *specials])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
                                      special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        mask_token="[MASK]", add_prefix_space=True, model_max_length=max_positions,
        model_input_names=["input_ids", "attention_mask"], clean_up_tokenization_spaces=False)


def _unigram_tokenizer(family: str, corpus: tuple[str, ...], max_positions: int):
    if family == "xlm-roberta":
        head, tail, lower = ["<s>", "<pad>", "</s>", "<unk>"], ["<mask>"], False
    elif family == "albert":
        head, tail, lower = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"], [], True
    else:  # deberta-v2 (deberta-v3's layout)
        head, tail, lower = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"], ["[MASK]"], False
    pieces = _train_unigram(corpus, VOCAB_SIZE - len(head) - len(tail), lower)
    vocab = [(t, 0.0) for t in head] + list(pieces) + [(t, 0.0) for t in tail]
    if family == "xlm-roberta":
        return transformers.XLMRobertaTokenizer(vocab=vocab, model_max_length=max_positions)
    if family == "albert":
        return transformers.AlbertTokenizer(vocab=vocab, do_lower_case=True, keep_accents=False,
                                            unk_token="<unk>", pad_token="<pad>", model_max_length=max_positions)
    return transformers.DebertaV2Tokenizer(vocab=vocab, do_lower_case=False, split_by_punct=False,
                                           model_max_length=max_positions)


def _decoder_tokenizer(family: str, corpus: tuple[str, ...], max_positions: int):
    """Byte-level BPE with the family's special tokens (first ids) and BOS habit (:data:`DECODERS`)."""
    _, specials, (bos, eos), bos_added, pad = DECODERS[family]
    pieces, merges = _train_bpe(corpus, VOCAB_SIZE - len(specials))
    vocab = {p: i for i, p in enumerate([*specials, *pieces])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # as GPT-2's: "The" at the start, " cat"
    tok.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=True)]
    if bos_added:
        post.append(processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                  special_tokens=[(bos, vocab[bos])]))
    tok.post_processor = processors.Sequence(post)
    names = dict(bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<unk>" if "<unk>" in vocab else None)
    return PreTrainedTokenizerFast(tokenizer_object=tok, add_prefix_space=False, model_max_length=max_positions,
                                   model_input_names=["input_ids", "attention_mask"],
                                   clean_up_tokenization_spaces=False, **{k: v for k, v in names.items() if v})


def make_tokenizer(family: str, corpus: Iterable[str] | None = None, max_positions: int = 128):
    """The family's tokenizer (a transformers tokenizer, not yet saved); see the module docstring."""
    _check_family(family)
    if family in DECODERS:
        return _decoder_tokenizer(family, _corpus(corpus), max_positions)
    if family in _WORDPIECE_FAMILIES:
        return _wordpiece_tokenizer(family, max_positions)
    if family == "mpnet":
        return _mpnet_tokenizer(max_positions)
    text = _corpus(corpus)
    if family == "roberta":
        return _roberta_tokenizer(text, max_positions)
    if family == "modernbert":
        return _modernbert_tokenizer(text, max_positions)
    return _unigram_tokenizer(family, text, max_positions)


# --------------------------------------------------------------------------- configs and models


def make_config(family: str, tokenizer, num_layers: int = 2, num_heads: int = 4, hidden: int = 32,
                intermediate: int = 64, max_positions: int = 128):
    """The family's config at the given sizes; vocabulary size and special-token ids from ``tokenizer``.

    ``max_positions`` is the usable length; RoBERTa / XLM-R get ``max_positions + 2`` position
    embeddings (positions start after ``padding_idx`` = 1, as real RoBERTa's 514 for 512 usable), and so
    does MPNet.
    """
    _check_family(family)
    if family in DECODERS:
        return _decoder_config(family, tokenizer, num_layers, num_heads, hidden, intermediate, max_positions)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    sizes = dict(num_hidden_layers=num_layers, num_attention_heads=num_heads, hidden_size=hidden,
                 intermediate_size=intermediate, max_position_embeddings=max_positions)
    if family in ("bert", "electra"):
        extra = dict(type_vocab_size=2)
        if family == "electra":
            extra["embedding_size"] = hidden
    elif family in ("roberta", "xlm-roberta"):
        extra = dict(type_vocab_size=1, max_position_embeddings=max_positions + 2,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    elif family == "mpnet":
        extra = dict(max_position_embeddings=max_positions + 2, relative_attention_num_buckets=MPNET_BUCKETS,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    elif family == "distilbert":
        sizes = dict(n_layers=num_layers, n_heads=num_heads, dim=hidden, hidden_dim=intermediate,
                     max_position_embeddings=max_positions)
        extra = {}
    elif family == "albert":
        extra = dict(embedding_size=ALBERT_EMBEDDING_SIZE, num_hidden_groups=1, inner_group_num=1, type_vocab_size=2,
                     bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    elif family == "deberta-v2":
        extra = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=DEBERTA_POSITION_BUCKETS,
                     max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True,
                     position_biased_input=False, type_vocab_size=0, layer_norm_eps=1e-7, hidden_act="gelu")
    else:  # modernbert: global attention on layers 0, 2, ..., sliding window on 1, 3, ...
        extra = dict(layer_types=["sliding_attention" if i % 2 else "full_attention" for i in range(num_layers)],
                     local_attention=MODERNBERT_LOCAL_ATTENTION, cls_token_id=tokenizer.cls_token_id,
                     sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
                     eos_token_id=tokenizer.sep_token_id)
    return AutoConfig.for_model(family, **{**ids, **sizes, **extra})


def _decoder_config(family: str, tokenizer, num_layers: int, num_heads: int, hidden: int, intermediate: int,
                    max_positions: int):
    """A causal LM's config: grouped-query attention where the family has it, small sliding windows."""
    model_type = DECODERS[family][0]
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, use_cache=False)
    if family == "gpt2":
        return AutoConfig.for_model(model_type, n_layer=num_layers, n_head=num_heads, n_embd=hidden,
                                    n_inner=intermediate, n_positions=max_positions, **ids)
    sizes = dict(num_hidden_layers=num_layers, num_attention_heads=num_heads, hidden_size=hidden,
                 intermediate_size=intermediate, max_position_embeddings=max_positions)
    if family == "gpt_neox":
        return AutoConfig.for_model(model_type, rotary_pct=0.5, use_parallel_residual=True, **sizes, **ids)
    head_dim = hidden // num_heads
    extra = dict(num_key_value_heads=KV_HEADS if num_heads % KV_HEADS == 0 else num_heads, head_dim=head_dim)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if family == "mistral":
        extra.update(sliding_window=DECODER_WINDOW)
    elif family == "gemma2":
        extra.update(sliding_window=DECODER_WINDOW, layer_types=alternating, query_pre_attn_scalar=head_dim,
                     attn_logit_softcapping=GEMMA2_SOFTCAP, final_logit_softcapping=None)
    elif family == "gemma3":
        extra.update(sliding_window=DECODER_WINDOW, layer_types=alternating, query_pre_attn_scalar=head_dim)
    return AutoConfig.for_model(model_type, **sizes, **ids, **extra)


def build_tiny(family: str, out_dir, seed: int = 0, num_layers: int = 2, num_heads: int = 4, hidden: int = 32,
               intermediate: int = 64, max_positions: int = 128, corpus: Iterable[str] | None = None) -> Path:
    """Write a tiny random ``family`` model (its masked-LM class, so the folder has an MLM head; a causal LM's
    causal-LM class) and its tokenizer into ``out_dir`` with ``save_pretrained``; returns ``out_dir``.

    Weights are drawn from ``seed`` (the global torch RNG is left as it was). Sizes: ``num_layers``
    layers of ``num_heads`` heads, hidden size ``hidden``, feed-forward ``intermediate``, up to
    ``max_positions`` tokens per sequence (special tokens included); vocabulary from the tokenizer.
    ``corpus`` (strings) trains the BPE / Unigram tokenizers; None = the MiniLM vocabulary.
    """
    _check_family(family)
    if hidden % num_heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(family, corpus, max_positions)
    config = make_config(family, tokenizer, num_layers, num_heads, hidden, intermediate, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = AutoModelForCausalLM if family in DECODERS else AutoModelForMaskedLM
        model = cls.from_config(config)
    model.eval()
    with _quiet_progress():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def _quiet_progress():
    """No "Writing model shards" bar for a tiny model (transformers' setting restored after)."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- cache


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def tiny_folder(family: str, root=None, corpus: Iterable[str] | None = None, **sizes) -> Path:
    """Build-or-reuse the folder of a tiny ``family`` model: ``<root>/tiny-models/<family>-<hash>``.

    ``root`` defaults to ``$PROBES_CACHE_DIR`` or ``.cache/probes``; ``sizes`` are
    :func:`build_tiny`'s keyword arguments (``seed``, ``num_layers``, ``num_heads``, ``hidden``,
    ``intermediate``, ``max_positions``); the hash covers them, the corpus and :data:`FORMAT`. The
    model is built in a temporary folder beside the final one and renamed into place, so concurrent
    callers never see a partial folder (the first to finish wins; the others use its folder).
    """
    _check_family(family)
    unknown = set(sizes) - set(SIZES)
    if unknown:
        raise TypeError(f"unknown size argument(s) {sorted(unknown)}; allowed: {sorted(SIZES)}")
    params = {**SIZES, **sizes}
    text = None if corpus is None else tuple(str(s) for s in corpus)
    key = dict(family=family, format=FORMAT, corpus=None if text is None else _digest(text), **params)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(root if root is not None else os.environ.get("PROBES_CACHE_DIR") or ".cache/probes")
    base = base.expanduser() / "tiny-models"
    final = base / f"{family}-{digest}"
    if _complete(final):
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=base))
    try:
        build_tiny(family, tmp, corpus=text, **params)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _complete(final):  # not another builder's finished folder
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_encoder(family: str = "bert", root=None, name: str | None = None, head: str = "base",
                 bos: bool | None = None, **sizes):
    """A tiny random ``family`` encoder or causal LM (:class:`probes.model.load.Encoder`) from :func:`tiny_folder`,
    loaded like any local folder; ``head`` and ``bos`` as in ``load_encoder`` (the folders have an MLM head,
    a causal LM's a causal-LM head); ``name`` (part of cache keys) defaults to ``tiny-<family>``."""
    return load_encoder(str(tiny_folder(family, root=root, **sizes)), name=name or f"tiny-{family}", head=head,
                        bos=bos)


__all__ = ["ALL_FAMILIES", "DECODERS", "FAMILIES", "FORMAT", "build_tiny", "default_corpus", "make_config", "make_tokenizer", "tiny_encoder",
           "tiny_folder"]
