"""DDP probe training (two CPU processes, gloo): one run folder, one metrics.json, one wandb run, every test
sentence scored once, and the same UAS as one process within 0.5 points."""

import json
import os
import random
import subprocess
import sys

from torch.utils.data import DistributedSampler

from probes.data.conllu import read_conllu
from probes.training.datamodule import LengthBatchSampler
from probes.train import train
from tests.conftest import ROOT, WORDS, chain_overrides, compose_train


def test_length_batches_are_shared_out_by_rank():
    lengths = [random.Random(k).randint(2, 30) for k in range(101)]
    for shuffle in (True, False):
        whole = list(LengthBatchSampler(lengths, 8, 2000, shuffle, seed=3))
        parts = [list(LengthBatchSampler(lengths, 8, 2000, shuffle, seed=3,
                                         sampler=DistributedSampler(range(101), num_replicas=3, rank=r)))
                 for r in range(3)]
        if shuffle:  # training: as many steps on every rank, every batch of the epoch somewhere
            assert len({len(p) for p in parts}) == 1
            assert {tuple(b) for p in parts for b in p} == {tuple(b) for b in whole}
        else:  # evaluation: each sentence exactly once
            assert sorted(i for p in parts for b in p for i in b) == list(range(101))


def _noisy_chain(path, n, seed):
    """Chain sentences (head = previous word) with 20% of the heads moved to another earlier word at random
    (still trees): UAS stays below 100."""
    rng, lines = random.Random(seed), []
    for s in range(n):
        m = rng.randint(3, 10)
        lines.append(f"# sent_id = s{s}")
        for j in range(1, m + 1):
            others = list(range(1, j - 1))
            head = j - 1 if rng.random() > 0.2 or not others else rng.choice(others)
            lines.append(f"{j}\t{rng.choice(WORDS)}\t_\tX\t_\t_\t{head}\t{'root' if head == 0 else 'dep'}\t_\t_")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def test_ddp_two_processes_match_one(tmp_path):
    d = tmp_path / "data" / "chain"
    d.mkdir(parents=True)
    for split, n, seed in (("train", 160, 0), ("dev", 40, 1), ("test", 41, 2)):
        _noisy_chain(d / f"chain-{split}.conllu", n, seed)
    over = [o for o in chain_overrides(tmp_path / "data", tmp_path) if not o.startswith("paths.output_dir")] + \
        ["probe=distance_glove", "trainer.max_epochs=6", "data.batch_size=8", "data.extract_in_child=false"]
    one = train(compose_train(over + [f"paths.output_dir={tmp_path / 'one'}"]))

    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "train.py", "trainer=ddp", "trainer.devices=2", "logger=wandb",
                        f"paths.log_dir={tmp_path / 'logs'}", *[o for o in over if o != "logger=none"]],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Starting with 2 processes" in r.stdout + r.stderr
    runs = list((tmp_path / "logs").rglob("metrics.json"))
    folders = [p.name for p in (tmp_path / "logs" / "train" / "runs").iterdir()]
    assert len(runs) == 1 and folders == [runs[0].parent.name]
    run = runs[0].parent
    two = json.loads(runs[0].read_text())
    assert two["sys/world_size"] == 2.0 and not (run / ".ddp_config.yaml").exists()
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    # all test sentences predicted (gathered from both ranks) and the metric counts every word once
    pred, gold = read_conllu(run / "predictions" / "test.conllu", trees=False), read_conllu(d / "chain-test.conllu")
    assert [s.words for s in pred] == [s.words for s in gold]
    correct = sum(p == g for s, t in zip(pred, gold) for p, g in zip(s.heads, t.heads))
    assert abs(correct / sum(s.n for s in gold) - two["test/uas"]) < 1e-6
    assert 0.5 < one["test/uas"] < 0.95  # not trivial: the noise is not learnable
    for k in ("val/uas_best", "test/uas", "test/uas_nopunct"):
        assert abs(two[k] - one[k]) <= 0.005, (k, one[k], two[k])
