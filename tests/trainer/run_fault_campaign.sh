#!/usr/bin/env bash
# The checkpoint fault campaign: one fault per call, in a two-rank CPU run of configs/ci-tiny.yaml
# (a constant schedule after a 2-step warm-up, so a run stopped early and one resumed with a
# larger training.max_steps follow the same trajectory as one uninterrupted 12-step run):
#   kill9          LLMTRAIN_TEST_KILL_IN_CHECKPOINT=1:8 makes rank 1 kill -9 itself after writing
#                  its files of the step-8 checkpoint, before the manifest: the job exits non-zero
#                  and leaves step_00000008.tmp beside the complete step_00000004
#   disk_full      the step-8 checkpoint overflows a size-limited file: its writes fail with EFBIG
#                  (ulimit -f, for every rank); with mount permitted (root, a private mount
#                  namespace) also a full 2 MiB tmpfs (ENOSPC). The job must exit non-zero naming
#                  the file and the OS error, leave step_00000004 byte for byte as it was and
#                  nothing of step 8
#   flipped_byte   one byte of rank 1's exp_avg file of step_00000008 flipped
#   truncated_manifest
#                  step_00000008/manifest.json cut to half its size; then, in a copy, a byte of
#                  step_00000004 flipped too: with no intact checkpoint the run must stop with
#                  exit code 2 and write nothing
# Each time the next run with checkpoint.resume=auto must take step_00000004 (the newest intact
# checkpoint), say so, name what it skipped (file and reason), and log the losses of the
# uninterrupted run bit for bit at every step, each step once.
# usage: run_fault_campaign.sh BUILD_DIR SOURCE_DIR TRIAL
# Environment: MPI_RUN_TIMEOUT (seconds per run, default 300), MPI_KEEP_WORK (keep the temporary
# directory).
set -euo pipefail
build=$1
source=$2
trial=$3
work=$(mktemp -d)
export OMP_NUM_THREADS=1
# shellcheck source=tests/trainer/mpi_common.sh
. "$(dirname "$0")/mpi_common.sh"
mpi_setup
mpi_common+=(schedule.type=constant checkpoint.every=4 checkpoint.keep_last=0 checkpoint.resume=auto)

fail() {
  local log=$1
  shift
  [ -z "$log" ] || tail -n 40 "$log"
  echo "FAIL: $trial: $*"
  exit 1
}

# run NAME MAX_STEPS [ARGS...]: a two-rank run in $work/NAME (log $work/NAME.log); its exit code in $code.
run() {
  local name=$1 steps=$2
  shift 2
  code=0
  mpi_train 2 "$work/$name.log" run.output_dir="$work/$name" training.max_steps="$steps" "$@" || code=$?
}

# expect_resumed NAME SKIPPED_PATTERN: the run in $work/NAME resumed, exit 0, from step_00000004,
# naming what it skipped; then its losses equal the reference's at every step, each step once.
expect_resumed() {
  local name=$1 skipped=$2 log="$work/$1.log" taken
  [ "$code" -eq 0 ] || fail "$log" "the resumed run exited with code $code"
  taken=$(grep -m1 "resume: auto takes" "$log" || true)
  [ -n "$taken" ] || fail "$log" "the resumed run does not say which checkpoint it takes"
  echo "$taken" | grep -q "checkpoints/step_00000004 (step 4), the newest intact checkpoint" ||
    fail "$log" "it took another checkpoint than step_00000004: $taken"
  echo "$taken" | grep -qE -- "$skipped" || fail "$log" "it does not say it skipped /$skipped/: $taken"
  grep -q "resumed from .*step_00000004 at step 4" "$log" || fail "$log" "no 'resumed from ... at step 4'"
  echo "   ${taken#*checkpoint: }"
  mpi_losses "$work/ref/metrics.jsonl" > "$work/ref.losses"
  mpi_losses "$work/$name/metrics.jsonl" > "$work/$name.losses"
  [ "$(wc -l < "$work/ref.losses")" -eq 12 ] || fail "" "the reference logged $(wc -l < "$work/ref.losses") losses, expected 12"
  if ! cmp -s "$work/ref.losses" "$work/$name.losses"; then
    paste "$work/ref.losses" "$work/$name.losses"
    fail "" "the losses after resume differ from the uninterrupted run's (reference | resumed)"
  fi
  echo "   losses of steps 1-12 equal the uninterrupted run's bit for bit, each step logged once"
  [ -f "$work/$name/checkpoints/step_00000012/DONE" ] || fail "$log" "the resumed run saved no step 12"
  ! compgen -G "$work/$name/checkpoints/*.tmp" > /dev/null || fail "" "an incomplete step directory is left: $(ls "$work/$name/checkpoints")"
}

# flip_byte FILE OFFSET MASK: XORs byte OFFSET of FILE with MASK in place; prints "old -> new".
flip_byte() {
  local old
  old=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf '%b' "$(printf '\\%03o' $((old ^ $3)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
  echo "$old -> $((old ^ $3))"
}

