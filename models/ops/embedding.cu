// CUDA kernels of the token embedding (bf16 table and activations, fp32 table gradient).
// Forward: a gather, one 16-byte copy per thread when rows allow it. Backward: a deterministic
// scatter-add (see embedding.h): clamp ids and number the tokens, stable radix sort of
// (id, token) pairs, per-window run sums, then a pass that finishes the runs crossing windows.
// The last two only write rows of one row window, so a sort can serve many windows.
#include <cub/device/device_radix_sort.cuh>

#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/ops/embedding.h"
#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

using gpu::ceil_div;

constexpr int kCopyThreads = 256;
constexpr int kBackwardThreads = 128;
constexpr int kWindow = 64;  // sorted token positions per backward window
constexpr std::size_t kAlignment = 256;

__device__ __forceinline__ std::int64_t clamp_id(std::int32_t id, std::int64_t vocab, std::int32_t* invalid_id_flag) {
  if (id < 0 || id >= vocab) {
    if (invalid_id_flag != nullptr) *invalid_id_flag = 1;
    return id < 0 ? 0 : vocab - 1;
  }
  return id;
}

template <int Vec>
__global__ void __launch_bounds__(kCopyThreads)
    embedding_forward_kernel(const std::int32_t* __restrict__ ids, std::int64_t tokens,
                             const __nv_bfloat16* __restrict__ table, std::int64_t vocab, std::int64_t dim,
                             __nv_bfloat16* __restrict__ out, std::int32_t* invalid_id_flag) {
  gpu::for_each_chunk<Vec>(tokens, dim, [&](std::int64_t n, std::int64_t column) {
    const std::int64_t id = clamp_id(ids[n], vocab, column == 0 ? invalid_id_flag : nullptr);
    const __nv_bfloat16* src = table + id * dim + column;
    __nv_bfloat16* dst = out + n * dim + column;
    if constexpr (Vec == gpu::kVector) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      *dst = *src;
    }
  });
}

// Sort input: clamped ids as keys, token indices as values.
__global__ void __launch_bounds__(kCopyThreads)
    embedding_sort_input_kernel(const std::int32_t* __restrict__ ids, std::int64_t tokens, std::int64_t vocab,
                                std::uint32_t* __restrict__ keys, std::int32_t* __restrict__ positions,
                                std::int32_t* invalid_id_flag) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < tokens; n += stride) {
    keys[n] = static_cast<std::uint32_t>(clamp_id(ids[n], vocab, invalid_id_flag));
    positions[n] = static_cast<std::int32_t>(n);
  }
}

// The table gradient rows [row_begin, row_end) being written: row r at rows + (r - row_begin) * dim.
struct RowWindow {
  float* rows;
  std::uint32_t row_begin;
  std::uint32_t row_end;

  __device__ __forceinline__ bool holds(std::uint32_t id) const { return id - row_begin < row_end - row_begin; }
  __device__ __forceinline__ float* row(std::uint32_t id, std::int64_t dim) const {
    return rows + static_cast<std::int64_t>(id - row_begin) * dim;
  }
};

