// The Qwen3 batch-1 decode megakernel: one persistent, co-resident grid decodes one or many tokens
// (the whole stack, lm_head and argmax included) with no grid-wide barrier.
//
// Each block runs its list of units (decode_megakernel_plan.h) for every token. Warp 0 is the
// producer: one thread walks the same list and streams each unit's weight rows (or KV-cache rows)
// into a ring of shared-memory pages with bulk copies completing on mbarriers, one page in flight
// at a time (queued copies would delay every hand-off behind them in L2), never waiting for
// activations, so the next units' weights load while the consumers wait or compute. The other
// warps are consumers: per unit they wait for its inputs, compute from the pages, store bf16
// outputs and bump the phase's counter.
//
// Synchronisation between blocks (docs/megakernel.md has the argument in full):
// - Activations are plain bf16 arrays. A unit stores its outputs, its consumers meet at a barrier
//   and one thread release-adds the phase counter; a consumer leader acquires it until the phase
//   is complete for this token, then its block reads the inputs through L2.
// - A few small words are tagged 64-bit words (value, epoch + 1): lm_head partials, arrival bases
//   and the token word (the next greedy id).
// - The KV cache is plain bf16. Every thread that stored cache rows fences, the block meets at a
//   barrier, and one thread release-adds the layer's cache counter; a producer acquires that
//   counter (every append of the earlier tokens) and fences the async proxy before streaming
//   cache rows.
// - Attention chunks of one kv head arrive on an atomic counter; the last one merges them (in
//   chunk order), so o_proj reads one merged vector.
// - Buffers are per layer and every unit of token t completes before the argmax of t, on which
//   token t + 1's first units wait, so nothing is overwritten while it is still being read.
// - Every spin has a deadline: on timeout the kernel records where it stood and all blocks leave.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "core/async_copy.cuh"
#include "core/block_reduce.cuh"
#include "core/error.h"
#include "core/memory_order.cuh"
#include "models/qwen3/decode_megakernel_plan.h"

namespace models::qwen3::megakernel {
namespace {

constexpr int kMaxThreads = 32 * (kMaxConsumerWarps + 1);

// The kernel's device code exists for sm_90 and later only (bulk copies, mbarrier transactions).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
constexpr int kGatherBatch = 8;
constexpr float kLog2e = 1.4426950408889634f;

using core::bulk_copy;
using core::evict_first_policy;
using core::globaltimer;
using core::mbar_arrive;
using core::mbar_arrive_expect_tx;
using core::mbar_init;
using core::mbar_test;
using core::smem_addr;

using core::atom_add_acq_rel;
using core::ld_acquire_u32;
using core::ld_acquire_u64;
using core::ld_relaxed_u32;
using core::red_add_relaxed;
using core::red_add_release;
using core::st_release_u64;

// Tagged words: a value (low half) and the epoch + 1 of the token that wrote it (high half).
__device__ __forceinline__ std::uint64_t ld_tagged(const std::uint64_t* p) { return core::ld_relaxed_u64(p); }

__device__ __forceinline__ void st_tagged_u32(std::uint64_t* p, std::uint32_t value, std::uint32_t tag) {
  core::st_relaxed_u64(p, (static_cast<std::uint64_t>(tag) << 32) | value);
}

__device__ __forceinline__ void st_tagged(std::uint64_t* p, float value, std::uint32_t tag) {
  st_tagged_u32(p, __float_as_uint(value), tag);
}

__device__ __forceinline__ std::uint32_t tag_of(std::uint64_t v) { return static_cast<std::uint32_t>(v >> 32); }
__device__ __forceinline__ float value_of(std::uint64_t v) { return __uint_as_float(static_cast<std::uint32_t>(v)); }

// Named barrier 1 over the consumer warps (the producer warp never joins it).
__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// Barrier over the consumer warps that also tells every thread whether any thread passed true.
__device__ __forceinline__ bool consumer_any(bool pred, int threads) {
  std::uint32_t result;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\t"
      "setp.ne.u32 p, %1, 0;\n\t"
      "bar.red.or.pred q, 1, %2, p;\n\t"
      "selp.u32 %0, 1, 0, q;\n\t}"
      : "=r"(result)
      : "r"(static_cast<std::uint32_t>(pred)), "r"(threads)
      : "memory");
  return result != 0;
}

using core::warp_sum;

__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}

__device__ __forceinline__ std::uint16_t float_to_bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float round_bf16(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }

// The 8 bf16 values of a 16-byte word.
__device__ __forceinline__ void unpack8(const uint4& w, float (&v)[8]) {
  v[0] = __uint_as_float(w.x << 16);
  v[1] = __uint_as_float(w.x & 0xffff0000u);
  v[2] = __uint_as_float(w.y << 16);
  v[3] = __uint_as_float(w.y & 0xffff0000u);
  v[4] = __uint_as_float(w.z << 16);
  v[5] = __uint_as_float(w.z & 0xffff0000u);
  v[6] = __uint_as_float(w.w << 16);
  v[7] = __uint_as_float(w.w & 0xffff0000u);
}

// 8 bf16 weights (one 16-byte word) times 8 fp32 inputs into 4 independent accumulators
// (elements k and k + 4 into a[k]): four dependency chains instead of one, so a warp keeps the
// FMA pipe busy (one chain per row left the products latency-bound at about 1 FMA a cycle).
__device__ __forceinline__ void fma8(const uint4& w, const float4& x0, const float4& x1, float (&a)[4]) {
  a[0] = fmaf(__uint_as_float(w.x << 16), x0.x, a[0]);
  a[1] = fmaf(__uint_as_float(w.x & 0xffff0000u), x0.y, a[1]);
  a[2] = fmaf(__uint_as_float(w.y << 16), x0.z, a[2]);
  a[3] = fmaf(__uint_as_float(w.y & 0xffff0000u), x0.w, a[3]);
  a[0] = fmaf(__uint_as_float(w.z << 16), x1.x, a[0]);
  a[1] = fmaf(__uint_as_float(w.z & 0xffff0000u), x1.y, a[1]);
  a[2] = fmaf(__uint_as_float(w.w << 16), x1.z, a[2]);
  a[3] = fmaf(__uint_as_float(w.w & 0xffff0000u), x1.w, a[3]);
}

// E consecutive bf16 values (8 or 4 aligned bytes) as floats.
template <int E>
__device__ __forceinline__ void load_bf16(const std::uint16_t* src, float (&out)[E]) {
  if constexpr (E == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    out[0] = __uint_as_float(w.x << 16);
    out[1] = __uint_as_float(w.x & 0xffff0000u);
    out[2] = __uint_as_float(w.y << 16);
    out[3] = __uint_as_float(w.y & 0xffff0000u);
  } else {
    static_assert(E == 2);
    const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(src);
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
  }
}

// ---------------------------------------------------------------- waiting with a deadline

struct Where {
  int kind;
  int layer;
  int token;
};

// Spin bookkeeping: every 256 spins, checks whether another block aborted and whether this wait
// passed the deadline (then records it and makes every block leave).
struct Waiter {
  const Params& p;
  Where where;
  int what;
  std::uint64_t deadline = 0;
  std::uint32_t spins = 0;

  __device__ Waiter(const Params& params, Where w, int what_) : p(params), where(w), what(what_) {}

  __device__ __forceinline__ bool again(std::uint32_t want, std::uint32_t seen) {
    if ((++spins & 255u) != 0) return true;
    return check(want, seen);
  }

