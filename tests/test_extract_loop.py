"""The extraction stage's own loop (``probes.extract.stage.predict_loop``: one device, batches built ahead, writes in a
background thread, no Lightning loop): its cache entry against one built by an independent plain loop written here
(the tokenizer on the running text, a plain eager transformers forward with ``output_attentions`` over padded
batches, word pooling by explicit loops), byte for byte the entry of Lightning's predict loop, an interrupted build
(an error in the writer thread or the forward, or the process killed while writing) leaves no complete entry and the
next build is the clean one, and a split is tokenized once per process."""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from probes.extract import cache, stage
from probes.extract.stage import encode_split, extract, forget_splits, own_loop_device, probe_trainer
from probes.maps import MapEngine
from probes.measures.attention import Attention
from probes.model.load import load_encoder
from probes.model.tiny import tiny_folder
from tests import reference
from tests.conftest import ROOT
from tests.loops import MAX_LENGTH, MAX_TOKENS, SENTS, TRAINER, fail_third_batch, files, worker_threads


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_folder(family, root=root, num_layers=2) for family in ("bert", "roberta")}


def key_for(name: str, **more) -> dict:
    return dict(encoder=name, dataset="synthetic", split="dev", **more)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_own_loop_entry_equals_the_independent_plain_loop(folders, tmp_path, family):
    enc = load_encoder(str(folders[family]))
    enc.model.train()  # the loop computes in eval mode and puts the modes back
    got = extract(enc, SENTS, key_for(enc.name), tmp_path, TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS,
                  loop="own")
    assert enc.model.training and all(m.training for m in enc.model.modules())
    want = reference.plain_entry(folders[family], SENTS, MAX_LENGTH)
    skipped = [i for i in range(len(SENTS)) if i not in want]
    assert len(SENTS) - 1 in skipped and len(want) > len(SENTS) // 2 and got.skipped == skipped

    # batches of several lengths: padding inside the length batches
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS)
    encoded = encode_split(enc.tokenizer, SENTS)
    kept = [encoded[i] for i in sorted(want)]
    batches = engine.batches(kept)
    assert len(batches) > 2 and any(len({kept[k].n_pieces for k in b}) > 1 for b in batches)

    # the entry as a whole: one shard, every kept sentence once, back to back, each block the plain loop's maps
    manifest = json.loads((got.path / "manifest.json").read_text())
    assert manifest["shards"] == ["maps-r0.f16"] and manifest["n_sentences"] == len(SENTS)
    index = np.load(got.path / "index-r0.npy")  # (N, 3): sentence, element offset, W
    data = np.fromfile(got.path / "maps-r0.f16", dtype=np.float16)
    L, H = enc.num_layers, enc.num_heads
    assert sorted(index[:, 0].tolist()) == sorted(want)
    sizes = [L * H * int(w) ** 2 for w in index[:, 2]]
    assert index[:, 1].tolist() == np.cumsum([0] + sizes[:-1]).tolist() and data.size == sum(sizes)
    for (i, offset, w), size in zip(index.tolist(), sizes):
        assert w == len(SENTS[i]) + 2
        block = data[offset:offset + size].reshape(L, H, w, w).astype(np.float32)
        # float16 storage: rounding 2^-11 relative, of values up to the pieces of a word
        np.testing.assert_allclose(block, want[i], atol=2e-3, rtol=0, err_msg=f"sentence {i}")
        np.testing.assert_array_equal(got[i], data[offset:offset + size].reshape(L, H, w, w))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_own_loop_writes_lightnings_entry_byte_for_byte(folders, tmp_path, monkeypatch, precision):
    enc = load_encoder(str(folders["roberta"]))  # pad id 1: padding that is not zero
    trainer = functools.partial(TRAINER, precision=precision)
    own = extract(enc, SENTS, key_for(enc.name), tmp_path / "own", trainer, max_length=MAX_LENGTH,
                  max_tokens=MAX_TOKENS, loop="own")
    lightning = extract(enc, SENTS, key_for(enc.name), tmp_path / "lightning", trainer, max_length=MAX_LENGTH,
                        max_tokens=MAX_TOKENS, loop="lightning")
    monkeypatch.setattr(stage, "predict_loop", functools.partial(stage.predict_loop, overlap=False))
    in_turn = extract(enc, SENTS, key_for(enc.name), tmp_path / "in-turn", trainer, max_length=MAX_LENGTH,
                      max_tokens=MAX_TOKENS, loop="own")
    assert own.path.name == lightning.path.name == in_turn.path.name
    assert files(own) == files(lightning) == files(in_turn)  # maps, index and manifest (its checksums included)
    assert not worker_threads()


