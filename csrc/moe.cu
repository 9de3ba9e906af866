// Mixture-of-experts decode (Qwen3-MoE): the routing and the chosen experts' products, for a few
// rows of x, with the expert choice staying on the device.
//
//   moe_route          logits [M, E] -> ids [M, k] (int32), the k largest logits of each row in
//                      descending order (ties to the lower index, NaN as -inf), and weights [M, k] (fp32): their
//                      softmax probabilities over all E, renormalised to sum to 1 over the k if
//                      norm_topk_prob.
//   moe_gemv_silu_mul  out[m, s] = silu(x[m] . gate_e^T) * (x[m] . up_e^T), e = ids[m, s], for the
//                      experts' merged gate|up weights [E, 2I, K] (rows: gate, then up), each
//                      product rounded to bf16 first, as gemv_silu_mul; rms_eps as in gemv.
//   moe_gemv_sum       out[m] (+)= sum_s weights[m, s] * (x[m, s] . down_e^T), e = ids[m, s], for the
//                      experts' down weights [E, N, I]: the sum in fp32, rounded to bf16 once
//                      (accumulate: then added to out, as gemv's accumulate).
//
// Idea. A decode row reads only its k experts' weights, and which they are is known only on the
// device: the expert kernels read the ids after their programmatic-dependent-launch wait and index
// the stacked weights with them, so the step has no host sync and one CUDA graph serves every
// routing. A warp computes one output: moe_gemv_silu_mul one feature of one (row, slot) (its gate
// and up rows), moe_gemv_sum one output feature of one row over all k experts, so the weighted sum
// needs no second pass and is added in one fixed order. Lanes stride over the inner dim in 16-byte
// loads, software-pipelined (the next trip of chunks of a row issued before the current ones are
// used), and their sums meet in a shuffle reduction. An expert chosen by several rows is read once
// per (row, slot): at the few rows of a decode step that costs little (mostly L2 hits); prompts
// (many rows) take grouped GEMMs instead (decodex/model.py). moe_gemv_silu_mul cannot load its
// weights before the wait, as the GEMVs do: which expert to read is what the kernel ahead (moe_route)
// writes. moe_gemv_sum, two kernels behind moe_route in the decode step, can (prefetch_weight).
// Ids outside [0, E) are never dereferenced: their outputs are NaN.
#include "common.h"
#include "ops.h"
#include "ptx.cuh"

