// Sampling one token per row of logits [B, V] (bf16 or fp32) with per-row temperature, top-k and
// top-p, exactly decodex.reference.sample's algorithm, on the device, with no sort of the vocabulary.
//
// Shared frame: one block of 1024 threads per row. temperature <= 0: the argmax (NaN largest, ties
// to the lowest index, as torch.argmax). Otherwise, with y = x / t and e = expf(y - max y) computed
// per element exactly as the reference does in fp32:
//   top-k  keeps y >= the k-th largest y (value ties kept, as `row >= topk(k).values[-1]`);
//   top-p  walks the kept values from the largest down accumulating e; the first value where the
//          normalised running mass reaches top_p is the nucleus' smallest member (the reference's
//          sorted_p[need - 1]) and keeps e >= its e (ties kept); if the mass never reaches top_p
//          (rounding), nothing more is removed;
//   draw   u = reference.uniform(seed, position) (splitmix64, bit-exact); the token is the first
//          index, in index order, whose running sum of kept e exceeds u * (kept total): a block-wide
//          fp64 prefix sum over 8192 elements per step, stopping at the step that crosses.
// Working in e = p * Z instead of normalised p changes sums only by rounding: a token can differ from
// the reference's only when u * total lies within a rounding band of a cumulative boundary, or top_p
// within one of a nucleus boundary (tests/test_sample.py detects and counts those cases).
//
// Variant bf16 (the decode path): a bf16 logit has only 65536 bit patterns and every quantity above
// is a function of the pattern, so the block reads the row once into a full-resolution histogram of
// the patterns in order-preserving "key" form (128 KB of shared memory: two 16-bit counters per
// word; a counter reaching 32768 is reset by the thread that got it there, which records the 32768
// in a 16-entry overflow table, so counts are exact for V < 2^19). max, the top-k key, the top-p
// key, the kept-key bitmap and the kept total all come from sweeps over the 65536 keys (64
// contiguous keys per thread, thread 0 the largest, read with a per-lane rotation so a warp hits 32
// banks), count * e per key: no float atomics. Then the one index-order pass.
// Variant fp32 (host-side callers with fp32 logits): 32-bit keys, so radix selection, 8 bits per
// pass from the top: top-k with 256-bin counts (4 passes), top-p with 256-bin masses accumulated in
// per-warp fp64 shared histograms (4 passes, the first also gives the normaliser), a pass for the
// kept total, then the index-order pass. Slower (about 11 reads of the row, L2-resident), exact.
//
// Limits: V in [1, 2^19), inner dim contiguous (rows that are not 16-byte aligned use scalar loads).
// Finite logits (-inf allowed); NaN logits are never drawn (the reference's result is meaningless
// then). Shared memory per block: ~137 KB (bf16), ~67 KB (fp32).
#include <algorithm>

#include "common.h"
#include "logits.cuh"
#include "ops.h"

namespace decodex {

constexpr int kSampleThreads = 1024;
constexpr unsigned kNoKey = 0xffffffffu;
constexpr int64_t kSampleMaxV = (int64_t(1) << 19) - 1;

// Small per-block state of both variants.
struct SampleScratch {
  double d[32];
  unsigned u[32];
  u64 k[32];
  unsigned sel;     // broadcast: a selected key or bin (kNoKey: none)
  unsigned sel_n;   // broadcast: the count above the selected bin
  double sel_mass;  // broadcast: the mass above the selected bin
  float e_thr;      // broadcast: the top-p threshold on e
};

// e of a logit: the reference's exp(row / t - max(row / t)), each step rounded as fp32 torch does.
__device__ __forceinline__ float logit_e(float x, float t, float ymax) {
  return expf(__fsub_rn(__fdiv_rn(x, t), ymax));
}

// ---- block-wide scans and reductions (blockDim.x == kSampleThreads) ----

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Exclusive prefix sum over threads in index order; *total gets the block sum.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T incl = warp_inclusive_scan(v);
  T excl = __shfl_up_sync(0xffffffffu, incl, 1);  // exclusive within the warp, without subtracting
  if (lane == 0) excl = T(0);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  const T w = warp_inclusive_scan(scratch[lane]);  // 32 warps: every lane holds one warp total
  const T before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
  *total = __shfl_sync(0xffffffffu, w, 31);
  return warp ? before + excl : excl;
}

