// GPU fused lm_head + softmax cross-entropy (cross_entropy.h describes the algorithm): the chunk
// loop on the host side of the stream, the three products through LinearPlan, and three kernels:
// the target count, the per-row softmax pass (loss and in-place dlogits) and the mean loss; for
// the vocabulary-split backward, the tile loop of pass 2 and its elementwise dlogits kernel.
// Every reduction has a fixed order (shuffle trees, then warps in order), so results are
// bit-identical run to run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>

#include "core/error.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/op_checks.h"
#include "core/block_reduce.cuh"

namespace models::ops {
namespace {

constexpr int kRowThreads = 512;
constexpr int kReduceThreads = 1024;
constexpr int kWindowThreads = 256;
constexpr unsigned kMaxGridY = 65535;
constexpr std::size_t kWorkspaceAlignment = 256;

std::size_t round_up(std::size_t bytes, std::size_t multiple) { return (bytes + multiple - 1) / multiple * multiple; }

// The sizes every pass checks: tokens, dim, vocab and its tile size (`tile`, 0: automatic); the
// ids and the count are int32, so vocab and tokens must fit.
void check_sizes(std::string_view op, std::int64_t tokens, std::int64_t dim, std::int64_t vocab, const char* tile,
                 std::int64_t tile_tokens) {
  checks::require_non_negative(op, "tokens", tokens);
  checks::require_positive(op, "dim", dim);
  checks::require_positive(op, "vocab", vocab);
  checks::require_non_negative(op, tile, tile_tokens);
  if (vocab > INT32_MAX) checks::fail(op, "vocab must fit in int32, got " + std::to_string(vocab));
  if (tokens > INT32_MAX) checks::fail(op, "tokens must fit in int32 (the count), got " + std::to_string(tokens));
}

// Running maximum and sum of exp(x - max) over part of a row.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_down_sync(0xFFFFFFFFu, x.max, offset), __shfl_down_sync(0xFFFFFFFFu, x.sum, offset)};
    x = combine(x, other);
  }
  return x;
}

// Adds `count` values (already in fp32) to a running state: one rescale per group.
template <int kCount>
__device__ __forceinline__ MaxSum accumulate(MaxSum state, const float (&values)[kCount]) {
  float group_max = values[0];
#pragma unroll
  for (int i = 1; i < kCount; ++i) group_max = fmaxf(group_max, values[i]);
  const float m = fmaxf(state.max, group_max);
  float sum = state.max == -INFINITY ? 0.0f : state.sum * __expf(state.max - m);
#pragma unroll
  for (int i = 0; i < kCount; ++i) sum += __expf(values[i] - m);
  // NaN in the group: fmaxf ignored it, __expf(NaN - m) did not.
  return {m, sum};
}

__device__ __forceinline__ void unpack8(const uint4& packed, float (&out)[8]) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// The dlogits factor of a counted token: grad_scale / count, 0 when nothing counts, NaN for a
// target outside [0, vocab). Shared by both backward kernels so their dlogits agree.
__device__ __forceinline__ float dlogits_scale(std::int32_t target, std::int64_t vocab, std::int32_t counted,
                                               float grad_scale) {
  const bool valid = target >= 0 && target < vocab;
  return !valid ? NAN : counted > 0 ? grad_scale / static_cast<float>(counted) : 0.0f;
}

// (softmax - onehot) * scale of one logit, before the bf16 rounding.
__device__ __forceinline__ float dlogit(float logit, float lse, bool is_target, float scale) {
  return (__expf(logit - lse) - (is_target ? 1.0f : 0.0f)) * scale;
}

// Rewrites `row` (`width` logits, column `target` being the target's; outside [0, width) when it
// is not in this row) in place as bf16 dlogits, the calling thread taking elements first, first +
// stride, ...; with `ignored` it writes zeros. Both backward kernels use it, so they agree.
// kVector: the row starts 16-byte aligned and width % 8 == 0.
template <bool kVector>
__device__ __forceinline__ void write_dlogits(__nv_bfloat16* row, std::int64_t width, std::int64_t first,
                                              std::int64_t stride, bool ignored, float lse, std::int64_t target,
                                              float scale) {
  if constexpr (kVector) {
    auto* row16 = reinterpret_cast<uint4*>(row);
    for (std::int64_t v = first; v < width / 8; v += stride) {
      if (ignored) {
        row16[v] = make_uint4(0, 0, 0, 0);
        continue;
      }
      float values[8];
      unpack8(row16[v], values);
      uint4 packed;
      auto* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const std::int64_t j = v * 8 + 2 * i;
        pairs[i] = __floats2bfloat162_rn(dlogit(values[2 * i], lse, j == target, scale),
                                         dlogit(values[2 * i + 1], lse, j + 1 == target, scale));
      }
      row16[v] = packed;
    }
  } else {
    for (std::int64_t j = first; j < width; j += stride) {
      row[j] = __float2bfloat16_rn(ignored ? 0.0f : dlogit(__bfloat162float(row[j]), lse, j == target, scale));
    }
  }
}