// One block per (window of kWindow sorted positions, column tile). Each run of equal ids is summed
// in sorted (= token) order. A run that neither starts at the window's first position nor ends at
// its last lies wholly inside this window, so its id appears nowhere else: it is added to dtable
// directly. The run holding the first position goes to partial slot 0, the run holding the last
// position (when it is another run) to slot 1. Only runs of ids in the row window are summed and
// written (the slots of other runs hold zeros nobody reads); a window whose ids all lie outside
// the row window returns at once (its slots are never read either: a run of an in-window id
// continues only into windows holding that id).
template <int Vec>
__global__ void __launch_bounds__(kBackwardThreads)
    embedding_backward_window_kernel(const std::uint32_t* __restrict__ sorted_ids,
                                     const std::int32_t* __restrict__ sorted_tokens, std::int64_t tokens,
                                     const __nv_bfloat16* __restrict__ dout, std::int64_t dim, RowWindow dtable,
                                     float* __restrict__ partials) {
  __shared__ std::uint32_t window_ids[kWindow];
  __shared__ std::int32_t window_tokens[kWindow];
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kWindow;
  const int count = static_cast<int>(tokens - begin < kWindow ? tokens - begin : kWindow);
  // Sorted ids: the window's ids span [first, last]. Uniform across the block, before any barrier.
  if (sorted_ids[begin + count - 1] < dtable.row_begin || sorted_ids[begin] >= dtable.row_end) return;
  for (int p = threadIdx.x; p < count; p += blockDim.x) {
    window_ids[p] = sorted_ids[begin + p];
    window_tokens[p] = sorted_tokens[begin + p];
  }
  __syncthreads();
  const std::int64_t column = (static_cast<std::int64_t>(blockIdx.y) * kBackwardThreads + threadIdx.x) * Vec;
  if (column >= dim) return;

  float* slot0 = partials + (2 * static_cast<std::int64_t>(blockIdx.x)) * dim + column;
  float* slot1 = slot0 + dim;
  float acc[Vec];
#pragma unroll
  for (int k = 0; k < Vec; ++k) acc[k] = 0.0f;
  bool first_run = true;
  for (int p = 0; p < count; ++p) {
    if (p > 0 && window_ids[p] != window_ids[p - 1]) {
      if (first_run) {
        gpu::store_float<Vec>(slot0, acc);
        first_run = false;
      } else if (dtable.holds(window_ids[p - 1])) {
        gpu::add_to_float<Vec>(dtable.row(window_ids[p - 1], dim) + column, acc);
      }
#pragma unroll
      for (int k = 0; k < Vec; ++k) acc[k] = 0.0f;
    }
    if (!dtable.holds(window_ids[p])) continue;
    float row[Vec];
    gpu::load_bf16<Vec>(dout + static_cast<std::int64_t>(window_tokens[p]) * dim + column, row);
#pragma unroll
    for (int k = 0; k < Vec; ++k) acc[k] += row[k];
  }
  gpu::store_float<Vec>(first_run ? slot0 : slot1, acc);
}

// Adds slot 0 of the windows after `window` for as long as they continue the run of `id`.
template <int Vec>
__device__ __forceinline__ void continue_run(const std::uint32_t* sorted_ids, std::int64_t tokens, std::int64_t windows,
                                             std::int64_t window, std::uint32_t id, const float* partials,
                                             std::int64_t dim, std::int64_t column, float (&acc)[Vec]) {
  for (std::int64_t next = window + 1; next < windows; ++next) {
    const std::int64_t begin = next * kWindow;
    if (sorted_ids[begin] != id) return;
    float part[Vec];
    gpu::load_float<Vec>(partials + (2 * next) * dim + column, part);
#pragma unroll
    for (int k = 0; k < Vec; ++k) acc[k] += part[k];
    const std::int64_t last = (begin + kWindow < tokens ? begin + kWindow : tokens) - 1;
    if (sorted_ids[last] != id) return;
  }
}

// One block per (window, column tile): finishes the runs of ids in the row window that start in
// this window and touch one of its edges, adding the partials of the following windows in window
// order.
template <int Vec>
__global__ void __launch_bounds__(kBackwardThreads)
    embedding_backward_combine_kernel(const std::uint32_t* __restrict__ sorted_ids, std::int64_t tokens,
                                      std::int64_t windows, const float* __restrict__ partials, std::int64_t dim,
                                      RowWindow dtable) {
  const std::int64_t window = blockIdx.x;
  const std::int64_t column = (static_cast<std::int64_t>(blockIdx.y) * kBackwardThreads + threadIdx.x) * Vec;
  if (column >= dim) return;
  const std::int64_t begin = window * kWindow;
  const std::int64_t last = (begin + kWindow < tokens ? begin + kWindow : tokens) - 1;
  const std::uint32_t first_id = sorted_ids[begin];
  const std::uint32_t last_id = sorted_ids[last];

  if (dtable.holds(first_id) && (window == 0 || sorted_ids[begin - 1] != first_id)) {
    float acc[Vec];
    gpu::load_float<Vec>(partials + (2 * window) * dim + column, acc);
    if (first_id == last_id)
      continue_run<Vec>(sorted_ids, tokens, windows, window, first_id, partials, dim, column, acc);
    gpu::add_to_float<Vec>(dtable.row(first_id, dim) + column, acc);
  }
  if (first_id != last_id && dtable.holds(last_id)) {
    float acc[Vec];
    gpu::load_float<Vec>(partials + (2 * window + 1) * dim + column, acc);
    continue_run<Vec>(sorted_ids, tokens, windows, window, last_id, partials, dim, column, acc);
    gpu::add_to_float<Vec>(dtable.row(last_id, dim) + column, acc);
  }
}

