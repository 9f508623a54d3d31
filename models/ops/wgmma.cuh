// Hopper's warpgroup matrix multiply (wgmma) for kernels that keep their tiles in shared memory:
// the 128-byte swizzled tile layout, shared-memory matrix descriptors, and D[64, N] += A[64, 16]
// B[16, N] in bf16 with fp32 accumulation, A from shared memory or registers and B from shared
// memory (K-major, i.e. rows of A and columns of B contiguous along K; or B MN-major, rows of B
// contiguous along N), issued by the 128 threads of a warpgroup together: one instruction is
// 64 x N x 16 where mma.sync is 16 x 8 x 16 per warp. The attention kernels of attention_hopper.cuh
// use it; tests/models/ops/test_wgmma_gpu.cu checks it against a CPU product.
//
// Layout: a tile of R rows x 64 bf16 (128 bytes a row) in 8-row atoms of 1024 bytes, each atom
// 1024-byte aligned; within an atom row r's 16-byte chunk q sits at chunk q ^ r (the 128-byte
// swizzle, which the descriptor names, so loads of 8 consecutive rows hit distinct banks). A
// descriptor points at the tile's first row; the next 16 columns (the next k16 step) start 32 bytes
// further, which the hardware swizzles the same way.
//
// Accumulators: thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 + {0, 8} and columns
// 8 j + 2 (t % 4) + {0, 1} for j < N / 8, in d[4 j + 2 i + c] (row offset 8 i, column offset c):
// mma.sync's m16n8 fragment, repeated over N. wgmma needs sm_90a: on other targets these compile to
// a trap (callers run a wgmma kernel only where the build targets sm_90a and the device is Hopper).
#pragma once

#include <cstdint>

namespace models::ops::gpu {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LLMTRAIN_WGMMA 1
#endif

// Byte offset of element (row, column) of a swizzled tile of 64-column rows (bf16).
__host__ __device__ constexpr std::uint32_t swizzled_offset(std::uint32_t row, std::uint32_t column) {
  const std::uint32_t byte = column * 2;
  return row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
}

// The descriptor of a swizzled K-major tile at shared address `address` (1024-byte aligned):
// start address >> 4 (bits 0-13), leading byte offset unused by this layout (1), stride byte
// offset 1024 >> 4 between 8-row atoms (bits 32-45), base offset 0, swizzle mode 1 = 128 bytes.
__host__ __device__ constexpr std::uint64_t swizzled_tile_descriptor(std::uint32_t address) {
  return static_cast<std::uint64_t>((address >> 4) & 0x3FFF) | (std::uint64_t{1} << 16) |
         (std::uint64_t{1024 >> 4} << 32) | (std::uint64_t{1} << 62);
}

// The descriptor of the same swizzled layout read MN-major (instructions with the transpose bit):
// the tile's rows are the K index and its 64 columns the M or N index, so a k16 step is two 8-row
// atoms (its start 2048 bytes further per step), the stride byte offset 1024 steps between the two
// atoms and the leading byte offset `mn_stride_bytes` from one 64-column tile to the next (N 128).
__host__ __device__ constexpr std::uint64_t swizzled_mn_major_descriptor(std::uint32_t address,
                                                                         std::uint32_t mn_stride_bytes) {
  return static_cast<std::uint64_t>((address >> 4) & 0x3FFF) |
         (static_cast<std::uint64_t>((mn_stride_bytes >> 4) & 0x3FFF) << 16) | (std::uint64_t{1024 >> 4} << 32) |
         (std::uint64_t{1} << 62);
}

// The descriptor of the k16 step `k` of a tile: 32 bytes (2 units of 16) further.
__host__ __device__ constexpr std::uint64_t descriptor_at_k(std::uint64_t descriptor, int k) {
  return descriptor + static_cast<std::uint64_t>(2 * k);
}

__device__ __forceinline__ void wgmma_trap() { __trap(); }

// Shared-memory writes by this thread become visible to the async proxy that wgmma reads through
// (then a barrier makes every thread's visible).
__device__ __forceinline__ void fence_shared_for_wgmma() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  wgmma_trap();
#endif
}

// Before the first wgmma that reads or writes accumulators this thread touched.
__device__ __forceinline__ void wgmma_fence() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  wgmma_trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  wgmma_trap();
#endif
}

// Waits until at most `Pending` committed groups are still running.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef LLMTRAIN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#else
  wgmma_trap();
