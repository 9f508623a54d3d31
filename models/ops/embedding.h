// Token embedding: a gather of table rows, and its backward, a scatter-add of output gradients
// into the table's gradient. With tie_word_embeddings the lm_head reads the same table, so the
// loss also accumulates into this gradient range; the backward therefore adds, never overwrites.
//
// Layouts (row-major): ids [N] int32, table and dtable [V, D], out and dout [N, D].
//
// CUDA kernels (embedding.cu): the table is the slab's bf16 mirror, out and dout are bf16, and
// dtable is the slab's fp32 gradient (accumulated). Out-of-range ids cannot throw on the device:
// they are clamped into [0, V) (negative -> 0, >= V -> V - 1) in both directions, so nothing is
// read or written out of bounds, and the kernel stores 1 into `*invalid_id_flag` (when not null).
// The caller zeroes the flag once and reads it whenever it synchronises anyway.
// The backward is deterministic without floating-point atomics: a stable device radix sort (CUB)
// groups token positions by id, keeping token order inside a group; windows of 64 sorted
// positions sum their runs of equal ids in fp32, runs inside a window go straight into dtable and
// runs crossing a window edge are finished by a second pass that adds the window partials in
// window order. Cost: the sort (one pass over the N (id, position) int32 pairs per 8 bits of
// ceil(log2 V), 3 passes for Qwen3's vocabulary), one read of dout, one read-modify-write of the
// used dtable rows, and 2 * ceil(N / 64) * D fp32 partials written and read once.
//
// Row windows (ZeRO-2 with sharded gradients, where the full fp32 dtable never exists): the
// backward splits into a sort, done once per step, and scatters that each add the runs whose id
// lies in [row_begin, row_end) into a buffer holding just those rows. Every run is summed exactly
// as in the full backward, so scatters over windows covering [0, V) give bit-identical rows to one
// full-range scatter. The in-window ids are one contiguous range of sorted positions: a scatter's
// blocks whose 64 sorted ids all lie outside the window leave after reading two ids, and the
// positions of out-of-window runs load no dout rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

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

// The same for rows [row_begin, row_end) only, 0 <= row_begin <= row_end <= V: dtable_rows holds
// those rows ((row_end - row_begin) * dim elements, row r at (r - row_begin) * dim) and gets what
// the full version adds to them, bit for bit; tokens of other ids are skipped (but all ids must
// still lie in [0, V)). An empty window is a no-op.
template <typename Scalar>
void embedding_backward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> dout, std::int64_t vocab,
                            std::int64_t dim, std::int64_t row_begin, std::int64_t row_end,
                            std::span<Scalar> dtable_rows);

// out[n, :] = table[clamp(ids[n]), :] on `stream`. All pointers are device memory.
void embedding_forward_cuda(const std::int32_t* ids, std::int64_t tokens, const __nv_bfloat16* table,
                            std::int64_t vocab, std::int64_t dim, __nv_bfloat16* out, std::int32_t* invalid_id_flag,
                            cudaStream_t stream);

// Bytes of device workspace the backward needs for these sizes (0 when tokens == 0): for
// embedding_backward_cuda, and for the sort and the scatters of the windowed backward alike.
std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t dim);

// dtable[clamp(ids[n]), :] += dout[n, :] (fp32, deterministic, see above) on `stream`; rows of
// unused ids are not touched. `workspace` holds at least embedding_backward_workspace_bytes bytes,
// 256-byte aligned (cudaMalloc memory is). The same as embedding_backward_sort_cuda followed by
// embedding_backward_scatter_cuda over rows [0, vocab).
void embedding_backward_cuda(const std::int32_t* ids, std::int64_t tokens, const __nv_bfloat16* dout,
                             std::int64_t vocab, std::int64_t dim, float* dtable, std::int32_t* invalid_id_flag,
                             void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// Windowed backward, phase 1, on `stream`: clamps the ids (raising `*invalid_id_flag` as above)
// and stable-sorts the (id, token) pairs into the leading, "sorted" part of `workspace` (the
// workspace of embedding_backward_workspace_bytes(tokens, vocab, dim) for the dim the scatters
// use; the sort checks that its own part fits). No-op when tokens == 0.
void embedding_backward_sort_cuda(const std::int32_t* ids, std::int64_t tokens, std::int64_t vocab,
                                  std::int32_t* invalid_id_flag, void* workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream);

// Windowed backward, phase 2, on `stream`: for every id r in [row_begin, row_end) (0 <= row_begin
// <= row_end <= vocab), dtable_rows[(r - row_begin) * dim + :] += the sum of dout[n, :] over tokens
// with clamp(ids[n]) == r; nothing else of dtable_rows (nor any other row) is touched, and an
// empty window is a no-op. Reads the sorted pairs the last embedding_backward_sort_cuda left in
// the same workspace, with the same tokens and vocab: the workspace must not be written between
// that sort and its scatters (the scatters themselves only write its partials part, which is
// scratch per call, so scatters sharing a workspace must be ordered, e.g. on one stream).
void embedding_backward_scatter_cuda(std::int64_t tokens, const __nv_bfloat16* dout, std::int64_t vocab,
                                     std::int64_t dim, std::int64_t row_begin, std::int64_t row_end, float* dtable_rows,
                                     void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace models::ops
