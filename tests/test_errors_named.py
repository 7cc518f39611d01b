"""Errors that name the fault, raised before any long work: a damaged model folder or .gguf file (the file and
what is wrong), an unknown extraction precision (the key and the allowed values), dep_heads on sentences without
trees, a word that is not a string (sentence, word, type), a full disk (the path), an unknown hub id offline (at
once, naming the id)."""

import errno
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

import probes
from probes.config import ConfigTypeError, check_types
from probes.extract import cache as C
from probes.extract import precision as P
from probes.extract import stage, writer
from probes.extract.attention_caches import ensure_caches
from probes.extract.settings import ExtractSettings
from probes.io import DiskFullError, atomic_write, atomic_write_text
from probes.model import load as L
from probes.model.load import ModelFileError, load_encoder, tiny_bert
from probes.model.tiny import tiny_folder
from probes.train import train
from tests.conftest import WORDS, chain_overrides, compose_train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_folder("bert", root=tmp_path_factory.mktemp("tiny"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- model files
def test_corrupt_config_json_names_the_file(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "corrupt")
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": ')
    with pytest.raises(ModelFileError, match=rf"^{folder / 'config.json'}: not valid JSON \(Expecting value at line "
                                             r"1, column 39; 38 bytes\): the file is damaged or truncated") as e:
        load_encoder(str(folder))
    assert "hub" not in str(e.value)  # not "neither a local folder nor reachable on the hub"
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["model_type"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=rf"^{folder / 'config.json'}: no model_type key"):
        load_encoder(str(folder))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match=rf"^{folder / 'config.json'}: expected a JSON object"):
        load_encoder(str(folder))


def test_empty_or_incomplete_model_folder_names_what_is_missing(tiny_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^{empty}: the model folder is empty"):
        load_encoder(str(empty))
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=rf"^{empty / 'config.json'}: missing, .* holds notes.txt"):
        load_encoder(str(empty))
    folder = _copy(tiny_dir, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{folder}: no weights file"):
        load_encoder(str(folder))
    assert load_encoder(str(folder), random_init=True).num_layers == 2  # random weights need no file


def test_truncated_safetensors_is_named_before_the_weights_load(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "cut")
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(ModelFileError, match=rf"^{weights}: truncated: [\d,]+ bytes on disk, its header says"):
        load_encoder(str(folder))  # at load_encoder, not when the weights are first used
    os.truncate(weights, 4)
    with pytest.raises(ModelFileError, match=rf"^{weights}: not a readable safetensors file"):
        load_encoder(str(folder))


def test_truncated_gguf_names_the_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.truncate(path, path.stat().st_size - 1000)  # the tensor data ends early, as an interrupted download
    with pytest.raises(ModelFileError, match=rf"^{path}: not a complete GGUF file \([\d,]+ bytes on disk; the "
                                             r"reader says: cannot reshape .*truncated"):
        load_encoder(str(path))
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelFileError, match=rf"^{path}: not a complete GGUF file .*magic"):
        load_encoder(str(path))


# ----------------------------------------------------------------------------- hub ids
def test_unknown_hub_id_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"^encoder 'nobody-here/no-such-model-42': no local folder of that "
                                                r"name, and no copy in the Hugging Face cache .*HF_HUB_OFFLINE"):
        load_encoder("nobody-here/no-such-model-42")
    assert time.monotonic() - t0 < 2  # no retries


def test_unknown_hub_id_with_the_hub_unreachable_fails_at_once(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(L.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(L, "hub_reachable", lambda timeout_s=3.0: False)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"^encoder 'nobody-here/no-such-model-42': no local folder of that "
                                                r"name, no copy .* and the hub \(https?://.*\) is not reachable"):
        load_encoder("nobody-here/no-such-model-42")
    assert time.monotonic() - t0 < 2


def test_a_missing_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "hub_reachable", lambda timeout_s=3.0: pytest.fail("a path is not a hub id"))
    for name in (str(tmp_path / "no" / "such" / "model"), "./models/x", "~/nothing/here/at/all"):
        with pytest.raises(FileNotFoundError, match=r"no such local folder \(and not a Hugging Face hub id"):
            load_encoder(name)