namespace decodex {

namespace {

constexpr int kMoeWarps = 8;             // warps (outputs) per block of the expert kernels
constexpr int kMoeUnroll = 4;            // moe_gemv_silu_mul: 16-byte chunks a row a lane loads a trip
constexpr int kSumUnroll = 3;            // moe_gemv_sum's: one trip is a row of 768 (Qwen3-30B-A3B's I)
constexpr int kMoeMaxTopK = 32;          // k: moe_gemv_sum keeps a row's ids and weights in smem
constexpr int kRouteWarps = 4;           // moe_route: rows per block, one warp each
constexpr int kRouteMaxExperts = 1024;   // 32 logits a lane

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  float a[8], b[8];
  bf16x8_to_float(*reinterpret_cast<const bf16x8*>(&w), a);
  bf16x8_to_float(*reinterpret_cast<const bf16x8*>(&x), b);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = __fmaf_rn(a[i], b[i], acc);
  return acc;
}

__device__ __forceinline__ float squares8(uint4 x, float acc) {
  return add_squares8(*reinterpret_cast<const bf16x8*>(&x), acc);
}

// ---- moe_route ----

// The choice key of expert e (< 2^16) with logit x, a bf16 value: x's 16 bits, order-preserving,
// above the complemented index, so the unsigned max is the largest logit at the lowest index, and a
// warp picks it in one redux.sync. NaN counts as -inf; -0 as +0 (equal logits tie, as the
// reference's stable sort has them). Every key is above 0, which means "none left".
static_assert(kRouteMaxExperts <= 0x10000, "route_key holds the expert index in 16 bits");
__device__ __forceinline__ unsigned route_key(float x, int e) {
  x = isnan(x) ? -INFINITY : __fadd_rn(x, 0.f);
  const unsigned bits = __float_as_uint(x) >> 16;  // exact: x came from bf16
  const unsigned ord = (bits & 0x8000u) ? ~bits & 0xffffu : bits | 0x8000u;
  return ord << 16 | (0xffffu - static_cast<unsigned>(e));
}

// route_key's expert index and logit (as the key holds it: NaN as -inf, -0 as +0).
__device__ __forceinline__ int key_expert(unsigned key) { return static_cast<int>(0xffffu - (key & 0xffffu)); }
__device__ __forceinline__ float key_logit(unsigned key) {
  const unsigned ord = key >> 16;
  const unsigned bits = (ord & 0x8000u) ? ord & 0x7fffu : ~ord & 0xffffu;
  return __uint_as_float(bits << 16);
}

// One warp per row; lane l holds logits l, l + 32, ... (kPerLane of them: E <= 32 kPerLane) and
// their keys. Each round one warp max (redux.sync) over the lanes' largest keys picks the next
// expert, whose lane zeroes its key, and lane r keeps round r's key; round 0's is the largest logit,
// which the softmax needs. After the rounds, lanes r < k turn their keys into ids and weights at
// once (the key holds the logit), so a round is a max and a compare, nothing more (moe_route was
// 3.8 us a layer of the Qwen3-30B-A3B step with the softmax inside the rounds, 1.6 now: session 41).
template <int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
moe_route_kernel(const __nv_bfloat16* __restrict__ logits, int64_t stride, int M, int E, int k,
                 bool norm, int* __restrict__ ids, float* __restrict__ weights) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int m = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (m >= M) return;  // a whole warp
  const __nv_bfloat16* row = logits + m * stride;
  float v[kPerLane];       // logit lane + 32 j (a copy of the last one past E: the softmax skips it)
  unsigned key[kPerLane];  // 0: no expert there, or chosen already
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    v[j] = __bfloat162float(row[min(e, E - 1)]);  // no branch around the load
    key[j] = e < E ? route_key(v[j], e) : 0u;
  }
  auto best_key = [&] {  // the warp's largest key left
    unsigned best = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) best = key[j] > best ? key[j] : best;
    return __reduce_max_sync(0xffffffffu, best);
  };
  unsigned best = best_key();
  const float mx = key_logit(best);  // the largest logit (NaN as -inf)
  float sum = 0.f;  // a NaN logit makes it NaN, and so every weight, as softmax does
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) sum += lane + 32 * j < E ? expf(v[j] - mx) : 0.f;
  unsigned kept = lane == 0 ? best : 0u;
  for (int r = 1; r < k; ++r) {
    const int e = key_expert(best);  // its lane drops it (every lane takes the same path)
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) key[j] = (e & 31) == lane && j == (e >> 5) ? 0u : key[j];
    best = best_key();
    if (lane == r) kept = best;
  }
  sum = warp_reduce(sum, Sum{});
  const float prob = lane < k ? __fdiv_rn(expf(key_logit(kept) - mx), sum) : 0.f;
  const float chosen_sum = warp_reduce(prob, Sum{});
  if (lane < k) {
    ids[m * k + lane] = key_expert(kept);
    weights[m * k + lane] = norm ? __fdiv_rn(prob, chosen_sum) : prob;
  }
}

// ---- the expert GEMVs ----
// A lane's loads come in trips of kMoeUnroll (moe_gemv_sum: kSumUnroll) 16-byte chunks per row
// (chunk c = c0 + 32 t), and the next trip's are issued before the current trip's math (software
// pipelining: ptxas would otherwise interleave each load with its use, leaving one chunk a row in
// flight). Chunks past the row are predicated off (zeros, no load), so they add nothing.

