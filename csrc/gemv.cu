// decodex::gemv: out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N]) for decode batches M = 1..8 (the
// plain product up to 64, see Variants), and decodex::gemv_silu_mul, the same kernel with
// SiLU(gate) * up in its epilogue. The kernel and its launcher also serve gemv_rope_append
// (csrc/rope_append.cu) through gemv.h.
//
// The kernel and its idea: csrc/gemv_kernel.cuh.
// The host picks (wr, wk, c, U) per (N, K, M, kind of call) once per shape (cached): from tables of
// measured shapes (kTuned; kTunedRows for some at 2-4 rows; kTunedPlain for plain calls), else by
// a rule fitted to in-step sweeps up to 8 rows of x (rule_config), else (9-64 rows) with a small
// cost model of waves, bytes in flight and load latency.
// DECODEX_GEMV_CONFIG overrides the choice, for all shapes or per shape (a tuning knob for
// bench/gemv.py --sweep and bench/decode.py --sweep-gemv, not for the model).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "common.h"
#include "gemv.h"
#include "gemv_kernel.cuh"
#include "ops.h"

namespace decodex {
namespace {

using namespace gemv_detail;

// ---- host: configuration ----

struct GemvConfig {
  int wr, wk, c, u;  // tiles per block, k-ranges per block, blocks per cluster, unroll
};

// Resident blocks per SM of the (M, U) kernel at `warps` warps per block; asked once, cached. It
// asks about the c = 1 instance also for clusters, whose instances may hold more registers (M = 1,
// U = 4: 94 against 80): an estimate for the cost model and the first wave's L2 prefetch.
int blocks_per_sm(int m, int u, int warps) {
  // Per kernel M: 1..8, then 16, 24, ..., 64 (slots 8..14). Zero-initialized: 0 = not asked yet.
  static std::atomic<int> cache[kMaxRows + kMaxRowsWide / 8 - 1][2][kMaxWarps + 1];
  const int km = kernel_rows(m);
  return cached_blocks_per_sm(cache[km <= kMaxRows ? km - 1 : kMaxRows + km / 8 - 2][u == 8][warps],
                              reinterpret_cast<const void*>(kernel_for<false>(m, u, GemvEpilogue::kStore, false)),
                              warps * 32, "gemv");
}

// Estimated microseconds of one call. The kernel is a stream of blocks, each doing
// ceil(S/U) rounds of loads (S = k-steps per warp); a wave of resident blocks moves its bytes at
// the smallest of the HBM bandwidth, what its loads in flight sustain (with a 1.5x margin over one
// round trip: latency grows under load), and what its SMs can each pull, but no faster than its
// rounds of latency. Crude on purpose: it only has to rank configurations.
double estimate_us(int64_t N, int64_t K, int M, int sms, const GemvConfig& cf, int bps) {
  constexpr double kHbmBytesPerUs = 4.0e6;  // ~4.0 TB/s reachable of the H200's ~4.26
  constexpr double kSmBytesPerUs = 4.0e4;   // ~40 GB/s that one SM surely pulls (~1.2x its share)
  constexpr double kRoundTripUs = 0.9;      // issue to use of a round of loads, under load
  constexpr double kClusterUs = 0.15;       // two cluster barriers + DSMEM reads
  const int64_t tiles = ceil_div(N, kTileRows), ksteps = ceil_div(K, kStepK);
  const int64_t parts = static_cast<int64_t>(cf.wk) * cf.c;
  if (parts > ksteps || bps <= 0) return std::numeric_limits<double>::infinity();
  const int64_t steps = ceil_div(ksteps, parts), rounds = ceil_div(steps, cf.u);
  const int64_t groups = ceil_div(tiles, cf.wr), blocks = groups * cf.c;
  const int64_t resident = static_cast<int64_t>(bps) * sms;
  // Weight bytes, plus x re-read by every block group (L2 hits: counted at a quarter).
  const double bytes = 2.0 * N * K + 0.25 * 2.0 * groups * M * K;
  const double block_bytes = bytes / blocks;
  const double block_inflight = 1024.0 * cf.wr * cf.wk * std::min<int64_t>(steps, cf.u);
  auto wave_us = [&](int64_t nb) {
    const double active_sms = static_cast<double>(std::min<int64_t>(nb, sms));
    const double bw = std::min({kHbmBytesPerUs, nb * block_inflight / (1.5 * kRoundTripUs),
                                active_sms * kSmBytesPerUs});
    return std::max(rounds * kRoundTripUs, nb * block_bytes / bw);
  };
  const int64_t full = blocks / resident, rest = blocks % resident;
  return full * wave_us(resident) + (rest ? wave_us(rest) : 0.0) + (cf.c > 1 ? kClusterUs : 0.0);
}

// Configurations measured fastest on the H200 for the Qwen2.5-1.5B and -7B shapes, one per range of
// M: 1..4 (kTunedRows below overrides some at 2..4), 5..8, then the wide variants 9..16, 17..32,
// 33..64 (an entry of zeros, kModel: choose_config's rule or cost model). Up to 8 rows they were
// chosen inside the decode step, as `python -m bench.decode --sweep-gemv` does: each shape's
// configurations forced in turn through DECODEX_GEMV_CONFIG, the step's graph replays timed
// (2026-12-01, with a scratch copy of that sweep; bench/RESULTS.md, session 7). The kernel ahead
// and programmatic dependent launch change what is best: for example the 1.5B down projection gains
// from cluster split-K (192 blocks instead of 96) in the step; alone it gains only with
// prefetch_weight (plain calls lose). The 7B q/o M <= 4 entry is from the sweep of session 24 (U =
// 8 over U = 4: the step 0.7% faster at 1K, 0.2-0.9% at 32K and batches 2 and 4); with the cluster
// push that session, clusters of 4 won the 1.5B down and o projections at 1K (0.3-0.45%) but lost
// 0.4% at 32K each, so those entries stay. The 7B down M <= 4 entry is from the sweep of session
// 25, after the c = 1 instances lost their cluster code (their registers fell, the old (1,8,1,4)
// went from 2 to 3 blocks an SM, and the step took 1% longer; (2,4,2,8) is 2.1% faster than it);
// after the split-K push moved to st.async (session 28) the in-step sweep at batch 1 picked
// (1,5,8,8), 0.8% faster in the 7B step at 1K than (2,4,2,8) and 0.6% at 32K (batches 2 to 4 share
// the entry: session 45's sweep at batch 4 found none better). The wide ones are the best of
// `python -m bench.gemv --sweep --ms 16,32,64` (L2-cold, prefetch_weight; session 9), where the
// cost model, which sees no x traffic, was up to 2.7x slower. The entries after those were swept
// inside the steps of their models on an H100 (sessions 41-45), except the 8B ones chosen alone
// (see there); the in-step sweeps took 2-13% off steps that had run on the cost model's choices.
// Other shapes use rule_config up to kMaxRows rows of x and the cost model above.
struct TunedShape {
  int64_t N, K;
  GemvConfig m1, m8, m16, m32, m64;
};
constexpr GemvConfig kModel{0, 0, 0, 0};
constexpr bool is_model(const GemvConfig& cf) {  // an entry that leaves the shape to rule or model
  return cf.wr == 0 && cf.wk == 0 && cf.c == 0 && cf.u == 0;
}
constexpr TunedShape kTuned[] = {
    // Qwen2.5-1.5B
    {1536, 1536, {1, 6, 1, 8}, {1, 7, 1, 4}, {1, 8, 1, 8}, {1, 6, 2, 4}, {1, 6, 2, 4}},  // q, o
    {256, 1536, {1, 6, 1, 8}, {1, 6, 1, 8}, kModel, kModel, kModel},                     // k, v
    {2048, 1536, {1, 6, 1, 8}, {1, 6, 1, 8}, {1, 7, 1, 8}, {1, 6, 2, 4}, {1, 6, 2, 4}},  // qkv
    {17920, 1536, {1, 2, 1, 4}, {1, 2, 1, 4}, {1, 3, 1, 4}, {1, 3, 1, 4}, {1, 3, 1, 4}}, // gate|up
    {1536, 8960, {1, 7, 2, 8}, {1, 7, 2, 8}, {1, 7, 2, 4}, {1, 6, 2, 8}, {1, 7, 2, 4}},  // down
    {151936, 1536, {1, 7, 1, 8}, {1, 6, 1, 8}, {2, 2, 1, 4}, {2, 2, 1, 4}, {2, 2, 1, 4}},  // lm_head
    // Qwen2.5-7B
    {3584, 3584, {1, 7, 1, 8}, {1, 7, 1, 4}, {1, 7, 1, 4}, {1, 7, 1, 4}, {1, 7, 1, 4}},  // q, o
    {512, 3584, {1, 7, 2, 8}, {1, 7, 2, 8}, kModel, kModel, kModel},                     // k, v
    {4608, 3584, {1, 5, 1, 8}, {1, 4, 2, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}},  // qkv
    {37888, 3584, {1, 8, 1, 8}, {1, 4, 1, 4}, {1, 4, 1, 4}, {1, 3, 1, 4}, {1, 4, 1, 4}}, // gate|up
    {3584, 18944, {1, 5, 8, 8}, {1, 2, 4, 4}, {4, 2, 4, 4}, {2, 2, 4, 4}, {1, 4, 2, 4}}, // down
    {152064, 3584, {1, 5, 1, 8}, {1, 8, 1, 8}, {2, 2, 1, 4}, {4, 2, 1, 4}, {4, 2, 1, 4}},  // lm_head
    // Llama-3.1-8B and Qwen3-8B (hidden 4096; q, o, k, v and qkv shared): their M <= 4 entries are
    // the fastest alone (L2-cold, prefetch_weight: `python -m bench.gemv --sweep --models
    // llama3.1-8b,qwen3-8b --ms 1`, session 36), where the cost model's were up to 51% slower
    // (gate|up 28672x4096: 83.2 against 55.0 us), which took the 1K step from 4.54 to 3.85 ms
    // (Llama-3.1-8B) and 4.29 to 3.93 (Qwen3-8B). Qwen3-8B's step swept at 1K on an H100 (session 42)
    // then changed its gate|up and the shared qkv (5.1021 -> 4.9929 ms) and kept the rest;
    // Llama-3.1-8B's the same way (session 43) changed its gate|up (4.9672 -> 4.8922 ms) and kept
    // its down. Their batch-8 steps swept the same way (session 45: down, then gate|up) changed
    // both downs (Llama-3.1-8B 5.4999 -> 5.4065 ms, Qwen3-8B 5.5474 -> 5.5257) and kept the rule's
    // gate|up. The other sizes: choose_config's rule or cost model.
    {4096, 4096, {1, 8, 1, 8}, kModel, kModel, kModel, kModel},       // q, o
    {1024, 4096, {1, 5, 2, 8}, kModel, kModel, kModel, kModel},       // k, v
    {6144, 4096, {1, 4, 4, 4}, kModel, kModel, kModel, kModel},       // qkv
    {28672, 4096, {1, 4, 4, 4}, kModel, kModel, kModel, kModel},      // Llama-3.1-8B gate|up
    {4096, 14336, {1, 7, 1, 8}, {2, 4, 2, 8}, kModel, kModel, kModel},  // Llama-3.1-8B down
    {128256, 4096, {2, 4, 2, 8}, kModel, kModel, kModel, kModel},     // Llama-3.1-8B lm_head
    {24576, 4096, {1, 4, 4, 4}, kModel, kModel, kModel, kModel},      // Qwen3-8B gate|up
    {4096, 12288, {1, 8, 1, 8}, {2, 4, 2, 8}, kModel, kModel, kModel},  // Qwen3-8B down
    {151936, 4096, {2, 4, 2, 8}, kModel, kModel, kModel, kModel},     // Qwen3-8B lm_head
    // Qwen3-30B-A3B's router (with the RMS scale) and o projection: swept inside the batch-1 step at
    // 1K on an H100 (`python -m bench.decode --sweep-gemv --models qwen3-30b-a3b --cases 1x1024
    // --sweep-shapes 128x2048`, then 2048x4096; session 41): the step 2.6676 -> 2.6386 ms and
    // 2.6698 -> 2.6247 against the cost model's choices (a cluster at U = 4 for the router). Both
    // have each warp's k-range in one trip. Batches 2 to 4 share the entries (timed with them in
    // session 42, not against the model's choices).
    {128, 2048, {1, 8, 1, 8}, kModel, kModel, kModel, kModel},        // router
    {2048, 4096, {1, 8, 2, 8}, {1, 4, 4, 4}, kModel, kModel, kModel},   // o
    // Its qkv, swept the same way after the two above (session 42): 2.6035 -> 2.5800 ms. At batch 8
    // (session 43) the qkv took the step 11.1743 -> 11.0243 ms and then the o 11.0444 -> 10.9191;
    // the router kept the M = 8 cost model's choice.
    {5120, 2048, {1, 8, 1, 4}, {1, 4, 2, 4}, kModel, kModel, kModel},   // qkv
    // Qwen3-1.7B, Qwen3-4B and Llama-3.2-1B, swept inside their steps at 1K on an H100 (session 42:
    // `python -m bench.decode --sweep-gemv --models M --cases 1x1024`, and 8x1024 for the Qwens' M =
    // 8 entries, each shape after the ones above it, LM heads then left to the model). Against the
    // cost model's choices: Qwen3-1.7B 1.4825 -> 1.3653 ms at batch 1, 1.9691 -> 1.7144 at batch
    // 8; Qwen3-4B 3.2237 -> 2.9905, 3.7193 -> 3.4306 at batch 8; Llama-3.2-1B 1.0019 -> 0.9195
    // (its q and o take Qwen3-1.7B's 2048x2048 entry, which its sweep kept). Batches 2 to 4 and 5
    // to 7 share the entries.
    {2048, 6144, {1, 3, 4, 8}, {1, 8, 2, 8}, kModel, kModel, kModel},   // Qwen3-1.7B down
    {12288, 2048, {1, 4, 1, 4}, {2, 1, 4, 8}, kModel, kModel, kModel},  // Qwen3-1.7B gate|up
    {4096, 2048, {1, 4, 2, 8}, {1, 4, 2, 4}, kModel, kModel, kModel},   // Qwen3-1.7B qkv
    {2048, 2048, {1, 8, 1, 8}, {2, 2, 4, 4}, kModel, kModel, kModel},   // Qwen3-1.7B q, o
    {151936, 2048, {2, 4, 1, 8}, kModel, kModel, kModel, kModel},       // Qwen3-1.7B, 30B lm_head
    {2560, 9728, {1, 5, 8, 8}, {1, 5, 4, 8}, kModel, kModel, kModel},   // Qwen3-4B down
    {19456, 2560, {1, 5, 1, 8}, {4, 2, 1, 4}, kModel, kModel, kModel},  // Qwen3-4B gate|up
    {6144, 2560, {2, 4, 1, 8}, {1, 5, 1, 8}, kModel, kModel, kModel},   // Qwen3-4B qkv
    {2560, 4096, {1, 5, 2, 8}, {1, 2, 4, 4}, kModel, kModel, kModel},   // Qwen3-4B o
    // Llama-3.2-3B the same way: 2.5232 -> 2.2771 ms. Both Llamas' M = 8 entries from their
    // batch-8 sweeps (session 43): Llama-3.2-1B 1.1335 -> 1.0410 ms (its q and o keep Qwen3-1.7B's
    // (2,2,4,4): 1.0469 against the sweep's best 1.0407, which was not in the 1.7B's top five),
    // Llama-3.2-3B 2.8495 -> 2.6424. The LM heads at batch 1, swept last (session 43), gained
    // 0.4-0.7%: Qwen3-1.7B 1.3707 -> 1.3655 ms, Llama-3.2-1B 0.9038 -> 0.8979, Llama-3.2-3B
    // 2.2522 -> 2.2432 (the top five within 0.05% of each other in each).
    {2048, 8192, {1, 8, 2, 8}, {1, 8, 2, 8}, kModel, kModel, kModel},   // Llama-3.2-1B down
    {16384, 2048, {1, 8, 1, 4}, {8, 1, 2, 4}, kModel, kModel, kModel},  // Llama-3.2-1B gate|up
    {3072, 2048, {1, 5, 1, 8}, {1, 8, 1, 8}, kModel, kModel, kModel},   // Llama-3.2-1B qkv
    {128256, 2048, {2, 2, 2, 4}, kModel, kModel, kModel, kModel},       // Llama-3.2-1B lm_head
    {3072, 8192, {1, 4, 8, 4}, {1, 4, 8, 4}, kModel, kModel, kModel},   // Llama-3.2-3B down
    {16384, 3072, {1, 6, 1, 4}, {1, 6, 2, 4}, kModel, kModel, kModel},  // Llama-3.2-3B gate|up
    {5120, 3072, {1, 3, 4, 4}, {2, 1, 4, 8}, kModel, kModel, kModel},   // Llama-3.2-3B qkv
    {3072, 3072, {1, 6, 2, 4}, {1, 8, 1, 8}, kModel, kModel, kModel},   // Llama-3.2-3B q, o
    {128256, 3072, {2, 2, 4, 4}, kModel, kModel, kModel, kModel},       // Llama-3.2-3B lm_head
    // Qwen2.5-0.5B and -3B, the first models the rule chose for as built, swept the same way at
    // batches 1 and 8 (session 44; the 3B's down, gate|up and qkv only: its o and LM head have
    // Qwen3-1.7B's entries): 0.5B 0.5708 -> 0.5182 ms at batch 1, 0.6286 -> 0.6138 at 8; 3B 2.3122
    // -> 2.2469 and 2.4593 -> 2.4277. Where nothing beat the rule's choice by 0.3% (the 0.5B LM head
    // 151936x896, the 3B gate|up 22016x2048, the kModel entries below) it stays.
    {896, 4864, {1, 3, 8, 8}, {1, 8, 4, 8}, kModel, kModel, kModel},    // Qwen2.5-0.5B down
    {9728, 896, {4, 1, 2, 8}, kModel, kModel, kModel, kModel},          // Qwen2.5-0.5B gate|up
    {1152, 896, {1, 7, 1, 4}, kModel, kModel, kModel, kModel},          // Qwen2.5-0.5B qkv
    {896, 896, {2, 4, 1, 8}, {2, 2, 4, 8}, kModel, kModel, kModel},     // Qwen2.5-0.5B q, o
    {2048, 11008, {1, 8, 2, 8}, {1, 3, 4, 8}, kModel, kModel, kModel},  // Qwen2.5-3B down
    {2560, 2048, kModel, {2, 2, 4, 8}, kModel, kModel, kModel},         // Qwen2.5-3B qkv
};

// Rows m_from to 4 of x where an in-step sweep at batch 4 beat the shape's M = 1 entry (which
// kTuned's m1 serves for M = 1..4 otherwise): `python -m bench.decode --sweep-gemv --models 1.5b
// --cases 4x1024`, then `--models 7b` (H100, session 45; the shapes swept in the table's order, each
// with the ones kept before it in place): Qwen2.5-1.5B 1.3327 -> 1.2971 ms a step (-2.7%),
// Qwen2.5-7B 4.8699 -> 4.8019 (-1.4%); their other shapes kept the M = 1 entry. In the step
// (interleaved A/B, same H100), the M = 1 entries forced back made the 7B 3.9% / 2.6% / 2.2% slower
// at batches 2 / 3 / 4 and the 1.5B 2.7% / 2.4% slower at 3 / 4 but 0.3% faster at 2, so the 1.5B's
// serve 3-4 rows. Llama-3.1-8B's down: the same sweep (H100, session 46) found (1,4,8,8) 0.5% faster
// at batch 4; as built, its M = 1 entry forced back made the step 0.14% / 0.44% / 0.37% slower at
// batches 2 / 3 / 4 (H100, session 47), so it serves 2-4 rows.
struct TunedRows {
  int64_t N, K;
  int m_from;  // the fewest rows of x the entry serves (up to kTunedRowsTo)
  GemvConfig cf;
};
constexpr int kTunedRowsTo = 4;
constexpr TunedRows kTunedRows[] = {
    {2048, 1536, 3, {2, 2, 4, 4}},    // Qwen2.5-1.5B qkv
    {17920, 1536, 3, {1, 3, 2, 4}},   // Qwen2.5-1.5B gate|up
    {1536, 8960, 3, {1, 5, 4, 8}},    // Qwen2.5-1.5B down
    {4608, 3584, 2, {2, 1, 4, 8}},    // Qwen2.5-7B qkv
    {37888, 3584, 2, {1, 7, 1, 4}},   // Qwen2.5-7B gate|up
    {152064, 3584, 2, {1, 7, 1, 4}},  // Qwen2.5-7B lm_head
    {4096, 14336, 2, {1, 4, 8, 8}},   // Llama-3.1-8B down
};

// Plain calls (prefetch_weight=False: no weight loaded before the PDL wait, so nothing overlaps the
// kernel ahead) of the Qwen2.5-1.5B and -7B shapes, rows m_from to m_to of x: the fastest alone
// (L2-cold, `python -m bench.gemv --sweep --plain --ms 1,2,4,8`; H100, session 49). The tables
// above, tuned on prefetch calls, left plain calls up to 27% slower (the 1.5B q at M = 8: 4.35
// against 3.18 us), and the 7B qkv at M = 1 slower than cuBLAS (15.2 us here; cuBLAS 13.7 on an
// H100 in session 48; 13.3-13.5 with (2,2,4,4)). Plain calls want more, shorter k-ranges (a cluster
// split-K of 2 to 8) than prefetch calls, which start their first loads early. An entry is the
// sweep's best at each M it serves or within 1.5% of it (M = 4 of the 7B LM head not timed); the
// 1.5B LM head at M = 1 keeps its prefetch choice (the best plain one was 0.3% faster). Ten shapes
// of other presets follow (session 51). Shapes not listed: the prefetch calls' choice.
struct TunedPlain {
  int64_t N, K;
  int m_from, m_to;
  GemvConfig cf;
};
constexpr TunedPlain kTunedPlain[] = {
    {1536, 1536, 1, 8, {1, 6, 2, 4}},       // Qwen2.5-1.5B q, o: 4.06 -> 3.57 us at M = 1
    {256, 1536, 1, 8, {1, 3, 4, 4}},        // k, v: 2.48 -> 2.34
    {2048, 1536, 1, 1, {1, 4, 4, 4}},       // qkv: 5.11 -> 4.51
    {2048, 1536, 2, 8, {1, 3, 2, 8}},       //   4.38 -> 3.63 at M = 2
    {17920, 1536, 1, 8, {1, 3, 2, 4}},      // gate|up: 22.02 -> 19.61
    {1536, 8960, 1, 8, {1, 7, 2, 4}},       // down: 12.69 -> 11.44
    {151936, 1536, 2, 8, {1, 6, 2, 4}},     // lm_head: 155.83 -> 150.36 at M = 8
    {3584, 3584, 1, 8, {1, 1, 4, 4}},       // Qwen2.5-7B q, o: 11.26 -> 10.36
    {512, 3584, 1, 1, {1, 4, 8, 4}},        // k, v: 3.39 -> 3.24
    {512, 3584, 2, 8, {1, 7, 2, 8}},        //   2.94 -> 2.92 at M = 2
    {4608, 3584, 1, 1, {2, 2, 4, 4}},       // qkv: 15.18 -> 13.30
    {4608, 3584, 2, 8, {1, 7, 2, 4}},       //   16.06 -> 12.82 at M = 2
    {37888, 3584, 1, 1, {1, 2, 8, 8}},      // gate|up: 92.18 -> 87.60
    {37888, 3584, 2, 8, {1, 7, 2, 4}},      //   88.47 -> 87.36 at M = 2
    {3584, 18944, 1, 8, {1, 1, 4, 8}},      // down: 49.14 -> 47.43
    {152064, 3584, 1, 1, {1, 2, 8, 8}},     // lm_head: 363.91 -> 341.96
    {152064, 3584, 2, 8, {1, 5, 4, 8}},     //   364.26 -> 345.31 at M = 8
    // Other presets' shapes whose plain calls trailed cuBLAS or matched it within 2% (H100, session
    // 51: `python -m bench.gemv --models ... --sweep --plain --ms 1,8`; the M = 2..8 entries are M =
    // 8's best, timed as built at 2, 4 and 8 too), us at the tables' choice -> the entry's. The
    // 0.5B gate|up stays 2% slower than cuBLAS at M = 1: no configuration beat it.
    {9728, 896, 1, 1, {2, 1, 1, 4}},        // Qwen2.5-0.5B gate|up: 10.29 -> 8.73 (cuBLAS 8.43)
    {9728, 896, 2, 8, {2, 2, 2, 4}},        //   9.08 -> 8.49 at M = 8
    {151936, 896, 1, 8, {1, 7, 1, 4}},      // Qwen2.5-0.5B lm_head: 96.11 -> 86.77
    {2048, 2048, 1, 1, {1, 4, 1, 4}},       // 3B, Qwen3-1.7B, Llama-3.2-1B q, o: 6.26 -> 5.28
    {2048, 2048, 2, 8, {1, 4, 4, 4}},       //   5.69 -> 4.58 at M = 8
    {2560, 2048, 1, 1, {1, 1, 4, 4}},       // Qwen2.5-3B qkv: 6.58 -> 5.75
    {2560, 2048, 2, 8, {2, 3, 4, 4}},       //   7.08 -> 5.58 at M = 8
    {4096, 2048, 1, 8, {2, 4, 2, 4}},       // Qwen3-1.7B qkv, Qwen3-30B-A3B q: 8.93 -> 7.47
    {12288, 2048, 2, 8, {2, 2, 4, 4}},      // Qwen3-1.7B gate|up: 20.29 -> 17.15 at M = 8
    {6144, 2560, 1, 8, {1, 5, 1, 8}},       // Qwen3-4B qkv: 13.97 -> 12.58 (M = 8's own choice;
                                            //   M = 2, 4: 13.7, 13.8 -> 12.0, 12.4 as built)
    {19456, 2560, 1, 1, {1, 5, 2, 4}},      // Qwen3-4B gate|up: 33.96 -> 33.15
    {19456, 2560, 2, 8, {2, 2, 2, 4}},      //   37.89 -> 33.38 at M = 8
    {3072, 2048, 1, 8, {1, 1, 4, 4}},       // Llama-3.2-1B qkv: 7.94 -> 6.08
    {5120, 3072, 1, 8, {1, 4, 2, 4}},       // Llama-3.2-3B qkv: 12.86 -> 11.90
};

// The configuration of a shape the table leaves open, up to kMaxRows rows of x: each warp about
// kRuleSteps k-steps (two trips of U = 4), the warps' k-ranges split over up to kRuleWarps warps a
// block and the rest over a cluster of up to kMaxCluster blocks; one warp row a block. Fitted to
// in-step sweeps on an H100 (sessions 41-43: 51 shapes of seven models at batches 1 and 8, the
// first lines of bench/gemv_sweeps.jsonl; `python -m bench.gemv_rule --loo`): on the 41 timed with
// the cost model's choice (below), the rule costs 0.63% of the step a shape against the shape's
// best configuration, the cost model 1.99%, and the rule is the nearer on 37; refitted then with
// one model left out and costed on it, 0.61%. On models none of that saw (session 43, the same
// H100, the rule's picks forced against the cost model's in the step): Qwen2.5-3B 5.0% faster at
// batch 1 and 10.7% at 8, Qwen2.5-0.5B 16.7% faster at 8 but 0.7% slower at 1, Llama-3.1-8B and
// Qwen3-8B at batch 8 (their M = 8 not in the table) 6.3% and 8.1% faster. As built (sessions 44
// and 45), the 20 shapes of the four then swept in their steps cost 0.96% of the step a shape
// against their best (then tabled; at most 2.91%); refitted with those lines too, (8 k-steps, 6
// k-warps) comes first at 0.696% against these constants' 0.699%, so they stay. Without clusters
// (below sm_90) the same rule with c = 1, not measured.
constexpr int kRuleSteps = 8, kRuleWarps = 5;
constexpr GemvConfig rule_config(int64_t K, bool clusters) {
  const int64_t ksteps = ceil_div(K, kStepK), parts = ceil_div(ksteps, kRuleSteps);
  int c = 1;
  while (c < (clusters ? kMaxCluster : 1) && ceil_div(parts, c) > kRuleWarps) c *= 2;
  const int wk = static_cast<int>(std::min<int64_t>(ceil_div(parts, c), kMaxWarps));
  return {1, wk, c, ceil_div(ksteps, int64_t{wk} * c) > kRuleSteps ? 8 : 4};
}

// For a plain call kTunedPlain's entry, else kTunedRows' or else kTuned's entry for a weight [N, K]
// at M rows of x, else up to kMaxRows rows rule_config: the choices that need no device
// (gemv_config reports them).
std::optional<GemvConfig> known_config(int64_t N, int64_t K, int M, bool clusters, bool prefetch_weight) {
  if (!prefetch_weight) {
    for (const TunedPlain& t : kTunedPlain) {
      if (t.N == N && t.K == K && M >= t.m_from && M <= t.m_to && (clusters || t.cf.c == 1)) return t.cf;
    }
  }
  for (const TunedRows& t : kTunedRows) {
    if (t.N == N && t.K == K && M >= t.m_from && M <= kTunedRowsTo && (clusters || t.cf.c == 1)) {
      return t.cf;
    }
  }
  for (const TunedShape& t : kTuned) {
    const GemvConfig& cf = M <= 4 ? t.m1 : M <= 8 ? t.m8 : M <= 16 ? t.m16 : M <= 32 ? t.m32 : t.m64;
    if (t.N == N && t.K == K && !is_model(cf) && (clusters || cf.c == 1)) return cf;
  }
  if (M <= kMaxRows) return rule_config(K, clusters);
  return std::nullopt;
}

GemvConfig choose_config(int64_t N, int64_t K, int M, int sms, bool clusters, bool prefetch_weight) {
  if (const std::optional<GemvConfig> cf = known_config(N, K, M, clusters, prefetch_weight)) return *cf;
  // Above kMaxRows (the wide variants, no in-step data): the cost model.
  GemvConfig best{1, 1, 1, 4};
  double best_us = std::numeric_limits<double>::infinity();
  // Cheapest structure first; a later candidate must win by 2% to replace it.
  for (int c = 1; c <= (clusters ? kMaxCluster : 1); c *= 2) {
    for (int u : {4, 8}) {
      if (M > kMaxRows && u == 8) continue;  // the wide variants spill at U = 8
      for (int wk = 1; wk <= kMaxWarps; ++wk) {
        for (int wr = 1; wr * wk <= kMaxWarps; wr *= 2) {
          const GemvConfig cf{wr, wk, c, u};
          const double us = estimate_us(N, K, M, sms, cf, blocks_per_sm(M, u, wr * wk));
          if (us < 0.98 * best_us) {
            best = cf;
            best_us = us;
          }
        }
      }
    }
  }
  return best;
}

// Whether a configuration from outside the table is one the kernel has: wr, wk >= 1 with wr * wk
// <= kMaxWarps warps, clusters of 1 to kMaxCluster (1 below sm_90), U 4 or 8.
constexpr bool config_valid(const GemvConfig& cf, bool clusters) {
  return cf.wr >= 1 && cf.wk >= 1 && cf.wr * cf.wk <= kMaxWarps && cf.c >= 1 && cf.c <= kMaxCluster &&
         (cf.u == 4 || cf.u == 8) && (clusters || cf.c == 1);
}

// Whether no (N, K) appears twice in a table (known_config takes the first match, so a second one
// would never be used).
template <typename Entry, size_t n>
constexpr bool shapes_unique(const Entry (&table)[n]) {
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (table[j].N == table[i].N && table[j].K == table[i].K) return false;
    }
  }
  return true;
}

