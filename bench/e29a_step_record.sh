#!/usr/bin/env bash
# The whole-model train step of E29a's two upstream settings (configs/e29a-d1024-l8-n8.yaml and
# configs/e29a-d1024-l6-n16.yaml: byte level, D 1024, batch 64 x T 512) on one GPU: a short run of
# each through build/trainer (60 steps, warm-up 10, logging every 10, no evaluation, checkpoint or
# sample), and from its metrics the median tokens/s and MFU of the logged intervals after the first
# and the largest device memory in use. One line per config in OUT.jsonl.
# usage: bench/e29a_step_record.sh [OUT.jsonl]   (default bench/results/e29a_step.jsonl; after
# building; DATA_DIR overrides runs/data, STEPS the 60)
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-bench/results/e29a_step.jsonl}
data=${DATA_DIR:-runs/data} out=runs/e29a_step steps=${STEPS:-60}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
mkdir -p "$data" "$out"
# shellcheck source=bench/kjv_data.sh
source bench/kjv_data.sh
kjv_shards "$data"
for config in configs/e29a-d1024-l8-n8.yaml configs/e29a-d1024-l6-n16.yaml; do
  name=$(basename "$config" .yaml)
  rm -rf "${out:?}/$name"
  build/trainer "$config" data.train="$data/kjv_train.bin" data.val="$data/kjv_val.bin" training.max_steps="$steps" \
    schedule.warmup_steps=10 logging.every=10 eval.every=0 checkpoint.every=0 checkpoint.resume=never sample.every=0 sample.tokens=1 \
    run.output_dir="$out/$name" > "$out/$name.log" 2>&1 || { tail -n 20 "$out/$name.log"; exit 1; }
  python3 - "$out/$name/metrics.jsonl" "$config" "$device" "$commit" "$steps" >> "$results" <<'PY'
import datetime, json, statistics, sys
path, config, device, commit, steps = sys.argv[1:]
logs = [r for r in map(json.loads, open(path)) if r.get("tokens_per_s") is not None]
later = logs[1:] or logs  # the first interval carries the start-up
print(json.dumps({
    "bench": "e29a_train_step_" + config.split("/")[-1].removesuffix(".yaml"),
    "device": device, "commit": commit, "date": datetime.date.today().isoformat(), "config": config,
    "steps": int(steps), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
    "mfu": statistics.median(r["mfu"] for r in later),
    "memory_gib": max(r["memory_gib"] for r in logs),
    "loss_at_end": logs[-1]["loss"]}))
PY
  tail -n 1 "$results"
done
