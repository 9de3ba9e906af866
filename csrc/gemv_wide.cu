// The wgmma GEMV: decodex::gemv's kernel for M = 17..64 rows of x (the plain epilogue: bias and
// accumulate, no RMS scale), the batched decode step's products above 16 rows, on warpgroup MMA
// (wgmma, sm_90a builds on compute capability 9.0: gemv_wgmma_available). gemv.cu's kernels serve
// the rest: M <= 16, the fused epilogues, other builds and devices.
//
// Why: at 64 rows a product does 64 multiply-adds per weight element. mma.sync kernels, every
// fragment through registers, ran out of instruction issue there (bench/RESULTS.md, session 13).
// wgmma reads both operands from shared memory, 64 x BN x 16 per instruction:
//  * A block is one warpgroup (128 threads) and BN = 64 or 128 weight rows. D[64 x BN] = x . W^T
//    with A = x (64 rows; rows past M are zeros) and B = the weight tile, both K-major.
//  * A ring of 4 stages, each 64 k of x (8 KB) and of the weight tile (BN x 128 B), filled by
//    cp.async in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), 3 stages
//    ahead; with prefetch_weight the first 3 stages' weights are requested before
//    griddepcontrol.wait.
//  * Split-K over the c blocks of a thread-block cluster (c = 1, 2, 4 or 8; 16, a non-portable
//    size, only when forced, for sweeps of the small-N products): each block's fp32
//    results go to its shared memory; after a cluster barrier, rank r sums its share of them over
//    the blocks in rank order (a fixed order: deterministic) and stores bf16, 8 outputs a thread.
// A row's result does not depend on the other rows (for a given configuration).
// DECODEX_GEMV_WIDE_CONFIG="t,c" (or "N,K:t,c;...") forces BN = 64 t and c, for sweeps.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <utility>

#include "common.h"
#include "gemv.h"
#include "ptx.cuh"

namespace decodex {
namespace {

constexpr int kMaxCluster = 8;

// 8 consecutive bf16 of out at p, `valid` (1..8) of them: one 16-byte access when vec (p 16-byte
// aligned) and all 8 are there, else element by element (the rest zeros / not stored). Plain
// coherent accesses: out is written in this kernel.
[[maybe_unused]] __device__ __forceinline__ uint4 load_out8(const __nv_bfloat16* p, int valid, bool vec) {
  if (vec && valid == 8) return *reinterpret_cast<const uint4*>(p);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < valid) e[i] = p[i];
  }
  return v;
}

[[maybe_unused]] __device__ __forceinline__ void store_out8(__nv_bfloat16* p, const uint4& v, int valid, bool vec) {
  if (vec && valid == 8) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < valid) p[i] = e[i];
  }
}

template <int BN>
__device__ __forceinline__ void wgmma_step(float (&d)[BN / 2], uint64_t da, uint64_t db) {
  if constexpr (BN == 128) {
    wgmma_m64n128k16(d, da, db);
  } else {
    wgmma_m64n64k16(d, da, db);
  }
}

constexpr int kStageK = 64;   // k a stage: one 128-byte swizzle row
constexpr int kStages = 4;    // ring depth (3 stages in flight while one is multiplied)
constexpr int kThreads = 128; // one warpgroup
constexpr int smem_bytes(int bn) { return kStages * (bn + 64) * 128 + 1024; }  // + alignment slack

