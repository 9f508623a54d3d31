#include "core/half.h"

#include <bit>
#include <cmath>

namespace core {

std::uint16_t float_to_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return 0x7FFFu;                          // the canonical NaN the GPU conversion produces
  const std::uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // ties to even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

float bf16_to_float(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t float_to_fp16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7FFFu;          // canonical NaN, as on the GPU
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to nearest even integer.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24: mantissa * 2^(e-150) / 2^-24
    std::uint32_t q = mantissa >> shift;
    const std::uint32_t rem = mantissa & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to even.
  std::uint32_t v = abs - (112u << 23);
  v += 0xFFFu + ((v >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (v >> 13));
}

float fp16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  const std::uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace core
