// Correctly rounded fp32 arithmetic that the compiler may not fuse or reorder, on host and
// device alike. The optimizers' element formulas are written with these once and shared by the
// CPU reference and the CUDA kernels, so both produce the same bits for the same inputs.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define OPTIM_HD __host__ __device__ __forceinline__
#else
#define OPTIM_HD inline
#endif

namespace optim::fp {

OPTIM_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

OPTIM_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

OPTIM_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

OPTIM_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// a * b + c with a single rounding.
OPTIM_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

OPTIM_HD bool finite(float a) {
#if defined(__CUDA_ARCH__)
  return isfinite(a);
#else
  return std::isfinite(a);
#endif
}

}  // namespace optim::fp
