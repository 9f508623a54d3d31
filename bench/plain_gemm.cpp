#include "bench/plain_gemm.h"

#include <string>

#include "core/error.h"
#include "optim/muon_gemm.h"

namespace bench {

PlainGemm::PlainGemm(cublasLtHandle_t handle, const GemmShape& shape) : handle_(handle) {
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  a_ = optim::bf16_strided_layout(shape.m, shape.k, shape.m, shape.batch, shape.stride_a);
  b_ = optim::bf16_strided_layout(shape.k, shape.n, shape.k, shape.batch, shape.stride_b);
  d_ = optim::bf16_strided_layout(shape.m, shape.n, shape.m, shape.batch, shape.stride_d);
  algo_ = optim::first_algorithm(handle_, desc_, a_, b_, d_, d_, kWorkspaceBytes,
                                 "plain product [" + std::to_string(shape.m) + ", " + std::to_string(shape.k) +
                                     "] x [" + std::to_string(shape.k) + ", " + std::to_string(shape.n) + "] x " +
                                     std::to_string(shape.batch));
}

PlainGemm::~PlainGemm() {
  // Destruction must not throw; these calls only free host memory.
  if (d_) (void)cublasLtMatrixLayoutDestroy(d_);
  if (b_) (void)cublasLtMatrixLayoutDestroy(b_);
  if (a_) (void)cublasLtMatrixLayoutDestroy(a_);
  if (desc_) (void)cublasLtMatmulDescDestroy(desc_);
}

void PlainGemm::run(const void* a, const void* b, void* d, void* workspace, cudaStream_t stream) const {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(handle_, desc_, &alpha, a, a_, b, b_, &beta, d, d_, d, d_, &algo_, workspace,
                              kWorkspaceBytes, stream));
}

}  // namespace bench
