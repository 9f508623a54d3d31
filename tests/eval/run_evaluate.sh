#!/usr/bin/env bash
# build/evaluate on the CPU and the shipped tasks:
# - data/tasks/*.jsonl are what scripts/make_kjv_tasks.py makes from data/kjv.txt.gz (when python3 is there);
# - both shipped tasks on a committed fixture folder: a table, and --output with every item's
#   log-likelihoods or generated text; --decoder megakernel on the cpu runs the plain decoder, saying why;
# - bad input exits 2 naming the file, line and field.
# usage: run_evaluate.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
evaluate="$build/evaluate"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
tasks="$source/data/tasks/kjv_next_verse.jsonl,$source/data/tasks/kjv_verse_completion.jsonl"

if command -v python3 > /dev/null; then
  python3 "$source/scripts/make_kjv_tasks.py" --out "$work/tasks" > /dev/null
  for name in kjv_next_verse kjv_verse_completion; do
    cmp -s "$work/tasks/$name.jsonl" "$source/data/tasks/$name.jsonl" ||
      fail "data/tasks/$name.jsonl differs from what scripts/make_kjv_tasks.py makes"
  done
  echo "the shipped tasks are reproducible"
fi

folder="$source/tests/fixtures/qwen3/tied"
"$evaluate" "$folder" --tasks "$tasks" --limit 6 --device cpu --decoder megakernel --output "$work/out.json" \
  > "$work/table.txt" 2> "$work/log.txt" || fail "evaluate exited non-zero: $(cat "$work/log.txt")"
cat "$work/table.txt"
grep -q "^kjv_next_verse  *multiple_choice  *6  *acc " "$work/table.txt" || fail "no next-verse row"
grep -q "acc_norm" "$work/table.txt" || fail "no acc_norm row"
grep -q "^kjv_verse_completion  *generative  *6  *exact_match" "$work/table.txt" || fail "no verse-completion row"
grep -q "prefix_share" "$work/table.txt" || fail "no prefix_share row"
grep -q "plain decoder (the megakernel runs on cuda only)" "$work/log.txt" || fail "no fallback reason: $(cat "$work/log.txt")"
python_check='
import json, sys
j = json.load(open(sys.argv[1]))
mc, gen = j["tasks"]
assert mc["kind"] == "multiple_choice" and len(mc["results"]) == 6, mc
assert all(len(r["loglik"]) == 4 and 0 <= r["prediction"] < 4 for r in mc["results"]), mc["results"][0]
assert set(mc["metrics"]) == {"acc", "acc_norm"}
assert gen["decoder"] == "plain" and len(gen["results"]) == 6
assert all("generated" in r and "prediction" in r for r in gen["results"])
assert set(gen["metrics"]) == {"exact_match", "prefix_share"}
'
if command -v python3 > /dev/null; then
  python3 -c "$python_check" "$work/out.json" || fail "--output: $(head -c 600 "$work/out.json")"
else
  grep -q '"loglik"' "$work/out.json" || fail "--output has no loglik"
  grep -q '"generated"' "$work/out.json" || fail "--output has no generated text"
fi
echo "evaluate: table and --output"

expect_exit2() {  # PATTERN ARGS...: evaluate exits 2 and says PATTERN
  local pattern=$1
  shift
  set +e
  "$evaluate" "$@" > "$work/out.txt" 2>&1
  local code=$?
  set -e
  [ $code -eq 2 ] || fail "exit $code (expected 2) for: $* -- $(cat "$work/out.txt")"
  grep -q -- "$pattern" "$work/out.txt" || fail "no '$pattern' for: $* -- $(cat "$work/out.txt")"
}
printf '{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "a", "endings": ["b", "c"], "label": 5}\n' > "$work/bad.jsonl"
expect_exit2 "bad.jsonl:2: field 'label': 5 is outside \[0, 1\]" "$folder" --tasks "$work/bad.jsonl" --device cpu
printf '{"ctx": "a", "endings": ["b", "c"]}\n' > "$work/nolabel.jsonl"
expect_exit2 "nolabel.jsonl:1: field 'label': missing" "$folder" --tasks "$work/nolabel.jsonl" --device cpu
: > "$work/empty.jsonl"
expect_exit2 "empty.jsonl: the task has no items" "$folder" --tasks "$work/empty.jsonl" --device cpu
expect_exit2 "no_such.jsonl: cannot read" "$folder" --tasks "$work/no_such.jsonl" --device cpu
expect_exit2 "decoder" "$folder" --tasks "$tasks" --decoder fastest --device cpu
echo "evaluate: bad input exits 2 naming the file, line and field"
