// The persistent E29a kernels (layer_persistent.h), both directions: one cooperative grid of
// 256-thread blocks, at most one per SM.
//
// Shared memory of a block: its rows of the stacked [W_h ; W_write] (bf16, 16-row tiles in mma
// fragment order), the cross-warp partial sums, the step scratch (slot sums, attentions) and its
// sequence's tape [N, D].
//
// Rows phase on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulation): h is fp32,
// so each value is split into three bf16 parts that sum to it exactly (split_pair); every product
// of a bf16 weight and a part is exact in fp32, and only the sums' order and rounding differ from
// the hybrid path's fp32 products. A block takes a row block of the stacked matrix times its part
// of the batch (RowsShare: with the batch in two parts, twice the rows and half of h a step, each
// h value split once for two tiles). A warp takes one or two 16-row tiles x 8 sequences over all
// of K, or with fewer tasks than warps a range of it, the ranges summed in range order by the
// first range's warp; h comes through L2 in fragment order (frag_at), the next 8 k-steps loading
// while these are multiplied. (On the FMA units, 16 rows x 4 sequences a warp with the bf16
// weights unpacked, the phase took 10.6 us a step at B 64, D 1024; on the tensor cores with the
// batch in one part, 6.8.)
//
// Sequence phase, per sequence and thread-owned features (h_t and r_t stay with the thread from
// one step to the next; x, z, w_t and W_h h_t arrive in one round of loads): the write attention
// of t, the tape update (its read scores for t + 1 summed in the same pass), y_t, then the read
// attention of t + 1 and h_{t+1}. Formulas are layer_step.cuh's (tape_update, softmax_warp), per
// feature in the hybrid path's order; the slot sums are SeqShared's (lane folds, then the warps in
// order, then the cluster's blocks in rank order). A sequence takes one block, or a cluster of C
// blocks each with a slice of the features (Slice) where blocks are to spare (the host chooses
// C, a template parameter).
//
// Every phase is inlined into its kernel, so the launch's arguments are read from the constant
// bank where they are used; as called functions they took them through a generic pointer, reloaded
// after every store that might alias them (those loads were among the sequence phase's top
// stalls). Inlined, the kernels take minutes to compile: each slot capacity's are instantiated in a
// file of their own (layer_persistent_n*.cu), so the four compile in parallel. (nvcc's
// --split-compile left the FMA rows phase's butterfly slower, 11.0 -> 18.9 us a step at B 64.)
// Each kernel has three variants (Variant): D 1024 with N the capacity as constants (`full`: the
// sequence phase's passes without loop exits, Slice), else D and N from the launch with h loaded
// 16 bytes at a time (D % 8 == 0) or one float at a time.
//
// Barriers: one counter for the launch; every block release-adds 1 and acquires until it reaches
// blocks x barriers passed; zeroed before the launch. Every wait has a deadline.
#pragma once

#include <string>
#include <type_traits>

#include <cooperative_groups.h>

#include "core/async_copy.cuh"
#include "core/error.h"
#include "core/memory_order.cuh"
#include "models/e29a/layer_persistent_launch.h"
#include "models/e29a/layer_step.cuh"
#include "models/ops/mma_bf16.cuh"

namespace models::e29a::kernels::persistent {

namespace cg = cooperative_groups;

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

// A grid-wide barrier with a deadline, in two halves: the block's arrival (its earlier writes
// released), then the wait for every block's (acquired). What a block does between them overlaps
// the others' arrivals: it must not write what another block reads after the barrier, nor read
// what another writes before it.
__device__ inline void grid_arrive(const GridSync& g, std::uint32_t& passed) {
  ++passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool stall = g.stall_block == static_cast<int>(blockIdx.x) && passed == 1;
    if (!stall) core::red_add_release(&g.sync->arrived, 1);
  }
}