__device__ __forceinline__ double block_sum_double(double v, double* scratch) {
  double total;
  block_exclusive_scan(v, scratch, &total);
  return total;
}

// Block max / min of an unsigned over exactly 32 warps (the redux instruction, one per warp, then one
// over the 32 warp results).
template <bool kMax>
__device__ __forceinline__ unsigned block_extreme_uint(unsigned v, unsigned* scratch) {
  auto warp_extreme = [](unsigned u) {
    return kMax ? __reduce_max_sync(0xffffffffu, u) : __reduce_min_sync(0xffffffffu, u);
  };
  v = warp_extreme(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_extreme(scratch[threadIdx.x & 31]);
}

__device__ __forceinline__ unsigned block_max_uint(unsigned v, unsigned* scratch) {
  return block_extreme_uint<true>(v, scratch);
}

__device__ __forceinline__ unsigned block_min_uint(unsigned v, unsigned* scratch) {
  return block_extreme_uint<false>(v, scratch);
}

// ---- variant bf16: the full-resolution histogram ----

constexpr int kKeys = 65536;                      // bf16 bit patterns
constexpr int kSegKeys = kKeys / kSampleThreads;  // 64 contiguous keys per thread
constexpr int kHistWords = kKeys / 2;             // two 16-bit counters per word
constexpr int kOvfSlots = 16;                     // V < 16 * 32768: at most 15 keys overflow

struct Hist16 {
  unsigned hist[kHistWords];  // key k: bits 16*(k&1) .. +15 of word k>>1
  unsigned keep[kKeys / 32];  // kept-key bitmap for the index-order pass
  unsigned ovf_key[kOvfSlots];
  unsigned ovf_cnt[kOvfSlots];
  int any_ovf;
};

// Order-preserving map of bf16 bits to 16 bits: larger value, larger key (-0 one below +0).
__device__ __forceinline__ unsigned bf16_key(unsigned bits) {
  return (bits & 0x8000u) ? (~bits & 0xffffu) : (bits | 0x8000u);
}
__device__ __forceinline__ float bf16_key_value(unsigned key) {
  const unsigned bits = (key & 0x8000u) ? (key & 0x7fffu) : (~key & 0xffffu);
  return __uint_as_float(bits << 16);
}

__device__ __forceinline__ void hist_add(Hist16& hs, unsigned key) {
  const unsigned sh = (key & 1u) << 4;
  const unsigned old = atomicAdd(&hs.hist[key >> 1], 1u << sh);
  if (((old >> sh) & 0xffffu) == 0x7fffu) {
    // This increment made the counter 32768: take it back to 0 and count the 32768 in the table.
    // (Other threads can add at most ~1000 more meanwhile; the field never reaches 0x10000.)
    atomicSub(&hs.hist[key >> 1], 0x8000u << sh);
    for (int s = 0; s < kOvfSlots; ++s) {
      const unsigned prev = atomicCAS(&hs.ovf_key[s], kNoKey, key);
      if (prev == kNoKey || prev == key) {
        atomicAdd(&hs.ovf_cnt[s], 1u);
        break;
      }
    }
    hs.any_ovf = 1;
  }
}

__device__ __forceinline__ unsigned hist_count(const Hist16& hs, unsigned word, unsigned key) {
  unsigned c = (word >> ((key & 1u) << 4)) & 0xffffu;
  if (hs.any_ovf) {
    for (int s = 0; s < kOvfSlots; ++s)
      if (hs.ovf_key[s] == key) c += 32768u * hs.ovf_cnt[s];
  }
  return c;
}

// Calls f(key, count) for every key of this thread's segment with count > 0, in a rotated order
// (for sums and bitmaps only). Segment of thread t: keys [65472 - 64t, 65535 - 64t].
template <typename F>
__device__ __forceinline__ void for_each_present_key(const Hist16& hs, F&& f) {
  const unsigned lo = kKeys - kSegKeys * (threadIdx.x + 1);
  const unsigned w0 = lo >> 1, lane = threadIdx.x & 31;
  const bool any_ovf = hs.any_ovf;
#pragma unroll 4
  for (unsigned s = 0; s < kSegKeys / 2; ++s) {
    const unsigned w = w0 + ((s + lane) & 31u);
    const unsigned word = hs.hist[w];
    if (word == 0 && !any_ovf) continue;
    const unsigned c0 = hist_count(hs, word, 2 * w), c1 = hist_count(hs, word, 2 * w + 1);
    if (c0) f(2 * w, c0);
    if (c1) f(2 * w + 1, c1);
  }
}

// Thresholds, kept-key bitmap and kept total of one bf16 row. Returns false if every logit is NaN.
static __device__ bool prepare_bf16(const __nv_bfloat16* __restrict__ row, int64_t V, bool vec_ok,
                                    float t, int k, float pp, Hist16& hs, SampleScratch& sc,
                                    float& ymax, double& total) {
  const int tid = threadIdx.x;
  const int64_t groups = (V + 7) / 8;
  // 1. Histogram of the row's keys (NaN left out), and the largest key.
  for (int i = tid; i < kHistWords / 4; i += kSampleThreads)
    reinterpret_cast<uint4*>(hs.hist)[i] = make_uint4(0, 0, 0, 0);
  if (tid < kOvfSlots) {
    hs.ovf_key[tid] = kNoKey;
    hs.ovf_cnt[tid] = 0;
  }
  if (tid == 0) hs.any_ovf = 0;
  __syncthreads();
  unsigned max_key = 0, any_valid = 0;
  for (int64_t c = tid; c < groups; c += kSampleThreads) {
    float f[8];
    const int n = load8(row, V, c, vec_ok, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < n && f[j] == f[j]) {
        const unsigned key = bf16_key(__float_as_uint(f[j]) >> 16);
        hist_add(hs, key);
        max_key = max(max_key, key);
        any_valid = 1;
      }
    }
  }
  any_valid = block_max_uint(any_valid, sc.u);  // also the barrier after the histogram
  if (!any_valid) return false;
  max_key = block_max_uint(max_key, sc.u);
  ymax = __fdiv_rn(bf16_key_value(max_key), t);

  // 2. top-k: the key where the count from the top reaches k; keep y >= its y.
  float thr_y = -INFINITY;
  if (k > 0 && k < V) {
    unsigned seg = 0;
    for_each_present_key(hs, [&](unsigned, unsigned c) { seg += c; });
    unsigned all;
    const unsigned excl = block_exclusive_scan(seg, sc.u, &all);
    if (tid == 0) sc.sel = kNoKey;
    __syncthreads();
    const unsigned kk = static_cast<unsigned>(k);
    if (excl < kk && excl + seg >= kk) {  // this thread's segment holds the k-th largest
      unsigned cum = excl;
      for (int j = 0; j < kSegKeys; ++j) {
        const unsigned key = kKeys - 1 - kSegKeys * tid - j;
        cum += hist_count(hs, hs.hist[key >> 1], key);
        if (cum >= kk) {
          sc.sel = key;
          break;
        }
      }
    }
    __syncthreads();
    if (sc.sel != kNoKey) thr_y = __fdiv_rn(bf16_key_value(sc.sel), t);  // else < k non-NaN logits
  }

  // 3. top-p: the first kept key (from the top) where the normalised running mass reaches top_p.
  float e_thr = 0.f;  // keep e >= e_thr; 0 keeps everything top-k kept
  if (pp < 1.f) {
    double seg = 0.0;
    unsigned has = 0;
    for_each_present_key(hs, [&](unsigned key, unsigned c) {
      const float x = bf16_key_value(key);
      if (__fdiv_rn(x, t) >= thr_y) {
        seg += static_cast<double>(c) * static_cast<double>(logit_e(x, t, ymax));
        has = 1;
      }
    });
    double Z;
    const double excl = block_exclusive_scan(seg, sc.d, &Z);
    const bool reaches = has && static_cast<float>((excl + seg) / Z) >= pp;
    const unsigned first = block_min_uint(reaches ? static_cast<unsigned>(tid) : kNoKey, sc.u);
    if (first != kNoKey && tid == static_cast<int>(first)) {
      double cum = excl;
      float last_e = 0.f;
      bool done = false;
      for (int j = 0; j < kSegKeys && !done; ++j) {
        const unsigned key = kKeys - 1 - kSegKeys * tid - j;
        const unsigned c = hist_count(hs, hs.hist[key >> 1], key);
        const float x = bf16_key_value(key);
        if (c && __fdiv_rn(x, t) >= thr_y) {
          last_e = logit_e(x, t, ymax);
          cum += static_cast<double>(c) * static_cast<double>(last_e);
          done = static_cast<float>(cum / Z) >= pp;
        }
      }
      sc.e_thr = last_e;  // the crossing key's e (its segment's last kept one if rounding disagrees)
    }
    __syncthreads();
    if (first != kNoKey) e_thr = sc.e_thr;
  }

  // 4. The kept-key bitmap and the kept mass.
  double mass = 0.0;
  {
    u64 bits = 0;
    const unsigned lo = kKeys - kSegKeys * (tid + 1);
    for_each_present_key(hs, [&](unsigned key, unsigned c) {
      const float x = bf16_key_value(key);
      if (__fdiv_rn(x, t) >= thr_y) {
        const float e = logit_e(x, t, ymax);
        if (e >= e_thr) {
          bits |= 1ull << (key - lo);
          mass += static_cast<double>(c) * static_cast<double>(e);
        }
      }
    });
    hs.keep[lo / 32] = static_cast<unsigned>(bits);
    hs.keep[lo / 32 + 1] = static_cast<unsigned>(bits >> 32);
  }
  total = block_sum_double(mass, sc.d);  // its barriers also publish the bitmap
  return true;
}