  // Out of line: one copy of the deadline and abort bookkeeping instead of one per spin site.
  __device__ __noinline__ bool check(std::uint32_t want, std::uint32_t seen) {
    if (ld_relaxed_u32(reinterpret_cast<const std::uint32_t*>(&p.abort->flag)) != 0) return false;
    const std::uint64_t now = globaltimer();
    if (deadline == 0) {
      deadline = now + static_cast<std::uint64_t>(p.timeout_ns);
      return true;
    }
    if (now < deadline) return true;
    if (atomicCAS(&p.abort->flag, 0, 1) == 0) {
      p.abort->block = static_cast<int>(blockIdx.x);
      p.abort->kind = where.kind;
      p.abort->layer = where.layer;
      p.abort->token = where.token;
      p.abort->what = what;
      p.abort->want = want;
      p.abort->seen = seen;
      __threadfence();
    }
    return false;
  }
};

// The page ring as both sides walk it: slot and phase parity of the next page.
struct Ring {
  int slot = 0;
  std::uint32_t phase = 0;
  __device__ void advance(int pages) {
    if (++slot == pages) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// ---------------------------------------------------------------- producer

__device__ const std::uint16_t* matrix_of(const Params& p, const Unit& u) {
  if (u.kind == UnitKind::lm_head) return p.head;
  const LayerWeights& w = p.layers[u.layer];
  switch (u.kind) {
    case UnitKind::qkv: return w.qkv;
    case UnitKind::o_proj: return w.o_proj;
    case UnitKind::gate_up: return w.gate_up;
    default: return w.down;
  }
}

// After an abort: waits (briefly) until the copies of the last pages issued have landed, so none
// writes shared memory after the block has left.
__device__ void drain(std::uint64_t* full, const Ring& ring, int pages, std::int64_t issued) {
  Ring r = ring;
  for (std::int64_t k = 0; k < pages && k < issued; ++k) {
    if (--r.slot < 0) {
      r.slot = pages - 1;
      r.phase ^= 1u;
    }
    const std::uint64_t until = globaltimer() + 10000000;  // 10 ms
    while (!mbar_test(full + r.slot, r.phase) && globaltimer() < until) {
    }
  }
}

// One thread streams every page of the block's units, in the consumers' order.
__device__ void run_producer(const Params& p, unsigned char* smem, std::uint64_t* full, std::uint64_t* empty) {
  const Dims& d = p.dims;
  const Geometry& g = p.geo;
  const Unit* units = p.units + p.block_begin[blockIdx.x];
  const int unit_count = p.block_begin[blockIdx.x + 1] - p.block_begin[blockIdx.x];
  const std::uint64_t policy = evict_first_policy();
  const bool hint = p.evict_first != 0;
  Ring ring;
  Ring oldest;  // the page issued `g.inflight` pages before the next one
  std::int64_t issued = 0;
  for (int t = 0; t < p.tokens; ++t) {
    const std::int64_t position = p.position + t;
    const std::uint32_t epoch = p.epoch + static_cast<std::uint32_t>(t);
    int visible_layer = -1;
    for (int i = 0; i < unit_count; ++i) {
      const Unit u = units[i];
      const int pages = unit_pages(u, position, g, d);
      if (pages == 0) continue;
      if (u.kind == UnitKind::attention && visible_layer != u.layer) {
        // Cache rows of earlier tokens: wait until every append of this layer by an earlier token
        // was released (kv_heads per token), then order the async proxy after those stores.
        const std::uint32_t* appended = p.counters + kCounterStride * p.counter_index.cache(u.layer);
        const std::uint32_t want = static_cast<std::uint32_t>(d.kv_heads) * epoch;
        Waiter w(p, {-1, u.layer, t}, wait_cache);
        std::uint32_t seen;
        while ((seen = ld_acquire_u32(appended)) < want) {
          if (!w.again(want, seen)) return drain(full, ring, g.pages, issued);
        }
        core::fence_proxy_async_global();
        visible_layer = u.layer;
      }
      for (int k = 0; k < pages; ++k) {
        {
          Waiter w(p, {-1, u.layer, t}, wait_page_empty);
          while (!mbar_test(empty + ring.slot, ring.phase ^ 1u)) {
            if (!w.again(ring.phase ^ 1u, 0)) return drain(full, ring, g.pages, issued);
          }
        }
        if (g.inflight > 0 && issued >= g.inflight) {
          // At most g.inflight pages in flight: copies queued in L2 delay every hand-off behind them.
          Waiter w(p, {-1, u.layer, t}, wait_page_full);
          while (!mbar_test(full + oldest.slot, oldest.phase)) {
            if (!w.again(oldest.phase, 0)) return drain(full, ring, g.pages, issued);
          }
          oldest.advance(g.pages);
        }
        unsigned char* dst = smem + static_cast<std::size_t>(ring.slot) * g.page_bytes;
        std::uint64_t* bar = full + ring.slot;
        const Span s = page_span(u, position, k, g, d);
        if (u.kind == UnitKind::attention) {
          const std::int64_t row =
              ((static_cast<std::int64_t>(u.layer) * d.kv_heads + u.a) * p.capacity + s.first) * d.head_dim;
          const std::uint32_t bytes = static_cast<std::uint32_t>(s.count) * d.head_dim * 2;
          mbar_arrive_expect_tx(bar, 2 * bytes);
          bulk_copy(dst, p.k_cache + row, bytes, bar, policy, hint);
          bulk_copy(dst + positions_per_page(g, d) * d.head_dim * 2, p.v_cache + row, bytes, bar, policy, hint);
        } else {
          const int length = row_length(u.kind, d);
          const std::uint16_t* w = matrix_of(p, u);
          const std::int64_t row = u.a + s.first;
          const std::uint32_t bytes = static_cast<std::uint32_t>(s.count) * length * 2;
          if (u.kind == UnitKind::gate_up) {
            mbar_arrive_expect_tx(bar, 2 * bytes);
            bulk_copy(dst, w + row * length, bytes, bar, policy, hint);
            bulk_copy(dst + bytes, w + (d.ffn + row) * length, bytes, bar, policy, hint);
          } else {
            mbar_arrive_expect_tx(bar, bytes);
            bulk_copy(dst, w + row * length, bytes, bar, policy, hint);
          }
        }
        ring.advance(g.pages);
        ++issued;
      }
    }
  }
}

// ---------------------------------------------------------------- consumers

constexpr int kNormRegs = 16;
constexpr int kRowsPerPass = 4;  // rows (or gate/up row pairs) a warp's pass of a matrix unit takes

// A norm weight as one consumer thread uses it: its first kNormRegs elements in registers.
struct NormWeights {
  float w[kNormRegs];
  const std::uint16_t* src;
};

struct Consumer {
  const Params& p;
  unsigned char* smem;
  std::uint64_t* full;
  std::uint64_t* empty;
  int tid, warp, lane, threads, warps;
  Ring ring;
  bool ok = true;
  // Shared-memory areas.
  float* vec_a;    // input vector, elements 8c..8c+3 at [4c..4c+3]
  float* vec_b;    // elements 8c+4..8c+7 at [4c..4c+3]
  float* scratch;  // attention scratch (aliases the vector)
  float* red;      // [warps] block reductions
  float* best_v;   // [warps]
  int* best_i;     // [warps]
  int* bcast;      // [4]
  float* merge;    // [merge_floats]
  float* rows;     // [max unit rows] residual rows
  // Diagnostics: this unit's trace row (null unless tracing), marks 1..6 between start and end.
  std::uint64_t* trace_row = nullptr;
  std::uint64_t page_wait_ns = 0;
  __device__ void mark(int k) {
    if (trace_row != nullptr && tid == 0) trace_row[k] = globaltimer();
  }
  __device__ void end_trace() {
    if (trace_row != nullptr && tid == 0) {
      trace_row[kTraceEnd] = globaltimer();
      trace_row[kTraceWords - 1] = page_wait_ns;
    }
    page_wait_ns = 0;
  }
  // The token being decoded.
  int t = 0;
  std::int64_t position = 0;
  std::uint32_t epoch = 0;
  std::uint32_t tag = 0;  // epoch + 1: what this token's outputs carry

  __device__ Consumer(const Params& params, unsigned char* s, std::uint64_t* f, std::uint64_t* e)
      : p(params), smem(s), full(f), empty(e) {
    tid = static_cast<int>(threadIdx.x) - 32;
    warp = tid / 32;
    lane = tid % 32;
    warps = p.geo.consumer_warps;
    threads = warps * 32;
    vec_a = reinterpret_cast<float*>(smem + p.smem_vec);
    vec_b = vec_a + p.vec_floats / 2;
    scratch = vec_a;
    red = reinterpret_cast<float*>(smem + p.smem_small);
    best_v = red + warps;
    best_i = reinterpret_cast<int*>(best_v + warps);
    bcast = best_i + warps;
    merge = reinterpret_cast<float*>(bcast + 4);
    rows = merge + p.merge_floats;
  }

  __device__ void begin_token(int token) {
    t = token;
    position = p.position + token;
    epoch = p.epoch + static_cast<std::uint32_t>(token);
    tag = epoch + 1;
  }

  __device__ std::uint32_t* counter(int index) const { return p.counters + kCounterStride * index; }

  __device__ void vec_set(int j, float v) {
    const int c = j >> 3, o = j & 7;
    (o < 4 ? vec_a : vec_b)[4 * c + (o & 3)] = v;
  }
  __device__ float vec_get(int j) const {
    const int c = j >> 3, o = j & 7;
    return (o < 4 ? vec_a : vec_b)[4 * c + (o & 3)];
  }

  // The leader acquires a phase counter once it reaches `want` (every unit of the phase released
  // its outputs), then all consumers go on: the barrier orders their reads after the acquire.
  __device__ void wait_counter(int index, std::uint32_t want, Where where) {
    if (tid == 0 && ok) {
      const std::uint32_t* c = counter(index);
      Waiter w(p, where, WaitWhat::wait_counter);
      std::uint32_t seen;
      while ((seen = ld_acquire_u32(c)) < want) {
        if (!w.again(want, seen)) {
          ok = false;
          break;
        }
      }
    }
    consumer_sync(threads);
  }

  // A tagged word of this token (spins until it carries `tag`).
  __device__ std::uint64_t await_word(const std::uint64_t* src, std::uint64_t v, std::uint32_t want, Where where) {
    return await_tag([src] { return ld_tagged(src); }, v, want, where);
  }

  // `v`, or what load() returns next, once its tag is `want` (spins with the deadline).
  template <class Load>
  __device__ std::uint64_t await_tag(Load load, std::uint64_t v, std::uint32_t want, Where where) {
    if (tag_of(v) == want) return v;
    Waiter w(p, where, wait_tagged);
    while (tag_of(v) != want) {
      if (!ok || !w.again(want, tag_of(v))) {
        ok = false;
        break;
      }
      v = load();
    }
    return v;
  }

  // For j < n: use(j, value of the word at address_of(j)) once it carries this token's tag.
  // Element j goes to consumer thread j % threads; loads are issued kGatherBatch at a time before
  // any wait.
  template <class AddressOf, class Use>
  __device__ void gather_words(int n, Where where, AddressOf address_of, Use use) {
    for (int start = tid; start < n; start += kGatherBatch * threads) {
      std::uint64_t v[kGatherBatch];
#pragma unroll
      for (int i = 0; i < kGatherBatch; ++i) {
        const int j = start + i * threads;
        v[i] = j < n ? ld_tagged(address_of(j)) : 0;
      }
#pragma unroll
      for (int i = 0; i < kGatherBatch; ++i) {
        const int j = start + i * threads;
        if (j < n) use(j, value_of(await_word(address_of(j), v[i], tag, where)));
      }
    }
  }
  // The same with addresses base + index_of(j).
  template <class IndexOf, class Use>
  __device__ void gather(const std::uint64_t* base, int n, Where where, IndexOf index_of, Use use) {
    gather_words(
        n, where, [&](int j) { return base + index_of(j); }, use);
  }

  // For j < n: use(j, value) of the bf16 activations src[j] (16-byte aligned, n a multiple of 8),
  // read through L2 after the phase counter's acquire. Chunk c (elements 8c..8c+7) goes to
  // consumer thread c % threads.
  template <class Use>
  __device__ void load_bf16_vector(const std::uint16_t* src, int n, Use use) {
    const uint4* words = reinterpret_cast<const uint4*>(src);
    for (int c = tid; c < n / 8; c += threads) {
      float v[8];
      unpack8(__ldcg(words + c), v);
#pragma unroll
      for (int e = 0; e < 8; ++e) use(8 * c + e, v[e]);
    }
  }

  // rows[i] = src[i] for i < n (bf16 activations at any alignment).
  __device__ void load_bf16_rows(const std::uint16_t* src, int n, float* out) {
    for (int i = tid; i < n; i += threads) out[i] = bf16_bits_to_float(__ldcg(src + i));
  }

  // Sum over the consumer threads, the same on every thread, in a fixed order.
  __device__ float block_sum(float v) {
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    consumer_sync(threads);
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += red[w];
    consumer_sync(threads);
    return s;
  }

  // Waits until the page at `at` has landed.
  __device__ void page_wait_at(const Ring& at, Where where) {
    if (ok && !mbar_test(full + at.slot, at.phase)) {
      const std::uint64_t begun = trace_row != nullptr ? globaltimer() : 0;
      Waiter w(p, where, wait_page_full);
      while (!mbar_test(full + at.slot, at.phase)) {
        if (!w.again(at.phase, 0)) {
          ok = false;
          break;
        }
      }
      if (trace_row != nullptr) page_wait_ns += globaltimer() - begun;
    }
  }

  __device__ const unsigned char* page_wait(Where where) {
    page_wait_at(ring, where);
    return smem + static_cast<std::size_t>(ring.slot) * p.geo.page_bytes;
  }

  __device__ void page_release() {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + ring.slot);
    ring.advance(p.geo.pages);
  }

  // End of a unit: every consumer's writes are issued; false (on every consumer) when some wait
  // failed, so all of them leave together.
  __device__ bool finish() {
    if (consumer_any(!ok, threads)) ok = false;
    return ok;
  }

  // The token word once it carries the previous token's tag, acquired: the previous token's
  // units are done with every buffer this token rewrites.
  __device__ std::uint64_t await_token(Where where) {
    const auto load = [this] { return ld_acquire_u64(p.token); };
    return await_tag(load, load(), epoch, where);
  }

  // The id fed at this token (leader reads, all get it). Greedy: the argmax after the previous
  // token; teacher forcing: the given id, but from the second token of a launch on only after the
  // previous token finished (its units must be done with the buffers this token rewrites).
  __device__ int token_id(Where where) {
    if (tid == 0) {
      std::uint64_t v = 0;
      if ((p.greedy != 0 || t > 0) && ok) v = await_token(where);
      int id = p.greedy != 0      ? static_cast<int>(static_cast<std::uint32_t>(v))
               : p.ids != nullptr ? p.ids[t]
                                  : p.host_id;
      if (id < 0 || id >= p.dims.vocab) id = 0;
      bcast[0] = id;
    }
    consumer_sync(threads);
    const int id = bcast[0];
    return id;
  }

  // This thread's elements of a norm weight (j = tid + k * threads), loaded before a unit waits
  // for its input so that their latency hides behind the wait; elements past kNormRegs * threads
  // are read when used.
  __device__ void prefetch_norm(const std::uint16_t* weight, int d, NormWeights& w) const {
    w.src = weight;
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int j = tid + k * threads;
      w.w[k] = j < d ? bf16_bits_to_float(weight[j]) : 0.0f;
    }
  }

