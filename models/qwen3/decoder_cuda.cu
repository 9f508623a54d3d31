// Kernels of the Qwen3 decoder's step (batch 1): matrix-vector products over the bf16 mirror with
// fused norm / residual / SwiGLU epilogues, the per-head q/k norm + RoPE + cache append, and
// split-key attention over the bf16 cache with its log-sum-exp merge. Every sum runs in a fixed
// order (xor butterflies, then warps in index order), so steps are bit-identical run to run.
#include <algorithm>
#include <string>

#include "core/block_reduce.cuh"
#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/qwen3/decoder_cuda.h"

namespace models::qwen3::decode {
namespace {

using ops::gpu::load_bf16;

constexpr int kMatvecThreads = 256;
constexpr int kMatvecWarps = kMatvecThreads / 32;
constexpr int kAttentionThreads = 128;
constexpr std::int64_t kMinSplitKeys = 32;

using core::warp_sum;

// Sum over the block (blockDim.x a multiple of 32, at most 1024), the same value in every thread.
__device__ float block_sum(float v) {
  __shared__ float warps[32];
  return core::block_sum_all(v, warps);
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <int Vec, Epilogue E, bool Norm>
__global__ void __launch_bounds__(kMatvecThreads) matvec_kernel(MatvecArgs a) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  bf16* xs = reinterpret_cast<bf16*>(shared_raw);
  const int in = static_cast<int>(a.in);
  if constexpr (Norm) {
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < in; i += kMatvecThreads) {
      const float v = __bfloat162float(a.x[i]);
      sum_sq = fmaf(v, v, sum_sq);
    }
    sum_sq = block_sum(sum_sq);
    const float rstd = 1.0f / sqrtf(sum_sq / static_cast<float>(in) + a.eps);
    for (int i = threadIdx.x; i < in; i += kMatvecThreads) {
      xs[i] = __float2bfloat16_rn(__bfloat162float(a.x[i]) * rstd * __bfloat162float(a.norm_weight[i]));
    }
  } else {
    for (int i = threadIdx.x; i < in; i += kMatvecThreads) xs[i] = a.x[i];
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int chunks = in / Vec;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kMatvecWarps;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kMatvecWarps + threadIdx.x / 32; row < a.rows;
       row += warps) {
    const bf16* w_row = a.weight + row * in;
    const bf16* w_up = a.weight + (row + a.rows) * in;  // swiglu only
    float acc = 0.0f, acc_up = 0.0f;
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
      float w[Vec], xv[Vec];
      load_bf16<Vec>(w_row + c * Vec, w);
      load_bf16<Vec>(xs + c * Vec, xv);
#pragma unroll
      for (int k = 0; k < Vec; ++k) acc = fmaf(w[k], xv[k], acc);
      if constexpr (E == Epilogue::swiglu_bf16) {
        float u[Vec];
        load_bf16<Vec>(w_up + c * Vec, u);
#pragma unroll
        for (int k = 0; k < Vec; ++k) acc_up = fmaf(u[k], xv[k], acc_up);
      }
    }
    acc = warp_sum(acc);
    if constexpr (E == Epilogue::swiglu_bf16) acc_up = warp_sum(acc_up);
    if (lane == 0) {
      if constexpr (E == Epilogue::store_bf16) {
        static_cast<bf16*>(a.out)[row] = __float2bfloat16_rn(acc);
      } else if constexpr (E == Epilogue::add_bf16) {
        bf16* out = static_cast<bf16*>(a.out);
        out[row] = __float2bfloat16_rn(__bfloat162float(out[row]) + round_bf16(acc));
      } else if constexpr (E == Epilogue::swiglu_bf16) {
        const float g = round_bf16(acc), u = round_bf16(acc_up);
        static_cast<bf16*>(a.out)[row] = __float2bfloat16_rn(g * (1.0f / (1.0f + expf(-g))) * u);
      } else {
        static_cast<float*>(a.out)[row] = acc;
      }
    }
  }
  if (a.advance != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *a.advance += 1;
}

template <int Vec, Epilogue E>
void launch_matvec(const MatvecArgs& a, int blocks, cudaStream_t stream) {
  const std::size_t shared = (static_cast<std::size_t>(a.in) * sizeof(bf16) + 15) / 16 * 16;
  const auto run = [&](auto kernel) {
    if (shared > 48 * 1024) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    }
    kernel<<<blocks, kMatvecThreads, shared, stream>>>(a);
  };
  if (a.norm_weight != nullptr) {
    run(matvec_kernel<Vec, E, true>);
  } else {
    run(matvec_kernel<Vec, E, false>);
  }
  CUDA_CHECK_LAUNCH("decode matvec_kernel");
}