# ----------------------------------------------------------------------------- extraction precision
def test_unknown_precision_names_the_key_and_the_allowed_values(chain_data, tmp_path):
    over = [o for o in chain_overrides(chain_data, tmp_path) if not o.startswith("extract.precision=")]
    cfg = compose_train(over + ["extract.precision=bogus"])
    with pytest.raises(ConfigTypeError, match=r"extract\.precision: expected one of 'auto', .*'32-true'.*, got "
                                              r"'bogus'"):
        check_types(cfg)
    t0 = time.monotonic()
    with pytest.raises(ConfigTypeError, match=r"extract\.precision"):
        train(cfg)  # before the treebank is read or anything is extracted
    assert time.monotonic() - t0 < 10 and not (tmp_path / "cache").exists()
    plain = dict(OmegaConf.to_container(cfg.extract, resolve=True), precision="bogus")
    with pytest.raises(ValueError, match=r"extract\.precision='bogus' is not a precision: expected one of auto, "):
        ExtractSettings.from_config(plain)
    with pytest.raises(ValueError, match=r"extract\.precision='bogus'"):  # in this process, no child started
        ensure_caches(cfg.encoder, probes.treebank(dev=chain_data / "chain" / "chain-dev.conllu"), ["dev"], plain,
                      tmp_path / "cache")
    assert not (tmp_path / "cache" / "attention").exists()
    assert set(P.PRECISIONS) >= {"auto", "32-true", "bf16-mixed", "16-mixed"}
    assert ExtractSettings.from_config(dict(plain, precision="bf16-mixed")).precision == "bf16-mixed"


# ----------------------------------------------------------------------------- the Python API
def test_dep_heads_on_plain_sentences_refuses_before_extracting(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"^dep_heads needs dependency trees: no word of split 'dev' \(.*"
                                         r"sentences\.conllu\) .*Plain sentences .*carry no trees"):
        probes.analyze("dep_heads", sentences=["The cat sat .", "Dogs bark"], output_dir=tmp_path / "out",
                       overrides=[f"paths.cache_dir={cache}"], figures=False)
    assert not (cache / "attention").exists()  # nothing was extracted


def test_word_that_is_not_a_string_is_named():
    with pytest.raises(TypeError, match=r"^sentence 0, word 1: expected a string, got 3 \(int\)"):
        probes.word_maps(None, [["The", 3, "cat"]])  # before any encoder is loaded
    with pytest.raises(TypeError, match=r"^sentence 1, word 2: expected a string, got None \(NoneType\)"):
        probes.word_maps(None, ["A b", ["x", "y", None]])
    with pytest.raises(TypeError, match=r"^sentence 0: expected a string or a list of words, got int"):
        probes.word_maps(None, [7])


# ----------------------------------------------------------------------------- a full disk
def test_full_disk_in_an_atomic_write_names_the_file(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")

    def fill(tmp: str) -> None:  # the kernel's ENOSPC, as a full disk gives it
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x" * 4096)

    target = tmp_path / "out" / "metrics.json"
    with pytest.raises(DiskFullError, match=rf"writing {target}: no space left on the device \(.* free there\)") as e:
        atomic_write(target, fill)
    assert e.value.errno == errno.ENOSPC and e.value.path == target
    assert list((tmp_path / "out").iterdir()) == []  # the temporary file is removed


def test_full_disk_in_a_text_write_names_the_file(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError, match=rf"^\[Errno 28\] writing {tmp_path / 'a.json'}: no space left"):
        atomic_write_text(tmp_path / "a.json", "{}")
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError):  # other errors pass unchanged
        atomic_write(tmp_path / "b.json", lambda tmp: open(tmp_path / "missing" / "x", "rb"))


def test_full_disk_while_writing_the_attention_cache_names_the_entry(tmp_path, monkeypatch):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")

    class FullShard(C.ShardWriter):
        def __init__(self, partial_dir, rank):
            super().__init__(partial_dir, rank)
            self._f.close()
            self._f = open("/dev/full", "wb", buffering=0)  # every write: ENOSPC from the kernel

    monkeypatch.setattr(writer.cache, "ShardWriter", FullShard)
    sents = [[WORDS[(i + k) % len(WORDS)] for k in range(4)] for i in range(4)]
    trainer = stage.pl.Trainer
    key = dict(encoder="tiny", dataset="full", split="x")
    with pytest.raises(DiskFullError, match=r"writing the cache entry's maps .*maps-r0\.f16: no space left") as e:
        stage.extract(tiny_bert(), sents, key, tmp_path, lambda callbacks: trainer(
            callbacks=callbacks, accelerator="cpu", devices=1, precision="32-true", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False))
    assert e.value.path.name == "maps-r0.f16" and e.value.path.parent.name.endswith(".partial")
    assert not C.is_complete(C.entry_dir(tmp_path, key))
