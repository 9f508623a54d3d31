// CUDA kernel of the fused 8-bit AdamW update: one thread block per work chunk.
//   fp32 chunk (a small tensor): AdamW on packed fp32 state, 16-byte accesses.
//   quantised chunk: each warp takes whole 256-element blocks; lane l holds the 4-element groups
//   at 4l and 128 + 4l (coalesced 16-byte accesses of w and g, 4-byte ones of the codes). The
//   warp stages its next block in shared memory by asynchronous copies while it computes the
//   current one (the first one is requested before the chunk's prologue), decodes through
//   256-entry tables in shared memory, and takes a block's maxima with two warp reductions (no
//   block-wide barrier).
// Clip, skip, bias correction and the rounding seed come from StepScalars on the device; the
// last block to finish advances the step counter (as in adamw.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <type_traits>

#include "core/error.h"
#include "optim/adamw8bit.h"
#include "optim/adamw_span.cuh"
#include "optim/quantization.h"

namespace optim {

namespace {

constexpr int kUpdateThreads = 256;
constexpr int kUpdateWarps = kUpdateThreads / 32;
// Tuning, measured on H200 (docs/optimizers.md): whether a warp stages its next block in shared
// memory with asynchronous copies while it computes the current one, and the minimum resident
// thread blocks per SM asked of the compiler (it bounds the registers per thread: 64 at 4).
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

// What differs between the segments of a chunk (the rest of AdamWElementParams is the same for
// the whole launch and comes in the kernel's parameters).
struct SegmentParams {
  float clip, step_size, decay_factor, inv_bc2_sqrt, bc2_sqrt;
};

struct ChunkShared {
  SegmentParams params[kMaxChunkSegments];
  std::int64_t seg_begin[kMaxChunkSegments];
  std::int64_t seg_end[kMaxChunkSegments];
  float unit_m[256];  // decoded value / scale of every code byte (MomentCodec<Q>::unit_m)
  float unit_v[256];
};

__device__ __forceinline__ AdamWElementParams element_params(const AdamWElementParams& uniform,
                                                             const SegmentParams& s) {
  AdamWElementParams e = uniform;
  e.clip = s.clip;
  e.step_size = s.step_size;
  e.decay_factor = s.decay_factor;
  e.inv_bc2_sqrt = s.inv_bc2_sqrt;
  e.bc2_sqrt = s.bc2_sqrt;
  return e;
}

// The arrays the quantised path reads and writes: weights, gradients, mirror, the moments' codes
// and their per-block scales.
template <typename Half>
struct QuantisedArrays {
  float* master;
  float* grad;
  Half* mirror;
  std::uint8_t* q_m;
  std::uint8_t* q_v;
  float* scale_m;
  float* scale_v;
};

// The buffers as the quantised path addresses them: every array by the index relative to the
// owned range (grad and mirror shifted by owned_begin on the host; grad comes in as
// Slab::grad_origin(), indexed by global element), the scales by block.
template <typename Half>
struct LocalBuffers : QuantisedArrays<Half> {
  std::int64_t owned_begin;
};

// Where a lane's elements of one block lie: its first group (the second is 128 elements on) and the
// block's scales.
template <typename Half>
using LanePointers = QuantisedArrays<Half>;

// The lane's pointers into the block at local index `local` (a multiple of 256).
template <typename Half>
__device__ __forceinline__ LanePointers<Half> lane_pointers(const LocalBuffers<Half>& L, std::int64_t local) {
  const std::int64_t e = local + 4 * (threadIdx.x & 31);
  const auto block = static_cast<std::uint64_t>(local) / kQuantBlock;
  return {L.master + e, L.grad + e, L.mirror + e, L.q_m + e, L.q_v + e, L.scale_m + block, L.scale_v + block};
}

// A warp's copy of one block in shared memory, filled by asynchronous copies: lane l's groups
// (at 4l and 128 + 4l) at [l] and [32 + l], and the block's scales.
struct alignas(16) BlockStage {
  float4 w[64];
  float4 g[64];
  std::uint32_t m[64];
  std::uint32_t v[64];
  float scale_m, scale_v, unused[2];
};

// Starts the copies of the block at `p` into `stage` (one commit group). Whole 16-byte groups are
// copied even where only some elements are quantised: the block lies inside the owned range (so
// inside a gradient buffer that covers the shard only), and the other elements are read but never
// used.
template <typename Half>
__device__ __forceinline__ void stage_block(BlockStage& stage, const LanePointers<Half>& p) {
  const int lane = threadIdx.x & 31;
  __pipeline_memcpy_async(&stage.w[lane], p.master, 16);
  __pipeline_memcpy_async(&stage.w[32 + lane], p.master + 128, 16);
  __pipeline_memcpy_async(&stage.g[lane], p.grad, 16);
  __pipeline_memcpy_async(&stage.g[32 + lane], p.grad + 128, 16);
  __pipeline_memcpy_async(&stage.m[lane], p.q_m, 4);
  __pipeline_memcpy_async(&stage.m[32 + lane], p.q_m + 128, 4);
  __pipeline_memcpy_async(&stage.v[lane], p.q_v, 4);
  __pipeline_memcpy_async(&stage.v[32 + lane], p.q_v + 128, 4);
  if (lane == 0) __pipeline_memcpy_async(&stage.scale_m, p.scale_m, 4);
  if (lane == 1) __pipeline_memcpy_async(&stage.scale_v, p.scale_v, 4);
  __pipeline_commit();
}

// The lane's share of a block as update_block reads it: group h (0: at 4l, 1: at 128 + 4l).
// StagedBlock reads it from the warp's stage when it is needed (so that it need not sit in
// registers), LoadedBlock holds it in registers (loaded from global memory).
struct StagedBlock {
  const BlockStage* stage;
  int lane;
  __device__ __forceinline__ float4 w(int h) const { return stage->w[32 * h + lane]; }
  __device__ __forceinline__ float4 g(int h) const { return stage->g[32 * h + lane]; }
  __device__ __forceinline__ std::uint32_t m(int h) const { return stage->m[32 * h + lane]; }
  __device__ __forceinline__ std::uint32_t v(int h) const { return stage->v[32 * h + lane]; }
  __device__ __forceinline__ float scale_m() const { return stage->scale_m; }
  __device__ __forceinline__ float scale_v() const { return stage->scale_v; }
};

struct LoadedBlock {
  float4 w_[2], g_[2];
  std::uint32_t m_[2], v_[2];
  float scale_m_, scale_v_;
  __device__ __forceinline__ float4 w(int h) const { return w_[h]; }
  __device__ __forceinline__ float4 g(int h) const { return g_[h]; }
  __device__ __forceinline__ std::uint32_t m(int h) const { return m_[h]; }
  __device__ __forceinline__ std::uint32_t v(int h) const { return v_[h]; }
  __device__ __forceinline__ float scale_m() const { return scale_m_; }
  __device__ __forceinline__ float scale_v() const { return scale_v_; }
};

template <typename Half>
__device__ __forceinline__ LoadedBlock load_block(const LanePointers<Half>& p, unsigned mask0, unsigned mask1) {
  LoadedBlock in;
  in.w_[0] = load4(p.master, mask0);
  in.w_[1] = load4(p.master + 128, mask1);
  in.g_[0] = load4(p.grad, mask0);
  in.g_[1] = load4(p.grad + 128, mask1);
  const auto* qm = reinterpret_cast<const std::uint32_t*>(p.q_m);
  const auto* qv = reinterpret_cast<const std::uint32_t*>(p.q_v);
  in.m_[0] = __ldcs(qm);
  in.m_[1] = __ldcs(qm + 32);
  in.v_[0] = __ldcs(qv);
  in.v_[1] = __ldcs(qv + 32);
  in.scale_m_ = *p.scale_m;
  in.scale_v_ = *p.scale_v;
  return in;
}

__device__ __forceinline__ float component(const float4& x, int e) {
  return e == 0 ? x.x : (e == 1 ? x.y : (e == 2 ? x.z : x.w));
}

// ---- The element arithmetic of a lane's 8 elements (two 4-element groups) ----------------------
//
// Everything below computes exactly what the CPU reference computes (adamw_element_quantised,
// MomentCodec<Q>::encode_m / encode_v); what differs is only how many instructions it takes:
//   * the square roots of the 8 updated v are taken by the compiler's own fast path of sqrt.rn
//     (sqrt_rn_in_range) when all 8 lie in its range, with one range test for the 8 instead of a
//     test and a branch per element; otherwise by fp::sqrt;
//   * a companded code is first computed as if the approximate root were already right
//     (fast_encode_m / fast_encode_v: no correction step, floor by one add rounded down, the code
//     read off the bits of that sum); when any of a lane's 16 codes fails the check that makes
//     this exact (the guess's code is the reference's lo), the lane recomputes all 16 with the
//     reference encoder. The guess is off by a code only where the root lies within ~1e-4 of a
//     code, so the recomputation is rare.

// Exactly fp::sqrt(x) (sqrt.rn.f32) for x in [2^-101, FLT_MAX]: the instruction sequence that the
// compiler emits for sqrt.rn on sm_80, sm_86 and sm_90 (MUFU.RSQ, FMUL.FTZ x 2, FFMA x 2) and
// takes when this range test passes (other inputs go to a slower subroutine). No denormal occurs
// inside the range, so the FTZ of the compiler's multiplications makes no difference.
// tests/optim/test_adamw8bit_gpu.cpp checks it against fp::sqrt over every float of the range.
__device__ __forceinline__ float sqrt_rn_in_range(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  const float s = __fmul_rn(x, y);
  const float h = __fmul_rn(y, 0.5f);
  const float r = __fmaf_rn(-s, s, x);
  return __fmaf_rn(r, h, s);
}

// bits(x) - bits(2^-101): sqrt_rn_in_range(x) is exact when this is at most kSqrtRangeSpan.
__device__ __forceinline__ unsigned sqrt_range_offset(float x) { return __float_as_uint(x) - 0x0D000000u; }
constexpr unsigned kSqrtRangeSpan = 0x727FFFFFu;  // bits(FLT_MAX) - bits(2^-101)

// 2^23 + floor(x) for x in [0, 2^23): exact, one add rounded toward -inf. Its bit pattern is
// 0x4B000000 + floor(x), so a code is the low byte of the pattern.
__device__ __forceinline__ float floor_biased(float x) { return __fadd_rd(x, 0x1p23f); }

// The magnitude k of the companded m code (in the low byte) of MomentCodec<companded>::encode_m,
// computed with lo = the code of the approximate root. Sets `bad` where that may not be the
// reference's lo: t < position(lo) (or t is NaN), or t >= position(lo + 1) below the top.
// Positions are k^2, so hi - lo = 2k + 1 exactly, and t - lo >= 2k + 1 whenever t >= (k + 1)^2.
__device__ __forceinline__ std::uint32_t fast_encode_m(float m, float factor, float u, bool& bad) {
  constexpr float last = kCompandedMTop - 1;
  // |m| here, (m < 0 ? -m : m) in the reference: they differ at -0 only, whose code is 0 either way.
  const float t = fp::mul(fabsf(m), factor);                             // the sign is applied by signed_m_codes
  const float biased = floor_biased(fminf(quant::sqrt_guess(t), last));  // a NaN t gives last, and bad
  const float k = fp::add(biased, -0x1p23f);
  const float gap = fp::fma(2.0f, k, 1.0f);
  const float diff = fp::add(t, -fp::mul(k, k));
  bad |= !(diff >= 0.0f) || (diff >= gap && k < last);
  return __float_as_uint(biased) + (fp::mul(u, gap) < diff ? 1u : 0u);
}

// Four companded m codes from their magnitudes k (the bytes of `magnitudes`, each below 128) and
// the signs of m: 0x80 | k for a negative m with k > 0, else k.
__device__ __forceinline__ std::uint32_t signed_m_codes(std::uint32_t magnitudes, const float* m) {
  const std::uint32_t signs = __byte_perm(__byte_perm(__float_as_uint(m[0]), __float_as_uint(m[1]), 0x0073u),
                                          __byte_perm(__float_as_uint(m[2]), __float_as_uint(m[3]), 0x0073u),
                                          0x5410u);        // bit 7 of byte k: m[k] < 0
  const std::uint32_t nonzero = magnitudes + 0x7F7F7F7Fu;  // bit 7 of byte k: k > 0 (no carries)
  return magnitudes | (signs & nonzero & 0x80808080u);
}

// The companded v code (in the low byte) of MomentCodec<companded>::encode_v, as fast_encode_m.
__device__ __forceinline__ std::uint32_t fast_encode_v(float v, float factor, float u, bool& bad) {
  constexpr float last = kCompandedVTop - 1;
  const float t = fp::mul(v, factor);
  const float biased = floor_biased(fminf(quant::fourth_root_guess(t), last));
  const float c = fp::add(biased, -0x1p23f);
  const float lo = quant::v_code_position(c);
  const float hi = quant::v_code_position(fp::add(c, 1.0f));
  const float diff = fp::add(t, -lo);
  bad |= !(diff >= 0.0f) || (t >= hi && c < last);
  // A t > 0 never gets code 0: at c = 0 the draw is taken as 0, so that the code is 1 exactly when
  // t > 0 (elsewhere min(u, c) = u).
  return __float_as_uint(biased) + (fp::mul(fminf(u, c), fp::add(hi, -lo)) < diff ? 1u : 0u);
}

// `word` with its byte k replaced by the low byte of `code`.
// (k == 0 starts the word: its other bytes are replaced by those of k = 1, 2, 3.)
__device__ __forceinline__ std::uint32_t put_byte(std::uint32_t word, std::uint32_t code, int k) {
  return k == 0 ? code : __byte_perm(word, code, k == 1 ? 0x3240u : (k == 2 ? 0x3410u : 0x4210u));
}

// Byte mask of the member elements of a 4-bit element mask.
__device__ __forceinline__ std::uint32_t byte_mask(unsigned mask) {
  return ((mask & 1u) ? 0xFFu : 0u) | ((mask & 2u) ? 0xFF00u : 0u) | ((mask & 4u) ? 0xFF0000u : 0u) |
         ((mask & 8u) ? 0xFF000000u : 0u);
}

// The codes of one of the lane's groups (elements 0..3 of m and v), one word per moment.
// Companded: `bits(p)` is the 64-bit draw word of the group's pair p (elements 2p and 2p + 1: the
// low and high half, see rounding_draws_from).
template <Quantization Q, typename Bits>
__device__ __forceinline__ void encode_group(const float* m, const float* v, const CodeScale& code_m,
                                             const CodeScale& code_v, Bits bits_of_pair, std::uint32_t& out_m,
                                             std::uint32_t& out_v) {
  using Codec = MomentCodec<Q>;
  if constexpr (Q == Quantization::companded) {
    // encode(k, u) for the group's elements k = 0..3 with their draws u.
    auto for_each_element = [&](auto encode) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const std::uint64_t bits = bits_of_pair(p);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          encode(2 * p + h, rounding_draws_from(static_cast<std::uint32_t>(bits >> (32 * h))));
      }
    };
    bool bad = false;
    for_each_element([&](int k, const RoundingDraws& u) {
      out_m = put_byte(out_m, fast_encode_m(m[k], code_m.factor, u.m, bad), k);
      out_v = put_byte(out_v, fast_encode_v(v[k], code_v.factor, u.v, bad), k);
    });
    out_m = signed_m_codes(out_m, m);
    if (bad) {
      for_each_element([&](int k, const RoundingDraws& u) {
        out_m = put_byte(out_m, Codec::encode_m(m[k], code_m, u.m), k);
        out_v = put_byte(out_v, Codec::encode_v(v[k], code_v, u.v), k);
      });
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out_m = put_byte(out_m, Codec::encode_m(m[k], code_m, 0.0f), k);
      out_v = put_byte(out_v, Codec::encode_v(v[k], code_v, 0.0f), k);
    }
  }
}

