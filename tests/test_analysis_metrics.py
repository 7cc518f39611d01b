"""Pure attention statistics on synthetic maps (probes.analysis.clark.metrics)."""

import math

import numpy as np
import pytest
import torch

from probes.analysis.clark.clustering import classify_heads, mds_embedding
from probes.analysis.clark.dep_heads import evaluate, tables
from probes.analysis.clark.head_stats import pair_indices, separator_positions, sequence_attention, stats_table
from probes.analysis.clark.metrics import (
    DepAccumulator, HeadStatsAccumulator, evaluation_positions, is_period_comma, most_attended_rows, offset_predictions,
    piece_strings, piece_text, predict_heads, punct_positions, sentence_head_stats, smooth, smoothed_entropy,
)
from probes.model.inputs import encode_word_pairs
from probes.analysis.naming import head_name
from probes.stats import entropy, js_divergence_matrix
from probes.data.conllu import Sentence


def shift_attention(T: int, offset: int) -> torch.Tensor:
    """(T, T) one-hot rows: token i attends to i + offset (clipped into 0..T-1)."""
    a = torch.zeros(T, T)
    a[torch.arange(T), (torch.arange(T) + offset).clamp(0, T - 1)] = 1
    return a


def stack_heads(*maps: torch.Tensor, layers: int = 1) -> torch.Tensor:
    """(L, H, T, T) with the given maps as heads, repeated over layers."""
    return torch.stack(maps).unsqueeze(0).repeat(layers, 1, 1, 1)


def test_head_name_is_one_based():
    assert head_name(7, 9) == "8-10"
    assert head_name(0, 0) == "1-1"


def test_piece_text_strips_the_tokenizer_markers():
    """WordPiece ``##``, byte-level BPE ``Ġ`` (a space before the piece) and SentencePiece ``▁``."""
    assert [piece_text(t) for t in ("##.", "Ġ,", "▁,", "x", "Ġ", "<s>")] == [".", ",", ",", "x", "", "<s>"]


class _PieceTokenizer:
    """convert_ids_to_tokens / convert_tokens_to_string of a fixed piece list (byte-level style)."""

    def __init__(self, pieces, decoded):
        self.pieces, self.decoded = pieces, decoded

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(self.decoded[self.pieces.index(t)] for t in tokens)


def test_punct_positions_are_period_and_comma_only():
    """Clark's punctuation: '.' and ',' pieces (marker stripped); the specials at 0 and T - 1 never count."""
    assert is_period_comma(".") and is_period_comma("Ġ,") and is_period_comma("▁.") and is_period_comma("##,")
    assert not any(is_period_comma(t) for t in ("!", "?", ";", "--", "“", "...", "a.", "Ġ", "[SEP]"))
    tok = _PieceTokenizer([".", "Ġhi", "Ġ,", ",", "Ġ!", "Ġ."], [".", " hi", " ,", ",", " !", " ."])
    assert punct_positions(tok, [0, 1, 2, 4, 5, 3], byte_level=False) == [False, False, True, False, True, False]
    # byte-level: a piece holding a whole non-ASCII character is read as that character; partial bytes stay
    tok = _PieceTokenizer(["<s>", "ĠâĢľ", "Ġhi", "âĢ", "Ġ,", "</s>"], ["<s>", " \u201c", " hi", "\ufffd", " ,", "</s>"])
    assert piece_strings(tok, [0, 1, 2, 3, 4, 5], byte_level=True) == ["<s>", "\u201c", "hi", "âĢ", ",", "</s>"]
    assert punct_positions(tok, [0, 1, 2, 3, 4, 5], byte_level=True) == [False] * 4 + [True, False]


