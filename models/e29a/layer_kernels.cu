// Phase kernels of the E29a layer (layer_kernels.h), one block per sequence. The forward steps'
// bodies, the fixed-order slot reductions and the tape update live in layer_step.cuh, shared with
// the persistent forward; the backward's bodies are here. The replay uses the forward's tape
// update, so it gives the forward's bits.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "models/e29a/layer_kernels.h"
#include "models/e29a/layer_step.cuh"

namespace models::e29a::kernels {
namespace {

constexpr int kMaxThreads = 256;

using step::block_slot_sums;
using step::kFull;
using step::Shared;
using step::sigmoidf;
using step::softmax_backward_warp;
using step::tape_update;

std::size_t shared_bytes(int max_n, int threads, int dim) {
  return step::shared_floats(max_n, threads, dim) * sizeof(float);
}

template <int MaxN>
__global__ void __launch_bounds__(kMaxThreads) read_step_kernel(ReadStepArgs a) {
  extern __shared__ float smem[];
  step::read_sequence<MaxN>(a, blockIdx.x, Shared<MaxN>(smem),
                            a.tape + static_cast<std::int64_t>(blockIdx.x) * a.slots * a.dim);
}

template <int MaxN>
__global__ void __launch_bounds__(kMaxThreads) write_step_kernel(WriteStepArgs a) {
  extern __shared__ float smem[];
  step::write_sequence<MaxN>(a, blockIdx.x, Shared<MaxN>(smem),
                             a.tape + static_cast<std::int64_t>(blockIdx.x) * a.slots * a.dim);
}

template <int MaxN>
__global__ void __launch_bounds__(kMaxThreads) write_back_kernel(WriteBackArgs a) {
  extern __shared__ float smem[];
  const Shared<MaxN> sh(smem);
  const std::int64_t b = blockIdx.x;
  const int D = a.dim, N = a.slots;
  const float* H = a.tape + b * N * D;
  float* dH = a.d_tape + b * N * D;
  const float* w = a.write + b * D;
  const float* z = a.z + b * a.z_stride;
  const __nv_bfloat16* dy = a.dy + b * a.dy_stride;
  __nv_bfloat16* dz = a.dz + b * a.dz_stride;

  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  // The carried gradients' factor: 1, or the bound over their joint norm when it is exceeded.
  float carry = 1.0f;
  if (a.carry_clip > 0.0f) {
    float sq = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) sq = fmaf(a.dh_next[b * D + d], a.dh_next[b * D + d], sq);
    for (int i = threadIdx.x; i < N * D; i += blockDim.x) sq = fmaf(dH[i], dH[i], sq);
    part[0] = sq;
    block_slot_sums<MaxN>(part, sh, 1);
    part[0] = 0.0f;
    const float norm = sqrtf(sh.sums[0]);
    if (norm > a.carry_clip) carry = a.carry_clip / norm;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    // Gate and output: y = h * silu(g), g = z + r + h.
    const float h = a.h[b * D + d];
    const float g = (z[d] + a.read[b * D + d]) + h;
    const float s = sigmoidf(g);
    const float dout = __bfloat162float(dy[d]);
    const float dg = dout * h * (s * (1.0f + g * (1.0f - s)));
    a.d_gate[b * D + d] = dg;
    dz[d] = __float2bfloat16_rn(dg);
    a.dh_local[b * D + d] = (carry * a.dh_next[b * D + d] + dout * (g * s)) + dg;
    // Gradient of the write attention weights: <dH[n], w - H[n]>.
    const float v = w[d];
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) part[n] = fmaf(carry * dH[n * D + d], v - H[n * D + d], part[n]);
    }
  }
  if (threadIdx.x < N) sh.attn[threadIdx.x] = a.write_attn[b * N + threadIdx.x];
  block_slot_sums<MaxN>(part, sh, N);
  if (threadIdx.x < 32) softmax_backward_warp<MaxN>(sh, N, a.detach_scores);
  __syncthreads();
  if (a.score_grad && threadIdx.x < N) a.score_grad[b * N + threadIdx.x] = sh.ds[threadIdx.x];

  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float v = w[d];
    float dw = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const float dh_n = carry * dH[n * D + d];
        const float sds = a.scale * sh.ds[n];
        dw = fmaf(sh.attn[n], dh_n, dw);
        dw = fmaf(sds, H[n * D + d], dw);
        dH[n * D + d] = fmaf(1.0f - sh.attn[n], dh_n, sds * v);
      }
    }
    a.d_write[b * D + d] = dw;
    a.d_write_bf16[b * D + d] = __float2bfloat16_rn(dw);
  }
}

