// The GEMV kernel of decodex::gemv, gemv_silu_mul and gemv_rope_append, and the table of its
// instances (kernel_for). csrc/gemv.cu has the ops, the choice of configuration and the launch.
// The instances that split K over a thread-block cluster (c > 1) are compiled in
// csrc/gemv_cluster.cu, the others in gemv.cu, so the two build in parallel.
//
// The op streams the weight (every byte read once, ~1 FLOP per byte), so all of it is arranged
// around keeping enough 16-byte weight loads in flight on every SM and nothing else in the way.
//
// Idea of the kernel (one kernel, templated on M and the unroll depth U):
//  * Tensor cores do the math: mma.sync m16n8k16, bf16 in, fp32 accumulate. A warp's 16 weight
//    rows are the A operand and the M <= 8 rows of x the B operand (n = 8; columns n >= M are
//    zero), so all M rows come out of one pass over each weight row and M = 8 costs the same
//    instructions as M = 1 (only more x bytes, from L1).
//  * No shuffles, no ldmatrix: thread (g = lane/4, t = lane%4) loads 16 B (8 consecutive k) of
//    weight rows g and g+8 and of x row g, at k = step*32 + 8t, and hands the four bf16 pairs to
//    the mma's fragments as they are. That maps the mma's logical k onto physical k by the same
//    permutation for A and B, which leaves the dot product unchanged.
//  * Weight loads: ld.global.nc.L1::no_allocate.L2::256B (used once: keep them out of L1; a warp
//    reads each row in 64 B pieces, so let L2 fetch the 256 B granule at once).
//    x loads: ld.global.nc through L1; every warp on the same k-range reads the same x.
//  * U k-steps per loop trip: 2U weight loads and U x loads are all issued before the first mma
//    (U*1 KB per warp in flight); two accumulator sets halve the mma dependency chain.
//  * Work split: a warp owns one 16-row tile and one of P = wk*c contiguous k-ranges. A block
//    holds wr tiles x wk k-ranges and sums its k-ranges through shared memory.
//  * Before griddepcontrol.wait, the first wave of blocks asks L2 for its first round of weight
//    rows, so that DRAM round trip overlaps the kernel ahead (programmatic dependent launch). With
//    prefetch_weight (the caller promises the kernel ahead does not write the weight: the decode
//    graph, whose weights never change) every block loads its first round of weights straight into
//    registers before the wait instead; only x, which the kernel ahead writes, waits.
//  * Epilogues (GemvEpilogue, gemv.h) pick which 16 rows form a tile so that what the epilogue
//    combines (gate and up; a RoPE pair) lands in one lane; each rounds the product to bf16 first,
//    so a fused op equals gemv followed by the unfused op bit for bit. With accumulate (kStore),
//    the lane that owns an output adds the rounded product to it: out += product, as an add after
//    gemv would round it. The decode graph adds the o and down products into the residual so.
//  * RMS scale (rms_eps, kRms): out = (x . W^T) / rms(x), rms(x) = sqrt(mean(x^2) + eps) per row of
//    x: the product of RMSNorm(x) whose weight the caller has folded into W's columns. The sums of
//    squares come from the x fragments the main loop loads anyway, on the tensor cores: one more
//    mma per half step with x as both operands (A rows g = x row g, rows g + 8 zero) puts
//    sum_k x[n,k]^2 on the diagonal of its 16x8 result. Those mmas depend only on x and are issued
//    before the weights' mmas, so they run while the warp waits for its weights (FMAs on unpacked
//    bf16 after the mmas lengthened each trip, measurably at K = 3584). With one row of x the
//    other lanes' x is free, so each lane holds another k-step of the trip and one pair of mmas
//    squares the whole trip (kSpread below; session 25: the batch-1 steps 0.1-0.5% faster,
//    and the 7B gate|up with the norm inside no longer needs a configuration of its own).
//    The diagonal is summed over the k-ranges with the dot products (same reduction, same order),
//    so the norm costs no extra load, round trip or kernel; the epilogue scales each result before
//    the bias. (An earlier prologue that normalised x first, one L2 round trip per block, was
//    slower than an rms_norm kernel on the big shapes: bench/RESULTS.md, session 4.)
//
// Variants (chosen per call by the host, same kernel body):
//  * c = 1, block-local split-K: big N, or K short enough that wk <= 8 warps cover it. These
//    instances (kCluster false) are compiled without the cluster code below.
//  * c > 1, cluster split-K (sm_90): small N (the K projection has 16 tiles for 132 SMs) splits
//    K again over the c blocks of a thread-block cluster, on c SMs; the other blocks push their
//    partials into block 0's shared memory (st.async, distributed shared memory), which sums them
//    once its mbarrier has counted their bytes. No workspace, no atomics, and the summation order
//    is fixed, so results are deterministic.
//  * U = 4 (80-96 registers, more warps per SM) or U = 8 (128 registers, twice the loads in
//    flight per warp).
//  * The wide variants, M = 9..64 (gemv's plain epilogue, with or without accumulate; no RMS
//    scale): M rounded up to a multiple of 8 is the template's M, the real count is a kernel
//    argument. Each block of 8 x rows is the n = 8 of its own two mmas per k-step, with one
//    accumulator set (NB = M/8 independent chains already), and x is loaded one k-step at a time.
//    Each weight byte is still read once; what grows is the x a warp reads per weight byte (M * 64
//    bytes per 1 KB k-step), all of it through L1 and L2. That is what loses to cuBLAS at M = 64
//    (its tiles reuse x from shared memory); at M = 16 the GEMV wins on the small shapes.
//    (bench/RESULTS.md, session 9.)
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "common.h"
#include "gemv.h"
#include "ptx.cuh"

