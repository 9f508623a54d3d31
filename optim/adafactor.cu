// CUDA kernels of the fused Adafactor step (adafactor.h lists the passes). One block per work
// item; tiles of factored tensors loop columns across threads and rows inside a thread, so
// every warp access is coalesced and each element's row and column are known.
// Gradients are indexed by global element (Slab::grad_origin()). A tile's first row may start
// before the owned range (a segment cut mid-row), so its base pointers can lie outside the
// buffers; only elements inside the segment are ever read or written (in_segment), which lets
// the gradient buffer cover the owned shard only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.h"
#include "optim/adafactor.h"
#include "core/block_reduce.cuh"
#include "optim/update_epilogue.cuh"

namespace optim {

using core::block_sum;
using core::warp_sum;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBatch = 8;   // rows of a tile whose loads are issued together (scalar path)
constexpr int kRowBatch4 = 4;  // the same for the float4 path

struct StepState {
  float clip;
  long long t;
  bool skip;
};

__device__ StepState read_step_state(const StepScalars* scalars, const AdafactorStepParams& p) {
  return {clip_coefficient(scalars->grad_sq_sum, p.max_norm), scalars->step + 1,
          skips_step(p.policy, scalars->nonfinite)};
}

__device__ __forceinline__ bool in_segment(const Segment& s, std::int64_t e) {
  return e >= s.offset && e < s.offset + s.length;
}

// ---- phase 1 -----------------------------------------------------------------------------

// Tiles whose rows are whole float4 groups (cols % 4 == 0; tensors start at multiples of 64,
// and shard cuts at multiples of 256, so a group lies wholly inside or outside the segment).
__device__ __forceinline__ bool vector_tile(const Segment& seg) { return (seg.cols & 3) == 0; }

// Square of an unclipped gradient element for the statistics; non-finite counts as 0 and is counted.
__device__ __forceinline__ float squared_grad(float g, unsigned int& nonfinite, double& grad_sq) {
  if (!isfinite(g)) {
    ++nonfinite;
    return 0.0f;
  }
  const float g2 = fp::mul(g, g);
  grad_sq += g2;
  return g2;
}

// The float4 groups at column group c of tile rows r0 .. r0 + kRowBatch4 - 1, every load issued
// before any is used (many in flight): ok[k] whether row r0 + k's group lies in the item (and
// `in_columns`) and in its segment; g its gradients (streaming loads), w its weights when
// `with_weights` (kStreamWeights: streaming too, the update's last read of them); zeros elsewhere.
template <bool kStreamWeights>
__device__ __forceinline__ void load_row_batch(const AdafactorItem& item, const Segment& seg, const float4* g4,
                                               const float4* w4, std::int64_t cols4, std::int64_t c, int r0,
                                               bool in_columns, bool with_weights, float4 (&g)[kRowBatch4],
                                               float4 (&w)[kRowBatch4], bool (&ok)[kRowBatch4]) {
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kRowBatch4; ++k) {
    const std::int64_t i4 = (r0 + k) * cols4 + c;
    ok[k] = in_columns && r0 + k < item.count && in_segment(seg, item.first + 4 * i4);
    g[k] = ok[k] ? __ldcs(g4 + i4) : zero4;
    w[k] = ok[k] && with_weights ? (kStreamWeights ? __ldcs(w4 + i4) : w4[i4]) : zero4;
  }
}

