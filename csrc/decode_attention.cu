// decode_attention: one query token per sequence against a bf16 KV cache, split over the KV length
// (flash-decoding), for head dims 64 and 128 and any GQA group.
//
// Idea. Decode attention reads each cache row once and does ~2 * group FLOPs per byte, so it is a
// pure bandwidth problem, but with GQA (6-8 query heads per KV head) the per-token work is too much
// for scalar FMAs plus warp shuffles at 4 TB/s. So both products run on tensor cores (mma.sync
// m16n8k16, bf16 in, fp32 accumulate) in the "swapped" orientation that suits a handful of heads:
//   S^T [16 tokens x 8 heads] = K_tile [16 x D] . Q^T [D x 8]
//   O^T [D x 8 heads]        += V_tile^T [D x 16] . P^T [16 x 8]
// The 8 head columns hold the query heads of one KV head (padded with zero queries), so every K and
// V row is read once for its whole group. Each lane's fragments are 16-byte chunks of the tile's
// rows, used as they are (no ldmatrix, no shuffles):
//   - a dot product does not care in which order the head dim is summed, so K (the A operand) and
//     Q (the B operand) are loaded with the SAME permutation of the head dim that makes each lane's
//     16-byte chunk of a K row exactly its A-fragment words;
//   - for P.V the head dim is the M index (any permutation, undone when the result is written) and
//     the tokens are K; a lane loads 16 bytes of 4 token rows and pairs them with byte permutes into
//     A-fragment words; P^T comes from the S^T accumulator through one movmatrix transpose per 8x8.
// Each warp walks 16-token tiles of its split with an online softmax in fp32, with the next tiles'
// K and V in flight while it computes one. Two ways, one per kernel instance:
//   - the register path (decode_attention, and rope_append_attention up to 8 rows): the next
//     tile's loads go straight into a second register buffer (218 registers a thread; one tile in
//     flight while the other is used);
//   - the ring path (rope_append_attention above 8 rows): the tiles come through a ring of kStages
//     slots in shared memory (cp.async), so kStages tiles are in flight and only the one being
//     computed sits in registers (196 registers, 96 KB of shared memory a block). Beside the cuBLAS
//     products of the batched step it saves 1.8 us a layer (1.5B, 64 rows); run as decode_attention
//     beside the GEMVs of the small batches it was slower, so decode_attention keeps the registers
//     (bench/RESULTS.md, session 16), and so does rope_append_attention at the GEMVs' batches
//     (Qwen3's step at batch 1, whose q/k norms put rope_append's work there: session 40).
// A block has 4 warps (2 blocks an SM), or 8 (one block an SM) for short caches at batch 1 and 2
// and for long caches at up to 4 (b, KV head) pairs (wide_split_blocks); split_warps has the
// exceptions (6 warps: wide blocks of head dim 128, and two blocks an SM of head dim 64). The
// warps of a block are merged through shared memory into one partial (o, m, l) per (b, head, split).
// Where there are at most 8 splits (short caches, big batches) and clusters pay (merge_in_cluster),
// the splits of a (b, KV head) are one thread-block cluster: each block pushes its partial's slices
// to the blocks that own them through distributed shared memory (st.async, counted on the owner's
// mbarrier), and once its bytes have landed each merges its slice and writes bf16 (merge_cluster),
// with no workspace round trip and no second kernel. Otherwise the partials go to the workspace and a
// second small kernel merges the splits (log-sum-exp) and writes bf16. It runs one
// block per (b, head) with 1-8 warps, one per 16 splits (on an H200 with Hkv = 2: 16 splits at
// batch 8 on a 32K cache, one warp and no barrier; 66 at batch 1 on 32K, 5 warps); each warp walks
// its share of the splits in chunks of 32 with an online rescale, all of a chunk's rows of o in
// flight at once, and the warps merge through shared memory. That kernel is launched with
// programmatic dependent launch so its launch overlaps the first kernel's tail (it executes
// griddepcontrol.wait before it reads anything). With prefetch_cache (the decode graph, whose
// kernel ahead is the append of row lengths[b] - 1) the split kernel also issues its first tiles'
// loads or copies before its own wait, so the first DRAM round trip overlaps that kernel.
// Groups of more than 8 query heads take several head blocks per KV head (each re-reads the rows,
// mostly from L2); real models have 1-8.
//
// Precision: scores are exact bf16 products summed in fp32. exp(x * scale) is computed as
// exp2f(x * scale * log2(e)): exp2f is accurate to 2 ulp and folding the constant costs one fp32
// rounding of the exponent (relative 6e-8, i.e. ~1e-6 absolute on exponents ~20): far below bf16.
// P is rounded to bf16 for the tensor-core P.V product, as flash attention does, and l sums those
// rounded weights so they sum exactly to l. Output rounding to bf16 dominates the error.
//
// Lengths are read on the device. The grid (the number of splits) depends only on the cache
// capacity and the SM count, so one CUDA graph stays valid while the lengths grow; the live length
// is then cut into equal ranges of whole 16-token tiles (at least 128 tokens) over those splits, so
// a short sequence in a long cache still spreads over the SMs. A split past lengths[b] reads
// nothing and writes an empty partial (m = -inf, l = 0); a length-0 sequence gets zeros; lengths
// are clamped to [0, S].
// Fragments are 32-bit words, so 16-byte chunks are held as uint4 rather than common.h's bf16x8.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

#include "common.h"
#include "decode_attention.h"
#include "ptx.cuh"
#include "ops.h"

namespace decodex {

namespace {

constexpr int kWarps = 4;                  // warps per split block (2 kWarps: split_warps)
constexpr int kTile = 16;                  // tokens per warp per step (the mma M/K extent)
constexpr int kHeadsPerBlock = 8;          // query heads per block (the mma N extent)
constexpr int kMinSplitTokens = 128;       // no split shorter than this (2 tiles per warp)
constexpr int kSplitBlocksPerSm = 2;       // one resident wave of 4-warp split blocks (2 fit an SM)
constexpr int kWideMinSplits = 32;         // 8-warp blocks, one an SM, where that gives this many
constexpr int kMaxSplits = 1024;           // caps decode_attention_splits
constexpr int kClusterSplits = 8;          // up to this many splits merge in a cluster (portable)
constexpr int kStages = 3;                 // a warp's ring of tiles in shared memory
constexpr int kRopeRegisterRows = 8;       // rope_append_attention: the register path up to 8 rows
constexpr int kCombineSplitsPerWarp = 16;  // combine: one warp per 16 splits ...
constexpr int kCombineMaxWarps = 8;        // ... up to 8
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;  // i is a compile-time constant
}

// Transpose of an 8x8 b16 matrix held in the standard fragment layout (lane l: row l/4, cols
// 2*(l%4), +1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// One warp's 16-token tile in registers. Lane (g = lane/4, t = lane%4):
//   k[r][c]: token g + 8r of the tile, head dims [32c + 8t, +8)
//   v[i][h]: token 2t + (i&1) + 8(i>>1) of the tile, head dims [64h + 8g, +8)
template <int D>
struct KVTile {
  uint4 k[2][D / 32];
  uint4 v[4][D / 64];
};

// The register path (plain decode_attention): the tile's rows straight from global memory into
// KVTile's lane layout (zeros for tokens at or past end).
template <int D>
__device__ __forceinline__ void load_tile(KVTile<D>& tile, const __nv_bfloat16* k_rows,
                                          const __nv_bfloat16* v_rows, int base, int end, int g,
                                          int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tok = base + g + 8 * r;
    const bool ok = tok < end;
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
      tile.k[r][c] = load16_stream(k_rows + (int64_t)tok * D + 32 * c + 8 * t, ok);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = base + 2 * t + (i & 1) + 8 * (i >> 1);
    const bool ok = tok < end;
#pragma unroll
    for (int h = 0; h < D / 64; ++h)
      tile.v[i][h] = load16_stream(v_rows + (int64_t)tok * D + 64 * h + 8 * g, ok);
  }
}

// The ring path (rope_append_attention): a warp's ring of kStages slots, each one tile's K rows
// then V rows (16 x D bf16 each), filled by cp.async (16-byte chunks, L2 only) and read into a
// KVTile just before the tile is used. Chunks are placed with an XOR swizzle so that the KVTile
// reads below are free of bank conflicts: K row r's chunk j sits at chunk j ^ 4(r & 1) (a quarter
// warp reads rows g, g + 1 at chunks 4c + t), V row r's chunk j at j ^ (r & 6) (a quarter warp
// reads rows 2t + e at chunks 8h + g, g in {2q, 2q + 1}).
template <int D>
constexpr int kTileBytes = 2 * kTile * D * 2;  // K and V of one tile, bf16
template <int D>
constexpr int kRingBytes = kWarps * kStages * kTileBytes<D>;  // the block's dynamic shared memory

