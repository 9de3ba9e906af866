// The PTX that decodex's GEMV and decode attention are built on: predicated 16-byte loads with
// their cache hints, 2- and 4-byte coherent loads, the L2 bulk prefetch, the tensor-core mma, the
// cp.async copies, the cluster start barrier, and the warpgroup MMA (wgmma) of the batched GEMV.
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

// Defines `type name(const void* p, bool pred)`: one `bits`-wide coherent load at p (p may be
// written later by the same thread), or 0 when !pred. Volatile, so it is issued where it is written
// rather than sunk to its use. `reg` is the asm constraint of `type`.
#define DX_DEFINE_LOAD_SCALAR(name, type, reg, bits)                                        \
  __device__ __forceinline__ type name(const void* p, bool pred) {                          \
    type v;                                                                                 \
    asm volatile("{\n"                                                                      \
                 "  .reg .pred p;\n"                                                        \
                 "  setp.ne.b32 p, %2, 0;\n"                                                \
                 "  mov." bits " %0, 0;\n"                                                  \
                 "  @p ld.global." bits " %0, [%1];\n"                                      \
                 "}\n"                                                                      \
                 : "=" reg(v)                                                               \
                 : "l"(p), "r"(static_cast<int>(pred)));                                    \
    return v;                                                                               \
  }

DX_DEFINE_LOAD_SCALAR(load_b16, uint16_t, "h", "b16")  // 2 bytes
DX_DEFINE_LOAD_SCALAR(load_b32, uint32_t, "r", "b32")  // 4 bytes

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

// 16 bytes of shared memory at shared-space address a.
__device__ __forceinline__ uint4 lds16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
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

// ---- thread-block clusters (sm_90): blocks that push into each other's shared memory ----
// A block's shared memory may be written by another only once that block runs: each block of a
// cluster of c > 1 arrives on the cluster barrier first thing (cluster_started_arrive) and waits on
// it before its first store into another block (cluster_started_wait); by then the others have long
// arrived. Used by decode_attention's cluster merge and the GEMV's cluster split-K.
__device__ __forceinline__ void cluster_started_arrive(int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (c > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_started_wait(int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (c > 1) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// ---- distributed shared memory stores counted on the owner's mbarrier (sm_90) ----
// A block pushes into another's shared memory with st.async: each store, when it lands, takes its
// bytes off the owner's mbarrier, whose one arrival (by the owner) announced the total. The owner
// waits on the phase and then reads its inbox; no cluster barrier (with its GPU-scope fence) and no
// wait in the pushing block. The owner initialises the mbarrier before cluster_started_arrive, so
// every pusher (after cluster_started_wait) sees it initialised (mbar_init, fence_mbar_init).
// decode_attention's cluster merge and the GEMV's cluster split-K.

// The 32-bit shared::cta address of p (this block's shared memory).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The shared::cluster address of `local`'s counterpart in rank r's shared memory.
__device__ __forceinline__ uint32_t cluster_addr(const void* local, int r) {
  uint32_t out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_u32(local)), "r"(r));
#endif
  return out;
}
// An mbarrier expecting `count` arrivals a phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#endif
}
// Releases this thread's mbarrier inits to the cluster (and the async proxy: bulk copies, st.async).
__device__ __forceinline__ void fence_mbar_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// The one arrival, with the bytes the phase waits for (stores that land before it are fine: the
// transaction count may go below zero until then).
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* mbar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(mbar)), "r"(bytes)
               : "memory");
#endif
}
// Until the phase of the given parity completes (acquire at cluster scope: the pushed bytes are
// visible after it).
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* mbar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      "  .reg .pred done;\n"
      "WAIT_%=:\n"
      "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "  @!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(mbar)), "r"(parity)
      : "memory");
#endif
}
// 16 / 8 / 4 bytes into another block's shared memory (raddr, from cluster_addr), counted on its
// mbarrier at rmbar.
__device__ __forceinline__ void st_async(uint32_t raddr, float4 v, uint32_t rmbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
      ::"r"(raddr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rmbar) : "memory");
#endif
}
__device__ __forceinline__ void st_async(uint32_t raddr, float2 v, uint32_t rmbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               ::"r"(raddr), "f"(v.x), "f"(v.y), "r"(rmbar) : "memory");
#endif
}
__device__ __forceinline__ void st_async(uint32_t raddr, float v, uint32_t rmbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               ::"r"(raddr), "f"(v), "r"(rmbar) : "memory");
#endif
}

// ---- warpgroup MMA (sm_90a): the wgmma GEMV (csrc/gemv_wide.cu) ----

// The accumulator operands of a wgmma: d[i .. i + n) as "+f", and their names %0 .. %(n - 1).
#define DECODEX_D8(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), \
    "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define DECODEX_D16(i) DECODEX_D8(i), DECODEX_D8((i) + 8)
#define DECODEX_D32(i) DECODEX_D16(i), DECODEX_D16((i) + 16)
#define DECODEX_D64(i) DECODEX_D32(i), DECODEX_D32((i) + 32)
#define DECODEX_R8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define DECODEX_R16 DECODEX_R8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define DECODEX_R32 DECODEX_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DECODEX_R64 DECODEX_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
// One wgmma.mma_async of shape m64nNk16 (bf16 in, fp32 accumulators, scale-d 1: d += A B): REGS the
// accumulators' names, A / B / ONE the names of desc_a, desc_b and the constant 1 after them.
#define DECODEX_WGMMA(N, REGS, A, B, ONE, DS)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ONE ", 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS "}, " A ", " B \
               ", p, 1, 1, 0, 0;\n}\n"                                                        \
               : DS : "l"(desc_a), "l"(desc_b), "r"(1))

// d[64 x N] += A[64 x 16] * B[16 x N] (wgmma.mma_async, bf16 in, fp32 accumulators; N = 16, 32, 64
// or 128): A and B K-major in shared memory, described by desc_a / desc_b. d in the wgmma
// accumulator layout (thread (warp w, lane 4g + t) holds rows 16w + g (+ 8) and columns 8j + 2t
// (+ 1) in d[4j + 2h + e]). Must sit between wgmma_fence and wgmma_commit; d is not valid until
// wgmma_wait.
template <int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (N == 16) {
    DECODEX_WGMMA(16, DECODEX_R8, "%8", "%9", "%10", DECODEX_D8(0));
  } else if constexpr (N == 32) {
    DECODEX_WGMMA(32, DECODEX_R16, "%16", "%17", "%18", DECODEX_D16(0));
  } else if constexpr (N == 64) {
    DECODEX_WGMMA(64, DECODEX_R32, "%32", "%33", "%34", DECODEX_D32(0));
  } else {
    static_assert(N == 128, "wgmma_m64k16: N must be 16, 32, 64 or 128");
    DECODEX_WGMMA(128, DECODEX_R64, "%64", "%65", "%66", DECODEX_D64(0));
  }
#else
  (void)d; (void)desc_a; (void)desc_b;
  __trap();  // sm_90a only; the host sends nothing here otherwise
#endif
}
#undef DECODEX_WGMMA
#undef DECODEX_R64
#undef DECODEX_R32
#undef DECODEX_R16
#undef DECODEX_R8
#undef DECODEX_D64
#undef DECODEX_D32
#undef DECODEX_D16
#undef DECODEX_D8

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