// Whether kTunedPlain's entries are configurations the kernel has, their row ranges within
// 1..kMaxRows, and no two ranges of a shape overlap (known_config takes the first match).
constexpr bool plain_table_ok() {
  for (const TunedPlain& t : kTunedPlain) {
    if (!config_valid(t.cf, true) || t.m_from < 1 || t.m_from > t.m_to || t.m_to > kMaxRows) return false;
  }
  for (const TunedPlain& a : kTunedPlain) {
    for (const TunedPlain& b : kTunedPlain) {
      if (&a != &b && a.N == b.N && a.K == b.K && a.m_from <= b.m_to && b.m_from <= a.m_to) return false;
    }
  }
  return true;
}
static_assert(plain_table_ok(), "kTunedPlain: an entry the kernel does not have, or overlapping rows");

// kTuned and kTunedRows checked at compile time: every entry kModel (kTuned only) or a
// configuration the kernel has, kTunedRows' row ranges within 2..kTunedRowsTo, no shape listed twice.
constexpr bool tuned_table_ok() {
  for (const TunedShape& t : kTuned) {
    for (const GemvConfig& cf : {t.m1, t.m8, t.m16, t.m32, t.m64}) {
      if (!is_model(cf) && !config_valid(cf, true)) return false;
    }
  }
  for (const TunedRows& t : kTunedRows) {
    if (!config_valid(t.cf, true) || t.m_from < 2 || t.m_from > kTunedRowsTo) return false;
  }
  return shapes_unique(kTuned) && shapes_unique(kTunedRows);
}
static_assert(tuned_table_ok(),
              "kTuned / kTunedRows: an entry the kernel does not have, or a shape listed twice");

