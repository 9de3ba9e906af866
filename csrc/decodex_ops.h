// decodex ops for other C++ extensions. Header-only: each function calls the op through the torch
// dispatcher, so nothing links against decodex._C — but decodex must be loaded in the process
// (`import decodex` in Python, or torch.ops.load_library on decodex/_C*.so) before the first call.
// Include path: python -c "import decodex; print(decodex.include_dir())".
// Shapes and semantics: see the schema comments in decodex's csrc/bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace decodex_ops {

namespace detail {
template <typename Sig>
inline c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
}  // namespace detail

using T = at::Tensor;

using OptT = std::optional<T>;

using OptD = std::optional<double>;

using OptInts = at::OptionalIntArrayRef;

// prefetch_weight, rms_eps, accumulate, config, launch_dependents_early, launch_dependents_after:
// see the schemas in csrc/bindings.cpp (the weight is not written by the kernel just before this
// one on the stream; each product row is scaled by 1/rms(x row); out += the product; the kernel
// configuration [wr, wk, c, u] to launch; the next kernel may launch before this one waits for the
// kernel ahead; or only after this percentage of its main loop).
inline void gemv(const T& x, const T& weight, const OptT& bias, T& out,
                 bool prefetch_weight = false, OptD rms_eps = std::nullopt,
                 bool accumulate = false, OptInts config = std::nullopt,
                 bool launch_dependents_early = false, int64_t launch_dependents_after = 0) {
  static auto h = detail::op<void(const T&, const T&, const OptT&, T&, bool, OptD, bool, OptInts,
                                  bool, int64_t)>("decodex::gemv");
  h.call(x, weight, bias, out, prefetch_weight, rms_eps, accumulate, config, launch_dependents_early,
         launch_dependents_after);
}

inline void gemv_silu_mul(const T& x, const T& weight, T& out, bool prefetch_weight = false,
                          OptD rms_eps = std::nullopt, OptInts config = std::nullopt,
                          int64_t launch_dependents_after = 0) {
  static auto h = detail::op<void(const T&, const T&, T&, bool, OptD, OptInts, int64_t)>(
      "decodex::gemv_silu_mul");
  h.call(x, weight, out, prefetch_weight, rms_eps, config, launch_dependents_after);
}

// The most rows of x gemv_silu_mul takes on CUDA device `device` (64 or 8).
inline int64_t gemv_silu_mul_max_rows(int64_t device) {
  static auto h = detail::op<int64_t(int64_t)>("decodex::gemv_silu_mul_max_rows");
  return h.call(device);
}

// The configuration [wr, wk, c, u] gemv launches for a weight [N, K] and M = 1..8 rows of x when
// none is given, for a call with this prefetch_weight (no GPU needed; see the schema in
// csrc/bindings.cpp).
inline std::vector<int64_t> gemv_config(int64_t N, int64_t K, int64_t M, bool clusters = true,
                                        bool prefetch_weight = false) {
  static auto h = detail::op<std::vector<int64_t>(int64_t, int64_t, int64_t, bool, bool)>(
      "decodex::gemv_config");
  return h.call(N, K, M, clusters, prefetch_weight);
}

inline void rms_norm(const T& x, const T& weight, double eps, T& out) {
  static auto h = detail::op<void(const T&, const T&, double, T&)>("decodex::rms_norm");
  h.call(x, weight, eps, out);
}

inline void fused_add_rms_norm(const T& x, T& residual, const T& weight, double eps, T& out) {
  static auto h = detail::op<void(const T&, T&, const T&, double, T&)>("decodex::fused_add_rms_norm");
  h.call(x, residual, weight, eps, out);
}

inline void rope_append(T& q, T& k, const T& v, const T& inv_freq, const T& positions, T& k_cache,
                        T& v_cache, const OptT& rms_x = std::nullopt, OptD rms_eps = std::nullopt,
                        const OptT& bias = std::nullopt, const OptT& q_norm = std::nullopt,
                        const OptT& k_norm = std::nullopt, OptD norm_eps = std::nullopt) {
  static auto h = detail::op<void(T&, T&, const T&, const T&, const T&, T&, T&, const OptT&, OptD,
                                  const OptT&, const OptT&, const OptT&, OptD)>("decodex::rope_append");
  h.call(q, k, v, inv_freq, positions, k_cache, v_cache, rms_x, rms_eps, bias, q_norm, k_norm, norm_eps);
}

inline void gemv_rope_append(const T& x, const T& weight, const OptT& bias, const T& inv_freq,
                             const T& positions, T& out, T& k_cache, T& v_cache,
                             bool prefetch_weight = false, OptD rms_eps = std::nullopt,
                             OptInts config = std::nullopt) {
  static auto h = detail::op<void(const T&, const T&, const OptT&, const T&, const T&, T&, T&, T&,
                                  bool, OptD, OptInts)>("decodex::gemv_rope_append");
  h.call(x, weight, bias, inv_freq, positions, out, k_cache, v_cache, prefetch_weight, rms_eps, config);
}

