// CUDA kernels of RMSNorm and the per-head RMSNorm (bf16 activations, fp32 statistics and weight
// gradient). One row group per row for the forward and for dx; dweight is a two-launch fixed-order
// reduction over row chunks (see rmsnorm.h), whose first launch also makes dx for rows of 256 to
// 1,024 features (one pass over x and dy instead of two). Rows may be strided tokens of
// [tokens, heads, dim].
#include <algorithm>

#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/ops/column_sums.cuh"
#include "models/ops/op_checks.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rmsnorm_math.cuh"

namespace models::ops {
namespace {

using gpu::ceil_div;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr std::int64_t kMinChunkRows = 32;  // rows per dweight partial, at least
constexpr std::int64_t kMaxChunks = 512;    // dweight partials per column, at most

// Where row r of a [tokens, heads, dim] tensor starts when tokens are token_stride elements apart.
struct RowAddress {
  std::int64_t heads;
  std::int64_t dim;
  std::int64_t token_stride;
  __device__ __forceinline__ std::int64_t operator()(std::int64_t row) const {
    if (heads == 1) return row * token_stride;
    const std::int64_t token = row / heads;
    return token * token_stride + (row - token * heads) * dim;
  }
};

struct Chunking {
  std::int64_t rows_per_chunk = 0;
  std::int64_t chunks = 0;
};

Chunking chunking(std::int64_t rows) {
  Chunking c;
  if (rows == 0) return c;
  c.rows_per_chunk = std::max(kMinChunkRows, ceil_div(rows, kMaxChunks));
  c.chunks = ceil_div(rows, c.rows_per_chunk);
  return c;
}

template <int Vec, int Lanes>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(const __nv_bfloat16* __restrict__ x, RowAddress x_at,
                           const __nv_bfloat16* __restrict__ weight, std::int64_t rows, int dim, float eps,
                           __nv_bfloat16* __restrict__ y, RowAddress y_at, float* __restrict__ rstd) {
  const int lane = threadIdx.x % Lanes;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kThreads / Lanes) + threadIdx.x / Lanes;
  const bool active = row < rows;
  const int vectors = dim / Vec;
  const __nv_bfloat16* x_row = x + (active ? x_at(row) : 0);

  float sum_sq = 0.0f;
  if (active) {
    for (int j = lane; j < vectors; j += Lanes) {
      float v[Vec];
      gpu::load_bf16<Vec>(x_row + j * Vec, v);
#pragma unroll
      for (int k = 0; k < Vec; ++k) sum_sq = fmaf(v[k], v[k], sum_sq);
    }
  }
  sum_sq = gpu::group_sum<Lanes>(sum_sq);
  if (!active) return;
  const float r = gpu::rms_inverse(sum_sq, dim, eps);

  __nv_bfloat16* y_row = y + y_at(row);
  for (int j = lane; j < vectors; j += Lanes) {
    float v[Vec], w[Vec], out[Vec];
    gpu::load_bf16<Vec>(x_row + j * Vec, v);
    gpu::load_bf16<Vec>(weight + j * Vec, w);
#pragma unroll
    for (int k = 0; k < Vec; ++k) out[k] = gpu::rms_apply(v[k], r, w[k]);
    gpu::store_bf16<Vec>(y_row + j * Vec, out);
  }
  if (lane == 0) rstd[row] = r;
}

// dx = r * (g - x_hat * mean(g * x_hat)) with g = dy * w, x_hat = x * r.
template <int Vec, int Lanes>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_dx_kernel(const __nv_bfloat16* __restrict__ dy, RowAddress dy_at,
                               const __nv_bfloat16* __restrict__ x, RowAddress x_at,
                               const __nv_bfloat16* __restrict__ weight, const float* __restrict__ rstd,
                               std::int64_t rows, int dim, __nv_bfloat16* __restrict__ dx, RowAddress dx_at) {
  const int lane = threadIdx.x % Lanes;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kThreads / Lanes) + threadIdx.x / Lanes;
  const bool active = row < rows;
  const int vectors = dim / Vec;
  const __nv_bfloat16* x_row = x + (active ? x_at(row) : 0);
  const __nv_bfloat16* dy_row = dy + (active ? dy_at(row) : 0);