__device__ __forceinline__ int k_chunk(int row, int j) { return j ^ (4 * (row & 1)); }
__device__ __forceinline__ int v_chunk(int row, int j) { return j ^ (row & 6); }

// Copies tokens [base, base + 16) of K and V into the slot at shared address `slot`: tokens at or
// past `end` are zero-filled (nothing read).
template <int D>
__device__ __forceinline__ void copy_tile(uint32_t slot, const __nv_bfloat16* k_rows,
                                          const __nv_bfloat16* v_rows, int base, int end, int lane) {
  constexpr int kChunks = D / 8;                  // 16-byte chunks of a row
  constexpr int kPerLane = kTile * kChunks / 32;  // chunks of K (and of V) per lane
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i, row = e / kChunks, j = e % kChunks;
    const int tok = base + row;
    const bool ok = tok < end;
    const int64_t at = (int64_t)(ok ? tok : 0) * D + 8 * j;
    const uint32_t dst = slot + row * (2 * D);
    cp_async16(dst + 16 * k_chunk(row, j), k_rows + at, ok ? 16u : 0u);
    cp_async16(dst + kTile * D * 2 + 16 * v_chunk(row, j), v_rows + at, ok ? 16u : 0u);
  }
}

// The slot at shared address `slot` into registers, in KVTile's lane layout.
template <int D>
__device__ __forceinline__ void read_tile(KVTile<D>& tile, uint32_t slot, int g, int t) {
  const uint32_t vs = slot + kTile * D * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) tile.k[r][c] = lds16(slot + row * (2 * D) + 16 * k_chunk(row, 4 * c + t));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = 2 * t + (i & 1) + 8 * (i >> 1);
#pragma unroll
    for (int h = 0; h < D / 64; ++h) tile.v[i][h] = lds16(vs + row * (2 * D) + 16 * v_chunk(row, 8 * h + g));
  }
}

// One 16-token tile (tokens base .. base+15, those >= end masked) into the running softmax state of
// heads 2t, 2t+1: m (max, log2 units), this lane's share of l, and the O^T accumulators.
template <int D>
__device__ __forceinline__ void attend_tile(const KVTile<D>& tile, const uint4 (&qf)[D / 32], int base,
                                            int end, int g, float scale_log2, float (&o)[D / 16][4],
                                            float& m0, float& m1, float& l0, float& l1) {
  // S^T = K . Q^T: k-step 2c + s uses words 2s, 2s+1 of the lane's 16-byte chunks.
  // Two accumulators (even and odd k-steps) halve the chain of dependent mmas.
  float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk >> 1, w = (kk & 1) * 2;
    mma_bf16_16816((kk & 1) ? s2 : s, word(tile.k[0][c], w), word(tile.k[1][c], w),
                   word(tile.k[0][c], w + 1), word(tile.k[1][c], w + 1), word(qf[c], w), word(qf[c], w + 1));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += s2[i];
  // s[0], s[1]: token g, heads 2t, 2t+1; s[2], s[3]: token g + 8. Padded tokens -> -inf.
  const bool ok_lo = base + g < end, ok_hi = base + g + 8 < end;
  const float x0 = ok_lo ? s[0] * scale_log2 : -INFINITY;
  const float x1 = ok_lo ? s[1] * scale_log2 : -INFINITY;
  const float x2 = ok_hi ? s[2] * scale_log2 : -INFINITY;
  const float x3 = ok_hi ? s[3] * scale_log2 : -INFINITY;
  // Tile max per head over the 8 lanes that share t (lane bits 2..4). Token `base` is valid, so
  // the max is finite and exp2(m_old - m_new) is 0 on the first tile (m_old = -inf).
  float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float corr0 = exp2f(m0 - mn0), corr1 = exp2f(m1 - mn1);
  m0 = mn0;
  m1 = mn1;
  // P in bf16 (the P.V operand); l sums the rounded values so the weights sum to exactly l.
  const __nv_bfloat162 p_lo = __floats2bfloat162_rn(exp2f(x0 - mn0), exp2f(x1 - mn1));
  const __nv_bfloat162 p_hi = __floats2bfloat162_rn(exp2f(x2 - mn0), exp2f(x3 - mn1));
  const float2 f_lo = __bfloat1622float2(p_lo), f_hi = __bfloat1622float2(p_hi);
  l0 = l0 * corr0 + f_lo.x + f_hi.x;
  l1 = l1 * corr1 + f_lo.y + f_hi.y;
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    o[i][0] *= corr0;
    o[i][1] *= corr1;
    o[i][2] *= corr0;
    o[i][3] *= corr1;
  }
  // P^T [16 tokens x 8 heads] as the B operand: transpose the two 8x8 halves of S^T's layout.
  const uint32_t pb0 = movmatrix_trans(bf162_bits(p_lo));  // tokens 2t, 2t+1, head g
  const uint32_t pb1 = movmatrix_trans(bf162_bits(p_hi));  // tokens 2t+8, 2t+9, head g

  // O^T += V^T . P^T. A-fragment words pair two tokens of one dim: low halves are the even dims.
#pragma unroll
  for (int h = 0; h < D / 64; ++h) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t v0 = word(tile.v[0][h], p), v1 = word(tile.v[1][h], p);
      const uint32_t v2 = word(tile.v[2][h], p), v3 = word(tile.v[3][h], p);
      mma_bf16_16816(o[h * 4 + p], __byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632),
                __byte_perm(v2, v3, 0x5410), __byte_perm(v2, v3, 0x7632), pb0, pb1);
    }
  }
}

// The tokens per split for a live length len: equal ranges of whole tiles over the splits, none
// shorter than kMinSplitTokens. Split s holds [s * chunk, min((s + 1) * chunk, len)): empty iff
// s * chunk >= len. The split kernel and the combine both use it, so they agree on which are empty.
__device__ __forceinline__ int split_chunk(int len, int splits) {
  const int per = (len + splits - 1) / splits;
  return max(kMinSplitTokens, (per + kTile - 1) / kTile * kTile);
}

// The splits of one (b, KV head, head block) merged inside their thread-block cluster (grid.x =
// splits = the cluster size c, at most kClusterSplits; sm_90), with no workspace round trip and no
// combine kernel. The block's outputs (head j, dims 2 d2, 2 d2 + 1: `items` float2) are cut into c
// slices of `per`, rank r owning slice r. As the block merges its warps' partials (a thread merges
// 4 dims of a head, two outputs), the pair's merged o (unnormalised) goes straight to its owner's
// inbox through distributed shared memory, in one 16-byte st.async where `per` is even (push_pair;
// else two, push_partial), and each head's (m in log2 units, l) to every rank. Each st.async counts
// its bytes on the owner's mbarrier, which expects them all (inbox_bytes, set before the block
// says it has started); once they have landed, a block merges its own slice from its own shared
// memory, in split order, and writes bf16 (merge_cluster): out = sum_r w_r o_r / sum_r w_r l_r,
// w_r = exp2(m_r - max m). An empty split sends o zeros and m = -inf (weight 0); all empty (length
// 0) gives zeros. No block reads another's shared memory and each waits for every byte written
// into it, so there is no cluster barrier after the start one. Measured in the step at batch 1
// (bench/RESULTS.md): generic stores and a cluster barrier (which compiles to a GPU-scope fence)
// cost 0.13 us a layer more than st.async at 1.5B (session 28);
// every block pulling all the splits' partials of its outputs after a barrier, then a second
// barrier, cost about 0.1 us a layer more (session 20), and the block's partial gathered in its own
// shared memory first and pushed in 16-byte stores after a block barrier 0.1-0.2 us more; one
// output a thread (8-byte stores) and one thread sending a head's (m, l) to all c ranks cost 0.16
// and 0.13 us a layer more than the pairs and c threads (session 27); each warp pushing its own
// partial to the owners (no block merge, 8x the stores) 2.4 us more.
template <int D>
struct ClusterInbox {
  float2 o[kHeadsPerBlock * D / 2 + kClusterSplits];  // [source rank][owned output]
  float2 ml[kClusterSplits][kHeadsPerBlock];          // [source rank][head]: (m, l)
  uint64_t full;  // c > 1: counts the bytes the ranks push in (inbox_bytes), one phase
};

struct ClusterSlice {
  int c, rank, per;  // cluster size, this block's rank, outputs a rank owns
  __device__ __forceinline__ ClusterSlice(int splits, int items) : c(splits), rank(0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // c = 1 (one split, launched without a cluster): the block's own shared memory.
    if (c > 1) rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
#endif
    per = (items + c - 1) / c;
  }
};

