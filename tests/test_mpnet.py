"""MPNet (relative position bias computed inside ``MPNetSelfAttention``) through the model layer's adapter, on the
tiny random MPNet of probes.model.tiny and, when fetched, the real all-mpnet-base-v2.

References are built here from the raw text: MPNet's own tokenizer on the joined words, each piece's word from
its character offsets by a loop, a separately loaded ``attn_implementation="eager"`` MPNetModel with
``output_attentions=True``, pooling by explicit loops, and a plain reimplementation of MPNet's layers (the
model's own linear layers, LayerNorms and relative-position bucketing, written out per layer and head)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, MPNetModel
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

import probes
from probes.measures import build
from probes.model import attention_function, hooks, structure
from probes.model.inputs import encode_words
from probes.model.tiny import tiny_encoder, tiny_folder
from tests.conftest import require_model
from tests.reference import eager_word_maps, text_pieces
from tests.test_measures import KINDS, MEASURES, ref_flow, ref_rollout

SENTS = [["The", "unbelievably", "quick", "fox", "jumped", "over", "the", "dog", "."], ["Hello", "!"],
         ["John", "'s", "wheel-chair", ",", "a", "cat", "and", "a", "mat", "sat", "."]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("mpnet", root=tmp_path_factory.mktemp("tiny-mpnet"))


# ----------------------------------------------------------------------------- references
def plain_layer(ref: MPNetModel, l: int, X: torch.Tensor, uniform=(), zero_heads=(), zero: int | None = None):
    """Layer ``l`` of MPNet written out on its input X (T, D) of one unpadded sentence: q, k, v, scores / sqrt(d)
    + relative position bias, softmax, per-head context, o, LayerNorm, feed-forward, LayerNorm.

    uniform: heads whose attention is 1/T everywhere; zero_heads: heads whose context is zero; zero: a token whose
    value vectors are zero in every head. Returns (output (T, D), attentions (H, T, T), head contexts (T, H*d))."""
    lay = ref.encoder.layer[l]
    sa = lay.attention.attn
    H = ref.config.num_attention_heads
    T, D = X.shape
    d = D // H
    rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # (T, T) key position - query position
    bias = ref.encoder.relative_attention_bias(ref.encoder.relative_position_bucket(rel)).permute(2, 0, 1)  # (H, T, T)
    q = sa.q(X).view(T, H, d).transpose(0, 1)  # (H, T, d)
    k = sa.k(X).view(T, H, d).transpose(0, 1)  # (H, T, d)
    v = sa.v(X).view(T, H, d).transpose(0, 1).clone()  # (H, T, d)
    if zero is not None:
        v[:, zero] = 0
    A = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + bias, -1)  # (H, T, T)
    heads = []
    for h in range(H):
        if h in uniform:
            A = A.clone()
            A[h] = 1.0 / T
        heads.append(torch.zeros(T, d) if h in zero_heads else A[h] @ v[h])  # (T, d)
    ctx = torch.cat(heads, -1)  # (T, H*d)
    a = lay.attention.LayerNorm(sa.o(ctx) + X)  # (T, D)
    return lay.output.LayerNorm(lay.output.dense(lay.intermediate(a)) + a), A, ctx


def plain_forward(ref: MPNetModel, ids: torch.Tensor, uniform: dict | None = None, zero_heads: dict | None = None,
                  inputs_embeds: torch.Tensor | None = None):
    """MPNet written out for one unpadded sentence ids (T,) (:func:`plain_layer` per layer); uniform, zero_heads:
    {layer: heads}. Returns (L + 1 hidden states (T, D), L attentions (H, T, T), L head contexts (T, H*d))."""
    X = ref.embeddings(input_ids=ids[None], inputs_embeds=inputs_embeds)[0]  # (T, D)
    hs, atts, ctxs = [X], [], []
    for l in range(ref.config.num_hidden_layers):
        X, A, ctx = plain_layer(ref, l, X, (uniform or {}).get(l, ()), (zero_heads or {}).get(l, ()))
        hs.append(X)
        atts.append(A)
        ctxs.append(ctx)
    return hs, atts, ctxs


# ----------------------------------------------------------------------------- tokenizer and running text
def test_tokenizer_is_mpnets_own(folder):
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(tok).__name__ == "MPNetTokenizer"
    assert (tok.cls_token, tok.sep_token, tok.pad_token, tok.mask_token) == ("<s>", "</s>", "<pad>", "<mask>")
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert tok.mask_token_id == len(tok) - 1 and tok.pad_token_id == 1
    assert tok("a b", "c d")["input_ids"][3:5] == [tok.sep_token_id] * 2  # <s> A </s></s> B </s>


def test_words_read_as_running_text(folder):
    tok = tiny_encoder("mpnet", root=folder.parent.parent).tokenizer
    for words, e in zip(SENTS, encode_words(tok, SENTS)):
        ids, wids = text_pieces(tok, words)
        assert e.input_ids == ids and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
        assert e.word_of_piece == [-1, *wids[1:-1], len(words)]
        assert tok.unk_token_id not in ids
        for k, w in enumerate(words):
            spelt = tok.convert_tokens_to_string(tok.convert_ids_to_tokens([i for i, x in zip(ids, wids) if x == k]))
            assert spelt.replace(" ", "") == w.lower()


# ----------------------------------------------------------------------------- maps and interventions
def test_adapter_is_installed_and_parts_found(folder):
    enc = tiny_encoder("mpnet", root=folder.parent.parent)
    model = enc.model
    sites = structure.attention_sites(model)
    assert len(sites) == 2 and all(isinstance(m, MPNetSelfAttention) and "forward" in m.__dict__ for m in sites)
    parts = structure.layer_parts(model)
    for lay, p in zip(model.encoder.layer, parts):
        assert p.proj is lay.attention.attn.o and p.norm is lay.attention.LayerNorm and p.post_ln and not p.sub_norm


def test_word_maps_equal_eager_forward(folder):
    """The API (batched, padded, the engine's pooling) and the capture of a padded batch equal the eager forward
    of each sentence alone, pooled by loops."""
    enc = tiny_encoder("mpnet", root=folder.parent.parent)
    ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(folder)
    got = probes.word_maps(enc, SENTS, device="cpu")
    for words, wm in zip(SENTS, got):
        assert wm.labels == ["<s>", *words, "</s>"]
        np.testing.assert_allclose(wm.maps, eager_word_maps(ref, tok, words)[0], rtol=1e-4, atol=2e-6)
    # the raw capture of a right-padded batch: each sentence's (L, H, T, T) = the eager forward's attentions
    seqs = [text_pieces(tok, w)[0] for w in SENTS]
    T = max(map(len, seqs))
    ids = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in seqs])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in seqs])
    with torch.no_grad(), hooks.attention(enc.model) as s:
        s.run(input_ids=ids, attention_mask=mask)
    for b, x in enumerate(seqs):
        n = len(x)
        with torch.no_grad():
            att = ref(input_ids=torch.tensor([x]), output_attentions=True).attentions
        for l in range(2):
            torch.testing.assert_close(s.probs[l][b, :, :n, :n], att[l][0], atol=1e-6, rtol=1e-5)
            assert torch.all(s.probs[l][b, :, :n, n:] == 0)


def test_plain_forward_is_mpnet(folder):
    """The reimplementation the interventions are checked against is MPNet (its states and attentions)."""
    ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.tensor(text_pieces(AutoTokenizer.from_pretrained(folder), SENTS[0])[0])
    with torch.no_grad():
        out = ref(input_ids=ids[None], output_attentions=True)
        hs, atts, _ = plain_forward(ref, ids)
    torch.testing.assert_close(hs[-1], out.last_hidden_state[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(atts, out.attentions):
        torch.testing.assert_close(a, b[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("what", ["uniform", "gate"])
def test_head_intervention_equals_plain_forward(folder, what):
    """Disabling head 2 of layer 1 (uniform attention) or masking it (gate 0: its output zero) equals the plain
    reimplementation with that head changed; the other heads and layer 0 are untouched."""
    enc = tiny_encoder("mpnet", root=folder.parent.parent)
    ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.tensor(text_pieces(enc.tokenizer, SENTS[2])[0])
    gates = torch.ones(2, 4)
    gates[1, 2] = 0.0
    kw = dict(uniform={1: [2]}) if what == "uniform" else dict(gates=gates)
    with torch.no_grad():
        with hooks.attention(enc.model, **kw) as s:
            got = s.run(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).last_hidden_state[0]
        hs, atts, _ = plain_forward(ref, ids, **({"uniform": {1: [2]}} if what == "uniform"
                                                 else {"zero_heads": {1: [2]}}))
        plain, _, _ = plain_forward(ref, ids)
    torch.testing.assert_close(got, hs[-1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain[-1], atol=1e-4)
    for l in range(2):
        torch.testing.assert_close(s.probs[l][0], atts[l], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- every map kind
def _scaled(folder):
    """(model on the project's path, eager reference) with value and output weights x8 (as tests/test_measures:
    a random tiny model mixes little)."""
    model = attention_function.prepare(AutoModel.from_pretrained(folder).eval())
    ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        for m in (model, ref):
            for name, p in m.named_parameters():
                if name.endswith(("attn.v.weight", "attn.o.weight")):
                    p.mul_(8.0)
    return model, ref


def ref_decomposition(ref, X: torch.Tensor, A: torch.Tensor, l: int):
    """Loops over heads and positions: (norm (H, T, T), norm_res_ln (T, T), alti contributions (T, T)) of
    layer l from its input X (T, D) and attentions A (H, T, T) (Kobayashi et al.; Ferrando et al.)."""
    lay = ref.encoder.layer[l]
    sa, ln = lay.attention.attn, lay.attention.LayerNorm
    H = ref.config.num_attention_heads
    T, D = X.shape
    d = D // H
    V = sa.v(X)  # (T, H*d)
    W, b = sa.o.weight, sa.o.bias
    f = torch.zeros(H, T, D)
    for h in range(H):
        for j in range(T):
            f[h, j] = W[:, h * d:(h + 1) * d] @ V[j, h * d:(h + 1) * d]
    norm = torch.zeros(H, T, T)
    S = torch.zeros(T, T, D)
    for i in range(T):
        for j in range(T):
            for h in range(H):
                norm[h, i, j] = (A[h, i, j] * f[h, j]).norm()
                S[i, j] += A[h, i, j] * f[h, j]
            if i == j:
                S[i, j] += X[i]
    r = S.sum(1) + b
    y = ln(r)
    Tv = torch.zeros_like(S)
    for i in range(T):
        sd = torch.sqrt(r[i].var(unbiased=False) + ln.eps)
        for j in range(T):
            Tv[i, j] = ln.weight * (S[i, j] - S[i, j].mean()) / sd
    c = torch.zeros(T, T)
    for i in range(T):
        for j in range(T):
            c[i, j] = max(0.0, float(y[i].abs().sum() - (y[i] - Tv[i, j]).abs().sum()))
        c[i] /= c[i].sum()
    return norm, Tv.norm(dim=-1), c


def ref_value_zeroing(ref, ids: torch.Tensor) -> np.ndarray:
    """(L, T, T): cosine distance of each layer's output with token j's values zeroed in that layer (the layer's
    input kept), rows normalised (Mohebbi et al.)."""
    hs, _, _ = plain_forward(ref, ids)
    L, T = len(hs) - 1, len(ids)
    out = np.zeros((L, T, T))
    for l in range(L):
        for j in range(T):
            new, _, _ = plain_layer(ref, l, hs[l], zero=j)
            for i in range(T):
                cos = torch.nn.functional.cosine_similarity(new[i].double(), hs[l + 1][i].double(), dim=0)
                out[l, i, j] = max(0.0, 1 - float(cos))
        out[l] /= out[l].sum(-1, keepdims=True)
    return out


def ref_grad(ref, ids: torch.Tensor) -> np.ndarray:
    """(L, H, T, T): |gradient x input| of each head's context (summed units) w.r.t. the word embeddings, rows
    normalised, one backward per target (the plain reimplementation's contexts)."""
    H, T = ref.config.num_attention_heads, len(ids)
    emb = ref.embeddings.word_embeddings(ids[None]).detach().requires_grad_(True)  # (1, T, D)
    _, _, ctxs = plain_forward(ref, ids, inputs_embeds=emb)
    d = ctxs[0].shape[-1] // H
    out = np.zeros((len(ctxs), H, T, T))
    for l, ctx in enumerate(ctxs):
        for h in range(H):
            for i in range(T):
                (g,) = torch.autograd.grad(ctx[i, h * d:(h + 1) * d].sum(), emb, retain_graph=True)
                a = (g * emb).abs().sum(-1)[0]
                out[l, h, i] = (a / a.sum()).detach().numpy()
    return out


def test_every_kind_matches_its_reference(folder):
    """Each map kind on a right-padded batch of two sentences equals its reference written out for MPNet."""
    model, ref = _scaled(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    seqs = [text_pieces(tok, w)[0] for w in (SENTS[1], ["The", "fox", "saw", "John", "'s", "dog", "."])]
    T = max(map(len, seqs))
    ids = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in seqs])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in seqs])
    got = {}
    for k in KINDS:
        with torch.inference_mode(k != "grad_attribution"):
            got[k] = torch.stack(build(k, MEASURES)(model, ids, mask), 1).detach()  # (B, L, H', T, T)
    for b, x in enumerate(seqs):
        x = torch.tensor(x)
        n = len(x)
        crop = {k: v[b, :, :, :n, :n].float().numpy() for k, v in got.items()}
        with torch.no_grad():
            hs, atts, _ = plain_forward(ref, x)
            dec = [ref_decomposition(ref, hs[l], atts[l], l) for l in range(2)]
        np.testing.assert_allclose(crop["attention"], np.stack([a.numpy() for a in atts]), atol=1e-6)
        roll, aug = ref_rollout(atts)
        np.testing.assert_allclose(crop["rollout"][:, 0], roll, atol=1e-5)
        np.testing.assert_allclose(crop["flow"][:, 0], ref_flow(aug), atol=1e-5)
        np.testing.assert_allclose(crop["norm"], np.stack([dd[0].numpy() for dd in dec]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(crop["norm_res_ln"][:, 0], np.stack([dd[1].numpy() for dd in dec]), rtol=1e-4,
                                   atol=1e-5)
        c = [dd[2].numpy() for dd in dec]
        np.testing.assert_allclose(crop["alti"][:, 0], np.stack([c[0], c[1] @ c[0]]), atol=1e-5)
        with torch.no_grad():
            vz = ref_value_zeroing(ref, x)
        np.testing.assert_allclose(crop["value_zeroing"][:, 0], vz, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(crop["grad_attribution"], ref_grad(ref, x), atol=1e-5)
        assert not np.allclose(crop["alti"], crop["rollout"])


# ----------------------------------------------------------------------------- the real model
def test_real_mpnet_maps_equal_eager_forward():
    """all-mpnet-base-v2 (12 x 12): the word maps of the API equal its eager forward pooled by loops."""
    path = require_model("mpnet_base")
    enc = probes.load_encoder(path)
    assert enc.model_type == "mpnet" and enc.num_layers == 12 and enc.num_heads == 12
    ref = MPNetModel.from_pretrained(path, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    sents = SENTS[:2]
    for words, wm in zip(sents, probes.word_maps(enc, sents, device="cpu")):
        np.testing.assert_allclose(wm.maps, eager_word_maps(ref, tok, words)[0], rtol=1e-4, atol=1e-5)
