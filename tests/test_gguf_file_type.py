"""The quantization a GGUF file's header names (``general.file_type``) and its tensors' types, as the decoders'
records state them (``probes.model.load.gguf_file_type``, ``gguf_weights``: read by walking the header), against
the gguf package's own reader on small files written with its writer: keys before it of every kind (strings,
arrays of strings and numbers, scalars), tensors of two types, a file without a file type, and a header cut
short."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from probes.model.load import ModelFileError, gguf_file_type, gguf_metadata, gguf_weights


def write_gguf(path, file_type: int | None, n_tokens: int = 300) -> None:
    """A small GGUF file: a vocabulary (array of strings), scores (array of floats), scalars of several types and a
    string before ``general.file_type`` (left out when None), then one tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_name("tiny test model")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" * (1 + i % 3) for i in range(n_tokens)])
    w.add_token_scores([float(i) / 7 for i in range(n_tokens)])
    w.add_token_types([1 + i % 2 for i in range(n_tokens)])
    w.add_bool("tiny.flag", True)
    w.add_float64("tiny.scale", 0.125)
    w.add_int64("tiny.offset", -5)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_string("tiny.after", "a key after the file type")
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))  # 32 weights in F32
    w.add_tensor("output_norm.weight", np.ones((96,), dtype=np.float16))  # 96 in F16: 75 % of the 128
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reader_value(path, key: str):
    """The gguf package's own reading of a scalar or string key (the independent reference)."""
    field = gguf.GGUFReader(str(path)).fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value[0].item()


@pytest.mark.parametrize("file_type, name", [(gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"),
                                             (gguf.LlamaFileType.MOSTLY_Q4_1, "Q4_1"),
                                             (gguf.LlamaFileType.ALL_F32, "F32")])
def test_file_type_equals_the_gguf_reader(tmp_path, file_type, name):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, int(file_type))
    assert reader_value(path, "general.file_type") == int(file_type)
    assert gguf_file_type(path) == name
    reader = gguf.GGUFReader(str(path))
    n = {t.tensor_type.name: int(t.n_elements) for t in reader.tensors}
    assert n == {"F32": 32, "F16": 96}
    assert gguf_weights(path, "dequantized to float32 at fetch") == (
        f"GGUF {name} (F16 75 %, F32 25 % of the weights), dequantized to float32 at fetch")
    for key in ("general.name", "tiny.scale", "tiny.offset", "tiny.flag", "tiny.after"):  # before and after it
        assert gguf_metadata(path, key) == reader_value(path, key), key
    assert gguf_metadata(path, "no.such.key") is None


def test_a_file_without_a_file_type(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, None)
    assert gguf_file_type(path) is None
    assert gguf_weights(path, "dequantized on load") == (
        "GGUF (no file type in its header) (F16 75 %, F32 25 % of the weights), dequantized on load")


def test_a_cut_header_or_another_file_is_named(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, 15, n_tokens=5000)
    os.truncate(path, 2000)  # inside the vocabulary, before the file type
    with pytest.raises(ModelFileError, match=rf"^{path}: the GGUF header ends early .*truncated"):
        gguf_file_type(path)
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelFileError, match=rf"^{path}: not a GGUF file"):
        gguf_file_type(path)
