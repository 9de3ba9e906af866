// decodex::gemv: out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N]) for decode batches M = 1..8, and
// decodex::gemv_silu_mul, the same kernel with SiLU(gate) * up in its epilogue. The kernel and its
// launcher also serve gemv_rope_append (csrc/rope_append.cu) through gemv.h.
//
// The op streams the weight (every byte read once, ~1 FLOP per byte), so everything is arranged
// around keeping the memory system full: as many weight bytes requested as early as possible, on
// every SM, with nothing else in their way.
//
// Idea of the kernel (sm_90; one kernel, templated on M and the epilogue):
//  * Work: the weight is cut into tiles of 16 rows (the mma's m). Blocks are persistent, one per SM:
//    block b of the grid takes tiles b, b + grid, b + 2 grid, ... so every SM streams the same
//    number of bytes to within one tile.
//  * Loads: the copy engine, not registers. One producer warp streams each tile through a ring of
//    shared-memory stages (16 rows x up to 512 columns, 16 KB) with cp.async.bulk, one copy per row
//    (rows are contiguous in memory), completing on the stage's mbarrier. ~100 KB of weight per SM
//    is in flight from the start, which registers cannot hold (the old register-load kernel peaked
//    at 60-75% of bandwidth on mid-sized weights); the ring is sized so that two blocks fit an SM:
//    the next kernel's block moves in while this one drains.
//  * Before griddepcontrol.wait (programmatic dependent launch) the producer asks L2 for the first
//    ring's worth of its weight rows, so that DRAM round trip overlaps the kernel ahead. Only L2
//    prefetches are issued before the wait: L2 is the point of coherence, so they stay correct even
//    if the kernel ahead wrote the weight; the copies into shared memory come after it.
//  * Math: four consumer warps split each stage's k-steps and run mma.sync m16n8k16 (bf16 in, fp32
//    accumulate) with the 16 weight rows as A and the M <= 8 rows of x as B (n = 8; columns n >= M
//    are zero), so M = 8 costs the same instructions as M = 1. Lane (g = lane/4, t = lane%4) reads
//    16 B (8 consecutive k) of rows g and g+8 and of x row g at k = step*32 + 8t and hands the
//    bf16 pairs to the fragments as they are: the same permutation of k on both operands, which
//    leaves the dot product unchanged. Rows sit 1088 B apart in a stage (64 B more than 1 KB), so
//    those 16-byte reads are free of bank conflicts. x comes from global memory (L1/L2: every tile
//    reads it), loaded one stage ahead.
//  * A tile's four warp partials are summed through shared memory in a fixed order; then the
//    epilogue (GemvEpilogue, gemv.h) rounds the result to bf16 (after the bias) before any epilogue
//    math, so a fused op equals gemv followed by the unfused op bit for bit.
//  * Split-K over a thread-block cluster (c > 1): when there are fewer tiles than SMs (the K
//    projection has 16), or when it evens out the SMs' share, the c blocks of a cluster take the
//    same tiles, each one k-range, and rank 0 sums the others' partials received in its shared
//    memory (distributed shared memory, mbarrier handshakes, double-buffered per tile). No
//    workspace, no atomics, a fixed summation order: results are deterministic.
// The host picks c per (N, K) from the tile count and the SM count (choose_config). The env
// variable DECODEX_GEMV_CONFIG="c,stages" forces a configuration (bench/gemv.py --sweep, tests).
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "common.h"
#include "ptx.cuh"
#include "gemv.h"
#include "ops.h"

