"""precision=auto: the decision rule (32-true left only for a clear margin), the interleaved measurement within
its time budget, and the record a run folder gets."""

from __future__ import annotations

import json

import pytest
import torch

from probes.extract import precision as P
from probes.model.inputs import encode_words
from probes.model.load import tiny_bert

CANDS = ["32-true", "bf16-mixed"]


@pytest.mark.parametrize("speedup,choice", [(1.0, "32-true"), (1.2, "32-true"), (1.29, "32-true"),
                                            (1.3, "bf16-mixed"), (1.4, "bf16-mixed"), (0.5, "32-true")])
def test_fp32_is_left_only_for_a_clear_margin(speedup, choice):
    best, ratio = P.decide({"32-true": speedup * 1e-4, "bf16-mixed": 1e-4}, CANDS, margin=1.3)
    assert best == choice and ratio == pytest.approx(speedup)


def test_decision_among_three_and_without_fp32():
    t = {"16-mixed": 1.0, "bf16-mixed": 0.9, "32-true": 1.1}
    assert P.decide(t, ["16-mixed", "bf16-mixed", "32-true"], margin=1.3) == ("32-true", pytest.approx(1.1 / 0.9))
    assert P.decide(t, ["16-mixed", "bf16-mixed", "32-true"], margin=1.2)[0] == "bf16-mixed"
    assert P.decide(t, ["16-mixed", "bf16-mixed"], margin=1.3) == ("bf16-mixed", None)  # no fp32: the fastest


class FakeMachine:
    """A clock that advances by what each timed call takes, and the order of the calls."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.now, self.calls = seconds, 0.0, []

    def clock(self) -> float:
        return self.now

    def time_fn(self, precision: str) -> float:
        self.calls.append(precision)
        self.now += self.seconds[precision]
        return self.seconds[precision] / 1000  # seconds per token of a 1000-token batch


def test_candidates_are_timed_interleaved_within_the_budget():
    m = FakeMachine({"32-true": 0.05, "bf16-mixed": 0.04})
    samples = P.measure(CANDS, m.time_fn, budget_s=0.6, min_rounds=3, max_rounds=8, clock=m.clock)
    assert m.calls == ["32-true", "bf16-mixed"] * (len(m.calls) // 2)  # A B A B ..., warm-up included
    rounds = len(samples["32-true"])
    assert len(m.calls) == 2 * (rounds + 1) and 3 <= rounds <= 8
    assert m.now <= 0.6 + 1e-9  # the next round would not have fitted
    assert m.now + 0.09 > 0.6 or rounds == 8
    # slow candidates: the minimum number of rounds still runs, past the budget
    slow = FakeMachine({"32-true": 0.5, "bf16-mixed": 0.4})
    assert len(P.measure(CANDS, slow.time_fn, budget_s=0.6, min_rounds=3, clock=slow.clock)["bf16-mixed"]) == 3


def test_the_minimum_decides_so_a_disturbed_round_does_not(tmp_path):
    """bf16 is 1.1x faster when undisturbed; load hits fp32 in one round: the decision stays 32-true."""
    seq = iter([0, 0] + [9.0, 1.0] + [1.1, 1.0] * 7)  # warm-up, a disturbed round, then quiet rounds

    def time_fn(p):
        return next(seq)

    key = dict(cpu="c", device="cpu", layers=1)
    assert P.choose(key, CANDS, time_fn, tmp_path / "p.json", margin=1.3, budget_s=0.0) == "32-true"
    rec = json.loads((tmp_path / "p.json").read_text())[P.key_string(key)]
    assert rec["timings"] == {"32-true": 1.1, "bf16-mixed": 1.0} and rec["samples"]["32-true"][0] == 9.0


def test_record_for_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "candidates", lambda device: list(CANDS))
    enc = tiny_bert()
    assert P.record("32-true", "cpu", enc, tmp_path, margin=1.3) == dict(requested="32-true", precision="32-true",
                                                                         decided_by="config")
    before = P.record("auto", "cpu", enc, tmp_path, margin=1.3)
    assert before["decided_by"] == "not measured" and before["precision"] is None
    key = P.precision_key(enc.config, "cpu")
    m = FakeMachine({"32-true": 0.02, "bf16-mixed": 0.01})
    assert P.choose(key, CANDS, m.time_fn, tmp_path / P.STORE, margin=1.3, clock=m.clock) == "bf16-mixed"
    rec = P.record("auto", "cpu", enc, tmp_path, margin=1.3)
    assert rec["decided_by"] == "measured" and rec["precision"] == "bf16-mixed" and rec["requested"] == "auto"
    assert rec["speedup"] == pytest.approx(2.0) and rec["margin"] == 1.3 and set(rec["timings"]) == set(CANDS)
    assert rec["store"] == str(tmp_path / P.STORE) and rec["key"] == key
    assert P.record("auto", "cpu", enc, tmp_path, margin=1.5)["decided_by"] == "not measured"  # another rule
    assert enc._model is None  # nothing loaded


def test_cpu_timer_runs_one_thread_and_restores_the_thread_count():
    enc = tiny_bert()
    encoded = encode_words(enc.tokenizer, [["the", "cat", "saw", "a", "dog"]] * 20)
    f = P.precision_timer(enc, encoded, "cpu", tokens=64)
    seen = []
    handle = enc.model.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert f("32-true") > 0 and f("bf16-mixed") > 0
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        handle.remove()
        torch.set_num_threads(before)