def test_prev_head_has_prev_statistic_one_minus_one_over_t():
    T = 7
    attn = stack_heads(shift_attention(T, -1), shift_attention(T, 1), shift_attention(T, 0),
                       torch.full((T, T), 1 / T), layers=2)
    punct = [False, False, True, False, False, True, False]
    s = sentence_head_stats(attn, punct)
    assert s["prev"].shape == (2, 4)
    # Clark's code: the diagonal's sum / T (the first token has no previous one)
    assert torch.allclose(s["prev"][:, 0], torch.full((2,), (T - 1) / T))
    assert torch.allclose(s["next"][:, 1], torch.full((2,), (T - 1) / T))
    assert torch.allclose(s["self"][:, 2], torch.ones(2))
    assert torch.allclose(s["prev"][:, 1], torch.zeros(2))
    # previous-token head: [CLS] row attends to itself (clipped) -> cls = 2/T (rows 0 and 1), sep = 0
    assert s["cls"][0, 0].item() == pytest.approx(2 / T)
    assert s["sep"][0, 0].item() == pytest.approx(0)
    # next-token head: rows T-2 and T-1 attend to [SEP]; punct columns 2 and 5 get rows 1 and 4
    assert s["sep"][0, 1].item() == pytest.approx(2 / T)
    assert s["punct"][0, 1].item() == pytest.approx(2 / T)
    # uniform head
    assert s["cls"][0, 3].item() == pytest.approx(1 / T)
    assert s["punct"][0, 3].item() == pytest.approx(2 / T)


def test_entropy_one_hot_zero_uniform_log_n():
    for n in (2, 5, 33):
        assert entropy(torch.eye(n)).tolist() == [0.0] * n
        assert torch.allclose(entropy(torch.full((n, n), 1 / n)), torch.full((n,), math.log(n)), atol=1e-6)
    attn = stack_heads(torch.eye(6), torch.full((6, 6), 1 / 6))
    s = sentence_head_stats(attn, [False] * 6)
    # smoothed as Clark's code: a one-hot row becomes 0.9999 + 0.0001 / 6 and 0.0001 / 6 elsewhere
    hi, lo = 0.9999 + 1e-4 / 6, 1e-4 / 6
    assert s["entropy"][0, 0].item() == pytest.approx(-(hi * math.log(hi) + 5 * lo * math.log(lo)), rel=1e-4)
    assert s["entropy"][0, 1].item() == pytest.approx(math.log(6), rel=1e-6)
    assert s["cls_entropy"][0, 1].item() == pytest.approx(math.log(6), rel=1e-6)


def test_accumulator_averages_sentences_and_uniform_reference():
    acc = HeadStatsAccumulator()
    acc.add(stack_heads(torch.full((4, 4), 0.25)), [False] * 4)
    acc.add(stack_heads(torch.full((8, 8), 0.125)), [False] * 8)
    r = acc.result()
    assert r["entropy"][0, 0] == pytest.approx((math.log(4) + math.log(8)) / 2, rel=1e-6)
    assert acc.uniform_entropy == pytest.approx((math.log(4) + math.log(8)) / 2)
    df = stats_table(r, acc.uniform_entropy)
    assert set(df.columns) == {"layer", "head", "stat", "value"}
    assert set(df.stat) >= {"prev", "self", "next", "cls", "sep", "punct", "entropy", "cls_entropy", "uniform_entropy"}


def chain_sentence(n: int) -> Sentence:
    """Word 1 is the root; every other word's head is the previous word (relation 'prev')."""
    heads = tuple([0] + list(range(1, n)))
    return Sentence(sent_id=None, text=None, words=tuple(f"w{i}" for i in range(n)), upos=("X",) * n,
                    xpos=("_",) * n, heads=heads, deprels=("root",) + ("prev",) * (n - 1), misc=("_",) * n,
                    lines=(), doc_id=None, line_no=1)


