#!/usr/bin/env bash
# What a new user runs into, each refused or handled: a refused run leaves the run directory's
# config.yaml alone; resuming at max_steps trains nothing and logs no made-up loss; a tokenizer
# larger than the model's vocabulary, a huge micro-batch, a config that is /dev/zero and a FIFO
# given as a shard are refused at once (exit 2); a second trainer on a live run directory is
# refused and a killed run leaves no stale lock; after kill -9 and resume every step appears once
# in metrics.jsonl; resuming with another seq_len is refused unless allowed; SIGTERM to the
# launch script saves on every rank and exits 0. usage: run_user_faults.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2> /dev/null || true; rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source "$(dirname "$0")/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 300000
trainer="$build/trainer"
base=("$source/configs/ci-tiny.yaml" data.train="$work/train.bin" data.val="$work/val.bin" eval.every=0 sample.tokens=1
      schedule.warmup_steps=2 checkpoint.resume=auto)
expect_exit() {  # CODE TEXT LOG COMMAND...
  local want=$1 text=$2 log=$3; shift 3
  set +e
  timeout 60 "$@" > "$log" 2>&1
  local code=$?
  set -e
  [ "$code" -eq "$want" ] || { cat "$log"; echo "FAIL: exit $code, expected $want: $*"; exit 1; }
  [ -z "$text" ] || grep -qF -- "$text" "$log" || { cat "$log"; echo "FAIL: no '$text' in the output of: $*"; exit 1; }
}

# 1. A run, then a refused run (corrupt shard) on the same directory: config.yaml untouched.
"$trainer" "${base[@]}" run.output_dir="$work/run" training.max_steps=6 checkpoint.every=3 > "$work/run.log" 2>&1
sum=$(sha256sum < "$work/run/config.yaml")
head -c 100 /dev/urandom > "$work/corrupt.bin"
expect_exit 2 "corrupt.bin" "$work/corrupt.log" "$trainer" "${base[@]}" run.output_dir="$work/run" data.train="$work/corrupt.bin" training.max_steps=50
[ "$(sha256sum < "$work/run/config.yaml")" = "$sum" ] || { echo "FAIL: a refused run rewrote config.yaml"; exit 1; }
echo "ok: refused run leaves config.yaml"

# 2. Resuming at max_steps: nothing to train, no invented final loss.
expect_exit 0 "nothing to train" "$work/past.log" "$trainer" "${base[@]}" run.output_dir="$work/run" training.max_steps=6
! grep -q "final loss 0.0000" "$work/past.log" || { echo "FAIL: a made-up final loss"; exit 1; }
echo "ok: resume at max_steps"

# 3. Bad inputs refused at once, exit 2.
expect_exit 2 "has 300 ids but model.vocab_size is 256" "$work/vocab.log" \
  "$trainer" "${base[@]}" run.output_dir="$work/v" data.tokenizer="$source/tests/fixtures/tokenizer/small_bpe.json"
expect_exit 2 "training.micro_batch_size: expected an integer in [1," "$work/micro.log" \
  "$trainer" "${base[@]}" run.output_dir="$work/m" training.micro_batch_size=4611686018427387904
expect_exit 2 "training.global_batch_size" "$work/global.log" \
  "$trainer" "${base[@]}" run.output_dir="$work/g" training.micro_batch_size=1 training.global_batch_size=6442450944
expect_exit 2 "/dev/zero: not a regular file" "$work/zero.log" "$trainer" /dev/zero
mkfifo "$work/fifo"
expect_exit 2 "is not a regular file" "$work/fifo.log" "$trainer" "${base[@]}" run.output_dir="$work/f" data.train="$work/fifo"
echo "ok: bad inputs refused"

# 4. A second trainer on a live run directory is refused; after kill -9 the lock is free again.
# LLMTRAIN_TEST_HANG stops rank 0 at step 8 (after the checkpoint of step 5), as a wedged run would.
LLMTRAIN_TEST_HANG=0:8 "$trainer" "${base[@]}" run.output_dir="$work/live" training.max_steps=12 checkpoint.every=5 \
  logging.every=1 > "$work/live.log" 2>&1 &
live=$!
for _ in $(seq 100); do grep -q "LLMTRAIN_TEST_HANG" "$work/live.log" && break; sleep 0.2; done
grep -q "LLMTRAIN_TEST_HANG" "$work/live.log" || { cat "$work/live.log"; echo "FAIL: the first run did not reach step 8"; exit 1; }
expect_exit 2 "is in use by another trainer (pid $live)" "$work/second.log" \
  "$trainer" "${base[@]}" run.output_dir="$work/live" training.max_steps=12
