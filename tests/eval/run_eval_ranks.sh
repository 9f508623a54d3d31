#!/usr/bin/env bash
# Evaluation scores on 1, 2 and 3 cpu ranks must be equal (eval_ranks writes them).
set -euo pipefail
mpiexec=$1 program=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for ranks in 1 2 3; do
  "$mpiexec" -n "$ranks" --oversubscribe "$program" "$dir/ranks$ranks.txt"
done
cat "$dir/ranks1.txt"
for ranks in 2 3; do
  if ! diff "$dir/ranks1.txt" "$dir/ranks$ranks.txt"; then
    echo "FAIL: $ranks ranks give other scores than 1 rank" >&2
    exit 1
  fi
done
echo "the same scores on 1, 2 and 3 ranks"