def test_prev_head_scores_100_percent_on_prev_chain():
    n = 6
    W = n + 2
    prev, nxt = shift_attention(W, -1), shift_attention(W, 1)
    word_attn = stack_heads(prev, nxt, layers=2).numpy().astype(np.float16)
    pred = predict_heads(word_attn)  # (L, H, n)
    assert pred[0, 0].tolist() == [2, 1, 2, 3, 4, 5]  # word 1 -> [CLS] is ignored -> next best (first) word
    # transposed next-token head: the word attending most to j is j - 1 -> also finds the heads
    assert predict_heads(word_attn, transpose=True)[0, 1, 1:].tolist() == [1, 2, 3, 4, 5]

    acc = DepAccumulator(2, 2, offsets=[-1, 1])
    s = chain_sentence(n)
    acc.add(word_attn, s.words, s.heads, s.deprels)
    acc.add(word_attn, s.words, s.heads, s.deprels)
    assert acc.count == {"all": 2 * (n - 1), "prev": 2 * (n - 1)}  # root excluded
    a = acc.head_accuracy("prev")  # (2, L, H)
    assert a[0, :, 0].tolist() == [1.0, 1.0]  # dep2head, previous-token head
    assert a[1, :, 1].tolist() == [1.0, 1.0]  # head2dep, next-token head
    assert a[0, :, 1].tolist() == [0.0, 0.0]
    assert acc.offset_accuracy("prev").tolist() == [1.0, 0.0]


def test_offset_baseline_hand_computed():
    # "The big dog barked at the cat ." with UD-style heads
    words = ("The", "big", "dog", "barked", "at", "the", "cat", ".")
    heads = (3, 3, 4, 0, 7, 7, 4, 4)
    rels = ("det", "amod", "nsubj", "root", "case", "det", "obl", "punct")
    assert offset_predictions(8, -1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # clipped to ROOT (0)
    assert offset_predictions(8, 2).tolist() == [3, 4, 5, 6, 7, 8, 8, 8]
    acc = DepAccumulator(1, 1, offsets=[-3, -2, -1, 0, 1, 2])
    W = len(words) + 2
    acc.add(np.full((1, 1, W, W), 1 / W, dtype=np.float16), words, heads, rels)
    # scored words (root, punct excluded): The->3, big->3, dog->4, at->7, the->7, cat->4
    # offset +1 predicts 2,3,4,6,7,8 -> correct: big, dog, the = 3/6; +2 predicts 3,4,5,7,8,8 -> The, at = 2/6
    # -1 predicts 0,1,2,4,5,6 -> none; -3 predicts 0,0,0,2,3,4 -> cat = 1/6; -2: 0,0,1,3,4,5 -> none
    assert acc.count["all"] == 6 and acc.count["det"] == 2
    assert acc.offset_accuracy("all").tolist() == pytest.approx([1 / 6, 0, 0, 0, 3 / 6, 2 / 6])
    assert acc.offset_accuracy("det").tolist() == pytest.approx([0, 0, 0, 0, 0.5, 0.5])


def test_possessive_scored_through_clitic():
    words = ("John", "'s", "dog", "barked")
    rels = ("nmod:poss", "case", "nsubj", "root")
    assert evaluation_positions(words, rels, ["nmod:poss"]).tolist() == [1, 1, 2, 3]
    assert evaluation_positions(words, rels, []).tolist() == [0, 1, 2, 3]


class _ListCache:
    def __init__(self, maps):
        self.maps = maps

    def __contains__(self, i):
        return self.maps[i] is not None

    def __getitem__(self, i):
        return self.maps[i]


def test_tables_best_head_and_offset():
    n = 5
    W = n + 2
    word_attn = stack_heads(shift_attention(W, 1), shift_attention(W, -1), layers=2).numpy()
    sents = [chain_sentence(n)] * 3
    acc = evaluate(_ListCache([word_attn, None, word_attn]), sents, 2, 2, offsets=[-1, 1], progress=False)
    assert acc.n_sentences == 2
    dep, off, table = tables(acc, min_count=1)
    assert len(dep) == 2 * 2 * 2 * 2  # relations (all, prev) x directions x L x H
    row = table.set_index("relation").loc["prev"]
    assert (row.layer, row["head"], row["name"], row.direction, row.accuracy) == (0, 1, "1-2", "dep2head", 1.0)
    assert (row.best_offset, row.offset_accuracy, row.difference) == (-1, 1.0, 0.0)
    assert row["count"] == 2 * (n - 1)


def test_js_identical_heads_zero_and_properties():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 9, 9, generator=g), -1)
    attn = torch.cat([a, a[:1]])  # head 3 == head 0
    d = js_divergence_matrix(attn, max_elements=500)  # small chunks
    assert d.shape == (4, 4)
    assert d[0, 3].item() == pytest.approx(0, abs=1e-9)
    assert torch.allclose(d, d.T) and torch.all(d.diagonal() == 0)
    assert d[0, 1] > 0
    # disjoint one-hot rows: JS = 1 bit per token (log 2 nats)
    e = torch.stack([torch.eye(5), torch.roll(torch.eye(5), 1, 1)])
    assert js_divergence_matrix(e)[0, 1].item() == pytest.approx(5.0, rel=1e-6)


