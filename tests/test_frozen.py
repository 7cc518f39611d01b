"""probes.model.frozen.held_in: the whole model in bf16 for a frozen forward, restored bit for bit."""

import copy

import pytest
import torch
from torch import nn
from transformers import (AutoModel, BertConfig, BertModel, DistilBertConfig, DistilBertModel, ElectraConfig,
                          ElectraModel, RobertaConfig, RobertaModel)

from probes.model import attention_function, hooks, packed
from probes.model.frozen import _exact_gelu, held_in, packed_linear_supported
from probes.model.inputs import pad
from probes.model.load import tiny_bert

BF16_CPU = packed_linear_supported(nn.Linear(1, 1), torch.bfloat16)


def test_held_in_runs_the_model_in_bf16_and_restores_it_bit_for_bit():
    enc = tiny_bert(max_position_embeddings=64)
    model = enc.model.eval()
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[2, 7, 9, 11, 13, 3]])  # (1, T)
    with torch.no_grad():
        y32 = model(input_ids=ids).last_hidden_state  # (1, T, D)
        with held_in(model, torch.bfloat16) as m:
            assert m is model
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert all(b.dtype == torch.bfloat16 for b in model.buffers() if b.is_floating_point())
            y16 = model(input_ids=ids).last_hidden_state
            inter = model.encoder.layer[0].intermediate
            x = torch.randn(1, 6, inter.dense.in_features).to(torch.bfloat16)  # (1, T, D)
            fused = inter(x)  # (1, T, F)
        again = model(input_ids=ids).last_hidden_state
    assert y16.dtype == torch.bfloat16 and (y16.float() - y32).abs().max() < 0.1
    assert torch.equal(again, y32)  # the float32 model is back, bit for bit: same Parameters, same data
    assert all(p is params[n] and p.dtype == torch.float32 and torch.equal(p, before[n])
               for n, p in model.named_parameters())
    assert not any("forward" in mod.__dict__ for mod in model.modules())
    assert type(inter.intermediate_act_fn).__name__ == "GELUActivation"
    # the (packed, GELU-fused) intermediate block equals dense then the exact GELU, computed here in float32
    w, b = inter.dense.weight.to(torch.bfloat16).float(), inter.dense.bias.to(torch.bfloat16).float()
    expected = nn.functional.gelu(x.float() @ w.T + b)
    assert (fused.float() - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_held_in_casts_a_tied_parameter_once():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Linear(4, 4))
    model[1].weight = lin.weight  # tied
    w = lin.weight.detach().clone()
    with held_in(model, torch.bfloat16):
        assert model[1].weight is lin.weight and lin.weight.dtype == torch.bfloat16
        y = model(torch.ones(2, 4, dtype=torch.bfloat16))  # (2, 4)
        assert y.dtype == torch.bfloat16
    assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight, w) and model[1].weight is lin.weight