// Grid: ceil(N / BN) * c blocks of one warpgroup; clusters of (c, 1, 1) when c > 1. Block b: weight
// rows (b / c) * BN ..., cluster rank (k-range) b % c of c ranges that split ceil(K / 64) stages.
// D[64 x BN] = x[64 x k] . W[BN x k]^T by wgmma: A = x (rows past m_rows zero), B = the weight tile,
// both staged by cp.async into a ring of kStages (x, W) tiles in the 128-byte swizzle.
template <int BN>
__global__ void __launch_bounds__(kThreads)
gemv_wide_kernel(const __nv_bfloat16* __restrict__ x,       // [m_rows, ldx], rows 16 B aligned
                 const __nv_bfloat16* __restrict__ weight,  // [N, ldw]
                 const __nv_bfloat16* __restrict__ bias,    // [N] or nullptr
                 __nv_bfloat16* __restrict__ out,           // [m_rows, ldo]
                 int64_t ldx, int64_t ldw, int64_t ldo, int N, int K, int m_rows, int c,
                 bool prefetch_weight, bool accumulate, bool vec_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWBytes = BN * 128, kStageBytes = kWBytes + 64 * 128;
  constexpr int kRedStride = BN + 4;  // floats a row of x in the results
  constexpr int kPieces = 64 * BN / 8;
  constexpr int kPiecesPerThread = kPieces / kThreads;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rank = static_cast<int>(blockIdx.x) % c;
  const int row0 = static_cast<int>(blockIdx.x) / c * BN;
  const int ksteps = (K + kStageK - 1) / kStageK;
  const int s_begin = static_cast<int>(static_cast<int64_t>(rank) * ksteps / c);
  const int s_end = static_cast<int>(static_cast<int64_t>(rank + 1) * ksteps / c);
  const int steps = s_end - s_begin;

  // Copies: thread tid moves 16-byte chunk q = tid % 8 of tile rows tid / 8 + 16j (x and W alike).
  const int q = tid & 7, r0 = tid >> 3;
  const uint32_t swz = static_cast<uint32_t>(r0 * 128 + ((q ^ (r0 & 7)) << 4));
  const int k_lim = K - s_begin * kStageK - q * 8;  // stage i's chunk exists while i * 64 < k_lim
  const int w_rows = N - row0 - r0, x_rows = m_rows - r0;  // rows r0 + 16j exist for 16j < these
  const __nv_bfloat16* wsrc = weight + static_cast<int64_t>(min(row0 + r0, N - 1)) * ldw + s_begin * kStageK + q * 8;
  const __nv_bfloat16* xsrc = x + static_cast<int64_t>(min(r0, m_rows - 1)) * ldx + s_begin * kStageK + q * 8;
  auto issue_weights = [&](int i) {
    const uint32_t dst = base + static_cast<uint32_t>((i % kStages) * kStageBytes) + swz;
    const bool in = i < steps && i * kStageK < k_lim;
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      const bool ok = in && 16 * j < w_rows;
      cp_async16_l2_256(dst + j * 16 * 128, ok ? wsrc + 16 * j * ldw + i * kStageK : weight, ok ? 16u : 0u);
    }
  };
  auto issue_x = [&](int i) {
    const uint32_t dst = base + static_cast<uint32_t>((i % kStages) * kStageBytes + kWBytes) + swz;
    const bool in = i < steps && i * kStageK < k_lim;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = in && 16 * j < x_rows;
      cp_async16(dst + j * 16 * 128, ok ? xsrc + 16 * j * ldx + i * kStageK : x, ok ? 16u : 0u);
    }
  };

  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  // The first kStages - 1 stages; with prefetch_weight their weights before griddepcontrol.wait (x,
  // which the kernel ahead writes, after it). One cp.async group a stage (the first also holds the
  // early weights).
  if (prefetch_weight) {
    for (int i = 0; i < kStages - 1; ++i) issue_weights(i);
  }
  pdl_begin();
  for (int i = 0; i < kStages - 1; ++i) {
    if (!prefetch_weight) issue_weights(i);
    issue_x(i);
    cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage i have landed
    fence_proxy_async_shared();    // ... and are visible to wgmma
    __syncthreads();               // every thread's; and every warp is done with stage i - 1
    issue_weights(i + kStages - 1);  // into stage i - 1's slot
    issue_x(i + kStages - 1);
    cp_async_commit();
    const uint32_t st = base + static_cast<uint32_t>((i % kStages) * kStageBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kStageK / 16; ++kk) {
      wgmma_step<BN>(d, smem_desc_sw128(st + kWBytes + kk * 32), smem_desc_sw128(st + kk * 32));
    }
    wgmma_commit();
    wgmma_wait_all();
  }
  cp_async_wait<0>();  // the zero-fills queued past the end
  __syncthreads();     // every warp is done with the ring: it takes the results

  // The block's results, [x row n][block row] in fp32. Thread (warp w, g, t) holds x rows 16w + g
  // (+ 8) and weight rows 8j + 2t (+ 1) of the tile (the wgmma accumulator layout).
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 16 * warp + g + 8 * h;
      *reinterpret_cast<float2*>(red + n * kRedStride + 8 * j + 2 * t) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
  }
  namespace cg = cooperative_groups;
  if (c > 1) {
    cg::this_cluster().sync();  // every block's partials written and visible cluster-wide
  } else {
    __syncthreads();
  }
  // The stores go by pieces of 8 consecutive weight rows of one x row: piece p = n * (BN / 8) +
  // rows / 8. Rank r takes pieces [r, r + 1) * kPieces / c and sums them over the cluster's blocks
  // in rank order (a fixed order: deterministic).
  const int lo = rank * kPieces / c, hi = (rank + 1) * kPieces / c;
  float y[kPiecesPerThread][8];
  uint4 old[kPiecesPerThread];
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + tid + pi * kThreads;
    const int n = p / (BN / 8), rl = p % (BN / 8) * 8, row = row0 + rl;
    const bool ok = p < hi && n < m_rows && row < N;