namespace decodex {
namespace {

constexpr int kTileRows = 16;      // weight rows per tile: the mma's m
constexpr int kStepK = 32;         // k per warp step: 4 threads x 8 bf16
constexpr int kConsumers = 4;      // consumer warps per block; one producer warp more
constexpr int kThreads = (kConsumers + 1) * 32;
constexpr int kChunkK = 1536;      // columns per stage at most (3 KB of each row: see stage_shape)
constexpr int kSteps = 4;          // k-steps per consumer warp per batch (kSteps * 4 * 32 columns)
constexpr int kBatchK = kSteps * kConsumers * kStepK;  // columns of one batch of the four warps
constexpr int kMaxStages = 12;
constexpr int kMaxCluster = 8;     // portable cluster size limit
constexpr int kRingBytes = 104 << 10;  // default ring: 2 stages of 16 x 3136 B; two blocks fit an SM

struct GemvArgs {
  const __nv_bfloat16* x;       // [M, ldx], rows 16 B aligned
  const __nv_bfloat16* weight;  // [rows, ldw]: N rows ([2N, ldw] for kSiluMul)
  const __nv_bfloat16* bias;    // [N] or nullptr (nullptr for kSiluMul)
  __nv_bfloat16* out;           // [M, ldo]
  int64_t ldx, ldw, ldo;
  int N, K;        // outputs per row of x, inner dim
  int tiles;       // 16-row tiles of the epilogue's row order
  int c;           // blocks per cluster: k-ranges of each tile
  int stages;      // ring stages
  int kc;          // columns per stage
  int pitch;       // bytes between rows in a stage (a multiple of 128)
  bool prefetch_weight;  // the first ring's weight rows may be copied before the PDL wait
  RopeAppendArgs rope;
};

// The weight rows of a tile, per epilogue. Lane (g, t) holds results for tile rows g and g + 8; the
// row pairing puts what the epilogue combines into one lane:
//  * kStore: rows 16j .. 16j+15 (ceil(N/16) tiles).
//  * kSiluMul (N = I outputs, weight [2I, K] = [gate; up]): gate rows 8j .. 8j+7 and the matching
//    up rows I + 8j .. (ceil(I/8) tiles); out = silu(gate) * up.
//  * kRopeAppend (weight = [q heads | k heads | v heads] x D rows): tile j of a q or k head pairs
//    rows 8j .. 8j+7 of the head with rows D/2 + 8j .. (the RoPE pairs, D/16 tiles per head); v
//    rows are plain 16-row tiles. Same tile count as kStore.
template <int kEpi>
struct TileRows {
  static constexpr bool kSilu = kEpi == static_cast<int>(GemvEpilogue::kSiluMul);
  static constexpr bool kRope = kEpi == static_cast<int>(GemvEpilogue::kRopeAppend);
  int tile, N, D, head, hj;
  bool rope_tile;  // tiles of q and k heads (RoPE pairs)

  __device__ TileRows(int tile_, const GemvArgs& a) : tile(tile_), N(a.N), D(a.rope.D) {
    const int per_head = kRope ? D / 16 : 1;
    rope_tile = kRope && tile < (a.rope.H + a.rope.Hkv) * per_head;
    head = tile / per_head;
    hj = tile - head * per_head;
  }
  // Weight row of tile-local row i (0..15), and whether it exists.
  __device__ int row(int i) const {
    if (kSilu) return tile * 8 + (i & 7) + (i >= 8 ? N : 0);
    if (rope_tile) return head * D + 8 * hj + (i & 7) + (i >= 8 ? D / 2 : 0);
    return tile * kTileRows + i;
  }
  __device__ bool ok(int i) const { return (kSilu ? tile * 8 + (i & 7) : row(i)) < N; }
};

// Stage q of a block: the q / chunks-th of its tiles, columns [k0, k0 + cols) of it.
struct Stage {
  int tile_i, chunk, tile, k0, cols;
};

template <int M, int kEpi>
__device__ __forceinline__ void epilogue(const GemvArgs& a, const TileRows<kEpi>& tr, int g, int t,
                                         const float (&r)[4]);

// Block b of cluster rank `rank`, cluster `cid` of `nclus`. Roles: warps 0..kConsumers-1 consume,
// warp kConsumers produces. Dynamic shared memory: the ring [stages][16 + M][pitch] bytes (16 weight
// rows, then the M rows of x over the same columns), then (c > 1)
// rank 0's inbox for the other ranks' partials [c][2][4][32] floats.
// __launch_bounds__(kThreads, 2): two blocks per SM (this kernel's and the next one's).
template <int M, int kEpi>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const GemvArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ uint64_t inbox_full[2], inbox_free[2];  // c > 1: rank 0's inbox / the others' acks
  __shared__ __align__(16) float red[2][kConsumers][4][32];  // per-warp partials, by tile parity

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = a.c, rank = static_cast<int>(blockIdx.x) % c;
  const int cid = static_cast<int>(blockIdx.x) / c, nclus = static_cast<int>(gridDim.x) / c;
  // This rank's k-range: whole 32-column steps, as even as integers allow (may be empty).
  const int ksteps = (a.K + kStepK - 1) / kStepK;
  const int k_begin = static_cast<int>(static_cast<int64_t>(rank) * ksteps / c) * kStepK;
  const int k_end = min(static_cast<int>(static_cast<int64_t>(rank + 1) * ksteps / c) * kStepK, a.K);
  const int range = max(k_end - k_begin, 0);
  const int chunks = max(1, (range + a.kc - 1) / a.kc);  // an empty range still has one (empty) stage
  const int my_tiles = cid < a.tiles ? (a.tiles - 1 - cid) / nclus + 1 : 0;
  const int total = my_tiles * chunks;  // stages this block streams
  const int S = a.stages;
  constexpr int kRows = kTileRows + M;  // rows of a stage
  float* inbox = reinterpret_cast<float*>(smem + static_cast<size_t>(S) * kRows * a.pitch);

