#!/usr/bin/env bash
# Hang attribution: rank 1 of a 2-rank cpu run is stopped (SIGSTOP) mid-run; the watchdog of rank 0
# must end the job within its timeout and its message must name rank 1 as behind and the
# collective it never joined, read from rank 1's progress record in shared memory.
# usage: run_sigstop.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2> /dev/null || true; rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
source "$(dirname "$0")/kjv_shards.sh"
make_kjv_shards "$source" "$build" "$work" 200000
mpirun --oversubscribe -np 2 "$build/trainer" "$source/configs/ci-tiny.yaml" data.train="$work/train.bin" \
  data.val="$work/val.bin" run.output_dir="$work/run" training.max_steps=100000 training.micro_batch_size=4 \
  schedule.warmup_steps=2 eval.every=0 logging.every=1 parallel.timeout_s=3 > "$work/log" 2>&1 &
job=$!
for _ in $(seq 150); do grep -q "step 5/" "$work/log" && break; sleep 0.2; done
rank1=""
for pid in $(pgrep -f "trainer .*$work/run"); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then rank1=$pid; fi
done
[ -n "$rank1" ] || { cat "$work/log"; echo "FAIL: rank 1 not found"; exit 1; }
kill -STOP "$rank1"
start=$(date +%s)
set +e; timeout 60 tail --pid="$job" -f /dev/null; wait "$job"; code=$?; set -e
kill -9 "$rank1" 2> /dev/null || true
echo "job ended with exit $code after $(( $(date +%s) - start )) s"
grep -A2 "did not finish within" "$work/log" | head -4
[ "$code" -ne 0 ] || { echo "FAIL: exit 0"; exit 1; }
grep -qE "rank 1 (is behind: it never joined|has not finished) collective #" "$work/log" \
  || { cat "$work/log" | tail -20; echo "FAIL: the message does not name rank 1 and the collective"; exit 1; }
echo PASS
