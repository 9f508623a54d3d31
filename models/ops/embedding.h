// Token embedding: a gather of table rows, and its backward, a scatter-add of output gradients
// into the table's gradient. With tie_word_embeddings the lm_head reads the same table, so the
// loss also accumulates into this gradient range; the backward therefore adds, never overwrites.
//
// Layouts (row-major): ids [N] int32, table and dtable [V, D], out and dout [N, D].
#pragma once

#include <cstdint>
#include <span>

namespace models::ops {

// out[n, :] = table[ids[n], :]. Throws core::Error naming the first id outside [0, V).
template <typename Scalar>
void embedding_forward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> table, std::int64_t vocab,
                           std::int64_t dim, std::span<Scalar> out);

// dtable[v, :] += sum over n with ids[n] == v of dout[n, :], summed in double in token order
// (deterministic whatever the thread count). Rows of unused ids are left untouched.
template <typename Scalar>
void embedding_backward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> dout, std::int64_t vocab,
                            std::int64_t dim, std::span<Scalar> dtable);

}  // namespace models::ops
