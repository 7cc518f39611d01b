"""Hidden-state cache: per-word states equal a plain forward of each sentence alone pooled by hand
(mean or first piece, chosen layers), keyed entries, lazy per-layer reads, clear errors; tiny BERT and RoBERTa."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_CONLLU, compose_train
from probes.data.sources import Treebank
from probes.extract.representations import (RepresentationCache, build_hidden_cache, cached_hidden_path,
                                            ensure_hidden_caches)
from probes.extract.settings import ExtractSettings
from probes.model.hidden import hidden_states
from probes.model.tiny import tiny_encoder
from tests.reference import text_pieces

# conf/extract with small batches on the CPU, as a plain dict (the entry points take either)
EXTRACT = OmegaConf.to_container(compose_train(
    ["extract.precision=32-true", "extract.max_tokens=64", "extract.max_batch_size=2", "extract.max_pairs=null",
     "extract.trainer.accelerator=cpu", "+extract.trainer.enable_progress_bar=false"]).extract, resolve=True)


@pytest.fixture(scope="module")
def treebank(tmp_path_factory) -> Treebank:
    d = tmp_path_factory.mktemp("tb")
    (d / "tiny").mkdir()
    for split in ("dev", "test"):
        (d / "tiny" / f"tiny-{split}.conllu").write_text(TINY_CONLLU)
    return Treebank(name="tiny", data_dir=str(d), subdir="tiny", files={"dev": "tiny-dev.conllu", "test": "tiny-test.conllu"},
                    download=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")  # tiny models built once for the module


def _by_hand(encoder, words: list[str], layer: int, pooling: str) -> np.ndarray:
    """(n, D): one sentence alone as running text (the tokenizer on the joined words, each piece's word from its
    characters: :func:`tests.reference.text_pieces`) through the base model (transformers' own hidden_states),
    pooled by hand."""
    ids, wids = text_pieces(encoder.tokenizer, words)
    x = torch.tensor([ids])
    with torch.no_grad():
        states = encoder.base(input_ids=x, attention_mask=torch.ones_like(x),
                              output_hidden_states=True).hidden_states[layer][0]  # (T, D)
    out = []
    for w in range(len(words)):
        pieces = [t for t, x in enumerate(wids) if x == w]
        out.append(states[pieces].mean(0) if pooling == "mean" else states[pieces[0]])
    return torch.stack(out).numpy()


@pytest.mark.parametrize("family,pooling,layers", [("bert", "mean", None), ("roberta", "first", [0, 2])])
def test_cache_equals_a_plain_forward_pooled_by_hand(tmp_path, models, treebank, family, pooling, layers):
    enc = tiny_encoder(family, root=models)
    hidden = dict(layers=layers, pooling=pooling)
    cache = build_hidden_cache(enc, treebank, "dev", EXTRACT, hidden, str(tmp_path / "cache"))
    assert cache.path.parent.name == "hidden" and cache.layers == (layers or [0, 1, 2])
    assert cache.dim == enc.config.hidden_size
    sentences = treebank.read("dev")
    assert len(cache) == len(sentences)
    for i, s in enumerate(sentences):
        whole = cache[i]  # (L', n, D)
        assert whole.dtype == np.float16 and whole.shape == (len(cache.layers), s.n, cache.dim)
        for k, l in enumerate(cache.layers):
            ref = _by_hand(enc, list(s.words), l, pooling)
            np.testing.assert_allclose(cache.layer(i, l).astype(np.float32), ref, atol=5e-3, rtol=2e-3)
            np.testing.assert_array_equal(cache.layer(i, l), whole[k])
    # same key: found without the weights; another pooling or layer set: another entry
    assert cached_hidden_path(enc, treebank, "dev", EXTRACT, hidden, str(tmp_path / "cache")) == cache.path
    other = dict(hidden, pooling="first" if pooling == "mean" else "mean")
    assert cached_hidden_path(enc, treebank, "dev", EXTRACT, other, str(tmp_path / "cache")) is None


def test_ensure_reuses_entries_and_errors_are_clear(tmp_path, models, treebank):
    enc = tiny_encoder("bert", root=models)
    hidden = dict(layers=[1], pooling="mean")
    caches = ensure_hidden_caches(enc, treebank, ["dev", "test"], EXTRACT, hidden, str(tmp_path / "cache"), child=False)
    assert set(caches) == {"dev", "test"} and not list((tmp_path / "cache" / "hidden").glob("*.partial"))
    stamp = (caches["dev"].path / "manifest.json").stat().st_mtime_ns
    again = ensure_hidden_caches(enc, treebank, ["dev"], EXTRACT, hidden, str(tmp_path / "cache"), child=False)
    assert (again["dev"].path / "manifest.json").stat().st_mtime_ns == stamp  # a hit, not rebuilt
    with pytest.raises(KeyError, match=r"layer 2 is not in hidden-state cache .* \(stored: \[1\]\)"):
        caches["dev"].layer(0, 2)
    with pytest.raises(ValueError, match=r"out of range 0\.\.2"):
        build_hidden_cache(enc, treebank, "dev", EXTRACT, dict(layers=[3], pooling="mean"), str(tmp_path / "c2"))
    with pytest.raises(ValueError, match="pooling"):
        build_hidden_cache(enc, treebank, "dev", EXTRACT, dict(layers=[0], pooling="sum"), str(tmp_path / "c3"))
    with pytest.raises(FileNotFoundError, match="no complete hidden-state cache"):
        RepresentationCache(tmp_path / "nowhere")


def test_hidden_states_layer_range(models):
    enc = tiny_encoder("bert", root=models)
    ids = torch.tensor([[enc.tokenizer.cls_token_id, enc.tokenizer.sep_token_id]])
    out = hidden_states(enc.model, [2, 0], input_ids=ids, attention_mask=torch.ones_like(ids))
    assert list(out) == [0, 2] and out[2].shape == (1, 2, enc.config.hidden_size)
    with pytest.raises(ValueError, match=r"\[3\] out of range 0\.\.2"):
        hidden_states(enc.model, [3], input_ids=ids, attention_mask=torch.ones_like(ids))


def test_child_process_builds_the_entries_built_here(tmp_path, treebank):
    """The runner's child process (encoder given as its config) writes the entries an in-process build writes,
    byte for byte, under the same names; a second call finds them without a child."""
    cfg = compose_train(["encoder=tiny"])
    hidden = dict(layers=[0, 2], pooling="first")
    child = ensure_hidden_caches(cfg.encoder, treebank, ["dev", "test"], EXTRACT, hidden, str(tmp_path / "a"),
                                 {"test": 1}, child=True)
    here = ensure_hidden_caches(cfg.encoder, treebank, ["dev", "test"], EXTRACT, hidden, str(tmp_path / "b"),
                                {"test": 1}, child=False)
    assert len(child["dev"]) == len(treebank.read("dev")) and len(child["test"]) == 1
    for split in ("dev", "test"):
        a, b = child[split].path, here[split].path
        assert a.name == b.name
        for f in sorted(p.name for p in a.iterdir()):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
    stamp = (child["dev"].path / "manifest.json").stat().st_mtime_ns
    again = ensure_hidden_caches(cfg.encoder, treebank, ["dev"], EXTRACT, hidden, str(tmp_path / "a"), child=True)
    assert (again["dev"].path / "manifest.json").stat().st_mtime_ns == stamp


def test_extract_settings_name_missing_and_unknown_keys():
    with pytest.raises(ValueError, match=r"missing keys \['maps', 'measures'\], unknown keys \['pooling'\]"):
        ExtractSettings.from_config(dict({k: v for k, v in EXTRACT.items() if k not in ("maps", "measures")},
                                         pooling="mean"))
    s = ExtractSettings.from_config(EXTRACT)
    assert ExtractSettings.from_config(s) is s and s.replace(maps="rollout").map_key()["maps"]["kind"] == "rollout"
    assert s.map_key() == {"maps": {"kind": "attention", "_target_": "probes.measures.attention.Attention"}}