  float g_dot_x = 0.0f;
  if (active) {
    for (int j = lane; j < vectors; j += Lanes) {
      float xv[Vec], dv[Vec], w[Vec];
      gpu::load_bf16<Vec>(x_row + j * Vec, xv);
      gpu::load_bf16<Vec>(dy_row + j * Vec, dv);
      gpu::load_bf16<Vec>(weight + j * Vec, w);
#pragma unroll
      for (int k = 0; k < Vec; ++k) g_dot_x = fmaf(dv[k] * w[k], xv[k], g_dot_x);
    }
  }
  g_dot_x = gpu::group_sum<Lanes>(g_dot_x);
  if (!active) return;
  const float r = rstd[row];
  const float mean = gpu::rms_mean(g_dot_x, r, dim);  // mean_d(g * x_hat)

  __nv_bfloat16* dx_row = dx + dx_at(row);
  for (int j = lane; j < vectors; j += Lanes) {
    float xv[Vec], dv[Vec], w[Vec], out[Vec];
    gpu::load_bf16<Vec>(x_row + j * Vec, xv);
    gpu::load_bf16<Vec>(dy_row + j * Vec, dv);
    gpu::load_bf16<Vec>(weight + j * Vec, w);
#pragma unroll
    for (int k = 0; k < Vec; ++k) out[k] = gpu::rms_dx(dv[k], w[k], xv[k], r, mean);
    gpu::store_bf16<Vec>(dx_row + j * Vec, out);
  }
}