__global__ void __launch_bounds__(kThreads) statistics_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ float row_part[kWarps][kAdafactorTileRows];  // per-warp row sums, lane 0 writes
  __shared__ double scratch[kWarps];
  __shared__ unsigned long long count_scratch[kWarps];
  const AdafactorItem item = v.items[blockIdx.x];
  const Segment seg = v.segments[item.segment];
  const AdafactorSegment info = v.info[item.segment];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double weight_sq = 0, grad_sq = 0;
  unsigned int nonfinite = 0;

  if (item.kind == kTileItem) {
    for (int i = threadIdx.x; i < kWarps * kAdafactorTileRows; i += kThreads) (&row_part[0][0])[i] = 0.0f;
    __syncthreads();
    if (vector_tile(seg)) {
      const std::int64_t cols4 = seg.cols / 4;
      const float4* g4 = reinterpret_cast<const float4*>(v.grad + item.first);
      const float4* w4 = reinterpret_cast<const float4*>(v.master + (item.first - v.owned_begin));
      for (std::int64_t base = 0; base < cols4; base += kThreads) {  // uniform trip count: shuffles below
        const std::int64_t c = base + threadIdx.x;
        double col0 = 0, col1 = 0, col2 = 0, col3 = 0;
        for (int r0 = 0; r0 < item.count; r0 += kRowBatch4) {
          float4 g[kRowBatch4], w[kRowBatch4];
          bool ok[kRowBatch4];
          load_row_batch<false>(item, seg, g4, w4, cols4, c, r0, c < cols4, p.scale_parameter, g, w, ok);
#pragma unroll
          for (int k = 0; k < kRowBatch4; ++k) {
            const float a = squared_grad(g[k].x, nonfinite, grad_sq);
            const float b = squared_grad(g[k].y, nonfinite, grad_sq);
            const float cc = squared_grad(g[k].z, nonfinite, grad_sq);
            const float d = squared_grad(g[k].w, nonfinite, grad_sq);
            col0 += a;
            col1 += b;
            col2 += cc;
            col3 += d;
            weight_sq = fma(static_cast<double>(w[k].x), static_cast<double>(w[k].x), weight_sq);
            weight_sq = fma(static_cast<double>(w[k].y), static_cast<double>(w[k].y), weight_sq);
            weight_sq = fma(static_cast<double>(w[k].z), static_cast<double>(w[k].z), weight_sq);
            weight_sq = fma(static_cast<double>(w[k].w), static_cast<double>(w[k].w), weight_sq);
            const float row = warp_sum((a + b) + (cc + d));
            if (lane == 0 && r0 + k < item.count) row_part[warp][r0 + k] += row;
          }
        }
        if (c < cols4) {
          float* out = v.col_partials + item.col_partials + 4 * c;
          out[0] = static_cast<float>(col0);
          out[1] = static_cast<float>(col1);
          out[2] = static_cast<float>(col2);
          out[3] = static_cast<float>(col3);
        }
      }
    } else {
      const std::int64_t cols = seg.cols;
      float row_acc[kAdafactorTileRows];
#pragma unroll
      for (int r = 0; r < kAdafactorTileRows; ++r) row_acc[r] = 0.0f;
      for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
        double col = 0;
#pragma unroll
        for (int r = 0; r < kAdafactorTileRows; ++r) {
          if (r < item.count) {
            const std::int64_t e = item.first + r * cols + c;
            if (in_segment(seg, e)) {
              const float g2 = squared_grad(v.grad[e], nonfinite, grad_sq);
              row_acc[r] += g2;
              col += g2;
              if (p.scale_parameter) {
                const double w = v.master[e - v.owned_begin];
                weight_sq = fma(w, w, weight_sq);
              }
            }
          }
        }
        v.col_partials[item.col_partials + c] = static_cast<float>(col);
      }
#pragma unroll
      for (int r = 0; r < kAdafactorTileRows; ++r) {
        const float s = warp_sum(row_acc[r]);
        if (lane == 0) row_part[warp][r] = s;
      }
    }
    __syncthreads();
    if (threadIdx.x < item.count) {
      double total = 0;
      for (int w = 0; w < kWarps; ++w) total += row_part[w][threadIdx.x];
      v.stats[info.row_stats + item.row0 + threadIdx.x] = total;
    }
  } else {
    for (std::int64_t e = item.first + threadIdx.x; e < item.first + item.count; e += kThreads) {
      squared_grad(v.grad[e], nonfinite, grad_sq);
      if (p.scale_parameter) {
        const double w = v.master[e - v.owned_begin];
        weight_sq = fma(w, w, weight_sq);
      }
    }
  }
  weight_sq = block_sum(weight_sq, scratch);
  grad_sq = block_sum(grad_sq, scratch);
  const unsigned long long count = block_sum(static_cast<unsigned long long>(nonfinite), count_scratch);
  if (threadIdx.x == 0) {
    v.item_partials[blockIdx.x] = weight_sq;
    v.grad_partials[blockIdx.x] = grad_sq;
    v.nonfinite_partials[blockIdx.x] = count;
  }
}