// One block per row of the chunk's logits. Pass 1: max and sum of exponentials, logsumexp, the
// token's loss (and the logsumexp itself in token_lse when not null). Pass 2 (backward): dlogits =
// (softmax - onehot) * scale over the logits, in bf16.
// kVector: rows start 16-byte aligned and vocab % 8 == 0, so 8 logits per 16-byte access.
template <bool kBackward, bool kVector>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_rows_kernel(__nv_bfloat16* __restrict__ logits, std::int64_t vocab,
                              const std::int32_t* __restrict__ targets, float* __restrict__ token_losses,
                              float* __restrict__ token_lse, const std::int32_t* __restrict__ count, float grad_scale) {
  __shared__ MaxSum warp_states[kRowThreads / 32];
  __shared__ float row_lse;
  __nv_bfloat16* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  const std::int32_t target = targets[blockIdx.x];

  if (target == kIgnoreIndex) {
    if (threadIdx.x == 0) {
      token_losses[blockIdx.x] = 0.0f;
      if (token_lse != nullptr) token_lse[blockIdx.x] = 0.0f;
    }
    if constexpr (kBackward) write_dlogits<kVector>(row, vocab, threadIdx.x, kRowThreads, true, 0.0f, -1, 0.0f);
    return;
  }

  MaxSum state{-INFINITY, 0.0f};
  if constexpr (kVector) {
    const auto* row16 = reinterpret_cast<const uint4*>(row);
    for (std::int64_t v = threadIdx.x; v < vocab / 8; v += kRowThreads) {
      float values[8];
      unpack8(row16[v], values);
      state = accumulate(state, values);
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < vocab; j += kRowThreads) {
      const float values[1] = {__bfloat162float(row[j])};
      state = accumulate(state, values);
    }
  }
  state = warp_combine(state);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_states[warp] = state;
  __syncthreads();
  const bool valid = target >= 0 && target < vocab;
  if (threadIdx.x == 0) {
    MaxSum total = warp_states[0];
    for (int w = 1; w < kRowThreads / 32; ++w) total = combine(total, warp_states[w]);
    const float lse = total.max + logf(total.sum);
    row_lse = lse;
    if (token_lse != nullptr) token_lse[blockIdx.x] = lse;
    // Read before the barrier: pass 2 overwrites the row.
    token_losses[blockIdx.x] = valid ? lse - __bfloat162float(row[target]) : NAN;
  }
  __syncthreads();

  if constexpr (kBackward) {
    const float lse = row_lse;
    const std::int32_t counted = *count;
    const float scale = dlogits_scale(target, vocab, counted, grad_scale);
    write_dlogits<kVector>(row, vocab, threadIdx.x, kRowThreads, false, lse, target, scale);
  }
}

// Pass 2 of the vocabulary-split backward: the logits of a tile of tokens over the vocabulary rows
// [row_begin, row_begin + rows) ([tile, rows], row-major) become, in place, the dlogits the row
// kernel computes, from the logsumexp pass 1 saved. Block (x, y): token x, a slice of its row.
// kVector: rows % 8 == 0 (tile rows start 16-byte aligned in the 256-byte-aligned workspace).
template <bool kVector>
__global__ void __launch_bounds__(kWindowThreads)
    cross_entropy_window_dlogits_kernel(__nv_bfloat16* __restrict__ logits, std::int64_t rows, std::int64_t row_begin,
                                        std::int64_t vocab, const std::int32_t* __restrict__ targets,
                                        const float* __restrict__ token_lse, const std::int32_t* __restrict__ count,
                                        float grad_scale) {
  __nv_bfloat16* row = logits + static_cast<std::int64_t>(blockIdx.x) * rows;
  const std::int32_t target = targets[blockIdx.x];
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * kWindowThreads + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.y) * kWindowThreads;
  if (target == kIgnoreIndex) {
    write_dlogits<kVector>(row, rows, first, stride, true, 0.0f, -1, 0.0f);
    return;
  }
  const float lse = token_lse[blockIdx.x];
  const float scale = dlogits_scale(target, vocab, *count, grad_scale);
  // The target's column in the window (outside [0, rows) when another window holds it).
  write_dlogits<kVector>(row, rows, first, stride, false, lse, static_cast<std::int64_t>(target) - row_begin, scale);
}