// The draw words of a group whose elements are 2j .. 2j + 3 in a step seeded `seed`, from
// key = seed ^ j (j even): rounding_bits(seed, j + p) = splitmix64(seed ^ (j + p)) = splitmix64(key ^ p).
struct HashedDraws {
  std::uint64_t key;
  __device__ __forceinline__ std::uint64_t operator()(int p) const {
    return core::splitmix64(key ^ static_cast<std::uint64_t>(p));
  }
};

// Update, block maxima, requantisation and stores of the block at local index `local`; `key` is
// the step's seed ^ (global index of the lane's first element) / 2. The lane's elements k = 0..7
// are its first element + k for k < 4 and + 124 + k for k >= 4 (group h = k / 4). Whole: all are
// members, one parameter set (e0) serves all; otherwise mask0 / mask1 say which elements of each
// group are quantised, and e0 / e1 are the groups' parameters.
template <Quantization Q, bool Whole, typename Half, typename Block>
__device__ __forceinline__ void update_block(const LocalBuffers<Half>& L, std::int64_t local, std::uint64_t key,
                                             const Block& in, unsigned mask0, unsigned mask1,
                                             const AdamWElementParams& e0, const AdamWElementParams& e1,
                                             const ChunkShared& shared) {
  using Codec = MomentCodec<Q>;
  const unsigned members = Whole ? 0xFFu : (mask0 | (mask1 << 4));
  auto params = [&](int k) -> const AdamWElementParams& { return Whole || k < 4 ? e0 : e1; };

  // Dequantise and update the moments.
  float m[8], v[8];
  {
    const float scale_m = in.scale_m(), scale_v = in.scale_v();
    const std::uint32_t codes_m[2] = {in.m(0), in.m(1)}, codes_v[2] = {in.v(0), in.v(1)};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int shift = 8 * (k & 3);
      m[k] = fp::mul(scale_m, shared.unit_m[(codes_m[k >> 2] >> shift) & 0xFFu]);
      v[k] = fp::mul(scale_v, shared.unit_v[(codes_v[k >> 2] >> shift) & 0xFFu]);
      adamw_moments(m[k], v[k], component(in.g(k >> 2), k & 3), params(k));
    }
  }

  // sqrt(v) and the weights, one range test for the 8 square roots (non-members count as 1).
  // Otherwise each root is fp::sqrt's, with v = 0 (an element that never had a gradient, outside
  // the range) written as 0 directly: the sign of a zero root does not reach the weight (the
  // denominator is eps either way).
  float w[8];
  unsigned range = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) range = max(range, sqrt_range_offset(((members >> k) & 1u) ? v[k] : 1.0f));
  if (range <= kSqrtRangeSpan) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w[k] = adamw_weight_quantised(component(in.w(k >> 2), k & 3), m[k], sqrt_rn_in_range(v[k]), params(k));
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float root = v[k] == 0.0f ? 0.0f : fp::sqrt(v[k]);
      w[k] = adamw_weight_quantised(component(in.w(k >> 2), k & 3), m[k], root, params(k));
    }
  }
  const float4 w0 = make_float4(w[0], w[1], w[2], w[3]);
  const float4 w1 = make_float4(w[4], w[5], w[6], w[7]);
  const LanePointers<Half> p = lane_pointers(L, local);
  if (Whole) {
    write_back4(reinterpret_cast<float4*>(p.master), reinterpret_cast<float4*>(p.grad), p.mirror, w0);
    write_back4(reinterpret_cast<float4*>(p.master + 128), reinterpret_cast<float4*>(p.grad + 128), p.mirror + 128, w1);
  } else {
    write_back4_masked(p.master, p.grad, p.mirror, w0, mask0);
    write_back4_masked(p.master + 128, p.grad + 128, p.mirror + 128, w1, mask1);
  }

  // Block maxima over the quantised elements (non-members read as 0); max is order-free, so the
  // result is the CPU reference's.
  float max_m = 0.0f, max_v = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (!((members >> k) & 1u)) m[k] = v[k] = 0.0f;
    max_m = fmaxf(max_m, fabsf(m[k]));
    max_v = fmaxf(max_v, v[k]);
  }
  max_m = block_scale(warp_max_nonnegative(max_m));
  max_v = block_scale(warp_max_nonnegative(max_v));

  if ((threadIdx.x & 31) == 0) {
    *p.scale_m = max_m;
    *p.scale_v = max_v;
  }
  const CodeScale code_m = Codec::code_scale_m(max_m), code_v = Codec::code_scale_v(max_v);
  std::uint32_t out_m[2] = {0, 0}, out_v[2] = {0, 0};
  // The lane's second group starts at global index 2(j + 64) for the first's 2j, and j + 64 = j | 64
  // (j = block start / 2 + 2l, block starts being multiples of 256).
  encode_group<Q>(m, v, code_m, code_v, HashedDraws{key}, out_m[0], out_v[0]);
  encode_group<Q>(m + 4, v + 4, code_m, code_v, HashedDraws{key ^ 64u}, out_m[1], out_v[1]);
  if (!Whole) {
    const std::uint32_t keep0 = byte_mask(mask0), keep1 = byte_mask(mask1);
    out_m[0] &= keep0;
    out_v[0] &= keep0;
    out_m[1] &= keep1;
    out_v[1] &= keep1;
  }
  auto* wm = reinterpret_cast<std::uint32_t*>(p.q_m);
  auto* wv = reinterpret_cast<std::uint32_t*>(p.q_v);
  __stcs(wm, out_m[0]);
  __stcs(wm + 32, out_m[1]);
  __stcs(wv, out_v[0]);
  __stcs(wv + 32, out_v[1]);
}