// v into `slot` of rank `owner`'s inbox, counted on that rank's mbarrier `full`; with c = 1 (no
// cluster) a plain store into this block's own shared memory.
template <typename T>
__device__ __forceinline__ void push_to(const ClusterSlice& cs, T* slot, int owner, T v, uint64_t* full) {
  if (cs.c == 1) {
    *slot = v;
  } else {
    st_async(cluster_addr(slot, owner), v, cluster_addr(full, owner));
  }
}

// Output `item` (head item / (D/2)) of this block's merged partial to its owner; a head's first
// output also sends the head's (m, l) to every rank.
template <int D>
__device__ __forceinline__ void push_partial(ClusterInbox<D>& inbox, const ClusterSlice& cs, int item,
                                             float2 o, float m, float l) {
  const int owner = item / cs.per;
  push_to(cs, &inbox.o[cs.rank * cs.per + item - owner * cs.per], owner, o, &inbox.full);
  if (item % (D / 2) == 0) {
    float2* ml = &inbox.ml[cs.rank][item / (D / 2)];
    for (int r = 0; r < cs.c; ++r) push_to(cs, ml, r, make_float2(m, l), &inbox.full);
  }
}

// The bytes push_pair / push_partial of the c ranks store into this block's inbox (what its
// mbarrier waits for): its slice of o from each rank, and each head's (m, l) from each rank.
template <int D>
__device__ __forceinline__ uint32_t inbox_bytes(const ClusterSlice& cs, int heads) {
  const int owned = max(0, min(cs.per, heads * (D / 2) - cs.rank * cs.per));
  return static_cast<uint32_t>(cs.c * (owned + heads) * 8);
}

// Outputs item and item + 1 (item even: dims 2d .. 2d + 3 of head item / (D/2), d = item % (D/2))
// to their owner in one 16-byte store where the slices have an even size (the pair then has one
// owner and an aligned slot), else in two (push_partial).
template <int D>
__device__ __forceinline__ void push_pair(ClusterInbox<D>& inbox, const ClusterSlice& cs, int item,
                                          float4 o, float m, float l) {
  static_assert(D / 4 >= kClusterSplits, "a head's pairs must cover every rank's (m, l) store");
  if (cs.per % 2 == 0) {
    const int owner = item / cs.per;
    float2* slot = &inbox.o[cs.rank * cs.per + item - owner * cs.per];
    push_to(cs, reinterpret_cast<float4*>(slot), owner, o, &inbox.full);
    // The head's (m, l) to every rank, one store a thread: the pair of dims 4r .. 4r + 3 to rank r
    // (each thread of a head holds the same m and l; a head has D / 4 >= c pairs).
    const int r = (item % (D / 2)) / 2;
    if (r < cs.c) push_to(cs, &inbox.ml[cs.rank][item / (D / 2)], r, make_float2(m, l), &inbox.full);
  } else {
    push_partial<D>(inbox, cs, item, make_float2(o.x, o.y), m, l);
    push_partial<D>(inbox, cs, item + 1, make_float2(o.z, o.w), m, l);
  }
}

template <int D>
__device__ __forceinline__ void merge_cluster(ClusterInbox<D>& inbox, const ClusterSlice& cs,
                                              __nv_bfloat16* out_rows, int heads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cs.c == 1) {
    __syncthreads();
  } else {
    mbar_wait_cluster(&inbox.full, 0);  // every byte of this block's slice has landed
  }
  const int c = cs.c;
  for (int k = threadIdx.x; k < cs.per; k += blockDim.x) {
    const int item = cs.rank * cs.per + k;
    if (item >= heads * (D / 2)) break;
    const int j = item / (D / 2), d2 = item % (D / 2);
    float m[kClusterSplits], l[kClusterSplits];
    float2 o[kClusterSplits];
#pragma unroll
    for (int r = 0; r < kClusterSplits; ++r) {
      const float2 ml = r < c ? inbox.ml[r][j] : make_float2(-INFINITY, 0.f);
      m[r] = ml.x;
      l[r] = ml.y;
      o[r] = r < c ? inbox.o[r * cs.per + k] : make_float2(0.f, 0.f);
    }
    float M = m[0];
#pragma unroll
    for (int r = 1; r < kClusterSplits; ++r) M = fmaxf(M, m[r]);
    float2 acc = make_float2(0.f, 0.f);
    float sum = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int r = 0; r < kClusterSplits; ++r) {
        const float wt = exp2f(m[r] - M);  // 0 for an empty split or r >= c
        acc.x += wt * o[r].x;
        acc.y += wt * o[r].y;
        sum += wt * l[r];
      }
      acc.x /= sum;
      acc.y /= sum;
    }
    *reinterpret_cast<__nv_bfloat162*>(out_rows + (int64_t)j * D + 2 * d2) =
        __floats2bfloat162_rn(acc.x, acc.y);
  }
#else
  __trap();  // the host never merges in a cluster below sm_90
#endif
}

// rope_append_attention's prologue (kRope): rope_append's work for what this block reads or writes,
// done by the block itself, with rope_append's arithmetic (so the op equals rope_append then
// decode_attention bit for bit). Work items are 8-pair slices (8 dims of each half of a head) of the
// block's query heads and, where the block reads row pos or appends it (kv), of k
// and v. rope_load issues the item's loads and the first of the rms_x row's; rope_prologue then
// (live rows) scales by 1/rms(rms_x row), adds
// the bias and rounds to bf16 (scale_bias_round8), norms q and k heads (q_norm / k_norm, Qwen3:
// head_rms_norm), rotates q and k, and puts q in sm_q and k, v in
// sm_kv (whence the tile holding row pos is patched); the appending block writes them to the
// caches' row pos. A row with no position (pos < 0) keeps its q as it is, as rope_append leaves it.
struct RopeLoads {
  bf16x8 a1 = {}, a2 = {};  // the item's two halves
  SquaresLoads sq;          // the first of the rms_x row's loads
};

// Item it of a block: a q head (which = 0, head hj of the block) or the k (1) or v (2) head kvh, and
// its first pair c0; items = q items + (kv ? 2 * D / 16 : 0).
template <int D>
struct RopeItem {
  int which, hj, c0, items;
  __device__ __forceinline__ RopeItem(int it, int heads, bool kv) {
    constexpr int kSlices = D / 16;
    const int q_items = heads * kSlices;
    items = q_items + (kv ? 2 * kSlices : 0);
    which = it < q_items ? 0 : (it - q_items) / kSlices + 1;
    hj = it < q_items ? it / kSlices : 0;
    c0 = (it % kSlices) * 8;
  }
};

template <int D>
__device__ __forceinline__ void rope_load(const AttnRope& rope, const __nv_bfloat16* q_row, int b,
                                          int kvh, int heads, bool kv, RopeLoads& l) {
  const RopeItem<D> item(threadIdx.x, heads, kv);  // kWarps * 32 >= 8 * 8 + 2 * 8 items at D = 128
  const __nv_bfloat16* src = item.which == 0 ? q_row + (int64_t)item.hj * D
                             : item.which == 1 ? rope.k + (int64_t)b * rope.k_bstride + (int64_t)kvh * D
                                               : rope.v + (int64_t)b * rope.v_bstride + (int64_t)kvh * D;
  if (static_cast<int>(threadIdx.x) < item.items) {
    l.a1 = *reinterpret_cast<const bf16x8*>(src + item.c0);
    l.a2 = *reinterpret_cast<const bf16x8*>(src + D / 2 + item.c0);
  }
  if (rope.rms_x != nullptr) load_squares(rope.rms_x + (int64_t)b * rope.x_bstride, rope.K, l.sq);
}

// The prologue's constant inputs, which no kernel of the decode step writes: the item's q_norm or
// k_norm slices (items as RopeItem with kv, the most a block has) and thread i's inv_freq[i] (i < D /
// 2, one angle a thread). Loaded before the PDL wait where the tiles are, so that after the wait the
// prologue waits for one memory round trip (q, k, v), not also for the norm weights after the sums
// of squares (0.3-0.5% of the Qwen3 steps on an H100: bench/RESULTS.md, session 40).
struct RopeConsts {
  bf16x8 w1 = {}, w2 = {};
  float inv_freq = 0.f;
};

template <int D>
__device__ __forceinline__ void rope_consts(const AttnRope& rope, int heads, RopeConsts& c) {
  const RopeItem<D> item(threadIdx.x, heads, true);
  if (rope.q_norm != nullptr && static_cast<int>(threadIdx.x) < item.items && item.which < 2) {
    const __nv_bfloat16* w = item.which == 0 ? rope.q_norm : rope.k_norm;
    c.w1 = *reinterpret_cast<const bf16x8*>(w + item.c0);
    c.w2 = *reinterpret_cast<const bf16x8*>(w + D / 2 + item.c0);
  }
  static_assert(D / 2 <= kWarps * 32, "one angle a thread");
  if (threadIdx.x < D / 2) c.inv_freq = rope.inv_freq[threadIdx.x];
}