// rule_config checked at compile time for every K up to 64K: a configuration the kernel has, with or
// without clusters, whose k-ranges all get at least one k-step.
constexpr bool rule_ok() {
  for (int64_t K = 8; K <= 65536; K += 8) {
    for (bool clusters : {true, false}) {
      const GemvConfig cf = rule_config(K, clusters);
      if (!config_valid(cf, clusters) || cf.wr != 1 || int64_t{cf.wk} * cf.c > ceil_div(K, kStepK)) {
        return false;
      }
    }
  }
  return true;
}
static_assert(rule_ok(), "rule_config: a configuration the kernel does not have");
// A few of its picks, pinned (tests/test_bench_gemv_rule.py holds bench.gemv_rule's copy to them).
constexpr bool rule_picks_ok() {
  const GemvConfig a = rule_config(2048, true), b = rule_config(8192, true);
  return a.wk == 4 && a.c == 2 && a.u == 4 && b.wk == 4 && b.c == 8 && rule_config(896, true).c == 1 &&
         rule_config(18944, true).u == 8 && rule_config(2048, false).wk == 8;
}
static_assert(rule_picks_ok(), "rule_config: not the rule its comment describes");

// What config_valid asks, for its errors (evaluated only when a check fails).
std::string config_needs() {
  return msg(": need wr*wk <= ", kMaxWarps, ", 1 <= c <= ", kMaxCluster, " (c = 1 below sm_90), u in {4, 8}");
}

