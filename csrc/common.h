// Shared helpers for decodex's launchers: argument checks with messages that name the argument,
// the launch-error checks, programmatic dependent launch, and small device utilities used by more
// than one kernel.
// Kept light on purpose (no torch/all.h): every .cu includes it, and nvcc compile time matters on
// 2-core CI machines.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace decodex {

// Error messages. On the H200 test image, a failing TORCH_CHECK whose message streamed a number from
// this library crashed the process under pytest, while messages made only of strings raised as they
// should. The cause was not pinned down (our guess: the iostream number formatting of a second
// libstdc++ in the process). So every message is built here as one std::string, numbers through
// std::to_string / snprintf, and handed to TORCH_CHECK whole; with that, every argument-check test
// passes there. DX_CHECK(cond, parts...) is TORCH_CHECK with this formatting: use it in csrc/.
inline std::string shape_str(c10::IntArrayRef sizes);
namespace detail {
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(c10::IntArrayRef s) { return shape_str(s); }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const c10::Device& d) { return d.str(); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline std::string piece(T v) { return std::to_string(v); }
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline std::string piece(T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  return buf;
}
}  // namespace detail
template <typename... Parts>
inline std::string msg(const Parts&... parts) {
  std::string s;
  ((s += detail::piece(parts)), ...);
  return s;
}
#define DX_CHECK(cond, ...) TORCH_CHECK((cond), ::decodex::msg(__VA_ARGS__))

// Argument checks: the message always names the argument as the user spelled it in the schema.
#define DX_CHECK_CUDA(t) DX_CHECK((t).is_cuda(), #t " must be a CUDA tensor, got device ", (t).device())
#define DX_CHECK_DTYPE(t, dt) \
  DX_CHECK((t).scalar_type() == (dt), #t " must have dtype ", (dt), ", got ", (t).scalar_type())
#define DX_CHECK_DIM(t, d) \
  DX_CHECK((t).dim() == (d), #t " must be ", (d), "-D, got shape ", ::decodex::shape_str((t).sizes()))
#define DX_CHECK_CONTIGUOUS(t) \
  DX_CHECK((t).is_contiguous(), #t " must be contiguous, got strides ", (t).strides())
#define DX_CHECK_SAME_DEVICE(a, b) \
  DX_CHECK((a).device() == (b).device(), #a " and " #b " must be on the same device, got ", \
              (a).device(), " and ", (b).device())
#define DX_CHECK_SHAPE(t, ...) ::decodex::check_shape((t), #t, __VA_ARGS__)
// "[2, 3]", formatted without iostreams (see DX_CHECK).
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

template <typename... Sizes>
inline void check_shape(const at::Tensor& t, const char* name, Sizes... sizes) {
  const std::vector<int64_t> want{static_cast<int64_t>(sizes)...};
  DX_CHECK(t.sizes().vec() == want, name, " must have shape ", shape_str(want), ", got ",
              shape_str(t.sizes()));
}

// 16-byte vector loads need 16-byte aligned base pointers.
#define DX_CHECK_ALIGNED16(t)                                                   \
  DX_CHECK(reinterpret_cast<uintptr_t>((t).data_ptr()) % 16 == 0, #t       \
              " must be 16-byte aligned (its storage offset breaks vector loads)")

// After every launch: a bad configuration surfaces here, named by the op.
#define DX_CHECK_LAUNCH(op)                                                              \
  do {                                                                                   \
    cudaError_t err_ = cudaGetLastError();                                               \
    DX_CHECK(err_ == cudaSuccess, "decodex::" op " kernel launch failed: ",           \
                cudaGetErrorString(err_));                                               \
  } while (0)

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// rms_eps of the ops that scale rows by 1/rms(x) = rsqrt(mean(x^2) + rms_eps): finite and >= 0
// (rms_norm's argument is called eps: `name`).
inline float check_rms_eps(const char* op, double rms_eps, const char* name = "rms_eps") {
  DX_CHECK(std::isfinite(rms_eps) && rms_eps >= 0.0, "decodex::", op, ": ", name,
           " must be finite and >= 0, got ", rms_eps);
  return static_cast<float>(rms_eps);
}

// The optional rms_x [M, K] (with rms_eps) of silu_mul and rope_append: the rows whose 1/rms scales
// each row of an unscaled product first. Checks it (bf16 on ref's device, contiguous rows of a
// stride that is a multiple of 8, 16-byte aligned, K a positive multiple of 8) and returns its
// pointer (null without it), K and row stride.
struct RmsX {
  const void* ptr = nullptr;
  int64_t K = 0, stride = 0;
  float eps = 0.f;
};
inline RmsX check_rms_x(const char* op, const std::optional<at::Tensor>& rms_x,
                        std::optional<double> rms_eps, int64_t M, const at::Tensor& ref) {
  DX_CHECK(rms_x.has_value() == rms_eps.has_value(), op, ": rms_x and rms_eps go together (got only ",
           rms_x ? "rms_x" : "rms_eps", ")");
  RmsX r;
  if (!rms_x) return r;
  const at::Tensor& x = *rms_x;
  DX_CHECK(x.is_cuda() && x.device() == ref.device(), "rms_x must be a CUDA tensor on ", ref.device(),
           ", got ", x.device());
  DX_CHECK(x.scalar_type() == at::kBFloat16, "rms_x must have dtype BFloat16, got ", x.scalar_type());
  DX_CHECK(x.dim() == 2 && x.size(0) == M && x.size(1) > 0 && x.size(1) % 8 == 0 &&
               x.size(1) <= 0x7fffffff,
           "rms_x must have shape [M, K] with M = ", M, " and K a positive multiple of 8, got ",
           x.sizes());
  DX_CHECK(x.stride(1) == 1 && (M <= 1 || (x.stride(0) >= x.size(1) && x.stride(0) % 8 == 0)),
           "rms_x must have contiguous rows with a stride that is a multiple of 8, got strides ",
           x.strides());
  DX_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "rms_x must be 16-byte aligned");
  r.eps = check_rms_eps(op, *rms_eps);
  r.ptr = x.data_ptr();
  r.K = x.size(1);
  r.stride = M <= 1 ? 0 : x.stride(0);
  return r;
}

// Whether the memory spans of two tensors intersect (bytes from the first to past the last element).
inline bool spans_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size()));
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

