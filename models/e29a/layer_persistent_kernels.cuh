// The persistent E29a kernels (layer_persistent.h), both directions: one cooperative grid of
// 256-thread blocks, at most one per SM.
//
// Shared memory of a block: its rows of the stacked [W_h ; W_write] (bf16, 16-row tiles), the
// cross-warp partial sums, the step scratch (slot sums, attentions) and its sequence's tape [N, D].
//
// Rows phase (fp32 products on the FMA units: the same values as the hybrid path's fp32 products
// up to summation order): a warp takes 16 rows x 4 sequences over a range of 256-feature blocks;
// lane l accumulates features l*8 .. l*8+7 of each block (h through L2, the next block loading
// while this one is multiplied), a butterfly over the lanes leaves two finished sums a lane, and
// with fewer sequence groups than warps the warps' ranges are summed in range order through
// shared memory. A width that is not a multiple of 8 takes features l, l+32, ... instead.
//
// Sequence phase, per sequence and thread-owned features d = tid + 256 j (h_t and r_t stay with
// the thread from one step to the next; x, z, w_t and W_h h_t arrive in one round of loads): the
// write attention of t, the tape update (its read scores for t + 1 summed in the same pass), y_t,
// then the read attention of t + 1 and h_{t+1}. Formulas and reductions are layer_step.cuh's
// (tape_update, block_slot_sums, softmax_warp), in the same per-thread order as the hybrid
// path's kernels.
//
// Every phase is inlined into its kernel, so the launch's arguments are read from the constant
// bank where they are used; as called functions they took them through a generic pointer, reloaded
// after every store that might alias them (those loads were among the sequence phase's top
// stalls). Inlined, the kernels take minutes to compile: each slot capacity's are instantiated in a
// file of their own (layer_persistent_n*.cu), so the four compile in parallel. (nvcc's
// --split-compile left the rows phase's butterfly slower, 11.0 -> 18.9 us a step at B 64.)
//
// Barriers: one counter for the launch; every block release-adds 1 and acquires until it reaches
// blocks x barriers passed; zeroed before the launch. Every wait has a deadline.
#pragma once

#include <string>

#include "core/async_copy.cuh"
#include "core/error.h"
#include "core/memory_order.cuh"
#include "models/e29a/layer_persistent_launch.h"
#include "models/e29a/layer_step.cuh"

namespace models::e29a::kernels::persistent {

// The barrier words of a launch and its deadline.
struct GridSync {
  PersistentSync* sync = nullptr;
  int stall_block = -1;
  std::uint64_t timeout_ns = 0;
};
template <typename Args>
struct Params {
  Args a;
  GridSync grid;
  Layout l;
};

using step::kFull;

// Records the first timed-out wait of the launch (later ones see `aborted` and just leave).
__device__ inline void record_abort(const GridSync& g, std::uint32_t barrier, std::uint32_t wanted,
                                    std::uint32_t seen) {
  PersistentSync* s = g.sync;
  if (atomicCAS(&s->aborted, 0u, 1u) == 0u) {
    s->block = blockIdx.x;
    s->barrier = barrier;
    s->wanted = wanted;
    s->seen = seen;
    __threadfence();
  }
}

// A grid-wide barrier with a deadline. Returns false when the launch aborted (here or elsewhere).
__device__ inline bool grid_barrier(const GridSync& g, std::uint32_t& passed, int* ok_flag) {
  ++passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    PersistentSync* s = g.sync;
    const bool stall = g.stall_block == static_cast<int>(blockIdx.x) && passed == 1;
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
        const std::uint64_t now = core::globaltimer();
        if (start == 0) {
          start = now;
        } else if (now - start > g.timeout_ns) {
          record_abort(g, passed, want, seen);
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

// Shared-memory accesses by 32-bit shared addresses: the tape is reached through a pointer the
// compiler cannot place in shared memory across calls (generic accesses). Volatile keeps them in
// program order among themselves; without a memory clobber global loads may still move across
// them (the on-chip tapes are reached only through these, and __syncthreads orders the copies in
// and out).
__device__ __forceinline__ float lds(std::uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
  return v;
}

__device__ __forceinline__ void sts(std::uint32_t address, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(v));
}

// part[n] += H[n] . v over the thread's features d = tid + 256 j (H: the tape's shared address).
template <int MaxN>
__device__ __forceinline__ void score_partials(std::uint32_t H, const float (&v)[kMaxFeatures], int D, int N,
                                               float (&part)[MaxN]) {
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) part[n] = fmaf(lds(H + 4u * static_cast<std::uint32_t>(n * D + d)), v[j], part[n]);
    }
  }
}

// One step of the lanes' butterfly over v[0, 2 Half): a lane keeps half of its values (the upper
// half when its lane bit Half / 2 is set) and adds its partner's copy of that half. A template
// step, so every index is a constant and v stays in registers (a loop over the steps left v in
// local memory with computed offsets).
template <int Half>
__device__ __forceinline__ void butterfly_step(float (&v)[kTileRows * kItems], int lane) {
  const bool upper = (lane & (Half / 2)) != 0;
#pragma unroll
  for (int q = 0; q < Half; ++q) {
    const float keep = upper ? v[q + Half] : v[q];
    const float send = upper ? v[q] : v[q + Half];
    v[q] = keep + __shfl_xor_sync(kFull, send, Half / 2);
  }
}