// DECODEX_GEMV_CONFIG: a fixed configuration for tuning sweeps, either "wr,wk,c,u" for every
// shape, or entries "N,K:wr,wk,c,u" separated by ';' for the shapes they name (N = weight rows, so
// gate|up is 2I; a shape not named keeps its usual choice).
bool config_override(GemvConfig& cf, int64_t N, int64_t K, bool clusters) {
  int v[4];
  if (!config_from_env("DECODEX_GEMV_CONFIG", "wr,wk,c,u", N, K, v, 4)) return false;
  cf = {v[0], v[1], v[2], v[3]};
  DX_CHECK(config_valid(cf, clusters), "DECODEX_GEMV_CONFIG=\"", std::getenv("DECODEX_GEMV_CONFIG"), "\"",
           config_needs());
  return true;
}

// GemvOptions::launch_dependents_early, unless DECODEX_GEMV_DEPENDENTS_EARLY names the shape.
bool dependents_early(bool asked, int64_t N, int64_t K) {
  int v = 0;
  if (!config_from_env("DECODEX_GEMV_DEPENDENTS_EARLY", "0|1", N, K, &v, 1)) return asked;
  DX_CHECK(v == 0 || v == 1, "DECODEX_GEMV_DEPENDENTS_EARLY=\"",
           std::getenv("DECODEX_GEMV_DEPENDENTS_EARLY"), "\": each value must be 0 or 1");
  return v == 1;
}