  // x of layer l (l = 0: the token's embedding row) into the vector, RMS-normalised and scaled
  // by `weight`. Ends with the vector complete.
  __device__ void load_normed_input(int layer, const NormWeights& weight, Where where) {
    const int d = p.dims.hidden;
    float ss = 0.0f;
    if (layer == 0) {
      const int id = token_id(where);
      const std::uint16_t* row = p.embed + static_cast<std::int64_t>(id) * d;
      for (int j = tid; j < d; j += threads) {
        const float v = bf16_bits_to_float(row[j]);
        vec_set(j, v);
        ss += v * v;
      }
    } else {
      load_bf16_vector(p.x + static_cast<std::int64_t>(layer) * d, d, [&](int j, float v) {
        vec_set(j, v);
        ss += v * v;
      });
    }
    normalise(d, ss, weight);
  }

  // vec[j] = bf16(vec[j] * rstd * weight[j]) (rounded as the plain decoder rounds its normed
  // input), then a barrier. `ss`: this thread's part of the sum of squares; block_sum's barriers
  // make every element of the vector visible to every thread first.
  __device__ void normalise(int d, float ss, const NormWeights& weight) {
    const float rstd = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(d) + p.dims.eps);
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int j = tid + k * threads;
      if (j < d) vec_set(j, round_bf16(vec_get(j) * rstd * weight.w[k]));
    }
    for (int j = tid + kNormRegs * threads; j < d; j += threads)
      vec_set(j, round_bf16(vec_get(j) * rstd * bf16_bits_to_float(weight.src[j])));
    consumer_sync(threads);
  }

  // Slot and parity of the page k places ahead of the ring's next one (k < pages).
  __device__ Ring ahead(int k) const {
    Ring r = ring;
    r.slot += k;
    if (r.slot >= p.geo.pages) {
      r.slot -= p.geo.pages;
      r.phase ^= 1u;
    }
    return r;
  }

  // Rows [u.a, u.b) of the unit's matrix (streamed in pages) times the vector: epi(row, dot) on
  // lane 0 of the warp that computed it; gate_up: epi(row, gate dot, up dot). A unit whose pages
  // fit the ring is taken in one window (every page waited for, then all rows at once, then every
  // page released); a longer one (lm_head) in windows of half the ring, so the producer fills one
  // half while the consumers read the other. Each warp takes kRowsPerPass rows (or row pairs) per
  // pass, reading each input chunk once for all of them; every dot product runs in the same order
  // whatever the window (lane partition, then the xor butterfly).
  template <class Epi>
  __device__ void matvec(const Unit& u, Epi epi, Where where) {
    // Rows per pass: one on units of one row a warp (o_proj, down), else kRowsPerPass. The code is
    // kept small on purpose: one token runs every unit kind once per layer, and a larger body
    // (more instances, unrolled loops) measured slower (instruction fetch, not arithmetic, bounds
    // these short units).
    const int per_warp = (u.b - u.a + warps - 1) / warps;
    if (u.kind == UnitKind::gate_up) return matvec_rows<true, kRowsPerPass>(u, epi, where);
    if (per_warp <= 1) return matvec_rows<false, 1>(u, epi, where);
    return matvec_rows<false, kRowsPerPass>(u, epi, where);
  }

  template <bool Pairs, int R, class Epi>
  __device__ __forceinline__ void matvec_rows(const Unit& u, Epi epi, Where where) {
    const int length = row_length(u.kind, p.dims);
    const int per_page = p.geo.page_bytes / row_bytes(u.kind, p.dims);
    const int chunks = length / 8;
    const float4* xa = reinterpret_cast<const float4*>(vec_a);
    const float4* xb = reinterpret_cast<const float4*>(vec_b);
    const int n = u.b - u.a;
    const int total_pages = (n + per_page - 1) / per_page;
    const int window = total_pages <= p.geo.pages ? total_pages : max(1, p.geo.pages / 2);
    for (int page0 = 0; page0 < total_pages; page0 += window) {
      const int pages = min(window, total_pages - page0);
      for (int k = 0; k < pages; ++k) page_wait_at(ahead(k), where);
      const int first = page0 * per_page;
      const int count = min(pages * per_page, n - first);
      // Row i of the window: page i / per_page, slot i % per_page; with pairs the up row follows
      // the page's gate rows.
      auto row_ptr = [&](int i, bool up) {
        const int k = i / per_page, j = i % per_page;
        const int page_rows = min(per_page, n - first - k * per_page);
        return reinterpret_cast<const uint4*>(smem + static_cast<std::size_t>(ahead(k).slot) * p.geo.page_bytes +
                                              static_cast<std::size_t>(up ? page_rows + j : j) * length * 2);
      };
      for (int i0 = warp; i0 < count; i0 += R * warps) {
        const uint4* rows[R];
        const uint4* ups[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int i = i0 + r * warps < count ? i0 + r * warps : i0;
          rows[r] = row_ptr(i, false);
          ups[r] = Pairs ? row_ptr(i, true) : rows[r];
        }
        float sa[R][4], ta[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int k = 0; k < 4; ++k) sa[r][k] = ta[r][k] = 0.0f;
        }
#pragma unroll 1
        for (int c = lane; c < chunks; c += 32) {
          const float4 x0 = xa[c], x1 = xb[c];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            fma8(rows[r][c], x0, x1, sa[r]);
            if constexpr (Pairs) fma8(ups[r][c], x0, x1, ta[r]);
          }
        }
        float s[R], t[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s[r] = (sa[r][0] + sa[r][1]) + (sa[r][2] + sa[r][3]);
          t[r] = (ta[r][0] + ta[r][1]) + (ta[r][2] + ta[r][3]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
            if constexpr (Pairs) t[r] += __shfl_xor_sync(0xffffffffu, t[r], o);
          }
        }
        if (lane == 0) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (i0 + r * warps < count) epi(u.a + first + i0 + r * warps, s[r], t[r]);
          }
        }
      }
      __syncwarp();
      for (int k = 0; k < pages; ++k) {
        if (lane == 0) mbar_arrive(empty + ring.slot);
        ring.advance(p.geo.pages);
      }
    }
  }
};

