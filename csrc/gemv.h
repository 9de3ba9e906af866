// The GEMV launcher shared by the ops built on decodex's GEMV kernel (csrc/gemv_kernel.cuh): gemv,
// gemv_silu_mul (gemv.cu) and gemv_rope_append (rope_append.cu). Each op checks its own arguments
// and picks an epilogue; the configuration and the launch are gemv.cu's.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>
#include <cuda_bf16.h>

#include <array>
#include <optional>

namespace decodex {

// What the GEMV does with its fp32 results.
enum class GemvEpilogue : int {
  kStore = 0,       // out[m, n] = bf16(acc + bias[n])
  kSiluMul = 1,     // weight [2I, K] = [gate; up]: out[m, i] = silu(bf16 gate) * bf16 up
  kRopeAppend = 2,  // weight = q|k|v rows: out = q|k|v with q, k rotated; k, v appended to the cache
};

// kRopeAppend's extra arguments (rope_append's, minus q/k/v, which are the GEMV's output rows).
struct RopeAppendArgs {
  const float* inv_freq = nullptr;  // [D/2]
  const int* positions = nullptr;   // [M]: row m's position; < 0 or >= S: no rotation, no append
  __nv_bfloat16* k_cache = nullptr;  // [M, Hkv, S, D], strides (kc_b, kc_h, D, 1)
  __nv_bfloat16* v_cache = nullptr;  // [M, Hkv, S, D], strides (vc_b, vc_h, D, 1)
  int64_t kc_b = 0, kc_h = 0, vc_b = 0, vc_h = 0;
  int H = 0, Hkv = 0, S = 0, D = 0;
};

// The options every GEMV op takes (the schema arguments of the same names, see bindings.cpp).
struct GemvOptions {
  // The kernel just before on the stream does not write the weight (nor kRopeAppend's bias and
  // inv_freq): the GEMV may load its first weights (and those) before that kernel has finished
  // (see gemv_kernel.cuh).
  bool prefetch_weight = false;
  // If set, each product row is scaled by 1/rms(x row) = rsqrt(mean(x^2) + rms_eps) before the bias.
  std::optional<float> rms_eps;
  // kStore only: out += the product (rounded to bf16 first, as gemv then an add would round).
  bool accumulate = false;
  // (wr, wk, c, u) of gemv.cu's kernel, chosen by the caller (the schemas' `config`) instead of the
  // built-in choice; DECODEX_GEMV_CONFIG, the tuning knob, still overrides it. At most 8 rows of x.
  std::optional<std::array<int, 4>> config;
  // gemv only: the kernel lets the next kernel on the stream launch before it waits for the kernel
  // ahead (griddepcontrol.launch_dependents before .wait), so the next kernel's loads before its own
  // wait (a GEMV's prefetch_weight) overlap the kernel ahead of this one, and not only this one.
  // The caller promises that the next kernel reads before its wait nothing that the kernel ahead
  // writes. It pays where the kernel ahead leaves the memory bus idle: the decode step sets it on
  // the o projection, whose kernel ahead is the attention's merge. DECODEX_GEMV_DEPENDENTS_EARLY,
  // the A/B knob ("0" or "1" for every shape, or "N,K:0;N,K:1;..."), overrides it, and reaches
  // gemv_silu_mul's and gemv_rope_append's launches too (launch_gemv reads it for every epilogue).
  bool launch_dependents_early = false;
  // gemv and gemv_silu_mul (1 to 100; 0: off): the next kernel may launch only once every block
  // has triggered, not right after the wait, and a block triggers when the first of its warps has
  // issued the loads of this percentage of its main loop's trips (a block's first
  // griddepcontrol.launch_dependents is the one that counts; 100: as the blocks exit). The next
  // kernel's loads before its wait (prefetch_weight) then come as this product's own drain,
  // instead of early beside them (then DRAM idles between this kernel's last loads and the next
  // one's first after its wait). It pays where this product is large and the next kernel's blocks
  // fit beside its own: the decode step sets it on Qwen2.5-1.5B's gate|up and down
  // (bench/RESULTS.md, session 57). The ops reject it beside launch_dependents_early; where the
  // knobs combine them, early wins (the first trigger counts). One row of x only: the instances of
  // more rows (whose registers are all taken at u = 8) and the wgmma kernel ignore it, as a hint
  // may be ignored.
  // DECODEX_GEMV_DEPENDENTS_AFTER (a percentage for every shape, or "N,K:pct;..."), the A/B knob,
  // overrides it and reaches gemv_rope_append's launches too.
  int launch_dependents_after = 0;
};

// Rows of x the plain gemv takes (kStore without RMS); the fused epilogues and rms_eps take 8.
constexpr int kMaxRowsWide = 64;

// x, weight and out of a linear op (gemv's and lt_linear's): CUDA, on one device, bf16, 2-D.
void check_linear_tensors(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
// x [M, K] (1 <= M <= max_m), weight [rows, K] and out: the checks every GEMV op shares (`op`
// names the op).
void check_gemv_x_weight(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& out, int64_t max_m = 8);
// out [M, n_out] with a dense last dim and non-overlapping rows.
void check_gemv_out(const at::Tensor& out, int64_t M, int64_t n_out);
// bias: none, or [N] bf16 contiguous on x's device (x_name: what the messages call x; rope_append
// checks its bias against q); returns its pointer (nullptr for none). lt_linear checks its bias so too.
const __nv_bfloat16* check_gemv_bias(const std::optional<at::Tensor>& bias, const at::Tensor& x,
                                     int64_t N, const char* x_name = "x");
// The options from the schema arguments: rms_eps none or finite and >= 0; config none or four
// values for at most kMaxRows rows of x (launch_gemv checks them against the device);
// launch_dependents_after 0 to 100, and 0 with launch_dependents_early; and x must not overlap out
// (the kernel reads x while other blocks write out).
GemvOptions gemv_options(const char* op, const at::Tensor& x, const at::Tensor& out,
                         bool prefetch_weight, std::optional<double> rms_eps,
                         bool accumulate = false, at::OptionalIntArrayRef config = std::nullopt,
                         bool launch_dependents_early = false, int64_t launch_dependents_after = 0);
// Launches the GEMV of x and weight with the given epilogue (rope: kRopeAppend's arguments).
void launch_gemv(const char* op, const at::Tensor& x, const at::Tensor& weight,
                 const __nv_bfloat16* bias, at::Tensor& out, GemvEpilogue epilogue,
                 const GemvOptions& options, const RopeAppendArgs& rope = {});

// The wgmma GEMV (csrc/gemv_wide.cu): gemv's kStore product (no rms_eps) for kWgmmaMinRows + 1 ..
// kMaxRowsWide rows of x, and gemv_silu_mul's kSiluMul product (rms_eps allowed) for 9 ..
// kMaxRowsWide rows, checked by the caller (`op` names it). It needs a build with sm_90a code
// (DECODEX_SM90A, set by setup.py) and a device of compute capability 9.0; elsewhere gemv.cu's
// wide variants serve gemv's rows and gemv_silu_mul takes at most 8. At 9..16 rows gemv.cu's are
// faster on the small products (bench/RESULTS.md, session 13).
constexpr int kWgmmaMinRows = 16;
bool gemv_wgmma_available(int device);
// Whether gemv's M rows of x times the weight [N, K] run on the wgmma kernel: where it is available,
// above kWgmmaMinRows rows, except the small products (N <= 4608, K <= 4096) up to 32 rows; always
// when DECODEX_GEMV_WIDE_CONFIG forces one of its configurations for the shape.
bool gemv_prefers_wgmma(int64_t M, int64_t N, int64_t K, int device);
void launch_gemv_wide(const char* op, const at::Tensor& x, const at::Tensor& weight,
                      const __nv_bfloat16* bias, at::Tensor& out, GemvEpilogue epilogue,
                      const GemvOptions& options);

// A configuration forced through the environment variable `var` for tuning sweeps: "v1,...,vcount"
// for every shape, or entries "N,K:v1,...,vcount" separated by ';' for the weight shapes [N, K]
// they name. Returns whether one applies to [N, K] (the first entry naming it), its values in
// `values`; a malformed value is an error naming `var` and the `fields` ("wr,wk,c,u").
bool config_from_env(const char* var, const char* fields, int64_t N, int64_t K, int* values,
                     int count);

}  // namespace decodex
