#!/usr/bin/env bash
# kill -9 at random moments while a run saves a checkpoint after every step: after each kill the
# newest complete checkpoint must verify and `checkpoint.resume=auto` must continue from it.
# usage: kill9_trials.sh BUILD_DIR SOURCE_DIR [TRIALS]
set -uo pipefail
build=$1
source=$2
trials=${3:-20}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gunzip -c "$source/data/kjv.txt.gz" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null || exit 1
# A 4M-parameter model on 16-token steps: writing its checkpoint (about 50 MB) takes a good share
# of each step, so many kills land inside a save.
common=(run.output_dir="$work/run" data.train="$work/train.bin" data.val="$work/val.bin" model.hidden_size=256
        model.intermediate_size=1024 model.num_layers=4 model.num_heads=4 model.num_kv_heads=2 model.head_dim=64
        training.micro_batch_size=1 data.seq_len=16 schedule.warmup_steps=0 checkpoint.every=1
        checkpoint.keep_last=2 eval.every=0 logging.every=1 sample.tokens=1)
hits=0
for trial in $(seq 1 "$trials"); do
  "$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=100000 checkpoint.resume=auto \
    > "$work/trial.log" 2>&1 &
  pid=$!
  sleep "$(awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.2f", 0.5 + 2.0 * rand() }')"
  kill -9 "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  ls "$work/run/checkpoints" 2> /dev/null | grep -q '\.tmp$' && hits=$((hits + 1))  # killed inside a save
  newest=$(ls "$work/run/checkpoints" 2> /dev/null | grep -E '^step_[0-9]{8}$' | sort | tail -1)
  [ -n "$newest" ] || { echo "trial $trial: no complete checkpoint yet"; continue; }
  step=$((10#${newest#step_}))
  if ! "$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=$((step + 1)) \
       checkpoint.allow_schedule_change=true checkpoint.resume=auto > "$work/resume.log" 2>&1; then
    cat "$work/resume.log"
    echo "FAIL: trial $trial: resume from $newest failed"
    exit 1
  fi
  grep -q "resumed from" "$work/resume.log" || { cat "$work/resume.log"; echo "FAIL: trial $trial: did not resume"; exit 1; }
  echo "trial $trial: killed at a random moment (newest complete checkpoint $newest), resumed and saved step $((step + 1))"
done
echo "kill -9 trials: $trials runs, $hits killed while a checkpoint directory was being written; every resume worked"
