#!/usr/bin/env bash
# Downstream tasks in the trainer on the CPU: a short run without data.val evaluates both shipped
# tasks every 10 steps (log lines, eval/<task>/<metric> and seconds in metrics.jsonl), and
# build/evaluate on its run directory gives the final step's numbers; an item longer than
# data.seq_len is refused at the start (exit 2, file and line) before the run directory exists.
# usage: run_trainer_tasks.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
gunzip -c "$source/data/kjv.txt.gz" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null
next="$source/data/tasks/kjv_next_verse.jsonl"
completion="$source/data/tasks/kjv_verse_completion.jsonl"
run() {  # OUTPUT_DIR SEQ_LEN
  "$build/trainer" "$source/configs/ci-tiny.yaml" run.output_dir="$1" data.train="$work/train.bin" data.val= \
    eval.every=0 data.seq_len="$2" training.max_steps=20 logging.every=10 checkpoint.every=0 \
    "eval.tasks=[$next, $completion]" eval.tasks_every=10 eval.tasks_limit=16
}
run "$work/run" 256 > "$work/out.log" 2>&1 || { cat "$work/out.log"; fail "trainer exited non-zero"; }
grep -q "step 10 | kjv_next_verse acc [0-9.]* acc_norm [0-9.]* (16 items" "$work/out.log" || fail "no task line: $(cat "$work/out.log")"
grep -q "step 20 | kjv_verse_completion exact_match [0-9.]* prefix_share [0-9.]* (16 items, .*plain decoder)" \
  "$work/out.log" || fail "no generative task line"
[ "$(grep -c '"eval/kjv_next_verse/acc_norm"' "$work/run/metrics.jsonl")" = 2 ] || fail "eval records missing"
grep -q '"eval/kjv_verse_completion/seconds"' "$work/run/metrics.jsonl" || fail "no seconds recorded"
acc=$(grep '"eval/kjv_next_verse/acc"' "$work/run/metrics.jsonl" | tail -1 | sed 's/.*"eval\/kjv_next_verse\/acc":\([0-9.e+-]*\).*/\1/')
"$build/evaluate" "$work/run" --tasks "$next,$completion" --limit 16 --device cpu > "$work/table.txt" 2> /dev/null ||
  fail "evaluate on the run directory"
tool_acc=$(grep "^kjv_next_verse" "$work/table.txt" | awk '{print $5}')
awk -v a="$acc" -v b="$tool_acc" 'BEGIN { exit !((a - b) ^ 2 < 1e-10) }' ||
  fail "evaluate gives acc $tool_acc, the trainer's last step $acc"
echo "trainer: tasks every 10 steps without data.val; evaluate on the run agrees (acc $acc)"

set +e
run "$work/refused" 64 > "$work/refused.log" 2>&1
code=$?
set -e
[ $code -eq 2 ] || fail "exit $code for items longer than data.seq_len: $(cat "$work/refused.log")"
grep -q "kjv_next_verse.jsonl:1: the context and ending 0 need [0-9]* positions" "$work/refused.log" ||
  fail "no file and line: $(cat "$work/refused.log")"
[ ! -e "$work/refused" ] || fail "a refused run wrote its directory"
echo "trainer: an item longer than data.seq_len is refused at the start"