std::size_t align_up(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// Radix bits that cover every id in [0, vocab).
int id_bits(std::int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (std::int64_t{1} << bits) < vocab) ++bits;
  return bits;
}

// The backward's workspace: first the sort's part (keys and values in and out, CUB's storage), which
// depends on tokens and vocab only, so the sort can place it without knowing dim; the sorted
// keys_out and positions_out must survive until the last scatter. Then the window partials,
// scratch of each scatter.
struct BackwardWorkspace {
  std::uint32_t* keys_in = nullptr;
  std::uint32_t* keys_out = nullptr;
  std::int32_t* positions_in = nullptr;
  std::int32_t* positions_out = nullptr;
  void* sort_storage = nullptr;
  float* partials = nullptr;
  std::size_t sort_bytes = 0;
  std::size_t sort_part_bytes = 0;
  std::size_t total_bytes = 0;
};

// dim = 0 plans the sort's part only (no partials).
BackwardWorkspace plan_workspace(std::int64_t tokens, std::int64_t vocab, std::int64_t dim, void* base) {
  BackwardWorkspace w;
  if (tokens == 0) return w;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    // No GPU to ask (a memory plan made on a machine without one): an estimate of CUB's storage,
    // its alternate key and value buffers plus 1 MiB of histograms and tile state.
    (void)cudaGetLastError();
    w.sort_bytes = static_cast<std::size_t>(tokens) * 2 * (sizeof(std::uint32_t) + sizeof(std::int32_t)) + (1 << 20);
  } else {
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, w.sort_bytes, static_cast<const std::uint32_t*>(nullptr), static_cast<std::uint32_t*>(nullptr),
        static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), static_cast<int>(tokens), 0,
        id_bits(vocab)));
  }
  auto* bytes = static_cast<std::byte*>(base);
  std::size_t offset = 0;
  auto take = [&](std::size_t size) {
    std::byte* p = bytes == nullptr ? nullptr : bytes + offset;
    offset += align_up(size);
    return p;
  };
  const auto n = static_cast<std::size_t>(tokens);
  w.keys_in = reinterpret_cast<std::uint32_t*>(take(n * sizeof(std::uint32_t)));
  w.keys_out = reinterpret_cast<std::uint32_t*>(take(n * sizeof(std::uint32_t)));
  w.positions_in = reinterpret_cast<std::int32_t*>(take(n * sizeof(std::int32_t)));
  w.positions_out = reinterpret_cast<std::int32_t*>(take(n * sizeof(std::int32_t)));
  w.sort_storage = take(w.sort_bytes);
  w.sort_part_bytes = offset;
  const auto windows = static_cast<std::size_t>(ceil_div(tokens, kWindow));
  w.partials = reinterpret_cast<float*>(take(2 * windows * static_cast<std::size_t>(dim) * sizeof(float)));
  w.total_bytes = offset;
  return w;
}

void check_sizes(std::string_view op, std::int64_t tokens, std::int64_t vocab, std::int64_t dim) {
  checks::require_non_negative(op, "tokens", tokens);
  checks::require_positive(op, "vocab", vocab);
  checks::require_positive(op, "dim", dim);
  if (tokens > INT32_MAX) checks::fail(op, "tokens must be below 2^31, got " + std::to_string(tokens));
  if (vocab > INT32_MAX) checks::fail(op, "vocab must be below 2^31, got " + std::to_string(vocab));
}

void require_pointer(std::string_view op, std::string_view name, const void* pointer) {
  if (pointer == nullptr) checks::fail(op, std::string(name) + " must not be null");
}

