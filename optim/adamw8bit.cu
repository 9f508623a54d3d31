// CUDA kernel of the fused 8-bit AdamW update: one thread block per work chunk.
//   fp32 chunk (a small tensor): AdamW on packed fp32 state, 16-byte accesses.
//   quantised chunk: each warp takes whole 256-element blocks; lane l holds the 4-element groups
//   at 4l and 128 + 4l (coalesced 16-byte accesses of w and g, 4-byte ones of the codes). The
//   warp stages its next block in shared memory by asynchronous copies while it computes the
//   current one, decodes through 256-entry tables in shared memory, and takes a block's maxima
//   with two warp reductions (no block-wide barrier).
// Clip, skip, bias correction and the rounding seed come from StepScalars on the device; the
// last block to finish advances the step counter (as in adamw.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include "core/error.h"
#include "optim/adamw8bit.h"
#include "optim/mirror_store.cuh"
#include "optim/quantization.h"

namespace optim {

namespace {

constexpr int kUpdateThreads = 256;
constexpr int kUpdateWarps = kUpdateThreads / 32;
// Tuning, measured on H200 (docs/optimizers.md): whether a warp stages its next block in shared
// memory with asynchronous copies while it computes the current one, and the minimum resident
// thread blocks per SM asked of the compiler (it bounds the registers per thread).
#ifndef ADAMW8BIT_ASYNC_COPY
#define ADAMW8BIT_ASYNC_COPY 1
#endif
#ifndef ADAMW8BIT_MIN_BLOCKS
#define ADAMW8BIT_MIN_BLOCKS 4
#endif
constexpr bool kAsyncCopy = ADAMW8BIT_ASYNC_COPY != 0;
constexpr int kMinBlocksPerSm = ADAMW8BIT_MIN_BLOCKS;

// 4 consecutive floats; `mask` bit e says element e may be touched (others read as 0).
__device__ __forceinline__ float4 load4(const float* p, unsigned mask) {
  if (mask == 0xFu) return __ldcs(reinterpret_cast<const float4*>(p));
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mask & 1u) r.x = p[0];
  if (mask & 2u) r.y = p[1];
  if (mask & 4u) r.z = p[2];
  if (mask & 8u) r.w = p[3];
  return r;
}

__device__ __forceinline__ void store4(float* p, float4 x, unsigned mask) {
  if (mask == 0xFu) {
    __stcs(reinterpret_cast<float4*>(p), x);
    return;
  }
  if (mask & 1u) p[0] = x.x;
  if (mask & 2u) p[1] = x.y;
  if (mask & 4u) p[2] = x.z;
  if (mask & 8u) p[3] = x.w;
}

template <typename Half>
__device__ __forceinline__ void store_mirror_masked(Half* p, float4 w, unsigned mask) {
  if (mask == 0xFu) {
    store_mirror4(p, w);
    return;
  }
  if (mask & 1u) store_mirror(p + 0, w.x);
  if (mask & 2u) store_mirror(p + 1, w.y);
  if (mask & 4u) store_mirror(p + 2, w.z);
  if (mask & 8u) store_mirror(p + 3, w.w);
}

__device__ __forceinline__ float& lane_of(float4& v, int e) {
  return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

__device__ __forceinline__ float lane_value(const float4& v, int e) {
  return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// Maximum over the warp of non-negative floats: their bit patterns order like the floats, so one
// integer warp reduction does it (the result is the same as any order of fmaxf).
__device__ __forceinline__ float warp_max_nonnegative(float x) {
  return __uint_as_float(__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(x)));
}

// Which elements of the 4-aligned group at global index i lie in a quantised segment of the
// chunk. `cursor` walks the chunk's segments forward (a lane's groups only move forward).
// Tensors start at multiples of 64, so a group that starts inside a segment is inside it up to
// the segment's end.
__device__ __forceinline__ unsigned member_mask(std::int64_t i, int& cursor, const std::int64_t* seg_begin,
                                                const std::int64_t* seg_end, int count) {
  while (cursor < count && seg_end[cursor] <= i) ++cursor;
  if (cursor >= count || seg_begin[cursor] > i) return 0u;
  const std::int64_t left = seg_end[cursor] - i;
  return left >= 4 ? 0xFu : (1u << left) - 1u;
}

struct ChunkShared {
  AdamWElementParams params[kMaxChunkSegments];
  std::int64_t seg_begin[kMaxChunkSegments];
  std::int64_t seg_end[kMaxChunkSegments];
  float unit_m[256];  // decoded value / scale of every code byte (MomentCodec<Q>::unit_m)
  float unit_v[256];
};

// What one lane reads of a block: its two 4-element groups (at 4l and 128 + 4l), their codes,
// the block's scales, and which elements are quantised.
struct BlockInput {
  float4 w0, w1, g0, g1;
  std::uint32_t m0, m1, v0, v1;  // 4 code bytes each
  float scale_m, scale_v;
  unsigned mask0, mask1;
  int p0, p1;  // index of each group's segment in the chunk
};

// A warp's copy of one block in shared memory (what a lane reads of it, see BlockInput), filled
// by asynchronous copies: lane l's groups at [l] and [32 + l].
struct alignas(16) BlockStage {
  float4 w[64];
  float4 g[64];
  std::uint32_t m[64];
  std::uint32_t v[64];
  float scale_m, scale_v, unused[2];
};

// Starts the copies of the block at global index `base` into `stage` (one commit group). Whole
// 16-byte groups are copied even where only some elements are quantised: the block lies inside
// the owned range, and the other elements are read but never used.
__device__ __forceinline__ void stage_block(BlockStage& stage, const AdamW8bitBuffers& b, std::int64_t base) {
  const int lane = threadIdx.x & 31;
  const std::int64_t i0 = base + 4 * lane;
  const std::int64_t local0 = i0 - b.owned_begin;
  __pipeline_memcpy_async(&stage.w[lane], b.master + local0, 16);
  __pipeline_memcpy_async(&stage.w[32 + lane], b.master + local0 + 128, 16);
  __pipeline_memcpy_async(&stage.g[lane], b.grad + i0, 16);
  __pipeline_memcpy_async(&stage.g[32 + lane], b.grad + i0 + 128, 16);
  __pipeline_memcpy_async(&stage.m[lane], b.q_m + local0, 4);
  __pipeline_memcpy_async(&stage.m[32 + lane], b.q_m + local0 + 128, 4);
  __pipeline_memcpy_async(&stage.v[lane], b.q_v + local0, 4);
  __pipeline_memcpy_async(&stage.v[32 + lane], b.q_v + local0 + 128, 4);
  const std::int64_t block = (base - b.owned_begin) / kQuantBlock;
  if (lane == 0) __pipeline_memcpy_async(&stage.scale_m, b.scale_m + block, 4);
  if (lane == 1) __pipeline_memcpy_async(&stage.scale_v, b.scale_v + block, 4);
  __pipeline_commit();
}

__device__ __forceinline__ BlockInput read_stage(const BlockStage& stage, unsigned mask0, unsigned mask1) {
  const int lane = threadIdx.x & 31;
  BlockInput in;
  in.mask0 = mask0;
  in.mask1 = mask1;
  in.w0 = stage.w[lane];
  in.w1 = stage.w[32 + lane];
  in.g0 = stage.g[lane];
  in.g1 = stage.g[32 + lane];
  in.m0 = stage.m[lane];
  in.m1 = stage.m[32 + lane];
  in.v0 = stage.v[lane];
  in.v1 = stage.v[32 + lane];
  in.scale_m = stage.scale_m;
  in.scale_v = stage.scale_v;
  return in;
}

__device__ __forceinline__ BlockInput load_block(const AdamW8bitBuffers& b, std::int64_t base, unsigned mask0,
                                                 unsigned mask1) {
  const std::int64_t i0 = base + 4 * (threadIdx.x & 31);
  const std::int64_t local0 = i0 - b.owned_begin;
  BlockInput in;
  in.mask0 = mask0;
  in.mask1 = mask1;
  in.w0 = load4(b.master + local0, mask0);
  in.w1 = load4(b.master + local0 + 128, mask1);
  in.g0 = load4(b.grad + i0, mask0);
  in.g1 = load4(b.grad + i0 + 128, mask1);
  const auto* qm = reinterpret_cast<const std::uint32_t*>(b.q_m + local0);
  const auto* qv = reinterpret_cast<const std::uint32_t*>(b.q_v + local0);
  in.m0 = __ldcs(qm);
  in.m1 = __ldcs(qm + 32);
  in.v0 = __ldcs(qv);
  in.v1 = __ldcs(qv + 32);
  const std::int64_t block = (base - b.owned_begin) / kQuantBlock;
  in.scale_m = b.scale_m[block];
  in.scale_v = b.scale_v[block];
  return in;
}

// One 4-element group: dequantise, AdamW in fp32, store w / mirror / g of the member elements.
// All four lanes are computed (no per-element branches); the updated m and v of non-members
// read as 0 for the block maxima and the requantisation.
template <typename Half>
__device__ __forceinline__ void update_group(const AdamW8bitBuffers& b, Half* mirror, std::int64_t i, unsigned mask,
                                             float4 w, const float4 g, std::uint32_t codes_m, std::uint32_t codes_v,
                                             float scale_m, float scale_v, const ChunkShared& shared,
                                             const AdamWElementParams e, float4& m, float4& v) {
  m = make_float4(0.f, 0.f, 0.f, 0.f);
  v = m;
  if (mask == 0u) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float mk = fp::mul(scale_m, shared.unit_m[(codes_m >> (8 * k)) & 0xFFu]);
    float vk = fp::mul(scale_v, shared.unit_v[(codes_v >> (8 * k)) & 0xFFu]);
    adamw_element_quantised(lane_of(w, k), mk, vk, lane_value(g, k), e);
    const bool member = (mask >> k) & 1u;
    lane_of(m, k) = member ? mk : 0.0f;
    lane_of(v, k) = member ? vk : 0.0f;
  }
  const std::int64_t local = i - b.owned_begin;
  store4(b.master + local, w, mask);
  store4(b.grad + i, make_float4(0.f, 0.f, 0.f, 0.f), mask);
  store_mirror_masked(mirror + i, w, mask);
}

// The codes of one group under the block's new scales (0 for non-members), packed little-endian.
template <Quantization Q>
__device__ __forceinline__ void encode_group(std::int64_t i, unsigned mask, const float4& m, const float4& v,
                                             CodeScale code_m, CodeScale code_v, std::uint64_t seed,
                                             std::uint32_t& codes_m, std::uint32_t& codes_v) {
  using Codec = MomentCodec<Q>;
  codes_m = 0;
  codes_v = 0;
  if (mask == 0u) return;
  std::uint64_t bits[2] = {0, 0};  // elements i, i + 1 and i + 2, i + 3 (i is a multiple of 4)
  if constexpr (Q == Quantization::companded) {
    bits[0] = rounding_bits(seed, i >> 1);
    bits[1] = rounding_bits(seed, (i >> 1) + 1);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const RoundingDraws u = rounding_draws_from(static_cast<std::uint32_t>(bits[k >> 1] >> (32 * (k & 1))));
    const std::uint32_t cm = Codec::encode_m(lane_value(m, k), code_m, u.m);
    const std::uint32_t cv = Codec::encode_v(lane_value(v, k), code_v, u.v);
    const std::uint32_t keep = ((mask >> k) & 1u) ? 0xFFu : 0u;
    codes_m |= (cm & keep) << (8 * k);
    codes_v |= (cv & keep) << (8 * k);
  }
}

// Update, block maxima, requantisation and stores of one block (the lane's share of it).
template <Quantization Q, typename Half>
__device__ __forceinline__ void update_block(const AdamW8bitBuffers& b, Half* mirror, std::int64_t base,
                                             const BlockInput& in, const AdamWElementParams& e0,
                                             const AdamWElementParams& e1, const ChunkShared& shared,
                                             std::uint64_t seed) {
  using Codec = MomentCodec<Q>;
  const std::int64_t i0 = base + 4 * (threadIdx.x & 31);
  const std::int64_t i1 = i0 + 128;
  float4 m0, v0, m1, v1;
  update_group(b, mirror, i0, in.mask0, in.w0, in.g0, in.m0, in.v0, in.scale_m, in.scale_v, shared, e0, m0, v0);
  update_group(b, mirror, i1, in.mask1, in.w1, in.g1, in.m1, in.v1, in.scale_m, in.scale_v, shared, e1, m1, v1);

  // Block maxima over the quantised elements (non-members are 0); max is order-free, so the
  // result is the CPU reference's.
  float max_m = fmaxf(fmaxf(fmaxf(fabsf(m0.x), fabsf(m0.y)), fmaxf(fabsf(m0.z), fabsf(m0.w))),
                      fmaxf(fmaxf(fabsf(m1.x), fabsf(m1.y)), fmaxf(fabsf(m1.z), fabsf(m1.w))));
  float max_v = fmaxf(fmaxf(fmaxf(v0.x, v0.y), fmaxf(v0.z, v0.w)), fmaxf(fmaxf(v1.x, v1.y), fmaxf(v1.z, v1.w)));
  max_m = block_scale(warp_max_nonnegative(max_m));
  max_v = block_scale(warp_max_nonnegative(max_v));
  const CodeScale code_m = Codec::code_scale_m(max_m);
  const CodeScale code_v = Codec::code_scale_v(max_v);
  std::uint32_t out_m0, out_v0, out_m1, out_v1;
  encode_group<Q>(i0, in.mask0, m0, v0, code_m, code_v, seed, out_m0, out_v0);
  encode_group<Q>(i1, in.mask1, m1, v1, code_m, code_v, seed, out_m1, out_v1);
  const std::int64_t local0 = i0 - b.owned_begin;
  auto* wm = reinterpret_cast<std::uint32_t*>(b.q_m + local0);
  auto* wv = reinterpret_cast<std::uint32_t*>(b.q_v + local0);
  __stcs(wm, out_m0);
  __stcs(wm + 32, out_m1);
  __stcs(wv, out_v0);
  __stcs(wv + 32, out_v1);
  if ((threadIdx.x & 31) == 0) {
    const std::int64_t block = (base - b.owned_begin) / kQuantBlock;
    b.scale_m[block] = max_m;
    b.scale_v[block] = max_v;
  }
}

// The warp's blocks of a quantised chunk (blocks warp, warp + 8, ...). With kAsyncCopy the next
// block is staged in shared memory (`stages`: this warp's two) while the current one is computed.
// Whole: the chunk lies inside one quantised segment, so every element is a member and one
// parameter set serves all (the common case: no lookups, no masks).
template <Quantization Q, bool Whole, typename Half>
__device__ __forceinline__ void update_quantised_blocks(const AdamW8bitBuffers& b, Half* mirror,
                                                        const AdamW8bitChunk& chunk, const ChunkShared& shared,
                                                        BlockStage* stages, bool skip, std::uint64_t seed) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int count = chunk.segment_count;
  const int blocks = chunk.length / static_cast<int>(kQuantBlock);
  auto base_of = [&](int blk) { return chunk.offset + static_cast<std::int64_t>(blk) * kQuantBlock; };
  int cursor0 = 0, cursor1 = 0;
  // Member masks and segment indices of the lane's groups in block `blk` (cursors move forward).
  auto membership = [&](int blk, unsigned& mask0, unsigned& mask1, int& p0, int& p1) {
    if (Whole) {
      mask0 = mask1 = 0xFu;
      p0 = p1 = 0;
      return;
    }
    const std::int64_t i0 = base_of(blk) + 4 * lane;
    mask0 = member_mask(i0, cursor0, shared.seg_begin, shared.seg_end, count);
    mask1 = member_mask(i0 + 128, cursor1, shared.seg_begin, shared.seg_end, count);
    p0 = cursor0 < count ? cursor0 : count - 1;
    p1 = cursor1 < count ? cursor1 : count - 1;
  };
  if (skip) {
    for (int blk = warp; blk < blocks; blk += kUpdateWarps) {
      unsigned mask0, mask1;
      int p0, p1;
      membership(blk, mask0, mask1, p0, p1);
      const std::int64_t i0 = base_of(blk) + 4 * lane;
      store4(b.grad + i0, make_float4(0.f, 0.f, 0.f, 0.f), mask0);
      store4(b.grad + i0 + 128, make_float4(0.f, 0.f, 0.f, 0.f), mask1);
    }
    return;
  }
  if (warp >= blocks) return;
  // Only the step size and the decay factor differ between segments; the rest of the element
  // parameters is the same for the whole step.
  const AdamWElementParams uniform_params = shared.params[0];
  int stage = 0;
  if (kAsyncCopy) stage_block(stages[0], b, base_of(warp));
  for (int blk = warp; blk < blocks; blk += kUpdateWarps) {
    unsigned mask0, mask1;
    int p0, p1;
    membership(blk, mask0, mask1, p0, p1);
    BlockInput in;
    if (kAsyncCopy) {
      if (blk + kUpdateWarps < blocks) {
        stage_block(stages[stage ^ 1], b, base_of(blk + kUpdateWarps));
        __pipeline_wait_prior(1);  // all but the copies just started: the current block is in
      } else {
        __pipeline_wait_prior(0);
      }
      __syncwarp();  // the scales were copied by lanes 0 and 1
      in = read_stage(stages[stage], mask0, mask1);
      __syncwarp();  // every lane has read the stage before it is refilled
      stage ^= 1;
    } else {
      in = load_block(b, base_of(blk), mask0, mask1);
    }
    AdamWElementParams e0 = uniform_params, e1 = uniform_params;
    if (!Whole) {
      e0.step_size = shared.params[p0].step_size;
      e0.decay_factor = shared.params[p0].decay_factor;
      e1.step_size = shared.params[p1].step_size;
      e1.decay_factor = shared.params[p1].decay_factor;
    }
    update_block<Q>(b, mirror, base_of(blk), in, e0, e1, shared, seed);
  }
}

