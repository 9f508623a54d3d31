// CUDA kernels of the fused Adafactor step (adafactor.h lists the passes). One block per work
// item; tiles of factored tensors loop columns across threads and rows inside a thread, so
// every warp access is coalesced and each element's row and column are known.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.h"
#include "optim/adafactor.h"
#include "optim/block_reduce.cuh"

namespace optim {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBatch = 8;  // rows of a tile whose loads are issued together

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

__global__ void __launch_bounds__(kThreads)
statistics_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ double row_scratch[kWarps][kAdafactorTileRows];
  __shared__ double scratch[kWarps];
  const AdafactorItem item = v.items[blockIdx.x];
  const Segment seg = v.segments[item.segment];
  const AdafactorSegment info = v.info[item.segment];
  const float clip = clip_coefficient(v.scalars->grad_sq_sum, p.max_norm);
  double weight_sq = 0;

  if (item.kind == kTileItem) {
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
            const float g = adafactor_grad(v.grad[e], clip);
            const float g2 = fp::mul(g, g);
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
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < kAdafactorTileRows; ++r) {
      const float s = warp_sum(row_acc[r]);
      if (lane == 0) row_scratch[warp][r] = s;
    }
    __syncthreads();
    if (threadIdx.x < item.count) {
      double total = 0;
      for (int w = 0; w < kWarps; ++w) total += row_scratch[w][threadIdx.x];
      v.stats[info.row_stats + item.row0 + threadIdx.x] = total;
    }
  } else if (p.scale_parameter) {
    for (std::int64_t e = item.first + threadIdx.x; e < item.first + item.count; e += kThreads) {
      const double w = v.master[e - v.owned_begin];
      weight_sq = fma(w, w, weight_sq);
    }
  }
  const double total = block_sum(weight_sq, scratch);
  if (threadIdx.x == 0) v.item_partials[blockIdx.x] = total;
}

// Column sums and per-tensor sums from per-item partials (phases 1 and 2).
__global__ void __launch_bounds__(kThreads)
reduce_kernel(AdafactorDeviceView v, const AdafactorReduceItem* reduce, double* out_u) {
  __shared__ double scratch[kWarps];
  const AdafactorReduceItem r = reduce[blockIdx.x];
  const AdafactorSegment info = v.info[r.segment];
  if (r.kind == kReduceColumns) {
    const Segment seg = v.segments[r.segment];
    const std::int64_t c = r.col0 + threadIdx.x;
    if (c < seg.cols) {
      double sum = 0;
      const float* p = v.col_partials + info.first_col_partial + c;
      for (std::int64_t t = 0; t < info.item_count; ++t) sum += p[t * seg.cols];
      v.stats[info.row_stats + seg.rows + c] = sum;
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

__global__ void __launch_bounds__(kThreads)
row_col_ema_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ double scratch[kWarps];
  const StepState st = read_step_state(v.scalars, p);
  if (st.skip) return;
  const std::int32_t si = v.factored_segments[blockIdx.x];
  const Segment seg = v.segments[si];
  const AdafactorSegment info = v.info[si];
  const double beta2 = adafactor_beta2(p, st.t);
  float* R = v.row_col_state + info.row_state;
  float* C = R + seg.rows;
  double row_total = 0;
  for (std::int64_t i = threadIdx.x; i < seg.rows; i += kThreads) {
    const float r = adafactor_ema(p, beta2, R[i], v.stats[info.row_stats + i] / seg.cols);
    R[i] = r;
    row_total += r;
  }
  row_total = block_sum(row_total, scratch);
  if (threadIdx.x == 0) v.row_means[info.tensor] = seg.rows > 0 ? row_total / seg.rows : 0.0;
  for (std::int64_t j = threadIdx.x; j < seg.cols; j += kThreads) {
    C[j] = adafactor_ema(p, beta2, C[j], v.stats[info.row_stats + seg.rows + j] / seg.rows);
  }
}

__device__ AdafactorElementParams element_params(const AdafactorDeviceView& v, const AdafactorStepParams& p,
                                                 const StepState& st, const Segment& seg,
                                                 const AdafactorSegment& info, double u_sq_sum) {
  return adafactor_element_params(p, st.t, st.clip, p.lr * seg.lr_scale, seg.decay, v.stats[info.weight_stats],
                                  u_sq_sum, info.numel, v.row_means[info.tensor]);
}

__global__ void __launch_bounds__(kThreads)
u_statistics_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ double scratch[kWarps];
  __shared__ AdafactorElementParams shared_e;
  const StepState st = read_step_state(v.scalars, p);
  if (st.skip) return;
  const AdafactorItem item = v.items[blockIdx.x];
  const Segment seg = v.segments[item.segment];
  const AdafactorSegment info = v.info[item.segment];
  if (threadIdx.x == 0) shared_e = element_params(v, p, st, seg, info, 0.0);
  __syncthreads();
  const AdafactorElementParams e = shared_e;
  double u_sq = 0;
  if (item.kind == kTileItem) {
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
          const float u = adafactor_u(adafactor_grad(g[k], st.clip), adafactor_factored_v(e, R[item.row0 + r0 + k], col));
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

__device__ __forceinline__ void store_mirror(void* mirror, core::DType dtype, std::int64_t i, float w) {
  if (dtype == core::DType::bf16) {
    static_cast<__nv_bfloat16*>(mirror)[i] = __float2bfloat16_rn(w);
  } else {
    static_cast<__half*>(mirror)[i] = __float2half_rn(w);
  }
}

__global__ void __launch_bounds__(kThreads)
update_kernel(AdafactorDeviceView v, AdafactorStepParams p) {
  __shared__ AdafactorElementParams shared_e;
  __shared__ StepState shared_st;
  const bool has_item = blockIdx.x < v.item_count;  // a slab without items still counts the step
  const AdafactorItem item = has_item ? v.items[blockIdx.x] : AdafactorItem{};
  if (threadIdx.x == 0) {
    shared_st = read_step_state(v.scalars, p);
    if (has_item && !shared_st.skip) {
      const Segment seg = v.segments[item.segment];
      shared_e = element_params(v, p, shared_st, seg, v.info[item.segment], v.u_stats[v.info[item.segment].u_stats]);
    }
  }
  __syncthreads();
  const StepState st = shared_st;

  if (has_item) {
    const Segment seg = v.segments[item.segment];
    const AdafactorSegment info = v.info[item.segment];
    const AdafactorElementParams e = shared_e;
    if (item.kind == kTileItem) {
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
              const float u = adafactor_u(adafactor_grad(g[k], st.clip),
                                          adafactor_factored_v(e, R[item.row0 + r0 + k], col));
              adafactor_apply(e, w[k], e.use_beta1 ? v.exp_avg + local : nullptr, u);
              v.master[local] = w[k];
              store_mirror(v.mirror, v.mirror_dtype, el, w[k]);
            }
            v.grad[el] = 0.0f;
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
          v.master[local] = w;
          store_mirror(v.mirror, v.mirror_dtype, el, w);
        }
        v.grad[el] = 0.0f;
      }
    }
  }

  // The last block to finish advances the step counters; every block has read them by then.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&v.scalars->update_arrivals, 1u) == gridDim.x - 1) {
      if (st.skip) {
        ++v.scalars->skipped;
      } else {
        ++v.scalars->step;
      }
      v.scalars->update_arrivals = 0;
    }
  }
}