def clark_behaviour(avg_attns: dict[str, np.ndarray], entropies: np.ndarray, uniform: float) -> list[list[str]]:
    """The colouring loop of Clark's General_Analysis.ipynb as written there ("right" = next token, "left" =
    previous), with his 3.8-nat threshold expressed over the uniform entropy of 128 tokens."""
    ENTROPY_THRESHOLD, POSITION_THRESHOLD, SPECIAL_TOKEN_THRESHOLD = 3.8 / np.log(128) * uniform, 0.5, 0.6
    out = []
    for layer in range(entropies.shape[0]):
        row = []
        for head in range(entropies.shape[1]):
            label = "other"
            if avg_attns["right"][layer, head] > POSITION_THRESHOLD:
                label = "next"
            if avg_attns["left"][layer, head] > POSITION_THRESHOLD:
                label = "prev"
            if entropies[layer, head] > ENTROPY_THRESHOLD:
                label = "broad"
            if avg_attns["cls"][layer, head] > SPECIAL_TOKEN_THRESHOLD:
                label = "cls"
            if avg_attns["sep"][layer, head] > SPECIAL_TOKEN_THRESHOLD:
                label = "sep"
            if avg_attns["punct"][layer, head] > SPECIAL_TOKEN_THRESHOLD:
                label = "punct"
            row.append(label)
        out.append(row)
    return out


def test_behaviour_labels_and_mds():
    stats = {k: np.zeros((1, 4)) for k in ("prev", "next", "cls", "sep", "punct", "entropy")}
    stats["prev"][0, 0] = 0.9
    stats["entropy"][0, 1] = 2.9  # > 0.783 x 3.0
    stats["entropy"][0, 2] = 1.0
    stats["cls"][0, 3], stats["prev"][0, 3] = 0.55, 0.7  # [CLS] share under 0.6: the position label stays
    assert classify_heads(stats, 3.0).tolist() == [["prev", "broad", "other", "prev"]]
    # against the notebook's loop on random statistics, where several tests hit the same head
    rng = np.random.default_rng(0)
    for _ in range(5):
        r = {k: rng.uniform(0, 1, (6, 12)) for k in ("prev", "next", "cls", "sep", "punct")}
        r["entropy"] = rng.uniform(0, 4, (6, 12))
        ref = clark_behaviour(dict(right=r["next"], left=r["prev"], cls=r["cls"], sep=r["sep"], punct=r["punct"]),
                              r["entropy"], 3.5)
        assert classify_heads(r, 3.5).tolist() == ref
    dist = np.array([[0, 1, 2], [1, 0, 1], [2, 1, 0]], dtype=float)
    coords, stress = mds_embedding(dist, seed=0, n_init=1, max_iter=300, eps=1e-6)  # fast; defaults: Clark's
    assert coords.shape == (3, 2) and np.isfinite(stress)
    assert np.linalg.norm(coords[0] - coords[2]) > np.linalg.norm(coords[0] - coords[1])