// A device attribute, asked once per device (ordinals below 64) and cached; 0 stands for "not
// asked yet" (the attributes cached here are never 0).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device) {
  static std::atomic<int> cached[64];  // zero-initialized
  if (device >= 0 && device < 64) {
    const int v = cached[device].load(std::memory_order_relaxed);
    if (v) return v;
  }
  int n = 0;
  cudaDeviceGetAttribute(&n, kAttr, device);
  if (device >= 0 && device < 64) cached[device].store(n, std::memory_order_relaxed);
  return n;
}

inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Resident blocks per SM of `kernel` at `threads` threads a block (no dynamic shared memory),
// asked once and cached in `slot` (0: not asked yet; the count is stored + 1). Occupancy depends on
// the architecture only; decodex runs on one kind of GPU per process. `op` names the caller.
inline int cached_blocks_per_sm(std::atomic<int>& slot, const void* kernel, int threads, const char* op) {
  int n = slot.load(std::memory_order_relaxed);
  if (n == 0) {
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0);
    DX_CHECK(err == cudaSuccess, "decodex::", op, ": occupancy query failed: ", cudaGetErrorString(err));
    n = (n > 0 ? n : 0) + 1;
    slot.store(n, std::memory_order_relaxed);
  }
  return n - 1;
}

// Sets `attr` of `kernel` on `device` (the current device) to `value`, unless the value last set
// there already serves: it is at least `value` when `at_least`, else equal to it. A kernel attribute
// is host-side state of the device, no stream work (fine during CUDA-graph capture). Returns the
// error of the setting (cudaSuccess when nothing needed setting).
inline cudaError_t set_kernel_attribute(const void* kernel, int device, cudaFuncAttribute attr,
                                        int value, bool at_least) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> last;  // (kernel, device, attr) -> value
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kernel, device, static_cast<int>(attr));
  const auto it = last.find(key);
  if (it != last.end() && (at_least ? value <= it->second : value == it->second)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, attr, value);
  if (err == cudaSuccess) last[key] = value;
  return err;
}