// GemvOptions::launch_dependents_after, unless DECODEX_GEMV_DEPENDENTS_AFTER names the shape.
int dependents_after(int asked, int64_t N, int64_t K) {
  int v = 0;
  if (!config_from_env("DECODEX_GEMV_DEPENDENTS_AFTER", "pct", N, K, &v, 1)) return asked;
  DX_CHECK(v >= 0 && v <= 100, "DECODEX_GEMV_DEPENDENTS_AFTER=\"",
           std::getenv("DECODEX_GEMV_DEPENDENTS_AFTER"), "\": each value must be 0 to 100");
  return v;
}

}  // namespace

// ---- host: the shared checks and launcher (gemv.h) ----

bool config_from_env(const char* var, const char* fields, int64_t N, int64_t K, int* values,
                     int count) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return false;
  const bool per_shape = std::strchr(env, ':') != nullptr;
  bool found = false;  // every entry is checked, wherever the match is
  for (const char* p = env; *p != '\0';) {
    long long n = 0, k = 0;
    int used = 0, v[8] = {};
    bool parsed = !per_shape || (std::sscanf(p, "%lld,%lld:%n", &n, &k, &used) == 2 && used > 0);
    for (int i = 0; parsed && i < count; ++i) {
      int more = 0;
      parsed = std::sscanf(p + used, i == 0 ? "%d%n" : ",%d%n", &v[i], &more) == 1;
      used += more;
    }
    DX_CHECK(parsed && used > 0 && (p[used] == '\0' || (per_shape && p[used] == ';')), var,
             " must be \"", fields, "\" or \"N,K:", fields, ";...\", got \"", env, "\"");
    if (!found && (!per_shape || (n == N && k == K))) {  // the first entry naming the shape
      std::copy(v, v + count, values);
      found = true;
    }
    p += used;
    if (*p == ';') {
      ++p;
      DX_CHECK(*p != '\0', var, "=\"", env, "\" ends with ';'");
    }
  }
  return found;
}