// ---------------------------------------------------------------- units

// A residual-adding product's output, rounded as the plain decoder rounds: bf16(x + bf16(dot)).
__device__ __forceinline__ std::uint16_t residual_sum(float x, float dot) {
  return float_to_bf16_bits(x + round_bf16(dot));
}

// Every unit's outputs are stored before finish()'s barrier; then one release-add of its phase
// counter publishes them (and orders its reads before any later overwrite).
__device__ void publish(Consumer& c, int counter) {
  if (c.tid == 0) red_add_release(c.counter(counter), 1);
}

__device__ __forceinline__ void run_qkv(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Dims& d = p.dims;
  const int l = u.layer;
  const Where where{static_cast<int>(u.kind), l, c.t};
  NormWeights norm;
  c.prefetch_norm(p.layers[l].input_norm, d.hidden, norm);
  if (l > 0) c.wait_counter(p.counter_index.down(l - 1), p.down_units * c.tag, where);
  c.mark(1);
  c.load_normed_input(l, norm, where);
  c.mark(2);
  if (l == 0 && u.index == 0 && p.greedy != 0 && p.ids_out != nullptr && c.tid == 0) p.ids_out[c.t] = c.bcast[0];
  std::uint16_t* out = p.qkv + static_cast<std::int64_t>(l) * d.qkv_size;
  c.matvec(
      u, [&](int row, float v, float) { out[row] = float_to_bf16_bits(v); }, where);
  c.mark(3);
  if (!c.finish()) return;
  if (c.tid == 0) {
    for (int g = 0; g < d.kv_heads; ++g) {
      if (qkv_rows_touch_group(u.a, u.b, g, d)) red_add_release(c.counter(p.counter_index.group(l, g)), 1);
    }
  }
}

