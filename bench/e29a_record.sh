#!/usr/bin/env bash
# One E29a layer forward + backward at upstream's shapes (D 1024, T 512; B 64 N 8 and B 16 N 16):
# bench/e29a_bench (ours) and bench/peer_e29a.py (PyTorch autograd, bf16: eager, torch.compile, each also in CUDA graphs)
# in the same run on the same GPU, joined by bench/record.py into one line each of OUT.jsonl.
# usage: bench/e29a_record.sh [OUT.jsonl]   (default bench/results/e29a.jsonl; needs build/bench/e29a_bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/e29a.jsonl}
log=${LOG:-/dev/stderr}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
compile=${PEER_COMPILE:---compile --graph}
status=0
tmp=$(mktemp -d)
for shape in 64:8 16:16; do
  IFS=: read -r batch slots <<< "$shape"
  if ! build/bench/e29a_bench --batch "$batch" --slots "$slots" > "$tmp/ours.json" 2>> "$log"; then
    echo "e29a_record: e29a_bench B $batch N $slots failed" >&2
    status=1
    continue
  fi
  if ! python3 bench/peer_e29a.py --batch "$batch" --slots "$slots" $compile > "$tmp/peer.json" 2>> "$log"; then
    echo "e29a_record: peer_e29a.py B $batch N $slots failed" >&2
    status=1
    continue
  fi
  python3 bench/record.py "$tmp/ours.json" "$tmp/peer.json" "$out" --commit "$commit" || status=1
done
rm -rf "$tmp"
exit $status
