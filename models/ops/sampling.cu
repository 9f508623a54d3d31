// CUDA kernels of token sampling (semantics in sampling.h). Greedy: a two-launch argmax under
// the total order (value descending, id ascending), so any reduction order finds the same id.
// Sampling: one 64-bit key per token, (orderable z) << id_bits | (vocab - 1 - id), sorted
// descending by CUB (ties by id ascending without relying on a stable sort); a tiled scan of
// e = sampling_exp(z - z_max) in the sorted order; one thread then finds the top-k end, the top-p
// end and the draw by binary search. Running sums are chained so that they never decrease (each
// level adds its offset to a value whose last element equals the next offset exactly), which
// keeps the binary searches well defined.
#include <algorithm>
#include <cfloat>
#include <limits>

#include <cub/device/device_radix_sort.cuh>

#include "core/error.h"
#include "models/ops/sampling.h"

namespace models::ops {
namespace {

constexpr int kGreedyBlocks = 64;
constexpr int kGreedyThreads = 512;
constexpr int kScanThreads = 256;
constexpr int kPerThread = 4;
constexpr int kTile = kScanThreads * kPerThread;  // elements per scan block

int id_bits_for(std::int64_t vocab) {
  int bits = 1;
  while ((std::int64_t{1} << bits) < vocab) ++bits;
  return bits;
}

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace: sort keys in and out, the scan, tile totals, argmax partials, CUB's storage.
struct Workspace {
  std::uint64_t* keys_in = nullptr;
  std::uint64_t* keys_out = nullptr;
  std::uint64_t* cum = nullptr;
  std::uint64_t* tile_total = nullptr;
  float* greedy_value = nullptr;
  std::int32_t* greedy_index = nullptr;
  void* sort_storage = nullptr;
  std::size_t sort_bytes = 0;
  std::size_t total = 0;
};

// Pointers into `base` (sizes only when base is nullptr).
Workspace carve(std::int64_t vocab, void* base) {
  const auto v = static_cast<std::size_t>(vocab);
  const std::size_t tiles = static_cast<std::size_t>((vocab + kTile - 1) / kTile);
  Workspace w;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    char* p = base == nullptr ? nullptr : static_cast<char*>(base) + at;
    at += align_up(bytes);
    return p;
  };
  w.keys_in = reinterpret_cast<std::uint64_t*>(take(v * 8));
  w.keys_out = reinterpret_cast<std::uint64_t*>(take(v * 8));
  w.cum = reinterpret_cast<std::uint64_t*>(take(v * 8));
  w.tile_total = reinterpret_cast<std::uint64_t*>(take(tiles * 8));
  w.greedy_value = reinterpret_cast<float*>(take(kGreedyBlocks * 4));
  w.greedy_index = reinterpret_cast<std::int32_t*>(take(kGreedyBlocks * 4));
  const int end_bit = 32 + id_bits_for(vocab);
  CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(nullptr, w.sort_bytes, static_cast<const std::uint64_t*>(nullptr),
                                                      static_cast<std::uint64_t*>(nullptr), static_cast<int>(vocab), 0,
                                                      end_bit));
  w.sort_storage = take(w.sort_bytes);
  w.total = at;
  return w;
}

struct Candidate {
  float value;
  std::int32_t index;
};

__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Candidate other{__shfl_xor_sync(0xFFFFFFFFu, c.value, offset), __shfl_xor_sync(0xFFFFFFFFu, c.index, offset)};
    if (better(other, c)) c = other;
  }
  return c;
}

// Best of a block's candidates into lane 0 of warp 0 (blockDim.x a multiple of 32, <= 1024).
__device__ Candidate block_best(Candidate c) {
  __shared__ Candidate warps[32];
  c = warp_best(c);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, count = blockDim.x / 32;
  if (lane == 0) warps[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < count ? warps[lane] : Candidate{-INFINITY, std::numeric_limits<std::int32_t>::max()};
    c = warp_best(c);
  }
  return c;
}

