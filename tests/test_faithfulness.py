"""analysis=faithfulness: importances, blank-out, AOPC and Spearman against slow independent implementations
(separate forwards per perturbed input, explicit per-bin loops, scipy's Spearman, captum's attributions), on
tiny random classifiers of every encoder family, single sentences (SST-2) and pairs (MRPC)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from captum.attr import InputXGradient, IntegratedGradients
from omegaconf import OmegaConf
from scipy.stats import spearmanr
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from probes.analysis.beyond.faithfulness import (METRICS, Classifier, ExampleChoice, Scoring, compute, make_items,
                                                 map_importance, merge, paper_numbers, partial_writer, score_example,
                                                 top_counts)
from probes.analysis.context import AnalysisContext, run_analysis
from probes.stats import bootstrap_mean
from probes.data.glue import GlueExample
from probes.glue.export import load_finetuned
from probes.measures.attention import Attention
from probes.measures.gradient import GradAttribution
from probes.measures.rollout import Flow
from probes.measures.saliency import HeadAttributionRows, logit_attributions
from probes.model import hooks, structure
from probes.model.families import set_padding
from probes.model.fixed_inputs import fixed_inputs
from probes.model.tiny import FAMILIES, tiny_folder

ROOT = Path(__file__).resolve().parents[1]
SST2 = ["it 's a charming and often affecting journey .", "unflinchingly bleak and desperate",
        "the acting , costumes , music , cinematography and sound are all astounding", "a mess ."]
MRPC = [("He said the pie business does n't fit the company 's strategy .",
         "The pie business does not fit our strategy ."),
        ("Magnarelli said Racicot hated the regime .", "His wife said he was behind Bush .")]


def write_glue(root: Path) -> Path:
    (root / "SST-2").mkdir(parents=True)
    (root / "SST-2" / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s} \t{i % 2}\n"
                                                                         for i, s in enumerate(SST2)))
    (root / "MRPC").mkdir()
    (root / "MRPC" / "dev.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "".join(
        f"{i % 2}\t{i}\t{i + 100}\t{a}\t{b}\n" for i, (a, b) in enumerate(MRPC)))
    return root


def make_run(family: str, task: str, root: Path) -> Path:
    """A GLUE run folder holding a tiny random classifier trained for a few steps on the test examples, so its
    prediction depends on the input (a tiny random encoder's [CLS] barely varies)."""
    folder = tiny_folder(family, root=root / "models")
    run = root / f"run-{family}-{task}"
    if (run / "hf_model" / "config.json").exists():
        return run
    torch.manual_seed(3)
    clf = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=2)
    tok = set_padding(AutoTokenizer.from_pretrained(str(folder)), clf.config)  # decoders: the EOS pads
    texts = [(s, None) for s in SST2] if task == "sst2" else MRPC + [(b, a) for a, b in MRPC]
    enc = tok([a for a, _ in texts], None if task == "sst2" else [b for _, b in texts], padding=True,
              return_tensors="pt")
    labels = torch.arange(len(texts)) % 2
    opt = torch.optim.AdamW(clf.parameters(), lr=3e-3)
    clf.train()
    for _ in range(40):  # until the examples are told apart, not saturated
        loss = clf(**enc, labels=labels).loss
        if loss < 0.55:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    clf.eval()
    clf.save_pretrained(run / "hf_model")
    tok.save_pretrained(run / "hf_model")
    (run / "hf_model" / "glue_task.json").write_text(json.dumps({"task": task}))
    return run


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("faith")
    write_glue(r / "glue")
    return r


def run_faithfulness(root: Path, run: Path, out: Path, **params):
    ctx = AnalysisContext.create("faithfulness", out, overrides=[f"paths.data_dir={root}",
                                                                 f"paths.cache_dir={root / 'cache'}"],
                                 params=dict(checkpoint=str(run), **params), figures=True)
    return run_analysis(ctx.cfg, out, context=ctx)


# ----------------------------------------------------------------------------- slow references
def slow_probs(model, ids: list[int], tt: list[int] | None) -> np.ndarray:
    """One plain forward of one sequence: (C,) probabilities."""
    x = torch.tensor([ids])
    inp = dict(input_ids=x, attention_mask=torch.ones_like(x))
    if tt is not None:
        inp["token_type_ids"] = torch.tensor([tt])
    with torch.no_grad():
        return model(**structure.model_inputs(model, **inp)).logits.softmax(-1)[0].numpy()


