#!/usr/bin/env bash
# The GPU checks of issue 43 in one device call (bench/README.md "The GPU checks in one call"), after
# bench/device/prepare.sh here:   run(command="bash bench/device/check.sh", carry=[".carry"], timeout_s=600)
# Steps, most important first; each runs only if the time it needs is left of LIMIT seconds, and is cut at what is
# left. LIMIT defaults to 360: a session's 15 device minutes also pay the machine's start (1.5 to 6.5 minutes seen)
# and the transfers; with more left (the tool's status), a larger LIMIT, at most 540 (the tool's 600 s a command).
#   1. the machine: GPU, driver, torch, transformers, disk
#   2. head_stats and sink, bert-base shape (random weights), all of EWT train, bf16-mixed, the analyses' batches
#      (each analysis step also counts, in one more untimed run, the operators and kernels per 1,000 pieces)
#   3. the same at 32-true, batches of 32,768 pieces
#   4. extraction into the cache (bench/extract_speed.py), all of EWT dev, bf16-mixed and 32-true, the stage's own
#      loop and Lightning's, with the cache folder's write rate measured in the same run
#   5. head_stats and sink at bf16-mixed with batches of 32,768 pieces
#   6. the other streamed and cached analyses, EWT dev (GUM dev for coref_heads), bf16-mixed
#   7. extraction into the cache, all of EWT train, bf16-mixed, one round
# Results: $OUT/check.log (everything printed) and one JSON per step that ran (at most 8 files come back).
# A dry run of the same steps on this machine's CPU, a few sentences each, in an environment like that machine's:
#   DEVICE=cpu QUICK=1 bash bench/device/check.sh
# DRY=1 prints each step's name and command, tab-separated, and runs nothing (tests/test_bench_device.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
DRY=${DRY:-0}
LIMIT=${LIMIT:-360}
OUT=${OUT:-$PWD/.carry/out}
if [ "$DRY" != 1 ] && [ ! -f .carry/data/ud_english_ewt/en_ewt-ud-train.conllu ]; then
  echo "check: no .carry/data/ud_english_ewt/en_ewt-ud-train.conllu: run bash bench/device/prepare.sh first" >&2
  exit 2
fi
[ "$DRY" = 1 ] || mkdir -p "$OUT"
log=$OUT/check.log
start=$SECONDS
export PYTHONUNBUFFERED=1 PROBES_DATA_DIR=$PWD/.carry/data WANDB_MODE=disabled
if [ "$DRY" != 1 ] && ls .carry/whl/*.whl > /dev/null 2>&1; then  # the carried wheels, ahead of the machine's own packages
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/probes-site \
    .carry/whl/*.whl >> "$log" 2>&1 || { echo "check: the carried wheels did not install (see $log)"; exit 1; }
fi
export PYTHONPATH=/tmp/probes-site:$PWD/.carry/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "$QUICK" = 1 ]; then all=40; dev=40; rounds=1; else all=0; dev=0; rounds=3; fi

# step NAME SECONDS_NEEDED COMMAND...: runs COMMAND (output appended to the log) if SECONDS_NEEDED are left
step() {
  local name=$1 need=$2; shift 2
  if [ "$DRY" = 1 ]; then printf '%s\t' "$name" "$@"; echo; return; fi
  local left=$(( LIMIT - (SECONDS - start) ))
  if [ "$left" -lt "$need" ]; then
    echo "== $name: skipped, ${left} s left of ${LIMIT} (needs about ${need})" | tee -a "$log"
    return
  fi
  echo "== $name ($(date -u +%H:%M:%S) UTC, ${left} s left): $*" | tee -a "$log"
  local t=$SECONDS
  timeout --kill-after=10 "$left" "$@" 2>&1 | tee -a "$log" | grep -E "^(==|.*tok/s|.*MB/s|.*Error|Traceback)" || true
  echo "== $name: exit ${PIPESTATUS[0]} after $(( SECONDS - t )) s" | tee -a "$log"
}

machine='nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tail -1; nproc; df -h . | tail -1
python3 -c "import sys, torch, transformers, hydra; print(sys.version.split()[0], \"torch\", torch.__version__,
  \"transformers\", transformers.__version__, \"GPU\", torch.cuda.is_available() and torch.cuda.get_device_name())"'

analysis=(python3 bench/analysis_speed.py --device "$DEVICE" --encoder bert-base-random --ops)
# the cache in the working tree's folder (on the machine's disk, as a project's .cache/ would be)
extract=(python3 bench/extract_speed.py --device "$DEVICE" --encoder bert-base-random --loop auto lightning
         --cache-dir "$PWD/.carry")

step machine 5 bash -c "$machine"
step analyses_train_bf16 60 "${analysis[@]}" --rounds "$rounds" --split train --sentences "$all" --precision bf16-mixed \
  --analyses head_stats sink --out "$OUT/analyses_train_bf16.json"
step analyses_train_fp32 60 "${analysis[@]}" --rounds "$rounds" --split train --sentences "$all" --precision 32-true \
  --analyses head_stats sink --max-tokens 32768 --max-batch-size 1024 --out "$OUT/analyses_train_fp32_big.json"
step extract_dev 90 "${extract[@]}" --split dev --sentences "$dev" --precision bf16-mixed 32-true --rounds "$rounds" \
  --budget 60 --out "$OUT/extract_dev.json"
step analyses_train_bf16_big 45 "${analysis[@]}" --rounds "$rounds" --split train --sentences "$all" --precision bf16-mixed \
  --analyses head_stats sink --max-tokens 32768 --max-batch-size 1024 --out "$OUT/analyses_train_bf16_big.json"
step analyses_dev_others 90 "${analysis[@]}" --split dev --sentences "$dev" --precision bf16-mixed --rounds "$(( rounds < 2 ? rounds : 2 ))" \
  --analyses dep_heads coref_heads coref_heads_whole pattern_types linguistic_attention clustering \
  --out "$OUT/analyses_dev_others.json"
step extract_train 120 "${extract[@]}" --split train --sentences "$all" --precision bf16-mixed --rounds 1 \
  --budget 30 --out "$OUT/extract_train.json"
[ "$DRY" = 1 ] && exit 0
echo "== done after $(( SECONDS - start )) s; files in $OUT:" | tee -a "$log"
ls -l "$OUT" | tee -a "$log"
