#!/usr/bin/env bash
# One node, one rank per GPU: mpirun -np N build/trainer CONFIG [section.key=value ...]
# usage: launch/mpirun_local.sh CONFIG.yaml [section.key=value ...]
#
#   N        NP if set, else the number of GPUs `nvidia-smi -L` lists (1 without a GPU: a
#            `device: cpu` config then runs as a single rank; set NP for several CPU ranks).
#   binding  the ranks are spread in order over the NUMA domains (ranks 0..k-1 on the first, ...),
#            each bound to its domain, which matches the usual GPU numbering (lower GPUs on the
#            first socket); the trainer uses GPU (local rank mod GPU count). Each rank gets
#            OMP_NUM_THREADS = cores / N unless OMP_NUM_THREADS is set. BIND="--bind-to none" (or
#            any mpirun mapping options) replaces the binding.
#   trainer  TRAINER, else build/trainer of this checkout.
#   extra    MPIRUN_ARGS is added to the mpirun options (e.g. "--mca btl ^openib").
# NCCL_*, LLMTRAIN_* and CUDA_* variables of the calling shell are passed to the ranks.
# SIGTERM (or SIGUSR1) to this script reaches the ranks as SIGUSR1: they agree on a step, save a
# checkpoint and exit 0, and so does the script. (SIGTERM sent to mpirun itself makes Open MPI
# kill the ranks and exit 1, so send it here, or send SIGUSR1 to mpirun.)
# Example: NP=2 launch/mpirun_local.sh configs/quickstart.yaml parallel.zero_stage=2
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  if [ $# -ge 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then exit 0; fi
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
trainer=${TRAINER:-$root/build/trainer}
[ -x "$trainer" ] || { echo "error: $trainer not found: build first (cmake --preset release && cmake --build build)" >&2; exit 2; }
command -v mpirun > /dev/null || { echo "error: mpirun not found (install Open MPI)" >&2; exit 2; }

if [ -z "${NP:-}" ]; then
  NP=0
  if command -v nvidia-smi > /dev/null; then NP=$( (nvidia-smi -L 2> /dev/null || true) | grep -c '^GPU ' || true); fi
  [ "$NP" -ge 1 ] || NP=1
fi
cores=$(nproc)
numa=$(find /sys/devices/system/node -maxdepth 1 -name 'node[0-9]*' 2> /dev/null | wc -l)
[ "$numa" -ge 1 ] || numa=1
per_numa=$(( (NP + numa - 1) / numa ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NP > 0 ? cores / NP : 1 ))}

args=(-np "$NP")
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)
if [ -n "${BIND:-}" ]; then
  read -r -a bind <<< "$BIND"
else
  bind=(--map-by "ppr:$per_numa:numa:OVERSUBSCRIBE" --bind-to numa)
  # More ranks than cores (a CPU test run): binding would overload the cores, so none.
  [ "$NP" -le "$cores" ] || bind=(--map-by "ppr:$per_numa:numa:OVERSUBSCRIBE" --bind-to none)
fi
args+=("${bind[@]}" -x OMP_NUM_THREADS)
# shellcheck source=launch/mpi_args.sh
. "$(dirname "$0")/mpi_args.sh"
echo "launching $NP rank(s) on $(hostname) ($numa NUMA domain(s), $OMP_NUM_THREADS threads per rank)" >&2
run_mpirun "$trainer" "$@"
