"""The hidden-state extraction's own loop (``probes.extract.stage.device_loop`` under
``probes.extract.representations.extract_hidden``: one device, batches built ahead, writes in a background thread, no
Lightning loop): its entry byte for byte the entry of Lightning's predict loop (full and mixed precision, writes in
the background or in turn), each sentence's states those of an independent reference written here (the model's own
tokenizer on the words joined by spaces, one plain transformers forward per sentence with ``output_hidden_states``,
word states pooled by loops over the pieces: their mean or the first), an interrupted build (an error in the writer
thread or the forward) leaves no complete entry and the next build is the clean one, a rank of a distributed job
keeps Lightning's loop, and a split is tokenized once per process for every cache kind; tiny BERT and Llama."""

from __future__ import annotations

import functools
import json
import time

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from transformers import AutoModel, AutoTokenizer

from probes.extract import cache, stage
from probes.extract.representations import HiddenExtractor, extract_hidden, hidden_entry_dir
from probes.extract.stage import encode_split, extract, forget_splits
from probes.model.inputs import length_batches
from probes.model.load import load_encoder
from probes.model.tiny import tiny_folder
from tests import reference
from tests.loops import MAX_LENGTH, MAX_TOKENS, SENTS, TRAINER, fail_third_batch, files, worker_threads


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_folder(family, root=root, num_layers=2, max_positions=64) for family in ("bert", "llama")}


def key_for(name: str, pooling: str = "mean", layers=(0, 1, 2), **more) -> dict:
    return dict(encoder=name, dataset="synthetic", split="dev", kind="hidden", pooling=pooling, layers=list(layers),
                **more)


def build(enc, cache_dir, key, trainer=TRAINER, **kwargs):
    return extract_hidden(enc, SENTS, key, cache_dir, trainer, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS, **kwargs)


