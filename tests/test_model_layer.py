"""The model-access layer: loading, capture, stop, interventions, values, blocks, prefix reuse, inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, RobertaConfig

from probes.model import hooks, structure
from probes.model.families import usable_max_length
from probes.model.inputs import encode_words, length_batches, pad, pad_encoded
from probes.model.load import MissingHeadError, load_encoder, load_packaged, tiny_bert
from probes.model.prefix_cache import PrefixCache
from probes.model.tiny import tiny_encoder, tiny_folder

SENTS = [["The", "unbelievably", "quick", "fox", "."], ["A", "dog", "barked", "at", "the", "red", "cat", "!"], ["Hi"]]


@pytest.fixture(scope="module")
def enc():
    e = tiny_bert(num_hidden_layers=3, num_attention_heads=4, seed=3)
    with torch.no_grad():  # non-trivial LayerNorms so that every layer matters
        for n, p in e.model.named_parameters():
            if "LayerNorm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return e


def _batch(e, sents=SENTS):
    return pad_encoded(encode_words(e.tokenizer, sents), e.tokenizer.pad_token_id)


def test_capture_equals_eager_output_attentions_and_stops_early(enc):
    batch = _batch(enc)
    ref = AutoModel.from_config(enc.config, attn_implementation="eager").eval()
    ref.load_state_dict(enc.model.state_dict())
    with torch.no_grad():
        want = ref(**batch, output_attentions=True).attentions
        with hooks.attention(enc.model, [0, 1], stop=True) as s:
            out = s.run(**batch)
    assert out is None and sorted(s.probs) == [0, 1]  # stopped after layer 1, layer 2 never ran
    for l in (0, 1):
        torch.testing.assert_close(s.probs[l], want[l], atol=1e-6, rtol=0)
    assert s.attentions().shape == (3, 2, 4, batch["input_ids"].shape[1], batch["input_ids"].shape[1])


def test_values_and_outputs_are_the_heads_own(enc):
    batch = _batch(enc)
    with torch.no_grad(), hooks.attention(enc.model, values=True) as s:
        s.run(**batch)
    for l in range(3):
        v, o, a = s.value[l], s.output[l], s.probs[l]  # (B, H, T, d), (B, T, H, d), (B, H, T, T)
        torch.testing.assert_close(o, (a @ v).transpose(1, 2))
    # values equal the layer's value projection of its input hidden states (independent computation)
    hs = enc.model(**batch, output_hidden_states=True).hidden_states
    lin = enc.model.encoder.layer[1].attention.self.value
    B, T, D = hs[1].shape
    torch.testing.assert_close(s.value[1], lin(hs[1]).view(B, T, 4, D // 4).transpose(1, 2))


def test_gates_scale_head_outputs_and_give_head_importance(enc):
    batch = _batch(enc)
    gates = torch.ones(3, 4, requires_grad=True)
    with hooks.attention(enc.model, [], gates=gates, values=True) as s:
        out = s.run(**batch).last_hidden_state
        out.pow(2).sum().backward()
    assert gates.grad.shape == (3, 4) and torch.all(gates.grad != 0)
    zero = torch.ones(3, 4)
    zero[2, 1] = 0
    with torch.no_grad(), hooks.attention(enc.model, [2], gates=zero, values=True) as s:
        s.run(**batch)
    assert torch.all(s.output[2][:, :, 1] == 0) and torch.any(s.output[2][:, :, 0] != 0)


def test_retain_grad_gives_dloss_dattention(enc):
    batch = _batch(enc, SENTS[:1])
    with hooks.attention(enc.model, retain_grad=True) as s:
        emb = enc.model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
        out = s.run(inputs_embeds=emb, attention_mask=batch["attention_mask"])
        out.last_hidden_state.sum().backward()
    assert all(s.probs[l].grad is not None and s.probs[l].grad.shape == s.probs[l].shape for l in range(3))


def test_uniform_and_range_errors(enc):
    with pytest.raises(ValueError, match="layer 3 out of range"):
        with hooks.attention(enc.model, uniform={3: [0]}):
            pass
    with pytest.raises(ValueError, match="head 4 out of range"):
        with hooks.attention(enc.model, uniform={0: [4]}) as s:
            s.run(**_batch(enc))
    with hooks.attention(enc.model):
        with pytest.raises(RuntimeError, match="another attention session"):
            with hooks.attention(enc.model):
                pass


def test_block_function_equals_hidden_states(enc):
    batch = _batch(enc)
    with torch.no_grad():
        hs = enc.model(**batch, output_hidden_states=True).hidden_states
        for l in range(3):
            torch.testing.assert_close(structure.block_function(enc.model, l, **batch)(hs[l]), hs[l + 1])


def test_prefix_cache_reuse_is_exact(enc):
    batch = _batch(enc)
    with torch.no_grad():
        plain, outs = PrefixCache.record(enc.model, batch)
        for first in range(3):
            with hooks.attention(enc.model, [], uniform={first: [0]}):
                full = enc.model(**batch).last_hidden_state
                with PrefixCache.reuse(enc.model, outs, first):
                    fast = enc.model(**batch).last_hidden_state
            torch.testing.assert_close(fast, full)
        torch.testing.assert_close(enc.model(**batch).last_hidden_state, plain.last_hidden_state)  # restored


def test_prefix_cache_skips_the_stored_blocks_and_restores_them(enc):
    """Inside ``reuse`` the embeddings and blocks below ``first_layer`` do not compute (their submodules are never
    called) and the later ones do; after the block, also one left by an error, every module computes again and an
    instance forward set before (as accelerate's hooks do) is back; ``reuse`` inside ``reuse`` is an error."""
    batch = _batch(enc)
    emb, mods = PrefixCache.parts(enc.model)
    called = []
    handles = [m.register_forward_hook(lambda mod, a, o, k=k: called.append(k))
               for k, m in [("emb", emb.word_embeddings)] + [(j, b.attention.self.query) for j, b in enumerate(mods)]]
    with torch.no_grad():
        plain, outs = PrefixCache.record(enc.model, batch)
        called.clear()
        with PrefixCache.reuse(enc.model, outs, 2):
            fast = enc.model(**batch).last_hidden_state
            with pytest.raises(RuntimeError, match="already active"), PrefixCache.reuse(enc.model, outs, 1):
                pass
        assert called == [2]
        torch.testing.assert_close(fast, plain.last_hidden_state)
        original = mods[0].forward
        mods[0].forward = lambda *a, **k: original(*a, **k)  # an instance forward set by someone else
        mine = mods[0].__dict__["forward"]
        with pytest.raises(KeyError), PrefixCache.reuse(enc.model, outs, 3):
            raise KeyError("inside")
        assert mods[0].__dict__["forward"] is mine
        assert "forward" not in emb.__dict__ and "forward" not in mods[1].__dict__
        del mods[0].forward
        called.clear()
        torch.testing.assert_close(enc.model(**batch).last_hidden_state, plain.last_hidden_state)
        assert called == ["emb", 0, 1, 2]
    for h in handles:
        h.remove()


def test_model_inputs_drop_what_the_model_does_not_take():
    d = tiny_encoder("distilbert")
    ids = torch.tensor([[1, 2, 3]])
    kept = structure.model_inputs(d.model, input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=None)
    assert set(kept) == {"input_ids"}


def test_usable_length_and_prefix_space():
    assert usable_max_length(RobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512
    assert usable_max_length(AutoConfig.for_model("bert", max_position_embeddings=512)) == 512
    r = tiny_encoder("roberta")
    assert r.max_length == 128 and getattr(r.tokenizer, "add_prefix_space", False)
    (e,) = encode_words(r.tokenizer, [["a", "fox", "jumped"]])
    assert e.input_ids[0] == r.tokenizer.bos_token_id and e.input_ids[-1] == r.tokenizer.eos_token_id
    assert e.word_of_piece[0] == -1 and e.word_of_piece[-1] == 3 and sorted(set(e.word_of_piece[1:-1])) == [0, 1, 2]


def test_padding_and_length_batches():
    out = pad([[5, 6, 7], [8]], pad_id=0, type_ids=[[0, 0, 1], None])
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["token_type_ids"].tolist() == [[0, 0, 1], [0, 0, 0]]
    with pytest.raises(ValueError, match="sequence 1: 1 token type ids for 2 ids"):
        pad([[5, 6, 7], [8, 9]], pad_id=0, type_ids=[[0, 0, 1], [1]])  # (one id would have filled the row)
    batches = length_batches([5, 1, 9, 3, 3], max_tokens=9, max_batch_size=2)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert all(len(b) * max([5, 1, 9, 3, 3][i] for i in b) <= 9 for b in batches if len(b) > 1)


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint_loads_in_float32(stored, tmp_path):
    """A checkpoint stored in half precision is held in float32 (transformers' default keeps the stored dtype,
    so 32-true would compute in half precision), with the stored values, and its random-weight twin too."""
    src = tiny_folder("bert")
    folder = tmp_path / "half"
    AutoModel.from_pretrained(src, dtype=stored).save_pretrained(folder)
    tiny_encoder("bert").tokenizer.save_pretrained(folder)
    assert AutoConfig.from_pretrained(folder).dtype == stored  # transformers would load it so
    model = load_encoder(str(folder)).model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    stored_model = AutoModel.from_pretrained(folder)
    assert next(stored_model.parameters()).dtype == stored
    for (n, p), q in zip(model.named_parameters(), stored_model.parameters()):
        assert torch.equal(p, q.float()), n
    assert {p.dtype for p in load_encoder(str(folder), random_init=True).model.parameters()} == {torch.float32}


@pytest.mark.slow
def test_packaged_encoder_has_no_mlm_head():
    with pytest.raises(MissingHeadError, match="no mlm head"):
        load_packaged(head="mlm").model


@pytest.mark.parametrize("family,pooling", [("distilbert", "cls"), ("roberta", "pooler")])
def test_finetuned_encoder_plus_head_loads_with_its_logits(family, pooling, tmp_path):
    from probes.glue.export import export_hf, load_finetuned
    from probes.glue.module import SequenceClassifier

    enc = tiny_encoder(family)
    module = SequenceClassifier(enc, task="mrpc", pooling=pooling).eval()
    with torch.no_grad():
        module.head.weight.normal_()
    export_hf(module, tmp_path / "hf_model")
    ft = load_finetuned(tmp_path, task="mrpc", reference_tokenizer=enc.tokenizer)  # the run folder
    batch = _batch(enc)
    with torch.no_grad():
        want = module(**batch)
        got = ft.model(**structure.model_inputs(ft.model, **batch)).logits
        with hooks.attention(ft.model, uniform={0: [1]}) as s:  # interventions reach it too
            changed = s.run(**batch).logits
    torch.testing.assert_close(got, want)
    assert ft.task == "mrpc" and not torch.equal(changed, got)  # (a tanh pooler can leave the change small)
