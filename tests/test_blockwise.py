"""Attention in blocks of query rows (probes.model.blockwise) and its reducers (probes.maps.reducers): equal to a
plain eager forward, for every family of probes.model.tiny, at block sizes 1, 7 and T; the engine's choice of
blocks by budget; interventions in blocks; refusals of what cannot fit; the real SmolLM2 and Gemma 3 at 2,000
pieces.

References are built here from the raw text (:func:`tests.reference.text_pieces`: the model's own tokenizer on the
joined words), a separately loaded ``attn_implementation="eager"`` model run with ``output_attentions=True`` one
sentence at a time, word maps pooled by explicit loops (:func:`tests.reference.pool_by_loops`) and the head
statistics written out row by row (:func:`stats_by_loops`); nothing from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

import probes
from probes.maps import MapEngine
from probes.maps.engine import MapMemoryError
from probes.maps.reducers import HeadStats, Pool, Several, given_units, span_units
from probes.measures import build
from probes.measures.attention import Attention
from probes.model import hooks
from probes.model.fetched import converted_path
from probes.model.inputs import Encoded, encode_words, pad_encoded
from probes.model.tiny import ALL_FAMILIES, DECODER_WINDOW, MODERNBERT_LOCAL_ATTENTION, tiny_folder
from tests.conftest import require_model, require_shared
from tests.reference import pool_by_loops, text_pieces, word_groups

# a sentence longer than every sliding window of the tiny models (4 tokens; ModernBERT 8), with split words and
# punctuation, and a short one: one padded batch
SENTS = [["The", "unbelievably", "quick", "fox", ",", "John", "'s", "wheel-chair", "and", "a", "cat", "jumped",
          "over", "the", "lazy", "dog", "while", "everyone", "watched", "it", "happen", "."],
         ["Dogs", "bark", ",", "cats", "meow", "."]]
PUNCT = {",", "."}
BINS = 18
ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-blockwise")
    return {f: tiny_folder(f, root=root) for f in ALL_FAMILIES}


@pytest.fixture(scope="module")
def loaded(folders):
    """family -> (encoder on the project's path, eager model, tokenizer), each loaded once."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            d = str(folders[family])
            cache[family] = (probes.load_encoder(d), AutoModel.from_pretrained(d, attn_implementation="eager").eval(),
                             AutoTokenizer.from_pretrained(d))
        return cache[family]

    return get


# ----------------------------------------------------------------------------- references
def stats_by_loops(att: np.ndarray, sep: list[bool], punct: list[bool], s: float = 1e-4, bins: int = BINS) -> dict:
    """Per-head statistics of one sequence's piece attention ``att`` (L, H, n, n), row by row: Clark et al.'s
    (prev / self / next: the attention to i - 1, i, i + 1 summed over rows / n; cls: to position 0; sep: to the
    separators; sep_sep / rest_sep: that from the separator rows / the others; punct: to punctuation; entropy: of
    the row smoothed as (1 - s) a + s / n; cls_entropy: that of row 0), the mean distance sum_j a_ij |i - j| and
    its histogram (bin 0: d = 0, bin k: 2^(k-1) <= d < 2^k, the last bin open)."""
    L, H, n, _ = att.shape
    out = {k: np.zeros((L, H)) for k in ("prev", "self", "next", "cls", "sep", "sep_sep", "rest_sep", "punct",
                                          "entropy", "cls_entropy", "distance")}
    hist = np.zeros((L, H, bins))
    n_sep = sum(sep)
    for i in range(n):
        row = att[:, :, i, :]  # (L, H, n)
        if i > 0:
            out["prev"] += row[..., i - 1]
        out["self"] += row[..., i]
        if i < n - 1:
            out["next"] += row[..., i + 1]
        out["cls"] += row[..., 0]
        to_sep = sum(row[..., j] for j in range(n) if sep[j]) if n_sep else np.zeros((L, H))
        out["sep"] += to_sep
        out["sep_sep" if sep[i] else "rest_sep"] += to_sep
        out["punct"] += sum((row[..., j] for j in range(n) if punct[j]), np.zeros((L, H)))
        q = (1 - s) * row + s / n
        e = -(q * np.log(q)).sum(-1)
        out["entropy"] += e
        if i == 0:
            out["cls_entropy"] = e
        for j in range(n):
            d = abs(i - j)
            out["distance"] += row[..., j] * d
            hist[..., min(d.bit_length(), bins - 1)] += row[..., j]
    for k in ("prev", "self", "next", "cls", "sep", "punct", "entropy", "distance"):
        out[k] /= n
    out["sep_sep"] = out["sep_sep"] / n_sep if n_sep else np.full((L, H), np.nan)
    out["rest_sep"] = out["rest_sep"] / (n - n_sep) if n_sep < n else np.full((L, H), np.nan)
    out["distance_hist"] = hist / n
    return out


def reference(model, tok, words: list[str]) -> dict:
    """The eager forward of one sentence as running text: ids, word of each piece, attentions (L, H, n, n) float64,
    word maps pooled by loops (L, H, R, R) and the rows R of the (W, W) layout they are (first special where the
    tokenizer adds one, the words, last special where it adds one), separator and punctuation flags, statistics."""
    ids, wids = text_pieces(tok, words)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    att = torch.stack(out.attentions)[:, 0].double().numpy()  # (L, H, n, n)
    n = len(words)
    rows = ([0] if wids[0] is None else []) + list(range(1, n + 1)) + ([n + 1] if wids[-1] is None else [])
    sep = [w is None and t > 0 for t, w in enumerate(wids)]
    punct = [w is not None and words[w] in PUNCT for w in wids]
    return dict(ids=ids, wids=wids, att=att, rows=rows, sep=sep, punct=punct,
                words=pool_by_loops(att, word_groups(wids, n)), stats=stats_by_loops(att, sep, punct))


def blockwise(enc, encoded: list[Encoded], rows: int | None, refs: list[dict], layers=None) -> list[dict]:
    """Word maps and statistics of the padded batch of ``encoded`` through the project's attention in blocks of
    ``rows`` query rows (None: one block of all T rows), reduced by Pool and HeadStats."""
    batch = pad_encoded(encoded, enc.tokenizer.pad_token_id or 0)
    T = batch["input_ids"].shape[1]
    layers = list(range(enc.num_layers)) if layers is None else layers
    reducer = Several(words=Pool(), stats=HeadStats(sep=lambda k, e: refs[k]["sep"],
                                                    punct=lambda k, e: refs[k]["punct"], bins=BINS))
    reducer.start(layers, enc.num_heads, range(len(encoded)), encoded, T, torch.device("cpu"))
    with torch.no_grad():
        Attention().reduce(enc.model, batch["input_ids"], batch["attention_mask"], layers, reducer,
                           rows_per_block=T if rows is None else rows)
    return reducer.results()


def check_against(got: dict, ref: dict, what: str) -> None:
    w = got["words"].double().numpy()[:, :, ref["rows"]][:, :, :, ref["rows"]]
    np.testing.assert_allclose(w, ref["words"], atol=ATOL, rtol=0, err_msg=f"{what}: word maps")
    for k, v in ref["stats"].items():
        np.testing.assert_allclose(got["stats"][k].numpy(), v, atol=ATOL, rtol=1e-6, err_msg=f"{what}: {k}")


# ----------------------------------------------------------------------------- every family, blocks of 1, 7, T
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_blocks_equal_an_eager_forward(loaded, family):
    enc, eager, tok = loaded(family)
    refs = [reference(eager, tok, words) for words in SENTS]
    encoded = encode_words(enc.tokenizer, SENTS)
    for e, ref in zip(encoded, refs):
        assert e.input_ids == ref["ids"]  # the reference reads the same pieces
    T = max(e.n_pieces for e in encoded)
    assert T > max(DECODER_WINDOW, MODERNBERT_LOCAL_ATTENTION) + 4  # the sliding windows cut
    for rows in (1, 7, None):
        for got, ref, words in zip(blockwise(enc, encoded, rows, refs), refs, SENTS):
            check_against(got, ref, f"{family}, blocks of {rows or T} rows, {' '.join(words)[:30]}")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_layer_outputs_in_blocks_equal_the_full_computation(loaded, family):
    enc, eager, tok = loaded(family)
    encoded = encode_words(enc.tokenizer, SENTS)
    batch = pad_encoded(encoded, enc.tokenizer.pad_token_id or 0)
    refs = [eager(input_ids=torch.tensor([e.input_ids])).last_hidden_state[0] for e in encoded]
    for rows in (1, 7):
        with torch.no_grad(), hooks.attention(enc.model, layers=[], rows_per_block=rows) as s:
            out = s.run(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        for j, (e, ref) in enumerate(zip(encoded, refs)):
            torch.testing.assert_close(out[j, :e.n_pieces], ref, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{family}, blocks of {rows}: {m}")


class Spans:
    """A reducer that records the key span of every block."""

    def __init__(self):
        self.cols: list[tuple[int, int, tuple[int, int]]] = []

    def update(self, layer, probs, rows, cols):
        assert probs.shape[-2:] == (rows[1] - rows[0], cols[1] - cols[0])
        self.cols.append((layer, rows[0], cols))


@pytest.mark.parametrize("family", ["gemma2", "mistral", "llama", "modernbert", "bert"])
def test_blocks_leave_out_the_keys_no_row_sees(loaded, family):
    """Causal blocks stop at their last row, sliding windows start at the window; bidirectional full attention
    keeps every key."""
    enc, _, _ = loaded(family)
    (e,) = encode_words(enc.tokenizer, SENTS[:1])
    T = e.n_pieces
    spans = Spans()
    with torch.no_grad(), hooks.attention(enc.model, reduce=spans, rows_per_block=4) as s:
        s.run(input_ids=torch.tensor([e.input_ids]), attention_mask=torch.ones(1, T, dtype=torch.long))
    last = [(a, c) for l, a, c in spans.cols if a + 4 < T]
    if family in ("gemma2", "mistral"):  # layer 0 of both slides (window 4)
        assert any(lo > 0 and hi == a + 4 for a, (lo, hi) in last)
    if enc.causal:
        assert all(hi == a + 4 for a, (lo, hi) in last)
    elif family == "bert":
        assert all(c == (0, T) for _, _, c in spans.cols)
    else:  # modernbert: its local layer sees 4 tokens each side
        assert any(c != (0, T) for _, _, c in spans.cols)


# ----------------------------------------------------------------------------- interventions in blocks
@pytest.mark.parametrize("family", ["bert", "gemma2", "deberta-v2", "mpnet"])
def test_interventions_in_blocks_equal_whole_maps(loaded, family):
    enc, _, _ = loaded(family)
    encoded = encode_words(enc.tokenizer, SENTS)
    batch = pad_encoded(encoded, enc.tokenizer.pad_token_id or 0)
    B, T = batch["input_ids"].shape
    zero = torch.zeros(B, T, dtype=torch.bool)
    zero[:, 3] = True
    gates = torch.rand(enc.num_layers, enc.num_heads, generator=torch.Generator().manual_seed(0))
    kw = dict(uniform={0: [1], 1: [0, 2]}, gates=gates, zero_values={1: zero}, values=True)
    with torch.no_grad():
        with hooks.attention(enc.model, layers=[], **kw) as s:
            whole = s.run(**batch).last_hidden_state
            whole_out = dict(s.output)
        with hooks.attention(enc.model, layers=[], rows_per_block=5, **kw) as s:
            blocks = s.run(**batch).last_hidden_state
            block_out = dict(s.output)
    for j, e in enumerate(encoded):
        n = e.n_pieces
        torch.testing.assert_close(blocks[j, :n], whole[j, :n], atol=ATOL, rtol=0)
        for l in whole_out:
            torch.testing.assert_close(block_out[l][j, :n], whole_out[l][j, :n], atol=ATOL, rtol=0)


def test_blocks_refuse_what_needs_whole_maps(loaded):
    enc, _, _ = loaded("bert")
    with pytest.raises(ValueError, match="retain_grad needs the whole maps"):
        with hooks.attention(enc.model, retain_grad=True, rows_per_block=4):
            pass
    with pytest.raises(ValueError, match="give a reducer"):
        with hooks.attention(enc.model, layers=[0], rows_per_block=4):
            pass


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("family", ["bert", "llama", "gemma3"])
def test_engine_computes_long_batches_in_blocks(loaded, family):
    """Above ``attention_budget_mb`` the engine's word maps (its own batches and the cache stage's dense batches)
    are computed in blocks and equal the whole-map path's; below it the whole-map path is taken."""
    enc, eager, tok = loaded(family)
    encoded = encode_words(enc.tokenizer, SENTS)
    T = max(e.n_pieces for e in encoded)
    whole = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer)
    small = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, attention_budget_mb=0.02)
    assert whole.rows_per_block(2, T) is None
    rows = small.rows_per_block(2, T)
    assert rows is not None and 1 <= rows < T
    want = dict(whole.iter_word_maps(encoded, progress=False))
    got = dict(small.iter_word_maps(encoded, progress=False))
    for k, (words, e) in enumerate(zip(SENTS, encoded)):
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)
        ref = reference(eager, tok, words)
        w = got[k].double().numpy()[:, :, ref["rows"]][:, :, :, ref["rows"]]
        np.testing.assert_allclose(w, ref["words"], atol=ATOL, rtol=0)
    batch = whole.batch(encoded, [0, 1])  # the cache stage's batches: dense pooling matrices
    torch.testing.assert_close(small.word_maps(batch, torch.float32), whole.word_maps(batch, torch.float32),
                               atol=1e-6, rtol=0)


