#!/usr/bin/env bash
# Data-parallel scaling of the trainer on one host (configs/scaling.yaml: 8 x 2048 tokens per GPU
# per step). Each case is PRESET:GPUS:ZERO_STAGE[:OPTIMIZER]; every case runs `trainer` under
# mpirun and appends its measured figures (median tokens/s over steps 4.., memory, slab terms) to
# $OUT/scaling_raw.jsonl, with the per-GPU peak nvidia-smi saw during the run (sampled every 50 ms,
# the largest over the run's GPUs: everything the process holds, CUDA context and libraries
# included) beside the total of `trainer --plan` for the same case; bench/record_scaling.py turns
# them into bench/results/scaling.jsonl records. $SCALING_EXTRA: overrides for every run and plan
# (e.g. "model.recompute=full training.max_steps=5" for the fit checks of larger models). A case
# the trainer refuses (its plan does not fit) is reported with the refusal.
# usage: bench/scaling.sh CASE...      (needs runs/data/kjv_train.bin, see launch/quickstart.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
mpi_flags=(--oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && mpi_flags+=(--allow-run-as-root)
status=0
for case in "$@"; do
  IFS=: read -r preset gpus stage optimizer <<< "$case"
  optimizer=${optimizer:-adamw}
  run=runs/scaling/$preset-g$gpus-z$stage-$optimizer
  rm -rf "$run"
  echo "== $case" >> "$OUT/scaling.log"
  read -r -a extra <<< "${SCALING_EXTRA:-}"
  overrides=(model.preset="$preset" parallel.zero_stage="$stage" optimizer.type="$optimizer" "${extra[@]}")
  plan_gib=$(build/trainer --plan configs/scaling.yaml "${overrides[@]}" --world "$gpus" 2>&1 | awk '$1 == "total" { print $3 }')
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 50 > "$OUT/smi.csv" 2> /dev/null &
  smi=$!
  code=0
  timeout 900 mpirun "${mpi_flags[@]}" -np "$gpus" build/trainer configs/scaling.yaml "${overrides[@]}" \
    run.output_dir="$run" > "$OUT/scaling_case.log" 2>&1 || code=$?
  cat "$OUT/scaling_case.log" >> "$OUT/scaling.log"
  kill "$smi" 2> /dev/null
  wait "$smi" 2> /dev/null
  # MiB -> GiB, the largest over the GPUs this run used (the first $gpus).
  peak_gib=$(awk -F', ' -v n="$gpus" '$1 < n && $2 > m { m = $2 } END { printf "%.2f", m / 1024 }' "$OUT/smi.csv")
  if [ "$code" -ne 0 ]; then
    refusal=$(grep -m1 -o "the memory plan needs.*" "$OUT/scaling_case.log" || true)
    echo "scaling: $case exited with $code (plan $plan_gib GiB, peak $peak_gib GiB) ${refusal:-(see scaling.log)}"
    echo "{\"preset\": \"$preset\", \"gpus\": $gpus, \"zero_stage\": $stage, \"optimizer\": \"$optimizer\", \"extra\": \"${SCALING_EXTRA:-}\", \"exit\": $code, \"plan_gib\": ${plan_gib:-null}, \"peak_gib\": $peak_gib}" >> "$OUT/scaling_failed.jsonl"
    status=1
    continue
  fi
  python3 - "$run/metrics.jsonl" "$preset" "$gpus" "$stage" "$optimizer" "${plan_gib:-nan}" "$peak_gib" "${SCALING_EXTRA:-}" \
    >> "$OUT/scaling_raw.jsonl" <<'PY'
import json, statistics, sys
path, preset, gpus, stage, optimizer, plan_gib, peak_gib, extra = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
memory = next(r["memory_per_rank"] for r in rows if "memory_per_rank" in r)
steps = [r for r in rows if "tokens_per_s" in r and r["step"] >= 4]
print(json.dumps({"preset": preset, "gpus": int(gpus), "zero_stage": int(stage), "optimizer": optimizer,
                  "tok_s": statistics.median(r["tokens_per_s"] for r in steps),
                  "mfu": statistics.median(r["mfu"] for r in steps),
                  "memory_gib": max(r["memory_gib"] for r in steps), **memory,
                  "final_loss": steps[-1]["loss"], "steps": len(steps),
                  "plan_gib": float(plan_gib), "peak_gib": float(peak_gib), "extra": extra}))
PY
  tail -1 "$OUT/scaling_raw.jsonl"
done
exit $status
