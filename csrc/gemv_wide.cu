// The wide GEMV: decodex::gemv's kernel for M = 9..64 rows of x (the plain epilogue: bias and
// accumulate, no RMS scale), the batched decode step's products above 8 rows. gemv.cu's kernel
// serves M <= 8 and the fused epilogues; both share the mma fragment trick described there.
//
// Why a second kernel: at M = 64 a product does 64 multiply-adds per weight element, so the x side
// of the mma, not the weight stream, is what a GEMV built for M <= 8 runs out of. Read from L1/L2
// per warp, x costs 4x the weight's bytes; there the 8-row kernel reached 39-52% of the read
// bandwidth where cuBLAS reached 64-86% (bench/RESULTS.md, session 9). Here:
//  * x lives in shared memory. The block's warps all take the same k-range of x, staged in chunks
//    of 256 k (all M rows, zero-filled past M, past the block's k-range and past K) by cp.async into
//    a double buffer; each warp reads its mma fragments from there. A chunk row is 256 + 32 bf16
//    (576 B, 64 mod 128), so the 16-byte loads of a quarter warp (two rows x 64 B) hit all 32 banks.
//  * A warp owns T tiles of 16 weight rows (T = 1 or 2), so each x fragment read feeds T tiles.
//  * The weights stream through registers as in gemv.cu (16 B per lane per row, rows g and g + 8,
//    k = step * 32 + 8t), double-buffered: trip i + 1's U k-steps are loaded before trip i's mmas.
//    With prefetch_weight the first trip is loaded before griddepcontrol.wait.
//  * Split-K over the c blocks of a thread-block cluster (c = 1, 2, 4 or 8): each block's partials go
//    to its shared memory; after a cluster barrier, rank r sums values r, r + c, ... of every
//    block in rank order (a fixed order: results are deterministic) and stores them.
// Each block of 8 x rows is the n = 8 of its own two mmas per k-step, so a row's result does not
// depend on the other rows or their number (for a given configuration).
// The host picks (T, c, U) per shape: a table measured on the H200 for the Qwen2.5 shapes, else a
// rule of thumb; DECODEX_GEMV_WIDE_CONFIG="t,c" (or "N,K:t,c;...") forces one, for sweeps.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include "common.h"
#include "gemv.h"
#include "ptx.cuh"

namespace decodex {
namespace {

constexpr int kWarps = 4;                    // warps per block
constexpr int kTileRows = 16;                // weight rows per tile: the mma's m
constexpr int kStepK = 32;                   // k per warp step: 4 lanes x 8 bf16
constexpr int kChunkK = 256;                 // k of x per staged chunk
constexpr int kChunkSteps = kChunkK / kStepK;
constexpr int kRowStride = kChunkK + 32;     // bf16 per staged x row (576 B = 64 mod 128)
constexpr int kMaxCluster = 8;
constexpr int kRing = 8;                     // k-steps of weights a warp keeps in flight (+ 1 in use)

// Dynamic shared memory: the x double buffer (reused after the main loop for the block's results),
// then the warps' weight rings (kRing steps of T tiles x 2 halves x 512 B).
constexpr int smem_x_bytes(int mb) { return 2 * mb * 8 * kRowStride * 2; }
constexpr int smem_bytes(int mb, int t) {
  const int red = mb * 8 * (kWarps * t * kTileRows + 4) * 4;
  return (smem_x_bytes(mb) > red ? smem_x_bytes(mb) : red) + kWarps * kRing * t * 2 * 512;
}

// 8 consecutive bf16 of out at p, `valid` (1..8) of them: one 16-byte access when vec (p 16-byte
// aligned) and all 8 are there, else element by element (the rest zeros / not stored). Plain
// coherent accesses: out is written in this kernel.
__device__ __forceinline__ uint4 load_out8(const __nv_bfloat16* p, int valid, bool vec) {
  if (vec && valid == 8) return *reinterpret_cast<const uint4*>(p);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < valid) e[i] = p[i];
  }
  return v;
}

