import copy
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from probes.analysis.clark import coref_heads, dep_heads
from probes.analysis.clark.coref_heads import coref_source
from probes.data.sources import Treebank
from probes.extract import precision as P
from probes.extract.attention_caches import ensure_cache, ensure_caches
from probes.extract.cache import AttentionCache, cache_key, entry_dir
from probes.extract.representations import HiddenStates
from probes.extract.runner import TreebankSplit, entry_path
from probes.extract.settings import ExtractSettings
from probes.extract.precision import precision_timer, timing_batches
from probes.extract.stage import AttentionExtractor, AttentionMaps, extract
from probes.maps import MapEngine, make_batch, pooling_matrices
from probes.measures.attention import Attention
from probes.model.frozen import linears_in
from probes.model.inputs import WORD_ENCODING, encode_words, length_batches
from probes.model.load import Encoder, tiny_bert
from tests.conftest import ROOT, WORDS, chain_overrides, compose_train
from tests.reference import pool_by_loops, pooling_by_hand, text_pieces, word_groups

SENTS = [[WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9)] for i in range(40)] + [["Unbelievably", "long"]]
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def eager_twin(enc: Encoder) -> torch.nn.Module:
    """A separate plain transformers model (eager attention, not the project's path) with the same weights."""
    from transformers import AutoModel

    cfg = copy.deepcopy(enc.config)
    cfg._attn_implementation = "eager"
    model = AutoModel.from_config(cfg, attn_implementation="eager")
    model.load_state_dict(enc.model.state_dict())
    return model.eval()


def reference_maps(ref: torch.nn.Module, tokenizer, words) -> np.ndarray:
    """(L, H, W, W) word-level maps from a plain eager forward (fp32, or as ``ref`` is held) with
    output_attentions of one sentence as running text (the tokenizer on the joined words,
    :func:`tests.reference.text_pieces`), pooled by explicit loops (rows mean, columns sum; nothing from
    probes.model.inputs)."""
    ids, wids = text_pieces(tokenizer, words)
    assert wids[0] is None and wids[-1] is None  # [CLS] ... [SEP]: W = words + 2 rows
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([ids]), output_attentions=True)
    attn = torch.stack(out.attentions, 1)[0].float().numpy()  # (L, H, T, T)
    return pool_by_loops(attn, word_groups(wids, len(words)))


def word_maps_fp32(enc: Encoder, sentences) -> list[np.ndarray]:
    """The extractor's float32 word maps of ``sentences`` in one padded batch (no float16 storage)."""
    encoded = encode_words(enc.tokenizer, sentences)
    batch = make_batch(encoded, list(range(len(encoded))), "mean", "sum", enc.tokenizer.pad_token_id)
    with torch.inference_mode():
        maps = MapEngine(enc.model, Attention()).word_maps(batch, torch.float32)  # (B, L, H, W, W)
    return [maps[k, :, :, :e.n_words + 2, :e.n_words + 2].numpy() for k, e in enumerate(encoded)]


def tiny_deberta_v2() -> Encoder:
    """Tiny random DeBERTa-v2 (relative c2p/p2c attention) with the packaged BERT vocabulary."""
    from transformers import DebertaV2Config, DebertaV2Model

    tok = tiny_bert().tokenizer
    cfg = DebertaV2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=128, relative_attention=True,
                          pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=32)
    torch.manual_seed(0)
    return Encoder(DebertaV2Model(cfg), tok, "tiny-deberta-v2", "random-0")


@pytest.mark.parametrize("make", [functools.partial(tiny_bert, max_position_embeddings=128), tiny_deberta_v2],
                         ids=["bert", "deberta-v2"])
def test_word_maps_equal_eager_fp32_forward(make):
    """Padded batch through the model layer == one sentence at a time through an eager twin, within 1e-4."""
    enc = make()
    ref = eager_twin(enc)
    sents = SENTS[:12] + SENTS[-1:]
    for words, got in zip(sents, word_maps_fp32(enc, sents)):
        np.testing.assert_allclose(got, reference_maps(ref, enc.tokenizer, words), atol=1e-4, rtol=0)


