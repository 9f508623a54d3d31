// The 8-bit moment codes of adamw8bit, written once for the CPU reference and the CUDA kernel.
//
// A quantisation block is 256 consecutive elements of the slab's global index space with one
// fp32 scale per moment: the block maximum of |m| (of v) over the block's quantised elements.
// Two codes (docs/optimizers.md, section adamw8bit):
//   companded (default): m byte = sign << 7 | k, |m| = scale * (k/127)^2 (square-root domain);
//                        v byte = c,             v  = scale * (c/255)^4  (fourth-root domain),
//                        and a non-zero v never gets code 0. Stochastic rounding, unbiased in
//                        value space: between the neighbouring codes lo < hi the code is hi with
//                        probability (x - value(lo)) / (value(hi) - value(lo)).
//   linear (baseline):   m and v as signed int8 q, value = scale * q/127, round to nearest
//                        (ties away from zero); a small v rounds to 0.
// Every value-determining operation goes through fp:: (correctly rounded, never fused), and the
// random draws come from core/rng.h keyed by the step and the global element index, so the CPU and
// the GPU produce the same codes, whatever the thread layout, chunk size or world size.
// Only the first guess of a code may use approximate roots (fast on the GPU); the guess is then
// corrected against the exact code values, which makes the result independent of it.
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

namespace quant {

inline constexpr float kInv127 = 1.0f / 127.0f;
inline constexpr float kInv255 = 1.0f / 255.0f;

// (k/127)^2 for k in [0, 127]; exactly 1 at the top code, so the block maximum is exact.
OPTIM_HD float companded_m_unit(int k) {
  if (k >= kCompandedMTop) return 1.0f;
  const float q = fp::mul(static_cast<float>(k), kInv127);
  return fp::mul(q, q);
}

// (c/255)^4 for c in [0, 255]; exactly 1 at the top code.
OPTIM_HD float companded_v_unit(int c) {
  if (c >= kCompandedVTop) return 1.0f;
  const float q = fp::mul(static_cast<float>(c), kInv255);
  const float q2 = fp::mul(q, q);
  return fp::mul(q2, q2);
}

// q/127 for q in [-127, 127]; exactly +-1 at the ends.
OPTIM_HD float linear_unit(int q) {
  if (q >= kLinearTop) return 1.0f;
  if (q <= -kLinearTop) return -1.0f;
  return fp::mul(static_cast<float>(q), kInv127);
}

// First guesses of sqrt(r) and r^(1/4); only used to start the search for a code.
OPTIM_HD float sqrt_guess(float r) {
#if defined(__CUDA_ARCH__)
  return r * rsqrtf(r);  // NaN at r = 0: the caller clamps
#else
  return std::sqrt(r);
#endif
}

OPTIM_HD float fourth_root_guess(float r) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(rsqrtf(r));
#else
  return std::sqrt(std::sqrt(r));
#endif
}

// Float guess -> integer in [0, top - 1] (NaN -> 0).
OPTIM_HD int clamp_guess(float x, int top) {
  const float hi = static_cast<float>(top - 1);
  const float c = x > 0.0f ? (x < hi ? x : hi) : 0.0f;
  return static_cast<int>(c);
}

// The code of `a` (>= 0) in [0, top] under the code values scale * unit(k), rounded
// stochastically with the uniform draw `u` in [0, 1): lo = the largest k < top with
// value(k) <= a, hi = lo + 1, and hi is taken when u * (value(hi) - value(lo)) < a - value(lo).
// `guess` only decides where the search starts.
template <typename Unit>
OPTIM_HD int stochastic_code(float a, float scale, int guess, int top, float u, Unit unit) {
  int k = guess;
  float lo = fp::mul(scale, unit(k));
  while (k > 0 && a < lo) {
    --k;
    lo = fp::mul(scale, unit(k));
  }
  float hi = fp::mul(scale, unit(k + 1));
  while (k + 1 < top && a >= hi) {
    ++k;
    lo = hi;
    hi = fp::mul(scale, unit(k + 1));
  }
  return fp::mul(u, fp::add(hi, -lo)) < fp::add(a, -lo) ? k + 1 : k;
}

}  // namespace quant

// Seed of the stochastic rounding of step t (1-based number of the step being applied).
OPTIM_HD std::uint64_t rounding_seed(long long t) {
  return core::splitmix64(0x8b17ull ^ static_cast<std::uint64_t>(t));
}