// ---- variant fp32: radix selection, 8 bits per pass ----

struct Radix32 {
  double whist[kSampleThreads / 32][256];  // per-warp bin masses (fp64 atomics stay in the warp)
  double bin_mass[256];
  unsigned bin_cnt[256];
};

__device__ __forceinline__ unsigned f32_key(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float f32_key_value(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Calls f(x) for every non-NaN logit of the row (this thread's share).
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ row, int64_t V, bool vec_ok,
                                               F&& f) {
  const int64_t groups = (V + 7) / 8;
  for (int64_t c = threadIdx.x; c < groups; c += kSampleThreads) {
    float x[8];
    const int n = load8(row, V, c, vec_ok, x);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n && x[j] == x[j]) f(x[j]);
  }
}

// Thresholds and kept total of one fp32 row. Returns false if every logit is NaN.
static __device__ bool prepare_f32(const float* __restrict__ row, int64_t V, bool vec_ok, float t,
                                   int k, float pp, Radix32& rs, SampleScratch& sc, float& ymax,
                                   float& thr_y, float& e_thr, double& total) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned max_key = 0, any_valid = 0;
  for_each_logit(row, V, vec_ok, [&](float x) {
    max_key = max(max_key, f32_key(x));
    any_valid = 1;
  });
  any_valid = block_max_uint(any_valid, sc.u);
  if (!any_valid) return false;
  max_key = block_max_uint(max_key, sc.u);
  ymax = __fdiv_rn(f32_key_value(max_key), t);

  // top-k: the k-th largest key, one byte per pass, by counts.
  thr_y = -INFINITY;
  if (k > 0 && k < V) {
    unsigned prefix = 0, mask = 0, rem = static_cast<unsigned>(k);
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      if (tid < 256) rs.bin_cnt[tid] = 0;
      __syncthreads();
      for_each_logit(row, V, vec_ok, [&](float x) {
        const unsigned key = f32_key(x);
        if ((key & mask) == prefix) atomicAdd(&rs.bin_cnt[(key >> shift) & 255u], 1u);
      });
      __syncthreads();
      if (warp == 0) {  // lane l owns bins 255 - 8l - j, j = 0..7 (descending)
        unsigned cnt[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum += cnt[j] = rs.bin_cnt[255 - 8 * lane - j];
        const unsigned incl = warp_inclusive_scan(sum), excl = incl - sum;
        const bool hit = excl < rem && incl >= rem;
        if (__ballot_sync(0xffffffffu, hit) == 0 && lane == 0) sc.sel = kNoKey;
        if (hit) {
          unsigned cum = excl;
          for (int j = 0; j < 8; ++j) {
            if (cum + cnt[j] >= rem) {
              sc.sel = 255 - 8 * lane - j;
              sc.sel_n = cum;
              break;
            }
            cum += cnt[j];
          }
        }
      }
      __syncthreads();
      if (sc.sel == kNoKey) {
        found = false;  // fewer than k non-NaN logits: no top-k
      } else {
        prefix |= sc.sel << shift;
        mask |= 0xffu << shift;
        rem -= sc.sel_n;
      }
    }
    if (found) thr_y = __fdiv_rn(f32_key_value(prefix), t);
  }

  // top-p: the first kept key (from the top) where the normalised running mass reaches top_p, one
  // byte per pass, by masses. The first pass bins every kept logit, so it also gives Z.
  e_thr = 0.f;
  if (pp < 1.f) {
    unsigned prefix = 0, mask = 0;
    double above = 0.0, Z = 0.0;  // Z: meaningful in warp 0, which does the selection
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      double* wh = &rs.whist[0][0];
      for (int i = tid; i < (kSampleThreads / 32) * 256; i += kSampleThreads) wh[i] = 0.0;
      if (tid < 256) rs.bin_cnt[tid] = 0;
      __syncthreads();
      for_each_logit(row, V, vec_ok, [&](float x) {
        const float y = __fdiv_rn(x, t);
        const unsigned key = f32_key(x);
        if (y >= thr_y && (key & mask) == prefix) {
          const unsigned d = (key >> shift) & 255u;
          atomicAdd(&rs.bin_cnt[d], 1u);
          const float e = expf(__fsub_rn(y, ymax));
          if (e > 0.f) atomicAdd(&rs.whist[warp][d], static_cast<double>(e));
        }
      });
      __syncthreads();
      if (tid < 256) {
        double m = 0.0;
        for (int w = 0; w < kSampleThreads / 32; ++w) m += rs.whist[w][tid];
        rs.bin_mass[tid] = m;
      }
      __syncthreads();
      if (warp == 0) {
        double m[8], sum = 0.0;
        unsigned present = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          m[j] = rs.bin_mass[255 - 8 * lane - j];
          sum += m[j];
          if (rs.bin_cnt[255 - 8 * lane - j]) present |= 1u << j;
        }
        if (shift == 24) Z = warp_reduce(sum, Sum{});
        const double incl = warp_inclusive_scan(sum);
        double excl = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) excl = 0.0;
        int hit = -1;
        double cum = above + excl, before = 0.0;
        for (int j = 0; j < 8; ++j) {
          if (hit < 0) {
            before = cum;
            cum += m[j];
            if ((present >> j & 1u) && static_cast<float>(cum / Z) >= pp) hit = j;
          }
        }
        const unsigned hits = __ballot_sync(0xffffffffu, hit >= 0);
        if (hits) {
          if (lane == __ffs(hits) - 1) {
            sc.sel = 255 - 8 * lane - hit;
            sc.sel_mass = before;
          }
        } else if (shift == 24) {
          if (lane == 0) sc.sel = kNoKey;  // the mass never reaches top_p: no top-p cut
        } else {
          // Rounding: the parent bin reached top_p but no child does; take its last present child.
          const unsigned have = __ballot_sync(0xffffffffu, present != 0);
          const int L = 31 - __clz(have);  // the parent is present, so some child is
          if (lane == L) {
            const int j = 31 - __clz(present);
            double bsum = above + excl;
            for (int i = 0; i < j; ++i) bsum += m[i];
            sc.sel = 255 - 8 * lane - j;
            sc.sel_mass = bsum;
          }
        }
      }
      __syncthreads();
      if (sc.sel == kNoKey) {
        found = false;
      } else {
        prefix |= sc.sel << shift;
        mask |= 0xffu << shift;
        above = sc.sel_mass;
      }
    }
    if (found) e_thr = logit_e(f32_key_value(prefix), t, ymax);
  }

  double mass = 0.0;
  for_each_logit(row, V, vec_ok, [&](float x) {
    const float y = __fdiv_rn(x, t);
    if (y >= thr_y) {
      const float e = expf(__fsub_rn(y, ymax));
      if (e >= e_thr) mass += static_cast<double>(e);
    }
  });
  total = block_sum_double(mass, sc.d);
  return true;
}