// Lets `kernel` launch with up to `bytes` of dynamic shared memory on `device` (the current device):
// set only when a call needs more than the kernel was allowed before. `op` names the caller.
inline void allow_dynamic_smem(const void* kernel, int bytes, int device, const char* op) {
  const cudaError_t err = set_kernel_attribute(
      kernel, device, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes, /*at_least=*/true);
  DX_CHECK(err == cudaSuccess, "decodex::", op, ": could not allow ", bytes,
           " bytes of shared memory a block: ", cudaGetErrorString(err));
}

// ---- programmatic dependent launch (PDL) ----
// Every decodex kernel starts with pdl_begin(): griddepcontrol.wait blocks until the kernel before
// it in the stream has finished and its writes are visible, then griddepcontrol.launch_dependents
// lets the next kernel's blocks be scheduled. Launched through launch_pdl, a kernel's launch and
// block scheduling thus overlap the tail of the kernel before it (in a CUDA graph too), which is most
// of the cost of the many small kernels of a decode step. By default nothing but L2 prefetches
// touches global memory before the wait, so the order of reads and writes is exactly that of plain
// launches. Without the launch attribute both instructions do nothing. DECODEX_PDL=0 turns the
// attribute off (read once).
// A kernel that can do useful work before the wait calls pdl_wait() and pdl_trigger() itself, in
// that order, after that work: L2 prefetches of a GEMV's weights (safe at any time: L2 is the GPU's
// point of coherence), and, only where the caller promises that the kernel ahead writes none of
// them, loads into registers of the GEMV's weights (prefetch_weight) or of decode attention's
// older cache rows (prefetch_cache). Every kernel triggers after its wait (a gemv with
// launch_dependents_after later still, in its main loop), so the kernel ahead is the only one that
// can still be running, except after a gemv with launch_dependents_early, which triggers first
// (gemv.h): the decode step's o product, so that gate|up loads its first weights while the
// attention's merge leaves the memory bus idle (bench/RESULTS.md, session 55). Triggering first in
// the attention's kernels, or in every GEMV, was measured slower in the decode step (sessions 8, 19
// and 55).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_trigger();
}

// An environment switch of two values: nullopt where `name` is unset or empty, else whether it is
// `on` rather than `off`; any other value is an error naming the switch (so "false" is never a
// silent "on").
inline std::optional<bool> env_switch(const char* name, const char* off, const char* on) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  const std::string v(env);
  DX_CHECK(v == off || v == on, name, " must be ", off, " or ", on, " (or unset), got \"", v, "\"");
  return v == on;
}

// DECODEX_PDL=0 launches every kernel without PDL (=1 or unset: with it). Read at the first launch
// and kept for the process; a bad value fails every launch, naming the switch.
inline bool pdl_enabled() {
  static const bool enabled = env_switch("DECODEX_PDL", "0", "1").value_or(true);
  return enabled;
}

// ---- the shared-memory carveout ----
// Each SM splits 256 KB between shared memory and L1. A kernel's split preference is only a hint,
// and by our reading an SM changes its split only while idle: with programmatic dependent launch the
// next kernel's blocks join an SM that still runs the kernel before, under that kernel's split. The
// register GEMVs keep their weight loads in flight in L1, and the decode step measured so (bench/
// RESULTS.md, session 23, one split forced on every kernel): against the driver's own choices a
// 100 KB shared-memory split made the 7B step 0.5-0.7% faster at batch 1 (three runs of four) and
// 2.5% at batch 8, and moved 1.5B's by -0.3 to +0.4%; 132 KB made the 7B step 5% slower, 164 KB
// 15-29%, and a 228 KB split on the kernels other than the GEMVs alone 8.5% (the GEMVs then ran
// under it). So every decodex kernel without dynamic shared memory asks for the same 100 KB split
// (kCarveoutPercent: percent of the 228 KB maximum, which the driver rounds up to its 100 KB
// configuration), and the kernels that size their shared memory at launch (the wgmma GEMV,
// rope_append_attention's ring) keep the driver's choice. DECODEX_CARVEOUT=<percent> (-1: the
// driver's default) replaces kCarveoutPercent, read per launch (A/B runs of the step).
constexpr int kCarveoutPercent = 44;