__global__ void __launch_bounds__(kGreedyThreads)
    argmax_partial_kernel(const float* __restrict__ logits, std::int64_t vocab, float* __restrict__ value,
                          std::int32_t* __restrict__ index) {
  Candidate best{-INFINITY, std::numeric_limits<std::int32_t>::max()};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vocab; i += stride) {
    const float v = logits[i];
    const Candidate c{isnan(v) ? -INFINITY : v, static_cast<std::int32_t>(i)};
    if (better(c, best)) best = c;
  }
  best = block_best(best);
  if (threadIdx.x == 0) {
    value[blockIdx.x] = best.value;
    index[blockIdx.x] = best.index;
  }
}

__global__ void argmax_final_kernel(const float* __restrict__ value, const std::int32_t* __restrict__ index,
                                    std::int32_t* __restrict__ out) {
  Candidate best{-INFINITY, std::numeric_limits<std::int32_t>::max()};
  for (int i = threadIdx.x; i < kGreedyBlocks; i += blockDim.x) {
    const Candidate c{value[i], index[i]};
    if (better(c, best)) best = c;
  }
  best = block_best(best);
  if (threadIdx.x == 0) *out = best.index;
}

// Order-preserving map of a float (no NaN, no -0) to uint32, and back.
__device__ __forceinline__ std::uint32_t orderable(float f) {
  const std::uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ float from_orderable(std::uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

__global__ void build_keys_kernel(const float* __restrict__ logits, std::int64_t vocab, float temperature, int id_bits,
                                  std::uint64_t* __restrict__ keys) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vocab; i += stride) {
    float z = logits[i] / temperature;
    if (isnan(z)) z = -INFINITY;
    if (z == INFINITY) z = FLT_MAX;
    z += 0.0f;
    keys[i] = (static_cast<std::uint64_t>(orderable(z)) << id_bits) | static_cast<std::uint64_t>(vocab - 1 - i);
  }
}

__device__ __forceinline__ double key_z(std::uint64_t key, int id_bits) {
  return static_cast<double>(from_orderable(static_cast<std::uint32_t>(key >> id_bits)));
}

// Tile-local running sums of the weights along the sorted keys; tile_total[b] is the tile's last
// sum. Integer sums: exact in any order, so equal to the host's sequential ones.
__global__ void __launch_bounds__(kScanThreads)
    scan_tiles_kernel(const std::uint64_t* __restrict__ keys, std::int64_t vocab, int id_bits,
                      std::uint64_t* __restrict__ cum, std::uint64_t* __restrict__ tile_total) {
  __shared__ std::uint64_t warp_total[kScanThreads / 32];
  const double z_max = key_z(keys[0], id_bits);
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kTile + threadIdx.x * kPerThread;
  std::uint64_t local[kPerThread];
  std::uint64_t running = 0;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const std::int64_t i = first + k;
    running += i < vocab ? sampling_weight(sampling_exp(key_z(keys[i], id_bits) - z_max)) : 0;
    local[k] = running;
  }
  // Offsets of the lanes and of the warps.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  std::uint64_t lane_offset = 0;
  for (int l = 0; l < 31; ++l) {
    const std::uint64_t t = __shfl_sync(0xFFFFFFFFu, running, l);
    if (lane > l) lane_offset += t;
  }
  if (lane == 31) warp_total[warp] = lane_offset + running;
  __syncthreads();
  std::uint64_t warp_offset = 0;
  for (int w = 0; w < warp; ++w) warp_offset += warp_total[w];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const std::int64_t i = first + k;
    if (i < vocab) cum[i] = warp_offset + lane_offset + local[k];
  }
  if (threadIdx.x == kScanThreads - 1) tile_total[blockIdx.x] = warp_offset + lane_offset + running;
}

