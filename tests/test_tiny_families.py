"""Tiny random models of every supported family (probes.model.tiny), checked with plain transformers:
offline loading, pre-split words, eager attentions, the saved masked-LM head, the folder cache."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

from probes.model.tiny import FAMILIES, MODERNBERT_LOCAL_ATTENTION, build_tiny, tiny_folder
from tests.reference import text_pieces

WORDS = ["The", "unbelievably", "quick", "fox", "jumped", "."]
SIZES = dict(num_layers=2, num_heads=4, hidden=32, intermediate=64, max_positions=128)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """family -> its folder, each family built once per module."""
    root = tmp_path_factory.mktemp("tiny-families")
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny(family, root / family, seed=0, **SIZES)
        return built[family]

    return get


@pytest.fixture(scope="module")
def loaded(folder):
    """family -> (tokenizer, eager base model), loaded once per module."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            d = folder(family)
            cache[family] = (AutoTokenizer.from_pretrained(d),
                             AutoModel.from_pretrained(d, attn_implementation="eager").eval())
        return cache[family]

    return get


def _pieces_per_word(ids: list[int], wids: list[int | None], n_words: int) -> list[list[int]]:
    return [[i for i, w in zip(ids, wids) if w == k] for k in range(n_words)]


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_offline(folder, family):
    d = folder(family)
    config = AutoConfig.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModel.from_pretrained(d)
    assert config.model_type == family and model.config.model_type == family
    assert model.config.num_hidden_layers == SIZES["num_layers"]
    assert model.config.num_attention_heads == SIZES["num_heads"]
    assert model.config.hidden_size == SIZES["hidden"]
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    expected_positions = SIZES["max_positions"] + (2 if family in ("roberta", "xlm-roberta", "mpnet") else 0)
    assert config.max_position_embeddings == expected_positions
    if family in ("roberta", "xlm-roberta"):
        assert tok.pad_token_id == 1 and tok.cls_token == "<s>" and tok.sep_token == "</s>"
    if family in ("roberta", "modernbert"):
        assert tok.add_prefix_space is True


@pytest.mark.parametrize("family", FAMILIES)
def test_pre_split_words(loaded, family):
    """Words read as running text (the tokenizer on the joined words, each piece's word from its characters:
    :func:`tests.reference.text_pieces`): the specials around, every word with pieces of its own, in order, that
    spell the word, no unknown token; a word has the same pieces at the start of a text as in the middle
    (byte-level BPE with add_prefix_space: "Ġword", Metaspace: "▁word")."""
    tok, _ = loaded(family)
    ids, wids = text_pieces(tok, WORDS)
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert wids[0] is None and wids[-1] is None
    inner = wids[1:-1]
    assert None not in inner and inner == sorted(inner) and set(inner) == set(range(len(WORDS)))
    assert tok.unk_token_id not in ids
    split = _pieces_per_word(ids, wids, len(WORDS))
    for k, word in enumerate(WORDS):
        spelt = tok.convert_tokens_to_string(tok.convert_ids_to_tokens(split[k])).strip()
        assert spelt.casefold() == word.casefold(), (word, tok.convert_ids_to_tokens(split[k]))
    # a word in the middle is tokenized as the same word at the start
    for k, word in enumerate(WORDS):
        alone = text_pieces(tok, [word])
        assert _pieces_per_word(*alone, 1)[0] == split[k], (word, tok.convert_ids_to_tokens(split[k]))


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_attentions(loaded, family):
    tok, model = loaded(family)
    enc = tok(" ".join(WORDS), return_tensors="pt")  # the words as running text
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    T = enc["input_ids"].shape[1]
    assert len(out.attentions) == SIZES["num_layers"]
    for a in out.attentions:
        assert a.shape == (1, SIZES["num_heads"], T, T)
        torch.testing.assert_close(a.sum(-1), torch.ones(1, SIZES["num_heads"], T), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_length(loaded, family):
    """A sequence of max_positions tokens (special tokens included) fits the position embeddings."""
    tok, model = loaded(family)
    n = SIZES["max_positions"]
    word = tok("fox")["input_ids"][1]
    ids = torch.tensor([[tok.cls_token_id] + [word] * (n - 2) + [tok.sep_token_id]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.last_hidden_state.shape == (1, n, SIZES["hidden"])


def test_modernbert_sliding_window(loaded):
    """Layer 0 attends globally, layer 1 only within local_attention // 2 tokens on either side."""
    tok, model = loaded("modernbert")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    words = "the cat sat on the mat and then it ran away from the big dog very quickly".split()
    enc = tok(" ".join(words), return_tensors="pt")
    T = enc["input_ids"].shape[1]
    assert T > MODERNBERT_LOCAL_ATTENTION
    with torch.no_grad():
        att = model(**enc, output_attentions=True).attentions
    pos = torch.arange(T)
    far = (pos[:, None] - pos[None, :]).abs() > MODERNBERT_LOCAL_ATTENTION // 2
    assert att[0][0][:, far].abs().max() > 0
    assert att[1][0][:, far].abs().max() == 0


def test_deberta_relative_attention(folder):
    config = AutoConfig.from_pretrained(folder("deberta-v2"))
    assert config.relative_attention and list(config.pos_att_type) == ["p2c", "c2p"]
    assert 0 < config.position_buckets <= 64 and config.position_biased_input is False


@pytest.mark.parametrize("family", FAMILIES)
def test_mlm_head_saved(folder, family):
    model, info = AutoModelForMaskedLM.from_pretrained(folder(family), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert model.config.model_type == family


def test_tiny_folder_reuse_and_sizes(tmp_path):
    sizes = dict(num_layers=1, num_heads=2, hidden=16, intermediate=32, max_positions=32)
    first = tiny_folder("bert", root=tmp_path, **sizes)
    assert first.parent == tmp_path / "tiny-models" and first.name.startswith("bert-")
    stamp = (first / "config.json").stat().st_mtime_ns, (first / "model.safetensors").stat().st_mtime_ns
    again = tiny_folder("bert", root=tmp_path, **sizes)
    assert again == first
    assert ((again / "config.json").stat().st_mtime_ns, (again / "model.safetensors").stat().st_mtime_ns) == stamp
    other = tiny_folder("bert", root=tmp_path, **{**sizes, "num_layers": 2})
    reseeded = tiny_folder("bert", root=tmp_path, **{**sizes, "seed": 1})
    assert len({first, other, reseeded}) == 3
    assert AutoConfig.from_pretrained(other).num_hidden_layers == 2
    assert AutoConfig.from_pretrained(first).num_hidden_layers == 1
    assert sorted(os.listdir(tmp_path / "tiny-models")) == sorted(p.name for p in (first, other, reseeded))


def test_tiny_folder_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBES_CACHE_DIR", str(tmp_path / "cache"))
    d = tiny_folder("distilbert", num_layers=1, num_heads=2, hidden=16, intermediate=32, max_positions=32)
    assert d.parent == tmp_path / "cache" / "tiny-models"
    assert AutoConfig.from_pretrained(d).model_type == "distilbert"
