// The wgmma GEMV: the batched decode step's products on warpgroup MMA (wgmma, sm_90a builds on
// compute capability 9.0: gemv_wgmma_available). Two epilogues:
//  * kStore (decodex::gemv, M = 17..64 rows of x): bias and accumulate, no RMS scale;
//  * kSiluMul (decodex::gemv_silu_mul, M = 9..64): out[m, i] = silu(gate) * up of the [gate; up]
//    weight, optionally each product row scaled by 1/rms(x row) first (rms_eps), the sum of squares
//    taken from the x tiles already in shared memory.
// gemv.cu's kernels serve the rest: fewer rows, the other epilogues, other builds and devices.
//
// Why: at 64 rows a product does 64 multiply-adds per weight element. mma.sync kernels, every
// fragment through registers, ran out of instruction issue there (bench/RESULTS.md, session 13).
// wgmma reads both operands from shared memory, 64 x BN x 16 per instruction:
//  * A block is one warpgroup (128 threads) and BN = 64, 96, 128 or 144 weight rows (the sizes let a
//    product's blocks spread evenly over the SMs: see choose_wide). D[64 x BN] = x . W^T
//    with A = x (64 rows; rows past M are zeros) and B = the weight tile, both K-major.
//  * A ring of S = 4 or 8 stages, each 64 k of x (8 KB) and of the weight tile (BN x 128 B), filled
//    by cp.async in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), S - 1
//    stages ahead; with prefetch_weight the first S - 1 stages' weights are requested before
//    griddepcontrol.wait.
//  * kSiluMul: a block's BN weight rows are BN / 2 gate rows and the BN / 2 matching up rows, so its
//    epilogue has both halves of its BN / 2 outputs.
//  * Split-K over the c blocks of a thread-block cluster (c = 1..8; 16, a non-portable size, only
//    when forced, for sweeps of the small-N products): each block's fp32
//    results go to its shared memory; after a cluster barrier, rank r sums its share of them over
//    the blocks in rank order (a fixed order: deterministic) and stores bf16, 8 outputs a thread.
// A row's result does not depend on the other rows (for a given configuration).
// DECODEX_GEMV_WIDE_CONFIG="bn,c,s" (or "N,K:bn,c,s;...", N the weight rows) forces BN, c and S,
// for sweeps.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <cmath>
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

// d[64 x BN] += x tile (desc_a) . weight tile^T, one k16 step: BN = 64 or 128 in one wgmma, 96 and
// 144 as 64 + 32 and 128 + 16 (the second over tile rows 64 / 128 on, whose accumulators continue
// d's layout). w: the weight tile's address plus the k16 step's 32 B.
template <int BN>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], uint64_t desc_a, uint32_t w) {
  constexpr int kHead = BN >= 128 ? 128 : 64, kTail = BN - kHead;
  wgmma_m64k16<kHead>(reinterpret_cast<float(&)[kHead / 2]>(d[0]), desc_a, smem_desc_sw128(w));
  if constexpr (kTail > 0) {
    wgmma_m64k16<kTail>(reinterpret_cast<float(&)[kTail / 2]>(d[kHead / 2]), desc_a,
                        smem_desc_sw128(w + kHead * 128));
  }
}

constexpr int kStageK = 64;   // k a stage: one 128-byte swizzle row
constexpr int kThreads = 128; // one warpgroup
// Shared memory of a block: the ring (+ alignment slack). The epilogue reuses it for the fp32
// results (64 x (BN + 4)) and the rows' sums of squares (64), which fit in any ring of S >= 2.
constexpr int smem_bytes(int bn, int stages) { return stages * (bn + 64) * 128 + 1024; }

