#!/usr/bin/env bash
# Downstream evaluation speed on one GPU (bench/eval_bench: 200 generative items x 32 new tokens
# with the megakernel and the plain decoder, 200 four-way items of 100 tokens, and their share of
# a configs/qwen3-0.6b.yaml run evaluating every 500 steps), as one line of OUT.jsonl with the
# date and commit. No peer: lm-evaluation-harness runs outside the training loop.
# usage: bench/eval_record.sh [OUT.jsonl] [eval_bench options, e.g. --step-ms 6055]
#        (default bench/results/eval.jsonl; needs build/bench/eval_bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/eval.jsonl}
shift || true
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
if ! build/bench/eval_bench "$@" > "$tmp"; then
  echo "eval_record: eval_bench failed" >&2
  exit 1
fi
python3 - "$tmp" "$out" "$commit" <<'PY'
import datetime, json, sys
def rounded(v):
    if isinstance(v, float): return round(v, 4)
    if isinstance(v, dict): return {k: rounded(x) for k, x in v.items()}
    if isinstance(v, list): return [rounded(x) for x in v]
    return v
ours = rounded(json.load(open(sys.argv[1])))
record = {"bench": ours.pop("bench"), "device": ours.pop("device"), "peer": None,
          "date": datetime.date.today().isoformat(), "commit": sys.argv[3]}
record.update(ours)
line = json.dumps(record)
with open(sys.argv[2], "a") as f:
    f.write(line + "\n")
print(line)
PY
