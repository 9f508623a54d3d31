// Milliseconds between CUDA events for the benches: one kernel launch on the default stream
// (bench/handoff_bench, bench/cluster_bench), or the median of repeated work on a stream; and the
// device copy bandwidth that memory-bound floors are measured against.
#pragma once

#include <algorithm>
#include <vector>

#include <cuda_runtime.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"

namespace bench {

// launch() enqueues the work and returns its launch status. A refused launch (not cudaSuccess)
// returns -1 with the error cleared, so the caller can report it and go on.
template <class Launch>
float launch_ms(Launch launch) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start));
  const cudaError_t launched = launch();
  float ms = -1.0f;
  if (launched == cudaSuccess) {
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  } else {
    (void)cudaGetLastError();
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return ms;
}

// Median milliseconds of `work` on `stream` over `reps` calls after `warmup`, events around each.
template <class Work>
double median_ms(cudaStream_t stream, int warmup, int reps, Work work) {
  cudaEvent_t start{}, stop{};
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float e = 0;
    CUDA_CHECK(cudaEventElapsedTime(&e, start, stop));
    if (i >= warmup) ms.push_back(e);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Device-to-device copy bandwidth in bytes/s, reads plus writes: the median of `reps` copies of
// `bytes` (well past L2) after 3 warm-up copies.
inline double copy_bytes_per_s(const core::DeviceContext& ctx, std::size_t bytes, int reps) {
  core::Buffer src(ctx.device(), bytes), dst(ctx.device(), bytes);
  src.fill_bytes(1, ctx.stream());
  const double ms = median_ms(ctx.stream(), 3, reps, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
  });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

}  // namespace bench
