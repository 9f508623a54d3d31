// SwiGLU activation of the Qwen3 MLP: out = silu(gate) * up with silu(g) = g / (1 + exp(-g)).
// gate_proj and up_proj are contiguous in the slab, so one GEMM produces both halves:
// gate_up [rows, 2F] holds gate in columns [0, F) and up in columns [F, 2F).
//
// Layouts (row-major): gate_up, dgate_up [rows, 2 * features]; out, dout [rows, features].
// Evaluated in double per element, rounded once.
#pragma once

#include <cstdint>
#include <span>

namespace models::ops {

template <typename Scalar>
void swiglu_forward_cpu(std::span<const Scalar> gate_up, std::int64_t rows, std::int64_t features,
                        std::span<Scalar> out);

// dgate = dout * up * silu'(gate) with silu'(g) = s (1 + g (1 - s)), s = sigmoid(g);
// dup = dout * silu(gate). dgate_up is written (not accumulated).
template <typename Scalar>
void swiglu_backward_cpu(std::span<const Scalar> dout, std::span<const Scalar> gate_up, std::int64_t rows,
                         std::int64_t features, std::span<Scalar> dgate_up);

}  // namespace models::ops