  auto stage = [&](int q) {
    Stage s;
    s.tile_i = q / chunks;
    s.chunk = q - s.tile_i * chunks;
    s.tile = cid + s.tile_i * nclus;
    s.k0 = k_begin + s.chunk * a.kc;
    s.cols = max(0, min(a.kc, k_end - s.k0));
    return s;
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumers);
    }
    if (c > 1) {
      for (int i = 0; i < 2; ++i) {
        mbar_init(&inbox_full[i], 32 * (c - 1));
        mbar_init(&inbox_free[i], 32);
      }
    }
    fence_mbar_init();
  }
  const bool producer = warp == kConsumers;
  if (c > 1) {
    cooperative_groups::this_cluster().sync();  // every block's barriers initialised
  } else {
    __syncthreads();
  }

  // Stage q's copies: the weight rows (lanes 0..15) and the M rows of x over the same columns
  // (lanes 16..16+M-1; x is L2-resident and read by every tile, staged with the weight so that the
  // consumers never wait on global memory). `arm`: this call also arms the stage's barrier with
  // the bytes of both parts.
  const uint64_t policy = l2_evict_first();
  auto copy_stage = [&](int q, bool weight_rows, bool x_rows, bool arm) {
    const Stage s = stage(q);
    const TileRows<kEpi> tr(s.tile, a);
    const int slot = q % S;
    const bool is_x = lane >= kTileRows && lane < kRows;
    const bool w_row = lane < kTileRows && tr.ok(lane);
    if (arm) {
      const unsigned rows = __popc(__ballot_sync(0xffffffffu, s.cols > 0 && (is_x || w_row)));
      if (lane == 0) mbar_arrive_expect_tx(&full[slot], rows * static_cast<unsigned>(s.cols) * 2u);
      __syncwarp();  // armed before any of its copies can complete
    }
    if (s.cols > 0 && ((weight_rows && w_row) || (x_rows && is_x))) {
      const __nv_bfloat16* src =
          is_x ? a.x + static_cast<int64_t>(lane - kTileRows) * a.ldx + s.k0
               : a.weight + static_cast<int64_t>(tr.row(lane)) * a.ldw + s.k0;
      bulk_copy_to_shared(smem + (static_cast<size_t>(slot) * kRows + lane) * a.pitch, src,
                          static_cast<uint32_t>(s.cols) * 2u, &full[slot],
                          is_x ? l2_evict_last() : policy);
    }
  };
  // prefetch_weight: the caller promises the kernel ahead does not write the weight, so the first
  // ring's weight rows are copied before griddepcontrol.wait, during that kernel (x after it).
  const int early = a.prefetch_weight ? min(S, total) : 0;
  if (producer) {
    for (int q = 0; q < early; ++q) copy_stage(q, true, false, true);
  }
  pdl_begin();

  if (producer) {
    for (int q = 0; q < early; ++q) copy_stage(q, false, true, false);
    for (int q = early; q < total; ++q) {
      const int round = q / S;
      if (round > 0) mbar_wait(&empty[q % S], (round - 1) & 1);
      copy_stage(q, true, true, true);
    }
    return;  // c > 1: the producer takes no part in the partial-sum handshakes
  }

  // ---- consumers ----
  const int g = lane >> 2, t = lane & 3;
  const uint32_t ring = smem_u32(smem);
  // A stage is consumed in batches of kBatchK columns: warp w takes k-steps w, w + 4, ... of each.
  const int batches = (a.kc + kBatchK - 1) / kBatchK;

  // acc_lo: pairs 0,1 of each 16 B load; acc_hi: pairs 2,3. Fragment of d (per lane):
  // [0] = (row g, n 2t), [1] = (row g, n 2t+1), [2] = (row g+8, n 2t), [3] = (row g+8, n 2t+1).
  float acc_lo[4] = {0.f, 0.f, 0.f, 0.f}, acc_hi[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q = 0; q < total; ++q) {
    const Stage s = stage(q);
    const TileRows<kEpi> tr(s.tile, a);
    const bool ok0 = tr.ok(g), ok1 = tr.ok(g + 8);
    const int slot = q % S;
    mbar_wait(&full[slot], (q / S) & 1);
    const uint32_t base = ring + static_cast<uint32_t>(slot * kRows) * a.pitch;
    for (int batch = 0; batch < batches; ++batch) {
      uint4 wa[kSteps], wb[kSteps], xv[kSteps];
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        const int kk = batch * kBatchK + (warp + j * kConsumers) * kStepK + 8 * t;
        const bool in = kk < s.cols;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        wa[j] = in && ok0 ? lds16(base + g * a.pitch + 2 * kk) : zero;
        wb[j] = in && ok1 ? lds16(base + (g + 8) * a.pitch + 2 * kk) : zero;
        xv[j] = in && g < M ? lds16(base + (kTileRows + g) * a.pitch + 2 * kk) : zero;
      }
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        // A rows g / g+8 = weight rows; B column g = x row g; same physical k on both sides.
        mma_bf16_16816(acc_lo, wa[j].x, wb[j].x, wa[j].y, wb[j].y, xv[j].x, xv[j].y);
        mma_bf16_16816(acc_hi, wa[j].z, wb[j].z, wa[j].w, wb[j].w, xv[j].z, xv[j].w);
      }
    }
    __syncwarp();  // every lane's reads of the stage are done (the mma consumed them)
    if (lane == 0) mbar_arrive(&empty[slot]);
    if (s.chunk != chunks - 1) continue;

    // ---- end of a tile: sum the consumer warps (fixed order), then the cluster's ranks ----
    const int buf = s.tile_i & 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      red[buf][warp][i][lane] = acc_lo[i] + acc_hi[i];
      acc_lo[i] = acc_hi[i] = 0.f;
    }
    // One barrier per tile suffices: red is double-buffered, and no warp can write this buffer
    // again before warp 0 has passed the next tile's barrier, i.e. finished reading it.
    named_barrier_sync(1, kConsumers * 32);
    if (warp != 0) continue;
    float r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r[i] = red[buf][0][i][lane];
