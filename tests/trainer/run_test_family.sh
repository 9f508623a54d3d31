#!/usr/bin/env bash
# The test-only bigram family (tests/support/test_family.cpp) through the unchanged trainer and
# export tool: a run stopped after step 4 and resumed equals an uninterrupted run at every step;
# the checkpoint resumes on 2 ranks (resharded), and with Adafactor and adamw8bit on 3; the last checkpoint exports as a folder whose
# tensors and config.json name the family. usage: run_test_family.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
programs="$build/tests/family_programs"
source "$(dirname "$0")/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 200000
cat > "$work/bigram.yaml" <<YAML
run: {name: bigram, output_dir: $work/run, seed: 3}
device: cpu
model: {arch: bigram, preset: bigram-test}
data: {train: $work/train.bin, val: $work/val.bin, seq_len: 16, tokenizer: byte}
training: {micro_batch_size: 2, global_batch_size: 4, max_steps: 8, precision: fp32}
optimizer: {type: adamw8bit}
parallel: {zero_stage: 1}
checkpoint: {every: 4, keep_last: 0}
eval: {every: 0}
logging: {every: 1}
YAML
losses() { grep '"loss"' "$1/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*"loss":\([0-9.e+-]*\).*/\1 \2/; s/.*"loss":\([0-9.e+-]*\).*"step":\([0-9]*\).*/\2 \1/' | sort -n | uniq; }
"$programs" trainer "$work/bigram.yaml" run.output_dir="$work/full" > "$work/full.log" 2>&1 || { cat "$work/full.log"; echo "FAIL: uninterrupted run"; exit 1; }
"$programs" trainer "$work/bigram.yaml" training.max_steps=8 > "$work/a.log" 2>&1 || { cat "$work/a.log"; exit 1; }
# Resume on 2 ranks from step 4 (resharding), writing a run of its own.
mkdir -p "$work/resumed"
cp -r "$work/run/checkpoints" "$work/resumed/"
rm -rf "$work/resumed/checkpoints/step_00000008"
mpirun --oversubscribe -np 2 "$programs" trainer "$work/bigram.yaml" run.output_dir="$work/resumed" \
  > "$work/resumed.log" 2>&1 || { cat "$work/resumed.log"; echo "FAIL: resume on 2 ranks"; exit 1; }
grep -q "step 5/8" "$work/resumed.log" || { cat "$work/resumed.log"; echo "FAIL: did not resume at step 5"; exit 1; }
full=$(losses "$work/full" | awk '$1 > 4')
resumed=$(losses "$work/resumed" | awk '$1 > 4')
echo "uninterrupted: $(echo $full)"; echo "resumed on 2 ranks: $(echo $resumed)"
paste <(echo "$full") <(echo "$resumed") | awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-5 * $2) bad = 1 } END { exit bad }' \
  || { echo "FAIL: resumed losses differ from the uninterrupted run"; exit 1; }
# Adafactor and adamw8bit resharded onto 3 ranks: some shards hold no small (packed) tensor at all.
for optimizer in adafactor adamw8bit; do
  d="$work/$optimizer"
  "$programs" trainer "$work/bigram.yaml" optimizer.type=$optimizer training.global_batch_size=6 run.output_dir="$d/full" > "$d.full.log" 2>&1 \
    || { cat "$d.full.log"; echo "FAIL: $optimizer uninterrupted run"; exit 1; }
  mkdir -p "$d/resumed"
  cp -r "$d/full/checkpoints" "$d/resumed/"
  rm -rf "$d/resumed/checkpoints/step_00000008"
  mpirun --oversubscribe -np 3 "$programs" trainer "$work/bigram.yaml" optimizer.type=$optimizer training.global_batch_size=6 \
    run.output_dir="$d/resumed" > "$d.resumed.log" 2>&1 || { cat "$d.resumed.log"; echo "FAIL: $optimizer resume on 3 ranks"; exit 1; }
  paste <(losses "$d/full" | awk '$1 > 4') <(losses "$d/resumed" | awk '$1 > 4') |
    awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-5 * $2) bad = 1 } END { exit bad }' \
    || { echo "FAIL: $optimizer resumed on 3 ranks differs from the uninterrupted run"; exit 1; }
  echo "$optimizer: resumed on 3 ranks equals the uninterrupted run"
done
"$programs" export_hf "$work/run/checkpoints/step_00000008" "$work/hf" --dtype fp32 > /dev/null \
  || { echo "FAIL: export"; exit 1; }
grep -q '"BigramForTests"' "$work/hf/config.json" || { echo "FAIL: config.json does not name the family"; exit 1; }
grep -q 'proj.bias' "$work/hf/model.safetensors" || { echo "FAIL: tensors missing"; exit 1; }
# The exported folder starts a new run through init_from (shape read from its config.json).
"$programs" trainer "$work/bigram.yaml" run.output_dir="$work/from_hf" model.init_from="$work/hf" \
  training.max_steps=2 checkpoint.every=0 > "$work/from_hf.log" 2>&1 || { cat "$work/from_hf.log"; echo "FAIL: init_from"; exit 1; }
echo "PASS"