// Column sums and per-tensor sums from per-item partials (phases 1 and 2).
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(AdafactorDeviceView v, const AdafactorReduceItem* reduce, double* out_u) {
  __shared__ double scratch[kWarps];
  const AdafactorReduceItem r = reduce[blockIdx.x];
  if (r.kind == kReduceGrad) {  // the step's gradient statistics, from every item in order
    __shared__ unsigned long long count_scratch[kWarps];
    double sum = 0;
    unsigned long long count = 0;
    for (std::int64_t k = threadIdx.x; k < v.item_count; k += kThreads) {
      sum += v.grad_partials[k];
      count += v.nonfinite_partials[k];
    }
    sum = block_sum(sum, scratch);
    count = block_sum(count, count_scratch);
    if (threadIdx.x == 0) {
      v.scalars->grad_sq_sum = sum;
      v.scalars->nonfinite = count;
    }
    return;
  }
  const AdafactorSegment info = v.info[r.segment];
  if (r.kind == kReduceColumns) {
    // Lane = column, warp = every kWarps-th tile; the warps' sums are then added in warp order.
    __shared__ double warp_sums[kWarps][kAdafactorReduceColumns];
    const Segment seg = v.segments[r.segment];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const std::int64_t c = r.col0 + lane;
    double sum = 0;
    if (c < seg.cols) {
      const float* p = v.col_partials + info.first_col_partial + c;
#pragma unroll 8
      for (std::int64_t t = warp; t < info.item_count; t += kWarps) sum += p[t * seg.cols];
    }
    warp_sums[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && c < seg.cols) {
      double total = 0;
      for (int w = 0; w < kWarps; ++w) total += warp_sums[w][lane];
      v.stats[info.row_stats + seg.rows + c] = total;
    }
    return;
  }
  double sum = 0;
  for (std::int64_t k = threadIdx.x; k < info.item_count; k += kThreads) sum += v.item_partials[info.first_item + k];
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    if (r.kind == kReduceWeights) {
      v.stats[info.weight_stats] = sum;
    } else {
      out_u[info.u_stats] = sum;
    }
  }
}

// ---- phase 2 -----------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) ema_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ double scratch[kWarps];
  const StepState st = read_step_state(v.scalars, p);
  if (st.skip) return;
  const AdafactorEmaItem item = v.ema_items[blockIdx.x];
  const Segment seg = v.segments[item.segment];
  const AdafactorSegment info = v.info[item.segment];
  const double beta2 = adafactor_beta2(p, st.t);
  float* state = v.row_col_state + info.row_state + (item.rows ? 0 : seg.rows) + item.begin;
  const double* sums = v.stats + info.row_stats + (item.rows ? 0 : seg.rows) + item.begin;
  const double count = item.rows ? seg.cols : seg.rows;
  const double clip_sq =
      static_cast<double>(st.clip) * static_cast<double>(st.clip);  // statistics are of the unclipped g
  double total = 0;
  for (int i = threadIdx.x; i < item.count; i += kThreads) {
    const float x = adafactor_ema(p, beta2, state[i], clip_sq * sums[i] / count);
    state[i] = x;
    total += x;
  }
  total = block_sum(total, scratch);
  if (threadIdx.x == 0 && item.rows) v.row_partials[item.row_partial] = total;
}

// mean(R) of a factored segment from the EMA items' partial sums; call from a whole warp.
__device__ double warp_row_mean(const AdafactorDeviceView& v, const AdafactorSegment& info, const Segment& seg) {
  if (!info.factored || seg.rows == 0) return 0.0;
  double total = 0;
  for (std::int64_t k = threadIdx.x & 31; k < info.row_partial_count; k += 32) {
    total += v.row_partials[info.first_row_partial + k];
  }
  return warp_sum(total) / static_cast<double>(seg.rows);
}