#pragma unroll
      for (int w = 1; w < kConsumers; ++w) r[i] += red[buf][w][i][lane];
    }
    if (c > 1) {
      // Rank p's partial for tiles of parity buf: inbox[p][buf][lane][4], in rank 0's shared
      // memory. inbox_full[buf] (rank 0's) counts the other ranks' lanes; inbox_free[buf] (rank
      // p's) tells p that rank 0 has read that slot. A barrier's k-th phase is tile 2k + buf.
      if (rank != 0) {
        if (s.tile_i >= 2) mbar_wait_cluster(&inbox_free[buf], ((s.tile_i - 2) >> 1) & 1);
        st_cluster_f32x4(inbox + ((rank * 2 + buf) * 32 + lane) * 4, 0,
                         make_float4(r[0], r[1], r[2], r[3]));
        mbar_arrive_cluster(&inbox_full[buf], 0);
        continue;
      }
      mbar_wait_cluster(&inbox_full[buf], (s.tile_i >> 1) & 1);
      for (int p = 1; p < c; ++p) {
        const float4 v = *reinterpret_cast<const float4*>(inbox + ((p * 2 + buf) * 32 + lane) * 4);
        r[0] += v.x;
        r[1] += v.y;
        r[2] += v.z;
        r[3] += v.w;
      }
      for (int p = 1; p < c; ++p) mbar_arrive_cluster(&inbox_free[buf], p);
    }
    epilogue<M, kEpi>(a, tr, g, t, r);
  }
  // Rank r > 0 leaves only once rank 0 has read its last partials (it arrives on our barriers).
  if (c > 1 && rank != 0 && warp == 0) {
    for (int ti = max(my_tiles - 2, 0); ti < my_tiles; ++ti) {
      mbar_wait_cluster(&inbox_free[ti & 1], (ti >> 1) & 1);
    }
  }
#else
  pdl_begin();
  __trap();  // bulk copies and clusters need sm_90; the host refuses older devices
#endif
}

