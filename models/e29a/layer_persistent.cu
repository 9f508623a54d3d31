// The persistent E29a forward (layer_persistent.h). One cooperative grid, 256 threads a block, a
// block per SM at most. Block k holds `rows` consecutive rows of the stacked [W_h ; W_write]
// (2D rows) in shared memory as bf16, padded to whole 16-row tiles; the sequence phase uses the
// hybrid path's step functions on a block's own scratch after the weights.
//
// The rows phase: a warp takes 16 rows x 4 sequences at a time; lane l accumulates features
// l*8 .. l*8+7 of every 256 (or l, l+32, ... for a D that is not a multiple of 8) in fp32, then a
// butterfly over the 32 lanes (each step halves the values a lane keeps) leaves two finished dot
// products per lane: 62 shuffles for 64 sums, in a fixed order. h_t comes through L2 (__ldcg):
// other blocks wrote it after this launch began.
//
// Barriers: one counter for the launch, every block release-adds 1 and acquires until it reaches
// blocks x (barriers passed); zeroed before the launch.
#include "models/e29a/layer_persistent.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/memory_order.cuh"
#include "models/e29a/layer_step.cuh"

namespace models::e29a::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 16;  // rows of a warp pass
constexpr int kItems = 4;      // sequences of a warp pass
constexpr int kMaxTiles = 8;   // at most 128 rows a block

struct Params {
  PersistentForwardArgs a;
  int rows_per_block = 0, tiles = 0, ld = 0;
  std::size_t weight_bytes = 0;
  std::uint64_t timeout_ns = 0;
};

__device__ __forceinline__ std::uint64_t globaltimer() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A grid-wide barrier with a deadline. Returns false when the launch aborted (here or elsewhere).
__device__ bool grid_barrier(const Params& p, std::uint32_t& passed, int* ok_flag) {
  ++passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    PersistentSync* s = p.a.sync;
    const bool stall = p.a.stall_block == static_cast<int>(blockIdx.x) && passed == 1;
    if (!stall) core::red_add_release(&s->arrived, 1);
    const std::uint32_t want = passed * gridDim.x;
    bool ok = true;
    std::uint64_t start = 0;
    for (std::uint32_t spins = 1;; ++spins) {
      const std::uint32_t seen = core::ld_acquire_u32(&s->arrived);
      if (seen >= want) break;
      if ((spins & 255) == 0) {
        if (core::ld_relaxed_u32(&s->aborted) != 0) {
          ok = false;
          break;
        }
        const std::uint64_t now = globaltimer();
        if (start == 0) {
          start = now;
        } else if (now - start > p.timeout_ns) {
          if (atomicCAS(&s->aborted, 0u, 1u) == 0u) {
            s->block = blockIdx.x;
            s->barrier = passed;
            s->wanted = want;
            s->seen = seen;
            __threadfence();
          }
          ok = false;
          break;
        }
      }
    }
    *ok_flag = ok ? 1 : 0;
  }
  __syncthreads();
  return *ok_flag != 0;
}

__device__ __forceinline__ void unpack8(const uint4& w, float (&v)[8]) {
  const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(words[k] << 16);
    v[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
  }
}