// The warp's blocks of a quantised chunk (blocks warp, warp + 8, ...). With kAsyncCopy the next
// block is staged in shared memory (`stages`: this warp's two) while the current one is computed;
// the kernel has staged the warp's first block in stages[0] already.
// Whole: the chunk lies inside one quantised segment, so every element is a member and one
// parameter set serves all (the common case: no lookups, no masks).
template <Quantization Q, bool Whole, typename Half>
__device__ __forceinline__ void update_quantised_blocks(const LocalBuffers<Half>& L, const AdamW8bitChunk& chunk,
                                                        const ChunkShared& shared, BlockStage* stages,
                                                        std::uint64_t seed, const AdamWElementParams& uniform) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int count = chunk.segment_count;
  const int blocks = chunk.length / static_cast<int>(kQuantBlock);
  constexpr std::int64_t kStride = kUpdateWarps * kQuantBlock;  // elements from a warp's block to its next
  int cursor0 = 0, cursor1 = 0;
  const AdamWElementParams whole_params = element_params(uniform, shared.params[0]);
  int stage = 0;
  std::int64_t local = chunk.offset - L.owned_begin + warp * kQuantBlock;  // the warp's block
  // `left`: the warp's blocks from this one on (blocks warp, warp + 8, ... below `blocks`).
  for (int left = (blocks - warp + kUpdateWarps - 1) / kUpdateWarps; left > 0; --left, local += kStride) {
    // Member masks and segment parameters of the lane's groups (cursors move forward).
    unsigned mask0 = 0xFu, mask1 = 0xFu;
    AdamWElementParams e0 = whole_params, e1 = whole_params;
    if (!Whole) {
      const std::int64_t i0 = local + L.owned_begin + 4 * lane;
      mask0 = member_mask(i0, cursor0, shared.seg_begin, shared.seg_end, count);
      mask1 = member_mask(i0 + 128, cursor1, shared.seg_begin, shared.seg_end, count);
      e0 = element_params(uniform, shared.params[cursor0 < count ? cursor0 : count - 1]);
      e1 = element_params(uniform, shared.params[cursor1 < count ? cursor1 : count - 1]);
    }
    // The key of the draws: seed ^ j with j = (global index of the lane's first element) / 2
    // = block start / 2 + 2l, where block start / 2 is a multiple of 128 (so + 2l is ^ 2l).
    const std::uint64_t key =
        seed ^ (static_cast<std::uint64_t>(local + L.owned_begin) >> 1) ^ static_cast<std::uint64_t>(2 * lane);
    if (kAsyncCopy) {
      if (left > 1) {
        __syncwarp();  // every lane has read the stage it is about to refill (the previous block's)
        stage_block(stages[stage ^ 1], lane_pointers(L, local + kStride));
        __pipeline_wait_prior(1);  // all but the copies just started: the current block is in
      } else {
        __pipeline_wait_prior(0);
      }
      __syncwarp();  // the scales were copied by lanes 0 and 1
      update_block<Q, Whole>(L, local, key, StagedBlock{&stages[stage], lane}, mask0, mask1, e0, e1, shared);
      stage ^= 1;
    } else {
      update_block<Q, Whole>(L, local, key, load_block(lane_pointers(L, local), mask0, mask1), mask0, mask1, e0, e1,
                             shared);
    }
  }
}

