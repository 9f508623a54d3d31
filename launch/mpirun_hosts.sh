#!/usr/bin/env bash
# Several nodes, one rank per GPU, over ssh with Open MPI's mpirun.
# usage: launch/mpirun_hosts.sh HOSTFILE CONFIG.yaml [section.key=value ...]
#
#   HOSTFILE  one node per line as Open MPI reads it, with its GPU count as slots:
#                 node01 slots=8
#                 node02 slots=8
#             N = the sum of the slots (NP overrides); GPUS_PER_NODE (default: the first line's
#             slots) ranks go to each node in turn, so ranks 0..7 are node01's.
#   Requirements: passwordless ssh between the nodes, the same checkout, build and Open MPI at the
#             same paths on every node, and the config's data files readable on every node.
#             run.output_dir must be on a filesystem shared by all nodes (NFS, Lustre, ...):
#             every rank writes its shard of each checkpoint there and rank 0 writes DONE once
#             all are written; on node-local disks no checkpoint would be complete or resumable.
#   Environment passed to every rank with -x: NCCL_* (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
#             NCCL_DEBUG), LLMTRAIN_*, CUDA_*, OMP_NUM_THREADS, PATH and LD_LIBRARY_PATH.
#   TRAINER (default: build/trainer of this checkout), MPIRUN_ARGS (extra mpirun options, e.g.
#             "--mca btl_tcp_if_include eth0"), BIND (mapping options replacing the default).
# Example: NCCL_SOCKET_IFNAME=eth0 launch/mpirun_hosts.sh hosts.txt configs/quickstart.yaml run.output_dir=/shared/runs/q
set -euo pipefail
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  if [ $# -ge 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then exit 0; fi
  exit 2
fi
hostfile=$1
shift
[ -f "$hostfile" ] || { echo "error: hostfile $hostfile not found" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
trainer=${TRAINER:-$root/build/trainer}
[ -x "$trainer" ] || { echo "error: $trainer not found: build first (cmake --preset release && cmake --build build)" >&2; exit 2; }
command -v mpirun > /dev/null || { echo "error: mpirun not found (install Open MPI)" >&2; exit 2; }

# Slots per line (1 where a line gives none), ignoring comments and blank lines.
slots=$(sed 's/#.*//' "$hostfile" | awk 'NF { n = 1; for (i = 2; i <= NF; ++i) if ($i ~ /^slots=/) n = substr($i, 7) + 0; print n }')
[ -n "$slots" ] || { echo "error: no hosts in $hostfile" >&2; exit 2; }
nodes=$(echo "$slots" | wc -l)
NP=${NP:-$(echo "$slots" | awk '{ s += $1 } END { print s }')}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(echo "$slots" | head -1)}

args=(-np "$NP" --hostfile "$hostfile")
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)
if [ -n "${BIND:-}" ]; then
  read -r -a bind <<< "$BIND"
else
  # Whole nodes in rank order; each rank may use its node's cores (the trainer's work is on the GPU).
  bind=(--map-by "ppr:$GPUS_PER_NODE:node" --bind-to none)
fi
args+=("${bind[@]}" -x PATH)
for name in LD_LIBRARY_PATH OMP_NUM_THREADS; do
  if [ -n "${!name:-}" ]; then args+=(-x "$name"); fi
done
# shellcheck source=launch/mpi_args.sh
. "$(dirname "$0")/mpi_args.sh"
echo "launching $NP rank(s) on $nodes node(s) ($GPUS_PER_NODE per node); run.output_dir must be on a shared filesystem" >&2
run_mpirun "$trainer" "$@"