// Writes a finished tile: lane (g, t) holds r[0], r[1] for row g (of x rows n = 2t, 2t+1) and r[2],
// r[3] for row g + 8. Results are rounded to bf16 (after the bias) as gemv stores them before any
// epilogue math, so each fused op equals gemv followed by its unfused op bit for bit.
template <int M, int kEpi>
__device__ __forceinline__ void epilogue(const GemvArgs& a, const TileRows<kEpi>& tr, int g, int t,
                                         const float (&r)[4]) {
  const int row0 = tr.row(g), row1 = tr.row(g + 8);
  auto stored = [&](int i, int row) {
    float v = r[i];
    if (a.bias != nullptr) v += __bfloat162float(a.bias[row]);
    return __bfloat162float(__float2bfloat16_rn(v));
  };
  if constexpr (TileRows<kEpi>::kSilu) {
    // r[i] gate, r[i + 2] up of output row n = 2t + i, feature row0.
    if (!tr.ok(g)) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = 2 * t + i;
      if (n < M) {
        a.out[static_cast<int64_t>(n) * a.ldo + row0] =
            __float2bfloat16_rn(silu_times(stored(i, row0), stored(i + 2, row1)));
      }
    }
  } else if constexpr (TileRows<kEpi>::kRope) {
    // r[i] / r[i + 2]: rows row0 / row1 of output row n = 2t + i: a RoPE pair (x1, x2) of a q or
    // k head, or two v features. Rotated and appended only where 0 <= position < S (rope_append's
    // rule: any other row is left as the plain product).
    const RopeAppendArgs& rope = a.rope;
    const int D = rope.D;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = 2 * t + i;
      if (n >= M) continue;
      float v0 = stored(i, row0), v1 = stored(i + 2, row1);
      const int pos = rope.positions[n];
      const bool live = pos >= 0 && pos < rope.S;
      if (tr.rope_tile && live) {
        float cs, sn;
        rope_cos_sin(pos, rope.inv_freq[8 * tr.hj + g], cs, sn);
        rope_rotate(v0, v1, cs, sn, v0, v1);
      }
      const __nv_bfloat16 b0 = __float2bfloat16_rn(v0), b1 = __float2bfloat16_rn(v1);
      a.out[static_cast<int64_t>(n) * a.ldo + row0] = b0;
      a.out[static_cast<int64_t>(n) * a.ldo + row1] = b1;
      if (live && row0 >= rope.H * D) {  // a k or v row: append at the position
        const bool is_k = row0 < (rope.H + rope.Hkv) * D;
        const int f0 = row0 - (is_k ? rope.H : rope.H + rope.Hkv) * D;  // feature in the k/v rows
        const int f1 = f0 + (row1 - row0);
        __nv_bfloat16* cache = is_k ? rope.k_cache + n * rope.kc_b : rope.v_cache + n * rope.vc_b;
        const int64_t hs = is_k ? rope.kc_h : rope.vc_h;
        const int64_t at = static_cast<int64_t>(pos) * D;
        cache[(f0 / D) * hs + at + f0 % D] = b0;
        cache[(f1 / D) * hs + at + f1 % D] = b1;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i >= 2 ? row1 : row0;
      const int n = 2 * t + (i & 1);
      if (n < M && row < a.N) {
        a.out[static_cast<int64_t>(n) * a.ldo + row] = __float2bfloat16_rn(stored(i, row));
      }
    }
  }
}

// ---- host: configuration ----

struct GemvConfig {
  int c, stages;  // blocks per cluster (k-ranges per tile), ring stages
};

using GemvKernel = void (*)(const GemvArgs);

template <int kEpi>
GemvKernel kernel_for(int m) {
  switch (m) {
    case 1: return gemv_kernel<1, kEpi>;
    case 2: return gemv_kernel<2, kEpi>;
    case 3: return gemv_kernel<3, kEpi>;
    case 4: return gemv_kernel<4, kEpi>;
    case 5: return gemv_kernel<5, kEpi>;
    case 6: return gemv_kernel<6, kEpi>;
    case 7: return gemv_kernel<7, kEpi>;
    default: return gemv_kernel<8, kEpi>;
  }
}

