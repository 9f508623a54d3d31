#!/usr/bin/env bash
# The watchdog turns a hung collective into a job abort: rank 1 never joins MODE (barrier,
# all_reduce or first_all_reduce; timeout 2 s); mpirun must exit non-zero within 20 s with
# "did not finish within 2 s" on stderr and no crashed rank. `timeout 60` makes a hang fail the
# test instead of hanging CI. The cuda variant passes as skipped where the binary says SKIPPED.
# usage: run_watchdog.sh MPIEXEC NUMPROC_FLAG RANKS TEST_BINARY MODE [DEVICE]
set -u
mpiexec=$1
numproc_flag=$2
ranks=$3
binary=$4
mode=$5
device=${6:-cpu}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

start=$(date +%s%N)
timeout 60 "$mpiexec" "$numproc_flag" "$ranks" --oversubscribe "$binary" --device "$device" --hang "$mode" > "$log" 2>&1
code=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
cat "$log"
echo "mpirun exit code $code after $elapsed_ms ms"

if [ "$code" -eq 0 ] && grep -q "SKIPPED" "$log"; then
  exit 0  # no GPU: the cuda variant skips
fi
[ "$code" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout 60)"; exit 1; }
[ "$code" -ne 0 ] || { echo "FAIL: mpirun exited 0"; exit 1; }
[ "$elapsed_ms" -le 20000 ] || { echo "FAIL: took $elapsed_ms ms, more than 20 s"; exit 1; }
grep -q "did not finish within 2 s" "$log" || { echo "FAIL: no 'did not finish within 2 s' message"; exit 1; }
if grep -qE "Segmentation fault|on signal (6|11)|Aborted \(core dumped\)" "$log"; then
  echo "FAIL: a rank crashed instead of being aborted by the watchdog"; exit 1
fi
echo "PASS: the watchdog aborted the job"