// ---- the draw and the kernel ----

__device__ __forceinline__ u64 splitmix64(u64 x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// reference.uniform: 24 bits of splitmix64(splitmix64(seed) + position), exact in fp32.
__device__ __forceinline__ float sample_uniform(int64_t seed, int position) {
  const u64 h = splitmix64(splitmix64(static_cast<u64>(seed)) +
                           static_cast<u64>(static_cast<int64_t>(position)));
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

template <typename T>
__global__ void __launch_bounds__(kSampleThreads, 1)
sample_kernel(const T* __restrict__ logits,  // [B, V], row stride row_stride
              int64_t row_stride, int64_t V, bool vec_ok,
              const float* __restrict__ temperature,  // [B]
              const int* __restrict__ top_k,          // [B]
              const float* __restrict__ top_p,        // [B]
              const int64_t* __restrict__ seed,       // [B]
              const int* __restrict__ positions,      // [B]
              int64_t* __restrict__ out,              // [B], stride out_stride
              int64_t out_stride) {
  pdl_begin();
  __shared__ SampleScratch sc;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  const T* row = logits + b * row_stride;
  const int64_t groups = (V + 7) / 8;
  const float t = temperature[b];

  if (t <= 0.f) {  // greedy
    const u64 best = block_max_u64(thread_argmax(row, V, 0, groups, vec_ok), sc.k);
    if (tid == 0) out[b * out_stride] = argmax_key_index(best);
    return;
  }

  float ymax, thr_y = -INFINITY, e_thr = 0.f;
  double total;
  bool ok;
  if constexpr (sizeof(T) == 2) {
    ok = prepare_bf16(row, V, vec_ok, t, top_k[b], top_p[b], *reinterpret_cast<Hist16*>(smem_raw), sc,
                      ymax, total);
  } else {
    ok = prepare_f32(row, V, vec_ok, t, top_k[b], top_p[b], *reinterpret_cast<Radix32*>(smem_raw), sc,
                     ymax, thr_y, e_thr, total);
  }
  if (!ok) {  // every logit NaN: nothing to sample from
    if (tid == 0) out[b * out_stride] = 0;
    return;
  }
  // Kept, and its e (0 if not kept).
  auto kept_e = [&](float x) -> float {
    if constexpr (sizeof(T) == 2) {
      const Hist16& hs = *reinterpret_cast<const Hist16*>(smem_raw);
      const unsigned key = bf16_key(__float_as_uint(x) >> 16);  // NaN keys are never in the bitmap
      return (hs.keep[key >> 5] >> (key & 31u)) & 1u ? logit_e(x, t, ymax) : -1.f;
    } else {
      if (x != x) return -1.f;
      const float y = __fdiv_rn(x, t);
      if (!(y >= thr_y)) return -1.f;
      const float e = expf(__fsub_rn(y, ymax));
      return e >= e_thr ? e : -1.f;
    }
  };
  const double thr = static_cast<double>(sample_uniform(seed[b], positions[b])) * total;

  // In index order: the first kept index whose running sum of e exceeds u * total.
  double carry = 0.0;
  unsigned last_kept = 0;  // 1 + the last kept index seen by this thread (0: none)
  for (int64_t base = 0; base < groups; base += kSampleThreads) {
    const int64_t c = base + tid;
    float e[8];
    double s = 0.0;
    if (c < groups) {
      float x[8];
      const int n = load8(row, V, c, vec_ok, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        e[j] = j < n ? kept_e(x[j]) : -1.f;
        if (e[j] >= 0.f) {
          s += static_cast<double>(e[j]);
          last_kept = static_cast<unsigned>(c * 8 + j) + 1;
        }
      }
    }
    double step_total;
    const double excl = block_exclusive_scan(s, sc.d, &step_total);
    unsigned cand = kNoKey;
    if (c < groups && carry + excl + s > thr) {
      double run = carry + excl;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (e[j] > 0.f) {
          run += static_cast<double>(e[j]);
          if (cand == kNoKey && run > thr) cand = static_cast<unsigned>(c * 8 + j);
        }
      }
      if (cand == kNoKey) {  // rounding between the scan and this walk: its last kept element
        for (int j = 7; j >= 0 && cand == kNoKey; --j)
          if (e[j] > 0.f) cand = static_cast<unsigned>(c * 8 + j);
      }
    }
    cand = block_min_uint(cand, sc.u);
    if (cand != kNoKey) {
      if (tid == 0) out[b * out_stride] = cand;
      return;
    }
    carry += step_total;
  }
  // Never exceeded (rounding): the last kept index, as the reference's clamp.
  const unsigned last = block_max_uint(last_kept, sc.u);
  if (tid == 0) out[b * out_stride] = last ? static_cast<int64_t>(last) - 1 : 0;
}

namespace {

template <typename T>
void launch_sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                   const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& positions,
                   at::Tensor& out, bool vec_ok, int smem) {
  allow_dynamic_smem(reinterpret_cast<const void*>(sample_kernel<T>), smem, logits.get_device(), "sample");
  const cudaError_t err = launch_pdl(
      sample_kernel<T>, dim3(static_cast<unsigned>(logits.size(0))), dim3(kSampleThreads),
      static_cast<size_t>(smem), current_stream(), reinterpret_cast<const T*>(logits.data_ptr()),
      logits.stride(0), logits.size(1), vec_ok, temperature.data_ptr<float>(), top_k.data_ptr<int>(),
      top_p.data_ptr<float>(), seed.data_ptr<int64_t>(), positions.data_ptr<int>(),
      out.data_ptr<int64_t>(), out.stride(0));
  DX_CHECK_LAUNCHED(err, "sample");
}

}  // namespace