template <Quantization Q, typename Half>
__device__ __forceinline__ void update_quantised_chunk(const LocalBuffers<Half>& L, const AdamW8bitChunk& chunk,
                                                       const ChunkShared& shared, BlockStage* stages, bool skip,
                                                       std::uint64_t seed, const AdamWElementParams& uniform) {
  if (skip) {
    const int lane = threadIdx.x & 31;
    const int count = chunk.segment_count;
    const int blocks = chunk.length / static_cast<int>(kQuantBlock);
    int cursor0 = 0, cursor1 = 0;
    for (int blk = threadIdx.x >> 5; blk < blocks; blk += kUpdateWarps) {
      const std::int64_t i0 = chunk.offset + static_cast<std::int64_t>(blk) * kQuantBlock + 4 * lane;
      const unsigned mask0 = member_mask(i0, cursor0, shared.seg_begin, shared.seg_end, count);
      const unsigned mask1 = member_mask(i0 + 128, cursor1, shared.seg_begin, shared.seg_end, count);
      float* g = L.grad + (i0 - L.owned_begin);
      store4(g, make_float4(0.f, 0.f, 0.f, 0.f), mask0);
      store4(g + 128, make_float4(0.f, 0.f, 0.f, 0.f), mask1);
    }
    if (kAsyncCopy) __pipeline_wait_prior(0);  // the first block's copies (unused) must land first
    return;
  }
  const bool whole = chunk.segment_count == 1 && shared.seg_begin[0] <= chunk.offset &&
                     shared.seg_end[0] >= chunk.offset + chunk.length;
  if (whole) {
    update_quantised_blocks<Q, true>(L, chunk, shared, stages, seed, uniform);
  } else {
    update_quantised_blocks<Q, false>(L, chunk, shared, stages, seed, uniform);
  }
}

