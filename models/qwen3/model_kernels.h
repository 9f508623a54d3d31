// Small element-wise kernels the GPU Qwen3 model needs between its ops.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::qwen3 {

// positions[i] = i % seq for i < tokens.
void fill_positions(std::int32_t* positions, std::int64_t tokens, std::int64_t seq, cudaStream_t stream);

// out = a + b (bf16, fp32 addition, one rounding); out may be a or b.
void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, std::int64_t n, cudaStream_t stream);

}  // namespace models::qwen3