template <int MaxN>
__global__ void __launch_bounds__(kMaxThreads) read_back_kernel(ReadBackArgs a) {
  extern __shared__ float smem[];
  const Shared<MaxN> sh(smem);
  const std::int64_t b = blockIdx.x;
  const int D = a.dim, N = a.slots;
  const float* H = a.tape + b * N * D;
  float* dH = a.d_tape + b * N * D;
  __nv_bfloat16* dx = a.dx + b * a.dx_stride;

  float part[MaxN];
#pragma unroll
  for (int n = 0; n < MaxN; ++n) part[n] = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float h = a.h[b * D + d];
    const float dh = a.dh_local[b * D + d] + a.dh_write[b * D + d];
    const float dp = dh * (1.0f - h * h);
    a.d_pre[b * D + d] = dp;
    a.d_pre_bf16[b * D + d] = __float2bfloat16_rn(dp);
    dx[d] = __float2bfloat16_rn(dp);
    a.d_bias[b * D + d] += dp;
    const float dr = a.d_gate[b * D + d] + dp;
    sh.vec[d] = dr;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) part[n] = fmaf(dr, H[n * D + d], part[n]);
    }
  }
  if (threadIdx.x < N) sh.attn[threadIdx.x] = a.read_attn[b * N + threadIdx.x];
  block_slot_sums<MaxN>(part, sh, N);
  if (threadIdx.x < 32) softmax_backward_warp<MaxN>(sh, N, a.detach_scores);
  __syncthreads();
  if (a.score_grad && threadIdx.x < N) a.score_grad[b * N + threadIdx.x] = sh.ds[threadIdx.x];

  const float* hp = a.h_prev + b * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float dr = sh.vec[d];
    const float h_prev = hp[d];
    float dh_prev = 0.0f;
#pragma unroll
    for (int n = 0; n < MaxN; ++n) {
      if (n < N) {
        const float sds = a.scale * sh.ds[n];
        dH[n * D + d] += fmaf(sh.attn[n], dr, sds * h_prev);
        dh_prev = fmaf(sh.ds[n], H[n * D + d], dh_prev);
      }
    }
    a.dh_prev[b * D + d] = a.scale * dh_prev;
  }
}

__global__ void replay_tape_kernel(const float* __restrict__ checkpoint, const float* __restrict__ write_attn,
                                   const float* __restrict__ write, std::int64_t batch, int slots, int dim, int count,
                                   float* __restrict__ seg) {
  const std::int64_t per_step = batch * slots * dim;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_step) return;
  const std::int64_t d = i % dim, bn = i / dim, n = bn % slots, b = bn / slots;
  float h = checkpoint[i];
  seg[i] = h;
  for (int k = 1; k < count; ++k) {
    const float attn = write_attn[((k - 1) * batch + b) * slots + n];
    const float w = write[((k - 1) * batch + b) * dim + d];
    h = tape_update(h, attn, w);
    seg[k * per_step + i] = h;
  }
}

__global__ void broadcast_tape_kernel(const __nv_bfloat16* __restrict__ tape0, std::int64_t total,
                                      std::int64_t per_sequence, float* __restrict__ tape) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) tape[i] = __bfloat162float(tape0[i % per_sequence]);
}

__global__ void bf16_to_float_kernel(const __nv_bfloat16* __restrict__ in, std::int64_t count,
                                     float* __restrict__ out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = __bfloat162float(in[i]);
}

