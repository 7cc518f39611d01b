"""The public Python API (probes.api): encoders, word maps against a slow independent reference, readers,
one's own treebank (Python and Hydra), analyses from Python equal to the command line's CSVs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.utils import instantiate
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

import probes
from probes.analysis.context import AnalysisContext
from probes.config import compose
from probes.data.conllu import ConlluError, Sentence
from probes.model.load import packaged_minilm_path
from probes.model.tiny import FAMILIES, tiny_folder
from tests.conftest import TINY_CONLLU, write_chain_treebank
from tests.reference import text_pieces

REPO = Path(__file__).resolve().parents[1]
SENTS = [["The", "dog", "barked", "."], ["John", "'s", "unbelievably-comfortable", "cat", "sat", "on", "it", "!"],
         ["Hi"]]
FIRST_LAST = {"bert": ("[CLS]", "[SEP]"), "distilbert": ("[CLS]", "[SEP]"), "electra": ("[CLS]", "[SEP]"),
              "albert": ("[CLS]", "[SEP]"), "deberta-v2": ("[CLS]", "[SEP]"), "modernbert": ("[CLS]", "[SEP]"),
              "roberta": ("<s>", "</s>"), "xlm-roberta": ("<s>", "</s>"), "mpnet": ("<s>", "</s>")}
KINDS = list(compose("analyze").extract.measures)
CPU = ["extract.precision=32-true", "extract.trainer.accelerator=cpu"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: tiny_folder(f, root=root) for f in FAMILIES}


# ----------------------------------------------------------------------------- the slow reference
def reference_rows(tokenizer, words: list[str]) -> tuple[list[int], list[int]]:
    """(input ids, word-map row of every piece) of the words as running text: the tokenizer on the joined words,
    each piece's word from its characters (:func:`tests.reference.text_pieces`, nothing from probes.model.inputs);
    first special -> 0, word w -> w + 1, any other special -> the last row."""
    ids, wids = text_pieces(tokenizer, words)
    R = len(words) + 2
    rows = [0 if t == 0 else R - 1 if w is None else w + 1 for t, w in enumerate(wids)]
    return ids, rows


def slow_pool(piece: np.ndarray, rows: list[int], R: int) -> np.ndarray:
    """(L, H, T, T) piece maps -> (L, H, R, R): row = mean over the word's pieces, column = sum, by loops."""
    L, H = piece.shape[:2]
    out = np.zeros((L, H, R, R))
    members = [[t for t, r in enumerate(rows) if r == k] for k in range(R)]
    for l in range(L):
        for h in range(H):
            for a in range(R):
                for b in range(R):
                    total = 0.0
                    for t in members[a]:
                        for u in members[b]:
                            total += float(piece[l, h, t, u])
                    out[l, h, a, b] = total / len(members[a])
    return out


