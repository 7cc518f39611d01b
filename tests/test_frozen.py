"""probes.model.frozen.held_in: the whole model in bf16 for a frozen forward, restored bit for bit."""

import torch
from torch import nn

from probes.model.frozen import held_in, packed_linear_supported
from probes.model.load import tiny_bert


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
