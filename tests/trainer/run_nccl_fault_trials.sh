#!/usr/bin/env bash
# Fault trials of a multi-GPU run on real NCCL (tests/gpu.sh faults; the figures in
# docs/results.md): the quickstart-size model of gpu_parity.yaml on 2 GPUs at ZeRO stage
# $TRIAL_STAGE (default 3), a constant learning rate (so a resumed run's schedule is the
# uninterrupted run's whatever max_steps it gets), a checkpoint every 2 steps, parallel.timeout_s=10.
#  (a) kill -9 of rank 1 once a checkpoint of step 4 or later exists;
#  (b) rank 1 stopped (SIGSTOP) after step 5;
#  (c) SIGTERM to the launcher (mpirun forwards it to the ranks, which stop after one step together
#      and save it).
# For each: the seconds from the fault to the job's exit, its exit code and message, the newest
# complete checkpoint; then resumes from it on 2 GPUs and on another GPU count (1, and 4 where the
# host has 4), 8 steps each, and prints the largest relative difference of their losses from an
# uninterrupted 2-GPU run's at the same steps (0 means bit for bit).
# usage: run_nccl_fault_trials.sh BUILD_DIR SOURCE_DIR    ($TRIALS: which of "a b c", default all)
set -euo pipefail
build=$1
source=$2
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
[ "$gpus" -ge 2 ] || { echo "SKIPPED: needs 2 GPUs, found $gpus"; exit 0; }
work=$(mktemp -d)
MPI_CONFIG=$source/tests/trainer/gpu_parity.yaml
stage=${TRIAL_STAGE:-3}
MPI_EXTRA_ARGS="device=cuda training.global_batch_size=12 schedule.type=constant parallel.zero_stage=$stage"
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup
other=1
[ "$gpus" -ge 4 ] && other="1 4"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
rank_pid() {  # RUN_DIR RANK
  local pid
  for pid in $(pgrep -f -- "$1" 2> /dev/null || true); do
    [ "$(readlink -f "/proc/$pid/exe" 2> /dev/null)" = "$(readlink -f "$trainer_bin")" ] || continue
    if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$pid"
      return 0
    fi
  done
}
# The background job of a long run (400 steps) in $1.
start_run() {
  timeout -k 10 600 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$trainer_bin" "$config" "${mpi_common[@]}" \
    run.output_dir="$1" training.max_steps=400 checkpoint.every=2 checkpoint.resume=never parallel.timeout_s=10 \
    > "$1.log" 2>&1 &
  job=$!
}
wait_for_step() {  # RUN_DIR STEP: until the metrics log that step (at most 180 s)
  for _ in $(seq 1800); do
    [ -f "$1/metrics.jsonl" ] && [ "$(mpi_losses "$1/metrics.jsonl" | tail -1 | cut -d' ' -f1)" -ge "$2" ] 2> /dev/null &&
      return 0
    kill -0 "$job" 2> /dev/null || return 1
    sleep 0.05
  done
  return 1
}
# Waits for the job after the fault at time $2; prints what happened; $1 names the trial.
report_exit() {
  local code=0
  wait "$job" || code=$?
  mpi_kill_leftovers_of "$1"
  echo "   job exited with code $code $(since "$2") s after the fault"
  grep -m3 -E "did not finish within|stopped after step|signal|error|Error" "$1.log" | sed 's/^/   message: /' || true
}
mpi_kill_leftovers_of() { pkill -9 -f -- "$1" 2> /dev/null || true; }
# Resumes checkpoint $1 on $2 GPUs for 8 steps and compares the losses with the reference.
resume_and_compare() {
  local ckpt=$1 np=$2 step out
  step=$((10#${ckpt##*step_}))
  out="$work/resume.$(basename "$(dirname "$(dirname "$ckpt")")").np$np"
  if ! mpi_train "$np" "$out.log" run.output_dir="$out" checkpoint.resume="$ckpt" checkpoint.every=0 \
    training.max_steps=$((step + 8)) checkpoint.allow_schedule_change=true; then
    tail -n 20 "$out.log"
    echo "FAIL: resuming $(basename "$ckpt") on $np GPU(s)"
    status=1
    return
  fi
  mpi_losses "$out/metrics.jsonl" > "$out.losses"
  worst=$(MPI_REL_TOL=1 mpi_compare "$work/reference.losses" "$out.losses" $((step + 1)) $((step + 8))) || worst="missing steps"
  echo "   resumed $(basename "$ckpt") on $np GPU(s): steps $((step + 1))-$((step + 8)), largest relative loss difference from the uninterrupted run $worst"
  if [ "$np" -eq 2 ] && [ "$worst" != "0.000e+00" ]; then
    echo "FAIL: the same GPU count must repeat the uninterrupted losses bit for bit"
    status=1
  fi
}
status=0

echo "== reference: uninterrupted, 2 GPUs, ZeRO-$stage, 40 steps"
mpi_train 2 "$work/reference.log" run.output_dir="$work/reference" training.max_steps=40 checkpoint.every=0 \
  checkpoint.resume=never || { tail -n 30 "$work/reference.log"; echo "FAIL: the reference run"; exit 1; }
mpi_losses "$work/reference/metrics.jsonl" > "$work/reference.losses"

# After the fault at time $2 on run $1: how the job ended, its newest checkpoint, the resumes.
after_fault() {
  local ckpt np
  report_exit "$1" "$2"
  ckpt=$(mpi_newest_checkpoint "$1")
  echo "   newest complete checkpoint $(basename "$ckpt")"
  for np in 2 $other; do resume_and_compare "$ckpt" "$np"; done
}
trials=${TRIALS:-a b c}

if [[ " $trials " == *" a "* ]]; then
  echo "== (a) kill -9 of rank 1"
  run="$work/kill9"
  start_run "$run"
  for _ in $(seq 1800); do
    ckpt=$(mpi_newest_checkpoint "$run")
    [ -n "$ckpt" ] && [ $((10#${ckpt##*step_})) -ge 4 ] && break
    sleep 0.05
  done
  kill -9 "$(rank_pid "$run" 1)"
  after_fault "$run" "$(now)"
fi

if [[ " $trials " == *" b "* ]]; then
  echo "== (b) rank 1 stopped (SIGSTOP) after step 5"
  run="$work/sigstop"
  start_run "$run"
  wait_for_step "$run" 5
  kill -STOP "$(rank_pid "$run" 1)"
  after_fault "$run" "$(now)"
fi

if [[ " $trials " == *" c "* ]]; then
  echo "== (c) SIGTERM to the launcher after step 5"
  run="$work/sigterm"
  start_run "$run"
  wait_for_step "$run" 5
  kill -TERM "$(pgrep -P "$job" | head -1)"  # the launcher under `timeout`
  after_fault "$run" "$(now)"
fi

[ "$status" -eq 0 ] && echo "nccl fault trials done"
exit "$status"