__global__ void choose_kernel(const std::uint64_t* __restrict__ keys, std::int64_t vocab, int id_bits,
                              const std::uint64_t* __restrict__ cum, const std::uint64_t* __restrict__ tile_total,
                              std::int64_t tiles, std::int64_t top_k, float top_p, float uniform,
                              std::int32_t* __restrict__ out) {
  extern __shared__ std::uint64_t tile_offset[];
  if (threadIdx.x != 0) return;
  const std::uint64_t id_mask = (std::uint64_t{1} << id_bits) - 1;
  const auto id_of = [&](std::int64_t i) {
    return static_cast<std::int32_t>(vocab - 1 - static_cast<std::int64_t>(keys[i] & id_mask));
  };
  if (from_orderable(static_cast<std::uint32_t>(keys[0] >> id_bits)) == -INFINITY) {
    *out = id_of(0);
    return;
  }
  std::uint64_t offset = 0;
  for (std::int64_t t = 0; t < tiles; ++t) {
    tile_offset[t] = offset;
    offset += tile_total[t];
  }
  const auto cum_at = [&](std::int64_t i) { return static_cast<double>(tile_offset[i / kTile] + cum[i]); };

  std::int64_t kept = vocab;
  if (top_k > 0 && top_k < vocab) {
    // The first position after top_k - 1 whose z is below the k-th one.
    const std::uint64_t kth = keys[top_k - 1] >> id_bits;
    std::int64_t lo = top_k, hi = vocab;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if ((keys[mid] >> id_bits) == kth)
        lo = mid + 1;
      else
        hi = mid;
    }
    kept = lo;
  }
  // First index in [0, n) with cum_at(i) >= value (strict: > value).
  const auto search = [&](std::int64_t n, double value, bool strict) {
    std::int64_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      const double c = cum_at(mid);
      if (strict ? c > value : c >= value)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  };
  if (top_p < 1.0f) {
    const double threshold = static_cast<double>(top_p) * cum_at(kept - 1);
    kept = min(search(kept, threshold, false), kept - 1) + 1;
  }
  const double target = static_cast<double>(uniform) * cum_at(kept - 1);
  *out = id_of(min(search(kept, target, true), kept - 1));
}

}  // namespace

std::size_t sample_cuda_workspace_bytes(std::int64_t vocab) {
  if (vocab <= 0 || vocab > kMaxSamplingVocab) {
    throw core::Error("sample_cuda: vocabulary of " + std::to_string(vocab) + " entries (at most " +
                      std::to_string(kMaxSamplingVocab) + ")");
  }
  return carve(vocab, nullptr).total;
}

void sample_cuda(const float* logits, std::int64_t vocab, const SamplingParams& params, float uniform,
                 std::int32_t* out_id, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  check_sampling(params);
  const Workspace w = carve(vocab, workspace);
  if (workspace_bytes < w.total) {
    throw core::Error("sample_cuda: workspace of " + std::to_string(workspace_bytes) + " bytes, needs " +
                      std::to_string(w.total));
  }
  if (is_greedy(params)) {
    argmax_partial_kernel<<<kGreedyBlocks, kGreedyThreads, 0, stream>>>(logits, vocab, w.greedy_value, w.greedy_index);
    CUDA_CHECK_LAUNCH("argmax_partial_kernel");
    argmax_final_kernel<<<1, 64, 0, stream>>>(w.greedy_value, w.greedy_index, out_id);
    CUDA_CHECK_LAUNCH("argmax_final_kernel");
    return;
  }
  const int id_bits = id_bits_for(vocab);
  const std::int64_t tiles = (vocab + kTile - 1) / kTile;
  build_keys_kernel<<<static_cast<unsigned>(std::min<std::int64_t>((vocab + 255) / 256, 4096)), 256, 0, stream>>>(
      logits, vocab, params.temperature, id_bits, w.keys_in);
  CUDA_CHECK_LAUNCH("build_keys_kernel");
  std::size_t sort_bytes = w.sort_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(w.sort_storage, sort_bytes, w.keys_in, w.keys_out,
                                                      static_cast<int>(vocab), 0, 32 + id_bits, stream));
  scan_tiles_kernel<<<static_cast<unsigned>(tiles), kScanThreads, 0, stream>>>(w.keys_out, vocab, id_bits, w.cum,
                                                                               w.tile_total);
  CUDA_CHECK_LAUNCH("scan_tiles_kernel");
  const std::size_t shared = static_cast<std::size_t>(tiles) * sizeof(std::uint64_t);
  if (shared > 48 * 1024) throw core::Error("sample_cuda: vocabulary too large for the choice kernel");
  choose_kernel<<<1, 32, shared, stream>>>(w.keys_out, vocab, id_bits, w.cum, w.tile_total, tiles, params.top_k,
                                           params.top_p, uniform, out_id);
  CUDA_CHECK_LAUNCH("choose_kernel");
}

}  // namespace models::ops
