// CUDA kernel for Slab::write_mirror: the 16-bit forward copy of the master weights.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.h"
#include "optim/slab.h"

namespace optim {

namespace {

template <typename Half>
__device__ Half round_to(float x);
template <>
__device__ __nv_bfloat16 round_to<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __half round_to<__half>(float x) {
  return __float2half_rn(x);
}

template <typename Half>
__global__ void write_mirror_kernel(const float* __restrict__ master, Half* __restrict__ mirror, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    mirror[i] = round_to<Half>(master[i]);
  }
}

}  // namespace

void launch_write_mirror(const float* master, void* mirror, core::DType mirror_dtype, std::int64_t n,
                         cudaStream_t stream) {
  if (n == 0) return;
  constexpr int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 65536));
  if (mirror_dtype == core::DType::bf16) {
    write_mirror_kernel<<<blocks, threads, 0, stream>>>(master, static_cast<__nv_bfloat16*>(mirror), n);
  } else {
    write_mirror_kernel<<<blocks, threads, 0, stream>>>(master, static_cast<__half*>(mirror), n);
  }
  CUDA_CHECK_LAUNCH("write_mirror_kernel");
}

}  // namespace optim
