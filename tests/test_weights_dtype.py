"""encoder.dtype: the weights' dtype (float32, bfloat16, float16), the cache key field it adds, the precisions
that compute on it, and errors naming the key."""

import pytest
import torch
from transformers import AutoModel

import probes
from probes.config import ConfigTypeError, check_types, compose
from probes.extract.cache import cache_key_hash
from probes.extract.precision import candidates_for, resolve_precision
from probes.model.frozen import compute_in, computes_in
from probes.model.hooks import attention
from probes.model.load import load_encoder
from probes.model.tiny import tiny_folder

SENTENCES = ["the cat sat on the mat .", "a big dog saw the small red house and liked it"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("bert", root=tmp_path_factory.mktemp("models"), num_layers=3)


def plain_attentions(folder, dtype: torch.dtype) -> list[torch.Tensor]:
    """Reference: transformers' own eager attention probabilities, L x (B, H, T, T), of weights loaded in dtype."""
    model = AutoModel.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager").eval()
    tok = probes.load_encoder(str(folder)).tokenizer
    batch = tok(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        return list(model(**batch, output_attentions=True).attentions)


def captured(encoder, precision: str = "32-true") -> list[torch.Tensor]:
    """The project's captured maps, L x (B, H, T, T), under ``precision``'s compute dtypes."""
    batch = encoder.tokenizer(SENTENCES, return_tensors="pt", padding=True)
    with compute_in(encoder.model, precision), torch.inference_mode(), attention(encoder.model) as s:
        s.run(**batch)
        return [s.probs[l] for l in range(encoder.num_layers)]


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_weights_load_in_that_dtype_and_compute_in_it(folder, name, dtype):
    enc = load_encoder(str(folder), dtype=name)
    assert enc.dtype == dtype
    assert {p.dtype for p in enc.model.parameters() if p.is_floating_point()} == {dtype}
    maps, ref, ref32 = captured(enc), plain_attentions(folder, dtype), plain_attentions(folder, torch.float32)
    for m, r, r32 in zip(maps, ref, ref32):
        assert m.dtype == dtype
        torch.testing.assert_close(m.float(), r.float(), rtol=0, atol=2e-3)
        assert (m.float() - r32).abs().max() > 0  # the half weights are what the forward used


def test_float32_is_the_default_and_its_key_has_no_dtype_field(folder):
    default, explicit = load_encoder(str(folder)), load_encoder(str(folder), dtype="float32")
    assert default.dtype == explicit.dtype == torch.float32
    assert default.key_fields() == explicit.key_fields() == {"causal": False, "bos": False}  # no weights_dtype field
    for m, r in zip(captured(default), plain_attentions(folder, torch.float32)):
        torch.testing.assert_close(m, r, rtol=0, atol=1e-6)


def test_half_weights_are_named_in_the_cache_key(folder):
    fields = {name: load_encoder(str(folder), dtype=name).key_fields() for name in ("float32", "bfloat16", "float16")}
    assert fields["bfloat16"] == {**fields["float32"], "weights_dtype": "bfloat16"}
    assert fields["float16"] == {**fields["float32"], "weights_dtype": "float16"}
    assert len({cache_key_hash(dict(precision="32-true", **f)) for f in fields.values()}) == 3


def test_precisions_that_would_round_half_weights_again_are_refused(folder):
    bf16, fp16 = load_encoder(str(folder), dtype="bfloat16"), load_encoder(str(folder), dtype="float16")
    for enc, precision in ((bf16, "16-mixed"), (fp16, "bf16-mixed"), (bf16, "64-true")):
        with pytest.raises(ValueError, match=rf"extract.precision={precision}.*encoder.dtype="):
            with compute_in(enc.model, precision):
                pass
        with pytest.raises(ValueError, match="encoder.dtype"):
            resolve_precision(precision, "cpu", bf16 if enc is bf16 else fp16, margin=1.3)
    assert resolve_precision("bf16-mixed", "cpu", bf16, margin=1.3) == "bf16-mixed"
    assert resolve_precision("32-true", "cpu", fp16, margin=1.3) == "32-true"
    assert computes_in("32-true", torch.bfloat16) == torch.bfloat16  # no cast: the key's weights_dtype says so
    assert computes_in("16-mixed", torch.float32) == torch.float16
    assert "32-true" in candidates_for("cpu", torch.bfloat16)
    assert all(computes_in(c, torch.bfloat16) is not None for c in candidates_for("cpu", torch.bfloat16))
    assert [c for c in ("16-mixed", "bf16-mixed", "32-true") if computes_in(c, torch.bfloat16)] == ["bf16-mixed",
                                                                                                   "32-true"]


def test_bf16_weights_under_bf16_mixed_equal_float32_weights_held_in_bf16(folder):
    held = captured(load_encoder(str(folder)), "bf16-mixed")
    loaded = captured(load_encoder(str(folder), dtype="bfloat16"), "bf16-mixed")
    for a, b in zip(held, loaded):
        assert a.dtype == b.dtype == torch.bfloat16
        # equal to the last bit where bf16 is emulated (Zen 3); a CPU with native bf16 kernels (AVX512-BF16, AMX)
        # accumulates the two in another order: there at most two bf16 steps apart (2^-7 relative each), on few
        # entries (measured on a Zen 4: 0.3-1.6 % of them, by 2^-11 at most)
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=1e-6)
        assert (a != b).float().mean() < 0.05


@pytest.mark.parametrize("bad", ["float64", "bf16", "half", 16])
def test_a_bad_dtype_names_encoder_dtype(folder, bad):
    with pytest.raises(ValueError, match=r"encoder\.dtype=.*float32, bfloat16, float16"):
        load_encoder(str(folder), dtype=bad)


def test_the_config_passes_dtype_through_and_checks_it(folder):
    cfg = compose("analyze", ["encoder=auto", f"encoder.name_or_path={folder}", "encoder.dtype=bfloat16"])
    check_types(cfg)
    assert probes.load_encoder(str(folder), dtype="bfloat16").dtype == torch.bfloat16  # the public API
    assert probes.load_encoder(None, dtype="float16").dtype == torch.float16  # the packaged default
    with pytest.raises(ConfigTypeError, match=r"encoder\.dtype: expected one of 'float32', 'bfloat16', 'float16'"):
        check_types(compose("analyze", ["encoder=auto", f"encoder.name_or_path={folder}", "encoder.dtype=fp8"]))
    for name in ("auto", "bert_base_uncased", "minilm", "minilm_random", "smollm2"):
        node = compose("analyze", [f"encoder={name}"]).encoder
        assert node.dtype == "float32" and node.device_map is None, name