void check_linear_tensors(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
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
}

void check_gemv_x_weight(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& out, int64_t max_m) {
  check_linear_tensors(x, weight, out);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  DX_CHECK(M >= 1 && M <= max_m, "decodex::", op, " handles M = 1..", max_m,
           " rows of x, got x of shape ", x.sizes(), " (M = ", M,
           "); use cuBLAS (F.linear) for larger batches");
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
                                     int64_t N, const char* x_name) {
  if (!bias.has_value()) return nullptr;
  const at::Tensor& b = *bias;  // checked by hand: the messages must say "bias"
  DX_CHECK(b.is_cuda(), "bias must be a CUDA tensor, got device ", b.device());
  DX_CHECK(b.device() == x.device(), x_name, " and bias must be on the same device, got ", x.device(),
           " and ", b.device());
  DX_CHECK(b.scalar_type() == at::kBFloat16, "bias must have dtype ", at::kBFloat16, ", got ",
           b.scalar_type());
  DX_CHECK(b.dim() == 1 && b.size(0) == N, "bias must have shape [N] = [", N, "], got ",
           b.sizes());
  DX_CHECK(N <= 1 || b.stride(0) == 1, "bias must be contiguous, got strides ", b.strides());
  return reinterpret_cast<const __nv_bfloat16*>(b.data_ptr());
}