// Returns false when the launch aborted (here or elsewhere).
__device__ inline bool grid_wait(const GridSync& g, std::uint32_t passed, int* ok_flag) {
  if (threadIdx.x == 0) {
    PersistentSync* s = g.sync;
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

__device__ inline bool grid_barrier(const GridSync& g, std::uint32_t& passed, int* ok_flag) {
  grid_arrive(g, passed);
  return grid_wait(g, passed, ok_flag);
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

// The shared address of element (n, d) of an on-chip [N, D] fp32 array at shared address `base`.
__device__ __forceinline__ std::uint32_t at_nd(std::uint32_t base, int n, int d, int D) {
  return base + 4u * static_cast<std::uint32_t>(n * D + d);
}

// One step of the lanes' butterfly over v[0, 2 Half): a lane keeps half of its values (the upper
// half when its lane bit Dist is set) and adds its partner's (lane ^ Dist) copy of that half. A
// template step, so every index is a constant and v stays in registers (a loop over the steps left
// v in local memory with computed offsets).
// At > 0: the same over v[At, At + 2 Half).
template <int Half, int Dist, int Size, int At = 0>
__device__ __forceinline__ void butterfly_step(float (&v)[Size], int lane) {
  static_assert(At + 2 * Half <= Size);
  const bool upper = (lane & Dist) != 0;
#pragma unroll
  for (int q = At; q < At + Half; ++q) {
    const float keep = upper ? v[q + Half] : v[q];
    const float send = upper ? v[q] : v[q + Half];
    v[q] = keep + __shfl_xor_sync(kFull, send, Dist);
  }
}

// h (fp32) as three bf16 parts for two features: hi + mid + lo = h exactly (each part takes the
// next 8 bits of the 24-bit significand, the remainders exact in fp32), so W h is a sum of exact
// bf16 products. Pairs as mma B operands (the first feature in the low half).
struct SplitPair {
  std::uint32_t hi, mid, lo;
};
__device__ __forceinline__ SplitPair split_pair(float x, float y) {
  using ops::gpu::high_of;
  using ops::gpu::low_of;
  using ops::gpu::pack_bf16;
  SplitPair s;
  s.hi = pack_bf16(x, y);
  const float rx = x - low_of(s.hi), ry = y - high_of(s.hi);
  s.mid = pack_bf16(rx, ry);
  s.lo = pack_bf16(rx - low_of(s.mid), ry - high_of(s.mid));
  return s;
}

// NT tiles' 16 rows each times 8 sequences over this warp's k-steps [s0, s1) (16 features each)
// on the tensor cores: lane (g, c) = (lane / 4, lane % 4) loads features 4c .. 4c + 3 of k-step s
// of sequence g at h + s * stride (nullptr: absent, zero; RowsJob says where they lie), splits
// them once for all NT tiles (tile t's weights at w_frag + t * tile_stride, in fragment order:
// load_rows), and ends with out[t] = C_t[g][2c, 2c + 1] and C_t[g + 8][2c, 2c + 1] (rows x
// sequences).
// The hi, mid and lo parts' products go to three accumulators a tile (so consecutive products do
// not wait on each other), each batch of kAhead k-steps from zero and then added to its part's
// total in fp32: the tensor cores' accumulation truncates, and in one chain over all of K the
// errors came out up to 4x the FMA sums' on the same draws, batched like them; the parts are
// summed smallest first at the end. h of the next batch is loaded while this one is multiplied (a
// ring refilling one k-step at a time, and L1 prefetches further ahead, were both slower).
template <bool Vec, bool Whole, int NT>
__device__ __forceinline__ void tile_product(const uint4* w_frag, int tile_stride, const float* h, int stride, int D,
                                             int s0, int s1, float (&out)[NT][4]) {
  constexpr int kAhead = 8;
  const int lane = threadIdx.x & 31, c = lane & 3;
  float acc[NT][3][4] = {};
  float4 next[kAhead];
  auto load = [&](int first) {
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int s = first + u, k = s * kStep + 4 * c;
      if constexpr (Vec) {
        const bool in = h != nullptr && s < s1 && k < D;
        next[u] = in ? __ldcg(reinterpret_cast<const float4*>(h + s * stride)) : float4{0, 0, 0, 0};
      } else {
        const bool in = h != nullptr && s < s1;
        const float* at = h + s * stride;
        next[u].x = in && k < D ? __ldcg(at) : 0.0f;
        next[u].y = in && k + 1 < D ? __ldcg(at + 1) : 0.0f;
        next[u].z = in && k + 2 < D ? __ldcg(at + 2) : 0.0f;
        next[u].w = in && k + 3 < D ? __ldcg(at + 3) : 0.0f;
      }
    }
  };
  load(s0);
  for (int s = s0; s < s1; s += kAhead) {
    float4 cur[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) cur[u] = next[u];
    load(s + kAhead);
    float part[NT][3][4] = {};
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (!Whole && s + u >= s1) break;
      const SplitPair lo = split_pair(cur[u].x, cur[u].y), hi = split_pair(cur[u].z, cur[u].w);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint4 w = w_frag[t * tile_stride + (s + u) * 32 + lane];
        const std::uint32_t a[4] = {w.x, w.y, w.z, w.w};
        ops::gpu::mma_bf16(part[t][0], a, lo.hi, hi.hi);
        ops::gpu::mma_bf16(part[t][1], a, lo.mid, hi.mid);
        ops::gpu::mma_bf16(part[t][2], a, lo.lo, hi.lo);
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int p = 0; p < 3; ++p)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][p][e] += part[t][p][e];
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[t][e] = acc[t][0][e] + (acc[t][1][e] + acc[t][2][e]);
}

// What one rows phase multiplies: rows below split times in_lo, rows from split times in_hi (both
// [B, K], or in fragment order: frag_at); row r < split goes to out_lo[b, r], row r >= split to
// out_hi[b, r - split] (rows whose index in their half is out_dim or more are padding; a null
// output is not wanted).
struct RowsJob {
  int K = 0, B = 0, split = 0, out_dim = 0;
  bool frag = false;  // inputs in fragment order (frag_at), else [B, K]
  const float* in_lo = nullptr;
  const float* in_hi = nullptr;
  float* out_lo = nullptr;
  float* out_hi = nullptr;
};

// Where feature d of sequence b lies in fragment order: [b / 8][d / 16][lane][4] with lane =
// 4 (b % 8) + (d % 16) / 4, D rounded up to whole k-steps. A warp's loads of a k-step then take 512
// contiguous bytes (four whole lines) where [B, D] rows gave 64 bytes from each of eight rows (rows
// phase 5.5 -> 5.4 us a step at B 64, 3.3 -> 3.1 at B 16; H100).
__device__ __forceinline__ std::size_t frag_at(std::int64_t b, int d, int D) {
  const int ld = (D + kStep - 1) / kStep * kStep;
  const std::size_t step = static_cast<std::size_t>(b / kGroup) * (ld / kStep) + d / kStep;  // of all groups
  return (step * 32 + (b % kGroup) * 4 + (d % kStep) / 4) * 4 + d % 4;
}

// What a block multiplies in every rows phase: rows [row0, row0 + rows) of the stacked matrix
// (Layout::rows_per_block a row block) times the sequence groups of its part of the batch (part
// p of Layout::batch_parts takes groups [p G / parts, (p + 1) G / parts) of G = ceil(B / 8)).
// Block i is row block i / parts, batch part i % parts; blocks past the row blocks have none.
struct RowsShare {
  int row0 = 0, rows = 0, part = 0;
};
__device__ __forceinline__ RowsShare rows_share(const Layout& l, int total_rows) {
  RowsShare r;
  const int block = static_cast<int>(blockIdx.x), row_block = block / l.batch_parts;
  r.part = block % l.batch_parts;
  r.row0 = row_block * l.rows_per_block;
  r.rows = row_block < l.row_blocks ? max(0, min(l.rows_per_block, total_rows - r.row0)) : 0;
  return r;
}

// The block's share of one rows phase. Its tiles go in units: two adjacent tiles that take the
// same input and are both wanted share a unit, so each h value is split once for both (a unit of
// one otherwise). A warp takes one unit x 8 sequences (a group) over all of K, or, with fewer
// tasks than warps, a part of K; then every part's fragments go to shared memory and every thread
// adds one output's parts in part order and stores it.
template <bool Vec, bool Full>
__device__ __forceinline__ void rows_phase(const RowsJob& job, const Layout& l, const __nv_bfloat16* weights,
                                           float* reduce, const RowsShare& share) {
  const int K = Full ? kMaxDim : job.K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int B = job.B;
  const int steps = (Full ? K : l.ld) / kStep, tile_stride = steps * 32;
  const int all_groups = (B + kGroup - 1) / kGroup;
  const int g0 = share.part * all_groups / l.batch_parts;
  const int groups = (share.part + 1) * all_groups / l.batch_parts - g0;
  if (share.rows == 0 || groups <= 0) return;
  auto put = [&](int row, int b, float value) {
    if (row < job.split) {
      if (job.out_lo && row < job.out_dim) job.out_lo[static_cast<std::size_t>(b) * job.out_dim + row] = value;
    } else if (job.out_hi && row - job.split < job.out_dim) {
      job.out_hi[static_cast<std::size_t>(b) * job.out_dim + (row - job.split)] = value;
    }
  };
  // Tile t's rows [first, last) of the stacked matrix, whether any is wanted, and its input.
  auto first_of = [&](int t) { return share.row0 + t * kTileRows; };
  auto last_of = [&](int t) { return share.row0 + min(share.rows, (t + 1) * kTileRows); };
  auto wanted = [&](int t) {
    const int first = first_of(t), last = last_of(t);
    return first < last && ((job.out_lo && first < job.split) || (job.out_hi && last > job.split));
  };
  auto input_of = [&](int t) { return first_of(t) < job.split ? job.in_lo : job.in_hi; };
  // Sum e of lane q's fragment: row offset and sequence offset within the tile and group.
  auto row_of = [](int q, int e) { return (q >> 2) + 8 * (e >> 1); };
  auto seq_of = [](int q, int e) { return 2 * (q & 3) + (e & 1); };
  // A K-part's fragments in shared memory: up to two tiles of 32 lanes' float4 a group.
  constexpr int kPartSlots = 2 * 32;
  for (int tile = 0; tile < l.tiles;) {
    if (!wanted(tile)) {
      ++tile;
      continue;
    }
    const int width = tile + 1 < l.tiles && wanted(tile + 1) && input_of(tile + 1) == input_of(tile) ? 2 : 1;
    const uint4* w_frag = reinterpret_cast<const uint4*>(weights) + static_cast<std::size_t>(tile) * tile_stride;
    const float* in = input_of(tile);
    const int kparts = max(1, kWarps / groups);
    // Warp w: group w (every kWarps-th when there are more groups than warps), or group
    // w % groups and K-part w / groups.
    for (int task = warp; task < max(groups, kWarps); task += kWarps) {
      const int g = groups >= kWarps ? task : task % groups, part = groups >= kWarps ? 0 : task / groups;
      const bool active = g < groups && part < kparts;
      float sums[2][4] = {};
      if (active) {
        const int b = (g0 + g) * kGroup + (lane >> 2);
        const float* h = b >= B     ? nullptr
                         : job.frag ? in + static_cast<std::size_t>(g0 + g) * steps * kTileSums + 4 * lane
                                    : in + static_cast<std::size_t>(b) * K + 4 * (lane & 3);
        const int stride = job.frag ? kTileSums : kStep;
        const int s0 = part * steps / kparts, s1 = (part + 1) * steps / kparts;
        // Full: K is 64 k-steps and kparts divides 8, so every part is whole batches of 8.
        if (width == 2) {
          tile_product<Vec, Full, 2>(w_frag, tile_stride, h, stride, K, s0, s1, sums);
        } else {
          float one[1][4];
          tile_product<Vec, Full, 1>(w_frag, tile_stride, h, stride, K, s0, s1, one);
#pragma unroll
          for (int e = 0; e < 4; ++e) sums[0][e] = one[0][e];
        }
      }
      if (kparts > 1) {
        // Every K-part leaves its fragments in shared memory; then every thread adds one output's
        // parts in part order and stores it (by part 0's warps alone, 14 16-byte loads and 8 stores
        // a lane at B 16: rows phase 2.74 -> 2.32 us a step, H200).
        float4* slots = reinterpret_cast<float4*>(reduce);
        if (active) {
          for (int t = 0; t < width; ++t)
            slots[(part * groups + g) * kPartSlots + t * 32 + lane] = {sums[t][0], sums[t][1], sums[t][2], sums[t][3]};
        }
        __syncthreads();
        for (int q = threadIdx.x; q < groups * width * 128; q += kThreads) {
          const int e = q & 3, q_lane = (q >> 2) & 31, wide = width - 1, t = (q >> 7) & wide, gg = (q >> 7) >> wide;
          const int at = (gg * kPartSlots + t * 32 + q_lane) * 4 + e, part_stride = groups * kPartSlots * 4;
          // Every part loaded before any is added (a loop to kparts loaded one at a time).
          float part_sums[kWarps];
#pragma unroll
          for (int pp = 0; pp < kWarps; ++pp) part_sums[pp] = reduce[at + min(pp, kparts - 1) * part_stride];
          float v = part_sums[0];
#pragma unroll
          for (int pp = 1; pp < kWarps; ++pp) v = pp < kparts ? v + part_sums[pp] : v;
          const int row = first_of(tile + t) + row_of(q_lane, e), b = (g0 + gg) * kGroup + seq_of(q_lane, e);
          if (row < last_of(tile + t) && b < B) put(row, b, v);
        }
        // The slots are taken again by the next unit (the next rows phase is behind a grid barrier).
        if (tile + width < l.tiles) __syncthreads();
      } else if (active) {
        for (int t = 0; t < width; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = first_of(tile + t) + row_of(lane, e), b = (g0 + g) * kGroup + seq_of(lane, e);
            if (row < last_of(tile + t) && b < B) put(row, b, sums[t][e]);
          }
        }
      }
    }
    tile += width;
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

// The features of its sequence a block owns: a sequence spreads over a cluster of C blocks
// (Layout::cluster), rank r taking the 256-feature chunks r, r + C, ...; thread tid's j-th
// feature is tid + (j C + r) 256 (C 1: tid + 256 j, the whole sequence), kFeaturesOf<C> of them.
// C is a template parameter: with the strides and the feature count constants, the passes index
// registers and shared memory by fixed offsets (with C a launch value they ran up to 60% slower).
template <int C>
constexpr int kFeaturesOf = kMaxFeatures / C;

// Full (Variant::full: D 1024 and N the slot capacity) makes D and N constants (dim_of, slots_of)
// and the index says that every feature is below D (the thread and the rank masked to their
// ranges), so the passes' tests `d < D` and `n < N` fold away and a pass is straight-line code.
// With the tests, a pass over the on-chip tape loaded one slot at a time: a load behind a loop exit
// cannot move above it (layer 12.0 -> 10.2 ms at B 16, 14.3 -> 12.6 at B 64; H200).
template <int C, bool Full>
struct Slice {
  static constexpr int size = C;
  int rank = 0;
  __device__ int feature(int j) const {
    const int tid = static_cast<int>(threadIdx.x);
    if constexpr (Full) return (tid & (kThreads - 1)) + (j * C + (rank & (C - 1))) * kThreads;
    return tid + (j * C + rank) * kThreads;
  }
};

// D and N of a launch, constants in the full variant.
template <bool Full, typename Args>
__device__ __forceinline__ int dim_of(const Args& a) {
  return Full ? kMaxDim : a.dim;
}
template <int MaxN, bool Full, typename Args>
__device__ __forceinline__ int slots_of(const Args& a) {
  return Full ? MaxN : a.slots;
}

// The sequence phase's shared scratch (layout: seq_shared_floats). A phase's slot sums are summed
// once for the block however many it needs: a thread's partials in chunks of 32 values, each chunk
// folded over the warp's lanes by butterfly steps (31 shuffles for 32 values, where a shuffle tree
// per value takes 160), then the warps' sums added in warp order; in a cluster, every block then
// sends its sums to every block of the cluster, which adds them in rank order (so every block
// holds the same sums and runs the same softmaxes).
//
// The exchange is one-way: each value goes into the receivers' inboxes by st.async, which
// completes 4 bytes of the receiver's mbarrier of that inbox; a receiver arms its mbarrier for the
// exchange's bytes and waits for the phase (a sender's bytes may land before the arming: the count
// goes below zero until then). No cluster barrier: in bench/cluster_bench's exchange of 16 sums
// between 2 blocks, 0.52 us instead of 0.98 (H100).
template <int MaxN, int C, bool Full>
struct SeqShared {
  static constexpr int kStride = seq_warp_stride(MaxN);
  std::uint64_t* bars;  // [2]: the inboxes' mbarriers
  float* warp_part;     // [kWarps][kStride]
  float* sums;          // [4][MaxN]: the block sums by quantity
  float* attn;          // [2][MaxN]: two attentions' weights
  float* ds;            // [2][MaxN]: and their score gradients
  float* inbox;         // [2][kMaxCluster][kStride]: the cluster's block sums, by rank
  float* verdicts;      // [2][kMaxCluster]: and whether each rank's launch still stands (1) or aborted (0)
  Slice<C, Full> slice;
  // Which inbox the next exchange fills: a block may send exchange k + 1 while a peer still reads
  // exchange k, never k + 2 (it would have to receive k + 1 first, which that peer sends after
  // reading k). phases: bit p, the phase parity inbox p's mbarrier waits for next.
  mutable int parity = 0, phases = 0;
  // A wait passed its deadline: a peer never sent (the launch is lost; the block leaves without
  // the final cluster barrier).
  mutable bool stuck = false;
  std::uint64_t timeout_ns = 0;

  __device__ SeqShared(float* base, Slice<C, Full> s, std::uint64_t timeout)
      : bars(reinterpret_cast<std::uint64_t*>(base)),
        warp_part(base + kExchangeWords),
        sums(warp_part + kWarps * kStride),
        attn(sums + 4 * MaxN),
        ds(attn + 2 * MaxN),
        inbox(ds + 2 * MaxN),
        verdicts(inbox + 2 * kMaxCluster * kStride),
        slice(s),
        timeout_ns(timeout) {}

  // Before the first exchange (every block of the grid calls it): the mbarriers set up and seen
  // by the cluster's blocks before any of them sends.
  __device__ void start_exchanges() const {
    // fold_part leaves some partials unwritten: zeros, not whatever shared memory held.
    for (int i = threadIdx.x; i < kWarps * kStride; i += kThreads) warp_part[i] = 0.0f;
    if constexpr (C > 1) {
      if (threadIdx.x < 2) core::mbar_init(bars + threadIdx.x, 1);
      core::fence_mbarrier_init();
      cg::this_cluster().sync();
    }
  }
  // After the last: no block leaves while a peer's stores may still land in it.
  __device__ void end_exchanges() const {
    if constexpr (C > 1) {
      if (!__syncthreads_or(stuck)) cg::this_cluster().sync();
    }
  }

  // Attention k (0 or 1) as layer_step.cuh's softmaxes take it, its scores the sums of quantity k.
  __device__ step::Shared<MaxN> view(int k) const {
    step::Shared<MaxN> s(warp_part);
    s.sums = sums + k * MaxN;
    s.attn = attn + k * MaxN;
    s.ds = ds + k * MaxN;
    s.vec = nullptr;
    return s;
  }

  // Chunk c of this thread's partials: lane l keeps the warp's sum of v[l].
  __device__ __forceinline__ void fold(float (&v)[32], int c) const {
    const int lane = threadIdx.x & 31;
    butterfly_step<16, 16>(v, lane);
    butterfly_step<8, 8>(v, lane);
    butterfly_step<4, 4>(v, lane);
    butterfly_step<2, 2>(v, lane);
    butterfly_step<1, 1>(v, lane);
    warp_part[(threadIdx.x >> 5) * kStride + c * 32 + lane] = v[0];
  }

  // The same when only v[At, At + Used) can be nonzero (one quantity of a pass; Used 8, 16 or 32):
  // the butterfly over them alone, Used / 2 + ... + 1 shuffles, then log2(32 / Used) more over the
  // lanes that hold parts of the same value (16 shuffles for 16 values where fold takes 31). The
  // other values' places in the warp's partials are left as they are (their sums are not read).
  template <int Used, int At>
  __device__ __forceinline__ void fold_part(float (&v)[32], int c) const {
    static_assert(Used == 8 || Used == 16 || Used == 32);
    if constexpr (Used == 32) {
      fold(v, c);
    } else {
      constexpr int kSpread = 32 / Used;  // lanes a value's parts end on
      const int lane = threadIdx.x & 31;
      butterfly_step<Used / 2, 16, 32, At>(v, lane);
      butterfly_step<Used / 4, 8, 32, At>(v, lane);
      butterfly_step<Used / 8, 4, 32, At>(v, lane);
      if constexpr (Used == 16) butterfly_step<1, 2, 32, At>(v, lane);
      float sum = v[At];
#pragma unroll
      for (int dist = kSpread / 2; dist >= 1; dist /= 2) sum += __shfl_xor_sync(kFull, sum, dist);
      if ((lane & (kSpread - 1)) == 0) warp_part[(threadIdx.x >> 5) * kStride + c * 32 + At + lane / kSpread] = sum;
    }
  }
  // Values a pass of Q quantities can leave nonzero in one quantity's part of a chunk.
  template <int Q>
  static constexpr int used_of() {
    return MaxN < 32 / Q ? MaxN : 32 / Q;
  }

  // Chunks of a pass that sums Q quantities for every slot, 32 / Q slots a chunk.
  template <int Q>
  static constexpr int chunks() {
    return (MaxN + 32 / Q - 1) / (32 / Q);
  }

  // A pass over the thread's features and the slots: add(v, i, n, j, d) adds slot n's (the chunk's
  // i-th) terms of feature d (the thread's j-th) to v[k * 32 / Q + i] for its quantities k; each
  // chunk is folded when done.
  // Kind >= 0: only quantity Kind is summed (fold_part).
  template <int Q, int Kind = -1, typename Add>
  __device__ __forceinline__ void score_pass(int D, int N, Add add) const {
    score_pass<Q, Kind>(
        D, N, [](int) {}, add);
  }

  // The same, with chunk_start(c) called before chunk c's first term (to load what it reads).
  template <int Q, int Kind = -1, typename Start, typename Add>
  __device__ __forceinline__ void score_pass(int D, int N, Start chunk_start, Add add) const {
    constexpr int kSlots = 32 / Q;
#pragma unroll
    for (int c = 0; c < chunks<Q>(); ++c) {
      chunk_start(c);
      float v[32];
#pragma unroll
      for (int q = 0; q < 32; ++q) v[q] = 0.0f;
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int d = slice.feature(j);
        if (d >= D) break;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          const int n = c * kSlots + i;
          if (n < MaxN && n < N) add(v, i, n, j, d);
        }
      }
      if constexpr (Kind < 0) {
        fold(v, c);
      } else {
        fold_part<used_of<Q>(), Kind * kSlots>(v, c);
      }
    }
  }

  // Value q's sum over the block's warps, in warp order.
  __device__ __forceinline__ float block_sum(int q) const {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += warp_part[w * kStride + q];
    return s;
  }

  // Quantity k's block sums, then (when `run`) warp 0's softmax of them into attention k, and a
  // block barrier: finish() and softmax_warp, except with one block and one chunk of sums, where
  // warp 0 adds the warps' partials itself (block_sum, as finish) and each slot's sum goes to its
  // lane by a shuffle, without the store and load of the sums.
  template <int Q>
  __device__ __forceinline__ void finish_softmax(int k, float scale, int N, bool run, bool& ok) const {
    if constexpr (C == 1 && chunks<Q>() == 1) {
      __syncthreads();
      if (threadIdx.x < 32) {
        const float sum = __shfl_sync(kFull, block_sum(threadIdx.x), (threadIdx.x + k * (32 / Q)) & 31);
        if (run) step::softmax_warp_of<MaxN>(sum, 0.0f, view(k), scale, N);
      }
    } else {
      finish<Q>(ok);
      if (threadIdx.x < 32 && run) step::softmax_warp<MaxN>(view(k), scale, N);
    }
    __syncthreads();
  }

  // Quantity k's softmax of scale times its block sums (C 1, one chunk) by every warp at once, lane
  // n < N returning weight n: the same sums and arithmetic as finish_softmax, so the same bits in
  // every warp, without warp 0's store of the weights and the block barrier after it. Each lane
  // reads only its own quantity's partials: the other quantity's fold may be writing its own.
  template <int Q>
  __device__ __forceinline__ float softmax_each_warp(int k, float scale, int N) const {
    static_assert(C == 1 && chunks<Q>() == 1);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const float sum = lane < N ? block_sum(k * (32 / Q) + lane) : 0.0f;
    return step::softmax_lane<MaxN>(sum, 0.0f, scale, N).w0;
  }

  // After every fold: sums[k][n] for the Q quantities (chunk c: slots c * 32 / Q + i, value
  // k * 32 / Q + i). A block barrier before; after, a block barrier (or, one chunk and no
  // cluster, warp 0's: every caller's next reader of the sums is warp 0). In a cluster (every block
  // of it calls this at the same point) `ok` goes in as this block's verdict and comes out as the
  // cluster's: a block whose grid barrier failed still reaches the exchange, so the cluster
  // leaves together (no block may leave while a peer can still send to it; a wait past the
  // deadline means a peer never came, and the block leaves as aborted).
  template <int Q>
  __device__ __forceinline__ void finish(bool& ok) const {
    constexpr int kSlots = 32 / Q, kChunks = chunks<Q>();
    static_assert(kChunks * 32 <= kStride);
    static_assert(C == 1 || C == 2 || C == kMaxCluster);
    __syncthreads();
    const int count = kChunks * 32;
    auto store = [&](int q, float s) {
      const int c = q / 32, k = (q % 32) / kSlots, n = c * kSlots + q % kSlots;
      if (n < MaxN) sums[k * MaxN + n] = s;
    };
    if constexpr (C == 1 && kChunks == 1) {
      // Warp 0 alone sums, and warp 0 alone reads the sums next (every caller): a warp barrier.
      if (threadIdx.x < 32) {
        store(threadIdx.x, block_sum(threadIdx.x));
        __syncwarp();
      }
    } else if constexpr (C == 1) {
      for (int q = threadIdx.x; q < count; q += kThreads) store(q, block_sum(q));
      __syncthreads();
    } else {
      float* box = inbox + parity * kMaxCluster * kStride;
      int* votes = reinterpret_cast<int*>(verdicts) + parity * kMaxCluster;
      std::uint64_t* bar = bars + parity;
      if (threadIdx.x == 0) core::mbar_arrive_expect_tx(bar, static_cast<std::uint32_t>(C * (count + 1) * 4));
      for (int q = threadIdx.x; q < count; q += kThreads) {
        const float s = block_sum(q);
        for (int r = 0; r < C; ++r) core::st_async_cluster(box + slice.rank * kStride + q, __float_as_uint(s), bar, r);
      }
      if (threadIdx.x == 0) {
        for (int r = 0; r < C; ++r) core::st_async_cluster(votes + slice.rank, ok ? 1u : 0u, bar, r);
      }
      const bool late = !wait(bar, static_cast<std::uint32_t>(phases >> parity) & 1u);
      phases ^= 1 << parity;
      if (__syncthreads_or(late)) {
        stuck = true;
        ok = false;
      }
      for (int q = threadIdx.x; q < count; q += kThreads) {
        float s = 0.0f;
        for (int r = 0; r < C; ++r) s += box[r * kStride + q];
        store(q, s);
      }
      for (int r = 0; r < C; ++r) ok = ok && votes[r] != 0;
      parity ^= 1;
      __syncthreads();
    }
  }

  // Waits for the phase of `bar` with this parity (acquire at cluster scope: the peers' stores are
  // seen); false past the launch's deadline.
  __device__ __forceinline__ bool wait(std::uint64_t* bar, std::uint32_t phase) const {
    std::uint64_t start = 0;
    for (std::uint32_t spins = 1;; ++spins) {
      if (core::mbar_test_cluster(bar, phase)) return true;
      if ((spins & 63) == 0) {
        const std::uint64_t now = core::globaltimer();
        if (start == 0) {
          start = now;
        } else if (now - start > timeout_ns) {
          return false;
        }
      }
    }
  }
};