template <int Vec>
void dispatch_matvec(const MatvecArgs& a, Epilogue e, int blocks, cudaStream_t stream) {
  switch (e) {
    case Epilogue::store_bf16: launch_matvec<Vec, Epilogue::store_bf16>(a, blocks, stream); break;
    case Epilogue::add_bf16: launch_matvec<Vec, Epilogue::add_bf16>(a, blocks, stream); break;
    case Epilogue::swiglu_bf16: launch_matvec<Vec, Epilogue::swiglu_bf16>(a, blocks, stream); break;
    case Epilogue::store_f32: launch_matvec<Vec, Epilogue::store_f32>(a, blocks, stream); break;
  }
}

__global__ void qk_norm_rope_append_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ q_norm,
                                           const bf16* __restrict__ k_norm, int heads, int kv_heads, int head_dim,
                                           float eps, const double* __restrict__ inv_freq,
                                           const std::int32_t* __restrict__ position, bf16* __restrict__ q_out,
                                           bf16* __restrict__ k_cache, bf16* __restrict__ v_cache) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  constexpr double kInvTwoPi = 0.15915494309189533576888376337251;
  const int half = head_dim / 2;
  const bool is_q = blockIdx.x < static_cast<unsigned>(heads);
  const int head = is_q ? blockIdx.x : blockIdx.x - heads;
  const bf16* src = qkv + (is_q ? head * head_dim : (heads + head) * head_dim);
  const bf16* weight = is_q ? q_norm : k_norm;
  const std::int64_t pos = *position;
  const std::int64_t kv_size = static_cast<std::int64_t>(kv_heads) * head_dim;
  const int i = threadIdx.x;
  const bool active = i < half;
  const float a = active ? __bfloat162float(src[i]) : 0.0f;
  const float b = active ? __bfloat162float(src[i + half]) : 0.0f;
  const float sum_sq = block_sum(fmaf(b, b, a * a));
  if (!active) return;
  const float rstd = 1.0f / sqrtf(sum_sq / static_cast<float>(head_dim) + eps);
  const float ya = round_bf16(a * rstd * __bfloat162float(weight[i]));
  const float yb = round_bf16(b * rstd * __bfloat162float(weight[i + half]));
  // The angle as rope.cu forms it: double product and reduction, fp32 sincos.
  const double angle = static_cast<double>(pos) * inv_freq[i];
  const double turns = rint(angle * kInvTwoPi);
  float s, c;
  sincosf(static_cast<float>(fma(-turns, kTwoPi, angle)), &s, &c);
  bf16* dst = is_q ? q_out + head * head_dim : k_cache + pos * kv_size + head * head_dim;
  dst[i] = __float2bfloat16_rn(ya * c - yb * s);
  dst[i + half] = __float2bfloat16_rn(yb * c + ya * s);
  if (!is_q) {
    const bf16* v = qkv + (heads + kv_heads + head) * head_dim;
    bf16* v_dst = v_cache + pos * kv_size + head * head_dim;
    v_dst[i] = v[i];
    v_dst[i + half] = v[i + half];
  }
}

struct SplitRange {
  std::int64_t length, chunk, active;
};

__device__ __forceinline__ SplitRange split_range(std::int64_t length, int splits) {
  const std::int64_t chunk = max(kMinSplitKeys, (length + splits - 1) / splits);
  return {length, chunk, (length + chunk - 1) / chunk};
}

