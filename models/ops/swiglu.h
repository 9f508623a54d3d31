// SwiGLU activation of the Qwen3 MLP: out = silu(gate) * up with silu(g) = g / (1 + exp(-g)).
// gate_proj and up_proj are contiguous in the slab, so one GEMM produces both halves:
// gate_up [rows, 2F] holds gate in columns [0, F) and up in columns [F, 2F).
//
// Layouts (row-major): gate_up, dgate_up [rows, 2 * features]; out, dout [rows, features].
// Evaluated in double per element, rounded once.
//
// CUDA kernels (swiglu.cu): bf16 in and out, each element evaluated in fp32 (expf, not the fast
// intrinsic) and rounded once to bf16; 16-byte accesses when features % 8 == 0.
#pragma once

#include <cstdint>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::ops {

template <typename Scalar>
void swiglu_forward_cpu(std::span<const Scalar> gate_up, std::int64_t rows, std::int64_t features,
                        std::span<Scalar> out);

// dgate = dout * up * silu'(gate) with silu'(g) = s (1 + g (1 - s)), s = sigmoid(g);
// dup = dout * silu(gate). dgate_up is written (not accumulated).
template <typename Scalar>
void swiglu_backward_cpu(std::span<const Scalar> dout, std::span<const Scalar> gate_up, std::int64_t rows,
                         std::int64_t features, std::span<Scalar> dgate_up);

// out = silu(gate) * up on `stream`; device pointers; out must not overlap gate_up.
void swiglu_forward_cuda(const __nv_bfloat16* gate_up, std::int64_t rows, std::int64_t features, __nv_bfloat16* out,
                         cudaStream_t stream);

// dgate_up written (not accumulated); it must not overlap dout or gate_up.
void swiglu_backward_cuda(const __nv_bfloat16* dout, const __nv_bfloat16* gate_up, std::int64_t rows,
                          std::int64_t features, __nv_bfloat16* dgate_up, cudaStream_t stream);

}  // namespace models::ops