def test_packed_linear_only_for_bf16_on_cpu():
    model = nn.Linear(4, 4)
    assert not packed_linear_supported(model, torch.float16)
    assert packed_linear_supported(model, torch.bfloat16) == (
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _eager_twin(model: nn.Module) -> nn.Module:
    """A separate plain transformers model (eager attention, not the project's path) with the same weights, fp32."""
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"
    twin = AutoModel.from_config(cfg, attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _padded_batch(lengths: list[int], vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded random ids of the given lengths: input_ids, attention_mask (B, T)."""
    g = torch.Generator().manual_seed(seed)
    return pad([torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths], 0)


def _bert_style(family: str) -> nn.Module:
    """A tiny random encoder of a BERT-style family (3 layers) on the project's attention path."""
    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "bert":
        model = tiny_bert(num_hidden_layers=3, max_position_embeddings=64).model
    elif family == "roberta":
        model = attention_function.prepare(RobertaModel(RobertaConfig(**sizes)).eval())
    else:
        model = attention_function.prepare(ElectraModel(ElectraConfig(embedding_size=16, **sizes)).eval())
    with torch.no_grad():  # peaked maps (random initial weights give near-uniform ones)
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(20.0)
            layer.attention.self.key.weight.mul_(20.0)
    return model


@pytest.mark.skipif(not BF16_CPU, reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_bert_style_encoder_on_packed_rows_matches_the_plain_forward(monkeypatch, family):
    """Held in bf16, a BERT-style encoder runs on packed rows (probes.model.packed): the maps captured at the real
    positions and the hidden states there match a plain fp32 eager forward of each sentence alone (an independent
    model) within bf16 rounding; padding rows of the maps are finite distributions, padding hidden states zero."""
    model = _bert_style(family).eval()
    twin = _eager_twin(model)
    lengths = [9, 3, 6, 2]
    batch = _padded_batch(lengths, model.config.vocab_size)
    calls = []
    call = packed.PackedLayer.__call__
    monkeypatch.setattr(packed.PackedLayer, "__call__", lambda self, *a: calls.append(1) or call(self, *a))

    def run():
        with held_in(model, torch.bfloat16), torch.inference_mode():
            with hooks.attention(model) as s:
                calls.clear()  # (finding the attention sites runs a forward of its own)
                hidden = s.run(**batch).last_hidden_state.float()  # (B, T, D)
                return hidden, s.attentions().float()  # (B, L, H, T, T)

    hidden, maps = run()
    assert len(calls) == 3  # one per layer: the packed path ran
    with monkeypatch.context() as m:  # the generic path held in bf16, for the scale of bf16 rounding
        m.setattr(packed, "bert_style_encoder", lambda *a: False)
        generic_hidden, generic_maps = run()
    assert not calls[3:]
    worst = dict(map=0.0, hidden=0.0, generic_map=0.0, generic_hidden=0.0)
    for k, n in enumerate(lengths):
        with torch.no_grad():
            ref = twin(input_ids=batch["input_ids"][k:k + 1, :n], output_attentions=True)
        ref_maps, ref_hidden = torch.stack(ref.attentions, 1)[0], ref.last_hidden_state[0]  # (L, H, n, n), (n, D)
        for name, h, a in (("", hidden, maps), ("generic_", generic_hidden, generic_maps)):
            worst[name + "map"] = max(worst[name + "map"], (a[k, :, :, :n, :n] - ref_maps).abs().max().item())
            worst[name + "hidden"] = max(worst[name + "hidden"], (h[k, :n] - ref_hidden).abs().max().item())
        assert torch.all(hidden[k, n:] == 0)
        pad_rows = maps[k, :, :, n:, :]  # (L, H, T - n, T)
        assert torch.isfinite(pad_rows).all() and torch.allclose(pad_rows.sum(-1), torch.ones(()), atol=1e-2)
    assert maps.max() > 0.5  # peaked maps: the comparison is not one of uniform rows
    # bf16 keeps 8 mantissa bits; the packed path rounds differently from the generic one (fused Q/K/V and
    # residuals, base-2 scores), not more
    assert 0 < worst["map"] <= max(1.5 * worst["generic_map"], 1e-2) and worst["map"] <= 0.05, worst
    assert worst["hidden"] <= max(1.5 * worst["generic_hidden"], 0.05) and worst["hidden"] <= 0.25, worst


@pytest.mark.skipif(not BF16_CPU, reason="no oneDNN bf16 on this CPU")
def test_packed_rows_give_way_to_the_generic_path_when_observed(monkeypatch):
    """With hooks on the encoder's modules (block internals here; likewise a replaced block forward, gradients,
    another attention implementation) the held model runs its generic forward: the same numbers as with the
    packed path switched off."""
    enc = tiny_bert(num_hidden_layers=2, max_position_embeddings=64)
    model = enc.model.eval()
    batch = _padded_batch([7, 4], model.config.vocab_size, seed=1)
    calls = []
    call = packed.PackedLayer.__call__
    monkeypatch.setattr(packed.PackedLayer, "__call__", lambda self, *a: calls.append(1) or call(self, *a))

    def run(**kw):
        with held_in(model, torch.bfloat16), torch.inference_mode(), hooks.attention(model, **kw) as s:
            calls.clear()  # (finding the attention sites and the layer parts runs forwards of their own)
            s.run(**batch)
            return s.attentions(), {l: s.block_output[l] for l in s.block_output}

    maps, blocks = run(internals=True)
    assert not calls and blocks
    monkeypatch.setattr(packed, "bert_style_encoder", lambda m, g: False)
    generic_maps, generic_blocks = run(internals=True)
    assert torch.equal(maps, generic_maps) and all(torch.equal(blocks[l], generic_blocks[l]) for l in blocks)


def test_softmax2_rows_is_the_softmax_also_for_a_row_far_below_the_largest_score():
    """Base-2 scores with a masked key: softmax over each row, from the whole tensor's largest score, and from the
    row-wise kernel when a row's scores lie too far below it (its sum would underflow)."""
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 3, 5, 5, generator=g) * 4).to(torch.bfloat16)  # (B, H, T, T)
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bfloat16)
    mask[1, :, :, 4] = torch.finfo(torch.bfloat16).min  # (B, 1, T, T) the second item's last key is padding

    def expected(s):
        return torch.softmax((s + mask).float() * packed.LN2, dim=-1)

    p = packed.softmax2_rows(scores, mask)
    assert p.dtype == torch.bfloat16 and (p.float() - expected(scores)).abs().max() <= 4e-3
    assert torch.all(p[1, :, :, 4] == 0)
    far = scores.clone()
    far[0, 1, 2] -= 300  # 2^-300 underflows float32
    p = packed.softmax2_rows(far, mask)
    assert torch.isfinite(p).all() and (p.float() - expected(far)).abs().max() <= 4e-3
    s32 = scores.float()  # computed in place on a float32 copy: never on the scores themselves
    kept = s32.clone()
    p32 = packed.softmax2_rows(s32, mask.float())
    assert torch.equal(s32, kept) and p32.dtype == torch.float32
    assert (p32 - expected(scores)).abs().max() <= 1e-6


def test_packed_rows_only_for_the_bert_block_structure():
    """The structure decides, not the model name: BERT, RoBERTa and ELECTRA encoders have it; DistilBERT's blocks,
    or a BERT whose feed-forward is not an exact GELU, keep the generic path."""
    small = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    yes = [tiny_bert().model, RobertaModel(RobertaConfig(**small)),
           ElectraModel(ElectraConfig(embedding_size=32, **small))]
    no = [DistilBertModel(DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
          BertModel(BertConfig(**small, hidden_act="relu"))]
    for m in yes:
        assert sum(packed.bert_style_encoder(x, _exact_gelu) for x in m.modules()) == 1, type(m).__name__
    for m in no:
        assert not any(packed.bert_style_encoder(x, _exact_gelu) for x in m.modules()), type(m).__name__