// One (G query heads of a kv head, split, query) per block: HD / 8 lanes own a key (8 dims each,
// 16-byte loads); the block's key groups run an online softmax (log2 domain) over their keys,
// then merge.
template <int HD, int G>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_partial_kernel(const bf16* __restrict__ q, std::int64_t q_stride, const bf16* __restrict__ k_cache,
                             const bf16* __restrict__ v_cache, KvLayout layout, int heads, int heads_per_kv,
                             const std::int32_t* __restrict__ position, int splits, float scale_log2,
                             float* __restrict__ partial_o, float2* __restrict__ partial_ml) {
  constexpr int kLanes = HD / 8;
  constexpr int kGroups = kAttentionThreads / kLanes;
  __shared__ float shared_m[kGroups][G], shared_l[kGroups][G];
  __shared__ __align__(16) float shared_o[kGroups][G][HD];

  // Block x: query heads [head0, head0 + G) of kv head kv_head (heads_per_kv / G blocks per kv head).
  const int blocks_per_kv = heads_per_kv / G;
  const int kv_head = blockIdx.x / blocks_per_kv, head0 = kv_head * heads_per_kv + (blockIdx.x % blocks_per_kv) * G;
  const int split = blockIdx.y;
  const std::int64_t query = blockIdx.z;
  const SplitRange range = split_range(*position + query + 1, splits);
  if (split >= range.active) return;
  const std::int64_t begin = split * range.chunk, end = min(range.length, begin + range.chunk);
  const int lane = threadIdx.x % kLanes, group = threadIdx.x / kLanes;
  const std::int64_t kv_stride = layout.position_stride;

  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load_bf16<8>(q + query * q_stride + (head0 + g) * HD + lane * 8, qf[g]);
#pragma unroll
    for (int k = 0; k < 8; ++k) qf[g][k] *= scale_log2;
  }
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[g][k] = 0.0f;
  }
  const bf16* k_base = k_cache + kv_head * layout.head_stride + lane * 8;
  const bf16* v_base = v_cache + kv_head * layout.head_stride + lane * 8;
  // Every thread runs the same number of iterations: the shuffles of group_sum span the whole
  // warp (several key groups), so a group past the end still takes part, with its update skipped.
#pragma unroll 2
  for (std::int64_t first = begin; first < end; first += kGroups) {
    const std::int64_t j = first + group;
    const bool valid = j < end;
    float kf[8], vf[8];
    if (valid) {
      load_bf16<8>(k_base + j * kv_stride, kf);
      load_bf16<8>(v_base + j * kv_stride, vf);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) kf[k] = vf[k] = 0.0f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s = fmaf(qf[g][k], kf[k], s);
      s = ops::gpu::group_sum<kLanes>(s);
      if (!valid) continue;
      const float m_new = fmaxf(m[g], s);
      const float correction = exp2f(m[g] - m_new);
      const float p = exp2f(s - m_new);
      l[g] = fmaf(l[g], correction, p);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[g][k] = fmaf(acc[g][k], correction, p * vf[k]);
      m[g] = m_new;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int k = 0; k < 8; ++k) shared_o[group][g][lane * 8 + k] = acc[g][k];
    if (lane == 0) {
      shared_m[group][g] = m[g];
      shared_l[group][g] = l[g];
    }
  }
  __syncthreads();
  const std::int64_t row = (query * heads + head0) * splits + split;  // of head g: row + g * splits
  for (int t = threadIdx.x; t < G * HD; t += kAttentionThreads) {
    const int g = t / HD, d = t % HD;
    float best = -INFINITY;
    for (int k = 0; k < kGroups; ++k) best = fmaxf(best, shared_m[k][g]);
    float sum_l = 0.0f, sum_o = 0.0f;
    for (int k = 0; k < kGroups; ++k) {
      const float w = exp2f(shared_m[k][g] - best);  // 0 for groups that saw no key
      sum_l = fmaf(shared_l[k][g], w, sum_l);
      sum_o = fmaf(shared_o[k][g][d], w, sum_o);
    }
    partial_o[(row + g * splits) * HD + d] = sum_o;
    if (d == 0) partial_ml[row + g * splits] = make_float2(best, sum_l);
  }
}