template <Quantization Q, typename Half>
__device__ __forceinline__ void update_quantised_chunk(const AdamW8bitBuffers& b, Half* mirror,
                                                       const AdamW8bitChunk& chunk, const ChunkShared& shared,
                                                       BlockStage* stages, bool skip, std::uint64_t seed) {
  const bool whole = chunk.segment_count == 1 && shared.seg_begin[0] <= chunk.offset &&
                     shared.seg_end[0] >= chunk.offset + chunk.length;
  if (whole) {
    update_quantised_blocks<Q, true>(b, mirror, chunk, shared, stages, skip, seed);
  } else {
    update_quantised_blocks<Q, false>(b, mirror, chunk, shared, stages, skip, seed);
  }
}

template <typename Half>
__device__ __forceinline__ void update_fp32_chunk(const AdamW8bitBuffers& b, Half* mirror, const AdamW8bitChunk& chunk,
                                                  const AdamWElementParams& e, bool skip) {
  const int n = chunk.length;
  const int vectors = n >> 2;
  float* g = b.grad + chunk.offset;
  float4* g4 = reinterpret_cast<float4*>(g);
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  if (skip) {
    for (int i = threadIdx.x; i < vectors; i += kUpdateThreads) __stcs(g4 + i, zero4);
    for (int i = (vectors << 2) + threadIdx.x; i < n; i += kUpdateThreads) g[i] = 0.0f;
    return;
  }
  float* w = b.master + (chunk.offset - b.owned_begin);
  float* m = b.small_m + chunk.state_offset;
  float* v = b.small_v + chunk.state_offset;
  Half* out = mirror + chunk.offset;
  float4* w4 = reinterpret_cast<float4*>(w);
  float4* m4 = reinterpret_cast<float4*>(m);
  float4* v4 = reinterpret_cast<float4*>(v);
  for (int i = threadIdx.x; i < vectors; i += kUpdateThreads) {
    const float4 gi = __ldcs(g4 + i);
    float4 wi = __ldcs(w4 + i);
    float4 mi = m4[i];
    float4 vi = v4[i];
    adamw_element(wi.x, mi.x, vi.x, gi.x, e);
    adamw_element(wi.y, mi.y, vi.y, gi.y, e);
    adamw_element(wi.z, mi.z, vi.z, gi.z, e);
    adamw_element(wi.w, mi.w, vi.w, gi.w, e);
    __stcs(w4 + i, wi);
    m4[i] = mi;
    v4[i] = vi;
    __stcs(g4 + i, zero4);
    store_mirror4(out + 4 * i, wi);
  }
  for (int i = (vectors << 2) + threadIdx.x; i < n; i += kUpdateThreads) {
    adamw_element(w[i], m[i], v[i], g[i], e);
    store_mirror(out + i, w[i]);
    g[i] = 0.0f;
  }
}

