// Rotary position embedding, rotate-half form as Hugging Face Qwen3 (apply_rotary_pos_emb):
// with h = head_dim / 2, for i < h
//   inv_freq_i = theta^(-2i / head_dim),   angle = position * inv_freq_i,
//   out[i]     = x[i]     * cos(angle) - x[i + h] * sin(angle),
//   out[i + h] = x[i + h] * cos(angle) + x[i]     * sin(angle).
// inv_freq, the angle and its cosine and sine are computed in double, then cos and sin are
// rounded to the element type (fp32) before the rotation; the rotation itself is evaluated in
// double and rounded once. Positions are given per token, so packed documents and shifted
// windows use the positions they need.
//
// Layouts (row-major): x, out, dout, dx [tokens, heads, head_dim]; positions [tokens] int32 >= 0.
// out may be the same memory as x (in place) but must not partially overlap it.
#pragma once

#include <cstdint>
#include <span>

namespace models::ops {

template <typename Scalar>
void rope_forward_cpu(std::span<const Scalar> x, std::span<const std::int32_t> positions, std::int64_t heads,
                      std::int64_t head_dim, double theta, std::span<Scalar> out);

// The rotation is orthogonal, so the backward is the inverse rotation (angle -> -angle) of dout.
// dx may be the same memory as dout.
template <typename Scalar>
void rope_backward_cpu(std::span<const Scalar> dout, std::span<const std::int32_t> positions, std::int64_t heads,
                       std::int64_t head_dim, double theta, std::span<Scalar> dx);

}  // namespace models::ops