def slow_remove(ids, tt, units, removed, erase, mask_id):
    """The sequence with the pieces of ``removed`` units deleted or masked, by an explicit loop."""
    gone = set()
    for u in removed:
        gone.update(units[u])
    new_ids, new_tt = [], []
    for t in range(len(ids)):
        if t in gone and erase == "delete":
            continue
        new_ids.append(mask_id if t in gone else ids[t])
        if tt is not None:
            new_tt.append(tt[t])
    return new_ids, (new_tt if tt is not None else None)


def slow_aopc(model, item, scores, erase, mask_id, c, p, bins):
    order = sorted(range(len(scores)), key=lambda u: (-scores[u], u))
    comp, suff = [], []
    for b in bins:
        k = max(1, math.ceil(b * len(scores) / 100 - 1e-9))
        k = min(k, len(scores))
        comp.append(p - slow_probs(model, *slow_remove(item.ids, item.token_types, item.units, order[:k], erase,
                                                        mask_id))[c])
        suff.append(p - slow_probs(model, *slow_remove(item.ids, item.token_types, item.units, order[k:], erase,
                                                        mask_id))[c])
    return float(np.mean(comp)), float(np.mean(suff))


# ----------------------------------------------------------------------------- pieces
def test_top_counts_and_bootstrap():
    assert top_counts(20, [1, 5, 10, 20, 50]) == [1, 1, 2, 4, 10]
    assert top_counts(3, [1, 50, 100]) == [1, 2, 3]
    rng = np.random.default_rng(0)
    v = rng.normal(size=(400, 3))
    v[:10, 2] = np.nan
    v[:, 1] = 0.5
    mean, lo, hi, n = bootstrap_mean(v, 500, 0)
    np.testing.assert_allclose(mean, np.nanmean(v, 0))
    assert list(n) == [400, 400, 390]
    assert lo[1] == hi[1] == 0.5
    se = np.nanstd(v[:, 0]) / np.sqrt(400)
    assert abs((hi[0] - lo[0]) / (2 * 1.96 * se) - 1) < 0.2  # the percentile interval ~ the normal one
    assert lo[0] < mean[0] < hi[0]


def test_papers_numbers_from_papers_yaml():
    nums = {(x["source"], x["kind"], x["metric"], x["model"]): x["value"] for x in paper_numbers()}
    assert nums[("Abnar & Zuidema 2020", "rollout", "spearman_blankout", "6-layer SVA transformer")] == 0.71
    assert nums[("Abnar & Zuidema 2020", "flow", "spearman_blankout", "DistilBERT SST-2")] == 0.14
    assert nums[("Abnar & Zuidema 2020", "flow", "spearman_grad", "6-layer SVA transformer")] == 0.61
    got = sorted(v for (s, k, m, _), v in nums.items() if s == "Ferrando et al. 2022" and m == "comprehensiveness")
    assert got == [0.076, 0.231, 0.269]
    assert sorted(v for (s, k, m, _), v in nums.items() if s == "Ferrando et al. 2022" and m == "sufficiency") == \
        [0.057, 0.067, 0.179]


def test_flow_rows_and_head_attribution_rows_equal_the_full_maps(root):
    ft = load_finetuned(make_run("bert", "sst2", root))
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 3]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        full = torch.stack(Flow()(ft.model, ids, mask))  # (L, 1, 1, T, T)
        rows = torch.stack(Flow(rows=[0])(ft.model, ids, mask))
        ga = torch.stack(GradAttribution()(ft.model, ids, mask))  # (L, 1, H, T, T)
        gr = torch.stack(HeadAttributionRows(rows=[0])(ft.model, ids, mask))
    torch.testing.assert_close(rows[..., 0, :], full[..., 0, :], atol=1e-9, rtol=0)
    assert rows[..., 1:, :].abs().max() == 0
    torch.testing.assert_close(gr[..., 0, :], ga[..., 0, :], atol=1e-6, rtol=1e-5)