# ------------------------------------------------------------------ Clark's code, ported loop by loop
def clark_head_stats(tokens: list[str], attns: np.ndarray) -> dict[str, np.ndarray]:
    """General_Analysis.ipynb's token stats and entropies of ONE document (n_docs = 1), as written there."""
    n_tokens = attns.shape[-1]
    seps, clss, puncts = (np.zeros(n_tokens) for _ in range(3))
    for position, token in enumerate(tokens):
        if token == "[SEP]":
            seps[position] = 1
        if token == "[CLS]":
            clss[position] = 1
        if token == "." or token == ",":
            puncts[position] = 1
    sep_seps = np.ones((n_tokens, n_tokens)) * seps[np.newaxis] * seps[:, np.newaxis]
    rest_seps = np.ones((n_tokens, n_tokens)) * (np.ones(n_tokens) - seps)[:, np.newaxis] * seps[np.newaxis]
    selectors = {"self": np.eye(n_tokens, n_tokens), "next": np.eye(n_tokens, n_tokens, 1),
                 "prev": np.eye(n_tokens, n_tokens, -1), "sep": np.tile(seps[np.newaxis], [n_tokens, 1]),
                 "sep_sep": sep_seps, "rest_sep": rest_seps, "cls": np.tile(clss[np.newaxis], [n_tokens, 1]),
                 "punct": np.tile(puncts[np.newaxis], [n_tokens, 1])}
    out = {}
    for key, selector in selectors.items():
        denom = 2 if key == "sep_sep" else n_tokens - 2 if key == "rest_sep" else n_tokens
        out[key] = (attns * selector[np.newaxis, np.newaxis]).sum(-1).sum(-1) / denom
    a = 0.9999 * attns + (0.0001 / attns.shape[-1])
    out["entropy"] = -(a * np.log(a)).sum(-1).mean(-1)
    out["cls_entropy"] = -(a * np.log(a))[:, :, 0].sum(-1)
    return out


def test_head_stats_equal_clarks_code_on_pairs():
    """Every statistic of the accumulator over two random `[CLS] A [SEP] B [SEP]` maps equals Clark's
    notebook code (its loop over documents divided by n_docs); 'next'/'prev' are its 'right'/'left'."""
    g = np.random.default_rng(0)
    docs = [["[CLS]", "the", "dog", ",", "ran", ".", "[SEP]", "it", "sat", ".", "[SEP]"],
            ["[CLS]", "hi", "[SEP]", "yes", ",", "no", "[SEP]"]]
    acc, want = HeadStatsAccumulator(), {}
    for tokens in docs:
        T = len(tokens)
        attns = g.dirichlet(np.full(T, 0.3), size=(2, 3, T))  # (L, H, T, T)
        acc.add(torch.tensor(attns), [t in (".", ",") for t in tokens], [t == "[SEP]" for t in tokens])
        for k, v in clark_head_stats(tokens, attns).items():
            want[k] = want.get(k, 0) + v / len(docs)
    got = acc.result()
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert acc.uniform_entropy == pytest.approx((math.log(11) + math.log(7)) / 2)


def test_smoothed_entropy_equals_direct_loop():
    g = torch.Generator().manual_seed(1)
    attn = torch.softmax(3 * torch.randn(2, 5, 5, generator=g), -1)
    attn[0, 0] = torch.tensor([1.0, 0, 0, 0, 0])
    got = smoothed_entropy(attn)
    for h in range(2):
        for i in range(5):
            p = [0.9999 * float(x) + 0.0001 / 5 for x in attn[h, i]]
            assert got[h, i].item() == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-5, abs=1e-7)
    assert torch.allclose(smooth(attn, 1e-3).sum(-1), torch.ones(2, 5))