inline void apply_carveout(const void* kernel) {
  const char* env = std::getenv("DECODEX_CARVEOUT");
  int want = kCarveoutPercent;
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    DX_CHECK(*end == '\0' && v >= -1 && v <= 100,
             "DECODEX_CARVEOUT must be a percent from 0 to 100 or -1 (the driver's default), got \"",
             env, "\"");
    want = static_cast<int>(v);
  }
  int device = 0;
  DX_CHECK(cudaGetDevice(&device) == cudaSuccess, "decodex: no current CUDA device");
  const cudaError_t err = set_kernel_attribute(
      kernel, device, cudaFuncAttributePreferredSharedMemoryCarveout, want, /*at_least=*/false);
  DX_CHECK(err == cudaSuccess, "decodex: could not set a kernel's shared-memory carveout to ", want,
           "%: ", cudaGetErrorString(err));
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute and, when cluster_x > 1,
// thread-block clusters of (cluster_x, 1, 1) (sm_90); returns the launch error.
template <typename... Params, typename... Args>
inline cudaError_t launch_pdl_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                       cudaStream_t stream, unsigned cluster_x, Args&&... args) {
  if (smem == 0) apply_carveout(reinterpret_cast<const void*>(kernel));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute; returns the launch error.
template <typename... Params, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  return launch_pdl_clusters(kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

// After launch_pdl: a failed launch names the op.
#define DX_CHECK_LAUNCHED(err, op) \
  DX_CHECK((err) == cudaSuccess, "decodex::" op " kernel launch failed: ", cudaGetErrorString(err))

// ---- device utilities ----

// 8 bf16 values moved as one 16-byte vector.
// SwiGLU of one element, each step rounded as torch's silu(g) * u in fp32 is: silu_mul and the
// gemv_silu_mul epilogue both use it, so the fused op equals gemv then silu_mul bit for bit.
__device__ __forceinline__ float silu_times(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

// RoPE (half-split "rotate_half" layout) of the pair (x1, x2) = (x[i], x[i + D/2]) at `pos`:
// angle = pos * inv_freq[i] in fp32, precise sincosf, separately rounded products and sums; the
// same fp32 bits as decodex.reference.rope. rope_append and the gemv_rope_append epilogue use it.
__device__ __forceinline__ void rope_cos_sin(int pos, float inv_freq_i, float& c, float& s) {
  sincosf(__fmul_rn(static_cast<float>(pos), inv_freq_i), &s, &c);
}

__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& o1,
                                            float& o2) {
  o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

struct alignas(16) bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void bf16x8_to_float(const bf16x8& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = __bfloat1622float2(v.h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ bf16x8 float_to_bf16x8(const float (&f)[8]) {
  bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// The rms_x / bias step of rope_append (and rope_append_attention) on 8 values: unpacked to fp32 and,
// if scaled or biased, multiplied by scale, bias[0..8) added and the sum rounded to bf16, as gemv's
// rms_eps and bias epilogue stores its product.
__device__ __forceinline__ void scale_bias_round8(const bf16x8& raw, bool scaled, float scale,
                                                  const __nv_bfloat16* bias, float (&f)[8]) {
  bf16x8_to_float(raw, f);
  if (!scaled && bias == nullptr) return;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float y = __fmul_rn(f[j], scale);  // scale is 1 when not scaled: exact
    if (bias != nullptr) y = __fadd_rn(y, __bfloat162float(bias[j]));
    f[j] = __bfloat162float(__float2bfloat16_rn(y));
  }
}

// 1 / rms from a row's fp32 sum of squares (precise division and rsqrtf, no fast-math), as
// decodex.reference.inv_rms computes it: rms_norm and the GEMV's rms_eps scale share it.
__device__ __forceinline__ float rms_inv(float sumsq, int K, float eps) {
  return rsqrtf(__fadd_rn(__fdiv_rn(sumsq, static_cast<float>(K)), eps));
}

// Qwen3's norm of one q or k head (rope_append, rope_append_attention), on one work item's 16 values
// of it (x1: elements c0..c0+7, x2: half+c0..; w1, w2: the norm weight's same elements, loaded by
// the caller): the head's fp32 sum of squares over its `slices` items, which are `slices` aligned
// consecutive lanes of one warp, all active (items come in whole heads, and blockDim.x is a multiple
// of 32, which `slices` divides: the host checks D/16 is a power of two up to 32); then each value
// times 1/rms(head) times w, rounded to bf16 as decodex.reference.rms_norm stores it. Every lane of
// the group gets the same sum (a butterfly of commutative adds), so the two halves agree.
__device__ __forceinline__ void head_rms_norm(float (&x1)[8], float (&x2)[8], const bf16x8& w1raw,
                                              const bf16x8& w2raw, int half, int slices, float eps) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = __fmaf_rn(x1[j], x1[j], ss);
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = __fmaf_rn(x2[j], x2[j], ss);
  const int lane = threadIdx.x & 31;
  const unsigned group =
      slices == 32 ? 0xffffffffu : ((1u << slices) - 1u) << (lane & ~(slices - 1));
  for (int o = 1; o < slices; o <<= 1) ss = __fadd_rn(ss, __shfl_xor_sync(group, ss, o));
  const float inv = rms_inv(ss, 2 * half, eps);
  float w1[8], w2[8];
  bf16x8_to_float(w1raw, w1);
  bf16x8_to_float(w2raw, w2);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    x1[j] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(x1[j], inv), w1[j])));
    x2[j] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(x2[j], inv), w2[j])));
  }
}

