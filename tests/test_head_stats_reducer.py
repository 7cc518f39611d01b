"""head_stats' and sink's statistics, reduced a batch at a time on the maps' device (:class:`probes.maps.reducers.HeadStats`
through ``MapEngine.iter_reduced_batches``), against a plain per-sentence loop written here.

The reference is independent of the code under test: the model's own tokenizer on the raw sentence (or on the two
sentences of a pair, the tokenizer's pair form), one eager forward with ``output_attentions=True`` per sentence,
every statistic by explicit Python loops over rows and keys, then the mean over sentences. Batches hold sentences
of different lengths (padding), pair input is tested on an encoder, and sentences longer than the model reads are
skipped on both sides.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import probes
from probes.analysis.beyond.sink import first_token_alpha
from probes.analysis.clark import head_stats
from probes.data.conllu import read_conllu
from probes.maps.reducers import HeadStats
from probes.model.inputs import Encoded, encode_words
from probes.model.tiny import tiny_folder
from tests import reference

MAX_POSITIONS = 40
DOCS = [["The cat sat on the mat .", "It was warm , and quiet ."],
        ["Dogs bark .", "Nobody sleeps , ever .", "A wheel rolled by , slowly , in the dark night ."],
        ["Hello there !", " ".join(["very"] * 45) + " long ."],  # the second is above MAX_POSITIONS pieces
        ["Yes .", "No , thanks ."]]


@pytest.fixture(scope="module", params=["bert", "llama"])  # an encoder; a decoder (causal, no separator alone)
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("hs-reducer")
    folder = tiny_folder(request.param, root=root, max_positions=MAX_POSITIONS)
    enc = probes.load_encoder(str(folder))
    eager = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    path = root / "dev.conllu"
    path.write_text(reference.conllu_documents(DOCS))
    return request.param, enc, eager, AutoTokenizer.from_pretrained(str(folder)), read_conllu(path)


@pytest.mark.parametrize("pairs", [False, True])
def test_head_stats_equal_a_per_sentence_loop(model, pairs):
    family, enc, eager, tok, sentences = model
    if pairs and family == "llama":
        pytest.skip("a decoder has no pair form of its own tokenizer to build the reference from")
    # batches of up to 3 sequences of different lengths: padding in every batch
    acc, n_sentences, counts, (first, any_sep) = head_stats._compute(enc, sentences, "cpu", pairs, max_tokens=4096,
                                                                     max_batch_size=3)
    ref = reference.reference_inputs(tok, sentences, pairs)
    read = [r for r in ref if len(r[0]["input_ids"]) <= enc.max_length]
    assert len(read) < len(ref)  # the long sentence is skipped on both sides
    assert counts.n_sequences == len(read) and counts.n_skipped == len(ref) - len(read)
    want = {}
    for ids, pieces, special in read:
        for k, v in reference.head_stats_by_loops(reference.eager_maps(eager, ids), pieces, special).items():
            want[k] = want.get(k, 0) + v / len(read)
    got = acc.result()
    assert any_sep == (family == "bert")
    for k in head_stats.HEAD_STATS:
        if not any_sep and k in ("sep", "sep_sep", "rest_sep"):
            assert np.isnan(got[k]).all() if k == "sep_sep" else True
            continue
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    lengths = [len(r[0]["input_ids"]) for r in read]
    uniform = [float(np.mean(np.log(np.arange(1, T + 1)))) if family == "llama" else math.log(T) for T in lengths]
    assert acc.uniform_entropy == pytest.approx(float(np.mean(uniform)))


def test_sink_alpha_equals_a_per_sentence_loop(model):
    """first_token_alpha: each input's mean over rows of the attention to position 0, batched with padding."""
    family, enc, eager, tok, sentences = model
    fits = [s for s in sentences if len(tok(" ".join(s.words))["input_ids"]) <= enc.max_length]
    encoded = encode_words(enc.tokenizer, [list(s.words) for s in fits])
    alpha = first_token_alpha(enc, encoded, "cpu", max_batch_size=3, max_tokens=64)  # (N, L, H)
    for n, s in enumerate(fits):
        att = reference.eager_maps(eager, {"input_ids": tok(" ".join(s.words))["input_ids"]})
        T = att.shape[-1]
        want = np.array([[sum(att[l, h, i, 0] for i in range(T)) / T for h in range(att.shape[1])]
                         for l in range(att.shape[0])])
        np.testing.assert_allclose(alpha[n], want, rtol=1e-5, atol=1e-7)


