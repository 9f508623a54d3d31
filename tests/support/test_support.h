// Helpers shared by the test suites: fresh random data, random parameter lists, closeness checks
// that report the worst element, and the GPU-availability guard.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <functional>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "optim/param_spec.h"
#include "optim/segments.h"

namespace test {

// ||a - b|| / ||b|| over n values, in double; infinity when a holds a non-finite value.
template <typename A, typename B>
double normwise_error(const A* a, const B* b, std::size_t n) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// A data file outside the repository (a large corpus, the real Qwen3 tokenizer): the path in
// environment variable `variable` when set (nullopt when that file does not exist), else
// `fallback` when it exists.
std::optional<std::filesystem::path> find_data(const char* variable, const std::filesystem::path& fallback);

// The whole file as bytes (empty when it cannot be read).
std::string read_file(const std::filesystem::path& path);

// A seed that differs on every run (fresh inputs), printed so a failure can be replayed with
// LLMTRAIN_TEST_SEED=<seed>.
std::uint64_t fresh_seed();

// Values from N(0, scale^2).
std::vector<float> random_normal(std::mt19937_64& rng, std::size_t n, float scale = 1.0f);

// A random list of parameters with awkward sizes: empty, one element, primes, non-multiples of
// 4/64/256, 1-D and 2-D, some without decay, some with lr scales.
std::vector<optim::ParamSpec> random_specs(std::mt19937_64& rng, int count, std::int64_t max_numel = 5000);

// Gradients from N(0, scale^2) for the tensor elements of the whole slab of `layout`, 0 in the
// padding.
std::vector<float> random_grads(std::mt19937_64& rng, const optim::SlabLayout& layout, float scale);

// Makes one random element of a random one of `segments` NaN or -inf (the non-finite step paths).
void poison_one_gradient(std::mt19937_64& rng, const std::vector<optim::Segment>& segments, std::vector<float>& grads);

// Copies between host vectors and (host or device) buffers.
template <typename T>
std::vector<T> to_host(const core::Buffer& buffer) {
  std::vector<T> out(buffer.bytes() / sizeof(T));
  if (buffer.kind() == core::MemoryKind::device) {
    if (!out.empty()) {
      // The library works on non-blocking streams: finish their work before and after the copy.
      cudaError_t e = cudaDeviceSynchronize();
      if (e == cudaSuccess) e = cudaMemcpy(out.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) throw std::runtime_error(std::string("cudaMemcpy to host: ") + cudaGetErrorString(e));
    }
  } else if (!out.empty()) {
    std::memcpy(out.data(), buffer.data(), buffer.bytes());
  }
  return out;
}

template <typename T>
void from_host(core::Buffer& buffer, const std::vector<T>& values) {
  if (values.size() * sizeof(T) != buffer.bytes()) throw std::runtime_error("from_host: size mismatch");
  if (values.empty()) return;
  if (buffer.kind() == core::MemoryKind::device) {
    // A pageable copy may return before it lands, and the library's streams do not wait for
    // the legacy stream: synchronise the device on both sides.
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(buffer.data(), values.data(), buffer.bytes(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) throw std::runtime_error(std::string("cudaMemcpy to device: ") + cudaGetErrorString(e));
  } else {
    std::memcpy(buffer.data(), values.data(), buffer.bytes());
  }
}

// Captures what `work` enqueues on `stream` into a graph (the caller destroys it), and counts a
// graph's kernel nodes: a step's launch count whatever the number of tensors.
cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& work);
int kernel_nodes(cudaGraph_t graph);

// Every element satisfies |a - b| <= rtol * |b| + atol; on failure names the worst element.
::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected, double rtol,
                                     double atol);

}  // namespace test

// Skips the current test, with the reason, when no CUDA device is usable.
#define REQUIRE_GPU()                                                                                       \
  do {                                                                                                      \
    if (::core::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device available (no driver or no GPU)"; \
  } while (0)