__global__ void float_to_bf16_kernel(const float* __restrict__ in, std::int64_t count,
                                     __nv_bfloat16* __restrict__ out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void add_batch_sum_kernel(const float* __restrict__ in, std::int64_t batch, std::int64_t count,
                                     float* __restrict__ out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float s = 0.0f;
  for (std::int64_t b = 0; b < batch; ++b) s += in[b * count + i];
  out[i] += s;
}

__global__ void add_bf16_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, std::int64_t count,
                                __nv_bfloat16* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

std::int64_t blocks_for(std::int64_t elements, int threads) { return (elements + threads - 1) / threads; }

// Threads per sequence block: about 4 features per thread, whole warps, at most kMaxThreads, and
// at least one thread per slot (thread n sums, loads and stores slot n's values).
int threads_for(int dim, int slots) {
  const int quarter = (dim + 3) / 4;
  const int least = (slots + 31) / 32 * 32;
  return std::clamp((quarter + 31) / 32 * 32, least, kMaxThreads);
}

void check_slots(int slots) {
  if (slots < 1 || slots > kMaxSlots) {
    throw core::Error("e29a cuda: slots must be in [1, " + std::to_string(kMaxSlots) + "], got " +
                      std::to_string(slots));
  }
}

// Launches kernel<MaxN> for the smallest capacity holding `slots`, one block per sequence.
template <template <int> class Launch, typename Args>
void launch_by_slots(const Args& args, cudaStream_t stream, const char* what) {
  check_slots(args.slots);
  if (args.batch == 0) return;
  const int threads = threads_for(args.dim, args.slots);
  if (args.slots <= 8) {
    Launch<8>::run(args, threads, shared_bytes(8, threads, args.dim), stream);
  } else if (args.slots <= 16) {
    Launch<16>::run(args, threads, shared_bytes(16, threads, args.dim), stream);
  } else if (args.slots <= 32) {
    Launch<32>::run(args, threads, shared_bytes(32, threads, args.dim), stream);
  } else {
    Launch<64>::run(args, threads, shared_bytes(64, threads, args.dim), stream);
  }
  CUDA_CHECK_LAUNCH(what);
}

template <typename Kernel>
void prepare_shared(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

#define E29A_LAUNCHER(name, kernel, Args)                                                    \
  template <int MaxN>                                                                        \
  struct name {                                                                              \
    static void run(const Args& args, int threads, std::size_t bytes, cudaStream_t stream) { \
      prepare_shared(kernel<MaxN>, bytes);                                                   \
      kernel<MaxN><<<static_cast<unsigned>(args.batch), threads, bytes, stream>>>(args);     \
    }                                                                                        \
  };

E29A_LAUNCHER(ReadStepLaunch, read_step_kernel, ReadStepArgs)
E29A_LAUNCHER(WriteStepLaunch, write_step_kernel, WriteStepArgs)
E29A_LAUNCHER(WriteBackLaunch, write_back_kernel, WriteBackArgs)
E29A_LAUNCHER(ReadBackLaunch, read_back_kernel, ReadBackArgs)
#undef E29A_LAUNCHER

}  // namespace

void read_step(const ReadStepArgs& args, cudaStream_t stream) {
  launch_by_slots<ReadStepLaunch>(args, stream, "e29a read_step");
}
void write_step(const WriteStepArgs& args, cudaStream_t stream) {
  launch_by_slots<WriteStepLaunch>(args, stream, "e29a write_step");
}
void write_back(const WriteBackArgs& args, cudaStream_t stream) {
  launch_by_slots<WriteBackLaunch>(args, stream, "e29a write_back");
}
void read_back(const ReadBackArgs& args, cudaStream_t stream) {
  launch_by_slots<ReadBackLaunch>(args, stream, "e29a read_back");
}

void replay_tape(const float* checkpoint, const float* write_attn, const float* write, std::int64_t batch, int slots,
                 int dim, int count, float* seg, cudaStream_t stream) {
  const std::int64_t per_step = batch * slots * dim;
  if (per_step == 0 || count <= 0) return;
  replay_tape_kernel<<<static_cast<unsigned>(blocks_for(per_step, 256)), 256, 0, stream>>>(
      checkpoint, write_attn, write, batch, slots, dim, count, seg);
  CUDA_CHECK_LAUNCH("e29a replay_tape");
}

void broadcast_tape(const __nv_bfloat16* tape0, std::int64_t batch, std::int64_t per_sequence, float* tape,
                    cudaStream_t stream) {
  const std::int64_t total = batch * per_sequence;
  if (total == 0) return;
  broadcast_tape_kernel<<<static_cast<unsigned>(blocks_for(total, 256)), 256, 0, stream>>>(tape0, total, per_sequence,
                                                                                           tape);
  CUDA_CHECK_LAUNCH("e29a broadcast_tape");
}

void bf16_to_float(const __nv_bfloat16* in, std::int64_t count, float* out, cudaStream_t stream) {
  if (count == 0) return;
  bf16_to_float_kernel<<<static_cast<unsigned>(blocks_for(count, 256)), 256, 0, stream>>>(in, count, out);
  CUDA_CHECK_LAUNCH("e29a bf16_to_float");
}

void float_to_bf16(const float* in, std::int64_t count, __nv_bfloat16* out, cudaStream_t stream) {
  if (count == 0) return;
  float_to_bf16_kernel<<<static_cast<unsigned>(blocks_for(count, 256)), 256, 0, stream>>>(in, count, out);
  CUDA_CHECK_LAUNCH("e29a float_to_bf16");
}

void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, std::int64_t count, __nv_bfloat16* out,
              cudaStream_t stream) {
  if (count == 0) return;
  add_bf16_kernel<<<static_cast<unsigned>(blocks_for(count, 256)), 256, 0, stream>>>(a, b, count, out);
  CUDA_CHECK_LAUNCH("e29a add_bf16");
}

void add_batch_sum(const float* in, std::int64_t batch, std::int64_t count, float* out, cudaStream_t stream) {
  if (count == 0) return;
  add_batch_sum_kernel<<<static_cast<unsigned>(blocks_for(count, 256)), 256, 0, stream>>>(in, batch, count, out);
  CUDA_CHECK_LAUNCH("e29a add_batch_sum");
}

}  // namespace models::e29a::kernels