GemvKernel kernel_for(int m, GemvEpilogue epi) {
  switch (epi) {
    case GemvEpilogue::kSiluMul: return kernel_for<static_cast<int>(GemvEpilogue::kSiluMul)>(m);
    case GemvEpilogue::kRopeAppend:
      return kernel_for<static_cast<int>(GemvEpilogue::kRopeAppend)>(m);
    default: return kernel_for<static_cast<int>(GemvEpilogue::kStore)>(m);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Stage geometry of a configuration: columns per stage and the row pitch in bytes.
struct StageShape {
  int kc, pitch;
};

// Columns per stage: each rank's k-range in equal whole-step chunks, as long as two stages of
// 16 + M rows fit the ring (at most kChunkK). Each row of a stage is one bulk copy, and the copy
// engine's rate per block is what limits a ring of small copies (measured on the H200, scratch
// stream benchmark: 16 copies of 1 KB per stage streamed 2.3 TB/s at one block per SM, 16 of 3 KB
// 4.6 TB/s), so chunks are as long as the ring allows.
StageShape stage_shape(int64_t K, int c, int M) {
  const int64_t range = std::min(ceil_div(ceil_div(K, kStepK), c) * kStepK, K);
  const int64_t cap = std::min<int64_t>(kChunkK, kRingBytes / 2 / (kTileRows + M) / 128 * 64);
  const int64_t chunks = ceil_div(range, cap);
  const int kc = static_cast<int>(std::min(ceil_div(ceil_div(range, chunks), kStepK) * kStepK, K));
  // Rows start on 128-byte boundaries (the 16-byte reads of a quarter-warp then hit two rows on
  // the same banks: a 2-way conflict, cheap next to the memory stream).
  const int pitch = static_cast<int>(ceil_div(2 * kc, 128) * 128);
  return {kc, pitch};
}

int stage_bytes(const StageShape& st, int M) { return (kTileRows + M) * st.pitch; }

int default_stages(const StageShape& st, int M) {
  return std::clamp(kRingBytes / stage_bytes(st, M), 2, kMaxStages);
}

size_t smem_bytes(const StageShape& st, const GemvConfig& cf, int M) {
  return static_cast<size_t>(cf.stages) * stage_bytes(st, M) +
         (cf.c > 1 ? static_cast<size_t>(cf.c) * 2 * 4 * 32 * sizeof(float) : 0);
}

// The cluster size: 1 (each block takes whole tiles) unless that leaves most SMs idle; then the
// smallest power of two that gives at least half the SMs work, with at least 4 k-steps per rank.
// (Measured: with enough tiles, split-K lost to whole tiles everywhere, e.g. 1.5B gate|up 27 us at
// c = 1 against 49 us at c = 2, because every rank must wait for the slowest at each tile.)
int choose_cluster(int64_t tiles, int64_t K, int sms) {
  const int64_t ksteps = ceil_div(K, kStepK);
  int c = 1;
  while (c < kMaxCluster && tiles * c < sms / 2 && ksteps >= 8 * c) c *= 2;
  return c;
}

// DECODEX_GEMV_CONFIG="c,stages": a fixed configuration for tuning sweeps and tests.
bool config_override(GemvConfig& cf) {
  const char* env = std::getenv("DECODEX_GEMV_CONFIG");
  if (env == nullptr || *env == '\0') return false;
  GemvConfig o{};
  char tail = 0;
  DX_CHECK(std::sscanf(env, "%d,%d%c", &o.c, &o.stages, &tail) == 2,
           "DECODEX_GEMV_CONFIG must be \"c,stages\", got \"", env, "\"");
  DX_CHECK(o.c >= 1 && o.c <= kMaxCluster && o.stages >= 2 && o.stages <= kMaxStages,
           "DECODEX_GEMV_CONFIG=\"", env, "\": need 1 <= c <= ", kMaxCluster, " and 2 <= stages <= ",
           kMaxStages);
  cf = o;
  return true;
}

// The most dynamic shared memory a gemv block may ask for, set once per kernel.
constexpr int kMaxDynamicSmem = 220 << 10;  // 227 KB per block, less the static part

void allow_dynamic_smem(GemvKernel kernel) {
  static std::atomic<GemvKernel> done[3 * 8];  // each kernel's pointer once set; nullptr = free
  for (auto& slot : done) {
    GemvKernel k = slot.load(std::memory_order_acquire);
    if (k == kernel) return;
    if (k != nullptr) continue;
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicSmem);
    DX_CHECK(err == cudaSuccess, "decodex::gemv: cannot allow ", kMaxDynamicSmem,
             " bytes of dynamic shared memory: ", cudaGetErrorString(err));
    GemvKernel expected = nullptr;
    slot.compare_exchange_strong(expected, kernel, std::memory_order_acq_rel);
    return;
  }
}

}  // namespace

// ---- host: the shared checks and launcher (gemv.h) ----

