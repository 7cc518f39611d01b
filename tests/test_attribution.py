"""Gradient attributions (Pascual et al. 2021): exact toys, captum agreement, comparison helpers.

Other families (DistilBERT, ALBERT, DeBERTa-v2): tests/test_flow.py::test_attributions_other_families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes.analysis.pascual.attribution import PATTERNS, argmax_patterns, captum_head_attribution, select_shortest
from probes.stats import js_divergence, spearman_rows, top1_agreement
from probes.measures.gradflow import (attribution_distribution, head_attribution_gflops, head_attributions,
                                      hta_attributions, ig_baseline, ig_points, input_x_gradient, integrated_gradients,
                                      layer_head_scalars_fn, word_embeddings)
from probes.model.load import tiny_bert
from tests.reference import head_attributions_stepwise, head_scalars_fn


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


@pytest.mark.parametrize("method,baseline,chunk", [("ixg", None, 1024), ("ig", "zero", 1024), ("ig", "pad", 7),
                                                   ("ig", "zero", None), ("hta", None, 5)])
def test_batched_points_equal_stepwise_reference(tiny, method, baseline, chunk):
    """IG points as one batch dimension (and targets x points in chunks) = a loop of one vjp per step."""
    enc, ids = tiny
    b = None if baseline is None else ig_baseline(enc.model, ids, baseline, enc.tokenizer.pad_token_id)
    calls = []
    if method == "hta":
        got = hta_attributions(enc.model, ids, chunk_size=chunk, progress=lambda *a: calls.append(a))
    else:
        got = head_attributions(enc.model, ids, method, steps=6, chunk_size=chunk, baseline=b,
                                progress=lambda *a: calls.append(a))
    ref = head_attributions_stepwise(enc.model, ids, method, steps=6, chunk_size=256, baseline=b)
    assert got.shape == ref.shape == (enc.num_layers, enc.num_heads, len(ids), len(ids))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert sorted({layer for layer, _ in calls}) == list(range(enc.num_layers))
    for layer in range(enc.num_layers):  # the shares of each layer's targets add up to 1
        assert sum(share for l, share in calls if l == layer) == pytest.approx(1.0)


def test_ig_points_are_riemann_midpoints():
    x, b = torch.randn(3, 2), torch.randn(3, 2)
    p = ig_points(x, b, 4)
    assert p.shape == (4, 3, 2)
    for k in range(4):
        torch.testing.assert_close(p[k], b + (k + 0.5) / 4 * (x - b))


def test_head_attribution_gflops_counts_blocks(tiny):
    enc, _ = tiny
    c = enc.model.config
    D, F, H, T = c.hidden_size, c.intermediate_size, c.num_attention_heads, 7
    block = 8 * D * D * T + 4 * D * F * T + 4 * T * T * D
    attn = 6 * D * D * T + 4 * T * T * D
    assert head_attribution_gflops(enc.model, T, 0) == pytest.approx(H * T * attn / 1e9)
    assert head_attribution_gflops(enc.model, T, 1, points=3) == pytest.approx(3 * H * T * (block + attn) / 1e9)


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


# --------------------------------------------------------------------------- several map kinds, one attribution


def _slow_patterns(rows: np.ndarray) -> list[str]:
    """Argmax pattern of each row of one (T, T) map, written out: cls > sep > self > prev > next > other."""
    T = rows.shape[-1]
    out = []
    for i, row in enumerate(rows):
        j = int(np.argmax(row))
        out.append("cls" if j == 0 else "sep" if j == T - 1 else "self" if j == i else "prev" if j == i - 1
                   else "next" if j == i + 1 else "other")
    return out


def test_head_pattern_counts_and_dominant_agreement():
    from probes.analysis.pascual.attribution import dominant_pattern_agreement, head_pattern_counts

    rng = np.random.default_rng(0)
    d = rng.random((2, 3, 6, 6))  # (L, H, T, T)
    counts = head_pattern_counts(d)
    for l in range(2):
        for h in range(3):
            want = [_slow_patterns(d[l, h]).count(p) for p in PATTERNS]
            assert counts[l, h].tolist() == want
    a, b = np.zeros((1, 2, len(PATTERNS))), np.zeros((1, 2, len(PATTERNS)))
    a[0, 0, PATTERNS.index("cls")], b[0, 0, PATTERNS.index("cls")] = 3, 5  # same dominant pattern
    a[0, 1, PATTERNS.index("self")], b[0, 1, PATTERNS.index("next")] = 3, 5  # different
    assert dominant_pattern_agreement(a, b).tolist() == [[True, False]]


def test_several_kinds_against_one_attribution_match_slow_reference(tmp_path):
    """``analysis.kinds=[attention,rollout]``: each kind's per-layer JS / Spearman / top-1 / pattern agreement
    equal a slow reference (one ``autograd.grad`` per head target, rollout and the statistics written out with
    loops and scipy), and the attribution is computed once per sentence and method."""
    import json
    from unittest import mock

    import pandas as pd
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from scipy.spatial.distance import jensenshannon
    from scipy.stats import spearmanr

    from probes.analysis.context import AnalysisContext
    from probes.analysis.pascual import attribution as A
    from probes.model import hooks
    from probes.model.inputs import encode_words
    from tests.conftest import ROOT, TINY_CONLLU

    data = tmp_path / "data"
    (data / "ud_english_ewt").mkdir(parents=True)
    (data / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            "analysis=attribution", "encoder=tiny_family", "encoder.family=bert", f"encoder.root={tmp_path / 'm'}",
            f"paths.data_dir={data}", f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
            "data.treebank.download=false", "analysis.n_shortest=null", "analysis.min_words=2",
            "analysis.methods=[ixg]", "analysis.captum_check=0", "analysis.kinds=[attention,rollout]"])
    ctx = AnalysisContext(cfg, tmp_path / "out")
    with mock.patch.object(A, "head_attributions", wraps=A.head_attributions) as spy:
        layers = instantiate(cfg.analysis)(ctx)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["kinds"] == ["attention", "rollout"] and summary["n_sentences"] == 2
    assert spy.call_count == 2  # one attribution per sentence (and method), shared by both kinds

    model = ctx.encoder.model
    sents = [s for s in ctx.sentences("dev") if s.n >= 2]
    enc = encode_words(ctx.encoder.tokenizer, [list(s.words) for s in sents])
    L, H = ctx.encoder.num_layers, ctx.encoder.num_heads
    stats = {k: {c: [[] for _ in range(L)] for c in ("js", "spearman", "top1")} for k in ("attention", "rollout")}
    pats = {k: {w: np.zeros((L, H if k == "attention" else 1, len(PATTERNS))) for w in ("map", "attr")}
            for k in ("attention", "rollout")}
    for e in enc:
        ids = torch.tensor(e.input_ids)
        T = len(ids)
        x = word_embeddings(model, ids).clone().requires_grad_(True)
        with torch.enable_grad():
            s = head_scalars_fn(model, ids)(x)  # (L, H, T)
            dist = torch.zeros(L, H, T, T, dtype=torch.float64)
            for l in range(L):
                for h in range(H):
                    for i in range(T):
                        (g,) = torch.autograd.grad(s[l, h, i], x, retain_graph=True)
                        m = (g * x).detach().abs().sum(-1).double()
                        dist[l, h, i] = m / m.sum()
        with torch.no_grad(), hooks.attention(model) as sess:
            sess.run(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None])
            att = torch.stack([sess.probs[l][0] for l in range(L)]).double()  # (L, H, T, T)
        roll, prev = [], None
        for l in range(L):  # Abnar & Zuidema: (mean_h A + I) / rowsum, multiplied down the layers
            a = att[l].mean(0) + torch.eye(T, dtype=torch.float64)
            a = a / a.sum(-1, keepdim=True)
            prev = a if prev is None else a @ prev
            roll.append(prev)
        maps = {"attention": att.numpy(), "rollout": torch.stack(roll)[:, None].numpy()}
        for kind, mp in maps.items():
            dd = dist.numpy() if kind == "attention" else dist.numpy().mean(1, keepdims=True)
            for l in range(L):
                for h in range(mp.shape[1]):
                    for i in range(T):
                        p, q = dd[l, h, i], mp[l, h, i] / mp[l, h, i].sum()
                        stats[kind]["js"][l].append(jensenshannon(p, q, base=2) ** 2)
                        stats[kind]["spearman"][l].append(spearmanr(p, q)[0])
                        stats[kind]["top1"][l].append(float(np.argmax(p) == np.argmax(q)))
                    for w, rows in (("map", mp[l, h]), ("attr", dd[l, h])):
                        for name in _slow_patterns(rows):
                            pats[kind][w][l, h, PATTERNS.index(name)] += 1
    for kind in ("attention", "rollout"):
        got = layers[(layers.kind == kind) & (layers.method == "ixg")].sort_values("layer")
        for c in ("js", "spearman", "top1"):
            want = [np.nanmean(v) for v in stats[kind][c]]
            np.testing.assert_allclose(got[c].to_numpy(), want, atol=1e-5)
        agree = (pats[kind]["map"].argmax(-1) == pats[kind]["attr"].argmax(-1)).mean(1)
        np.testing.assert_allclose(got["pattern_agree"].to_numpy(), agree)
    heads = pd.read_csv(tmp_path / "out" / "attribution_heads.csv")
    assert len(heads) == L * H + L and set(heads[heads.kind == "rollout"]["head"]) == {0}
    pat = pd.read_csv(tmp_path / "out" / "attribution_patterns.csv")
    assert set(pat.source) == {"attention", "rollout", "ixg"}


def test_hta_attributions_match_one_grad_per_target(tiny):
    """``method=hta``: ||d s_{l,h,i} / d x_j||_2 normalised over j, against one ``autograd.grad`` per target."""
    from probes.analysis.pascual.attribution import head_distributions

    enc, ids = tiny
    dist = hta_attributions(enc.model, ids, chunk_size=5)
    L, H, T = enc.num_layers, enc.num_heads, len(ids)
    assert dist.shape == (L, H, T, T)
    x = word_embeddings(enc.model, ids).clone().requires_grad_(True)
    with torch.enable_grad():
        s = head_scalars_fn(enc.model, ids)(x)  # (L, H, T)
        for l in range(L):
            for h in range(H):
                for i in range(T):
                    (g,) = torch.autograd.grad(s[l, h, i], x, retain_graph=True)
                    m = g.norm(dim=-1)
                    torch.testing.assert_close(dist[l, h, i], m / m.sum(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(head_distributions(enc.model, ids, "hta", 1, None, None), dist)