// 16 rows x 4 sequences, lane partial sums over this warp's 256-feature blocks [j0, j1), reduced
// across the lanes: lane l ends with sums q_base(l) and q_base(l) + 1 (q = row * 4 + item).
// `hs[i]` points at sequence i's h (shared or global memory; nullptr: absent, zero).
template <bool Vec>
__device__ __forceinline__ void tile_product(const __nv_bfloat16* w_tile, int ld, int D,
                                             const float* const (&hs)[kItems], int j0, int j1, float (&out)[2]) {
  const int lane = threadIdx.x & 31;
  float v[kTileRows * kItems];
#pragma unroll
  for (int q = 0; q < kTileRows * kItems; ++q) v[q] = 0.0f;
  if constexpr (Vec) {
    // h of the next 256-feature block is loaded while this one is multiplied.
    float4 next[kItems][2];
    auto load = [&](int j) {
      const int k0 = j * 256 + lane * 8;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const bool in = hs[i] != nullptr && j < j1 && k0 < D;
        const auto* src = reinterpret_cast<const float4*>(hs[i] + (in ? k0 : 0));
        next[i][0] = in ? __ldcg(src) : float4{0, 0, 0, 0};
        next[i][1] = in ? __ldcg(src + 1) : float4{0, 0, 0, 0};
      }
    };
    load(j0);
    for (int j = j0; j < j1; ++j) {
      const int k0 = j * 256 + lane * 8;
      if (k0 >= D) break;
      float hv[kItems][8];
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const float4 lo = next[i][0], hi = next[i][1];
        hv[i][0] = lo.x, hv[i][1] = lo.y, hv[i][2] = lo.z, hv[i][3] = lo.w;
        hv[i][4] = hi.x, hv[i][5] = hi.y, hv[i][6] = hi.z, hv[i][7] = hi.w;
      }
      load(j + 1);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        float wf[8];
        unpack8(*reinterpret_cast<const uint4*>(w_tile + r * ld + k0), wf);
        // Consecutive FMAs go to the 4 sequences' accumulators in turn: a warp issues in order, and
        // 8 dependent FMAs on one accumulator would stall it on the FMA latency each time.
#pragma unroll
        for (int e = 0; e < 8; ++e) {
#pragma unroll
          for (int i = 0; i < kItems; ++i) v[r * kItems + i] = fmaf(wf[e], hv[i][e], v[r * kItems + i]);
        }
      }
    }
  } else {
    for (int k = j0 * 256 + lane; k < min(D, j1 * 256); k += 32) {
      float hv[kItems];
#pragma unroll
      for (int i = 0; i < kItems; ++i) hv[i] = hs[i] ? __ldcg(hs[i] + k) : 0.0f;
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        const float wf = __bfloat162float(w_tile[r * ld + k]);
#pragma unroll
        for (int i = 0; i < kItems; ++i) v[r * kItems + i] = fmaf(wf, hv[i], v[r * kItems + i]);
      }
    }
  }
  butterfly_step<32>(v, lane);
  butterfly_step<16>(v, lane);
  butterfly_step<8>(v, lane);
  butterfly_step<4>(v, lane);
  butterfly_step<2>(v, lane);
  out[0] = v[0];
  out[1] = v[1];
}

// What one rows phase multiplies: rows below split times in_lo, rows from split times in_hi (both
// [B, K]); row r < split goes to out_lo[b, r], row r >= split to out_hi[b, r - split] (rows whose
// index in their half is out_dim or more are padding; a null output is not wanted).
struct RowsJob {
  int K = 0, B = 0, split = 0, out_dim = 0;
  const float* in_lo = nullptr;
  const float* in_hi = nullptr;
  float* out_lo = nullptr;
  float* out_hi = nullptr;
};