template <int D>
__device__ __forceinline__ void rope_prologue(const AttnRope& rope, const RopeLoads& l,
                                              const RopeConsts& rc, __nv_bfloat16* k_cache_row,
                                              __nv_bfloat16* v_cache_row, int b, int kvh, int head0,
                                              int heads, int H, int Hkv, int pos, bool kv, bool append,
                                              __nv_bfloat16 (&sm_q)[kHeadsPerBlock][D],
                                              __nv_bfloat16 (&sm_kv)[2][D]) {
  __shared__ float cs[D];  // cos [D/2], then sin [D/2]
  __shared__ float scratch[32];
  const RopeItem<D> item(threadIdx.x, heads, kv);
  const bool scaled = rope.rms_x != nullptr;
  const float scale =
      scaled ? rms_inv(block_sum(sum_squares(rope.rms_x + (int64_t)b * rope.x_bstride, rope.K, l.sq),
                                 scratch),
                       rope.K, rope.rms_eps)
             : 1.f;
  if (pos >= 0 && threadIdx.x < D / 2) {
    float c, s;
    rope_cos_sin(pos, rc.inv_freq, c, s);
    cs[threadIdx.x] = c;
    cs[D / 2 + threadIdx.x] = s;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < item.items) {
    const int c0 = item.c0;
    bf16x8 r1 = l.a1, r2 = l.a2;  // q of a row with no position: as it is
    if (pos >= 0) {
      const int bias_head = item.which == 0 ? head0 + item.hj : item.which == 1 ? H + kvh : H + Hkv + kvh;
      const __nv_bfloat16* bias = rope.bias == nullptr ? nullptr : rope.bias + (int64_t)bias_head * D;
      float x1[8], x2[8];
      scale_bias_round8(l.a1, scaled, scale, bias == nullptr ? nullptr : bias + c0, x1);
      scale_bias_round8(l.a2, scaled, scale, bias == nullptr ? nullptr : bias + D / 2 + c0, x2);
      // Qwen3's head norms: a head's D / 16 items are aligned consecutive lanes, all here (items
      // come in whole heads, and pos is uniform).
      if (rope.q_norm != nullptr && item.which < 2) {
        head_rms_norm(x1, x2, rc.w1, rc.w2, D / 2, D / 16, rope.norm_eps);
      }
      if (item.which < 2) {
        float o1[8], o2[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) rope_rotate(x1[j], x2[j], cs[c0 + j], cs[D / 2 + c0 + j], o1[j], o2[j]);
        r1 = float_to_bf16x8(o1);
        r2 = float_to_bf16x8(o2);
      } else {
        r1 = float_to_bf16x8(x1);
        r2 = float_to_bf16x8(x2);
      }
    }
    __nv_bfloat16* dst = item.which == 0 ? sm_q[item.hj] : sm_kv[item.which - 1];
    *reinterpret_cast<bf16x8*>(dst + c0) = r1;
    *reinterpret_cast<bf16x8*>(dst + D / 2 + c0) = r2;
    if (item.which > 0 && append) {
      __nv_bfloat16* row = item.which == 1 ? k_cache_row : v_cache_row;
      *reinterpret_cast<bf16x8*>(row + c0) = r1;
      *reinterpret_cast<bf16x8*>(row + D / 2 + c0) = r2;
    }
  }
  __syncthreads();
}

// kRope: the lanes of a tile that hold row pos (token rel = pos - base of the tile) take its k and v
// from sm_kv instead of what the cache held when the tile was loaded.
template <int D>
__device__ __forceinline__ void patch_fresh_row(KVTile<D>& tile, int rel, int g, int t,
                                                const __nv_bfloat16 (&sm_kv)[2][D]) {
  if (rel < 0 || rel >= kTile) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (g + 8 * r == rel) {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) tile.k[r][c] = *reinterpret_cast<const uint4*>(&sm_kv[0][32 * c + 8 * t]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (2 * t + (i & 1) + 8 * (i >> 1) == rel) {
#pragma unroll
      for (int h = 0; h < D / 64; ++h) tile.v[i][h] = *reinterpret_cast<const uint4*>(&sm_kv[1][64 * h + 8 * g]);
    }
  }
}