// Adds the squares of 8 values to sumsq in index order (fused multiply-adds).
__device__ __forceinline__ float add_squares8(const bf16x8& x, float sumsq) {
  float a[8];
  bf16x8_to_float(x, a);
#pragma unroll
  for (int e = 0; e < 8; ++e) sumsq = __fmaf_rn(a[e], a[e], sumsq);
  return sumsq;
}

// This thread's share of the sum of squares of row[0, K) (K a multiple of 8, 16-byte aligned): the
// 8-element groups threadIdx.x, threadIdx.x + blockDim.x, ... in that order (block_sum adds the
// shares up), loaded kSquaresBatch at a time so that their round trips overlap. load_squares issues
// the first batch (a kernel may put other loads behind it before it needs the sum); sum_squares adds
// it and the rest. Absent groups are zeros, which add nothing.
constexpr int kSquaresBatch = 4;
struct SquaresLoads {
  bf16x8 v[kSquaresBatch];
};
__device__ __forceinline__ void load_squares_batch(const __nv_bfloat16* row, int K, int j0,
                                                   SquaresLoads& l) {
#pragma unroll
  for (int u = 0; u < kSquaresBatch; ++u) {
    const int j = j0 + u * static_cast<int>(blockDim.x);
    l.v[u] = j < K / 8 ? reinterpret_cast<const bf16x8*>(row)[j] : bf16x8{};
  }
}
__device__ __forceinline__ void load_squares(const __nv_bfloat16* row, int K, SquaresLoads& l) {
  load_squares_batch(row, K, threadIdx.x, l);
}
__device__ __forceinline__ float sum_squares(const __nv_bfloat16* row, int K, SquaresLoads l) {
  float ss = 0.f;
  for (int j0 = threadIdx.x;;) {
#pragma unroll
    for (int u = 0; u < kSquaresBatch; ++u) ss = add_squares8(l.v[u], ss);
    j0 += kSquaresBatch * blockDim.x;
    if (j0 >= K / 8) return ss;
    load_squares_batch(row, K, j0, l);
  }
}
__device__ __forceinline__ float thread_sum_squares(const __nv_bfloat16* row, int K) {
  SquaresLoads l;
  load_squares(row, K, l);
  return sum_squares(row, K, l);
}

// Reductions over a warp or a whole block with an associative op (Sum, Max below). A block
// reduction needs blockDim.x a multiple of 32 (at most 1024) and 32 Ts of shared `scratch`;
// `identity` stands in for absent warps. Every thread gets the result.
struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ unsigned long long operator()(unsigned long long a,
                                                           unsigned long long b) const {
    return a > b ? a : b;
  }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, Op op, T identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : identity;
  return warp_reduce(v, op);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, scratch, Sum{}, 0.f);
}

}  // namespace decodex