namespace decodex {
namespace gemv_detail {

constexpr int kTileRows = 16;  // weight rows per warp: the mma's m
constexpr int kStepK = 32;     // k per warp step: 4 threads x 8 bf16
constexpr int kMaxWarps = 8;   // warps per block (wr * wk)
constexpr int kMaxCluster = 8; // portable cluster size limit
constexpr int kMaxRows = 8;      // rows of x of the fused epilogues and of the RMS scale

// Grid: ceil(tiles / wr) * c blocks of wr*wk warps; clusters of (c, 1, 1) when c > 1.
// Warp w of block b: tile (b / c) * wr + w / wk, k-range (b % c) * wk + w % wk of the P = wk * c
// ranges that split ceil(K/32) k-steps as evenly as integers allow.
// A tile is 16 weight rows, whose results lane (g, t) holds for rows g and g + 8. Which rows, per
// epilogue (the row pairing puts what the epilogue combines into one lane):
//  * kStore: rows 16j .. 16j+15 (ceil(N/16) tiles).
//  * kSiluMul (N = I outputs, weight [2I, K] = [gate; up]): gate rows 8j .. 8j+7 and the matching
//    up rows I + 8j .. (ceil(I/8) tiles); out = silu(gate) * up.
//  * kRopeAppend (weight = [q heads | k heads | v heads] x D rows): tile j of a q or k head pairs
//    rows 8j .. 8j+7 of the head with rows D/2 + 8j .. (the RoPE pairs, D/16 tiles per head); v
//    rows are plain 16-row tiles. Same tile count as kStore.
// Before griddepcontrol.wait each warp of the first wave of blocks (blockIdx < prefetch_blocks, the
// blocks resident at once) asks L2 for its first round of weight rows (lanes 0-15, one row each):
// the weights do not depend on the kernel before, so their first DRAM round trip overlaps that
// kernel's tail instead of following it. Later blocks start long after the wait has passed; a
// prefetch there only duplicates their loads (measured: the 1.5B lm_head lost 25% with it).
// With prefetch_weight every warp instead loads its first round of weights into registers before
// the wait (the caller promises the kernel before does not write the weight); a block that starts
// after the wait has passed just loads them early.
// __launch_bounds__(256, 2): without a minimum of blocks per SM, ptxas trades the loads in flight
// for occupancy (it sank each load down to its mma: 3 loads in flight instead of 3U). With it,
// ptxas may use up to 128 registers and issues all 3U loads of a trip before the first mma.
template <int M, int U, int kEpi, bool kRms, bool kCluster>
__global__ void __launch_bounds__(kMaxWarps * 32, 2)
gemv_kernel(const __nv_bfloat16* __restrict__ x,       // [M, ldx], rows 16 B aligned
            const __nv_bfloat16* __restrict__ weight,  // [N, ldw] ([2N, ldw] for kSiluMul)
            const __nv_bfloat16* __restrict__ bias,    // [N] or nullptr (nullptr for kSiluMul)
            __nv_bfloat16* __restrict__ out,           // [M, ldo]
            int64_t ldx, int64_t ldw, int64_t ldo, int N, int K, int wr, int wk, int c,
            int prefetch_blocks, bool prefetch_weight, bool launch_dependents_early,
            float rms_eps, bool accumulate, const RopeAppendArgs rope, int m_rows,
            int dependents_after) {
  constexpr bool kSilu = kEpi == static_cast<int>(GemvEpilogue::kSiluMul);
  constexpr bool kRope = kEpi == static_cast<int>(GemvEpilogue::kRopeAppend);
  // Blocks of 8 x rows, each the n = 8 of its own mmas: 1 up to M = 8; M / 8 for the wide
  // variants (M a multiple of 8 up to 64, kStore without RMS), which take their real row count
  // from m_rows (<= M; rows past it are zeros in, nothing out).
  constexpr int NB = M <= 8 ? 1 : M / 8;
  static_assert(NB == 1 || (M % 8 == 0 && M <= kMaxRowsWide && kEpi == 0 && !kRms),
                "the wide GEMV (M > 8) has the plain epilogue only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int mr = NB == 1 ? M : m_rows;
  // Per-warp partial sums, [warp][value][lane]: 4 accumulators per block of x rows, then (kRms)
  // the sum of squares.
  constexpr int kSums = 4 * NB + (kRms ? 1 : 0);
  __shared__ float red[kMaxWarps][kSums][32];
  // Cluster split-K by push (see the cluster sum below): in rank 0, rank q's lead warp j's partial
  // at slot (q - 1) * wr + j. Only M <= 8 pushes (the wide variants' partials would double `red`).
  __shared__ float inbox[NB == 1 ? kMaxWarps : 1][kSums][32];
  __shared__ uint64_t inbox_full;  // push: rank 0 counts the bytes the other ranks push in

  // kCluster: launched with clusters of c > 1 blocks; the other instances have no cluster code
  // (the host launches them with c = 1 only), so c is a constant 1 there.
  if constexpr (!kCluster) c = 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x % c;  // block rank in its cluster (cluster dims are (c, 1, 1))
  const bool push = NB == 1 && c > 1 && (c - 1) * wr <= kMaxWarps;  // grid-uniform
  if (push && rank == 0 && threadIdx.x == 0) {  // ready before the block says it has started
    mbar_init(&inbox_full, 1);  // one arrival: the one below, with the byte count
    fence_mbar_init();
    mbar_arrive_expect(&inbox_full, static_cast<uint32_t>((c - 1) * wr * kSums * 32 * sizeof(float)));
  }
  cluster_started_arrive(push ? c : 1);
  const int tile = (blockIdx.x / c) * wr + warp / wk;
  const int parts = wk * c, part = rank * wk + warp % wk;
  const int ksteps = (K + kStepK - 1) / kStepK;
  // kRopeAppend: tiles below rope_tiles are RoPE pairs of a q/k head (head, 8-pair slice hj).
  const int tiles_per_head = kRope ? rope.D / 16 : 1;
  const bool rope_tile = kRope && tile < (rope.H + rope.Hkv) * tiles_per_head;
  const int head = tile / tiles_per_head, hj = tile - head * tiles_per_head;
  // Weight row of tile-local row i (0..15), and whether it exists.
  auto tile_row = [&](int i) {
    if (kSilu) return tile * 8 + (i & 7) + (i >= 8 ? N : 0);
    if (rope_tile) return head * rope.D + 8 * hj + (i & 7) + (i >= 8 ? rope.D / 2 : 0);
    return tile * kTileRows + i;
  };
  auto row_ok = [&](int i) { return (kSilu ? tile * 8 + (i & 7) : tile_row(i)) < N; };
  const bool tile_ok = row_ok(0);  // the last block's spare warps only join the sums
  // 32-bit: part + 1 <= parts <= kMaxWarps * kMaxCluster = 64 and ksteps <= 2^25 (K < 2^30).
  const int s_begin = static_cast<int>(static_cast<uint32_t>(part) * ksteps / parts);
  const int s_end =
      tile_ok ? static_cast<int>(static_cast<uint32_t>(part + 1) * ksteps / parts) : s_begin;

  const int row0 = tile_row(g), row1 = tile_row(g + 8);
  const bool ok0 = row_ok(g), ok1 = row_ok(g + 8), xok = g < M;
  const int rows = kSilu ? 2 * N : N;
  // Clamped so no out-of-range pointer is formed; the loads are predicated off anyway.
  const __nv_bfloat16* w0 = weight + static_cast<int64_t>(min(row0, rows - 1)) * ldw;
  const __nv_bfloat16* w1 = weight + static_cast<int64_t>(min(row1, rows - 1)) * ldw;
  const __nv_bfloat16* xg = x + static_cast<int64_t>(min(g, M - 1)) * ldx;
  // One trip of the loop: the weights of the U k-steps from s, then x, then the mma.
  auto load_weights = [&](uint4 (&wa)[U], uint4 (&wb)[U], int s) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int k = (s + j) * kStepK + t * 8;
      const bool in = (s + j < s_end) && (k < K);
      wa[j] = load16_stream_l2_256(w0 + k, in && ok0);
      wb[j] = load16_stream_l2_256(w1 + k, in && ok1);
    }
  };
  // acc_lo: pairs 0,1 of each 16 B load; acc_hi: pairs 2,3. Fragment of d (per lane):
  // [0] = (row g, n 2t), [1] = (row g, n 2t+1), [2] = (row g+8, n 2t), [3] = (row g+8, n 2t+1).
  float acc_lo[4] = {0.f, 0.f, 0.f, 0.f}, acc_hi[4] = {0.f, 0.f, 0.f, 0.f};
  // kRms: x . x^T of this warp's k-steps; lane (g, t) holds the diagonal entry of x row g in
  // element g & 1 when t == g / 2 (the 16x8 result's layout, as for d above; rows g + 8 unused).
  float ss[4] = {0.f, 0.f, 0.f, 0.f};
  // kSpread (kRms with one row of x): the weights' mmas store only column n = 0, so the other
  // lanes' x (B columns 1..7) may be anything. At unrolled position j lane (g, t) holds x's step
  // s + (j + g) % U (lane g = 0: step s + j, as the product needs); position 0 then holds U
  // different steps in rows g < U, and one pair of mmas puts the squares of the whole trip on the
  // diagonal (rows g >= U zeroed), instead of a pair per step. The diagonal, each step once, is
  // summed over the warp at the end.
  constexpr bool kSpread = kRms && M == 1;
  static_assert(!kSpread || U <= 8, "kSpread squares a trip's U steps in the A operand's 8 rows");
  // The wide variants: one accumulator set per block of 8 x rows (NB independent mma chains
  // already), x loaded one k-step at a time (NB loads, not U * NB, so the registers hold out).
  float accw[NB][4] = {};
  auto x_and_mma_wide = [&](const uint4 (&wa)[U], const uint4 (&wb)[U], int s) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int k = (s + j) * kStepK + t * 8;
      const bool in = (s + j < s_end) && (k < K);
      uint4 xv[NB];
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int n = 8 * b + g;
        xv[b] = load16_cached(x + static_cast<int64_t>(min(n, mr - 1)) * ldx + k, in && n < mr);
      }
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        mma_bf16_16816(accw[b], wa[j].x, wb[j].x, wa[j].y, wb[j].y, xv[b].x, xv[b].y);
        mma_bf16_16816(accw[b], wa[j].z, wb[j].z, wa[j].w, wb[j].w, xv[b].z, xv[b].w);
      }
    }
  };
  auto x_and_mma_narrow = [&](const uint4 (&wa)[U], const uint4 (&wb)[U], int s) {
    uint4 xv[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int js = kSpread ? (j + g) % U : j;  // the k-step whose x this lane holds at j
      const int k = (s + js) * kStepK + t * 8;
      const bool in = (s + js < s_end) && (k < K);
      xv[j] = load16_cached(xg + k, in && (kSpread || xok));
    }
    // The squares first: x (from L1 or L2) arrives before the weights (from memory), so these
    // mmas run while the warp waits for the weights. Absent x vectors are zeros: they add nothing.
    if constexpr (kSpread) {
      const uint4 xa = g < U ? xv[0] : make_uint4(0u, 0u, 0u, 0u);  // each step's squares once
      mma_bf16_16816(ss, xa.x, 0u, xa.y, 0u, xv[0].x, xv[0].y);
      mma_bf16_16816(ss, xa.z, 0u, xa.w, 0u, xv[0].z, xv[0].w);
    } else if constexpr (kRms) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        mma_bf16_16816(ss, xv[j].x, 0u, xv[j].y, 0u, xv[j].x, xv[j].y);
        mma_bf16_16816(ss, xv[j].z, 0u, xv[j].w, 0u, xv[j].z, xv[j].w);
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      // A rows g / g+8 = weight rows; B column g = x row g; same physical k on both sides.
      mma_bf16_16816(acc_lo, wa[j].x, wb[j].x, wa[j].y, wb[j].y, xv[j].x, xv[j].y);
      mma_bf16_16816(acc_hi, wa[j].z, wb[j].z, wa[j].w, wb[j].w, xv[j].z, xv[j].w);
    }
  };
  auto x_and_mma = [&](const uint4 (&wa)[U], const uint4 (&wb)[U], int s) {
    if constexpr (NB > 1) {
      x_and_mma_wide(wa, wb, s);
    } else {
      x_and_mma_narrow(wa, wb, s);
    }
  };

  // The first trip is peeled: with prefetch_weight its weights are loaded before the wait.
  uint4 wa0[U], wb0[U];
  if (prefetch_weight) {
    load_weights(wa0, wb0, s_begin);  // the weight does not depend on the kernel ahead
  } else if (static_cast<int>(blockIdx.x) < prefetch_blocks && lane < kTileRows &&
             s_begin < s_end && row_ok(lane)) {
    const int k0 = s_begin * kStepK, k1 = min(min(s_begin + U, s_end) * kStepK, K);
    prefetch_l2_bulk(weight + static_cast<int64_t>(tile_row(lane)) * ldw + k0,
                     static_cast<uint32_t>(k1 - k0) * 2u);
  }
  // kRope: the epilogue's other inputs are fetched before the main loop, so that no round trip
  // follows it at the end of every block: by the lanes that will store (lead warps, rank 0 of a
  // cluster), the bias of their rows row0 and row1, the inv_freq of their RoPE pair and the
  // positions of their x rows. The bias and inv_freq are as constant as the weight: with
  // prefetch_weight (whose promise covers them) they are loaded before the wait, else right after
  // it; the positions after it. (kStore reads its bias in the epilogue: the two registers made
  // the M = 8, U = 8 instance spill. kSilu has none.)
  const bool lead = warp % wk == 0;
  const bool stores = kRope && lead && rank == 0 && tile_ok;
  float bias_r[2] = {0.f, 0.f};  // kRope: rows row0, row1
  float inv_freq_r = 0.f;        // kRope: the pair's inverse frequency (rope tiles)
  auto fetch_constants = [&] {
    if constexpr (kRope) {
      auto bias_at = [&](int row, bool ok) {
        const uint16_t bits = load_b16(bias + min(row, N - 1), stores && ok);
        return __bfloat162float(__ushort_as_bfloat16(bits));
      };
      if (bias != nullptr) {
        bias_r[0] = bias_at(row0, ok0);
        bias_r[1] = bias_at(row1, ok1);
      }
      inv_freq_r = __uint_as_float(load_b32(rope.inv_freq + 8 * hj + g, stores && rope_tile));
    }
  };
  if (prefetch_weight) fetch_constants();
  // launch_dependents_early: the next kernel may launch (and load its weights) while the kernel
  // ahead of this one still runs; dependents_after (percent; one row of x only: the instances of
  // more rows have no registers to spare for it): only once this warp has issued that share of its
  // trips' loads (the block triggers with its first warp to get there), so that the next kernel's
  // loads before its wait come as this one's drain (gemv.h's GemvOptions says when each pays).
  // Otherwise right after the wait, as pdl_begin.
  if (launch_dependents_early) pdl_trigger();
  pdl_wait();
  const int trips = s_begin < s_end ? (s_end - s_begin + U - 1) / U : 0;
  // The trip before whose loads the warp triggers; at trigger_trip == trips (100%) it never does,
  // and its block triggers as it exits.
  const int trigger_trip = M == 1 ? dependents_after * trips / 100 : 0;
  const int trigger_s = s_begin + trigger_trip * U;
  if (trigger_trip == 0) pdl_trigger();
  if (!prefetch_weight) fetch_constants();
  int pos_r[2] = {-1, -1};  // kRope: the positions of x rows 2t, 2t + 1
  if constexpr (kRope) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = 2 * t + i;
      pos_r[i] = static_cast<int>(load_b32(rope.positions + min(n, M - 1), stores && n < M));
    }
  }
  // accumulate: the storing lanes fetch the outputs they add to now, likewise.
  uint16_t old_out[4] = {0, 0, 0, 0};
  if (NB == 1 && !kSilu && !kRope && accumulate && lead && rank == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i >= 2 ? row1 : row0;
      const int n = 2 * t + (i & 1);
      old_out[i] = load_b16(out + static_cast<int64_t>(min(n, M - 1)) * ldo + min(row, N - 1),
                            tile_ok && n < M && row < N);
    }
  }
  if (s_begin < s_end) {
    if (!prefetch_weight) load_weights(wa0, wb0, s_begin);
    x_and_mma(wa0, wb0, s_begin);
  }
  for (int s = s_begin + U; s < s_end; s += U) {
    uint4 wa[U], wb[U];
    if (M == 1 && s == trigger_s) pdl_trigger();
    load_weights(wa, wb, s);
    x_and_mma(wa, wb, s);
  }
  float r[kSums];
  if constexpr (NB == 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = acc_lo[i] + acc_hi[i];
  } else {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
      for (int i = 0; i < 4; ++i) r[4 * b + i] = accw[b][i];
    }
  }
  if constexpr (kRms) {  // the diagonal: x row g's sum of squares in lane 4g + g/2, else 0
    r[kSums - 1] = t == g / 2 ? ((g & 1) ? ss[1] : ss[0]) : 0.f;
  }
  if constexpr (kSpread) {  // row 0's: the whole diagonal, in every lane
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      r[kSums - 1] += __shfl_xor_sync(0xffffffffu, r[kSums - 1], off);
    }
  }

  // Sum the wk k-ranges of each tile in the block (block-uniform branch).
  if (wk > 1) {
#pragma unroll
    for (int i = 0; i < kSums; ++i) red[warp][i][lane] = r[i];
    __syncthreads();
    if (lead) {
      for (int p = 1; p < wk; ++p) {
#pragma unroll
        for (int i = 0; i < kSums; ++i) r[i] += red[warp + p][i][lane];
      }
    }
  }
  // Sum the c blocks of the cluster into block 0 (grid-uniform branch), in rank order. Push (M <= 8
  // where the inbox holds every rank's lead partials): each other rank's lead warps st.async their
  // partial straight into rank 0's inbox (ptx.cuh), counted on rank 0's mbarrier (inbox_full), and
  // their block exits; rank 0's lead warps wait for the bytes, its other warps exit at once. Pull
  // (otherwise): every lead warp leaves its partial in its own `red` slot, rank 0 reads the others'
  // after a barrier, and a second barrier keeps their shared memory alive until it has. Measured
  // (bench/RESULTS.md, session 28): st.async instead of generic stores and a cluster barrier made
  // the step 0.2% faster at 1.5B 1K and 32K and 0.5-0.8% at batch 8 (1.5B, 7B), 0.4% slower at 7B
  // 1K (the 7B down projection's re-tune in gemv.cu took that back); letting rank 0's other warps
  // wait too was 0.5% slower at 1.5B 1K (0.7% faster at 1.5B batch 8). Session 24: the push's one
  // barrier and no remote load made the 1.5B down projection (clusters of 2) 0.3 us faster alone
  // and the step 0.4-0.7% faster at 1.5B (1K, 32K, batch 8) and at 7B batch 8 (clusters of 4).
  // That build also ran the 1.5B LM head (c = 1) 2% slower; since the c = 1 instances have none of
  // this code (kCluster), it takes 107 us against 111-114 and the 1.5B step is 2% faster (session
  // 25).
  if (c > 1) {
#if __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    const int lead_slot = warp / wk;  // this lead warp's index among the block's wr
    if (push) {
      cluster_started_wait(c);
      if (rank != 0) {
        if (lead) {
          const uint32_t dst = cluster_addr(&inbox[(rank - 1) * wr + lead_slot][0][lane], 0);
          const uint32_t bar = cluster_addr(&inbox_full, 0);
#pragma unroll
          for (int i = 0; i < kSums; ++i) st_async(dst + i * 32 * sizeof(float), r[i], bar);
        }
        return;
      }
      if (!lead) return;  // only rank 0's lead warps sum (and their block outlives the stores)
      mbar_wait_cluster(&inbox_full, 0);  // every rank's partials have landed
    } else {
      if (lead) {
        // A lead warp only rewrites its own slot, which no other warp of its block reads.
#pragma unroll
        for (int i = 0; i < kSums; ++i) red[warp][i][lane] = r[i];
      }
      cluster.sync();  // every rank's partials written and visible where rank 0 reads them
    }
    if (rank == 0 && lead) {
      for (int q = 1; q < c; ++q) {
        const float* part = push ? &inbox[(q - 1) * wr + lead_slot][0][0]
                                 : cluster.map_shared_rank(&red[warp][0][0], q);
#pragma unroll
        for (int i = 0; i < kSums; ++i) r[i] += part[i * 32 + lane];
      }
    }
    if (!push) cluster.sync();  // the other blocks' shared memory must outlive rank 0's reads
    if (rank != 0) return;
#else
    __trap();  // the host never picks c > 1 below sm_90
#endif
  }
  if (!lead || !tile_ok) return;

  // kRms: r[i] belongs to x row n = 2t + (i & 1), whose sum of squares lane 4n + n/2 holds in r[4].
  float inv_rms[2] = {1.f, 1.f};
  if constexpr (kRms) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = min(2 * t + i, M - 1);
      inv_rms[i] = rms_inv(__shfl_sync(0xffffffffu, r[kSums - 1], 4 * n + n / 2), K, rms_eps);
    }
  }
  // Results are rounded to bf16 (after the RMS scale and the bias) as gemv stores them before any
  // epilogue math, so each fused op equals gemv followed by its unfused op bit for bit.
  auto stored = [&](int i, int row) {
    // Explicit roundings: no FMA contraction, which could differ between the epilogues' kernels.
    float v = kRms ? __fmul_rn(r[i], inv_rms[i & 1]) : r[i];
    if (bias != nullptr) {  // kRope: row is row0 for i < 2, row1 for i >= 2
      v = __fadd_rn(v, kRope ? bias_r[(i >> 1) & 1] : __bfloat162float(bias[row]));
    }
    return __bfloat162float(__float2bfloat16_rn(v));
  };
  if constexpr (kSilu) {
    // r[i] gate, r[i + 2] up of output row n = 2t + i, feature row0.
    if (ok0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = 2 * t + i;
        if (n < M) {
          out[static_cast<int64_t>(n) * ldo + row0] =
              __float2bfloat16_rn(silu_times(stored(i, row0), stored(i + 2, row1)));
        }
      }
    }
  } else if constexpr (kRope) {
    // r[i] / r[i + 2]: rows row0 / row1 of output row n = 2t + i: a RoPE pair (x1, x2) of a q or
    // k head, or two v features. Rotated and appended only where 0 <= position < S (rope_append's
    // rule: any other row is left as the plain product).
    const int D = rope.D;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = 2 * t + i;
      if (n >= M) continue;
      float v0 = stored(i, row0), v1 = stored(i + 2, row1);
      const int pos = pos_r[i];
      const bool live = pos >= 0 && pos < rope.S;
      if (rope_tile && live) {
        float cs, sn;
        rope_cos_sin(pos, inv_freq_r, cs, sn);
        rope_rotate(v0, v1, cs, sn, v0, v1);
      }
      const __nv_bfloat16 b0 = __float2bfloat16_rn(v0), b1 = __float2bfloat16_rn(v1);
      out[static_cast<int64_t>(n) * ldo + row0] = b0;
      out[static_cast<int64_t>(n) * ldo + row1] = b1;
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
  } else if constexpr (NB > 1) {
    // r[4b + i]: row (i >= 2 ? row1 : row0) of x row 8b + 2t + (i & 1). accumulate: every old
    // value is loaded before the first store, so the loads share one round trip.
    uint16_t old_w[4 * NB];
#pragma unroll
    for (int i = 0; i < 4 * NB; ++i) {
      const int row = (i & 2) ? row1 : row0, n = 8 * (i / 4) + 2 * t + (i & 1);
      old_w[i] = load_b16(out + static_cast<int64_t>(min(n, mr - 1)) * ldo + min(row, N - 1),
                          accumulate && n < mr && row < N);
    }
#pragma unroll
    for (int i = 0; i < 4 * NB; ++i) {
      const int row = (i & 2) ? row1 : row0, n = 8 * (i / 4) + 2 * t + (i & 1);
      if (n < mr && row < N) {
        float v = stored(i, row);
        if (accumulate) v = __fadd_rn(__bfloat162float(__ushort_as_bfloat16(old_w[i])), v);
        out[static_cast<int64_t>(n) * ldo + row] = __float2bfloat16_rn(v);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i >= 2 ? row1 : row0;
      const int n = 2 * t + (i & 1);
      if (n < M && row < N) {
        float v = stored(i, row);
        if (accumulate) v = __fadd_rn(__bfloat162float(__ushort_as_bfloat16(old_out[i])), v);  // out += it
        out[static_cast<int64_t>(n) * ldo + row] = __float2bfloat16_rn(v);
      }
    }
  }
#else
  pdl_begin();
  __trap();  // bf16 mma needs sm_80; the host refuses older devices
#endif
}