__device__ __forceinline__ void store_out8(__nv_bfloat16* p, const uint4& v, int valid, bool vec) {
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

// Grid: ceil(tiles / (kWarps * T)) * c blocks of kWarps warps; clusters of (c, 1, 1) when c > 1.
// Block b: tile group b / c, cluster rank (k-range) b % c of c ranges that split ceil(K/32) k-steps
// as evenly as integers allow. Warp w: tiles (group * kWarps + w) * T + 0..T-1.
// Shared memory: the x double buffer (reused for the results at the end), then each warp's ring of
// kRing k-steps of its weight fragments.
template <int MB, int T>
__global__ void __launch_bounds__(kWarps * 32)
gemv_wide_kernel(const __nv_bfloat16* __restrict__ x,       // [m_rows, ldx], rows 16 B aligned
                 const __nv_bfloat16* __restrict__ weight,  // [N, ldw]
                 const __nv_bfloat16* __restrict__ bias,    // [N] or nullptr
                 __nv_bfloat16* __restrict__ out,           // [m_rows, ldo]
                 int64_t ldx, int64_t ldw, int64_t ldo, int N, int K, int m_rows, int c,
                 bool prefetch_weight, bool accumulate, bool vec_out) {
  // A chunk of x is staged with the weights kChunkSteps k-steps ahead of its use, which the ring's
  // wait (kRing - 1 steps ahead) covers only if kRing <= kChunkSteps + 1.
  static_assert(kRing <= kChunkSteps + 1, "the ring's wait must cover the x chunk staged with it");
  constexpr int kBufElems = MB * 8 * kRowStride;
  constexpr int kBlockRows = kWarps * T * kTileRows;
  constexpr int kRedStride = kBlockRows + 4;  // floats a row of x in the partials
  constexpr int kPieces = MB * 8 * kBlockRows / 8;
  constexpr int kPiecesPerThread = (kPieces + kWarps * 32 - 1) / (kWarps * 32);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rank = static_cast<int>(blockIdx.x) % c;
  const int tile0 = (static_cast<int>(blockIdx.x) / c * kWarps + warp) * T;
  const int ksteps = (K + kStepK - 1) / kStepK;
  const int s_begin = static_cast<int>(static_cast<int64_t>(rank) * ksteps / c);
  const int s_end = static_cast<int>(static_cast<int64_t>(rank + 1) * ksteps / c);
  const int steps = s_end - s_begin;

  // Weight rows g and g + 8 of each tile (clamped so no out-of-range pointer is formed; absent
  // rows are zero-filled).
  // Per-step work is kept to a few instructions (the loop is issue-bound at 8 warps an SM): every
  // address below is set up once and advanced by a constant.
  const __nv_bfloat16* wrow[T][2];  // lane's k = s_begin * 32 + 8t of weight rows g, g + 8
  bool wok[T][2];
#pragma unroll
  for (int tt = 0; tt < T; ++tt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (tile0 + tt) * kTileRows + g + 8 * h;
      wok[tt][h] = row < N;
      wrow[tt][h] = weight + static_cast<int64_t>(min(row, N - 1)) * ldw + (s_begin * kStepK + t * 8);
    }
  }
  // Steps whose 16 bytes at k = (s_begin + i) * 32 + 8t this lane copies: i < w_steps (k < K).
  const int w_steps = min(steps, (K - t * 8 + kStepK - 1) / kStepK - s_begin);
  // The warp's ring: slot (step % kRing, tile, half) holds each lane's 16 B, lane after lane, so a
  // lane reads back exactly what its own cp.async wrote (no barrier, only its own wait).
  unsigned char* ring = smem + smem_x_bytes(MB) + warp * kRing * T * 2 * 512 + lane * 16;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  auto slot = [&](int i, int tt, int h) { return ((i % kRing * T + tt) * 2 + h) * 512; };
  // Step i (from s_begin) of the weights into its slot; zeros past s_end, K and N.
  auto issue_weights = [&](int i) {
    const bool in = i < w_steps;
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool ok = in && wok[tt][h];
        cp_async16_l2_256(ring_s + slot(i, tt, h), ok ? wrow[tt][h] + i * kStepK : weight, ok ? 16u : 0u);
      }
    }
  };
  // Chunk ch (k-steps s_begin + ch * kChunkSteps ...) of all MB * 8 rows into buffer ch & 1; zeros
  // past m_rows, s_end and K. Thread p copies piece q = p % 32 (k-step q / 4, 8 k at (q % 4) * 8)
  // of rows p / 32 + 4j.
  constexpr int kPiecesRow = kChunkSteps * 4;  // 16-byte pieces a row
  static_assert(kWarps * 32 % kPiecesRow == 0, "a thread copies one column of pieces");
  constexpr int kRowsStep = kWarps * 32 / kPiecesRow, kRowsEach = MB * 8 / kRowsStep;
  const int xq = static_cast<int>(threadIdx.x) % kPiecesRow, xr = static_cast<int>(threadIdx.x) / kPiecesRow;
  const __nv_bfloat16* xsrc = x + static_cast<int64_t>(xr) * ldx + s_begin * kStepK + xq * 8;
  const int x_rows = (m_rows - xr + kRowsStep - 1) / kRowsStep;  // rows j < x_rows exist
  const uint32_t xdst = static_cast<uint32_t>(__cvta_generic_to_shared(xs)) +
                        static_cast<uint32_t>((xr * kRowStride + xq * 8) * 2);
  auto stage_x = [&](int ch) {
    const int step = ch * kChunkSteps + xq / 4;  // from s_begin
    const bool col = step < steps && (s_begin + step) * kStepK + (xq % 4) * 8 < K;
    const __nv_bfloat16* src = xsrc + ch * kChunkK;
    const uint32_t dst = xdst + static_cast<uint32_t>((ch & 1) * kBufElems * 2);
#pragma unroll
    for (int j = 0; j < kRowsEach; ++j) {
      const bool ok = col && j < x_rows;
      cp_async16(dst + static_cast<uint32_t>(j * kRowsStep * kRowStride * 2),
                 ok ? src + static_cast<int64_t>(j) * kRowsStep * ldx : x, ok ? 16u : 0u);
    }
  };

  // Two accumulator sets (the pairs 0,1 and 2,3 of each 16-byte load), as in gemv.cu.
  float acc_lo[T][MB][4], acc_hi[T][MB][4];
