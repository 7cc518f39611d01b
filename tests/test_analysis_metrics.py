"""Pure attention statistics on synthetic maps (probes.analysis.clark.metrics)."""

import math

import numpy as np
import pytest
import torch

from probes.analysis.clark.clustering import classify_heads, mds_embedding
from probes.analysis.clark.dep_heads import evaluate, tables
from probes.analysis.clark.head_stats import stats_table
from probes.analysis.clark.metrics import (
    DepAccumulator, HeadStatsAccumulator, evaluation_positions, is_punct_piece, offset_predictions, piece_strings,
    piece_text, predict_heads, punct_positions, sentence_head_stats,
)
from probes.analysis.naming import head_name
from probes.analysis.stats import entropy, js_divergence_matrix
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


def test_punct_pieces():
    assert is_punct_piece(".") and is_punct_piece(",") and is_punct_piece("##.") and is_punct_piece("--")
    assert is_punct_piece("“") and is_punct_piece("$")
    assert not is_punct_piece("[CLS]") and not is_punct_piece("a.") and not is_punct_piece("##") \
        and not is_punct_piece("")
    # byte-level BPE (Ġ = a space before the piece) and SentencePiece (▁) word-start markers
    assert is_punct_piece("Ġ,") and is_punct_piece("Ġ.") and is_punct_piece("▁,") and is_punct_piece("▁.")
    assert is_punct_piece("Ġ--") and is_punct_piece("▁“")
    assert not is_punct_piece("Ġ") and not is_punct_piece("▁") and not is_punct_piece("Ġa") \
        and not is_punct_piece("▁the") and not is_punct_piece("<s>") and not is_punct_piece("</s>")
    assert [piece_text(t) for t in ("##.", "Ġ,", "▁,", "x")] == [".", ",", ",", "x"]


class _PieceTokenizer:
    """convert_ids_to_tokens / convert_tokens_to_string of a fixed piece list (byte-level style)."""

    def __init__(self, pieces, decoded):
        self.pieces, self.decoded = pieces, decoded

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(self.decoded[self.pieces.index(t)] for t in tokens)


def test_punct_positions_specials_never_count_and_byte_level_decoding():
    # specials that look like punctuation to is_punct_piece still never count (positions 0 and T - 1)
    tok = _PieceTokenizer(["<.>", "Ġhi", "Ġ,", "<|>"], ["<.>", " hi", " ,", "<|>"])
    assert is_punct_piece("<.>") and is_punct_piece("<|>")
    assert punct_positions(tok, [0, 1, 2, 3], byte_level=False) == [False, False, True, False]
    # byte-level: a piece holding a whole non-ASCII character is read as that character; partial bytes stay
    tok = _PieceTokenizer(["<s>", "ĠâĢľ", "Ġhi", "âĢ", "</s>"], ["<s>", " \u201c", " hi", "\ufffd", "</s>"])
    assert piece_strings(tok, [0, 1, 2, 3, 4], byte_level=True) == ["<s>", "\u201c", "hi", "âĢ", "</s>"]
    assert punct_positions(tok, [0, 1, 2, 3, 4], byte_level=True) == [False, True, False, False, False]
    assert punct_positions(tok, [0, 1, 2, 3, 4], byte_level=False) == [False] * 5


def test_prev_head_has_prev_statistic_one():
    T = 7
    attn = stack_heads(shift_attention(T, -1), shift_attention(T, 1), shift_attention(T, 0),
                       torch.full((T, T), 1 / T), layers=2)
    punct = [False, False, True, False, False, True, False]
    s = sentence_head_stats(attn, punct)
    assert s["prev"].shape == (2, 4)
    assert torch.allclose(s["prev"][:, 0], torch.ones(2))
    assert torch.allclose(s["next"][:, 1], torch.ones(2))
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
    assert s["entropy"][0, 0].item() == pytest.approx(0, abs=1e-7)
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
    return Sentence(None, None, tuple(f"w{i}" for i in range(n)), ("X",) * n, heads,
                    ("root",) + ("prev",) * (n - 1), ("_",) * n, (), None, 1)


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
    assert offset_predictions(8, -1).tolist() == [1, 1, 2, 3, 4, 5, 6, 7]
    assert offset_predictions(8, 2).tolist() == [3, 4, 5, 6, 7, 8, 8, 8]
    acc = DepAccumulator(1, 1, offsets=[-3, -2, -1, 0, 1, 2])
    W = len(words) + 2
    acc.add(np.full((1, 1, W, W), 1 / W, dtype=np.float16), words, heads, rels)
    # scored words (root, punct excluded): The->3, big->3, dog->4, at->7, the->7, cat->4
    # offset +1 predicts 2,3,4,6,7,8 -> correct: big, dog, the = 3/6; +2 predicts 3,4,5,7,8,8 -> The, at = 2/6
    # -1 predicts 1,1,2,4,5,6 -> none; -3 predicts 1,1,1,2,3,4 -> cat = 1/6; -2: 1,1,1,3,4,5 -> none
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


def test_behaviour_labels_and_mds():
    stats = {k: np.zeros((1, 3)) for k in ("prev", "next", "cls", "sep", "punct", "entropy")}
    stats["prev"][0, 0] = 0.9
    stats["entropy"][0, 1] = 2.9
    stats["entropy"][0, 2] = 1.0
    assert classify_heads(stats, 3.0).tolist() == [["prev", "broad", "other"]]
    dist = np.array([[0, 1, 2], [1, 0, 1], [2, 1, 0]], dtype=float)
    coords, stress = mds_embedding(dist, seed=0)
    assert coords.shape == (3, 2) and np.isfinite(stress)
    assert np.linalg.norm(coords[0] - coords[2]) > np.linalg.norm(coords[0] - coords[1])