// The block's element constants, computed by warp 0 into shared memory.
__device__ void block_element_params(const AdafactorDeviceView& v, const AdafactorStepParams& p, const StepState& st,
                                     const Segment& seg, const AdafactorSegment& info, double u_sq_sum,
                                     AdafactorElementParams* out) {
  if (threadIdx.x < 32) {
    const double mean = warp_row_mean(v, info, seg);
    if (threadIdx.x == 0) {
      *out = adafactor_element_params(p, st.t, st.clip, p.lr * seg.lr_scale, seg.decay, v.stats[info.weight_stats],
                                      u_sq_sum, info.numel, mean);
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) u_statistics_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ double scratch[kWarps];
  __shared__ AdafactorElementParams shared_e;
  const StepState st = read_step_state(v.scalars, p);
  if (st.skip) return;
  const AdafactorItem item = v.items[blockIdx.x];
  const Segment seg = v.segments[item.segment];
  const AdafactorSegment info = v.info[item.segment];
  block_element_params(v, p, st, seg, info, 0.0, &shared_e);
  const AdafactorElementParams e = shared_e;
  double u_sq = 0;
  if (item.kind == kTileItem && vector_tile(seg)) {
    const float* R = v.row_col_state + info.row_state;
    const float* C = R + seg.rows;  // not 16-byte aligned: read as scalars
    const std::int64_t cols4 = seg.cols / 4;
    const float4* g4 = reinterpret_cast<const float4*>(v.grad + item.first);
    for (std::int64_t c = threadIdx.x; c < cols4; c += kThreads) {
      const float4 col = make_float4(C[4 * c], C[4 * c + 1], C[4 * c + 2], C[4 * c + 3]);
      for (int r0 = 0; r0 < item.count; r0 += kRowBatch4) {
        float4 g[kRowBatch4];
        bool ok[kRowBatch4];
#pragma unroll
        for (int k = 0; k < kRowBatch4; ++k) {
          const std::int64_t i4 = (r0 + k) * cols4 + c;
          ok[k] = r0 + k < item.count && in_segment(seg, item.first + 4 * i4);
          g[k] = ok[k] ? __ldcs(g4 + i4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < kRowBatch4; ++k) {
          if (!ok[k]) continue;
          const float row = R[item.row0 + r0 + k];
          const float u0 = adafactor_u(adafactor_grad(g[k].x, st.clip), adafactor_factored_v(e, row, col.x));
          const float u1 = adafactor_u(adafactor_grad(g[k].y, st.clip), adafactor_factored_v(e, row, col.y));
          const float u2 = adafactor_u(adafactor_grad(g[k].z, st.clip), adafactor_factored_v(e, row, col.z));
          const float u3 = adafactor_u(adafactor_grad(g[k].w, st.clip), adafactor_factored_v(e, row, col.w));
          u_sq = fma(static_cast<double>(u0), static_cast<double>(u0), u_sq);
          u_sq = fma(static_cast<double>(u1), static_cast<double>(u1), u_sq);
          u_sq = fma(static_cast<double>(u2), static_cast<double>(u2), u_sq);
          u_sq = fma(static_cast<double>(u3), static_cast<double>(u3), u_sq);
        }
      }
    }
  } else if (item.kind == kTileItem) {
    const float* R = v.row_col_state + info.row_state;
    const float* C = R + seg.rows;
    const std::int64_t cols = seg.cols;
    for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float col = C[c];
      for (int r0 = 0; r0 < item.count; r0 += kRowBatch) {
        float g[kRowBatch];
        bool ok[kRowBatch];
#pragma unroll
        for (int k = 0; k < kRowBatch; ++k) {  // all loads of the batch first: many in flight
          const std::int64_t el = item.first + (r0 + k) * cols + c;
          ok[k] = r0 + k < item.count && in_segment(seg, el);
          g[k] = ok[k] ? v.grad[el] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kRowBatch; ++k) {
          if (!ok[k]) continue;
          const float u =
              adafactor_u(adafactor_grad(g[k], st.clip), adafactor_factored_v(e, R[item.row0 + r0 + k], col));
          u_sq = fma(static_cast<double>(u), static_cast<double>(u), u_sq);
        }
      }
    }
  } else {
    for (std::int64_t el = item.first + threadIdx.x; el < item.first + item.count; el += kThreads) {
      const float g = adafactor_grad(v.grad[el], st.clip);
      const float u = adafactor_u(g, adafactor_full_v(e, v.v_state[info.v_state + (el - seg.offset)], g));
      u_sq = fma(static_cast<double>(u), static_cast<double>(u), u_sq);
    }
  }
  u_sq = block_sum(u_sq, scratch);
  if (threadIdx.x == 0) v.item_partials[blockIdx.x] = u_sq;
}

// ---- phase 3 -----------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) update_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ AdafactorElementParams shared_e;
  const bool has_item = blockIdx.x < v.item_count;  // a slab without items still counts the step
  const AdafactorItem item = has_item ? v.items[blockIdx.x] : AdafactorItem{};
  const StepState st = read_step_state(v.scalars, p);
  if (has_item && !st.skip) {
    const AdafactorSegment info = v.info[item.segment];
    block_element_params(v, p, st, v.segments[item.segment], info, v.u_stats[info.u_stats], &shared_e);
  }

  if (has_item) {
    const Segment seg = v.segments[item.segment];
    const AdafactorSegment info = v.info[item.segment];
    const AdafactorElementParams e = shared_e;
    const AnyMirror mirror{v.mirror, v.mirror_dtype};
    if (item.kind == kTileItem && vector_tile(seg) && !st.skip) {
      const float* R = v.row_col_state + info.row_state;
      const float* C = R + seg.rows;  // not 16-byte aligned: read as scalars
      const std::int64_t cols4 = seg.cols / 4;
      float4* g4 = reinterpret_cast<float4*>(v.grad + item.first);
      const std::int64_t local0 = item.first - v.owned_begin;
      float4* w4 = reinterpret_cast<float4*>(v.master + local0);
      float4* m4 = e.use_beta1 ? reinterpret_cast<float4*>(v.exp_avg + local0) : nullptr;
      const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
      for (std::int64_t c = threadIdx.x; c < cols4; c += kThreads) {
        const float4 col = make_float4(C[4 * c], C[4 * c + 1], C[4 * c + 2], C[4 * c + 3]);
        for (int r0 = 0; r0 < item.count; r0 += kRowBatch4) {
          float4 g[kRowBatch4], w[kRowBatch4];
          bool ok[kRowBatch4];
          load_row_batch<true>(item, seg, g4, w4, cols4, c, r0, true, true, g, w, ok);
#pragma unroll
          for (int k = 0; k < kRowBatch4; ++k) {
            if (!ok[k]) continue;
            const std::int64_t i4 = (r0 + k) * cols4 + c;
            const float row = R[item.row0 + r0 + k];
            float4 m = m4 ? m4[i4] : zero4;
            adafactor_apply(e, w[k].x, &m.x,
                            adafactor_u(adafactor_grad(g[k].x, st.clip), adafactor_factored_v(e, row, col.x)));
            adafactor_apply(e, w[k].y, &m.y,
                            adafactor_u(adafactor_grad(g[k].y, st.clip), adafactor_factored_v(e, row, col.y)));
            adafactor_apply(e, w[k].z, &m.z,
                            adafactor_u(adafactor_grad(g[k].z, st.clip), adafactor_factored_v(e, row, col.z)));
            adafactor_apply(e, w[k].w, &m.w,
                            adafactor_u(adafactor_grad(g[k].w, st.clip), adafactor_factored_v(e, row, col.w)));
            if (m4) m4[i4] = m;
            write_back4(w4 + i4, g4 + i4, mirror + (item.first + 4 * i4), w[k]);
          }
        }
      }
    } else if (item.kind == kTileItem) {
      const float* R = v.row_col_state + info.row_state;
      const float* C = R + seg.rows;
      const std::int64_t cols = seg.cols;
      for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
        const float col = st.skip ? 0.0f : C[c];
        for (int r0 = 0; r0 < item.count; r0 += kRowBatch) {
          float g[kRowBatch], w[kRowBatch];
          bool ok[kRowBatch];
#pragma unroll
          for (int k = 0; k < kRowBatch; ++k) {  // all loads of the batch first: many in flight
            const std::int64_t el = item.first + (r0 + k) * cols + c;
            ok[k] = r0 + k < item.count && in_segment(seg, el);
            g[k] = ok[k] && !st.skip ? v.grad[el] : 0.0f;
            w[k] = ok[k] && !st.skip ? v.master[el - v.owned_begin] : 0.0f;
          }
#pragma unroll
          for (int k = 0; k < kRowBatch; ++k) {
            if (!ok[k]) continue;
            const std::int64_t el = item.first + (r0 + k) * cols + c;
            if (!st.skip) {
              const std::int64_t local = el - v.owned_begin;
              const float u =
                  adafactor_u(adafactor_grad(g[k], st.clip), adafactor_factored_v(e, R[item.row0 + r0 + k], col));
              adafactor_apply(e, w[k], e.use_beta1 ? v.exp_avg + local : nullptr, u);
              write_back(v.master + local, v.grad + el, mirror + el, w[k]);
            } else {
              v.grad[el] = 0.0f;
            }
          }
        }
      }
    } else {
      for (std::int64_t el = item.first + threadIdx.x; el < item.first + item.count; el += kThreads) {
        if (!st.skip) {
          const std::int64_t local = el - v.owned_begin;
          const float second_moment = adafactor_full_v_read(e, v.v_state[info.v_state + (el - seg.offset)]);
          const float u = adafactor_u(adafactor_grad(v.grad[el], st.clip), second_moment);
          float w = v.master[local];
          adafactor_apply(e, w, e.use_beta1 ? v.exp_avg + local : nullptr, u);
          write_back(v.master + local, v.grad + el, mirror + el, w);
        } else {
          v.grad[el] = 0.0f;
        }
      }
    }
  }

  finish_update(v.scalars, st.skip);
}

