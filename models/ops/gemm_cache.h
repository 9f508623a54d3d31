// The cuBLASLt product cache behind every GPU matrix product of the models (ops::LinearPlan and
// the E29a recurrence): one column-major product D = op(A) op(B) (+ D) with fp32 compute, A and B
// of one type (bf16 or fp32), D fp32 or bf16. Per shape, types and pointer alignment it keeps the
// matmul descriptor, the matrix layouts and the algorithm cuBLASLt's heuristic chose at the first
// call, so a steady-state call is a map lookup plus one cublasLtMatmul: nothing created, nothing
// allocated, no wait for the device, capturable in a CUDA graph (the first call of a shape inside
// a capture is refused). Split-K only with the deterministic reduction schemes NONE |
// COMPUTE_TYPE and true fp32 compute (no TF32): results are bit-identical run to run on one GPU
// model. The caller's workspace is 256-byte aligned, kLinearWorkspaceBytes long.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "models/ops/linear.h"

namespace models::ops::detail {

// One column-major product D = alpha * op(A) op(B) + beta * C with C = D, as cuBLASLt sees it.
struct GemmShape {
  cublasOperation_t trans_a;
  cublasOperation_t trans_b;
  std::int64_t m, n, k;
  std::int64_t lda, ldb, ldd;
  cudaDataType_t d_type;
  bool accumulate;                       // beta = 1 (C = D read) instead of beta = 0
  cudaDataType_t ab_type = CUDA_R_16BF;  // A and B
};

class GemmCache {
 public:
  // `owner` names the caller in error messages.
  GemmCache(cublasLtHandle_t handle, cudaStream_t stream, std::string owner);
  ~GemmCache();
  GemmCache(const GemmCache&) = delete;
  GemmCache& operator=(const GemmCache&) = delete;

  void run(const GemmShape& shape, const void* a, const void* b, void* d, DeviceWorkspace workspace);
  std::size_t size() const { return entries_.size(); }

 private:
  using Key = std::array<std::int64_t, 14>;
  // Owns the descriptors of one cached configuration.
  struct Entry {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::size_t workspace_bytes = 0;

    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    Entry(Entry&& other) noexcept
        : desc(std::exchange(other.desc, nullptr)),
          a(std::exchange(other.a, nullptr)),
          b(std::exchange(other.b, nullptr)),
          d(std::exchange(other.d, nullptr)),
          algo(other.algo),
          workspace_bytes(other.workspace_bytes) {}
    Entry& operator=(Entry&&) = delete;
    ~Entry() {
      // Destruction must not throw; these calls only free host memory.
      if (d) (void)cublasLtMatrixLayoutDestroy(d);
      if (b) (void)cublasLtMatrixLayoutDestroy(b);
      if (a) (void)cublasLtMatrixLayoutDestroy(a);
      if (desc) (void)cublasLtMatmulDescDestroy(desc);
    }
  };
  Entry create(const GemmShape& s, const std::array<std::uint32_t, 3>& alignments);

  cublasLtHandle_t handle_;
  cudaStream_t stream_;
  std::string owner_;
  std::map<Key, Entry> entries_;
};

}  // namespace models::ops::detail