def test_offsets_clipped_to_root_equal_clarks_predictor():
    """Offset accuracies on random trees equal Clark's offset_predictor + evaluate_predictor (root and
    punct left out as the table); a word near the start predicts ROOT (0), not word 1."""
    assert offset_predictions(3, -2).tolist() == [0, 0, 1]
    g = np.random.default_rng(2)
    offsets = [-3, -2, -1, 0, 1, 2]
    acc = DepAccumulator(1, 1, offsets=offsets)
    correct, total = np.zeros(len(offsets)), 0
    for _ in range(30):
        n = int(g.integers(1, 9))
        heads = [0] + [int(g.integers(0, n + 1)) for _ in range(n - 1)]
        g.shuffle(heads)
        rels = ["root" if h == 0 else ("punct" if g.random() < 0.2 else "x") for h in heads]
        words = [f"w{i}" for i in range(n)]
        acc.add(np.full((1, 1, n + 2, n + 2), 1 / (n + 2)), words, heads, rels)
        for o, off in enumerate(offsets):  # Clark: max(0, min(i + offset + 1, len(words))), i 0-based
            pred = [max(0, min(i + off + 1, n)) for i in range(n)]
            correct[o] += sum(p == h for p, h, r in zip(pred, heads, rels) if r not in ("root", "punct"))
        total += sum(r not in ("root", "punct") for r in rels)
    assert acc.count["all"] == total > 0
    np.testing.assert_allclose(acc.offset_accuracy("all"), correct / total)


def clark_js_distances(attns: np.ndarray) -> np.ndarray:
    """head_distances.py for one document, with K heads instead of 144."""
    K = attns.shape[0] * attns.shape[1]
    js_distances = np.zeros([K, K])
    attns_flat = attns.reshape([K, attns.shape[2], attns.shape[3]])
    for head in range(K):
        head_attns = np.expand_dims(attns_flat[head], 0)
        head_attns_smoothed = (0.001 / head_attns.shape[1]) + (head_attns * 0.999)
        attns_flat_smoothed = (0.001 / attns_flat.shape[1]) + (attns_flat * 0.999)
        m = (head_attns_smoothed + attns_flat_smoothed) / 2
        js = -head_attns_smoothed * np.log(m / head_attns_smoothed)
        js += -attns_flat_smoothed * np.log(m / attns_flat_smoothed)
        js /= 2
        js_distances[head] += js.sum(-1).sum(-1)
    return js_distances


def test_smoothed_js_distances_equal_clarks_code():
    """clustering's distance (smooth 0.001, JS in nats = bits x ln 2) equals head_distances.py, one-hot rows included."""
    from probes.stats import LN2

    g = np.random.default_rng(3)
    attns = g.dirichlet(np.full(6, 0.2), size=(2, 3, 6))  # (L, H, T, T)
    attns[0, 0] = np.eye(6)
    want = clark_js_distances(attns)
    got = js_divergence_matrix(smooth(torch.tensor(attns).reshape(6, 6, 6), 1e-3), dtype=torch.float64) * LN2
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-9)


def test_pair_indices_stay_within_documents():
    assert pair_indices(["a", "a", "a", "b", "b", "c", "d", "d"]) == [(0, 1), (3, 4), (6, 7)]
    assert pair_indices([None, None, None]) == [(0, 1)]
    assert pair_indices(["a"]) == []


