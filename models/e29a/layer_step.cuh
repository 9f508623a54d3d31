// The per-sequence arithmetic of one E29a step on the GPU, shared by the hybrid path's phase
// kernels (layer_kernels.cu: one block per sequence) and the persistent forward
// (layer_persistent_kernels.cuh: a block walks its sequences between grid-wide barriers), so both run the
// same operations in the same order. A block's threads stride over the D features; the N slot
// sums are reduced in a fixed order (warp shuffles, then warps in order); softmax and its backward
// run in warp 0 (N <= 64: two slots per lane). The tape update is written with explicit
// round-to-nearest operations so the backward's replay gives the forward's bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

#include "models/e29a/layer_kernels.h"

namespace models::e29a::kernels::step {

// Floats of a block's step scratch: per-warp partials [warps][max_n], sums, attn, ds, one D-vector.
__host__ __device__ constexpr std::size_t shared_floats(int max_n, int threads, int dim) {
  return static_cast<std::size_t>((threads / 32) * max_n + 3 * max_n + dim);
}

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float tape_update(float tape, float attn, float write) {
  return __fadd_rn(__fmul_rn(__fsub_rn(1.0f, attn), tape), __fmul_rn(attn, write));
}

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// Shared memory of a phase kernel: per-warp partials [warps][MaxN], then the slot vectors.
template <int MaxN>
struct Shared {
  float* warp_part;
  float* sums;  // [MaxN] block sums
  float* attn;  // [MaxN]
  float* ds;    // [MaxN] score gradients
  float* vec;   // [dim]

  __device__ explicit Shared(float* base) {
    const int warps = blockDim.x / 32;
    warp_part = base;
    sums = warp_part + warps * MaxN;
    attn = sums + MaxN;
    ds = attn + MaxN;
    vec = ds + MaxN;
  }
};

// sums[n] = sum over the block's threads of part[n]: each warp by a shuffle tree (lane 0's value),
// then the warps in order by thread n. Ends with a barrier; sums[] is then visible to all.
template <int MaxN>
__device__ __forceinline__ void block_slot_sums(float (&part)[MaxN], const Shared<MaxN>& sh, int slots) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int n = 0; n < MaxN; ++n) {
    if (n < slots) {
      float v = part[n];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
      if (lane == 0) sh.warp_part[warp * MaxN + n] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x < slots) {
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += sh.warp_part[w * MaxN + threadIdx.x];
    sh.sums[threadIdx.x] = s;
  }
  __syncthreads();
}

// The first lane distance of a warp reduction over MaxN slots' lanes: lanes from MaxN on hold the
// reduction's identity (-inf, 0), so steps across them change nothing and are left out (the same
// bits in lanes below MaxN).
template <int MaxN>
constexpr int first_distance() {
  return MaxN >= 32 ? 16 : MaxN / 2;
}

// Lane n's softmax weights of slots n and n + 32 (0 past `slots`) of scale * sums, lane n's sums
// given; the normaliser is lane 0's sum, broadcast. Any warp: warps given the same sums return the
// same bits.
struct LaneWeights {
  float w0, w1;
};
template <int MaxN>
__device__ __forceinline__ LaneWeights softmax_lane(float sum0, float sum1, float scale, int slots) {
  const int lane = threadIdx.x & 31;
  const bool has0 = lane<slots, has1 = MaxN> 32 && lane + 32 < slots;
  const float s0 = has0 ? scale * sum0 : -INFINITY;
  const float s1 = has1 ? scale * sum1 : -INFINITY;
  float m = fmaxf(s0, s1);
#pragma unroll
  for (int offset = first_distance<MaxN>(); offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, offset));
  const float e0 = has0 ? expf(s0 - m) : 0.0f, e1 = has1 ? expf(s1 - m) : 0.0f;
  float total = e0 + e1;
#pragma unroll
  for (int offset = first_distance<MaxN>(); offset > 0; offset >>= 1) {
    total += __shfl_xor_sync(kFull, total, offset);
  }
  total = __shfl_sync(kFull, total, 0);
  return {has0 ? e0 / total : 0.0f, has1 ? e1 / total : 0.0f};
}

// Warp 0: attn = softmax(scale * sums) with lane n's sums of slots n and n + 32 given.
template <int MaxN>
__device__ __forceinline__ void softmax_warp_of(float sum0, float sum1, const Shared<MaxN>& sh, float scale,
                                                int slots) {
  const int lane = threadIdx.x;
  const LaneWeights w = softmax_lane<MaxN>(sum0, sum1, scale, slots);
  if (lane < slots) sh.attn[lane] = w.w0;
  if (MaxN > 32 && lane + 32 < slots) sh.attn[lane + 32] = w.w1;
}

// Warp 0: attn = softmax(scale * sums), the sums from shared memory.
template <int MaxN>
__device__ __forceinline__ void softmax_warp(const Shared<MaxN>& sh, float scale, int slots) {
  const int lane = threadIdx.x;
  softmax_warp_of<MaxN>(sh.sums[min(lane, MaxN - 1)], MaxN > 32 ? sh.sums[min(lane + 32, MaxN - 1)] : 0.0f, sh, scale,
                        slots);
}

