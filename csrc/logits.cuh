// Device helpers shared by argmax.cu and sample.cu: reading a row of logits 8 elements at a time
// (16-byte vectors where the row allows, scalar loads for a ragged tail or an unaligned row), and
// the 64-bit argmax key that makes "largest value, then lowest index, NaN largest" a plain max.
#pragma once

#include "common.h"

namespace decodex {

using u64 = unsigned long long;

__device__ __forceinline__ float logit_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float logit_to_float(float x) { return x; }

// Elements [8c, 8c + 8) of a row of V logits into f; returns how many exist (8 except at the tail).
// vec_ok: the row start is 16-byte aligned (base and row stride), so full groups load as vectors.
template <typename T>
__device__ __forceinline__ int load8(const T* __restrict__ row, int64_t V, int64_t c, bool vec_ok,
                                     float (&f)[8]) {
  const int64_t i0 = c * 8;
  if (vec_ok && i0 + 8 <= V) {
    if constexpr (sizeof(T) == 2) {
      bf16x8_to_float(*reinterpret_cast<const bf16x8*>(row + i0), f);
    } else {
      const float4 a = reinterpret_cast<const float4*>(row + i0)[0];
      const float4 b = reinterpret_cast<const float4*>(row + i0)[1];
      f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
    return 8;
  }
  const int n = static_cast<int>(V - i0 < 8 ? V - i0 : 8);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = j < n ? logit_to_float(row[i0 + j]) : 0.f;
  return n;
}

// Order-preserving map of a float to uint32 (a < b  <=>  key(a) < key(b)), with -0 == +0 and every
// NaN above +inf, as torch.argmax treats NaN as the maximum.
__device__ __forceinline__ unsigned argmax_order(float f) {
  if (f != f) return 0xffffffffu;
  unsigned u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The argmax key of element `idx` with value f: larger key = better; ties in value go to the lower
// index. 0 is below every real key (the order of -inf is 0x007fffff), so it is the neutral element.
__device__ __forceinline__ u64 argmax_key(float f, unsigned idx) {
  return (static_cast<u64>(argmax_order(f)) << 32) | static_cast<u64>(~idx);
}
__device__ __forceinline__ int64_t argmax_key_index(u64 key) {
  return static_cast<int64_t>(~static_cast<unsigned>(key & 0xffffffffull));
}

// Max over a whole block (blockDim.x a multiple of 32). `scratch` holds 32 keys. Every thread gets it.
__device__ __forceinline__ u64 block_max_u64(u64 v, u64* scratch) {
  return block_reduce(v, scratch, Max{}, u64{0});
}

// The argmax key of elements [8 * c_begin, 8 * c_end) of a row, this thread's share (stride
// blockDim), four groups' loads issued together per trip. A thread meets its elements in increasing
// index order, so a running (value, index) pair updated on a strict > keeps the lowest index of a
// tie, and the 64-bit key is made once, at the end. Per group of 8 only a max and a sum are taken;
// the group is scanned element by element only when its max beats the running value, its sum is
// NaN (a NaN inside, or inf - inf: the scan sorts that out), it is a ragged tail, or nothing is
// held yet. The first NaN is kept against everything (torch's rule: NaN is the largest). Making a
// key of every element instead was 11% slower at B = 64 (bench/RESULTS.md, session 12).
template <typename T>
__device__ __forceinline__ u64 thread_argmax(const T* __restrict__ row, int64_t V, int64_t c_begin,
                                             int64_t c_end, bool vec_ok) {
  constexpr int kGroups = 4;
  float best = -INFINITY;
  int64_t best_i = -1;  // none yet
  for (int64_t c = c_begin + threadIdx.x; c < c_end; c += kGroups * blockDim.x) {
    float f[kGroups][8];
    int n[kGroups];
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int64_t cu = c + u * static_cast<int64_t>(blockDim.x);
      n[u] = 0;
      if (cu < c_end) {
        n[u] = load8(row, V, cu, vec_ok, f[u]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[u][j] = 0.f;  // never loaded: defined, and n[u] = 0 skips it
      }
    }
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      float mx = f[u][0], sum = f[u][0];
#pragma unroll
      for (int j = 1; j < 8; ++j) {
        mx = fmaxf(mx, f[u][j]);
        sum += f[u][j];
      }
      if (n[u] == 0 || !(mx > best || sum != sum || n[u] < 8 || best_i < 0)) continue;
      const int64_t i0 = (c + u * static_cast<int64_t>(blockDim.x)) * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = f[u][j];
        if (j < n[u] && (best_i < 0 || v > best || (v != v && best == best))) {
          best = v;
          best_i = i0 + j;
        }
      }
    }
  }
  return best_i < 0 ? u64{0} : argmax_key(best, static_cast<unsigned>(best_i));
}

}  // namespace decodex