void check_gemv_x_weight(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& out) {
  DX_CHECK_CUDA(x);
  DX_CHECK_CUDA(weight);
  DX_CHECK_CUDA(out);
  DX_CHECK_SAME_DEVICE(x, weight);
  DX_CHECK_SAME_DEVICE(x, out);
  DX_CHECK_DTYPE(x, at::kBFloat16);
  DX_CHECK_DTYPE(weight, at::kBFloat16);
  DX_CHECK_DTYPE(out, at::kBFloat16);
  DX_CHECK_DIM(x, 2);
  DX_CHECK_DIM(weight, 2);
  DX_CHECK_DIM(out, 2);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  DX_CHECK(M >= 1 && M <= 8, "decodex::", op, " handles M = 1..8 rows of x, got x of shape ",
           x.sizes(), " (M = ", M, "); use cuBLAS (F.linear) for larger batches");
  DX_CHECK(weight.size(1) == K, "weight must have shape [N, K] with K = x.size(1) = ", K,
           ", got ", weight.sizes());
  DX_CHECK(K > 0 && K % 8 == 0, "decodex::", op,
           " needs K (x.size(1)) to be a positive multiple of 8, got K = ", K);
  DX_CHECK(N < (int64_t{1} << 30) && K < (int64_t{1} << 30), "decodex::", op,
           ": N and K must be below 2^30, got N = ", N, ", K = ", K);
  // Rows may be strided (a slice of a wider buffer); the last dim must be dense, and x / weight
  // rows 16-byte aligned for the vector loads. Strides of size-1 dims are never used.
  DX_CHECK(x.stride(1) == 1, "x must have a contiguous last dim, got strides ", x.strides());
  DX_CHECK(M == 1 || (x.stride(0) >= K && x.stride(0) % 8 == 0),
           "x rows must not overlap and start 16-byte aligned (stride(0) >= K and a ",
           "multiple of 8), got strides ", x.strides(), " for shape ", x.sizes());
  DX_CHECK(weight.stride(1) == 1, "weight must have a contiguous last dim, got strides ",
           weight.strides());
  DX_CHECK(N <= 1 || (weight.stride(0) >= K && weight.stride(0) % 8 == 0),
           "weight rows must not overlap and start 16-byte aligned (stride(0) >= K and a ",
           "multiple of 8), got strides ", weight.strides(), " for shape ", weight.sizes());
  DX_CHECK_ALIGNED16(x);
  DX_CHECK_ALIGNED16(weight);
}

void check_gemv_out(const at::Tensor& out, int64_t M, int64_t n_out) {
  DX_CHECK_SHAPE(out, M, n_out);
  DX_CHECK(n_out <= 1 || out.stride(1) == 1, "out must have a contiguous last dim, got strides ",
           out.strides());
  DX_CHECK(M == 1 || out.stride(0) >= n_out,
           "out rows must not overlap (stride(0) >= ", n_out, "), got strides ", out.strides(),
           " for shape ", out.sizes());
}

const __nv_bfloat16* check_gemv_bias(const std::optional<at::Tensor>& bias, const at::Tensor& x,
                                     int64_t N) {
  if (!bias.has_value()) return nullptr;
  const at::Tensor& b = *bias;  // checked by hand: the messages must say "bias"
  DX_CHECK(b.is_cuda(), "bias must be a CUDA tensor, got device ", b.device());
  DX_CHECK(b.device() == x.device(), "x and bias must be on the same device, got ", x.device(),
           " and ", b.device());
  DX_CHECK(b.scalar_type() == at::kBFloat16, "bias must have dtype ", at::kBFloat16, ", got ",
           b.scalar_type());
  DX_CHECK(b.dim() == 1 && b.size(0) == N, "bias must have shape [N] = [", N, "], got ",
           b.sizes());
  DX_CHECK(N <= 1 || b.stride(0) == 1, "bias must be contiguous, got strides ", b.strides());
  return reinterpret_cast<const __nv_bfloat16*>(b.data_ptr());
}