// One block per entry of a table of `count` (an item, a reduction, an EMA row); nothing when the
// table is empty.
template <typename... Params, typename... Args>
void launch_per_entry(void (*kernel)(Params...), std::int64_t count, const char* what, cudaStream_t stream,
                      const Args&... args) {
  if (count <= 0) return;
  kernel<<<static_cast<unsigned int>(count), kThreads, 0, stream>>>(args...);
  CUDA_CHECK_LAUNCH(what);
}

}  // namespace

void launch_adafactor_statistics(const AdafactorDeviceView& v, const AdafactorStepParams& p, cudaStream_t stream) {
  launch_per_entry(statistics_kernel, v.item_count, "adafactor statistics_kernel", stream, v, p);
  launch_per_entry(reduce_kernel, v.reduce_stats_count, "adafactor reduce_kernel (statistics)", stream, v,
                   v.reduce_stats, v.u_stats);
}

void launch_adafactor_second_moments(const AdafactorDeviceView& v, const AdafactorStepParams& p, cudaStream_t stream) {
  launch_per_entry(ema_kernel, v.ema_count, "adafactor ema_kernel", stream, v, p);
  launch_per_entry(u_statistics_kernel, v.item_count, "adafactor u_statistics_kernel", stream, v, p);
  launch_per_entry(reduce_kernel, v.reduce_u_count, "adafactor reduce_kernel (U)", stream, v, v.reduce_u, v.u_stats);
}

void launch_adafactor_update(const AdafactorDeviceView& v, const AdafactorStepParams& p, cudaStream_t stream) {
  // Even a slab without items launches one block: it advances the step counter.
  update_kernel<<<static_cast<unsigned int>(v.item_count > 0 ? v.item_count : 1), kThreads, 0, stream>>>(v, p);
  CUDA_CHECK_LAUNCH("adafactor update_kernel");
}

}  // namespace optim
