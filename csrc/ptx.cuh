// The PTX that decodex's GEMV and decode attention are built on: predicated 16-byte loads with
// their cache hints, a 2-byte coherent load, the L2 bulk prefetch, the tensor-core mma, and the
// cp.async copies of the wide GEMV.
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

}  // namespace decodex