// Rows [row0, row0 + rows) of [W_h ; W_write] times h of every sequence: a row r < D goes to
// recurrent[b, r] (when want_pre), a row D + r to write_out[b, r] (when want_write).
template <bool Vec>
__device__ __noinline__ void rows_phase(const Params& p, const __nv_bfloat16* weights, int row0, int rows, const float* h,
                           bool want_pre, bool want_write, float* write_out) {
  const PersistentForwardArgs& a = p.a;
  const int D = a.dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const auto B = static_cast<int>(a.batch);
  const int groups = (B + kItems - 1) / kItems;
  const int q_base = ((lane >> 4) & 1) * 32 + ((lane >> 3) & 1) * 16 + ((lane >> 2) & 1) * 8 +
                     ((lane >> 1) & 1) * 4 + (lane & 1) * 2;
  for (int tile = 0; tile < p.tiles; ++tile) {
    const int first = row0 + tile * kTileRows;
    const int last = row0 + min(rows, (tile + 1) * kTileRows);  // exclusive
    if (first >= last) break;
    const bool needed = (want_pre && first < D) || (want_write && last > D);
    if (!needed) continue;
    const __nv_bfloat16* w_tile = weights + static_cast<std::size_t>(tile) * kTileRows * p.ld;
    for (int g = warp; g < groups; g += kWarps) {
      float v[kTileRows * kItems];
#pragma unroll
      for (int q = 0; q < kTileRows * kItems; ++q) v[q] = 0.0f;
      const float* hs[kItems];
      bool valid[kItems];
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int b = g * kItems + i;
        valid[i] = b < B;
        hs[i] = h + static_cast<std::size_t>(valid[i] ? b : 0) * D;
      }
      if constexpr (Vec) {
        for (int k0 = lane * 8; k0 < D; k0 += 256) {
          float hv[kItems][8];
#pragma unroll
          for (int i = 0; i < kItems; ++i) {
            const float4 lo = valid[i] ? __ldcg(reinterpret_cast<const float4*>(hs[i] + k0)) : float4{0, 0, 0, 0};
            const float4 hi = valid[i] ? __ldcg(reinterpret_cast<const float4*>(hs[i] + k0 + 4)) : float4{0, 0, 0, 0};
            hv[i][0] = lo.x, hv[i][1] = lo.y, hv[i][2] = lo.z, hv[i][3] = lo.w;
            hv[i][4] = hi.x, hv[i][5] = hi.y, hv[i][6] = hi.z, hv[i][7] = hi.w;
          }
#pragma unroll
          for (int r = 0; r < kTileRows; ++r) {
            float wf[8];
            unpack8(*reinterpret_cast<const uint4*>(w_tile + r * p.ld + k0), wf);
#pragma unroll
            for (int i = 0; i < kItems; ++i) {
#pragma unroll
              for (int e = 0; e < 8; ++e) v[r * kItems + i] = fmaf(wf[e], hv[i][e], v[r * kItems + i]);
            }
          }
        }
      } else {
        for (int k = lane; k < D; k += 32) {
          float hv[kItems];
#pragma unroll
          for (int i = 0; i < kItems; ++i) hv[i] = valid[i] ? __ldcg(hs[i] + k) : 0.0f;
#pragma unroll
          for (int r = 0; r < kTileRows; ++r) {
            const float wf = __bfloat162float(w_tile[r * p.ld + k]);
#pragma unroll
            for (int i = 0; i < kItems; ++i) v[r * kItems + i] = fmaf(wf, hv[i], v[r * kItems + i]);
          }
        }
      }
      // Butterfly: at each step a lane keeps half of its values (the upper half when its lane bit
      // is set) and adds its partner's copy of that half.
#pragma unroll
      for (int s = 0; s < 5; ++s) {
        const int offset = 16 >> s, half = 32 >> s;
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (int q = 0; q < half; ++q) {
          const float keep = upper ? v[q + half] : v[q];
          const float send = upper ? v[q] : v[q + half];
          v[q] = keep + __shfl_xor_sync(step::kFull, send, offset);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int q = q_base + j, r = q / kItems, i = q % kItems;
        const int row = first + r, b = g * kItems + i;
        if (row >= last || b >= B) continue;
        if (row < D) {
          if (want_pre) a.recurrent[static_cast<std::size_t>(b) * D + row] = v[j];
        } else if (want_write) {
          write_out[static_cast<std::size_t>(b) * D + (row - D)] = v[j];
        }
      }
    }
  }
}

__device__ ReadStepArgs read_args(const PersistentForwardArgs& a, std::int64_t t) {
  const std::int64_t B = a.batch, D = a.dim, N = a.slots, T = a.steps;
  ReadStepArgs r;
  r.batch = B;
  r.dim = a.dim;
  r.slots = a.slots;
  r.scale = a.scale;
  r.tape = a.tape;
  r.h_prev = a.h + t * B * D;
  r.x = a.xz + t * 2 * D;
  r.x_stride = T * 2 * D;
  r.recurrent = a.recurrent;
  r.bias = a.bias;
  r.h = a.h + (t + 1) * B * D;
  r.h_bf16 = a.h_bf16 + (t + 1) * B * D;
  r.read = a.read + t * B * D;
  r.read_attn = a.read_attn + t * B * N;
  return r;
}

