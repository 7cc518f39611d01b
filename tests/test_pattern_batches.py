"""``analysis=pattern_types``' per-head classes, computed a batch at a time on the maps' device
(:func:`probes.analysis.kovaleva.pattern_types.head_predictions`), against a plain per-example loop written here.

The reference is independent of the batching under test: each example's inputs are the model's own tokenizer on
the raw text (a sentence, or a pair in the tokenizer's pair form), one eager forward with ``output_attentions=True``
per example, and every head's map classified alone (preprocessed on the host, the CNN's plain eval-mode forward). Batches are
small, hold examples of different lengths (padding) and examples of the same length (classified together). The
tiny random models' queries and keys are scaled up (in both models alike) so that their maps are peaked and the
classes vary from head to head.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import probes
from probes.analysis.kovaleva.pattern_types import encode_glue, head_predictions
from probes.maps import MapEngine, pad_id_of
from probes.measures.attention import Attention
from probes.model.tiny import tiny_folder
from probes.patterns.components.cnn import CLASSES, MaxPool2, preprocess, preprocess_padded
from probes.patterns import module as pattern_module
from probes.patterns.module import PatternClassifier
from tests import reference

MAX_POSITIONS = 64
MAX_TOKENS = 60  # a few examples per batch
# texts of different lengths; some of the same length (the same words in another order), so that batches hold
# both several lengths and several examples of one length
TEXTS = ["The cat sat on the mat .", "The mat sat on the cat .", "Dogs bark .", "Nobody sleeps , ever .",
         "A wheel rolled by , slowly , in the dark night .", "A night rolled by , slowly , in the dark wheel .",
         "Hello there !", "Yes .", "No , thanks .", "It was warm , and quiet .", "It was quiet , and warm .",
         "She likes apples and pears very much , they said .", "Too short ."]
SHARPEN = 10.0  # queries and keys scaled in both models: peaked maps (a random model's near-uniform maps look alike)
TIE = 1e-4  # a map whose two best logits are closer than this may go either way (float noise of the two forwards)


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.(query|key|q_proj|k_proj)\.", name):
                p.mul_(SHARPEN)
    return model


@pytest.fixture(scope="module", params=["bert", "llama"])  # an encoder; a decoder (causal, no pair form)
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("pattern-batches")
    folder = tiny_folder(request.param, root=root, max_positions=MAX_POSITIONS)
    enc = probes.load_encoder(str(folder))
    _sharpen(enc.model)
    eager = _sharpen(AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval())
    return request.param, enc, eager, AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def classifier():
    """A randomly initialised CNN (both channels) whose last layer is centred on random peaked maps, so that its
    classes vary from map to map (uncentred, one class wins everywhere)."""
    torch.manual_seed(0)
    m = PatternClassifier(channels=("max", "sqrt"), class_weighting="none").eval()
    g = torch.Generator().manual_seed(0)
    maps = torch.softmax(4 * torch.randn(64, 24, 24, generator=g), -1)  # (64, 24, 24)
    with torch.no_grad():
        last = m.net.head[-1]
        last.bias -= last(m.net.head[:-1](m.net.features(m.preprocess_tensor(maps)))).mean(0)
    return m


def _examples(pairs: bool) -> list:
    if not pairs:
        return [SimpleNamespace(text_a=t, text_b=None) for t in TEXTS]
    firsts = TEXTS[:7]
    return [SimpleNamespace(text_a=a, text_b=b) for a, b in zip(firsts, firsts[1:] + firsts[:1])] + \
        [SimpleNamespace(text_a=b, text_b=a) for a, b in zip(firsts[:4], firsts[1:5])]  # swapped: same lengths


def _reference(eager, tok, classifier, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, L, H) classes by a plain loop: the tokenizer on each raw text, one eager forward, each map alone
    preprocessed on the host and through the CNN's own eval-mode forward; with each map's runner-up class and the
    margin of its two best logits."""
    sentences = [SimpleNamespace(words=t.split(), doc_id=f"d{n}")
                 for n, e in enumerate(examples) for t in (e.text_a, e.text_b) if t is not None]
    classes, second, margin = [], [], []
    for inputs, _, _ in reference.reference_inputs(tok, sentences, pairs=examples[0].text_b is not None):
        att = reference.eager_maps(eager, inputs).astype(np.float32)  # (L, H, T, T)
        L, H = att.shape[:2]
        with torch.no_grad():  # the plain eval-mode network (not the fused one the code under test runs)
            top = torch.stack([classifier.net(classifier.preprocess([att[l, h]]))[0]
                               for l in range(L) for h in range(H)]).topk(2, 1)  # (L * H, 2)
        classes.append(top.indices[:, 0].reshape(L, H).numpy())
        second.append(top.indices[:, 1].reshape(L, H).numpy())
        margin.append((top.values[:, 0] - top.values[:, 1]).reshape(L, H).numpy())
    return np.array(classes), np.array(second), np.array(margin)


