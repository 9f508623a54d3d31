#!/usr/bin/env bash
# The test command: installs missing dependencies, checks the formatting (scripts/check_format.sh),
# builds (release preset) and runs every test.
# Tests labelled gpu skip, saying why, on a machine without a GPU. Then the sanitizer step
# (scripts/sanitize.sh): the file readers under ASan + UBSan, their fuzz corpora, the
# hostile-input tests and a short run of each fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/check_format.sh
export PATH="$PATH:/usr/local/cuda/bin"
cmake --preset release
cmake --build --preset release -j"$(nproc)"
ctest --preset release -j"$(nproc)"
bash scripts/sanitize.sh