// Warp 0: ds = attn * ((g - g[0]) - sum_m attn[m] (g[m] - g[0])) with g = sums (the gradient of the
// attention weights); exactly zero when every g is equal, and zero when the scores are detached.
template <int MaxN>
__device__ __forceinline__ void softmax_backward_warp(const Shared<MaxN>& sh, int slots, bool detach) {
  const int lane = threadIdx.x;
  const bool has0 = lane<slots, has1 = MaxN> 32 && lane + 32 < slots;
  const float g_first = sh.sums[0];
  const float g0 = has0 ? sh.sums[lane] - g_first : 0.0f, g1 = has1 ? sh.sums[lane + 32] - g_first : 0.0f;
  const float a0 = has0 ? sh.attn[lane] : 0.0f, a1 = has1 ? sh.attn[lane + 32] : 0.0f;
  float mean = a0 * g0 + a1 * g1;
#pragma unroll
  for (int offset = first_distance<MaxN>(); offset > 0; offset >>= 1) mean += __shfl_xor_sync(kFull, mean, offset);
  mean = __shfl_sync(kFull, mean, 0);
  if (has0) sh.ds[lane] = detach ? 0.0f : a0 * (g0 - mean);
  if (has1) sh.ds[lane + 32] = detach ? 0.0f : a1 * (g1 - mean);
}

// part[n] += H[n] . v over the thread's features d = tid, tid + blockDim, ... (H [N, D] and v [D]
// in global or shared memory, through generic pointers).
template <int MaxN>
__device__ __forceinline__ void score_partials(const float* H, const float* v, int D, int N, float (&part)[MaxN]) {
#pragma unroll 4
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float vd = v[d];
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) part[n] = fmaf(H[n * D + d], vd, part[n]);
    }
  }
}

// An attention over the slots from every thread's score partials: the block's sums, softmax of
// scale times them into sh.attn (visible to all threads on return), and thread n < N stores
// weight n to out[n].
template <int MaxN>
__device__ __forceinline__ void slot_attention(float (&part)[MaxN], const Shared<MaxN>& sh, float scale, int N,
                                               float* out) {
  block_slot_sums<MaxN>(part, sh, N);
  if (threadIdx.x < 32) softmax_warp<MaxN>(sh, scale, N);
  __syncthreads();
  if (threadIdx.x < N) out[threadIdx.x] = sh.attn[threadIdx.x];
}

// Step t of sequence b (the block's threads): the read attention over H_{t-1} with h_{t-1}, r_t and
// h_t = tanh(x_t + W_h h_{t-1} + r_t + b_h). H: the sequence's tape [N, D] (global or shared
// memory; a.tape is not read).
template <int MaxN>
__device__ __forceinline__ void read_sequence(const ReadStepArgs& a, std::int64_t b, const Shared<MaxN>& sh,
                                              const float* H) {
  const int D = a.dim, N = a.slots;
  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  score_partials<MaxN>(H, a.h_prev + b * D, D, N, part);
  slot_attention<MaxN>(part, sh, a.scale, N, a.read_attn + b * N);

  const float* x = a.x + b * a.x_stride;
  const float* rec = a.recurrent + b * D;
#pragma unroll 4
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float r = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) r = fmaf(sh.attn[n], H[n * D + d], r);
    }
    const float pre = ((x[d] + rec[d]) + r) + __bfloat162float(a.bias[d]);
    const float h = tanhf(pre);
    a.h[b * D + d] = h;
    a.h_bf16[b * D + d] = __float2bfloat16_rn(h);
    a.read[b * D + d] = r;
  }
}

// Step t of sequence b: the write attention over H_{t-1} with w_t, H_t (H_{t-1} to the checkpoint
// first when asked) and y_t = h_t * silu(z_t + r_t + h_t). H: the sequence's tape, updated in place.
template <int MaxN>
__device__ __forceinline__ void write_sequence(const WriteStepArgs& a, std::int64_t b, const Shared<MaxN>& sh,
                                               float* H) {
  const int D = a.dim, N = a.slots;
  const float* w = a.write + b * D;

  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  score_partials<MaxN>(H, w, D, N, part);
  slot_attention<MaxN>(part, sh, a.scale, N, a.write_attn + b * N);

  float* checkpoint = a.checkpoint ? a.checkpoint + b * N * D : nullptr;
  const float* z = a.z + b * a.z_stride;
  __nv_bfloat16* y = a.y + b * a.y_stride;
#pragma unroll 4
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float v = w[d];
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const float old = H[n * D + d];
        if (checkpoint) checkpoint[n * D + d] = old;
        H[n * D + d] = tape_update(old, sh.attn[n], v);
      }
    }
    const float h = a.h[b * D + d];
    const float g = (z[d] + a.read[b * D + d]) + h;
    y[d] = __float2bfloat16_rn(h * (g * sigmoidf(g)));
  }
}

}  // namespace models::e29a::kernels::step
