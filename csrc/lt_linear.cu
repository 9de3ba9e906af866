// lt_linear: out[M, N] (+)= x[M, K] @ weight[N, K]^T (+ bias[N]) by cuBLASLt, with the algorithm
// picked by the caller from a list of candidates, bf16 in and out, fp32 accumulation.
//
// Why: the batched decode step (more than 8 rows) runs its products on cuBLAS, and torch takes
// the first answer of cuBLAS's heuristic. For the skinny products of decode (M = 16..64 rows,
// weight-bound) that answer is often not the fastest: on the H200 at 64 rows the 1.5B gate|up
// product took 20.1 us on cuBLAS and 17.7 on the best of the list below (7B: 74.6 and 70.7;
// `python -m bench.lt_linear --ms 64`, bench/RESULTS.md, session 17). So the list is exposed and
// the caller times it: the engine times
// every candidate over all layers' weights in a CUDA graph, as its other plans are timed.
//
// The candidates of a problem (shapes, strides, pointer alignments, accumulate, bias, workspace
// size, device) are computed once and cached for the process: the heuristic's first kHeuristic
// answers, then each of the first kVaried of them with split-K forced to 1, 2, 4, 8 and 16 under
// both out-of-place (fp32 workspace, a reduce kernel) and in-place reductions, where cuBLASLt
// accepts that configuration (cublasLtMatmulAlgoCheck), duplicates dropped. The order is fixed for
// a problem, so an index chosen once stays valid. No host sync and no allocation per call (the
// workspace is the caller's), so calls capture in CUDA graphs.
//
// Column-major view (cuBLAS's): out^T [N, M] = weight [N, K] (op T of the row-major [N, K] as a
// K x N column-major matrix) times x^T [K, M].
#include <cublasLt.h>

#include <cstring>
#include <tuple>

#include "common.h"
#include "gemv.h"
#include "ops.h"

namespace decodex {
namespace {

constexpr int kHeuristic = 16;  // the heuristic's answers kept
constexpr int kVaried = 3;      // of which this many also get forced split-K variants
constexpr int kSplitKs[] = {1, 2, 4, 8, 16};

#define DX_CHECK_LT(call, what)                                                                \
  do {                                                                                         \
    const cublasStatus_t st_ = (call);                                                         \
    DX_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "decodex::lt_linear: ", what, " failed: cuBLAS status ", \
             static_cast<int>(st_));                                                           \
  } while (0)

// The largest power of two (at most 256) dividing a pointer: cuBLASLt's algorithms state the
// alignment they need, and the candidates are those that work at the arguments' alignment.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

// One problem as cuBLASLt sees it.
struct Problem {
  int device;
  int64_t M, N, K, ldx, ldw, ldo;
  bool accumulate, bias;
  uint32_t align_x, align_w, align_o;
  int64_t workspace;
  bool operator<(const Problem& o) const {
    return std::tie(device, M, N, K, ldx, ldw, ldo, accumulate, bias, align_x, align_w, align_o, workspace) <
           std::tie(o.device, o.M, o.N, o.K, o.ldx, o.ldw, o.ldo, o.accumulate, o.bias, o.align_x, o.align_w,
                    o.align_o, o.workspace);
  }
};

// cublasLtMatmulAlgo_t is a typedef of an unnamed struct, which nvcc 13.0's front end cannot hold
// in a std::vector under C++20 (an internal error); a named wrapper can.
struct Algo {
  cublasLtMatmulAlgo_t algo;
};

cublasLtHandle_t handle(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h;
  DX_CHECK_LT(cublasLtCreate(&h), "cublasLtCreate");
  handles[device] = h;  // kept for the process
  return h;
}

// The descriptors of one call (host objects, cheap; made per call so calls on several threads
// share nothing but the cached candidates).
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, o = nullptr;
  Descs(const Problem& p, const void* bias_ptr) {
    DX_CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    DX_CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "TRANSA");
    DX_CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "TRANSB");
    if (p.bias) {
      const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
      DX_CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "EPILOGUE");
      const cudaDataType_t bt = CUDA_R_16BF;
      DX_CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)),
                  "BIAS_DATA_TYPE");
      DX_CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                 sizeof(bias_ptr)), "BIAS_POINTER");
    }
    DX_CHECK_LT(cublasLtMatrixLayoutCreate(&w, CUDA_R_16BF, p.K, p.N, p.ldw), "layout of weight");
    DX_CHECK_LT(cublasLtMatrixLayoutCreate(&x, CUDA_R_16BF, p.K, p.M, p.ldx), "layout of x");
    DX_CHECK_LT(cublasLtMatrixLayoutCreate(&o, CUDA_R_16BF, p.N, p.M, p.ldo), "layout of out");
  }
  ~Descs() {
    cublasLtMatrixLayoutDestroy(o);
    cublasLtMatrixLayoutDestroy(x);
    cublasLtMatrixLayoutDestroy(w);
    cublasLtMatmulDescDestroy(op);
  }
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;
};