// ---- the instances ----

using GemvKernel = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                            __nv_bfloat16*, int64_t, int64_t, int64_t, int, int, int, int, int,
                            int, bool, bool, float, bool, const RopeAppendArgs, int, int);

// The kernel's template M for m rows of x: m itself up to 8, else m rounded up to a multiple of 8.
inline int kernel_rows(int m) { return m <= kMaxRows ? m : (m + 7) / 8 * 8; }

template <bool kCluster, int M, int kEpi, bool kRms>
GemvKernel kernel_for_m(int u) {
  return u == 8 ? gemv_kernel<M, 8, kEpi, kRms, kCluster> : gemv_kernel<M, 4, kEpi, kRms, kCluster>;
}

// The kernel of template M = Ms for the m that equals one of Ms (nullptr for none).
template <bool kCluster, int kEpi, bool kRms, int... Ms>
GemvKernel kernel_among(int m, int u, std::integer_sequence<int, Ms...>) {
  GemvKernel k = nullptr;
  (void)((m == Ms && (k = kernel_for_m<kCluster, Ms, kEpi, kRms>(u)) != nullptr) || ...);
  return k;
}

// m <= 8: the kernel of M = m; m > 8: the wide variants, M = m rounded up to a multiple of 8
// (kStore without RMS only; the ops refuse the rest).
template <bool kCluster, int kEpi, bool kRms>
GemvKernel kernel_for(int m, int u) {
  GemvKernel k = nullptr;
  if (m <= kMaxRows) {
    k = kernel_among<kCluster, kEpi, kRms>(m, u, std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>{});
  } else if constexpr (kEpi == static_cast<int>(GemvEpilogue::kStore) && !kRms) {
    k = kernel_among<kCluster, kEpi, kRms>(kernel_rows(m), u,
                                           std::integer_sequence<int, 16, 24, 32, 40, 48, 56, 64>{});
  }
  DX_CHECK(k != nullptr, "decodex::gemv: no kernel for ", m, " rows of x with this epilogue");
  return k;
}

