"""Gradient flow (Westera 2019) maths on a real tiny random BERT: identity layers, batched vs loop, OLS."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probes.analysis.westera.flow import correlations, pair_rows
from probes.analysis.westera.gradflow import (encoder_layers, gradient_flow, gradient_flow_loop, hidden_and_attention, ols)
from probes.model.load import tiny_bert
from probes.model.inputs import encode_words, pooling_matrix

WORDS = ["the", "qwertyuiop", "cat", "saw", "dogs", "."]


def _ids(enc, words=WORDS):
    e = encode_words(enc.tokenizer, [words])[0]
    return e, torch.tensor(e.input_ids)


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
    for layer in encoder_layers(enc.model):
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
    e, ids = _ids(enc)
    D = enc.config.hidden_size
    fm = tm = None
    if level == "word":
        fm = pooling_matrix(e.word_of_piece, e.n_words, "mean")
        tm = pooling_matrix(e.word_of_piece, e.n_words, "sum")
        assert e.n_pieces > e.n_words + 2  # "qwertyuiop" is split, so pooling is exercised
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
    e, ids = _ids(enc)
    a = gradient_flow(enc.model, ids)
    b = gradient_flow(enc.model, ids, chunk_size=2)
    torch.testing.assert_close(a["G"], b["G"])
    # word-level attention = the cache's pooling of the head-mean attention
    fm = pooling_matrix(e.word_of_piece, e.n_words, "mean")
    tm = pooling_matrix(e.word_of_piece, e.n_words, "sum")
    w = gradient_flow(enc.model, ids, fm, tm)
    torch.testing.assert_close(w["A"], fm @ a["A"] @ tm.T, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w["A"].sum(-1), torch.ones(w["A"].shape[:2]), atol=1e-5, rtol=1e-5)


def test_correlations_table():
    enc = tiny_bert()
    _randomise_layernorms(enc.model)
    e, ids = _ids(enc)
    fm = pooling_matrix(e.word_of_piece, e.n_words, "mean")
    tm = pooling_matrix(e.word_of_piece, e.n_words, "sum")
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
