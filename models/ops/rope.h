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
//
// CUDA kernels (rope.cu), bf16 in and out, in place or not, with a token stride (elements between
// consecutive tokens, >= heads * head_dim) for the input and the output, so q and k can be read from
// and written into a packed qkv buffer [tokens, (Hq + 2 Hkv) * head_dim] (q at offset 0, k at
// offset Hq * head_dim, stride (Hq + 2 Hkv) * head_dim). In place means the same pointer and the
// same stride. inv_freq is computed on the host in double exactly as above (head_dim <= 512) and
// passed with the launch; the angle position * inv_freq is formed in double (bit-identical to the
// reference's) and reduced to [-pi, pi] in double; cos and sin are then computed in fp32
// (sincosf) from the fp32-rounded reduced angle. Their error against the reference's rounded
// double values is at most about 3e-7 (rounding the reduced angle, sincosf's 2 ulp, the rounding
// of the reference), whatever the position. The rotation is evaluated in fp32 and rounded to bf16.
// No check on positions: any int32 rotates by its angle (negative ones too).
#pragma once

#include <cstdint>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::ops {

template <typename Scalar>
void rope_forward_cpu(std::span<const Scalar> x, std::span<const std::int32_t> positions, std::int64_t heads,
                      std::int64_t head_dim, double theta, std::span<Scalar> out);

// The rotation is orthogonal, so the backward is the inverse rotation (angle -> -angle) of dout.
// dx may be the same memory as dout.
template <typename Scalar>
void rope_backward_cpu(std::span<const Scalar> dout, std::span<const std::int32_t> positions, std::int64_t heads,
                       std::int64_t head_dim, double theta, std::span<Scalar> dx);

// out = rope(x) on `stream`; device pointers, positions [tokens].
void rope_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, __nv_bfloat16* out,
                       std::int64_t out_token_stride, const std::int32_t* positions, std::int64_t tokens,
                       std::int64_t heads, std::int64_t head_dim, double theta, cudaStream_t stream);

// dx = inverse rotation of dout (dx may be dout with the same stride).
void rope_backward_cuda(const __nv_bfloat16* dout, std::int64_t dout_token_stride, __nv_bfloat16* dx,
                        std::int64_t dx_token_stride, const std::int32_t* positions, std::int64_t tokens,
                        std::int64_t heads, std::int64_t head_dim, double theta, cudaStream_t stream);

}  // namespace models::ops