# Checksums of every file of a checkpoint directory.
sums() { (cd "$1" && cksum ./* | sort -k 3); }

echo "== reference: 12 steps uninterrupted"
run ref 12
[ "$code" -eq 0 ] || fail "$work/ref.log" "the reference run exited with code $code"

case $trial in
kill9)
  echo "== rank 1 kill -9 in the middle of the step-8 checkpoint"
  export LLMTRAIN_TEST_KILL_IN_CHECKPOINT=1:8
  code=0
  SECONDS=0
  timeout -k 10 "$MPI_RUN_TIMEOUT" "$mpirun" --allow-run-as-root --oversubscribe -x LLMTRAIN_TEST_KILL_IN_CHECKPOINT \
    -np 2 "$trainer_bin" "$config" "${mpi_common[@]}" run.output_dir="$work/run" training.max_steps=12 \
    > "$work/run.log" 2>&1 || code=$?
  unset LLMTRAIN_TEST_KILL_IN_CHECKPOINT
  mpi_kill_leftovers
  echo "   mpirun exited with code $code after $SECONDS s"
  [ "$code" -ne 0 ] || fail "$work/run.log" "the job exited 0 although rank 1 was killed"
  [ "$SECONDS" -lt "$MPI_RUN_TIMEOUT" ] || fail "$work/run.log" "the job hung until its timeout"
  grep -q "rank 1 kills itself in the checkpoint of step 8" "$work/run.log" || fail "$work/run.log" "the hook did not fire"
  ckpt="$work/run/checkpoints"
  [ -f "$ckpt/step_00000004/DONE" ] || fail "$work/run.log" "step_00000004 is not complete"
  [ -d "$ckpt/step_00000008.tmp" ] && [ ! -e "$ckpt/step_00000008" ] ||
    fail "$work/run.log" "expected step_00000008.tmp and no step_00000008: $(ls "$ckpt")"
  [ -f "$ckpt/step_00000008.tmp/master.rank1.bin" ] && [ ! -e "$ckpt/step_00000008.tmp/manifest.json" ] ||
    fail "$work/run.log" "step_00000008.tmp should hold rank 1's files and no manifest: $(ls "$ckpt/step_00000008.tmp")"
  echo "   left: $(ls "$ckpt" | paste -sd' ') (step_00000008.tmp: $(ls "$ckpt/step_00000008.tmp" | paste -sd' '))"
  run run 12
  expect_resumed run "skipped step_00000008\.tmp: incomplete step"
  ;;

disk_full)
  echo "== 8 steps, checkpoint of step 4"
  run run 4
  [ "$code" -eq 0 ] || fail "$work/run.log" "the first 4 steps exited with code $code"
  step4="$work/run/checkpoints/step_00000004"
  before=$(sums "$step4")
  shard=$(stat -c %s "$step4/master.rank1.bin")
  limit_kb=$((shard / 2 / 1024))
  echo "== resumed to 12 steps with files limited to $limit_kb KiB (ulimit -f; a shard file is $shard bytes)"
  code=0
  SECONDS=0
  # Open MPI's own shared-memory files (the PMIx store, the sm transport) would overflow the limit
  # before the trainer starts: this job keeps them in memory and talks over TCP.
  (ulimit -f "$limit_kb" && export PMIX_MCA_gds=hash OMPI_MCA_btl=self,tcp && mpi_train 2 "$work/full.log" run.output_dir="$work/run" training.max_steps=12) || code=$?
  echo "   mpirun exited with code $code after $SECONDS s"
  [ "$code" -ne 0 ] || fail "$work/full.log" "the job exited 0 although its checkpoint could not be written"
  [ "$SECONDS" -lt "$MPI_RUN_TIMEOUT" ] || fail "$work/full.log" "the job hung until its timeout"
  message=$(grep -m1 "checkpoint of step 8 not saved" "$work/full.log" || true)
  echo "$message" | grep -qE "cannot write $work/run/checkpoints/step_00000008\.tmp/[^ ]+: File too large" ||
    fail "$work/full.log" "no 'checkpoint of step 8 not saved ... cannot write PATH: File too large' message: $message"
  echo "   ${message#*: }"
  [ "$(sums "$step4")" = "$before" ] || fail "" "step_00000004 changed"
  [ "$(ls "$work/run/checkpoints")" = "step_00000004" ] || fail "" "something of step 8 is left: $(ls "$work/run/checkpoints")"
  echo "   step_00000004 unchanged, nothing of step 8 left"
  run run 12
  expect_resumed run ""

  # ENOSPC: the run directory on a full tmpfs, in a private mount namespace (gone with it).
  if [ "$(id -u)" -eq 0 ] && command -v unshare > /dev/null &&
     unshare -m --propagation private sh -c "mount -t tmpfs -o size=1m tmpfs '$work'" 2> /dev/null; then
    echo "== ENOSPC: the run directory on a 2 MiB tmpfs (a checkpoint is $(du -sk "$step4" | cut -f1) KiB)"
    mkdir "$work/tmpfs"
    export -f mpi_train mpi_kill_leftovers
    export mpirun trainer_bin config work MPI_RUN_TIMEOUT
    code=0
    unshare -m --propagation private bash -c '
      set -e
      mount -t tmpfs -o size=2m tmpfs "$work/tmpfs"
      read -r -a mpi_common <<< "$1"
      mpi_train 2 "$work/enospc.log" run.output_dir="$work/tmpfs/run" training.max_steps=4 || exit 90
      sum4=$(cd "$work/tmpfs/run/checkpoints/step_00000004" && cksum ./* | sort -k 3)
      rc=0
      mpi_train 2 "$work/enospc.log" run.output_dir="$work/tmpfs/run" training.max_steps=12 || rc=$?
      [ "$rc" -ne 0 ] || exit 91
      [ "$(cd "$work/tmpfs/run/checkpoints/step_00000004" && cksum ./* | sort -k 3)" = "$sum4" ] || exit 92
      [ "$(ls "$work/tmpfs/run/checkpoints")" = step_00000004 ] || exit 93
      cp -r "$work/tmpfs/run" "$work/enospc"' _ "${mpi_common[*]}" || code=$?
    case $code in
    0) ;;
    90) fail "$work/enospc.log" "the first 4 steps on the tmpfs failed" ;;
    91) fail "$work/enospc.log" "the job exited 0 on a full disk" ;;
    92) fail "$work/enospc.log" "step_00000004 changed on the full disk" ;;
    93) fail "$work/enospc.log" "something of step 8 is left on the full disk" ;;
    *) fail "$work/enospc.log" "the tmpfs trial ended with code $code" ;;
    esac
    message=$(grep -m1 "checkpoint of step 8 not saved" "$work/enospc.log" || true)
    echo "$message" | grep -qE "cannot (write|fsync|close|create) $work/tmpfs/run/checkpoints/step_00000008\.tmp/[^ ]+: No space left on device" ||
      fail "$work/enospc.log" "no 'checkpoint of step 8 not saved ... PATH: No space left on device' message: $message"
    echo "   ${message#*: }"
    echo "   step_00000004 unchanged, nothing of step 8 left"
    run enospc 12
    expect_resumed enospc ""
  else
    echo "   (no ENOSPC trial: mounting a tmpfs is not permitted here)"
  fi
  ;;

flipped_byte)
  echo "== 8 steps, then one byte of step_00000008/state.exp_avg.rank1.bin flipped"
  run run 8
  [ "$code" -eq 0 ] || fail "$work/run.log" "the first 8 steps exited with code $code"
  file="$work/run/checkpoints/step_00000008/state.exp_avg.rank1.bin"
  [ -f "$file" ] || fail "" "no $file: $(ls "$work/run/checkpoints/step_00000008")"
  offset=$(($(stat -c %s "$file") / 2))
  echo "   byte $offset: $(flip_byte "$file" "$offset" 0x10)"
  run run 12
  expect_resumed run "skipped step_00000008: [^;]*state\.exp_avg\.rank1\.bin: checksum mismatch"
  ;;

truncated_manifest)
  echo "== 8 steps, then step_00000008/manifest.json cut to half its size"
  run run 8
  [ "$code" -eq 0 ] || fail "$work/run.log" "the first 8 steps exited with code $code"
  cp -a "$work/run" "$work/none"
  manifest="$work/run/checkpoints/step_00000008/manifest.json"
  truncate -s $(($(stat -c %s "$manifest") / 2)) "$manifest"
  echo "   manifest.json now $(stat -c %s "$manifest") bytes"
  run run 12
  expect_resumed run "skipped step_00000008: [^;]*manifest\.json: checksum mismatch [^;]*the manifest is truncated"

  echo "== no intact checkpoint: step_00000008's manifest truncated and a byte of step_00000004 flipped"
  manifest="$work/none/checkpoints/step_00000008/manifest.json"
  truncate -s $(($(stat -c %s "$manifest") / 2)) "$manifest"
  file="$work/none/checkpoints/step_00000004/master.rank0.bin"
  flip_byte "$file" 100 1 > /dev/null
  before=$(cksum "$work/none/metrics.jsonl" "$work/none/config.yaml")
  run none 12
  [ "$code" -eq 2 ] || fail "$work/none.log" "exit code $code with no intact checkpoint, expected 2"
  message=$(grep -m1 "none of the 2 checkpoints" "$work/none.log" || true)
  [ -n "$message" ] || fail "$work/none.log" "no 'none of the 2 checkpoints ... verifies' message"
  grep -q "step_00000004/master.rank0.bin: checksum mismatch" "$work/none.log" ||
    fail "$work/none.log" "the log does not say why step_00000004 is unusable"
  [ "$(cksum "$work/none/metrics.jsonl" "$work/none/config.yaml")" = "$before" ] ||
    fail "$work/none.log" "the refused run changed metrics.jsonl or config.yaml"
  ! grep -q '"step":9' "$work/none/metrics.jsonl" || fail "" "the refused run trained"
  echo "   exit 2: ${message#error: }"
  ;;

*)
  echo "usage: run_fault_campaign.sh BUILD_DIR SOURCE_DIR kill9|disk_full|flipped_byte|truncated_manifest"
  exit 2
  ;;
esac
echo "fault campaign: $trial passed"
