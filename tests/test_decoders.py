"""Causal LMs through the model layer and the stages below the analyses, on tiny random models of every decoder
family (probes.model.tiny.DECODERS) loaded from their folders.

The reference is a separately loaded ``attn_implementation="eager"`` transformers model run with
``output_attentions=True`` on one sentence, its attention pooled to words by an explicit loop over the pieces
of each word (rows: mean over the row word's pieces, columns: sum over the column word's pieces).
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import probes
from probes.extract.cache import cache_key
from probes.measures import build
from probes.model import hooks
from probes.model.families import adds_bos, is_causal
from probes.model.hidden import hidden_states
from probes.model.inputs import WORD_ENCODING, encode_words, pad_encoded
from probes.model.load import load_encoder
from probes.model.tiny import DECODER_WINDOW, DECODERS, KV_HEADS, tiny_folder
from probes.analysis.context import run_analysis
from probes.train import train
from tests import reference
from tests.conftest import ROOT, chain_overrides, compose_train, require_model
from tests.test_families import _analysis_cfg

SENTS = [["The", "unbelievably", "quick", "fox", "jumped", "over", "the", "dog", "."], ["Hello", "!"],
         ["A", "cat", ",", "a", "dog", "and", "John", "'s", "mat", "sat", "."]]
BOS_FAMILIES = {f for f, spec in DECODERS.items() if spec[3]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-decoders")
    return {f: tiny_folder(f, root=root) for f in DECODERS}


def eager_word_maps(folder, words: list[str], bos: bool | None = None) -> tuple[np.ndarray, list[str]]:
    """(L, H, R, R) word maps of a plain eager forward of one sentence as running text (the folder's own tokenizer
    on the joined words), pooled by explicit loops (:func:`tests.reference.eager_word_maps`); R rows: the BOS
    (where the tokenizer adds one, or ``bos=True`` prepends it) and the words."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    return reference.eager_word_maps(model, tok, words, bos=bool(bos))


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_word_maps_equal_eager_forward(folders, family):
    enc = probes.load_encoder(str(folders[family]))
    assert enc.causal and is_causal(enc.config) and enc.bos == (family in BOS_FAMILIES)
    got = probes.word_maps(enc, SENTS, device="cpu")  # one padded batch of three lengths
    for words, wm in zip(SENTS, got):
        ref, labels = eager_word_maps(folders[family], words)
        assert wm.labels == labels
        assert wm.maps.shape == ref.shape
        np.testing.assert_allclose(wm.maps, ref, atol=2e-6)
        # causal: nothing above the diagonal, rows of real tokens sum to 1
        assert np.abs(np.triu(wm.maps, 1)).max() == 0.0
        np.testing.assert_allclose(wm.maps.sum(-1), 1.0, atol=1e-5)


def test_encoder_options_and_layout(folders):
    llama = load_encoder(str(folders["llama"]))
    (e,) = encode_words(llama.tokenizer, [["a", "cat"]])
    assert e.word_of_piece[0] == -1 and e.n_words not in e.word_of_piece  # BOS row, no last special
    gpt2 = load_encoder(str(folders["gpt2"]))
    (e,) = encode_words(gpt2.tokenizer, [["a", "cat"]])
    assert -1 not in e.word_of_piece and gpt2.tokenizer.pad_token is not None  # EOS as pad
    assert gpt2.config.pad_token_id == gpt2.tokenizer.pad_token_id and gpt2.tokenizer.padding_side == "right"
    # BOS on request, removed on request; it enters the cache key
    gpt2_bos = load_encoder(str(folders["gpt2"]), bos=True)
    assert gpt2_bos.bos and adds_bos(gpt2_bos.tokenizer)
    ref, labels = eager_word_maps(folders["gpt2"], SENTS[0], bos=True)
    wm = probes.word_maps(gpt2_bos, [SENTS[0]], device="cpu")[0]
    assert wm.labels == labels and labels[0] == "<|endoftext|>"
    np.testing.assert_allclose(wm.maps, ref, atol=2e-6)
    assert not load_encoder(str(folders["llama"]), bos=False).bos
    assert gpt2.key_fields() == {"causal": True, "bos": False} and gpt2_bos.key_fields()["bos"] is True
    with pytest.raises(ValueError, match="causal LMs only"):
        load_encoder(str(tiny_folder("bert", root=folders["gpt2"].parent.parent)), bos=True)
    with pytest.raises(ValueError, match="causal_lm"):
        load_encoder(str(folders["llama"]), head="mlm")


