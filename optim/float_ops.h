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

// The device spelling of an expression in device code, the host spelling elsewhere: the two
// sides of a formula that must give the same bits on both.
#if defined(__CUDA_ARCH__)
#define OPTIM_DEVICE_OR_HOST(device, host) (device)
#else
#define OPTIM_DEVICE_OR_HOST(device, host) (host)
#endif

namespace optim::fp {

OPTIM_HD float mul(float a, float b) { return OPTIM_DEVICE_OR_HOST(__fmul_rn(a, b), a * b); }
OPTIM_HD float add(float a, float b) { return OPTIM_DEVICE_OR_HOST(__fadd_rn(a, b), a + b); }
OPTIM_HD float div(float a, float b) { return OPTIM_DEVICE_OR_HOST(__fdiv_rn(a, b), a / b); }
OPTIM_HD float sqrt(float a) { return OPTIM_DEVICE_OR_HOST(__fsqrt_rn(a), std::sqrt(a)); }
// a * b + c with a single rounding.
OPTIM_HD float fma(float a, float b, float c) { return OPTIM_DEVICE_OR_HOST(__fmaf_rn(a, b, c), std::fma(a, b, c)); }
OPTIM_HD bool finite(float a) { return OPTIM_DEVICE_OR_HOST(isfinite(a), std::isfinite(a)); }

}  // namespace optim::fp