// Counts the targets that are not the ignore index (one block; integers, so any order is exact).
__global__ void __launch_bounds__(kReduceThreads)
    count_targets_kernel(const std::int32_t* __restrict__ targets, std::int64_t tokens,
                         std::int32_t* __restrict__ count) {
  __shared__ int scratch[kReduceThreads / 32];
  int local = 0;
  for (std::int64_t n = threadIdx.x; n < tokens; n += kReduceThreads) local += targets[n] != kIgnoreIndex ? 1 : 0;
  const int total = core::block_sum(local, scratch);
  if (threadIdx.x == 0) *count = total;
}

// mean_loss = sum(token_losses) / count, summed in double in a fixed order (one block). With
// kCountTargets it also counts the targets (the forward, which needs no count before).
template <bool kCountTargets>
__global__ void __launch_bounds__(kReduceThreads)
    mean_loss_kernel(const float* __restrict__ token_losses, const std::int32_t* __restrict__ targets,
                     std::int64_t tokens, std::int32_t* __restrict__ count, float* __restrict__ mean_loss) {
  __shared__ double sum_scratch[kReduceThreads / 32];
  __shared__ int count_scratch[kReduceThreads / 32];
  double local_sum = 0.0;
  int local_count = 0;
  for (std::int64_t n = threadIdx.x; n < tokens; n += kReduceThreads) {
    local_sum += static_cast<double>(token_losses[n]);
    if constexpr (kCountTargets) local_count += targets[n] != kIgnoreIndex ? 1 : 0;
  }
  const double sum = core::block_sum(local_sum, sum_scratch);
  if constexpr (kCountTargets) {
    const int total = core::block_sum(local_count, count_scratch);
    if (threadIdx.x == 0) *count = total;
  }
  if (threadIdx.x == 0) {
    // In the backward, count_targets_kernel wrote the count earlier on the stream.
    const std::int32_t counted = *count;
    *mean_loss = counted > 0 ? static_cast<float>(sum / static_cast<double>(counted)) : 0.0f;
  }
}

template <typename Element>
checks::Region device_region(std::string_view op, std::string_view name, const Element* data, std::int64_t elements) {
  if (elements > 0 && data == nullptr) checks::fail(op, std::string(name) + " is null");
  return {name, data, static_cast<std::size_t>(elements) * sizeof(Element)};
}

}  // namespace

std::int64_t cross_entropy_chunk_tokens_cuda(std::int64_t vocab, std::int64_t requested) {
  checks::require_positive("cross_entropy_chunk_tokens_cuda", "vocab", vocab);
  checks::require_non_negative("cross_entropy_chunk_tokens_cuda", "requested", requested);
  if (requested > 0) return requested;
  const auto fit = static_cast<std::int64_t>(kCrossEntropyChunkLogitBytes / (static_cast<std::size_t>(vocab) * 2));
  if (fit >= 128) return fit / 128 * 128;
  return std::max<std::int64_t>(1, fit);
}

std::size_t cross_entropy_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t chunk_tokens) {
  checks::require_non_negative("cross_entropy_workspace_bytes", "tokens", tokens);
  const std::int64_t rows = std::min(tokens, cross_entropy_chunk_tokens_cuda(vocab, chunk_tokens));
  return round_up(static_cast<std::size_t>(rows * vocab) * sizeof(__nv_bfloat16), kWorkspaceAlignment) +
         linear_workspace_bytes();
}

std::int64_t cross_entropy_weight_rows_tile_tokens(std::int64_t tokens, std::int64_t vocab, std::int64_t rows,
                                                   std::int64_t requested) {
  constexpr std::string_view op = "cross_entropy_weight_rows_tile_tokens";
  checks::require_non_negative(op, "tokens", tokens);
  checks::require_positive(op, "vocab", vocab);
  checks::require_positive(op, "rows", rows);
  checks::require_non_negative(op, "requested", requested);
  if (requested > 0) return requested;
  // The logits part of cross_entropy_workspace_bytes(tokens, vocab, 0), in elements.
  const std::size_t capacity =
      (cross_entropy_workspace_bytes(tokens, vocab, 0) - linear_workspace_bytes()) / sizeof(__nv_bfloat16);
  const auto fit = static_cast<std::int64_t>(capacity / static_cast<std::size_t>(rows));
  if (fit >= tokens) return std::max<std::int64_t>(1, tokens);
  if (fit >= 128) return fit / 128 * 128;
  return std::max<std::int64_t>(1, fit);
}