def eager_word_maps(folder, words: list[str]) -> np.ndarray:
    """The plain transformers model (eager attention, output_attentions) of one sentence, pooled by loops."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    ids, rows = reference_rows(tok, words)
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    piece = torch.stack(att)[:, 0].double().numpy()  # (L, H, T, T)
    return slow_pool(piece, rows, len(words) + 2)


# ----------------------------------------------------------------------------- word maps
@pytest.mark.parametrize("family", FAMILIES)
def test_word_maps_equal_eager_forward_pooled_by_loops(models, family):
    enc = probes.load_encoder(models[family])
    got = probes.word_maps(enc, SENTS)
    assert len(got) == len(SENTS)
    first, last = FIRST_LAST[family]
    for words, wm in zip(SENTS, got):
        R = len(words) + 2
        assert wm.maps.dtype == np.float32 and wm.maps.shape == (2, 4, R, R)
        assert wm.labels == [first, *words, last] and wm.words == words and wm.layers == [0, 1]
        np.testing.assert_allclose(wm.maps, eager_word_maps(models[family], words), rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(wm.maps.sum(-1), 1.0, atol=1e-5)  # mean rows of row-stochastic maps


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_equals_its_piece_maps_pooled_by_loops(models, kind):
    """word_maps of each kind == the kind's measure run on the sentence, pooled by the slow loop (one sentence
    per call: value zeroing's cosine distances of a random tiny model are small enough that float32 rounding
    differs between batch shapes)."""
    folder = models["bert"]
    enc = probes.load_encoder(folder)
    measure = instantiate(compose("analyze").extract.measures[kind])
    sents = [SENTS[0], SENTS[2], ["a", "big", "red", "house", "."]]
    got = [wm for s in sents for wm in probes.word_maps(enc, [s], kind=kind)]
    tok = AutoTokenizer.from_pretrained(str(folder))
    for words, wm in zip(sents, got):
        ids, rows = reference_rows(tok, words)
        x = torch.tensor([ids])
        piece = torch.stack(measure(enc.model, x, torch.ones_like(x)))[:, 0].detach().double().numpy()
        H = 4 if measure.per_head else 1
        assert wm.maps.shape == (2, H, len(words) + 2, len(words) + 2) and wm.kind == kind
        np.testing.assert_allclose(wm.maps, slow_pool(piece, rows, len(words) + 2), rtol=1e-4, atol=1e-5)


def test_strings_split_on_whitespace_and_layers_select(models):
    enc = probes.load_encoder(models["roberta"])
    [a] = probes.word_maps(enc, ["  The dog\tbarked  . "])
    [b] = probes.word_maps(enc, [SENTS[0]])
    assert a.words == SENTS[0] and a.labels == ["<s>", *SENTS[0], "</s>"]
    np.testing.assert_array_equal(a.maps, b.maps)
    [one] = probes.word_maps(enc, [SENTS[0]], layers=1)
    [two] = probes.word_maps(enc, [SENTS[0]], layers=[1, 0])
    assert one.layers == [1] and two.layers == [1, 0]
    np.testing.assert_array_equal(one.maps[0], b.maps[1])
    np.testing.assert_array_equal(two.maps, b.maps[[1, 0]])
    frame = b.frame(1, 2)
    assert list(frame.index) == b.labels and np.array_equal(frame.to_numpy(), b.maps[1, 2])
    tidy = b.to_frame()
    assert len(tidy) == b.maps.size
    row = tidy[(tidy.layer == 1) & (tidy["head"] == 2) & (tidy["from"] == 1) & (tidy["to"] == 5)].iloc[0]
    assert (row.from_label, row.to_label, row.value) == ("The", "</s>", b.maps[1, 2, 1, 5])
    with pytest.raises(ValueError, match="layers"):
        probes.word_maps(enc, [SENTS[0]], layers=[2])


def test_word_maps_bad_input(models):
    enc = probes.load_encoder(models["bert"])
    with pytest.raises(ValueError, match="sentence 1 is empty"):
        probes.word_maps(enc, ["a b", "   "])
    with pytest.raises(ValueError, match="sentence 0 is empty"):
        probes.word_maps(enc, [[]])
    with pytest.raises(TypeError, match="list of sentences"):
        probes.word_maps(enc, "The dog barked")
    with pytest.raises(KeyError, match="rollout"):
        probes.word_maps(enc, ["a b"], kind="no_such_kind")
    with pytest.raises(ValueError, match="sentence 0 has 130 pieces"):  # the tiny models hold 128
        probes.word_maps(enc, [["a"] * 128])


@pytest.mark.slow
def test_packaged_minilm_word_maps_equal_eager_forward():
    enc = probes.load_encoder()
    assert enc.name == "all-MiniLM-L6-v2" and (enc.num_layers, enc.num_heads) == (6, 12)
    got = probes.word_maps(enc, [" ".join(SENTS[1]), SENTS[0]])
    for words, wm in zip([SENTS[1], SENTS[0]], got):
        assert wm.labels == ["[CLS]", *words, "[SEP]"]
        np.testing.assert_allclose(wm.maps, eager_word_maps(packaged_minilm_path(), words), rtol=1e-4, atol=2e-6)


# ----------------------------------------------------------------------------- encoders
def test_encoder_by_config_name_equals_the_command_lines():
    """``load_encoder("tiny")`` is ``encoder=tiny`` of conf/encoder/tiny.yaml: same weights, same maps."""
    by_name = probes.load_encoder("tiny")
    by_conf = instantiate(compose("analyze", ["encoder=tiny"]).encoder)
    assert by_name.name == by_conf.name and by_name.num_layers == 2
    a, b = probes.word_maps(by_name, [SENTS[0]]), probes.word_maps(by_conf, [SENTS[0]])
    np.testing.assert_array_equal(a[0].maps, b[0].maps)
    with pytest.raises(FileNotFoundError):
        probes.load_encoder("no_such_encoder_config")


def test_finetuned_run_folder_gives_its_encoder(models, tmp_path):
    """A GLUE run folder (hf_model/ holding a sequence classifier): head=base is the classifier's encoder."""
    run = tmp_path / "run"
    clf = AutoModelForSequenceClassification.from_pretrained(str(models["bert"]), num_labels=2)
    torch.manual_seed(1)
    with torch.no_grad():  # not the pre-trained weights any more
        for p in clf.bert.encoder.parameters():
            p.add_(0.1 * torch.randn_like(p))
    clf.save_pretrained(run / "hf_model")
    AutoTokenizer.from_pretrained(str(models["bert"])).save_pretrained(run / "hf_model")
    (run / "hf_model" / "glue_task.json").write_text(json.dumps({"task": "rte"}))
    enc = probes.load_encoder(run)
    assert enc.name == "run" and enc.head == "base"
    [wm] = probes.word_maps(enc, [SENTS[0]])
    np.testing.assert_allclose(wm.maps, eager_word_maps(run / "hf_model", SENTS[0]), rtol=1e-4, atol=2e-6)
    [pre] = probes.word_maps(probes.load_encoder(models["bert"]), [SENTS[0]])
    assert not np.allclose(wm.maps, pre.maps, atol=1e-3)
    assert type(probes.load_encoder(run, head="sequence_classification").model).__name__.endswith(
        "ForSequenceClassification")
    with pytest.raises(ValueError, match="masked-LM"):
        probes.load_encoder(run, head="mlm")