kill -9 "$live"; wait "$live" 2> /dev/null || true
echo "ok: second trainer refused"

# 5. After kill -9 (steps 6 and 7 logged after the step-5 checkpoint) the resumed run logs each
# step once, with the losses of an uninterrupted run.
"$trainer" "${base[@]}" run.output_dir="$work/live" training.max_steps=12 checkpoint.every=5 logging.every=1 > "$work/resume.log" 2>&1
"$trainer" "${base[@]}" run.output_dir="$work/whole" training.max_steps=12 checkpoint.every=5 logging.every=1 > "$work/whole.log" 2>&1
steps() { grep '"loss"' "$1" | sed 's/.*"step":\([0-9]*\).*/\1/'; }
[ "$(steps "$work/live/metrics.jsonl" | sort -n | uniq -d)" = "" ] || { echo "FAIL: duplicated steps in metrics.jsonl"; exit 1; }
[ "$(steps "$work/live/metrics.jsonl" | wc -l)" -eq 12 ] || { echo "FAIL: expected 12 logged steps"; exit 1; }
losses() { grep '"loss"' "$1" | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/'; }
[ "$(losses "$work/live/metrics.jsonl")" = "$(losses "$work/whole/metrics.jsonl")" ] \
  || { paste <(losses "$work/live/metrics.jsonl") <(losses "$work/whole/metrics.jsonl"); echo "FAIL: losses differ after resume"; exit 1; }
echo "ok: kill -9 and resume log every step once"

# 6. SIGTERM mid-window: the resumed run's logged averages equal the uninterrupted run's.
"$trainer" "${base[@]}" run.output_dir="$work/window" training.max_steps=12 logging.every=4 checkpoint.every=6 > /dev/null 2>&1
"$trainer" "${base[@]}" run.output_dir="$work/window_whole" training.max_steps=12 logging.every=4 checkpoint.every=0 > /dev/null 2>&1
rm -rf "$work/window/checkpoints/step_00000012"
sed -i '/"step":\(7\|8\|9\|10\|11\|12\)[,}]/d' "$work/window/metrics.jsonl"
"$trainer" "${base[@]}" run.output_dir="$work/window" training.max_steps=12 logging.every=4 checkpoint.every=6 > /dev/null 2>&1
[ "$(losses "$work/window/metrics.jsonl")" = "$(losses "$work/window_whole/metrics.jsonl")" ] \
  || { paste <(losses "$work/window/metrics.jsonl") <(losses "$work/window_whole/metrics.jsonl"); echo "FAIL: window averages differ after resume"; exit 1; }
echo "ok: logging window continues across a resume"

# 7. Another seq_len on resume: refused by name, accepted when allowed.
expect_exit 2 "checkpoint.allow_data_change" "$work/seq.log" "$trainer" "${base[@]}" run.output_dir="$work/run" \
  training.max_steps=8 data.seq_len=32
expect_exit 0 "" "$work/seq_ok.log" "$trainer" "${base[@]}" run.output_dir="$work/run" training.max_steps=8 \
  data.seq_len=32 checkpoint.allow_data_change=true checkpoint.allow_schedule_change=true
echo "ok: data order change refused unless allowed"

# 8. SIGTERM to the launch script: both ranks save one checkpoint, exit 0.
NP=2 BIND="--bind-to none --oversubscribe" TRAINER="$trainer" "$source/launch/mpirun_local.sh" "${base[@]}" \
  run.output_dir="$work/mpi" training.max_steps=100000 training.micro_batch_size=4 training.global_batch_size=8 checkpoint.every=0 \
  schedule.warmup_steps=2 logging.every=1 > "$work/mpi.log" 2>&1 &
launcher=$!
for _ in $(seq 150); do grep -q "step 3/" "$work/mpi.log" && break; sleep 0.2; done
kill -TERM "$launcher"
set +e; wait "$launcher"; code=$?; set -e
[ "$code" -eq 0 ] || { cat "$work/mpi.log"; echo "FAIL: the launch script exited $code after SIGTERM"; exit 1; }
ls "$work/mpi/checkpoints"/step_*/DONE > /dev/null || { echo "FAIL: no checkpoint after SIGTERM"; exit 1; }
echo "ok: SIGTERM to the launch script saves and exits 0"
echo PASS