#pragma unroll
  for (int tt = 0; tt < T; ++tt) {
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_lo[tt][b][i] = acc_hi[tt][b][i] = 0.f;
    }
  }
  // The first kRing - 1 steps of weights, one cp.async group each; with prefetch_weight before
  // griddepcontrol.wait (the weight does not depend on the kernel ahead).
  if (prefetch_weight) {
    for (int i = 0; i < kRing - 1; ++i) {
      issue_weights(i);
      cp_async_commit();
    }
  }
  pdl_begin();
  if (!prefetch_weight) {
    for (int i = 0; i < kRing - 1; ++i) {
      issue_weights(i);
      cp_async_commit();
    }
  }
  stage_x(0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  // Step i: wait for the group of step i - kRing + 1 (its weights: step i), and at a chunk start
  // for every thread's x pieces (staged 8 steps before); then queue step i + kRing - 1's weights
  // (and, at a chunk start, the next chunk of x into the buffer the last chunk used), then the mmas.
  for (int i = 0; i < steps; ++i) {
    const int ci = i % kChunkSteps;
    if (i > 0) {
      cp_async_wait<kRing - 2>();
      if (ci == 0) __syncthreads();  // chunk i / 8 visible; chunk i / 8 - 1 read by every warp
    }
    issue_weights(i + kRing - 1);
    if (ci == 0 && i + kChunkSteps < steps) stage_x(i / kChunkSteps + 1);
    cp_async_commit();
    uint4 wa[T], wb[T];
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {
      wa[tt] = *reinterpret_cast<const uint4*>(ring + slot(i, tt, 0));
      wb[tt] = *reinterpret_cast<const uint4*>(ring + slot(i, tt, 1));
    }
    const __nv_bfloat16* xb =
        xs + (i / kChunkSteps & 1) * kBufElems + g * kRowStride + ci * kStepK + t * 8;
    uint4 xv[MB];  // B column g of block b = x row 8b + g; the same physical k as the weights
#pragma unroll
    for (int b = 0; b < MB; ++b) xv[b] = *reinterpret_cast<const uint4*>(xb + 8 * b * kRowStride);
    // All first halves, then all second halves: 2 * T * MB independent chains, none waiting on
    // the mma just issued (ptxas keeps the mmas in this order).
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
      for (int tt = 0; tt < T; ++tt) {
        mma_bf16_16816(acc_lo[tt][b], wa[tt].x, wb[tt].x, wa[tt].y, wb[tt].y, xv[b].x, xv[b].y);
      }
    }
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
      for (int tt = 0; tt < T; ++tt) {
        mma_bf16_16816(acc_hi[tt][b], wa[tt].z, wb[tt].z, wa[tt].w, wb[tt].w, xv[b].z, xv[b].w);
      }
    }
  }
  cp_async_wait<0>();  // the zero-fills queued past the end
  __syncthreads();     // every warp is done with x: its buffers take the results

  // The block's results, [x row n][block row] in fp32 (rows padded to kRedStride so the fragment
  // stores hit distinct banks), in the shared memory the x chunks are done with. Lane (g, t) holds
  // rows g, g + 8 of each tile for x rows 8b + 2t, 8b + 2t + 1 (the mma's d fragment).
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int tt = 0; tt < T; ++tt) {
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = 8 * b + 2 * t + (i & 1), rl = (warp * T + tt) * kTileRows + g + 8 * (i >> 1);
        red[n * kRedStride + rl] = acc_lo[tt][b][i] + acc_hi[tt][b][i];
      }
    }
  }
  namespace cg = cooperative_groups;
  if (c > 1) {
    cg::this_cluster().sync();  // every block's partials written and visible cluster-wide
  } else {
    __syncthreads();
  }
  // The stores go by pieces of 8 consecutive weight rows of one x row: piece p = n * (kBlockRows / 8)
  // + rows / 8. Rank r takes pieces [r, r + 1) * kPieces / c and sums them over the cluster's blocks
  // in rank order (a fixed order: deterministic).
  const int lo = rank * kPieces / c, hi = (rank + 1) * kPieces / c;
  const int row_base = static_cast<int>(blockIdx.x) / c * kBlockRows;
  float y[kPiecesPerThread][8];
  uint4 old[kPiecesPerThread];
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + static_cast<int>(threadIdx.x) + pi * kWarps * 32;
    const int n = p / (kBlockRows / 8), rl = p % (kBlockRows / 8) * 8, row = row_base + rl;
    const bool ok = p < hi && n < m_rows && row < N;
