"""encoder.device_map: a model placed across devices (here the two this CPU machine has: the CPU and the disk,
accelerate's offload) gives the maps, word maps and cache entries of the model on one device, and stays where it
was placed."""

import functools

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from transformers import AutoModel

import probes
from probes.config import ConfigTypeError, check_types, compose
from probes.extract.stage import extract
from probes.model.frozen import compute_in
from probes.model.hooks import attention
from probes.model.load import PlacementError, input_device, load_encoder
from probes.model.tiny import tiny_folder

SENTENCES = ["The cat sat on the mat .", "A big dog saw the small red house and liked it very much ."]
TRAINER = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
# layers 0-1 in memory, layers 2-3 offloaded to the disk (weights read from the checkpoint file at each call)
SPLITS = {
    "bert": {"embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "cpu", "encoder.layer.2": "disk",
             "encoder.layer.3": "disk", "pooler": "cpu"},
    "qwen2": {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "cpu", "layers.2": "disk", "layers.3": "disk",
              "norm": "cpu", "rotary_emb": "cpu"},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_folder(family, root=root, num_layers=4) for family in SPLITS}


@pytest.fixture(scope="module")
def pairs(folders, tmp_path_factory):
    """{family: (the model on one device, the same model split over CPU and disk)}."""
    out = {}
    for family, folder in folders.items():
        offload = tmp_path_factory.mktemp(f"offload-{family}")
        out[family] = (load_encoder(str(folder), name=f"t-{family}"),
                       load_encoder(str(folder), name=f"t-{family}", device_map=SPLITS[family], offload_folder=offload))
    return out


def offloaded(model: nn.Module) -> set[str]:
    """Names of the parameters that sit on the meta device (offloaded: loaded only while their layer runs)."""
    return {n for n, p in model.named_parameters() if p.is_meta}


@pytest.mark.parametrize("family", list(SPLITS))
def test_split_model_is_really_split(pairs, family):
    whole, split = pairs[family]
    meta = offloaded(split.model)
    assert meta and all((".2." in n or ".3." in n) for n in meta)  # layers 2 and 3, nothing else
    assert not offloaded(whole.model) and set(split.model.hf_device_map.values()) == {"cpu", "disk"}
    assert input_device(split.model) == torch.device("cpu")


@pytest.mark.parametrize("family", list(SPLITS))
def test_captured_maps_equal_transformers_own_unsplit_forward(pairs, folders, family):
    _, split = pairs[family]
    plain = AutoModel.from_pretrained(str(folders[family]), dtype=torch.float32, attn_implementation="eager").eval()
    batch = split.tokenizer(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = plain(**batch, output_attentions=True).attentions  # L x (B, H, T, T)
    with torch.inference_mode(), attention(split.model) as s:
        s.run(**batch)
        got = [s.probs[l] for l in range(split.num_layers)]
    for g, r in zip(got, ref):
        assert g.device == torch.device("cpu")
        mask = batch["attention_mask"][:, None, :, None].bool()  # padded query rows aside
        torch.testing.assert_close(g.masked_fill(~mask, 0), r.masked_fill(~mask, 0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(SPLITS))
@pytest.mark.parametrize("kind", ["attention", "rollout"])
def test_word_maps_equal_the_unsplit_model(pairs, family, kind):
    whole, split = pairs[family]
    a = probes.word_maps(whole, SENTENCES, kind=kind, device="cpu", progress=False)
    b = probes.word_maps(split, SENTENCES, kind=kind, device="cpu", progress=False)
    for x, y in zip(a, b):
        assert x.labels == y.labels
        np.testing.assert_array_equal(x.maps, y.maps)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precisions_compute_the_split_model_as_the_whole(pairs, precision):
    whole, split = pairs["qwen2"]
    batch = whole.tokenizer(SENTENCES, return_tensors="pt", padding=True)
    out = []
    for enc in (whole, split):
        cast = torch.autocast("cpu", dtype=torch.float16, enabled=precision == "16-mixed")
        with compute_in(enc.model, precision), torch.inference_mode(), cast, attention(enc.model, internals=True) as s:
            s.run(**batch)
            out.append((s.attentions(), s.residual_sum[3]))
    assert out[0][0].dtype == out[1][0].dtype
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=0)
    assert offloaded(split.model)  # still placed afterwards


def test_extraction_through_the_trainer_equals_the_unsplit_model(pairs, tmp_path):
    whole, split = pairs["bert"]
    words = [s.split() for s in SENTENCES]
    a = extract(whole, words, dict(encoder="whole", dataset="s", split="x"), tmp_path, TRAINER)
    b = extract(split, words, dict(encoder="split", dataset="s", split="x"), tmp_path, TRAINER)
    for i in range(len(words)):
        np.testing.assert_array_equal(a[i], b[i])
    assert offloaded(split.model)


def test_moving_a_placed_model_leaves_it_in_place(pairs):
    _, split = pairs["qwen2"]
    before = offloaded(split.model)
    split.model.to("cpu")
    split.model.to(torch.device("cpu"), torch.float32)
    split.model.cuda()
    nn.Sequential(split.model).to("cpu")  # a parent module moved, as a Trainer moves its LightningModule
    assert offloaded(split.model) == before
    with pytest.raises(PlacementError, match="encoder.dtype"):
        split.model.half()
    with pytest.raises(PlacementError, match="encoder.dtype"):
        nn.Sequential(split.model).to(torch.bfloat16)
    assert {p.dtype for p in split.model.parameters()} == {torch.float32}


@pytest.mark.parametrize("memory", ["400KB", "100KB"])  # the weights take 667 KB: part of the layers, or all
def test_auto_map_with_max_memory_offloads_what_does_not_fit(folders, tmp_path, memory):
    whole = load_encoder(str(folders["qwen2"]))
    auto = load_encoder(str(folders["qwen2"]), device_map="auto", max_memory={"cpu": memory}, offload_folder=tmp_path)
    assert "disk" in set(auto.model.hf_device_map.values()) and offloaded(auto.model)
    for x, y in zip(probes.word_maps(whole, SENTENCES, device="cpu", progress=False),
                    probes.word_maps(auto, SENTENCES, device="cpu", progress=False)):
        np.testing.assert_array_equal(x.maps, y.maps)


def test_bad_placements_name_the_key(folders):
    folder = str(folders["bert"])
    with pytest.raises(ValueError, match=r"encoder\.device_map=5"):
        load_encoder(folder, device_map=5)
    with pytest.raises(ValueError, match=r"encoder\.device_map is an empty map"):
        load_encoder(folder, device_map={})
    with pytest.raises(ValueError, match=r"encoder\.max_memory"):
        load_encoder(folder, max_memory={"cpu": "1GB"})
    with pytest.raises(ValueError, match=r"encoder\.max_memory=.*\{device: size\}"):
        load_encoder(folder, device_map="auto", max_memory="1GB")
    with pytest.raises(ValueError, match=r"encoder\.device_map.*random_init"):
        load_encoder(folder, device_map="auto", random_init=True)
    with pytest.raises(ConfigTypeError, match=r"encoder\.device_map: expected str or a mapping or null"):
        check_types(compose("analyze", ["encoder=auto", f"encoder.name_or_path={folder}", "encoder.device_map=5"]))
    check_types(compose("analyze", ["encoder=auto", f"encoder.name_or_path={folder}", "encoder.device_map=auto"]))
