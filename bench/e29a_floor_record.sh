#!/usr/bin/env bash
# The E29a recurrence against its hand-off floor on one GPU, same run: bench/handoff_bench with
# the state's sizes (B x D fp32: 16384 and 65536) gives the floor of one hand-off (every block reads
# the whole state from L2, writes its slice, synchronises; method f32), four a step (two each
# direction) over T 512 steps; bench/e29a_bench (three runs a shape, the median) times the
# recurrence alone (the persistent launches, without the products over all tokens). One line per
# shape in OUT.jsonl with both and their ratio.
# usage: bench/e29a_floor_record.sh [OUT.jsonl]   (default bench/results/e29a.jsonl; after building)
#        bench/e29a_floor_record.sh --from DIR OUT.jsonl   (records a run's saved outputs: DIR/handoff.txt,
#        DIR/bench.jsonl as this script writes them)
set -euo pipefail
cd "$(dirname "$0")/.."
from=""
if [ "${1:-}" = "--from" ]; then
  from=$2
  shift 2
fi
out=${1:-bench/results/e29a.jsonl}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
dir=$from
if [ -z "$dir" ]; then
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  build/bench/handoff_bench 2000 16384 65536 > "$dir/handoff.txt"
  for shape in 64:8 16:16; do
    IFS=: read -r batch slots <<< "$shape"
    for _ in 1 2 3; do build/bench/e29a_bench --batch "$batch" --slots "$slots" >> "$dir/bench.jsonl"; done
  done
fi
python3 - "$dir/handoff.txt" "$dir/bench.jsonl" "$commit" >> "$out" <<'PY'
import datetime, json, statistics, sys
handoff, bench, commit = sys.argv[1:]
lines = open(handoff).read().splitlines()
sizes = [int(v) for v in next(l for l in lines if l.startswith("n ")).split()[1:]]
f32 = [float(v) for v in next(l for l in lines if l.startswith("f32 ")).split()[1:]]
per_round = dict(zip(sizes, f32))
runs = [json.loads(l) for l in open(bench)]
for batch in sorted({r["batch"] for r in runs}, reverse=True):
    mine = [r for r in runs if r["batch"] == batch]
    r0 = mine[0]
    state = r0["batch"] * r0["dim"]
    floor_ms = 4 * per_round[state] * r0["steps"] / 1000
    rec = statistics.median(r["recurrence_ms"] for r in mine)
    layer = statistics.median(r["ours_ms"] for r in mine)
    print(json.dumps({
        "bench": "e29a_recurrence_floor_d%d_t%d_b%d_n%d" % (r0["dim"], r0["steps"], r0["batch"], r0["slots"]),
        "device": r0["device"], "commit": commit, "date": datetime.date.today().isoformat(),
        "recurrence_ms": round(rec, 4),
        "recurrence_fwd_ms": round(statistics.median(r["recurrence_fwd_ms"] for r in mine), 4),
        "recurrence_bwd_ms": round(statistics.median(r["recurrence_bwd_ms"] for r in mine), 4),
        "layer_ms": round(layer, 4), "handoff_us": per_round[state], "floor_ms": round(floor_ms, 4),
        "recurrence_over_floor": round(rec / floor_ms, 3), "layer_over_floor": round(layer / floor_ms, 3),
        "runs": len(mine), "forward": r0["forward"], "backward": r0["backward"],
        "cluster_forward": r0["cluster_forward"], "cluster_backward": r0["cluster_backward"],
        "batch_parts_forward": r0["batch_parts_forward"], "batch_parts_backward": r0["batch_parts_backward"]}))
PY