template <Quantization Q, typename Half>
__global__ void __launch_bounds__(kUpdateThreads, kMinBlocksPerSm)
adamw8bit_update_kernel(AdamW8bitBuffers b, const AdamW8bitChunk* __restrict__ chunks, std::int64_t num_chunks,
                        const Segment* __restrict__ segments, const Segment* __restrict__ quantised_segments,
                        StepScalars* __restrict__ scalars, AdamWStepParams params) {
  __shared__ ChunkShared shared;
  __shared__ BlockStage stages[kAsyncCopy ? 2 * kUpdateWarps : 1];  // two per warp
  __shared__ AdamW8bitChunk shared_chunk;
  __shared__ bool shared_skip;
  __shared__ std::uint64_t shared_seed;
  const bool has_chunk = blockIdx.x < num_chunks;
  if (threadIdx.x == 0) {
    shared_skip = skips_step(params.policy, scalars->nonfinite);
    if (has_chunk) shared_chunk = chunks[blockIdx.x];
  }
  __syncthreads();

  if (has_chunk) {
    const AdamW8bitChunk chunk = shared_chunk;
    const bool skip = shared_skip;
    if (chunk.kind == ChunkKind::quantised) {
      using Codec = MomentCodec<Q>;
      for (int c = threadIdx.x; c < 256; c += kUpdateThreads) {
        shared.unit_m[c] = Codec::unit_m(static_cast<std::uint8_t>(c));
        shared.unit_v[c] = Codec::unit_v(static_cast<std::uint8_t>(c));
      }
    }
    if (static_cast<int>(threadIdx.x) < chunk.segment_count) {
      // Each segment's step parameters, one thread per segment.
      const Segment seg = chunk.kind == ChunkKind::fp32 ? segments[chunk.first_segment]
                                                        : quantised_segments[chunk.first_segment + threadIdx.x];
      const float clip = clip_coefficient(scalars->grad_sq_sum, params.max_norm);
      const long long t = scalars->step + 1;
      shared.params[threadIdx.x] = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
      shared.seg_begin[threadIdx.x] = seg.offset;
      shared.seg_end[threadIdx.x] = seg.offset + seg.length;
      if (threadIdx.x == 0) shared_seed = rounding_seed(t);
    }
    __syncthreads();
    Half* mirror = static_cast<Half*>(b.mirror);
    if (chunk.kind == ChunkKind::fp32) {
      update_fp32_chunk(b, mirror, chunk, shared.params[0], skip);
    } else {
      update_quantised_chunk<Q>(b, mirror, chunk, shared, stages + 2 * (threadIdx.x >> 5), skip, shared_seed);
    }
  }

  // The last block to finish advances the step counters; every block has read them by then.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&scalars->update_arrivals, 1u) == gridDim.x - 1) {
      if (shared_skip) {
        ++scalars->skipped;
      } else {
        ++scalars->step;
      }
      scalars->update_arrivals = 0;
    }
  }
}