// The two uniform draws in [0, 1) of element `index` (global slab index) in the step seeded
// `seed`, 24 bits each from one 64-bit hash: m's is core::uniform01(seed, index) (bits 40..63),
// v's the next 24 bits (16..39) of the same hash. One hash per element instead of one per draw
// halves the kernel's integer work; the draws stay independent of thread layout and world size.
struct RoundingDraws {
  float m, v;
};

OPTIM_HD RoundingDraws rounding_draws(std::uint64_t seed, std::int64_t index) {
  const std::uint64_t bits = core::splitmix64(seed ^ core::splitmix64(static_cast<std::uint64_t>(index)));
  return {static_cast<float>(bits >> 40) * 0x1p-24f, static_cast<float>((bits >> 16) & 0xFFFFFFu) * 0x1p-24f};
}

// A block's scale, with what encoding needs of it precomputed once per block.
struct CodeScale {
  float scale;   // the block maximum (0 for a block whose elements are all 0)
  float factor;  // companded: 1/scale (guess only); linear: 127/scale (exact, part of the code)
};

// Encoding and decoding of one moment element under one code. Bytes are stored raw: companded
// m is sign-magnitude, linear codes are two's-complement int8 (v's are never negative).
template <Quantization Q>
struct MomentCodec;

template <>
struct MomentCodec<Quantization::companded> {
  static OPTIM_HD CodeScale code_scale(float scale) {
    return {scale, scale > 0.0f ? fp::div(1.0f, scale) : 0.0f};
  }
  static OPTIM_HD float decode_m(std::uint8_t code, float scale) {
    const float magnitude = fp::mul(scale, quant::companded_m_unit(code & 0x7F));
    return (code & 0x80) ? -magnitude : magnitude;
  }
  static OPTIM_HD float decode_v(std::uint8_t code, float scale) {
    return fp::mul(scale, quant::companded_v_unit(code));
  }
  static OPTIM_HD std::uint8_t encode_m(float m, CodeScale s, float u) {
    if (!(s.scale > 0.0f)) return 0;
    const float a = m < 0.0f ? -m : m;
    const int guess = quant::clamp_guess(quant::sqrt_guess(a * s.factor) * 127.0f, kCompandedMTop);
    const int k = quant::stochastic_code(a, s.scale, guess, kCompandedMTop, u, quant::companded_m_unit);
    return static_cast<std::uint8_t>(k == 0 ? 0 : (m < 0.0f ? 0x80 | k : k));
  }
  static OPTIM_HD std::uint8_t encode_v(float v, CodeScale s, float u) {
    if (!(v > 0.0f) || !(s.scale > 0.0f)) return 0;
    const int guess = quant::clamp_guess(quant::fourth_root_guess(v * s.factor) * 255.0f, kCompandedVTop);
    const int c = quant::stochastic_code(v, s.scale, guess, kCompandedVTop, u, quant::companded_v_unit);
    return static_cast<std::uint8_t>(c < 1 ? 1 : c);  // a non-zero v never decodes to 0
  }
};

template <>
struct MomentCodec<Quantization::linear> {
  static OPTIM_HD CodeScale code_scale(float scale) {
    return {scale, scale > 0.0f ? fp::div(static_cast<float>(kLinearTop), scale) : 0.0f};
  }
  static OPTIM_HD float decode(std::uint8_t code, float scale) {
    return fp::mul(scale, quant::linear_unit(static_cast<std::int8_t>(code)));
  }
  static OPTIM_HD float decode_m(std::uint8_t code, float scale) { return decode(code, scale); }
  static OPTIM_HD float decode_v(std::uint8_t code, float scale) { return decode(code, scale); }
  // Round to nearest, ties away from zero (roundf on both sides).
  static OPTIM_HD std::uint8_t encode(float x, CodeScale s) {
    if (!(s.scale > 0.0f)) return 0;
    float q = ::roundf(fp::mul(x, s.factor));
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    return static_cast<std::uint8_t>(static_cast<std::int8_t>(q));
  }
  static OPTIM_HD std::uint8_t encode_m(float m, CodeScale s, float) { return encode(m, s); }
  static OPTIM_HD std::uint8_t encode_v(float v, CodeScale s, float) { return encode(v, s); }
};

}  // namespace optim