def test_write_many_writes_what_write_writes(tmp_path):
    rng = np.random.default_rng(0)
    padded = rng.random((3, 2, 4, 9, 9)).astype(np.float16)  # (B, L, H, W, W): blocks are strided views
    items = [(5, padded[0, :, :, :4, :4]), (2, padded[1, :, :, :9, :9]), (7, padded[2, :, :, :6, :6])]
    for name in ("one", "many"):
        (tmp_path / name).mkdir()
    one = cache.ShardWriter(tmp_path / "one", 0)
    for i, m in items:
        one.write(i, m)
    one.close()
    many = cache.ShardWriter(tmp_path / "many", 0)
    many.write_many(items[:2])
    many.write_many([])
    many.write_many(items[2:])
    many.close()
    for f in ("maps-r0.f16", "index-r0.npy", "checksums-r0.json"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "many" / f).read_bytes(), f


# ----------------------------------------------------------------------------- interruptions
@pytest.mark.parametrize("where", ["writer thread", "forward"])
def test_an_interrupted_build_leaves_no_entry_and_the_next_is_clean(folders, tmp_path, monkeypatch, where):
    enc = load_encoder(str(folders["bert"]))
    key = key_for(enc.name)
    calls, error = fail_third_batch(monkeypatch, where, MapEngine, "word_maps")  # a failing disk, or Ctrl-C in the forward
    with pytest.raises(error):
        extract(enc, SENTS, key, tmp_path / "a", TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS, loop="own")
    assert len(calls) == 3 and (calls[0] == "cache-writer") == (where == "writer thread")
    final = cache.entry_dir(tmp_path / "a", key)
    assert not cache.is_complete(final) and final.with_name(final.name + ".partial").is_dir()
    with pytest.raises(FileNotFoundError):
        cache.AttentionCache(final)
    time.sleep(0.1)
    assert not worker_threads()  # the batch builder and the writer stopped
    monkeypatch.undo()
    again = extract(enc, SENTS, key, tmp_path / "a", TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS)
    clean = extract(enc, SENTS, key, tmp_path / "b", TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS)
    assert files(again) == files(clean) and not list((tmp_path / "a" / "attention").glob("*.partial"))


KILLED_CHILD = """
import os, signal, sys
import pytorch_lightning as pl
from probes.extract import cache
from probes.extract.stage import extract
from probes.model.load import load_encoder
folder, out, words = sys.argv[1], sys.argv[2], [s.split(",") for s in sys.argv[3].split(";")]
write_many, calls = cache.ShardWriter.write_many, []
def write_then_die(self, items):
    write_many(self, items)
    self._f.flush()  # the first batches reached the file
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
cache.ShardWriter.write_many = write_then_die
enc = load_encoder(folder)
extract(enc, words, dict(encoder=enc.name, dataset="synthetic", split="dev"), out, lambda callbacks: pl.Trainer(
    callbacks=callbacks, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False), max_length=%d, max_tokens=%d, loop="own")
""" % (MAX_LENGTH, MAX_TOKENS)


