// Cross-entropy loss with the lm_head fused in, as Qwen3's causal LM loss:
//   logits = hidden @ W^T,   loss = mean over counted tokens n of (logsumexp(logits[n]) - logits[n, t_n]),
// where a token counts unless its target is kIgnoreIndex (-100). W is the tied embedding table
// or a separate lm_head, [vocab, dim] row-major.
//
// Memory: tokens are processed in chunks of `chunk_tokens` rows; only one chunk's logits
// [chunk_tokens, vocab] exist at a time (in the element type, dot products accumulated in double;
// logsumexp and the loss in double). chunk_tokens = 0 picks max(1, kCrossEntropyChunkLogits / vocab),
// i.e. at most 4 Mi logits (16 MiB in fp32) per chunk. The chunk size changes results only by
// rounding of the summation order in dW.
//
// Layouts (row-major): hidden, dhidden [tokens, dim]; weight, dweight [vocab, dim]; targets [tokens] int32.
// If every target is ignored: loss 0, count 0, dhidden all zeros, dweight unchanged.
//
// GPU (CrossEntropyPlan, linear.h conventions): hidden and weight bf16, dhidden bf16 (written),
// dweight the fp32 gradient (accumulated). Per chunk of tokens:
//   1. logits[chunk, vocab] = hidden_chunk @ W^T by cuBLASLt, fp32 accumulation, stored in bf16;
//   2. one block per row: max and sum of exponentials in fp32 (one pass, a fixed reduction tree),
//      loss = logsumexp - logit[target], and in the backward dlogits = (softmax - onehot) * scale
//      written in bf16 over the logits;
//   3. dhidden_chunk = dlogits @ W (written) and dW += dlogits^T @ hidden_chunk (fp32).
// The logits are stored in bf16, as a PyTorch bf16 model's lm_head output is before its fp32
// loss: half the memory and traffic of fp32, and dlogits (which must be bf16 to be a GEMM operand
// with the bf16 weight) can then overwrite them in place, so the workspace is one bf16 buffer of
// chunk x vocab plus the GEMM workspace. The price is the bf16 rounding of each logit (at most
// 2^-8 relative) in the loss and the softmax: a token's loss moves by at most 2^-7 max_j |logit_j|.
// scale = grad_scale / count, where count is read from device memory by the row kernels (a small
// kernel counts the targets first), so nothing waits for the host. The mean loss is reduced on
// the device in a fixed order. Everything is bit-identical run to run. A target outside
// [0, vocab) that is not the ignore index cannot be reported without a host sync: its loss and
// its dlogits row are NaN (so the loss and every gradient are NaN and the optimizer's non-finite
// check skips the step), and it counts as a counted token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_bf16.h>

#include "core/device.h"
#include "models/ops/linear.h"

namespace models::ops {

inline constexpr std::int32_t kIgnoreIndex = -100;
inline constexpr std::int64_t kCrossEntropyChunkLogits = std::int64_t{1} << 22;

struct CrossEntropyResult {
  double loss = 0.0;       // mean over counted tokens
  std::int64_t count = 0;  // tokens whose target is not kIgnoreIndex
};

// The number of tokens per chunk for `vocab` when `requested` (0 = automatic) is asked for.
std::int64_t cross_entropy_chunk_tokens(std::int64_t vocab, std::int64_t requested);

template <typename Scalar>
CrossEntropyResult cross_entropy_forward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                             std::span<const std::int32_t> targets, std::int64_t dim,
                                             std::int64_t vocab, std::int64_t chunk_tokens = 0);

// Gradients of grad_scale * loss, recomputing each chunk's logits:
//   dlogits = grad_scale * (softmax(logits) - onehot(target)) / count  (zero rows for ignored tokens),
//   dhidden = dlogits @ W (written),  dweight += dlogits^T @ hidden (accumulated).
// Returns the same loss and count as the forward, so a training step needs only this call.
template <typename Scalar>
CrossEntropyResult cross_entropy_backward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                              std::span<const std::int32_t> targets, std::int64_t dim,
                                              std::int64_t vocab, std::span<Scalar> dhidden,
                                              std::span<Scalar> dweight, double grad_scale = 1.0,
                                              std::int64_t chunk_tokens = 0);

// ---- GPU ----

// Default GPU chunk: the bf16 logits of a chunk take at most this many bytes (1 GiB: 3456 tokens
// for Qwen3's vocabulary of 151936; small next to a 0.6B model's activations at T = 2048). Larger chunks trade memory for speed: the weight-gradient
// product (K = chunk) reads and writes the whole fp32 dW once per chunk. Measured on H200 for
// 16384 tokens, dim 1024, vocab 151936 (bench/linear_bench): 39.2 ms at 384 tokens per chunk,
// 31.0 at 768, 29.0 at 1536, 27.6 at 3072, 26.9 at 6144.
inline constexpr std::size_t kCrossEntropyChunkLogitBytes = std::size_t{1} << 30;

// Tokens per GPU chunk: `requested` when positive, else the most tokens whose bf16 logits fit in
// kCrossEntropyChunkLogitBytes, rounded down to a multiple of 128 when at least 128 (whole tiles).
std::int64_t cross_entropy_chunk_tokens_cuda(std::int64_t vocab, std::int64_t requested);

// Workspace bytes a CrossEntropyPlan call needs: the logits of one chunk of
// min(tokens, chunk) rows (bf16, rounded up to 256 bytes) plus linear_workspace_bytes().
std::size_t cross_entropy_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t chunk_tokens = 0);

// Device outputs of a call; all are written.
struct CrossEntropyDeviceOutputs {
  float* token_losses = nullptr;  // [tokens]: logsumexp - logit[target]; 0 for ignored tokens
  float* mean_loss = nullptr;     // [1]: mean of token_losses over counted tokens; 0 when none counts
  std::int32_t* count = nullptr;  // [1]: tokens whose target is not kIgnoreIndex
};

// The fused lm_head + cross-entropy on one device context's stream; holds the GEMM plan (its
// cached cuBLASLt configurations, see LinearPlan) across calls. No allocation, no host sync.
class CrossEntropyPlan {
 public:
  explicit CrossEntropyPlan(const core::DeviceContext& context);

  void forward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
               std::int64_t tokens, std::int64_t dim, std::int64_t vocab, CrossEntropyDeviceOutputs outputs,
               DeviceWorkspace workspace, std::int64_t chunk_tokens = 0);

  // Loss outputs as forward, plus dhidden (bf16, written) and dweight (fp32, +=) of
  // grad_scale * mean loss.
  void backward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
                std::int64_t tokens, std::int64_t dim, std::int64_t vocab, __nv_bfloat16* dhidden, float* dweight,
                float grad_scale, CrossEntropyDeviceOutputs outputs, DeviceWorkspace workspace,
                std::int64_t chunk_tokens = 0);

  const LinearPlan& gemms() const { return gemms_; }

 private:
  void run(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets, std::int64_t tokens,
           std::int64_t dim, std::int64_t vocab, __nv_bfloat16* dhidden, float* dweight, float grad_scale,
           CrossEntropyDeviceOutputs outputs, DeviceWorkspace workspace, std::int64_t chunk_tokens);

  cudaStream_t stream_;
  LinearPlan gemms_;
};

}  // namespace models::ops