__device__ WriteStepArgs write_args(const PersistentForwardArgs& a, std::int64_t t) {
  const std::int64_t B = a.batch, D = a.dim, N = a.slots, T = a.steps;
  WriteStepArgs w;
  w.batch = B;
  w.dim = a.dim;
  w.slots = a.slots;
  w.scale = a.scale;
  w.tape = a.tape;
  w.checkpoint = t % a.interval == 0 ? a.checkpoints + (t / a.interval) * B * N * D : nullptr;
  w.write = a.write + t * B * D;
  w.h = a.h + (t + 1) * B * D;
  w.read = a.read + t * B * D;
  w.z = a.xz + t * 2 * D + D;
  w.z_stride = T * 2 * D;
  w.write_attn = a.write_attn + t * B * N;
  w.y = a.y + t * D;
  w.y_stride = T * D;
  return w;
}

template <int MaxN, bool Vec>
__global__ void __launch_bounds__(kThreads, 1) persistent_forward_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok_flag;
  const PersistentForwardArgs& a = p.a;
  const int D = a.dim;
  const std::int64_t B = a.batch, T = a.steps;
  auto* weights = reinterpret_cast<__nv_bfloat16*>(smem);
  const step::Shared<MaxN> sh(reinterpret_cast<float*>(smem + p.weight_bytes));

  // This block's rows, zero-padded to whole tiles and to ld columns.
  const int row0 = static_cast<int>(blockIdx.x) * p.rows_per_block;
  const int rows = max(0, min(p.rows_per_block, 2 * D - row0));
  const int padded_rows = p.tiles * kTileRows;
  for (int i = threadIdx.x; i < padded_rows * p.ld; i += kThreads) {
    const int r = i / p.ld, k = i % p.ld, row = row0 + r;
    __nv_bfloat16 w = __float2bfloat16_rn(0.0f);
    if (r < rows && k < D) w = row < D ? a.w_h[static_cast<std::size_t>(row) * D + k] : a.w_write[static_cast<std::size_t>(row - D) * D + k];
    weights[i] = w;
  }
  __syncthreads();

  std::uint32_t passed = 0;
  // W_h h_{-1}, then step 0's read.
  rows_phase<Vec>(p, weights, row0, rows, a.h, true, false, nullptr);
  if (!grid_barrier(p, passed, &ok_flag)) return;
  if (T > 0) {
    const ReadStepArgs r0 = read_args(a, 0);
    for (std::int64_t b = blockIdx.x; b < B; b += gridDim.x) {
      step::read_sequence<MaxN>(r0, b, sh);
      __syncthreads();
    }
  }
  for (std::int64_t t = 0; t < T; ++t) {
    if (!grid_barrier(p, passed, &ok_flag)) return;
    // w_t = W_write h_t and, unless last, W_h h_t.
    rows_phase<Vec>(p, weights, row0, rows, a.h + (t + 1) * B * D, t + 1 < T, true, a.write + t * B * D);
    if (!grid_barrier(p, passed, &ok_flag)) return;
    const WriteStepArgs w = write_args(a, t);
    const bool more = t + 1 < T;
    const ReadStepArgs r = more ? read_args(a, t + 1) : ReadStepArgs{};
    for (std::int64_t b = blockIdx.x; b < B; b += gridDim.x) {
      step::write_sequence<MaxN>(w, b, sh);
      __syncthreads();
      if (more) {
        step::read_sequence<MaxN>(r, b, sh);
        __syncthreads();
      }
    }
  }
}

struct Device {
  int sms = 0, smem_optin = 0, cooperative = 0;
};

Device current_device() {
  int id = 0;
  CUDA_CHECK(cudaGetDevice(&id));
  Device d;
  CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, id));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, id));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.cooperative, cudaDevAttrCooperativeLaunch, id));
  return d;
}

int slot_capacity(int slots) { return slots <= 8 ? 8 : slots <= 16 ? 16 : slots <= 32 ? 32 : 64; }

struct Geometry {
  int grid = 0, rows_per_block = 0, tiles = 0, ld = 0;
  std::size_t weight_bytes = 0, smem = 0;
};

