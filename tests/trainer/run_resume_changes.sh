#!/usr/bin/env bash
# A resume continues the run it resumes: a changed shape key (model.rms_norm_eps, rope_theta) is
# refused naming both values; a changed learning-rate schedule (training.max_steps, optimizer.lr,
# schedule.*) is refused unless checkpoint.allow_schedule_change, then continues with a warning
# and elapsed_s continuing.
# max_steps near 2^63 is refused at load, a validation shard too short for one sequence at start
# (not at the first evaluation). A metrics.jsonl that cannot be written (a file size
# limit, as a full disk) stops the run with exit 1 naming the file.
# usage: run_resume_changes.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
source "$(dirname "$0")/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 100000
trainer="$build/trainer"
base=("$source/configs/ci-tiny.yaml" data.train="$work/train.bin" data.val="$work/val.bin" data.seq_len=16
      training.micro_batch_size=1 eval.every=0 sample.tokens=1 schedule.warmup_steps=1 logging.every=1)
expect_exit() {  # CODE TEXT COMMAND...
  local want=$1 text=$2; shift 2
  set +e
  "$@" > "$work/out.log" 2>&1
  local code=$?
  set -e
  [ "$code" -eq "$want" ] || { cat "$work/out.log"; echo "FAIL: exit $code, expected $want: $*"; exit 1; }
  grep -qF -- "$text" "$work/out.log" || { cat "$work/out.log"; echo "FAIL: no '$text' in the output of: $*"; exit 1; }
  echo "ok: exit $code: $(grep -F -- "$text" "$work/out.log" | head -1 | cut -c1-200)"
}
run=("${base[@]}" run.output_dir="$work/run" checkpoint.every=2 checkpoint.resume=auto)
"$trainer" "${run[@]}" training.max_steps=4 > "$work/first.log" 2>&1 || { cat "$work/first.log"; echo "FAIL: first run"; exit 1; }
expect_exit 2 "model.rms_norm_eps: the config gives 0.5 but" "$trainer" "${run[@]}" training.max_steps=4 model.rms_norm_eps=0.5
expect_exit 2 "model.rope_theta: the config gives 5000 but" "$trainer" "${run[@]}" training.max_steps=4 model.rope_theta=5000
expect_exit 2 "training.max_steps 4 -> 8" "$trainer" "${run[@]}" training.max_steps=8
expect_exit 2 "optimizer.lr 0.003 -> 0.01" "$trainer" "${run[@]}" training.max_steps=4 optimizer.lr=0.01
expect_exit 2 "schedule.type cosine -> linear" "$trainer" "${run[@]}" training.max_steps=4 schedule.type=linear
expect_exit 0 "continuing on the new curve" "$trainer" "${run[@]}" training.max_steps=6 checkpoint.allow_schedule_change=true
# elapsed_s continues from the checkpoint instead of starting again at 0.
elapsed() { grep "\"step\":$1,\"loss\"\|\"loss\".*\"step\":$1[,}]" "$work/run/metrics.jsonl" | sed 's/.*"elapsed_s":\([0-9.e+-]*\).*/\1/'; }
[ -n "$(elapsed 4)" ] && [ -n "$(elapsed 5)" ] || { cat "$work/run/metrics.jsonl"; echo "FAIL: no elapsed_s records"; exit 1; }
awk -v a="$(elapsed 4)" -v b="$(elapsed 5)" 'BEGIN { exit !(b >= a) }' ||
  { echo "FAIL: elapsed_s went back from $(elapsed 4) at step 4 to $(elapsed 5) at step 5 after the resume"; exit 1; }
echo "ok: elapsed_s continues: step 4 $(elapsed 4) s, step 5 $(elapsed 5) s"

expect_exit 2 "training.max_steps: expected an integer in [1, 1000000000000]" \
  "$trainer" "${base[@]}" run.output_dir="$work/huge" training.max_steps=9223372036854775807 schedule.type=wsd \
  schedule.warmup_steps=9223372036854775000

# A validation shard shorter than one sequence is refused before anything is written.
printf 'abc' > "$work/tiny.txt"
"$build/tools/make_shards" "$work/tiny.txt" --train-out "$work/tiny.bin" > /dev/null
expect_exit 2 "data.val: $work/tiny.bin holds 3 tokens, fewer than one sequence of data.seq_len + 1 = 17" \
  "$trainer" "${base[@]}" run.output_dir="$work/tinyval" data.val="$work/tiny.bin" eval.every=2 training.max_steps=4
[ ! -e "$work/tinyval" ] || { echo "FAIL: a refused run wrote $work/tinyval"; exit 1; }

# 4 KiB of metrics.jsonl at most: the run must stop at the first record it cannot write.
set +e
# (PMIx's shared-memory store and Open MPI's shared-memory transport write larger files: off.)
( trap '' XFSZ; ulimit -f 4; export PMIX_MCA_gds=hash OMPI_MCA_btl=self,tcp; exec "$trainer" "${base[@]}" run.output_dir="$work/full" training.max_steps=80 \
    checkpoint.every=0 checkpoint.at_end=false logging.tensorboard=false ) 2>&1 | tail -3 > "$work/full.log"
code=${PIPESTATUS[0]}
set -e
[ "$code" -eq 1 ] || { cat "$work/full.log"; echo "FAIL: a run that cannot write metrics.jsonl exited $code"; exit 1; }
grep -q "writing $work/full/metrics.jsonl: File too large" "$work/full.log" ||
  { cat "$work/full.log"; echo "FAIL: the metrics write error is not named"; exit 1; }
echo "ok: metrics.jsonl write error stops the run: $(grep -F metrics.jsonl "$work/full.log" | head -1)"
echo "PASS"
