"""clustering's distances between heads, reduced a batch at a time on the maps' device
(:class:`probes.maps.reducers.HeadDistances` through :func:`probes.analysis.clark.clustering.head_distances`), against
a plain per-sentence loop written here.

The reference is independent of the code under test: the model's own tokenizer on the raw sentence (or on the two
sentences of a pair, the tokenizer's pair form), one eager forward with ``output_attentions=True`` per sentence, the
smoothing ``(1 - s) a + s / T`` and the Jensen-Shannon divergence of every pair of heads' rows by plain numpy on that
one map, then the sum over sentences. Batches hold sentences of different lengths (padding), pair input is tested on
an encoder, and sentences longer than the model reads are skipped on both sides. On the packaged MiniLM and 64 UD
EWT sentences, clustering's tables equal the per-sentence computation it replaced.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer

import probes
from probes.analysis.clark import clustering
from probes.analysis.clark.head_stats import encode_inputs, separator_positions
from probes.analysis.clark.metrics import HeadStatsAccumulator, PunctFlags, smooth
from probes.data.conllu import read_conllu
from probes.maps import HeadDistances, MapEngine
from probes.maps.reducers import log_into
from probes.measures import Measure
from probes.measures.attention import Attention
from probes.model.inputs import Encoded
from probes.model.tiny import tiny_folder
from probes.stats import LN2, js_divergence_matrix
from tests import reference
from tests.conftest import require_shared

MAX_POSITIONS = 40
SMOOTHING = 1e-3
FLOAT32_NATS_PER_ROW = 2e-7  # the float32 rounding of one row's JS divergence (see the per-sentence test)
SHARPEN = 8.0  # the tiny models' query projections scaled by this (sharper attention; see sharpened)
DOCS = [["The cat sat on the mat .", "It was warm , and quiet ."],
        ["Dogs bark .", "Nobody sleeps , ever .", "A wheel rolled by , slowly , in the dark night ."],
        ["Hello there !", " ".join(["very"] * 45) + " long ."],  # the second is above MAX_POSITIONS pieces
        ["Yes .", "No , thanks ."]]
STATS = ("prev", "self", "next", "cls", "sep", "punct", "entropy")  # the statistics clustering reports


def sharpened(folder: Path, into: Path) -> Path:
    """A copy of a tiny model's folder whose query projections are :data:`SHARPEN` times larger: a random tiny model
    attends almost uniformly (JS distances near 0, all rounding); this one's heads differ."""
    shutil.copytree(folder, into)
    weights = load_file(into / "model.safetensors")
    for k, v in weights.items():
        if k.rsplit(".", 2)[-2] in ("query", "q_proj"):
            weights[k] = v * SHARPEN
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


@pytest.fixture(scope="module", params=["bert", "llama"])  # an encoder; a decoder (causal)
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("js-reducer")
    folder = sharpened(tiny_folder(request.param, root=root, max_positions=MAX_POSITIONS), root / "sharp")
    enc = probes.load_encoder(str(folder))
    eager = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    path = root / "dev.conllu"
    path.write_text(reference.conllu_documents(DOCS))
    return request.param, enc, eager, AutoTokenizer.from_pretrained(str(folder)), read_conllu(path)


def loop_js(att: np.ndarray, s: float = SMOOTHING) -> np.ndarray:
    """(K, K) nats: for every pair of heads, the JS divergence of their smoothed rows summed over the rows of one
    (L, H, T, T) map, pair by pair (0 log 0 = 0)."""
    L, H, T, _ = att.shape
    p = (1 - s) * att.reshape(L * H, T, T) + s / T  # (K, T, T)
    out = np.zeros((L * H, L * H))
    for a in range(L * H):
        for b in range(L * H):
            m = (p[a] + p[b]) / 2  # (T, T)
            kl_a = np.where(p[a] > 0, p[a] * np.log(np.where(p[a] > 0, p[a], 1) / np.where(p[a] > 0, m, 1)), 0.0)
            kl_b = np.where(p[b] > 0, p[b] * np.log(np.where(p[b] > 0, p[b], 1) / np.where(p[b] > 0, m, 1)), 0.0)
            out[a, b] = 0.5 * kl_a.sum() + 0.5 * kl_b.sum()
    return out


