// Shared-memory transfers by the copy engine and the barriers that track them (PTX wrappers, sm_90
// and later): mbarriers with transaction counts, bulk global -> shared copies and 2D tensor (TMA)
// copies, stores into another block of the cluster that complete its mbarrier's bytes, the L2
// evict-first policy, and the nanosecond timer that deadlines read. One definition for the kernels
// that load through the copy engine: the Qwen3 decode megakernel streams its weights with them; the
// E29a persistent kernels' cluster exchanges signal with them and their deadlines read the same
// timer; the Hopper attention kernels load their tiles with the tensor copies. A barrier is named
// by its shared-memory address (the 32-bit form) or by a pointer to it.
#pragma once

#include <cstdint>

namespace core {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, std::uint32_t count) { mbar_init(smem_addr(bar), count); }

// Barrier initialisations visible to the other threads and the copy engine before any uses them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  mbar_arrive_expect_tx(smem_addr(bar), bytes);
}

__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) { mbar_arrive(smem_addr(bar)); }

// Waits until the phase of `bar` with this parity (0 for the first, then alternating) has
// completed: a spin with no deadline, for kernels whose every wait is bounded by their own copies.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Whether the phase of `bar` with this parity has completed (acquire, CTA scope).
__device__ __forceinline__ bool mbar_test(std::uint64_t* bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// The same at cluster scope: stores other blocks of the cluster made into this block's shared
// memory, completing the phase (st_async_cluster), are seen after it.
__device__ __forceinline__ bool mbar_test_cluster(std::uint64_t* bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Stores 32 bits at `at` in block `rank` of the cluster, completing 4 bytes of that block's `bar`
// (both given by this block's addresses of them: every block lays out its shared memory alike).
__device__ __forceinline__ void st_async_cluster(const void* at, std::uint32_t bits, std::uint64_t* bar,
                                                 std::uint32_t rank) {
  std::uint32_t dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem_addr(at)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst), "r"(bits),
               "r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ std::uint64_t evict_first_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Bulk copy global -> shared (the copy engine), completing `bytes` of the mbarrier's transaction.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, std::uint32_t bytes, std::uint64_t* bar,
                                          std::uint64_t policy, bool hint) {
  if (hint) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
  }
}

// Copies the box at element coordinates (x, y) of the 2D tensor map `map` (a kernel parameter
// declared __grid_constant__, or global memory) to shared address `dst`, completing its bytes on
// `bar`'s current phase.
__device__ __forceinline__ void tensor_copy_2d(std::uint32_t dst, const void* map, std::uint32_t bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(x), "r"(y)
      : "memory");
}

__device__ __forceinline__ std::uint64_t globaltimer() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Orders this thread's earlier generic-proxy view of global memory (data other blocks published
// and this one acquired) before its later bulk copies (async proxy) read it.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace core
