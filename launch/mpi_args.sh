# shellcheck shell=bash
# Sourced by the mpirun launch scripts: appends to the array `args` a -x for every NCCL_*,
# LLMTRAIN_* and CUDA_* variable of the environment (so every rank sees them) and the words of
# $MPIRUN_ARGS (extra mpirun options).
for name in $(compgen -e); do
  case $name in NCCL_* | LLMTRAIN_* | CUDA_*) args+=(-x "$name") ;; esac
done
if [ -n "${MPIRUN_ARGS:-}" ]; then
  read -r -a extra <<< "$MPIRUN_ARGS"
  args+=("${extra[@]}")
fi
