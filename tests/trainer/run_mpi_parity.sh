#!/usr/bin/env bash
# Multi-rank parity on the CPU: for each optimizer, a reference run of configs/ci-tiny.yaml with
# one rank, then runs with 2 and 3 ranks under each parallel.zero_stage (0, 1, 2, 3). The global
# batch (6 sequences of 64 tokens) is the same at every world size, so every step's loss (the mean
# over all ranks, from rank 0's metrics.jsonl) must match the reference within 1e-5 relative.
# Under ZeRO-3 a rank's weight memory must be its shard (2 + 4 bytes an element: mirror and
# master) plus the two fp32 gather buffers of the largest layer, not the whole model (ci-tiny's
# numbers, worked out by hand below). ZeRO-3's samples, validation losses and task scores:
# run_mpi_zero3_decode.sh.
# usage: run_mpi_parity.sh BUILD_DIR SOURCE_DIR [OPTIMIZERS...]   (default: adamw adamw8bit adafactor muon)
# Environment: MPI_PARITY_WORLDS (default "2 3"), MPI_PARITY_FLOOR (a micro-batch size: also run
# the reference with it and report the difference, the reduction-order noise of the device),
# MPI_PARITY_STAGES (default "0 1 2 3"), MPI_PARITY_ONE_MICRO (a global batch G: the N-rank runs use
# micro-batches of G / N sequences, one per step, which is when ZeRO-2 on cuda shards the gradients),
# MPI_RUN_TIMEOUT (seconds per run, default 300),
# MPI_KEEP_WORK (keep the temporary directory).
set -euo pipefail
build=$1
source=$2
shift 2
optimizers=("$@")
[ ${#optimizers[@]} -gt 0 ] || optimizers=(adamw adamw8bit adafactor muon)
read -r -a worlds <<< "${MPI_PARITY_WORLDS:-2 3}"
read -r -a stages <<< "${MPI_PARITY_STAGES:-0 1 2 3}"
steps=6
work=$(mktemp -d)
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup

# ci-tiny's slab: embedding 256 x 64 = 16384 elements; a layer from input_norm to down spans
# 37120 (64, 8192 for qkv, q/k norms 32 each on 64-element alignment, 4096, 64, 16384, 8192);
# 2 layers and the final norm end at 90688, padded to a multiple of np x 256.
zero3_memory_check() {  # METRICS NP -> prints a failure reason, or nothing
  local block=$(( $2 * 256 ))
  local total=$(( (90688 + block - 1) / block * block ))
  local want_weights=$(( 6 * total / $2 )) want_gather=$(( 2 * 4 * 37120 ))
  local weights gather
  weights=$(grep -o '"weight_bytes":[0-9]*' "$1" | head -1 | cut -d: -f2)
  gather=$(grep -o '"gather_bytes":[0-9]*' "$1" | head -1 | cut -d: -f2)
  if [ "$weights" != "$want_weights" ] || [ "$gather" != "$want_gather" ]; then
    echo "ZeRO-3 weight memory $weights + gather buffers $gather bytes, expected $want_weights + $want_gather"
  fi
}

failures=()
printf '%-10s %3s %5s  %s\n' optimizer np stage "max relative loss difference (tolerance $MPI_REL_TOL)"
for opt in "${optimizers[@]}"; do
  case $opt in
    adamw | adamw8bit | adafactor | muon) ;;
    *) echo "FAIL: unknown optimizer '$opt' (expected adamw, adamw8bit, adafactor or muon)"; exit 1 ;;
  esac
  # ci-tiny sets lr 3e-3 and weight_decay 0. Adafactor needs no other keys (relative_step: its
  # step size is min(lr, 1/sqrt(t)) x rms(w)); lr 1e-2, Hugging Face's default, makes it move.
  # Muon's matrices take Keller Jordan's lr 0.02 (its matrices are assembled across the shards).
  args=(optimizer.type="$opt" training.max_steps="$steps" checkpoint.every=0 checkpoint.resume=never)
  [ "$opt" = adafactor ] && args+=(optimizer.lr=1e-2)
  [ "$opt" = muon ] && args+=("optimizer.muon={lr: 0.02}")
  ref="$work/$opt.ref"
  code=0
  mpi_train 1 "$ref.log" run.output_dir="$ref" "${args[@]}" || code=$?
  if [ "$code" -ne 0 ]; then
    cat "$ref.log"
    echo "FAIL: $opt reference run (np 1) exited with code $code$([ "$code" -eq 124 ] && echo ' (timed out)')"
    exit 1
  fi
  mpi_losses "$ref/metrics.jsonl" > "$ref.losses"
  [ "$(wc -l < "$ref.losses")" -eq "$steps" ] ||
    { cat "$ref/metrics.jsonl"; echo "FAIL: $opt reference run logged $(wc -l < "$ref.losses") losses, expected $steps"; exit 1; }
  printf '%-10s %3s %5s  %s\n' "$opt" 1 - "reference: losses $(awk '{ printf "%s%.4f", (NR > 1 ? " " : ""), $2 }' "$ref.losses")"
  if [ -n "${MPI_PARITY_FLOOR:-}" ]; then
    # The same single-rank run with another micro-batch size ($MPI_PARITY_FLOOR): the same
    # sequences, only the order of the gradient additions differs. Its distance from the
    # reference is the noise floor of reduction order on this device (reported, not checked).
    floor="$work/$opt.floor"
    mpi_train 1 "$floor.log" run.output_dir="$floor" "${args[@]}" training.micro_batch_size="$MPI_PARITY_FLOOR" ||
      { tail -n 20 "$floor.log"; echo "FAIL: $opt floor run"; exit 1; }
    mpi_losses "$floor/metrics.jsonl" > "$floor.losses"
    printf '%-10s %3s %5s  %s\n' "$opt" 1 - "micro-batch $MPI_PARITY_FLOOR instead (reduction order only): $(MPI_REL_TOL=1 mpi_compare "$ref.losses" "$floor.losses" 1 $steps)"
  fi
  for np in "${worlds[@]}"; do
    micro=()
    if [ -n "${MPI_PARITY_ONE_MICRO:-}" ]; then
      [ $((MPI_PARITY_ONE_MICRO % np)) -eq 0 ] || { echo "FAIL: MPI_PARITY_ONE_MICRO=$MPI_PARITY_ONE_MICRO is not a multiple of $np"; exit 1; }
      micro=(training.micro_batch_size=$((MPI_PARITY_ONE_MICRO / np)))
    fi
    for stage in "${stages[@]}"; do
      name="$opt np $np stage $stage"
      out="$work/$opt.np$np.zero$stage"
      code=0
      mpi_train "$np" "$out.log" run.output_dir="$out" parallel.zero_stage=$stage "${args[@]}" "${micro[@]}" || code=$?
      if [ "$code" -ne 0 ]; then
        tail -n 40 "$out.log"
        printf '%-10s %3s %5s  %s\n' "$opt" "$np" "$stage" "FAIL (exit code $code$([ "$code" -eq 124 ] && echo ', timed out'))"
        failures+=("$name: exit code $code")
        continue
      fi
      if [ ! -f "$out/metrics.jsonl" ]; then
        tail -n 40 "$out.log"
        printf '%-10s %3s %5s  %s\n' "$opt" "$np" "$stage" "FAIL (no metrics.jsonl)"
        failures+=("$name: no metrics.jsonl")
        continue
      fi
      mpi_losses "$out/metrics.jsonl" > "$out.losses"
      logged=$(wc -l < "$out.losses")
      worst=""
      if [ "$logged" -ne "$steps" ]; then
        # More lines than steps: more than one rank wrote metrics.jsonl.
        printf '%-10s %3s %5s  %s\n' "$opt" "$np" "$stage" "FAIL ($logged loss records, expected $steps)"
        failures+=("$name: $logged loss records in metrics.jsonl, expected $steps (rank 0 alone writes one per step)")
      elif worst=$(mpi_compare "$ref.losses" "$out.losses" 1 $steps); then
        printf '%-10s %3s %5s  %s\n' "$opt" "$np" "$stage" "$worst"
        if [ "$stage" = 3 ] && [ -z "${MPI_CONFIG:-}" ]; then
          memory=$(zero3_memory_check "$out/metrics.jsonl" "$np")
          if [ -n "$memory" ]; then
            echo "FAIL: $memory"
            failures+=("$name: $memory")
          fi
        fi
      else
        printf '%-10s %3s %5s  %s\n' "$opt" "$np" "$stage" "$worst FAIL"
        failures+=("$name: max relative loss difference $worst > $MPI_REL_TOL")
      fi
    done
  done
done
if [ ${#failures[@]} -gt 0 ]; then
  for f in "${failures[@]}"; do echo "FAIL: $f"; done
  exit 1
fi
echo "mpi parity passed (${optimizers[*]}; world sizes 1 ${worlds[*]}; ZeRO stages ${stages[*]}${MPI_PARITY_ONE_MICRO:+; one micro-batch per step})"
