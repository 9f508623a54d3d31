#!/usr/bin/env bash
# model.init_from reads config.json: a Hugging Face fixture folder starts a run with its shape
# (YAML shape keys left out); a folder whose config.json contradicts the YAML, asks for rope
# scaling, or is not JSON, is refused with exit 2 naming the key (and both values) or the
# parser's line:column, and the output directory of an existing run stays byte for byte as it was.
# A checkpoint's run directory is accepted too (its newest step, weights only).
# usage: run_init_from.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
fixture="$source/tests/fixtures/qwen3/tied"
source "$(dirname "$0")/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 100000
cat > "$work/run.yaml" <<YAML
run: {name: init, output_dir: $work/run, seed: 3}
device: cpu
model: {arch: qwen3, init_from: $fixture}
data: {train: $work/train.bin, seq_len: 32, tokenizer: byte}
training: {micro_batch_size: 2, max_steps: 2, precision: fp32}
checkpoint: {every: 0}
logging: {every: 1}
sample: {tokens: 4}
YAML
"$build/trainer" "$work/run.yaml" > "$work/ok.log" 2>&1 || { cat "$work/ok.log"; echo "FAIL: init_from the fixture folder"; exit 1; }
grep -q "hidden_size: 64" "$work/run/config.yaml" || { echo "FAIL: the shape did not come from config.json"; exit 1; }
snapshot() { (cd "$work/run" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
before=$(snapshot)
expect_refusal() {  # NAME EXPECTED_TEXT OVERRIDES...
  local name=$1 expected=$2; shift 2
  set +e
  "$build/trainer" "$work/run.yaml" "$@" > "$work/$name.log" 2>&1
  local code=$?
  set -e
  [ "$code" -eq 2 ] || { cat "$work/$name.log"; echo "FAIL: $name: exit $code, expected 2"; exit 1; }
  grep -qF -- "$expected" "$work/$name.log" || { cat "$work/$name.log"; echo "FAIL: $name: message lacks '$expected'"; exit 1; }
  [ "$(snapshot)" = "$before" ] || { echo "FAIL: $name changed the run directory"; exit 1; }
  echo "$name: $(grep error "$work/$name.log" | head -1)"
}
expect_refusal contradicts "model.hidden_size: the config gives 128 but" model.hidden_size=128
mkdir -p "$work/rope" && cp "$fixture"/* "$work/rope/"
sed -i 's/"rope_scaling": null/"rope_scaling": {"type": "linear", "factor": 2.0}/' "$work/rope/config.json"
grep -q '"rope_scaling": {' "$work/rope/config.json" || sed -i 's/^{/{"rope_scaling": {"type": "linear", "factor": 2.0},/' "$work/rope/config.json"
expect_refusal rope_scaling "rope_scaling: rope scaling is not supported" model.init_from="$work/rope"
mkdir -p "$work/broken" && cp "$fixture"/* "$work/broken/"
printf '{\n  "vocab_size": 1000,\n  "hidden_size": 64,,\n}\n' > "$work/broken/config.json"
expect_refusal not_json "broken/config.json:3:" model.init_from="$work/broken"
# A run directory (its newest checkpoint) starts a new run from its weights.
"$build/trainer" "$work/run.yaml" run.output_dir="$work/second" model.init_from="$work/run" \
  > "$work/second.log" 2>&1 || { cat "$work/second.log"; echo "FAIL: init_from a run directory"; exit 1; }
echo "PASS"