def test_gguf_without_the_optional_package(tmp_path, monkeypatch):
    """A .gguf path with the package gguf not importable (``sys.modules["gguf"] = None`` hides an installed
    one) is an ImportError naming the install command; with gguf importable the same path gets past that check
    to the missing file."""
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match="pip install gguf accelerate"):
        probes.load_encoder(tmp_path / "model.gguf")
    monkeypatch.undo()
    if importlib.util.find_spec("gguf") is not None:
        with pytest.raises(FileNotFoundError, match="GGUF file not found"):
            probes.load_encoder(tmp_path / "model.gguf")


# ----------------------------------------------------------------------------- readers and treebanks
def test_readers(tmp_path):
    p = tmp_path / "a.conllu"
    p.write_text(TINY_CONLLU)
    sents = probes.read_conllu(p)
    assert [s.words for s in sents][0] == ("The", "dog", "barked", ".") and isinstance(sents[0], Sentence)
    bad = tmp_path / "bad.conllu"
    bad.write_text(TINY_CONLLU.replace("2\tdog\tdog\tNOUN\t_\t_\t3", "2\tdog\tdog\tNOUN\t_\t_\tx"))
    with pytest.raises(ConlluError, match=f"{bad}:3: HEAD"):
        probes.read_conllu(bad)
    with pytest.raises(FileNotFoundError, match="nope.conllu"):
        probes.read_conllu(tmp_path / "nope.conllu")
    t = tmp_path / "s.txt"
    t.write_text("The dog  barked .\n\n   \nHi\tthere\n")
    assert probes.read_text(t) == [["The", "dog", "barked", "."], ["Hi", "there"]]
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        probes.read_text(tmp_path / "nope.txt")


