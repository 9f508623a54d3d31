#!/usr/bin/env bash
# A/B of the Qwen3 training step on one GPU: this tree against another source tree of the project
# (made beforehand with `git worktree add DIR REV` inside an ignored folder that travels with the
# tree, since the GPU machine has no git), each built into its own folder (the base into
# build-ab-base, kept between calls), then `qwen3_train_bench` alternating base, this, base, ...
# so that clock and thermal drift reach both alike. Prints each pair and the medians; appends
# every run to $OUT/train_ab.jsonl with "side": "base" or "this".
# usage: bench/train_ab.sh BASE_SOURCE_DIR [RUNS] [qwen3_train_bench options...]
#        (RUNS pairs, default 3; options default to --batch 8 --seq 2048)
set -euo pipefail
cd "$(dirname "$0")/.."
base_src=${1:?usage: bench/train_ab.sh BASE_SOURCE_DIR [RUNS] [bench options...]}
runs=${2:-3}
shift $(($# >= 2 ? 2 : 1))
options=("$@")
[ ${#options[@]} -gt 0 ] || options=(--batch 8 --seq 2048)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -f "$base_src/bench/qwen3_train_bench.cpp" ] || { echo "train_ab: $base_src is not a source tree of this project"; exit 2; }
jobs=$(nproc)
build() {  # SOURCE BUILD_DIR
  { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build "$2" -j"$jobs" -- bench/qwen3_train_bench; } \
    > "$OUT/train_ab_build_$(basename "$2").log" 2>&1 || { tail -30 "$OUT/train_ab_build_$(basename "$2").log"; exit 1; }
}
build . build
build "$base_src" build-ab-base
for ((r = 1; r <= runs; ++r)); do
  for side in base this; do
    binary=build/bench/qwen3_train_bench
    [ "$side" = base ] && binary=build-ab-base/bench/qwen3_train_bench
    "$binary" "${options[@]}" 2>> "$OUT/train_ab.log" |
      python3 -c "import json, sys; r = json.load(sys.stdin); r['side'] = '$side'; r['pair'] = $r; print(json.dumps(r))" \
        >> "$OUT/train_ab.jsonl"
  done
done
python3 - "$OUT/train_ab.jsonl" "$runs" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][-2 * int(sys.argv[2]):]
for side in ("base", "this"):
    ms = [r["ours_ms"] for r in rows if r["side"] == side]
    print(f"{side}: step ms {' '.join(f'{m:.2f}' for m in ms)}, median {statistics.median(ms):.2f}; "
          f"memory {max(r['memory_gib'] for r in rows if r['side'] == side):.2f} GiB")
base = statistics.median(r["ours_ms"] for r in rows if r["side"] == "base")
this = statistics.median(r["ours_ms"] for r in rows if r["side"] == "this")
print(f"this / base: {this / base:.4f} ({(base - this) / base * 100:+.1f}% faster)")
PY