// out[B] (int64): a token drawn from softmax(logits / temperature) restricted to top_k (<= 0: off)
// and top_p; temperature[b] <= 0 means greedy. The draw is a hash of (seed[b], positions[b]).
void sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
            const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& positions,
            at::Tensor& out) {
  DX_CHECK_CUDA(logits);
  DX_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "logits must have dtype BFloat16 or Float, got ", logits.scalar_type());
  DX_CHECK_DIM(logits, 2);
  const int64_t B = logits.size(0), V = logits.size(1);
  DX_CHECK(V >= 1 && V <= kSampleMaxV, "sample: V = logits.size(1) must be in [1, ", kSampleMaxV,
              "], got ", V);
  DX_CHECK(logits.stride(1) == 1 || V == 1, "logits must be contiguous along V, got strides ",
              logits.strides());
  auto check_vec = [&](const at::Tensor& t, const char* name, at::ScalarType dt) {
    DX_CHECK(t.is_cuda() && t.device() == logits.device(), name, " must be a CUDA tensor on ",
                logits.device(), ", got ", t.device());
    DX_CHECK(t.scalar_type() == dt, name, " must have dtype ", dt, ", got ", t.scalar_type());
    DX_CHECK(t.dim() == 1 && t.size(0) == B, name, " must have shape [", B, "], got ", t.sizes());
    DX_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  };
  check_vec(temperature, "temperature", at::kFloat);
  check_vec(top_k, "top_k", at::kInt);
  check_vec(top_p, "top_p", at::kFloat);
  check_vec(seed, "seed", at::kLong);
  check_vec(positions, "positions", at::kInt);
  DX_CHECK(out.is_cuda() && out.device() == logits.device(), "out must be a CUDA tensor on ",
              logits.device(), ", got ", out.device());
  DX_CHECK_DTYPE(out, at::kLong);
  DX_CHECK_SHAPE(out, B);
  if (B == 0) return;
  DX_CHECK(B <= 0x7fffffff, "sample: B too large");

  const c10::cuda::CUDAGuard guard(logits.device());
  const bool vec_ok = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 &&
                      (B == 1 || (logits.stride(0) * logits.element_size()) % 16 == 0);
  if (logits.scalar_type() == at::kBFloat16) {
    launch_sample<__nv_bfloat16>(logits, temperature, top_k, top_p, seed, positions, out, vec_ok,
                                 static_cast<int>(sizeof(Hist16)));
  } else {
    launch_sample<float>(logits, temperature, top_k, top_p, seed, positions, out, vec_ok,
                         static_cast<int>(sizeof(Radix32)));
  }
  DX_CHECK_LAUNCH("sample");
}

}  // namespace decodex