template <typename Half>
__device__ __forceinline__ void update_fp32_chunk(const AdamW8bitBuffers& b, Half* mirror, const AdamW8bitChunk& chunk,
                                                  const AdamWElementParams& e, bool skip) {
  float* g = b.grad + chunk.offset;
  if (skip) {
    zero_gradients(g, chunk.length, kUpdateThreads);
    return;
  }
  adamw_update_span<false>(b.master + (chunk.offset - b.owned_begin), b.small_m + chunk.state_offset,
                           b.small_v + chunk.state_offset, g, mirror + chunk.offset, chunk.length, e, kUpdateThreads);
}

// `uniform`: the fields of AdamWElementParams that are the same for every segment and step
// (betas, eps), rounded on the host; the others are formed per chunk from StepScalars.
template <Quantization Q, typename Half>
__global__ void __launch_bounds__(kUpdateThreads, kMinBlocksPerSm)
    adamw8bit_update_kernel(AdamW8bitBuffers b, const AdamW8bitChunk* __restrict__ chunks, std::int64_t num_chunks,
                            const Segment* __restrict__ segments, const Segment* __restrict__ quantised_segments,
                            StepScalars* __restrict__ scalars, AdamWStepParams params, AdamWElementParams uniform,
                            LocalBuffers<Half> L) {
  __shared__ ChunkShared shared;
  __shared__ BlockStage stages[kAsyncCopy ? 2 * kUpdateWarps : 1];  // two per warp
  __shared__ std::uint64_t shared_seed;
  const bool has_chunk = blockIdx.x < num_chunks;
  const bool skip = skips_step(params.policy, scalars->nonfinite);
  if (has_chunk) {
    const AdamW8bitChunk chunk = chunks[blockIdx.x];  // every thread reads it (one broadcast load)
    const int warp = threadIdx.x >> 5;
    // The warp's first block is on its way while the prologue below runs.
    if (kAsyncCopy && chunk.kind == ChunkKind::quantised && warp * static_cast<int>(kQuantBlock) < chunk.length) {
      stage_block(stages[2 * warp], lane_pointers(L, chunk.offset - L.owned_begin + warp * kQuantBlock));
    }
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
      const AdamWElementParams e = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
      shared.params[threadIdx.x] = {e.clip, e.step_size, e.decay_factor, e.inv_bc2_sqrt, e.bc2_sqrt};
      shared.seg_begin[threadIdx.x] = seg.offset;
      shared.seg_end[threadIdx.x] = seg.offset + seg.length;
      if (threadIdx.x == 0) shared_seed = rounding_seed(t);
    }
    __syncthreads();
    Half* mirror = static_cast<Half*>(b.mirror);
    if (chunk.kind == ChunkKind::fp32) {
      update_fp32_chunk(b, mirror, chunk, element_params(uniform, shared.params[0]), skip);
    } else {
      update_quantised_chunk<Q>(L, chunk, shared, stages + 2 * (threadIdx.x >> 5), skip, shared_seed, uniform);
    }
  }

  finish_update(scalars, skip);
}

