"""grad_sep, objective=contrastive: in-batch-negative loss (MultipleNegativesRankingLoss) on paraphrase pairs,
checked against a from-scratch eager reference on a tiny random BERT."""

import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from transformers import AutoModel

from probes.analysis.clark import grad_sep as G
from probes.analysis.context import AnalysisContext
from tests.conftest import require_shared

REPO = Path(__file__).resolve().parents[1]

# (label, sentence 1, sentence 2): MRPC's train.tsv columns; the label-0 rows are not pairs of the objective
ROWS = [
    (1, "The dog barked at the cat.", "A dog was barking at a cat."),
    (0, "Stocks fell sharply today.", "The weather was mild, sunny and dry."),
    (1, "John, the farmer, sold his old tractor.", "The farmer John sold his tractor."),
    (1, "She left early, before the meeting.", "Before the meeting, she went home."),
    (1, "Prices rose by ten percent last year.", "Last year, prices went up ten percent."),
    (0, "He likes tea.", "The train was late."),
    (1, "The company posted a large loss.", "A big loss was reported by the firm."),
]
PAIRS = [(a, b) for lab, a, b in ROWS if lab == 1]  # 5 pairs


def _write_mrpc(data_dir: Path, rows) -> None:
    d = data_dir / "glue" / "MRPC"
    d.mkdir(parents=True, exist_ok=True)
    lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
    lines += [f"{lab}\t{100 + i}\t{200 + i}\t{a}\t{b}" for i, (lab, a, b) in enumerate(rows)]
    (d / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _compose(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="analyze", overrides=overrides)


@pytest.fixture
def cfg(tmp_path):
    _write_mrpc(tmp_path / "data", ROWS)

    def make(*extra):
        return _compose(["analysis=grad_sep", "encoder=tiny", "analysis.objective=contrastive",
                         f"paths.data_dir={tmp_path / 'data'}", f"paths.cache_dir={tmp_path / 'cache'}",
                         "logger.use_wandb=false", "analysis_device=cpu", *extra])
    return make


def _reference(model, tok, pairs, scale: float, g: int) -> dict:
    """Per layer and target, sum |dL/dA| and count over real rows / key columns, from scratch: each sentence
    tokenized alone, a plain eager forward per group (anchors then positives) with ``output_attentions``, mean
    pooling, normalized cosine x scale, cross-entropy, backward."""
    ref = AutoModel.from_config(copy.deepcopy(model.config), attn_implementation="eager")
    assert ref.config._attn_implementation == "eager"
    ref.load_state_dict(model.state_dict())
    ref.eval()
    # eval mode: dropout returns its input itself, so the returned probabilities are the tensor multiplied with V
    x = torch.rand(3)
    assert torch.nn.functional.dropout(x, p=0.5, training=False) is x
    L, H = ref.config.num_hidden_layers, ref.config.num_attention_heads
    sums = {t: [0.0] * L for t in G.TARGETS}
    counts = {t: [0] * L for t in G.TARGETS}
    specials = set(tok.all_special_ids)
    for start in range(0, len(pairs), g):
        group = pairs[start:start + g]
        n = len(group)
        seqs = [tok(a)["input_ids"] for a, _ in group] + [tok(b)["input_ids"] for _, b in group]
        T = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), T), tok.pad_token_id)  # (2n, T)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)  # (2n, T)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        out = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        assert len(out.attentions) == L
        for a in out.attentions:
            assert type(a.grad_fn).__name__ == "SoftmaxBackward0"  # the softmax output itself, no dropout op
            a.retain_grad()
        emb = torch.stack([out.last_hidden_state[i, :len(s)].mean(0) for i, s in enumerate(seqs)])  # (2n, E)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        scores = scale * emb[:n] @ emb[n:].T  # (n, n)
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(n))
        loss.backward()
        for l, a in enumerate(out.attentions):
            grad = a.grad  # (2n, H, T, T)
            for b, s in enumerate(seqs):
                for j, (tid, piece) in enumerate(zip(s, tok.convert_ids_to_tokens(s))):
                    if tid == tok.sep_token_id:
                        t = "sep"
                    elif tid not in specials and piece.removeprefix("##") in (".", ","):
                        t = "punct"
                    else:
                        t = "other"
                    sums[t][l] += float(grad[b, :, :len(s), j].double().abs().sum())
                    counts[t][l] += H * len(s)
    return dict(sums=sums, counts=counts)


def _table(df: pd.DataFrame, stat: str) -> pd.Series:
    return df[df.stat == stat].set_index(["layer", "target"]).value