class PieceAttention(Measure):
    """Attention as a kind without ``reduce``: clustering's piece-map path (rows normalised) on maps whose rows
    already sum to 1, so the same reference applies."""

    per_head = True

    def layer_maps(self, model, input_ids, attention_mask, layers, token_type_ids=None):
        return Attention().layer_maps(model, input_ids, attention_mask, layers, token_type_ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("path", ["reduced", "piece maps"])
@pytest.mark.parametrize("pair_blocks", [False, True])  # a CPU's loop over heads a; a GPU's blocks of pairs
def test_distances_equal_a_per_sentence_loop(model, pairs, path, dtype, pair_blocks, monkeypatch):
    """head_distances (attention reduced by the engine, or a kind's piece maps) equals the eager per-sentence
    loop: the distances, the statistics clustering reports, the sequences read and their pieces; either way of
    reducing the pairs of heads."""
    monkeypatch.setattr(HeadDistances, "_by_pair_blocks", lambda self, device: pair_blocks)
    family, enc, eager, tok, sentences = model
    if pairs and family == "llama":
        pytest.skip("a decoder has no pair form of its own tokenizer to build the reference from")
    encoded, _ = encode_inputs(enc.tokenizer, sentences, pairs)
    # batches of up to 3 sequences of different lengths: padding in every batch
    totals = clustering.head_distances(enc, encoded, PieceAttention() if path == "piece maps" else None, "cpu",
                                       SMOOTHING, max_tokens=4096, max_batch_size=3, dtype=dtype)
    ref = reference.reference_inputs(tok, sentences, pairs)
    read = [r for r in ref if len(r[0]["input_ids"]) <= enc.max_length]
    assert len(read) < len(ref)  # the long sentence is skipped on both sides
    assert sorted(encoded[k].input_ids for k in totals.read) == sorted(r[0]["input_ids"] for r in read)
    assert totals.n_tokens == sum(len(r[0]["input_ids"]) for r in read)
    want_js, want_stats = 0.0, {}
    for ids, pieces, special in read:
        att = reference.eager_maps(eager, ids)
        want_js = want_js + loop_js(att)
        loops = reference.head_stats_by_loops(att, pieces, special)
        for k in STATS:
            want_stats[k] = want_stats.get(k, 0) + loops[k] / len(read)
    got = totals.js.cpu().numpy()
    assert got.shape == want_js.shape and got.dtype == np.float64
    # float64: the float32 maps' own differences (engine and eager forward); float32 arithmetic: each row's JS is a
    # difference of sums of about log T nats, each rounded to float32 (about 2e-7 nats per row)
    atol = 1e-8 if dtype == torch.float64 else FLOAT32_NATS_PER_ROW * totals.n_tokens
    np.testing.assert_allclose(got, want_js, rtol=1e-6, atol=atol)
    np.testing.assert_array_equal(got, got.T)
    assert (np.diag(got) == 0).all()
    stats = totals.stats.result()
    for k in STATS:
        if k == "sep" and family == "llama":
            continue  # a decoder's single sentence holds no separator
        np.testing.assert_allclose(stats[k], want_stats[k], rtol=1e-5, atol=1e-6, err_msg=k)


class Recording(HeadDistances):
    """HeadDistances (float64) that records the rows of every block it is given."""

    def __init__(self):
        super().__init__(SMOOTHING, dtype=torch.float64)
        self.blocks = []

    def update(self, layer, probs, rows, cols):
        self.blocks.append(rows)
        super().update(layer, probs, rows, cols)


def test_blocks_of_rows_equal_whole_maps(model):
    """Batches above the attention budget, computed in blocks of query rows, give the whole maps' distances."""
    family, enc, eager, tok, sentences = model
    encoded, _ = encode_inputs(enc.tokenizer, sentences, False)
    items = [e for e in encoded if e.n_pieces <= enc.max_length]
    out = []
    for budget in (1024, 1e-3):  # MiB: whole maps; a few rows per block
        engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, device="cpu", max_batch_size=4,
                           max_pairs=None, attention_budget_mb=budget)
        reducer = Recording()
        out.append(torch.cat([r for _, r in engine.iter_reduced_batches(items, reducer, progress=False)]))
        assert all(a == 0 for a, b in reducer.blocks) == (budget == 1024)  # blocks of rows only below the budget
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("pair_blocks", [False, True])  # a CPU's loop over heads a; a GPU's blocks of pairs
@pytest.mark.parametrize("smoothing", [SMOOTHING, 0.0])
def test_padding_never_leaks(smoothing, pair_blocks):
    """Padded rows and keys, even non-finite ones, never reach a sum: a batch given whole, in blocks of rows, in
    blocks of rows and keys (a causal layer: the keys after a block's last row hold 0 and are not handed over), in
    small chunks, equals each item alone."""
    g = torch.Generator().manual_seed(0)
    ns, L, H = [7, 3, 1, 9], 2, 3
    B, T = len(ns), max(ns)
    maps = torch.full((L, B, H, T, T), float("nan"))  # (L', B, H, T, T) padding: NaN
    later = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T) keys after the row
    for i, n in enumerate(ns):
        scores = 3 * torch.randn(L, H, n, n, generator=g)  # (L', H, n, n)
        scores[1] = scores[1].masked_fill(later[:n, :n], float("-inf"))  # layer 1 causal
        maps[:, i, :, :n, :n] = torch.softmax(scores, -1)
        maps[1, i, :, :n, n:] = 0.0  # a causal row's later keys, padding included
    maps[0, 0, 0, :7, :7] = torch.eye(7)  # one-hot rows: exact zeros
    items = [Encoded(list(range(n)), list(range(n)), n) for n in ns]
    want = [loop_js(maps[:, i, :, :n, :n].double().numpy(), smoothing) for i, n in enumerate(ns)]

    def run(rows: int, key_blocks: bool, chunk: int | None) -> torch.Tensor:
        r = HeadDistances(smoothing, chunk_elements=chunk, pair_blocks=pair_blocks)
        r.start([0, 1], H, range(B), items, T, torch.device("cpu"))
        for l in range(L):
            for a in range(0, T, rows):
                b = min(T, a + rows)
                hi = b if key_blocks and l == 1 else T  # the causal layer's blocks: keys 0 .. b only
                r.update(l, maps[l, :, :, a:b, :hi], (a, b), (0, hi))
        return r.batch_results()

    for rows, key_blocks, chunk in ((T, False, None), (4, False, 5), (1, False, 1), (3, True, 64), (2, True, None)):
        got = run(rows, key_blocks, chunk)  # (B, K, K)
        assert got.shape == (B, L * H, L * H) and got.dtype == torch.float64 and torch.isfinite(got).all()
        for i in range(B):
            np.testing.assert_allclose(got[i].numpy(), want[i], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rows {rows}, key blocks {key_blocks}, item {i}")
        assert (got[2] == 0).all()  # one piece: every row is the same point mass


def test_nbytes_and_errors():
    items = [Encoded(list(range(n)), list(range(n)), n) for n in (5, 9)]
    r = HeadDistances()
    maps = 2 * 3 * 4 * 9 * 9 * 4  # B x L' x H x T^2 float32
    assert r.nbytes([0, 1, 2], 4, [0, 1], items) >= maps
    assert HeadDistances(dtype=torch.float64).nbytes([0, 1, 2], 4, [0, 1], items) >= 2 * maps
    # on a CPU the chunk's two temporaries are the CPU's chunk, not a GPU's (the device not given: the larger, and
    # the three of a GPU's blocks of pairs)
    big = [Encoded(list(range(n)), list(range(n)), n) for n in (300, 300)]
    cpu, any_device = (r.nbytes(list(range(6)), 12, [0, 1], big, d) for d in (torch.device("cpu"), None))
    pair_rows = 2 * (6 * 12 - 1) * 300 * 300  # every pair's rows of the batch: less than a GPU's chunk
    assert any_device - cpu == 4 * (3 * min(HeadDistances.GPU_CHUNK_ELEMENTS, pair_rows)
                                    - 2 * HeadDistances.CPU_CHUNK_ELEMENTS)
    assert HeadDistances(pair_blocks=True).nbytes(list(range(6)), 12, [0, 1], big, torch.device("cpu")) - cpu == (
        4 * HeadDistances.CPU_CHUNK_ELEMENTS)  # a CPU asked for blocks of pairs: a third temporary
    for bad in (dict(smoothing=1.0), dict(smoothing=-0.1), dict(dtype=torch.int32), dict(chunk_elements=0)):
        with pytest.raises(ValueError):
            HeadDistances(**bad)


def old_clustering_sums(enc, encoded, smoothing: float):
    """The per-sentence computation clustering replaced (up to the float64 JS here): each sequence's maps alone,
    :func:`probes.stats.js_divergence_matrix` of its smoothed rows, the statistics of
    :class:`~probes.analysis.clark.metrics.HeadStatsAccumulator`."""
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, device="cpu", max_pairs=None)
    items = [e for e in encoded if e.n_pieces <= enc.max_length]
    punct = PunctFlags(enc.tokenizer)
    L, H = enc.num_layers, enc.num_heads
    total, acc = torch.zeros(L * H, L * H, dtype=torch.float64), HeadStatsAccumulator()
    for k, attn in engine.iter_piece_maps(items, progress=False):  # attn (L, H, T, T)
        T = attn.shape[-1]
        total += js_divergence_matrix(smooth(attn.double().reshape(L * H, T, T), smoothing),
                                      dtype=torch.float64) * LN2
        acc.add(attn, punct(items[k].input_ids), separator_positions(items[k]))
    return total.numpy(), acc.result()


