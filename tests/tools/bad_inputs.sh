#!/usr/bin/env bash
# What each tool refuses, as a table: every row runs the tool on one bad input and checks the
# exit status (2: bad input or usage; 1: the output cannot be written), a phrase of the message
# on stderr, and that nothing was half-written or overwritten. A few rows check that input once
# refused by mistake now works (exit 0).
# usage: bad_inputs.sh BUILD_DIR SOURCE_DIR generate|make_shards|export_hf|plot_metrics
# With BAD_INPUTS_TABLE=FILE each row is appended to FILE as a markdown table row (docs/bad_inputs.md).
set -uo pipefail
build=$1
source=$2
tool=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# row EXIT PHRASE REDIRECT PROGRAM ARGS...: REDIRECT is '' or a shell redirection of the tool's
# stdout/stdin ('>&-', '>/dev/full', '<&-').
row() {
  local expected=$1 phrase=$2 redirect=$3 program=$4
  shift 4
  local quoted=""
  for a in "$@"; do quoted+=" $(printf '%q' "$a")"; done
  local out="$work/stdout.txt"
  case "$redirect" in
    '') "$program" "$@" > "$out" 2> "$work/err.txt" ;;
    '>&-') "$program" "$@" >&- 2> "$work/err.txt" ;;
    '>/dev/full') "$program" "$@" > /dev/full 2> "$work/err.txt" ;;
    '<&-') "$program" "$@" <&- > "$out" 2> "$work/err.txt" ;;
    'ulimit -v'*) ( ulimit -v "${redirect#ulimit -v }" && exec "$program" "$@" ) > "$out" 2> "$work/err.txt" ;;
  esac
  local code=$?
  local message
  message=$(grep -v '^$' "$work/err.txt" | head -1)
  if [ "$code" -ne "$expected" ]; then
    fail "$tool$quoted $redirect exited $code, expected $expected: $(cat "$work/err.txt")"
  elif [ -n "$phrase" ] && ! grep -qF -- "$phrase" "$work/err.txt"; then
    fail "$tool$quoted $redirect: message lacks '$phrase': $(cat "$work/err.txt")"
  else
    echo "ok: exit $code: $tool$quoted $redirect"
  fi
  if [ -n "${BAD_INPUTS_TABLE:-}" ]; then
    local shown="$tool${quoted//$work\//} ${redirect}"
    case "$redirect" in 'ulimit'*) shown="($redirect; $tool${quoted//$work\//})" ;; esac
    shown=${shown//$source\//}
    message=${message//$work\//}
    message=${message//$source\//}
    [ "$expected" -eq 0 ] && message="(accepted) ${message}"
    printf '| `%s` | %s | %s |\n' "${shown% }" "$expected" "${message//|/\\|}" >> "$BAD_INPUTS_TABLE"
  fi
}

no_temporaries() {  # DIR: no NAME.tmp.PID left behind
  if ls "$1" | grep -q '\.tmp\.'; then fail "temporary files left in $1: $(ls "$1")"; fi
}

cd "$work" || exit 1
case "$tool" in
generate)
  g="$build/generate"
  tied="$source/tests/fixtures/qwen3/tied"
  row 2 "give --prompt" '' "$g" "$tied" --device cpu
  row 2 "non-negative integers" '' "$g" "$tied" --prompt-ids 1,x --device cpu
  row 2 "outside the model's vocabulary" '' "$g" "$tied" --prompt-ids 5,1000 --device cpu
  row 2 "exceed the model's 256 positions" '' "$g" "$tied" --prompt-ids 1 --max-new-tokens 256 --device cpu
  # prompt + new tokens would overflow a 64-bit sum
  row 2 "exceed the model's 256 positions" '' "$g" "$tied" --prompt-ids 1,2,3 --max-new-tokens 9223372036854775807 --device cpu
  row 2 "--max-new-tokens must be >= 0" '' "$g" "$tied" --prompt-ids 1 --max-new-tokens -1 --device cpu
  row 2 "temperature" '' "$g" "$tied" --prompt-ids 1 --temperature -1 --device cpu
  row 2 "top_p" '' "$g" "$tied" --prompt-ids 1 --top-p 1.5 --device cpu
  row 2 "the prompt is empty" '' "$g" "$tied" --prompt "" --device cpu
  row 2 "no such file" '' "$g" "$work/absent" --prompt-ids 1 --device cpu
  mkdir -p empty
  row 2 "config.json" '' "$g" empty --prompt-ids 1 --device cpu
  row 2 "" '' "$g" "$tied" --prompt-ids 1 --no-such-option
  # A context of 2^24 positions: the KV cache of 16M tokens (49 GB) cannot be allocated in 4 GB.
  mkdir -p long && cp "$tied"/*.safetensors long/ &&
    sed 's/"max_position_embeddings": 256/"max_position_embeddings": 16777216/' "$tied/config.json" > long/config.json
  row 2 "needs 49152009216 bytes" 'ulimit -v 4000000' "$g" long --prompt-ids 1,2,3 --max-new-tokens 16000000 --device cpu
  # A run directory before its first checkpoint (the trainer has written config.yaml and metrics).
  mkdir -p run && echo "model: {arch: qwen3}" > run/config.yaml && : > run/metrics.jsonl
  row 2 "the run has no complete checkpoint yet" '' "$g" run --prompt-ids 1 --device cpu
  mkdir -p run/checkpoints/step_00000010
  row 2 "the run has no complete checkpoint yet" '' "$g" run --prompt-ids 1 --device cpu
  row 2 "standard output is closed" '>&-' "$g" "$tied" --prompt-ids 1 --max-new-tokens 2 --device cpu
  row 1 "writing standard output" '>/dev/full' "$g" "$tied" --prompt-ids 1 --max-new-tokens 2 --device cpu
  ;;
make_shards)
  m="$build/tools/make_shards"
  printf 'In the beginning\nGod created\n' > in.txt
  cp in.txt in.orig
  row 2 "is the input in.txt" '' "$m" in.txt --train-out in.txt
  cmp -s in.txt in.orig || fail "--train-out in.txt changed the corpus"
  ln -s in.txt link.txt
  row 2 "is the input link.txt" '' "$m" link.txt --train-out in.txt
  row 2 "is the input in.txt" '' "$m" in.txt --train-out t.bin --val-out ./in.txt --val-every 2
  row 2 "name the same file" '' "$m" in.txt --train-out t.bin --val-out ./t.bin --val-every 2
  [ -e t.bin ] && fail "t.bin written although refused"
  mkdir -p folder
  row 2 "is a folder; give a file name" '' "$m" in.txt --train-out folder
  row 2 "is a folder, not a file" '' "$m" folder --train-out t.bin
  row 2 "cannot open input 'absent.txt'" '' "$m" absent.txt --train-out t.bin
  row 2 "--val-fraction: expected a number in [0, 1], got nan" '' "$m" in.txt --train-out t.bin --val-out v.bin --val-fraction nan
  row 2 "--val-fraction: expected a number in [0, 1], got 1.5" '' "$m" in.txt --train-out t.bin --val-out v.bin --val-fraction 1.5
  row 2 "--val-every: expected a whole number >= 1, got 0" '' "$m" in.txt --train-out t.bin --val-out v.bin --val-every 0
  row 2 "--threads: expected a whole number in [1, 1024], got 0" '' "$m" in.txt --train-out t.bin --threads 0
  row 2 "--threads: expected a whole number in [1, 1024], got 100000" '' "$m" in.txt --train-out t.bin --threads 100000
  row 2 "--chunk-kib: expected a whole number in [1, 1048576] (1 GiB), got 0" '' "$m" in.txt --train-out t.bin --chunk-kib 0
  row 2 "--separator-id: expected an id >= 0, got -1" '' "$m" in.txt --train-out t.bin --separator-id -1
  row 2 "--separator-id 300 is outside the vocabulary of 256 ids" '' "$m" in.txt --train-out t.bin --separator-id 300
  row 2 "--jsonl-field: expected a key name, got ''" '' "$m" in.txt --train-out t.bin --jsonl-field ''
  row 2 "need --val-out" '' "$m" in.txt --train-out t.bin --val-every 2
  row 2 "excludes" '' "$m" in.txt --train-out t.bin --val-out v.bin --val-every 2 --val-fraction 0.1
  row 2 "" '' "$m" in.txt --train-out t.bin --no-such-option
  row 2 "" '' "$m" in.txt
  row 2 "'-' reads standard input, which is closed" '<&-' "$m" - --train-out t.bin
  [ -e t.bin ] && fail "t.bin written although every run was refused"
  no_temporaries .
  # stdout closed: the report must not land in the shard, which takes the free descriptor 1.
  row 0 "" '>&-' "$m" "$work/in.txt" --train-out t.bin
  [ "$(stat -c %s t.bin)" -eq $((24 + 2 * 29)) ] || fail "stdout closed: t.bin has $(stat -c %s t.bin) bytes, expected $((24 + 2 * 29))"
  row 1 "writing standard output" '>/dev/full' "$m" in.txt --train-out t2.bin
  no_temporaries .
  ;;
export_hf)
  e="$build/tools/export_hf"
  mkdir -p empty run
  echo "model: {arch: qwen3}" > run/config.yaml
  : > file.txt
  row 2 "no such directory" '' "$e" absent out
  row 2 "neither a checkpoint step directory" '' "$e" empty out
  row 2 "the run has no complete checkpoint yet" '' "$e" run out
  row 2 "" '' "$e" run out --dtype fp16
  row 2 "" '' "$e" run
  [ -e out ] && fail "out written although every run was refused"
  ;;
plot_metrics)
  p="$build/tools/plot_metrics"
  printf '{"step": 10, "loss": 5.5}\n{"step": 20, "loss": null}\n{"step": 30, "loss": 4.0}\n{"step": 30, "val_loss": 4.2}\n' > m.jsonl
  row 0 "" '' "$p" m.jsonl -o loss.png
  [ "$(stat -c %s loss.png)" -lt 100000 ] || fail "loss.png has $(stat -c %s loss.png) bytes: not deflated"
  [ "$(head -c 8 loss.png | od -An -tx1 | tr -d ' ')" = "89504e470d0a1a0a" ] || fail "loss.png is not a PNG"
  printf '{"step": 1, "loss": 1e308}\n{"step": 2, "loss": -1e308}\n{"step": 1e15, "loss": 3}\n' > huge.jsonl
  row 0 "" '' "$p" huge.jsonl -o huge.png
  row 2 "is the input itself" '' "$p" m.jsonl -o ./m.jsonl
  grep -q '"step": 10' m.jsonl || fail "-o m.jsonl overwrote the metrics"
  row 2 "is a folder" '' "$p" . -o x.png
  row 2 "cannot open absent.jsonl" '' "$p" absent.jsonl -o x.png
  printf '{"step": -5, "loss": 1}\n' > negative.jsonl
  row 2 "'step' must be in [0, 1e15], got -5" '' "$p" negative.jsonl -o x.png
  printf '{"step": 1, "loss": "low"}\n' > string.jsonl
  row 2 "string.jsonl:1: 'loss' is string, not a number" '' "$p" string.jsonl -o x.png
  printf '{"loss": 1}\n' > nostep.jsonl
  row 2 "a loss without a 'step'" '' "$p" nostep.jsonl -o x.png
  printf '{"step": 1, "loss": 1}\n[1, 2]\n' > array.jsonl
  row 2 "array.jsonl:2: not a JSON object" '' "$p" array.jsonl -o x.png
  printf '{"step": 1}\n' > none.jsonl
  row 2 "has no loss records" '' "$p" none.jsonl -o x.png
  row 2 "" '' "$p" m.jsonl --no-such-option
  row 1 "cannot write absent/x.png" '' "$p" m.jsonl -o absent/x.png
  row 1 "writing standard output" '>/dev/full' "$p" m.jsonl -o y.png
  [ -e x.png ] && fail "x.png written although every run was refused"
  no_temporaries .
  ;;
*) echo "unknown tool $tool"; exit 1 ;;
esac
[ "$failures" -eq 0 ] || { echo "$failures failed"; exit 1; }
echo "$tool: every bad input refused as expected"