template <int HD>
__global__ void __launch_bounds__(HD)
    attention_combine_kernel(const float* __restrict__ partial_o, const float2* __restrict__ partial_ml, int heads,
                             const std::int32_t* __restrict__ position, int splits, bf16* __restrict__ att) {
  const int head = blockIdx.x, d = threadIdx.x;
  const std::int64_t query = blockIdx.y;
  const SplitRange range = split_range(*position + query + 1, splits);
  const std::int64_t row = (query * heads + head) * splits;
  float best = -INFINITY;
  for (std::int64_t s = 0; s < range.active; ++s) best = fmaxf(best, partial_ml[row + s].x);
  float sum_l = 0.0f, sum_o = 0.0f;
  for (std::int64_t s = 0; s < range.active; ++s) {
    const float2 ml = partial_ml[row + s];
    const float w = exp2f(ml.x - best);
    sum_l = fmaf(ml.y, w, sum_l);
    sum_o = fmaf(partial_o[(row + s) * HD + d], w, sum_o);
  }
  att[(query * heads + head) * HD + d] = __float2bfloat16_rn(sum_o / sum_l);
}

template <int HD, int G>
void launch_attention(const bf16* q, std::int64_t q_stride, const bf16* k_cache, const bf16* v_cache, KvLayout layout,
                      int heads, int kv_heads, const std::int32_t* position, std::int64_t queries, int splits,
                      float* partial, bf16* att, cudaStream_t stream) {
  const int group = heads / kv_heads;
  float* partial_o = partial;
  auto* partial_ml = reinterpret_cast<float2*>(partial + queries * heads * splits * HD);
  const float scale_log2 = 1.4426950408889634f / sqrtf(static_cast<float>(HD));
  const dim3 grid(static_cast<unsigned>(kv_heads * (group / G)), static_cast<unsigned>(splits),
                  static_cast<unsigned>(queries));
  attention_partial_kernel<HD, G><<<grid, kAttentionThreads, 0, stream>>>(
      q, q_stride, k_cache, v_cache, layout, heads, group, position, splits, scale_log2, partial_o, partial_ml);
  CUDA_CHECK_LAUNCH("attention_partial_kernel");
  attention_combine_kernel<HD><<<dim3(static_cast<unsigned>(heads), static_cast<unsigned>(queries)), HD, 0, stream>>>(
      partial_o, partial_ml, heads, position, splits, att);
  CUDA_CHECK_LAUNCH("attention_combine_kernel");
}

template <int HD>
void dispatch_group(int group, const bf16* q, std::int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
                    KvLayout layout, int heads, int kv_heads, const std::int32_t* position, std::int64_t queries,
                    int splits, float* partial, bf16* att, cudaStream_t stream) {
  switch (group) {
#define LLMTRAIN_GROUP_CASE(G)                                                                                 \
  case G:                                                                                                      \
    launch_attention<HD, G>(q, q_stride, k_cache, v_cache, layout, heads, kv_heads, position, queries, splits, \
                            partial, att, stream);                                                             \
    break;
    LLMTRAIN_GROUP_CASE(1)
    LLMTRAIN_GROUP_CASE(2)
    LLMTRAIN_GROUP_CASE(3)
    LLMTRAIN_GROUP_CASE(4)
    LLMTRAIN_GROUP_CASE(5)
    LLMTRAIN_GROUP_CASE(6)
    LLMTRAIN_GROUP_CASE(7)
    LLMTRAIN_GROUP_CASE(8)
#undef LLMTRAIN_GROUP_CASE
    default: throw core::Error("decode attention: query heads per block must be 1..8, got " + std::to_string(group));
  }
}

__global__ void embed_token_kernel(const std::int32_t* device_token, std::int32_t token, const bf16* __restrict__ table,
                                   std::int64_t vocab, std::int64_t dim, bf16* __restrict__ x,
                                   std::int32_t* __restrict__ invalid_flag) {
  std::int64_t id = device_token != nullptr ? *device_token : token;
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && invalid_flag != nullptr) *invalid_flag = 1;
    id = id < 0 ? 0 : vocab - 1;
  }
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < dim;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    x[i] = table[id * dim + i];
  }
}

