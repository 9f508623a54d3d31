#!/usr/bin/env bash
# Faults in a two-rank CPU run of configs/ci-tiny.yaml; the job must end, never hang, and its
# newest complete checkpoint must stay usable.
#  (a) hang: LLMTRAIN_TEST_HANG=1:5 stops rank 1 at step 5 before the gradient synchronisation;
#      with parallel.timeout_s=3 the watchdog of rank 0 must end the job with a non-zero exit
#      within 60 s, saying "rank <r>: ... did not finish within ...". The step-4 checkpoint must
#      export (export_hf) and resume on one rank.
#  (b) kill -9 of rank 1 once a complete checkpoint exists: mpirun must exit non-zero within
#      parallel.timeout_s + 30 s, leaving no process of the job behind; the newest complete
#      checkpoint must export and resume on two ranks.
#  (c) SIGUSR1 to rank 1 alone: both ranks stop after the same step, save it together, exit 0.
# usage: run_mpi_faults.sh BUILD_DIR SOURCE_DIR
# Environment: MPI_RUN_TIMEOUT (seconds per ordinary run, default 300), MPI_KEEP_WORK (keep the
# temporary directory).
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The processes of a job: those whose command line names its output directory (mpirun, timeout
# and the ranks).
job_pids() { pgrep -f -- "$1" 2> /dev/null || true; }

# The pid of the trainer process of rank $2 among the processes naming $1.
rank_pid() {
  local pid exe want
  want=$(readlink -f "$trainer_bin")
  for pid in $(job_pids "$1"); do
    exe=$(readlink -f "/proc/$pid/exe" 2> /dev/null || true)
    [ "$exe" = "$want" ] || continue
    if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null |
       grep -qE "^(OMPI_COMM_WORLD_RANK|PMIX_RANK|PMI_RANK)=$2\$"; then
      echo "$pid"
      return 0
    fi
  done
}

# Checks that checkpoint $1 exports as a Hugging Face folder and resumes for 2 more steps with
# $2 ranks; $3 names the case in messages.
check_checkpoint() {
  local ckpt=$1 np=$2 what=$3 step code=0
  step=$((10#${ckpt##*step_}))
  "$build/tools/export_hf" "$ckpt" "$work/$what.hf" > "$work/$what.export.log" 2>&1 || code=$?
  if [ "$code" -ne 0 ]; then
    cat "$work/$what.export.log"
    echo "FAIL: $what: export_hf of $ckpt exited with code $code"
    exit 1
  fi
  echo "   export_hf of $(basename "$ckpt"): exit 0"
  # A fresh output directory: the checkpoint named by path; the schedule now ends at step + 2.
  mpi_train "$np" "$work/$what.resume.log" run.output_dir="$work/$what.resumed" checkpoint.resume="$ckpt" \
    checkpoint.every=0 training.max_steps=$((step + 2)) checkpoint.allow_schedule_change=true || code=$?
  if [ "$code" -ne 0 ]; then
    tail -n 40 "$work/$what.resume.log"
    echo "FAIL: $what: resuming $ckpt with $np rank(s) exited with code $code"
    exit 1
  fi
  grep -q "resumed from .*$(basename "$ckpt") at step $step" "$work/$what.resume.log" ||
    { tail -n 40 "$work/$what.resume.log"; echo "FAIL: $what: the resumed run does not say it resumed from step $step"; exit 1; }
  [ -f "$work/$what.resumed/checkpoints/step_$(printf %08d $((step + 2)))/DONE" ] ||
    { tail -n 40 "$work/$what.resume.log"; echo "FAIL: $what: the resumed run saved no checkpoint at step $((step + 2))"; exit 1; }
  echo "   resumed from step $step with $np rank(s) and trained to step $((step + 2)): exit 0"
}

# (a) A rank that hangs before the gradient synchronisation.
echo "== (a) rank 1 hangs at step 5, parallel.timeout_s=3"
hang="$work/hang"
export LLMTRAIN_TEST_HANG=1:5
start=$(now)
code=0
timeout -k 10 120 "$mpirun" --allow-run-as-root --oversubscribe -x LLMTRAIN_TEST_HANG -np 2 \
  "$trainer_bin" "$config" "${mpi_common[@]}" run.output_dir="$hang" training.max_steps=200 checkpoint.every=2 \
  checkpoint.resume=never parallel.timeout_s=3 > "$work/hang.log" 2>&1 || code=$?
elapsed=$(since "$start")
unset LLMTRAIN_TEST_HANG
mpi_kill_leftovers
echo "   mpirun exited with code $code after $elapsed s"
if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
  tail -n 40 "$work/hang.log"
  echo "FAIL: (a) the job hung: still running after 120 s (killed by timeout, exit code $code)"
  exit 1
fi
[ "$code" -ne 0 ] || { tail -n 40 "$work/hang.log"; echo "FAIL: (a) the job exited 0 although rank 1 hung at step 5"; exit 1; }
awk -v e="$elapsed" 'BEGIN { exit !(e <= 60) }' ||
  { tail -n 40 "$work/hang.log"; echo "FAIL: (a) the job took $elapsed s to fail, expected at most 60 s"; exit 1; }
message=$(grep -m1 "did not finish within" "$work/hang.log" || true)
[ -n "$message" ] || { tail -n 40 "$work/hang.log"; echo "FAIL: (a) no 'did not finish within' in the job's output"; exit 1; }
echo "$message" | grep -qE "rank [0-9]+: " ||
  { tail -n 40 "$work/hang.log"; echo "FAIL: (a) the timeout message names no rank ('rank <r>: '): $message"; exit 1; }
echo "   watchdog: $message"
newest=$(mpi_newest_checkpoint "$hang")
[ "$newest" = "$hang/checkpoints/step_00000004" ] ||
  { ls -la "$hang/checkpoints" 2> /dev/null || true; echo "FAIL: (a) the newest complete checkpoint is '${newest:-none}', expected step_00000004"; exit 1; }
check_checkpoint "$newest" 1 hang

# (b) kill -9 of one rank in the middle of a run.
echo "== (b) kill -9 of rank 1, parallel.timeout_s=10"
kill9="$work/kill9"
limit=10
start=$(now)
timeout -k 10 600 "$mpirun" --allow-run-as-root --oversubscribe -np 2 \
  "$trainer_bin" "$config" "${mpi_common[@]}" run.output_dir="$kill9" training.max_steps=100000 checkpoint.every=2 \
  checkpoint.resume=never parallel.timeout_s=$limit > "$work/kill9.log" 2>&1 &
job=$!
# Wait (at most 180 s: start-up and the first step's allowance) for a complete checkpoint.
first=""
for _ in $(seq 1800); do
  first=$(mpi_newest_checkpoint "$kill9")
  [ -n "$first" ] && break
  kill -0 "$job" 2> /dev/null || break
  sleep 0.1
done
if [ -z "$first" ]; then
  tail -n 40 "$work/kill9.log"
  echo "FAIL: (b) no complete checkpoint after $(since "$start") s$(kill -0 "$job" 2> /dev/null || echo ' (the job has exited)')"
  exit 1
fi
echo "   first complete checkpoint $(basename "$first") after $(since "$start") s"
victim=$(rank_pid "$kill9" 1)
if [ -z "$victim" ]; then
  ps -o pid,ppid,args -p "$(job_pids "$kill9" | paste -sd, -)" 2> /dev/null || true
  echo "FAIL: (b) no trainer process with OMPI_COMM_WORLD_RANK=1 among the job's processes"
  exit 1
fi
kill -9 "$victim"
killed=$(now)
echo "   kill -9 $victim (rank 1)"
while kill -0 "$job" 2> /dev/null; do
  if awk -v e="$(since "$killed")" -v l=$((limit + 30)) 'BEGIN { exit !(e > l) }'; then
    tail -n 40 "$work/kill9.log"
    echo "FAIL: (b) mpirun still running $((limit + 30)) s after rank 1 was killed"
    exit 1
  fi
  sleep 0.2
done
code=0
wait "$job" || code=$?
echo "   mpirun exited with code $code $(since "$killed") s after the kill"
[ "$code" -ne 0 ] || { tail -n 40 "$work/kill9.log"; echo "FAIL: (b) mpirun exited 0 although rank 1 was killed"; exit 1; }
[ "$code" -ne 124 ] || { tail -n 40 "$work/kill9.log"; echo "FAIL: (b) the job ran into its 600 s timeout"; exit 1; }
left=""
for _ in $(seq 50); do
  left=$(job_pids "$kill9")
  [ -z "$left" ] && break
  sleep 0.2
done
if [ -n "$left" ]; then
  ps -o pid,ppid,args -p "$(echo "$left" | paste -sd, -)" || true
  echo "FAIL: (b) processes of the job are still running 10 s after mpirun exited"
  exit 1
fi
echo "   no process of the job left"
newest=$(mpi_newest_checkpoint "$kill9")
[ -n "$newest" ] || { echo "FAIL: (b) no complete checkpoint left after the kill"; exit 1; }
echo "   newest complete checkpoint $(basename "$newest")$(compgen -G "$kill9/checkpoints/*.tmp" > /dev/null && echo ' (an incomplete one was left beside it)')"
check_checkpoint "$newest" 2 kill9

# (c) SIGUSR1 to one rank only: every rank stops after the same step, the job saves a complete
# checkpoint of that step together and exits 0.
echo "== (c) SIGUSR1 to rank 1 only"
usr1="$work/usr1"
start=$(now)
timeout -k 10 600 "$mpirun" --allow-run-as-root --oversubscribe -np 2 \
  "$trainer_bin" "$config" "${mpi_common[@]}" run.output_dir="$usr1" training.max_steps=100000 checkpoint.every=0 \
  checkpoint.resume=never > "$work/usr1.log" 2>&1 &
job=$!
for _ in $(seq 1800); do
  [ -f "$usr1/metrics.jsonl" ] && [ "$(mpi_losses "$usr1/metrics.jsonl" | wc -l)" -ge 3 ] && break
  kill -0 "$job" 2> /dev/null || break
  sleep 0.1
done
victim=$(rank_pid "$usr1" 1)
[ -n "$victim" ] || { tail -n 40 "$work/usr1.log"; echo "FAIL: (c) no trainer process of rank 1"; exit 1; }
kill -USR1 "$victim"
code=0
wait "$job" || code=$?
[ "$code" -eq 0 ] || { tail -n 40 "$work/usr1.log"; echo "FAIL: (c) the job exited with code $code after SIGUSR1, expected 0"; exit 1; }
last=$(mpi_losses "$usr1/metrics.jsonl" | tail -1 | cut -d' ' -f1)
newest=$(mpi_newest_checkpoint "$usr1")
[ "$newest" = "$(printf '%s/checkpoints/step_%08d' "$usr1" "$last")" ] ||
  { tail -n 40 "$work/usr1.log"; echo "FAIL: (c) newest checkpoint '${newest:-none}', expected the last logged step $last"; exit 1; }
grep -q "stopped after step $last with a checkpoint (another rank was signalled)" "$work/usr1.log" ||
  { tail -n 40 "$work/usr1.log"; echo "FAIL: (c) rank 0 does not say it stopped after step $last for another rank's signal"; exit 1; }
echo "   both ranks stopped after step $last and saved it ($(since "$start") s)"
echo "mpi faults passed"
