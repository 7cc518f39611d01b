"""AttentionDisabler: uniform attention over real tokens for chosen heads/layers, via hooks."""

import pytest
import torch

from probes.model.load import tiny_bert
from probes.extract.stage import self_attention_modules
from probes.glue.disable import AttentionDisabler

PAIRS = (["a cat saw the dog", "red"], ["the house", "big"])  # second example is padded


@pytest.fixture(scope="module")
def enc():
    return tiny_bert(num_hidden_layers=3, num_attention_heads=4, seed=1)


def _inputs(enc):
    return enc.tokenizer(*PAIRS, padding=True, return_tensors="pt")


def _run(model, inputs, **kw):
    with torch.no_grad():
        return model(**inputs, output_attentions=True, output_hidden_states=True, **kw)


def test_nothing_disabled_is_bit_identical(enc):
    x = _inputs(enc)
    plain = _run(enc.model, x)
    with AttentionDisabler(enc.model) as d:
        assert d.selected == {}
        same = _run(enc.model, x)
    assert torch.equal(plain.last_hidden_state, same.last_hidden_state)
    assert all(torch.equal(a, b) for a, b in zip(plain.attentions, same.attentions))


@pytest.mark.parametrize("layer,head", [(0, 0), (1, 2), (2, 3)])
def test_disabled_head_is_uniform_and_only_later_layers_change(enc, layer, head):
    x = _inputs(enc)
    mask = x["attention_mask"].bool()
    assert not mask.all()  # the test needs padding
    plain = _run(enc.model, x)
    with AttentionDisabler(enc.model, heads={(layer, head)}):
        dis = _run(enc.model, x)
    after = _run(enc.model, x)  # hooks removed on exit
    assert torch.equal(after.last_hidden_state, plain.last_hidden_state)
    n_real = mask.sum(1)
    a = dis.attentions[layer][:, head]  # (B, T, T)
    for b in range(a.shape[0]):
        n = int(n_real[b])
        want = torch.zeros_like(a[b, :n])
        want[:, :n] = 1.0 / n
        torch.testing.assert_close(a[b, :n], want, rtol=0, atol=1e-7)  # real query rows: 1/n over real keys
    for h in range(plain.attentions[layer].shape[1]):
        if h != head:
            assert torch.equal(dis.attentions[layer][:, h], plain.attentions[layer][:, h])
    for l in range(layer + 1):  # hidden_states[l] is the input of layer l: unchanged up to layer `layer`
        assert torch.equal(dis.hidden_states[l], plain.hidden_states[l])
    for l in range(layer):
        assert torch.equal(dis.attentions[l], plain.attentions[l])
    real = mask[..., None]
    assert not torch.allclose(dis.hidden_states[layer + 1] * real, plain.hidden_states[layer + 1] * real)


def test_context_matches_manual_computation(enc):
    """The disabled head's context is the mean of the value vectors of the real tokens."""
    layer, head = 1, 1
    x = _inputs(enc)
    mask = x["attention_mask"].bool()
    module = self_attention_modules(enc.model)[layer]
    seen = {}

    def grab(mod, args, kwargs, out):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["context"] = out[0]

    plain_ctx = None
    h = module.register_forward_hook(grab, with_kwargs=True)
    try:
        _run(enc.model, x)
        plain_ctx = seen["context"].clone()
        with AttentionDisabler(enc.model, heads={(layer, head)}):
            _run(enc.model, x)
    finally:
        h.remove()
    # `grab` was registered first but the disabler's hook is prepended, so `grab` saw the new context
    hidden, ctx = seen["hidden"], seen["context"]
    d = module.attention_head_size
    B, T = hidden.shape[:2]
    v = module.value(hidden).view(B, T, -1, d)[:, :, head]               # (B, T, d)
    m = mask.to(v.dtype)
    mean_v = (v * m[..., None]).sum(1) / m.sum(1, keepdim=True)          # (B, d)
    got = ctx.view(B, T, -1, d)[:, :, head]
    for b in range(B):
        n = int(mask[b].sum())
        torch.testing.assert_close(got[b, :n], mean_v[b].expand(n, d), rtol=1e-5, atol=1e-6)
    other = [i for i in range(ctx.shape[-1] // d) if i != head]
    assert torch.equal(ctx.view(B, T, -1, d)[:, :, other], plain_ctx.view(B, T, -1, d)[:, :, other])


def test_disabling_a_layer_equals_disabling_all_its_heads(enc):
    x = _inputs(enc)
    with AttentionDisabler(enc.model, layers={1}):
        a = _run(enc.model, x)
    with AttentionDisabler(enc.model, heads={(1, h) for h in range(enc.num_heads)}):
        b = _run(enc.model, x)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    with AttentionDisabler(enc.model, layers={0}):
        c = _run(enc.model, x)
    assert not torch.equal(a.last_hidden_state, c.last_hidden_state)


def test_bad_indices(enc):
    with pytest.raises(ValueError, match="layer"):
        AttentionDisabler(enc.model, layers={enc.num_layers})
    with pytest.raises(ValueError, match="head"):
        AttentionDisabler(enc.model, heads={(0, enc.num_heads)})


def test_prefix_reuse_equals_full_forward():
    """disable_scores' fast path (reuse layers < l) gives the same scores as full forwards."""
    import random

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
    import numpy as np

    np.testing.assert_allclose(fast.value.to_numpy(), slow.value.to_numpy(), rtol=0, atol=1e-6)
