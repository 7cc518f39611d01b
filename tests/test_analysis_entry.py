"""The analysis entry: Hydra composition, in-process runs on a tiny treebank, end-to-end CLI runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from probes.analysis.context import AnalysisContext
from probes.model.tiny import tiny_folder
from tests.conftest import SHARED_FOLDERS, TINY_CONLLU, require_shared, shared_data_dir

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHARED_DATA = shared_data_dir()
ANALYSES = ("head_stats", "dep_heads", "clustering")

def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="analyze", overrides=overrides)


@pytest.fixture
def tiny_cfg(tmp_path):
    """analyze config with the tiny encoder and a three-sentence 'EWT dev' in tmp_path."""
    (tmp_path / "data" / "ud_english_ewt").mkdir(parents=True)
    (tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu").write_text(TINY_CONLLU)

    def make(analysis, *extra):
        return _compose([f"analysis={analysis}", "encoder=tiny", f"paths.data_dir={tmp_path / 'data'}",
                         f"paths.cache_dir={tmp_path / 'cache'}", "logger.use_wandb=false",
                         "data.treebank.download=false", *extra])
    return make


def test_compose_defaults():
    cfg = _compose([])
    assert cfg.analysis._target_ == "probes.analysis.clark.head_stats.head_stats"
    assert cfg.encoder.name == "all-MiniLM-L6-v2" and cfg.data.name == "ud_english_ewt"
    assert cfg.analysis.split == "dev" and cfg.analysis.max_sentences is None
    assert cfg.logger.use_wandb is True
    for name in ANALYSES:
        a = _compose([f"analysis={name}"]).analysis
        assert a._partial_ is True and a._target_ == f"probes.analysis.clark.{name}.{name}"
        assert "split" in a and "max_sentences" in a


@pytest.mark.parametrize("analysis", ANALYSES)
def test_analysis_in_process_tiny(tiny_cfg, tmp_path, analysis):
    cfg = tiny_cfg(analysis)
    ctx = AnalysisContext(cfg, tmp_path / "out")
    instantiate(cfg.analysis)(ctx)
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["analysis"] == analysis
    L, H = 2, 4  # conf/encoder/tiny.yaml
    if analysis == "head_stats":
        df = pd.read_csv(out / "head_stats.csv")
        assert len(df[df.stat == "cls"]) == L * H
        assert df.layer.min() == 0 and df.layer.max() == L - 1 and df["head"].max() == H - 1
        # default input: pairs of consecutive sentences; the third (odd) sentence has no partner
        assert (summary["input"], summary["n_sequences"], summary["n_sentences"]) == ("pair", 1, 2)
        assert set(df.stat) >= {"sep_sep", "rest_sep"}
    elif analysis == "dep_heads":
        table = pd.read_csv(out / "dep_table.csv")
        assert table.relation.tolist() == ["all"]  # min_count 100 > any relation here
        # scored: The, dog, John, 's, cat, on, the, unbelievably-comfortable (root, punct excluded)
        assert table["count"].tolist() == [8]
        dep = pd.read_csv(out / "dep_heads.csv")
        assert len(dep) == 2 * L * H and dep.accuracy.between(0, 1).all()
        assert summary["n_sentences"] == 3
    else:
        emb = pd.read_csv(out / "head_embedding.csv")
        assert len(emb) == L * H and emb[["x", "y"]].notna().all().all()
        js = pd.read_csv(out / "js_distances.csv")
        assert len(js) == (L * H) ** 2 and (js.js >= 0).all()
        assert (js[(js.layer_a == js.layer_b) & (js.head_a == js.head_b)].js == 0).all()


def test_dep_heads_min_count_lists_relations(tiny_cfg, tmp_path):
    cfg = tiny_cfg("dep_heads", "analysis.min_count=2")
    instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out"))
    table = pd.read_csv(tmp_path / "out" / "dep_table.csv")
    assert table.relation.tolist() == ["all", "case", "det", "nsubj"]
    assert table.set_index("relation")["count"].to_dict() == {"all": 8, "case": 2, "det": 2, "nsubj": 2}


@pytest.mark.slow
@pytest.mark.parametrize("analysis", ANALYSES)
def test_cli_end_to_end(tmp_path, analysis):
    require_shared("ud_english_ewt/en_ewt-ud-dev.conllu", "shared EWT data")
    env = dict(os.environ, PROBES_DATA_DIR=str(SHARED_DATA), PROBES_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "probes.analyze", f"analysis={analysis}", "encoder=tiny",
           "analysis.max_sentences=20", f"paths.log_dir={tmp_path / 'logs'}"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "logs" / "analyze" / analysis).iterdir())
    assert len(runs) == 1
    out = runs[0]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "wandb").is_dir()  # offline wandb run inside the run dir
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all((out / p).stat().st_size > 1000 for p in pngs)
    if analysis == "head_stats":
        df = pd.read_csv(out / "head_stats.csv")
        wide = df.pivot_table(index=["layer", "head"], columns="stat", values="value")
        assert len(wide) == 2 * 4
        for k in ("prev", "self", "next", "cls", "sep", "punct"):
            assert wide[k].between(0, 1).all(), k
        # every row's entropy is at most log T, so the mean is at most the uniform reference
        assert (wide.entropy > 0).all() and (wide.entropy <= wide.uniform_entropy + 1e-5).all()
        assert (wide.cls_entropy <= wide.uniform_entropy.max() + 1e-5).all()
        assert summary["n_input_sentences"] == 20 and 0 < summary["n_sentences"] <= 20
        assert wide.sep_sep.between(0, 1).all() and wide.rest_sep.between(0, 1).all()
        assert set(pngs) == {"head_stats_heatmaps.png", "head_stats_layers.png"}
    elif analysis == "dep_heads":
        table = pd.read_csv(out / "dep_table.csv")
        assert table.relation.iloc[0] == "all" and table["count"].iloc[0] > 100
        assert table.accuracy.between(0, 1).all() and table.offset_accuracy.between(0, 1).all()
        assert (out / "relation_map.csv").is_file() and (out / "dep_offsets.csv").is_file()
        assert summary["n_sentences"] == 20
    else:
        emb = pd.read_csv(out / "head_embedding.csv")
        assert len(emb) == 8 and set(emb.behaviour) <= {"prev", "next", "cls", "sep", "punct", "broad", "other"}
        js = pd.read_csv(out / "js_distances.csv")
        assert len(js) == 64 and (js.js >= 0).all()
        # every input sentence accounted for: read, without a pair partner, or in a sequence too long
        assert summary["n_input_sentences"] == 20 and 0 < summary["n_sentences"] <= 20
        assert summary["n_sentences"] + summary["n_unpaired"] + summary["n_skipped_sentences"] == 20


def test_head_stats_skips_sentences_longer_than_the_encoder(tiny_cfg, tmp_path):
    """Sentences over encoder.max_length pieces are skipped and counted (s2 has 13 pieces with specials)."""
    cfg = tiny_cfg("head_stats", "encoder.max_position_embeddings=8", "analysis.pairs=false")
    instantiate(cfg.analysis)(AnalysisContext(cfg, tmp_path / "out"))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["n_sentences"], summary["n_skipped"], summary["n_input_sentences"]) == (2, 1, 3)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_wordpiece_attention_equals_eager_forward(tmp_path, family):
    """head_stats' live maps == the plain eager model's output_attentions of each sentence alone, for
    WordPiece, byte-level BPE (<s> ... </s>, 'Ġ,') and SentencePiece ('▁,') families; punctuation
    pieces found, the specials at 0 and T - 1 never punctuation."""
    import torch
    from transformers import AutoModel

    from probes.analysis.clark.head_stats import sequence_attention
    from probes.analysis.clark.metrics import is_period_comma

    folder = tiny_folder(family, root=tmp_path / "models")
    from probes.model.load import load_encoder
    enc = load_encoder(str(folder))
    ref = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    sents = [["The", "dog", "barked", "."], ["John", ",", "unbelievably", ",", "sat", "on", "it", "!"], ["Hi"]]
    seen = set()
    from probes.model.inputs import encode_words
    for i, attn, punct, _ in sequence_attention(enc, encode_words(enc.tokenizer, sents), max_tokens=20,
                                                max_batch_size=2):
        seen.add(i)
        ids = enc.tokenizer(" ".join(sents[i]))["input_ids"]  # the sentence as running text, its specials
        T = len(ids)
        assert attn.shape == (2, 4, T, T)
        with torch.no_grad():
            want = torch.stack(ref(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0]
        torch.testing.assert_close(attn, want, rtol=1e-4, atol=1e-6)
        toks = enc.tokenizer.convert_ids_to_tokens(ids)
        assert not punct[0] and not punct[-1] and len(punct) == T
        assert punct[1:-1] == [is_period_comma(t) for t in toks[1:-1]]
        n_punct = {0: 1, 1: 2, 2: 0}[i]  # '.' and ',' only (Clark's punctuation), not '!'
        assert sum(punct) == n_punct, (toks, punct)
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("env,outcome", [({"CI": "true"}, pytest.fail.Exception),
                                         ({"PROBES_REQUIRE_DATA": "1"}, pytest.fail.Exception),
                                         ({"CI": "false"}, pytest.skip.Exception)])
def test_missing_shared_data_fails_in_ci_and_skips_locally(tmp_path, monkeypatch, env, outcome):
    """tests/conftest.require_shared: a missing shared data folder fails a test in CI (or with
    PROBES_REQUIRE_DATA=1), naming the path and the variable; elsewhere the test is skipped."""
    for k in ("CI", "PROBES_REQUIRE_DATA"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PROBES_DATA_DIR", str(tmp_path))
    with pytest.raises(outcome, match="PROBES_DATA_DIR") as e:
        require_shared("glue", "GLUE data")
    assert str(tmp_path / "glue") in str(e.value)
    (tmp_path / "glue").mkdir()
    assert require_shared("glue") == tmp_path / "glue"


def test_required_shared_data_stops_the_session(tmp_path):
    """With PROBES_REQUIRE_DATA=1 (as .ci/run sets it) pytest stops before any test, exit status 1, naming the
    missing folders and PROBES_DATA_DIR; with every folder of SHARED_FOLDERS present it collects."""
    (tmp_path / "glue").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CI"} | dict(PROBES_REQUIRE_DATA="1", PROBES_DATA_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "tests/test_io.py"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "PROBES_DATA_DIR" in r.stdout + r.stderr
    missing = set(SHARED_FOLDERS) - {"glue"}
    assert all(name in r.stdout + r.stderr for name in missing) and "glue," not in r.stdout + r.stderr
    for name in missing:
        (tmp_path / name).mkdir()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

