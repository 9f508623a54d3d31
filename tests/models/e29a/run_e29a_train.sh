#!/usr/bin/env bash
# The E29a family through the unchanged trainer and export tool on the CPU: configs/e29a-quickstart-cpu
# trains with the loss clearly falling and prints a sample (the recurrent decoder); a run stopped
# at step 4 resumes on 2 ranks (resharded) with the losses of an uninterrupted run; the last
# checkpoint exports as a folder naming E29aForCausalLM and its tensors, which starts a new run
# through init_from; the same for a normed-sum residual. usage: run_e29a_train.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source "$source/tests/trainer/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 400000
data=(data.train="$work/train.bin" data.val="$work/val.bin")
losses() { grep '"loss"' "$1/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*"loss":\([0-9.e+-]*\).*/\1 \2/; s/.*"loss":\([0-9.e+-]*\).*"step":\([0-9]*\).*/\2 \1/' | sort -n | uniq; }

# 1. The quickstart config, shortened: the loss must clearly fall from ln(256) = 5.55.
"$build/trainer" "$source/configs/e29a-quickstart-cpu.yaml" run.output_dir="$work/quick" "${data[@]}" \
  training.max_steps=40 schedule.warmup_steps=10 logging.every=1 eval.every=0 sample.tokens=40 \
  > "$work/quick.log" 2>&1 || { cat "$work/quick.log"; echo "FAIL: quickstart-cpu run"; exit 1; }
first=$(losses "$work/quick" | head -1 | cut -d' ' -f2)
last=$(losses "$work/quick" | tail -1 | cut -d' ' -f2)
echo "quickstart-cpu: first loss $first, loss at step 40 $last"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(a - b > 1.5) }' || { echo "FAIL: loss did not clearly fall"; exit 1; }
grep -q -- "--- sample ---" "$work/quick.log" || { echo "FAIL: no sample printed"; exit 1; }

# 2. Stopped at step 4 and resumed on 2 ranks (resharded) equals the uninterrupted run.
run=(run.seed=3 training.micro_batch_size=4 training.global_batch_size=8 training.max_steps=8
     schedule.warmup_steps=2 checkpoint.every=4 checkpoint.keep_last=0 eval.every=0 sample.every=0 sample.tokens=1
     logging.every=1 parallel.zero_stage=1)
cfg="$source/configs/e29a-ci-tiny.yaml"
"$build/trainer" "$cfg" run.output_dir="$work/full" "${data[@]}" "${run[@]}" > "$work/full.log" 2>&1 ||
  { cat "$work/full.log"; echo "FAIL: uninterrupted run"; exit 1; }
mkdir -p "$work/resumed"
cp -r "$work/full/checkpoints" "$work/resumed/"
rm -rf "$work/resumed/checkpoints/step_00000008"
mpirun --oversubscribe -np 2 "$build/trainer" "$cfg" run.output_dir="$work/resumed" "${data[@]}" "${run[@]}" \
  checkpoint.resume=auto > "$work/resumed.log" 2>&1 || { cat "$work/resumed.log"; echo "FAIL: resume on 2 ranks"; exit 1; }
grep -q "step 5/8" "$work/resumed.log" || { cat "$work/resumed.log"; echo "FAIL: did not resume at step 5"; exit 1; }
full=$(losses "$work/full" | awk '$1 > 4')
resumed=$(losses "$work/resumed" | awk '$1 > 4')
echo "uninterrupted: $(echo $full)"; echo "resumed on 2 ranks: $(echo $resumed)"
[ "$(echo "$resumed" | wc -l)" -eq 4 ] || { echo "FAIL: expected the losses of steps 5..8"; exit 1; }
paste <(echo "$full") <(echo "$resumed") | awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-5 * $2) bad = 1 } END { exit bad }' \
  || { echo "FAIL: resumed losses differ from the uninterrupted run by more than 1e-5 relative"; exit 1; }

# 3. Export, then a new run from the exported folder.
"$build/tools/export_hf" "$work/full/checkpoints/step_00000008" "$work/hf" --dtype fp32 > /dev/null ||
  { echo "FAIL: export"; exit 1; }
grep -q '"E29aForCausalLM"' "$work/hf/config.json" || { cat "$work/hf/config.json"; echo "FAIL: config.json does not name E29aForCausalLM"; exit 1; }
grep -q '"n_slots"' "$work/hf/config.json" || { echo "FAIL: config.json has no n_slots"; exit 1; }
for name in model.embed_tokens.weight model.layers.1.mixer.W_xz.weight model.layers.0.mixer.tape_init model.norm.weight; do
  grep -q "$name" "$work/hf/model.safetensors" || { echo "FAIL: tensor $name missing"; exit 1; }
done
"$build/trainer" "$cfg" run.output_dir="$work/from_hf" "${data[@]}" model.init_from="$work/hf" training.max_steps=2 \
  schedule.warmup_steps=1 checkpoint.every=0 eval.every=0 sample.every=0 sample.tokens=1 > "$work/from_hf.log" 2>&1 ||
  { cat "$work/from_hf.log"; echo "FAIL: init_from the exported folder"; exit 1; }
grep -q '"residual": "pre_norm"' "$work/hf/config.json" || { echo "FAIL: config.json does not say residual: pre_norm"; exit 1; }

# 4. The normed-sum residual: its export says so, and a run started from that folder takes it.
"$build/trainer" "$cfg" run.output_dir="$work/normed" "${data[@]}" model.residual=normed_sum training.max_steps=2 \
  schedule.warmup_steps=1 checkpoint.every=2 checkpoint.keep_last=0 eval.every=0 sample.every=0 sample.tokens=1 \
  > "$work/normed.log" 2>&1 || { cat "$work/normed.log"; echo "FAIL: normed_sum run"; exit 1; }
"$build/tools/export_hf" "$work/normed/checkpoints/step_00000002" "$work/hf_normed" --dtype fp32 > /dev/null ||
  { echo "FAIL: export of the normed_sum run"; exit 1; }
grep -q '"residual": "normed_sum"' "$work/hf_normed/config.json" ||
  { cat "$work/hf_normed/config.json"; echo "FAIL: config.json does not say residual: normed_sum"; exit 1; }
"$build/trainer" "$cfg" run.output_dir="$work/from_normed" "${data[@]}" model.init_from="$work/hf_normed" \
  training.max_steps=2 schedule.warmup_steps=1 checkpoint.every=0 eval.every=0 sample.every=0 sample.tokens=1 \
  > "$work/from_normed.log" 2>&1 || { cat "$work/from_normed.log"; echo "FAIL: init_from the normed_sum folder"; exit 1; }
grep -q "residual: normed_sum" "$work/from_normed/config.yaml" ||
  { echo "FAIL: the run from the normed_sum folder is not a normed_sum model"; exit 1; }
echo "PASS"