// Rows [row0, row0 + rows) of the block's stacked matrix times every sequence's input. A warp
// takes 4 sequences (a group) over all of K, or, with fewer groups than warps, a part of K; parts
// are summed through shared memory in part order.
template <bool Vec>
__device__ __forceinline__ void rows_phase(const RowsJob& job, const Layout& l, const __nv_bfloat16* weights,
                                           float* reduce, int row0, int rows) {
  const int K = job.K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int B = job.B;
  const int blocks256 = (K + 255) / 256;
  const int q_base =
      ((lane >> 4) & 1) * 32 + ((lane >> 3) & 1) * 16 + ((lane >> 2) & 1) * 8 + ((lane >> 1) & 1) * 4 + (lane & 1) * 2;
  const int groups = (B + kItems - 1) / kItems;
  const int kparts = max(1, kWarps / groups);
  auto put = [&](int row, int b, float value) {
    if (row < job.split) {
      if (job.out_lo && row < job.out_dim) job.out_lo[static_cast<std::size_t>(b) * job.out_dim + row] = value;
    } else if (job.out_hi && row - job.split < job.out_dim) {
      job.out_hi[static_cast<std::size_t>(b) * job.out_dim + (row - job.split)] = value;
    }
  };
  for (int tile = 0; tile < l.tiles; ++tile) {
    const int first = row0 + tile * kTileRows, last = row0 + min(rows, (tile + 1) * kTileRows);
    if (first >= last || !((job.out_lo && first < job.split) || (job.out_hi && last > job.split))) continue;
    const __nv_bfloat16* w_tile = weights + static_cast<std::size_t>(tile) * kTileRows * l.ld;
    const float* in = first < job.split ? job.in_lo : job.in_hi;
    // Warp w: group w (every kWarps-th when there are more groups than warps), or group
    // w % groups and K-part w / groups.
    for (int task = warp; task < max(groups, kWarps); task += kWarps) {
      const int g = groups >= kWarps ? task : task % groups, part = groups >= kWarps ? 0 : task / groups;
      const bool active = g < groups && part < kparts;
      float sums[2] = {0.0f, 0.0f};
      if (active) {
        const float* hs[kItems];
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          const int b = g * kItems + i;
          hs[i] = b < B ? in + static_cast<std::size_t>(b) * K : nullptr;
        }
        tile_product<Vec>(w_tile, l.ld, K, hs, part * blocks256 / kparts, (part + 1) * blocks256 / kparts, sums);
      }
      if (kparts == 1) {
        if (!active) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int q = q_base + e, row = first + q / kItems, b = g * kItems + q % kItems;
          if (row < last && b < B) put(row, b, sums[e]);
        }
      } else {
        if (active) {
          reduce[(part * groups + g) * kTileSums + q_base] = sums[0];
          reduce[(part * groups + g) * kTileSums + q_base + 1] = sums[1];
        }
        __syncthreads();
        for (int t = threadIdx.x; t < groups * kTileSums; t += kThreads) {
          const int gg = t / kTileSums, q = t % kTileSums, row = first + q / kItems, b = gg * kItems + q % kItems;
          if (row >= last || b >= B) continue;
          float s = 0.0f;
          for (int pp = 0; pp < kparts; ++pp) s += reduce[(pp * groups + gg) * kTileSums + q];
          put(row, b, s);
        }
        __syncthreads();
      }
    }
  }
}

// The forward's rows phase: [W_h ; W_write] times h (W_h h into `recurrent` when wanted, W_write h
// into `write_out` when not null).
__device__ __forceinline__ RowsJob forward_rows(const PersistentForwardArgs& a, const float* h, bool want_pre,
                                                float* write_out) {
  RowsJob job;
  job.K = a.dim;
  job.B = static_cast<int>(a.batch);
  job.split = a.dim;
  job.out_dim = a.dim;
  job.in_lo = h;
  job.in_hi = h;
  job.out_lo = want_pre ? a.recurrent : nullptr;
  job.out_hi = write_out;
  return job;
}

// Profile timing by one thread: ns added to slot k from the previous mark (start or lap) to now.
template <int K>
struct Laps {
  bool on = false;
  std::uint64_t at = 0, ns[K] = {};
  __device__ void start() {
    if (on) at = core::globaltimer();
  }
  __device__ void lap(int k) {
    if (!on) return;
    const std::uint64_t now = core::globaltimer();
    ns[k] += now - at;
    at = now;
  }
};

// The features a thread owns in the sequence phase and what it keeps of them between steps.
struct Owned {
  float h[kMaxFeatures], r[kMaxFeatures];
  float bias[kMaxFeatures];  // b_h, loaded once: a load after the step's stores would wait for L2
};

// The read attention of step t over H (= H_{t-1}) from the slot partial sums `part` (of H . h_{t-1}),
// then r_t and h_t = tanh(x_t + W_h h_{t-1} + r_t + b_h); stores the saved tensors of step t.
template <int MaxN>
__device__ __forceinline__ void finish_read(const PersistentForwardArgs& a, const step::Shared<MaxN>& sh,
                                            float (&part)[MaxN], std::uint32_t H, std::int64_t b, std::int64_t t,
                                            const float (&x)[kMaxFeatures], const float (&rec)[kMaxFeatures],
                                            Owned& own) {
  const int D = a.dim, N = a.slots;
  const std::int64_t B = a.batch;
  // Everything the loop needs, in registers: stores through the output pointers below could
  // otherwise alias `a` and `sh` and make the compiler reload them on every use.
  float* h_out = a.h + ((t + 1) * B + b) * D;
  __nv_bfloat16* h_bf16 = a.h_bf16 + ((t + 1) * B + b) * D;
  float* read = a.read + (t * B + b) * D;
  step::slot_attention<MaxN>(part, sh, a.scale, N, a.read_attn + (t * B + b) * N);
  float attn[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) attn[n] = n < N ? sh.attn[n] : 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    float r = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) r = fmaf(attn[n], lds(H + 4u * static_cast<std::uint32_t>(n * D + d)), r);
    }
    const float pre = ((x[j] + rec[j]) + r) + own.bias[j];
    const float h = tanhf(pre);
    h_out[d] = h;
    h_bf16[d] = __float2bfloat16_rn(h);
    read[d] = r;
    own.h[j] = h;
    own.r[j] = r;
  }
}

