"""Head disabling through the model layer: ``hooks.attention(model, [], uniform={layer: [heads]})`` gives the
chosen heads uniform attention over the real tokens. Checked against a plain-torch recomputation of a
BERT layer from its parameters, and the prefix reuse of ``analysis=disable_heads`` against full forwards."""

import math

import pytest
import torch
import torch.nn.functional as F

from probes.analysis.kovaleva.disable_heads import disabled
from probes.model import hooks
from probes.model.load import tiny_bert

PAIRS = (["a cat saw the dog", "red"], ["the house", "big"])  # second example is padded


@pytest.fixture(scope="module")
def enc():
    return tiny_bert(num_hidden_layers=3, num_attention_heads=4, seed=1)


def _inputs(enc):
    return dict(enc.tokenizer(*PAIRS, padding=True, return_tensors="pt"))


def _run(model, inputs, uniform=None, values=False):
    """(output with hidden states, {layer: (B, H, T, T) probs}, session) of one forward."""
    with torch.no_grad(), hooks.attention(model, uniform=uniform, values=values) as s:
        out = s.run(**inputs, output_hidden_states=True)
    return out, s.probs, s


def _reference_layer(model, layer: int, hidden: torch.Tensor, mask: torch.Tensor, uniform_heads=()):
    """Plain-torch BERT layer from the model's parameters: (probs (B, H, T, T), head contexts (B, T, H, d),
    output (B, T, D)); heads in ``uniform_heads`` attend uniformly to the real keys (mask (B, T) bool)."""
    params = dict(model.named_parameters())
    cfg = model.config

    def p(name):
        return params[f"encoder.layer.{layer}.{name}"]

    def lin(x, name):
        return x @ p(f"{name}.weight").T + p(f"{name}.bias")

    B, T, D = hidden.shape
    H = cfg.num_attention_heads
    d = D // H
    q, k, v = (lin(hidden, f"attention.self.{n}").view(B, T, H, d).transpose(1, 2) for n in ("query", "key", "value"))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)                     # (B, H, T, T)
    probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
    u = mask[:, None, :].to(probs.dtype).expand(B, T, T)
    for h in uniform_heads:
        probs[:, h] = u / u.sum(-1, keepdim=True)
    context = (probs @ v).transpose(1, 2)                                  # (B, T, H, d)
    eps = cfg.layer_norm_eps
    a = F.layer_norm(lin(context.reshape(B, T, D), "attention.output.dense") + hidden, (D,),
                     p("attention.output.LayerNorm.weight"), p("attention.output.LayerNorm.bias"), eps)
    i = F.gelu(lin(a, "intermediate.dense"))
    out = F.layer_norm(lin(i, "output.dense") + a, (D,), p("output.LayerNorm.weight"), p("output.LayerNorm.bias"), eps)
    return probs, context, out, v                                          # v: (B, H, T, d)