// grid (ceil(I / kMoeWarps), M * k): block y is the pair (m, s); warp w computes feature j = block x
// * kMoeWarps + w of it: its gate row j and up row I + j of expert ids[m, s].
template <bool kRms>
__global__ void __launch_bounds__(kMoeWarps * 32)
moe_gemv_silu_mul_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                         const __nv_bfloat16* __restrict__ w,  // [E, 2I, K]
                         const int* __restrict__ ids, int k, int E, int I, int K, float rms_eps,
                         __nv_bfloat16* __restrict__ out) {  // [M, k, I]
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int j = blockIdx.x * kMoeWarps + (threadIdx.x >> 5);
  const int pair = blockIdx.y, m = pair / k;
  if (j >= I) return;  // a whole warp
  const int e = ids[pair];
  __nv_bfloat16* o = out + static_cast<int64_t>(pair) * I + j;
  if (e < 0 || e >= E) {
    if (lane == 0) *o = __float2bfloat16_rn(NAN);
    return;
  }
  const __nv_bfloat16* xr = x + m * x_stride;
  const __nv_bfloat16* gate = w + (static_cast<int64_t>(e) * 2 * I + j) * K;
  const __nv_bfloat16* up = gate + static_cast<int64_t>(I) * K;
  const int chunks = K / 8;
  uint4 gv[kMoeUnroll], uv[kMoeUnroll], xv[kMoeUnroll];
  auto load_trip = [&](int c0, uint4 (&g)[kMoeUnroll], uint4 (&u)[kMoeUnroll], uint4 (&xx)[kMoeUnroll]) {
#pragma unroll
    for (int t = 0; t < kMoeUnroll; ++t) {
      const int c = c0 + 32 * t;
      g[t] = load16_stream_l2_256(gate + 8 * c, c < chunks);
      u[t] = load16_stream_l2_256(up + 8 * c, c < chunks);
      xx[t] = load16_cached(xr + 8 * c, c < chunks);
    }
  };
  load_trip(lane, gv, uv, xv);
  float g = 0.f, u = 0.f, ss = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kMoeUnroll) {
    uint4 gn[kMoeUnroll], un[kMoeUnroll], xn[kMoeUnroll];
    load_trip(c0 + 32 * kMoeUnroll, gn, un, xn);
#pragma unroll
    for (int t = 0; t < kMoeUnroll; ++t) {
      g = dot8(gv[t], xv[t], g);
      u = dot8(uv[t], xv[t], u);
      if constexpr (kRms) ss = squares8(xv[t], ss);
      gv[t] = gn[t];
      uv[t] = un[t];
      xv[t] = xn[t];
    }
  }
  g = warp_reduce(g, Sum{});
  u = warp_reduce(u, Sum{});
  if constexpr (kRms) {
    const float inv = rms_inv(warp_reduce(ss, Sum{}), K, rms_eps);
    g = __fmul_rn(g, inv);
    u = __fmul_rn(u, inv);
  }
  if (lane == 0) {
    // The products rounded to bf16 before the activation, as gemv_silu_mul stores them.
    const float gr = __bfloat162float(__float2bfloat16_rn(g));
    const float ur = __bfloat162float(__float2bfloat16_rn(u));
    *o = __float2bfloat16_rn(silu_times(gr, ur));
  }
}