// x_t (or z_t) of sequence b for the thread's features.
__device__ __forceinline__ void load_xz(const PersistentForwardArgs& a, std::int64_t b, std::int64_t t, int half,
                                        float (&out)[kMaxFeatures]) {
  const float* src = a.xz + (b * a.steps + t) * 2 * a.dim + half * a.dim;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    out[j] = d < a.dim ? src[d] : 0.0f;
  }
}

// Step 0's read: H_0, h_{-1} (the start state), x_0 and W_h h_{-1}.
template <int MaxN>
__device__ __forceinline__ void first_read(const PersistentForwardArgs& a, const step::Shared<MaxN>& sh,
                                           std::uint32_t H, std::int64_t b, Owned& own) {
  const int D = a.dim, N = a.slots;
  float x[kMaxFeatures], rec[kMaxFeatures], hp[kMaxFeatures];
  load_xz(a, b, 0, 0, x);
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    rec[j] = d < D ? __ldcg(a.recurrent + b * D + d) : 0.0f;
    hp[j] = d < D ? a.h[b * D + d] : 0.0f;
  }
  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  score_partials<MaxN>(H, hp, D, N, part);
  finish_read<MaxN>(a, sh, part, H, b, 0, x, rec, own);
}

// Step t's write (attention, tape update, checkpoint, y_t), then step t + 1's read when there is
// one. w_t and W_h h_t come from this step's rows phase.
template <int MaxN>
__device__ __forceinline__ void write_then_read(const PersistentForwardArgs& a, const step::Shared<MaxN>& sh,
                                                std::uint32_t H, std::int64_t b, std::int64_t t, Owned& own,
                                                Laps<3>& sub) {
  sub.start();
  const int D = a.dim, N = a.slots;
  const std::int64_t B = a.batch, T = a.steps;
  const bool more = t + 1 < T;
  float w[kMaxFeatures], rec[kMaxFeatures], z[kMaxFeatures], x[kMaxFeatures];
  const float* w_src = a.write + (t * B + b) * D;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    w[j] = d < D ? __ldcg(w_src + d) : 0.0f;
    rec[j] = d < D && more ? __ldcg(a.recurrent + b * D + d) : 0.0f;
  }
  load_xz(a, b, t, 1, z);
  if (more) load_xz(a, b, t + 1, 0, x);

  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  score_partials<MaxN>(H, w, D, N, part);
  step::slot_attention<MaxN>(part, sh, a.scale, N, a.write_attn + (t * B + b) * N);
  sub.lap(0);

  float attn[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) attn[n] = n < N ? sh.attn[n] : 0.0f;
  float* checkpoint = t % a.interval == 0 ? a.checkpoints + ((t / a.interval) * B + b) * N * D : nullptr;
  __nv_bfloat16* y = a.y + (b * T + t) * D;
  float hj[kMaxFeatures], rj[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) hj[j] = own.h[j], rj[j] = own.r[j];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const std::uint32_t at = H + 4u * static_cast<std::uint32_t>(n * D + d);
        const float old = lds(at);
        if (checkpoint) checkpoint[n * D + d] = old;
        const float updated = step::tape_update(old, attn[n], w[j]);
        sts(at, updated);
        part[n] = fmaf(updated, hj[j], part[n]);  // step t + 1's read score
      }
    }
    const float g = (z[j] + rj[j]) + hj[j];
    y[d] = __float2bfloat16_rn(hj[j] * (g * step::sigmoidf(g)));
  }
  sub.lap(1);
  if (more) finish_read<MaxN>(a, sh, part, H, b, t + 1, x, rec, own);
  sub.lap(2);
}

