// The host launchers of every decodex op, one per csrc/<op>.cu. bindings.cpp registers them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <optional>
#include <vector>

namespace decodex {

void gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          at::Tensor& out, bool prefetch_weight, std::optional<double> rms_eps, bool accumulate,
          at::OptionalIntArrayRef config, bool launch_dependents_early,
          int64_t launch_dependents_after);
void gemv_silu_mul(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out,
                   bool prefetch_weight, std::optional<double> rms_eps, at::OptionalIntArrayRef config,
                   int64_t launch_dependents_after);
int64_t gemv_silu_mul_max_rows(int64_t device);
std::vector<int64_t> gemv_config(int64_t N, int64_t K, int64_t M, bool clusters, bool prefetch_weight);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, at::Tensor& out);
void rope_append(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& inv_freq,
                 const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                 const std::optional<at::Tensor>& rms_x, std::optional<double> rms_eps,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, std::optional<double> norm_eps);
void gemv_rope_append(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& inv_freq,
                      const at::Tensor& positions, at::Tensor& out, at::Tensor& k_cache,
                      at::Tensor& v_cache, bool prefetch_weight, std::optional<double> rms_eps,
                      at::OptionalIntArrayRef config);
void silu_mul(const at::Tensor& gate_up, at::Tensor& out, const std::optional<at::Tensor>& rms_x,
              std::optional<double> rms_eps);
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& lengths, double scale, at::Tensor& workspace,
                      at::Tensor& out, bool prefetch_cache);
void rope_append_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& inv_freq, const at::Tensor& positions,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                           double scale, at::Tensor& workspace, at::Tensor& out, bool prefetch_cache,
                           const std::optional<at::Tensor>& rms_x, std::optional<double> rms_eps,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q_norm,
                           const std::optional<at::Tensor>& k_norm, std::optional<double> norm_eps);
int64_t decode_attention_splits(int64_t batch, int64_t num_kv_heads, int64_t capacity,
                                int64_t sm_count);
void moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob, at::Tensor& ids,
               at::Tensor& weights);
void moe_gemv_silu_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                       at::Tensor& out, std::optional<double> rms_eps);
void moe_gemv_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                  const at::Tensor& weights, at::Tensor& out, bool accumulate, bool prefetch_weight);
void argmax(const at::Tensor& logits, at::Tensor& out);
void sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
            const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& positions,
            at::Tensor& out);
void advance_positions(at::Tensor& positions, at::Tensor& lengths);
void lt_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               at::Tensor& out, at::Tensor& workspace, int64_t algo, bool accumulate);
int64_t lt_linear_algos(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, const at::Tensor& out,
                        const at::Tensor& workspace, bool accumulate);

}  // namespace decodex
