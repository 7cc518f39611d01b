"""Host work overlapped with the device: batches built ahead in a background thread (``prefetched``,
``SentenceBatches(ahead=True)``), cache entries written by a background thread (``CacheWriter(background=True)``),
and the stage timers (:mod:`probes.maps.timing`). The threads change nothing that is written: an entry built with
them is byte for byte the entry the synchronous path writes, and their errors reach the caller."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from probes.extract import cache
from probes.extract.stage import AttentionExtractor, extract
from probes.extract.writer import BackgroundWrites, CacheWriter
from probes.maps import MapEngine, SentenceBatches, encode_all, make_batch, prefetched
from probes.maps.timing import measuring, op_groups, stage
from probes.measures.attention import Attention
from probes.model.load import tiny_bert
from tests.conftest import WORDS

SENTS = [[WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + i % 11)] for i in range(37)]
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)


def ahead_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("batches-ahead", "cache-writer"))]


def test_prefetched_keeps_order_reraises_and_stops():
    def items(fail_at=None):
        for k in range(6):
            if k == fail_at:
                raise KeyError(f"item {k}")
            yield k

    assert list(prefetched(items(), depth=2)) == list(range(6))
    got = []
    with pytest.raises(KeyError, match="item 3"):
        for x in prefetched(items(fail_at=3)):
            got.append(x)
    assert got == [0, 1, 2]
    it = prefetched(iter(range(1000)), depth=1)
    assert next(it) == 0
    it.close()  # leaving early stops the thread
    time.sleep(0.1)
    assert not ahead_threads()


def test_batches_built_ahead_equal_built_at_once_in_any_order():
    enc = tiny_bert(max_position_embeddings=128)
    encoded = encode_all(enc.tokenizer, SENTS)
    batches = [list(range(k, min(k + 4, len(SENTS)))) for k in range(0, len(SENTS), 4)]
    ahead = SentenceBatches(encoded, list(range(len(SENTS))), batches, "mean", "sum", 0, ahead=True)
    for order in (range(len(batches)), range(1, len(batches), 2), [3, 0, 7, 1, 9, 2]):
        for b in order:
            got = ahead[b]
            want = make_batch([encoded[i] for i in batches[b]], batches[b], "mean", "sum", 0)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), (list(order), b)
    broken = SentenceBatches(encoded, list(range(len(SENTS))), [[0, 1], [2, 999], [3]], "mean", "sum", 0, ahead=True)
    broken[0]  # starts building batch 1 (position 999 does not exist) in the background
    with pytest.raises(IndexError):
        broken[1]
    assert torch.equal(broken[2]["input_ids"], make_batch([encoded[3]], [3], "mean", "sum", 0)["input_ids"])


def test_background_writes_run_in_order_and_raise_the_first_error():
    done = []
    w = BackgroundWrites(depth=1)
    for k in range(5):
        w.submit(functools.partial(done.append, k))
    w.finish()
    assert done == list(range(5))

    def fail():
        raise OSError("disk on fire")

    done.clear()
    w = BackgroundWrites(depth=1)
    w.submit(functools.partial(done.append, 0))
    w.submit(fail)
    w.submit(functools.partial(done.append, 2))
    with pytest.raises(OSError, match="disk on fire"):
        w.finish()
    assert done == [0]  # nothing after the failed job


def _predict_entry(enc, key, tmp_path, extractor=AttentionExtractor, **writer) -> cache.AttentionCache:
    """The entry ``extract`` writes for ``key``, built with the writer and the batches given."""
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, max_tokens=64)
    encoded = encode_all(enc.tokenizer, SENTS)
    keep, skipped = engine.select(encoded)
    kept = [encoded[i] for i in keep]
    batches = engine.batches(kept)
    final = cache.entry_dir(tmp_path, key)
    manifest = dict(format_version=cache.FORMAT_VERSION, key=key, n_sentences=len(SENTS), skipped=skipped,
                    num_layers=len(engine.layers), layers=engine.layers, num_heads=engine.num_heads, maps="attention",
                    n_pieces=int(sum(e.n_pieces for e in kept)), dtype="float16",
                    layout="(L, H, W, W), L = len(layers), W = words + 2: [CLS], words, [SEP]; rows attend to columns "
                           "(H = 1 for per-layer map kinds)")
    data = SentenceBatches(kept, keep, batches, "mean", "sum", engine.pad_id, ahead=True)
    TRAINER(callbacks=[CacheWriter(final, manifest, **writer)]).predict(
        extractor(engine), DataLoader(data, batch_size=None), return_predictions=False)
    return cache.AttentionCache(final)


def test_entry_written_behind_is_byte_identical(tmp_path):
    enc = tiny_bert(max_position_embeddings=128)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    at_once = extract(enc, SENTS, key, tmp_path / "sync", TRAINER, max_tokens=64)
    behind = _predict_entry(enc, key, tmp_path / "behind", background=True, depth=1)
    names = sorted(p.name for p in at_once.path.iterdir())
    assert names == sorted(p.name for p in behind.path.iterdir()) and "maps-r0.f16" in names
    for name in names:
        assert (at_once.path / name).read_bytes() == (behind.path / name).read_bytes(), name
    assert not ahead_threads()


class Float32Maps(AttentionExtractor):
    """Returns float32 maps, which a shard refuses (it stores float16)."""

    def predict_step(self, batch, batch_idx=0):
        return dict(super().predict_step(batch, batch_idx), maps=self.engine.word_maps(batch, torch.float32))


def test_error_in_the_writer_thread_reaches_predict_and_leaves_no_entry(tmp_path):
    enc = tiny_bert(max_position_embeddings=128)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    with pytest.raises(AssertionError):
        _predict_entry(enc, key, tmp_path, Float32Maps, background=True)
    assert not cache.is_complete(cache.entry_dir(tmp_path, key))
    time.sleep(0.1)
    assert not ahead_threads()


def test_stage_times_count_the_engine_stages_from_every_thread(tmp_path):
    enc = tiny_bert(max_position_embeddings=128)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    with stage("outside"):  # not measuring: nothing recorded anywhere
        pass
    with measuring() as times, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _predict_entry(enc, key, tmp_path, background=True)
    got = times.as_dict()
    n_batches = len(MapEngine(enc.model, Attention(), max_tokens=64).batches(encode_all(enc.tokenizer, SENTS)))
    assert "outside" not in got
    assert {"tokenize", "batch", "forward", "pool", "to host", "write", "finalize"} <= got.keys()
    assert got["forward"]["calls"] == got["pool"]["calls"] == got["write"]["calls"] == n_batches
    assert got["batch"]["calls"] == n_batches and "batches-ahead" in got["batch"]["threads"]
    assert got["write"]["threads"] == ["cache-writer"]
    assert all(v["cpu_s"] >= 0 and v["wall_s"] > 0 for v in got.values())
    groups = op_groups(prof.events())
    assert groups["forward"]["matmul"] > 0 and groups["forward"]["softmax"] > 0 and groups["pool"]["matmul"] > 0
    assert groups["forward"]["range"] >= groups["forward"]["matmul"] + groups["forward"]["softmax"]