// A block's shared memory (the layout the host sized): its weight rows, the rows phase's reduce
// slots, the sequence phase's scratch, then the on-chip tapes.
template <int MaxN, int C, bool Full>
struct BlockShared {
  __nv_bfloat16* weights;
  float* reduce;
  SeqShared<MaxN, C, Full> seq;
  float* tapes;

  __device__ BlockShared(unsigned char* at, const Layout& l, Slice<C, Full> slice, std::uint64_t timeout_ns)
      : weights(reinterpret_cast<__nv_bfloat16*>(at)),
        reduce(reinterpret_cast<float*>(at + l.weight_bytes)),
        seq(reinterpret_cast<float*>(at + l.weight_bytes + l.reduce_bytes), slice, timeout_ns),
        tapes(reinterpret_cast<float*>(at + l.weight_bytes + l.reduce_bytes + l.step_bytes)) {}
};

// Rows [row0, row0 + rows) of the block's stacked matrix into `weights` in mma fragment order
// (tile_product): tile t, k-step s, lane (g, c) holds the uint4 {W[g][k, k + 1], W[g + 8][k, k + 1],
// W[g][k + 2, k + 3], W[g + 8][k + 2, k + 3]} with k = 16 s + 4 c, so a warp takes its A operand
// with one conflict-free 16-byte load a lane (rows of the tile; padding rows and columns zero):
// value(row, k) for row < rows and k < D.
template <typename Value>
__device__ __forceinline__ void load_rows(__nv_bfloat16* weights, const Layout& l, int rows, int D, Value value) {
  const int steps = l.ld / kStep;
  for (int i = threadIdx.x; i < l.tiles * kTileRows * l.ld; i += kThreads) {
    const int e = i % 8, lane = (i / 8) % 32, s = (i / 256) % steps, tile = i / (256 * steps);
    const int r = tile * kTileRows + (lane >> 2) + 8 * ((e >> 1) & 1),
              k = s * kStep + 4 * (lane & 3) + 2 * (e >> 2) + (e & 1);
    weights[i] = r < rows && k < D ? value(r, k) : __float2bfloat16_rn(0.0f);
  }
}

