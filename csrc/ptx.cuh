// The PTX that decodex's GEMV and decode attention are built on: predicated 16-byte loads with
// their cache hints, the L2 bulk prefetch, the tensor-core mma, and (sm_90) the mbarriers, bulk
// copies and distributed shared memory of a producer/consumer shared-memory ring.
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

// ---- sm_90: mbarriers, bulk copies global -> shared, distributed shared memory ----
// A shared-memory ring filled by the copy engine: the producer arms a stage's "full" mbarrier with
// the bytes it expects (arrive.expect_tx), then issues cp.async.bulk copies that complete those bytes
// on it; consumers wait for the phase, read the stage and arrive on its "empty" mbarrier; the
// producer waits for that before it refills the stage. Parities count the phases: a barrier's k-th
// completion (from 0) is waited for with parity k & 1.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Declared for the host pass too (kernels are parsed there), compiled for sm_90 and newer only.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}

// Makes barrier inits visible to the copy engine and to the other blocks of the cluster.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// One arrival plus `bytes` more expected from bulk copies in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// One arrival on the barrier at the same shared-memory offset in block `rank` of the cluster,
// releasing this thread's earlier writes (to that block's shared memory too) at cluster scope.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n"
      "  .reg .b32 remote;\n"
      "  mapa.shared::cluster.u32 remote, %0, %1;\n"
      "  mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(rank)
      : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Same, acquiring at cluster scope: what other blocks wrote before their arrivals is visible.
__device__ __forceinline__ bool mbar_try_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait_cluster(bar, parity)) {
  }
}

// An L2 policy for data read exactly once (weights): evicted first, so it does not push out what
// is reused (activations, the next kernel's prefetched weights).
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// An L2 policy for data every block reads (activations): kept over streamed data.
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global memory into this block's
// shared memory, completing on `bar`'s transaction count.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes,
                                                    uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

// A float4 into the shared memory of block `rank` of the cluster, at the offset of `local`.
__device__ __forceinline__ void st_cluster_f32x4(float* local, uint32_t rank, float4 v) {
  asm volatile(
      "{\n"
      "  .reg .b32 remote;\n"
      "  mapa.shared::cluster.u32 remote, %0, %1;\n"
      "  st.shared::cluster.v4.f32 [remote], {%2, %3, %4, %5};\n"
      "}\n" ::"r"(smem_u32(local)),
      "r"(rank), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
      : "memory");
}
#endif

// 16 bytes of shared memory. Volatile, so it is never hoisted above the barrier wait before it.
__device__ __forceinline__ uint4 lds16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// Barrier `id` (1..15; 0 is __syncthreads) over the first `threads` threads of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace decodex