template <Quantization Q>
void launch_for_code(const AdamW8bitBuffers& b, const AdamW8bitChunk* chunks, std::int64_t num_chunks,
                     const Segment* segments, const Segment* quantised_segments, StepScalars* scalars,
                     const AdamWStepParams& params, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>(num_chunks > 0 ? num_chunks : 1);
  // The step-independent fields (betas, eps): the same roundings as adamw_element_params's.
  const AdamWElementParams uniform = adamw_element_params(params, 1.0f, 1, 1.0f, 1.0f);
  auto local = [&](auto* mirror) {
    return LocalBuffers<std::remove_pointer_t<decltype(mirror)>>{
        {b.master, b.grad + b.owned_begin, mirror + b.owned_begin, b.q_m, b.q_v, b.scale_m, b.scale_v}, b.owned_begin};
  };
  if (b.mirror_dtype == core::DType::bf16) {
    adamw8bit_update_kernel<Q, __nv_bfloat16>
        <<<blocks, kUpdateThreads, 0, stream>>>(b, chunks, num_chunks, segments, quantised_segments, scalars, params,
                                                uniform, local(static_cast<__nv_bfloat16*>(b.mirror)));
  } else {
    adamw8bit_update_kernel<Q, __half>
        <<<blocks, kUpdateThreads, 0, stream>>>(b, chunks, num_chunks, segments, quantised_segments, scalars, params,
                                                uniform, local(static_cast<__half*>(b.mirror)));
  }
  CUDA_CHECK_LAUNCH("adamw8bit_update_kernel");
}

