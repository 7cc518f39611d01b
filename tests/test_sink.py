"""``analysis=sink`` (Gu et al. 2024's attention-sink metric) on tiny random models of probes/model/tiny.py through
the real conf/, against an independent reference: windows cut from the raw text with the model's own tokenizer
and each family's special-token layout written out here, a plain eager forward of transformers
(``output_attentions=True``) and plain loops. The reference's sink rate is Gu et al.'s own definition
(``compute_attention_sink`` in ``eval_sink_open_source.py`` of github.com/sail-sg/Attention-Sink): every window's
alpha of every head is compared with the threshold, and the indicator is averaged over windows, layers and heads;
the share of heads whose mean alpha over the windows exceeds the threshold is a different number, checked under
its own name at a threshold where the two differ."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from probes.analysis.beyond.sink import TooFewPieces, alpha_table, layer_table, text_windows
from probes.analysis.context import run_analysis
from probes.data.conllu import read_conllu
from probes.model import tiny
from tests.conftest import ROOT, TINY_CONLLU, WORDS, require_shared

WINDOW = 64
N_WINDOWS = 5
# family -> (the model class of its folder, what the tokenizer puts before / after one text)
LAYOUT = {
    "bert": (AutoModelForMaskedLM, lambda t: [t.cls_token_id], lambda t: [t.sep_token_id]),
    "llama": (AutoModelForCausalLM, lambda t: [t.bos_token_id], lambda t: []),
    "gpt2": (AutoModelForCausalLM, lambda t: [], lambda t: []),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> folder of a tiny random model (built once per module)."""
    root = tmp_path_factory.mktemp("models")
    return {f: tiny.tiny_folder(f, root=root) for f in LAYOUT}


def write_treebank(path, n_sentences: int, seed: int = 0) -> list[list[str]]:
    """A CoNLL-U file of ``n_sentences`` random sentences (capitalised first word, '.' or ',' inside); returns
    their words."""
    rng = random.Random(seed)
    sentences, lines = [], []
    for s in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        words[0] = words[0].capitalize()
        if len(words) > 5:
            words.insert(3, ",")
        words.append(".")
        sentences.append(words)
        lines.append(f"# sent_id = s{s}")
        lines += [f"{j}\t{w}\t{w}\tX\t_\t_\t{j - 1}\t{'root' if j == 1 else 'dep'}\t_\t_"
                  for j, w in enumerate(words, start=1)]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return sentences


@pytest.fixture
def run_sink(tmp_path, models):
    """Run ``analysis=sink`` on ``family``'s tiny model and the 'EWT dev' ``text`` (None: 120 random sentences)."""
    dev = tmp_path / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu"
    dev.parent.mkdir(parents=True)

    def run(family, *extra, text=None):
        if text is None:
            sentences = write_treebank(dev, 120)
        else:
            dev.write_text(text)
            sentences = None
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="analyze", overrides=[
                "analysis=sink", "encoder=auto", f"encoder.name_or_path={models[family]}",
                f"paths.data_dir={tmp_path / 'data'}", f"paths.cache_dir={tmp_path / 'cache'}",
                "logger.use_wandb=false", "data.treebank.download=false", "analysis_device=cpu",
                "analysis.max_batch_size=2", *extra])
        return run_analysis(cfg, tmp_path / "out", use_wandb=False), sentences
    return run


