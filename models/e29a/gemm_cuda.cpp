// Row-major products on the shared cuBLASLt cache (gemm_cuda.h). cuBLASLt is column-major: a
// row-major [r, c] matrix is the column-major [c, r] one, so C = op(A) op(B) is issued as
// C^T = op(B)^T op(A)^T, i.e. with the operands swapped and their transposition flags kept.
#include "models/e29a/gemm_cuda.h"

#include <string>

#include "core/error.h"
#include "models/ops/gemm_cache.h"

namespace models::e29a {

GemmPlan::GemmPlan(const core::DeviceContext& context) {
  if (!context.is_cuda()) throw core::Error("e29a GemmPlan needs a CUDA device context, got " + context.device().str());
  cache_ = std::make_unique<ops::detail::GemmCache>(context.cublaslt(), context.stream(), "e29a gemm");
}

GemmPlan::~GemmPlan() = default;
GemmPlan::GemmPlan(GemmPlan&&) noexcept = default;
GemmPlan& GemmPlan::operator=(GemmPlan&&) noexcept = default;

void GemmPlan::run(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b, const Output& c,
                   ops::DeviceWorkspace workspace) {
  if (m <= 0 || n <= 0 || k <= 0) {
    throw core::Error("e29a gemm: m, n, k must be positive, got " + std::to_string(m) + ", " + std::to_string(n) +
                      ", " + std::to_string(k));
  }
  if (a.type != b.type || (a.type != CUDA_R_32F && a.type != CUDA_R_16BF) ||
      (c.type != CUDA_R_32F && c.type != CUDA_R_16BF) || (c.accumulate && c.type != CUDA_R_32F)) {
    throw core::Error(
        "e29a gemm: unsupported types (operands fp32 or bf16 alike, output fp32 or bf16, "
        "accumulation into fp32 only)");
  }
  if (!a.data || !b.data || !c.data) throw core::Error("e29a gemm: null operand");
  if (workspace.data == nullptr || workspace.bytes < ops::kLinearWorkspaceBytes ||
      reinterpret_cast<std::uintptr_t>(workspace.data) % 256 != 0) {
    throw core::Error("e29a gemm: needs a 256-byte aligned workspace of linear_workspace_bytes()");
  }
  // Column-major: D^T [n, m] = op(B)^T [n, k] op(A)^T [k, m].
  const ops::detail::GemmShape shape{b.transpose == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     a.transpose == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     n,
                                     m,
                                     k,
                                     b.ld,
                                     a.ld,
                                     c.ld,
                                     c.type,
                                     c.accumulate,
                                     a.type};
  cache_->run(shape, b.data, a.data, c.data, workspace);
}

}  // namespace models::e29a