template <int MaxN, bool Vec>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_forward_kernel(const __grid_constant__ Params<PersistentForwardArgs> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok_flag;
  const PersistentForwardArgs& a = p.a;
  const int D = a.dim;
  const std::int64_t B = a.batch, T = a.steps;
  unsigned char* at = smem;
  auto* weights = reinterpret_cast<__nv_bfloat16*>(at);
  at += p.l.weight_bytes;
  auto* reduce = reinterpret_cast<float*>(at);
  at += p.l.reduce_bytes;
  const step::Shared<MaxN> sh(reinterpret_cast<float*>(at));
  at += p.l.step_bytes;
  float* chip_tape = reinterpret_cast<float*>(at);

  // This block's rows, zero-padded to whole tiles and to ld columns.
  const int row0 = static_cast<int>(blockIdx.x) * p.l.rows_per_block;
  const int rows = max(0, min(p.l.rows_per_block, 2 * D - row0));
  for (int i = threadIdx.x; i < p.l.tiles * kTileRows * p.l.ld; i += kThreads) {
    const int r = i / p.l.ld, k = i % p.l.ld, row = row0 + r;
    __nv_bfloat16 w = __float2bfloat16_rn(0.0f);
    if (r < rows && k < D) {
      w = row < D ? a.w_h[static_cast<std::size_t>(row) * D + k] : a.w_write[static_cast<std::size_t>(row - D) * D + k];
    }
    weights[i] = w;
  }
  // The tape of this block's sequence (one sequence a block at most) stays in shared memory.
  const std::int64_t per_tape = static_cast<std::int64_t>(a.slots) * D;
  const bool owner = static_cast<std::int64_t>(blockIdx.x) < B;
  if (owner) {
    const float* src = a.tape + blockIdx.x * per_tape;
    for (std::int64_t i = threadIdx.x; i < per_tape; i += kThreads) chip_tape[i] = src[i];
  }
  __syncthreads();
  const std::uint32_t tape = core::smem_addr(chip_tape);
  Owned own;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    own.bias[j] = d < D ? __bfloat162float(a.bias[d]) : 0.0f;
  }

  // Profile (thread 0 of block 0 and of the last block): ns in each kind of phase; block 0 also
  // splits its sequence phases (sub).
  Laps<4> phases;
  phases.on = a.profile != nullptr && threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1);
  phases.start();
  Laps<3> sub;
  sub.on = phases.on && blockIdx.x == 0;
  std::uint32_t passed = 0;
  rows_phase<Vec>(forward_rows(a, a.h, true, nullptr), p.l, weights, reduce, row0, rows);  // W_h h_{-1}
  phases.lap(0);
  bool ok = grid_barrier(p.grid, passed, &ok_flag);
  phases.lap(1);
  if (ok && T > 0) {
    if (owner) first_read<MaxN>(a, sh, tape, blockIdx.x, own);
    phases.lap(2);
  }
  for (std::int64_t t = 0; ok && t < T; ++t) {
    if (!(ok = grid_barrier(p.grid, passed, &ok_flag))) break;
    phases.lap(3);
    // w_t = W_write h_t and, unless last, W_h h_t.
    rows_phase<Vec>(forward_rows(a, a.h + (t + 1) * B * D, t + 1 < T, a.write + t * B * D), p.l, weights, reduce, row0,
                    rows);
    phases.lap(0);
    if (!(ok = grid_barrier(p.grid, passed, &ok_flag))) break;
    phases.lap(1);
    if (owner) write_then_read<MaxN>(a, sh, tape, blockIdx.x, t, own, sub);
    phases.lap(2);
  }
  __syncthreads();  // a thread's features of the tape are not the elements it copies back
  if (ok && owner) {
    float* dst = a.tape + blockIdx.x * per_tape;
    for (std::int64_t i = threadIdx.x; i < per_tape; i += kThreads) dst[i] = chip_tape[i];
  }
  if (phases.on) {
    for (int k = 0; k < 4; ++k) a.profile[(blockIdx.x == 0 ? 0 : 4) + k] = phases.ns[k];
  }
  if (sub.on) {
    for (int k = 0; k < 3; ++k) a.profile[8 + k] = sub.ns[k];
  }
}

// ---- Backward ----
//
// Per step t in reverse, a sequence phase and a rows phase between grid-wide barriers, as the
// forward. The write attention's gradients of step t need only dL/dH_t, so they are computed at
// the end of step t + 1's sequence phase; a rows phase then carries both products a step needs at
// once: W_h^T dp_{t+1} (to dL/dh_t) and W_write^T dw_t (to dL/dh_t as well). Sequence phase of t:
// the gate and dL/dh_t, the tanh, the read attention's backward over H_{t-1} (dL/dH_{t-1} and the
// read scores' part of dL/dh_{t-1}), then the write attention's backward of step t - 1 over
// H_{t-2} (dw_{t-1} and the rest of dL/dH_{t-2}). dL/dH stays in the block's shared memory, and so
// does the tape a step reads: H_{t-2} is brought in by step t's write-attention pass and read again
// by step t - 1's read attention. The tapes come from the segment replayed from its checkpoint by
// the block (the forward's update arithmetic: the forward's bits) into the segment scratch in
// global memory; a replay ends with the tape it is needed for already on chip.

// What a thread keeps of its features between backward steps.
struct BackOwned {
  float dh_read[kMaxFeatures];  // the read attention's part of dL/dh_{t-1}, from step t
  float d_bias[kMaxFeatures];   // dL/db_h of the sequence, summed over the steps walked
};

// The tape before step t of sequence b in the replayed segment starting at s0 ([K, B, N, D]).
__device__ __forceinline__ const float* segment_tape(const PersistentBackwardArgs& a, std::int64_t b, std::int64_t t,
                                                     std::int64_t s0) {
  return a.segment + ((t - s0) * a.batch + b) * a.slots * a.dim;
}

