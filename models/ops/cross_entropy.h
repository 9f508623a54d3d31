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
//
// Vocabulary-split backward (ZeRO-2 with sharded gradients; CrossEntropyPlan::backward_hidden and
// backward_weight_rows): the same gradients without the whole fp32 dW at once. Pass 1 does all of
// the above but the dW product and saves each token's logsumexp; pass 2 produces dW in windows
// of vocabulary rows, each final, by recomputing the window's logits (one extra forward GEMM of
// tokens x vocab x dim in all) and their dlogits from the saved logsumexp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

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

// `token_losses` (empty, or [tokens]): each token's loss, logsumexp - logit[target] (0 for ignored).
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                             std::span<const std::int32_t> targets, std::int64_t dim,
                                             std::int64_t vocab, std::int64_t chunk_tokens = 0,
                                             std::span<float> token_losses = {});

// Gradients of grad_scale * loss, recomputing each chunk's logits:
//   dlogits = grad_scale * (softmax(logits) - onehot(target)) / count  (zero rows for ignored tokens),
//   dhidden = dlogits @ W (written),  dweight += dlogits^T @ hidden (accumulated).
// Returns the same loss and count as the forward, so a training step needs only this call.
template <typename Scalar>
CrossEntropyResult cross_entropy_backward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                              std::span<const std::int32_t> targets, std::int64_t dim,
                                              std::int64_t vocab, std::span<Scalar> dhidden, std::span<Scalar> dweight,
                                              double grad_scale = 1.0, std::int64_t chunk_tokens = 0);

// The weight gradient restricted to the vocabulary rows [row_begin, row_end) (the reference for
// CrossEntropyPlan::backward_weight_rows):
//   dweight_rows[r - row_begin, k] += sum_n dlogits[n, r] * hidden[n, k],  row_begin <= r < row_end,
// with dlogits as above. dweight_rows is [(row_end - row_begin), dim]. Rows are computed as
// cross_entropy_backward_cpu computes them (same chunks, same order over tokens), so windows
// that partition [0, vocab) together give its dweight.
template <typename Scalar>
void cross_entropy_backward_weight_rows_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                            std::span<const std::int32_t> targets, std::int64_t dim, std::int64_t vocab,
                                            std::int64_t row_begin, std::int64_t row_end,
                                            std::span<Scalar> dweight_rows, double grad_scale = 1.0,
                                            std::int64_t chunk_tokens = 0);

// ---- GPU ----

// Default GPU chunk: the bf16 logits of a chunk take at most this many bytes (1 GiB: 3456 tokens
// for Qwen3's vocabulary of 151936; small next to a 0.6B model's activations at T = 2048). Larger chunks trade memory
// for speed: the weight-gradient product (K = chunk) reads and writes the whole fp32 dW once per chunk. Measured on
// H200 for 16384 tokens, dim 1024, vocab 151936 (bench/linear_bench): 39.2 ms at 384 tokens per chunk, 31.0 at
// 768, 29.0 at 1536, 27.6 at 3072, 26.9 at 6144.
inline constexpr std::size_t kCrossEntropyChunkLogitBytes = std::size_t{1} << 30;

// Tokens per GPU chunk: `requested` when positive, else the most tokens whose bf16 logits fit in
// kCrossEntropyChunkLogitBytes, rounded down to a multiple of 128 when at least 128 (whole tiles).
std::int64_t cross_entropy_chunk_tokens_cuda(std::int64_t vocab, std::int64_t requested);

// Workspace bytes a CrossEntropyPlan call needs: the logits of one chunk of
// min(tokens, chunk) rows (bf16, rounded up to 256 bytes) plus linear_workspace_bytes().
std::size_t cross_entropy_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t chunk_tokens = 0);

// Tokens per tile of CrossEntropyPlan::backward_weight_rows for a window of `rows` vocabulary rows:
// `requested` when positive, else the most tokens whose bf16 logits [tile, rows] fit the logits
// part of cross_entropy_workspace_bytes(tokens, vocab, 0): all tokens when they fit, else rounded
// down to a multiple of 128 when at least 128 (at least 1).
std::int64_t cross_entropy_weight_rows_tile_tokens(std::int64_t tokens, std::int64_t vocab, std::int64_t rows,
                                                   std::int64_t requested = 0);

