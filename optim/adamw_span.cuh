// The AdamW update of one contiguous fp32 span by a block's threads: 16-byte groups of four, then
// the tail one element at a time. AdamW runs it on every chunk and adamw8bit on its fp32 chunks
// (the tensors too small to quantise), so the loop is written once for both.
#pragma once

#include "optim/adamw_math.h"
#include "optim/update_epilogue.cuh"

namespace optim {

// w, m, v: the span's weights and moments; g: its gradients; out: its mirror; n elements, every
// pointer 16-byte aligned. kStreamMoments: the moments are read once (AdamW's whole-slab state),
// so their loads and stores are marked evict-first too.
template <bool kStreamMoments, typename Half>
__device__ __forceinline__ void adamw_update_span(float* w, float* m, float* v, float* g, Half* out, int n,
                                                  const AdamWElementParams& e, int threads) {
  const int vectors = n >> 2;
  float4* w4 = reinterpret_cast<float4*>(w);
  float4* m4 = reinterpret_cast<float4*>(m);
  float4* v4 = reinterpret_cast<float4*>(v);
  float4* g4 = reinterpret_cast<float4*>(g);
  for (int i = threadIdx.x; i < vectors; i += threads) {
    const float4 gi = __ldcs(g4 + i);
    float4 wi = __ldcs(w4 + i);
    float4 mi = kStreamMoments ? __ldcs(m4 + i) : m4[i];
    float4 vi = kStreamMoments ? __ldcs(v4 + i) : v4[i];
    adamw_element(wi.x, mi.x, vi.x, gi.x, e);
    adamw_element(wi.y, mi.y, vi.y, gi.y, e);
    adamw_element(wi.z, mi.z, vi.z, gi.z, e);
    adamw_element(wi.w, mi.w, vi.w, gi.w, e);
    if constexpr (kStreamMoments) {
      __stcs(m4 + i, mi);
      __stcs(v4 + i, vi);
    } else {
      m4[i] = mi;
      v4[i] = vi;
    }
    write_back4(w4 + i, g4 + i, out + 4 * i, wi);
  }
  for (int i = (vectors << 2) + threadIdx.x; i < n; i += threads) {
    float wi = w[i];
    adamw_element(wi, m[i], v[i], g[i], e);
    write_back(w + i, g + i, out + i, wi);
  }
}

}  // namespace optim
