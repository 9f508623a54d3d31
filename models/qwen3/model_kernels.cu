// Element-wise kernels of the GPU Qwen3 model (positions, residual additions).
#include "core/error.h"
#include "models/qwen3/model_kernels.h"

namespace models::qwen3 {

namespace {

__global__ void positions_kernel(std::int32_t* positions, std::int64_t tokens, std::int64_t seq) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < tokens; i += stride) {
    positions[i] = static_cast<std::int32_t>(i % seq);
  }
}

// 8 bf16 per thread where aligned (n a multiple of 8 and 16-byte aligned pointers), else scalar.
__global__ void add_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, std::int64_t n,
                           bool vector) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vector) {
    for (std::int64_t i = first; i < n / 8; i += stride) {
      const uint4 x = reinterpret_cast<const uint4*>(a)[i];
      const uint4 y = reinterpret_cast<const uint4*>(b)[i];
      uint4 z;
      const auto* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
      const auto* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
      auto* z2 = reinterpret_cast<__nv_bfloat162*>(&z);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 fx = __bfloat1622float2(x2[k]), fy = __bfloat1622float2(y2[k]);
        z2[k] = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
      }
      reinterpret_cast<uint4*>(out)[i] = z;
    }
    return;
  }
  for (std::int64_t i = first; i < n; i += stride) {
    out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
  }
}

unsigned int grid_for(std::int64_t work) {
  const std::int64_t blocks = (work + 255) / 256;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks));
}

}  // namespace

void fill_positions(std::int32_t* positions, std::int64_t tokens, std::int64_t seq, cudaStream_t stream) {
  if (tokens == 0) return;
  positions_kernel<<<grid_for(tokens), 256, 0, stream>>>(positions, tokens, seq);
  CUDA_CHECK_LAUNCH("positions_kernel");
}

void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vector = n % 8 == 0 && reinterpret_cast<std::uintptr_t>(a) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(b) % 16 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  add_kernel<<<grid_for(vector ? n / 8 : n), 256, 0, stream>>>(a, b, out, n, vector);
  CUDA_CHECK_LAUNCH("add_kernel");
}

}  // namespace models::qwen3