// The profile of a launch (thread 0 of block 0 and of the last block): ns in each phase kind
// (rows, barrier after it, sequence, barrier after it), block 0's sequence phase split in K parts.
template <int K>
struct Profile {
  Laps<4> phases;
  Laps<K> sub;
  __device__ explicit Profile(std::uint64_t* out) {
    phases.on = out != nullptr && threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1);
    sub.on = phases.on && blockIdx.x == 0;
    phases.start();
  }
  __device__ void write(std::uint64_t* out) const {
    if (phases.on) {
      for (int k = 0; k < 4; ++k) out[(blockIdx.x == 0 ? 0 : 4) + k] = phases.ns[k];
    }
    if (sub.on) {
      for (int k = 0; k < K; ++k) out[8 + k] = sub.ns[k];
    }
  }
};

// The features a thread owns in the sequence phase and what it keeps of them between steps.
struct Owned {
  float h[kMaxFeatures], r[kMaxFeatures];
  float bias[kMaxFeatures];  // b_h, loaded once: a load after the step's stores would wait for L2
};

// x_t (or z_t) of sequence b for the thread's features.
template <int C, bool Full>
__device__ __forceinline__ void load_xz(const PersistentForwardArgs& a, const Slice<C, Full>& slice, std::int64_t b,
                                        std::int64_t t, int half, float (&out)[kMaxFeatures]) {
  const int D = dim_of<Full>(a);
  const float* src = a.xz + (b * a.steps + t) * 2 * D + half * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = slice.feature(j);
    out[j] = d < D ? src[d] : 0.0f;
  }
}

// Step 0's read: the attention over H_0 with the start state h_{-1} (the read passes of the later
// steps' order: scores, cluster sums, softmax), r_0 and h_0 = tanh(x_0 + W_h h_{-1} + r_0 + b_h).
template <int MaxN, int C, bool Full>
__device__ __forceinline__ void first_read(const PersistentForwardArgs& a, const SeqShared<MaxN, C, Full>& sh,
                                           std::uint32_t H, std::int64_t b, Owned& own, bool& ok) {
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch;
  float x[kMaxFeatures], rec[kMaxFeatures], hp[kMaxFeatures];
  load_xz(a, sh.slice, b, 0, 0, x);
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    rec[j] = d < D ? __ldcg(a.recurrent + b * D + d) : 0.0f;
    hp[j] = d < D ? a.h[b * D + d] : 0.0f;
  }
  sh.template score_pass<1, 0>(
      D, N, [&](float(&v)[32], int i, int n, int j, int d) { v[i] = fmaf(lds(at_nd(H, n, d, D)), hp[j], v[i]); });
  sh.template finish_softmax<1>(0, a.scale, N, true, ok);
  if (sh.slice.rank == 0 && threadIdx.x < N) a.read_attn[b * N + threadIdx.x] = sh.attn[threadIdx.x];
  float* h_out = a.h + (B + b) * D;
  __nv_bfloat16* h_bf16 = a.h_bf16 + (B + b) * D;
  float* read = a.read + b * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    if (d >= D) break;
    float r = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) r = fmaf(sh.attn[n], lds(at_nd(H, n, d, D)), r);
    }
    const float pre = ((x[j] + rec[j]) + r) + own.bias[j];
    const float h = tanhf(pre);
    h_out[d] = h;
    a.h_frag[frag_at(b, d, D)] = h;
    h_bf16[d] = __float2bfloat16_rn(h);
    read[d] = r;
    own.h[j] = h;
    own.r[j] = r;
  }
}

// What a sequence phase leaves to store after the block's arrival at the next grid barrier: the
// outputs no block reads during the launch (y_t; h_{t+1} in fp32 and bf16 and r_{t+1}), so the
// arrival waits only for h_{t+1} in fragment order, which the next rows phase reads.
struct Outputs {
  std::int64_t t = -1;  // the step whose outputs these are (-1: none)
  bool more = false;    // h_{t+1} and r_{t+1} exist
  float z[kMaxFeatures], h[kMaxFeatures], r[kMaxFeatures], h_next[kMaxFeatures], r_next[kMaxFeatures];
};

template <int C, bool Full>
__device__ __forceinline__ void store_outputs(const PersistentForwardArgs& a, const Slice<C, Full>& slice,
                                              std::int64_t b, Outputs& o) {
  if (o.t < 0) return;
  const int D = dim_of<Full>(a);
  const std::int64_t B = a.batch, T = a.steps, t = o.t;
  __nv_bfloat16* y = a.y + (b * T + t) * D;
  float* h_out = a.h + ((t + 2) * B + b) * D;
  __nv_bfloat16* h_bf16 = a.h_bf16 + ((t + 2) * B + b) * D;
  float* read = a.read + ((t + 1) * B + b) * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = slice.feature(j);
    if (d >= D) break;
    const float g = (o.z[j] + o.r[j]) + o.h[j];
    y[d] = __float2bfloat16_rn(o.h[j] * (g * step::sigmoidf(g)));
    if (o.more) {
      h_out[d] = o.h_next[j];
      h_bf16[d] = __float2bfloat16_rn(o.h_next[j]);
      read[d] = o.r_next[j];
    }
  }
  o.t = -1;
}

