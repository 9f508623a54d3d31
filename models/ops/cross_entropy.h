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
#pragma once

#include <cstdint>
#include <span>

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

}  // namespace models::ops
