#!/usr/bin/env bash
# A/B of one benchmark on one GPU: this tree against another source tree of the project (made
# beforehand with `git worktree add DIR REV` inside an ignored folder that travels with the tree,
# since the GPU machine has no git), each built into its own folder (the base into build-ab-base,
# kept between calls), then the benchmark alternating base, this, base, ... so that clock and
# thermal drift reach both alike. Prints each side's runs and medians (`ours_ms`, and `fwd_ms`,
# `bwd_ms`, `memory_gib` where the benchmark reports them); appends every run to $OUT/ab.jsonl
# with "side": "base" or "this".
# usage: bench/ab.sh BENCH BASE_SOURCE_DIR [RUNS] [bench options...]
#        BENCH: qwen3_train_bench (options default to --batch 8 --seq 2048) or e29a_bench (default:
#        its own shape); RUNS pairs, default 3
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench/ab.sh BENCH BASE_SOURCE_DIR [RUNS] [bench options...]"
bench=${1:?$usage}
base_src=${2:?$usage}
runs=${3:-3}
shift $(($# >= 3 ? 3 : 2))
options=("$@")
if [ ${#options[@]} -eq 0 ] && [ "$bench" = qwen3_train_bench ]; then options=(--batch 8 --seq 2048); fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
source_file=$(ls "bench/$bench".c* 2> /dev/null | head -n 1)
[ -n "$source_file" ] || { echo "ab: no benchmark bench/$bench.*"; exit 2; }
[ -f "$base_src/$source_file" ] || { echo "ab: $base_src is not a source tree of this project with $source_file"; exit 2; }
jobs=$(nproc)
build() {  # SOURCE BUILD_DIR
  { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build "$2" -j"$jobs" -- "bench/$bench"; } \
    > "$OUT/ab_build_$(basename "$2").log" 2>&1 || { tail -30 "$OUT/ab_build_$(basename "$2").log"; exit 1; }
}
build . build
build "$base_src" build-ab-base
for ((r = 1; r <= runs; ++r)); do
  for side in base this; do
    binary=build/bench/$bench
    [ "$side" = base ] && binary=build-ab-base/bench/$bench
    "$binary" "${options[@]}" 2>> "$OUT/ab.log" |
      python3 -c "import json, sys; r = json.load(sys.stdin); r['side'] = '$side'; r['pair'] = $r; print(json.dumps(r))" \
        >> "$OUT/ab.jsonl"
  done
done
python3 - "$OUT/ab.jsonl" "$runs" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][-2 * int(sys.argv[2]):]
keys = [k for k in ("ours_ms", "fwd_ms", "bwd_ms") if all(k in r for r in rows)]
for side in ("base", "this"):
    mine = [r for r in rows if r["side"] == side]
    parts = []
    for k in keys:
        v = [r[k] for r in mine]
        parts.append(f"{k} {' '.join(f'{x:.2f}' for x in v)}, median {statistics.median(v):.2f}")
    if all("memory_gib" in r for r in mine):
        parts.append(f"memory {max(r['memory_gib'] for r in mine):.2f} GiB")
    print(f"{side}: " + "; ".join(parts))
base = statistics.median(r["ours_ms"] for r in rows if r["side"] == "base")
this = statistics.median(r["ours_ms"] for r in rows if r["side"] == "this")
print(f"this / base: {this / base:.4f} ({(base - this) / base * 100:+.1f}% faster)")
PY