def test_reducer_reads_no_padding_row():
    """Padding rows of a batch, even non-finite ones, never reach a sum: the batched statistics equal each item
    reduced alone, whole or in blocks of rows, and a subset of statistics equals the same entries of all."""

    g = torch.Generator().manual_seed(0)
    ns, H = [7, 3, 1, 9], 2
    T = max(ns)
    probs = torch.zeros(len(ns), H, T, T)
    for i, n in enumerate(ns):
        probs[i, :, :n, :n] = torch.softmax(torch.randn(H, n, n, generator=g), -1)
        probs[i, :, n:] = float("nan")  # padding rows
    items = [Encoded(list(range(n)), list(range(n)), n) for n in ns]
    flags = [[j % 3 == 1 for j in range(n)] for n in ns]

    def run(reducer, p, which, rows):
        reducer.start([0], H, which, [items[k] for k in which], p.shape[-1], torch.device("cpu"))
        for a in range(0, p.shape[-1], rows):
            reducer.update(0, p[:, :, a:a + rows], (a, min(p.shape[-1], a + rows)), (0, p.shape[-1]))
        return reducer.batch_results()

    def make(**kw):
        return HeadStats(sep=lambda k, e: flags[k], punct=lambda k, e: flags[k][::-1], **kw)

    for rows in (T, 4, 1):
        batch = run(make(), probs, list(range(len(ns))), rows)
        assert all(torch.isfinite(v).all() for k, v in batch.items() if k not in ("sep_sep", "rest_sep"))
        for i, n in enumerate(ns):
            alone = run(make(), probs[i:i + 1, :, :n, :n], [i], n)
            for k, v in alone.items():
                torch.testing.assert_close(batch[k][i], v[0], rtol=1e-6, atol=1e-9, equal_nan=True)
        part = run(make(stats=("cls", "entropy")), probs, list(range(len(ns))), rows)
        assert set(part) == {"cls", "entropy"}
        for k in part:
            torch.testing.assert_close(part[k], batch[k])
    with pytest.raises(ValueError, match="stats=\\['clss'\\]"):
        HeadStats(stats=("clss",))


@pytest.mark.parametrize("chunk", [None, 1])
def test_windowed_blocks_of_rows_and_keys_equal_loops(monkeypatch, chunk):
    """A sliding window's maps (row r attends to keys r - 3 .. r), reduced in blocks of rows over only the keys they
    see (so a block's keys start after position 0, as the engine hands a sliding-window layer's blocks), whole or in
    chunks of one row, with padding rows holding NaN: every statistic equals the plain loops on each item's map, and
    ``cls`` alone equals the same."""

    if chunk is not None:
        monkeypatch.setattr(HeadStats, "CPU_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(1)
    ns, H, window, rows = [9, 5, 12], 3, 4, 3
    T = max(ns)
    probs = torch.full((len(ns), H, T, T), float("nan"))  # (B, H, T, T) padding rows NaN
    pieces, special = [], []
    for i, n in enumerate(ns):
        probs[i, :, :n] = 0.0
        for r in range(n):
            lo = max(0, r - window + 1)
            probs[i, :, r, lo:r + 1] = torch.softmax(torch.randn(H, r + 1 - lo, generator=g), -1)
        pieces.append([{2: ".", 3: ","}.get(j % 4, f"w{j}") for j in range(n)])
        special.append([j in (0, n // 2, n - 1) for j in range(n)])  # first, a separator in the middle, last
    sep = [[s and j > 0 for j, s in enumerate(sp)] for sp in special]
    punct = [[p in (".", ",") and not s and 0 < j < len(p_) - 1 for j, (p, s) in enumerate(zip(p_, sp))]
             for p_, sp in zip(pieces, special)]
    items = [Encoded(list(range(n)), list(range(n)), n) for n in ns]

    def run(reducer):
        reducer.start([0], H, list(range(len(ns))), items, T, torch.device("cpu"))
        for a in range(0, T, rows):
            b = min(T, a + rows)
            lo = max(0, a - window + 1)  # the first key any of these rows sees
            reducer.update(0, probs[:, :, a:b, lo:b], (a, b), (lo, b))
        return reducer.batch_results()

    # head_stats' statistics (prev / self / next from the block's diagonals), all of them (from the attention by
    # offset, with the distance), cls alone
    got = [run(HeadStats(sep=lambda k, e: sep[k], punct=lambda k, e: punct[k], stats=stats))
           for stats in (head_stats.HEAD_STATS, None)]
    cls = run(HeadStats(stats=("cls",)))["cls"]
    for i, n in enumerate(ns):
        want = reference.head_stats_by_loops(probs[i:i + 1, :, :n, :n].double().numpy(), pieces[i], special[i])
        for k in head_stats.HEAD_STATS:
            for g_ in got:
                np.testing.assert_allclose(g_[k][i].numpy(), want[k], rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(cls[i].numpy(), want["cls"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("which", ["sep", "punct"])
def test_flags_of_the_wrong_length_are_refused(which):
    """A separator or punctuation callback that gives one flag too few is refused at the batch's start, naming the
    item (not broadcast, not padded); flags given as lists of 0/1 or as tensors are read alike."""
    items = [Encoded(list(range(n)), list(range(n)), n) for n in (4, 6)]
    good = {0: [0, 1, 0, 1], 1: torch.tensor([False, False, True, False, False, True])}
    flags = {k: (v[:-1] if k == 1 else v) for k, v in good.items()}  # item 1: one flag short
    kw = {which: lambda k, e: flags[k]}
    with pytest.raises(ValueError, match="item 1: .*one entry per piece \\(6\\)"):
        HeadStats(**kw).start([0], 2, [0, 1], items, 6, torch.device("cpu"))
    reducer = HeadStats(sep=lambda k, e: good[k], punct=lambda k, e: good[k])
    sep, punct = reducer._flags([0, 1], items, 7)  # (2, 7) each, padding False
    want = torch.tensor([[0, 1, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(sep, want) and torch.equal(punct, want)
    sep, punct = HeadStats()._flags([0, 1], items, 7)  # no callbacks: the last piece separates, no punctuation
    assert torch.equal(sep, torch.tensor([[0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool))
    assert not punct.any()
