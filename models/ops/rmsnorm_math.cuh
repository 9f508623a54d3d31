// RMSNorm's device arithmetic (rmsnorm.h gives the formula), shared by the norm kernels
// (rmsnorm.cu) and the fused q/k norm + rotation (qk_norm_rope.cu), so both round alike.
#pragma once

namespace models::ops::gpu {

// 1 / sqrt(mean(x^2) + eps) from the row's sum of squares.
__device__ __forceinline__ float rms_inverse(float sum_sq, int dim, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(dim) + eps);
}

// y = x * rstd * w.
__device__ __forceinline__ float rms_apply(float x, float r, float w) { return x * r * w; }

// dx = r * (dy * w - x * r * mean) with mean = mean_d(dy * w * x_hat) (see rms_mean).
__device__ __forceinline__ float rms_mean(float g_dot_x, float r, int dim) {
  return g_dot_x * r / static_cast<float>(dim);
}
// Spelled out with round-to-nearest intrinsics so no kernel contracts it into an FMA differently.
__device__ __forceinline__ float rms_dx(float dy, float w, float x, float r, float mean) {
  return __fmul_rn(r, __fsub_rn(__fmul_rn(dy, w), __fmul_rn(__fmul_rn(x, r), mean)));
}

}  // namespace models::ops::gpu
