#!/usr/bin/env bash
# Installs the build dependencies from the distribution (Debian 12 / Ubuntu 24.04) when they are
# missing: cmake, ninja, g++, Open MPI, yaml-cpp, spdlog, nlohmann-json, CLI11, GoogleTest, and
# clang-format 14 for the format check.
# The CUDA toolkit (nvcc, cuBLASLt, NCCL) is expected under /usr/local/cuda or on the PATH.
set -euo pipefail

missing=()
have_header() { [ -e "/usr/include/$1" ] || [ -e "/usr/local/include/$1" ]; }
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev openmpi-bin)
have_header yaml-cpp/yaml.h || missing+=(libyaml-cpp-dev)
have_header spdlog/spdlog.h || missing+=(libspdlog-dev)
have_header nlohmann/json.hpp || missing+=(nlohmann-json3-dev)
have_header CLI/CLI.hpp || missing+=(libcli11-dev)
have_header gtest/gtest.h || missing+=(libgtest-dev)
command -v clang-format-14 >/dev/null || missing+=(clang-format-14)

if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "install_deps: the CUDA toolkit (nvcc) was not found in PATH or /usr/local/cuda/bin;" \
       "install CUDA 12.4 or newer (it provides cuBLASLt; NCCL comes with it or from libnccl-dev)" >&2
  exit 1
fi
