// A plain bf16 matrix product through cuBLASLt, the yardstick of another product's rate on the
// same GPU: column-major D [m, n] = A [m, k] B [k, n], no transposes, alpha 1, beta 0, bf16
// operands and result, fp32 accumulation, `batch` products strided; cuBLASLt's first heuristic
// choice with a workspace, as a plain call to the library would get. Every status is checked.
#pragma once

#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace bench {

struct GemmShape {
  std::int64_t m = 0, n = 0, k = 0, batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_d = 0;  // elements between a batch's matrices
  double flop() const {
    return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * static_cast<double>(batch);
  }
};

class PlainGemm {
 public:
  static constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

  PlainGemm(cublasLtHandle_t handle, const GemmShape& shape);
  ~PlainGemm();
  PlainGemm(const PlainGemm&) = delete;
  PlainGemm& operator=(const PlainGemm&) = delete;

  // `workspace`: kWorkspaceBytes of device memory.
  void run(const void* a, const void* b, void* d, void* workspace, cudaStream_t stream) const;

 private:
  cublasLtHandle_t handle_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

}  // namespace bench
