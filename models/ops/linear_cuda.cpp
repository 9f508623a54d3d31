// GPU linear layer: the three products of a bias-free linear layer (forward, input gradient,
// weight gradient) as cuBLASLt matmuls on bf16 operands with fp32 accumulation through the product
// cache of gemm_cache.h (linear.h states the conventions).
//
// cuBLASLt is column-major; a row-major matrix [r, c] is the column-major matrix [c, r] with
// leading dimension c, so each row-major product is issued as its transpose:
//   forward   y[N, Out]   = x[N, In] W^T      ->  y^T  = op_T(W) x^T      (m Out, n N,   k In)
//   dgrad     dx[N, In]   = dy[N, Out] W      ->  dx^T = W^T dy^T         (m In,  n N,   k Out)
//   wgrad     dW[Out, In] += dy^T x           ->  dW^T += x^T op_T(dy^T)  (m In,  n Out, k N)
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/error.h"
#include "models/ops/gemm_cache.h"
#include "models/ops/linear.h"
#include "models/ops/op_checks.h"

namespace models::ops {

std::size_t linear_workspace_bytes() { return kLinearWorkspaceBytes; }

namespace {

using checks::Region;

void check_shape(std::string_view op, std::int64_t rows, std::int64_t in_features, std::int64_t out_features) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "in_features", in_features);
  checks::require_positive(op, "out_features", out_features);
}

// A device matrix argument of a product: its name, data, element size and element count.
struct Operand {
  std::string_view name;
  const void* data;
  std::size_t element_bytes;
  std::int64_t elements;
};

template <typename Element>
Operand operand(std::string_view name, const Element* data, std::int64_t elements) {
  return {name, data, sizeof(Element), elements};
}

// An operand present and aligned to its element; the byte range it covers.
Region matrix(std::string_view op, const Operand& m) {
  if (m.data == nullptr) checks::fail(op, std::string(m.name) + " is null");
  if (reinterpret_cast<std::uintptr_t>(m.data) % m.element_bytes != 0) {
    checks::fail(op,
                 std::string(m.name) + " is not aligned to its " + std::to_string(m.element_bytes) + "-byte element");
  }
  return {m.name, m.data, static_cast<std::size_t>(m.elements) * m.element_bytes};
}

void check_workspace(std::string_view op, DeviceWorkspace workspace) {
  if (workspace.data == nullptr || workspace.bytes < kLinearWorkspaceBytes) {
    checks::fail(op, "needs a device workspace of linear_workspace_bytes() = " + std::to_string(kLinearWorkspaceBytes) +
                         " bytes, got " + std::to_string(workspace.bytes) + (workspace.data ? "" : " (null)"));
  }
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % 256 != 0)
    checks::fail(op, "workspace is not 256-byte aligned");
}

// The checks of one product, in order: sizes, workspace, operands, the output apart from both
// inputs. False when there are no rows (nothing to compute).
bool check_product(std::string_view op, std::int64_t rows, std::int64_t in_features, std::int64_t out_features,
                   DeviceWorkspace workspace, const Operand& a, const Operand& b, const Operand& out) {
  check_shape(op, rows, in_features, out_features);
  check_workspace(op, workspace);
  if (rows == 0) return false;
  const Region a_region = matrix(op, a), b_region = matrix(op, b), out_region = matrix(op, out);
  checks::require_disjoint(op, {out_region}, {a_region, b_region});
  return true;
}

}  // namespace

LinearPlan::LinearPlan(const core::DeviceContext& context) {
  if (!context.is_cuda()) throw core::Error("LinearPlan needs a CUDA device context, got " + context.device().str());
  gemms_ = std::make_unique<detail::GemmCache>(context.cublaslt(), context.stream(), "LinearPlan");
}

LinearPlan::~LinearPlan() = default;
LinearPlan::LinearPlan(LinearPlan&& other) noexcept = default;
LinearPlan& LinearPlan::operator=(LinearPlan&& other) noexcept = default;

std::size_t LinearPlan::cached_configurations() const { return gemms_->size(); }

void LinearPlan::forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows,
                         std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* y,
                         DeviceWorkspace workspace) {
  if (!check_product("linear_forward (cuda)", rows, in_features, out_features, workspace,
                     operand("x", x, rows * in_features), operand("weight", weight, out_features * in_features),
                     operand("y", y, rows * out_features))) {
    return;
  }
  const detail::GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, out_features, rows,        in_features,
                                in_features, in_features, out_features, CUDA_R_16BF, false};
  gemms_->run(shape, weight, x, y, workspace);
}

void LinearPlan::backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* weight, std::int64_t rows,
                                std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* dx,
                                DeviceWorkspace workspace, GradOutput dx_mode) {
  if (!check_product("linear_backward_input (cuda)", rows, in_features, out_features, workspace,
                     operand("dy", dy, rows * out_features), operand("weight", weight, out_features * in_features),
                     operand("dx", dx, rows * in_features))) {
    return;
  }
  const detail::GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N,  in_features, rows,        out_features,
                                in_features, out_features, in_features, CUDA_R_16BF, dx_mode == GradOutput::accumulate};
  gemms_->run(shape, weight, dy, dx, workspace);
}

void LinearPlan::backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, std::int64_t rows,
                                 std::int64_t in_features, std::int64_t out_features, float* dweight,
                                 DeviceWorkspace workspace) {
  if (!check_product("linear_backward_weight (cuda)", rows, in_features, out_features, workspace,
                     operand("dy", dy, rows * out_features), operand("x", x, rows * in_features),
                     operand("dweight", dweight, out_features * in_features))) {
    return;  // dweight += 0
  }
  const detail::GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_T,  in_features, out_features, rows,
                                in_features, out_features, in_features, CUDA_R_32F,   true};
  gemms_->run(shape, x, dy, dweight, workspace);
}

void LinearPlan::backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                          std::int64_t rows, std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* dx,
                          float* dweight, DeviceWorkspace workspace, GradOutput dx_mode) {
  if (rows > 0) {
    checks::require_disjoint(
        "linear_backward (cuda)",
        {Region{"dx", dx, static_cast<std::size_t>(rows * in_features) * sizeof(*dx)},
         Region{"dweight", dweight, static_cast<std::size_t>(out_features * in_features) * sizeof(float)}},
        {});
  }
  backward_input(dy, weight, rows, in_features, out_features, dx, workspace, dx_mode);
  backward_weight(dy, x, rows, in_features, out_features, dweight, workspace);
}

}  // namespace models::ops
