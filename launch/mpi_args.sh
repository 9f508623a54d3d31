# shellcheck shell=bash
# Sourced by the mpirun launch scripts: appends to the array `args` a -x for every NCCL_*,
# LLMTRAIN_* and CUDA_* variable of the environment (so every rank sees them) and the words of
# $MPIRUN_ARGS (extra mpirun options); defines run_mpirun.
for name in $(compgen -e); do
  case $name in NCCL_* | LLMTRAIN_* | CUDA_*) args+=(-x "$name") ;; esac
done
if [ -n "${MPIRUN_ARGS:-}" ]; then
  read -r -a extra <<< "$MPIRUN_ARGS"
  args+=("${extra[@]}")
fi

# run_mpirun PROGRAM ARGS...: mpirun "${args[@]}" PROGRAM ARGS..., with SIGTERM and SIGUSR1 to this
# script passed to the ranks as SIGUSR1 (mpirun forwards it): they agree on a step, save and exit
# 0, and so does the script. SIGTERM sent to mpirun itself would make Open MPI kill the ranks and
# exit 1. Exits with mpirun's status.
run_mpirun() {
  mpirun "${args[@]}" "$@" &
  local child=$! status=0
  trap 'kill -USR1 "$child" 2> /dev/null || true' TERM USR1
  trap 'kill -INT "$child" 2> /dev/null || true' INT
  while :; do
    wait "$child" && status=0 || status=$?
    kill -0 "$child" 2> /dev/null || break  # a trapped signal interrupted wait: keep waiting
  done
  exit "$status"
}