@pytest.mark.parametrize("pairs", [False, True])
def test_batched_classes_equal_a_per_example_loop(model, classifier, pairs, monkeypatch):
    family, enc, eager, tok = model
    if pairs and family == "llama":
        pytest.skip("a decoder has no pair form of its own tokenizer to build the reference from")
    examples = _examples(pairs)
    items, skipped = encode_glue(enc.tokenizer, examples)
    assert skipped == 0 and max(e.n_pieces for e in items) <= MAX_POSITIONS
    # the batches: several, some with several lengths (padding), some with several examples of one length
    batches = MapEngine(enc.model, Attention(), max_tokens=MAX_TOKENS, max_batch_size=64, max_pairs=None
                        ).batches(items)
    lengths = [[items[k].n_pieces for k in b] for b in batches]
    assert len(batches) >= 3
    assert any(len(set(n)) > 1 for n in lengths) and any(len(set(n)) < len(n) for n in lengths)
    want, second, margin = _reference(eager, tok, classifier, examples)
    with monkeypatch.context() as m:  # the batched path classifies on the device, never map by map on the host
        m.setattr(PatternClassifier, "predict_maps", lambda *a, **k: pytest.fail("predict_maps called"))
        got = head_predictions(classifier, enc.model, items, "cpu", MAX_TOKENS, progress=False,
                               pad_id=pad_id_of(enc.tokenizer))
    assert got.dtype == np.int16 and got.shape == want.shape == (len(items), enc.num_layers, enc.num_heads)
    assert len(np.unique(want)) > 1  # the classifier tells maps apart: the comparison is not trivial
    tie = margin < TIE
    assert tie.mean() < 0.05
    np.testing.assert_array_equal(got[~tie], want[~tie])
    assert np.all((got[tie] == want[tie]) | (got[tie] == second[tie]))


def test_predict_tensor_equals_predict_maps(classifier):
    """Equal-size maps as one tensor: the classes and network inputs of the host path, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for t in (5, 32, 47):
        maps = torch.softmax(3 * torch.randn(20, t, t, generator=g), -1)  # (20, t, t)
        maps[::4, :, 0] += 1.0  # some columns
        got = classifier.predict_tensor(maps, batch_size=7)
        assert got.dtype == torch.long and got.shape == (20,)
        np.testing.assert_array_equal(got.numpy(), classifier.predict_maps(list(maps.numpy())))
        assert torch.equal(classifier.preprocess_tensor(maps), classifier.preprocess(list(maps.numpy())))
    assert classifier.predict_tensor(torch.zeros(0, 4, 4)).shape == (0,)
    assert set(classifier.classes) == set(CLASSES)


def _padded(lengths, K: int, T: int, seed: int) -> torch.Tensor:
    """(B, K, T, T) peaked random maps, item b's real in [:lengths[b], :lengths[b]], NaN in its padding."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.full((len(lengths), K, T, T), float("nan"))
    for b, n in enumerate(lengths):
        maps[b, :, :n, :n] = torch.softmax(3 * torch.randn(K, n, n, generator=g), -1)
        maps[b, ::2, :n, 0] += 1.0  # some columns
    return maps


@pytest.mark.parametrize("resize", ["area", "nearest"])
@pytest.mark.parametrize("size", [32, 20])
def test_preprocess_padded_equals_each_map_alone(resize, size):
    """Maps of many lengths padded into one tensor, resized at once (one matrix per length), give each map cut to its
    length through ``F.interpolate`` (``preprocess``) to the rounding of the sums: lengths below, at and above the
    size, dividing it or not; the padding (NaN here) never reaches a value."""
    lengths = [1, 2, 5, 13, 19, 31, 32, 33, 47, 64]
    maps = _padded(lengths, 3, 70, seed=2)  # (10, 3, 70, 70)
    got = preprocess_padded(maps, torch.tensor(lengths), size, resize, ("max", "sqrt"))  # (30, 2, size, size)
    assert got.shape == (30, 2, size, size) and bool(got.isfinite().all())
    for b, n in enumerate(lengths):
        want = preprocess(maps[b, :, :n, :n], size, resize, ("max", "sqrt"))  # (3, 2, size, size)
        torch.testing.assert_close(got[3 * b:3 * b + 3], want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="bilinear"):
        preprocess_padded(maps, torch.tensor(lengths), size, "bilinear")
    with pytest.raises(ValueError, match="lengths"):
        preprocess_padded(maps, torch.tensor([0] + lengths[1:]), size, resize)