// Phase 1: grid (splits, Hkv * head_blocks, B), kWarps warps. Block (split, kvh/hb, b) attends the
// query heads [8hb, 8hb + 8) of KV head kvh's group over tokens [split*chunk, +chunk) ∩ [0, len),
// chunk from the live length len
// and writes, per head, the unnormalised o[D], the running max m (log2 units) and the sum l.
// kRope (rope_append_attention): q, rope.k and rope.v are the unrotated product rows; the block
// first does rope_append's work for what it reads (rope_prologue) and the row positions[b] is taken
// from there, not from the cache; the block that owns that row appends it to the caches.
// kRing: the tiles come through the ring path (rope_append_attention above kRopeRegisterRows rows),
// else the register path.
template <int D, bool kRope, bool kRing, int W>
__global__ void __launch_bounds__(W * 32, 2 * kWarps / W) decode_attention_split_kernel(
    const __nv_bfloat16* __restrict__ q,        // [B, H, D], batch stride q_bstride
    const __nv_bfloat16* __restrict__ k_cache,  // [B, Hkv, S, D], batch stride k_bstride
    const __nv_bfloat16* __restrict__ v_cache,  // [B, Hkv, S, D], batch stride v_bstride
    const int* __restrict__ lengths,            // [B]
    float* __restrict__ workspace,              // [B, H, splits_cap, D + 2]
    __nv_bfloat16* __restrict__ out,            // [B, H, D]: written here when cluster_merge
    int64_t q_bstride, int64_t k_bstride, int64_t v_bstride, int H, int group, int head_blocks,
    int S, int splits, int splits_cap, float scale_log2, bool prefetch_cache, bool cluster_merge,
    const AttnRope rope) {
  // Without prefetch_cache nothing is read before the wait; with it, lengths and the cache rows
  // below lengths[b] - 1 are (the caller's promise: the kernel ahead writes neither); kRope: also
  // positions, every cache row (the kernel ahead writes no cache row; this one appends), inv_freq
  // and the q/k norm weights (rope_consts).
  if (!prefetch_cache) pdl_wait();

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / head_blocks, hb = blockIdx.y % head_blocks;
  const int b = blockIdx.z;
  const int heads = min(kHeadsPerBlock, group - kHeadsPerBlock * hb);  // live query heads here
  const int head0 = kvh * group + kHeadsPerBlock * hb;                 // first one, global index
  const int cluster = cluster_merge ? splits : 1;  // blocks of this block's cluster
  // The outputs this block merges when the cluster merges the splits (merge_cluster); its
  // mbarrier is ready before this block says it has started.
  __shared__ __align__(16) ClusterInbox<D> inbox;
  if (cluster > 1 && threadIdx.x == 0) {
    mbar_init(&inbox.full, 1);  // one arrival: the one below, with the byte count
    fence_mbar_init();
    // (The slice is made again where the pushes need it: one made here and held across the main
    // loop took 2-10 more registers in ptxas -v.)
    mbar_arrive_expect(&inbox.full, inbox_bytes<D>(ClusterSlice(cluster, heads * (D / 2)), heads));
  }
  cluster_started_arrive(cluster);
  const int len = min(max(lengths[b], 0), S);
  const int chunk = split_chunk(len, splits);
  const int start = split * chunk;
  const int end = min(start + chunk, len);
  // kRope: pos, the row appended (-1: none); fresh, that row if this block reads it (else -1); and
  // whether this block appends it (the block that reads it, or split 0 if none does; head block 0).
  int pos = -1;
  if constexpr (kRope) {
    const int p = rope.positions[b];
    pos = p >= 0 && p < S ? p : -1;
  }
  const int fresh = kRope && pos >= start && pos < end ? pos : -1;
  const bool append = kRope && pos >= 0 && hb == 0 && (pos < len ? fresh >= 0 : split == 0);
  const int64_t head_stride_ws = (int64_t)splits_cap * (D + 2);  // workspace: next head
  float* ws = workspace + ((int64_t)b * H + head0) * head_stride_ws + (int64_t)split * (D + 2);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* k_rows = k_cache + (int64_t)b * k_bstride + (int64_t)kvh * S * D;
  const __nv_bfloat16* v_rows = v_cache + (int64_t)b * v_bstride + (int64_t)kvh * S * D;

  // The first tiles (the header says why two paths): kRing, the ring path's first kStages copies;
  // otherwise the register path's first two tiles, one per buffer. With prefetch_cache they are
  // requested before the wait. Without kRope the register path leaves out row len - 1, which the
  // kernel ahead may be writing (the decode step's append), and loads a tile holding it again after
  // the wait; kRope patches row pos from the prologue instead (the kernel ahead writes no cache row).
  static_assert(!kRing || (kRope && W == kWarps),
                "the ring path is rope_append_attention's, with kWarps warps");
  constexpr int kStep = W * kTile;
  constexpr int kSlotBytes = kTileBytes<D>;
  extern __shared__ __align__(128) unsigned char ring_smem[];
  unsigned char* ring = ring_smem + warp * (kStages * kSlotBytes);
  const uint32_t ring_s = smem_u32(ring);
  int base = start + warp * kTile;
  KVTile<D> buf0, buf1;  // the register path's buffers
  if constexpr (kRing) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      const int tb = base + i * kStep;
      if (tb < end) copy_tile<D>(ring_s + i * kSlotBytes, k_rows, v_rows, tb, end, lane);
      cp_async_commit();
    }
  } else if (prefetch_cache && start < end) {
    const int old_end = kRope ? end : min(end, len - 1);
    load_tile<D>(buf0, k_rows, v_rows, base, old_end, g, t);
    load_tile<D>(buf1, k_rows, v_rows, base + kStep, old_end, g, t);
  }
  RopeConsts rope_c;
  if constexpr (kRope) rope_consts<D>(rope, heads, rope_c);
  pdl_begin();  // (the wait again is free) also lets the combine kernel launch; it waits for us

  __nv_bfloat16* out_rows = out + ((int64_t)b * H + head0) * D;

  // kRope: the block's q heads rotated, and row pos's k and v (block-uniform condition: the
  // prologue has barriers).
  __shared__ __align__(16) __nv_bfloat16 sm_q[kRope ? kHeadsPerBlock : 1][kRope ? D : 8];
  __shared__ __align__(16) __nv_bfloat16 sm_kv[2][kRope ? D : 8];
  // (The prologue's loads follow the cache's first tiles: measured faster in the step than the
  // other order, which must wait before the tiles; bench/RESULTS.md, session 11.)
  if constexpr (kRope) {
    if (start < end || append) {  // block-uniform (the prologue syncs)
      RopeLoads rope_loads;
      const bool kv = fresh >= 0 || append;  // the block needs row pos's k and v
      rope_load<D>(rope, q + (int64_t)b * q_bstride + (int64_t)head0 * D, b, kvh, heads, kv,
                   rope_loads);
      const int64_t cache_row = ((int64_t)kvh * S + max(pos, 0)) * D;
      rope_prologue<D>(rope, rope_loads, rope_c,
                       const_cast<__nv_bfloat16*>(k_cache) + (int64_t)b * k_bstride + cache_row,
                       const_cast<__nv_bfloat16*>(v_cache) + (int64_t)b * v_bstride + cache_row, b,
                       kvh, head0, heads, H, H / group, pos, kv, append, sm_q, sm_kv);
    }
  }

  if (start >= end) {  // nothing of this sequence in this split: an empty partial, no reads
    if (cluster_merge) {
      const ClusterSlice cs(cluster, heads * (D / 2));
      cluster_started_wait(cluster);
      for (int pair = threadIdx.x; pair < heads * (D / 4); pair += W * 32) {
        push_pair<D>(inbox, cs, 2 * pair, make_float4(0.f, 0.f, 0.f, 0.f), -INFINITY, 0.f);
      }
      merge_cluster<D>(inbox, cs, out_rows, heads);
    } else if (threadIdx.x < heads) {
      float* row = ws + threadIdx.x * head_stride_ws;
      row[D] = -INFINITY;
      row[D + 1] = 0.f;
    }
    return;
  }

  if constexpr (!kRing) {
    auto holds_last = [&](int tile_base) {
      return !kRope && tile_base <= len - 1 && len - 1 < tile_base + kTile;
    };
    if (!prefetch_cache || holds_last(base)) load_tile<D>(buf0, k_rows, v_rows, base, end, g, t);
    if (!prefetch_cache || holds_last(base + kStep)) {
      load_tile<D>(buf1, k_rows, v_rows, base + kStep, end, g, t);
    }
  }
  auto patch = [&](KVTile<D>& tile, int tile_base) {
    if constexpr (kRope) {
      if (fresh >= 0) patch_fresh_row<D>(tile, fresh - tile_base, g, t, sm_kv);
    }
  };

  // Q^T as the B operand, head dim permuted like K's: lane holds head g's dims [32c + 8t, +8).
  uint4 qf[D / 32];
  if constexpr (kRope) {
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      qf[c] = g < heads ? *reinterpret_cast<const uint4*>(&sm_q[g][32 * c + 8 * t]) : make_uint4(0, 0, 0, 0);
    }
  } else {
    const bool live = g < heads;
    const __nv_bfloat16* q_row = q + (int64_t)b * q_bstride + (int64_t)(head0 + (live ? g : 0)) * D;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) qf[c] = load16_stream(q_row + 32 * c + 8 * t, live);
  }

  // O^T accumulators: m-block (h, p) row g -> dim 64h + 8g + 2p, row g + 8 -> that dim + 1;
  // columns 2t, 2t+1 -> heads 2t, 2t+1. So o[h*4+p][0|2] is head 2t, o[h*4+p][1|3] head 2t+1.
  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of heads 2t, 2t+1 (log2 units)
  float l0 = 0.f, l1 = 0.f;              // this lane's share of their running sums

  if constexpr (kRing) {
    // Each tile: wait for its slot (the kStages - 1 later tiles' copies stay in flight), read it
    // into registers, refill the slot kStages tiles ahead, then compute.
    for (int slot = 0; base < end; base += kStep, slot = slot + 1 == kStages ? 0 : slot + 1) {
      cp_async_wait<kStages - 1>();
      __syncwarp();  // every lane's copies into the slot are visible to the warp
      KVTile<D> tile;
      read_tile<D>(tile, ring_s + slot * kSlotBytes, g, t);
      __syncwarp();  // every lane has read the slot before it is refilled
      const int next = base + kStages * kStep;
      if (next < end) copy_tile<D>(ring_s + slot * kSlotBytes, k_rows, v_rows, next, end, lane);
      cp_async_commit();
      patch(tile, base);
      attend_tile<D>(tile, qf, base, end, g, scale_log2, o, m0, m1, l0, l1);
    }
    cp_async_wait<0>();  // (nothing is in flight past the last tile; the ring is reused below)
  } else {
    // Consume one buffer while the other's loads are in flight, then refill it two tiles ahead
    // (written out twice rather than copied, so the buffers stay in registers).
    // kRope: row pos patched into its tile just before the tile is used.
    while (base < end) {
      patch(buf0, base);
      attend_tile<D>(buf0, qf, base, end, g, scale_log2, o, m0, m1, l0, l1);
      base += kStep;
      if (base >= end) break;
      load_tile<D>(buf0, k_rows, v_rows, base + kStep, end, g, t);
      patch(buf1, base);
      attend_tile<D>(buf1, qf, base, end, g, scale_log2, o, m0, m1, l0, l1);
      base += kStep;
      if (base >= end) break;
      load_tile<D>(buf1, k_rows, v_rows, base + kStep, end, g, t);
    }
  }
  // The lane's share of l -> the whole warp's (m is already the same on the 8 lanes of a t).
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }

  // Merge the warps: each puts (m, l, o) per head in shared memory (the ring path: o in the warp's
  // own ring).
  __shared__ float sm_m[W][kHeadsPerBlock], sm_l[W][kHeadsPerBlock];
  // The register path's o (a token array in the ring path, which never uses it).
  __shared__ __align__(16) float sm_o_regs[kRing ? 1 : W][kHeadsPerBlock][kRing ? 4 : D];
  static_assert(kHeadsPerBlock * D * 4 <= kStages * kSlotBytes, "a warp's o must fit its ring");
  auto sm_o = [&](int w) -> float (*)[D] {
    if constexpr (kRing) {
      return reinterpret_cast<float (*)[D]>(ring_smem + w * (kStages * kSlotBytes));
    } else {
      return sm_o_regs[w];
    }
  };
  __syncwarp();
  if (g == 0) {
    sm_m[warp][2 * t] = m0;
    sm_m[warp][2 * t + 1] = m1;
    sm_l[warp][2 * t] = l0;
    sm_l[warp][2 * t + 1] = l1;
  }
