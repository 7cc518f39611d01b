import pytest
import torch

from probes.model.inputs import POOLINGS, encode_words, pool_attention, pooling_matrix
from probes.model.load import load_packaged
from tests.reference import pooling_by_hand


def test_pooling_matrices_follow_clark():
    # [CLS] un ##believ ##able cat [SEP] -> words: unbelievable, cat
    word_of_piece = [-1, 0, 0, 0, 1, 2]
    to = pooling_matrix(word_of_piece, 2, "sum")
    frm = pooling_matrix(word_of_piece, 2, "mean")
    first = pooling_matrix(word_of_piece, 2, "first")
    assert to.tolist()[1] == [0, 1, 1, 1, 0, 0]
    assert torch.allclose(frm[1], torch.tensor([0, 1 / 3, 1 / 3, 1 / 3, 0, 0]))
    assert first.tolist()[1] == [0, 1, 0, 0, 0, 0]
    # attention from piece rows to piece columns, rows sum to 1
    attn = torch.softmax(torch.randn(1, 3, 6, 6), dim=-1)  # (B, K, T, T)
    words = pool_attention(attn, frm[None], to[None])  # (B, K, W, W)
    assert words.shape == (1, 3, 4, 4)
    assert torch.allclose(words.sum(-1), torch.ones(1, 3, 4), atol=1e-6)
    # to-word = sum over its pieces; from-word = mean over its pieces
    expected = attn[0, 0, 1:4, 1:4].sum(-1).mean()
    assert torch.isclose(words[0, 0, 1, 1], expected, atol=1e-6)
    assert torch.isclose(words[0, 0, 0, 1], attn[0, 0, 0, 1:4].sum(), atol=1e-6)


@pytest.mark.parametrize("mode", POOLINGS)
def test_pooling_matrix_equals_an_explicit_loop(mode):
    """Every pooling mode against :func:`tests.reference.pooling_by_hand`, on hand-written piece maps and on
    the packaged tokenizer's own (words split into several pieces, an unknown word, a one-word sentence)."""
    cases = [([-1, 0, 0, 0, 1, 2], 2), ([-1, 0, 1, 1, 2, 2, 2, 3], 3), ([-1, 0, 1], 1)]
    tok = load_packaged(name="minilm").tokenizer
    sents = [["Unbelievably", "\x07", "cats"], ["antidisestablishmentarianism", "is", "long", "."], ["Hi"]]
    cases += [(e.word_of_piece, e.n_words) for e in encode_words(tok, sents)]
    assert any(len(set(wop)) < len(wop) for wop, _ in cases[3:])  # the tokenizer does split some word
    for wop, n in cases:
        got, ref = pooling_matrix(wop, n, mode), pooling_by_hand(wop, n, mode)
        assert got.shape == (n + 2, len(wop))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-7, msg=f"{mode} {wop}")


def test_encode_words_marks_specials_and_unknown_words():
    tok = load_packaged(name="minilm").tokenizer
    (e,) = encode_words(tok, [["Unbelievably", "\x07", "cats"]])
    pieces = tok.convert_ids_to_tokens(e.input_ids)
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
    assert e.word_of_piece[0] == -1 and e.word_of_piece[-1] == 3
    assert sorted(set(e.word_of_piece[1:-1])) == [0, 1, 2]  # every word has at least one piece
    assert pieces[e.word_of_piece.index(1)] == "[UNK]"