// Test hooks (declared in adamw8bit.h, namespace self_check).
__global__ void sqrt_mismatch_kernel(unsigned long long* mismatches) {
  unsigned long long local = 0;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t b = 0x0D000000u + blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       b <= 0x7F7FFFFFu; b += stride) {
    const float x = __uint_as_float(static_cast<unsigned>(b));
    local += __float_as_uint(sqrt_rn_in_range(x)) != __float_as_uint(fp::sqrt(x)) ? 1u : 0u;
  }
  if (local != 0) atomicAdd(mismatches, local);
}

__global__ void companded_codes_kernel(const float* m, const float* v, const float* scale_m, const float* scale_v,
                                       const std::uint32_t* draws, std::int64_t groups, std::uint32_t* code_m,
                                       std::uint32_t* code_v) {
  using Codec = MomentCodec<Quantization::companded>;
  const std::int64_t g = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  float mg[4], vg[4];
  for (int k = 0; k < 4; ++k) {
    mg[k] = m[4 * g + k];
    vg[k] = v[4 * g + k];
  }
  const std::uint32_t* d = draws + 4 * g;
  auto bits = [d](int p) {
    return static_cast<std::uint64_t>(d[2 * p]) | static_cast<std::uint64_t>(d[2 * p + 1]) << 32;
  };
  std::uint32_t out_m = 0, out_v = 0;
  encode_group<Quantization::companded>(mg, vg, Codec::code_scale_m(scale_m[g]), Codec::code_scale_v(scale_v[g]), bits,
                                        out_m, out_v);
  code_m[g] = out_m;
  code_v[g] = out_v;
}

}  // namespace