def test_negative_rows_count_from_each_sentences_end(root):
    """rows=[-1] fills each sentence's last real piece of a right-padded batch, equal to the full maps' row."""
    ft = load_finetuned(make_run("bert", "sst2", root))
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 3], [2, 45, 46, 3, 0, 0, 0]])
    mask = (torch.arange(7) < torch.tensor([[7], [4]])).long()  # (2, 7)
    with torch.inference_mode():
        full = torch.stack(Flow()(ft.model, ids, mask))  # (L, 2, 1, T, T)
        last = torch.stack(Flow(rows=[-1])(ft.model, ids, mask))
        ga = torch.stack(GradAttribution()(ft.model, ids, mask))  # (L, 2, H, T, T)
        gl = torch.stack(HeadAttributionRows(rows=[-1])(ft.model, ids, mask))
    for b, n in enumerate((7, 4)):
        torch.testing.assert_close(last[:, b, :, n - 1], full[:, b, :, n - 1], atol=1e-9, rtol=0)
        torch.testing.assert_close(gl[:, b, :, n - 1], ga[:, b, :, n - 1], atol=1e-6, rtol=1e-5)
        assert last[:, b, :, :n - 1].abs().max() == 0 and gl[:, b, :, :n - 1].abs().max() == 0


def test_logit_attributions_match_captum(root):
    ft = load_finetuned(make_run("bert", "mrpc", root))
    model = ft.model
    [item], _ = make_items(ft.tokenizer, [GlueExample(*MRPC[0], 0, 0)], "word", 128)
    ids, tt = torch.tensor(item.ids), torch.tensor(item.token_types)
    x = model.get_input_embeddings()(ids[None]).detach()  # (1, T, E)

    def fwd(emb):
        B = emb.shape[0]
        return model(inputs_embeds=emb, attention_mask=torch.ones(B, emb.shape[1], dtype=torch.long),
                     token_type_ids=tt[None].expand(B, -1)).logits

    for target in (0, 1):
        ref = InputXGradient(fwd).attribute(x, target=target)[0]
        torch.testing.assert_close(logit_attributions(model, ids, target, "ixg", token_type_ids=tt), ref,
                                   atol=1e-6, rtol=1e-4)
        ref = IntegratedGradients(fwd).attribute(x, baselines=torch.zeros_like(x), target=target, n_steps=8,
                                                 method="riemann_middle")[0]
        got = logit_attributions(model, ids, target, "ig", steps=8, token_type_ids=tt, batch=3)
        torch.testing.assert_close(got, ref.float(), atol=1e-6, rtol=1e-4)


def test_fixed_inputs_give_the_pair_its_token_types(root):
    ft = load_finetuned(make_run("bert", "mrpc", root))
    [item], _ = make_items(ft.tokenizer, [GlueExample(*MRPC[0], 0, 0)], "word", 128)
    ids, tt = torch.tensor([item.ids]), torch.tensor([item.token_types])
    assert tt.max() == 1
    with torch.inference_mode():
        with hooks.attention(ft.model, layers=None) as s:
            s.run(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=tt)
            want = [s.probs[l].clone() for l in range(2)]
        with fixed_inputs(ft.model, token_type_ids=tt):
            got = Attention()(ft.model, ids, torch.ones_like(ids))
        plain = Attention()(ft.model, ids, torch.ones_like(ids))
    for g, w, p in zip(got, want, plain):
        torch.testing.assert_close(g, w)
    assert not torch.allclose(plain[-1], want[-1])


# ----------------------------------------------------------------------------- one example against slow code
@pytest.mark.parametrize("family,task,erase", [("bert", "sst2", "delete"), ("roberta", "mrpc", "delete"),
                                               ("bert", "mrpc", "mask"), ("distilbert", "sst2", "mask")])