def _pair_reference(tok, a: list[str], b: list[str]) -> tuple[list[int], list[int], list[int] | None]:
    """(ids, word of every piece, token types or None) of a sentence pair as the tokenizer joins the two running
    texts, ``tok(" ".join(a), " ".join(b), return_offsets_mapping=True)``: each piece's word is the first word
    whose characters its offsets cover (a piece of spaces alone: the next word; B's words after A's), -1 for the
    first special, len(a) + len(b) for every other special."""
    texts = [" ".join(a), " ".join(b)]
    enc = tok(*texts, return_offsets_mapping=True)
    owner = []  # owner[segment][c]: the word of character c of the segment's text, None for the spaces
    for words, shift in ((a, 0), (b, len(a))):
        chars = []
        for k, w in enumerate(words):
            chars += [shift + k] * len(w) + [None]
        owner.append(chars)
    n, wop = len(a) + len(b), []
    for t, (seg, (x, y)) in enumerate(zip(enc.sequence_ids(), enc["offset_mapping"])):
        if seg is None:
            wop.append(-1 if t == 0 else n)
            continue
        hit = [owner[seg][c] for c in range(x, y) if owner[seg][c] is not None]
        if not hit:
            hit = [next(owner[seg][c] for c in range(y, len(texts[seg])) if owner[seg][c] is not None)]
        wop.append(hit[0])
    return list(enc["input_ids"]), wop, (list(enc["token_type_ids"]) if "token_type_ids" in enc else None)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_pair_input_special_positions_and_attention(tmp_path, family):
    """encode_word_pairs = the tokenizer's own pair encoding: [CLS] at 0, separators where the
    tokenizer puts them (BERT: [SEP] after A and at the end; RoBERTa: </s></s> after A and </s>),
    B's words after A's, BERT's token types 1 on B; its live maps equal the eager model's of that pair."""
    from transformers import AutoModel

    from probes.model import tiny
    from probes.model.load import load_encoder

    folder = tiny.tiny_folder(family, root=tmp_path / "models")
    enc = load_encoder(str(folder))
    tok = enc.tokenizer
    a, b = ["The", "dog", "barked", "."], ["It", ",", "ran"]
    (e,) = encode_word_pairs(tok, [(a, b)])
    ids, wop, types = _pair_reference(tok, a, b)
    assert e.input_ids == ids and e.word_of_piece == wop and e.token_type_ids == types and e.n_words == 7
    sep_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    seps = [i for i, t in enumerate(e.input_ids) if t == sep_id]
    assert separator_positions(e) == [i in seps for i in range(e.n_pieces)]
    assert e.input_ids[0] == (tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id)
    assert len(seps) == (2 if family == "bert" else 3) and seps[-1] == e.n_pieces - 1
    words = [w for w in e.word_of_piece if 0 <= w < e.n_words]
    assert words == sorted(words) and set(words) == set(range(7))
    assert max(i for i, w in enumerate(e.word_of_piece) if w == 3) < seps[0] < min(
        i for i, w in enumerate(e.word_of_piece) if w == 4)  # A | separator(s) | B
    if family == "bert":
        assert e.token_type_ids == [0] * (seps[0] + 1) + [1] * (e.n_pieces - seps[0] - 1)
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    ((i, attn, punct, sep),) = list(sequence_attention(enc, [e]))
    kw = {"token_type_ids": torch.tensor([types])} if types is not None else {}
    with torch.no_grad():
        want = torch.stack(model(input_ids=torch.tensor([ids]), output_attentions=True, **kw).attentions)[:, 0]
    torch.testing.assert_close(attn, want, rtol=1e-4, atol=1e-6)
    assert sep == separator_positions(e) and sum(punct) == 2  # '.' and ','


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_most_attended_rows_equals_a_loop_over_the_chosen_rows(dtype):
    """The most-attended other word of chosen words of a padded batch (items of 1-6 words, ties included), by
    plain loops over each chosen row's candidates, first maximum winning."""
    g = torch.Generator().manual_seed(0)
    n = torch.tensor([3, 1, 6, 4])  # words per item; W = 8: padding beyond each
    maps = torch.rand(4, 2, 3, 8, 8, generator=g).to(dtype)  # (B, L, H, W, W)
    maps[2, :, :, 3, 1:3] = 2.0  # a tie between words 0 and 1 in row 2 of item 2, above all else: the first wins
    item = torch.tensor([0, 0, 1, 2, 2, 3, 2])
    word = torch.tensor([0, 2, 0, 2, 5, 3, 0])
    got = most_attended_rows(maps[item, :, :, word + 1], n[item], word)  # the chosen rows alone
    assert got.shape == (7, 2, 3) and got.dtype == torch.long
    for m in range(7):
        b, j = int(item[m]), int(word[m])
        for l in range(2):
            for h in range(3):
                best, pick = None, 0
                for k in range(int(n[b])):
                    v = float(maps[b, l, h, j + 1, k + 1])
                    if k != j and (best is None or v > best):
                        best, pick = v, k
                assert got[m, l, h] == pick + 1, (m, l, h)  # a one-word item: the word itself (never a head)
    assert (got[3] == 1).all()  # the tie