def reference_windows(tok, family: str, sentences: list[list[str]], n: int) -> list[list[int]]:
    """The first ``n`` windows of ``WINDOW`` ids: the running text of all sentences, cut into chunks of WINDOW
    minus the family's specials, each wrapped in them."""
    text = " ".join(" ".join(words) for words in sentences)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    _, before, after = LAYOUT[family]
    head, tail = before(tok), after(tok)
    assert len(head) + len(tail) == tok.num_special_tokens_to_add(pair=False)
    body = WINDOW - len(head) - len(tail)
    return [head + ids[k * body:(k + 1) * body] + tail for k in range(min(n, len(ids) // body))]


def reference_alpha(folder, family: str, windows: list[list[int]]) -> list[list[list[float]]]:
    """alpha[n][l][h]: window n's attention of head (l, h) to position 0, summed over the query rows t and divided
    by the number of rows that see position 0 (all T of them), as Gu et al.'s ``importance_scores`` at key 0 (eager
    forward, one window at a time)."""
    model = LAYOUT[family][0].from_pretrained(str(folder), attn_implementation="eager").eval()
    alpha = []
    for ids in windows:
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x (1, H, T, T)
        L, H, T = len(att), att[0].shape[1], len(ids)
        alpha.append([[sum(float(att[l][0, h, t, 0]) for t in range(T)) / (T - 0) for h in range(H)]
                      for l in range(L)])
    return alpha


def mean_alpha(alpha: list[list[list[float]]]) -> list[list[float]]:
    """alpha[l][h] averaged over the windows."""
    N, L, H = len(alpha), len(alpha[0]), len(alpha[0][0])
    return [[sum(alpha[n][l][h] for n in range(N)) / N for h in range(H)] for l in range(L)]


def gu_rate(alpha: list[list[list[float]]], threshold: float, layers=None) -> float:
    """Gu et al.'s sink rate: the indicator alpha > threshold of every window, layer (of ``layers``; None: all) and
    head, averaged over all of them."""
    cells = [v for window in alpha for l, row in enumerate(window) if layers is None or l in layers for v in row]
    return sum(1 for v in cells if v > threshold) / len(cells)


def share_above(alpha: list[list[float]], threshold: float) -> float:
    """The share of (layer, head) pairs of the window-mean ``alpha`` above ``threshold`` (mean, then threshold)."""
    above = sum(1 for row in alpha for v in row if v > threshold)
    return above / sum(len(row) for row in alpha)


def splitting_threshold(alpha: list[list[list[float]]]) -> float:
    """A threshold where Gu et al.'s rate and the share of heads whose mean alpha is above it differ, both strictly
    between 0 and 1, on no alpha: the first of the midpoints between consecutive per-window alphas, from the
    median outwards, that gives two different numbers."""
    values = sorted({v for window in alpha for row in window for v in row})
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    mean = mean_alpha(alpha)
    for t in sorted(mids, key=lambda m: abs(m - values[len(values) // 2])):
        rate, share = gu_rate(alpha, t), share_above(mean, t)
        if 0 < rate < 1 and 0 < share < 1 and abs(rate - share) > 1e-9:
            return t
    raise AssertionError("no threshold separates the two definitions")


@pytest.mark.parametrize("family", list(LAYOUT))
def test_sink_equals_eager_reference(run_sink, models, tmp_path, family):
    """sink.csv equals the reference alphas (mean over the windows) and each head's share of windows above the
    threshold; the sink rate is Gu et al.'s per-window rate and differs from the share of heads whose mean alpha is
    above the threshold, which is kept beside it; per layer the same; the windows are the reference windows, each
    of exactly 64 pieces."""
    folder = models[family]
    tok = AutoTokenizer.from_pretrained(str(folder))
    sentences = write_treebank(tmp_path / "words.conllu", 120)
    ref_windows = reference_windows(tok, family, sentences, N_WINDOWS)
    assert len(ref_windows) == N_WINDOWS and all(len(w) == WINDOW for w in ref_windows)
    alpha = reference_alpha(folder, family, ref_windows)  # (N, L, H) nested lists
    mean = mean_alpha(alpha)
    threshold = splitting_threshold(alpha)
    rate, share = gu_rate(alpha, threshold), share_above(mean, threshold)
    assert rate != pytest.approx(share, abs=1e-9)  # the two definitions differ here

    result, written = run_sink(family, f"analysis.max_windows={N_WINDOWS}", f"analysis.threshold={threshold}")
    assert written == sentences
    out = tmp_path / "out"
    got = pd.read_csv(out / "sink.csv")
    L, H = len(mean), len(mean[0])
    assert list(got.columns) == ["layer", "head", "alpha", "windows_above"] and len(got) == L * H
    for row in got.itertuples():
        assert row.alpha == pytest.approx(mean[row.layer][row.head], rel=1e-4, abs=1e-6), (row.layer, row.head)
        above = sum(1 for n in range(N_WINDOWS) if alpha[n][row.layer][row.head] > threshold) / N_WINDOWS
        assert row.windows_above == pytest.approx(above), (row.layer, row.head)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["sink_rate"] == pytest.approx(rate)
    assert summary["share_mean_alpha_above"] == pytest.approx(share)
    assert "sail-sg/Attention-Sink" in summary["sink_rate_definition"]
    assert (summary["window"], summary["n_windows"], summary["threshold"]) == (WINDOW, N_WINDOWS, threshold)
    assert summary["first_token"] == tok.convert_ids_to_tokens(ref_windows[0][0])
    assert summary["first_is_special"] == (family != "gpt2")
    assert summary["causal"] == (family != "bert")
    by_layer = pd.read_csv(out / "sink_by_layer.csv")
    assert list(by_layer.columns) == ["layer", "mean_alpha", "sink_rate", "share_mean_alpha_above", "n_heads"]
    for row in by_layer.itertuples():
        assert row.sink_rate == pytest.approx(gu_rate(alpha, threshold, layers={row.layer}))
        assert row.share_mean_alpha_above == pytest.approx(share_above([mean[row.layer]], threshold))
        assert row.mean_alpha == pytest.approx(sum(mean[row.layer]) / H, rel=1e-4)
        assert row.n_heads == H
    assert summary["per_layer_sink_rate"] == pytest.approx(list(by_layer.sink_rate))
    assert (out / "sink.png").stat().st_size > 1000 and "sink" in result.figures

    windows = text_windows(tok, " ".join(" ".join(w) for w in sentences), WINDOW, None)
    assert all(w.n_pieces == WINDOW for w in windows)
    assert [w.input_ids for w in windows[:N_WINDOWS]] == ref_windows


def test_the_rate_is_per_window_not_of_the_mean():
    """The two definitions on numbers worked by hand: one head, alpha 0.5 in one window and 0.2 in the other
    (mean 0.35): Gu et al.'s rate at 0.3 is 1/2, the share of heads whose mean is above 0.3 is 1; at 0.4, 1/2
    and 0."""
    alpha = np.array([[[0.5]], [[0.2]]])  # (N=2, L=1, H=1)
    assert layer_table(alpha, 0.3).iloc[0][["sink_rate", "share_mean_alpha_above"]].tolist() == [0.5, 1.0]
    assert layer_table(alpha, 0.4).iloc[0][["sink_rate", "share_mean_alpha_above"]].tolist() == [0.5, 0.0]
    assert alpha_table(alpha, 0.4).iloc[0][["alpha", "windows_above"]].tolist() == pytest.approx([0.35, 0.5])
    assert gu_rate(alpha.tolist(), 0.3) == 0.5 and share_above(mean_alpha(alpha.tolist()), 0.3) == 1.0


def test_sink_default_window_count_is_every_full_window(run_sink, models):
    """With max_windows above what the split holds, every full window is read and the partial last one dropped."""
    result, sentences = run_sink("gpt2", "analysis.max_windows=1000")
    tok = AutoTokenizer.from_pretrained(str(models["gpt2"]))
    n = len(tok(" ".join(" ".join(w) for w in sentences), add_special_tokens=False)["input_ids"])
    assert result.summary["n_windows"] == n // WINDOW


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_too_short_a_split_is_a_clear_error(run_sink, family):
    """Three short sentences hold fewer pieces than one window: an error naming the split and its file."""
    with pytest.raises(TooFewPieces, match=r"split 'dev' \(.*en_ewt-ud-dev\.conllu\) has \d+ pieces, fewer than "
                                           r"one window of 64"):
        run_sink(family, text=TINY_CONLLU)


def test_windows_of_the_shared_ewt_dev(models):
    """On the real EWT dev text the MiniLM vocabulary's windows (the tiny BERT's tokenizer) are the plain chunks
    of the running text, 100 of exactly 64 pieces, [CLS] first and [SEP] last."""
    dev = require_shared("ud_english_ewt/en_ewt-ud-dev.conllu", "shared EWT dev")
    tok = AutoTokenizer.from_pretrained(str(models["bert"]))
    sentences = [list(s.words) for s in read_conllu(dev)]
    ref = reference_windows(tok, "bert", sentences, 100)
    windows = text_windows(tok, " ".join(" ".join(w) for w in sentences), WINDOW, 100)
    assert len(windows) == 100 and all(w.n_pieces == WINDOW for w in windows)
    assert [w.input_ids for w in windows] == ref
    assert all(w.input_ids[0] == tok.cls_token_id and w.input_ids[-1] == tok.sep_token_id for w in windows)