std::vector<Algo> find_candidates(const Problem& p, cublasLtHandle_t h) {
  Descs d(p, nullptr);
  cublasLtMatmulPreference_t pref;
  DX_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = static_cast<uint64_t>(p.workspace);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align_w},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align_o},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align_o}};
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &ws, sizeof(ws));
  for (const auto& a : aligns) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, a.first, &a.second, sizeof(a.second));
  }
  cublasLtMatmulHeuristicResult_t found[kHeuristic];
  int n = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    // NOT_SUPPORTED: no algorithm for this problem, an empty list.
    st = cublasLtMatmulAlgoGetHeuristic(h, d.op, d.w, d.x, d.o, d.o, pref, kHeuristic, found, &n);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) st = CUBLAS_STATUS_SUCCESS, n = 0;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  DX_CHECK_LT(st, "the algorithm heuristic");

  std::vector<Algo> out;
  auto add = [&](const cublasLtMatmulAlgo_t& a) {
    for (const Algo& b : out) {
      if (std::memcmp(&a, &b.algo, sizeof(a)) == 0) return;
    }
    out.push_back(Algo{a});
  };
  for (int i = 0; i < n; ++i) {
    if (found[i].state == CUBLAS_STATUS_SUCCESS) add(found[i].algo);
  }
  const uint32_t schemes[] = {CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_INPLACE};
  for (int i = 0; i < std::min(n, kVaried); ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    for (const int split : kSplitKs) {
      for (const uint32_t scheme : schemes) {
        cublasLtMatmulAlgo_t a = found[i].algo;
        const int32_t s = split;
        const uint32_t sc = split == 1 ? CUBLASLT_REDUCTION_SCHEME_NONE : scheme;
        if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s, sizeof(s)) !=
                CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &sc, sizeof(sc)) !=
                CUBLAS_STATUS_SUCCESS) {
          continue;
        }
        cublasLtMatmulHeuristicResult_t check;
        if (cublasLtMatmulAlgoCheck(h, d.op, d.w, d.x, d.o, d.o, &a, &check) == CUBLAS_STATUS_SUCCESS &&
            check.workspaceSize <= ws) {
          add(a);
        }
      }
    }
  }
  return out;
}