def test_a_build_killed_while_writing_leaves_no_entry_and_the_next_is_clean(folders, tmp_path):
    enc = load_encoder(str(folders["bert"]))
    key = key_for(enc.name)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(folders["bert"]), str(tmp_path / "a"),
                        ";".join(",".join(s) for s in SENTS)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    final = cache.entry_dir(tmp_path / "a", key)
    partial = final.with_name(final.name + ".partial")
    assert not cache.is_complete(final) and (partial / "maps-r0.f16").stat().st_size > 0
    with cache.build_lock(final, timeout=5) as build_here:  # the dead builder's lock is free
        assert build_here
    again = extract(enc, SENTS, key, tmp_path / "a", TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS)
    clean = extract(enc, SENTS, key, tmp_path / "b", TRAINER, max_length=MAX_LENGTH, max_tokens=MAX_TOKENS)
    assert files(again) == files(clean) and not partial.exists()


# ----------------------------------------------------------------------------- which loop, tokenizing once
class Foreign(pl.Callback):
    pass


def test_the_own_loop_stands_in_only_where_lightning_would_add_nothing(folders, tmp_path):
    assert own_loop_device(TRAINER()) == (torch.device("cpu"), "")
    assert own_loop_device(TRAINER(precision="bf16-mixed"))[0] == torch.device("cpu")
    device, why = own_loop_device(TRAINER(callbacks=[Foreign()]))
    assert device is None and "Foreign" in why
    device, why = own_loop_device(TRAINER(devices=2, strategy="ddp"))
    assert device is None and "DDPStrategy" in why
    device, why = own_loop_device(TRAINER(limit_predict_batches=2))
    assert device is None and "limit_predict_batches" in why
    # a plain partial's Trainer is made once per process; a function that may add callbacks gets none kept
    assert probe_trainer(TRAINER) is probe_trainer(functools.partial(TRAINER)) is not None
    assert probe_trainer(functools.partial(TRAINER, precision="bf16-mixed")) is not probe_trainer(TRAINER)
    assert probe_trainer(lambda callbacks: TRAINER(callbacks=callbacks)) is None
    assert probe_trainer(functools.partial(TRAINER, callbacks=[Foreign()])) is None
    enc = load_encoder(str(folders["bert"]))
    with pytest.raises(ValueError, match=r"needs Lightning's predict loop \(callbacks \['Foreign'\]\)"):
        extract(enc, SENTS, key_for(enc.name), tmp_path, lambda callbacks: TRAINER(callbacks=callbacks + [Foreign()]),
                loop="own")
    with pytest.raises(ValueError, match="loop='fast'"):
        extract(enc, SENTS, key_for(enc.name, n=2), tmp_path, TRAINER, loop="fast")


def test_a_split_is_tokenized_once_per_process(folders, tmp_path, monkeypatch):
    enc = load_encoder(str(folders["bert"]))
    tokenized = []
    encode_all = stage.encode_all
    monkeypatch.setattr(stage, "encode_all", lambda tok, sents: tokenized.append(len(sents)) or encode_all(tok, sents))
    forget_splits()
    first = extract(enc, SENTS, key_for(enc.name, n=1), tmp_path, TRAINER, max_length=MAX_LENGTH)
    second = extract(enc, [list(s) for s in SENTS], key_for(enc.name, n=2), tmp_path, TRAINER, max_length=MAX_LENGTH)
    assert tokenized == [len(SENTS)]
    assert (first.path / "maps-r0.f16").read_bytes() == (second.path / "maps-r0.f16").read_bytes()
    extract(enc, SENTS[:-1], key_for(enc.name, n=3), tmp_path, TRAINER, max_length=MAX_LENGTH)  # other sentences
    assert tokenized == [len(SENTS), len(SENTS) - 1]
    assert encode_split(enc.tokenizer, SENTS) == encode_all(enc.tokenizer, SENTS) and gc.isenabled()
    forget_splits()
    encode_split(enc.tokenizer, SENTS)
    assert tokenized[-1] == len(SENTS) and len(tokenized) == 3
