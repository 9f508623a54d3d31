// Row-major matrix products on cuBLASLt for the E29a layer: C[m, n] (= or +=) op(A) op(B) with
// fp32 accumulation, operands fp32 or bf16, output fp32 or bf16. models/ops/linear.h covers bf16
// operands only; the recurrence needs fp32 operands (its state stays fp32 across the steps). Both
// go through the product cache of models/ops/gemm_cache.h (one descriptor set and algorithm per
// shape, types and alignments, chosen at the first call outside any graph capture; true fp32
// compute, deterministic split-K only), with the caller's 256-byte aligned workspace of
// ops::linear_workspace_bytes(). Results are bit-identical run to run on one GPU model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>
#include <library_types.h>

#include "core/device.h"
#include "models/ops/linear.h"

namespace models::ops::detail {
class GemmCache;
}

namespace models::e29a {

enum class Transpose { no, yes };

// A row-major matrix operand: `data` holds op(X) as stored, `ld` elements between rows.
struct Matrix {
  const void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  std::int64_t ld = 0;
  Transpose transpose = Transpose::no;  // yes: X is stored [cols of op(X), rows of op(X)]
};

struct Output {
  void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  std::int64_t ld = 0;
  bool accumulate = false;  // C += op(A) op(B) (fp32 output only)
};

class GemmPlan {
 public:
  explicit GemmPlan(const core::DeviceContext& context);
  ~GemmPlan();
  GemmPlan(GemmPlan&&) noexcept;
  GemmPlan& operator=(GemmPlan&&) noexcept;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  // C[m, n] (= or +=) op(A)[m, k] op(B)[k, n]; both operands of one type. m, n, k > 0.
  void run(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b, const Output& c,
           ops::DeviceWorkspace workspace);

 private:
  std::unique_ptr<ops::detail::GemmCache> cache_;
};

}  // namespace models::e29a
