#!/usr/bin/env bash
# Checkpoints resume on another world size and ZeRO stage: for each (N ranks -> M ranks, optimizer,
# ZeRO stage before -> after) of
#   2 -> 1 adamw ZeRO-1,  1 -> 3 adafactor ZeRO-2,  3 -> 2 adamw8bit ZeRO-1,
#   3 -> 2 adamw ZeRO-3,  2 -> 3 adafactor ZeRO-1 -> 3,  3 -> 2 adamw8bit ZeRO-3 -> 2,
#   2 -> 3 muon ZeRO-1 -> 3
# (each optimizer's state resharded, into and out of ZeRO-3) a run of configs/ci-tiny.yaml with N ranks saves
# checkpoints at steps 4 and 8 of an 8-step schedule; the step-8 checkpoint is deleted and a run
# with M ranks and checkpoint.resume=auto continues from step 4 to 8. Its losses at steps 5..8 must
# match the N-rank run's own (as it would have continued) within MPI_REL_TOL (1e-5) relative and
# an uninterrupted one-rank run within MPI_RESHARD_ONE_RANK_TOL (default: the same), and its log
# must say it resumed from step 4. (The N-rank run's own losses are checked against the one-rank
# reference too, so a parity failure is told apart from a resharding one.)
# usage: run_mpi_reshard.sh BUILD_DIR SOURCE_DIR
# Environment: MPI_RUN_TIMEOUT (seconds per run, default 300), MPI_KEEP_WORK (keep the temporary
# directory), MPI_RESHARD_ONE_RANK_TOL.
set -euo pipefail
build=$1
source=$2
steps=8
resume_step=4
work=$(mktemp -d)
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup
one_rank_tol=${MPI_RESHARD_ONE_RANK_TOL:-$MPI_REL_TOL}

# from to optimizer zero_stage [zero_stage of the resumed run]
cases=("2 1 adamw 1" "1 3 adafactor 2" "3 2 adamw8bit 1" "3 2 adamw 3" "2 3 adafactor 1 3" "3 2 adamw8bit 3 2"
  "2 3 muon 1 3")