// Step t's write (attention, tape update, checkpoint, y_t), then step t + 1's read when there is
// one. w_t and W_h h_t come from this step's rows phase.
//
// Three passes over the tape: the write scores H_{t-1} . w_t; the update (with step t + 1's read
// scores H_t . h_t summed from the updated values); r_{t+1}. The read scores are not taken from the
// first pass by linearity ((1 - a_n) H_{t-1}[n] . h_t + a_n w_t . h_t, one pass and one exchange
// fewer): measured 3% faster at B 16 and no faster at B 64, its errors like this order's on 16
// draws but 16x further from the reference on a chaotic one (docs/e29a.md, Tried and not kept).
template <int MaxN, int C, bool Full>
__device__ __forceinline__ void write_then_read(const PersistentForwardArgs& a, const SeqShared<MaxN, C, Full>& sh,
                                                std::uint32_t H, std::int64_t b, std::int64_t t, Owned& own, bool& ok,
                                                Outputs& out, Laps<4>& sub) {
  sub.start();
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, T = a.steps;
  const bool more = t + 1 < T, lead = sh.slice.rank == 0;  // the cluster's first block writes per-slot outputs
  float w[kMaxFeatures], rec[kMaxFeatures], z[kMaxFeatures], x[kMaxFeatures];
  const float* w_src = a.write + (t * B + b) * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    w[j] = d < D ? __ldcg(w_src + d) : 0.0f;
    rec[j] = d < D && more ? __ldcg(a.recurrent + b * D + d) : 0.0f;
  }
  load_xz(a, sh.slice, b, t, 1, z);
  if (more) load_xz(a, sh.slice, b, t + 1, 0, x);

  // The thread's tape elements, read once by the score pass, stay in registers for the update pass
  // and (updated) for the read pass where they take at most 64: the passes are bound by shared
  // memory (an SM moves 128 bytes a clock), and so the tape is read once a step instead of three
  // times (written once either way).
  constexpr bool kHold = MaxN * kFeaturesOf<C> <= 64;
  float held[kHold ? MaxN : 1][kHold ? kFeaturesOf<C> : 1];
  sh.template score_pass<2, 0>(D, N, [&](float(&v)[32], int i, int n, int j, int d) {
    const float hv = lds(at_nd(H, n, d, D));
    if constexpr (kHold) held[n][j] = hv;
    v[i] = fmaf(hv, w[j], v[i]);
  });
  sub.lap(0);
  // One block and one chunk of sums: each warp takes the weights in its lanes (softmax_each_warp)
  // and hands weight n to the passes by a shuffle.
  constexpr bool kEachWarp = C == 1 && SeqShared<MaxN, C, Full>::template chunks<2>() == 1;
  float write_weight = 0.0f, read_weight = 0.0f;
  if constexpr (kEachWarp) {
    write_weight = sh.template softmax_each_warp<2>(0, a.scale, N);
    if (lead && threadIdx.x < N) a.write_attn[(t * B + b) * N + threadIdx.x] = write_weight;
  } else {
    sh.template finish_softmax<2>(0, a.scale, N, true, ok);
    if (lead && threadIdx.x < N) a.write_attn[(t * B + b) * N + threadIdx.x] = sh.attn[threadIdx.x];
  }
  float* checkpoint = t % a.interval == 0 ? a.checkpoints + ((t / a.interval) * B + b) * N * D : nullptr;
  // Two copies of the pass, with and without the checkpoint's stores: a test a tape element would
  // put each element in a block of its own, and nothing would be scheduled across them.
  auto update_pass = [&](auto checkpointing) {
#pragma unroll
    for (int c = 0; c < SeqShared<MaxN, C, Full>::template chunks<2>(); ++c) {
      float v[32];
#pragma unroll
      for (int q = 0; q < 32; ++q) v[q] = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int n = c * 16 + i;
        if (n >= N || n >= MaxN) break;
        const float aw = kEachWarp ? __shfl_sync(kFull, write_weight, n) : sh.attn[n];
#pragma unroll
        for (int j = 0; j < kFeaturesOf<C>; ++j) {
          const int d = sh.slice.feature(j);
          if (d >= D) break;
          const std::uint32_t at = at_nd(H, n, d, D);
          float old;
          if constexpr (kHold) {
            old = held[n][j];
          } else {
            old = lds(at);
          }
          if constexpr (decltype(checkpointing)::value) checkpoint[n * D + d] = old;
          const float updated = step::tape_update(old, aw, w[j]);
          sts(at, updated);
          if constexpr (kHold) held[n][j] = updated;
          v[16 + i] = fmaf(updated, own.h[j], v[16 + i]);
        }
      }
      sh.template fold_part<SeqShared<MaxN, C, Full>::template used_of<2>(), 16>(v, c);
    }
  };
  if (checkpoint) {
    update_pass(std::true_type{});
  } else {
    update_pass(std::false_type{});
  }
  if constexpr (kEachWarp) {
    read_weight = sh.template softmax_each_warp<2>(1, a.scale, N);
    if (more && lead && threadIdx.x < N) a.read_attn[((t + 1) * B + b) * N + threadIdx.x] = read_weight;
  } else {
    sh.template finish_softmax<2>(1, a.scale, N, more, ok);
    if (more && lead && threadIdx.x < N) a.read_attn[((t + 1) * B + b) * N + threadIdx.x] = sh.attn[MaxN + threadIdx.x];
  }
  sub.lap(1);
  float r[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) r[j] = 0.0f;
#pragma unroll
  for (int n = 0; n < MaxN; ++n) {
    if (n >= N) break;
    const float ar = kEachWarp ? __shfl_sync(kFull, read_weight, n) : sh.attn[MaxN + n];
#pragma unroll
    for (int j = 0; j < kFeaturesOf<C>; ++j) {
      const int d = sh.slice.feature(j);
      if (d >= D) break;
      if constexpr (kHold) {
        r[j] = fmaf(ar, held[n][j], r[j]);
      } else {
        r[j] = fmaf(ar, lds(at_nd(H, n, d, D)), r[j]);
      }
    }
  }
  sub.lap(2);

  // h_{t+1} = tanh(x_{t+1} + W_h h_t + r_{t+1} + b_h) in fragment order now; y_t and the rest
  // after the arrival (Outputs).
  out.t = t;
  out.more = more;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    out.z[j] = z[j];
    out.h[j] = own.h[j];
    out.r[j] = own.r[j];
    if (d >= D) continue;
    if (more) {
      const float pre = ((x[j] + rec[j]) + r[j]) + own.bias[j];
      const float h = tanhf(pre);
      a.h_frag[frag_at(b, d, D)] = h;
      out.h_next[j] = h;
      out.r_next[j] = r[j];
      own.h[j] = h;
      own.r[j] = r[j];
    }
  }
  sub.lap(3);
}

// The tape's elements this block owns (its slice's features of every slot): f(n, d).
template <int C, bool Full, typename F>
__device__ __forceinline__ void for_owned(const Slice<C, Full>& slice, int N, int D, F f) {
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int j = 0; j < kFeaturesOf<C>; ++j) {
      const int d = slice.feature(j);
      if (d < D) f(n, d);
    }
  }
}

// After a grid barrier: whether the block goes on. A block whose sequence spreads over a cluster
// goes on to the next exchange even when the launch aborted (finish() carries the verdict there);
// any other block leaves at once.
__device__ __forceinline__ bool goes_on(bool ok, bool exchanges) { return ok || exchanges; }

template <int MaxN, int C, Variant V>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_forward_kernel(const __grid_constant__ Params<PersistentForwardArgs> p) {
  constexpr bool Vec = V != Variant::scalar, Full = V == Variant::full;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok_flag;
  const PersistentForwardArgs& a = p.a;
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, T = a.steps;
  const Slice<C, Full> slice{static_cast<int>(blockIdx.x) % C};
  const BlockShared<MaxN, C, Full> block(smem, p.l, slice, p.grid.timeout_ns);
  const SeqShared<MaxN, C, Full>& sh = block.seq;
  sh.start_exchanges();
  float* chip_tape = block.tapes;

  // This block's rows of [W_h ; W_write].
  const RowsShare share = rows_share(p.l, 2 * D);
  load_rows(block.weights, p.l, share.rows, D, [&](int r, int k) {
    const int row = share.row0 + r;
    return row < D ? a.w_h[static_cast<std::size_t>(row) * D + k]
                   : a.w_write[static_cast<std::size_t>(row - D) * D + k];
  });
  // The tape of this block's sequence (one sequence a block or cluster at most) stays in shared
  // memory, the block's slice of it.
  const std::int64_t per_tape = static_cast<std::int64_t>(N) * D;
  const std::int64_t b = blockIdx.x / C;
  const bool owner = b < B, exchanges = owner && C > 1;
  if (owner) {
    const float* src = a.tape + b * per_tape;
    for_owned(slice, N, D, [&](int n, int d) { chip_tape[n * D + d] = src[n * D + d]; });
  }
  __syncthreads();
  const std::uint32_t tape = core::smem_addr(chip_tape);
  Owned own;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = slice.feature(j);
    own.bias[j] = d < D ? __bfloat162float(a.bias[d]) : 0.0f;
    own.h[j] = own.r[j] = 0.0f;  // past D too: the score pass multiplies by them
  }

  Profile<4> profile(a.profile);
  auto& phases = profile.phases;
  auto& sub = profile.sub;
  std::uint32_t passed = 0;
  rows_phase<Vec, Full>(forward_rows(a, a.h, true, nullptr), p.l, block.weights, block.reduce, share);  // W_h h_{-1}
  phases.lap(0);
  bool ok = grid_barrier(p.grid, passed, &ok_flag);
  phases.lap(1);
  if (goes_on(ok, exchanges) && T > 0) {
    if (owner) first_read<MaxN, C, Full>(a, sh, tape, b, own, ok);
    phases.lap(2);
  }
  Outputs outputs;
  for (std::int64_t t = 0; ok && t < T; ++t) {
    grid_arrive(p.grid, passed);
    if (owner) store_outputs(a, slice, b, outputs);  // the last step's, while the others arrive
    ok = grid_wait(p.grid, passed, &ok_flag);
    if (!goes_on(ok, exchanges)) break;
    phases.lap(3);
    // w_t = W_write h_t and, unless last, W_h h_t.
    if (ok) {
      RowsJob job = forward_rows(a, a.h_frag, t + 1 < T, a.write + t * B * D);  // h_{t+1}
      job.frag = true;
      rows_phase<Vec, Full>(job, p.l, block.weights, block.reduce, share);
    }
    phases.lap(0);
    ok = ok && grid_barrier(p.grid, passed, &ok_flag);
    if (!goes_on(ok, exchanges)) break;
    phases.lap(1);
    if (owner) write_then_read<MaxN, C, Full>(a, sh, tape, b, t, own, ok, outputs, sub);
    phases.lap(2);
  }
  if (ok && owner) store_outputs(a, slice, b, outputs);
  __syncthreads();  // a thread's features of the tape are not the elements it copies back
  if (ok && owner) {
    float* dst = a.tape + b * per_tape;
    for_owned(slice, N, D, [&](int n, int d) { dst[n * D + d] = chip_tape[n * D + d]; });
  }
  sh.end_exchanges();
  profile.write(a.profile);
}

// ---- Backward ----
//
// Per step t in reverse, a sequence phase and a rows phase between grid-wide barriers, as the
// forward. The write attention's gradients of step t need only dL/dH_t, so they are computed at
// the end of step t + 1's sequence phase; a rows phase then carries both products a step needs at
// once: W_h^T dp_{t+1} (to dL/dh_t) and W_write^T dw_t (to dL/dh_t as well). Sequence phase of t:
// the gate and dL/dh_t, the tanh, the read attention's backward over H_{t-1} (dL/dH_{t-1} and the
// read scores' part of dL/dh_{t-1}), then the write attention's backward of step t - 1 over
// H_{t-2} (dw_{t-1} and the rest of dL/dH_{t-2}); both from one pass over the tapes and one block
// sum (backward_step says how). dL/dH stays in the block's shared memory, and so does the tape a
// step reads: H_{t-2} is brought in by step t's second pass and read again by step t - 1's read
// attention. The tapes come from the segment replayed from its checkpoint by the block (the
// forward's update arithmetic: the forward's bits) into the segment scratch in global memory.

// What a thread keeps of its features between backward steps.
struct BackOwned {
  float dh_read[kMaxFeatures];  // the read attention's part of dL/dh_{t-1}, from step t
  float d_bias[kMaxFeatures];   // dL/db_h of the sequence, summed over the steps walked
};

