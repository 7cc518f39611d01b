"""Gradient attributions (Pascual et al. 2021): exact toys, captum agreement, comparison helpers.

Other families (DistilBERT, ALBERT, DeBERTa-v2): tests/test_flow.py::test_attributions_other_families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes.analysis.pascual.attribution import select_shortest
from probes.analysis.stats import js_divergence, spearman_rows, top1_agreement
from probes.analysis.westera.gradflow import (PATTERNS, argmax_patterns, attribution_distribution,
                                              captum_head_attribution, head_attributions, head_scalars_fn,
                                              ig_baseline, input_x_gradient, integrated_gradients,
                                              layer_head_scalars_fn, word_embeddings)
from probes.model.load import tiny_bert


def test_linear_toy_attributions_are_w_times_x():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)  # y = sum(w * x), x: (T=5, D=3)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)

    def f(z):
        return (w * z).sum().reshape(1)

    torch.testing.assert_close(input_x_gradient(f, x)[0], w * x, rtol=0, atol=1e-12)
    for steps in (1, 7, 20):  # exact for any number of steps: the gradient is constant
        torch.testing.assert_close(integrated_gradients(f, x, steps=steps)[0], w * x, rtol=0, atol=1e-12)
    # and with a non-zero baseline: w * (x - x')
    b = torch.randn(5, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(integrated_gradients(f, x, b, steps=4)[0], w * (x - b), rtol=0, atol=1e-12)


def test_several_outputs_at_once():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(4, 6, 2, generator=g, dtype=torch.float64)  # 4 linear outputs
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)

    def f(z):
        return torch.einsum("ktd,td->k", W, z)

    torch.testing.assert_close(input_x_gradient(f, x, chunk_size=3), W * x)


def test_ig_completeness_on_nonlinear_toy():
    x = torch.tensor([[0.3, -1.2], [0.7, 0.4]], dtype=torch.float64)

    def f(z):
        return torch.tanh(z).pow(2).sum().reshape(1)

    attr = integrated_gradients(f, x, steps=400)[0]
    torch.testing.assert_close(attr.sum(), f(x)[0] - f(torch.zeros_like(x))[0], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    enc = tiny_bert(num_hidden_layers=2, num_attention_heads=4)
    ids = torch.tensor(enc.tokenizer("the cat saw a dog")["input_ids"])
    return enc, ids


def test_truncated_layer_function_equals_hooked_full_model(tiny):
    enc, ids = tiny
    x = word_embeddings(enc.model, ids)
    full = head_scalars_fn(enc.model, ids)(x)  # (L, H, T) from forward hooks
    for layer in range(enc.num_layers):
        torch.testing.assert_close(layer_head_scalars_fn(enc.model, ids, layer)(x), full[layer])


@pytest.mark.parametrize("method", ["ixg", "ig"])
def test_batched_attributions_match_captum(tiny, method):
    enc, ids = tiny
    dist = head_attributions(enc.model, ids, method, steps=5)
    L, H, T, T2 = dist.shape
    assert (L, H, T, T2) == (enc.num_layers, enc.num_heads, len(ids), len(ids))
    torch.testing.assert_close(dist.sum(-1), torch.ones(L, H, T))
    for layer, head, pos in [(0, 0, 0), (1, 3, 2), (1, 1, T - 1)]:
        ref = attribution_distribution(captum_head_attribution(enc.model, ids, layer, head, pos, method, steps=5))
        torch.testing.assert_close(dist[layer, head, pos], ref, atol=1e-5, rtol=1e-4)


def test_js_divergence():
    p = np.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    assert np.allclose(js_divergence(p, p), 0.0)
    assert np.isclose(js_divergence([1.0, 0.0], [0.0, 1.0]), 1.0)  # disjoint supports: 1 bit
    q = np.array([[0.5, 0.3, 0.2], [0.0, 0.5, 0.5]])
    d = js_divergence(p, q)
    assert np.allclose(d, js_divergence(q, p)) and (d > 0).all() and (d <= 1).all()
    m = 0.5 * (p[0] + q[0])
    want = 0.5 * (p[0] * np.log2(p[0] / m)).sum() + 0.5 * (q[0] * np.log2(q[0] / m)).sum()
    assert np.isclose(d[0], want)


def test_spearman_and_top1_helpers():
    a = np.array([[0.1, 0.5, 0.2, 0.9], [1, 2, 3, 4], [1, 1, 1, 1]], dtype=float)
    b = np.array([[1, 3, 2, 4], [4, 3, 2, 1], [1, 2, 3, 4]], dtype=float)
    r = spearman_rows(a, b)
    assert np.isclose(r[0], 1.0) and np.isclose(r[1], -1.0) and np.isnan(r[2])
    from scipy.stats import spearmanr

    x, y = np.array([3.0, 1, 2, 2, 5]), np.array([1.0, 0, 4, 2, 2])
    assert np.isclose(spearman_rows(x, y), spearmanr(x, y)[0])  # ties: average ranks
    assert top1_agreement(a, b).tolist() == [1.0, 0.0, 0.0]


def test_argmax_patterns():
    T = 5
    d = np.zeros((T, T))
    d[0, 0] = 1  # [CLS] row -> cls (cls wins over self)
    d[1, 2] = 1  # next
    d[2, 1] = 1  # prev
    d[3, 3] = 1  # self
    d[4, 2] = 1  # [SEP] row -> 2 steps back: other
    got = [PATTERNS[k] for k in argmax_patterns(d)]
    assert got == ["cls", "next", "prev", "self", "other"]
    d2 = np.zeros((T, T))
    d2[:, T - 1] = 1
    assert [PATTERNS[k] for k in argmax_patterns(d2)] == ["sep"] * T


def test_pad_baseline_and_captum(tiny):
    enc, ids = tiny
    x = word_embeddings(enc.model, ids)
    b = ig_baseline(enc.model, ids, "pad", enc.tokenizer.pad_token_id)
    pad = enc.model.get_input_embeddings().weight[enc.tokenizer.pad_token_id]
    torch.testing.assert_close(b[1:-1], pad.expand_as(b[1:-1]))
    torch.testing.assert_close(b[[0, -1]], x[[0, -1]])  # first / last special token keep their own
    dist = head_attributions(enc.model, ids, "ig", steps=3, baseline=b)
    ref = attribution_distribution(captum_head_attribution(enc.model, ids, 1, 2, 3, "ig", steps=3, baseline=b))
    torch.testing.assert_close(dist[1, 2, 3], ref, atol=1e-5, rtol=1e-4)


def test_select_shortest():
    n_words = [6, 2, 5, 9, 5]
    n_pieces = [9, 4, 8, 12, 7]
    assert select_shortest(n_words, n_pieces, None, 5, 512) == [4, 2, 0, 3]  # shortest first, >= 5 words
    assert select_shortest(n_words, n_pieces, 2, 5, 512) == [4, 2]
    assert select_shortest(n_words, n_pieces, None, 5, 10) == [4, 2, 0]  # longer than max_length: out
