#!/usr/bin/env bash
# Muon against AdamW at equal steps on the CPU quickstart (configs/quickstart-cpu.yaml: byte-level
# Qwen3, King James Bible), 200 steps, validation every 25: AdamW at lr 1e-3, 3e-3 and 1e-2; Muon at
# muon.lr 0.01, 0.02 and 0.05 with AdamW's 3e-3 for the embedding and norms. Records each run in
# bench/results/muon_quality.jsonl and draws the validation curves into docs/muon_vs_adamw.png.
# usage: bench/muon_quality.sh   (after building; DATA_DIR and OUT_DIR override runs/data and
# runs/muon_quality)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA_DIR:-runs/data}
out=${OUT_DIR:-runs/muon_quality}
mkdir -p "$data" "$out"
if [ ! -f "$data/kjv_train.bin" ] || [ ! -f "$data/kjv_val.bin" ]; then
  gunzip -c data/kjv.txt.gz > "$data/kjv.txt"
  build/tools/make_shards "$data/kjv.txt" --tokenizer byte --val-fraction 0.05 \
    --train-out "$data/kjv_train.bin" --val-out "$data/kjv_val.bin"
fi
common=(data.train="$data/kjv_train.bin" data.val="$data/kjv_val.bin" training.max_steps=200 eval.every=25
        eval.batches=8 "eval.tasks=[]" logging.every=25 sample.tokens=1 schedule.warmup_steps=20)
runs=()
train() {  # NAME OVERRIDES...
  local name=$1
  shift
  build/trainer configs/quickstart-cpu.yaml "${common[@]}" run.output_dir="$out/$name" "$@" > "$out/$name.log" 2>&1 ||
    { tail -n 20 "$out/$name.log"; echo "FAIL: $name"; exit 1; }
  runs+=("$name=$out/$name/metrics.jsonl")
}
for lr in 1.0e-3 3.0e-3 1.0e-2; do train "adamw-lr$lr" optimizer.lr=$lr; done
for lr in 0.01 0.02 0.05; do train "muon-lr$lr" optimizer.type=muon optimizer.lr=3.0e-3 "optimizer.muon={lr: $lr}"; done
python3 bench/e29a_train_record.py --bench muon_quality --output bench/results/muon_quality.jsonl \
  --title "quickstart-cpu, 200 steps" --device cpu --commit "$(git rev-parse --short HEAD)" \
  --png docs/muon_vs_adamw.png "${runs[@]}"
