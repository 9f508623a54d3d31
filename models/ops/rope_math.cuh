// RoPE's device arithmetic (rope.h gives the formula and its precision), shared by the rotation
// kernel (rope.cu) and the fused q/k norm + rotation (qk_norm_rope.cu), so both round alike.
#pragma once

#include <cmath>
#include <cstdint>

namespace models::ops::gpu {

constexpr int kRopeMaxHalf = 256;  // head_dim <= 512

// theta^(-2i / head_dim) for i < head_dim / 2, computed on the host and passed by value with a launch.
struct InverseFrequencies {
  double values[kRopeMaxHalf];
};

inline InverseFrequencies inverse_frequencies(std::int64_t head_dim, double theta) {
  InverseFrequencies inv_freq{};
  for (std::int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq.values[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  }
  return inv_freq;
}

// cos and direction * sin of position * inv_freq: the angle in double, reduced to [-pi, pi] in
// double, then sincosf of the fp32-rounded reduced angle.
__device__ __forceinline__ void rope_cos_sin(double position, double inv_freq, float direction, float& cos_out,
                                             float& sin_out) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  constexpr double kInvTwoPi = 0.15915494309189533576888376337251;
  const double angle = position * inv_freq;
  const double turns = rint(angle * kInvTwoPi);
  const float reduced = static_cast<float>(fma(-turns, kTwoPi, angle));
  float s, c;
  sincosf(reduced, &s, &c);
  cos_out = c;
  sin_out = direction * s;
}

// The pair (a, b) = (x[i], x[i + head_dim / 2]) rotated by the angle of (c, s); spelled out with
// round-to-nearest intrinsics so no kernel contracts it into an FMA differently.
__device__ __forceinline__ float rope_first(float a, float b, float c, float s) {
  return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
__device__ __forceinline__ float rope_second(float a, float b, float c, float s) {
  return __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

}  // namespace models::ops::gpu