def test_own_treebank_python_and_hydra(tmp_path, monkeypatch):
    for split, text in (("train", TINY_CONLLU * 2), ("dev", TINY_CONLLU)):
        (tmp_path / f"{split}.conllu").write_text(text)
    tb = probes.treebank(train=tmp_path / "train.conllu", dev=tmp_path / "dev.conllu")
    assert tb.splits == ["train", "dev"] and len(tb.read("train")) == 6 and len(tb.read("dev")) == 3
    assert tb.read("dev")[1].heads == (3, 1, 4, 0, 7, 7, 4, 4)
    with pytest.raises(KeyError, match="test"):
        tb.read("test")
    with pytest.raises(FileNotFoundError, match="missing.conllu"):
        probes.treebank(dev=tmp_path / "missing.conllu")
    # Hydra: data=conllu with the files on the command line, for training and for the analyses
    for config in ("train", "analyze"):
        cfg = compose(config, ["data=conllu", f"data.treebank.files.train={tmp_path / 'train.conllu'}",
                               f"data.treebank.files.dev={tmp_path / 'dev.conllu'}"])
        assert cfg.data._target_ == "probes.dependency.datamodule.DependencyDataModule"
        tb = instantiate(cfg.data.treebank)
        assert [s.words for s in tb.read("dev")] == [s.words for s in probes.read_conllu(tmp_path / "dev.conllu")]
        assert len(tb.read("train")) == 6 and cfg.data.name == "conllu"
        with pytest.raises(FileNotFoundError, match=r"data\.treebank\.files\.test"):
            tb.read("test")
    cfg = compose("analyze", ["data=conllu", f"data.treebank.files.dev={tmp_path / 'gone.conllu'}"])
    with pytest.raises(FileNotFoundError, match=r"gone\.conllu.*data\.treebank\.files\.dev"):
        instantiate(cfg.data.treebank).read("dev")


@pytest.mark.slow
def test_train_on_own_conllu_files(tmp_path):
    """`python train.py data=conllu data.treebank.files.<split>=...`: the documented command trains a probe on
    files outside the data folder (no download, no pinned digest)."""
    for split, n, seed in (("train", 60, 0), ("dev", 20, 1), ("test", 20, 2)):
        write_chain_treebank(tmp_path / f"{split}.conllu", n, seed)
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "train.py", "experiment=smoke", "encoder=tiny", "data=conllu", "logger=none",
                        *[f"data.treebank.files.{s}={tmp_path / f'{s}.conllu'}" for s in ("train", "dev", "test")],
                        f"paths.log_dir={tmp_path / 'logs'}", f"paths.cache_dir={tmp_path / 'cache'}",
                        "extract.precision=32-true", "extract.trainer.accelerator=cpu", "trainer.accelerator=cpu"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test/uas" in r.stdout + r.stderr
    entries = sorted(p.name for p in (tmp_path / "cache" / "attention").iterdir())
    assert len(entries) == 3 and all("-conllu-" in e for e in entries), entries


# ----------------------------------------------------------------------------- analyses
def _cli(tmp_path: Path, args: list[str]) -> Path:
    out = tmp_path / "cli"
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "-m", "probes.analyze", *args, "logger.use_wandb=false",
                        f"hydra.run.dir={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("analysis", ["dep_heads", "head_stats"])
