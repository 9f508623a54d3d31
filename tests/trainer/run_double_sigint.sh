#!/usr/bin/env bash
# Two SIGINTs during a CPU run of configs/ci-tiny.yaml: the second makes the trainer exit at once
# with code 130, without finishing the step or saving, and the newest complete checkpoint is left
# byte for byte as it was and still resumes.
# usage: run_double_sigint.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trainer_pid=""
cleanup() {
  if [ -n "$trainer_pid" ]; then kill -9 "$trainer_pid" 2> /dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
gunzip -c "$source/data/kjv.txt.gz" > "$work/full.txt"
head -c 400000 "$work/full.txt" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null
# 64 sequences per step make a step last long enough (a few hundred ms on two cores) for the
# two signals to arrive within one step.
common=(run.output_dir="$work/run" data.train="$work/train.bin" data.val="$work/val.bin" eval.every=0 logging.every=1
        schedule.warmup_steps=2 training.micro_batch_size=64 sample.every=0)

newest_complete() {
  local dir newest=""
  for dir in "$work"/run/checkpoints/step_*; do
    case $dir in *.tmp) continue ;; esac
    [ -f "$dir/DONE" ] && newest=$dir
  done
  echo "$newest"
}

"$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=100000 checkpoint.every=2 \
  checkpoint.resume=never > "$work/first.log" 2>&1 &
trainer_pid=$!
for _ in $(seq 1200); do
  [ -n "$(newest_complete)" ] && break
  sleep 0.1
done
saved=$(newest_complete)
[ -n "$saved" ] || { cat "$work/first.log"; echo "FAIL: no complete checkpoint after 120 s"; exit 1; }
# Wait until the step after that checkpoint is under way, then interrupt twice, 20 ms apart.
step=$(basename "$saved" | sed 's/step_0*//')
for _ in $(seq 600); do
  logged=$( (grep -c '"loss"' "$work/run/metrics.jsonl" 2> /dev/null) || true)
  [ "${logged:-0}" -gt "$step" ] && break
  sleep 0.05
done
before=$(cd "$saved" && cat ./* | cksum)
kill -INT "$trainer_pid"
sleep 0.02
kill -INT "$trainer_pid" 2> /dev/null || true
start=$(date +%s.%N)
set +e
wait "$trainer_pid"
code=$?
set -e
trainer_pid=""
took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
[ "$code" -eq 130 ] || { tail -20 "$work/first.log"; echo "FAIL: two SIGINTs gave exit code $code, expected 130"; exit 1; }
after=$(cd "$saved" && cat ./* | cksum)
[ "$before" = "$after" ] || { echo "FAIL: $saved changed"; exit 1; }
echo "two SIGINTs: exit 130 within $took s of the second; $(basename "$saved") untouched"
# It still resumes.
"$build/trainer" "$source/configs/ci-tiny.yaml" "${common[@]}" training.max_steps=$((step + 1)) \
  checkpoint.allow_schedule_change=true checkpoint.resume="$saved" > "$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; echo "FAIL: resuming $saved failed"; exit 1; }
grep -q "resumed from .*$(basename "$saved") at step $step" "$work/resume.log" ||
  { cat "$work/resume.log"; echo "FAIL: the resumed run does not say it resumed from step $step"; exit 1; }
echo "double SIGINT passed"
