// What the probes that stream a large buffer share (stream_probe, chain_probe; built with -Icsrc for
// decodex's ptx.cuh): an sm_90 shared-memory ring filled by bulk copies on mbarriers, and the plain
// read every such probe measures itself against. decodex's kernels use none of what is defined here.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "ptx.cuh"

// ---- a shared-memory ring filled by bulk copies (sm_90) ----
// (The shared address and the mbarrier init, fence and arrival with bytes expected are
// csrc/ptx.cuh's, which the kernels' cluster pushes use.)
using decodex::fence_mbar_init;
using decodex::mbar_arrive_expect;
using decodex::mbar_init;
using decodex::smem_u32;

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
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

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// An L2 policy for data read exactly once (weights): evicted first, so it does not push out what
// is reused (activations, the next kernel's prefetched weights).
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
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

// The plain read: every one of n16 16-byte words read once with decodex's weight loads, U loads in
// flight a thread; all four words of each load are folded in, so none is narrowed.
template <int U>
__global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ p, int64_t n16, float* sink) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nth = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (int64_t i = tid; i < n16; i += U * nth) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = decodex::load16_stream_l2_256(p + i + j * nth, i + j * nth < n16);
#pragma unroll
    for (int j = 0; j < U; ++j) acc += v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9E3779B9u) sink[0] = static_cast<float>(acc);
}
