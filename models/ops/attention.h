// Causal grouped-query attention (Qwen3), softmax scale 1 / sqrt(head_dim):
//   S[i, j] = scale * q_i . k_j for j <= i,   P = softmax_j(S),   out_i = sum_j P[i, j] v_j,
// where query head h reads key/value head h / (q_heads / kv_heads). The forward also returns the
// log-sum-exp of every score row, lse_i = log sum_{j <= i} exp(S[i, j]), which is all a
// flash-style backward needs to recompute P = exp(S - lse) without storing it.
//
// Layouts (row-major): q, out, dout, dq [batch, seq, q_heads, head_dim];
// k, v, dk, dv [batch, seq, kv_heads, head_dim]; lse [batch, q_heads, seq].
// Dot products, softmax and weighted sums are evaluated in double; the reference holds one
// score row (seq values) per thread, never a seq x seq matrix.
//
// The CUDA versions (attention.cu) take bf16 tensors as raw 16-bit words, accumulate in fp32 on
// the tensor cores and never materialise a seq x seq matrix. q, k, v and dq, dk, dv are token-strided
// views so that they can be slices of packed qkv / dqkv rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

namespace models::ops {

struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::int64_t q_heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
};

template <typename Scalar>
void attention_forward_cpu(const AttentionShape& shape, std::span<const Scalar> q, std::span<const Scalar> k,
                           std::span<const Scalar> v, std::span<Scalar> out, std::span<Scalar> lse);

// One query row of attention_forward_cpu, for the CPU decoders too: the scores scale * q . k_j in
// double for keys j = 0..last (key j at k + j * kv_stride, its value at v + j * kv_stride), their
// softmax, and the weighted sum of the values into out[0, dim). `weights` (last + 1 doubles) and
// `acc` (dim) are scratch. Returns the row's log-sum-exp of the scores.
template <typename Scalar>
double attention_row_cpu(const Scalar* q, const Scalar* k, const Scalar* v, std::int64_t kv_stride, std::int64_t last,
                         std::int64_t dim, double scale, double* weights, double* acc, Scalar* out);

// From dout and the forward's out and lse: with D_i = dout_i . out_i, dP[i, j] = dout_i . v_j and
// dS = P * (dP - D_i):  dq_i = scale * sum_j dS[i, j] k_j,  dk_j = scale * sum_i dS[i, j] q_i,
// dv_j = sum_i P[i, j] dout_i, the key/value sums running over every query head of the group.
// dq, dk and dv are written (not accumulated).
template <typename Scalar>
void attention_backward_cpu(const AttentionShape& shape, std::span<const Scalar> q, std::span<const Scalar> k,
                            std::span<const Scalar> v, std::span<const Scalar> out, std::span<const Scalar> lse,
                            std::span<const Scalar> dout, std::span<Scalar> dq, std::span<Scalar> dk,
                            std::span<Scalar> dv);

// A bf16 [batch, seq, heads, head_dim] device tensor whose consecutive tokens lie `token_stride`
// elements apart: heads * head_dim when dense, (q_heads + 2 * kv_heads) * head_dim for a slice of a
// packed qkv buffer [batch * seq, (q_heads + 2 * kv_heads) * head_dim]. `data` must be 16-byte
// aligned and `token_stride` a multiple of 8 of at least heads * head_dim.
template <typename Word>
struct TokenStrided {
  Word* data = nullptr;
  std::int64_t token_stride = 0;
};
using AttentionInput = TokenStrided<const std::uint16_t>;
using AttentionGradient = TokenStrided<std::uint16_t>;

// CUDA forward, head_dim 64 or 128: out is dense bf16 [batch, seq, q_heads, head_dim], lse fp32
// [batch, q_heads, seq] (natural log). Asynchronous on `stream`; allocates nothing, never syncs.
// `variant` picks a tile configuration; -1: the fastest measured one that fits the device's shared
// memory (see attention_cuda_variant_name).
void attention_forward_cuda(const AttentionShape& shape, AttentionInput q, AttentionInput k, AttentionInput v,
                            std::uint16_t* out, float* lse, cudaStream_t stream, int variant = -1);

// Bytes of device workspace attention_backward_cuda needs for `shape` (per-row softmax terms).
std::size_t attention_backward_workspace_bytes(const AttentionShape& shape);

// CUDA backward from the forward's out and lse and the dense bf16 dout [batch, seq, q_heads,
// head_dim]: writes dq, dk, dv (bf16, token-strided, not accumulated). Deterministic: every output
// element is summed in a fixed order by one thread, so reruns are bit-identical. `workspace` holds at
// least attention_backward_workspace_bytes(shape) bytes, 16-byte aligned. Asynchronous on `stream`.
void attention_backward_cuda(const AttentionShape& shape, AttentionInput q, AttentionInput k, AttentionInput v,
                             const std::uint16_t* out, const float* lse, const std::uint16_t* dout,
                             AttentionGradient dq, AttentionGradient dk, AttentionGradient dv, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream, int variant = -1);

// The tile configurations the CUDA kernels can run with, for benchmarks and tests: how many there
// are for a head dim, a name for each (block sizes and warps per block) and the shared memory a
// block of it needs. Variant -1 names the one the calls above choose on the current device.
// A variant may need a particular GPU (the wgmma ones: Hopper and a build with sm_90a code); the
// calls above run an unavailable one only when asked for it by number.
int attention_cuda_variant_count(std::int64_t head_dim, bool backward);
const char* attention_cuda_variant_name(std::int64_t head_dim, bool backward, int variant);
std::size_t attention_cuda_variant_smem_bytes(std::int64_t head_dim, bool backward, int variant);
bool attention_cuda_variant_available(std::int64_t head_dim, bool backward, int variant);

}  // namespace models::ops
