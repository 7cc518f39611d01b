"""bench/device/check.sh, the GPU checks of issue 43 run in one call of the device tool: every step's command is
accepted by its bench's own argument parser, the steps cover the issue's GPU targets, and what they write fits what
the tool brings back (at most 8 files from $OUT). A renamed flag or analysis would otherwise be found only on a lent
GPU, at the cost of its minutes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "device" / "check.sh"
MAX_FILES_BACK = 8  # the device tool brings back at most 8 files from $OUT (/work/.library/device/README.md)


def bench_module(name: str):
    """bench/<name>.py imported as a module (bench/ on the path, as when it runs as a script)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


def dry_steps(tmp_path: Path, **env) -> dict[str, list[str]]:
    """Step name -> the bench's argument list, as ``DRY=1 bash bench/device/check.sh`` prints them."""
    out = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"), **env}).stdout
    steps = {}
    for line in out.splitlines():
        fields = line.rstrip("\t").split("\t")
        if len(fields) > 2 and fields[1] == "python3":
            assert fields[0] not in steps, f"step {fields[0]} twice"
            steps[fields[0]] = fields[2:]
    assert not (tmp_path / "out").exists(), "a dry run wrote its output folder"
    return steps


def parsed(steps: dict[str, list[str]]) -> dict[str, tuple[str, object]]:
    """Step name -> (bench, its parsed arguments); an argument the bench does not take fails here (SystemExit)."""
    parsers = {}
    result = {}
    for name, argv in steps.items():
        script = Path(argv[0]).stem
        if script not in parsers:
            parsers[script] = bench_module(script).parser()
        result[name] = (script, parsers[script].parse_args(argv[1:]))
    return result


@pytest.mark.parametrize("quick", ["0", "1"])
def test_every_step_is_a_valid_bench_command(tmp_path, quick):
    steps = parsed(dry_steps(tmp_path, QUICK=quick))
    assert {bench for bench, _ in steps.values()} == {"analysis_speed", "extract_speed"}
    outs = [Path(a.out) for _, a in steps.values()]
    assert all(a.device == "cuda" and a.encoder == "bert-base-random" for _, a in steps.values())
    assert len(set(outs)) == len(outs), "two steps write the same file"
    assert all(p.parent == tmp_path / "out" for p in outs)
    assert len(outs) + 1 <= MAX_FILES_BACK  # the JSONs and check.log
    sentences = {a.sentences for _, a in steps.values()}
    assert sentences == ({40} if quick == "1" else {0})  # a few sentences, or whole splits


def test_steps_cover_the_gpu_targets(tmp_path):
    """Issue 43's GPU targets: head_stats and sink on all of EWT train at bf16-mixed and at 32-true; extraction into
    the cache, with the folder's write rate, through the stage's own loop and Lightning's."""
    steps = parsed(dry_steps(tmp_path))
    analysed = {(analysis, a.precision, a.split) for bench, a in steps.values() if bench == "analysis_speed"
                for analysis in a.analyses}
    for precision in ("bf16-mixed", "32-true"):
        for analysis in ("head_stats", "sink"):
            assert (analysis, precision, "train") in analysed
    others = {"dep_heads", "coref_heads", "pattern_types", "linguistic_attention", "clustering"}
    assert others <= {analysis for analysis, _, _ in analysed}
    extracted = [a for bench, a in steps.values() if bench == "extract_speed"]
    assert any(a.split == "train" for a in extracted) and any(a.split == "dev" for a in extracted)
    assert all({"auto", "lightning"} <= set(a.loop) and a.cache_dir for a in extracted)
    # the operators and kernels each analysis dispatches: on a GPU the host's cost per launch
    assert all(a.ops for bench, a in steps.values() if bench == "analysis_speed")
    # the most important steps first: a call cut short still measures the targets
    order = list(steps)
    assert order.index("analyses_train_bf16") < order.index("analyses_dev_others")
    assert order.index("analyses_train_fp32") < order.index("extract_train")


def test_the_scripts_parse():
    for script in (CHECK, REPO / "bench" / "device" / "prepare.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
