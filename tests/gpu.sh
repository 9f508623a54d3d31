#!/usr/bin/env bash
# Everything the GPU machine runs in one go: configure + build with all cores, the gpu (and cpu)
# tests, the fixture generators, and the benchmarks with their PyTorch peers.
# Logs and results go to $OUT (default ./gpu-out). Usage: tests/gpu.sh [build|test|fixtures|bench|quality]...
# (quality, not in the default list, trains on .carry/kjv.txt: a copy of the King James Bible text.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build fixtures test bench)
status=0

# Runs optimizer_bench for one optimizer and its PyTorch peer; appends the joined record.
bench_with_peer() {
  local type=$1 peer=$2 tmp
  tmp=$(mktemp -d)
  build/bench/optimizer_bench --optimizer "$type" > "$tmp/ours.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
  python3 "$peer" > "$tmp/peer.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
  cat "$tmp/ours.json" >> "$OUT/bench.log"
  python3 bench/record.py "$tmp/ours.json" "$tmp/peer.json" "$OUT/optimizers.jsonl" --commit "$COMMIT"
}

# Runs optimizer_bench for one optimizer and, in the same run, for our fp32 AdamW (its peer);
# appends the joined record.
bench_vs_adamw() {
  local type=$1 tmp
  tmp=$(mktemp -d)
  build/bench/optimizer_bench --optimizer adamw > "$tmp/adamw.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
  build/bench/optimizer_bench --optimizer "$type" > "$tmp/ours.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
  cat "$tmp/ours.json" >> "$OUT/bench.log"
  python3 bench/record_vs_adamw.py "$tmp/ours.json" "$tmp/adamw.json" "$OUT/optimizers.jsonl" --commit "$COMMIT"
}

run_step() {
  case "$1" in
    build)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
      { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build -j"$(nproc)" -- -k 0; } \
        > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; return 1; }
      ;;
    fixtures)
      python3 tests/fixtures/make_adamw_golden.py && cp tests/fixtures/adamw_golden.json "$OUT/" &&
        python3 tests/fixtures/make_adafactor_golden.py && cp tests/fixtures/adafactor_golden.json "$OUT/"
      ;;
    test)
      (cd build && ctest -L 'gpu|cpu' --output-on-failure --timeout 900) > "$OUT/ctest.log" 2>&1
      local rc=$?
      grep -E "tests passed|tests failed|Failed|SKIPPED|\*\*\*" "$OUT/ctest.log" | tail -20
      return $rc
      ;;
    bench)
      bench_vs_adamw adamw8bit || return 1
      bench_with_peer adamw bench/peer_adamw.py || return 1
      bench_with_peer adafactor bench/peer_adafactor.py || return 1
      ;;
    quality)
      [ -f .carry/kjv.txt ] || { echo "quality: .carry/kjv.txt is missing"; return 1; }
      build/bench/adamw8bit_quality --data .carry/kjv.txt --out "$OUT/optimizers.jsonl" --commit "$COMMIT" \
        2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
      ;;
    train)
      local tmp
      tmp=$(mktemp -d)
      # The peer at B = 8 (about 71 GiB; B = 16 does not fit an H200), ours at 8 and at larger batches.
      python3 bench/peer_qwen3_train.py --batch 8 --seq 2048 > "$tmp/peer.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
      cat "$tmp/peer.json" >> "$OUT/bench.log"
      for b in ${TRAIN_BATCHES:-8 16 32}; do
        build/bench/qwen3_train_bench --batch "$b" --seq 2048 > "$tmp/ours.json" 2>> "$OUT/bench.log" || { tail "$OUT/bench.log"; return 1; }
        cat "$tmp/ours.json" >> "$OUT/bench.log"
        python3 bench/record.py "$tmp/ours.json" "$tmp/peer.json" "$OUT/qwen3.jsonl" --commit "$COMMIT" --per-token
      done
      ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

for s in "${steps[@]}"; do
  echo "=== $s"
  start=$(date +%s)
  run_step "$s" || { echo "step $s FAILED"; status=1; }
  echo "=== $s took $(( $(date +%s) - start )) s"
done
exit $status
