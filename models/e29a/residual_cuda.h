// The residual stream's update between E29a layers on the GPU (residual.h has both kinds), in
// bf16 like the rest of the stream: pre_norm is one add; normed_sum adds, then runs the RMSNorm
// kernels of ops/rmsnorm.h with the unit weight held here.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/buffer.h"
#include "core/device.h"
#include "models/e29a/config.h"
#include "models/ops/linear.h"

namespace models::e29a {

class ResidualCuda {
 public:
  ResidualCuda(const core::DeviceContext& context, Residual kind, std::int64_t dim);

  bool normed() const { return kind_ == Residual::normed_sum; }

  // next = x + y (pre_norm; next may alias x or y), or sum = x + y and next = normed(sum) with
  // sum's rstd [rows] (normed_sum; both kept for the backward, next must not alias sum).
  void forward(const __nv_bfloat16* x, const __nv_bfloat16* y, std::int64_t rows, double eps, __nv_bfloat16* sum,
               float* rstd, __nv_bfloat16* next, cudaStream_t stream);

  // normed_sum: dsum = dL/ds from dnext = dL/dx_{l+1} (dsum must not alias the inputs).
  void backward(const __nv_bfloat16* dnext, const __nv_bfloat16* sum, const float* rstd, std::int64_t rows,
                __nv_bfloat16* dsum, ops::DeviceWorkspace workspace, cudaStream_t stream);

 private:
  Residual kind_;
  std::int64_t dim_;
  core::Buffer unit_;   // [dim] bf16 ones (normed_sum only)
  core::Buffer dunit_;  // [dim] fp32: the unit weight's gradient, which the op computes and nothing reads
};

}  // namespace models::e29a