def test_coarser_units_equal_loops(loaded):
    """Spans of N pieces and units given per piece (sentences of a text), rows the mean, columns the sum."""
    enc, eager, tok = loaded("llama")
    words = SENTS[0] + SENTS[1]
    ref = reference(eager, tok, words)
    (e,) = encode_words(enc.tokenizer, [words])
    n = e.n_pieces
    sentence = [0 if w is None or w < len(SENTS[0]) else 1 for w in ref["wids"]]  # the BOS: the first sentence
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, attention_budget_mb=0.01)
    red = Several(spans=Pool(span_units(5)), sentences=Pool(given_units([sentence])))
    (got,) = [r for _, r in engine.iter_reduced([e], red, progress=False)]
    spans = [list(range(a, min(a + 5, n))) for a in range(0, n, 5)]
    np.testing.assert_allclose(got["spans"].double().numpy(), pool_by_loops(ref["att"], spans), atol=ATOL)
    groups = [[t for t in range(n) if sentence[t] == u] for u in (0, 1)]
    np.testing.assert_allclose(got["sentences"].double().numpy(), pool_by_loops(ref["att"], groups), atol=ATOL)


def test_whole_map_kinds_are_refused_beyond_the_budget(loaded):
    enc, _, _ = loaded("bert")
    encoded = encode_words(enc.tokenizer, SENTS)
    rollout = build("rollout", {"rollout": {"_target_": "probes.measures.rollout.Rollout"}})
    engine = MapEngine(enc.model, rollout, tokenizer=enc.tokenizer, attention_budget_mb=0.001, kind="rollout")
    with pytest.raises(MapMemoryError, match=r"rollout maps of a batch of 2 x \d+ pieces need .*"
                                             r"attention_budget_mb=0.001.*cannot be computed in blocks"):
        engine.iter_word_maps(encoded, progress=False)  # refused before the first forward
    with pytest.raises(ValueError, match="rollout maps cannot be reduced"):
        engine.iter_reduced(encoded, Pool(), progress=False)


