// The matrix products of Newton-Schulz on the GPU, for every matrix of one shape at once: bf16
// operands, fp32 accumulation and scaling, bf16 results, as cuBLASLt strided-batched products.
// Matrix X_b (b < batch) is [r, c] row-major with r <= c, at X + b * x_stride(r, c); one iteration is
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

// A column-major bf16 [rows, cols] layout with leading dimension ld, `batch` matrices `stride`
// elements apart.
cublasLtMatrixLayout_t bf16_strided_layout(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t batch,
                                           std::int64_t stride);
// cuBLASLt's first heuristic choice for D = op(A) op(B) (+ C) within `workspace_bytes`; throws
// core::Error naming `what` when it has none.
cublasLtMatmulAlgo_t first_algorithm(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                     cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                     std::uint64_t workspace_bytes, const std::string& what);

class NewtonSchulzGemms {
 public:
  NewtonSchulzGemms(cublasLtHandle_t handle, std::int64_t r, std::int64_t c, std::int64_t batch);
  ~NewtonSchulzGemms();
  NewtonSchulzGemms(const NewtonSchulzGemms&) = delete;
  NewtonSchulzGemms& operator=(const NewtonSchulzGemms&) = delete;
  NewtonSchulzGemms(NewtonSchulzGemms&& other) noexcept;
  NewtonSchulzGemms& operator=(NewtonSchulzGemms&&) = delete;

  // One iteration from `x` into `x_next` (batch x x_stride(r, c) bf16 each), with `gram` and `poly`
  // as scratch (batch x gram_stride(r) bf16 each). Every pointer 256-byte aligned.
  void iterate(const void* x, void* x_next, void* gram, void* poly, cudaStream_t stream) const;

  // Elements from one matrix of a batch to the next: r * c (r * r for the Gram matrices) rounded up
  // to 128, so every matrix starts 256-byte aligned as cuBLASLt's fastest kernels want.
  static std::int64_t x_stride(std::int64_t r, std::int64_t c) { return padded(r * c); }
  static std::int64_t gram_stride(std::int64_t r) { return padded(r * r); }

 private:
  // One product D = alpha op(A) op(B) + beta C, its descriptors and algorithm.
  struct Product {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    float alpha = 1.0f, beta = 0.0f;
  };
  // A stored operand (column-major, before op): [rows, cols] with leading dimension ld, the batch's
  // matrices `stride` elements apart.
  struct Operand {
    bool transposed;
    std::int64_t rows, cols, ld, stride;
  };
  void make(Product& p, const Operand& a, const Operand& b, const Operand& d, float alpha, float beta,
            const std::string& what);
  void run(const Product& p, const void* a, const void* b, const void* c, void* d, cudaStream_t stream) const;
  static void destroy(Product& p);
  static std::int64_t padded(std::int64_t n) { return (n + 127) / 128 * 128; }

  cublasLtHandle_t handle_;
  std::int64_t r_, c_, batch_;
  Product gram_{}, poly_{}, step_{};
};

}  // namespace optim
