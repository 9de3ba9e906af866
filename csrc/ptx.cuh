// The PTX that decodex's GEMV and decode attention are built on: predicated 16-byte loads with
// their cache hints, a 2-byte coherent load, the L2 bulk prefetch, the tensor-core mma, and the
// cp.async copies and warpgroup MMA (wgmma) of the batched GEMV.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace decodex {

// Defines `uint4 name(const void* p, bool pred)`: 16 bytes at p through `instruction`, or zeros
// (no load issued) when !pred. Predicated inside the asm, so the load can never be speculated past
// its guard. `qualifier` is `volatile` (keeps the loads in program order) or empty.
#define DX_DEFINE_LOAD16(name, qualifier, instruction)                                      \
  __device__ __forceinline__ uint4 name(const void* p, bool pred) {                         \
    uint4 v;                                                                                \
    asm qualifier("{\n"                                                                     \
                  "  .reg .pred p;\n"                                                       \
                  "  setp.ne.b32 p, %5, 0;\n"                                               \
                  "  mov.b32 %0, 0;\n"                                                      \
                  "  mov.b32 %1, 0;\n"                                                      \
                  "  mov.b32 %2, 0;\n"                                                      \
                  "  mov.b32 %3, 0;\n"                                                      \
                  "  @p " instruction " {%0, %1, %2, %3}, [%4];\n"                          \
                  "}\n"                                                                     \
                  : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                              \
                  : "l"(p), "r"(static_cast<int>(pred)));                                   \
    return v;                                                                               \
  }

// GEMV weights: used once, so kept out of L1; L2 fetches the whole 256 B granule at once (a warp
// reads each row in 64 B pieces). Volatile: the compiler must not sink them next to their mma.
DX_DEFINE_LOAD16(load16_stream_l2_256, volatile, "ld.global.nc.L1::no_allocate.L2::256B.v4.u32")
// GEMV x: through L1, where every warp of the SM on the same k-range finds it.
DX_DEFINE_LOAD16(load16_cached, volatile, "ld.global.nc.v4.u32")
// KV-cache rows: read-only path, not kept in L1 (each row is read once).
DX_DEFINE_LOAD16(load16_stream, , "ld.global.nc.L1::no_allocate.v4.u32")

// Asks L2 to fetch [p, p + bytes) from memory (sm_90 bulk prefetch: no registers, nothing to wait
// for; p 16-byte aligned, bytes a multiple of 16). L2 is the point of coherence, so this is safe
// even before griddepcontrol.wait: a later load still sees every write.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// 2 bytes at p (a coherent load: p may be written later by the same thread), or 0 when !pred.
// Volatile, so it is issued where it is written rather than sunk to its use.
__device__ __forceinline__ uint16_t load_b16(const void* p, bool pred) {
  uint16_t v;
  asm volatile("{\n"
               "  .reg .pred p;\n"
               "  setp.ne.b32 p, %2, 0;\n"
               "  mov.b16 %0, 0;\n"
               "  @p ld.global.b16 %0, [%1];\n"
               "}\n"
               : "=h"(v)
               : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

// d[16x8] += a[16x16] * b[16x8]: mma.sync m16n8k16, bf16 operands in the PTX fragment layouts,
// fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// cp.async (sm_80): 16 bytes from global p into shared memory at dst (a shared-space address), through
// L2 only; the bytes past src_bytes (0 or 16) are zero-filled, so src_bytes = 0 writes 16 zeros and
// reads nothing. Completion is tracked by cp_async_commit / cp_async_wait groups.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* p, uint32_t src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(p), "r"(src_bytes)
               : "memory");
#endif
}

// cp_async16 for streamed weights: L2 fetches the whole 256 B granule at once (a warp reads each
// weight row in 64 B pieces).
__device__ __forceinline__ void cp_async16_l2_256(uint32_t dst, const void* p, uint32_t src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(p),
               "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// ---- warpgroup MMA (sm_90a): the wgmma GEMV (csrc/gemv_wide.cu) ----

// d[64 x 64] += A[64 x 16] * B[16 x 64] (wgmma.mma_async, bf16 in, fp32 accumulators): A and B
// K-major in shared memory, described by desc_a / desc_b. Must sit between wgmma_fence and
// wgmma_commit; d is not valid until wgmma_wait.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(1));
#else
  (void)d; (void)desc_a; (void)desc_b;
  __trap();  // sm_90a only; the host sends nothing here otherwise
#endif
}

// d[64 x 128] += A[64 x 16] * B[16 x 128] (wgmma.mma_async, bf16 in, fp32 accumulators): A and B
// K-major in shared memory, described by desc_a / desc_b. Must sit between wgmma_fence and
// wgmma_commit; d is not valid until wgmma_wait.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
#else
  (void)d; (void)desc_a; (void)desc_b;
  __trap();  // sm_90a only; the host sends nothing here otherwise
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_wait_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Makes this thread's generic-proxy writes to shared memory (cp.async's) visible to the async proxy
// (wgmma's operand reads).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// wgmma shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle: rows of 128 B
// (64 bf16 of k), 16-byte chunk c of row r stored at chunk c ^ (r % 8), groups of 8 rows 1024 B
// apart (the tile 1024-byte aligned). addr: the tile, plus 32 B per k16 step into the row.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

}  // namespace decodex
