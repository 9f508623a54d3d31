# shellcheck shell=bash disable=SC2154  # build, source and work come from the sourcing script
# Shared pieces of the multi-rank end-to-end tests (run_mpi_parity.sh, run_mpi_reshard.sh,
# run_mpi_faults.sh); sourced, not run. The sourcing script sets `build`, `source` and `work`
# (a fresh temporary directory) first and calls mpi_setup.
#   mpi_setup               finds mpirun, checks the binaries, makes byte shards of a corpus slice
#                           ($work/train.bin, $work/val.bin) and installs the cleanup trap
#   mpi_train NP LOG ARGS   build/trainer on configs/ci-tiny.yaml under mpirun -np NP with ARGS as
#                           overrides, bounded by $MPI_RUN_TIMEOUT seconds; stdout+stderr to LOG;
#                           returns the trainer's exit code (124: it ran out of time)
#   mpi_losses METRICS      "STEP LOSS" per training-loss record of a metrics.jsonl
#   mpi_compare REF RUN FIRST LAST
#                           prints the largest |a-b|/|b| over steps FIRST..LAST (b from REF); exit 1
#                           and a reason on stderr when a step is missing or |a-b| > 1e-5 |b|
#   mpi_newest_checkpoint RUN_DIR
#                           the newest complete checkpoint directory (step_NNNNNNNN with DONE), or nothing
#   mpi_kill_leftovers      kills, by pid, the processes whose command line names $work
# Only bash, coreutils, grep, sed and awk: CI has no Python packages.

# Environment: MPI_CONFIG (default configs/ci-tiny.yaml), MPI_EXTRA_ARGS (overrides applied after
# the common ones, e.g. "device=cuda training.global_batch_size=12" for the GPU machine),
# MPI_REL_TOL (default 1e-5), MPI_RUN_TIMEOUT (default 300).
MPI_RUN_TIMEOUT=${MPI_RUN_TIMEOUT:-300}
MPI_REL_TOL=${MPI_REL_TOL:-1e-5}

mpi_kill_leftovers() {
  local pids pid
  [ -n "${work:-}" ] || return 0
  pids=$(pgrep -f -- "$work/" 2> /dev/null || true)
  for pid in $pids; do
    [ "$pid" = "$$" ] && continue
    kill -9 "$pid" 2> /dev/null || true
  done
}

mpi_cleanup() {
  mpi_kill_leftovers
  if [ -n "${MPI_KEEP_WORK:-}" ]; then
    echo "kept $work (MPI_KEEP_WORK is set)"
  else
    rm -rf "$work"
  fi
}

mpi_setup() {
  trap mpi_cleanup EXIT
  # A command that stops the script under set -e says so instead of ending it silently.
  set -E
  trap '_mpi_rc=$?; echo "FAIL: $(basename "$0"): line $LINENO: \"$BASH_COMMAND\" exited with code $_mpi_rc" >&2' ERR
  trap 'exit 130' INT TERM
  # mpirun: the one CMake found for this build, else the one on PATH.
  mpirun=""
  if [ -f "$build/CMakeCache.txt" ]; then
    mpirun=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt" | head -1)
  fi
  if [ -z "$mpirun" ] || [ ! -x "$mpirun" ]; then mpirun=$(command -v mpirun || true); fi
  [ -n "$mpirun" ] || { echo "FAIL: no mpirun (neither MPIEXEC_EXECUTABLE in $build/CMakeCache.txt nor on PATH)"; exit 1; }
  trainer_bin="$build/trainer"
  [ -x "$trainer_bin" ] || { echo "FAIL: $trainer_bin is missing (build first)"; exit 1; }
  [ -x "$build/tools/make_shards" ] || { echo "FAIL: $build/tools/make_shards is missing"; exit 1; }
  [ -x "$build/tools/export_hf" ] || { echo "FAIL: $build/tools/export_hf is missing"; exit 1; }
  config="${MPI_CONFIG:-$source/configs/ci-tiny.yaml}"
  # A 400 kB slice of the corpus: about 5,900 windows of 64 tokens, plenty for these short runs.
  gunzip -c "$source/data/kjv.txt.gz" > "$work/full.txt"
  head -c 400000 "$work/full.txt" > "$work/kjv.txt"
  "$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
    --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null ||
    { echo "FAIL: make_shards"; exit 1; }
  # Small, fast and valid for world sizes 1, 2 and 3: 6 sequences per step (1 per micro-batch),
  # a short warm-up (warmup_steps must not exceed max_steps), no evaluation or samples during
  # the run, a one-token sample at the end.
  mpi_common=(data.train="$work/train.bin" data.val="$work/val.bin" training.micro_batch_size=1
              training.global_batch_size=6 schedule.warmup_steps=2 logging.every=1 eval.every=0 sample.every=0
              sample.tokens=1)
  local extra
  read -r -a extra <<< "${MPI_EXTRA_ARGS:-}"
  mpi_common+=("${extra[@]}")
}

mpi_train() {
  local np=$1 log=$2
  shift 2
  local code=0
  timeout -k 10 "$MPI_RUN_TIMEOUT" "$mpirun" --allow-run-as-root --oversubscribe -np "$np" \
    "$trainer_bin" "$config" "${mpi_common[@]}" "$@" > "$log" 2>&1 || code=$?
  # A run killed by the timeout may leave ranks behind; none may outlive it.
  if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then mpi_kill_leftovers; fi
  return "$code"
}

mpi_losses() {
  awk '{
    if (!match($0, /"step":[0-9]+/)) next
    step = substr($0, RSTART + 7, RLENGTH - 7)
    if (!match($0, /"loss":[-+0-9.eE]+/)) next
    print step, substr($0, RSTART + 7, RLENGTH - 7)
  }' "$1"
}

mpi_compare() {
  awk -v first="$3" -v last="$4" -v tol="$MPI_REL_TOL" '
    FILENAME == ARGV[1] { ref[$1] = $2; next }
    { run[$1] = $2 }
    END {
      worst = 0; bad = ""
      for (s = first; s <= last; ++s) {
        if (!(s in ref)) { bad = bad sprintf(" step %d: no reference loss;", s); continue }
        if (!(s in run)) { bad = bad sprintf(" step %d: no loss logged;", s); continue }
        a = run[s] + 0; b = ref[s] + 0
        d = a - b; if (d < 0) d = -d
        m = b; if (m < 0) m = -m
        rel = (m > 0) ? d / m : d
        if (rel > worst) worst = rel
        if (d > tol * m) bad = bad sprintf(" step %d: loss %s, reference %s (relative difference %.3e);", s, run[s], ref[s], rel)
      }
      printf "%.3e\n", worst
      if (bad != "") { print "    " bad > "/dev/stderr"; exit 1 }
    }' "$1" "$2"
}

mpi_newest_checkpoint() {
  local dir newest=""
  for dir in "$1"/checkpoints/step_*; do  # in step order: the names have 8 digits
    case $dir in *.tmp) continue ;; esac
    if [ -f "$dir/DONE" ]; then newest=$dir; fi
  done
  echo "$newest"
}