// Workspace bytes backward_weight_rows needs: the logits of one tile of min(tokens, tile) tokens
// by `rows` (bf16, rounded up to 256 bytes) plus linear_workspace_bytes(). With the automatic tile
// it is at most cross_entropy_workspace_bytes(tokens, vocab, 0), the fused path's workspace.
std::size_t cross_entropy_weight_rows_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t rows,
                                                      std::int64_t tile_tokens = 0);

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

  // ---- Vocabulary-split backward (ZeRO-2 with sharded gradients) ----
  // backward() needs the whole fp32 dweight [vocab, dim] at once (every chunk of tokens adds to
  // every row). These two passes produce the same gradients with dweight in windows of
  // vocabulary rows, each final when its call's work is done, so a window can be reduced across
  // ranks and its staging buffer reused for the next window:
  //   pass 1, backward_hidden: backward() without dweight, saving each token's logsumexp;
  //   pass 2, backward_weight_rows, once per window [row_begin, row_end) of any partition of
  //     [0, vocab), in any order: recomputes the window's logits from hidden and the window's
  //     weight rows and turns them into dlogits with the saved logsumexp.
  // Cost: every logit is computed twice, i.e. one extra forward GEMM of tokens x vocab x dim on
  // top of backward()'s three, plus one elementwise pass over the logits; memory is a window of
  // dweight instead of all of it. Measured on H200 for 16384 tokens, dim 1024, vocab 151936:
  // backward() 23.8 ms; backward_hidden 18.6 ms + backward_weight_rows over 1, 2, 4 or 8 windows
  // 17.6-18.0 ms = 36.5 ms (1.54x).
  // Each new (tile, window rows) shape adds GEMM configurations to the plan's cache (LinearPlan):
  // run a step before capturing a CUDA graph, as for backward().
  // Results: dlogits equal backward()'s up to the bf16 rounding of the recomputed logits (a
  // product of another shape may round an fp32 sum to the neighbouring bf16), and dW is summed
  // over tokens in another order, so dweight equals backward()'s up to rounding.

  // Pass 1: loss outputs, count and dhidden bit-identical to backward()'s with the same
  // chunk_tokens (same kernels and products, minus the dW product), plus token_lse [tokens]
  // (fp32, written): each token's logsumexp over its bf16 logits, 0 for ignored tokens. Same
  // workspace as backward().
  void backward_hidden(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
                       std::int64_t tokens, std::int64_t dim, std::int64_t vocab, __nv_bfloat16* dhidden,
                       float grad_scale, CrossEntropyDeviceOutputs outputs, float* token_lse, DeviceWorkspace workspace,
                       std::int64_t chunk_tokens = 0);

  // Pass 2, for vocabulary rows [row_begin, row_end) (0 <= row_begin < row_end <= vocab):
  //   dweight_rows[r - row_begin, k] += sum_n dlogits[n, r] * hidden[n, k]   (fp32, beta = 1),
  // dweight_rows being [(row_end - row_begin), dim]. Per tile of tokens: logits[tile, rows] =
  // hidden_tile @ weight[row_begin:row_end]^T (bf16), then in place dlogits = bf16((exp(logit -
  // token_lse[n]) - onehot) * scale) with backward()'s scale and arithmetic (grad_scale / *count,
  // 0 when the count is 0, zero rows for ignored tokens, NaN rows for invalid targets), then the
  // dW product. token_lse and count are pass 1's outputs for the same inputs; grad_scale must be
  // pass 1's. tile_tokens: see cross_entropy_weight_rows_tile_tokens (0 = automatic, so a
  // workspace of cross_entropy_workspace_bytes(tokens, vocab, 0) always suffices); the exact
  // requirement is cross_entropy_weight_rows_workspace_bytes. Speed: with a window width that is
  // not a multiple of 8 the tile's logits rows are not 16-byte aligned and cuBLASLt picks kernels
  // ~20x slower (measured on H200: 9217 rows 22 ms, 9216 rows 1.05 ms); callers pick widths of a
  // multiple of 128 where they can.
  void backward_weight_rows(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
                            const float* token_lse, const std::int32_t* count, std::int64_t tokens, std::int64_t dim,
                            std::int64_t vocab, std::int64_t row_begin, std::int64_t row_end, float* dweight_rows,
                            float grad_scale, DeviceWorkspace workspace, std::int64_t tile_tokens = 0);

  const LinearPlan& gemms() const { return gemms_; }

 private:
  // The chunk loop of forward (backward false), backward and backward_hidden (dweight null).
  // token_lse, when not null, receives each token's logsumexp.
  void run(std::string_view op, const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
           std::int64_t tokens, std::int64_t dim, std::int64_t vocab, bool backward, __nv_bfloat16* dhidden,
           float* dweight, float* token_lse, float grad_scale, CrossEntropyDeviceOutputs outputs,
           DeviceWorkspace workspace, std::int64_t chunk_tokens);

  cudaStream_t stream_;
  LinearPlan gemms_;
};

}  // namespace models::ops