# ----------------------------------------------------------------------------- the independent reference
def reference_states(folder, sentences: list[list[str]], layers: list[int], pooling: str, max_length: int
                     ) -> dict[int, np.ndarray]:
    """{sentence: (L', n, D) float32 word states} of the sentences of at most ``max_length`` pieces: the model's own
    tokenizer on the words joined by spaces, one plain forward of each sentence alone with ``output_hidden_states``,
    each word's state the mean of its pieces' (``mean``) or its first piece's (``first``), by loops."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    out = {}
    for i, words in enumerate(sentences):
        ids, wop = reference.text_pieces(tok, words)  # the tokenizer on the words joined by spaces
        if len(ids) > max_length:
            continue
        ids = torch.tensor([ids])
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
        block = np.zeros((len(layers), len(words), hidden[0].shape[-1]), dtype=np.float32)
        for k, l in enumerate(layers):
            h = hidden[l][0].numpy()  # (T, D)
            for w in range(len(words)):
                pieces = [t for t, x in enumerate(wop) if x == w]
                if pooling == "first":
                    block[k, w] = h[pieces[0]]
                else:
                    for t in pieces:
                        block[k, w] += h[t] / len(pieces)
        out[i] = block
    return out


@pytest.mark.parametrize("family,pooling,layers", [("bert", "mean", [0, 1, 2]), ("llama", "first", [0, 2]),
                                                   ("llama", "mean", [1])])
def test_own_loop_entry_equals_the_independent_reference(folders, tmp_path, family, pooling, layers):
    enc = load_encoder(str(folders[family]))
    enc.model.train()  # the loop computes in eval mode and puts the modes back
    got = build(enc, tmp_path, key_for(enc.name, pooling, layers), loop="own")
    assert enc.model.training and all(m.training for m in enc.model.modules())
    want = reference_states(folders[family], SENTS, layers, pooling, MAX_LENGTH)
    skipped = [i for i in range(len(SENTS)) if i not in want]
    assert len(SENTS) - 1 in skipped and len(want) > len(SENTS) // 2 and got.skipped == skipped

    # batches of several lengths (padding inside them), words of several pieces
    encoded = encode_split(enc.tokenizer, SENTS)
    kept = [encoded[i] for i in sorted(want)]
    batches = length_batches([e.n_pieces for e in kept], MAX_TOKENS, 128)
    assert len(batches) > 2 and any(len({kept[k].n_pieces for k in b}) > 1 for b in batches)
    assert any(len(e.word_of_piece) > len(set(e.word_of_piece)) + 1 for e in kept)

    # the entry as a whole: one shard, every kept sentence once, back to back, each block the reference's states
    manifest = json.loads((got.path / "manifest.json").read_text())
    assert manifest["shards"] == ["maps-r0.f16"] and manifest["layers"] == layers and got.layers == layers
    index = np.load(got.path / "index-r0.npy")  # (N, 3): sentence, element offset, n words
    data = np.fromfile(got.path / "maps-r0.f16", dtype=np.float16)
    D = got.dim
    assert sorted(index[:, 0].tolist()) == sorted(want) and D == enc.config.hidden_size
    sizes = [len(layers) * int(n) * D for n in index[:, 2]]
    assert index[:, 1].tolist() == np.cumsum([0] + sizes[:-1]).tolist() and data.size == sum(sizes)
    for (i, offset, n), size in zip(index.tolist(), sizes):
        assert n == len(SENTS[i])
        block = data[offset:offset + size].reshape(len(layers), n, D)
        # float16 storage: rounding 2^-11 relative; padding in the batches: float32 sums in another order
        np.testing.assert_allclose(block.astype(np.float32), want[i], atol=5e-3, rtol=2e-3, err_msg=f"sentence {i}")
        np.testing.assert_array_equal(got[i], block)
        np.testing.assert_array_equal(got.layer(i, layers[-1]), block[-1])


@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_own_loop_writes_lightnings_entry_byte_for_byte(folders, tmp_path, monkeypatch, family, precision):
    enc = load_encoder(str(folders[family]))
    trainer = functools.partial(TRAINER, precision=precision)
    key = key_for(enc.name, "mean", precision=precision)
    own = build(enc, tmp_path / "own", key, trainer, loop="own")
    lightning = build(enc, tmp_path / "lightning", key, trainer, loop="lightning")
    monkeypatch.setattr(stage, "device_loop", functools.partial(stage.device_loop, overlap=False))
    in_turn = build(enc, tmp_path / "in-turn", key, trainer, loop="own")
    assert own.path.name == lightning.path.name == in_turn.path.name
    assert files(own) == files(lightning) == files(in_turn)  # states, index and manifest (its checksums included)
    assert not worker_threads()


# ----------------------------------------------------------------------------- interruptions
@pytest.mark.parametrize("where", ["writer thread", "forward"])
def test_an_interrupted_build_leaves_no_entry_and_the_next_is_clean(folders, tmp_path, monkeypatch, where):
    enc = load_encoder(str(folders["bert"]))
    key = key_for(enc.name)
    calls, error = fail_third_batch(monkeypatch, where, HiddenExtractor, "word_states")  # a failing disk, or Ctrl-C in the forward
    with pytest.raises(error):
        build(enc, tmp_path / "a", key, loop="own")
    assert len(calls) == 3 and (calls[0] == "cache-writer") == (where == "writer thread")
    final = hidden_entry_dir(tmp_path / "a", key)
    assert not cache.is_complete(final) and (final.with_name(final.name + ".partial") / "maps-r0.f16").is_file()
    time.sleep(0.1)
    assert not worker_threads()  # the batch builder and the writer stopped
    monkeypatch.undo()
    again = build(enc, tmp_path / "a", key)
    clean = build(enc, tmp_path / "b", key, loop="lightning")
    assert files(again) == files(clean) and not list((tmp_path / "a" / "hidden").glob("*.partial"))


# ----------------------------------------------------------------------------- which loop, tokenizing once
class Foreign(pl.Callback):
    pass


def test_lightnings_loop_where_the_own_loop_cannot_stand_in(folders, tmp_path, monkeypatch):
    enc = load_encoder(str(folders["bert"]))
    ran, device_loop = [], stage.device_loop
    monkeypatch.setattr(stage, "device_loop", lambda *args, **kwargs: ran.append(1) or device_loop(*args, **kwargs))
    with pytest.raises(ValueError, match=r"extract_hidden\(loop='own'\): .*\(callbacks \['Foreign'\]\)"):
        build(enc, tmp_path, key_for(enc.name), lambda callbacks: TRAINER(callbacks=callbacks + [Foreign()]),
              loop="own")
    with pytest.raises(ValueError, match="loop='fast'"):
        build(enc, tmp_path, key_for(enc.name), loop="fast")
    # inside a rank of a distributed job (a DDP training's): Lightning's predict loop, the same entry
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)  # one rank of two
        assert stage.own_loop_device(TRAINER()) == (None, "inside a distributed job of 2 processes")
        in_job = build(enc, tmp_path / "job", key_for(enc.name))
    finally:
        torch.distributed.destroy_process_group()
    assert not ran
    alone = build(enc, tmp_path / "alone", key_for(enc.name))
    assert ran == [1] and files(in_job) == files(alone)


def test_a_split_is_tokenized_once_for_every_cache_kind(folders, tmp_path, monkeypatch):
    enc = load_encoder(str(folders["bert"]))
    tokenized = []
    encode_all = stage.encode_all
    monkeypatch.setattr(stage, "encode_all", lambda tok, sents: tokenized.append(len(sents)) or encode_all(tok, sents))
    forget_splits()
    extract(enc, SENTS, dict(encoder=enc.name, dataset="synthetic", split="dev"), tmp_path, TRAINER,
            max_length=MAX_LENGTH)
    first = build(enc, tmp_path, key_for(enc.name, "mean"))
    second = build(enc, tmp_path, key_for(enc.name, "first", (1,)))
    assert tokenized == [len(SENTS)] and first.path != second.path
    forget_splits()
