#!/usr/bin/env bash
# Muon against AdamW at equal steps on the quickstart model and data (byte-level Qwen3, King James
# Bible), each over a short learning-rate sweep, validation loss logged along the way. Records each
# run in bench/results/muon_quality.jsonl and draws the validation curves into one PNG in docs/.
#   cpu (default): configs/quickstart-cpu.yaml, 200 steps, validation every 25; AdamW at lr 1e-3,
#       3e-3 and 1e-2; Muon at muon.lr 0.01, 0.02 and 0.05 with AdamW's 3e-3 for the embedding
#       and norms -> docs/muon_vs_adamw.png
#   gpu: configs/quickstart.yaml (the GPU quickstart), its 1,250 steps, validation every 125;
#       AdamW at lr 1e-3, 2e-3 (the config's) and 4e-3; Muon at muon.lr 0.01 to 0.32 (doubling) with
#       AdamW's 2e-3 for the rest; the nine runs share the GPU -> docs/muon_vs_adamw_gpu.png
# usage: bench/muon_quality.sh [cpu|gpu]   (after building; DATA_DIR and OUT_DIR override runs/data
# and runs/muon_quality[-gpu]; RECORD=0 trains only)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-cpu}
case "$mode" in
  cpu)
    config=configs/quickstart-cpu.yaml steps=200 every=25 adamw_lrs="1.0e-3 3.0e-3 1.0e-2"
    muon_lrs="0.01 0.02 0.05" rest_lr=3.0e-3 title="quickstart-cpu, 200 steps" png=docs/muon_vs_adamw.png
    device=cpu out=${OUT_DIR:-runs/muon_quality}
    ;;
  gpu)
    config=configs/quickstart.yaml steps=1250 every=125 adamw_lrs="1.0e-3 2.0e-3 4.0e-3"
    muon_lrs="0.01 0.02 0.04 0.08 0.16 0.32" rest_lr=2.0e-3 title="quickstart (GPU), 1250 steps" png=docs/muon_vs_adamw_gpu.png
    device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) out=${OUT_DIR:-runs/muon_quality-gpu}
    ;;
  *)
    echo "usage: bench/muon_quality.sh [cpu|gpu]" >&2
    exit 2
    ;;
esac
data=${DATA_DIR:-runs/data}
mkdir -p "$data" "$out"
# shellcheck source=bench/kjv_data.sh
source bench/kjv_data.sh
kjv_shards "$data"
common=(data.train="$data/kjv_train.bin" data.val="$data/kjv_val.bin" training.max_steps=$steps eval.every=$every
        eval.batches=8 "eval.tasks=[]" logging.every=$every sample.tokens=1 sample.every=0)
[ "$mode" = cpu ] && common+=(schedule.warmup_steps=20)
runs=()
pids=()
train() {  # NAME OVERRIDES...
  local name=$1
  shift
  runs+=("$name=$out/$name/metrics.jsonl")
  if [ "$mode" = gpu ]; then  # concurrently: the small models share the GPU
    build/trainer "$config" "${common[@]}" run.output_dir="$out/$name" "$@" > "$out/$name.log" 2>&1 &
    pids+=("$!")
  else
    build/trainer "$config" "${common[@]}" run.output_dir="$out/$name" "$@" > "$out/$name.log" 2>&1 ||
      { tail -n 20 "$out/$name.log"; echo "FAIL: $name"; exit 1; }
  fi
}
for lr in $adamw_lrs; do train "adamw-lr$lr" optimizer.lr=$lr; done
for lr in $muon_lrs; do train "muon-lr$lr" optimizer.type=muon optimizer.lr=$rest_lr "optimizer.muon={lr: $lr}"; done
for pid in "${pids[@]}"; do
  wait "$pid" || { echo "FAIL: a training run (logs in $out)"; exit 1; }
done
[ "${RECORD:-1}" = 0 ] && exit 0
python3 bench/e29a_train_record.py --bench muon_quality --output bench/results/muon_quality.jsonl \
  --title "$title" --device "$device" --commit "$(git rev-parse --short HEAD)" --png "$png" "${runs[@]}"