GemvOptions gemv_options(const char* op, const at::Tensor& x, const at::Tensor& out,
                         bool prefetch_weight, std::optional<double> rms_eps, bool accumulate,
                         at::OptionalIntArrayRef config, bool launch_dependents_early,
                         int64_t launch_dependents_after) {
  DX_CHECK(!spans_overlap(x, out), "decodex::", op, ": x and out must not overlap in memory (the ",
           "kernel reads x while it writes out)");
  GemvOptions o;
  o.prefetch_weight = prefetch_weight;
  o.accumulate = accumulate;
  o.launch_dependents_early = launch_dependents_early;
  DX_CHECK(launch_dependents_after >= 0 && launch_dependents_after <= 100, "decodex::", op,
           ": launch_dependents_after must be 0 to 100 (a percentage of the main loop), got ",
           launch_dependents_after);
  DX_CHECK(!launch_dependents_early || launch_dependents_after == 0, "decodex::", op,
           ": launch_dependents_early and launch_dependents_after > 0 exclude each other");
  o.launch_dependents_after = static_cast<int>(launch_dependents_after);
  if (rms_eps.has_value()) o.rms_eps = check_rms_eps(op, *rms_eps);
  if (config.has_value()) {
    const c10::IntArrayRef v = *config;
    DX_CHECK(v.size() == 4, "decodex::", op, ": config must be [wr, wk, c, u] (4 values), got ", v);
    DX_CHECK(x.size(0) <= kMaxRows, "decodex::", op, ": config applies to at most ", kMaxRows,
             " rows of x, got x of shape ", x.sizes());
    std::array<int, 4> c{};
    for (int i = 0; i < 4; ++i) {
      DX_CHECK(v[i] >= 1 && v[i] <= 64, "decodex::", op, ": config values must be in [1, 64], got ", v);
      c[i] = static_cast<int>(v[i]);
    }
    o.config = c;
  }
  return o;
}

