"""Map kinds beyond attention weights (probes/measures) against slow direct implementations, and every kind
through extraction and dep_heads on a tiny model of every family.

The references are written here from the definitions (README "Beyond attention weights"), on a separately
loaded ``attn_implementation="eager"`` model with ``output_attentions`` / ``output_hidden_states``, with
Python loops over heads and positions; the flow reference is the published networkx Edmonds-Karp
construction (samiraabnar/attention_flow ``get_adjmat`` + ``compute_flows``). The measures run on a
right-padded batch of two sentences, so padding is checked as well.
"""

from __future__ import annotations

import copy
import json

import networkx as nx
import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModel

from probes.maps import MapEngine
from probes.measures import build
from probes.measures.rollout import flow_maps
from probes.measures.value_zeroing import ValueZeroing
from probes.model import attention_function, structure
from probes.model.inputs import Encoded
from probes.model.load import load_packaged
from probes.model.tiny import FAMILIES, tiny_folder
from tests.conftest import ROOT, TINY_CONLLU
from tests.reference import pool_by_loops, text_pieces, word_groups

KINDS = ("attention", "rollout", "flow", "norm", "norm_res_ln", "alti", "value_zeroing", "grad_attribution")
MEASURES = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "extract" / "default.yaml"))["measures"]
SENTS = [["The", "fox", "saw", "John", "'s", "dog", "."], ["Hello", "world", "!"]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: tiny_folder(f, root=root) for f in ("bert", "modernbert")}