unsigned int grid_of(std::int64_t count) { return static_cast<unsigned int>(count > 0 ? count : 1); }

}  // namespace

void launch_adafactor_statistics(const AdafactorDeviceView& v, const AdafactorStepParams& p, cudaStream_t stream) {
  if (v.item_count > 0) {
    statistics_kernel<<<grid_of(v.item_count), kThreads, 0, stream>>>(v, p);
    CUDA_CHECK_LAUNCH("adafactor statistics_kernel");
  }
  if (v.reduce_stats_count > 0) {
    reduce_kernel<<<grid_of(v.reduce_stats_count), kThreads, 0, stream>>>(v, v.reduce_stats, v.u_stats);
    CUDA_CHECK_LAUNCH("adafactor reduce_kernel (statistics)");
  }
}

void launch_adafactor_second_moments(const AdafactorDeviceView& v, const AdafactorStepParams& p,
                                     cudaStream_t stream) {
  if (v.factored_count > 0) {
    row_col_ema_kernel<<<grid_of(v.factored_count), kThreads, 0, stream>>>(v, p);
    CUDA_CHECK_LAUNCH("adafactor row_col_ema_kernel");
  }
  if (v.item_count > 0) {
    u_statistics_kernel<<<grid_of(v.item_count), kThreads, 0, stream>>>(v, p);
    CUDA_CHECK_LAUNCH("adafactor u_statistics_kernel");
  }
  if (v.reduce_u_count > 0) {
    reduce_kernel<<<grid_of(v.reduce_u_count), kThreads, 0, stream>>>(v, v.reduce_u, v.u_stats);
    CUDA_CHECK_LAUNCH("adafactor reduce_kernel (U)");
  }
}

void launch_adafactor_update(const AdafactorDeviceView& v, const AdafactorStepParams& p, cudaStream_t stream) {
  update_kernel<<<grid_of(v.item_count), kThreads, 0, stream>>>(v, p);
  CUDA_CHECK_LAUNCH("adafactor update_kernel");
}

}  // namespace optim
