#!/usr/bin/env bash
# End-to-end CPU run of configs/ci-tiny.yaml on the bundled corpus: the trainer must exit 0, its
# loss must clearly fall, and a misspelt key in the config must be refused (exit 2) by name.
# usage: run_ci_tiny.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gunzip -c "$source/data/kjv.txt.gz" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null
"$build/trainer" "$source/configs/ci-tiny.yaml" run.output_dir="$work/run" data.train="$work/train.bin" \
  data.val="$work/val.bin" > "$work/out.log" 2>&1 || { cat "$work/out.log"; echo "FAIL: trainer exited non-zero"; exit 1; }
first=$(grep -m1 '"loss"' "$work/run/metrics.jsonl" | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/')
last=$(grep '"loss"' "$work/run/metrics.jsonl" | tail -1 | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/')
val=$(grep '"val_loss"' "$work/run/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.e+-]*\).*/\1/')
echo "first logged loss $first, last $last, validation $val"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(a - b > 0.8) }' || { echo "FAIL: loss did not clearly fall"; exit 1; }
grep -q -- "--- sample ---" "$work/out.log" || { echo "FAIL: no sample printed"; exit 1; }
[ -f "$work/run/config.yaml" ] || { echo "FAIL: resolved config not written"; exit 1; }

# The final checkpoint exports as a Hugging Face folder; a directory that is not a checkpoint exits 2.
final=$(ls -d "$work/run/checkpoints"/step_* | sort | tail -1)
"$build/tools/export_hf" "$final" "$work/hf" --dtype bf16 || { echo "FAIL: export_hf"; exit 1; }
[ -s "$work/hf/model.safetensors" ] && [ -s "$work/hf/config.json" ] || { echo "FAIL: export incomplete"; exit 1; }
mkdir -p "$work/not_a_checkpoint"
set +e
"$build/tools/export_hf" "$work/not_a_checkpoint" "$work/hf2" > /dev/null 2>&1
code=$?
set -e
[ "$code" -eq 2 ] || { echo "FAIL: export_hf of a non-checkpoint gave exit code $code, expected 2"; exit 1; }

# A misspelt key is refused before any work, naming the key, with exit code 2.
sed 's/  max_steps:/  max_step:/' "$source/configs/ci-tiny.yaml" > "$work/bad.yaml"
set +e
"$build/trainer" "$work/bad.yaml" data.train="$work/train.bin" data.val="$work/val.bin" > "$work/bad.log" 2>&1
code=$?
set -e
cat "$work/bad.log"
[ "$code" -eq 2 ] || { echo "FAIL: misspelt key gave exit code $code, expected 2"; exit 1; }
grep -q "training.max_step" "$work/bad.log" || { echo "FAIL: the message does not name training.max_step"; exit 1; }
grep -q "did you mean" "$work/bad.log" || { echo "FAIL: no suggestion"; exit 1; }
echo "ci-tiny passed"