// Grid: ceil(N / (BN or BN / 2 for kSiluMul)) * c blocks of one warpgroup; clusters of (c, 1, 1)
// when c > 1. Block b: output columns group (b / c), cluster rank (k-range) b % c of c ranges that
// split ceil(K / 64) stages. D[64 x BN] = x[64 x k] . W[BN x k]^T by wgmma: A = x (rows past m_rows
// zero), B = the block's weight rows, both staged by cp.async into a ring of S (x, W) tiles in the
// 128-byte swizzle. N is out's columns (I for kSiluMul, whose weight has 2I rows).
template <int BN, int S>
__global__ void __launch_bounds__(kThreads)
gemv_wide_kernel(const __nv_bfloat16* __restrict__ x,       // [m_rows, ldx], rows 16 B aligned
                 const __nv_bfloat16* __restrict__ weight,  // [N, ldw] ([2N, ldw] for silu)
                 const __nv_bfloat16* __restrict__ bias,    // [N] or nullptr (nullptr for silu)
                 __nv_bfloat16* __restrict__ out,           // [m_rows, ldo]
                 int64_t ldx, int64_t ldw, int64_t ldo, int N, int K, int m_rows, int c,
                 bool prefetch_weight, bool accumulate, bool vec_out, bool silu, bool rms,
                 float rms_eps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWBytes = BN * 128, kStageBytes = kWBytes + 64 * 128;
  constexpr int kRedStride = BN + 4;  // floats a row of x in the results
  constexpr int kPieces = 64 * BN / 8;  // kStore's pieces of 8 outputs (kSiluMul: half of them)
  constexpr int kPiecesPerThread = kPieces / kThreads, kSiluPiecesPerThread = (kPieces / 2 + kThreads - 1) / kThreads;
  static_assert(BN % 16 == 0 && kPieces % kThreads == 0, "BN: a multiple of 16");
  static_assert(64 * kRedStride * 4 + 64 * 4 <= S * kStageBytes, "the results outgrow the ring");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rank = static_cast<int>(blockIdx.x) % c;
  const int col0 = static_cast<int>(blockIdx.x) / c * (silu ? BN / 2 : BN);  // first output column
  const int ksteps = (K + kStageK - 1) / kStageK;
  const int s_begin = static_cast<int>(static_cast<int64_t>(rank) * ksteps / c);
  const int s_end = static_cast<int>(static_cast<int64_t>(rank + 1) * ksteps / c);
  const int steps = s_end - s_begin;

  // Copies: thread tid moves 16-byte chunk q = tid % 8 of tile rows r0 + 16j (x and W alike).
  // Weight tile row r is weight row col0 + r (kStore), or for kSiluMul gate row col0 + r (r < BN/2)
  // and up row N + col0 + r - BN/2.
  const int q = tid & 7, r0 = tid >> 3;
  const uint32_t swz = static_cast<uint32_t>(r0 * 128 + ((q ^ (r0 & 7)) << 4));
  const int k_lim = K - s_begin * kStageK - q * 8;  // stage i's chunk exists while i * 64 < k_lim
  const int x_rows = m_rows - r0;  // x rows r0 + 16j exist for 16j < x_rows
  const __nv_bfloat16* wsrc[BN / 16];
  unsigned w_ok = 0;  // bit j: tile row r0 + 16j is a weight row
#pragma unroll
  for (int j = 0; j < BN / 16; ++j) {
    const bool up = silu && r0 + 16 * j >= BN / 2;
    const int col = col0 + r0 + 16 * j - (up ? BN / 2 : 0);
    if (col < N) w_ok |= 1u << j;
    wsrc[j] = weight + (static_cast<int64_t>(min(col, N - 1)) + (up ? N : 0)) * ldw + s_begin * kStageK + q * 8;
  }
  const __nv_bfloat16* xsrc = x + static_cast<int64_t>(min(r0, m_rows - 1)) * ldx + s_begin * kStageK + q * 8;
  auto issue_weights = [&](int i) {
    const uint32_t dst = base + static_cast<uint32_t>((i % S) * kStageBytes) + swz;
    const bool in = i < steps && i * kStageK < k_lim;
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      const bool ok = in && (w_ok >> j & 1u);
      cp_async16_l2_256(dst + j * 16 * 128, ok ? wsrc[j] + i * kStageK : weight, ok ? 16u : 0u);
    }
  };
  auto issue_x = [&](int i) {
    const uint32_t dst = base + static_cast<uint32_t>((i % S) * kStageBytes + kWBytes) + swz;
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
  float ss[4] = {0.f, 0.f, 0.f, 0.f};  // rms: sums of squares of this thread's chunks of x rows r0 + 16j
  // The first S - 1 stages; with prefetch_weight their weights before griddepcontrol.wait (x, which
  // the kernel ahead writes, after it). One cp.async group a stage (the first also holds the early
  // weights).
  if (prefetch_weight) {
    for (int i = 0; i < S - 1; ++i) issue_weights(i);
  }
  pdl_begin();
  for (int i = 0; i < S - 1; ++i) {
    if (!prefetch_weight) issue_weights(i);
    issue_x(i);
    cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<S - 2>();       // this thread's copies of stage i have landed
    fence_proxy_async_shared();   // ... and are visible to wgmma
    __syncthreads();              // every thread's; and every warp is done with stage i - 1
    issue_weights(i + S - 1);     // into stage i - 1's slot
    issue_x(i + S - 1);
    cp_async_commit();
    const uint32_t st = base + static_cast<uint32_t>((i % S) * kStageBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kStageK / 16; ++kk) {
      wgmma_tile<BN>(d, smem_desc_sw128(st + kWBytes + kk * 32), st + kk * 32);
    }
    wgmma_commit();
    if (rms) {  // while the tensor cores work: the squares of the x chunks this thread copied
      const unsigned char* xs = smem + (i % S) * kStageBytes + kWBytes + swz;  // (zeros past K)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(xs + j * 16 * 128);  // one 16-byte load
        bf16x8 b;
        memcpy(&b, &v, sizeof(b));
        ss[j] = add_squares8(b, ss[j]);
      }
    }
    wgmma_wait_all();
  }
  cp_async_wait<0>();  // the zero-fills queued past the end
  __syncthreads();     // every warp is done with the ring: it takes the results

  // The block's results, [x row n][tile row] in fp32. Thread (warp w, g, t) holds x rows 16w + g
  // (+ 8) and tile rows 8j + 2t (+ 1) (the wgmma accumulator layout). Then, with rms, the x rows'
  // sums of squares over this block's k-range (the 8 threads of a row in lane order).
  float* red = reinterpret_cast<float*>(smem);
  float* red_ss = red + 64 * kRedStride;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 16 * warp + g + 8 * h;
      *reinterpret_cast<float2*>(red + n * kRedStride + 8 * j + 2 * t) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
  }
  if (rms) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], o);
      if (q == 0) red_ss[r0 + 16 * j] = ss[j];
    }
  }
  namespace cg = cooperative_groups;
  if (c > 1) {
    cg::this_cluster().sync();  // every block's partials written and visible cluster-wide
  } else {
    __syncthreads();
  }
  // The sum over the cluster's blocks, in rank order (a fixed order: deterministic), of the 8
  // results at float offset `at` of the blocks' results.
  auto cluster_sum8 = [&](int at, float (&v)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
    for (int r = 0; r < c; ++r) {
      const float* part = (c > 1 ? cg::this_cluster().map_shared_rank(red, r) : red) + at;
      const float4 a = *reinterpret_cast<const float4*>(part), b = *reinterpret_cast<const float4*>(part + 4);
      v[0] += a.x, v[1] += a.y, v[2] += a.z, v[3] += a.w;
      v[4] += b.x, v[5] += b.y, v[6] += b.z, v[7] += b.w;
    }
  };
  // The stores go by pieces of 8 consecutive outputs of one x row: piece p = n * (pieces a row) +
  // column / 8. Rank r takes pieces [r, r + 1) * pieces / c.
  const int row_pieces = silu ? BN / 16 : BN / 8, pieces = 64 * row_pieces;
  const int lo = rank * pieces / c, hi = (rank + 1) * pieces / c;
  if (silu) {
#pragma unroll
    for (int pi = 0; pi < kSiluPiecesPerThread; ++pi) {
      const int p = lo + tid + pi * kThreads;
      const int n = p / row_pieces, cl = p % row_pieces * 8, col = col0 + cl;
      if (!(p < hi && n < m_rows && col < N)) continue;
      float scale = 1.f;
      if (rms) {
        float sumsq = 0.f;
        for (int r = 0; r < c; ++r) sumsq += (c > 1 ? cg::this_cluster().map_shared_rank(red_ss, r) : red_ss)[n];
        scale = rms_inv(sumsq, K, rms_eps);
      }
      float gate[8], up[8];
      cluster_sum8(n * kRedStride + cl, gate);
      cluster_sum8(n * kRedStride + BN / 2 + cl, up);
      // Rounded as gemv.cu's kSiluMul: each product (scaled) to bf16, then silu(gate) * up.
      uint4 packed;
      __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float gv = __bfloat162float(__float2bfloat16_rn(rms ? __fmul_rn(gate[e], scale) : gate[e]));
        const float uv = __bfloat162float(__float2bfloat16_rn(rms ? __fmul_rn(up[e], scale) : up[e]));
        o8[e] = __float2bfloat16_rn(silu_times(gv, uv));
      }
      store_out8(out + static_cast<int64_t>(n) * ldo + col, packed, min(N - col, 8), vec_out);
    }
    if (c > 1) cg::this_cluster().sync();  // the other blocks' shared memory outlives the reads
    return;
  }
  float y[kPiecesPerThread][8];
  uint4 old[kPiecesPerThread];
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + tid + pi * kThreads;
    const int n = p / row_pieces, cl = p % row_pieces * 8, col = col0 + cl;
    old[pi] = make_uint4(0u, 0u, 0u, 0u);
    if (!(p < hi && n < m_rows && col < N)) continue;
    cluster_sum8(n * kRedStride + cl, y[pi]);
    if (accumulate) old[pi] = load_out8(out + static_cast<int64_t>(n) * ldo + col, min(N - col, 8), vec_out);
  }
  if (c > 1) cg::this_cluster().sync();  // the other blocks' shared memory outlives these reads
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + tid + pi * kThreads;
    const int n = p / row_pieces, cl = p % row_pieces * 8, col = col0 + cl;
    if (!(p < hi && n < m_rows && col < N)) continue;
    // Rounded as gemv.cu's kStore: the product (+ bias) to bf16, then (accumulate) the sum again.
    const __nv_bfloat16* olds = reinterpret_cast<const __nv_bfloat16*>(&old[pi]);
    uint4 packed;
    __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float v = y[pi][e];
      if (bias != nullptr && col + e < N) v = __fadd_rn(v, __bfloat162float(bias[col + e]));
      v = __bfloat162float(__float2bfloat16_rn(v));
      if (accumulate) v = __fadd_rn(__bfloat162float(olds[e]), v);
      o8[e] = __float2bfloat16_rn(v);
    }
    store_out8(out + static_cast<int64_t>(n) * ldo + col, packed, min(N - col, 8), vec_out);
  }