// Block (column tile, row chunk): partials[chunk, d] = sum over the chunk's rows of dy * x_hat.
// Warp w takes rows w, w + kWarps, ... of the chunk; the warps' sums are added in warp order.
template <int Vec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_dweight_partial_kernel(const __nv_bfloat16* __restrict__ dy, RowAddress dy_at,
                                   const __nv_bfloat16* __restrict__ x, RowAddress x_at, const float* __restrict__ rstd,
                                   std::int64_t rows, int dim, std::int64_t rows_per_chunk,
                                   float* __restrict__ partials) {
  constexpr int kTile = 32 * Vec;
  __shared__ float warp_sums[kWarps][kTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t tile_begin = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const std::int64_t column = tile_begin + lane * Vec;
  const std::int64_t chunk = blockIdx.y;
  const std::int64_t row_begin = chunk * rows_per_chunk;
  const std::int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;

  float acc[Vec];
#pragma unroll
  for (int k = 0; k < Vec; ++k) acc[k] = 0.0f;
  if (column < dim) {
    for (std::int64_t row = row_begin + warp; row < row_end; row += kWarps) {
      const float r = rstd[row];
      float dv[Vec], xv[Vec];
      gpu::load_bf16<Vec>(dy + dy_at(row) + column, dv);
      gpu::load_bf16<Vec>(x + x_at(row) + column, xv);
#pragma unroll
      for (int k = 0; k < Vec; ++k) acc[k] = fmaf(dv[k], xv[k] * r, acc[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < Vec; ++k) warp_sums[warp][lane * Vec + k] = acc[k];
  __syncthreads();
  for (int c = threadIdx.x; c < kTile; c += kThreads) {
    if (tile_begin + c >= dim) break;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w][c];
    partials[chunk * dim + tile_begin + c] = total;
  }
}

// dx and the dweight partials in one pass, for rows of 17 to 32 * kVectorsPerLane vectors (those
// rmsnorm_backward_dx_kernel gives 32 lanes): block =
// row chunk (rmsnorm_dweight_partial_kernel's), warp w its rows w, w + kWarps, ..., a row's vectors
// over the warp's 32 lanes (rmsnorm_backward_dx_kernel with 32 lanes), so each column sits in the
// same lane as in the partial kernel. x and dy are read once and kept in registers for dx and the
// column sums; every sum runs in the two kernels' order, so the bits are theirs.
template <int Vec, int kVectorsPerLane>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_one_pass_kernel(const __nv_bfloat16* __restrict__ dy, RowAddress dy_at,
                                     const __nv_bfloat16* __restrict__ x, RowAddress x_at,
                                     const __nv_bfloat16* __restrict__ weight, const float* __restrict__ rstd,
                                     std::int64_t rows, int dim, std::int64_t rows_per_chunk,
                                     __nv_bfloat16* __restrict__ dx, RowAddress dx_at, float* __restrict__ partials) {
  extern __shared__ float warp_sums[];  // [kWarps][dim]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vectors = dim / Vec;
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t row_begin = chunk * rows_per_chunk;
  const std::int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;

  float w[kVectorsPerLane][Vec], acc[kVectorsPerLane][Vec];
#pragma unroll
  for (int i = 0; i < kVectorsPerLane; ++i) {
    const int j = lane + 32 * i;
    if (j < vectors) gpu::load_bf16<Vec>(weight + j * Vec, w[i]);
#pragma unroll
    for (int k = 0; k < Vec; ++k) acc[i][k] = 0.0f;
  }
  // Two rows at a time (w and w + kWarps, then the next two): their loads are in flight together.
  for (std::int64_t first = row_begin + warp; first < row_end; first += 2 * kWarps) {
    float xv[2][kVectorsPerLane][Vec], dv[2][kVectorsPerLane][Vec];
    float g_dot_x[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = first + h * kWarps;
      if (row >= row_end) continue;
      const __nv_bfloat16* x_row = x + x_at(row);
      const __nv_bfloat16* dy_row = dy + dy_at(row);
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < vectors) {
          gpu::load_bf16<Vec>(x_row + j * Vec, xv[h][i]);
          gpu::load_bf16<Vec>(dy_row + j * Vec, dv[h][i]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        if (lane + 32 * i < vectors && first + h * kWarps < row_end) {
#pragma unroll
          for (int k = 0; k < Vec; ++k) g_dot_x[h] = fmaf(dv[h][i][k] * w[i][k], xv[h][i][k], g_dot_x[h]);
        }
      }
      g_dot_x[h] = gpu::group_sum<32>(g_dot_x[h]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = first + h * kWarps;
      if (row >= row_end) continue;
      const float r = rstd[row];
      const float mean = gpu::rms_mean(g_dot_x[h], r, dim);
      __nv_bfloat16* dx_row = dx + dx_at(row);
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < vectors) {
          float out[Vec];
#pragma unroll
          for (int k = 0; k < Vec; ++k) {
            out[k] = gpu::rms_dx(dv[h][i][k], w[i][k], xv[h][i][k], r, mean);
            acc[i][k] = fmaf(dv[h][i][k], xv[h][i][k] * r, acc[i][k]);
          }
          gpu::store_bf16<Vec>(dx_row + j * Vec, out);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kVectorsPerLane; ++i) {
    const int j = lane + 32 * i;
    if (j < vectors) {
#pragma unroll
      for (int k = 0; k < Vec; ++k) warp_sums[warp * dim + j * Vec + k] = acc[i][k];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < dim; c += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) total += warp_sums[v * dim + c];
    partials[chunk * dim + c] = total;
  }
}

// Block of 32 columns: the chunks' partials added in a fixed order (column_sums.cuh), the total
// added to dweight.
__global__ void __launch_bounds__(kThreads)
    rmsnorm_dweight_combine_kernel(const float* __restrict__ partials, std::int64_t chunks, int dim,
                                   float* __restrict__ dweight) {
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x % 32;
  const float total = gpu::fixed_order_column_sum<kThreads>(partials, chunks, dim, column);
  if (threadIdx.x < 32 && column < dim) dweight[column] += total;
}

// Lanes per row: enough to cover the row's vectors once, between 4 and 32.
int lanes_for(std::int64_t vectors) {
  int lanes = 4;
  while (lanes < 32 && lanes < vectors) lanes *= 2;
  return lanes;
}

template <int Vec, int Lanes>
void launch_forward_lanes(const __nv_bfloat16* x, RowAddress x_at, const __nv_bfloat16* weight, std::int64_t rows,
                          int dim, float eps, __nv_bfloat16* y, RowAddress y_at, float* rstd, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>(ceil_div(rows, kThreads / Lanes));
  rmsnorm_forward_kernel<Vec, Lanes><<<blocks, kThreads, 0, stream>>>(x, x_at, weight, rows, dim, eps, y, y_at, rstd);
}

template <int Vec>
void launch_forward(const __nv_bfloat16* x, RowAddress x_at, const __nv_bfloat16* weight, std::int64_t rows, int dim,
                    float eps, __nv_bfloat16* y, RowAddress y_at, float* rstd, cudaStream_t stream) {
  switch (lanes_for(dim / Vec)) {
    case 4: launch_forward_lanes<Vec, 4>(x, x_at, weight, rows, dim, eps, y, y_at, rstd, stream); break;
    case 8: launch_forward_lanes<Vec, 8>(x, x_at, weight, rows, dim, eps, y, y_at, rstd, stream); break;
    case 16: launch_forward_lanes<Vec, 16>(x, x_at, weight, rows, dim, eps, y, y_at, rstd, stream); break;
    default: launch_forward_lanes<Vec, 32>(x, x_at, weight, rows, dim, eps, y, y_at, rstd, stream); break;
  }
}

template <int Vec, int Lanes>
void launch_dx_lanes(const __nv_bfloat16* dy, RowAddress dy_at, const __nv_bfloat16* x, RowAddress x_at,
                     const __nv_bfloat16* weight, const float* rstd, std::int64_t rows, int dim, __nv_bfloat16* dx,
                     RowAddress dx_at, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>(ceil_div(rows, kThreads / Lanes));
  rmsnorm_backward_dx_kernel<Vec, Lanes>
      <<<blocks, kThreads, 0, stream>>>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at);
}

// dx, then the dweight partials, each in its own launch.
template <int Vec>
void launch_two_pass(const __nv_bfloat16* dy, RowAddress dy_at, const __nv_bfloat16* x, RowAddress x_at,
                     const __nv_bfloat16* weight, const float* rstd, std::int64_t rows, int dim, __nv_bfloat16* dx,
                     RowAddress dx_at, float* partials, const Chunking& c, cudaStream_t stream) {
  switch (lanes_for(dim / Vec)) {
    case 4: launch_dx_lanes<Vec, 4>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at, stream); break;
    case 8: launch_dx_lanes<Vec, 8>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at, stream); break;
    case 16: launch_dx_lanes<Vec, 16>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at, stream); break;
    default: launch_dx_lanes<Vec, 32>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at, stream); break;
  }
  CUDA_CHECK_LAUNCH("rmsnorm_backward_dx_kernel");
  const dim3 grid(static_cast<unsigned int>(ceil_div(dim, 32 * Vec)), static_cast<unsigned int>(c.chunks));
  rmsnorm_dweight_partial_kernel<Vec>
      <<<grid, kThreads, 0, stream>>>(dy, dy_at, x, x_at, rstd, rows, dim, c.rows_per_chunk, partials);
  CUDA_CHECK_LAUNCH("rmsnorm_dweight_partial_kernel");
}