#pragma unroll
    for (int e = 0; e < 8; ++e) y[pi][e] = 0.f;
    old[pi] = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) continue;
    for (int q = 0; q < c; ++q) {
      const float* part = (c > 1 ? cg::this_cluster().map_shared_rank(red, q) : red) + n * kRedStride + rl;
      const float4 a = *reinterpret_cast<const float4*>(part), b = *reinterpret_cast<const float4*>(part + 4);
      y[pi][0] += a.x, y[pi][1] += a.y, y[pi][2] += a.z, y[pi][3] += a.w;
      y[pi][4] += b.x, y[pi][5] += b.y, y[pi][6] += b.z, y[pi][7] += b.w;
    }
    if (accumulate) old[pi] = load_out8(out + static_cast<int64_t>(n) * ldo + row, min(N - row, 8), vec_out);
  }
  if (c > 1) cg::this_cluster().sync();  // the other blocks' shared memory outlives these reads
#pragma unroll
  for (int pi = 0; pi < kPiecesPerThread; ++pi) {
    const int p = lo + static_cast<int>(threadIdx.x) + pi * kWarps * 32;
    const int n = p / (kBlockRows / 8), rl = p % (kBlockRows / 8) * 8, row = row_base + rl;
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
  __trap();  // clusters and cp.async with PDL: the host sends M > 8 here on sm_90 only
#endif
}

// ---- host ----

struct WideConfig {
  int t, c;  // tiles per warp, blocks per cluster (split-K)
};

using WideKernel = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                            __nv_bfloat16*, int64_t, int64_t, int64_t, int, int, int, int, bool, bool,
                            bool);

// x rows rounded up to a multiple of 16: MB = 2, 4, 6 or 8 blocks of 8.
int wide_blocks(int m) { return (m + 15) / 16 * 2; }

template <int T>
WideKernel wide_kernel_t(int mb) {
  switch (mb) {
    case 2: return gemv_wide_kernel<2, T>;
    case 4: return gemv_wide_kernel<4, T>;
    case 6: return gemv_wide_kernel<6, T>;
    case 8: return gemv_wide_kernel<8, T>;
    default: return nullptr;
  }
}

