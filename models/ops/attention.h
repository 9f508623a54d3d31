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
#pragma once

#include <cstdint>
#include <span>

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

// From dout and the forward's out and lse: with D_i = dout_i . out_i, dP[i, j] = dout_i . v_j and
// dS = P * (dP - D_i):  dq_i = scale * sum_j dS[i, j] k_j,  dk_j = scale * sum_i dS[i, j] q_i,
// dv_j = sum_i P[i, j] dout_i, the key/value sums running over every query head of the group.
// dq, dk and dv are written (not accumulated).
template <typename Scalar>
void attention_backward_cpu(const AttentionShape& shape, std::span<const Scalar> q, std::span<const Scalar> k,
                            std::span<const Scalar> v, std::span<const Scalar> out, std::span<const Scalar> lse,
                            std::span<const Scalar> dout, std::span<Scalar> dq, std::span<Scalar> dk,
                            std::span<Scalar> dv);

}  // namespace models::ops
