"""GLUE readers (real shared files, counts from shared/data/SOURCES.md §6) and per-task metrics."""

import math

import pytest
import torch

from probes.data.glue import GlueFormatError, read_glue, task_spec
from probes.glue.metrics import score, task_metrics
from tests.conftest import require_shared


@pytest.fixture
def glue_dir():
    return require_shared("glue", "GLUE data").parent


@pytest.mark.slow
@pytest.mark.parametrize("task,split,n,positives", [
    ("cola", "train", 8551, 6023), ("cola", "dev", 527 + 516, None), ("cola", "in_domain_dev", 527, None),
    ("cola", "out_of_domain_dev", 516, None), ("sst2", "train", 67349, 37569), ("sst2", "dev", 872, 444),
    ("mrpc", "train", 3668, 2474), ("mrpc", "dev", 408, 279), ("rte", "train", 2490, 1241),
    ("rte", "dev", 277, 131), ("stsb", "train", 5749, None), ("stsb", "dev", 1500, None),
])
def test_read_glue_counts(glue_dir, task, split, n, positives):
    ex = read_glue(task, split, glue_dir)
    assert len(ex) == n
    if positives is not None:  # label 1 (RTE: 1 = not_entailment, Hugging Face convention)
        assert sum(e.label == 1 for e in ex) == positives
    assert all(e.text_a for e in ex)
    assert all((e.text_b is not None) == task_spec(task).pair for e in ex)


@pytest.mark.slow
def test_read_glue_quirks(glue_dir):
    mrpc = read_glue("mrpc", "train", glue_dir)          # BOM header, quotes kept verbatim
    assert mrpc[0].label == 1 and mrpc[0].text_a.startswith("Amrozi accused") and '"the witness"' in mrpc[0].text_a
    cola = read_glue("cola", "train", glue_dir)          # no header: the first line is an example
    assert cola[0].text_a == "Our friends won't buy this analysis, let alone the next one we propose."
    assert [e.idx for e in cola[:3]] == [0, 1, 2]
    rte = read_glue("rte", "dev", glue_dir)              # string labels
    assert rte[0].label == 1 and rte[0].idx == 0 and rte[1].label == 0
    stsb = read_glue("stsb", "dev", glue_dir)            # float scores
    assert stsb[0].label == 5.0 and stsb[1].label == 4.75 and isinstance(stsb[1].label, float)
    assert all(0.0 <= e.label <= 5.0 for e in stsb)