std::size_t cross_entropy_weight_rows_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t rows,
                                                      std::int64_t tile_tokens) {
  const std::int64_t tile = std::min(tokens, cross_entropy_weight_rows_tile_tokens(tokens, vocab, rows, tile_tokens));
  return round_up(static_cast<std::size_t>(tile * rows) * sizeof(__nv_bfloat16), kWorkspaceAlignment) +
         linear_workspace_bytes();
}

CrossEntropyPlan::CrossEntropyPlan(const core::DeviceContext& context) : stream_(context.stream()), gemms_(context) {}

void CrossEntropyPlan::forward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
                               std::int64_t tokens, std::int64_t dim, std::int64_t vocab,
                               CrossEntropyDeviceOutputs outputs, DeviceWorkspace workspace,
                               std::int64_t chunk_tokens) {
  run("cross_entropy_forward (cuda)", hidden, weight, targets, tokens, dim, vocab, false, nullptr, nullptr, nullptr,
      0.0f, outputs, workspace, chunk_tokens);
}

void CrossEntropyPlan::backward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const std::int32_t* targets,
                                std::int64_t tokens, std::int64_t dim, std::int64_t vocab, __nv_bfloat16* dhidden,
                                float* dweight, float grad_scale, CrossEntropyDeviceOutputs outputs,
                                DeviceWorkspace workspace, std::int64_t chunk_tokens) {
  constexpr std::string_view op = "cross_entropy_backward (cuda)";
  if (dweight == nullptr) checks::fail(op, "dweight is null");
  run(op, hidden, weight, targets, tokens, dim, vocab, true, dhidden, dweight, nullptr, grad_scale, outputs, workspace,
      chunk_tokens);
}

void CrossEntropyPlan::backward_hidden(const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                                       const std::int32_t* targets, std::int64_t tokens, std::int64_t dim,
                                       std::int64_t vocab, __nv_bfloat16* dhidden, float grad_scale,
                                       CrossEntropyDeviceOutputs outputs, float* token_lse, DeviceWorkspace workspace,
                                       std::int64_t chunk_tokens) {
  constexpr std::string_view op = "cross_entropy_backward_hidden (cuda)";
  if (token_lse == nullptr && tokens > 0) checks::fail(op, "token_lse is null");
  run(op, hidden, weight, targets, tokens, dim, vocab, true, dhidden, nullptr, token_lse, grad_scale, outputs,
      workspace, chunk_tokens);
}