void launch_gemv(const char* op, const at::Tensor& x, const at::Tensor& weight,
                 const __nv_bfloat16* bias_ptr, at::Tensor& out, GemvEpilogue epilogue,
                 const GemvOptions& options, const RopeAppendArgs& rope) {
  const bool silu = epilogue == GemvEpilogue::kSiluMul;
  const int64_t M = x.size(0), K = x.size(1), rows = weight.size(0);
  const int64_t N = silu ? rows / 2 : rows;  // outputs per row of x
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  const int cc_major = device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
  DX_CHECK(cc_major >= 8, "decodex::gemv needs a GPU of compute capability 8.0 or newer");
  const bool clusters = cc_major >= 9;
  const int sms = sm_count(device);

  // Every epilogue has as many tiles as gemv on all `rows` (kSiluMul: 8 gate + 8 up rows each), so
  // all share gemv's configuration for the [rows, K] shape (and its summation order), with or
  // without the RMS scale. (Session 18 gave the 7B gate|up with the RMS scale its own, (1,2,1,8):
  // each of its squares' mmas per k-step cost (1,8,1,8) 3.6%. Since the squares of a whole trip
  // take one pair of mmas at M = 1 (kSpread), (1,8,1,8) is 1.1% faster there; session 25.)
  GemvConfig cf{};
  std::optional<GemvConfig> given;  // the caller's (config), checked even where the knob wins
  if (options.config.has_value()) {
    const std::array<int, 4>& v = *options.config;
    given = GemvConfig{v[0], v[1], v[2], v[3]};
    DX_CHECK(config_valid(*given, clusters), "decodex::", op, ": config = [", v[0], ", ", v[1], ", ",
             v[2], ", ", v[3], "] (wr, wk, c, u)", config_needs());
  }
  if (config_override(cf, rows, K, clusters)) {
    // DECODEX_GEMV_CONFIG, the tuning knob, wins over config.
  } else if (given.has_value()) {
    cf = *given;
  } else {
    // One choice per shape; a thread_local map needs no lock.
    thread_local std::map<std::array<int64_t, 5>, GemvConfig> chosen;
    const std::array<int64_t, 5> key{rows, K, M, device, options.prefetch_weight};
    auto it = chosen.find(key);
    if (it == chosen.end()) {
      it = chosen.emplace(key, choose_config(rows, K, static_cast<int>(M), sms, clusters,
                                             options.prefetch_weight)).first;
    }
    cf = it->second;
  }

  const int64_t tiles = silu ? ceil_div(N, kTileRows / 2) : ceil_div(N, kTileRows);
  const GemvKernel kernel =
      (cf.c > 1 ? kernel_for<true> : kernel_for<false>)(static_cast<int>(M), cf.u, epilogue,
                                                        options.rms_eps.has_value());
  const int64_t ldx = M == 1 ? 0 : x.stride(0);
  const int64_t ldw = rows == 1 ? 0 : weight.stride(0);
  const int64_t ldo = M == 1 ? 0 : out.stride(0);
  // Clusters of c > 1 blocks for the split-K reduction, and programmatic dependent launch (see
  // pdl_begin in common.h).
  const cudaError_t err = launch_pdl_clusters(
      kernel, dim3(static_cast<unsigned>(ceil_div(tiles, cf.wr) * cf.c)),
      dim3(static_cast<unsigned>(cf.wr * cf.wk * 32)), 0, current_stream(),
      static_cast<unsigned>(cf.c), reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr()), bias_ptr,
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), ldx, ldw, ldo, static_cast<int>(N),
      static_cast<int>(K), cf.wr, cf.wk, cf.c,
      static_cast<int>(std::min<int64_t>(int64_t{blocks_per_sm(static_cast<int>(M), cf.u, cf.wr * cf.wk)} * sms,
                                         std::numeric_limits<int>::max())),
      options.prefetch_weight, dependents_early(options.launch_dependents_early, rows, K),
      options.rms_eps.value_or(0.f), options.accumulate, rope,
      static_cast<int>(M), dependents_after(options.launch_dependents_after, rows, K));
  DX_CHECK(err == cudaSuccess, "decodex::", op, " kernel launch failed (wr=", cf.wr, ", wk=", cf.wk,
           ", c=", cf.c, ", u=", cf.u, "): ", cudaGetErrorString(err));
  const cudaError_t late = cudaGetLastError();
  DX_CHECK(late == cudaSuccess, "decodex::", op, " kernel launch failed: ",
           cudaGetErrorString(late));
}

// ---- host: the ops ----

void gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          at::Tensor& out, bool prefetch_weight, std::optional<double> rms_eps, bool accumulate,
          at::OptionalIntArrayRef config, bool launch_dependents_early,
          int64_t launch_dependents_after) {
  check_gemv_x_weight("gemv", x, weight, out, kMaxRowsWide);
  const int64_t M = x.size(0), N = weight.size(0);
  DX_CHECK(M <= kMaxRows || !rms_eps.has_value(), "decodex::gemv: rms_eps needs M <= ", kMaxRows,
           " rows of x, got x of shape ", x.sizes(), " (normalise x first, or pass at most ",
           kMaxRows, " rows a call)");
  check_gemv_out(out, M, N);
  const __nv_bfloat16* bias_ptr = check_gemv_bias(bias, x, N);
  const GemvOptions options =
      gemv_options("gemv", x, out, prefetch_weight, rms_eps, accumulate, config,
                   launch_dependents_early, launch_dependents_after);
  if (N == 0) return;
  if (gemv_prefers_wgmma(M, N, x.size(1), x.get_device())) {
    launch_gemv_wide("gemv", x, weight, bias_ptr, out, GemvEpilogue::kStore, options);
    return;
  }
  launch_gemv("gemv", x, weight, bias_ptr, out, GemvEpilogue::kStore, options);
}

void gemv_silu_mul(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out,
                   bool prefetch_weight, std::optional<double> rms_eps, at::OptionalIntArrayRef config,
                   int64_t launch_dependents_after) {
  check_gemv_x_weight("gemv_silu_mul", x, weight, out, kMaxRowsWide);
  const int64_t M = x.size(0), rows = weight.size(0);
  DX_CHECK(M <= gemv_silu_mul_max_rows(x.get_device()), "decodex::gemv_silu_mul: more than ",
           kMaxRows, " rows of x need the wgmma kernel (an sm_90a build on a device of compute ",
           "capability 9.0); got x of shape ", x.sizes(), " (pass at most ", kMaxRows, " rows a call)");
  DX_CHECK(rows % 2 == 0, "gemv_silu_mul: weight must stack gate and up rows, [2I, K], so ",
           "weight.size(0) must be even, got ", weight.sizes());
  check_gemv_out(out, M, rows / 2);
  const GemvOptions options =
      gemv_options("gemv_silu_mul", x, out, prefetch_weight, rms_eps, false, config, false,
                   launch_dependents_after);
  if (rows == 0) return;
  if (M > kMaxRows) {
    launch_gemv_wide("gemv_silu_mul", x, weight, nullptr, out, GemvEpilogue::kSiluMul, options);
    return;
  }
  launch_gemv("gemv_silu_mul", x, weight, nullptr, out, GemvEpilogue::kSiluMul, options);
}

std::vector<int64_t> gemv_config(int64_t N, int64_t K, int64_t M, bool clusters, bool prefetch_weight) {
  DX_CHECK(N >= 1, "gemv_config: N (the weight's rows) must be >= 1, got ", N);
  DX_CHECK(K >= 8 && K % 8 == 0, "gemv_config: K must be a positive multiple of 8, got ", K);
  DX_CHECK(M >= 1 && M <= kMaxRows, "gemv_config: M (rows of x) must be 1 to ", kMaxRows,
           " (above, the choice asks the device), got ", M);
  const GemvConfig cf = *known_config(N, K, static_cast<int>(M), clusters, prefetch_weight);
  return {cf.wr, cf.wk, cf.c, cf.u};
}

int64_t gemv_silu_mul_max_rows(int64_t device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: count 0, and no error left for the next launch
    count = 0;
  }
  DX_CHECK(device >= 0 && device < count, "gemv_silu_mul_max_rows: device must be a CUDA device index "
           "(0 to ", count - 1, " here), got ", device);
  return gemv_wgmma_available(static_cast<int>(device)) ? kMaxRowsWide : kMaxRows;
}

}  // namespace decodex
