// The 8-bit moment codes of adamw8bit, written once for the CPU reference and the CUDA kernel.
//
// A quantisation block is 256 consecutive elements of the slab's global index space with one
// fp32 scale per moment: the block maximum of |m| (of v) over the block's quantised elements.
// Two codes (docs/optimizers.md, section adamw8bit):
//   companded (default): m byte = sign << 7 | k, |m| = scale * (k/127)^2 (square-root domain);
//                        v byte = c,             v  = scale * (c/255)^4  (fourth-root domain),
//                        and a non-zero v never gets code 0. Stochastic rounding, unbiased in
//                        value space: between the neighbouring codes lo < hi the code is hi with
//                        probability (x - value(lo)) / (value(hi) - value(lo)), evaluated on an
//                        axis linear in x (t = |m| 127^2/scale with codes at k^2; t = v 255^4/scale
//                        with codes at c^4), which needs no division and no root per element.
//   linear (baseline):   m and v as signed int8 q, value = scale * q/127, round to nearest
//                        (ties away from zero); a small v rounds to 0.
// Every value-determining operation goes through fp:: (correctly rounded, never fused), and the
// random draws come from core/rng.h keyed by the step and the global element index, so the CPU and
// the GPU produce the same codes, whatever the thread layout, chunk size or world size.
// Only the first guess of a code may use approximate roots (fast on the GPU); the guess is then
// corrected against the exact code positions, which makes the result independent of it.
// Block maxima below kMinScale (2^-90) are stored as 0 (all codes 0): that keeps the axis factors
// finite, which bounds the guess's error by one code (stochastic_code); such moments are far
// below any eps (sqrt(2^-90) ~ 3e-14) and do not move the weights.
#pragma once

#include <cstdint>

#include "core/rng.h"
#include "optim/float_ops.h"
#include "optim/optimizer_config.h"

