"""Words are read as running text by every tokenizer family, and a tokenizer that glues or splits words stops the
run before any forward.

The reference is :func:`tests.reference.text_pieces`: the model's own tokenizer on the words joined by single
spaces, pieces given to words by a loop over characters; nothing from :mod:`probes.model.inputs`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

import probes
from probes.model.inputs import TokenizationError, encode_word_pairs, encode_words
from probes.model.load import load_encoder
from probes.model.tiny import DECODERS, FAMILIES, tiny_folder
from tests import reference

SENTS = [["The", "unbelievably", "quick", "fox", "jumped", "over", "the", "dog", "."], ["Hello", "!"],
         ["A", "cat", ",", "a", "dog", "and", "John", "'s", "mat", "sat", "."], ["wheel", "-", "chair", "éléphant"],
         ["There", "were", "10 000", "naïve", "people", "."]]  # a word with a space inside; an accent


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-running-text")
    return {f: tiny_folder(f, root=root) for f in (*FAMILIES, *DECODERS)}


def _wop(wids: list[int | None], n: int) -> list[int]:
    """word_of_piece of the reference: -1 for specials before the words, n after."""
    first = next(t for t, w in enumerate(wids) if w is not None)
    return [(-1 if t < first else n) if w is None else w for t, w in enumerate(wids)]


@pytest.mark.parametrize("family", sorted((*FAMILIES, *DECODERS)))
def test_encode_words_is_the_tokenizer_on_the_joined_sentence(folders, family):
    tok = load_encoder(str(folders[family])).tokenizer
    for words, e in zip(SENTS, encode_words(tok, SENTS)):
        ids, wids = reference.text_pieces(tok, words)
        assert e.input_ids == ids, (family, words)
        assert e.word_of_piece == _wop(wids, len(words)), (family, words)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoders_read_spaces_between_words(folders, family):
    """Byte-level decoders: the first word as at the start of a text, every later word with its space (the bug
    this guards against: pre-split words read as "Thecatsat")."""
    tok = load_encoder(str(folders[family])).tokenizer
    (e,) = encode_words(tok, [["The", "cat", "sat"]])
    pieces = [p for p, w in zip(tok.convert_ids_to_tokens(e.input_ids), e.word_of_piece) if 0 <= w < 3]
    words = [[p for p, w in zip(tok.convert_ids_to_tokens(e.input_ids), e.word_of_piece) if w == k] for k in range(3)]
    assert not words[0][0].startswith("Ġ") and all(w[0].startswith("Ġ") for w in words[1:]), pieces
    assert tok.decode([i for i, w in zip(e.input_ids, e.word_of_piece) if 0 <= w < 3]) == "The cat sat"


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "gpt2", "llama"])
def test_pairs_are_two_running_texts(folders, family):
    """Encoder pairs: the tokenizer's own pair encoding of the two joined texts; decoder pairs: each segment alone
    as running text, ``[BOS] A <sep> B``."""
    tok = load_encoder(str(folders[family])).tokenizer
    a, b = SENTS[2], SENTS[0]
    (e,) = encode_word_pairs(tok, [(a, b)])
    if family in DECODERS:
        ia, wa = reference.text_pieces(tok, a)
        ib, wb = reference.text_pieces(tok, b)
        body_a = [i for i, w in zip(ia, wa) if w is not None]
        body_b = [i for i, w in zip(ib, wb) if w is not None]
        assert e.input_ids[len(e.input_ids) - len(body_b):] == body_b
        assert body_a == [i for i, w in zip(e.input_ids, e.word_of_piece) if 0 <= w < len(a)]
    else:
        enc = tok(" ".join(a), " ".join(b))
        assert e.input_ids == list(enc["input_ids"])
    got = [[t for t, w in enumerate(e.word_of_piece) if w == k] for k in range(len(a) + len(b))]
    assert all(got) and sum(map(len, got)) == sum(0 <= w < e.n_words for w in e.word_of_piece)


def _bad_tokenizer(folder: Path, normalizer) -> PreTrainedTokenizerFast:
    """The tiny GPT-2 tokenizer with ``normalizer`` in front: made to glue or split words."""
    base = load_encoder(str(folder)).tokenizer
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=base.bos_token, eos_token=base.eos_token,
                                   pad_token=base.eos_token, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("normalizer, what", [(normalizers.Replace(" ", ""), "glue"),
                                              (normalizers.Replace("a", " a"), "split")])
def test_a_tokenizer_that_glues_or_splits_words_stops_before_any_forward(folders, normalizer, what):
    enc = load_encoder(str(folders["gpt2"]))
    enc.tokenizer = _bad_tokenizer(folders["gpt2"], normalizer)
    calls = []
    enc.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(TokenizationError, match=r"(?s)tokenizer TokenizersBackend.*sentence 0.*first differing piece"):
        probes.word_maps(enc, [["The", "cat", "sat", "on", "a", "mat"]], device="cpu")
    assert calls == []  # nothing reached the model
    with pytest.raises(TokenizationError):
        encode_word_pairs(enc.tokenizer, [(["The", "cat"], ["a", "mat"])])


def test_unknown_words_and_control_characters_keep_a_row(folders):
    """WordPiece: a word the normaliser removes entirely reads as [UNK] in its place; the log counts it."""
    tok = load_encoder(str(folders["bert"])).tokenizer
    (e,) = encode_words(tok, [["Unbelievably", "\x07", "cats"]])
    pieces = tok.convert_ids_to_tokens(e.input_ids)
    assert pieces[e.word_of_piece.index(1)] == "[UNK]" and sorted(set(e.word_of_piece[1:-1])) == [0, 1, 2]


@pytest.mark.parametrize("bad, match", [([["The", 3, "cat"]], r"sentence 0, word 1: expected a string, got 3 \(int\)"),
                                        ([["The", "", "cat"]], r"sentence 0, word 1: '' is empty"),
                                        (["The cat"], r"sentence 0: expected a list of words, got str")])
def test_bad_words_are_named(folders, bad, match):
    tok = load_encoder(str(folders["bert"])).tokenizer
    with pytest.raises((TypeError, ValueError), match=match):
        encode_words(tok, bad)