def test_output_that_cannot_fit_is_refused_before_any_forward(loaded):
    """Word maps of every layer of a 100,000-word text: refused with the sizes and what to change."""
    enc, _, _ = loaded("bert")
    n = 100_000
    text = Encoded([enc.tokenizer.cls_token_id] + [1000] * n + [enc.tokenizer.sep_token_id],
                   [-1] + list(range(n)) + [n], n)
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer)
    with pytest.raises(MapMemoryError, match=r"1 sequence\(s\) of up to 100002 pieces, 2 layers x 4 heads, need "
                                             r"[\d,.]+ GiB.*fewer layers, a coarser unit"):
        engine.iter_word_maps([text], progress=False)
    with pytest.raises(MapMemoryError, match="coarser unit"):
        engine.iter_reduced([text], Pool(), progress=False)


class OutOfMemory(Pool):
    """A pool that runs out of device memory at its third block."""

    def update(self, layer, probs, rows, cols):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        super().update(layer, probs, rows, cols)


def test_running_out_of_memory_midway_says_what_to_set(loaded):
    enc, _, _ = loaded("bert")
    encoded = encode_words(enc.tokenizer, SENTS)
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, attention_budget_mb=0.01)
    with pytest.raises(MapMemoryError, match=r"out of memory computing .* maps of a batch of 2 x \d+ pieces .*blocks "
                                             r"of \d+ query rows.*set extract.attention_budget_mb lower"):
        list(engine.iter_reduced(encoded, OutOfMemory(), progress=False))


