"""The map engine (:class:`probes.maps.MapEngine`): word maps of a padded batch equal a plain eager forward of each
sentence alone pooled by loops (attention and rollout), only the chosen layers are computed for attention, the
limits and settings come from conf/extract, and padding takes the tokenizer's pad id or 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from probes.config import compose
from probes.maps import MapEngine, pad_id_of
from probes.measures.attention import Attention
from probes.measures.norms import Norm
from probes.measures.rollout import Rollout
from probes.model.inputs import encode_word_pairs, encode_words
from probes.model.load import load_encoder
from probes.model.tiny import tiny_folder
from tests.reference import eager_word_maps, pool_by_loops, text_pieces, word_groups

SENTS = [["The", "dog", "barked", "."], ["John", "'s", "unbelievably-comfortable", "cat", "sat", "on", "it", "!"],
         ["Hi"], ["a", "big", "red", "house", "and", "a", "small", "one", "."]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: tiny_folder(f, root=root) for f in ("bert", "roberta")}


def eager(folder) -> tuple[torch.nn.Module, object]:
    """The plain transformers model (eager attention) and tokenizer of a model folder."""
    return AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval(), \
        AutoTokenizer.from_pretrained(str(folder))


def eager_rollout_word_maps(model, tokenizer, words: list[str]) -> np.ndarray:
    """(L, 1, R, R) rollout word maps of one sentence from a plain eager forward: each layer's head mean plus the
    identity, rows normalised, multiplied through the layers by loops (Abnar & Zuidema), pooled by loops."""
    ids, wids = text_pieces(tokenizer, words)
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    T = len(ids)
    joint = None
    out = []
    for a in att:
        m = a[0].double().mean(0).numpy() + np.eye(T)  # (T, T)
        m = m / m.sum(-1, keepdims=True)
        joint = m if joint is None else np.array([[sum(m[i, k] * joint[k, j] for k in range(T)) for j in range(T)]
                                                  for i in range(T)])
        out.append(joint[None])  # (1, T, T)
    return pool_by_loops(np.stack(out), word_groups(wids, len(words)))  # (L, 1, R, R)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_attention_word_maps_equal_eager_forward(folders, family):
    """Padded batches of several sentences (a small token budget: several batches), layers in a chosen order."""
    enc = load_encoder(str(folders[family]))
    ref, tok = eager(folders[family])
    engine = MapEngine(enc.model, Attention(), [1, 0], tokenizer=enc.tokenizer, max_tokens=40, device="cpu")
    got = dict(engine.iter_word_maps(encode_words(enc.tokenizer, SENTS), progress=False))
    assert sorted(got) == list(range(len(SENTS)))
    for k, words in enumerate(SENTS):
        want, labels = eager_word_maps(ref, tok, words)  # (L, H, R, R)
        assert len(labels) == len(words) + 2 and got[k].dtype == torch.float32
        assert got[k].shape == (2, 4, len(words) + 2, len(words) + 2)
        np.testing.assert_allclose(got[k].numpy(), want[[1, 0]], rtol=1e-4, atol=2e-6)


def test_rollout_word_maps_equal_eager_rollout(folders):
    """A per-layer kind that needs every layer: the engine computes all and keeps the chosen one."""
    enc = load_encoder(str(folders["bert"]))
    ref, tok = eager(folders["bert"])
    engine = MapEngine(enc.model, Rollout(), [1], tokenizer=enc.tokenizer, max_tokens=40)
    encoded = encode_words(enc.tokenizer, SENTS)
    got = dict(engine.iter_word_maps(encoded, progress=False))
    for k, words in enumerate(SENTS):
        want = eager_rollout_word_maps(ref, tok, words)  # (L, 1, R, R)
        assert got[k].shape == (1, 1, len(words) + 2, len(words) + 2)
        np.testing.assert_allclose(got[k].numpy(), want[[1]], rtol=1e-4, atol=2e-6)
    # word_maps of one padded batch hold the same maps
    batch = engine.batch(encoded, range(len(encoded)))
    with torch.inference_mode():
        maps = engine.word_maps(batch, torch.float32)  # (B, 1, 1, W, W)
    for k, e in enumerate(encoded):
        W = e.n_words + 2
        torch.testing.assert_close(maps[k, :, :, :W, :W], got[k], rtol=1e-5, atol=1e-6)


def test_piece_maps_of_attention_stop_after_the_last_chosen_layer(folders):
    """Attention runs the blocks up to the last chosen layer only; other kinds run them all and keep the chosen."""
    enc = load_encoder(str(folders["bert"]))
    ref, _ = eager(folders["bert"])
    encoded = encode_words(enc.tokenizer, SENTS[:2])
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer)
    batch = engine.batch(encoded, [0, 1])
    with torch.inference_mode():  # the first forward on a model also finds its attention modules (a whole forward)
        engine.piece_maps(batch["input_ids"], batch["attention_mask"])
    calls = []
    handle = enc.model.encoder.layer[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with torch.inference_mode():
            first = MapEngine(enc.model, Attention(), [0]).piece_maps(batch["input_ids"], batch["attention_mask"])
            assert calls == []  # the forward stopped inside layer 0
            norm = MapEngine(enc.model, Norm(), [0]).piece_maps(batch["input_ids"], batch["attention_mask"])
            assert calls  # every layer computed
    finally:
        handle.remove()
    assert len(first) == 1 and len(norm) == 1 and first[0].shape == (2, 4) + (batch["input_ids"].shape[1],) * 2
    with torch.no_grad():
        full = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    T = encoded[1].n_pieces
    torch.testing.assert_close(first[0][1, :, :T, :T], full.attentions[0][1, :, :T, :T], atol=1e-6, rtol=0)


def test_sentence_pairs_keep_their_token_types(folders):
    """BERT pairs ``[CLS] A [SEP] B [SEP]`` with token types 1 on B: piece maps equal the eager model's given the
    tokenizer's own pair encoding (types included), in a batch with a single sentence beside them."""
    enc = load_encoder(str(folders["bert"]))
    ref, tok = eager(folders["bert"])
    pairs = [(["The", "dog", "barked", "."], ["It", ",", "ran"]), (["Hi"], ["a", "big", "red", "house"])]
    items = encode_word_pairs(enc.tokenizer, pairs) + encode_words(enc.tokenizer, [SENTS[1]])
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer)
    got = dict(engine.iter_piece_maps(items, progress=False))
    for k, (a, b) in enumerate(pairs):
        x = tok(" ".join(a), " ".join(b), return_tensors="pt")
        assert x["input_ids"][0].tolist() == items[k].input_ids and set(x["token_type_ids"][0].tolist()) == {0, 1}
        with torch.no_grad():
            want = torch.stack(ref(**x, output_attentions=True).attentions)[:, 0]  # (L, H, T, T)
        torch.testing.assert_close(got[k], want, rtol=1e-4, atol=1e-6)


