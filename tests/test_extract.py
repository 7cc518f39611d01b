import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from probes.model.load import tiny_bert
from probes.extract.cache import AttentionCache
from probes.extract.stage import AttentionExtractor, extract, length_batches
from probes.model.inputs import encode_words, pool_attention, pooling_matrix
from tests.conftest import ROOT, WORDS, chain_overrides

SENTS = [[WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9)] for i in range(40)] + [["Unbelievably", "long"]]
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def reference_maps(enc, words):
    """Word-level maps from a plain full forward with output_attentions (no hooks, no batching)."""
    (e,) = encode_words(enc.tokenizer, [words])
    out = enc.model(input_ids=torch.tensor([e.input_ids]), output_attentions=True)
    attn = torch.stack(out.attentions, 1)[0]  # (L, H, T, T)
    L, H, T, _ = attn.shape
    frm = pooling_matrix(e.word_of_piece, e.n_words, "mean")[None]
    to = pooling_matrix(e.word_of_piece, e.n_words, "sum")[None]
    return pool_attention(attn.reshape(1, L * H, T, T), frm, to)[0].reshape(L, H, e.n_words + 2, -1).numpy()


def test_extract_matches_plain_forward_and_reuses_cache(tmp_path):
    enc = tiny_bert(max_position_embeddings=128)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    cache = extract(enc, SENTS, key, tmp_path, TRAINER, max_tokens=64)
    assert len(cache) == len(SENTS) and cache.skipped == []
    for i in (0, 5, len(SENTS) - 1):
        m = cache[i]
        assert m.shape == (2, 4, len(SENTS[i]) + 2, len(SENTS[i]) + 2) and m.dtype == np.float16
        np.testing.assert_allclose(m.astype(np.float32), reference_maps(enc, SENTS[i]), atol=2e-3)
    mtime = (cache.path / "manifest.json").stat().st_mtime_ns
    again = extract(enc, SENTS, key, tmp_path, TRAINER, max_tokens=64)  # hit: nothing rewritten
    assert (again.path / "manifest.json").stat().st_mtime_ns == mtime


def test_long_sentences_are_skipped_and_counted_or_rejected(tmp_path):
    enc = tiny_bert(max_position_embeddings=16)
    sents = [["cat"] * 5, ["cat"] * 30, ["dog"] * 3]
    cache = extract(enc, sents, dict(encoder=enc.name, dataset="s", split="x"), tmp_path, TRAINER)
    assert cache.skipped == [1] and 1 not in cache and 0 in cache and 2 in cache
    with pytest.raises(KeyError, match="skipped"):
        cache[1]
    with pytest.raises(ValueError, match="exceed 16 wordpieces"):
        extract(enc, sents, dict(encoder=enc.name, dataset="s", split="y"), tmp_path, TRAINER, long_sentences="error")


class Crash(pl.Callback):
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 2:
            raise RuntimeError("simulated crash")


def test_interrupted_extraction_leaves_nothing_complete_and_rerun_matches(tmp_path):
    enc = tiny_bert()
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    crashing = lambda callbacks: TRAINER(callbacks=callbacks + [Crash()])  # noqa: E731
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract(enc, SENTS, key, tmp_path / "a", crashing, max_tokens=48)
    entries = list((tmp_path / "a" / "attention").iterdir())
    assert [e.name.endswith(".partial") for e in entries] == [True]
    with pytest.raises(FileNotFoundError):
        AttentionCache(entries[0].with_name(entries[0].name.removesuffix(".partial")))
    resumed = extract(enc, SENTS, key, tmp_path / "a", TRAINER, max_tokens=48)
    clean = extract(enc, SENTS, key, tmp_path / "b", TRAINER, max_tokens=48)
    assert not list((tmp_path / "a" / "attention").glob("*.partial"))
    for i in range(len(SENTS)):
        np.testing.assert_array_equal(resumed[i], clean[i])


def test_early_stop_hooks_equal_full_forward():
    enc = tiny_bert()
    ex = AttentionExtractor(enc.model)
    ids = torch.tensor([encode_words(enc.tokenizer, [SENTS[3]])[0].input_ids])
    hooked = ex._attentions(ids, torch.ones_like(ids))
    full = enc.model(input_ids=ids, output_attentions=True).attentions
    assert len(hooked) == enc.num_layers
    for a, b in zip(hooked, full):
        torch.testing.assert_close(a, b)


def test_length_batches_respect_budget():
    lengths = [5, 50, 7, 20, 20, 3, 49]
    batches = length_batches(lengths, max_tokens=100, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1


def _extract_cli(chain_data, tmp_path, cache, devices):
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("paths.cache_dir")
            and not o.startswith("paths.output_dir")]
    over += ["splits=[dev,test]", f"extract.trainer.devices={devices}", "extract.max_tokens=64",
             f"hydra.run.dir={tmp_path / f'run{devices}'}"]
    if devices > 1:
        over.append("extract.trainer.strategy=ddp")
    env = dict(os.environ, PROBES_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "probes.extract", *over], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted((cache / "attention").iterdir())


def test_two_process_ddp_extraction_equals_single_process(chain_data, tmp_path):
    one = _extract_cli(chain_data, tmp_path, tmp_path / "c1", 1)
    two = _extract_cli(chain_data, tmp_path, tmp_path / "c2", 2)
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 2
    for a, b in zip(one, two):
        ca, cb = AttentionCache(a), AttentionCache(b)
        assert len(json.loads((b / "manifest.json").read_text())["shards"]) == 2  # one shard per rank
        for i in range(len(ca)):
            np.testing.assert_array_equal(ca[i], cb[i])


def test_random_encoder_name_covers_its_shape():
    """The encoder name is part of the cache key: any architecture change must change it."""
    from probes.model.load import tiny_bert

    a, b = tiny_bert(intermediate_size=64), tiny_bert(intermediate_size=48)
    assert a.name != b.name and a.name == tiny_bert(intermediate_size=64).name
