// The decode attention launcher shared by decode_attention (csrc/decode_attention.cu) and
// rope_append_attention (csrc/rope_append.cu), whose split kernel also does rope_append's work first.
#pragma once
#include <ATen/core/Tensor.h>
#include <cuda_bf16.h>

namespace decodex {

// rope_append_attention's extra arguments: the unrotated k and v rows of the product and
// rope_append's inputs (q, the unrotated q rows, is decode_attention's q argument).
struct AttnRope {
  const __nv_bfloat16* k = nullptr;  // [B, Hkv, D], batch stride k_bstride
  const __nv_bfloat16* v = nullptr;  // [B, Hkv, D], batch stride v_bstride
  int64_t k_bstride = 0, v_bstride = 0;
  const float* inv_freq = nullptr;  // [D/2]
  const int* positions = nullptr;   // [B]: the row appended; < 0 or >= S: none, q used unrotated
  const __nv_bfloat16* rms_x = nullptr;  // [B, K] or null: the product's rows scaled by 1/rms first
  int64_t x_bstride = 0;
  int K = 0;
  float rms_eps = 0.f;
  const __nv_bfloat16* bias = nullptr;  // [(H + 2 Hkv) D] or null, added after the scale
  const __nv_bfloat16* q_norm = nullptr;  // [D] or null (then k_norm too): Qwen3's head norms,
  const __nv_bfloat16* k_norm = nullptr;  // applied after the bias, before RoPE
  float norm_eps = 0.f;
};

// Checks decode_attention's arguments and launches it; with rope, the split kernel first does
// rope_append's work (rope's arguments checked by the caller): see rope_append_attention.
void launch_decode_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& lengths, double scale,
                             at::Tensor& workspace, at::Tensor& out, bool prefetch_cache,
                             const AttnRope* rope);

}  // namespace decodex
