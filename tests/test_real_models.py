"""The five real models end to end on a few UD EWT dev sentences: the packaged all-MiniLM-L6-v2 and the fetched
all-mpnet-base-v2, SmolLM2-135M, Gemma 3 270M and Qwen2.5-Coder-1.5B (``probes-fetch model=<name>``).

For each model: (a) ``probes.word_maps`` equals a plain eager forward of the model's own tokenization of the
joined sentence, pooled to words by loops; (b) ``head_stats`` and (c) ``dep_heads`` run through
``probes.analyze`` and give finite values of the model's layers x heads; (d) an attention-only probe trains for
one epoch (``train.py experiment=table3_attn_only``) and reports a finite test UAS (above chance for MiniLM).
The two larger decoders are marked ``big_model`` (``pytest -m "not big_model"`` leaves them out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoModel, AutoTokenizer

import probes
from conftest import ROOT, require_model, require_shared
from tests import reference
from tests.reference import eager_word_maps

pytestmark = pytest.mark.slow

# name -> (sentences for the map test, layers compared, train/dev/test sentences of the probe run)
PLAN = {
    "minilm": (4, None, (48, 16, 16)),
    "mpnet_base": (3, None, (24, 8, 8)),
    "smollm2": (3, None, (24, 8, 8)),
    "gemma3_270m": (3, [0, 8, 17], (16, 8, 8)),
    "qwen2_5_coder_1_5b": (2, [0, 14, 27], (8, 4, 4)),
}
BIG = ("gemma3_270m", "qwen2_5_coder_1_5b")
MAX_WORDS = 14  # the shortest dev sentences are read (a 1.5B model in float32 on a CPU)


def models_dir() -> str:
    """``paths.models_dir`` of the real conf/."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return str(compose(config_name="analyze").paths.models_dir)


