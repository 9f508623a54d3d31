// Linear layer without bias (every projection of Qwen3): y = x @ W^T with W stored [out, in]
// row-major, as torch.nn.Linear. Two implementations: the CPU reference (templated, products
// accumulated in double by matmul_cpu.h) and the GPU one (LinearPlan, cuBLASLt).
//
// Layouts (row-major): x, dx [rows, in_features]; weight, dweight [out_features, in_features];
// y, dy [rows, out_features].
//
// GPU conventions (the whole GPU model follows them): activations and their gradients are bf16;
// the weight is the slab's bf16 mirror; the weight gradient is the slab's fp32 gradient and is
// accumulated (+=), so gradient accumulation over micro-batches needs no extra pass. Products
// run on tensor cores with fp32 accumulation (CUBLAS_COMPUTE_32F), rounded once to the output type.
//
// Determinism: results are bit-identical run to run on one GPU model. Heuristic choices are
// cached per shape and pointer alignment, every call gets the caller's workspace (no library-owned
// workspace shared between streams), and the heuristic is restricted to split-K reduction schemes
// NONE and COMPUTE_TYPE (partial sums in fp32 in the workspace, added in a fixed order by a
// separate step); the INPLACE scheme (partials added into the output through counters) and the
// OUTPUT_TYPE scheme (partials rounded to bf16) are excluded.
//
// Alignment: cuBLASLt takes any leading dimension and any 2-byte-aligned bf16 pointer (4 bytes
// for fp32), so odd feature counts and row offsets into larger buffers are valid; the alignment
// each pointer actually has is passed to the heuristic (it is part of the cache key), so the
// chosen kernel never assumes more. Misaligned pointers and shapes with no cuBLASLt algorithm are
// rejected with core::Error naming the shape. The workspace must be 256-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_bf16.h>

#include "core/device.h"

namespace models::ops {

template <typename Scalar>
void linear_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows,
                        std::int64_t in_features, std::int64_t out_features, std::span<Scalar> y);

// dx = dy @ W (written); dweight += dy^T @ x (accumulated).
template <typename Scalar>
void linear_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                         std::int64_t rows, std::int64_t in_features, std::int64_t out_features, std::span<Scalar> dx,
                         std::span<Scalar> dweight);

// ---- GPU (cuBLASLt) ----

// Caller-owned device scratch memory for one call (256-byte aligned, e.g. from cudaMalloc).
struct DeviceWorkspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// Whether a gradient output is overwritten or added to (gradient accumulation).
enum class GradOutput { write, accumulate };

// The cuBLASLt workspace every LinearPlan call needs (32 MiB, PyTorch's size on Hopper): the
// heuristic may pick split-K kernels that keep fp32 partial sums there.
inline constexpr std::size_t kLinearWorkspaceBytes = std::size_t{32} << 20;
std::size_t linear_workspace_bytes();

namespace detail {
class GemmCache;
}

// The GPU linear layer on one device context's stream and cuBLASLt handle. It caches, per shape
// and pointer alignment, the matmul descriptor, matrix layouts and the algorithm the heuristic
// chose at the first call; later calls with that shape create nothing, allocate nothing and never
// wait for the device, so they can be captured in a CUDA graph. The first call of a shape must not
// happen during a stream capture (it is rejected with core::Error): run one step before capturing.
// One model holds one plan for all its projections. Not thread-safe. The context must outlive it.
class LinearPlan {
 public:
  explicit LinearPlan(const core::DeviceContext& context);
  ~LinearPlan();
  LinearPlan(LinearPlan&& other) noexcept;
  LinearPlan& operator=(LinearPlan&& other) noexcept;
  LinearPlan(const LinearPlan&) = delete;
  LinearPlan& operator=(const LinearPlan&) = delete;

  // y = x @ W^T (bf16, written).
  void forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows, std::int64_t in_features,
               std::int64_t out_features, __nv_bfloat16* y, DeviceWorkspace workspace);

  // dx = dy @ W (bf16), written or, with GradOutput::accumulate, added to the existing dx by the
  // GEMM epilogue (beta = 1). cuBLASLt does not promise one rounding of that sum: measured on
  // H200, some kernels round the product to bf16 before adding, so the result is within
  // 2^-8 (|dx| + |dy W|) of the exact sum (two roundings) rather than 2^-8 |dx + dy W|.
  void backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* weight, std::int64_t rows, std::int64_t in_features,
                      std::int64_t out_features, __nv_bfloat16* dx, DeviceWorkspace workspace,
                      GradOutput dx_mode = GradOutput::write);

  // dweight += dy^T @ x (fp32, accumulated: beta = 1 on the fp32 gradient).
  void backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, std::int64_t rows, std::int64_t in_features,
                       std::int64_t out_features, float* dweight, DeviceWorkspace workspace);

  // backward_input then backward_weight.
  void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows,
                std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* dx, float* dweight,
                DeviceWorkspace workspace, GradOutput dx_mode = GradOutput::write);

  // Number of cached product configurations (shape, transposition, output type, alignments).
  std::size_t cached_configurations() const;

 private:
  std::unique_ptr<detail::GemmCache> gemms_;
};

}  // namespace models::ops