def _setup(folder):
    """(model on the project's path, separately loaded eager reference, padded batch, per-sentence ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    seqs = [tok(" ".join(words))["input_ids"] for words in SENTS]  # each sentence as running text
    T = max(len(x) for x in seqs)
    batch = dict(input_ids=torch.tensor([x + [tok.pad_token_id or 0] * (T - len(x)) for x in seqs]),
                 attention_mask=torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in seqs]))  # right-padded
    model = attention_function.prepare(AutoModel.from_pretrained(folder).eval())
    ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():  # the random tiny model mixes little: larger values make the measures well conditioned
        for m in (model, ref):
            for name, p in m.named_parameters():
                if any(k in name for k in ("value.weight", "Wqkv.weight", "attention.output.dense.weight", "Wo.weight")):
                    p.mul_(8.0)
    return model, ref, batch, [torch.tensor(x) for x in seqs]


def _measure(kind, model, batch):
    with torch.inference_mode():
        return torch.stack(build(kind, MEASURES)(model, batch["input_ids"], batch["attention_mask"]), 1)  # (B, L, H', T, T)


def _eager(ref, ids):
    with torch.no_grad():
        out = ref(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], output_attentions=True,
                  output_hidden_states=True)
    return [a[0] for a in out.attentions], [h[0] for h in out.hidden_states]  # L x (H, T, T), L+1 x (T, D)


# ----------------------------------------------------------------------------- slow references
def ref_rollout(att):
    """Abnar & Zuidema: head mean + I, row-normalised, multiplied through the layers (loops)."""
    L, T = len(att), att[0].shape[-1]
    aug = []
    for a in att:
        m = a.mean(0).numpy() + np.eye(T)
        aug.append(m / m.sum(-1, keepdims=True))
    joint = [aug[0]]
    for l in range(1, L):
        joint.append(aug[l] @ joint[-1])
    return np.stack(joint), np.stack(aug)


def ref_flow(aug):
    """samiraabnar/attention_flow: get_adjmat + compute_flows with networkx Edmonds-Karp."""
    L, n, _ = aug.shape
    adj = np.zeros(((L + 1) * n, (L + 1) * n))
    for i in range(1, L + 1):
        for kf in range(n):
            for kt in range(n):
                adj[i * n + kf, (i - 1) * n + kt] = aug[i - 1, kf, kt]
    G = nx.DiGraph()
    for u, v in zip(*np.nonzero(adj)):
        G.add_edge(int(u), int(v), capacity=float(adj[u, v]))
    out = np.zeros((L, n, n))
    for i in range(1, L + 1):
        for kf in range(n):
            for v in range(n):
                out[i - 1, kf, v] = nx.maximum_flow_value(G, i * n + kf, v, flow_func=nx.algorithms.flow.edmonds_karp)
            out[i - 1, kf] /= out[i - 1, kf].sum()
    return out


def _parts(ref, l):
    """(value vectors (H, T, d), W_O (D, H*d), b_O, LayerNorm after attention or None, block input) of layer l:
    BERT (post-LN) or ModernBERT (pre-LN), written out per architecture."""
    cfg = ref.config
    H = cfg.num_attention_heads
    if cfg.model_type == "bert":
        lay = ref.encoder.layer[l]
        return lambda X: lay.attention.self.value(X), lay.attention.output.dense, lay.attention.output.LayerNorm, H
    lay = ref.layers[l]

    def values(X):
        qkv = lay.attn.Wqkv(lay.attn_norm(X))  # (T, 3D)
        return qkv.view(X.shape[0], 3, -1)[:, 2]
    return values, lay.attn.Wo, None, H


def ref_decomposition(ref, att, hs, l):
    """Loops: (norm (H, T, T), norm_res_ln (T, T), alti contributions (T, T)) of layer l."""
    values, dense, ln, H = _parts(ref, l)
    with torch.no_grad():
        X = hs[l]
        T, D = X.shape
        V = values(X)  # (T, H*d)
        d = V.shape[1] // H
        W, b = dense.weight, dense.bias if dense.bias is not None else torch.zeros(D)
        f = torch.zeros(H, T, D)
        for h in range(H):
            for j in range(T):
                f[h, j] = W[:, h * d:(h + 1) * d] @ V[j, h * d:(h + 1) * d]
        A = att[l]
        norm = torch.zeros(H, T, T)
        S = torch.zeros(T, T, D)
        for i in range(T):
            for j in range(T):
                for h in range(H):
                    norm[h, i, j] = (A[h, i, j] * f[h, j]).norm()
                    S[i, j] += A[h, i, j] * f[h, j]
                if i == j:
                    S[i, j] += X[i]
        r = S.sum(1) + b  # residual sum x_i + sum_j sum_h alpha f + b_O (S holds x_i once)
        if ln is not None:  # post-LN: the LayerNorm's linear part with the actual input's variance
            y = ln(r)
            Tv = torch.zeros_like(S)
            for i in range(T):
                sd = torch.sqrt(r[i].var(unbiased=False) + ln.eps)
                for j in range(T):
                    Tv[i, j] = ln.weight * (S[i, j] - S[i, j].mean()) / sd
        else:
            y, Tv = r, S
        nrl = Tv.norm(dim=-1)
        c = torch.zeros(T, T)
        for i in range(T):
            for j in range(T):
                c[i, j] = max(0.0, float(y[i].abs().sum() - (y[i] - Tv[i, j]).abs().sum()))
            c[i] /= c[i].sum()
    return norm, nrl, c


def ref_value_zeroing(ref, hs):
    """Mohebbi et al.: BERT layer written out with token t's values zeroed; cosine distance; rows sum to 1."""
    cfg = ref.config
    H = cfg.num_attention_heads
    L, T, D = len(hs) - 1, hs[0].shape[0], hs[0].shape[1]
    d = D // H
    out = np.zeros((L, T, T))
    with torch.no_grad():
        for l in range(L):
            lay = ref.encoder.layer[l]
            sa, X = lay.attention.self, hs[l]
            for t in range(T):
                q = sa.query(X).view(T, H, d).transpose(0, 1)
                k = sa.key(X).view(T, H, d).transpose(0, 1)
                v = sa.value(X).view(T, H, d).transpose(0, 1).clone()
                v[:, t] = 0
                A = torch.softmax(q @ k.transpose(1, 2) / d ** 0.5, -1)
                ctx = (A @ v).transpose(0, 1).reshape(T, D)
                a = lay.attention.output.LayerNorm(lay.attention.output.dense(ctx) + X)
                o = lay.output.LayerNorm(lay.output.dense(lay.intermediate(a)) + a)
                for i in range(T):
                    out[l, i, t] = 1 - float(torch.nn.functional.cosine_similarity(o[i], hs[l + 1][i], dim=0))
            out[l] /= out[l].sum(-1, keepdims=True)
    return out


def ref_grad(ref, ids):
    """Gradient x input of each head output (summed units) w.r.t. the word embeddings, one backward per target."""
    cfg = ref.config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    T = len(ids)
    out = np.zeros((L, H, T, T))
    ctx = {}
    handles = [ref.encoder.layer[l].attention.self.register_forward_hook(
        lambda m, a, o, l=l: ctx.__setitem__(l, o[0])) for l in range(L)]
    try:
        emb = ref.embeddings.word_embeddings(ids[None]).detach().requires_grad_(True)
        ref(inputs_embeds=emb, attention_mask=torch.ones_like(ids)[None])
        d = ctx[0].shape[-1] // H
        for l in range(L):
            for h in range(H):
                for i in range(T):
                    (g,) = torch.autograd.grad(ctx[l][0, i, h * d:(h + 1) * d].sum(), emb, retain_graph=True)
                    a = (g * emb).abs().sum(-1)[0]
                    out[l, h, i] = (a / a.sum()).detach().numpy()
    finally:
        for hd in handles:
            hd.remove()
    return out