template <int Vec>
void launch_backward(const __nv_bfloat16* dy, RowAddress dy_at, const __nv_bfloat16* x, RowAddress x_at,
                     const __nv_bfloat16* weight, const float* rstd, std::int64_t rows, int dim, __nv_bfloat16* dx,
                     RowAddress dx_at, float* dweight, float* partials, cudaStream_t stream) {
  const Chunking c = chunking(rows);
  constexpr int kOnePassVectorsPerLane = 4;  // x, dy and the column sums of 4 vectors in registers
  const int vectors = dim / Vec;
  bool one_pass = false;
  if constexpr (Vec == gpu::kVector) {
    one_pass = lanes_for(vectors) == 32 && vectors <= 32 * kOnePassVectorsPerLane;
    if (one_pass) {
      const std::size_t smem = static_cast<std::size_t>(kWarps) * dim * sizeof(float);
      rmsnorm_backward_one_pass_kernel<Vec, kOnePassVectorsPerLane>
          <<<static_cast<unsigned int>(c.chunks), kThreads, smem, stream>>>(dy, dy_at, x, x_at, weight, rstd, rows, dim,
                                                                            c.rows_per_chunk, dx, dx_at, partials);
      CUDA_CHECK_LAUNCH("rmsnorm_backward_one_pass_kernel");
    }
  }
  if (!one_pass) launch_two_pass<Vec>(dy, dy_at, x, x_at, weight, rstd, rows, dim, dx, dx_at, partials, c, stream);
  rmsnorm_dweight_combine_kernel<<<static_cast<unsigned int>(ceil_div(dim, 32)), kThreads, 0, stream>>>(
      partials, c.chunks, dim, dweight);
  CUDA_CHECK_LAUNCH("rmsnorm_dweight_combine_kernel");
}