@pytest.mark.parametrize("resize", ["area", "bilinear"])
def test_predict_padded_equals_each_item_alone(classifier, resize, monkeypatch):
    """``predict_padded`` (all lengths at once for area; by length for bilinear, not one matrix per length) gives
    the classes of ``predict_tensor`` on each item's maps cut to its length (area: but for near ties, where the
    rounding of the resize may choose the runner-up), whatever the items preprocessed at once."""
    m = PatternClassifier(channels=("max", "sqrt"), resize=resize, class_weighting="none").eval()
    m.load_state_dict(classifier.state_dict())
    lengths = [9, 9, 17, 23, 23, 40, 41]
    maps = _padded(lengths, 6, 44, seed=3)  # (7, 6, 44, 44)
    with torch.no_grad():
        top = [m.net(m.preprocess_tensor(maps[b, :, :n, :n])).topk(2, 1) for b, n in enumerate(lengths)]
    want = torch.stack([t.indices[:, 0] for t in top])  # (7, 6)
    second = torch.stack([t.indices[:, 1] for t in top])
    tie = torch.stack([t.values[:, 0] - t.values[:, 1] for t in top]) < TIE
    assert len(want.unique()) > 1 and tie.float().mean() < 0.1
    for elements in (1, 44 * 44 * 6 * 3, 2 ** 20):  # one item, three items, every item at a time
        monkeypatch.setattr(pattern_module, "CPU_PREPROCESS_ELEMENTS", elements)
        got = m.predict_padded(maps, torch.tensor(lengths), batch_size=5)
        assert got.shape == (7, 6) and got.dtype == torch.long
        assert torch.equal(got[~tie], want[~tie]) and bool(((got == want) | (got == second))[tie].all())
        with pytest.raises(ValueError, match="one per item"):
            m.predict_padded(maps, torch.tensor(lengths[:-1]))
        if resize == "bilinear":  # by length: exactly predict_tensor's classes of each item's maps
            assert torch.equal(got, torch.stack([m.predict_tensor(maps[b, :, :n, :n]) for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 3, 9, 7), (2, 5, 2, 3)])
def test_max_pool2_is_max_pool2d(shape):
    """The inference net's pool gives nn.MaxPool2d(2)'s maxima, odd sizes floored, NaN kept, in the input's memory
    format, computed by plain loops over the windows."""
    x = torch.randn(shape)
    x[0, 0, 0, 0] = float("nan")
    B, C, S, W = shape
    want = torch.empty(B, C, S // 2, W // 2)
    for i in range(S // 2):
        for j in range(W // 2):
            window = x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(B, C, 4)
            want[:, :, i, j] = torch.where(window.isnan().any(-1), float("nan"), window.amax(-1))
    for layout in (torch.contiguous_format, torch.channels_last):
        got = MaxPool2()(x.contiguous(memory_format=layout))
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert got[0, 0, 0, 0].isnan() and got.is_contiguous(memory_format=layout)
        torch.testing.assert_close(got, torch.nn.MaxPool2d(2)(x), rtol=0, atol=0, equal_nan=True)


def test_inference_net_is_the_eval_forward():
    """The fused network (BatchNorm folded into the convs, ReLU after the pool, channels-last) gives the logits of
    the plain eval-mode forward to rounding, with non-trivial BatchNorm statistics; building it leaves the module
    in its mode; the classifier builds it again when a weight changes, and its classes follow."""
    torch.manual_seed(1)
    m = PatternClassifier(channels=("max", "sqrt"), class_weighting="none")
    with torch.no_grad():
        for bn in (x for x in m.net.modules() if isinstance(x, torch.nn.BatchNorm2d)):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.2, 3.0)
            bn.weight.normal_()  # negative scales too: the pool then sees a decreasing map
            bn.bias.normal_()
    m.train()
    x = m.preprocess_tensor(torch.softmax(4 * torch.randn(40, 19, 19), -1))  # (40, 2, 32, 32)
    net = m.net.inference_net()
    assert m.training and all(x.training for x in m.net.modules())
    with torch.no_grad():
        want = m.net.eval()(x)  # (40, 5) the plain eval-mode forward
        m.train()
        got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want.argmax(1), torch.zeros(40, dtype=torch.long))  # classes vary: not trivial
    maps = torch.softmax(4 * torch.randn(40, 19, 19), -1)  # (40, 19, 19)
    before = m.predict_tensor(maps)
    assert m.training and m.inference_net() is m.inference_net()  # built once while nothing changes
    with torch.no_grad():
        m.net.head[-1].bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 100.0]))  # in place: the version changes
    assert torch.equal(m.predict_tensor(maps), torch.full((40,), 4)) and not torch.equal(before, torch.full((40,), 4))
    odd = PatternClassifier(size=36, class_weighting="none").eval()  # 36 -> 18 -> 9 -> 4: odd sizes floored
    x = odd.preprocess_tensor(maps)  # (40, 1, 36, 36)
    with torch.no_grad():
        torch.testing.assert_close(odd.inference_net()(x), odd.net(x), rtol=1e-5, atol=1e-5)
