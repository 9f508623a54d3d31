// The matrix products of Newton-Schulz on the GPU, for every matrix of one shape at once: bf16
// operands, fp32 accumulation and scaling, bf16 results, as cuBLASLt strided-batched products.
// Matrix X_b (b < batch) is [r, c] row-major with r <= c, batch after batch; one iteration is
//   A = X X^T;   B = c A A + b A;   X' = B X + a X
// (in cuBLASLt's column-major terms M = X^T: A = M^T M, X'^T = M B^T + a M). The descriptors
// and algorithms are chosen once, on construction, so an iteration allocates nothing and can be
// captured in a CUDA graph; every cuBLASLt status is checked.
#pragma once

#include <cstdint>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace optim {

class NewtonSchulzGemms {
 public:
  NewtonSchulzGemms(cublasLtHandle_t handle, std::int64_t r, std::int64_t c, std::int64_t batch);
  ~NewtonSchulzGemms();
  NewtonSchulzGemms(const NewtonSchulzGemms&) = delete;
  NewtonSchulzGemms& operator=(const NewtonSchulzGemms&) = delete;
  NewtonSchulzGemms(NewtonSchulzGemms&& other) noexcept;
  NewtonSchulzGemms& operator=(NewtonSchulzGemms&&) = delete;

  // One iteration from `x` into `x_next` (batch x r x c bf16 each), with `gram` and `poly` as
  // scratch (batch x r x r bf16 each).
  void iterate(const void* x, void* x_next, void* gram, void* poly, cudaStream_t stream) const;

 private:
  // One product D = alpha op(A) op(B) + beta C, its descriptors and algorithm.
  struct Product {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    float alpha = 1.0f, beta = 0.0f;
  };
  void make(Product& p, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
            std::int64_t ldb, std::int64_t ldd, float alpha, float beta, const std::string& what);
  void run(const Product& p, const void* a, const void* b, const void* c, void* d, cudaStream_t stream) const;
  static void destroy(Product& p);

  cublasLtHandle_t handle_;
  std::int64_t r_, c_, batch_;
  Product gram_{}, poly_{}, step_{};
};

}  // namespace optim