#endif
}

// D[64, N] = A B (accumulate false) or D + A B, N 64 or 128: d has N / 2 registers.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b,
                                         bool accumulate);

// The same with A from registers: thread t holds, as bf16 pairs (the lower column in the low half),
// a[0] = A[r][c, c + 1], a[1] = A[r + 8][c, c + 1], a[2] = A[r][c + 8, c + 9], a[3] = A[r + 8][c + 8,
// c + 9] with r = 16 (t / 32) + (t % 32) / 4 and c = 2 (t % 4): mma.sync's m16n8k16 A fragment, a
// warp to 16 rows; an accumulator converted to bf16 pairs has this layout (attention's P in P V).
template <int N>
struct RegisterAProduct;  // N 64 and 128, below
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                         bool accumulate) {
  RegisterAProduct<N>::template run<0>(d, a, desc_b, accumulate);
}

// The same with B MN-major (swizzled_mn_major_descriptor): B[k][n] at row k, column n of the tile,
// as a row-major [K, N] matrix such as V in P V lies in memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                            bool accumulate) {
  RegisterAProduct<N>::template run<1>(d, a, desc_b, accumulate);
}

// Keeps values in registers, unmoved, up to this point: for accumulators and A fragments that a
// wgmma still in flight reads or writes, after the wait that ends it (the compiler does not know
// the instruction runs on after its statement).
template <int Count>
__device__ __forceinline__ void keep_in_registers(float (&values)[Count]) {
#pragma unroll
  for (int i = 0; i < Count; ++i) asm volatile("" : "+f"(values[i])::"memory");
}
template <int Count>
__device__ __forceinline__ void keep_in_registers(std::uint32_t (&values)[Count]) {
#pragma unroll
  for (int i = 0; i < Count; ++i) asm volatile("" : "+r"(values[i])::"memory");
}

#ifdef LLMTRAIN_WGMMA
// The accumulator operands: the registers of d as "%0, ..." in the instruction and "+f" bindings.
#define LLMTRAIN_WGMMA_REGS32                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define LLMTRAIN_WGMMA_REGS64 LLMTRAIN_WGMMA_REGS32 LLMTRAIN_WGMMA_REGS32_63
#define LLMTRAIN_WGMMA_REGS32_63                                                       \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define LLMTRAIN_WGMMA_D32                                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define LLMTRAIN_WGMMA_D64                                                                                       \
  LLMTRAIN_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),    \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),    \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),    \
      "+f"(d[63])

// D[64, 64] (+)= A[64, 16] B[16, 64], both from shared memory through descriptors.
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b,
                                             bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LLMTRAIN_WGMMA_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : LLMTRAIN_WGMMA_D32
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64, 128] (+)= A[64, 16] B[16, 128], both from shared memory through descriptors.
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                              bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LLMTRAIN_WGMMA_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : LLMTRAIN_WGMMA_D64
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64, N] (+)= A[64, 16] B[16, N], A from registers, B from shared memory K-major (kBMnMajor 0)
// or MN-major (1): the instruction's transpose bit for B.
template <>
struct RegisterAProduct<64> {
  template <int kBMnMajor>
  static __device__ __forceinline__ void run(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                             bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LLMTRAIN_WGMMA_REGS32
        "}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : LLMTRAIN_WGMMA_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kBMnMajor));
  }
};

template <>
struct RegisterAProduct<128> {
  template <int kBMnMajor>
  static __device__ __forceinline__ void run(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                             bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LLMTRAIN_WGMMA_REGS64
        "}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : LLMTRAIN_WGMMA_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kBMnMajor));
  }
};
#undef LLMTRAIN_WGMMA_REGS32
#undef LLMTRAIN_WGMMA_REGS64
#undef LLMTRAIN_WGMMA_REGS32_63
#undef LLMTRAIN_WGMMA_D32
#undef LLMTRAIN_WGMMA_D64
#else
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&)[32], std::uint64_t, std::uint64_t, bool) {
  wgmma_trap();
}
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&)[64], std::uint64_t, std::uint64_t, bool) {
  wgmma_trap();
}
template <int N>
struct RegisterAProduct {
  template <int kBMnMajor>
  static __device__ __forceinline__ void run(float (&)[N / 2], const std::uint32_t (&)[4], std::uint64_t, bool) {
    wgmma_trap();
  }
};
#endif

}  // namespace models::ops::gpu