__global__ void fill_positions_kernel(std::int32_t* values, std::int64_t start, std::int64_t count) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    values[i] = static_cast<std::int32_t>(start + i);
  }
}

__global__ void set_int_kernel(std::int32_t* target, std::int32_t value) { *target = value; }

__global__ void bf16_to_f32_kernel(const bf16* __restrict__ in, float* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

// One 16-byte piece (8 elements) of a key or value row per thread, pieces numbered (position,
// kv head, piece) over blocks x; y: 0 keys, 1 values.
constexpr int kStoreThreads = 256;
__global__ void __launch_bounds__(kStoreThreads)
    store_kv_rows_kernel(const bf16* __restrict__ keys, std::int64_t k_stride, const bf16* __restrict__ values,
                         std::int64_t v_stride, std::int64_t n, int kv_heads, int head_dim, bf16* __restrict__ k_cache,
                         bf16* __restrict__ v_cache, KvLayout layout, std::int64_t start) {
  const int pieces = head_dim / 8;
  const std::int64_t at = static_cast<std::int64_t>(blockIdx.x) * kStoreThreads + threadIdx.x;
  if (at >= n * kv_heads * pieces) return;
  const int piece = static_cast<int>(at % pieces);
  const int head = static_cast<int>(at / pieces % kv_heads);
  const std::int64_t i = at / (static_cast<std::int64_t>(pieces) * kv_heads);
  const bool is_v = blockIdx.y == 1;
  const bf16* src = (is_v ? values + i * v_stride : keys + i * k_stride) + head * head_dim + piece * 8;
  bf16* dst = (is_v ? v_cache : k_cache) + (start + i) * layout.position_stride + head * layout.head_stride + piece * 8;
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

}  // namespace

void matvec(const MatvecArgs& args, Epilogue epilogue, int max_blocks, cudaStream_t stream) {
  if (args.rows <= 0 || args.in <= 0) throw core::Error("decode matvec: rows and in must be positive");
  if (args.in > (1 << 20)) throw core::Error("decode matvec: in_features above 2^20");
  const std::int64_t wanted = (args.rows + kMatvecWarps - 1) / kMatvecWarps;
  const int blocks = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(wanted, max_blocks)));
  const bool vector = args.in % ops::gpu::kVector == 0 && ops::gpu::aligned_16(args.weight);
  if (vector) {
    dispatch_matvec<ops::gpu::kVector>(args, epilogue, blocks, stream);
  } else {
    dispatch_matvec<1>(args, epilogue, blocks, stream);
  }
}

void qk_norm_rope_append(const bf16* qkv, const bf16* q_norm, const bf16* k_norm, int heads, int kv_heads, int head_dim,
                         float eps, const double* inv_freq, const std::int32_t* position, bf16* q_out, bf16* k_cache,
                         bf16* v_cache, cudaStream_t stream) {
  if (head_dim % 2 != 0 || head_dim > 2048)
    throw core::Error("decode qk_norm_rope_append: head_dim must be even, <= 2048");
  const int threads = std::max(32, (head_dim / 2 + 31) / 32 * 32);
  qk_norm_rope_append_kernel<<<heads + kv_heads, threads, 0, stream>>>(
      qkv, q_norm, k_norm, heads, kv_heads, head_dim, eps, inv_freq, position, q_out, k_cache, v_cache);
  CUDA_CHECK_LAUNCH("qk_norm_rope_append_kernel");
}

std::int64_t attention_partial_floats(int heads, int head_dim, std::int64_t queries, int splits) {
  return queries * heads * splits * (head_dim + 2);
}

int default_attention_splits(int multiprocessors, std::int64_t kv_heads) {
  const std::int64_t sms = std::max(1, multiprocessors);
  return static_cast<int>(std::clamp<std::int64_t>((4 * sms + kv_heads - 1) / kv_heads, 1, 128));
}