// The workspace holds `needed` bytes and is aligned.
void check_workspace(std::string_view op, const void* workspace, std::size_t workspace_bytes, std::size_t needed) {
  if (workspace_bytes < needed) {
    checks::fail(op, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(needed) +
                         " (embedding_backward_workspace_bytes)");
  }
  require_pointer(op, "workspace", workspace);
  if (reinterpret_cast<std::uintptr_t>(workspace) % kAlignment != 0)
    checks::fail(op, "workspace must be 256-byte aligned");
}

// Phase 1 (sizes and workspace already checked, tokens > 0).
void launch_sort(const std::int32_t* ids, std::int64_t tokens, std::int64_t vocab, std::int32_t* invalid_id_flag,
                 const BackwardWorkspace& w, cudaStream_t stream) {
  embedding_sort_input_kernel<<<gpu::grid_for(tokens, kCopyThreads), kCopyThreads, 0, stream>>>(
      ids, tokens, vocab, w.keys_in, w.positions_in, invalid_id_flag);
  CUDA_CHECK_LAUNCH("embedding_sort_input_kernel");
  std::size_t sort_bytes = w.sort_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.sort_storage, sort_bytes, w.keys_in, w.keys_out, w.positions_in,
                                             w.positions_out, static_cast<int>(tokens), 0, id_bits(vocab), stream));
}

// The launch shape of phase 2: one block per (window, column tile), 16-byte accesses when rows allow.
// Both widths sum every element in the same order, so the choice does not change the result.
struct ScatterShape {
  bool vector;
  dim3 grid;
};

ScatterShape scatter_shape(std::string_view op, std::int64_t tokens, const __nv_bfloat16* dout, std::int64_t dim,
                           const float* dtable_rows) {
  const bool vector = dim % gpu::kVector == 0 && gpu::aligned_16(dout) && gpu::aligned_16(dtable_rows);
  const std::int64_t tiles = ceil_div(dim, kBackwardThreads * (vector ? gpu::kVector : 1));
  if (tiles > 65535) checks::fail(op, "dim " + std::to_string(dim) + " is too large");
  return {vector, dim3(static_cast<unsigned int>(ceil_div(tokens, kWindow)), static_cast<unsigned int>(tiles))};
}

// Phase 2 (sizes, window and workspace already checked, tokens > 0, window not empty).
void launch_scatter(const ScatterShape& shape, std::int64_t tokens, const __nv_bfloat16* dout, std::int64_t dim,
                    std::int64_t row_begin, std::int64_t row_end, float* dtable_rows, const BackwardWorkspace& w,
                    cudaStream_t stream) {
  const std::int64_t windows = ceil_div(tokens, kWindow);
  const dim3 grid = shape.grid;
  const RowWindow rows{dtable_rows, static_cast<std::uint32_t>(row_begin), static_cast<std::uint32_t>(row_end)};
  if (shape.vector) {
    embedding_backward_window_kernel<gpu::kVector>
        <<<grid, kBackwardThreads, 0, stream>>>(w.keys_out, w.positions_out, tokens, dout, dim, rows, w.partials);
    CUDA_CHECK_LAUNCH("embedding_backward_window_kernel");
    embedding_backward_combine_kernel<gpu::kVector>
        <<<grid, kBackwardThreads, 0, stream>>>(w.keys_out, tokens, windows, w.partials, dim, rows);
  } else {
    embedding_backward_window_kernel<1>
        <<<grid, kBackwardThreads, 0, stream>>>(w.keys_out, w.positions_out, tokens, dout, dim, rows, w.partials);
    CUDA_CHECK_LAUNCH("embedding_backward_window_kernel");
    embedding_backward_combine_kernel<1>
        <<<grid, kBackwardThreads, 0, stream>>>(w.keys_out, tokens, windows, w.partials, dim, rows);
  }
  CUDA_CHECK_LAUNCH("embedding_backward_combine_kernel");
}