// Attention of kv head u.a's query heads over chunk u.b of the sequence: online softmax per warp
// over its positions, merged across warps into (max, sum, unnormalised output) per head. G: the
// most query heads per kv head it handles (registers hold G accumulators).
template <int E, int G>
__device__ __forceinline__ void run_attention(Consumer& c, const Unit& u) {
  constexpr int hd = 32 * E;
  constexpr int half = hd / 2;
  const Params& p = c.p;
  const Dims& d = p.dims;
  const Geometry& geo = p.geo;
  const int l = u.layer, g = u.a, chunk = u.b, group = d.group;
  const Where where{static_cast<int>(u.kind), l, c.t};
  const AttentionRange range = attention_range(u, c.position, geo, d);
  if (!range.active) {
    if (c.finish() && c.tid == 0) red_add_relaxed(c.counter(p.counter_index.attention(l)), 1);  // wrote nothing
    return;
  }
  const bool writer = range.holds_current;

  float* raw = c.scratch;                               // [(group + 2) * hd] q heads, k, v as produced
  float* q = raw + (group + 2) * hd;                    // [group * hd] normed, rotated, scaled by log2(e)/sqrt(hd)
  float* k_new = q + group * hd;                        // [hd] this token's k (bf16-rounded)
  float* v_new = k_new + hd;                            // [hd]
  float* warp_state = v_new + hd;                       // [warps * (hd + 2)]
  float* head_state = warp_state + c.warps * (hd + 2);  // [group * (hd + 2)] (max, sum, output) per head
  float* weights = head_state + group * (hd + 2);       // [group * max_splits * 2] merge scratch

  // This lane's q/k norm weights and RoPE angles, loaded before the wait.
  const LayerWeights& lw = p.layers[l];
  const float* rope = p.rope + c.position * hd;
  float qn[E], kn[E], cs[E / 2], sn[E / 2];
#pragma unroll
  for (int k = 0; k < E / 2; ++k) {
    const int i = c.lane + 32 * k;
    qn[k] = bf16_bits_to_float(lw.q_norm[i]);
    qn[k + E / 2] = bf16_bits_to_float(lw.q_norm[i + half]);
    kn[k] = bf16_bits_to_float(lw.k_norm[i]);
    kn[k + E / 2] = bf16_bits_to_float(lw.k_norm[i + half]);
    cs[k] = rope[2 * i];
    sn[k] = rope[2 * i + 1];
  }
  c.wait_counter(p.counter_index.group(l, g), static_cast<std::uint32_t>(p.group_counts[g]) * c.tag, where);
  c.mark(1);
  // The arrival count when this token began (published by the previous token's merger).
  std::uint64_t* base_word = p.base + static_cast<std::int64_t>(l) * d.kv_heads + g;
  const std::uint64_t base_first = c.tid == 0 ? ld_tagged(base_word) : 0;
  const std::int64_t q0 = static_cast<std::int64_t>(g) * group * hd;
  const std::int64_t k0 = d.q_size + static_cast<std::int64_t>(g) * hd;
  const std::int64_t v0 = d.q_size + d.kv_size + static_cast<std::int64_t>(g) * hd;
  const std::uint16_t* qkv = p.qkv + static_cast<std::int64_t>(l) * d.qkv_size;
  c.load_bf16_vector(qkv + q0, group * hd, [&](int j, float v) { raw[j] = v; });
  c.load_bf16_vector(qkv + k0, hd, [&](int j, float v) { raw[group * hd + j] = v; });
  c.load_bf16_vector(qkv + v0, hd, [&](int j, float v) { raw[(group + 1) * hd + j] = v; });
  consumer_sync(c.threads);
  c.mark(2);

  // Per-head RMSNorm and RoPE of the query heads (vectors 0..group-1) and of k (vector group).
  const std::int64_t cache_row = ((static_cast<std::int64_t>(l) * d.kv_heads + g) * p.capacity + c.position) * hd;
  const float q_scale = kLog2e / sqrtf(static_cast<float>(hd));
  bool wrote_cache = false;
  for (int vi = c.warp; vi <= group; vi += c.warps) {
    const float* x = raw + vi * hd;
    float lo[E / 2], hi[E / 2];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < E / 2; ++k) {
      lo[k] = x[c.lane + 32 * k];
      hi[k] = x[c.lane + 32 * k + half];
      ss += lo[k] * lo[k] + hi[k] * hi[k];
    }
    const float rstd = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(hd) + d.eps);
    const bool is_q = vi < group;
