#include "optim/muon_gemm.h"

#include <utility>

#include "core/error.h"
#include "optim/muon_math.h"

namespace optim {

cublasLtMatrixLayout_t bf16_strided_layout(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t batch,
                                           std::int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, static_cast<std::uint64_t>(rows),
                                          static_cast<std::uint64_t>(cols), ld));
  const auto count = static_cast<std::int32_t>(batch);
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  return layout;
}

cublasLtMatmulAlgo_t first_algorithm(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                     cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                     std::uint64_t workspace_bytes, const std::string& what) {
  cublasLtMatmulPreference_t preference = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
  const cublasStatus_t heuristic =
      status == CUBLAS_STATUS_SUCCESS
          ? cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, d, preference, 1, &result, &found)
          : status;
  (void)cublasLtMatmulPreferenceDestroy(preference);
  CUBLAS_CHECK(heuristic);
  if (found < 1) throw core::Error("cuBLASLt has no algorithm for " + what);
  return result.algo;
}

NewtonSchulzGemms::NewtonSchulzGemms(cublasLtHandle_t handle, std::int64_t r, std::int64_t c, std::int64_t batch)
    : handle_(handle), r_(r), c_(c), batch_(batch) {
  if (r < 1 || r > c || batch < 1 || batch > INT32_MAX) {
    throw core::Error("newton-schulz products: bad shape [" + std::to_string(r) + ", " + std::to_string(c) + "] x " +
                      std::to_string(batch) + " (expected 1 <= rows <= cols, 1 <= batch < 2^31)");
  }
  // Column-major: M = X^T is [c, r] with ld c; A and B are [r, r] with ld r.
  const std::int64_t xs = x_stride(r, c), gs = gram_stride(r);
  make(gram_, {true, c, r, c, xs}, {false, c, r, c, xs}, {false, r, r, r, gs}, 1.0f, 0.0f, "A = X X^T");
  make(poly_, {false, r, r, r, gs}, {false, r, r, r, gs}, {false, r, r, r, gs}, kMuonNsC, kMuonNsB, "B = c A A + b A");
  make(step_, {false, c, r, c, xs}, {true, r, r, r, gs}, {false, c, r, c, xs}, 1.0f, kMuonNsA, "X' = B X + a X");
}

NewtonSchulzGemms::NewtonSchulzGemms(NewtonSchulzGemms&& other) noexcept
    : handle_(other.handle_),
      r_(other.r_),
      c_(other.c_),
      batch_(other.batch_),
      gram_(std::exchange(other.gram_, Product{})),
      poly_(std::exchange(other.poly_, Product{})),
      step_(std::exchange(other.step_, Product{})) {}

NewtonSchulzGemms::~NewtonSchulzGemms() {
  destroy(gram_);
  destroy(poly_);
  destroy(step_);
}

void NewtonSchulzGemms::destroy(Product& p) {
  // Destruction must not throw; these calls only free host memory.
  if (p.d) (void)cublasLtMatrixLayoutDestroy(p.d);
  if (p.c) (void)cublasLtMatrixLayoutDestroy(p.c);
  if (p.b) (void)cublasLtMatrixLayoutDestroy(p.b);
  if (p.a) (void)cublasLtMatrixLayoutDestroy(p.a);
  if (p.desc) (void)cublasLtMatmulDescDestroy(p.desc);
  p = Product{};
}

void NewtonSchulzGemms::make(Product& p, const Operand& a, const Operand& b, const Operand& d, float alpha, float beta,
                             const std::string& what) {
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  p.a = bf16_strided_layout(a.rows, a.cols, a.ld, batch_, a.stride);
  p.b = bf16_strided_layout(b.rows, b.cols, b.ld, batch_, b.stride);
  p.c = bf16_strided_layout(d.rows, d.cols, d.ld, batch_, d.stride);
  p.d = bf16_strided_layout(d.rows, d.cols, d.ld, batch_, d.stride);
  p.alpha = alpha;
  p.beta = beta;
  p.algo = first_algorithm(handle_, p.desc, p.a, p.b, p.c, p.d, 0,
                           "newton-schulz product " + what + " at [" + std::to_string(r_) + ", " + std::to_string(c_) +
                               "] x " + std::to_string(batch_));
}

void NewtonSchulzGemms::run(const Product& p, const void* a, const void* b, const void* c, void* d,
                            cudaStream_t stream) const {
  CUBLAS_CHECK(
      cublasLtMatmul(handle_, p.desc, &p.alpha, a, p.a, b, p.b, &p.beta, c, p.c, d, p.d, &p.algo, nullptr, 0, stream));
}

void NewtonSchulzGemms::iterate(const void* x, void* x_next, void* gram, void* poly, cudaStream_t stream) const {
  run(gram_, x, x, gram, gram, stream);  // beta 0: C is not read
  run(poly_, gram, gram, gram, poly, stream);
  run(step_, x, poly, x, x_next, stream);
}

}  // namespace optim