#else
  pdl_begin();
  __trap();  // wgmma: sm_90a only; gemv_wgmma_available keeps the host from sending work here
#endif
}

// ---- host ----

struct WideConfig {
  int bn, c, s;  // weight rows a block (BN); blocks per cluster (split-K); ring stages (S)
};

using WideKernel = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                            __nv_bfloat16*, int64_t, int64_t, int64_t, int, int, int, int, bool, bool,
                            bool, bool, bool, float);

template <int BN>
WideKernel wide_kernel_bn(int s) {
  return s == 8 ? gemv_wide_kernel<BN, 8> : gemv_wide_kernel<BN, 4>;
}

WideKernel wide_kernel(const WideConfig& cf) {
  switch (cf.bn) {
    case 64: return wide_kernel_bn<64>(cf.s);
    case 96: return wide_kernel_bn<96>(cf.s);
    case 128: return wide_kernel_bn<128>(cf.s);
    default: return wide_kernel_bn<144>(cf.s);
  }
}

// 64 weight rows a block and the smallest cluster (split-K) that puts blocks on about 0.7 of the SMs,
// keeping at least 2 stages of k a block. Then a ring of 8 where the grid fits one block an SM (its
// 128 KB allow no more) and each block has at least 12 stages of k to stream, else 4 (3 blocks an
// SM). Without split-K (large N), blocks of 144 rows (2 an SM) where the last wave of resident
// blocks is fuller than with 64 (the 7B gate|up: 264 blocks fill 2 an SM exactly, 9% faster than
// 592 blocks of 64). This matches the best configuration swept at 64 rows for every Qwen2.5 product
// within 4% (the 1.5B qkv: 64,2,8 was 3-4% faster than the 64,4,4 chosen) (bench/RESULTS.md,
// sessions 13 and 14). `rows`: the weight's rows (2I for kSiluMul); sm_smem: shared memory an SM,
// block_smem_reserved: what the system takes a block.
WideConfig choose_wide(int64_t rows, int64_t K, int sms, int sm_smem, int block_smem_reserved) {
  WideConfig cf{64, 1, 4};
  const int64_t groups = ceil_div(rows, 64), ksteps = ceil_div(K, kStageK);
  while (cf.c < kMaxCluster && 10 * groups * cf.c < 7 * sms && ksteps / (2 * cf.c) >= 1) cf.c *= 2;
  if (groups * cf.c <= sms && ksteps / cf.c >= 12) cf.s = 8;
  if (cf.c == 1) {
    auto idle = [&](int bn) {  // the unused fraction of the last wave of resident blocks
      const int64_t slots = int64_t{sms} * (sm_smem / (smem_bytes(bn, cf.s) + block_smem_reserved));
      const double waves = static_cast<double>(ceil_div(rows, bn)) / static_cast<double>(std::max<int64_t>(slots, 1));
      return std::ceil(waves) - waves;
    };
    if (idle(144) + 0.1 < idle(64)) cf.bn = 144;
  }
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

bool gemv_prefers_wgmma(int64_t M, int64_t N, int64_t K, int device) {
  if (M <= kWgmmaMinRows || !gemv_wgmma_available(device)) return false;
  int forced[3];
  if (config_from_env("DECODEX_GEMV_WIDE_CONFIG", "bn,c,s", N, K, forced, 3)) return true;
  // Up to 32 rows gemv.cu's wide kernels were faster on the small products (bench/RESULTS.md,
  // session 14: the 1.5B qkv and o, the 7B qkv, in the decode step's plan timings).
  return !(M <= 32 && N <= 4608 && K <= 4096);
}

void launch_gemv_wide(const char* op, const at::Tensor& x, const at::Tensor& weight,
                      const __nv_bfloat16* bias, at::Tensor& out, GemvEpilogue epilogue,
                      const GemvOptions& options) {
  const bool silu = epilogue == GemvEpilogue::kSiluMul;
  DX_CHECK(silu || epilogue == GemvEpilogue::kStore, "decodex::", op,
           ": the wgmma GEMV has no such epilogue");
  DX_CHECK(silu || !options.rms_eps.has_value(), "decodex::", op, ": the wgmma GEMV scales by 1/rms ",
           "only with the SiLU epilogue");
  const int64_t M = x.size(0), K = x.size(1), rows = weight.size(0);
  const int64_t N = silu ? rows / 2 : rows;  // out's columns
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  DX_CHECK(gemv_wgmma_available(device), "decodex::", op, ": the wgmma kernel needs an sm_90a build ",
           "and a device of compute capability 9.0");
  WideConfig cf{};
  int fields[3];
  if (config_from_env("DECODEX_GEMV_WIDE_CONFIG", "bn,c,s", rows, K, fields, 3)) {
    cf = {fields[0], fields[1], fields[2]};
    DX_CHECK(cf.bn == 64 || cf.bn == 96 || cf.bn == 128 || cf.bn == 144,
             "DECODEX_GEMV_WIDE_CONFIG: bn must be 64, 96, 128 or 144, got ", cf.bn);
    DX_CHECK((cf.c >= 1 && cf.c <= kMaxCluster) || cf.c == 16,
             "DECODEX_GEMV_WIDE_CONFIG: c must be 1..8 or 16, got ", cf.c);
    DX_CHECK(cf.s == 4 || cf.s == 8, "DECODEX_GEMV_WIDE_CONFIG: s must be 4 or 8, got ", cf.s);
  } else {
    thread_local std::map<std::array<int64_t, 3>, WideConfig> chosen;  // one choice per shape
    const std::array<int64_t, 3> key{rows, K, device};
    auto it = chosen.find(key);
    if (it == chosen.end()) {
      const WideConfig best = choose_wide(rows, K, sm_count(device),
                                          device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device),
                                          device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(device));
      it = chosen.emplace(key, best).first;
    }
    cf = it->second;
  }
  const WideKernel kernel = wide_kernel(cf);
  const int smem = smem_bytes(cf.bn, cf.s);
  // The cluster attribute, like the shared memory's: host-side state, set once per device and kernel.
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, device, op);
  thread_local std::set<std::pair<WideKernel, int>> allowed;
  if (allowed.insert({kernel, device}).second) {
    DX_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess,
             "decodex::", op, ": could not allow clusters of 16 for the wgmma kernel");
  }
  // 16-byte stores of 8 outputs: out 16-byte aligned with rows a multiple of 8 elements apart.
  const bool vec_out = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.stride(0) % 8 == 0;
  const int64_t blocks = ceil_div(N, silu ? cf.bn / 2 : cf.bn) * cf.c;
  const cudaError_t err = launch_pdl_clusters(
      kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem),
      current_stream(), static_cast<unsigned>(cf.c), reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr()), bias,
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), M == 1 ? int64_t{0} : x.stride(0),
      rows == 1 ? int64_t{0} : weight.stride(0), M == 1 ? int64_t{0} : out.stride(0), static_cast<int>(N),
      static_cast<int>(K), static_cast<int>(M), cf.c, options.prefetch_weight, options.accumulate,
      vec_out, silu, options.rms_eps.has_value(), options.rms_eps.value_or(0.f));
  DX_CHECK(err == cudaSuccess, "decodex::", op, " wgmma kernel launch failed (bn=", cf.bn, ", c=", cf.c,
           ", s=", cf.s, "): ", cudaGetErrorString(err));
}

}  // namespace decodex