def test_from_config_limits_and_settings(folders):
    enc = load_encoder(str(folders["bert"]))
    x = compose("analyze").extract
    engine = MapEngine.from_config(x, enc.model, tokenizer=enc.tokenizer)
    assert type(engine.measure) is Attention and engine.layers == list(range(enc.num_layers))
    assert (engine.from_words, engine.to_words) == (x.from_words, x.to_words)
    assert (engine.max_tokens, engine.max_batch_size, engine.max_pairs) == (x.max_tokens, x.max_batch_size, x.max_pairs)
    assert engine.limit() == enc.max_length and engine.num_heads == enc.num_heads
    flow = MapEngine.from_config(x, enc.model, kind="flow", layers=[1], max_length=1000)
    assert flow.layers == [1] and flow.num_heads == 1
    assert flow.limit() == min(enc.max_length, int(x.measures.flow.max_pieces))  # the kind's bound
    assert MapEngine.from_config(x, enc.model, max_length=10).limit() == 10  # extract.max_length
    assert MapEngine.from_config(x, enc.model, max_length=10 ** 6).limit() == enc.max_length  # the model's
    keep, too_long = MapEngine.from_config(x, enc.model, max_length=6).select(encode_words(enc.tokenizer, SENTS))
    assert too_long == [k for k, e in enumerate(encode_words(enc.tokenizer, SENTS)) if e.n_pieces > 6] != []
    assert sorted(keep + too_long) == list(range(len(SENTS)))
    with pytest.raises(ValueError, match="exceed 6 wordpieces"):
        MapEngine.from_config(x, enc.model, max_length=6).select(encode_words(enc.tokenizer, SENTS), "error")
    with pytest.raises(ValueError, match="0..1"):
        MapEngine(enc.model, Attention(), [2])
    with pytest.raises(KeyError, match="no_such_kind"):
        MapEngine.from_config(x, enc.model, kind="no_such_kind")


def test_pad_id_falls_back_to_zero(folders):
    tok = AutoTokenizer.from_pretrained(str(folders["roberta"]))
    assert pad_id_of(tok) == tok.pad_token_id == 1
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id_of(tok) == 0 and pad_id_of(None) == 0
    enc = load_encoder(str(folders["bert"]))
    assert MapEngine(enc.model, Attention(), tokenizer=tok).pad_id == 0
    assert MapEngine(enc.model, Attention(), pad_id=7, tokenizer=tok).pad_id == 7


def test_batches_respect_tokens_sentences_and_pairs(folders):
    enc = load_encoder(str(folders["bert"]))
    encoded = encode_words(enc.tokenizer, SENTS * 5)
    n = [e.n_pieces for e in encoded]
    engine = MapEngine(enc.model, Attention(), max_tokens=60, max_batch_size=4, max_pairs=600)
    batches = engine.batches(encoded)
    assert sorted(k for b in batches for k in b) == list(range(len(encoded)))
    for b in batches:
        T = max(n[k] for k in b)
        assert len(b) == 1 or (len(b) <= 4 and len(b) * T <= 60 and len(b) * T * T <= 600)
