#!/usr/bin/env bash
# Checks (changes nothing) that every C++ and CUDA file git tracks is formatted as .clang-format
# says, with clang-format 14 (other versions format differently). To fix: scripts/check_format.sh --fix.
set -euo pipefail
cd "$(dirname "$0")/.."
format=""
for candidate in clang-format-14 clang-format; do
  if command -v "$candidate" >/dev/null && "$candidate" --version | grep -q "version 14\."; then
    format="$candidate"
    break
  fi
done
if [[ -z "$format" ]]; then
  echo "check_format: clang-format 14 not found (apt-get install clang-format-14)" >&2
  exit 1
fi
mode=(--dry-run --Werror)
[[ "${1:-}" == "--fix" ]] && mode=(-i)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z '*.h' '*.cpp' '*.cu' '*.cuh'
else  # a copy of the tree without git
  find core comm optim models text trainer tools tests bench \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \
    -o -name '*.cuh' \) -print0
fi | xargs -0 -P "$(nproc)" -n 16 "$format" "${mode[@]}"