void cached_attention(const bf16* q, std::int64_t q_stride, const bf16* k_cache, const bf16* v_cache, KvLayout layout,
                      int heads, int kv_heads, int head_dim, const std::int32_t* position, std::int64_t queries,
                      int splits, float* partial, bf16* att, cudaStream_t stream) {
  if (queries <= 0) return;
  if (splits < 1 || splits > 65535 || queries > 65535)
    throw core::Error("decode attention: splits or queries out of range");
  if (heads % kv_heads != 0) throw core::Error("decode attention: heads must be a multiple of kv_heads");
  if (q_stride % 8 != 0 || !ops::gpu::aligned_16(q))
    throw core::Error("decode attention: q rows must be 16-byte aligned");
  if (layout.position_stride % 8 != 0 || layout.head_stride % 8 != 0 || !ops::gpu::aligned_16(k_cache) ||
      !ops::gpu::aligned_16(v_cache))
    throw core::Error("decode attention: cache rows must be 16-byte aligned");
  // Query heads per block: the largest divisor of the group that is at most 8 (the keys are read
  // once per block, so larger is better).
  const int per_kv = heads / kv_heads;
  int group = 1;
  for (int g = 8; g > 1; --g) {
    if (per_kv % g == 0) {
      group = g;
      break;
    }
  }
  if (head_dim == 64) {
    dispatch_group<64>(group, q, q_stride, k_cache, v_cache, layout, heads, kv_heads, position, queries, splits,
                       partial, att, stream);
  } else if (head_dim == 128) {
    dispatch_group<128>(group, q, q_stride, k_cache, v_cache, layout, heads, kv_heads, position, queries, splits,
                        partial, att, stream);
  } else {
    throw core::Error("decode attention: head_dim must be 64 or 128, got " + std::to_string(head_dim));
  }
}

void embed_token(const std::int32_t* device_token, std::int32_t token, const bf16* table, std::int64_t vocab,
                 std::int64_t dim, bf16* x, std::int32_t* invalid_flag, cudaStream_t stream) {
  embed_token_kernel<<<ops::gpu::grid_for(dim, 256), 256, 0, stream>>>(device_token, token, table, vocab, dim, x,
                                                                       invalid_flag);
  CUDA_CHECK_LAUNCH("embed_token_kernel");
}

void fill_positions(std::int32_t* values, std::int64_t start, std::int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  fill_positions_kernel<<<ops::gpu::grid_for(count, 256), 256, 0, stream>>>(values, start, count);
  CUDA_CHECK_LAUNCH("fill_positions_kernel");
}

void set_int(std::int32_t* target, std::int32_t value, cudaStream_t stream) {
  set_int_kernel<<<1, 1, 0, stream>>>(target, value);
  CUDA_CHECK_LAUNCH("set_int_kernel");
}

void bf16_to_f32(const bf16* in, float* out, std::int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  bf16_to_f32_kernel<<<ops::gpu::grid_for(count, 256), 256, 0, stream>>>(in, out, count);
  CUDA_CHECK_LAUNCH("bf16_to_f32_kernel");
}

void store_kv_rows(const bf16* keys, std::int64_t k_stride, const bf16* values, std::int64_t v_stride, std::int64_t n,
                   int kv_heads, int head_dim, bf16* k_cache, bf16* v_cache, KvLayout layout, std::int64_t start,
                   cudaStream_t stream) {
  if (n <= 0) return;
  if (head_dim % 8 != 0 || k_stride % 8 != 0 || v_stride % 8 != 0 || layout.position_stride % 8 != 0 ||
      layout.head_stride % 8 != 0 || !ops::gpu::aligned_16(keys) || !ops::gpu::aligned_16(values) ||
      !ops::gpu::aligned_16(k_cache) || !ops::gpu::aligned_16(v_cache))
    throw core::Error("decode store_kv_rows: rows must be 16-byte aligned");
  const std::int64_t pieces = n * kv_heads * (head_dim / 8);
  const dim3 grid(static_cast<unsigned>((pieces + kStoreThreads - 1) / kStoreThreads), 2);
  store_kv_rows_kernel<<<grid, kStoreThreads, 0, stream>>>(keys, k_stride, values, v_stride, n, kv_heads, head_dim,
                                                           k_cache, v_cache, layout, start);
  CUDA_CHECK_LAUNCH("store_kv_rows_kernel");
}

}  // namespace models::qwen3::decode