#pragma unroll
    for (int k = 0; k < E / 2; ++k) {
      const int i = c.lane + 32 * k;
      // Rounded as the plain decoder rounds: the normed head, then the rotated one.
      const float a = round_bf16(lo[k] * rstd * (is_q ? qn[k] : kn[k]));
      const float b = round_bf16(hi[k] * rstd * (is_q ? qn[k + E / 2] : kn[k + E / 2]));
      const float first = a * cs[k] - b * sn[k];
      const float second = b * cs[k] + a * sn[k];
      if (vi < group) {
        q[vi * hd + i] = round_bf16(first) * q_scale;
        q[vi * hd + i + half] = round_bf16(second) * q_scale;
      } else {
        const std::uint16_t b0 = float_to_bf16_bits(first), b1 = float_to_bf16_bits(second);
        k_new[i] = bf16_bits_to_float(b0);
        k_new[i + half] = bf16_bits_to_float(b1);
        if (writer) {
          p.k_cache[cache_row + i] = b0;
          p.k_cache[cache_row + i + half] = b1;
          wrote_cache = true;
        }
      }
    }
  }
  for (int i = c.tid; i < hd; i += c.threads) {
    const std::uint16_t bits = float_to_bf16_bits(raw[(group + 1) * hd + i]);
    v_new[i] = bf16_bits_to_float(bits);
    if (writer) {
      p.v_cache[cache_row + i] = bits;
      wrote_cache = true;
    }
  }
  consumer_sync(c.threads);
  c.mark(3);

  // Online softmax (base 2) per warp. A writer's warp 0 takes the current position, the other
  // warps the cached ones.
  // The query heads stay in shared memory (registers hold the accumulators).
  float acc[G][E], m[G], sum[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    sum[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[h][e] = 0.0f;
    }
  }
  auto update = [&](const float(&kf)[E], const float(&vf)[E]) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (h < group) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(q[h * hd + c.lane * E + e], kf[e], s);
        s = warp_sum(s);
        const float m_new = fmaxf(m[h], s);
        const float scale = exp2f(m[h] - m_new);
        const float pr = exp2f(s - m_new);
        sum[h] = sum[h] * scale + pr;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = fmaf(pr, vf[e], acc[h][e] * scale);
        m[h] = m_new;
      }
    }
  };
  // kPositions cached positions at once per warp: independent dot products and shuffles in flight,
  // one rescale per group of positions. 16 elements of k and of v a lane where the group is small
  // (measured: 4 positions instead of 2 at head_dim 128, group 2: 8K context 42.5 -> 45.9% of
  // the floor), 8 where the accumulators of 8 heads leave fewer registers.
  constexpr int kPositions = (G <= 2 ? 16 : 8) / E;
  auto update_many = [&](const float(&kf)[kPositions][E], const float(&vf)[kPositions][E], int valid) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (h < group) {
        float s[kPositions];
#pragma unroll
        for (int i = 0; i < kPositions; ++i) {
          s[i] = 0.0f;
#pragma unroll
          for (int e = 0; e < E; ++e) s[i] = fmaf(q[h * hd + c.lane * E + e], kf[i][e], s[i]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
          for (int i = 0; i < kPositions; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
        }
        float m_new = m[h];
#pragma unroll
        for (int i = 0; i < kPositions; ++i) {
          if (i >= valid) s[i] = -INFINITY;
          m_new = fmaxf(m_new, s[i]);
        }
        const float scale = exp2f(m[h] - m_new);
        float pr[kPositions];
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < kPositions; ++i) {
          pr[i] = exp2f(s[i] - m_new);
          total += pr[i];
        }
        sum[h] = sum[h] * scale + total;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          float a = acc[h][e] * scale;
#pragma unroll
          for (int i = 0; i < kPositions; ++i) a = fmaf(pr[i], vf[i][e], a);
          acc[h][e] = a;
        }
        m[h] = m_new;
      }
    }
  };
  const bool split_warps = writer && c.warps > 1;
  const int first_warp = split_warps ? 1 : 0;
  const int cache_warps = c.warps - first_warp;
  const int per_page = positions_per_page(geo, d);
  const int pages = unit_pages(u, c.position, geo, d);
  for (int k = 0; k < pages; ++k) {
    const unsigned char* page = c.page_wait(where);
    const int count = page_span(u, c.position, k, geo, d).count;
    if (c.warp >= first_warp) {
      const std::uint16_t* kp = reinterpret_cast<const std::uint16_t*>(page);
      const std::uint16_t* vp = kp + per_page * hd;
      // Warp w takes positions [kPositions * w', kPositions * (w' + 1)) of every round.
      for (int j0 = (c.warp - first_warp) * kPositions; j0 < count; j0 += cache_warps * kPositions) {
        const int valid = min(kPositions, count - j0);
        float kf[kPositions][E], vf[kPositions][E];
#pragma unroll
        for (int i = 0; i < kPositions; ++i) {
          const int j = i < valid ? j0 + i : j0;
          load_bf16<E>(kp + j * hd + c.lane * E, kf[i]);
          load_bf16<E>(vp + j * hd + c.lane * E, vf[i]);
        }
        update_many(kf, vf, valid);
      }
    }
    c.page_release();
  }
  c.mark(4);
  if (writer && c.warp == 0) {
    float kf[E], vf[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kf[e] = k_new[c.lane * E + e];
      vf[e] = v_new[c.lane * E + e];
    }
    update(kf, vf);
  }

  // Merge the warps: (max, sum, unnormalised output) of each query head of the group.
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h < group) {
      float* mine = warp_state + c.warp * (hd + 2);
      if (c.lane == 0) {
        mine[0] = m[h];
        mine[1] = sum[h];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) mine[2 + c.lane * E + e] = acc[h][e];
      consumer_sync(c.threads);
      for (int i = c.tid; i < hd + 2; i += c.threads) {
        float top = -INFINITY;
        for (int w = 0; w < c.warps; ++w) top = fmaxf(top, warp_state[w * (hd + 2)]);
        float v = top;
        if (i > 0) {
          v = 0.0f;
          for (int w = 0; w < c.warps; ++w) {
            const float mw = warp_state[w * (hd + 2)];
            if (mw != -INFINITY) v = fmaf(warp_state[w * (hd + 2) + i], exp2f(mw - top), v);
          }
        }
        head_state[h * (hd + 2) + i] = v;
      }
      consumer_sync(c.threads);
    }
  }
  c.mark(5);
  // The base count: a tagged word of the previous token (its value is needed before arriving).
  std::uint32_t base = 0;
  if (c.tid == 0 && c.ok) base = static_cast<std::uint32_t>(c.await_word(base_word, base_first, c.epoch, where));
  const int splits = attention_chunking(c.position, geo, d).splits;
  std::uint16_t* merged = p.att + static_cast<std::int64_t>(l) * d.q_size + static_cast<std::int64_t>(g) * group * hd;
  if (splits == 1) {
    // The only chunk: the normalised output, and the base count unchanged.
    for (int k = c.tid; k < group * hd; k += c.threads) {
      const int h = k / hd, i = k % hd;
      merged[k] = float_to_bf16_bits(head_state[h * (hd + 2) + 2 + i] / head_state[h * (hd + 2) + 1]);
    }
    if (c.tid == 0) st_tagged_u32(base_word, base, c.tag);
  } else {
    // Publish this chunk's partials and arrive (acquire-release: the last arrival sees every
    // chunk's partials); the last of the token's chunks merges them all.
    const std::int64_t stride = static_cast<std::int64_t>(d.heads) * (hd + 2);  // between chunks
    float* part = p.part + static_cast<std::int64_t>(l) * geo.max_splits * stride +
                  static_cast<std::int64_t>(g) * group * (hd + 2);
    for (int k = c.tid; k < group * (hd + 2); k += c.threads) part[chunk * stride + k] = head_state[k];
    consumer_sync(c.threads);
    if (c.tid == 0) {
      const std::uint32_t old = c.ok ? atom_add_acq_rel(c.counter(p.counter_index.arrive(l, g)), 1) : 0;
      c.bcast[1] = old + 1 == base + static_cast<std::uint32_t>(splits) ? 1 : 0;
    }
    consumer_sync(c.threads);
    if (c.bcast[1] != 0) {
      // (max, sum) of every chunk and head, then each chunk's weight per head.
      for (int j = c.tid; j < 2 * splits * group; j += c.threads) {
        const int pair = j >> 1, h = pair / splits, s = pair % splits;
        weights[j] = __ldcg(part + s * stride + h * (hd + 2) + (j & 1));
      }
      consumer_sync(c.threads);
      for (int h = c.tid; h < group; h += c.threads) {
        float* ml = weights + 2 * h * splits;  // (max, sum) per chunk, then the weights in place
        float top = -INFINITY;
        for (int s = 0; s < splits; ++s) top = fmaxf(top, ml[2 * s]);
        float total = 0.0f;
        for (int s = 0; s < splits; ++s) total = fmaf(ml[2 * s + 1], exp2f(ml[2 * s] - top), total);
        for (int s = 0; s < splits; ++s) ml[2 * s + 1] = exp2f(ml[2 * s] - top) / total;
      }
      consumer_sync(c.threads);
      // Output element k: the chunks in order, loads issued kGatherBatch at a time.
      for (int k = c.tid; k < group * hd; k += c.threads) {
        const int h = k / hd, i = k % hd;
        const float* src = part + h * (hd + 2) + 2 + i;
        const float* w = weights + 2 * h * splits;
        float v = 0.0f;
        for (int s0 = 0; s0 < splits; s0 += kGatherBatch) {
          float x[kGatherBatch];
#pragma unroll
          for (int b = 0; b < kGatherBatch; ++b) x[b] = s0 + b < splits ? __ldcg(src + (s0 + b) * stride) : 0.0f;
#pragma unroll
          for (int b = 0; b < kGatherBatch; ++b) {
            if (s0 + b < splits) v = fmaf(x[b], w[2 * (s0 + b) + 1], v);
          }
        }
        merged[k] = float_to_bf16_bits(v);
      }
      if (c.tid == 0) st_tagged_u32(base_word, base + static_cast<std::uint32_t>(splits), c.tag);
    }
  }
  c.mark(6);
  if (!c.finish()) return;
  publish(c, p.counter_index.attention(l));
  // The appended rows, for the copy engine of any block (read from the next token on, so off this
  // token's path): each writing thread's proxy fence, a barrier, one release-add of the layer's
  // cache counter (cumulative over the block's stores ordered before it by the barrier).
  if (writer) {
    if (wrote_cache) asm volatile("fence.proxy.async.global;" ::: "memory");
    consumer_sync(c.threads);
    if (c.tid == 0) red_add_release(c.counter(p.counter_index.cache(l)), 1);
  }
}

