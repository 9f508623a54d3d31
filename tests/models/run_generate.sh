#!/usr/bin/env bash
# build/generate on the CPU:
# - greedy ids from --prompt-ids on the committed fixture folders equal transformers'
#   generate(do_sample=False) ids (tests/fixtures/qwen3/*/generate.json) to the fixture's length;
# - bad input exits 2 with a message naming the problem;
# - a short byte-level training run samples during training (log and metrics.jsonl) and
#   generates from its run directory (naming the step loaded), its step directory and its fp32
#   export alike; export_hf takes the run directory as well;
# - a run on a BPE tokenizer samples too, and generate finds the run's tokenizer.
# usage: run_generate.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
generate="$build/generate"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

json_list() {  # KEY FILE: the integers of "KEY": [...] as a comma-separated list
  grep -o "\"$1\": \[[^]]*\]" "$2" | sed 's/.*\[//; s/\]//; s/ //g'
}

for name in tied untied; do
  folder="$source/tests/fixtures/qwen3/$name"
  prompt=$(json_list prompt_ids "$folder/generate.json")
  expected=$(json_list ids "$folder/generate.json")
  length=$(grep -o '"max_length": [0-9]*' "$folder/generate.json" | grep -o '[0-9]*$')
  count=$(echo "$prompt" | tr ',' '\n' | wc -l)
  got=$("$generate" "$folder" --prompt-ids "$prompt" --max-new-tokens $((length - count)) --device cpu --ids \
        2> "$work/stats.txt") || fail "$name: generate exited non-zero: $(cat "$work/stats.txt")"
  [ "$got" = "$expected" ] || fail "$name: greedy ids differ from transformers'
  got:      $got
  expected: $expected"
  grep -q "decode: $((length - count)) tokens" "$work/stats.txt" || fail "$name: no decode figures: $(cat "$work/stats.txt")"
  grep -q "cpu, plain decoder (the megakernel runs on cuda only)" "$work/stats.txt" ||
    fail "$name: stderr does not name the decoder: $(cat "$work/stats.txt")"
  echo "$name: $length greedy ids equal transformers' ($(cat "$work/stats.txt"))"
done

expect_exit2() {  # PATTERN ARGS...: generate exits 2 and says PATTERN
  local pattern=$1
  shift
  set +e
  "$generate" "$@" > /dev/null 2> "$work/err.txt"
  local code=$?
  set -e
  [ "$code" -eq 2 ] || fail "generate $* exited $code, expected 2: $(cat "$work/err.txt")"
  grep -q -- "$pattern" "$work/err.txt" || fail "generate $*: message lacks '$pattern': $(cat "$work/err.txt")"
}
tied="$source/tests/fixtures/qwen3/tied"
expect_exit2 "give --prompt" "$tied" --device cpu
expect_exit2 "non-negative integers" "$tied" --prompt-ids 1,x --device cpu
expect_exit2 "outside the model's vocabulary" "$tied" --prompt-ids 5,1000 --device cpu
expect_exit2 "exceed the model's 256 positions" "$tied" --prompt-ids 1 --max-new-tokens 256 --device cpu
expect_exit2 "no such file" "$work/absent" --prompt-ids 1 --device cpu
expect_exit2 "config.json" "$work" --prompt-ids 1 --device cpu
expect_exit2 "temperature" "$tied" --prompt-ids 1 --temperature -1 --device cpu
expect_exit2 "top_p" "$tied" --prompt-ids 1 --top-p 1.5 --device cpu
expect_exit2 "the prompt is empty" "$tied" --prompt "" --device cpu
expect_exit2 "excludes" "$tied" --prompt a --prompt-ids 1 --device cpu
expect_exit2 "decoder" "$tied" --prompt-ids 1 --decoder fastest --device cpu
echo "bad input: exit 2 with a reason"

# A byte-level run: samples in the log and metrics.jsonl, then generate from the run.
gunzip -c "$source/data/kjv.txt.gz" > "$work/kjv_full.txt"
head -c 2000000 "$work/kjv_full.txt" > "$work/kjv.txt"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer byte --val-fraction 0.05 \
  --train-out "$work/train.bin" --val-out "$work/val.bin" > /dev/null