// The tapes before steps s0 .. s0 + count - 1 of sequence b (the thread's features, every slot),
// from the checkpoint and the saved writes, into the segment; `scratch` (shared) holds the running
// tape and ends with the segment's last.
template <int MaxN>
__device__ __forceinline__ void replay_segment(const PersistentBackwardArgs& a, std::int64_t b, std::int64_t s0,
                                               std::uint32_t scratch) {
  const int D = a.dim, N = a.slots;
  const std::int64_t B = a.batch, per_tape = static_cast<std::int64_t>(N) * D;
  const std::int64_t count = min(a.steps, s0 + a.interval) - s0;
  const float* checkpoint = a.checkpoints + ((s0 / a.interval) * B + b) * per_tape;
  float* seg = a.segment + b * per_tape;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    for (int n = 0; n < N; ++n) {
      const float v = checkpoint[n * D + d];
      seg[n * D + d] = v;
      sts(scratch + 4u * static_cast<std::uint32_t>(n * D + d), v);
    }
  }
  // Step k's write attention and values are loaded before step k - 1's stores (a load after them
  // could not be moved above: see backward_step).
  float attn[MaxN], w[kMaxFeatures];
  auto load = [&](std::int64_t k) {
    const std::int64_t row = (s0 + k - 1) * B + b;
    const bool in = k < count;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) attn[n] = in && n < N ? a.write_attn[row * N + n] : 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxFeatures; ++j) {
      const int d = threadIdx.x + j * kThreads;
      w[j] = in && d < D ? a.write[row * D + d] : 0.0f;
    }
  };
  load(1);
  for (std::int64_t k = 1; k < count; ++k) {
    float* out = seg + k * B * per_tape;
    float attn_k[MaxN], w_k[kMaxFeatures];
#pragma unroll
    for (int n = 0; n < MaxN; ++n) attn_k[n] = attn[n];
#pragma unroll
    for (int j = 0; j < kMaxFeatures; ++j) w_k[j] = w[j];
    load(k + 1);
#pragma unroll
    for (int j = 0; j < kMaxFeatures; ++j) {
      const int d = threadIdx.x + j * kThreads;
      if (d >= D) break;
#pragma unroll
      for (int n = 0; n < MaxN; ++n) {
        if (n < N) {
          const std::uint32_t at = scratch + 4u * static_cast<std::uint32_t>(n * D + d);
          const float v = step::tape_update(lds(at), attn_k[n], w_k[j]);
          sts(at, v);
          out[n * D + d] = v;
        }
      }
    }
  }
}

// The attention weights and score gradients of one softmax backward, from the slot partial sums
// `part` and the saved weights `attn_in` ([N]); `scores` (optional) receives the score gradients.
template <int MaxN>
__device__ __forceinline__ void slot_attention_backward(float (&part)[MaxN], const step::Shared<MaxN>& sh,
                                                        const float* attn_in, int N, bool detach, float* scores,
                                                        float (&attn)[MaxN], float (&ds)[MaxN]) {
  __syncthreads();  // the previous attention's weights are no longer read
  if (threadIdx.x < N) sh.attn[threadIdx.x] = attn_in[threadIdx.x];
  step::block_slot_sums<MaxN>(part, sh, N);
  if (threadIdx.x < 32) step::softmax_backward_warp<MaxN>(sh, N, detach);
  __syncthreads();
  if (scores && threadIdx.x < N) scores[threadIdx.x] = sh.ds[threadIdx.x];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) {
    attn[n] = n < N ? sh.attn[n] : 0.0f;
    ds[n] = n < N ? sh.ds[n] : 0.0f;
  }
}

// Sequence phase of step t (see above). `products`: this step's rows phase ran (not the last step).
// `s0`: the first step of the segment in the scratch, moved back when step t - 1 needs the one before.
template <int MaxN>
__device__ __forceinline__ void backward_step(const PersistentBackwardArgs& a, const step::Shared<MaxN>& sh,
                                              std::uint32_t dH, std::uint32_t tape, std::int64_t b, std::int64_t t,
                                              bool products, std::int64_t& s0, BackOwned& own, Laps<4>& sub) {
  sub.start();
  const int D = a.dim, N = a.slots;
  const std::int64_t B = a.batch, T = a.steps, row = t * B + b;
  // `tape` (shared) holds H_{t-1} on entry and H_{t-2} on return.
  auto H = [&](int n, int d) { return lds(tape + 4u * static_cast<std::uint32_t>(n * D + d)); };
  const float* xz = a.xz + (b * T + t) * 2 * D;
  const __nv_bfloat16* dy = a.dy + (b * T + t) * D;
  // Loads and arithmetic first, stores last: a load after a store through another pointer cannot
  // be moved above it (they might alias) and would wait for memory each feature.
  float hp[kMaxFeatures], dg[kMaxFeatures], dp[kMaxFeatures], dr[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    const float h = a.h[(row + B) * D + d];
    hp[j] = a.h[row * D + d];
    const float rec = products ? __ldcg(a.recurrent + b * D + d) : 0.0f;
    const float dhw = products ? __ldcg(a.dh_write + b * D + d) : 0.0f;
    // Gate and output: y = h * silu(g), g = z + r + h.
    const float g = (xz[D + d] + a.read[row * D + d]) + h;
    const float s = step::sigmoidf(g);
    const float dout = __bfloat162float(dy[d]);
    dg[j] = dout * h * (s * (1.0f + g * (1.0f - s)));
    const float dh_local = ((rec + own.dh_read[j]) + dout * (g * s)) + dg[j];
    dp[j] = (dh_local + dhw) * (1.0f - h * h);
    own.d_bias[j] += dp[j];
    dr[j] = dg[j] + dp[j];
  }
  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) part[n] = fmaf(dr[j], H(n, d), part[n]);
    }
  }
  __nv_bfloat16* dxz = a.dxz + (b * T + t) * 2 * D;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    dxz[D + d] = __float2bfloat16_rn(dg[j]);
    a.d_pre[b * D + d] = dp[j];
    a.d_pre_bf16[row * D + d] = __float2bfloat16_rn(dp[j]);
    dxz[d] = __float2bfloat16_rn(dp[j]);
  }
  float attn[MaxN], ds[MaxN];
  slot_attention_backward<MaxN>(part, sh, a.read_attn + row * N, N, a.detach_read,
                                a.read_scores ? a.read_scores + row * N : nullptr, attn, ds);
  sub.lap(0);
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    float dh_prev = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const std::uint32_t at = dH + 4u * static_cast<std::uint32_t>(n * D + d);
        sts(at, lds(at) + fmaf(attn[n], dr[j], (a.scale * ds[n]) * hp[j]));
        dh_prev = fmaf(ds[n], H(n, d), dh_prev);
      }
    }
    own.dh_read[j] = a.scale * dh_prev;
  }
  sub.lap(1);
  if (t == 0) return;

  // The write attention of step t - 1 over H_{t-2}: replayed into `tape` when step t - 1 starts
  // the segment before, else copied there from the segment as the scores are summed.
  const bool replayed = t - 1 < s0;
  if (replayed) {
    s0 -= a.interval;
    replay_segment<MaxN>(a, b, s0, tape);
  }
  sub.lap(2);
  const float* Hp = segment_tape(a, b, t - 1, s0);
  const std::int64_t prev = row - B;
  float w[kMaxFeatures], dw[kMaxFeatures];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    w[j] = a.write[prev * D + d];
    float hv[MaxN];