// o_proj rows [u.a, u.b): x_mid = x + o_proj(attention).
__device__ __forceinline__ void run_o_proj(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Dims& d = p.dims;
  const int l = u.layer, n = u.b - u.a;
  const Where where{static_cast<int>(u.kind), l, c.t};
  c.wait_counter(p.counter_index.attention(l), static_cast<std::uint32_t>(p.attention_slots) * c.tag, where);
  c.mark(1);
  // The attention output of every head (merged over the chunks by the attention units), and the
  // residual rows (the embedding's at layer 0).
  if (l == 0) {
    const int id = c.token_id(where);
    const std::uint16_t* row = p.embed + static_cast<std::int64_t>(id) * d.hidden + u.a;
    for (int i = c.tid; i < n; i += c.threads) c.rows[i] = bf16_bits_to_float(row[i]);
  } else {
    c.load_bf16_rows(p.x + static_cast<std::int64_t>(l) * d.hidden + u.a, n, c.rows);
  }
  c.load_bf16_vector(p.att + static_cast<std::int64_t>(l) * d.q_size, d.q_size,
                     [&](int j, float v) { c.vec_set(j, v); });
  consumer_sync(c.threads);
  c.mark(2);
  std::uint16_t* out = p.x_mid + static_cast<std::int64_t>(l) * d.hidden;
  const float* rows = c.rows;
  const int a = u.a;
  c.matvec(
      u, [&](int row, float v, float) { out[row] = residual_sum(rows[row - a], v); }, where);
  c.mark(3);
  if (!c.finish()) return;
  publish(c, p.counter_index.o_proj(l));
}

__device__ __forceinline__ void run_gate_up(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Dims& d = p.dims;
  const int l = u.layer;
  const Where where{static_cast<int>(u.kind), l, c.t};
  NormWeights norm;
  c.prefetch_norm(p.layers[l].post_norm, d.hidden, norm);
  c.wait_counter(p.counter_index.o_proj(l), static_cast<std::uint32_t>(p.o_units) * c.tag, where);
  c.mark(1);
  float ss = 0.0f;
  c.load_bf16_vector(p.x_mid + static_cast<std::int64_t>(l) * d.hidden, d.hidden, [&](int j, float v) {
    c.vec_set(j, v);
    ss += v * v;
  });
  c.normalise(d.hidden, ss, norm);
  c.mark(2);
  std::uint16_t* out = p.act + static_cast<std::int64_t>(l) * d.ffn;
  c.matvec(
      u,
      [&](int row, float gate, float up) {
        // SiLU(gate) * up on the bf16-rounded products, as the plain decoder computes it.
        const float g = round_bf16(gate), v = round_bf16(up);
        out[row] = float_to_bf16_bits(g * (1.0f / (1.0f + expf(-g))) * v);
      },
      where);
  c.mark(3);
  if (!c.finish()) return;
  publish(c, p.counter_index.gate_up(l));
}

__device__ __forceinline__ void run_down(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Dims& d = p.dims;
  const int l = u.layer, n = u.b - u.a;
  const Where where{static_cast<int>(u.kind), l, c.t};
  c.wait_counter(p.counter_index.gate_up(l), static_cast<std::uint32_t>(p.gate_up_units) * c.tag, where);
  c.mark(1);
  // act and the residual rows.
  c.load_bf16_rows(p.x_mid + static_cast<std::int64_t>(l) * d.hidden + u.a, n, c.rows);
  c.load_bf16_vector(p.act + static_cast<std::int64_t>(l) * d.ffn, d.ffn, [&](int j, float v) { c.vec_set(j, v); });
  consumer_sync(c.threads);
  c.mark(2);
  std::uint16_t* out = p.x + static_cast<std::int64_t>(l + 1) * d.hidden;
  const float* rows = c.rows;
  const int a = u.a;
  c.matvec(
      u, [&](int row, float v, float) { out[row] = residual_sum(rows[row - a], v); }, where);
  c.mark(3);
  if (!c.finish()) return;
  publish(c, p.counter_index.down(l));
}

// lm_head rows [u.a, u.b): logits and the unit's (max, first row reaching it).
__device__ __forceinline__ void run_lm_head(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Dims& d = p.dims;
  const int layers = d.layers;
  const Where where{static_cast<int>(u.kind), layers, c.t};
  NormWeights norm;
  c.prefetch_norm(p.final_norm, d.hidden, norm);
  c.wait_counter(p.counter_index.down(layers - 1), static_cast<std::uint32_t>(p.down_units) * c.tag, where);
  float ss = 0.0f;
  c.load_bf16_vector(p.x + static_cast<std::int64_t>(layers) * d.hidden, d.hidden, [&](int j, float v) {
    c.vec_set(j, v);
    ss += v * v;
  });
  c.normalise(d.hidden, ss, norm);
  float* logits =
      p.logits != nullptr && c.t >= p.logits_first ? p.logits + (c.t - p.logits_first) * p.logits_stride : nullptr;
  float best = -INFINITY;
  int best_row = INT_MAX;
  c.matvec(
      u,
      [&](int row, float v, float) {
        if (logits != nullptr) logits[row] = v;
        if (v > best || (v == best && row < best_row)) {
          best = v;
          best_row = row;
        }
      },
      where);
  if (c.lane == 0) {
    c.best_v[c.warp] = best;
    c.best_i[c.warp] = best_row;
  }
  consumer_sync(c.threads);
  if (c.tid == 0) {
    for (int w = 1; w < c.warps; ++w) {
      if (c.best_v[w] > best || (c.best_v[w] == best && c.best_i[w] < best_row)) {
        best = c.best_v[w];
        best_row = c.best_i[w];
      }
    }
    st_tagged(p.lm_part + 2 * u.index, best, c.tag);
    st_tagged_u32(p.lm_part + 2 * u.index + 1, static_cast<std::uint32_t>(best_row), c.tag);
  }
  if (!c.finish()) return;
  publish(c, p.counter_index.lm_head());
}

// The token's argmax over the lm_head units' partials: the next greedy id (the token word, which
// the next token's first units wait for). The token counter counts finished tokens.
__device__ __forceinline__ void run_argmax(Consumer& c, const Unit& u) {
  const Params& p = c.p;
  const Where where{static_cast<int>(u.kind), p.dims.layers, c.t};
  c.wait_counter(p.counter_index.lm_head(), static_cast<std::uint32_t>(p.lm_units) * c.tag, where);
  float* values = c.merge;  // [lm_units][2]
  c.gather(
      p.lm_part, 2 * p.lm_units, where, [](int j) { return j; }, [&](int j, float v) { values[j] = v; });
  consumer_sync(c.threads);
  if (c.tid == 0) {
    float best = -INFINITY;
    int best_row = INT_MAX;
    for (int i = 0; i < p.lm_units; ++i) {
      const float v = values[2 * i];
      const int row = static_cast<int>(__float_as_uint(values[2 * i + 1]));
      if (v > best || (v == best && row < best_row)) {
        best = v;
        best_row = row;
      }
    }
    if (best_row < 0 || best_row >= p.dims.vocab) best_row = 0;  // only when every logit is NaN
    // Released: every unit of this token (the argmax's ancestors) is done with its buffers.
    st_release_u64(p.token, (static_cast<std::uint64_t>(c.tag) << 32) | static_cast<std::uint32_t>(best_row));
  }
  if (!c.finish()) return;
  if (c.tid == 0) red_add_relaxed(c.counter(p.counter_index.tokens()), 1);
}