#pragma unroll
  for (int h = 0; h < D / 64; ++h) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int dim = 64 * h + 8 * g + 2 * p;
      const float* a = o[h * 4 + p];
      *reinterpret_cast<float2*>(&sm_o(warp)[2 * t][dim]) = make_float2(a[0], a[2]);
      *reinterpret_cast<float2*>(&sm_o(warp)[2 * t + 1][dim]) = make_float2(a[1], a[3]);
    }
  }
  __syncthreads();

  const ClusterSlice cs(cluster, heads * (D / 2));  // (cluster_merge only)
  cluster_started_wait(cluster);
  // A warp with no tile has m = -inf, l = 0, o = 0: weight exp2(-inf) = 0. Warp 0 always has one
  // (its first tile starts at `start` < end), so the block max M is finite.
  // A thread merges 4 dims of a head (outputs 2 pair, 2 pair + 1).
  for (int pair = threadIdx.x; pair < heads * (D / 4); pair += W * 32) {
    const int j = pair / (D / 4), d4 = pair % (D / 4);
    float M = sm_m[0][j];
#pragma unroll
    for (int w = 1; w < W; ++w) M = fmaxf(M, sm_m[w][j]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wt = exp2f(sm_m[w][j] - M);
      const float4 v = *reinterpret_cast<const float4*>(&sm_o(w)[j][4 * d4]);
      acc.x += wt * v.x;
      acc.y += wt * v.y;
      acc.z += wt * v.z;
      acc.w += wt * v.w;
      l += wt * sm_l[w][j];
    }
    if (cluster_merge) {
      push_pair<D>(inbox, cs, 2 * pair, acc, M, l);
    } else {  // (workspace rows are D + 2 floats: 8-byte aligned)
      float* row = ws + j * head_stride_ws;
      *reinterpret_cast<float2*>(row + 4 * d4) = make_float2(acc.x, acc.y);
      *reinterpret_cast<float2*>(row + 4 * d4 + 2) = make_float2(acc.z, acc.w);
      if (d4 == 0) *reinterpret_cast<float2*>(row + D) = make_float2(M, l);
    }
  }
  if (cluster_merge) merge_cluster<D>(inbox, cs, out_rows, heads);
}

// Phase 2: grid (H, B), W warps (blockDim 32 * W, W = combine_warps(splits) in 1..8). Block
// (head, b) writes out[b, head] = sum_s w_s o_s / sum_s w_s l_s, w_s = exp2(m_s - max m). Warp w
// takes the splits w, w + W, w + 2W, ... in chunks of 32: lane j loads (m, l) of the chunk's j-th
// split and, in the same round trip, the chunk's o rows are loaded kBatch at a time (the live
// splits are known from the length, so these loads wait for nothing); the chunk max (shuffles)
// rescales the warp's running (M, l, o) online and the rows are summed in order, each split's
// weight broadcast from its lane. kBatch (combine_batch) is 32 where a warp has more than 8
// splits, so that a chunk is one L2 round trip (8 at a time, the 32K cache's 17 splits a warp took
// three: 2 us more at 32K, bench/RESULTS.md, session 6), and 8 otherwise, where 8 rows already are
// one round trip and the kernel needs 72 registers a thread rather than 191. A lane owns dims
// 2 lane + 64 i as float2: a partial is D + 2 floats, so rows are 8-byte aligned, not 16, and each
// float2 load of a row is one coalesced 256-byte access.
// Empty splits (m = -inf) get weight 0 and their o (never written) is not loaded. The warps' states
// then merge through shared memory with one barrier (none when W = 1), and warp 0 writes bf16; all
// splits empty (length 0) -> zeros. The summation order depends only on splits: deterministic.
template <int D, int kBatch>
__global__ void __launch_bounds__(kCombineMaxWarps * 32) decode_attention_combine_kernel(
    const float* __restrict__ workspace,  // [B, H, splits_cap, D + 2]
    const int* __restrict__ lengths,      // [B]
    __nv_bfloat16* __restrict__ out,      // [B, H, D]
    int H, int S, int splits, int splits_cap) {
  constexpr int kRow = D + 2;     // floats per partial: o[D], m, l
  constexpr int kPairs = D / 64;  // float2 of o per lane
  __shared__ float sm_m[kCombineMaxWarps], sm_l[kCombineMaxWarps];
  __shared__ float2 sm_o[kCombineMaxWarps][D / 2];

  const int head = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const float* part = workspace + ((int64_t)b * H + head) * splits_cap * kRow;
  // The non-empty splits are a prefix, [0, live): known from the length (read before the wait:
  // the split kernel ahead never writes it), so each chunk's o rows load with its (m, l), in one
  // round trip, rather than after them.
  const int len = min(max(lengths[b], 0), S);
  const int chunk = split_chunk(len, splits);
  const int live = min(splits, (len + chunk - 1) / chunk);
  pdl_begin();  // phase 1 complete and visible

  float M = -INFINITY;  // max m over the warp's chunks so far (log2 units)
  float l = 0.f;        // lane j's share of the running sum: the j-th split of each chunk
  float2 acc[kPairs];   // running sum of w_s o_s over the warp's splits, dims 2 lane + 64 i
#pragma unroll
  for (int i = 0; i < kPairs; ++i) acc[i] = make_float2(0.f, 0.f);

  // A batch of the chunk's o rows, loaded together (zeros for an empty split: never written),
  // then summed in split order, each split's weight broadcast from its lane.
  float2 o[kBatch][kPairs];
  auto load_batch = [&](int first, int j0) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int sk = first + W * (j0 + k);
      const float* row = part + (int64_t)sk * kRow + 2 * lane;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        o[k][i] = sk < live ? *reinterpret_cast<const float2*>(row + 64 * i) : make_float2(0.f, 0.f);
      }
    }
  };
  auto add_batch = [&](float w, int j0) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const float wj = __shfl_sync(0xffffffffu, w, j0 + k);
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        acc[i].x += wj * o[k][i].x;
        acc[i].y += wj * o[k][i].y;
      }
    }
  };

  // Chunk: splits first + W j, j < 32. A chunk at or past `live` is empty, and so are the later
  // ones; otherwise its first split is live, so the chunk max is finite.
  for (int first = warp; first < live; first += 32 * W) {
    const int s = first + W * lane;
    load_batch(first, 0);
    const float2 ml = s < live ? *reinterpret_cast<const float2*>(part + (int64_t)s * kRow + D)
                               : make_float2(-INFINITY, 0.f);
    const float chunk_max = warp_reduce(ml.x, Max{});
    const float M_new = fmaxf(M, chunk_max);
    const float corr = exp2f(M - M_new);  // 0 on the warp's first chunk (M = -inf)
    const float w = exp2f(ml.x - M_new);  // 0 for an empty split and for s >= splits
    M = M_new;
    l = l * corr + w * ml.y;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      acc[i].x *= corr;
      acc[i].y *= corr;
    }
    add_batch(w, 0);
    const int n = min(32, (splits - first + W - 1) / W);  // splits in this chunk: lanes j < n
    for (int j0 = kBatch; j0 < n; j0 += kBatch) {
      load_batch(first, j0);
      add_batch(w, j0);
    }
  }
  l = warp_reduce(l, Sum{});

  // Merge the warps (a warp with no live split has M = -inf, l = 0, acc = 0: weight 0).
  if (W > 1) {
    if (lane == 0) {
      sm_m[warp] = M;
      sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < kPairs; ++i) sm_o[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    M = sm_m[0];
    for (int v = 1; v < W; ++v) M = fmaxf(M, sm_m[v]);
    if (M != -INFINITY) {
      l = 0.f;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) acc[i] = make_float2(0.f, 0.f);
      for (int v = 0; v < W; ++v) {
        const float wt = exp2f(sm_m[v] - M);
        l += wt * sm_l[v];
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const float2 x = sm_o[v][lane + 32 * i];
          acc[i].x += wt * x.x;
          acc[i].y += wt * x.y;
        }
      }
    }
  }

  __nv_bfloat16* out_row = out + ((int64_t)b * H + head) * D;
  const bool empty = M == -INFINITY;  // length 0: every split empty
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float x = empty ? 0.f : acc[i].x / l, y = empty ? 0.f : acc[i].y / l;
    *reinterpret_cast<__nv_bfloat162*>(out_row + 2 * lane + 64 * i) = __floats2bfloat162_rn(x, y);
  }
}

// Warps of the combine block: one per kCombineSplitsPerWarp splits, 1 to kCombineMaxWarps. A
// pure function of splits, so a captured graph's launch stays valid.
int combine_warps(int64_t splits) {
  return static_cast<int>(std::clamp<int64_t>(
      (splits + kCombineSplitsPerWarp - 1) / kCombineSplitsPerWarp, 1, kCombineMaxWarps));
}

// o rows a combine warp keeps in flight: all of a warp's splits (up to a chunk of 32) at once.
int combine_batch(int64_t splits) {
  const int64_t w = combine_warps(splits);
  return (splits + w - 1) / w <= 8 ? 8 : 32;
}

// Splits of kMinSplitTokens that a cache of this capacity holds (the last one partial).
constexpr int64_t min_length_splits(int64_t capacity) {
  return (capacity + kMinSplitTokens - 1) / kMinSplitTokens;
}