void check_row_window(std::string_view op, std::int64_t vocab, std::int64_t row_begin, std::int64_t row_end) {
  if (row_begin < 0 || row_begin > row_end || row_end > vocab) {
    checks::fail(op, "row window [" + std::to_string(row_begin) + ", " + std::to_string(row_end) +
                         ") is not inside [0, vocab = " + std::to_string(vocab) + ")");
  }
}

}  // namespace

void embedding_forward_cuda(const std::int32_t* ids, std::int64_t tokens, const __nv_bfloat16* table,
                            std::int64_t vocab, std::int64_t dim, __nv_bfloat16* out, std::int32_t* invalid_id_flag,
                            cudaStream_t stream) {
  check_sizes("embedding_forward_cuda", tokens, vocab, dim);
  if (tokens == 0) return;
  if (dim % gpu::kVector == 0 && gpu::aligned_16(table) && gpu::aligned_16(out)) {
    embedding_forward_kernel<gpu::kVector>
        <<<gpu::grid_for(tokens * (dim / gpu::kVector), kCopyThreads), kCopyThreads, 0, stream>>>(
            ids, tokens, table, vocab, dim, out, invalid_id_flag);
  } else {
    embedding_forward_kernel<1><<<gpu::grid_for(tokens * dim, kCopyThreads), kCopyThreads, 0, stream>>>(
        ids, tokens, table, vocab, dim, out, invalid_id_flag);
  }
  CUDA_CHECK_LAUNCH("embedding_forward_kernel");
}

std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t dim) {
  check_sizes("embedding_backward_workspace_bytes", tokens, vocab, dim);
  return plan_workspace(tokens, vocab, dim, nullptr).total_bytes;
}

void embedding_backward_cuda(const std::int32_t* ids, std::int64_t tokens, const __nv_bfloat16* dout,
                             std::int64_t vocab, std::int64_t dim, float* dtable, std::int32_t* invalid_id_flag,
                             void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  constexpr std::string_view op = "embedding_backward_cuda";
  check_sizes(op, tokens, vocab, dim);
  if (tokens == 0) return;
  const BackwardWorkspace w = plan_workspace(tokens, vocab, dim, workspace);
  check_workspace(op, workspace, workspace_bytes, w.total_bytes);
  require_pointer(op, "ids", ids);
  require_pointer(op, "dout", dout);
  require_pointer(op, "dtable", dtable);
  const ScatterShape shape = scatter_shape(op, tokens, dout, dim, dtable);
  launch_sort(ids, tokens, vocab, invalid_id_flag, w, stream);
  launch_scatter(shape, tokens, dout, dim, 0, vocab, dtable, w, stream);
}

void embedding_backward_sort_cuda(const std::int32_t* ids, std::int64_t tokens, std::int64_t vocab,
                                  std::int32_t* invalid_id_flag, void* workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream) {
  constexpr std::string_view op = "embedding_backward_sort_cuda";
  check_sizes(op, tokens, vocab, 1);
  if (tokens == 0) return;
  const BackwardWorkspace w = plan_workspace(tokens, vocab, 0, workspace);
  check_workspace(op, workspace, workspace_bytes, w.sort_part_bytes);
  require_pointer(op, "ids", ids);
  launch_sort(ids, tokens, vocab, invalid_id_flag, w, stream);
}

void embedding_backward_scatter_cuda(std::int64_t tokens, const __nv_bfloat16* dout, std::int64_t vocab,
                                     std::int64_t dim, std::int64_t row_begin, std::int64_t row_end, float* dtable_rows,
                                     void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  constexpr std::string_view op = "embedding_backward_scatter_cuda";
  check_sizes(op, tokens, vocab, dim);
  check_row_window(op, vocab, row_begin, row_end);
  if (tokens == 0 || row_begin == row_end) return;
  const BackwardWorkspace w = plan_workspace(tokens, vocab, dim, workspace);
  check_workspace(op, workspace, workspace_bytes, w.total_bytes);
  require_pointer(op, "dout", dout);
  require_pointer(op, "dtable_rows", dtable_rows);
  launch_scatter(scatter_shape(op, tokens, dout, dim, dtable_rows), tokens, dout, dim, row_begin, row_end, dtable_rows,
                 w, stream);
}

}  // namespace models::ops