def test_score_example_against_slow_implementations(root, family, task, erase):
    ft = load_finetuned(make_run(family, task, root))
    model = ft.model.eval()
    ex = GlueExample(*MRPC[0], 1, 0) if task == "mrpc" else GlueExample(SST2[2], None, 1, 0)
    bins = [1, 5, 10, 20, 50]
    for level in ("word", "piece"):
        [item], _ = make_items(ft.tokenizer, [ex], level, 128)
        n_words = len(ex.text_a.split()) + (len(ex.text_b.split()) if ex.text_b else 0)
        assert len(item.units) == (n_words if level == "word" else sum(len(u) for u in item.units))
        specials = set(range(len(item.ids))) - {t for u in item.units for t in u}
        assert 0 in specials and len(item.ids) - 1 in specials
        es = score_example(item, model, {"attention": Attention()}, Classifier(model, ft.tokenizer.pad_token_id, "cpu",
                                                                             max_tokens=64),
                           references=["ixg", "ig", "loo", "random"], row=0, erase=erase,
                           mask_id=ft.tokenizer.mask_token_id, bins=bins, aopc_layers=[2], ig_steps=4, seed=0,
                           device="cpu")
        p0 = slow_probs(model, item.ids, item.token_types)
        c, p = int(p0.argmax()), float(p0.max())
        assert es.predicted == c and es.p == pytest.approx(p, abs=1e-6)
        blank = np.array([p - slow_probs(model, *slow_remove(item.ids, item.token_types, item.units, [u], erase,
                                                             ft.tokenizer.mask_token_id))[c]
                          for u in range(len(item.units))])
        np.testing.assert_allclose(es.blankout, blank, atol=1e-5)
        assert np.abs(blank).max() > 1e-4  # the tiny classifier does react
        # the attention importance: last layer's [CLS] row, head mean, summed over each unit's pieces
        x = torch.tensor([item.ids])
        inp = dict(input_ids=x, attention_mask=torch.ones_like(x))
        if item.token_types is not None:
            inp["token_type_ids"] = torch.tensor([item.token_types])
        with torch.no_grad():
            att = model(**structure.model_inputs(model, **inp), output_attentions=True).attentions[-1][0]  # (H, T, T)
        want = np.array([float(att[:, 0, u].mean(0).sum()) for u in item.units])
        np.testing.assert_allclose(es.scores[("attention", 2)], want, atol=1e-5)
        x_ = torch.tensor(item.ids)
        tt = None if item.token_types is None else torch.tensor(item.token_types)
        ixg_piece = logit_attributions(model, x_, c, "ixg", token_type_ids=tt).sum(-1).numpy()
        np.testing.assert_allclose(es.scores[("ixg", 0)], [ixg_piece[u].sum() for u in item.units], atol=1e-5)
        rows = {(r["kind"], r["layer"]): r for r in es.rows}
        for key in [("attention", 2), ("ixg", 0), ("ig", 0), ("loo", 0), ("random", 0)]:
            comp, suff = slow_aopc(model, item, list(es.scores[key]), erase, ft.tokenizer.mask_token_id, c, p, bins)
            assert rows[key]["comprehensiveness"] == pytest.approx(comp, abs=1e-5), key
            assert rows[key]["sufficiency"] == pytest.approx(suff, abs=1e-5), key
            assert rows[key]["spearman_blankout"] == pytest.approx(spearmanr(es.scores[key], blank)[0], abs=1e-9)
            assert rows[key]["spearman_grad"] == pytest.approx(
                spearmanr(es.scores[key], es.scores[("ixg", 0)])[0], abs=1e-9)
        assert math.isnan(rows[("attention", 1)]["comprehensiveness"])  # AOPC at the selected layer only
        assert not math.isnan(rows[("attention", 1)]["spearman_blankout"])


# ----------------------------------------------------------------------------- the whole analysis, every family
@pytest.mark.parametrize("family", FAMILIES)
def test_analysis_runs_for_every_family(root, family, tmp_path):
    for task in ("sst2", "mrpc"):
        out = tmp_path / task
        res = run_faithfulness(root, make_run(family, task, root), out, max_examples=2, n_boot=50, ig_steps=3,
                               aopc_layers="all" if task == "mrpc" else "selected")
        table = res.tables["faithfulness"]
        kinds = ["attention", "rollout", "flow", "norm", "norm_res_ln", "alti", "value_zeroing", "grad_attribution"]
        assert list(table.kind) == kinds + ["ixg", "ig", "loo", "random"]
        assert np.isfinite(table[list(METRICS)].to_numpy(dtype=float)).all()
        assert set(table.layer) == {2, 0}
        ref = table.set_index("kind")
        assert ref.loc["loo", "spearman_blankout"] == pytest.approx(1.0)
        assert ref.loc["ixg", "spearman_grad"] == pytest.approx(1.0)
        # the table's means are the per-example means at the selected layer
        ex = res.tables["faithfulness_examples"]
        for kind in ("alti", "random"):
            layer = 2 if kind == "alti" else 0
            d = ex[(ex.kind == kind) & (ex.layer == layer)]
            assert len(d) == 2
            for m in METRICS:
                assert ref.loc[kind, m] == pytest.approx(np.nanmean(d[m]), abs=1e-12)
                assert ref.loc[kind, f"{m}_lo"] <= ref.loc[kind, m] + 1e-12 <= ref.loc[kind, f"{m}_hi"] + 2e-12
        layers = res.tables["faithfulness_layers"]
        aopc_layers = set(layers[(layers.metric == "comprehensiveness") & (layers.kind == "attention")].layer)
        assert aopc_layers == ({1, 2} if task == "mrpc" else {2})
        assert (out / "faithfulness.png").exists() and (out / "faithfulness_layers.png").exists()
        s = json.loads((out / "summary.json").read_text())["tasks"][task]
        assert s["n_examples"] == 2 and set(s["seconds_per_kind"]) >= set(kinds)