failures=()
for spec in "${cases[@]}"; do
  read -r from to opt stage resumed_stage <<< "$spec"
  resumed_stage=${resumed_stage:-$stage}
  name="$opt ZeRO-$stage $from -> ZeRO-$resumed_stage $to ranks"
  args=(optimizer.type="$opt" training.max_steps="$steps" checkpoint.keep_last=0)
  [ "$opt" = adafactor ] && args+=(optimizer.lr=1e-2)
  [ "$opt" = muon ] && args+=("optimizer.muon={lr: 0.02}")
  echo "== $name"

  # The reference: one rank, uninterrupted.
  tag="$opt.$from-$to.zero$stage-$resumed_stage"
  ref="$work/$tag.ref"
  code=0
  mpi_train 1 "$ref.log" run.output_dir="$ref" checkpoint.every=0 checkpoint.resume=never parallel.zero_stage="$stage" \
    "${args[@]}" || code=$?
  if [ "$code" -ne 0 ]; then
    tail -n 40 "$ref.log"
    echo "FAIL: $name: the one-rank reference run exited with code $code"
    exit 1
  fi
  mpi_losses "$ref/metrics.jsonl" > "$ref.losses"

  # N ranks, checkpoints at steps 4 and 8; the one of step 8 is then removed.
  run="$work/$tag.run"
  code=0
  mpi_train "$from" "$run.first.log" run.output_dir="$run" checkpoint.every=$resume_step checkpoint.resume=never \
    parallel.zero_stage="$stage" "${args[@]}" || code=$?
  if [ "$code" -ne 0 ]; then
    tail -n 40 "$run.first.log"
    failures+=("$name: the $from-rank run exited with code $code")
    echo "   FAIL: the $from-rank run exited with code $code"
    continue
  fi
  mpi_losses "$run/metrics.jsonl" > "$run.first.losses"
  if worst=$(MPI_REL_TOL=$one_rank_tol mpi_compare "$ref.losses" "$run.first.losses" 1 $steps); then
    echo "   $from-rank run, steps 1..$steps: max relative loss difference to the reference $worst"
  else
    echo "   FAIL: $from-rank run, steps 1..$steps: max relative loss difference to the reference $worst"
    failures+=("$name: the $from-rank run differs from the reference (max relative difference $worst)")
  fi
  saved="$run/checkpoints/step_$(printf %08d $resume_step)"
  last="$run/checkpoints/step_$(printf %08d $steps)"
  if [ ! -f "$saved/DONE" ]; then
    ls -la "$run/checkpoints" 2> /dev/null || true
    failures+=("$name: the $from-rank run left no complete checkpoint $saved")
    echo "   FAIL: no complete checkpoint at step $resume_step"
    continue
  fi
  rm -rf "$last"
  mv "$run/metrics.jsonl" "$run/metrics.first.jsonl"

  # M ranks resume from step 4.
  code=0
  mpi_train "$to" "$run.resumed.log" run.output_dir="$run" checkpoint.every=$resume_step checkpoint.resume=auto \
    parallel.zero_stage="$resumed_stage" "${args[@]}" || code=$?
  if [ "$code" -ne 0 ]; then
    tail -n 40 "$run.resumed.log"
    failures+=("$name: the $to-rank resumed run exited with code $code")
    echo "   FAIL: the $to-rank resumed run exited with code $code"
    continue
  fi
  if ! grep -q "resumed from .*step_$(printf %08d $resume_step) at step $resume_step" "$run.resumed.log"; then
    tail -n 40 "$run.resumed.log"
    failures+=("$name: the $to-rank run's log does not say it resumed from step $resume_step")
    echo "   FAIL: the log does not say 'resumed from ...step_$(printf %08d $resume_step) at step $resume_step'"
    continue
  fi
  mpi_losses "$run/metrics.jsonl" > "$run.resumed.losses"
  early=$(awk -v s=$resume_step '$1 <= s' "$run.resumed.losses" | wc -l)
  if [ "$early" -ne 0 ]; then
    failures+=("$name: the resumed run logged $early steps at or before step $resume_step")
    echo "   FAIL: the resumed run logged steps at or before step $resume_step"
  fi
  # As it would have continued: the N-rank run's own steps 5..8 (tolerance MPI_REL_TOL), and the
  # one-rank reference (tolerance MPI_RESHARD_ONE_RANK_TOL).
  if worst=$(mpi_compare "$run.first.losses" "$run.resumed.losses" $((resume_step + 1)) $steps); then
    echo "   resumed on $to ranks from step $resume_step, steps $((resume_step + 1))..$steps: max relative loss difference to the uninterrupted $from-rank run $worst"
  else
    echo "   FAIL: resumed on $to ranks, steps $((resume_step + 1))..$steps: max relative loss difference to the uninterrupted $from-rank run $worst"
    failures+=("$name: resumed losses differ from the uninterrupted $from-rank run (max relative difference $worst)")
  fi
  if worst=$(MPI_REL_TOL=$one_rank_tol mpi_compare "$ref.losses" "$run.resumed.losses" $((resume_step + 1)) $steps); then
    echo "   resumed on $to ranks, steps $((resume_step + 1))..$steps: max relative loss difference to the one-rank run $worst"
  else
    echo "   FAIL: resumed on $to ranks, steps $((resume_step + 1))..$steps: max relative loss difference to the one-rank run $worst"
    failures+=("$name: resumed losses differ from the one-rank reference (max relative difference $worst)")
  fi
  [ -f "$last/DONE" ] || {
    failures+=("$name: the resumed run did not save its final checkpoint")
    echo "   FAIL: no complete checkpoint at step $steps after the resumed run"
  }
done
if [ ${#failures[@]} -gt 0 ]; then
  for f in "${failures[@]}"; do echo "FAIL: $f"; done
  exit 1
fi
echo "mpi reshard passed (${cases[*]})"