template <bool kCluster, bool kRms>
GemvKernel kernel_for(int m, int u, GemvEpilogue epi) {
  switch (epi) {
    case GemvEpilogue::kSiluMul:
      return kernel_for<kCluster, static_cast<int>(GemvEpilogue::kSiluMul), kRms>(m, u);
    case GemvEpilogue::kRopeAppend:
      return kernel_for<kCluster, static_cast<int>(GemvEpilogue::kRopeAppend), kRms>(m, u);
    default: return kernel_for<kCluster, static_cast<int>(GemvEpilogue::kStore), kRms>(m, u);
  }
}

// The instance for m rows of x, unroll u, the epilogue, the RMS scale, and whether it is launched
// with clusters of c > 1 blocks (kCluster). Each translation unit instantiates one kCluster:
// gemv.cu false, gemv_cluster.cu true.
template <bool kCluster>
GemvKernel kernel_for(int m, int u, GemvEpilogue epi, bool rms) {
  return rms ? kernel_for<kCluster, true>(m, u, epi) : kernel_for<kCluster, false>(m, u, epi);
}

// Instantiated in gemv_cluster.cu only.
extern template GemvKernel kernel_for<true>(int m, int u, GemvEpilogue epi, bool rms);

}  // namespace gemv_detail
}  // namespace decodex