// The replayed segment the owners read: its first step s0 and its buffer in the scratch (the
// first of two, or with the replay ahead (ReplayAhead) alternating by segment), tracked together
// so no step divides to find the buffer.
struct Segment {
  std::int64_t s0 = 0;
  int buffer = 0;
  // The segment starting at s0, in the buffer its index gives (the replay ahead) or the first.
  __device__ static Segment starting(const PersistentBackwardArgs& a, std::int64_t s0, bool alternate) {
    Segment s;
    s.s0 = s0;
    s.buffer = alternate ? static_cast<int>(s0 / a.interval % 2) : 0;
    return s;
  }
  __device__ float* base(const PersistentBackwardArgs& a) const {
    return a.segment + buffer * a.interval * a.batch * a.slots * a.dim;
  }
  // The tape before step t of sequence b.
  __device__ const float* tape(const PersistentBackwardArgs& a, std::int64_t b, std::int64_t t) const {
    return base(a) + ((t - s0) * a.batch + b) * a.slots * a.dim;
  }
};

// The tapes before steps s0 .. s0 + count - 1 of sequence b (the thread's features, every slot),
// from the checkpoint and the saved writes, into the segment. Eight slots at a time with their
// running tape in registers (a chunk's write values come again from L1), so the tape on chip, the
// one the current step reads, stays as it is.
template <int MaxN, int C, bool Full>
__device__ __forceinline__ void replay_segment(const PersistentBackwardArgs& a, const Slice<C, Full>& slice,
                                               std::int64_t b, const Segment& segment) {
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, per_tape = static_cast<std::int64_t>(N) * D, s0 = segment.s0;
  const std::int64_t count = min(a.steps, s0 + a.interval) - s0;
  const float* checkpoint = a.checkpoints + ((s0 / a.interval) * B + b) * per_tape;
  float* seg = segment.base(a) + b * per_tape;
  constexpr int kChunk = 8;
  for (int n0 = 0; n0 < N; n0 += kChunk) {
    float v[kChunk][kMaxFeatures];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int n = n0 + i, d = slice.feature(j);
        v[i][j] = n < N && d < D ? checkpoint[n * D + d] : 0.0f;
        if (n < N && d < D) seg[n * D + d] = v[i][j];
      }
    }
    // Step k's write attention and values are loaded before step k - 1's stores (a load after them
    // could not be moved above: see backward_step).
    float attn[kChunk], w[kMaxFeatures];
    auto load = [&](std::int64_t k) {
      const std::int64_t row = (s0 + k - 1) * B + b;
      const bool in = k < count;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) attn[i] = in && n0 + i < N ? a.write_attn[row * N + n0 + i] : 0.0f;
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int d = slice.feature(j);
        w[j] = in && d < D ? a.write[row * D + d] : 0.0f;
      }
    };
    load(1);
    for (std::int64_t k = 1; k < count; ++k) {
      float* out = seg + k * B * per_tape;
      float attn_k[kChunk], w_k[kMaxFeatures];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) attn_k[i] = attn[i];
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) w_k[j] = w[j];
      load(k + 1);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
#pragma unroll
        for (int j = 0; j < kFeaturesOf<C>; ++j) {
          const int n = n0 + i, d = slice.feature(j);
          v[i][j] = step::tape_update(v[i][j], attn_k[i], w_k[j]);
          if (n < N && d < D) out[n * D + d] = v[i][j];
        }
      }
    }
  }
}

// The replay ahead. The blocks past the sequences' (blockIdx.x >= B C: none at B 64 with C 2 on
// 128 blocks, 96 at B 16) have nothing to do in the sequence phase, so they replay the segment
// before the one the owners read, a step of it each backward step, into the other of two segment
// buffers; the owners then replay only the segments the helpers cannot have reached (those the
// launch starts in). At B 16 the owners' replay took 1.4 us of a 13.4 us step (H100). Taken where
// the helpers have at most kAheadElements elements of a replayed tape each (two batches of loads a
// step: at B 16, N 16, 11 elements took 4.3 us of the owners' 5.2 us sequence phase, H200; more
// batches would hold the owners up); otherwise the owners replay as they go, in one buffer.
struct ReplayAhead {
  static constexpr int kAheadElements = 16;  // at most, a helper thread's elements of a step
  bool on = false;
  std::int64_t first = 0;        // the segments starting below it are the helpers'
  int helper = -1, helpers = 0;  // this thread's index among the helpers' threads, their count

  __device__ ReplayAhead(const PersistentBackwardArgs& a, int C) {
    const std::int64_t B = a.batch, T = a.steps, owners = B * C;
    helpers = static_cast<int>((gridDim.x - owners) * kThreads);
    on = helpers > 0 && B * a.slots * a.dim <= static_cast<std::int64_t>(kAheadElements) * helpers && T >= 3;
    if (!on) return;
    first = (T - 3) / a.interval * a.interval;  // the segment the loop's first step (T - 2) reads
    if (blockIdx.x >= owners) helper = static_cast<int>((blockIdx.x - owners) * kThreads + threadIdx.x);
  }

  // Where the owners' replay starts: the segment holding step T - 1.
  __device__ Segment last(const PersistentBackwardArgs& a) const {
    return Segment::starting(a, (a.steps - 1) / a.interval * a.interval, on);
  }

  // Loop step t (t <= T - 2): the owners read the segment S holding step t - 1; a helper replays
  // step S + K - t of segment S - K (from 0 at the loop's first step, which may start mid-segment),
  // so it is whole when step S reads it. The owners' replay arithmetic, element by element, every
  // load of a batch before its stores (a load after a store through another pointer waits for it).
  // In the full variant a batch is all of a helper's elements: in two batches of 8 the helpers
  // took 4.4 us a step at B 16, longer than the owners' sequence phase.
  template <int MaxN, bool Full>
  __device__ void step(const PersistentBackwardArgs& a, std::int64_t t) const {
    if (!on || helper < 0 || t < 1) return;
    const std::int64_t K = a.interval, S = (t - 1) / K * K;
    if (S < K) return;
    const std::int64_t P = S - K, hi = S + K - t, lo = t == a.steps - 2 ? 0 : hi;
    const int N = slots_of<MaxN, Full>(a), D = dim_of<Full>(a), per_step = static_cast<int>(a.batch) * N * D;
    float* base = Segment::starting(a, P, true).base(a);
    const float* checkpoint = a.checkpoints + (P / K) * per_step;
    for (std::int64_t k = lo; k <= hi; ++k) {
      float* out = base + k * per_step;
      const float* attn = a.write_attn + (P + k - 1) * a.batch * N;  // step P + k - 1's write, when k > 0
      const float* write = a.write + (P + k - 1) * a.batch * D;
      constexpr int kBatch = Full ? kAheadElements : 8;  // with D and N from the launch 16 spill (ptxas)
      for (int e0 = helper; e0 < per_step; e0 += kBatch * helpers) {
        float v[kBatch], at[kBatch], w[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int e = min(e0 + i * helpers, per_step - 1), bn = e / D;
          v[i] = k == 0 ? __ldcg(checkpoint + e) : __ldcg(out - per_step + e);
          at[i] = k == 0 ? 0.0f : attn[bn];
          w[i] = k == 0 ? 0.0f : write[bn / N * D + (e - bn * D)];
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int e = e0 + i * helpers;
          if (e < per_step) out[e] = k == 0 ? v[i] : step::tape_update(v[i], at[i], w[i]);
        }
      }
    }
  }
};

// What step t's sequence phase reads that the rows phase before it does not write: loaded by
// prepare_step after the block's rows and before the grid barrier, so the round trip to L2 overlaps
// the barrier's wait (only W_h^T dp_{t+1} and W_write^T dw_t are loaded after it).
template <int MaxN, int C, bool Full>
struct BackInputs {
  static constexpr bool kHeld = MaxN * kFeaturesOf<C> <= 32;
  // As loaded (features past D hold feature D - 1's values): nothing here waits for the loads.
  float h[kMaxFeatures], hp[kMaxFeatures], w[kMaxFeatures], z[kMaxFeatures], r[kMaxFeatures];
  __nv_bfloat16 dout[kMaxFeatures];
  float h2held[kHeld ? MaxN : 1][kMaxFeatures];
  const float* h2 = nullptr;                  // H_{t-2} of the thread's sequence in the replayed segment
  float read_attn = 0.0f, write_attn = 0.0f;  // threads n < N: slot n's weights (read of t, write of t - 1)
};

// Step t's replay (when step t - 1 starts the segment before) and its inputs' loads, issued between
// the block's arrival at the grid barrier and its wait. Every feature's loads unconditionally
// (features past D read feature D - 1, a step without a write reads valid memory; backward_step
// selects zero what is not wanted): a load behind a branch or a loop exit cannot be issued before
// it is decided, and a select here would wait for its load.
template <int MaxN, int C, bool Full>
__device__ __forceinline__ BackInputs<MaxN, C, Full> prepare_step(const PersistentBackwardArgs& a,
                                                                  const Slice<C, Full>& slice, std::int64_t b,
                                                                  std::int64_t t, Segment& segment,
                                                                  const ReplayAhead& ahead, Laps<4>& sub) {
  sub.start();
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, T = a.steps, row = t * B + b, prev = row - B;
  const bool write = t > 0;  // the write attention of step t - 1
  // H_{t-2} comes from the replayed segment in global memory (replayed first when step t - 1
  // starts the segment before).
  if (write && t - 1 < segment.s0) {
    segment.s0 -= a.interval;
    if (ahead.on) segment.buffer ^= 1;
    if (!ahead.on || segment.s0 >= ahead.first) replay_segment<MaxN, C, Full>(a, slice, b, segment);
  }
  BackInputs<MaxN, C, Full> in;
  in.h2 = segment.tape(a, b, write ? t - 1 : t);  // t = 0: read and unused
  const float* xz = a.xz + (b * T + t) * 2 * D;
  const __nv_bfloat16* dy = a.dy + (b * T + t) * D;
  // Where a thread's H_{t-2} (every slot) takes at most 32 registers it is kept for both passes
  // (kHeld: one round trip to L2 for both, where the score pass's chunks and the dL/dH pass's groups
  // of four slots each waited one).
  if constexpr (BackInputs<MaxN, C, Full>::kHeld) {
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int nn = min(n, N - 1), d = min(slice.feature(j), D - 1);
        in.h2held[n][j] = in.h2[nn * D + d];
      }
    }
  }
  const float* w_row = a.write + (write ? prev : row) * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = min(slice.feature(j), D - 1);
    in.h[j] = a.h[(row + B) * D + d];
    in.hp[j] = a.h[row * D + d];
    in.w[j] = w_row[d];
    in.z[j] = xz[D + d];
    in.r[j] = a.read[row * D + d];
    in.dout[j] = dy[d];
  }
  if (threadIdx.x < N) {
    in.read_attn = a.read_attn[row * N + threadIdx.x];
    if (write) in.write_attn = a.write_attn[prev * N + threadIdx.x];
  }
  sub.lap(0);
  return in;
}