def test_read_glue_errors_name_file_and_line(tmp_path):
    d = tmp_path / "glue" / "RTE"
    d.mkdir(parents=True)
    (d / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n")
    with pytest.raises(GlueFormatError, match=r"RTE/dev.tsv:3: .*'maybe'"):
        read_glue("rte", "dev", tmp_path)
    (d / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tentailment\n")
    with pytest.raises(GlueFormatError, match=r"RTE/dev.tsv:2: expected 4 .* found 3"):
        read_glue("rte", "dev", tmp_path)
    with pytest.raises(FileNotFoundError, match="RTE/train.tsv"):
        read_glue("rte", "train", tmp_path)
    with pytest.raises(ValueError, match="private"):
        read_glue("rte", "test", tmp_path)
    s = tmp_path / "glue" / "STS-B"
    s.mkdir()
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    (s / "dev.tsv").write_text(header + "0\tg\tf\ty\t0\tn\tn\ta\tb\tfive\n")
    with pytest.raises(GlueFormatError, match=r"STS-B/dev.tsv:2: .*five"):
        read_glue("stsb", "dev", tmp_path)


def test_mrpc_bom_and_cola_no_header(tmp_path):
    m = tmp_path / "glue" / "MRPC"
    m.mkdir(parents=True)
    (m / "dev.tsv").write_bytes("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\t\"a\tb\n".encode())
    assert read_glue("mrpc", "dev", tmp_path)[0].text_a == '"a'
    c = tmp_path / "glue" / "CoLA"
    c.mkdir()
    (c / "in_domain_dev.tsv").write_text("x\t1\t\tA b.\ny\t0\t*\tB a.\n")
    (c / "out_of_domain_dev.tsv").write_text("z\t1\t\tC.\n")
    ex = read_glue("cola", "dev", tmp_path)
    assert [(e.text_a, e.label, e.idx) for e in ex] == [("A b.", 1, 0), ("B a.", 0, 1), ("C.", 1, 2)]


# ---------------------------------------------------------------- metrics on hand-made cases

def _logits(preds):  # class ids -> 2-class logits whose argmax is the class
    return torch.nn.functional.one_hot(torch.tensor(preds), 2).float()


def test_mcc_known_confusion_matrix():
    # TP=3, TN=4, FP=1, FN=2: MCC = (3*4 - 1*2) / sqrt(4 * 5 * 5 * 6)
    labels = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    preds = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    want = (3 * 4 - 1 * 2) / math.sqrt((3 + 1) * (3 + 2) * (4 + 1) * (4 + 2))
    got = score("cola", _logits(preds), torch.tensor(labels))
    assert got.keys() == {"mcc"} and got["mcc"] == pytest.approx(want, abs=1e-6)


def test_mcc_is_zero_for_a_constant_prediction():
    labels = torch.tensor([1, 1, 1, 0, 1, 0, 1, 1, 1, 1])
    assert score("cola", _logits([1] * 10), labels)["mcc"] == 0.0
    assert score("cola", _logits([0] * 10), labels)["mcc"] == 0.0
    assert score("cola", _logits([1] * 9 + [0]), torch.tensor([1] * 9 + [0]))["mcc"] == pytest.approx(1.0)


def test_accuracy_and_f1():
    labels = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    preds = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    p, r = 3 / 4, 3 / 5
    got = score("mrpc", _logits(preds), torch.tensor(labels))
    assert got["acc"] == pytest.approx(0.7) and got["f1"] == pytest.approx(2 * p * r / (p + r))
    assert score("rte", _logits(preds), torch.tensor(labels)) == {"acc": pytest.approx(0.7)}
    assert score("sst2", _logits(labels), torch.tensor(labels)) == {"acc": 1.0}


def test_pearson_spearman():
    y = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    pred = torch.tensor([0.0, 1.0, 4.0, 9.0, 16.0])        # monotone, not linear
    got = score("stsb", pred[:, None], y)
    x, z = y.numpy(), pred.numpy()
    xc, zc = x - x.mean(), z - z.mean()
    pearson = float((xc * zc).sum() / math.sqrt((xc ** 2).sum() * (zc ** 2).sum()))
    assert got["spearman"] == pytest.approx(1.0) and got["pearson"] == pytest.approx(pearson, abs=1e-6)
    assert score("stsb", -pred[:, None], y)["spearman"] == pytest.approx(-1.0)


def test_metric_names_match_task_specs():
    for t in ("cola", "sst2", "mrpc", "stsb", "rte"):
        spec = task_spec(t)
        assert set(task_metrics(t).keys()) == set(spec.metrics) and spec.main_metric in spec.metrics


# ---------------------------------------------------------------- QQP, QNLI, MNLI, WNLI (user-supplied files)

MNLI_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
MNLI_LABELS = ["entailment", "neutral", "contradiction"]


def _mnli_row(i: int, a: str, b: str, gold: str, dev: bool) -> str:
    """One row of GLUE's MNLI files: 12 columns in train, 16 in dev (five annotator labels)."""
    labels = [gold] * 5 if dev else [gold]
    parse = lambda s: "( " + " ".join(s.split()) + " )"  # noqa: E731
    return "\t".join([str(i), str(100 + i), f"{100 + i}e", "fiction", parse(a), parse(b), f"(ROOT {a})",
                      f"(ROOT {b})", a, b, *labels, gold])


def write_official_glue(root, n: int = 12, seed: int = 0) -> dict:
    """Small QQP / QNLI / MNLI / WNLI folders in GLUE's official TSV formats; the expected examples."""
    import random

    rng = random.Random(seed)
    words = "the a cat dog saw liked house runs quickly big small red and of to in".split()
    sent = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "."  # noqa: E731
    want: dict = {}
    g = root / "glue"
    for d in ("QQP", "QNLI", "MNLI", "WNLI"):
        (g / d).mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        qqp, qnli, wnli = (["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"],
                           ["index\tquestion\tsentence\tlabel"], ["index\tsentence1\tsentence2\tlabel"])
        for i in range(n):
            a, b = sent(), sent()
            lab = i % 2
            qqp.append(f"{1000 + i}\t{2 * i}\t{2 * i + 1}\t{a} \"q\"?\t{b}?\t{lab}")
            qnli.append(f"{i}\t{a}?\t{b}\t{['entailment', 'not_entailment'][lab]}")
            wnli.append(f"{i}\t{a}\t{b}\t{lab}")
            want.setdefault(("qqp", split), []).append((f'{a} "q"?', f"{b}?", lab, 1000 + i))
            want.setdefault(("qnli", split), []).append((f"{a}?", b, lab, i))
            want.setdefault(("wnli", split), []).append((a, b, lab, i))
        for task, lines in (("QQP", qqp), ("QNLI", qnli), ("WNLI", wnli)):
            (g / task / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for name, dev in (("train", False), ("dev_matched", True), ("dev_mismatched", True)):
        head = MNLI_HEAD + (["label1", "label2", "label3", "label4", "label5"] if dev else ["label1"])
        lines = ["\t".join(head + ["gold_label"])]
        for i in range(n):
            a, b, gold = sent(), sent(), MNLI_LABELS[(i + len(name)) % 3]
            lines.append(_mnli_row(i, a, b, gold, dev))
            want.setdefault(("mnli", name), []).append((a, b, MNLI_LABELS.index(gold), i))
        (g / "MNLI" / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    want[("mnli", "dev")] = want[("mnli", "dev_matched")]
    return want


@pytest.mark.parametrize("task,split", [("qqp", "train"), ("qqp", "dev"), ("qnli", "train"), ("qnli", "dev"),
                                        ("mnli", "train"), ("mnli", "dev"), ("mnli", "dev_matched"),
                                        ("mnli", "dev_mismatched"), ("wnli", "train"), ("wnli", "dev")])
def test_official_formats_of_the_other_tasks(tmp_path, task, split):
    want = write_official_glue(tmp_path)
    got = [(e.text_a, e.text_b, e.label, e.idx) for e in read_glue(task, split, tmp_path)]
    assert got == want[(task, split)]
    assert task_spec(task).pair and task_spec(task).num_labels == (3 if task == "mnli" else 2)


def test_other_tasks_errors(tmp_path):
    write_official_glue(tmp_path)
    (tmp_path / "glue" / "MNLI" / "dev_mismatched.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"MNLI/dev_mismatched.tsv.*download_glue_data.py --tasks MNLI"):
        read_glue("mnli", "dev_mismatched", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"QQP/dev.tsv.*gluebenchmark"):
        read_glue("qqp", "dev", tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="dev_matched, dev_mismatched"):
        read_glue("mnli", "test_matched", tmp_path)
    p = tmp_path / "glue" / "MNLI" / "train.tsv"
    lines = p.read_text().splitlines()
    lines[3] = lines[3].rsplit("\t", 1)[0] + "\tmaybe"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(GlueFormatError, match=r"MNLI/train.tsv:4: .*'maybe'"):
        read_glue("mnli", "train", tmp_path)
    lines[3] = "\t".join(lines[3].split("\t")[:11])  # a short row
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(GlueFormatError, match=r"MNLI/train.tsv:4: expected 12 .* found 11"):
        read_glue("mnli", "train", tmp_path)
    p.write_text("\n".join([lines[0].replace("\tgold_label", "")] + lines[1:3]) + "\n")
    with pytest.raises(GlueFormatError, match=r"MNLI/train.tsv:1: .*gold_label"):
        read_glue("mnli", "train", tmp_path)
    q = tmp_path / "glue" / "QNLI" / "dev.tsv"
    q.write_text("index\tquestion\tsentence\tlabel\n0\ta?\tb\tneutral\n")
    with pytest.raises(GlueFormatError, match=r"QNLI/dev.tsv:2: .*'neutral'"):
        read_glue("qnli", "dev", tmp_path)


def test_mnli_and_qqp_metrics():
    labels = torch.tensor([0, 1, 2, 2, 1, 0])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0, 0, 0]), 3).float()
    assert score("mnli", logits, labels) == {"acc": pytest.approx(4 / 6)}
    got = score("qqp", _logits([1, 1, 0, 0]), torch.tensor([1, 0, 0, 1]))
    assert got == {"acc": pytest.approx(0.5), "f1": pytest.approx(0.5)}
    for t in ("qqp", "qnli", "mnli", "wnli"):
        spec = task_spec(t)
        assert set(task_metrics(t).keys()) == set(spec.metrics) and spec.main_metric in spec.metrics


def test_mnli_experiment_selects_on_matched_and_tests_on_mismatched(tmp_path):
    """`experiment=glue_mnli` (tiny BERT, 1 epoch): val/acc is dev_matched, test/acc dev_mismatched."""
    from probes.glue.evaluate import make_batches
    from probes.glue.export import load_finetuned
    from tests.glue_helpers import logits_and_labels
    from probes.train import train
    from tests.conftest import compose_train

    write_official_glue(tmp_path, n=16)
    out = tmp_path / "out"
    cfg = compose_train(["experiment=glue_mnli", "encoder=tiny", "logger=none", f"paths.data_dir={tmp_path}",
                         f"paths.output_dir={out}", "trainer.max_epochs=1", "trainer.accelerator=cpu",
                         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                         "data.batch_size=8"])
    assert cfg.data.test_split == "dev_mismatched" and cfg.data.max_train_examples == 8000
    m = train(cfg)
    ft = load_finetuned(out / "hf_model")
    for split, key in (("dev_matched", "val/acc"), ("dev_mismatched", "test/acc")):
        ex = read_glue("mnli", split, tmp_path)
        logits, labels = logits_and_labels(ft.model, make_batches(ft.tokenizer, ex, "mnli", batch_size=5))
        assert logits.shape == (16, 3)
        assert m[key] == pytest.approx(score("mnli", logits, labels)["acc"], abs=1e-6), key