#pragma unroll
    for (int n = 0; n < MaxN; ++n) hv[n] = n < N ? (replayed ? H(n, d) : Hp[n * D + d]) : 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        if (!replayed) sts(tape + 4u * static_cast<std::uint32_t>(n * D + d), hv[n]);
        part[n] = fmaf(lds(dH + 4u * static_cast<std::uint32_t>(n * D + d)), w[j] - hv[n], part[n]);
      }
    }
  }
  slot_attention_backward<MaxN>(part, sh, a.write_attn + prev * N, N, a.detach_write,
                                a.write_scores ? a.write_scores + prev * N : nullptr, attn, ds);
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    float v = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const std::uint32_t at = dH + 4u * static_cast<std::uint32_t>(n * D + d);
        const float dh_n = lds(at);
        const float sds = a.scale * ds[n];
        v = fmaf(attn[n], dh_n, v);
        v = fmaf(sds, H(n, d), v);
        sts(at, fmaf(1.0f - attn[n], dh_n, sds * w[j]));
      }
    }
    dw[j] = v;
  }
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) {
    const int d = threadIdx.x + j * kThreads;
    if (d >= D) break;
    a.d_write[b * D + d] = dw[j];
    a.d_write_bf16[prev * D + d] = __float2bfloat16_rn(dw[j]);
  }
  sub.lap(3);
}