// Blocks: enough for 16 rows each or one per sequence, at most one per SM.
Geometry geometry_for(const Device& dev, int dim, int slots, std::int64_t batch) {
  Geometry g;
  const int tiles_needed = (2 * dim + kTileRows - 1) / kTileRows;
  g.grid = static_cast<int>(std::min<std::int64_t>(dev.sms, std::max<std::int64_t>({tiles_needed, batch, 1})));
  g.rows_per_block = (2 * dim + g.grid - 1) / g.grid;
  g.tiles = (g.rows_per_block + kTileRows - 1) / kTileRows;
  g.ld = (dim + 7) / 8 * 8;
  g.weight_bytes = (static_cast<std::size_t>(g.tiles) * kTileRows * g.ld * sizeof(__nv_bfloat16) + 15) / 16 * 16;
  g.smem = g.weight_bytes + step::shared_floats(slot_capacity(slots), kThreads, dim) * sizeof(float);
  return g;
}

template <int MaxN, bool Vec>
void launch(const PersistentForwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  auto* kernel = persistent_forward_kernel<MaxN, Vec>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, g.smem));
  if (per_sm * dev.sms < g.grid) {
    throw core::Error("e29a persistent forward: " + std::to_string(g.grid) + " blocks of " + std::to_string(g.smem) +
                      " bytes of shared memory cannot all be resident (" + std::to_string(per_sm) + " per SM, " +
                      std::to_string(dev.sms) + " SMs)");
  }
  Params p;
  p.a = args;
  p.rows_per_block = g.rows_per_block;
  p.tiles = g.tiles;
  p.ld = g.ld;
  p.weight_bytes = g.weight_bytes;
  p.timeout_ns = static_cast<std::uint64_t>(args.timeout_seconds * 1e9);
  void* params[] = {&p};
  CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(g.grid), dim3(kThreads), params,
                                         g.smem, stream));
}

template <bool Vec>
void launch_by_slots(const PersistentForwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  switch (slot_capacity(args.slots)) {
    case 8: launch<8, Vec>(args, dev, g, stream); break;
    case 16: launch<16, Vec>(args, dev, g, stream); break;
    case 32: launch<32, Vec>(args, dev, g, stream); break;
    default: launch<64, Vec>(args, dev, g, stream); break;
  }
}

}  // namespace

std::string persistent_forward_refusal(int dim, int slots) {
  const Device dev = current_device();
  if (dev.cooperative == 0) return "the device has no cooperative launch";
  if (slots < 1 || slots > kMaxSlots) return "slots " + std::to_string(slots) + " outside [1, 64]";
  const Geometry g = geometry_for(dev, dim, slots, 1);
  if (g.tiles > kMaxTiles) {
    return "dim " + std::to_string(dim) + " needs " + std::to_string(g.rows_per_block) + " rows a block (at most " +
           std::to_string(kMaxTiles * kTileRows) + ")";
  }
  if (g.smem > static_cast<std::size_t>(dev.smem_optin)) {
    return "dim " + std::to_string(dim) + " needs " + std::to_string(g.smem) + " bytes of shared memory a block (" +
           std::to_string(dev.smem_optin) + " available)";
  }
  return "";
}

void persistent_forward(const PersistentForwardArgs& args, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(args.sync, 0, sizeof(PersistentSync), stream));
  if (args.batch == 0) return;
  const Device dev = current_device();
  const Geometry g = geometry_for(dev, args.dim, args.slots, args.batch);
  if (args.dim % 8 == 0) {
    launch_by_slots<true>(args, dev, g, stream);
  } else {
    launch_by_slots<false>(args, dev, g, stream);
  }
  CUDA_CHECK_LAUNCH("e29a persistent forward");
}

std::string persistent_abort_message(const PersistentSync& record, double timeout_seconds) {
  return "e29a persistent forward: block " + std::to_string(record.block) + " waited more than " +
         std::to_string(timeout_seconds) + " s at grid barrier " + std::to_string(record.barrier) + " (counter " +
         std::to_string(record.seen) + ", wanted " + std::to_string(record.wanted) +
         "); every block left, the layer's outputs of that call are not valid";
}

}  // namespace models::e29a::kernels
