// Host bf16/fp16 conversion: exact values, ties to even, subnormals, overflow, and exhaustive
// round trips over every 16-bit pattern.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

#include "core/half.h"

namespace {

float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

TEST(Half, Bf16KnownValues) {
  EXPECT_EQ(core::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(core::float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(core::float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(core::float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(core::float_to_bf16(from_bits(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(core::float_to_bf16(from_bits(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(core::float_to_bf16(from_bits(0x3F808001u)), 0x3F81);  // just above the tie
  EXPECT_EQ(core::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(core::float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to infinity
  EXPECT_EQ(core::float_to_bf16(std::nanf("")), 0x7FFF);
}

TEST(Half, Fp16KnownValues) {
  EXPECT_EQ(core::float_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(core::float_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(core::float_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(core::float_to_fp16(65519.0f), 0x7BFF);
  EXPECT_EQ(core::float_to_fp16(65520.0f), 0x7C00);                          // tie to even: infinity
  EXPECT_EQ(core::float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);             // smallest subnormal
  EXPECT_EQ(core::float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);             // half of it: tie to even (0)
  EXPECT_EQ(core::float_to_fp16(std::ldexp(3.0f, -26)), 0x0001);             // 0.75 of it rounds up
  EXPECT_EQ(core::float_to_fp16(std::ldexp(3.0f, -25)), 0x0002);             // 1.5 of it: tie to even (2)
  EXPECT_EQ(core::float_to_fp16(std::ldexp(1.0f, -14)), 0x0400);             // smallest normal
  EXPECT_EQ(core::float_to_fp16(std::ldexp(1023.5f, -24)), 0x0400);          // rounds up into the normals
  EXPECT_EQ(core::float_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, even stays
  EXPECT_EQ(core::float_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, odd rounds up
  EXPECT_EQ(core::float_to_fp16(std::nanf("")), 0x7FFF);
}

TEST(Half, ExhaustiveRoundTrips) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float b = core::bf16_to_float(h);
    if (!std::isnan(b)) {
      ASSERT_EQ(core::float_to_bf16(b), h) << "bf16 pattern " << bits;
    }
    const float f = core::fp16_to_float(h);
    if (!std::isnan(f)) {
      ASSERT_EQ(core::float_to_fp16(f), h) << "fp16 pattern " << bits;
    }
  }
}

TEST(Half, RoundsToNearestOnRandomFloats) {
  // The result must be one of the two neighbouring 16-bit values and the nearer one.
  std::uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    const float x = std::ldexp(static_cast<float>(static_cast<std::int32_t>(state)) / 2147483648.0f,
                               static_cast<int>(state % 40) - 30);
    const float b = core::bf16_to_float(core::float_to_bf16(x));
    EXPECT_LE(std::fabs(b - x), std::ldexp(std::fabs(x), -8)) << x;
    const float f = core::fp16_to_float(core::float_to_fp16(x));
    if (std::fabs(x) < 65504.0f) {
      EXPECT_LE(std::fabs(f - x), std::max(std::ldexp(std::fabs(x), -11), std::ldexp(1.0f, -25))) << x;
    }
  }
}

}  // namespace