// grid (ceil(N / kMoeWarps), M): warp w of block (bx, m) computes output feature n = bx * kMoeWarps
// + w of row m, over its k experts: the trips of all k rows of weight (kSumUnroll chunks a lane a
// trip) in one pipelined walk, each slot's dot product reduced as it completes and added in slot
// order. (A block per output feature, a warp per expert, was slower on the H200: 12.8 against 10.2
// us at Qwen3-30B-A3B's shape, M = 1; bench/RESULTS.md, session 36.) NB register buffers take the
// trips in turn (no moves between them): while one trip is summed, the other NB - 1 are in flight.
// NB = 3 (104 registers, 2 blocks an SM) for grids of up to two such waves, else NB = 2 (80
// registers, 3 blocks an SM); more buffers were slower (bench/RESULTS.md, session 41). With
// prefetch_weight the ids, the weights and every buffer's first trip of expert weights are read
// before griddepcontrol.wait (the caller promises the kernel ahead writes none of them: in the
// decode step moe_route, which writes ids and weights, runs two kernels ahead); x, which the kernel
// ahead writes, is read after it.
template <int NB>
__global__ void __launch_bounds__(kMoeWarps * 32, 2)
moe_gemv_sum_kernel(const __nv_bfloat16* __restrict__ x,  // [M, k, I]
                    const __nv_bfloat16* __restrict__ w,  // [E, N, I]
                    const int* __restrict__ ids, const float* __restrict__ weights, int k, int E,
                    int N, int I, bool accumulate, bool prefetch_weight,
                    __nv_bfloat16* __restrict__ out, int64_t out_stride) {  // [M, N]
  if (!prefetch_weight) pdl_begin();
  __shared__ int sm_id[kMoeMaxTopK];
  __shared__ float sm_w[kMoeMaxTopK];
  const int lane = threadIdx.x & 31, m = blockIdx.y;
  if (threadIdx.x < k) {  // through L2 (ld.global.cg): no line an earlier kernel left in L1
    sm_id[threadIdx.x] = __ldcg(ids + m * k + threadIdx.x);
    sm_w[threadIdx.x] = __ldcg(weights + m * k + threadIdx.x);
  }
  __syncthreads();
  const int n = blockIdx.x * kMoeWarps + (threadIdx.x >> 5);
  bool bad = false;
  for (int s = 0; s < k; ++s) bad |= sm_id[s] < 0 || sm_id[s] >= E;
  const int chunks = I / 8;
  constexpr int U = kSumUnroll;
  const int per_slot = (chunks + 32 * U - 1) / (32 * U);  // trips a slot
  const int trips = bad || n >= N ? 0 : k * per_slot;
  struct Trip {
    uint4 w[U], x[U];
  };
  auto locate = [&](int trip, int& c0, int& s) {
    s = trip < trips ? trip / per_slot : 0;
    c0 = lane + (trip - s * per_slot) * 32 * U;
  };
  auto load_w = [&](int trip, Trip& b) {
    int c0, s;
    locate(trip, c0, s);
    const __nv_bfloat16* wr = w + (static_cast<int64_t>(sm_id[s]) * N + n) * I;
#pragma unroll
    for (int t = 0; t < U; ++t) {
      const int c = c0 + 32 * t;
      b.w[t] = load16_stream_l2_256(wr + 8 * c, trip < trips && c < chunks);
    }
  };
  auto load_x = [&](int trip, Trip& b) {
    int c0, s;
    locate(trip, c0, s);
    const __nv_bfloat16* xr = x + (static_cast<int64_t>(m) * k + s) * I;
#pragma unroll
    for (int t = 0; t < U; ++t) {
      const int c = c0 + 32 * t;
      b.x[t] = load16_cached(xr + 8 * c, trip < trips && c < chunks);
    }
  };
  float d = 0.f, acc = 0.f;
  auto sum_trip = [&](int trip, const Trip& b) {
#pragma unroll
    for (int t = 0; t < U; ++t) d = dot8(b.w[t], b.x[t], d);
    if ((trip + 1) % per_slot == 0) {  // slot s done: weights[m, s] times its dot product
      acc = __fadd_rn(acc, __fmul_rn(sm_w[trip / per_slot], warp_reduce(d, Sum{})));
      d = 0.f;
    }
  };
  Trip buf[NB];
#pragma unroll
  for (int i = 0; i < NB; ++i) load_w(i, buf[i]);
  if (prefetch_weight) {
    pdl_wait();
    pdl_trigger();
  }
  if (n >= N) return;  // a whole warp
#pragma unroll
  for (int i = 0; i < NB; ++i) load_x(i, buf[i]);
  for (int trip = 0; trip < trips; trip += NB) {
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      if (trip + i < trips) sum_trip(trip + i, buf[i]);
      load_w(trip + i + NB, buf[i]);
      load_x(trip + i + NB, buf[i]);
    }
  }
  if (lane == 0) {
    __nv_bfloat16* o = out + m * out_stride + n;
    const __nv_bfloat16 y = __float2bfloat16_rn(bad ? NAN : acc);
    *o = accumulate ? __float2bfloat16_rn(__fadd_rn(__bfloat162float(*o), __bfloat162float(y))) : y;
  }
}