#pragma unroll
    for (int e = 0; e < 8; ++e) y[pi][e] = 0.f;
    old[pi] = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) continue;
    for (int r = 0; r < c; ++r) {
      const float* part = (c > 1 ? cg::this_cluster().map_shared_rank(red, r) : red) + n * kRedStride + rl;
      const float4 a = *reinterpret_cast<const float4*>(part), b = *reinterpret_cast<const float4*>(part + 4);
      y[pi][0] += a.x, y[pi][1] += a.y, y[pi][2] += a.z, y[pi][3] += a.w;
      y[pi][4] += b.x, y[pi][5] += b.y, y[pi][6] += b.z, y[pi][7] += b.w;
    }
    if (accumulate) old[pi] = load_out8(out + static_cast<int64_t>(n) * ldo + row, min(N - row, 8), vec_out);
  }
  if (c > 1) cg::this_cluster().sync();  // the other blocks' shared memory outlives these reads
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + tid + pi * kThreads;
    const int n = p / (BN / 8), rl = p % (BN / 8) * 8, row = row0 + rl;
    if (!(p < hi && n < m_rows && row < N)) continue;
    // Rounded as gemv.cu's kStore: the product (+ bias) to bf16, then (accumulate) the sum again.
    const __nv_bfloat16* olds = reinterpret_cast<const __nv_bfloat16*>(&old[pi]);
    uint4 packed;
    __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float v = y[pi][e];
      if (bias != nullptr && row + e < N) v = __fadd_rn(v, __bfloat162float(bias[row + e]));
      v = __bfloat162float(__float2bfloat16_rn(v));
      if (accumulate) v = __fadd_rn(__bfloat162float(olds[e]), v);
      o8[e] = __float2bfloat16_rn(v);
    }
    store_out8(out + static_cast<int64_t>(n) * ldo + row, packed, min(N - row, 8), vec_out);
  }
#else
  pdl_begin();
  __trap();  // wgmma: sm_90a only; gemv_wgmma_available keeps the host from sending work here
#endif
}

// ---- host ----

struct WideConfig {
  int t, c;  // weight rows a block: 64 t (t = 1 or 2); blocks per cluster (split-K)
};