def test_contrastive_matches_from_scratch_reference(cfg, tmp_path):
    """Through the real config: first 5 label-1 MRPC pairs, group_size 2 -> groups (0, 1), (2, 3); the lone
    fifth pair is dropped; mean_abs per layer / target equals the eager reference."""
    c = cfg("analysis.objectives.contrastive.group_size=2", "analysis.objectives.contrastive.scale=7.5")
    assert isinstance(instantiate(c.analysis.objectives.contrastive), G.ContrastiveObjective)
    df = instantiate(c.analysis)(AnalysisContext(c, tmp_path / "out", use_wandb=False))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["objective"] == "contrastive" and summary["n_sequences"] == 8
    assert set(df.target) == set(G.TARGETS)
    enc = instantiate(c.encoder)
    ref = _reference(enc.model, enc.tokenizer, PAIRS[:4], scale=7.5, g=2)
    mean_abs, count = _table(df, "mean_abs"), _table(df, "count")
    for t in G.TARGETS:
        for l in range(enc.model.config.num_hidden_layers):
            assert count.loc[(l, t)] == ref["counts"][t][l] > 0
            expected = ref["sums"][t][l] / ref["counts"][t][l]
            assert mean_abs.loc[(l, t)] == pytest.approx(expected, rel=1e-4), (l, t)
    assert (mean_abs > 0).all()
    # the result depends on the groups: another grouping of the same pairs moves it
    c3 = cfg("analysis.objectives.contrastive.group_size=4", "analysis.objectives.contrastive.scale=7.5",
             "analysis.max_sentences=4")
    df3 = instantiate(c3.analysis)(AnalysisContext(c3, tmp_path / "out3", use_wandb=False))
    assert not np.allclose(_table(df3, "mean_abs").values, mean_abs.values, rtol=1e-3)


def test_contrastive_groups_do_not_depend_on_batching(cfg, tmp_path):
    """One forward per fixed group whatever max_tokens / max_batch_size say: identical tables."""
    c = cfg("analysis.objectives.contrastive.group_size=3")
    obj = instantiate(c.analysis.objectives.contrastive)
    ctx = AnalysisContext(c, tmp_path / "out", use_wandb=False)
    m = obj.load(ctx)
    items = obj.prepare(obj.sequences(ctx, m.tokenizer, "dev", None, m.max_length), m.tokenizer)
    assert len(items) == 10  # 5 pairs: groups of 3 and 2 pairs
    assert obj.batches(items, 8, 1) == obj.batches(items, 4096, 32) == [list(range(6)), list(range(6, 10))]
    assert items[0]["ids"] == m.tokenizer(PAIRS[0][0])["input_ids"]  # anchors first ...
    assert items[3]["ids"] == m.tokenizer(PAIRS[0][1])["input_ids"]  # ... then the positives of the group
    a = G.compute(m.model, m.tokenizer, obj, items, "cpu", max_tokens=4096, max_batch_size=32, progress=False)
    b = G.compute(m.model, m.tokenizer, obj, items, "cpu", max_tokens=16, max_batch_size=1, progress=False)
    pd.testing.assert_frame_equal(a.table(), b.table(), check_exact=True)
    assert a.n_sequences == 10


def test_contrastive_clear_errors(cfg, tmp_path):
    with pytest.raises(ValueError, match="group_size=1: needs an integer >= 2"):
        G.ContrastiveObjective(group_size=1)
    with pytest.raises(InstantiationException, match="contrastive.group_size=1: needs an integer >= 2"):
        instantiate(cfg("analysis.objectives.contrastive.group_size=1").analysis)
    with pytest.raises(ValueError, match="pairs_task"):
        G.ContrastiveObjective(pairs_task="rte")
    # a pairs file without label-1 pairs: the error names the task, split and keys
    _write_mrpc(tmp_path / "neg", [(0, a, b) for _, a, b in ROWS])
    c = cfg(f"analysis.objectives.contrastive.data_dir={tmp_path / 'neg'}")
    with pytest.raises(ValueError, match=r"mrpc train has no label-1 .*pairs_task / pairs_split"):
        instantiate(c.analysis)(AnalysisContext(c, tmp_path / "out", use_wandb=False))
    # one pair only: no group with a negative
    c = cfg("analysis.max_sentences=1")
    with pytest.raises(ValueError, match="no group"):
        instantiate(c.analysis)(AnalysisContext(c, tmp_path / "out1", use_wandb=False))


def test_contrastive_pairs_from_shared_mrpc():
    """The shared MRPC train split: the first label-1 rows in file order (read here with plain string splits)."""
    path = require_shared("glue/MRPC/train.tsv", "GLUE MRPC")
    lines = path.read_text(encoding="utf-8-sig").splitlines()[1:]
    expected = [(c[3].strip(), c[4].strip()) for c in (ln.split("\t") for ln in lines) if c[0] == "1"][:20]
    pairs = G.ContrastiveObjective(data_dir=str(path.parents[2])).read_pairs(None, 20)
    assert [(p.text_a, p.text_b) for p in pairs] == expected