// The checks every expert op shares: ids [M, k] int32 contiguous on x's device.
void check_ids(const char* op, const at::Tensor& ids, int64_t M, const at::Tensor& ref) {
  DX_CHECK(ids.is_cuda() && ids.device() == ref.device(), "decodex::", op, ": ids must be a CUDA tensor on ",
           ref.device(), ", got ", ids.device());
  DX_CHECK(ids.scalar_type() == at::kInt, "decodex::", op, ": ids must have dtype Int, got ",
           ids.scalar_type());
  DX_CHECK(ids.dim() == 2 && ids.size(0) == M && ids.size(1) >= 1 && ids.size(1) <= kMoeMaxTopK,
           "decodex::", op, ": ids must have shape [M, k] with M = ", M, " and 1 <= k <= ", kMoeMaxTopK,
           ", got ", ids.sizes());
  DX_CHECK(ids.is_contiguous(), "decodex::", op, ": ids must be contiguous, got strides ", ids.strides());
}

// Stacked expert weights [E, rows, K]: bf16, contiguous, aligned, K a positive multiple of 8.
void check_experts(const char* op, const at::Tensor& w, const at::Tensor& ref) {
  DX_CHECK(w.is_cuda() && w.device() == ref.device(), "decodex::", op, ": weight must be a CUDA tensor on ",
           ref.device(), ", got ", w.device());
  DX_CHECK(w.scalar_type() == at::kBFloat16, "decodex::", op, ": weight must have dtype BFloat16, got ",
           w.scalar_type());
  DX_CHECK(w.dim() == 3 && w.size(0) >= 1 && w.size(1) >= 1 && w.size(2) >= 8 && w.size(2) % 8 == 0,
           "decodex::", op, ": weight must have shape [E, rows, K] with K a positive multiple of 8, got ",
           w.sizes());
  DX_CHECK(w.is_contiguous(), "decodex::", op, ": weight must be contiguous, got strides ", w.strides());
  DX_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, "decodex::", op,
           ": weight must be 16-byte aligned");
  DX_CHECK(w.size(0) <= 0x7fffffff && w.size(1) <= 0x7fffffff && w.size(2) <= 0x7fffffff,
           "decodex::", op, ": weight dims must each be below 2^31, got ", w.sizes());
}

}  // namespace

void moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob, at::Tensor& ids,
               at::Tensor& weights) {
  DX_CHECK_CUDA(logits);
  DX_CHECK_DTYPE(logits, at::kBFloat16);
  DX_CHECK_DIM(logits, 2);
  const int64_t M = logits.size(0), E = logits.size(1);
  DX_CHECK(E >= 1 && E <= kRouteMaxExperts, "moe_route: logits.size(1) (experts) must be in 1..",
           kRouteMaxExperts, ", got ", E);
  DX_CHECK(top_k >= 1 && top_k <= E && top_k <= 32, "moe_route: top_k must be in 1..min(32, experts = ", E,
           "), got ", top_k);
  DX_CHECK(logits.stride(1) == 1, "logits must be contiguous along its last dim, got strides ",
           logits.strides());
  DX_CHECK(M <= 0x7fffffff / 32, "moe_route: too many rows: ", M);
  check_ids("moe_route", ids, M, logits);
  DX_CHECK(ids.size(1) == top_k, "moe_route: ids must have shape [M, top_k] = [", M, ", ", top_k, "], got ",
           ids.sizes());
  DX_CHECK(weights.is_cuda() && weights.device() == logits.device(), "weights must be a CUDA tensor on ",
           logits.device(), ", got ", weights.device());
  DX_CHECK_DTYPE(weights, at::kFloat);
  DX_CHECK_SHAPE(weights, M, top_k);
  DX_CHECK_CONTIGUOUS(weights);
  DX_CHECK(!spans_overlap(ids, logits) && !spans_overlap(weights, logits) && !spans_overlap(ids, weights),
           "moe_route: ids, weights and logits must not overlap");
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto kernel = E <= 128 ? moe_route_kernel<4> : E <= 256 ? moe_route_kernel<8> : moe_route_kernel<32>;
  const cudaError_t err = launch_pdl(
      kernel, dim3(static_cast<unsigned>(ceil_div(M, kRouteWarps))), dim3(kRouteWarps * 32), 0,
      current_stream(), reinterpret_cast<const __nv_bfloat16*>(logits.data_ptr()), logits.stride(0),
      static_cast<int>(M), static_cast<int>(E), static_cast<int>(top_k), norm_topk_prob,
      ids.data_ptr<int>(), weights.data_ptr<float>());
  DX_CHECK_LAUNCHED(err, "moe_route");
  DX_CHECK_LAUNCH("moe_route");
}

void moe_gemv_silu_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                       at::Tensor& out, std::optional<double> rms_eps) {
  DX_CHECK_CUDA(x);
  DX_CHECK_DTYPE(x, at::kBFloat16);
  DX_CHECK_DIM(x, 2);
  const int64_t M = x.size(0), K = x.size(1);
  check_experts("moe_gemv_silu_mul", weight, x);
  const int64_t E = weight.size(0), I2 = weight.size(1);
  DX_CHECK(weight.size(2) == K, "moe_gemv_silu_mul: weight.size(2) must equal x.size(1) = ", K, ", got ",
           weight.size(2));
  DX_CHECK(I2 % 2 == 0, "moe_gemv_silu_mul: weight.size(1) = 2I must be even, got ", I2);
  const int64_t I = I2 / 2;
  DX_CHECK(x.stride(1) == 1 && (M <= 1 || (x.stride(0) >= K && x.stride(0) % 8 == 0)),
           "x must have contiguous rows with a stride that is a multiple of 8, got strides ", x.strides());
  DX_CHECK_ALIGNED16(x);
  check_ids("moe_gemv_silu_mul", ids, M, x);
  const int64_t k = ids.size(1);
  DX_CHECK(out.is_cuda() && out.device() == x.device(), "out must be a CUDA tensor on ", x.device(), ", got ",
           out.device());
  DX_CHECK_DTYPE(out, at::kBFloat16);
  DX_CHECK_SHAPE(out, M, k, I);
  DX_CHECK_CONTIGUOUS(out);
  DX_CHECK(M * k <= 65535, "moe_gemv_silu_mul: M * k = ", M * k, " (row, expert) pairs is more than one grid "
           "column holds (65535)");
  DX_CHECK(!spans_overlap(out, x) && !spans_overlap(out, ids) && !spans_overlap(out, weight),
           "moe_gemv_silu_mul: out must not overlap x, weight or ids");
  const float eps = rms_eps ? check_rms_eps("moe_gemv_silu_mul", *rms_eps) : 0.f;
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const dim3 grid(static_cast<unsigned>(ceil_div(I, kMoeWarps)), static_cast<unsigned>(M * k));
  const cudaError_t err = launch_pdl(
      rms_eps ? moe_gemv_silu_mul_kernel<true> : moe_gemv_silu_mul_kernel<false>, grid, dim3(kMoeWarps * 32),
      0, current_stream(), reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), M <= 1 ? K : x.stride(0),
      reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr()), ids.data_ptr<int>(), static_cast<int>(k),
      static_cast<int>(E), static_cast<int>(I), static_cast<int>(K), eps,
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
  DX_CHECK_LAUNCHED(err, "moe_gemv_silu_mul");
  DX_CHECK_LAUNCH("moe_gemv_silu_mul");
}