@pytest.mark.slow
def test_minilm_tables_equal_the_per_sentence_computation(tmp_path):
    """clustering on the packaged MiniLM, 64 UD EWT dev sentences (Clark's pairs): js_distances.csv and the
    statistics of head_embedding.csv equal the per-sentence computation within 1e-6 (relative: the sums of
    float32 maps in another order), the behaviour labels and the counts exactly."""
    dev = require_shared("ud_english_ewt/en_ewt-ud-dev.conllu", "shared EWT data")
    res = probes.analyze("clustering", treebank=probes.treebank(dev=dev), output_dir=tmp_path, figures=False,
                         max_sentences=64, mds_n_init=1, mds_max_iter=10)
    enc = probes.load_encoder("minilm")
    encoded, _ = encode_inputs(enc.tokenizer, read_conllu(dev)[:64], True)
    js, stats = old_clustering_sums(enc, encoded, SMOOTHING)
    table = pd.read_csv(tmp_path / "js_distances.csv")
    np.testing.assert_allclose(table.js.to_numpy().reshape(js.shape), js, rtol=1e-6, atol=1e-9)
    n_tokens = res.summary["n_tokens"]
    assert n_tokens == sum(e.n_pieces for e in encoded if e.n_pieces <= enc.max_length)
    np.testing.assert_allclose(table.js_per_token.to_numpy().reshape(js.shape), js / n_tokens, rtol=1e-6,
                               atol=1e-12)
    emb = pd.read_csv(tmp_path / "head_embedding.csv")
    for k in STATS:
        np.testing.assert_allclose(emb[k].to_numpy(), stats[k].reshape(-1), rtol=1e-6, atol=1e-7, err_msg=k)
    labels = clustering.classify_heads(stats, res.summary["uniform_entropy"])
    assert emb.behaviour.tolist() == labels.reshape(-1).tolist()
    assert res.summary["n_sequences"] == len(encoded) and res.summary["n_input_sentences"] == 64
    assert res.summary["n_sentences"] + res.summary["n_unpaired"] == 64  # pairs within documents; none too long


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_into_is_the_logarithm(dtype):
    """``log_into`` (numpy's log on a CPU, in place into ``out``) equals ``math.log`` of every value within a few
    units in the last place, over 1e-30 .. 1e3 (the smoothed probabilities' range and beyond), 1 exactly 0, on
    contiguous and strided tensors."""
    x = torch.logspace(-30, 3, 20_001, dtype=torch.float64).to(dtype)  # (N,)
    x[::1000] = 1.0
    eps = torch.finfo(dtype).eps
    for src, out in ((x, torch.empty_like(x)), (x[::3], torch.empty(2 * len(x[::3]), dtype=dtype)[::2])):  # strided
        assert log_into(src, out) is out
        want = torch.tensor([math.log(float(v)) for v in src], dtype=torch.float64)
        err = (out.double() - want).abs() / want.abs().clamp_min(1.0)
        assert err.max() <= 4 * eps, float(err.max())
        assert (out[src == 1.0] == 0).all()