WideKernel wide_kernel(int m, const WideConfig& cf) {
  const int mb = wide_blocks(m);
  return cf.t == 1 ? wide_kernel_t<1>(mb) : cf.t == 2 ? wide_kernel_t<2>(mb) : nullptr;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Configurations measured fastest on the H200 (`python -m bench.gemv --sweep --ms 16,32,64`), per
// range of M: 9..16, 17..32, 33..64. Other shapes take the rule of thumb below.
struct TunedWide {
  int64_t N, K;
  WideConfig m16, m32, m64;
};
constexpr TunedWide kTuned[] = {
    {0, 0, {1, 1}, {1, 1}, {1, 1}},  // placeholder: filled from the sweep
};

// Rule of thumb: two tiles a warp when there are at least 8 tile groups of 8 an SM (big N), else
// one; then the smallest cluster (split-K) that gives about two blocks an SM, keeping at least one
// chunk of k-steps per block.
WideConfig choose_wide(int64_t N, int64_t K, int m, int sms) {
  for (const TunedWide& tw : kTuned) {
    const WideConfig& cf = m <= 16 ? tw.m16 : m <= 32 ? tw.m32 : tw.m64;
    if (tw.N == N && tw.K == K) return cf;
  }
  const int64_t tiles = ceil_div(N, kTileRows), ksteps = ceil_div(K, kStepK);
  WideConfig cf{tiles >= int64_t{8} * kWarps * 2 * sms ? 2 : 1, 1};
  const int64_t groups = ceil_div(tiles, int64_t{kWarps} * cf.t);
  while (cf.c < kMaxCluster && groups * cf.c < 2 * sms && ksteps / (2 * cf.c) >= kChunkSteps) cf.c *= 2;
  return cf;
}

}  // namespace

void launch_gemv_wide(const at::Tensor& x, const at::Tensor& weight, const __nv_bfloat16* bias,
                      at::Tensor& out, const GemvOptions& options) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  DX_CHECK(device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9,
           "decodex::gemv: more than 8 rows of x need a GPU of compute capability 9.0 or newer ",
           "(thread-block clusters); got x of shape ", x.sizes(), ", use F.linear there");
  WideConfig cf{};
  int fields[2];
  if (config_from_env("DECODEX_GEMV_WIDE_CONFIG", "t,c", N, K, fields, 2)) {
    cf = {fields[0], fields[1]};
    DX_CHECK(cf.t == 1 || cf.t == 2, "DECODEX_GEMV_WIDE_CONFIG: t must be 1 or 2, got ", cf.t);
    DX_CHECK(cf.c == 1 || cf.c == 2 || cf.c == 4 || cf.c == 8,
             "DECODEX_GEMV_WIDE_CONFIG: c must be 1, 2, 4 or 8, got ", cf.c);
  } else {
    thread_local std::map<std::array<int64_t, 4>, WideConfig> chosen;  // one choice per shape
    const std::array<int64_t, 4> key{N, K, wide_blocks(static_cast<int>(M)), device};
    auto it = chosen.find(key);
    if (it == chosen.end()) {
      it = chosen.emplace(key, choose_wide(N, K, static_cast<int>(M), sm_count(device))).first;
    }
    cf = it->second;
  }
  const WideKernel kernel = wide_kernel(static_cast<int>(M), cf);
  DX_CHECK(kernel != nullptr, "decodex::gemv: no wide kernel for ", M, " rows, t=", cf.t);
  const int smem = smem_bytes(wide_blocks(static_cast<int>(M)), cf.t);
  thread_local std::set<WideKernel> allowed;  // kernels whose shared-memory limit is raised
  if (allowed.insert(kernel).second) {
    DX_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess,
             "decodex::gemv: could not allow ", smem, " bytes of shared memory for the wide kernel");
  }
  // 16-byte stores of 8 outputs: out 16-byte aligned with rows a multiple of 8 elements apart.
  const bool vec_out = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.stride(0) % 8 == 0;
  const int64_t blocks = ceil_div(ceil_div(N, kTileRows), int64_t{kWarps} * cf.t) * cf.c;
  const cudaError_t err = launch_pdl_clusters(
      kernel, dim3(static_cast<unsigned>(blocks)), dim3(kWarps * 32), static_cast<size_t>(smem),
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