def test_analyze_equals_the_cli(models, tmp_path, analysis):
    """probes.analyze on a tiny model and a test-written CoNLL-U == the CSVs and summary of
    `python -m probes.analyze ... data=conllu` on the same inputs (each with its own cache)."""
    dev = tmp_path / "dev.conllu"
    dev.write_text(TINY_CONLLU)
    folder = models["bert"]
    res = probes.analyze(analysis, encoder=folder, treebank=probes.treebank(dev=dev), output_dir=tmp_path / "api",
                         overrides=[*CPU, f"paths.cache_dir={tmp_path / 'cache_api'}"])
    assert res.name == analysis and res.output_dir == tmp_path / "api" and res.summary["analysis"] == analysis
    out = _cli(tmp_path, [f"analysis={analysis}", "encoder=auto", f"encoder.name_or_path={folder}", "data=conllu",
                          f"data.treebank.files.dev={dev}", *CPU, f"paths.cache_dir={tmp_path / 'cache_cli'}"])
    csvs = sorted(p.stem for p in out.glob("*.csv"))
    assert csvs == sorted(res.tables) and csvs
    for name in csvs:
        want = pd.read_csv(out / f"{name}.csv", float_precision="round_trip")
        got = pd.read_csv(tmp_path / "api" / f"{name}.csv", float_precision="round_trip")
        pd.testing.assert_frame_equal(got, want)
        pd.testing.assert_frame_equal(res.tables[name], want, check_dtype=False)
    assert sorted(res.figures) == sorted(p.stem for p in out.glob("*.png"))
    assert all(p.is_file() and p.parent == tmp_path / "api" for p in res.figures.values())
    cli_summary = json.loads((out / "summary.json").read_text())
    drop = {"seconds", "cache"}
    assert {k: v for k, v in res.summary.items() if k not in drop} == \
        {k: v for k, v in cli_summary.items() if k not in drop}


def test_analyze_on_plain_sentences_and_options(models, tmp_path):
    res = probes.analyze("head_stats", encoder=probes.load_encoder(models["bert"]),
                         sentences=["The dog barked .", ["Hi", "there"], "A cat"], output_dir=tmp_path / "out",
                         figures=False, pairs=False, overrides=CPU)
    assert res.figures == {} and not list((tmp_path / "out").glob("*.png"))
    assert res.summary["n_sentences"] == 3 and res.summary["input"] == "single"
    assert [s.words for s in probes.read_conllu(tmp_path / "out" / "sentences.conllu")] == \
        [("The", "dog", "barked", "."), ("Hi", "there"), ("A", "cat")]
    df = res.tables["head_stats"]
    pd.testing.assert_frame_equal(df, pd.read_csv(tmp_path / "out" / "head_stats.csv"), check_dtype=False)
    assert set(df.layer) == {0, 1} and set(df["head"]) == {0, 1, 2, 3}
    with pytest.raises(KeyError, match="max_sentences"):
        probes.analyze("head_stats", sentences=["a b"], output_dir=tmp_path / "x", no_such_param=1)
    with pytest.raises(ValueError, match="not both"):
        probes.analyze("head_stats", sentences=["a b"], treebank=tmp_path / "a.conllu")
    with pytest.raises(ValueError, match="no_such_analysis"):
        probes.analyze("no_such_analysis", sentences=["a b"], output_dir=tmp_path / "y")


def test_context_without_hydra(models, tmp_path):
    """AnalysisContext.create: the config composed for a name, ready objects in place of its nodes."""
    dev = tmp_path / "dev.conllu"
    dev.write_text(TINY_CONLLU)
    enc = probes.load_encoder(models["bert"])
    ctx = AnalysisContext.create("head_stats", tmp_path / "out", encoder=enc, treebank=probes.treebank(dev=dev),
                                 params={"pairs": False})
    assert ctx.name == "head_stats" and ctx.encoder is enc and ctx.use_wandb is False
    assert len(ctx.sentences("dev")) == 3 and ctx.cfg.analysis.pairs is False
    df = instantiate(ctx.cfg.analysis)(ctx)
    pd.testing.assert_frame_equal(ctx.tables["head_stats"], df)
    assert set(ctx.figures) == {"head_stats_heatmaps", "head_stats_layers"}


def test_import_probes_is_cheap_and_names_resolve():
    code = ("import sys, probes; heavy = [m for m in ('torch', 'transformers', 'probes.api') if m in sys.modules]; "
            "print(heavy, probes.__version__, sorted(probes.__all__))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[] 0.1.0"), r.stdout
    for name in probes.__all__:
        assert getattr(probes, name) is not None and (name == "__version__" or getattr(probes, name).__doc__)
    with pytest.raises(AttributeError):
        probes.no_such_name  # noqa: B018
    assert probes.analyze is probes.api.analyze  # the function; the CLI module of that name is only run (-m)
