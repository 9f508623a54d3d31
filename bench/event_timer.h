// Milliseconds of one kernel launch on the default stream, between two CUDA events, for the
// small standalone benches (bench/handoff_bench, bench/cluster_bench).
#pragma once

#include <cuda_runtime.h>

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

}  // namespace bench