inline void silu_mul(const T& gate_up, T& out, const OptT& rms_x = std::nullopt,
                     OptD rms_eps = std::nullopt) {
  static auto h = detail::op<void(const T&, T&, const OptT&, OptD)>("decodex::silu_mul");
  h.call(gate_up, out, rms_x, rms_eps);
}

// prefetch_cache: see the schema (the kernel just before writes no cache row but lengths[b] - 1).
inline void decode_attention(const T& q, const T& k_cache, const T& v_cache, const T& lengths,
                             double scale, T& workspace, T& out, bool prefetch_cache = false) {
  static auto h = detail::op<void(const T&, const T&, const T&, const T&, double, T&, T&, bool)>(
      "decodex::decode_attention");
  h.call(q, k_cache, v_cache, lengths, scale, workspace, out, prefetch_cache);
}

// rope_append then decode_attention in one kernel (see the schema); q, k, v are only read.
inline void rope_append_attention(const T& q, const T& k, const T& v, const T& inv_freq,
                                  const T& positions, T& k_cache, T& v_cache, const T& lengths,
                                  double scale, T& workspace, T& out, bool prefetch_cache = false,
                                  const OptT& rms_x = std::nullopt, OptD rms_eps = std::nullopt,
                                  const OptT& bias = std::nullopt, const OptT& q_norm = std::nullopt,
                                  const OptT& k_norm = std::nullopt, OptD norm_eps = std::nullopt) {
  static auto h = detail::op<void(const T&, const T&, const T&, const T&, const T&, T&, T&, const T&,
                                  double, T&, T&, bool, const OptT&, OptD, const OptT&, const OptT&,
                                  const OptT&, OptD)>("decodex::rope_append_attention");
  h.call(q, k, v, inv_freq, positions, k_cache, v_cache, lengths, scale, workspace, out,
         prefetch_cache, rms_x, rms_eps, bias, q_norm, k_norm, norm_eps);
}

inline int64_t decode_attention_splits(int64_t batch, int64_t num_kv_heads, int64_t capacity,
                                       int64_t sm_count) {
  static auto h = detail::op<int64_t(int64_t, int64_t, int64_t, int64_t)>("decodex::decode_attention_splits");
  return h.call(batch, num_kv_heads, capacity, sm_count);
}

// Mixture of experts: the top_k experts of each row and their weights; the chosen experts'
// gate|up product with SiLU; their down products summed with the weights.
inline void moe_route(const T& logits, int64_t top_k, bool norm_topk_prob, T& ids, T& weights) {
  static auto h = detail::op<void(const T&, int64_t, bool, T&, T&)>("decodex::moe_route");
  h.call(logits, top_k, norm_topk_prob, ids, weights);
}

inline void moe_gemv_silu_mul(const T& x, const T& weight, const T& ids, T& out, OptD rms_eps = std::nullopt) {
  static auto h = detail::op<void(const T&, const T&, const T&, T&, OptD)>("decodex::moe_gemv_silu_mul");
  h.call(x, weight, ids, out, rms_eps);
}

inline void moe_gemv_sum(const T& x, const T& weight, const T& ids, const T& weights, T& out,
                         bool accumulate = false, bool prefetch_weight = false) {
  static auto h =
      detail::op<void(const T&, const T&, const T&, const T&, T&, bool, bool)>("decodex::moe_gemv_sum");
  h.call(x, weight, ids, weights, out, accumulate, prefetch_weight);
}

inline void argmax(const T& logits, T& out) {
  static auto h = detail::op<void(const T&, T&)>("decodex::argmax");
  h.call(logits, out);
}

inline void sample(const T& logits, const T& temperature, const T& top_k, const T& top_p,
                   const T& seed, const T& positions, T& out) {
  static auto h = detail::op<void(const T&, const T&, const T&, const T&, const T&, const T&, T&)>(
      "decodex::sample");
  h.call(logits, temperature, top_k, top_p, seed, positions, out);
}

inline void advance_positions(T& positions, T& lengths) {
  static auto h = detail::op<void(T&, T&)>("decodex::advance_positions");
  h.call(positions, lengths);
}

// cuBLASLt's candidate `algo` (0 <= algo < lt_linear_algos(...) for the same arguments) for
// out (+)= x @ weight^T (+ bias); workspace: a uint8 CUDA buffer.
inline void lt_linear(const T& x, const T& weight, const OptT& bias, T& out, T& workspace,
                      int64_t algo, bool accumulate = false) {
  static auto h = detail::op<void(const T&, const T&, const OptT&, T&, T&, int64_t, bool)>(
      "decodex::lt_linear");
  h.call(x, weight, bias, out, workspace, algo, accumulate);
}

inline int64_t lt_linear_algos(const T& x, const T& weight, const OptT& bias, const T& out,
                               const T& workspace, bool accumulate = false) {
  static auto h = detail::op<int64_t(const T&, const T&, const OptT&, const T&, const T&, bool)>(
      "decodex::lt_linear_algos");
  return h.call(x, weight, bias, out, workspace, accumulate);
}

}  // namespace decodex_ops
