"""Gradient flow (Westera 2019) maths on real tiny random encoders (BERT; DistilBERT, ALBERT, DeBERTa-v2 built
from configs): identity layers, batched vs an independent autograd loop, OLS."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probes.stats import ols
from probes.analysis.pascual.attribution import captum_head_attribution
from probes.analysis.westera.flow import correlations, pair_rows, select_sentences
from probes.measures.gradflow import (attribution_distribution, block_functions, gradient_flow, head_attributions,
                                      hidden_and_attention)
from probes.model import attention_function, structure
from probes.model.load import tiny_bert
from tests.reference import gradient_flow_loop, pool_by_loops, pooling_by_hand, text_pieces, word_groups

WORDS = ["the", "qwertyuiop", "cat", "saw", "dogs", "."]


def _ids(enc, words=WORDS):
    """(word of every piece or None for a special, ids) of the words as running text
    (:func:`tests.reference.text_pieces`, nothing from probes.model.inputs)."""
    ids, wids = text_pieces(enc.tokenizer, words)
    return wids, torch.tensor(ids)


def _pooling(wids, n_words):
    """(from, to) (n_words + 2, T) word pooling matrices written out by hand (rows mean, columns sum): row 0 the
    specials before the words, row n_words + 1 those after."""
    first = next(t for t, w in enumerate(wids) if w is not None)
    wop = [w if w is not None else (-1 if t < first else n_words) for t, w in enumerate(wids)]
    return pooling_by_hand(wop, n_words, "mean"), pooling_by_hand(wop, n_words, "sum")


def _randomise_layernorms(model, seed=0):
    """Tiny BERT's LayerNorms start at gamma=1, beta=0, for which sum_d LN(x)_d is constant (zero
    gradient under the sum reduction); give them random affine parameters like a trained model."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight.data = 1 + 0.5 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.1 * torch.randn(m.bias.shape, generator=g)
    return model


def identity_bert():
    """Tiny BERT whose every encoder layer is the identity map h_n = h_{n-1}: attention-output and FFN
    output projections zeroed, the two post-residual LayerNorms replaced by nn.Identity."""
    enc = tiny_bert(num_hidden_layers=3)
    for layer in structure.blocks(enc.model):  # BertLayer
        for lin in (layer.attention.output.dense, layer.output.dense):
            lin.weight.data.zero_()
            lin.bias.data.zero_()
        layer.attention.output.LayerNorm = torch.nn.Identity()
        layer.output.LayerNorm = torch.nn.Identity()
    return enc


def test_identity_model_is_identity():
    enc = identity_bert()
    _, ids = _ids(enc)
    hs, _ = hidden_and_attention(enc.model, ids)
    for h in hs[1:]:
        assert torch.equal(h, hs[0])


@pytest.mark.parametrize("level", ["piece", "word"])
def test_identity_layers_give_identity_flow(level):
    enc = identity_bert()
    wids, ids = _ids(enc)
    D = enc.config.hidden_size
    fm = tm = None
    if level == "word":
        fm, tm = _pooling(wids, len(WORDS))
        assert len(wids) > len(WORDS) + 2  # "qwertyuiop" is split, so pooling is exercised
    out = gradient_flow(enc.model, ids, fm, tm)
    n = out["G"].shape[-1]
    # d sum_d h_n(t2) / d h_{n-1}(t1) = 1_D if t1 == t2 else 0 -> 2-norm sqrt(D) * identity
    want = math.sqrt(D) * torch.eye(n).expand_as(out["G"])
    torch.testing.assert_close(out["G"], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["Gstar"], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chain", [False, True])
def test_batched_flow_equals_per_pair_loop(chain):
    enc = tiny_bert(num_hidden_layers=3)
    _randomise_layernorms(enc.model)
    _, ids = _ids(enc)
    out = gradient_flow(enc.model, ids, chain=True)
    ref = gradient_flow_loop(enc.model, ids, chain=chain)
    got = out["Gstar"] if chain else out["G"]
    assert ref.abs().max() > 1e-2  # non-trivial gradients
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-4)
    # layer 1: G* == G (h_0 is the previous layer)
    torch.testing.assert_close(out["Gstar"][0], out["G"][0])


def test_batched_flow_chunked_and_pooling_linear():
    enc = tiny_bert()
    _randomise_layernorms(enc.model, 1)
    wids, ids = _ids(enc)
    a = gradient_flow(enc.model, ids)
    b = gradient_flow(enc.model, ids, chunk_size=2)
    torch.testing.assert_close(a["G"], b["G"])
    # word-level attention = the cache's pooling of the head-mean attention (explicit loops over the pieces)
    fm, tm = _pooling(wids, len(WORDS))
    w = gradient_flow(enc.model, ids, fm, tm)
    want = pool_by_loops(a["A"].numpy(), word_groups(wids, len(WORDS)))  # (L, W, W)
    torch.testing.assert_close(w["A"], torch.from_numpy(want).float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w["A"].sum(-1), torch.ones(w["A"].shape[:2]), atol=1e-5, rtol=1e-5)