"$build/trainer" "$source/configs/ci-tiny.yaml" run.output_dir="$work/run" data.train="$work/train.bin" \
  data.val="$work/val.bin" training.max_steps=30 sample.every=15 sample.tokens=24 eval.every=0 \
  > "$work/train.log" 2>&1 || { cat "$work/train.log"; fail "trainer exited non-zero"; }
grep -q "sample at step 15: And " "$work/train.log" || fail "no sample in the log"
[ "$(grep -c '"sample"' "$work/run/metrics.jsonl")" -eq 2 ] || fail "expected 2 samples in metrics.jsonl"
from_run=$("$generate" "$work/run" --prompt "And " --max-new-tokens 40 --device cpu 2> "$work/stats.txt") ||
  fail "generate from the run directory: $(cat "$work/stats.txt")"
grep -q "generate: loaded $work/run/checkpoints/step_00000030" "$work/stats.txt" ||
  fail "generate does not say which step it loaded: $(cat "$work/stats.txt")"
case "$from_run" in "And "*) ;; *) fail "the text does not start with the prompt: $from_run" ;; esac
step=$(ls -d "$work/run/checkpoints"/step_* | sort | tail -1)
from_step=$("$generate" "$step" --prompt "And " --max-new-tokens 40 --device cpu 2> /dev/null)
[ "$from_step" = "$from_run" ] || fail "step directory and run directory differ"
"$build/tools/export_hf" "$step" "$work/hf" --dtype fp32 > /dev/null || fail "export_hf"
# A run directory exports its newest step, as generate reads it.
"$build/tools/export_hf" "$work/run" "$work/hf_run" --dtype fp32 > "$work/export.txt" || fail "export_hf RUN_DIR"
grep -q "read $step" "$work/export.txt" || fail "export_hf does not say which step it read: $(cat "$work/export.txt")"
cmp -s "$work/hf/model.safetensors" "$work/hf_run/model.safetensors" || fail "export_hf RUN_DIR differs from its step"
from_export=$("$generate" "$work/hf" --prompt "And " --max-new-tokens 40 --device cpu 2> /dev/null)
[ "$from_export" = "$from_run" ] || fail "the fp32 export generates otherwise:
  run:    $from_run
  export: $from_export"
sampled=$("$generate" "$work/run" --prompt "And " --max-new-tokens 40 --temperature 0.8 --top-p 0.9 --seed 5 \
          --device cpu 2> /dev/null)
[ "$sampled" = "$("$generate" "$work/run" --prompt "And " --max-new-tokens 40 --temperature 0.8 --top-p 0.9 \
                   --seed 5 --device cpu 2> /dev/null)" ] || fail "a seeded sample is not repeatable"
echo "byte run: greedy '$(echo "$from_run" | head -c 60 | tr '\n' ' ')', sampled '$(echo "$sampled" | head -c 60 | tr '\n' ' ')'"

# A BPE run (the small fixture tokenizer): samples decoded through it; generate finds it.
bpe="$source/tests/fixtures/tokenizer/small_bpe.json"
"$build/tools/make_shards" "$work/kjv.txt" --tokenizer "$bpe" --val-fraction 0.05 \
  --train-out "$work/bpe_train.bin" --val-out "$work/bpe_val.bin" > /dev/null
"$build/trainer" "$source/configs/ci-tiny.yaml" run.output_dir="$work/bpe_run" data.train="$work/bpe_train.bin" \
  data.val="$work/bpe_val.bin" data.tokenizer="$bpe" model.vocab_size=300 training.max_steps=20 sample.every=10 \
  sample.tokens=16 eval.every=0 > "$work/bpe.log" 2>&1 || { cat "$work/bpe.log"; fail "BPE trainer exited non-zero"; }
grep -q "sample at step 10: And " "$work/bpe.log" || fail "no BPE sample in the log"
[ "$(grep -c '"sample"' "$work/bpe_run/metrics.jsonl")" -eq 2 ] || fail "expected 2 BPE samples in metrics.jsonl"
bpe_text=$("$generate" "$work/bpe_run" --prompt "And " --max-new-tokens 20 --device cpu 2> "$work/stats.txt") ||
  fail "generate from the BPE run: $(cat "$work/stats.txt")"
case "$bpe_text" in "And "*) ;; *) fail "BPE text does not start with the prompt: $bpe_text" ;; esac
echo "bpe run: '$(echo "$bpe_text" | head -c 60 | tr '\n' ' ')'"
echo "generate passed"