template <int MaxN, bool Vec>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_backward_kernel(const __grid_constant__ Params<PersistentBackwardArgs> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok_flag;
  const PersistentBackwardArgs& a = p.a;
  const int D = a.dim, N = a.slots;
  const std::int64_t B = a.batch, T = a.steps;
  unsigned char* at = smem;
  auto* weights = reinterpret_cast<__nv_bfloat16*>(at);
  at += p.l.weight_bytes;
  auto* reduce = reinterpret_cast<float*>(at);
  at += p.l.reduce_bytes;
  const step::Shared<MaxN> sh(reinterpret_cast<float*>(at));
  at += p.l.step_bytes;
  const std::int64_t per_tape = static_cast<std::int64_t>(N) * D;
  float* chip_d_tape = reinterpret_cast<float*>(at);
  const std::uint32_t d_tape = core::smem_addr(chip_d_tape);
  const std::uint32_t tape = core::smem_addr(chip_d_tape + (per_tape + 3) / 4 * 4);

  // This block's rows of [W_h^T ; W_write^T] (rows of the second from split), zero-padded.
  const int row0 = static_cast<int>(blockIdx.x) * p.l.rows_per_block;
  const int rows = max(0, min(p.l.rows_per_block, 2 * p.l.split - row0));
  for (int i = threadIdx.x; i < p.l.tiles * kTileRows * p.l.ld; i += kThreads) {
    const int r = i / p.l.ld, k = i % p.l.ld, row = row0 + r;
    __nv_bfloat16 w = __float2bfloat16_rn(0.0f);
    if (r < rows && k < D) {
      if (row < D) {
        w = a.w_h[static_cast<std::size_t>(k) * D + row];
      } else if (row >= p.l.split && row - p.l.split < D) {
        w = a.w_write[static_cast<std::size_t>(k) * D + (row - p.l.split)];
      }
    }
    weights[i] = w;
  }
  const bool owner = static_cast<std::int64_t>(blockIdx.x) < B;
  const auto b = static_cast<std::int64_t>(blockIdx.x);
  BackOwned own;
#pragma unroll
  for (int j = 0; j < kMaxFeatures; ++j) own.dh_read[j] = own.d_bias[j] = 0.0f;
  std::int64_t s0 = (T - 1) / a.interval * a.interval;
  if (owner) {
    for (std::int64_t i = threadIdx.x; i < per_tape; i += kThreads) chip_d_tape[i] = 0.0f;
    // dL/dH_{T-1} is zero, so the write attention of the last step has no gradient.
    for (int d = threadIdx.x; d < D; d += kThreads) {
      a.d_write_bf16[((T - 1) * B + b) * D + d] = __float2bfloat16_rn(0.0f);
    }
    if (a.write_scores && threadIdx.x < N) a.write_scores[((T - 1) * B + b) * N + threadIdx.x] = 0.0f;
  }
  __syncthreads();

  Laps<4> phases;
  phases.on = a.profile != nullptr && threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1);
  phases.start();
  Laps<4> sub;
  sub.on = phases.on && blockIdx.x == 0;
  if (owner) {
    replay_segment<MaxN>(a, b, s0, tape);  // leaves H_{T-2} in `tape`
    backward_step<MaxN>(a, sh, d_tape, tape, b, T - 1, false, s0, own, sub);
  }
  phases.lap(2);
  RowsJob job;
  job.K = D;
  job.B = static_cast<int>(B);
  job.split = p.l.split;
  job.out_dim = D;
  job.in_lo = a.d_pre;
  job.in_hi = a.d_write;
  job.out_lo = a.recurrent;
  job.out_hi = a.dh_write;
  std::uint32_t passed = 0;
  bool ok = true;
  for (std::int64_t t = T - 2; ok && t >= 0; --t) {
    if (!(ok = grid_barrier(p.grid, passed, &ok_flag))) break;
    phases.lap(3);
    rows_phase<Vec>(job, p.l, weights, reduce, row0, rows);  // W_h^T dp_{t+1}, W_write^T dw_t
    phases.lap(0);
    if (!(ok = grid_barrier(p.grid, passed, &ok_flag))) break;
    phases.lap(1);
    if (owner) backward_step<MaxN>(a, sh, d_tape, tape, b, t, true, s0, own, sub);
    phases.lap(2);
  }
  __syncthreads();
  if (ok && owner) {
    float* dst = a.d_tape + b * per_tape;
    for (std::int64_t i = threadIdx.x; i < per_tape; i += kThreads) dst[i] = chip_d_tape[i];
#pragma unroll
    for (int j = 0; j < kMaxFeatures; ++j) {
      const int d = threadIdx.x + j * kThreads;
      if (d < D) a.d_bias[b * D + d] = own.d_bias[j];
    }
  }
  if (phases.on) {
    for (int k = 0; k < 4; ++k) a.profile[(blockIdx.x == 0 ? 0 : 4) + k] = phases.ns[k];
  }
  if (sub.on) {
    for (int k = 0; k < 4; ++k) a.profile[8 + k] = sub.ns[k];
  }
}

template <typename Args>
void launch_kernel(void (*kernel)(Params<Args>), Direction direction, const Args& args, const Device& dev,
                   const Geometry& g, cudaStream_t stream) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, g.smem));
  if (per_sm * dev.sms < g.grid) {
    throw core::Error(std::string("e29a persistent ") + direction_name(direction) + ": " + std::to_string(g.grid) +
                      " blocks of " + std::to_string(g.smem) + " bytes of shared memory cannot all be resident (" +
                      std::to_string(per_sm) + " per SM, " + std::to_string(dev.sms) + " SMs)");
  }
  Params<Args> p;
  p.a = args;
  p.grid.sync = args.sync;
  p.grid.stall_block = args.stall_block;
  p.grid.timeout_ns = static_cast<std::uint64_t>(args.timeout_seconds * 1e9);
  p.l = g.l;
  void* params[] = {&p};
  CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(g.grid), dim3(kThreads), params,
                                         g.smem, stream));
}

template <int MaxN>
void launch(const PersistentForwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  if (args.dim % 8 == 0) {
    launch_kernel(persistent_forward_kernel<MaxN, true>, Direction::forward, args, dev, g, stream);
  } else {
    launch_kernel(persistent_forward_kernel<MaxN, false>, Direction::forward, args, dev, g, stream);
  }
}

template <int MaxN>
void launch(const PersistentBackwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  if (args.dim % 8 == 0) {
    launch_kernel(persistent_backward_kernel<MaxN, true>, Direction::backward, args, dev, g, stream);
  } else {
    launch_kernel(persistent_backward_kernel<MaxN, false>, Direction::backward, args, dev, g, stream);
  }
}

// The instances of one slot capacity (layer_persistent_n<MaxN>.cu: one file each, so the four
// capacities' kernels compile in parallel).
#define E29A_PERSISTENT_INSTANCES(MaxN)                                                                   \
  template void launch<MaxN>(const PersistentForwardArgs&, const Device&, const Geometry&, cudaStream_t); \
  template void launch<MaxN>(const PersistentBackwardArgs&, const Device&, const Geometry&, cudaStream_t)

}  // namespace models::e29a::kernels::persistent