void CrossEntropyPlan::run(std::string_view op, const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                           const std::int32_t* targets, std::int64_t tokens, std::int64_t dim, std::int64_t vocab,
                           bool backward, __nv_bfloat16* dhidden, float* dweight, float* token_lse, float grad_scale,
                           CrossEntropyDeviceOutputs outputs, DeviceWorkspace workspace, std::int64_t chunk_tokens) {
  if (backward) {
    if (dhidden == nullptr && tokens > 0) checks::fail(op, "dhidden is null");
    if (!std::isfinite(grad_scale)) checks::fail(op, "grad_scale must be finite, got " + std::to_string(grad_scale));
  }
  check_sizes(op, tokens, dim, vocab, "chunk_tokens", chunk_tokens);
  const std::size_t needed = cross_entropy_workspace_bytes(tokens, vocab, chunk_tokens);
  if (workspace.data == nullptr || workspace.bytes < needed) {
    checks::fail(op, "needs a workspace of cross_entropy_workspace_bytes(" + std::to_string(tokens) + ", " +
                         std::to_string(vocab) + ", " + std::to_string(chunk_tokens) + ") = " + std::to_string(needed) +
                         " bytes, got " + std::to_string(workspace.bytes) + (workspace.data ? "" : " (null)"));
  }
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % kWorkspaceAlignment != 0) {
    checks::fail(op, "workspace is not 256-byte aligned");
  }
  if (outputs.mean_loss == nullptr || outputs.count == nullptr)
    checks::fail(op, "mean_loss and count must not be null");
  const checks::Region losses = device_region(op, "token_losses", outputs.token_losses, tokens);
  const checks::Region mean = device_region(op, "mean_loss", outputs.mean_loss, 1);
  const checks::Region counted = device_region(op, "count", outputs.count, 1);
  const checks::Region hidden_region = device_region(op, "hidden", hidden, tokens * dim);
  const checks::Region weight_region = device_region(op, "weight", weight, vocab * dim);
  const checks::Region targets_region = device_region(op, "targets", targets, tokens);
  const checks::Region scratch{"workspace", workspace.data, workspace.bytes};
  const checks::Region dhidden_region = device_region(op, "dhidden", dhidden, backward ? tokens * dim : 0);
  const checks::Region dweight_region = device_region(op, "dweight", dweight, dweight != nullptr ? vocab * dim : 0);
  const checks::Region lse_region = device_region(op, "token_lse", token_lse, token_lse != nullptr ? tokens : 0);
  checks::require_disjoint(op, {losses, mean, counted, dhidden_region, dweight_region, lse_region, scratch},
                           {hidden_region, weight_region, targets_region});

  const std::int64_t chunk =
      std::max<std::int64_t>(1, std::min(tokens, cross_entropy_chunk_tokens_cuda(vocab, chunk_tokens)));
  auto* logits = static_cast<__nv_bfloat16*>(workspace.data);
  const std::size_t logits_bytes =
      round_up(static_cast<std::size_t>(std::min(tokens, chunk) * vocab) * sizeof(__nv_bfloat16), kWorkspaceAlignment);
  const DeviceWorkspace gemm_workspace{static_cast<char*>(workspace.data) + logits_bytes,
                                       workspace.bytes - logits_bytes};
  // 16-byte row accesses: the workspace is 256-byte aligned, so rows are aligned when vocab % 8 == 0.
  const bool vector = vocab % 8 == 0;

  if (backward) {
    count_targets_kernel<<<1, kReduceThreads, 0, stream_>>>(targets, tokens, outputs.count);
    CUDA_CHECK_LAUNCH("count_targets_kernel");
  }
  for (std::int64_t first = 0; first < tokens; first += chunk) {
    const std::int64_t rows = std::min(chunk, tokens - first);
    const __nv_bfloat16* hidden_chunk = hidden + first * dim;
    float* lse_chunk = token_lse != nullptr ? token_lse + first : nullptr;
    gemms_.forward(hidden_chunk, weight, rows, dim, vocab, logits, gemm_workspace);
    const auto grid = static_cast<unsigned>(rows);
    if (backward) {
      if (vector) {
        cross_entropy_rows_kernel<true, true><<<grid, kRowThreads, 0, stream_>>>(
            logits, vocab, targets + first, outputs.token_losses + first, lse_chunk, outputs.count, grad_scale);
      } else {
        cross_entropy_rows_kernel<true, false><<<grid, kRowThreads, 0, stream_>>>(
            logits, vocab, targets + first, outputs.token_losses + first, lse_chunk, outputs.count, grad_scale);
      }
      CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel (backward)");
      gemms_.backward_input(logits, weight, rows, dim, vocab, dhidden + first * dim, gemm_workspace, GradOutput::write);
      // backward_hidden leaves the weight gradient to backward_weight_rows.
      if (dweight != nullptr) gemms_.backward_weight(logits, hidden_chunk, rows, dim, vocab, dweight, gemm_workspace);
    } else {
      if (vector) {
        cross_entropy_rows_kernel<false, true><<<grid, kRowThreads, 0, stream_>>>(
            logits, vocab, targets + first, outputs.token_losses + first, lse_chunk, outputs.count, 0.0f);
      } else {
        cross_entropy_rows_kernel<false, false><<<grid, kRowThreads, 0, stream_>>>(
            logits, vocab, targets + first, outputs.token_losses + first, lse_chunk, outputs.count, 0.0f);
      }
      CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel (forward)");
    }
  }
  if (backward) {
    mean_loss_kernel<false>
        <<<1, kReduceThreads, 0, stream_>>>(outputs.token_losses, targets, tokens, outputs.count, outputs.mean_loss);
  } else {
    mean_loss_kernel<true>
        <<<1, kReduceThreads, 0, stream_>>>(outputs.token_losses, targets, tokens, outputs.count, outputs.mean_loss);
  }
  CUDA_CHECK_LAUNCH("mean_loss_kernel");
}