// Whether the split blocks are "wide": 8 warps (6 at head dim 128: split_warps), one block an SM,
// rather than 4 warps, two an SM (as many warps an SM or fewer, each with two 16-token tiles of
// loads in flight, and half the splits for the combine). Wide where one block
// an SM still gives every (b, KV head) pair kWideMinSplits splits or more (at most 4 pairs on 132
// SMs) and the cache is long enough for them to fill that wave (at least as many minimum-length
// splits); shorter caches keep their splits and 4-warp blocks. Measured in the step on an H100
// (bench/RESULTS.md, session 46), against 4-warp blocks: Qwen2.5-1.5B 1.8% faster at 32K and 1.2%
// at 16K (batch 1), 0.4% at 32K (batch 2); Qwen2.5-7B 0.2-0.3% at 8K to 32K. Left out, as
// measured: 8 pairs (Qwen3-1.7B at batch 1, 16 wide splits, 0.4-0.7% slower; the Qwen2.5s at
// batches 2-4 0.4-0.5% faster), 8 warps on a short cache's splits (the 1.5B at 4K, 68 blocks, 1.2%
// slower; the op alone at 8K 11% slower). DECODEX_ATTN_WIDE=0 never takes them (tests and A/B runs;
// read per call, like the other switches, so set it before sizing a workspace with
// decode_attention_splits); =1 or unset, this rule; another value is an error.
bool wide_split_blocks(int64_t pairs, int64_t capacity, int64_t sm_count) {
  if (env_switch("DECODEX_ATTN_WIDE", "0", "1") == false) return false;
  const int64_t fill = sm_count / pairs;
  return fill >= kWideMinSplits && min_length_splits(capacity) >= fill;
}

}  // namespace

// Splits from the cache capacity, never the live length (so a captured graph stays valid): as many
// as fit B * Hkv * splits split blocks in one resident wave (one wide block an SM where
// wide_split_blocks says so, else kSplitBlocksPerSm 4-warp blocks), but no split shorter than
// kMinSplitTokens (2 tiles per warp of a 4-warp block) so short caches are not cut into slivers
// whose partials cost more than they save; a short cache whose minimum-length splits number 9 to 16
// takes 8, so that its splits can merge in one cluster. Monotone non-decreasing in capacity;
// non-increasing in batch and KV heads on either side of the wide blocks' bound (at 132 SMs on a
// long cache: 33 splits at 4 pairs, 52 at 5); 1 once the (b, kv head) pairs alone fill the GPU.
int64_t decode_attention_splits(int64_t batch, int64_t num_kv_heads, int64_t capacity,
                                int64_t sm_count) {
  DX_CHECK(batch >= 1, "decode_attention_splits: batch must be >= 1, got ", batch);
  DX_CHECK(num_kv_heads >= 1, "decode_attention_splits: num_kv_heads must be >= 1, got ",
              num_kv_heads);
  DX_CHECK(capacity >= 0, "decode_attention_splits: capacity must be >= 0, got ", capacity);
  DX_CHECK(sm_count >= 1, "decode_attention_splits: sm_count must be >= 1, got ", sm_count);
  // Bounds that keep the products and sums below in int64 (no real GPU comes near them).
  DX_CHECK(batch <= 0x7fffffff && num_kv_heads <= 0x7fffffff && capacity <= 0x7fffffff &&
               sm_count <= 0x7fffffff,
           "decode_attention_splits: batch, num_kv_heads, capacity and sm_count must be < 2^31, got ",
           batch, ", ", num_kv_heads, ", ", capacity, ", ", sm_count);
  const int64_t pairs = batch * num_kv_heads;
  // Rounded down: one wave (group <= 8).
  const int64_t fill = wide_split_blocks(pairs, capacity, sm_count)
                           ? sm_count / pairs
                           : sm_count * kSplitBlocksPerSm / pairs;
  const int64_t by_length = min_length_splits(capacity);
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>({fill, by_length, kMaxSplits}));
  // A short cache (at most 2 kClusterSplits minimum-length splits) takes kClusterSplits, so that
  // its splits merge inside one cluster, with no combine kernel.
  return splits > kClusterSplits && by_length <= 2 * kClusterSplits ? kClusterSplits : splits;
}

namespace {
// The splits merge in their cluster (no workspace round trip, no combine kernel) where there are
// at most kClusterSplits of them, the device has clusters (sm_90), and either the clusters are
// pairs or the grid fills at most half of the one resident wave. Measured in the decode step
// (bench/RESULTS.md, session 10): clusters of 4 and 8 in a full wave (256 blocks) lost to the
// combine, up to 75 us a step (1.5B at 16 and 32 rows); pairs and small grids gained 20-100 us.
// DECODEX_ATTN_CLUSTER=1 merges in the cluster wherever it can, =0 never (tests and A/B runs;
// read per call; another value is an error).
bool merge_in_cluster(int64_t splits, int64_t blocks, int device) {
  if (splits > kClusterSplits || device_attribute<cudaDevAttrComputeCapabilityMajor>(device) < 9) {
    return false;
  }
  return env_switch("DECODEX_ATTN_CLUSTER", "0", "1")
      .value_or(splits <= 2 || blocks <= sm_count(device));
}

// Warps a block of the register path's split kernel: 8 where the splits merge in their cluster and
// the grid fills at most a quarter of the SMs (batch 1 and 2 on short caches), or where they take
// the combine and the blocks are wide (wide_split_blocks: one an SM), else 4 (two blocks an SM).
// With 8 warps, a split of 9 tiles (a 1025-token length over 8 splits) leaves no warp a third tile,
// whose loads could not be issued before the wait, and a tile's arithmetic overlaps another warp's
// on each scheduler. But a block of 8 warps (54K registers) can only become resident once the
// kernel ahead has left that much of an SM, so over many SMs its first loads start late: measured
// in the step (bench/RESULTS.md, session 20), 8 warps in clusters gained 0.5-1% at batch 1 (16 and
// 32 blocks) and lost 6% at batch 8 (128 blocks). Two exceptions take kMidWarps = 6 (measured in
// the step on an H100, bench/RESULTS.md, session 56):
//  - wide blocks of head dim 128: 8 such warps hold 55K of an SM's 64K registers (212 a thread),
//    and a block of the qkv GEMV ahead (6 warps of 96 registers, 18K) leaves no room for them until
//    it exits, while 6 (41K) become resident beside it and start their loads. Against 8: Qwen2.5-1.5B
//    0.3-0.4% faster at 32K, 0.6-1.6% at 8-16K; Qwen3-30B-A3B 0.1-0.5% at 32K, 1.5-1.8% at 8K;
//    Qwen2.5-3B and -7B within 0.4%. At head dim 64 (130 registers) 8 warps fit beside the GEMV,
//    and 6 made Qwen2.5-0.5B 2.7% slower at 32K;
//  - grids of two blocks an SM at head dim 64: two 6-warp blocks (26K each) still fit an SM, 12
//    warps of loads instead of 8. Against 4: Llama-3.2-1B (8 KV heads) 1.1-2.4% faster at 4-32K, and
//    1.2-1.5% at batch 4; Qwen2.5-0.5B 0.7-1.9% at batch 4. Where such a grid has one block an SM
//    or fewer (Qwen2.5-0.5B at 4K, 68 blocks) 6 warps were 1.3% slower, and at head dim 128 two
//    6-warp blocks do not fit an SM (Qwen3-1.7B and -8B, Llama-3.1-8B up to 3.5% slower).
// The clusters keep theirs (6 warps 0.2-0.7% slower at 1.5B, 1K). DECODEX_ATTN_WARPS=4, 6 or 8
// forces it (tests and A/B runs; read per call; another value is an error).
constexpr int kMidWarps = 6;
int split_warps(bool in_cluster, bool wide, int64_t blocks, int64_t D, int device) {
  if (const char* env = std::getenv("DECODEX_ATTN_WARPS"); env != nullptr && *env != '\0') {
    const std::string v(env);
    DX_CHECK(v == "4" || v == "6" || v == "8",
             "DECODEX_ATTN_WARPS must be 4, 6 or 8 (or unset), got \"", v, "\"");
    return v[0] - '0';
  }
  if (in_cluster) return 4 * blocks <= sm_count(device) ? 2 * kWarps : kWarps;
  if (wide) return D == 128 ? kMidWarps : 2 * kWarps;
  return D == 64 && blocks > sm_count(device) ? kMidWarps : kWarps;
}

// The register path's split kernel with `warps` warps (split_warps), with rope_append's prologue
// (kRope) or without.
template <int D, bool kRope>
auto* register_split_kernel(int warps) {
  return warps == 2 * kWarps ? decode_attention_split_kernel<D, kRope, false, 2 * kWarps>
         : warps == kMidWarps ? decode_attention_split_kernel<D, kRope, false, kMidWarps>
                              : decode_attention_split_kernel<D, kRope, false, kWarps>;
}

}  // namespace

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& lengths, double scale, at::Tensor& workspace,
                      at::Tensor& out, bool prefetch_cache) {
  // Other blocks still read q while a finished one writes out (rope_append_attention checks its
  // q, k and v itself).
  DX_CHECK(!spans_overlap(q, out), "decode_attention: out must not overlap q");
  launch_decode_attention("decode_attention", q, k_cache, v_cache, lengths, scale, workspace, out,
                          prefetch_cache, nullptr);
}