using WideKernel = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                            __nv_bfloat16*, int64_t, int64_t, int64_t, int, int, int, int, bool, bool,
                            bool);

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 64 weight rows a block, and the smallest cluster (split-K) that puts blocks on about 0.7 of the
// SMs, keeping at least 2 stages of k a block. This matches the best configuration of every
// Qwen2.5 product swept at 64 rows (bench/RESULTS.md, session 13; at 32 rows the 1.5B down and
// 7B gate|up were 1-3% faster with twice the c).
WideConfig choose_wide(int64_t N, int64_t K, int sms) {
  WideConfig cf{1, 1};
  const int64_t groups = ceil_div(N, 64), ksteps = ceil_div(K, kStageK);
  while (cf.c < kMaxCluster && 10 * groups * cf.c < 7 * sms && ksteps / (2 * cf.c) >= 1) cf.c *= 2;
  return cf;
}

}  // namespace

bool gemv_wgmma_available(int device) {
#if defined(DECODEX_SM90A)
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device) == 9 &&
         device_attribute<cudaDevAttrComputeCapabilityMinor>(device) == 0;
#else
  (void)device;
  return false;
#endif
}

void launch_gemv_wide(const at::Tensor& x, const at::Tensor& weight, const __nv_bfloat16* bias,
                      at::Tensor& out, const GemvOptions& options) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  DX_CHECK(gemv_wgmma_available(device), "decodex::gemv: the wgmma kernel needs an sm_90a build ",
           "and a device of compute capability 9.0");
  WideConfig cf{};
  int fields[2];
  if (config_from_env("DECODEX_GEMV_WIDE_CONFIG", "t,c", N, K, fields, 2)) {
    cf = {fields[0], fields[1]};
    DX_CHECK(cf.t == 1 || cf.t == 2, "DECODEX_GEMV_WIDE_CONFIG: t must be 1 or 2, got ", cf.t);
    DX_CHECK(cf.c == 1 || cf.c == 2 || cf.c == 4 || cf.c == 8 || cf.c == 16,
             "DECODEX_GEMV_WIDE_CONFIG: c must be 1, 2, 4, 8 or 16, got ", cf.c);
  } else {
    thread_local std::map<std::array<int64_t, 3>, WideConfig> chosen;  // one choice per shape
    const std::array<int64_t, 3> key{N, K, device};
    auto it = chosen.find(key);
    if (it == chosen.end()) it = chosen.emplace(key, choose_wide(N, K, sm_count(device))).first;
    cf = it->second;
  }
  const WideKernel kernel = cf.t == 2 ? gemv_wide_kernel<128> : gemv_wide_kernel<64>;
  const int smem = smem_bytes(64 * cf.t);
  // The attributes are host-side state of the current device (no stream work, fine during CUDA-graph
  // capture): set once per device and kernel.
  thread_local std::set<std::pair<WideKernel, int>> allowed;
  if (allowed.insert({kernel, device}).second) {
    DX_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess,
             "decodex::gemv: could not allow ", smem, " bytes of shared memory for the wide kernel");
    DX_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess,
             "decodex::gemv: could not allow clusters of 16 for the wide kernel");
  }
  // 16-byte stores of 8 outputs: out 16-byte aligned with rows a multiple of 8 elements apart.
  const bool vec_out = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.stride(0) % 8 == 0;
  const int64_t blocks = ceil_div(N, 64 * cf.t) * cf.c;
  const cudaError_t err = launch_pdl_clusters(
      kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem),
      current_stream(), static_cast<unsigned>(cf.c), reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr()), bias,
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), M == 1 ? int64_t{0} : x.stride(0),
      N == 1 ? int64_t{0} : weight.stride(0), M == 1 ? int64_t{0} : out.stride(0), static_cast<int>(N),
      static_cast<int>(K), static_cast<int>(M), cf.c, options.prefetch_weight, options.accumulate,
      vec_out);
  DX_CHECK(err == cudaSuccess, "decodex::gemv wide kernel launch failed (t=", cf.t, ", c=", cf.c,
           "): ", cudaGetErrorString(err));
}

}  // namespace decodex