// Sequence phase of step t (see above) from its prepared inputs. `products`: this step's rows
// phase ran (not the last step).
//
// Both attentions' backward from one pass over the tapes and one block sum: the write attention
// of t - 1 needs dL/dH_{t-1} . (w_{t-1} - H_{t-2}) per slot, and dL/dH_{t-1} is the carried
// gradient G plus the read attention's a_n dr + s_n h_{t-1} (s_n = scale ds_n), whose weights come
// from the same pass; so the pass sums dr . H_{t-1}, G . (w - H_{t-2}), dr . (w - H_{t-2}) and
// h_{t-1} . (w - H_{t-2}) and the write scores' gradient is the second + a_n third + s_n fourth
// (the same values up to rounding). The second pass updates dL/dH through both attentions.
template <int MaxN, int C, bool Full>
__device__ __forceinline__ void backward_step(const PersistentBackwardArgs& a, const SeqShared<MaxN, C, Full>& sh,
                                              std::uint32_t dH, std::uint32_t tape, std::int64_t b, std::int64_t t,
                                              bool products, const BackInputs<MaxN, C, Full>& in, BackOwned& own,
                                              bool& ok, Laps<4>& sub) {
  sub.start();
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, T = a.steps, row = t * B + b, prev = row - B;
  const bool write = t > 0;  // the write attention of step t - 1
  constexpr bool kHeld = BackInputs<MaxN, C, Full>::kHeld;
  const float* h2 = in.h2;
  const auto& h2held = in.h2held;
  // `tape` (shared) holds H_{t-1} on entry and H_{t-2} on return. The rows phase's products (the
  // loads after the grid barrier), zero selected where not wanted, then the arithmetic, stores
  // last (a load after a store through another pointer cannot be moved above it: they might alias).
  float h[kMaxFeatures], hp[kMaxFeatures], w[kMaxFeatures], rec[kMaxFeatures], dhw[kMaxFeatures];
  float z[kMaxFeatures], r[kMaxFeatures], dout[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const bool inside = sh.slice.feature(j) < D;
    const int d = min(sh.slice.feature(j), D - 1);
    rec[j] = __ldcg(a.recurrent + b * D + d);
    dhw[j] = __ldcg(a.dh_write + b * D + d);
    rec[j] = inside && products ? rec[j] : 0.0f;
    dhw[j] = inside && products ? dhw[j] : 0.0f;
    h[j] = inside ? in.h[j] : 0.0f;
    hp[j] = inside ? in.hp[j] : 0.0f;
    w[j] = inside && write ? in.w[j] : 0.0f;
    z[j] = inside ? in.z[j] : 0.0f;
    r[j] = inside ? in.r[j] : 0.0f;
    dout[j] = inside ? __bfloat162float(in.dout[j]) : 0.0f;
  }
  float dg[kMaxFeatures], dp[kMaxFeatures], dr[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    // Gate and output: y = h * silu(g), g = z + r + h.
    const float g = (z[j] + r[j]) + h[j];
    const float s = step::sigmoidf(g);
    dg[j] = dout[j] * h[j] * (s * (1.0f + g * (1.0f - s)));
    const float dh_local = ((rec[j] + own.dh_read[j]) + dout[j] * (g * s)) + dg[j];
    dp[j] = (dh_local + dhw[j]) * (1.0f - h[j] * h[j]);
    own.d_bias[j] += dp[j];
    dr[j] = dg[j] + dp[j];
  }
  // Scores: chunks of 8 slots, values i (dr . H_{t-1}), 8 + i (G . (w - H_{t-2})), 16 + i
  // (dr . (w - H_{t-2})), 24 + i (h_{t-1} . (w - H_{t-2})).
  // A chunk's H_{t-2} (8 slots) is loaded before its first term: behind the features' loop exits
  // each feature's loads would wait a round trip to L2 of their own (kHeld: from the registers
  // prepare_step filled).
  float h2c[8][kMaxFeatures];
  auto load_chunk = [&](int c) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        if constexpr (kHeld) {
          h2c[i][j] = h2held[min(c * 8 + i, MaxN - 1)][j];
        } else {
          const int n = min(c * 8 + i, N - 1), d = min(sh.slice.feature(j), D - 1);
          h2c[i][j] = h2[n * D + d];
        }
      }
    }
  };
  // Full variants whose two tapes fit the registers keep what this pass reads of H_{t-1} and dL/dH
  // for the second pass, which then reads no shared memory (each thread reads and writes only its
  // own elements, so the values are those it would read there).
  constexpr bool kHoldTapes = Full && 2 * MaxN * kFeaturesOf<C> <= 64;
  float held_h1[kHoldTapes ? MaxN : 1][kHoldTapes ? kFeaturesOf<C> : 1];
  float held_g[kHoldTapes ? MaxN : 1][kHoldTapes ? kFeaturesOf<C> : 1];
  sh.template score_pass<4>(D, N, load_chunk, [&](float(&v)[32], int i, int n, int j, int d) {
    const float h1 = lds(at_nd(tape, n, d, D)), g = lds(at_nd(dH, n, d, D));
    if constexpr (kHoldTapes) {
      held_h1[n][j] = h1;
      held_g[n][j] = g;
    }
    v[i] = fmaf(dr[j], h1, v[i]);
    const float diff = w[j] - h2c[i][j];
    v[8 + i] = fmaf(g, diff, v[8 + i]);
    v[16 + i] = fmaf(dr[j], diff, v[16 + i]);
    v[24 + i] = fmaf(hp[j], diff, v[24 + i]);
  });
  __nv_bfloat16* dxz = a.dxz + (b * T + t) * 2 * D;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    if (d >= D) break;
    dxz[D + d] = __float2bfloat16_rn(dg[j]);
    a.d_pre[frag_at(b, d, D)] = dp[j];
    a.d_pre_bf16[row * D + d] = __float2bfloat16_rn(dp[j]);
    dxz[d] = __float2bfloat16_rn(dp[j]);
  }
  sub.lap(1);
  if (threadIdx.x < N) {
    sh.attn[threadIdx.x] = in.read_attn;
    if (write) sh.attn[MaxN + threadIdx.x] = in.write_attn;
  }
  sh.template finish<4>(ok);
  if (threadIdx.x < 32) {
    const step::Shared<MaxN> read_view = sh.view(0), write_view = sh.view(1);
    step::softmax_backward_warp<MaxN>(read_view, N, a.detach_read);
    if (write) {
      __syncwarp();
      for (int n = threadIdx.x; n < N; n += 32) {
        const float g = sh.sums[MaxN + n] + sh.attn[n] * sh.sums[2 * MaxN + n];
        write_view.sums[n] = g + (a.scale * sh.ds[n]) * sh.sums[3 * MaxN + n];
      }
      __syncwarp();
      step::softmax_backward_warp<MaxN>(write_view, N, a.detach_write);
    }
  }
  __syncthreads();
  if (sh.slice.rank == 0 && threadIdx.x < N) {
    if (a.read_scores) a.read_scores[row * N + threadIdx.x] = sh.ds[threadIdx.x];
    if (write && a.write_scores) a.write_scores[prev * N + threadIdx.x] = sh.ds[MaxN + threadIdx.x];
  }
  sub.lap(2);

  // dL/dH_{t-1} = G + a_n dr + s_n h_{t-1} (the read of t), the read scores' part of dL/dh_{t-1},
  // then through the write of t - 1: dw_{t-1} and dL/dH_{t-2} = (1 - a'_n) dL/dH_{t-1} + s'_n w;
  // each feature's sums in slot order, as the hybrid path's.
  float dh_prev[kMaxFeatures], dw[kMaxFeatures];
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) dh_prev[j] = dw[j] = 0.0f;
  // H_{t-2} (kHeld: from registers; else from L2) four slots at a time, the next four loaded while
  // these are used: each slot's stores depend on its loads, and a load placed after a store waits
  // for it, so loaded a slot at a time the pass would wait a round trip to L2 per slot.
  constexpr int kGroup = 4;
  float next[kGroup][kMaxFeatures];
  auto load_group = [&](int n0) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int n = n0 + g, d = sh.slice.feature(j);
        if constexpr (kHeld) {
          next[g][j] = h2held[min(n, MaxN - 1)][j];
        } else {
          next[g][j] = n < N && d < D ? h2[n * D + d] : 0.0f;
        }
      }
    }
  };
  // The on-chip H_{t-1} and dL/dH of slot n + 1 are read before slot n's are written (they keep
  // their program order: read and written in turn, every element waited for its own read; B 16
  // backward 4.41 -> 4.36 ms on the H200).
  auto read_slot = [&](int n, float(&h1)[kMaxFeatures], float(&g)[kMaxFeatures]) {
#pragma unroll
    for (int j = 0; j < kFeaturesOf<C>; ++j) {
      const int d = sh.slice.feature(j);
      const bool in = n < N && n < MaxN && d < D;
      if constexpr (kHoldTapes) {
        h1[j] = in ? held_h1[min(n, MaxN - 1)][j] : 0.0f;
        g[j] = in ? held_g[min(n, MaxN - 1)][j] : 0.0f;
      } else {
        h1[j] = in ? lds(at_nd(tape, n, d, D)) : 0.0f;
        g[j] = in ? lds(at_nd(dH, n, d, D)) : 0.0f;
      }
    }
  };
  float h1_now[kMaxFeatures], g_now[kMaxFeatures], h1_next[kMaxFeatures] = {}, g_next[kMaxFeatures] = {};
  read_slot(0, h1_now, g_now);
  load_group(0);
#pragma unroll
  for (int n0 = 0; n0 < MaxN; n0 += kGroup) {
    if (n0 >= N) break;
    float h2g[kGroup][kMaxFeatures];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) h2g[g][j] = next[g][j];
    }
    load_group(n0 + kGroup);
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int n = n0 + g;
      if (n >= N) break;
      read_slot(n + 1, h1_next, g_next);
      const float ar = sh.attn[n], dsr = sh.ds[n], sr = a.scale * dsr;
      // Step 0 has no write attention before it: a' = s' = 0 leave dL/dH_{t-1} as it is.
      const float aw = write ? sh.attn[MaxN + n] : 0.0f, sw = write ? a.scale * sh.ds[MaxN + n] : 0.0f;
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        const int d = sh.slice.feature(j);
        if (d >= D) break;
        const float h1v = h1_now[j], h2v = h2g[g][j];
        sts(at_nd(tape, n, d, D), h2v);
        const float g1 = g_now[j] + fmaf(ar, dr[j], sr * hp[j]);
        dh_prev[j] = fmaf(dsr, h1v, dh_prev[j]);
        dw[j] = fmaf(aw, g1, dw[j]);
        dw[j] = fmaf(sw, h2v, dw[j]);
        sts(at_nd(dH, n, d, D), fmaf(1.0f - aw, g1, sw * w[j]));
      }
