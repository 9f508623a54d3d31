#!/usr/bin/env bash
# SIGTERM during a CPU run of configs/ci-tiny.yaml: the trainer finishes its step, saves a complete
# checkpoint and exits 0; a second run with checkpoint.resume=auto continues from that step.
# usage: run_signal_save.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trainer_pid=""
cleanup() {
  if [ -n "$trainer_pid" ]; then kill "$trainer_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
gunzip -c "$source/data/kjv.txt.gz" > "$work/full.txt"
head -c 400000 "$work/full.txt" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null
common=(run.output_dir="$work/run" data.train="$work/train.bin" data.val="$work/val.bin" eval.every=0 logging.every=1
        schedule.warmup_steps=2)

"$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=100000 \
  checkpoint.every=0 checkpoint.resume=never > "$work/first.log" 2>&1 &
trainer_pid=$!
# Signal once a few steps are logged.
for _ in $(seq 600); do
  logged=$( (grep -c '"loss"' "$work/run/metrics.jsonl" 2>/dev/null) || true)
  if [ "${logged:-0}" -ge 3 ]; then break; fi
  sleep 0.1
done
kill -TERM "$trainer_pid"
set +e
wait "$trainer_pid"
code=$?
set -e
trainer_pid=""
cat "$work/first.log"
[ "$code" -eq 0 ] || { echo "FAIL: SIGTERM gave exit code $code, expected 0"; exit 1; }
saved=$(ls -d "$work"/run/checkpoints/step_* 2>/dev/null | grep -v '\.tmp$' | tail -1)
[ -n "$saved" ] && [ -f "$saved/DONE" ] || { echo "FAIL: no complete checkpoint after SIGTERM"; exit 1; }
step=$((10#${saved##*step_}))
echo "checkpoint at step $step"

"$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=$((step + 2)) \
  checkpoint.allow_schedule_change=true checkpoint.resume=auto > "$work/second.log" 2>&1 || { cat "$work/second.log"; echo "FAIL: resumed run failed"; exit 1; }
cat "$work/second.log"
grep -q "resumed from .*step_$(printf %08d "$step") at step $step" "$work/second.log" ||
  { echo "FAIL: the second run did not resume from step $step"; exit 1; }
[ -f "$work/run/checkpoints/step_$(printf %08d $((step + 2)))/DONE" ] || { echo "FAIL: no checkpoint at step $((step + 2))"; exit 1; }
echo "signal save passed"