void launch_gemv(const char* op, const at::Tensor& x, const at::Tensor& weight,
                 const __nv_bfloat16* bias_ptr, at::Tensor& out, GemvEpilogue epilogue,
                 bool prefetch_weight, const RopeAppendArgs& rope) {
  const bool silu = epilogue == GemvEpilogue::kSiluMul;
  const int64_t M = x.size(0), K = x.size(1), rows = weight.size(0);
  const int64_t N = silu ? rows / 2 : rows;  // outputs per row of x
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  const int cc_major = device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
  DX_CHECK(cc_major >= 9, "decodex::", op, " needs a GPU of compute capability 9.0 or newer ",
           "(Hopper: bulk copies and thread-block clusters), got ", cc_major, ".x");
  const int sms = sm_count(device);
  // Every epilogue's tiles are 16 weight rows (kSiluMul: 8 gate + 8 up rows), so all share gemv's
  // configuration for the [rows, K] shape, and its summation order.
  const int64_t tiles = silu ? ceil_div(N, kTileRows / 2) : ceil_div(N, kTileRows);

  GemvConfig cf{};
  const bool forced = config_override(cf);
  if (!forced) cf.c = choose_cluster(tiles, K, sms);
  const StageShape st = stage_shape(K, cf.c, static_cast<int>(M));
  if (!forced) cf.stages = default_stages(st, static_cast<int>(M));
  const size_t smem = smem_bytes(st, cf, static_cast<int>(M));
  DX_CHECK(smem <= static_cast<size_t>(kMaxDynamicSmem), "decodex::", op, ": ", cf.stages,
           " stages of ", stage_bytes(st, static_cast<int>(M)),
           " bytes do not fit in shared memory (at most ", kMaxDynamicSmem, " bytes)");
  const int64_t nclus = std::max<int64_t>(1, std::min<int64_t>(tiles, sms / cf.c));

  GemvArgs a{};
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  a.weight = reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr());
  a.bias = bias_ptr;
  a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  a.ldx = M == 1 ? 0 : x.stride(0);
  a.ldw = rows == 1 ? 0 : weight.stride(0);
  a.ldo = M == 1 ? 0 : out.stride(0);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  a.tiles = static_cast<int>(tiles);
  a.c = cf.c;
  a.stages = cf.stages;
  a.kc = st.kc;
  a.pitch = st.pitch;
  a.prefetch_weight = prefetch_weight;
  a.rope = rope;

  const GemvKernel kernel = kernel_for(static_cast<int>(M), epilogue);
  allow_dynamic_smem(kernel);
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(static_cast<unsigned>(nclus * cf.c));
  launch.blockDim = dim3(kThreads);
  launch.dynamicSmemBytes = smem;
  launch.stream = current_stream();
  // Clusters of c > 1 blocks for the split-K sums, and programmatic dependent launch (see
  // pdl_begin in common.h).
  cudaLaunchAttribute attr[2];
  int n_attr = 0;
  if (cf.c > 1) {
    attr[n_attr].id = cudaLaunchAttributeClusterDimension;
    attr[n_attr].val.clusterDim.x = static_cast<unsigned>(cf.c);
    attr[n_attr].val.clusterDim.y = 1;
    attr[n_attr].val.clusterDim.z = 1;
    ++n_attr;
  }
  if (pdl_enabled()) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    ++n_attr;
  }
  launch.attrs = attr;
  launch.numAttrs = n_attr;
  const cudaError_t err = cudaLaunchKernelEx(&launch, kernel, a);
  DX_CHECK(err == cudaSuccess, "decodex::", op, " kernel launch failed (c=", cf.c, ", stages=",
           cf.stages, "): ", cudaGetErrorString(err));
  const cudaError_t late = cudaGetLastError();
  DX_CHECK(late == cudaSuccess, "decodex::", op, " kernel launch failed: ",
           cudaGetErrorString(late));
}

// ---- host: the ops ----

void gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          at::Tensor& out, bool prefetch_weight) {
  check_gemv_x_weight("gemv", x, weight, out);
  const int64_t M = x.size(0), N = weight.size(0);
  check_gemv_out(out, M, N);
  const __nv_bfloat16* bias_ptr = check_gemv_bias(bias, x, N);
  if (N == 0) return;
  launch_gemv("gemv", x, weight, bias_ptr, out, GemvEpilogue::kStore, prefetch_weight);
}

void gemv_silu_mul(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out,
                   bool prefetch_weight) {
  check_gemv_x_weight("gemv_silu_mul", x, weight, out);
  const int64_t M = x.size(0), rows = weight.size(0);
  DX_CHECK(rows % 2 == 0, "gemv_silu_mul: weight must stack gate and up rows, [2I, K], so ",
           "weight.size(0) must be even, got ", weight.sizes());
  check_gemv_out(out, M, rows / 2);
  if (rows == 0) return;
  launch_gemv("gemv_silu_mul", x, weight, nullptr, out, GemvEpilogue::kSiluMul, prefetch_weight);
}

}  // namespace decodex
