// Counter-based random numbers (SplitMix64 mixing of seed and counter): the same stream on
// host and device, and any element can be drawn independently, so initialisation and test
// data are reproducible whatever the thread layout.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LLMTRAIN_HD __host__ __device__
#else
#define LLMTRAIN_HD
#endif

namespace core {

LLMTRAIN_HD inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits, from (seed, counter).
LLMTRAIN_HD inline float uniform01(std::uint64_t seed, std::uint64_t counter) {
  return static_cast<float>(splitmix64(seed ^ splitmix64(counter)) >> 40) * 0x1p-24f;
}

// Standard normal from (seed, counter), Box-Muller on two independent uniforms.
LLMTRAIN_HD inline float normal01(std::uint64_t seed, std::uint64_t counter) {
  const float u1 = uniform01(seed, 2 * counter) + 0x1p-25f;  // never 0
  const float u2 = uniform01(seed, 2 * counter + 1);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

}  // namespace core