def test_cache_key_differs_with_bos(folders):
    class Settings:
        def max_length_for(self, encoder):
            return encoder.max_length

    class Nothing:
        def key_fields(self, *args):
            return {}

    keys = [cache_key(load_encoder(str(folders["gpt2"]), bos=b), Nothing(), Nothing(), Settings(), "32-true")
            for b in (None, True)]
    assert keys[0] != keys[1] and keys[0]["bos"] is False and keys[1]["bos"] is True
    # the rule that makes words into pieces is in every key: entries made from glued words are never read again
    assert keys[0]["word_encoding"] == WORD_ENCODING == "running-text"


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_grouped_query_heads(folders, family):
    """Per-query-head maps: the captured maps equal eager's (which repeats K/V), and the values captured for
    query heads of one group are the same key/value head's."""
    enc = load_encoder(str(folders[family]))
    model = enc.model
    assert model.config.num_key_value_heads == KV_HEADS < model.config.num_attention_heads
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(model, values=True) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    ref = AutoModel.from_pretrained(str(folders[family]), attn_implementation="eager").eval()
    with torch.no_grad():
        att = ref(input_ids=ids, output_attentions=True).attentions
    H, n = model.config.num_attention_heads, model.config.num_attention_heads // KV_HEADS
    for l in range(model.config.num_hidden_layers):
        assert s.probs[l].shape == (1, H, ids.shape[1], ids.shape[1])
        torch.testing.assert_close(s.probs[l], att[l], atol=1e-6, rtol=0)
        v = s.value[l]  # (1, H, T, d)
        for h in range(H):
            torch.testing.assert_close(v[:, h], v[:, (h // n) * n])
        assert not torch.allclose(s.probs[l][:, 0], s.probs[l][:, 1])  # query heads differ within a group


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_in_maps(folders, family):
    """Sliding-window layers attend to the last DECODER_WINDOW tokens only (Gemma: every other layer)."""
    enc = load_encoder(str(folders[family]))
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(enc.model) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    types = getattr(enc.config, "layer_types", None) or ["sliding_attention"] * enc.num_layers
    T = ids.shape[1]
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    outside = (j > i) | (i - j >= DECODER_WINDOW)
    for l, kind in enumerate(types):
        p = s.probs[l][0]  # (H, T, T)
        if kind == "sliding_attention":
            assert p[:, outside].abs().max() == 0
        else:
            assert p[:, (j <= i) & (i - j >= DECODER_WINDOW)].min() > 0


def test_softcap_is_applied(folders):
    """Gemma 2's attention soft-capping (cap 0.5 in the tiny model) as eager does it; the query weights are
    scaled up in both models so that scores exceed the cap and the capping changes the maps."""
    enc = load_encoder(str(folders["gemma2"]))
    ref = AutoModel.from_pretrained(str(folders["gemma2"]), attn_implementation="eager").eval()
    with torch.no_grad():
        for m in (enc.base, ref):
            for layer in m.layers:
                layer.self_attn.q_proj.weight.mul_(30.0)
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(enc.model) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        att = ref(input_ids=ids, output_attentions=True).attentions
        for m in ref.modules():
            if hasattr(m, "attn_logit_softcapping"):
                m.attn_logit_softcapping = None
        uncapped = ref(input_ids=ids, output_attentions=True).attentions
    for l in range(enc.num_layers):
        torch.testing.assert_close(s.probs[l], att[l], atol=1e-6, rtol=0)
    assert (s.probs[1] - uncapped[1]).abs().max() > 1e-2


def test_causal_lm_and_classification_heads(folders):
    lm = load_encoder(str(folders["llama"]), head="causal_lm")
    ref = AutoModelForCausalLM.from_pretrained(str(folders["llama"]), attn_implementation="eager").eval()
    ids = torch.tensor([encode_words(lm.tokenizer, [SENTS[0]])[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # sequence classification: last non-pad token pooling, pad token set; padded batch = each alone
    clf = load_encoder(str(folders["gpt2"]), head="sequence_classification", random_init=True)
    batch = clf.tokenizer([" ".join(SENTS[0]), "Hello !"], padding=True, return_tensors="pt")
    with torch.no_grad():
        both = clf.model(**batch).logits
        alone = clf.model(**clf.tokenizer(["Hello !"], return_tensors="pt")).logits
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- map kinds against slow references
KINDS = ("attention", "rollout", "flow", "norm", "norm_res_ln", "alti", "value_zeroing", "grad_attribution")


def _decoder_parts(ref, l):
    """Written out per architecture: (values of block input X -> (T, H, d) per query head, W_O (D, H*d), b_O,
    sub-layer RMS norm or None). Llama / Gemma 2: v_proj of the input RMSNorm, key/value head h // groups;
    GPT-2: the value third of c_attn (Conv1D) of ln_1; Gemma 2 puts an RMSNorm on o_proj's output."""
    cfg = ref.config
    H = cfg.num_attention_heads
    if cfg.model_type == "gpt2":
        blk = ref.h[l]
        D = cfg.hidden_size

        def values(X):
            return blk.attn.c_attn(blk.ln_1(X))[:, 2 * D:].view(X.shape[0], H, -1)
        return values, blk.attn.c_proj.weight.t(), blk.attn.c_proj.bias, None
    blk = ref.layers[l]
    kv = cfg.num_key_value_heads

    def values(X):
        v = blk.self_attn.v_proj(blk.input_layernorm(X)).view(X.shape[0], kv, -1)  # (T, H_kv, d)
        return torch.stack([v[:, h // (H // kv)] for h in range(H)], 1)  # (T, H, d)
    sub = blk.post_attention_layernorm if cfg.model_type == "gemma2" else None
    return values, blk.self_attn.o_proj.weight, blk.self_attn.o_proj.bias, sub


def ref_decoder_decomposition(ref, att, hs, l):
    """Loops: (norm (H, T, T), norm_res_ln (T, T), ALTI contributions (T, T)) of a pre-norm decoder layer: the
    residual stream carries x_i + z_i (Gemma 2: x_i + g * z_i / rms(z_i) with the actual z_i)."""
    values, W, b, sub = _decoder_parts(ref, l)
    with torch.no_grad():
        X = hs[l]
        T, D = X.shape
        V = values(X)  # (T, H, d)
        H, d = V.shape[1], V.shape[2]
        f = torch.zeros(H, T, D)
        for h in range(H):
            for j in range(T):
                f[h, j] = W[:, h * d:(h + 1) * d] @ V[j, h]
        A = att[l]
        norm = torch.zeros(H, T, T)
        S = torch.zeros(T, T, D)
        for i in range(T):
            for j in range(T):
                for h in range(H):
                    norm[h, i, j] = (A[h, i, j] * f[h, j]).norm()
                    S[i, j] += A[h, i, j] * f[h, j]
        z = S.sum(1) + (b if b is not None else 0)  # (T, D) the attention sub-layer output
        if sub is not None:
            gain = 1.0 + sub.weight.float()  # Gemma's RMSNorm: x / rms(x) * (1 + weight)
            for i in range(T):
                S[i] = S[i] * gain / torch.sqrt(z[i].pow(2).mean() + sub.eps)
            y = X + sub(z)
        else:
            y = X + z
        for i in range(T):
            S[i, i] += X[i]
        c = torch.zeros(T, T)
        for i in range(T):
            for j in range(T):
                c[i, j] = max(0.0, float(y[i].abs().sum() - (y[i] - S[i, j]).abs().sum()))
            c[i] /= c[i].sum()
    return norm, S.norm(dim=-1), c


def forward_with_hooks(ref, ids, hooks) -> None:
    """One no-grad forward of ``ids`` (T,) with plain torch forward hooks ``[(module, fn), ...]``, removed after."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            ref(input_ids=ids[None])
    finally:
        for h in handles:
            h.remove()


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def ref_decoder_value_zeroing(ref, ids, l, t):
    """Block l's output (T, D) of one sentence with token t's value vectors zeroed in layer l only: plain torch
    forward hooks on the eager model's v_proj (mask) and block (keep its output), not the project's hooks."""
    keep = torch.ones(1, len(ids), 1)
    keep[0, t] = 0
    blk = ref.layers[l]
    out = []
    forward_with_hooks(ref, ids, [(blk.self_attn.v_proj, lambda m, a, o: o * keep),
                                  (blk, lambda m, a, o: out.append(_first(o)))])
    return out[0][0]


def block_outputs(ref, ids) -> list[torch.Tensor]:
    """L x (T, D) outputs of every block of a plain forward (forward hooks on the blocks)."""
    out = []
    forward_with_hooks(ref, ids, [(b, lambda m, a, o: out.append(_first(o)[0])) for b in ref.layers])
    return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_decoder_measures_match_slow_references(folders, family):
    """norm, norm_res_ln, ALTI against loops written per architecture; attention, rollout and flow against the
    eager maps; every kind causal (no entry above the diagonal) on a padded batch of two sentences."""
    folder = folders[family]
    enc = load_encoder(str(folder))
    ref = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():  # larger value/output weights: the tiny random model mixes more
        for m in (enc.base, ref):
            for name, p in m.named_parameters():
                if any(k in name for k in ("v_proj.weight", "o_proj.weight", "c_proj.weight")):
                    p.mul_(8.0)
    encoded = encode_words(enc.tokenizer, SENTS[:2])
    measures = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "extract" / "default.yaml"))["measures"]
    batch = pad_encoded(encoded, enc.tokenizer.pad_token_id)
    with torch.inference_mode():
        got = {k: torch.stack(build(k, measures)(enc.model, batch["input_ids"], batch["attention_mask"]), 1)
               for k in KINDS}  # (B, L, H', T, T)
    for b, e in enumerate(encoded):
        n = e.n_pieces
        ids = torch.tensor(e.input_ids)
        with torch.no_grad():
            out = ref(input_ids=ids[None], output_attentions=True, output_hidden_states=True)
        att, hs = [a[0] for a in out.attentions], [x[0] for x in out.hidden_states]
        crop = {k: v[b, :, :, :n, :n].float().numpy() for k, v in got.items()}
        for k, v in crop.items():
            assert np.abs(np.triu(v, 1)).max() == 0.0, k
            assert np.isfinite(v).all(), k
        np.testing.assert_allclose(crop["attention"], np.stack([a.numpy() for a in att]), atol=1e-6)
        L = len(att)
        dec = [ref_decoder_decomposition(ref, att, hs, l) for l in range(L)]
        np.testing.assert_allclose(crop["norm"], np.stack([d[0].numpy() for d in dec]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(crop["norm_res_ln"][:, 0], np.stack([d[1].numpy() for d in dec]), rtol=1e-4,
                                   atol=1e-5)
        c = np.stack([d[2].numpy() for d in dec])
        alti = [c[0]]
        for l in range(1, L):
            alti.append(c[l] @ alti[-1])
        np.testing.assert_allclose(crop["alti"][:, 0], np.stack(alti), atol=1e-5)
        aug = [a.mean(0).numpy() + np.eye(n) for a in att]
        aug = [a / a.sum(-1, keepdims=True) for a in aug]
        roll = [aug[0]]
        for l in range(1, L):
            roll.append(aug[l] @ roll[-1])
        np.testing.assert_allclose(crop["rollout"][:, 0], np.stack(roll), atol=1e-5)
        if family != "gpt2":  # value zeroing written out through a hook on v_proj (GPT-2 fuses q, k, v)
            vz = np.zeros((L, n, n))
            orig = block_outputs(ref, ids)
            for l in range(L):
                for t in range(n):
                    new = ref_decoder_value_zeroing(ref, ids, l, t)
                    vz[l, :, t] = (1 - torch.nn.functional.cosine_similarity(
                        new.double(), orig[l].double(), dim=-1)).clamp(min=0).numpy()
                vz[l] = np.tril(vz[l])
                vz[l] /= vz[l].sum(-1, keepdims=True)
            np.testing.assert_allclose(crop["value_zeroing"][:, 0], vz, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- analyses and a probe on every decoder
@pytest.mark.parametrize("family", sorted(DECODERS))
@pytest.mark.parametrize("analysis,extra", [("head_stats", []), ("dep_heads", ["extract.maps=alti"])])
def test_analysis_runs_on_decoder(folders, family, analysis, extra, tmp_path):
    if family == "gpt_neox" and extra:  # parallel residual: ALTI is not defined, a clear error before extraction
        extra = ["extract.maps=rollout"]
    cfg = _analysis_cfg(tmp_path, family, analysis, f"encoder.root={folders[family].parent.parent}", *extra)
    run_analysis(cfg, tmp_path / "out", figures=family == "llama")  # figures built for all, written for one (PNG)
    csvs = list((tmp_path / "out").glob("*.csv"))
    assert csvs and all(len(pd.read_csv(p)) > 0 for p in csvs)
    if analysis == "head_stats":
        df = pd.read_csv(tmp_path / "out" / "head_stats.csv")
        assert set(df.layer) == {0, 1} and set(df["head"]) == {0, 1, 2, 3}
        names = {"bos", "first"} & set(df.stat)  # position 0's column on a decoder: BOS or the first word
        assert len(names) == 1 and "prev" in set(df.stat) and "cls" not in set(df.stat)
        first = names.pop()
        assert df[df.stat.isin([first, "prev"])].value.between(0, 1).all()
        assert "next" not in set(df.stat)  # causal: nothing attends to the next word, so it is not reported


def test_alti_on_parallel_residual_is_a_clear_error(folders, tmp_path):
    enc = load_encoder(str(folders["gpt_neox"]))
    with pytest.raises(ValueError, match="parallel residual"):
        probes.word_maps(enc, [["a", "b"]], kind="alti", device="cpu")


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_dependency_probe_trains_on_decoder(folders, chain_data, tmp_path, family):
    """The attention probe trains on each decoder's maps; the caches are built in a child interpreter (the default)
    for Llama and in this process for the others (the child receives the encoder's config whatever the family,
    and costs an interpreter's start: tests/test_extract.py compares its caches with this process's)."""
    over = [o for o in chain_overrides(chain_data, tmp_path) if o != "encoder=tiny"]
    cfg = compose_train(over + ["encoder=tiny_family", f"encoder.family={family}", "probe=attn_only",
                                f"encoder.root={folders[family].parent.parent}", "trainer.max_epochs=1",
                                "data.max_sentences.train=40",
                                f"data.extract_in_child={str(family == 'llama').lower()}"])
    m = train(cfg)
    assert 0 <= m["test/uas"] <= 1 and 0 <= m["val/uas_best"] <= 1


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_head_disabling_uniform_over_visible_keys(folders, family):
    """A disabled head attends uniformly to the keys its causal (and sliding-window) mask lets it see."""
    enc = load_encoder(str(folders[family]))
    (e,) = encode_words(enc.tokenizer, [SENTS[0]])
    ids = torch.tensor([e.input_ids])
    with hooks.attention(enc.model, uniform={0: [1]}) as s:
        s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    T = ids.shape[1]
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    window = getattr(enc.config, "sliding_window", None) or T
    visible = ((j <= i) & (i - j < window)).float()
    torch.testing.assert_close(s.probs[0][0, 1], visible / visible.sum(-1, keepdim=True))
    assert not torch.allclose(s.probs[0][0, 0], visible / visible.sum(-1, keepdim=True))


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_every_kind_is_causal_and_finite(folders, family):
    enc = load_encoder(str(folders[family]))
    for kind in KINDS:
        if family == "gpt_neox" and kind in ("norm_res_ln", "alti"):
            continue
        for wm in probes.word_maps(enc, SENTS[:2], kind=kind, device="cpu"):
            assert np.isfinite(wm.maps).all() and np.abs(np.triu(wm.maps, 1)).max() == 0.0, kind
            assert wm.maps.shape[-1] == len(wm.labels), kind


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2_gguf")
def test_smollm2_gguf_word_maps_equal_eager_forward():
    """The fetched SmolLM2-135M-Instruct GGUF (`probes-fetch model=smollm2`): 30 layers x 9 query heads over 3 key/value heads,
    no BOS added; word maps of chosen layers equal an eager forward of the same GGUF pooled by a loop."""
    path = require_model("smollm2")
    enc = probes.load_encoder(path)
    assert enc.causal and not enc.bos and enc.num_layers == 30 and enc.num_heads == 9
    assert enc.config.num_key_value_heads == 3 and enc.tokenizer.pad_token is not None
    words = "The capital of France is Paris .".split()
    layers = [0, 15, 29]
    wm = probes.word_maps(enc, [words, words[:3]], layers=layers, device="cpu")[0]
    assert wm.labels == words
    ref, tok = reference.gguf_reader(str(path))  # transformers' own GGUF reader (eager), shared by the session
    ref = ref.base_model  # the decoder without its LM head, as AutoModel reads it
    ids, wids = reference.text_pieces(tok, words)  # the GGUF's own tokenizer on "The capital of France is Paris ."
    assert tok.convert_ids_to_tokens(ids)[:3] == ["The", "Ġcapital", "Ġof"]  # running text, not glued words
    want, labels = reference.eager_word_maps(ref, tok, words)
    assert labels == words
    np.testing.assert_allclose(wm.maps, want[layers], atol=2e-4)
    assert np.abs(np.triu(wm.maps, 1)).max() == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_hidden_states_of_decoder(folders, family):
    """Layers 0..L-1 are the blocks' inputs, layer L the last block's output after the final norm; causal:
    appending a token leaves the earlier positions' states unchanged."""
    enc = load_encoder(str(folders[family]))
    ids = torch.tensor([encode_words(enc.tokenizer, [SENTS[0]])[0].input_ids])
    with torch.no_grad():
        hs = hidden_states(enc.model, None, input_ids=ids, attention_mask=torch.ones_like(ids))
        short = hidden_states(enc.model, None, input_ids=ids[:, :-2], attention_mask=torch.ones_like(ids[:, :-2]))
        with hooks.attention(enc.model, layers=[], block_io=True) as s:
            s.run(input_ids=ids, attention_mask=torch.ones_like(ids))
    L = enc.num_layers
    assert sorted(hs) == list(range(L + 1))
    for l in range(L):
        torch.testing.assert_close(hs[l], s.block_input[l])
    torch.testing.assert_close(hs[L], enc.base.norm(s.block_output[L - 1]) if family != "gpt2"
                               else enc.base.ln_f(s.block_output[L - 1]))
    for l in range(L + 1):
        torch.testing.assert_close(short[l], hs[l][:, :-2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_attention_cache_equals_eager_forward_of_running_text(folders, family, tmp_path):
    """The cache stage (batched, padded, float16 storage) against a plain eager forward of each sentence as running
    text pooled by loops: within float16's rounding of values up to 1 (half a unit in the last place: 2.44e-4)."""
    import pytorch_lightning as pl

    from probes.extract.stage import extract

    enc = load_encoder(str(folders[family]))
    trainer = functools.partial(pl.Trainer, accelerator="cpu", devices=1, precision="32-true", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    cache = extract(enc, SENTS, dict(encoder=enc.name, dataset="s", split=family), tmp_path, trainer, max_tokens=64)
    for k, words in enumerate(SENTS):
        ref, _ = eager_word_maps(folders[family], words)
        rows = ([0] if family in BOS_FAMILIES else []) + list(range(1, len(words) + 1))  # cache: W = n + 2 rows
        got = cache[k].astype(np.float64)[:, :, rows][:, :, :, rows]
        np.testing.assert_allclose(got, ref, atol=2.5e-4, rtol=0)
        assert np.abs(got - ref).mean() < 1e-4