void moe_gemv_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                  const at::Tensor& weights, at::Tensor& out, bool accumulate, bool prefetch_weight) {
  DX_CHECK_CUDA(x);
  DX_CHECK_DTYPE(x, at::kBFloat16);
  DX_CHECK_DIM(x, 3);
  const int64_t M = x.size(0), k = x.size(1), I = x.size(2);
  DX_CHECK_CONTIGUOUS(x);
  DX_CHECK_ALIGNED16(x);
  check_experts("moe_gemv_sum", weight, x);
  const int64_t E = weight.size(0), N = weight.size(1);
  DX_CHECK(weight.size(2) == I, "moe_gemv_sum: weight.size(2) must equal x.size(2) = ", I, ", got ",
           weight.size(2));
  check_ids("moe_gemv_sum", ids, M, x);
  DX_CHECK(ids.size(1) == k, "moe_gemv_sum: ids must have shape [M, k] = [", M, ", ", k, "] (x's first two "
           "dims), got ", ids.sizes());
  DX_CHECK(weights.is_cuda() && weights.device() == x.device(), "weights must be a CUDA tensor on ",
           x.device(), ", got ", weights.device());
  DX_CHECK_DTYPE(weights, at::kFloat);
  DX_CHECK_SHAPE(weights, M, k);
  DX_CHECK_CONTIGUOUS(weights);
  DX_CHECK(out.is_cuda() && out.device() == x.device(), "out must be a CUDA tensor on ", x.device(), ", got ",
           out.device());
  DX_CHECK_DTYPE(out, at::kBFloat16);
  DX_CHECK_DIM(out, 2);
  DX_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [M, N] = [", M, ", ", N, "], got ",
           out.sizes());
  DX_CHECK(out.stride(1) == 1 && (M <= 1 || out.stride(0) >= N),
           "out must have contiguous rows, got strides ", out.strides());
  DX_CHECK(M <= 65535, "moe_gemv_sum: M = ", M, " rows is more than one grid column holds (65535)");
  DX_CHECK(!spans_overlap(out, x) && !spans_overlap(out, ids) && !spans_overlap(out, weights) &&
               !spans_overlap(out, weight),
           "moe_gemv_sum: out must not overlap x, weight, ids or weights");
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const dim3 grid(static_cast<unsigned>(ceil_div(N, kMoeWarps)), static_cast<unsigned>(M));
  // Up to two waves of 2 blocks an SM (M <= 2 at Qwen3-30B-A3B's N): three buffers; more: two (3
  // blocks an SM).
  const bool deep = static_cast<int64_t>(grid.x) * grid.y <= 4 * sm_count(x.device().index());
  const cudaError_t err = launch_pdl(
      deep ? moe_gemv_sum_kernel<3> : moe_gemv_sum_kernel<2>, grid, dim3(kMoeWarps * 32), 0, current_stream(),
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr()), ids.data_ptr<int>(),
      weights.data_ptr<float>(), static_cast<int>(k), static_cast<int>(E), static_cast<int>(N),
      static_cast<int>(I), accumulate, prefetch_weight, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
      M <= 1 ? N : out.stride(0));
  DX_CHECK_LAUNCHED(err, "moe_gemv_sum");
  DX_CHECK_LAUNCH("moe_gemv_sum");
}

}  // namespace decodex
