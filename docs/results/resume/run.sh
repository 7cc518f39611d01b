#!/usr/bin/env bash
# The README's resume check, as recorded in docs/results/resume/smoke.json (run from the repository root):
# `experiment=smoke` left alone; the same run killed with SIGKILL right after its first epoch's checkpoints
# (tests/resume_helpers.py's callback, the one tests/test_resume.py uses) and continued with
# `python train.py resume=<folder>`; then both runs' metrics, the machine and the commands into the record.
#
#   PROBES_DATA_DIR=../shared/data bash docs/results/resume/run.sh [record.json]
#
# The run folders are logs/smoke/runs/resume-check-{alone,killed}/ (replaced if present); the record goes to
# the path given (default: docs/results/resume/smoke.json).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PROBES_DATA_DIR="${PROBES_DATA_DIR:-../shared/data}" WANDB_MODE="${WANDB_MODE:-offline}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # tests.resume_helpers for the kill callback
RECORD="${1:-docs/results/resume/smoke.json}"
ALONE=logs/smoke/runs/resume-check-alone
KILLED=logs/smoke/runs/resume-check-killed
rm -rf "$ALONE" "$KILLED"

python train.py experiment=smoke "hydra.run.dir=$ALONE"
set +e
PROBES_TEST_KILL_AFTER_EPOCH=0 python train.py experiment=smoke "hydra.run.dir=$KILLED" \
  '+callbacks.zz_kill={_target_: tests.resume_helpers.KillAfterEpoch}'
KILL_RC=$?
set -e
LEFT=$(ls "$KILLED/checkpoints" | tr '\n' ' ')
test ! -e "$KILLED/metrics.json"
python train.py "resume=$KILLED"

KILL_RC="$KILL_RC" LEFT="$LEFT" ALONE="$ALONE" KILLED="$KILLED" RECORD="$RECORD" python - <<'EOF'
import datetime, json, os, platform, subprocess
from pathlib import Path

import torch

alone, killed = Path(os.environ["ALONE"]), Path(os.environ["KILLED"])
lscpu = dict(ln.split(":", 1) for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
             if ":" in ln)
lscpu = {k.strip(): v.strip() for k, v in lscpu.items()}
flags = set(lscpu.get("Flags", "").split())
load = os.getloadavg()
metrics = {name: json.loads((d / "metrics.json").read_text()) for name, d in (("alone", alone), ("resumed", killed))}
for m in metrics.values():  # the checkpoint path: in the run's own folder, relative to the repository root
    m["best_checkpoint"] = os.path.relpath(m["best_checkpoint"])
prov = {name: json.loads((d / "provenance.json").read_text()) for name, d in (("alone", alone), ("resumed", killed))}
record = dict(
    what="README 'Quick start': experiment=smoke killed with SIGKILL after its first epoch's checkpoint and "
         "resumed with python train.py resume=<folder>, against the same run left alone",
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    commit=prov["alone"]["commit"],
    machine=dict(cpu=lscpu.get("Model name"), cpu_family=lscpu.get("CPU family"), cpu_model=lscpu.get("Model"),
                 cpus=int(lscpu.get("CPU(s)", 0)), hypervisor=lscpu.get("Hypervisor vendor"),
                 avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags, torch=torch.__version__,
                 python=platform.python_version(), load_average_at_end=[round(x, 2) for x in load]),
    precision=json.loads((killed / "precision.json").read_text()),
    commands=dict(
        alone=f"python train.py experiment=smoke hydra.run.dir={alone}",
        killed=f"PROBES_TEST_KILL_AFTER_EPOCH=0 python train.py experiment=smoke hydra.run.dir={killed} "
               "'+callbacks.zz_kill={_target_: tests.resume_helpers.KillAfterEpoch}'",
        resumed=f"python train.py resume={killed}",
        script="PROBES_DATA_DIR=../shared/data bash docs/results/resume/run.sh"),
    killed=dict(exit_status=int(os.environ["KILL_RC"]), checkpoints_left=os.environ["LEFT"].split(),
                metrics_json_left=False),
    resumed_from=os.path.relpath(prov["resumed"]["inputs"]["resumed_from"]),
    metrics=metrics,
    equal=sorted(k for k in metrics["alone"] if k != "best_checkpoint" and not k.startswith("sys/")
                 and metrics["alone"][k] == metrics["resumed"].get(k)),
    differ=sorted(k for k in metrics["alone"] if k != "best_checkpoint"
                  and metrics["alone"][k] != metrics["resumed"].get(k)),
)
Path(os.environ["RECORD"]).write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps({k: record[k] for k in ("date", "commit", "killed", "equal", "differ")}, indent=1))
EOF