template <int E, int G>
__device__ __forceinline__ void run_consumer(const Params& p, unsigned char* smem, std::uint64_t* full,
                                             std::uint64_t* empty) {
  Consumer c(p, smem, full, empty);
  const Unit* units = p.units + p.block_begin[blockIdx.x];
  const int unit_count = p.block_begin[blockIdx.x + 1] - p.block_begin[blockIdx.x];
  for (int t = 0; t < p.tokens; ++t) {
    c.begin_token(t);
    for (int i = 0; i < unit_count; ++i) {
      const Unit u = units[i];
      std::uint64_t* trace = p.trace == nullptr
                                 ? nullptr
                                 : p.trace + kTraceWords * (static_cast<std::int64_t>(t) * p.block_begin[gridDim.x] +
                                                            p.block_begin[blockIdx.x] + i);
      c.trace_row = trace;
      c.mark(0);
      switch (u.kind) {
        case UnitKind::qkv: run_qkv(c, u); break;
        case UnitKind::attention: run_attention<E, G>(c, u); break;
        case UnitKind::o_proj: run_o_proj(c, u); break;
        case UnitKind::gate_up: run_gate_up(c, u); break;
        case UnitKind::down: run_down(c, u); break;
        case UnitKind::lm_head: run_lm_head(c, u); break;
        case UnitKind::argmax: run_argmax(c, u); break;
      }
      c.end_trace();
      if (!c.ok) return;  // finish() made every consumer agree
    }
  }
}

#endif  // sm_90 device code

template <int E, int G>
__global__ void __launch_bounds__(kMaxThreads, 1) decode_megakernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + p.smem_barriers);
  std::uint64_t* empty = full + p.geo.pages;
  // A launch after an aborted one leaves at once (the host reports the first abort).
  __shared__ int aborted;
  if (threadIdx.x == 0) aborted = ld_relaxed_u32(reinterpret_cast<const std::uint32_t*>(&p.abort->flag)) != 0;
  __syncthreads();
  if (aborted) return;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.geo.pages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, static_cast<std::uint32_t>(p.geo.consumer_warps));
    }
    core::fence_mbarrier_init();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) run_producer(p, smem, full, empty);
    return;
  }
  run_consumer<E, G>(p, smem, full, empty);
#else
  __trap();  // bulk copies and mbarrier transactions need sm_90
#endif
}

__global__ void rope_table_kernel(float* rope, std::int64_t capacity, int head_dim, double theta) {
  const int half = head_dim / 2;
  const std::int64_t total = capacity * half;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t position = idx / half;
    const int i = static_cast<int>(idx % half);
    const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    const double angle = static_cast<double>(position) * inv_freq;
    rope[2 * idx] = static_cast<float>(cos(angle));
    rope[2 * idx + 1] = static_cast<float>(sin(angle));
  }
}

__global__ void retag_kernel(std::uint64_t* word) { *word &= 0xffffffffull; }

// The token word after a prompt run outside the kernel: the id a greedy sampler chose, tagged.
__global__ void set_token_word_kernel(std::uint64_t* word, const std::int32_t* id, std::uint32_t tag) {
  *word = (static_cast<std::uint64_t>(tag) << 32) | static_cast<std::uint32_t>(*id);
}

__device__ __forceinline__ std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_normal_kernel(std::uint16_t* data, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix64(seed ^ mix64(static_cast<std::uint64_t>(i)));
    const float u1 = (static_cast<float>(r >> 40) + 0.5f) * 0x1p-24f;
    const float u2 = static_cast<float>((r >> 16) & 0xffffffu) * 0x1p-24f;
    data[i] = __bfloat16_as_ushort(__float2bfloat16_rn(scale * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2)));
  }
}

using KernelFn = void (*)(Params);

// The instance for a shape: E = head_dim / 32; G = 2 for up to 2 query heads per kv head, else 8.
KernelFn kernel_for(int head_dim, int group) {
  if (head_dim != 64 && head_dim != 128) {
    throw core::InputError("decode megakernel: head_dim " + std::to_string(head_dim) + " not supported (64 or 128)");
  }
  if (group < 1 || group > kMaxGroup) {
    throw core::InputError("decode megakernel: " + std::to_string(group) + " query heads per kv head (1 to " +
                           std::to_string(kMaxGroup) + ")");
  }
  if (head_dim == 64) return group <= 2 ? decode_megakernel<2, 2> : decode_megakernel<2, kMaxGroup>;
  return group <= 2 ? decode_megakernel<4, 2> : decode_megakernel<4, kMaxGroup>;
}

// The largest dynamic shared memory of one block: the device's opt-in limit less the static part,
// set as the instance's limit on first use, so decoders of different geometries can live side
// by side.
int max_dynamic_smem(KernelFn kernel) {
  static std::mutex mutex;
  static std::map<KernelFn, int> limits;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = limits.find(kernel);
  if (found != limits.end()) return found->second;
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int limit = optin - static_cast<int>(attributes.sharedSizeBytes);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  limits[kernel] = limit;
  return limit;
}

}  // namespace

int prepare_megakernel(int head_dim, int group, int threads, int smem_bytes) {
  if (threads > kMaxThreads)
    throw core::Error("decode megakernel: at most " + std::to_string(kMaxConsumerWarps) + " consumer warps");
  const KernelFn kernel = kernel_for(head_dim, group);
  if (smem_bytes > max_dynamic_smem(kernel)) return 0;
  int blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
  return blocks;
}

int megakernel_max_smem(int head_dim, int group) { return max_dynamic_smem(kernel_for(head_dim, group)); }

void launch_megakernel(const Params& p, void* stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(p.geo.blocks));
  config.blockDim = dim3(static_cast<unsigned>(32 * (p.geo.consumer_warps + 1)));
  config.dynamicSmemBytes = static_cast<std::size_t>(p.smem_bytes);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;  // all blocks co-resident, or the launch fails
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel_for(p.dims.head_dim, p.dims.group), p));
}

void fill_rope_table(float* rope, std::int64_t capacity, int head_dim, double theta, void* stream) {
  const std::int64_t total = capacity * (head_dim / 2);
  const int blocks = static_cast<int>(std::min<std::int64_t>(4096, (total + 255) / 256));
  rope_table_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(rope, capacity, head_dim, theta);
  CUDA_CHECK_LAUNCH("rope_table_kernel");
}

void retag_token_word(std::uint64_t* word, void* stream) {
  retag_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(word);
  CUDA_CHECK_LAUNCH("retag_kernel");
}

void set_token_word(std::uint64_t* word, const std::int32_t* id, std::uint32_t tag, void* stream) {
  set_token_word_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(word, id, tag);
  CUDA_CHECK_LAUNCH("set_token_word_kernel");
}

void fill_bf16_normal(std::uint16_t* data, std::int64_t n, std::uint64_t seed, float scale, void* stream) {
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<std::int64_t>(4096, (n + 255) / 256));
  fill_normal_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(data, n, seed, scale);
  CUDA_CHECK_LAUNCH("fill_normal_kernel");
}

}  // namespace models::qwen3::megakernel