template <Quantization Q>
void launch_for_code(const AdamW8bitBuffers& b, const AdamW8bitChunk* chunks, std::int64_t num_chunks,
                     const Segment* segments, const Segment* quantised_segments, StepScalars* scalars,
                     const AdamWStepParams& params, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>(num_chunks > 0 ? num_chunks : 1);
  if (b.mirror_dtype == core::DType::bf16) {
    adamw8bit_update_kernel<Q, __nv_bfloat16><<<blocks, kUpdateThreads, 0, stream>>>(
        b, chunks, num_chunks, segments, quantised_segments, scalars, params);
  } else {
    adamw8bit_update_kernel<Q, __half><<<blocks, kUpdateThreads, 0, stream>>>(b, chunks, num_chunks, segments,
                                                                              quantised_segments, scalars, params);
  }
  CUDA_CHECK_LAUNCH("adamw8bit_update_kernel");
}

}  // namespace

void launch_adamw8bit_update(const AdamW8bitBuffers& buffers, const AdamW8bitChunk* chunks, std::int64_t num_chunks,
                             const Segment* segments, const Segment* quantised_segments, StepScalars* scalars,
                             const AdamWStepParams& params, Quantization quantization, cudaStream_t stream) {
  if (quantization == Quantization::companded) {
    launch_for_code<Quantization::companded>(buffers, chunks, num_chunks, segments, quantised_segments, scalars,
                                             params, stream);
  } else {
    launch_for_code<Quantization::linear>(buffers, chunks, num_chunks, segments, quantised_segments, scalars, params,
                                          stream);
  }
}

}  // namespace optim