# ----------------------------------------------------------------------------- measure vs reference
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_measures_match_slow_references(folders, family):
    model, ref, batch, ids = _setup(folders[family])
    got = {k: _measure(k, model, batch) for k in KINDS if family == "bert" or k in ("norm", "norm_res_ln", "alti")}
    for b, x in enumerate(ids):
        n = len(x)
        att, hs = _eager(ref, x)
        L = len(att)
        crop = {k: v[b, :, :, :n, :n].float().numpy() for k, v in got.items()}
        dec = [ref_decomposition(ref, att, hs, l) for l in range(L)]
        np.testing.assert_allclose(crop["norm"], np.stack([d[0].numpy() for d in dec]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(crop["norm_res_ln"][:, 0], np.stack([d[1].numpy() for d in dec]), rtol=1e-4,
                                   atol=1e-5)
        c = np.stack([d[2].numpy() for d in dec])
        alti = [c[0]]
        for l in range(1, L):
            alti.append(c[l] @ alti[-1])
        np.testing.assert_allclose(crop["alti"][:, 0], np.stack(alti), atol=1e-5)
        if family != "bert":
            continue
        np.testing.assert_allclose(crop["attention"], np.stack([a.numpy() for a in att]), atol=1e-6)
        roll, aug = ref_rollout(att)
        np.testing.assert_allclose(crop["rollout"][:, 0], roll, atol=1e-5)
        np.testing.assert_allclose(crop["flow"][:, 0], ref_flow(aug), atol=1e-5)
        np.testing.assert_allclose(crop["value_zeroing"][:, 0], ref_value_zeroing(ref, hs), rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(crop["grad_attribution"], ref_grad(ref, x), atol=1e-5)
        assert not np.allclose(crop["alti"], crop["rollout"])  # the kinds differ


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(KeyError, match="extract.maps='nope'"):
        build("nope", MEASURES)
    assert build("alti", MEASURES).heads(4) == 1 and build("norm", MEASURES).heads(4) == 4


def test_engine_piece_maps_equal_measure_alone(folders):
    model, _, batch, ids = _setup(folders["bert"])
    items = [Encoded(x.tolist(), [-1] * len(x), 0) for x in ids]
    engine = MapEngine(model, build("alti", MEASURES), pad_id=0)
    alone = {k: m for k, m in engine.iter_piece_maps(items, progress=False)}
    for k, x in enumerate(ids):
        one = _measure("alti", model, {"input_ids": x[None], "attention_mask": torch.ones_like(x)[None]})[0]
        torch.testing.assert_close(alone[k], one)


# ----------------------------------------------------------------------------- the pipeline, every family
PAIRS = [("bert", "rollout"), ("roberta", "flow"), ("xlm-roberta", "norm"), ("distilbert", "grad_attribution"),
         ("electra", "alti"), ("albert", "value_zeroing"), ("deberta-v2", "attention"), ("modernbert", "norm_res_ln"),
         ("mpnet", "alti")]
assert sorted(f for f, _ in PAIRS) == sorted(FAMILIES) and sorted({k for _, k in PAIRS}) == sorted(KINDS)


@pytest.mark.parametrize("family,kind", PAIRS)
def test_extract_and_dep_heads_with_kind(family, kind, tmp_path):
    """`python -m probes.extract extract.maps=<kind>` then `python -m probes.analyze analysis=dep_heads
    extract.maps=<kind>` (in process, same composition): the analysis reads the cache the extraction built,
    with H' heads per layer, and the cached maps equal the measure pooled to words."""
    from probes.analysis.context import run_analysis
    from probes.extract.attention_caches import run
    from probes.extract.cache import AttentionCache

    data = tmp_path / "data"
    (data / "ud_english_ewt").mkdir(parents=True)
    (data / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    common = ["encoder=tiny_family", f"encoder.family={family}", f"paths.data_dir={data}",
              f"paths.cache_dir={tmp_path / 'cache'}", "data.treebank.download=false", "extract.precision=32-true",
              "extract.trainer.accelerator=cpu", f"extract.maps={kind}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tcfg = compose(config_name="train", overrides=[*common, "splits=[dev]", "logger=none"])
        acfg = compose(config_name="analyze", overrides=[*common, "analysis=dep_heads", "logger.use_wandb=false"])
    path = run(tcfg)["dev"]
    cache = AttentionCache(path)
    per_head = build(kind, MEASURES).per_head
    assert cache.manifest["maps"] == kind and cache.num_heads == (4 if per_head else 1)
    run_analysis(acfg, tmp_path / "out", figures=False)  # built, not written (no PNG: not checked here)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["cache"] == path and summary["maps"] == kind and summary["n_sentences"] == 3
    # sentence 1 of the cache = the measure on it alone, pooled (mean from, sum to) like attention
    from hydra.utils import instantiate

    enc = instantiate(tcfg.encoder)
    words = ["John", "'s", "cat", "sat", "on", "the", "unbelievably-comfortable", "!"]
    ids, wids = text_pieces(enc.tokenizer, words)  # running text, each piece's word from its characters
    assert wids[0] is None and wids[-1] is None  # first and last special: W = words + 2 rows
    x = torch.tensor(ids)
    # the decomposition's parts are found in every family: post-LN blocks everywhere but ModernBERT (pre-LN)
    parts = structure.layer_parts(attention_function.prepare(enc.model.eval()))
    assert [p.post_ln for p in parts] == [family != "modernbert"] * 2
    piece = _measure(kind, attention_function.prepare(enc.model.eval()), {"input_ids": x[None],
                                                             "attention_mask": torch.ones_like(x)[None]})[0]
    want = pool_by_loops(piece.float().numpy(), word_groups(wids, len(words)))  # rows mean, columns sum, by loops
    np.testing.assert_allclose(np.asarray(cache[1], dtype=np.float32), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("analysis,kind,extra", [
    ("clustering", "alti", ["analysis.mds_n_init=1", "analysis.mds_max_iter=50"]),
    ("attribution", "rollout", ["analysis.n_shortest=2", "analysis.min_words=2", "analysis.ig_steps=2",
                                "analysis.captum_check=1", "analysis.methods=[ixg]"]),
])
def test_map_kind_in_clustering_and_attribution(analysis, kind, extra, tmp_path):
    """The live analyses take the kind: a per-layer kind gives one point / one row per layer."""
    from probes.analysis.context import run_analysis

    data = tmp_path / "data"
    (data / "ud_english_ewt").mkdir(parents=True)
    (data / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="analyze", overrides=[
            f"analysis={analysis}", "encoder=tiny_family", "encoder.family=bert", f"paths.data_dir={data}",
            f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false", "data.treebank.download=false",
            f"extract.maps={kind}", *extra])
    run_analysis(cfg, tmp_path / "out", figures=False)  # built, not written (no PNG: not checked here)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["maps"] == kind
    if analysis == "clustering":
        emb = pd.read_csv(tmp_path / "out" / "head_embedding.csv")
        assert len(emb) == 2 and set(emb["head"]) == {0}  # 2 layers x 1 map
    else:
        layers = pd.read_csv(tmp_path / "out" / "attribution_heads.csv")
        assert len(layers) == 2 and layers.js.between(0, 1).all()
        assert kind in summary["patterns"]


# ----------------------------------------------------------------------------- precision of flow and value zeroing
def _random_augmented(L: int, n: int, seed: int) -> np.ndarray:
    """(L, n, n) residual-augmented maps: 0.5 (random attention rows) + 0.5 I, as Rollout/Flow build them."""
    rng = np.random.default_rng(seed)
    att = rng.dirichlet(np.full(n, 0.3), size=(L, n))  # (L, n, n) rows sum to 1, many small entries
    return 0.5 * att + 0.5 * np.eye(n)[None]


def test_flow_capacities_precise_to_1e9():
    """The default integer scale (1e9) gives flows within 1e-8 of networkx's float max-flow; a 1e6
    scale does not (the check can fail)."""
    aug = _random_augmented(3, 7, seed=0)
    ref = ref_flow(aug)  # float64 capacities, networkx Edmonds-Karp
    np.testing.assert_allclose(flow_maps(aug), ref, atol=1e-8, rtol=0)
    assert np.abs(flow_maps(aug, scale=1e6) - ref).max() > 1e-8
    with pytest.raises(ValueError, match="extract.measures.flow.scale"):
        flow_maps(aug, scale=1e10)


@pytest.mark.slow
def test_value_zeroing_float32_model_equals_float64_reference():
    """Value zeroing of the packaged MiniLM in float32 equals the same computation on a float64 copy of the
    model to 1e-5 and has no negative entries: its [CLS] rows in layers 1-4 hold cosine distances below 1e-4,
    where a float32 ``1 - cos`` was rounding noise (errors up to 7e-3, entries down to -8e-3 on this sentence)."""
    enc = load_packaged()
    words = "The quick brown fox jumps over the lazy dog near the bank .".split()
    ids = torch.tensor([enc.tokenizer(" ".join(words))["input_ids"]])  # (1, T) the sentence as running text
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = torch.stack(ValueZeroing()(enc.model, ids, mask))[:, 0, 0].numpy()  # (L, T, T)
        ref = torch.stack(ValueZeroing()(copy.deepcopy(enc.model).double(), ids, mask))[:, 0, 0].numpy()
    assert got.min() >= 0
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