#pragma unroll
      for (int j = 0; j < kFeaturesOf<C>; ++j) {
        h1_now[j] = h1_next[j];
        g_now[j] = g_next[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) {
    const int d = sh.slice.feature(j);
    if (d >= D) break;
    own.dh_read[j] = a.scale * dh_prev[j];
    if (write) {
      a.d_write[frag_at(b, d, D)] = dw[j];
      a.d_write_bf16[prev * D + d] = __float2bfloat16_rn(dw[j]);
    }
  }
  sub.lap(3);
}

template <int MaxN, int C, Variant V>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_backward_kernel(const __grid_constant__ Params<PersistentBackwardArgs> p) {
  constexpr bool Vec = V != Variant::scalar, Full = V == Variant::full;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok_flag;
  const PersistentBackwardArgs& a = p.a;
  const int D = dim_of<Full>(a), N = slots_of<MaxN, Full>(a);
  const std::int64_t B = a.batch, T = a.steps;
  const Slice<C, Full> slice{static_cast<int>(blockIdx.x) % C};
  const BlockShared<MaxN, C, Full> block(smem, p.l, slice, p.grid.timeout_ns);
  const SeqShared<MaxN, C, Full>& sh = block.seq;
  sh.start_exchanges();
  const std::int64_t per_tape = static_cast<std::int64_t>(N) * D;
  float* chip_d_tape = block.tapes;
  const std::uint32_t d_tape = core::smem_addr(chip_d_tape);
  const std::uint32_t tape = core::smem_addr(chip_d_tape + (per_tape + 3) / 4 * 4);

  // This block's rows of [W_h^T ; W_write^T] (rows of the second from split), zero-padded.
  const RowsShare share = rows_share(p.l, 2 * p.l.split);
  load_rows(block.weights, p.l, share.rows, D, [&](int r, int k) {
    const int row = share.row0 + r;
    if (row < D) return a.w_h[static_cast<std::size_t>(k) * D + row];
    if (row >= p.l.split && row - p.l.split < D) return a.w_write[static_cast<std::size_t>(k) * D + (row - p.l.split)];
    return __float2bfloat16_rn(0.0f);
  });
  const std::int64_t b = blockIdx.x / C;
  const bool owner = b < B, exchanges = owner && C > 1;
  BackOwned own;
#pragma unroll
  for (int j = 0; j < kFeaturesOf<C>; ++j) own.dh_read[j] = own.d_bias[j] = 0.0f;
  if (owner) {
    for_owned(slice, N, D, [&](int n, int d) { chip_d_tape[n * D + d] = 0.0f; });
    // dL/dH_{T-1} is zero, so the write attention of the last step has no gradient.
#pragma unroll
    for (int j = 0; j < kFeaturesOf<C>; ++j) {
      const int d = slice.feature(j);
      if (d < D) a.d_write_bf16[((T - 1) * B + b) * D + d] = __float2bfloat16_rn(0.0f);
    }
    if (a.write_scores && slice.rank == 0 && threadIdx.x < N) {
      a.write_scores[((T - 1) * B + b) * N + threadIdx.x] = 0.0f;
    }
  }
  __syncthreads();

  Profile<4> profile(a.profile);
  auto& phases = profile.phases;
  auto& sub = profile.sub;
  bool ok = true;
  const ReplayAhead ahead(a, C);
  Segment segment = ahead.last(a);
  if (owner) {
    replay_segment<MaxN, C, Full>(a, slice, b, segment);
    // H_{T-2} on chip: the tape before step T - 1.
    const float* last = segment.tape(a, b, T - 1);
    for_owned(slice, N, D, [&](int n, int d) { sts(at_nd(tape, n, d, D), last[n * D + d]); });
    const BackInputs<MaxN, C, Full> in = prepare_step<MaxN, C, Full>(a, slice, b, T - 1, segment, ahead, sub);
    backward_step<MaxN, C, Full>(a, sh, d_tape, tape, b, T - 1, false, in, own, ok, sub);
  }
  phases.lap(2);
  RowsJob job;
  job.K = D;
  job.B = static_cast<int>(B);
  job.split = p.l.split;
  job.out_dim = D;
  job.in_lo = a.d_pre;
  job.in_hi = a.d_write;
  job.frag = true;
  job.out_lo = a.recurrent;
  job.out_hi = a.dh_write;
  std::uint32_t passed = 0;
  for (std::int64_t t = T - 2; ok && t >= 0; --t) {
    ok = grid_barrier(p.grid, passed, &ok_flag);
    if (!goes_on(ok, exchanges)) break;
    phases.lap(3);
    if (ok) rows_phase<Vec, Full>(job, p.l, block.weights, block.reduce, share);  // W_h^T dp_{t+1}, W_write^T dw_t
    phases.lap(0);
    const bool meet = ok;
    if (meet) grid_arrive(p.grid, passed);
    BackInputs<MaxN, C, Full> in;
    if (owner) in = prepare_step<MaxN, C, Full>(a, slice, b, t, segment, ahead, sub);  // its loads in flight
    ok = meet && grid_wait(p.grid, passed, &ok_flag);
    if (!goes_on(ok, exchanges)) break;
    phases.lap(1);
    if (owner) backward_step<MaxN, C, Full>(a, sh, d_tape, tape, b, t, true, in, own, ok, sub);
    ahead.step<MaxN, Full>(a, t);
    phases.lap(2);
  }
  __syncthreads();
  if (ok && owner) {
    float* dst = a.d_tape + b * per_tape;
    for_owned(slice, N, D, [&](int n, int d) { dst[n * D + d] = chip_d_tape[n * D + d]; });
#pragma unroll
    for (int j = 0; j < kFeaturesOf<C>; ++j) {
      const int d = slice.feature(j);
      if (d < D) a.d_bias[b * D + d] = own.d_bias[j];
    }
  }
  sh.end_exchanges();
  profile.write(a.profile);
}

// The launch's configuration: cooperative (the grid barriers need every block resident), in
// clusters of g.l.cluster blocks.
struct LaunchConfig {
  cudaLaunchAttribute attrs[2] = {};
  cudaLaunchConfig_t config = {};
  explicit LaunchConfig(const Geometry& g, cudaStream_t stream) {
    attrs[0].id = cudaLaunchAttributeCooperative;
    attrs[0].val.cooperative = 1;
    attrs[1].id = cudaLaunchAttributeClusterDimension;
    attrs[1].val.clusterDim.x = static_cast<unsigned>(g.l.cluster);
    attrs[1].val.clusterDim.y = 1;
    attrs[1].val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(g.grid));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = g.smem;
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = g.l.cluster > 1 ? 2 : 1;
  }
};

template <typename Args>
int resident_clusters_of(void (*kernel)(Params<Args>), const Geometry& g) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem)));
  LaunchConfig launch(g, nullptr);
  int clusters = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config));
  return clusters;
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
  LaunchConfig launch(g, stream);
  CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, p));
}

// The kernel of a launch: its blocks a sequence and whether the rows phase is vectorised.
// The kernel instances of one slot capacity, by cluster size and Variant.
template <int MaxN, int C>
void (*forward_instance(Variant v))(Params<PersistentForwardArgs>) {
  if (v == Variant::full) return persistent_forward_kernel<MaxN, C, Variant::full>;
  if (v == Variant::vec) return persistent_forward_kernel<MaxN, C, Variant::vec>;
  return persistent_forward_kernel<MaxN, C, Variant::scalar>;
}

template <int MaxN, int C>
void (*backward_instance(Variant v))(Params<PersistentBackwardArgs>) {
  if (v == Variant::full) return persistent_backward_kernel<MaxN, C, Variant::full>;
  if (v == Variant::vec) return persistent_backward_kernel<MaxN, C, Variant::vec>;
  return persistent_backward_kernel<MaxN, C, Variant::scalar>;
}

template <int MaxN>
void (*forward_kernel(int cluster, Variant v))(Params<PersistentForwardArgs>) {
  if (cluster == kMaxCluster) return forward_instance<MaxN, kMaxCluster>(v);
  if (cluster == 2) return forward_instance<MaxN, 2>(v);
  return forward_instance<MaxN, 1>(v);
}

template <int MaxN>
void (*backward_kernel(int cluster, Variant v))(Params<PersistentBackwardArgs>) {
  if (cluster == kMaxCluster) return backward_instance<MaxN, kMaxCluster>(v);
  if (cluster == 2) return backward_instance<MaxN, 2>(v);
  return backward_instance<MaxN, 1>(v);
}

template <int MaxN>
void launch(const PersistentForwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  const Variant v = variant_of(args.dim, args.slots, MaxN);
  launch_kernel(forward_kernel<MaxN>(g.l.cluster, v), Direction::forward, args, dev, g, stream);
}

template <int MaxN>
void launch(const PersistentBackwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream) {
  const Variant v = variant_of(args.dim, args.slots, MaxN);
  launch_kernel(backward_kernel<MaxN>(g.l.cluster, v), Direction::backward, args, dev, g, stream);
}

template <int MaxN>
int resident_clusters(Direction direction, int dim, int slots, const Geometry& g) {
  const Variant v = variant_of(dim, slots, MaxN);
  if (direction == Direction::forward) return resident_clusters_of(forward_kernel<MaxN>(g.l.cluster, v), g);
  return resident_clusters_of(backward_kernel<MaxN>(g.l.cluster, v), g);
}

// The instances of one slot capacity (layer_persistent_n<MaxN>.cu: one file each, so the four
// capacities' kernels compile in parallel).
#define E29A_PERSISTENT_INSTANCES(MaxN)                                                                    \
  template void launch<MaxN>(const PersistentForwardArgs&, const Device&, const Geometry&, cudaStream_t);  \
  template void launch<MaxN>(const PersistentBackwardArgs&, const Device&, const Geometry&, cudaStream_t); \
  template int resident_clusters<MaxN>(Direction, int, int, const Geometry&)

}  // namespace models::e29a::kernels::persistent