def test_correlations_table():
    enc = tiny_bert()
    _randomise_layernorms(enc.model)
    wids, ids = _ids(enc)
    fm, tm = _pooling(wids, len(WORDS))
    df = pair_rows(0, WORDS, gradient_flow(enc.model, ids, fm, tm))
    W = len(WORDS) + 2
    assert len(df) == 2 * W * W and df.special.sum() == 2 * (W * W - (W - 2) ** 2)
    c = correlations(df)
    assert set(c.scope) == {"all_layers", "layer", "per_sentence_mean"}
    assert c.rho.between(-1, 1).all()


def test_ols_recovers_coefficients():
    rng = np.random.default_rng(0)
    n = 2000
    x = rng.normal(size=(n, 2))
    groups = np.repeat(np.arange(100), n // 100)
    y = 1.5 + 2.0 * x[:, 0] - 0.5 * x[:, 1] + rng.normal(scale=0.1, size=n)
    res = {r["term"]: r for r in ols(y, x, ["a", "b"], groups)}
    assert abs(res["intercept"]["coef"] - 1.5) < 0.02
    assert abs(res["a"]["coef"] - 2.0) < 0.02 and abs(res["b"]["coef"] + 0.5) < 0.02
    assert res["a"]["p"] < 1e-10 and res["a"]["p_cluster"] < 1e-10 and res["a"]["n_groups"] == 100
    # classical SEs agree with the textbook formula
    X = np.column_stack([np.ones(n), x])
    beta = np.linalg.lstsq(X, y, rcond=None)[0]
    s2 = ((y - X @ beta) ** 2).sum() / (n - 3)
    se = np.sqrt(np.diag(np.linalg.inv(X.T @ X)) * s2)
    assert np.allclose([res[k]["se"] for k in ("intercept", "a", "b")], se)


def test_select_sentences():
    assert select_sentences(10) == list(range(10))
    assert select_sentences(10, max_sentences=4) == [0, 1, 2, 3]  # first N, file order
    sub = select_sentences(10, max_sentences=6, n_sentences=3, seed=1)
    assert len(sub) == 3 and sub == sorted(sub) and set(sub) <= set(range(6))
    assert sub == select_sentences(10, 6, 3, 1)  # seeded


# --------------------------------------------------------------------------- other families


def tiny_family(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random encoder of another family, built from its config, on the project's attention path,
    with random LayerNorm affines (see :func:`_randomise_layernorms`)."""
    import transformers

    common = dict(vocab_size=100, max_position_embeddings=64)
    if kind == "distilbert":
        cfg = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common)
    elif kind == "albert":  # 3 layers sharing one layer group
        cfg = transformers.AlbertConfig(embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=64, num_hidden_groups=1, **common)
    elif kind == "deberta-v2":
        cfg = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                           position_buckets=8, max_relative_positions=16, **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="eager")
    model.eval().requires_grad_(False)
    attention_function.prepare(model)
    return _randomise_layernorms(model, seed)


def _random_ids(n=7, seed=0):
    return torch.randint(5, 100, (n,), generator=torch.Generator().manual_seed(seed))


FAMILIES = ["distilbert", "albert", "deberta-v2"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_flow_other_families(kind):
    model = tiny_family(kind)
    ids = _random_ids()
    T, L = len(ids), model.config.num_hidden_layers
    hs, attn = hidden_and_attention(model, ids)
    assert len(hs) == L + 1 and attn.shape == (L, model.config.num_attention_heads, T, T)
    torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
    for n, f in enumerate(block_functions(model, ids)):  # each block function reproduces the forward
        torch.testing.assert_close(f(hs[n]), hs[n + 1], atol=1e-5, rtol=1e-5)
    out = gradient_flow(model, ids, chain=True)
    assert out["G"].shape == out["Gstar"].shape == out["A"].shape == (L, T, T)
    for chain, key in ((False, "G"), (True, "Gstar")):
        ref = gradient_flow_loop(model, ids, chain=chain)  # plain forward + autograd.grad per output token
        assert ref.abs().max() > 1e-2
        torch.testing.assert_close(out[key], ref.float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["Gstar"][0], out["G"][0])


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("method", ["ixg", "ig"])
def test_attributions_other_families(kind, method):
    model = tiny_family(kind)
    ids = _random_ids(6, seed=1)
    L, H, T = model.config.num_hidden_layers, model.config.num_attention_heads, len(ids)
    dist = head_attributions(model, ids, method, steps=4, chunk_size=7)
    assert dist.shape == (L, H, T, T)
    torch.testing.assert_close(dist.sum(-1), torch.ones(L, H, T))
    for layer, head, pos in [(0, 1, 2), (L - 1, H - 1, T - 1)]:
        ref = attribution_distribution(captum_head_attribution(model, ids, layer, head, pos, method, steps=4))
        torch.testing.assert_close(dist[layer, head, pos], ref, atol=1e-5, rtol=1e-4)