void launch_decode_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& lengths, double scale,
                             at::Tensor& workspace, at::Tensor& out, bool prefetch_cache,
                             const AttnRope* rope) {
  DX_CHECK_CUDA(q);
  DX_CHECK_CUDA(k_cache);
  DX_CHECK_CUDA(v_cache);
  DX_CHECK_CUDA(lengths);
  DX_CHECK_CUDA(workspace);
  DX_CHECK_CUDA(out);
  DX_CHECK_SAME_DEVICE(q, k_cache);
  DX_CHECK_SAME_DEVICE(q, v_cache);
  DX_CHECK_SAME_DEVICE(q, lengths);
  DX_CHECK_SAME_DEVICE(q, workspace);
  DX_CHECK_SAME_DEVICE(q, out);
  DX_CHECK_DTYPE(q, at::kBFloat16);
  DX_CHECK_DTYPE(k_cache, at::kBFloat16);
  DX_CHECK_DTYPE(v_cache, at::kBFloat16);
  DX_CHECK_DTYPE(lengths, at::kInt);
  DX_CHECK_DTYPE(workspace, at::kFloat);
  DX_CHECK_DTYPE(out, at::kBFloat16);
  DX_CHECK_DIM(q, 3);
  DX_CHECK_DIM(k_cache, 4);
  DX_CHECK_DIM(v_cache, 4);
  DX_CHECK_DIM(lengths, 1);
  DX_CHECK_DIM(workspace, 4);

  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  DX_CHECK(D == 64 || D == 128, op, ": head dim D = ", D,
              " (q.size(2)) is not supported (supported: 64, 128)");
  DX_CHECK(k_cache.size(0) == B && k_cache.size(3) == D,
              "k_cache must have shape [B, Hkv, S, D] with B = ", B, " and D = ", D, " (from q), got ",
              k_cache.sizes());
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  DX_CHECK_SHAPE(v_cache, B, Hkv, S, D);
  DX_CHECK(Hkv >= 1 && H % Hkv == 0, op, ": the query heads H = ", H,
              " (q.size(1)) must be a multiple of the KV heads Hkv = ", Hkv, " (k_cache.size(1))");
  DX_CHECK_SHAPE(lengths, B);
  DX_CHECK_SHAPE(out, B, H, D);
  DX_CHECK_CONTIGUOUS(lengths);
  DX_CHECK_CONTIGUOUS(out);
  DX_CHECK_CONTIGUOUS(workspace);
  DX_CHECK(S < (int64_t(1) << 30) && B <= 65535 && Hkv * ((H / Hkv + 7) / 8) <= 65535,
              op, ": sizes too large for the launch grid");

  // q rows and the cache's [Hkv, S, D] must be dense; batch strides are free (0 included) but
  // must keep rows 16-byte aligned. Strides of size-1 dims are never used, so not checked.
  auto stride_ok = [](const at::Tensor& t, int dim, int64_t want) {
    return t.size(dim) <= 1 || t.stride(dim) == want;
  };
  DX_CHECK(stride_ok(q, 2, 1) && stride_ok(q, 1, D) && (B <= 1 || q.stride(0) % 8 == 0),
              "q must have contiguous rows [H, D] and a batch stride that is a multiple of 8, got "
              "strides ", q.strides());
  DX_CHECK(stride_ok(k_cache, 3, 1) && stride_ok(k_cache, 2, D) && stride_ok(k_cache, 1, S * D) &&
                  (B <= 1 || (k_cache.stride(0) >= 0 && k_cache.stride(0) % 8 == 0)),
              "k_cache must be contiguous in its inner three dims [Hkv, S, D] with a batch stride "
              "that is a multiple of 8, got strides ", k_cache.strides());
  DX_CHECK(stride_ok(v_cache, 3, 1) && stride_ok(v_cache, 2, D) && stride_ok(v_cache, 1, S * D) &&
                  (B <= 1 || (v_cache.stride(0) >= 0 && v_cache.stride(0) % 8 == 0)),
              "v_cache must be contiguous in its inner three dims [Hkv, S, D] with a batch stride "
              "that is a multiple of 8, got strides ", v_cache.strides());
  DX_CHECK_ALIGNED16(q);
  DX_CHECK_ALIGNED16(k_cache);
  DX_CHECK_ALIGNED16(v_cache);
  DX_CHECK_ALIGNED16(workspace);
  DX_CHECK_ALIGNED16(out);
  DX_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  // A block writes out (the cluster merge, the combine) while others still read the workspace.
  DX_CHECK(!spans_overlap(workspace, out), op, ": workspace and out must not overlap");

  c10::cuda::CUDAGuard guard(q.device());
  const int sms = sm_count(q.get_device());
  const int64_t splits = decode_attention_splits(std::max<int64_t>(B, 1), Hkv, S, sms);
  DX_CHECK(workspace.size(0) == B && workspace.size(1) == H && workspace.size(3) == D + 2,
              "workspace must have shape [B, H, splits, D + 2] = [", B, ", ", H, ", >= ", splits,
              ", ", D + 2, "], got ", workspace.sizes());
  DX_CHECK(workspace.size(2) >= splits, "workspace has room for ", workspace.size(2),
              " splits (dim 2) but ", op, " uses ", splits,
              " for this batch, KV heads and cache capacity; size it with decode_attention_splits(",
              B, ", ", Hkv, ", ", S, ", sm_count)");
  if (B == 0 || H == 0) return;

  const int group = static_cast<int>(H / Hkv);
  const int head_blocks = (group + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const cudaStream_t stream = current_stream();
  const int64_t blocks = B * Hkv * head_blocks * splits;
  const bool in_cluster = merge_in_cluster(splits, blocks, q.get_device());
  // rope_append_attention takes the ring path above kRopeRegisterRows rows, always with kWarps warps.
  const bool ring = rope != nullptr && B > kRopeRegisterRows;
  const bool wide = wide_split_blocks(B * Hkv, S, sms);
  const int warps = ring ? kWarps : split_warps(in_cluster, wide, blocks, D, q.get_device());

  auto launch = [&](auto d_tag) {
    constexpr int kD = decltype(d_tag)::value;
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(Hkv * head_blocks),
                    static_cast<unsigned>(B));
    auto* kernel = ring ? decode_attention_split_kernel<kD, true, true, kWarps>
                   : rope != nullptr ? register_split_kernel<kD, true>(warps)
                                     : register_split_kernel<kD, false>(warps);
    const int smem = ring ? kRingBytes<kD> : 0;  // the ring path's ring
    if (smem > 0) allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, q.get_device(), op);
    cudaError_t err = launch_pdl_clusters(
        kernel, grid, dim3(warps * 32), static_cast<size_t>(smem), stream,
        in_cluster ? static_cast<unsigned>(splits) : 1u,
        reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(k_cache.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(v_cache.data_ptr()), lengths.data_ptr<int>(),
        workspace.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
        q.stride(0), k_cache.stride(0), v_cache.stride(0), static_cast<int>(H), group,
        head_blocks, static_cast<int>(S), static_cast<int>(splits),
        static_cast<int>(workspace.size(2)), scale_log2, prefetch_cache, in_cluster,
        rope != nullptr ? *rope : AttnRope{});
    DX_CHECK(err == cudaSuccess, "decodex::", op, " (split) kernel launch failed: ",
             cudaGetErrorString(err));
    DX_CHECK_LAUNCH("decode_attention (split)");
    if (in_cluster) return;

    // The combine may launch while the split kernel drains (programmatic dependent launch).
    err = launch_pdl(
        combine_batch(splits) == 8 ? decode_attention_combine_kernel<kD, 8>
                                   : decode_attention_combine_kernel<kD, 32>,
        dim3(static_cast<unsigned>(H), static_cast<unsigned>(B)), dim3(32 * combine_warps(splits)),
        0, stream, static_cast<const float*>(workspace.data_ptr<float>()),
        static_cast<const int*>(lengths.data_ptr<int>()),
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(H),
        static_cast<int>(S), static_cast<int>(splits), static_cast<int>(workspace.size(2)));
    DX_CHECK_LAUNCHED(err, "decode_attention (combine)");
    DX_CHECK_LAUNCH("decode_attention (combine)");
  };
  if (D == 64) {
    launch(std::integral_constant<int, 64>{});
  } else {
    launch(std::integral_constant<int, 128>{});
  }
}

}  // namespace decodex