# ----------------------------------------------------------------------------- real models, 2,000 pieces
def document_words(tok, pieces: int) -> list[str]:
    """The words of the first whole sentences of UD EWT dev (FORM of the word lines, read by a loop) that the
    model's tokenizer reads, joined, as at most ``pieces`` pieces."""
    path = require_shared() / "en_ewt-ud-dev.conllu"
    words, sentence = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            if len(tok(" ".join(words + sentence))["input_ids"]) > pieces:
                break
            words, sentence = words + sentence, []
        elif not line.startswith("#"):
            cols = line.split("\t")
            if cols[0].isdigit():
                sentence.append(cols[1])
    return words


def pool_contiguous(att: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """(L, H, R, R) of piece maps (L, H, n, n) float64 pooled over contiguous groups with numpy: columns summed,
    rows averaged (:func:`tests.reference.pool_by_loops`, vectorised over the pieces: differences of cumulative
    sums at the groups' ends)."""
    ends = np.array([g[-1] + 1 for g in groups])
    assert all(g == list(range(g[0], g[-1] + 1)) for g in groups) and ends[-1] == att.shape[-1]

    def sums(x: np.ndarray, axis: int) -> np.ndarray:
        c = np.take(np.cumsum(x, axis=axis), ends - 1, axis=axis)
        return np.diff(c, axis=axis, prepend=0)

    pooled = sums(sums(att, -1), -2)  # (L, H, R, R)
    return pooled / np.array([len(g) for g in groups])[:, None]


def stats_numpy(att: np.ndarray, sep: list[bool], punct: list[bool], s: float = 1e-4, bins: int = BINS) -> dict:
    """:func:`stats_by_loops` vectorised with numpy over the rows (for 2,000 pieces)."""
    L, H, n, _ = att.shape
    sep, punct = np.array(sep), np.array(punct)
    to_sep = att[..., sep].sum(-1)  # (L, H, n)
    q = (1 - s) * att + s / n
    ent = -(q * np.log(q)).sum(-1)  # (L, H, n)
    d = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    k = np.minimum(np.where(d > 0, np.floor(np.log2(np.maximum(d, 1))).astype(int) + 1, 0), bins - 1).ravel()
    hist = np.array([[np.bincount(k, weights=att[l, h].ravel(), minlength=bins) for h in range(H)]
                     for l in range(L)]) / n  # (L, H, K)
    nan = np.full((L, H), np.nan)
    return dict(prev=np.diagonal(att, -1, -2, -1).sum(-1) / n, self=np.diagonal(att, 0, -2, -1).sum(-1) / n,
                next=np.diagonal(att, 1, -2, -1).sum(-1) / n, cls=att[..., 0].mean(-1), sep=to_sep.mean(-1),
                sep_sep=to_sep[..., sep].mean(-1) if sep.any() else nan,
                rest_sep=to_sep[..., ~sep].mean(-1) if (~sep).any() else nan,
                punct=att[..., punct].sum(-1).mean(-1), entropy=ent.mean(-1), cls_entropy=ent[..., 0],
                distance=(att * d).sum(-1).mean(-1), distance_hist=hist)


@pytest.mark.slow
@pytest.mark.parametrize("name, layers", [("smollm2", [0, 2]),
                                          pytest.param("gemma3_270m", [0, 4, 5], marks=pytest.mark.big_model)])
def test_real_models_at_2000_pieces(name, layers):
    """Word maps and statistics of a 2,000-piece text in blocks equal a plain eager forward of the model's first
    layers (a truncated copy: the layers below are the same computation), pooled with numpy. Gemma 3's layers 0-4
    slide (512 tokens), layer 5 is global."""
    from tests.test_real_models import load, models_dir
    path = require_model(name)
    enc = load(name)
    # the reference reads the converted folder of a .gguf model (float32 as transformers' GGUF reader dequantizes
    # it, bit-identical to the file: tests/test_fetch_model.py): seconds instead of a minute
    src = str(converted_path(name, models_dir())[0]) if path.suffix == ".gguf" else str(path)
    kwargs = {}
    tok = AutoTokenizer.from_pretrained(src)
    words = document_words(tok, 2000)
    ids, wids = text_pieces(tok, words)
    n = len(ids)
    assert 1900 < n <= 2000
    config = AutoConfig.from_pretrained(src, **kwargs)
    config.num_hidden_layers = max(layers) + 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    eager = AutoModel.from_pretrained(src, config=config, attn_implementation="eager", dtype=torch.float32,
                                      **kwargs).eval()
    with torch.no_grad():
        att = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    att = torch.stack([att[l] for l in layers])[:, 0].double().numpy()  # (L', H, n, n)
    del eager
    sep = [False] * n
    punct = [w is not None and words[w] in PUNCT for w in wids]
    (e,) = encode_words(enc.tokenizer, [words])
    assert e.input_ids == ids
    reducer = Several(words=Pool(), stats=HeadStats(sep=lambda k, x: sep, punct=lambda k, x: punct, bins=BINS))
    engine = MapEngine(enc.model, Attention(), layers, tokenizer=enc.tokenizer, attention_budget_mb=64)
    assert engine.rows_per_block(1, n) < n
    ((_, got),) = list(engine.iter_reduced([e], reducer, progress=False))
    groups = word_groups(wids, len(words))
    rows = ([0] if wids[0] is None else []) + list(range(1, len(words) + 1))
    w = got["words"].double().numpy()[:, :, rows][:, :, :, rows]
    np.testing.assert_allclose(w, pool_contiguous(att, groups), atol=ATOL, rtol=0)
    for k, v in stats_numpy(att, sep, punct).items():
        np.testing.assert_allclose(got["stats"][k].numpy(), v, atol=ATOL, rtol=1e-5, err_msg=k)
    enc.release()
