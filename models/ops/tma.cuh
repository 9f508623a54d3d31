// Hopper's tensor memory accelerator (TMA) and the shared-memory barriers that track it, for
// kernels in which one thread loads tiles for the others: mbarrier init / arrive / arrive with an
// expected byte count / wait on a phase, and a 2D bulk tensor copy global -> shared that completes
// its bytes on an mbarrier. A copy through a CU_TENSOR_MAP_SWIZZLE_128B map with 64-element boxes
// writes the 128-byte swizzled layout of wgmma.cuh, so a landed tile is a wgmma operand as it is.
// sm_90a only; on other targets these compile to a trap (wgmma.cuh's rule).
#pragma once

#include <cstdint>

#include "models/ops/wgmma.cuh"

namespace models::ops::gpu {

__device__ __forceinline__ void mbarrier_init(std::uint32_t barrier, std::uint32_t arrivals) {
#ifdef LLMTRAIN_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
#else
  wgmma_trap();
#endif
}

// Barrier initialisations visible to the other threads (and the async proxy) before any uses them.
__device__ __forceinline__ void fence_barrier_init() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  wgmma_trap();
#endif
}

__device__ __forceinline__ void mbarrier_arrive(std::uint32_t barrier) {
#ifdef LLMTRAIN_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
#else
  wgmma_trap();
#endif
}

// Arrives and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(std::uint32_t barrier, std::uint32_t bytes) {
#ifdef LLMTRAIN_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
#else
  wgmma_trap();
#endif
}

// Waits until the phase with this parity (0 for the first, then alternating) has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint32_t barrier, std::uint32_t parity) {
#ifdef LLMTRAIN_WGMMA
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
#else
  wgmma_trap();
#endif
}

// Copies the box at element coordinates (x, y) of the 2D tensor map `map` (a kernel parameter
// declared __grid_constant__, or global memory) to shared address `destination`; its bytes count
// toward `barrier`'s current phase.
__device__ __forceinline__ void tma_load_2d(std::uint32_t destination, const void* map, std::uint32_t barrier, int x,
                                            int y) {
#ifdef LLMTRAIN_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          destination),
      "l"(map), "r"(barrier), "r"(x), "r"(y)
      : "memory");
#else
  wgmma_trap();
#endif
}

// A warpgroup's register budget per thread, raised or lowered (a multiple of 8 in [24, 256]): the
// loading warpgroup gives registers to the computing ones. Every thread of the warpgroup calls it.
template <int kRegisters>
__device__ __forceinline__ void raise_registers() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#else
  wgmma_trap();
#endif
}

template <int kRegisters>
__device__ __forceinline__ void lower_registers() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#else
  wgmma_trap();
#endif
}

}  // namespace models::ops::gpu
