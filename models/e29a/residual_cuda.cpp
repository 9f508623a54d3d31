// The residual stream's update between E29a layers on the GPU (residual_cuda.h).
#include "models/e29a/residual_cuda.h"

#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "models/e29a/layer_kernels.h"
#include "models/ops/rmsnorm.h"

namespace models::e29a {

ResidualCuda::ResidualCuda(const core::DeviceContext& context, Residual kind, std::int64_t dim)
    : kind_(kind), dim_(dim) {
  if (!normed()) return;
  const auto d = static_cast<std::size_t>(dim);
  const std::vector<std::uint16_t> ones(d, core::float_to_bf16(1.0f));
  unit_ = core::Buffer(context.device(), d * sizeof(std::uint16_t));
  dunit_ = core::Buffer(context.device(), d * sizeof(float));
  core::copy_bytes(unit_.data(), ones.data(), unit_.bytes(), context.stream());
  dunit_.fill_bytes(0, context.stream());  // the backward adds to it
  // The host vector goes away on return: the copy must have read it.
  CUDA_CHECK(cudaStreamSynchronize(context.stream()));
}

void ResidualCuda::forward(const __nv_bfloat16* x, const __nv_bfloat16* y, std::int64_t rows, double eps,
                           __nv_bfloat16* sum, float* rstd, __nv_bfloat16* next, cudaStream_t stream) {
  if (!normed()) {
    kernels::add_bf16(x, y, rows * dim_, next, stream);
    return;
  }
  kernels::add_bf16(x, y, rows * dim_, sum, stream);
  ops::rmsnorm_forward_cuda(sum, unit_.as<__nv_bfloat16>(), rows, dim_, eps, next, rstd, stream);
}

void ResidualCuda::backward(const __nv_bfloat16* dnext, const __nv_bfloat16* sum, const float* rstd, std::int64_t rows,
                            __nv_bfloat16* dsum, ops::DeviceWorkspace workspace, cudaStream_t stream) {
  if (!normed()) throw core::Error("ResidualCuda: pre_norm has no backward of its own (dL/ds is dL/dx_{l+1})");
  ops::rmsnorm_backward_cuda(dnext, sum, unit_.as<__nv_bfloat16>(), rstd, rows, dim_, dsum, dunit_.as<float>(),
                             workspace.data, workspace.bytes, stream);
}

}  // namespace models::e29a
