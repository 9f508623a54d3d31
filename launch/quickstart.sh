#!/usr/bin/env bash
# Quickstart: installs what is missing, builds, turns the bundled King James Bible into byte-level
# token shards (a fixed 95/5 train/validation split), trains a small Qwen3 on it -- on the GPU
# when one is present, else a smaller CPU configuration -- prints a generated sample and plots
# the loss curve to runs/<name>/loss.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
export PATH="$PATH:/usr/local/cuda/bin"
cmake --preset release > /dev/null
cmake --build --preset release -j"$(nproc)"

mkdir -p runs/data
if [ ! -f runs/data/kjv_train.bin ] || [ ! -f runs/data/kjv_val.bin ]; then
  gunzip -c data/kjv.txt.gz > runs/data/kjv.txt
  build/tools/make_shards runs/data/kjv.txt --tokenizer byte --val-fraction 0.05 \
    --train-out runs/data/kjv_train.bin --val-out runs/data/kjv_val.bin
fi

if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
  config=configs/quickstart.yaml
else
  echo "No GPU found: training the smaller CPU configuration (configs/quickstart-cpu.yaml)."
  config=configs/quickstart-cpu.yaml
fi
name=$(basename "$config" .yaml)
rm -f "runs/$name/metrics.jsonl"
build/trainer "$config" "$@"
build/tools/plot_metrics "runs/$name/metrics.jsonl" -o "runs/$name/loss.png"