void check_rows(std::string_view op, std::int64_t tokens, std::int64_t heads, std::int64_t dim) {
  checks::require_non_negative(op, heads == 1 ? "rows" : "tokens", tokens);
  checks::require_positive(op, "heads", heads);
  checks::require_positive(op, "dim", dim);
  if (dim > INT32_MAX) checks::fail(op, "dim must be below 2^31, got " + std::to_string(dim));
}

void check_stride(std::string_view op, std::string_view name, std::int64_t stride, std::int64_t heads,
                  std::int64_t dim) {
  if (stride < heads * dim) {
    checks::fail(op, std::string(name) + " token stride " + std::to_string(stride) +
                         " is below heads * head_dim = " + std::to_string(heads * dim));
  }
}

bool vectorisable(std::int64_t dim, std::initializer_list<std::int64_t> strides,
                  std::initializer_list<const void*> pointers) {
  if (dim % gpu::kVector != 0) return false;
  for (const std::int64_t s : strides) {
    if (s % gpu::kVector != 0) return false;
  }
  for (const void* p : pointers) {
    if (!gpu::aligned_16(p)) return false;
  }
  return true;
}

void forward(std::string_view op, const __nv_bfloat16* x, std::int64_t x_stride, const __nv_bfloat16* weight,
             std::int64_t tokens, std::int64_t heads, std::int64_t dim, double eps, __nv_bfloat16* y,
             std::int64_t y_stride, float* rstd, cudaStream_t stream) {
  check_rows(op, tokens, heads, dim);
  check_stride(op, "x", x_stride, heads, dim);
  check_stride(op, "y", y_stride, heads, dim);
  if (!(eps >= 0.0)) checks::fail(op, "eps must be non-negative, got " + std::to_string(eps));
  const std::int64_t rows = tokens * heads;
  if (rows == 0) return;
  const RowAddress x_at{heads, dim, x_stride}, y_at{heads, dim, y_stride};
  const auto d = static_cast<int>(dim);
  const auto e = static_cast<float>(eps);
  if (vectorisable(dim, {x_stride, y_stride}, {x, weight, y})) {
    launch_forward<gpu::kVector>(x, x_at, weight, rows, d, e, y, y_at, rstd, stream);
  } else {
    launch_forward<1>(x, x_at, weight, rows, d, e, y, y_at, rstd, stream);
  }
  CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

std::size_t workspace_bytes_for(std::int64_t rows, std::int64_t dim) {
  return static_cast<std::size_t>(chunking(rows).chunks) * static_cast<std::size_t>(dim) * sizeof(float);
}

void backward(std::string_view op, const __nv_bfloat16* dy, std::int64_t dy_stride, const __nv_bfloat16* x,
              std::int64_t x_stride, const __nv_bfloat16* weight, const float* rstd, std::int64_t tokens,
              std::int64_t heads, std::int64_t dim, __nv_bfloat16* dx, std::int64_t dx_stride, float* dweight,
              void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  check_rows(op, tokens, heads, dim);
  check_stride(op, "dy", dy_stride, heads, dim);
  check_stride(op, "x", x_stride, heads, dim);
  check_stride(op, "dx", dx_stride, heads, dim);
  const std::int64_t rows = tokens * heads;
  if (rows == 0) return;
  const std::size_t needed = workspace_bytes_for(rows, dim);
  if (workspace_bytes < needed) {
    checks::fail(op, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(needed));
  }
  if (!gpu::aligned_16(workspace)) checks::fail(op, "workspace must be 16-byte aligned");
  const RowAddress dy_at{heads, dim, dy_stride}, x_at{heads, dim, x_stride}, dx_at{heads, dim, dx_stride};
  auto* partials = static_cast<float*>(workspace);
  const auto d = static_cast<int>(dim);
  if (vectorisable(dim, {dy_stride, x_stride, dx_stride}, {dy, x, weight, dx})) {
    launch_backward<gpu::kVector>(dy, dy_at, x, x_at, weight, rstd, rows, d, dx, dx_at, dweight, partials, stream);
  } else {
    launch_backward<1>(dy, dy_at, x, x_at, weight, rstd, rows, d, dx, dx_at, dweight, partials, stream);
  }
}

}  // namespace