namespace optim {

inline constexpr std::int64_t kQuantBlock = 256;  // elements per scale (== kShardBlock)
inline constexpr int kCompandedMTop = 127;        // largest magnitude code of m
inline constexpr int kCompandedVTop = 255;        // largest code of v
inline constexpr int kLinearTop = 127;            // largest |q| of the linear code
inline constexpr float kMinScale = 0x1p-90f;      // smaller block maxima are stored as 0

namespace quant {

inline constexpr float kInv127 = 1.0f / 127.0f;
inline constexpr float kInv127Squared = 1.0f / 16129.0f;  // 127^2 * fl(1/127^2) == 1 exactly
inline constexpr float kInv255Squared = 1.0f / 65025.0f;  // 255^2 * fl(1/255^2) == 1 exactly
inline constexpr float k127Squared = 16129.0f;
inline constexpr float k255ToThe4 = 4228250625.0f;  // 255^4 (fp32: 4228250624)

// Exact conversions between small non-negative integers (< 2^23) and floats. On the GPU they
// use the 2^23 bias trick (full-rate ALU instead of the conversion unit); the results are exact,
// hence the same bits as the host's casts.
OPTIM_HD float small_int_to_float(std::uint32_t x) {
  return OPTIM_DEVICE_OR_HOST(__uint_as_float(0x4B000000u | x) - 0x1p23f, static_cast<float>(x));
}

OPTIM_HD int small_float_to_int(float x) {
  return OPTIM_DEVICE_OR_HOST(static_cast<int>(__float_as_uint(x + 0x1p23f) - 0x4B000000u), static_cast<int>(x));
}

// (k/127)^2 for k in [0, 127] (k^2 is exact); exactly 1 at the top code, so the block maximum
// is stored exactly.
OPTIM_HD float companded_m_unit(float k) { return fp::mul(fp::mul(k, k), kInv127Squared); }

// (c/255)^4 for c in [0, 255]; exactly 1 at the top code.
OPTIM_HD float companded_v_unit(float c) {
  const float q2 = fp::mul(fp::mul(c, c), kInv255Squared);
  return fp::mul(q2, q2);
}

// q/127 for q in [-127, 127]; exactly +-1 at the ends (127 * fl(1/127) == 1; the byte -128 is
// never written, it would read as -128/127).
OPTIM_HD float linear_unit(int q) { return fp::mul(static_cast<float>(q), kInv127); }

// Where the codes sit on the encoder's position axis t (t is linear in the moment):
// m: t = |m| * 127^2 / scale, code k at k^2 (exact); v: t = v * 255^4 / scale, code c at
// fl(fl(c^2)^2). The decoders' values scale * unit(k) agree with these to fp32 rounding.
OPTIM_HD float m_code_position(float k) { return fp::mul(k, k); }
OPTIM_HD float v_code_position(float c) {
  const float c2 = fp::mul(c, c);
  return fp::mul(c2, c2);
}

#if defined(__CUDA_ARCH__)
// One hardware approximation (MUFU) each, denormals flushed: good enough for a first guess.
__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sqrt_approx(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// First guesses of sqrt(t) and t^(1/4); only used to start the search for a code. On the GPU a
// denormal t reads as 0, a guess of 0, which is right for any t below the first code. (The
// square root used to be t * rsqrt(t), which is +inf for a denormal t: such a t -- |m| below
// ~2^-140 of its block maximum -- got code 125 on the GPU against 0 or 1 on the CPU.)
OPTIM_HD float sqrt_guess(float t) { return OPTIM_DEVICE_OR_HOST(sqrt_approx(t), std::sqrt(t)); }
OPTIM_HD float fourth_root_guess(float t) {
  return OPTIM_DEVICE_OR_HOST(rsqrt_approx(rsqrt_approx(t)), std::sqrt(std::sqrt(t)));
}

// The code in [0, top] of position t >= 0 on an axis whose codes sit at position(k) (increasing,
// position(0) = 0), rounded stochastically with the uniform draw u in [0, 1): lo = the largest
// k < top with position(k) <= t, hi = lo + 1, and hi is taken when
// u * (position(hi) - position(lo)) < t - position(lo), i.e. with probability
// (t - position(lo)) / (position(hi) - position(lo)).
// `root` is a guess of the real k with position(k) = t; it must be within one code of lo. That
// holds for the host's exact roots and for the GPU's approximate ones (relative error < 2^-21,
// under 1e-3 of a code, t being normal or below the first code because scale >= kMinScale), so
// one correction step lands both on the same lo. Branch-free: selects only.
template <typename Position>
OPTIM_HD int stochastic_code(float t, float root, int top, float u, Position position) {
  const auto last = static_cast<float>(top - 1);
  float k = ::floorf(::fminf(::fmaxf(root, 0.0f), last));  // NaN -> 0
  const float lo0 = position(k);
  const float hi0 = position(k + 1.0f);
  k += (t >= hi0 && k < last) ? 1.0f : (t < lo0 ? -1.0f : 0.0f);
  const float lo = position(k);
  const float hi = position(k + 1.0f);
  const float up = fp::mul(u, fp::add(hi, -lo)) < fp::add(t, -lo) ? 1.0f : 0.0f;
  return small_float_to_int(k + up);
}

}  // namespace quant

// Seed of the stochastic rounding of step t (1-based number of the step being applied).
OPTIM_HD std::uint64_t rounding_seed(long long t) {
  return core::splitmix64(0x8b17ull ^ static_cast<std::uint64_t>(t));
}

// The two uniform draws in [0, 1) of element `index` (global slab index) in the step seeded
// `seed`, 16 bits each: the elements 2j and 2j + 1 share one SplitMix64 output
// core::splitmix64(seed ^ j), element 2j taking its bits 0..31 (m: 0..15, v: 16..31) and element
// 2j + 1 its bits 32..63. The seed is itself a SplitMix64 output. One mix per two elements keeps
// the kernel's integer work small, and 16 bits resolve a rounding probability to 2^-16 of a code
// gap; the draws depend only on (step, element), never on thread layout or world size.
struct RoundingDraws {
  float m, v;
};

OPTIM_HD std::uint64_t rounding_bits(std::uint64_t seed, std::int64_t pair) {
  return core::splitmix64(seed ^ static_cast<std::uint64_t>(pair));
}

// The draws of the element whose 32 bits are `half` (the low or high half of rounding_bits).
OPTIM_HD RoundingDraws rounding_draws_from(std::uint32_t half) {
  return {static_cast<float>(half & 0xFFFFu) * 0x1p-16f, static_cast<float>(half >> 16) * 0x1p-16f};
}

OPTIM_HD RoundingDraws rounding_draws(std::uint64_t seed, std::int64_t index) {
  const std::uint64_t bits = rounding_bits(seed, index >> 1);
  return rounding_draws_from(static_cast<std::uint32_t>((index & 1) ? bits >> 32 : bits));
}

// The stored scale of a block whose largest |m| (or v) over its quantised elements is `max`.
OPTIM_HD float block_scale(float max) { return max >= kMinScale ? max : 0.0f; }

// A block's scale, with what encoding needs of it precomputed once per block.
struct CodeScale {
  float scale;   // the stored block maximum (0 for a block whose moments are all 0)
  float factor;  // maps a moment to the code axis: companded 127^2/scale (m), 255^4/scale (v);
                 // linear 127/scale
};

// Encoding and decoding of one moment element under one code. Bytes are stored raw: companded
// m is sign-magnitude, linear codes are two's-complement int8 (v's are never negative).
template <Quantization Q>
struct MomentCodec;

template <>
struct MomentCodec<Quantization::companded> {
  // factor: 127^2 / scale for m, 255^4 / scale for v (the position axis of stochastic_code).
  static OPTIM_HD CodeScale code_scale_m(float scale) {
    return {scale, scale > 0.0f ? fp::div(quant::k127Squared, scale) : 0.0f};
  }
  static OPTIM_HD CodeScale code_scale_v(float scale) {
    return {scale, scale > 0.0f ? fp::div(quant::k255ToThe4, scale) : 0.0f};
  }
  // Decoded value / scale of each byte (sign included); decode is scale * unit.
  static OPTIM_HD float unit_m(std::uint8_t code) {
    const float magnitude = quant::companded_m_unit(quant::small_int_to_float(code & 0x7Fu));
    return (code & 0x80) ? -magnitude : magnitude;
  }
  static OPTIM_HD float unit_v(std::uint8_t code) { return quant::companded_v_unit(quant::small_int_to_float(code)); }
  static OPTIM_HD float decode_m(std::uint8_t code, float scale) { return fp::mul(scale, unit_m(code)); }
  static OPTIM_HD float decode_v(std::uint8_t code, float scale) { return fp::mul(scale, unit_v(code)); }
  // A block of scale 0 has factor 0, so every t is 0 and every code 0.
  static OPTIM_HD std::uint8_t encode_m(float m, CodeScale s, float u) {
    const float t = fp::mul(m < 0.0f ? -m : m, s.factor);
    const int k = quant::stochastic_code(t, quant::sqrt_guess(t), kCompandedMTop, u, quant::m_code_position);
    return static_cast<std::uint8_t>(k == 0 ? 0 : (m < 0.0f ? 0x80 | k : k));
  }
  // A v with t > 0 never gets code 0 (it would decode to 0).
  static OPTIM_HD std::uint8_t encode_v(float v, CodeScale s, float u) {
    const float t = fp::mul(v, s.factor);
    const int c = quant::stochastic_code(t, quant::fourth_root_guess(t), kCompandedVTop, u, quant::v_code_position);
    return static_cast<std::uint8_t>(t > 0.0f ? (c < 1 ? 1 : c) : 0);
  }
};

template <>
struct MomentCodec<Quantization::linear> {
  static OPTIM_HD CodeScale code_scale(float scale) {
    return {scale, scale > 0.0f ? fp::div(static_cast<float>(kLinearTop), scale) : 0.0f};
  }
  static OPTIM_HD CodeScale code_scale_m(float scale) { return code_scale(scale); }
  static OPTIM_HD CodeScale code_scale_v(float scale) { return code_scale(scale); }
  static OPTIM_HD float unit(std::uint8_t code) { return quant::linear_unit(static_cast<std::int8_t>(code)); }
  static OPTIM_HD float unit_m(std::uint8_t code) { return unit(code); }
  static OPTIM_HD float unit_v(std::uint8_t code) { return unit(code); }
  static OPTIM_HD float decode(std::uint8_t code, float scale) { return fp::mul(scale, unit(code)); }
  static OPTIM_HD float decode_m(std::uint8_t code, float scale) { return decode(code, scale); }
  static OPTIM_HD float decode_v(std::uint8_t code, float scale) { return decode(code, scale); }
  // Round to nearest, ties away from zero (roundf on both sides); scale 0 gives factor 0, code 0.
  static OPTIM_HD std::uint8_t encode(float x, CodeScale s) {
    float q = ::roundf(fp::mul(x, s.factor));
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    return static_cast<std::uint8_t>(static_cast<std::int8_t>(q));
  }
  static OPTIM_HD std::uint8_t encode_m(float m, CodeScale s, float) { return encode(m, s); }
  static OPTIM_HD std::uint8_t encode_v(float v, CodeScale s, float) { return encode(v, s); }
};

}  // namespace optim