def load(name: str):
    """The encoder ``conf/encoder/<name>.yaml`` builds (``encoder=<name>``)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[f"encoder={name}"])
    return instantiate(cfg.encoder)


def dev_sentences(n: int, max_words: int = MAX_WORDS) -> list[list[str]]:
    """The first ``n`` sentences of EWT dev of 4 to ``max_words`` words (FORM of the word lines: no multiword
    token ranges, no empty nodes), read from the CoNLL-U text by a loop."""
    path = require_shared() / "en_ewt-ud-dev.conllu"
    out, words = [], []
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if not line.strip():
            if 4 <= len(words) <= max_words:
                out.append(words)
            words = []
            if len(out) == n:
                break
        elif not line.startswith("#"):
            cols = line.split("\t")
            if cols[0].isdigit():
                words.append(cols[1])
    return out


def reference_source(name: str) -> tuple[str, dict]:
    """Where the reference forward reads the model: the packaged or fetched folder; a ``.gguf`` model's GGUF file
    itself (SmolLM2, through transformers' GGUF reader) or, for the larger ones, its converted folder
    (bit-identical to the GGUF: tests/test_fetch_model.py)."""
    if name == "minilm":
        from probes.model.load import packaged_minilm_path
        return packaged_minilm_path(), {}
    path = require_model(name)
    if path.suffix != ".gguf":
        return str(path), {}
    if name not in BIG:
        return str(path.parent), dict(gguf_file=path.name)
    from probes.model.fetched import converted_path
    return str(converted_path(name, models_dir())[0]), {}


def _marks(name: str) -> list:
    """``big_model`` for the two larger decoders; SmolLM2's tests run on the pytest-xdist worker that reads its GGUF
    file for the other tests of that file (``xdist_group("smollm2_gguf")``: :func:`tests.reference.gguf_reader`)."""
    if name in BIG:
        return [pytest.mark.big_model]
    return [pytest.mark.xdist_group("smollm2_gguf")] if name == "smollm2" else []


@pytest.fixture(scope="module", params=[pytest.param(n, marks=_marks(n)) for n in PLAN])
def real(request):
    """(name, encoder) of one real model; module scope: each model is loaded once for its tests."""
    name = request.param
    if name != "minilm":
        require_model(name)
    require_shared()
    enc = load(name)
    yield name, enc
    enc.release()


def test_word_maps_equal_an_eager_forward_pooled_by_loops(real):
    name, enc = real
    n, layers, _ = PLAN[name]
    sentences = dev_sentences(n)
    src, kwargs = reference_source(name)
    if "gguf_file" in kwargs:  # transformers' own GGUF reader, read once per session (tests/reference.py)
        model, tokenizer = reference.gguf_reader(str(require_model(name)))
        model = model.base_model  # the decoder without its LM head, as AutoModel reads it
    else:
        model = AutoModel.from_pretrained(src, attn_implementation="eager", dtype=torch.float32, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    got = probes.word_maps(enc, sentences, layers=layers, device="cpu")
    chosen = list(range(enc.num_layers)) if layers is None else layers
    for words, wm in zip(sentences, got):
        want, labels = eager_word_maps(model, tokenizer, words)
        assert wm.labels == labels, (wm.labels, labels)
        assert wm.maps.shape == (len(chosen), enc.num_heads, len(labels), len(labels))
        np.testing.assert_allclose(wm.maps, want[chosen], atol=1e-4, err_msg=f"{name}: {' '.join(words)}")
        if enc.causal:
            assert np.abs(np.triu(wm.maps, 1)).max() == 0.0


def test_head_stats_runs(real, tmp_path):
    name, enc = real
    result = probes.analyze("head_stats", encoder=enc, output_dir=tmp_path / "out", figures=False,
                            overrides=[f"paths.cache_dir={tmp_path / 'cache'}", f"paths.models_dir={models_dir()}"],
                            max_sentences=8)
    table = result.tables["head_stats"]  # long form: layer, head, stat, value
    L, H = enc.config.num_hidden_layers, enc.config.num_attention_heads
    assert table.stat.nunique() >= 5
    for stat, rows in table.groupby("stat"):
        assert sorted(zip(rows["layer"], rows["head"])) == [(l, h) for l in range(L) for h in range(H)], stat
        assert np.isfinite(rows.value.to_numpy(dtype=float)).all(), (name, stat)


def test_dep_heads_runs(real, tmp_path):
    name, enc = real
    result = probes.analyze("dep_heads", encoder=enc, output_dir=tmp_path / "out", figures=False,
                            overrides=[f"paths.cache_dir={tmp_path / 'cache'}", f"paths.models_dir={models_dir()}"],
                            max_sentences=16, min_count=1)
    dep = result.tables["dep_heads"]
    L, H = enc.config.num_hidden_layers, enc.config.num_attention_heads
    assert set(dep["layer"]) == set(range(L)) and set(dep["head"]) == set(range(H))
    acc = dep.accuracy.to_numpy(dtype=float)
    assert np.isfinite(acc).all() and ((acc >= 0) & (acc <= 1)).all(), name


def test_attention_probe_trains(real, tmp_path):
    name, enc = real
    n_train, n_dev, n_test = PLAN[name][2]
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    r = subprocess.run(
        [sys.executable, "train.py", "experiment=table3_attn_only", f"encoder={name}", "trainer.max_epochs=1",
         f"data.max_sentences={{train: {n_train}, dev: {n_dev}, test: {n_test}}}", "logger=none",
         f"paths.output_dir={out}", f"paths.cache_dir={tmp_path / 'cache'}", f"paths.models_dir={models_dir()}",
         "extract.trainer.accelerator=cpu", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    uas = metrics["test/uas"]
    assert np.isfinite(uas) and 0.0 <= uas <= 1.0, metrics
    if name == "minilm":
        assert uas > chance_uas(n_test), metrics  # one epoch on 48 sentences: 0.093 against 0.071


def chance_uas(n: int) -> float:
    """The expected UAS of a uniform guess of each word's head among the sentence's other words and the root
    (1 / n_words per word) over the first ``n`` sentences of EWT test."""
    path = require_shared() / "en_ewt-ud-test.conllu"
    lengths, words = [], 0
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if not line.strip():
            if words:
                lengths.append(words)
            words = 0
            if len(lengths) == n:
                break
        elif not line.startswith("#") and line.split("\t")[0].isdigit():
            words += 1
    return len(lengths) / sum(lengths)
