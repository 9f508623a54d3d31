#!/usr/bin/env bash
# The sanitizer step: the file readers (config, tokenizer, token shards, safetensors and Hugging
# Face folders, checkpoints) built with clang under AddressSanitizer + UBSan (tests/fuzz), then
# ctest label `sanitize`: every fuzz corpus and the hostile-input tests through them, and each
# libFuzzer target for LLMTRAIN_FUZZ_SECONDS (default 25) on its corpus.
# Needs a built release tree (scripts/test.sh builds it first; LLMTRAIN_RELEASE_BUILD, default
# build/) whose objects supply everything beyond the readers. Installs clang when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
release="${LLMTRAIN_RELEASE_BUILD:-build}"
out="${LLMTRAIN_SANITIZE_BUILD:-build-sanitize}"
seconds="${LLMTRAIN_FUZZ_SECONDS:-25}"
export PATH="$PATH:/usr/local/cuda/bin"

has_libfuzzer() {
  command -v clang++ >/dev/null || return 1
  local probe
  probe="$(mktemp -d)"
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$probe/t.cpp"
  clang++ -fsanitize=fuzzer,address,undefined "$probe/t.cpp" -o "$probe/t" >/dev/null 2>&1
  local status=$?
  rm -rf "$probe"
  return $status
}
if ! has_libfuzzer; then
  echo "sanitize: installing clang and its sanitizer runtimes (libFuzzer)"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-dev
fi

cmake --build "$release" --target trainer_loop  # the objects the fuzz build links (a no-op when built)
cmake -S tests/fuzz -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DLLMTRAIN_RELEASE_BUILD="$(cd "$release" && pwd)" -DLLMTRAIN_FUZZ_SECONDS="$seconds"
cmake --build "$out" -j"$(nproc)"
ctest --test-dir "$out" -L sanitize -j"$(nproc)" --output-on-failure