def test_compute_writes_only_the_partial_rows_and_removes_them(root, tmp_path):
    """compute writes nothing but the rows so far (every log_every examples, through its writer), removed at the
    end of the task; bad settings are named by their key."""
    out = tmp_path / "out"
    run = make_run("bert", "sst2", root)
    ctx = AnalysisContext.create("faithfulness", out, overrides=[f"paths.data_dir={root}",
                                                                 f"paths.cache_dir={root / 'cache'}"],
                                 params=dict(checkpoint=str(run)))
    path, write, seen = out / "faithfulness_examples.partial.csv", partial_writer(out), []
    before = sorted(out.iterdir())  # the context's own records

    def spy(suffix, rows):
        write(suffix, rows)
        seen.append((suffix, None if rows is None else len(pd.read_csv(path)), path.exists()))

    scoring = Scoring(kinds=("attention",), references=("ixg", "loo", "random"), ig_steps=2)
    result = compute(ctx, ExampleChoice(checkpoint=str(run), max_examples=3), scoring, {"attention": Attention()},
                     n_boot=10, log_every=1, partial=spy)
    [task] = result.tasks
    per = len(task.examples) // 3  # rows per example: the attention layers and the references
    assert per == 2 + 3 and task.n_examples == 3
    assert seen == [("", per, True), ("", 2 * per, True), ("", None, False)]
    assert sorted(out.iterdir()) == before
    with pytest.raises(ValueError, match="analysis.erase"):
        Scoring(erase="blank")
    with pytest.raises(ValueError, match="analysis.references"):
        Scoring(references=("ixg", "shap"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decoders_read_the_last_row(root, family, tmp_path):
    """On a decoder the pooled token is the last one: row -1 runs every kind (flow and grad_attribution on
    that row only, through the config's interpolation) and scores each example by its last piece's row;
    row 0 (a token that sees only itself) is refused before any work."""
    run = make_run(family, "sst2", root)
    with pytest.raises(ValueError, match="analysis.row=0"):
        run_faithfulness(root, run, tmp_path / "zero", max_examples=2, n_boot=20, ig_steps=2)
    res = run_faithfulness(root, run, tmp_path / "last", max_examples=2, n_boot=20, ig_steps=2, row=-1)
    table = res.tables["faithfulness"]
    assert np.isfinite(table[list(METRICS)].to_numpy(dtype=float)).all() and "flow" in set(table.kind)
    s = json.loads((tmp_path / "last" / "summary.json").read_text())["tasks"]["sst2"]
    assert s["row"] == -1
    ft = load_finetuned(run)
    [item], _ = make_items(ft.tokenizer, [GlueExample(SST2[0], None, 0, 0)], "word", 128)
    ids = torch.tensor([item.ids])
    with torch.inference_mode():
        att = torch.stack(Attention()(ft.model.eval(), ids, torch.ones_like(ids)))  # (L, 1, H, T, T)
    imp = map_importance(Attention(), ft.model, item, -1, "cpu")  # (L, T)
    np.testing.assert_allclose(imp, att[:, 0, :, -1].float().mean(1).double().numpy(), atol=1e-6)
    assert (imp[:, :-1] > 0).any()  # the last row reaches back over the sentence (row 0 would be [1, 0, ...])


def test_bad_settings_are_named_before_work(root, tmp_path):
    run = make_run("bert", "sst2", root)
    with pytest.raises(ValueError, match="analysis.erase"):
        run_faithfulness(root, run, tmp_path / "a", erase="drop")
    with pytest.raises(ValueError, match="analysis.layer"):
        run_faithfulness(root, run, tmp_path / "b", layer=7)
    with pytest.raises(ValueError, match="analysis.references"):
        run_faithfulness(root, run, tmp_path / "c", references=["ixg", "shap"])


# ----------------------------------------------------------------------------- the docs' tables
DOC = ROOT / "docs" / "beyond" / "faithfulness.md"
RESULTS = ROOT / "docs" / "results" / "faithfulness"


def doc_rows(text: str, marker: str) -> dict[str, list[str]]:
    """The rows (first cell -> cells) of the markdown table after the line holding ``marker``."""
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`* ")] = cells[1:]
    return rows


@pytest.mark.parametrize("task", ["sst2", "mrpc"])
def test_doc_tables_are_the_recorded_runs(task):
    csv = RESULTS / f"{task}.csv"
    if not csv.exists():
        pytest.skip(f"{csv} not recorded yet")
    table = pd.read_csv(csv).set_index("kind")
    rows = doc_rows(DOC.read_text(), f"<!-- table:{task} -->")
    assert set(rows) == set(table.index)
    for kind, cells in rows.items():
        for m, cell in zip(METRICS, cells):
            got = re.match(r"(-?[0-9.]+) \[(-?[0-9.]+), (-?[0-9.]+)\]", cell)
            assert got, (kind, m, cell)
            for v, col in zip(got.groups(), (m, f"{m}_lo", f"{m}_hi")):
                assert float(v) == pytest.approx(round(float(table.loc[kind, col]), 3), abs=6e-4), (kind, col)


def test_runs_over_parts_merge_into_the_run_over_all(root, tmp_path):
    run = make_run("bert", "sst2", root)
    full = run_faithfulness(root, run, tmp_path / "full", n_boot=200, ig_steps=3)
    for first in (0, 2):
        run_faithfulness(root, run, tmp_path / f"part{first}", first_example=first, max_examples=2, n_boot=200,
                         ig_steps=3)
    table = merge([tmp_path / "part2", tmp_path / "part0"], tmp_path / "merged", n_boot=200, seed=0)
    ex = pd.read_csv(tmp_path / "merged" / "faithfulness_examples.csv").sort_values(["example", "kind", "layer"])
    want = full.tables["faithfulness_examples"].sort_values(["example", "kind", "layer"])
    np.testing.assert_allclose(ex[list(METRICS)].to_numpy(float), want[list(METRICS)].to_numpy(float), atol=1e-12)
    got = table.set_index("kind")[list(METRICS)]
    np.testing.assert_allclose(got.to_numpy(float), full.tables["faithfulness"].set_index("kind").loc[got.index,
                                                                                                   list(METRICS)]
                               .to_numpy(float), atol=1e-12)
    s = json.loads((tmp_path / "merged" / "summary.json").read_text())
    assert s["tasks"]["sst2"]["n_examples"] == 4 and (tmp_path / "merged" / "faithfulness_layers.png").exists()
    with pytest.raises(ValueError, match="share examples"):
        merge([tmp_path / "part0", tmp_path / "full"], tmp_path / "bad")
    # a stopped run: its partial per-example CSV and its Hydra config
    stopped = tmp_path / "part2"
    (stopped / "summary.json").unlink()
    (stopped / "faithfulness_examples.csv").rename(stopped / "faithfulness_examples.partial.csv")
    (stopped / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"analysis": dict(task="sst2", checkpoint=str(run), split="dev", layer=None, row=0,
                                                      level="word", erase="delete", bins=[1, 5, 10, 20, 50],
                                                      ig_steps=3)}), stopped / ".hydra" / "config.yaml")
    again = merge([tmp_path / "part0", stopped], tmp_path / "merged2", n_boot=200, seed=0)
    pd.testing.assert_frame_equal(again[list(METRICS)].reset_index(drop=True), table[list(METRICS)].reset_index(drop=True))
    s = json.loads((tmp_path / "merged2" / "summary.json").read_text())
    assert [p["stopped"] for p in s["parts"]] == [False, True]