def test_nothing_disabled_is_bit_identical(enc):
    x = _inputs(enc)
    mask = x["attention_mask"].bool()
    with torch.no_grad():
        plain = enc.model(**x, output_hidden_states=True)  # no session at all
    same, probs, _ = _run(enc.model, x, uniform={})
    assert torch.equal(plain.last_hidden_state, same.last_hidden_state)
    assert all(torch.equal(a, b) for a, b in zip(plain.hidden_states, same.hidden_states))
    for l in range(enc.num_layers):  # the captured maps are the model's own (plain-torch reference)
        want, _, out, _ = _reference_layer(enc.model, l, plain.hidden_states[l], mask)
        real = mask[:, None, :, None] & mask[:, None, None, :]
        torch.testing.assert_close(probs[l] * real, want * real, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[mask], plain.hidden_states[l + 1][mask], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer,head", [(0, 0), (1, 2), (2, 3)])
def test_disabled_head_is_uniform_and_only_later_layers_change(enc, layer, head):
    x = _inputs(enc)
    mask = x["attention_mask"].bool()
    assert not mask.all()  # the test needs padding
    plain, plain_probs, _ = _run(enc.model, x)
    dis, dis_probs, _ = _run(enc.model, x, uniform={layer: [head]})
    with torch.no_grad():
        after = enc.model(**x)  # the intervention ends with the session
    assert torch.equal(after.last_hidden_state, plain.last_hidden_state)
    n_real = mask.sum(1)
    a = dis_probs[layer][:, head]  # (B, T, T)
    for b in range(a.shape[0]):
        n = int(n_real[b])
        want = torch.zeros_like(a[b, :n])
        want[:, :n] = 1.0 / n
        torch.testing.assert_close(a[b, :n], want, rtol=0, atol=1e-7)  # real query rows: 1/n over real keys
    for h in range(plain_probs[layer].shape[1]):
        if h != head:
            assert torch.equal(dis_probs[layer][:, h], plain_probs[layer][:, h])
    for l in range(layer + 1):  # hidden_states[l] is the input of layer l: unchanged up to layer `layer`
        assert torch.equal(dis.hidden_states[l], plain.hidden_states[l])
    for l in range(layer):
        assert torch.equal(dis_probs[l], plain_probs[l])
    real = mask[..., None]
    assert not torch.allclose(dis.hidden_states[layer + 1] * real, plain.hidden_states[layer + 1] * real)


@pytest.mark.parametrize("layer,head", [(1, 1), (0, 3)])
def test_context_matches_manual_computation(enc, layer, head):
    """The disabled head's context is uniform @ V = the mean of the value vectors of the real tokens
    (V recomputed from the layer's value projection), and the layer's output is what a plain-torch
    BERT layer with that head uniform computes."""
    x = _inputs(enc)
    mask = x["attention_mask"].bool()
    plain, _, ps = _run(enc.model, x, values=True)
    dis, _, ds = _run(enc.model, x, uniform={layer: [head]}, values=True)
    hidden = plain.hidden_states[layer]                                    # (B, T, D) input of the layer
    _, ref_ctx, ref_out, ref_v = _reference_layer(enc.model, layer, hidden, mask, uniform_heads=[head])
    torch.testing.assert_close(ds.value[layer], ref_v, rtol=1e-5, atol=1e-6)  # (B, H, T, d)
    v = ref_v[:, head]                                                     # (B, T, d)
    m = mask.to(v.dtype)
    mean_v = (v * m[..., None]).sum(1) / m.sum(1, keepdim=True)            # (B, d)
    got = ds.output[layer][:, :, head]                                     # (B, T, d)
    B, T, d = got.shape
    for b in range(B):
        n = int(mask[b].sum())
        torch.testing.assert_close(got[b, :n], mean_v[b].expand(n, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[mask], ref_ctx[:, :, head][mask], rtol=1e-5, atol=1e-6)
    other = [i for i in range(enc.num_heads) if i != head]
    assert torch.equal(ds.output[layer][:, :, other], ps.output[layer][:, :, other])
    torch.testing.assert_close(dis.hidden_states[layer + 1][mask], ref_out[mask], rtol=1e-4, atol=1e-5)


def test_disabling_a_layer_equals_disabling_all_its_heads(enc):
    x = _inputs(enc)
    assert disabled("layer", 1, -1, enc.num_heads) == {1: list(range(enc.num_heads))}
    assert disabled("head", 1, 2, enc.num_heads) == {1: [2]} and disabled("none", -1, -1, enc.num_heads) == {}
    a, _, _ = _run(enc.model, x, uniform=disabled("layer", 1, -1, enc.num_heads))
    b, _, _ = _run(enc.model, x, uniform={1: [h for h in reversed(range(enc.num_heads))]})
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    c, _, _ = _run(enc.model, x, uniform=disabled("layer", 0, -1, enc.num_heads))
    assert not torch.equal(a.last_hidden_state, c.last_hidden_state)


def test_bad_indices(enc):
    with pytest.raises(ValueError, match="layer"):
        with hooks.attention(enc.model, [], uniform={enc.num_layers: [0]}):
            pass
    with pytest.raises(ValueError, match="head"):
        _run(enc.model, _inputs(enc), uniform={0: [enc.num_heads]})
    with pytest.raises(ValueError, match="condition"):
        disabled("heads", 0, 0, enc.num_heads)


def test_prefix_reuse_equals_full_forward():
    """disable_scores' fast path (reuse layers < l) gives the same scores as full forwards."""
    import random

    import numpy as np
    from transformers import BertConfig, BertForSequenceClassification

    from probes.analysis.kovaleva.disable_heads import disable_scores
    from probes.data.glue import GlueExample
    from probes.glue.evaluate import make_batches

    enc = tiny_bert(num_hidden_layers=3, num_attention_heads=2)
    torch.manual_seed(0)
    cfg = BertConfig(**{**enc.config.to_dict(), "num_labels": 1})
    cfg._attn_implementation = "eager"
    model = BertForSequenceClassification(cfg).eval()
    rng = random.Random(0)
    words = "the a cat dog saw liked house runs big small".split()
    ex = [GlueExample(" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))), "a dog", rng.random() * 5, i)
          for i in range(11)]
    batches = make_batches(enc.tokenizer, ex, "stsb", batch_size=4)
    fast = disable_scores(model, batches, "stsb", 3, 2, progress=False, reuse_prefix=True)
    slow = disable_scores(model, batches, "stsb", 3, 2, progress=False, reuse_prefix=False)
    assert len(fast) == 2 * (1 + 3 * 2 + 3)
    assert (fast.delta != 0).any()
    np.testing.assert_allclose(fast.value.to_numpy(), slow.value.to_numpy(), rtol=0, atol=1e-6)