// The problem of these arguments, checked.
Problem problem_of(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias_opt,
                   const at::Tensor& out, const at::Tensor& workspace, bool accumulate) {
  check_linear_tensors(x, weight, out);
  DX_CHECK_CUDA(workspace);
  DX_CHECK_SAME_DEVICE(x, workspace);
  DX_CHECK_DTYPE(workspace, at::kByte);
  DX_CHECK_DIM(workspace, 1);
  DX_CHECK_CONTIGUOUS(workspace);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  DX_CHECK(M >= 1 && K >= 1 && N >= 1, "decodex::lt_linear: x [M, K] and weight [N, K] must be non-empty, got ",
           x.sizes(), " and ", weight.sizes());
  DX_CHECK(weight.size(1) == K, "weight must have shape [N, K] with K = x.size(1) = ", K, ", got ",
           weight.sizes());
  DX_CHECK_SHAPE(out, M, N);
  // Row-major with contiguous rows; a row stride of at least the row (views of wider buffers).
  DX_CHECK(x.stride(1) == 1 && (M == 1 || x.stride(0) >= K), "x must have contiguous rows, got strides ",
           x.strides());
  DX_CHECK(weight.stride(1) == 1 && (N == 1 || weight.stride(0) >= K),
           "weight must have contiguous rows, got strides ", weight.strides());
  DX_CHECK(out.stride(1) == 1 && (M == 1 || out.stride(0) >= N), "out must have contiguous rows, got strides ",
           out.strides());
  DX_CHECK(!spans_overlap(x, out) && !spans_overlap(weight, out), "decodex::lt_linear: out must not overlap x or weight");
  DX_CHECK(K <= 0x7fffffff && N <= 0x7fffffff && M <= 0x7fffffff, "decodex::lt_linear: sizes too large");
  Problem p{};
  p.device = x.get_device();
  p.M = M, p.N = N, p.K = K;
  p.ldx = M == 1 ? K : x.stride(0);
  p.ldw = N == 1 ? K : weight.stride(0);
  p.ldo = M == 1 ? N : out.stride(0);
  p.accumulate = accumulate;
  p.align_x = alignment(x.data_ptr());
  p.align_w = alignment(weight.data_ptr());
  p.align_o = alignment(out.data_ptr());
  p.bias = check_gemv_bias(bias_opt, x, N) != nullptr;
  // cuBLASLt's alignment preferences cover x, weight and out but not the epilogue's bias, and a
  // candidate may load it 16 bytes at a time ("misaligned address", which ends the CUDA context).
  DX_CHECK(!p.bias || reinterpret_cast<uintptr_t>(bias_opt->data_ptr()) % 16 == 0,
           "decodex::lt_linear: bias must be 16-byte aligned (its storage offset breaks cuBLASLt's "
           "vector loads)");
  p.workspace = workspace.numel();
  return p;
}

const std::vector<Algo>& candidates(const Problem& p) {
  static std::mutex mu;
  static std::map<Problem, std::vector<Algo>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(p);
  if (it == cache.end()) it = cache.emplace(p, find_candidates(p, handle(p.device))).first;
  return it->second;  // std::map never moves its elements
}

}  // namespace

int64_t lt_linear_algos(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const at::Tensor& out, const at::Tensor& workspace, bool accumulate) {
  const Problem p = problem_of(x, weight, bias, out, workspace, accumulate);
  const c10::cuda::CUDAGuard guard(x.device());
  return static_cast<int64_t>(candidates(p).size());
}

void lt_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               at::Tensor& out, at::Tensor& workspace, int64_t algo, bool accumulate) {
  const Problem p = problem_of(x, weight, bias, out, workspace, accumulate);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto& list = candidates(p);
  DX_CHECK(algo >= 0 && algo < static_cast<int64_t>(list.size()), "decodex::lt_linear: algo must be in [0, ",
           list.size(), ") for this problem (lt_linear_algos), got ", algo);
  Descs d(p, bias ? bias->data_ptr() : nullptr);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  const cublasStatus_t st =
      cublasLtMatmul(handle(p.device), d.op, &alpha, weight.data_ptr(), d.w, x.data_ptr(), d.x, &beta,
                     out.data_ptr(), d.o, out.data_ptr(), d.o, &list[algo].algo, workspace.data_ptr(),
                     static_cast<size_t>(p.workspace), current_stream());
  DX_CHECK(st == CUBLAS_STATUS_SUCCESS, "decodex::lt_linear: cublasLtMatmul failed with cuBLAS status ",
           static_cast<int>(st), " (algo ", algo, ")");
}

}  // namespace decodex
