"""Causal LMs through the model layer and the stages below the analyses, on tiny random models of every decoder
family (probes.model.tiny.DECODERS) loaded from their folders.

The reference is a separately loaded ``attn_implementation="eager"`` transformers model run with
``output_attentions=True`` on one sentence, its attention pooled to words by an explicit loop over the pieces
of each word (rows: mean over the row word's pieces, columns: sum over the column word's pieces).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import probes
from probes.extract.cache import cache_key
from probes.model import hooks
from probes.model.families import adds_bos, is_causal
from probes.model.inputs import encode_words
from probes.model.load import load_encoder
from probes.model.tiny import DECODER_WINDOW, DECODERS, KV_HEADS, tiny_folder

SENTS = [["The", "unbelievably", "quick", "fox", "jumped", "over", "the", "dog", "."], ["Hello", "!"],
         ["A", "cat", ",", "a", "dog", "and", "John", "'s", "mat", "sat", "."]]
BOS_FAMILIES = {f for f, spec in DECODERS.items() if spec[3]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-decoders")
    return {f: tiny_folder(f, root=root) for f in DECODERS}


def eager_word_maps(folder, words: list[str], bos: bool | None = None) -> tuple[np.ndarray, list[str]]:
    """(L, H, R, R) word maps of a plain eager forward of one sentence, pooled by an explicit loop; R rows:
    the BOS (where the tokenizer adds one, or ``bos=True`` prepends it) and the words."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    enc = tok(words, is_split_into_words=True)
    ids, wids = list(enc["input_ids"]), list(enc.word_ids())
    if bos and ids[0] != tok.bos_token_id:
        ids, wids = [tok.bos_token_id, *ids], [None, *wids]
    with torch.no_grad():
        att = torch.stack(model(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0]  # (L, H, T, T)
    groups = ([[0]] if wids[0] is None else []) + [[i for i, w in enumerate(wids) if w == k] for k in range(len(words))]
    labels = ([tok.convert_ids_to_tokens(ids[0])] if wids[0] is None else []) + list(words)
    L, H = att.shape[:2]
    out = np.zeros((L, H, len(groups), len(groups)))
    for r, rows in enumerate(groups):
        for c, cols in enumerate(groups):
            total = 0.0
            for i in rows:
                for j in cols:
                    total = total + att[:, :, i, j].double().numpy()
            out[:, :, r, c] = total / len(rows)
    return out, labels


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_word_maps_equal_eager_forward(folders, family):
    enc = probes.load_encoder(str(folders[family]))
    assert enc.causal and is_causal(enc.config) and enc.bos == (family in BOS_FAMILIES)
    got = probes.word_maps(enc, SENTS, device="cpu")  # one padded batch of three lengths
    for words, wm in zip(SENTS, got):
        ref, labels = eager_word_maps(folders[family], words)
        assert wm.labels == labels
        assert wm.maps.shape == ref.shape
        np.testing.assert_allclose(wm.maps, ref, atol=2e-6)
        # causal: nothing above the diagonal, rows of real tokens sum to 1
        assert np.abs(np.triu(wm.maps, 1)).max() == 0.0
        np.testing.assert_allclose(wm.maps.sum(-1), 1.0, atol=1e-5)


def test_encoder_options_and_layout(folders):
    llama = load_encoder(str(folders["llama"]))
    (e,) = encode_words(llama.tokenizer, [["a", "cat"]])
    assert e.word_of_piece[0] == -1 and e.n_words not in e.word_of_piece  # BOS row, no last special
    gpt2 = load_encoder(str(folders["gpt2"]))
    (e,) = encode_words(gpt2.tokenizer, [["a", "cat"]])
    assert -1 not in e.word_of_piece and gpt2.tokenizer.pad_token is not None  # EOS as pad
    assert gpt2.config.pad_token_id == gpt2.tokenizer.pad_token_id and gpt2.tokenizer.padding_side == "right"
    # BOS on request, removed on request; it enters the cache key
    gpt2_bos = load_encoder(str(folders["gpt2"]), bos=True)
    assert gpt2_bos.bos and adds_bos(gpt2_bos.tokenizer)
    ref, labels = eager_word_maps(folders["gpt2"], SENTS[0], bos=True)
    wm = probes.word_maps(gpt2_bos, [SENTS[0]], device="cpu")[0]
    assert wm.labels == labels and labels[0] == "<|endoftext|>"
    np.testing.assert_allclose(wm.maps, ref, atol=2e-6)
    assert not load_encoder(str(folders["llama"]), bos=False).bos
    assert gpt2.key_fields() == {"causal": True, "bos": False} and gpt2_bos.key_fields()["bos"] is True
    with pytest.raises(ValueError, match="causal LMs only"):
        load_encoder(str(tiny_folder("bert", root=folders["gpt2"].parent.parent)), bos=True)
    with pytest.raises(ValueError, match="causal_lm"):
        load_encoder(str(folders["llama"]), head="mlm")


def test_cache_key_differs_with_bos(folders):
    class Settings:
        def max_length_for(self, encoder):
            return encoder.max_length

    class Nothing:
        def key_fields(self, *args):
            return {}

    keys = [cache_key(load_encoder(str(folders["gpt2"]), bos=b), Nothing(), Nothing(), Settings(), "32-true")
            for b in (None, True)]
    assert keys[0] != keys[1] and keys[0]["bos"] is False and keys[1]["bos"] is True


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_grouped_query_heads(folders, family):
    """Per-query-head maps: the captured maps equal eager's (which repeats K/V), and the values captured for
    query heads of one group are the same key/value head's."""
    enc = load_encoder(str(folders[family]))
    model = enc.model
    assert model.config.num_key_value_heads == KV_HEADS < model.config.num_attention_heads
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(model, values=True) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    ref = AutoModel.from_pretrained(str(folders[family]), attn_implementation="eager").eval()
    with torch.no_grad():
        att = ref(input_ids=ids, output_attentions=True).attentions
    H, n = model.config.num_attention_heads, model.config.num_attention_heads // KV_HEADS
    for l in range(model.config.num_hidden_layers):
        assert s.probs[l].shape == (1, H, ids.shape[1], ids.shape[1])
        torch.testing.assert_close(s.probs[l], att[l], atol=1e-6, rtol=0)
        v = s.value[l]  # (1, H, T, d)
        for h in range(H):
            torch.testing.assert_close(v[:, h], v[:, (h // n) * n])
        assert not torch.allclose(s.probs[l][:, 0], s.probs[l][:, 1])  # query heads differ within a group


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_in_maps(folders, family):
    """Sliding-window layers attend to the last DECODER_WINDOW tokens only (Gemma: every other layer)."""
    enc = load_encoder(str(folders[family]))
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(enc.model) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    types = getattr(enc.config, "layer_types", None) or ["sliding_attention"] * enc.num_layers
    T = ids.shape[1]
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    outside = (j > i) | (i - j >= DECODER_WINDOW)
    for l, kind in enumerate(types):
        p = s.probs[l][0]  # (H, T, T)
        if kind == "sliding_attention":
            assert p[:, outside].abs().max() == 0
        else:
            assert p[:, (j <= i) & (i - j >= DECODER_WINDOW)].min() > 0


def test_softcap_is_applied(folders):
    """Gemma 2's attention soft-capping (cap 0.5 in the tiny model) as eager does it; the query weights are
    scaled up in both models so that scores exceed the cap and the capping changes the maps."""
    enc = load_encoder(str(folders["gemma2"]))
    ref = AutoModel.from_pretrained(str(folders["gemma2"]), attn_implementation="eager").eval()
    with torch.no_grad():
        for m in (enc.base, ref):
            for layer in m.layers:
                layer.self_attn.q_proj.weight.mul_(30.0)
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(enc.model) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        att = ref(input_ids=ids, output_attentions=True).attentions
        for m in ref.modules():
            if hasattr(m, "attn_logit_softcapping"):
                m.attn_logit_softcapping = None
        uncapped = ref(input_ids=ids, output_attentions=True).attentions
    for l in range(enc.num_layers):
        torch.testing.assert_close(s.probs[l], att[l], atol=1e-6, rtol=0)
    assert (s.probs[1] - uncapped[1]).abs().max() > 1e-2


def test_causal_lm_and_classification_heads(folders):
    lm = load_encoder(str(folders["llama"]), head="causal_lm")
    ref = AutoModelForCausalLM.from_pretrained(str(folders["llama"]), attn_implementation="eager").eval()
    ids = torch.tensor([encode_words(lm.tokenizer, [SENTS[0]])[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # sequence classification: last non-pad token pooling, pad token set; padded batch = each alone
    clf = load_encoder(str(folders["gpt2"]), head="sequence_classification", random_init=True)
    batch = clf.tokenizer([" ".join(SENTS[0]), "Hello !"], padding=True, return_tensors="pt")
    with torch.no_grad():
        both = clf.model(**batch).logits
        alone = clf.model(**clf.tokenizer(["Hello !"], return_tensors="pt")).logits
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=0)