def test_attentions_stop_early_and_equal_full_forward():
    enc = tiny_bert()
    ids = torch.tensor([enc.tokenizer(" ".join(SENTS[3]))["input_ids"]])
    with torch.no_grad():
        got = torch.stack(MapEngine(enc.model, Attention()).piece_maps(ids, torch.ones_like(ids)), 1)  # (1, L, H, T, T)
        full = eager_twin(enc)(input_ids=ids, output_attentions=True).attentions
    assert got.shape == (1, enc.num_layers, enc.num_heads, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(got[0], torch.stack(full, 0)[:, 0], atol=1e-6, rtol=0)


def test_extract_matches_plain_forward_and_reuses_cache(tmp_path):
    enc = tiny_bert(max_position_embeddings=128)
    ref = eager_twin(enc)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    cache = extract(enc, SENTS, key, tmp_path, TRAINER, max_tokens=64)
    assert len(cache) == len(SENTS) and cache.skipped == []
    for i in (0, 5, len(SENTS) - 1):
        m = cache[i]
        assert m.shape == (2, 4, len(SENTS[i]) + 2, len(SENTS[i]) + 2) and m.dtype == np.float16
        # float16 storage: relative rounding 2^-11 of values <= (pieces per word)
        np.testing.assert_allclose(m.astype(np.float32), reference_maps(ref, enc.tokenizer, SENTS[i]), atol=2e-3)
    mtime = (cache.path / "manifest.json").stat().st_mtime_ns
    again = extract(enc, SENTS, key, tmp_path, TRAINER, max_tokens=64)  # hit: nothing rewritten
    assert (again.path / "manifest.json").stat().st_mtime_ns == mtime


def test_fp16_linears_in_casts_linear_weights_once_bit_identically():
    """16-mixed: every nn.Linear held in float16 (``linears_in``) gives, byte for byte, the maps of autocast casting
    the fp32 weights at every call; afterwards the model holds its own fp32 weights (the same Parameters)."""
    enc = tiny_bert(max_position_embeddings=128)
    before = {n: p.detach().clone() for n, p in enc.model.named_parameters()}
    params = {n: p for n, p in enc.model.named_parameters()}
    ex = AttentionExtractor(MapEngine(enc.model, Attention()))
    encoded = encode_words(enc.tokenizer, SENTS)
    batch = make_batch(encoded, list(range(len(SENTS))), "mean", "sum", enc.tokenizer.pad_token_id)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
        per_call = ex.predict_step(batch)["maps"]  # (B, L, H, W, W) float16, fp32 weights cast per call
        with linears_in(enc.model, "16-mixed"):
            assert all(m.weight.dtype == torch.float16 for m in enc.model.modules() if isinstance(m, torch.nn.Linear))
            once = ex.predict_step(batch)["maps"]
    assert torch.equal(once, per_call)
    assert all(p is params[n] and p.dtype == torch.float32 and torch.equal(p, before[n])
               for n, p in enc.model.named_parameters())
    with linears_in(enc.model, "32-true"):  # full precision: nothing is touched
        assert all(p is params[n] for n, p in enc.model.named_parameters())


def test_bf16_extraction_holds_the_whole_model_in_bf16(tmp_path):
    """bf16-mixed attention maps come from the model held wholly in bf16 (``compute_in``: no autocast casts, packed
    oneDNN linear layers with the GELU fused on a bf16 CPU, words pooled in bf16). They match an independent
    forward of a plain eager twin cast to bf16 (pooled in float32) and stay near the fp32 maps; fp32 extraction is
    unaffected (its maps are those of the plain fp32 path) and the model holds its fp32 Parameters afterwards."""
    enc = tiny_bert(max_position_embeddings=128)
    before = {n: p.detach().clone() for n, p in enc.model.named_parameters()}
    params = {n: p for n, p in enc.model.named_parameters()}
    ref = eager_twin(enc).to(torch.bfloat16)
    key = dict(encoder=enc.name, dataset="synthetic", split="dev")
    bf16 = extract(enc, SENTS, dict(key, p="bf16"), tmp_path, functools.partial(TRAINER, precision="bf16-mixed"))
    fp32 = extract(enc, SENTS, dict(key, p="fp32"), tmp_path, TRAINER)
    assert all(p is params[n] and p.dtype == torch.float32 and torch.equal(p, before[n])
               for n, p in enc.model.named_parameters())
    to_ref, to_fp32 = 0.0, 0.0
    for i, words in enumerate(SENTS):
        m = bf16[i].astype(np.float32)
        to_ref = max(to_ref, float(np.abs(m - reference_maps(ref, enc.tokenizer, words)).max()))
        to_fp32 = max(to_fp32, float(np.abs(m - fp32[i].astype(np.float32)).max()))
    # bf16 keeps 8 mantissa bits: one rounding of a value <= 1 is <= 2^-9; the twin differs in kernels and pooling
    assert to_ref <= 1e-2, to_ref
    assert 0 < to_fp32 <= 1e-2, to_fp32
    # fp32 entries are what they were: the plain fp32 path, pooled in float32
    ex = AttentionExtractor(MapEngine(enc.model, Attention()))
    encoded = encode_words(enc.tokenizer, SENTS)
    batch = make_batch(encoded, list(range(len(SENTS))), "mean", "sum", enc.tokenizer.pad_token_id)
    with torch.inference_mode():
        maps = ex.predict_step(batch)["maps"]
    for i, e in enumerate(encoded):
        W = e.n_words + 2
        assert np.array_equal(fp32[i], maps[i, :, :, :W, :W].numpy()), i


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


def test_length_batches_respect_budget():
    lengths = [5, 50, 7, 20, 20, 3, 49]
    batches = length_batches(lengths, max_tokens=100, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1


# ----------------------------------------------------------------------------- precision=auto
def test_auto_precision_is_remembered_per_shape_with_its_timings(tmp_path):
    store = tmp_path / "precision.json"
    calls = []

    def fake(seconds):
        def time_fn(p):
            calls.append(p)
            return seconds[p]
        return time_fn

    key = dict(cpu="Test CPU", torch="2.x", device="cpu", model_type="bert", layers=6, heads=12, hidden=384,
               intermediate=1536, threads=2)
    cands = ["32-true", "bf16-mixed"]
    assert P.choose(key, cands, fake({"32-true": 2e-4, "bf16-mixed": 3e-4}), store, margin=1.3) == "32-true"
    assert set(calls) == set(cands) and len(calls) >= 2 * 4  # a warm-up and at least 3 rounds each
    first = store.read_text()
    # remembered: no timing, same answer even if the machine would now time differently
    calls.clear()
    assert P.choose(key, cands, fake({"32-true": 9.0, "bf16-mixed": 1e-9}), store, margin=1.3) == "32-true"
    assert calls == [] and store.read_text() == first
    # another model shape is measured on its own; the first decision stays
    other = dict(key, layers=12, hidden=768, intermediate=3072)
    assert P.choose(other, cands, fake({"32-true": 5e-4, "bf16-mixed": 1e-4}), store, margin=1.3) == "bf16-mixed"
    data = json.loads(store.read_text())
    assert {v["precision"] for v in data.values()} == {"32-true", "bf16-mixed"} and len(data) == 2
    # the record holds the timings (best of each), the margin and the speed-up the decision was made on
    rec = data[P.key_string(other)]
    assert rec["timings"] == {"32-true": 5e-4, "bf16-mixed": 1e-4} and rec["margin"] == 1.3
    assert rec["speedup"] == pytest.approx(5.0) and rec["rounds"] >= 3 and len(rec["samples"]["32-true"]) == rec["rounds"]
    # another margin, or a different candidate set (e.g. a CPU that gained bf16), re-measures
    calls.clear()
    assert P.choose(key, cands, fake({"32-true": 2e-4, "bf16-mixed": 1e-4}), store, margin=1.5) == "bf16-mixed"
    assert calls
    calls.clear()
    assert P.choose(key, ["32-true", "bf16-mixed", "16-mixed"],
                    fake({"32-true": 3.0, "bf16-mixed": 2.0, "16-mixed": 1.0}), store, margin=1.3) == "16-mixed"
    assert set(calls) == {"32-true", "bf16-mixed", "16-mixed"}
    # a single candidate needs no timing
    assert P.choose(key, ["32-true"], fake({}), store, margin=1.3) == "32-true"


def test_resolve_precision_measures_once_and_keys_on_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "candidates", lambda device: ["32-true", "bf16-mixed"])
    timed = []

    def timer(encoder, encoded, device):
        timed.append(encoder.config.num_hidden_layers)
        return lambda p: {"32-true": 1.0, "bf16-mixed": 2.0}[p] * encoder.config.num_hidden_layers

    monkeypatch.setattr("probes.extract.precision.precision_timer", timer)
    a, b = tiny_bert(), tiny_bert(num_hidden_layers=3)
    assert P.resolve_precision("auto", "cpu", a, SENTS, tmp_path, lookup_only=True, margin=1.3) is None
    assert P.resolve_precision("auto", "cpu", a, SENTS, tmp_path, margin=1.3) == "32-true"
    assert P.resolve_precision("auto", "cpu", a, SENTS, tmp_path, lookup_only=True, margin=1.3) == "32-true"
    assert P.resolve_precision("auto", "cpu", b, SENTS, tmp_path, margin=1.3) == "32-true"
    assert timed == [2, 3]  # once per shape
    with pytest.raises(ValueError, match="precision_margin"):
        P.resolve_precision("auto", "cpu", a, SENTS, tmp_path)
    assert P.resolve_precision("bf16-mixed", "cpu", a) == "bf16-mixed"  # explicit: as given, nothing timed
    assert timed == [2, 3] and a._model is None  # deciding (fake timer) loaded no weights


def test_precision_timer_times_real_batches():
    enc = tiny_bert()
    encoded = encode_words(enc.tokenizer, SENTS)
    batches = timing_batches(encoded, enc.max_length, tokens=64, n=4)
    mid = sorted(e.n_pieces for e in encoded)[len(encoded) // 2]
    assert len(batches) == 4 and all(len(b) == 64 // mid for b in batches)  # same-size batches around the median
    f = precision_timer(enc, encoded, "cpu", tokens=64)
    assert f("32-true") > 0 and f("bf16-mixed") > 0
    assert precision_timer(enc, [], "cpu") is None


# ----------------------------------------------------------------------------- stage entry points
def test_ensure_caches_in_a_child_process_equal_in_process(chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path))
    treebank = instantiate(cfg.data.treebank)
    got = ensure_caches(cfg.encoder, treebank, ["dev", "test"], cfg.extract, str(tmp_path / "c1"),
                        {"dev": 12}, child=True)
    assert set(got) == {"dev", "test"} and len(got["dev"]) == 12 and len(got["test"]) == 30
    enc = instantiate(cfg.encoder)
    for split, cache in got.items():
        mine, _ = ensure_cache(enc, treebank, split, cfg.extract, str(tmp_path / "c2"), 12 if split == "dev" else None)
        assert cache.path.name == mine.path.name
        for i in range(len(cache)):
            np.testing.assert_array_equal(cache[i], mine[i])
    again = ensure_caches(cfg.encoder, treebank, ["dev"], cfg.extract, str(tmp_path / "c1"), {"dev": 12})
    assert again["dev"].path == got["dev"].path  # hit: no child needed
    with pytest.raises(RuntimeError, match="child process failed"):
        bad = OmegaConf.to_container(cfg.extract, resolve=True)
        bad["trainer"] = dict(bad["trainer"], _target_="no.such.Trainer")  # only the child builds the trainer
        ensure_caches(cfg.encoder, treebank, ["dev"], bad, str(tmp_path / "c3"))  # fails in the child


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
    a, b = tiny_bert(intermediate_size=64), tiny_bert(intermediate_size=48)
    assert a.name != b.name and a.name == tiny_bert(intermediate_size=64).name


def test_batched_pooling_matrices_equal_pooling_matrix():
    enc = tiny_bert()
    items = encode_words(enc.tokenizer, SENTS + [["Unbelievably", "éléphant", "antidisestablishmentarianism"]])
    T = max(e.n_pieces for e in items) + 3  # extra padding
    for mode in ("mean", "sum", "first"):
        m = pooling_matrices(items, mode, T)  # (B, W, T)
        for k, e in enumerate(items):
            ref = torch.zeros(m.shape[1], T)
            ref[:e.n_words + 2, :e.n_pieces] = pooling_by_hand(e.word_of_piece, e.n_words, mode)  # explicit loop
            assert torch.equal(m[k], ref), (mode, k)


# ----------------------------------------------------------------------------- cache keys
PIN_CONLLU = ("# sent_id = a\n1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n2\tdog\tdog\tNOUN\t_\t_\t3\tnsubj\t_\t_\n"
              "3\tbarked\tbark\tVERB\t_\t_\t0\troot\t_\t_\n\n# sent_id = b\n"
              "1\tUnbelievably\tunbelievably\tADV\t_\t_\t2\tadvmod\t_\t_\n2\tlong\tlong\tADJ\t_\t_\t0\troot\t_\t_\n\n")


def test_cache_keys_are_pinned(tmp_path):
    """The key of the default attention entry, field by field, and the entry names (key hashes) of every cache
    kind, pinned: a change of the key changes these names and must come with a new ``FORMAT_VERSION`` (or a new
    field) so that no entry is read under a key that does not describe it.

    Computed on the pinned treebank file, ``encoder=tiny`` and the ``extract`` node of conf/ with
    ``extract.precision=32-true``. A change of conf/extract/default.yaml's measure options changes the keys of
    that map kind, and should: it makes new entries.
    """
    (tmp_path / "pin").mkdir()
    (tmp_path / "pin" / "pin-dev.conllu").write_text(PIN_CONLLU)
    tb = Treebank(name="pin", data_dir=str(tmp_path), subdir="pin", files={"dev": "pin-dev.conllu"}, download=False)
    cfg = compose_train(["encoder=tiny", "extract.precision=32-true"])
    enc = instantiate(cfg.encoder)
    s = ExtractSettings.from_config(cfg.extract)
    dev = TreebankSplit(tb, "dev", None)

    def name(kind, source, settings, precision="32-true"):
        """The entry's name; the same as entry_dir's of cache_key."""
        actual = entry_path(enc, kind, source, settings, "/c", precision)
        assert actual.name == entry_dir("/c", cache_key(enc, source, kind, settings, precision), kind.folder).name
        return actual.name

    assert cache_key(enc, dev, AttentionMaps(), s, "32-true") == dict(
        format_version=2, encoder="tiny-bert-6dbe4a76e6ed", revision="random-6dbe4a76e6ed",
        word_encoding=WORD_ENCODING, max_length=128, precision="32-true", storage="float16", causal=False,
        bos=False, dataset="pin", split="dev", max_sentences=None, long_sentences="skip",
        data_sha256="09837535d941a0c68ce84f629e361967c1ecdd22c80f2a10ba2d3a5b992af0d8",
        from_words="mean", to_words="sum", layers=[0, 1],
        maps=dict(kind="attention", _target_="probes.measures.attention.Attention"))
    assert name(AttentionMaps(), dev, s) == "tiny-bert-6dbe4a76e6ed-pin-dev-a4bf1e12496f25b7"
    assert name(AttentionMaps(), TreebankSplit(tb, "dev", 1), s) == "tiny-bert-6dbe4a76e6ed-pin-dev-01e21b748701806b"
    assert name(AttentionMaps(), dev, s.replace(maps="rollout")) == "tiny-bert-6dbe4a76e6ed-pin-dev-f9c5bc85999fa334"
    assert name(AttentionMaps(), dev, s.replace(layers=[1, 0])) == "tiny-bert-6dbe4a76e6ed-pin-dev-b44489f7b04d599c"
    assert name(AttentionMaps(), dev, s.replace(maps="flow", max_length=20), "bf16-mixed") == \
        "tiny-bert-6dbe4a76e6ed-pin-dev-6e02eb8e583362ad"
    assert name(AttentionMaps(), dev, s, "bf16-mixed") == "tiny-bert-6dbe4a76e6ed-pin-dev-d891e84dd4031b9d"
    assert name(HiddenStates(None, "mean"), dev, s) == "tiny-bert-6dbe4a76e6ed-pin-dev-bcead9bf626836d7"
    assert name(HiddenStates((2, 0), "first"), dev, s) == "tiny-bert-6dbe4a76e6ed-pin-dev-594a09bb66b2828a"
    assert entry_path(enc, HiddenStates(None, "mean"), dev, s, "/c", "32-true").parent.name == "hidden"
    coref = coref_source([], [], "gum", "dev", "0123456789abcdef", None)
    fit = s.replace(max_length=40, long_sentences="error")
    assert name(AttentionMaps(), coref, fit) == "tiny-bert-6dbe4a76e6ed-gum-coref-segments-dev-6d40f851c2022b0e"
    assert name(AttentionMaps(), coref, fit.replace(maps="rollout")) == \
        "tiny-bert-6dbe4a76e6ed-gum-coref-segments-dev-90b80c62a8578597"
    # the measure node's options are in the key: another flow scale, another entry
    other_flow = dict(s.measures, flow=dict(s.measures["flow"], scale=1000000))
    assert name(AttentionMaps(), dev, s.replace(maps="flow", max_length=20, measures=other_flow), "bf16-mixed") != \
        "tiny-bert-6dbe4a76e6ed-pin-dev-6e02eb8e583362ad"
    with pytest.raises(ValueError, match="long_sentences=error"):
        name(AttentionMaps(), coref, s)  # word lists are keyed without the policy: only 'error' is allowed


def test_selected_layers_equal_those_of_the_full_cache_under_their_own_key(tmp_path):
    """``extract.layers``: the entry stores the chosen layers in the chosen order, equal to the same layers of
    an all-layer entry (a separate extraction); null and the list of every layer share a key, a subset gets its own; the
    analyses name heads by their real layer; a bad index fails before any work, naming the key."""
    (tmp_path / "pin").mkdir()
    (tmp_path / "pin" / "pin-dev.conllu").write_text(PIN_CONLLU)
    tb = Treebank(name="pin", data_dir=str(tmp_path), subdir="pin", files={"dev": "pin-dev.conllu"}, download=False)
    cfg = compose_train(["encoder=tiny", "extract.precision=32-true", "extract.trainer.accelerator=cpu"])
    enc = instantiate(cfg.encoder)
    s = ExtractSettings.from_config(cfg.extract)
    assert enc.num_layers >= 2
    every = list(range(enc.num_layers))
    assert s.layers is None and s.layer_key(enc) == s.replace(layers=every).layer_key(enc) == {"layers": every}
    dev = TreebankSplit(tb, "dev", None)
    full, sents = ensure_cache(enc, tb, "dev", s, tmp_path / "c")
    sub, _ = ensure_cache(enc, tb, "dev", s.replace(layers=[1, 0]), tmp_path / "c")
    assert full.path != sub.path and full.layers == every and sub.layers == [1, 0]
    assert sub.num_layers == 2 and sub.num_heads == full.num_heads
    assert entry_path(enc, AttentionMaps(), dev, s.replace(layers=every), tmp_path / "c", "32-true") == full.path
    for i in range(len(full)):
        np.testing.assert_array_equal(sub[i], full[i][[1, 0]])
    # dep_heads and coref_heads tables name heads by the model's layer, not the position in the entry
    acc = dep_heads.evaluate(sub, sents, sub.num_layers, sub.num_heads, progress=False)
    dep, _, table = dep_heads.tables(acc, min_count=1, layers=sub.layers)
    assert set(dep.layer) == {0, 1}
    full_dep, _, _ = dep_heads.tables(dep_heads.evaluate(full, sents, full.num_layers, full.num_heads, progress=False),
                                      min_count=1, layers=full.layers)
    key = ["relation", "layer", "head", "direction"]
    merged = dep.merge(full_dep, on=key, suffixes=("", "_full"))
    assert len(merged) == len(dep) and np.allclose(merged.accuracy, merged.accuracy_full)
    assert (table.name == [f"{l + 1}-{h + 1}" for l, h in zip(table.layer, table["head"])]).all()
    one, _ = ensure_cache(enc, tb, "dev", s.replace(layers=[1]), tmp_path / "c")
    _, _, table1 = dep_heads.tables(dep_heads.evaluate(one, sents, 1, one.num_heads, progress=False), 1, one.layers)
    assert set(table1.layer) == {1} and table1.name.str.startswith("2-").all()
    heads, ctable = coref_heads.tables(coref_heads.CorefAccumulator(1, one.num_heads), one.layers)
    assert set(heads.layer) == {1} and ctable.name.dropna().str.startswith("2-").all()
    for bad in ([enc.num_layers], [0, 0], [-1], []):
        with pytest.raises(ValueError, match=r"extract\.layers"):
            ensure_cache(enc, tb, "dev", s.replace(layers=bad), tmp_path / "c")
