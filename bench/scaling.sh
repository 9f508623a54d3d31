#!/usr/bin/env bash
# Data-parallel scaling of the trainer on one host (configs/scaling.yaml: 8 x 2048 tokens per GPU
# per step). Each case is PRESET:GPUS:ZERO_STAGE[:OPTIMIZER]; every case runs `trainer` under
# mpirun and appends its measured figures (median tokens/s over steps 4.., memory, slab terms) to
# $OUT/scaling_raw.jsonl; bench/record_scaling.py turns them into bench/results/scaling.jsonl records.
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
  if ! timeout 900 mpirun "${mpi_flags[@]}" -np "$gpus" build/trainer configs/scaling.yaml model.preset="$preset" \
      parallel.zero_stage="$stage" optimizer.type="$optimizer" run.output_dir="$run" >> "$OUT/scaling.log" 2>&1; then
    echo "scaling: $case failed (see scaling.log)"
    status=1
    continue
  fi
  python3 - "$run/metrics.jsonl" "$preset" "$gpus" "$stage" "$optimizer" >> "$OUT/scaling_raw.jsonl" <<'PY'
import json, statistics, sys
path, preset, gpus, stage, optimizer = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
memory = next(r["memory_per_rank"] for r in rows if "memory_per_rank" in r)
steps = [r for r in rows if "tokens_per_s" in r and r["step"] >= 4]
print(json.dumps({"preset": preset, "gpus": int(gpus), "zero_stage": int(stage), "optimizer": optimizer,
                  "tok_s": statistics.median(r["tokens_per_s"] for r in steps),
                  "mfu": statistics.median(r["mfu"] for r in steps),
                  "memory_gib": max(r["memory_gib"] for r in steps), **memory,
                  "final_loss": steps[-1]["loss"], "steps": len(steps)}))
PY
  tail -1 "$OUT/scaling_raw.jsonl"
done
exit $status