void CrossEntropyPlan::backward_weight_rows(const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                                            const std::int32_t* targets, const float* token_lse,
                                            const std::int32_t* count, std::int64_t tokens, std::int64_t dim,
                                            std::int64_t vocab, std::int64_t row_begin, std::int64_t row_end,
                                            float* dweight_rows, float grad_scale, DeviceWorkspace workspace,
                                            std::int64_t tile_tokens) {
  constexpr std::string_view op = "cross_entropy_backward_weight_rows (cuda)";
  check_sizes(op, tokens, dim, vocab, "tile_tokens", tile_tokens);
  if (row_begin < 0 || row_begin >= row_end || row_end > vocab) {
    checks::fail(op, "rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) +
                         ") must be a non-empty range within the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  if (!std::isfinite(grad_scale)) checks::fail(op, "grad_scale must be finite, got " + std::to_string(grad_scale));
  const std::int64_t rows = row_end - row_begin;
  const std::size_t needed = cross_entropy_weight_rows_workspace_bytes(tokens, vocab, rows, tile_tokens);
  if (workspace.data == nullptr || workspace.bytes < needed) {
    checks::fail(op, "needs a workspace of cross_entropy_weight_rows_workspace_bytes(" + std::to_string(tokens) + ", " +
                         std::to_string(vocab) + ", " + std::to_string(rows) + ", " + std::to_string(tile_tokens) +
                         ") = " + std::to_string(needed) + " bytes, got " + std::to_string(workspace.bytes) +
                         (workspace.data ? "" : " (null)"));
  }
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % kWorkspaceAlignment != 0) {
    checks::fail(op, "workspace is not 256-byte aligned");
  }
  const checks::Region hidden_region = device_region(op, "hidden", hidden, tokens * dim);
  const checks::Region weight_region = device_region(op, "weight", weight, vocab * dim);
  const checks::Region targets_region = device_region(op, "targets", targets, tokens);
  const checks::Region lse_region = device_region(op, "token_lse", token_lse, tokens);
  const checks::Region count_region = device_region(op, "count", count, 1);
  const checks::Region dweight_region = device_region(op, "dweight_rows", dweight_rows, rows * dim);
  const checks::Region scratch{"workspace", workspace.data, workspace.bytes};
  checks::require_disjoint(op, {dweight_region, scratch},
                           {hidden_region, weight_region, targets_region, lse_region, count_region});

  const std::int64_t tile = std::min(tokens, cross_entropy_weight_rows_tile_tokens(tokens, vocab, rows, tile_tokens));
  auto* logits = static_cast<__nv_bfloat16*>(workspace.data);
  const std::size_t logits_bytes =
      round_up(static_cast<std::size_t>(tile * rows) * sizeof(__nv_bfloat16), kWorkspaceAlignment);
  const DeviceWorkspace gemm_workspace{static_cast<char*>(workspace.data) + logits_bytes,
                                       workspace.bytes - logits_bytes};
  const __nv_bfloat16* window = weight + row_begin * dim;
  // 16-byte accesses when every tile row starts 16-byte aligned.
  const bool vector = rows % 8 == 0;
  const std::int64_t units = vector ? rows / 8 : rows;
  const auto slices =
      static_cast<unsigned>(std::min<std::int64_t>(kMaxGridY, (units + kWindowThreads - 1) / kWindowThreads));

  for (std::int64_t first = 0; first < tokens; first += tile) {
    const std::int64_t n = std::min(tile, tokens - first);
    const __nv_bfloat16* hidden_tile = hidden + first * dim;
    gemms_.forward(hidden_tile, window, n, dim, rows, logits, gemm_workspace);
    const dim3 grid(static_cast<unsigned>(n), slices);
    if (vector) {
      cross_entropy_window_dlogits_kernel<true><<<grid, kWindowThreads, 0, stream_>>>(
          logits, rows, row_begin, vocab, targets + first, token_lse + first, count, grad_scale);
    } else {
      cross_entropy_window_dlogits_kernel<false><<<grid, kWindowThreads, 0, stream_>>>(
          logits, rows, row_begin, vocab, targets + first, token_lse + first, count, grad_scale);
    }
    CUDA_CHECK_LAUNCH("cross_entropy_window_dlogits_kernel");
    gemms_.backward_weight(logits, hidden_tile, n, dim, rows, dweight_rows, gemm_workspace);
  }
}

}  // namespace models::ops