void rmsnorm_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows, std::int64_t dim,
                          double eps, __nv_bfloat16* y, float* rstd, cudaStream_t stream) {
  forward("rmsnorm_forward_cuda", x, dim, weight, rows, 1, dim, eps, y, dim, rstd, stream);
}

std::size_t rmsnorm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim) {
  check_rows("rmsnorm_backward_workspace_bytes", rows, 1, dim);
  return workspace_bytes_for(rows, dim);
}

void rmsnorm_backward_cuda(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                           const float* rstd, std::int64_t rows, std::int64_t dim, __nv_bfloat16* dx, float* dweight,
                           void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  backward("rmsnorm_backward_cuda", dy, dim, x, dim, weight, rstd, rows, 1, dim, dx, dim, dweight, workspace,
           workspace_bytes, stream);
}

void head_rmsnorm_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, const __nv_bfloat16* weight,
                               std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, double eps,
                               __nv_bfloat16* y, std::int64_t y_token_stride, float* rstd, cudaStream_t stream) {
  forward("head_rmsnorm_forward_cuda", x, x_token_stride, weight, tokens, heads, head_dim, eps, y, y_token_stride, rstd,
          stream);
}

std::size_t head_rmsnorm_backward_workspace_bytes(std::int64_t tokens, std::int64_t heads, std::int64_t head_dim) {
  check_rows("head_rmsnorm_backward_workspace_bytes", tokens, heads, head_dim);
  return workspace_bytes_for(tokens * heads, head_dim);
}

void head_rmsnorm_backward_cuda(const __nv_bfloat16* dy, std::int64_t dy_token_stride, const __nv_bfloat16* x,
                                std::int64_t x_token_stride, const __nv_bfloat16* weight, const float* rstd,
                                std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, __nv_bfloat16* dx,
                                std::int64_t dx_token_stride, float* dweight, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream) {
  backward("head_rmsnorm_backward_cuda", dy, dy_token_stride, x, x_token_stride, weight, rstd, tokens, heads, head_dim,
           dx, dx_token_stride, dweight, workspace, workspace_bytes, stream);
}

}  // namespace models::ops