namespace self_check {

std::uint64_t adamw8bit_sqrt_mismatches() {
  unsigned long long* counter = nullptr;
  CUDA_CHECK(cudaMalloc(&counter, sizeof(*counter)));
  CUDA_CHECK(cudaMemset(counter, 0, sizeof(*counter)));
  sqrt_mismatch_kernel<<<4096, 256>>>(counter);
  CUDA_CHECK_LAUNCH("sqrt_mismatch_kernel");
  unsigned long long result = 0;
  CUDA_CHECK(cudaMemcpy(&result, counter, sizeof(result), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(counter));
  return result;
}

void adamw8bit_companded_codes(const std::vector<float>& m, const std::vector<float>& v,
                               const std::vector<float>& scale_m, const std::vector<float>& scale_v,
                               const std::vector<std::uint32_t>& draws, std::vector<std::uint8_t>& code_m,
                               std::vector<std::uint8_t>& code_v) {
  const std::size_t n = m.size();
  const std::size_t groups = n / 4;
  if (n % 4 != 0 || v.size() != n || draws.size() != n || scale_m.size() != groups || scale_v.size() != groups) {
    throw core::Error("adamw8bit_companded_codes: inconsistent sizes");
  }
  auto upload = [](const auto& host) {
    void* device = nullptr;
    const std::size_t bytes = host.size() * sizeof(host[0]);
    CUDA_CHECK(cudaMalloc(&device, bytes > 0 ? bytes : 1));
    if (bytes > 0) CUDA_CHECK(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice));
    return device;
  };
  void* dm = upload(m);
  void* dv = upload(v);
  void* dsm = upload(scale_m);
  void* dsv = upload(scale_v);
  void* dd = upload(draws);
  std::vector<std::uint32_t> words_m(groups), words_v(groups);
  void* dcm = upload(words_m);
  void* dcv = upload(words_v);
  const auto blocks = static_cast<unsigned>((groups + 255) / 256);
  if (blocks > 0) {
    companded_codes_kernel<<<blocks, 256>>>(static_cast<const float*>(dm), static_cast<const float*>(dv),
                                            static_cast<const float*>(dsm), static_cast<const float*>(dsv),
                                            static_cast<const std::uint32_t*>(dd), static_cast<std::int64_t>(groups),
                                            static_cast<std::uint32_t*>(dcm), static_cast<std::uint32_t*>(dcv));
    CUDA_CHECK_LAUNCH("companded_codes_kernel");
    CUDA_CHECK(cudaMemcpy(words_m.data(), dcm, groups * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(words_v.data(), dcv, groups * 4, cudaMemcpyDeviceToHost));
  }
  for (void* p : {dm, dv, dsm, dsv, dd, dcm, dcv}) CUDA_CHECK(cudaFree(p));
  code_m.resize(n);
  code_v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    code_m[i] = static_cast<std::uint8_t>(words_m[i / 4] >> (8 * (i % 4)));
    code_v[i] = static_cast<std::uint8_t>(words_v[i / 4] >> (8 * (i % 4)));
  }
}

}  // namespace self_check

void launch_adamw8bit_update(const AdamW8bitBuffers& buffers, const AdamW8bitChunk* chunks, std::int64_t num_chunks,
                             const Segment* segments, const Segment* quantised_segments, StepScalars* scalars,
                             const AdamWStepParams& params, Quantization quantization, cudaStream_t stream) {
  if (quantization == Quantization::companded) {
    launch_for_code<Quantization::companded>(buffers, chunks, num_chunks, segments, quantised_segments, scalars, params,
                                             stream);
  } else {
    launch_for_code<Quantization::linear>(buffers, chunks, num_chunks, segments, quantised_segments, scalars, params,
                                          stream);
  }
}

}  // namespace optim
