#!/usr/bin/env bash
# What ZeRO-3 decodes and evaluates from the gathered model equals ZeRO-1's, bit for bit: for each
# world size, a ZeRO-1 and a ZeRO-3 run of 4 steps (configs/ci-tiny.yaml, or $MPI_CONFIG) sample,
# compute the validation loss and score both shipped tasks every 2 steps, and the records of
# metrics.jsonl (samples, validation losses, every task metric at full precision; the seconds left
# out) must be identical. 7 items a task and 7 validation batches: on 2 and 3 ranks the ranks
# take 4/3 and 3/2/2 of each. Validation runs the ranks in lockstep (a rank short of batches
# repeats one uncounted); the task scorer's forwards must not communicate at all.
# usage: run_mpi_zero3_decode.sh BUILD_DIR SOURCE_DIR
# Environment: MPI_DECODE_WORLDS (default "1 2 3"), MPI_CONFIG and MPI_EXTRA_ARGS as in
# mpi_common.sh (on GPUs: device=cuda; the script skips when a world has fewer GPUs than ranks).
set -euo pipefail
build=$1
source=$2
read -r -a worlds <<< "${MPI_DECODE_WORLDS:-1 2 3}"
if [[ " ${MPI_EXTRA_ARGS:-} " == *" device=cuda "* ]]; then
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
  for np in "${worlds[@]}"; do
    [ "$gpus" -ge "$np" ] || { echo "SKIPPED: $np ranks on cuda need $np GPUs, found $gpus"; exit 0; }
  done
fi
# Tiny models: one OpenMP thread a rank (threads spinning on shared cores cost 10-50x).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
work=$(mktemp -d)
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup
tasks="[$source/data/tasks/kjv_next_verse.jsonl, $source/data/tasks/kjv_verse_completion.jsonl]"
args=(training.max_steps=4 checkpoint.every=0 checkpoint.resume=never data.seq_len=256 sample.every=2 sample.tokens=16
      eval.every=2 eval.batches=7 "eval.tasks=$tasks" eval.tasks_every=2 eval.tasks_limit=7)

# What ZeRO-3 must reproduce (RUN_DIR LOG): the samples, validation losses and task metrics of
# metrics.jsonl (not the seconds), and the final sample the log prints. The sample goes to stdout
# and the log lines to stderr; mpirun forwards the two streams separately, so a log line written
# before the sample can land inside its block: log lines ("HH:MM:SS [rank R] ...") are dropped.
decoded_records() {
  { grep -E '"sample"|"val_loss"|"eval/' "$1/metrics.jsonl" || true; } |
    sed -E 's/,?"eval\/[^"]*\/seconds":[-+0-9.eE]+//g'
  sed -n '/^--- sample ---$/,/^--------------$/p' "$2" |
    { grep -Ev '^[0-9]{2}:[0-9]{2}:[0-9]{2} \[rank [0-9]+\] ' || true; }
}

failures=()
for np in "${worlds[@]}"; do
  for stage in 1 3; do
    out="$work/np$np.zero$stage"
    mpi_train "$np" "$out.log" run.output_dir="$out" parallel.zero_stage=$stage "${args[@]}" ||
      { tail -n 30 "$out.log"; failures+=("np $np ZeRO-$stage: the run failed"); continue; }
    decoded_records "$out" "$out.log" > "$out.records"
  done
  one="$work/np$np.zero1.records" three="$work/np$np.zero3.records"
  [ -f "$one" ] && [ -f "$three" ] || continue
  samples=$(grep -c '"sample"' "$one" || true)
  scores=$(grep -c '"eval/kjv_verse_completion/exact_match"' "$one" || true)
  if [ "$samples" -ne 2 ] || [ "$scores" -ne 2 ] || [ "$(grep -c '"val_loss"' "$one" || true)" -ne 2 ] ||
    ! grep -q -- '--- sample ---' "$one"; then
    cat "$one"
    failures+=("np $np: expected 2 samples, 2 validation losses, 2 task records and a final sample")
  elif ! cmp -s "$one" "$three"; then
    diff "$one" "$three" || true
    failures+=("np $np: ZeRO-3's samples, validation losses or task scores differ from ZeRO-1's")
  else
    echo "np $np: ZeRO-3's samples, validation losses and task scores equal ZeRO-1's ($(wc -l < "$three") records)"
  fi
done
if [ ${#failures[@]} -gt 0 ]; then
  for f in "${failures[@]}"; do echo "FAIL: $f"; done
  exit 1
fi
echo "ZeRO-3 decodes and evaluates as ZeRO-1 on ${worlds[*]} ranks"
