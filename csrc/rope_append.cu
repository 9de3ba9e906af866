// RoPE on q and k in place, then k and v appended to the KV cache, all rows in one launch. Also
// gemv_rope_append (at the end): the merged qkv GEMV with this op in its epilogue
// (csrc/gemv_kernel.cuh).
//
// Idea: one block per batch row b. The block first computes cos/sin of the D/2 angles
// float(positions[b]) * inv_freq[i] once into shared memory (fp32 multiply, precise sincosf, as
// decodex.reference.rope: no __sinf), then every (head, 16-element slice) of q, k and v is one work
// item: a thread loads the 8 elements of the first half and the matching 8 of the second half
// (16-byte vectors, pairs (i, i + D/2): the HF Llama/Qwen "rotate_half" layout), rotates them with
// separately rounded products and sums (x1*cos - x2*sin, x2*cos + x1*sin: bit-identical fp32 to the
// reference given the same cos/sin), writes q or k back in place and, for k and v, the row
// `positions[b]` of the cache. Llama-3 scaling only changes inv_freq, which the caller precomputes.
// rms_x / bias (the decode step's cuBLAS path, whose qkv GEMM reads the unnormalised residual
// without the bias): q, k and v are first scaled by 1/rms(rms_x row), the bias added and the sum
// rounded to bf16, as gemv's rms_eps and bias epilogue stores its product; v itself is left as it
// was (only its cache row is written). q_norm / k_norm (Qwen3): then each q and k head is
// RMS-normalised over its D values with that weight and rounded to bf16 (head_rms_norm below), and
// RoPE rotates the result.
// A thread's first item is loaded before positions[b] is read, so those two L2 round trips overlap
// instead of following each other (at batch 64 the op sits between a cuBLAS GEMM and attention, on
// the step's critical path).
//
// Rows: positions[b] < 0 skips row b entirely (padding slot). positions[b] >= S (the cache capacity)
// also skips the whole row: nothing is written, q and k stay unrotated. That is a caller bug (the
// reference raises IndexError); the host must keep positions < S (the model checks on the host), and
// the kernel guarantees it never writes out of bounds.
// Strides: q, k, v may be row views into a merged qkv buffer (any stride(0), inner [heads, D]
// contiguous). The caches need contiguous [Hkv, S, D] but any stride(0), including 0: the prefill
// path writes a prompt's T tokens into cache slot s with cache[s:s+1].expand(T, ...) and
// positions = arange(T).
#include <algorithm>

#include "common.h"
#include "decode_attention.h"
#include "gemv.h"
#include "ops.h"

namespace decodex {

constexpr int kRopeMaxThreads = 512;

__global__ void __launch_bounds__(kRopeMaxThreads)
rope_append_kernel(__nv_bfloat16* __restrict__ q,  // [B, H, D], row stride q_stride
                   int64_t q_stride,
                   __nv_bfloat16* __restrict__ k,  // [B, Hkv, D], row stride k_stride
                   int64_t k_stride,
                   const __nv_bfloat16* __restrict__ v,  // [B, Hkv, D], row stride v_stride
                   int64_t v_stride,
                   const float* __restrict__ inv_freq,  // [D/2]
                   const int* __restrict__ positions,   // [B]
                   __nv_bfloat16* __restrict__ k_cache,  // [B, Hkv, S, D], strides (kc_b, kc_h, D, 1)
                   int64_t kc_b, int64_t kc_h,
                   __nv_bfloat16* __restrict__ v_cache,  // [B, Hkv, S, D], strides (vc_b, vc_h, D, 1)
                   int64_t vc_b, int64_t vc_h, int H, int Hkv, int S, int D,
                   const __nv_bfloat16* __restrict__ rms_x,  // [B, K], row stride x_stride, or null
                   int64_t x_stride, int K, float rms_eps,
                   const __nv_bfloat16* __restrict__ bias,     // [(H + 2 Hkv) D] or null
                   const __nv_bfloat16* __restrict__ q_norm,   // [D] or null (then k_norm too)
                   const __nv_bfloat16* __restrict__ k_norm,   // [D]
                   float norm_eps) {
  pdl_begin();
  extern __shared__ float cs[];  // cos [D/2] then sin [D/2]
  __shared__ float scratch[32];
  const int64_t b = blockIdx.x;
  const int half = D / 2;
  const int slices = half / 8;  // 8-element slices of each half
  const int items = (H + 2 * Hkv) * slices;
  // Item `it`: the (head, slice) of q, k or v; its source row and first pair index.
  auto source = [&](int it, int& head, int& c0) -> const __nv_bfloat16* {
    head = it / slices;
    c0 = (it - head * slices) * 8;
    if (head < H) return q + b * q_stride + static_cast<int64_t>(head) * D;
    if (head < H + Hkv) return k + b * k_stride + static_cast<int64_t>(head - H) * D;
    return v + b * v_stride + static_cast<int64_t>(head - H - Hkv) * D;
  };
  // This thread's first item is loaded before the position is known, so its round trip overlaps
  // the position's and the cos/sin table's (a row that turns out to be skipped just discards it).
  bf16x8 first1 = {}, first2 = {};
  if (threadIdx.x < items) {
    int head, c0;
    const __nv_bfloat16* x = source(threadIdx.x, head, c0);
    first1 = *reinterpret_cast<const bf16x8*>(x + c0);
    first2 = *reinterpret_cast<const bf16x8*>(x + half + c0);
  }
  // rms_x: this thread's share of the row's sum of squares, also before the position (its loads
  // then overlap the others); the block sums it below.
  const float ss = rms_x != nullptr ? thread_sum_squares(rms_x + b * x_stride, K) : 0.f;
  const int pos = positions[b];
  if (pos < 0 || pos >= S) return;  // the whole block leaves together: no barrier is skipped
  // rms_x: 1/rms of the row, the product's scale
  const float scale = rms_x != nullptr ? rms_inv(block_sum(ss, scratch), K, rms_eps) : 1.f;
  // An item's 8 values at offset `at` of its head (rms_x / bias: scaled, biased and rounded to bf16
  // first, as gemv's rms_eps and bias epilogue stores its product).
  auto prepared = [&](const bf16x8& raw, int head, int at, float (&f)[8]) {
    scale_bias_round8(raw, rms_x != nullptr, scale,
                      bias == nullptr ? nullptr : bias + static_cast<int64_t>(head) * D + at, f);
  };

  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    rope_cos_sin(pos, inv_freq[i], c, s);
    cs[i] = c;
    cs[half + i] = s;
  }
  __syncthreads();

  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    int head, c0;
    const __nv_bfloat16* x = source(it, head, c0);
    const bf16x8 a1 = it == threadIdx.x ? first1 : *reinterpret_cast<const bf16x8*>(x + c0);
    const bf16x8 a2 = it == threadIdx.x ? first2 : *reinterpret_cast<const bf16x8*>(x + half + c0);
    float x1[8], x2[8];
    prepared(a1, head, c0, x1);
    prepared(a2, head, half + c0, x2);
    if (q_norm != nullptr && head < H + Hkv) {  // uniform over the head's lanes
      const __nv_bfloat16* w = head < H ? q_norm : k_norm;
      head_rms_norm(x1, x2, *reinterpret_cast<const bf16x8*>(w + c0),
                    *reinterpret_cast<const bf16x8*>(w + half + c0), half, slices, norm_eps);
    }
    if (head < H + Hkv) {
      float o1[8], o2[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        rope_rotate(x1[j], x2[j], cs[c0 + j], cs[half + c0 + j], o1[j], o2[j]);
      }
      const bf16x8 r1 = float_to_bf16x8(o1), r2 = float_to_bf16x8(o2);
      __nv_bfloat16* xw = const_cast<__nv_bfloat16*>(x);  // q or k: rotated in place
      *reinterpret_cast<bf16x8*>(xw + c0) = r1;
      *reinterpret_cast<bf16x8*>(xw + half + c0) = r2;
      if (head >= H) {
        __nv_bfloat16* dst =
            k_cache + b * kc_b + static_cast<int64_t>(head - H) * kc_h + static_cast<int64_t>(pos) * D;
        *reinterpret_cast<bf16x8*>(dst + c0) = r1;
        *reinterpret_cast<bf16x8*>(dst + half + c0) = r2;
      }
    } else {
      const int h = head - H - Hkv;
      __nv_bfloat16* dst =
          v_cache + b * vc_b + static_cast<int64_t>(h) * vc_h + static_cast<int64_t>(pos) * D;
      *reinterpret_cast<bf16x8*>(dst + c0) = float_to_bf16x8(x1);  // a1, a2 unless scaled / biased
      *reinterpret_cast<bf16x8*>(dst + half + c0) = float_to_bf16x8(x2);
    }
  }
}

namespace {

// q / k / v: [B, heads, D] bf16, inner [heads, D] contiguous, 16-byte aligned rows.
void check_heads(const at::Tensor& t, const char* name, int64_t B, int64_t D, const at::Tensor& ref) {
  DX_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be a CUDA tensor on ",
              ref.device(), ", got ", t.device());
  DX_CHECK(t.scalar_type() == at::kBFloat16, name, " must have dtype BFloat16, got ", t.scalar_type());
  DX_CHECK(t.dim() == 3 && t.size(0) == B && t.size(2) == D, name, " must have shape [", B,
              ", heads, ", D, "], got ", t.sizes());
  DX_CHECK(t.stride(2) == 1 && (t.stride(1) == D || t.size(1) == 1), name,
              " must be contiguous within a row ([heads, D]), got strides ", t.strides());
  DX_CHECK(t.stride(0) % 8 == 0 || B == 1, name,
              " row stride must be a multiple of 8 elements (16-byte rows), got ", t.stride(0));
  DX_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned (its storage offset breaks vector loads)");
}

// k_cache / v_cache: [B, Hkv, S, D] bf16, inner [Hkv, S, D] contiguous, any stride(0) (0 allowed).
void check_cache(const at::Tensor& t, const char* name, int64_t B, int64_t Hkv, int64_t S, int64_t D,
                 const at::Tensor& ref) {
  DX_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be a CUDA tensor on ",
              ref.device(), ", got ", t.device());
  DX_CHECK(t.scalar_type() == at::kBFloat16, name, " must have dtype BFloat16, got ", t.scalar_type());
  DX_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == Hkv && t.size(2) == S && t.size(3) == D,
              name, " must have shape [", B, ", ", Hkv, ", ", S, ", ", D, "] (S from k_cache), got ",
              t.sizes());
  DX_CHECK(t.stride(3) == 1 && t.stride(2) == D && (t.stride(1) == S * D || Hkv == 1), name,
              " must be contiguous in its inner [Hkv, S, D] dims (any stride(0)), got strides ",
              t.strides());
  DX_CHECK(t.stride(0) % 8 == 0 || B == 1, name, " stride(0) must be a multiple of 8 elements, got ",
              t.stride(0));
  DX_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned (its storage offset breaks vector stores)");
}

// inv_freq [D/2] fp32 and positions [B] int32, contiguous, on ref's device.
void check_rope_inputs(const at::Tensor& inv_freq, const at::Tensor& positions, int64_t B,
                       int64_t D, const at::Tensor& ref) {
  DX_CHECK(inv_freq.is_cuda() && inv_freq.device() == ref.device(), "inv_freq must be on ",
              ref.device(), ", got ", inv_freq.device());
  DX_CHECK_DTYPE(inv_freq, at::kFloat);
  DX_CHECK_SHAPE(inv_freq, D / 2);
  DX_CHECK_CONTIGUOUS(inv_freq);
  DX_CHECK(positions.is_cuda() && positions.device() == ref.device(), "positions must be on ",
              ref.device(), ", got ", positions.device());
  DX_CHECK_DTYPE(positions, at::kInt);
  DX_CHECK_SHAPE(positions, B);
  DX_CHECK_CONTIGUOUS(positions);
}

// rope_append's arguments, checked for `op` (rope_append and rope_append_attention): q [B, H, D],
// k and v [B, Hkv, D] (row views of a q|k|v product), the caches [B, Hkv, S, D], inv_freq [D/2],
// positions [B], rms_x / rms_eps and bias [(H + 2 Hkv) D]. attention: D must be a head dim the
// attention kernel takes (64, 128), else any multiple of 16 up to 1024.
struct RopeShapes {
  int64_t B, H, D, Hkv, S;
  RmsX rx;
  const __nv_bfloat16* bias;
};
RopeShapes check_rope_append(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& inv_freq,
                             const at::Tensor& positions, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const std::optional<at::Tensor>& rms_x,
                             std::optional<double> rms_eps, const std::optional<at::Tensor>& bias,
                             bool attention) {
  DX_CHECK(q.dim() == 3, op, ": q must be 3-D [B, H, D], got shape ", q.sizes());
  DX_CHECK(k.dim() == 3, op, ": k must be 3-D [B, Hkv, D], got shape ", k.sizes());
  DX_CHECK(k_cache.dim() == 4, op, ": k_cache must be 4-D [B, Hkv, S, D], got shape ", k_cache.sizes());
  RopeShapes a;
  a.B = q.size(0), a.H = q.size(1), a.D = q.size(2), a.Hkv = k.size(1), a.S = k_cache.size(2);
  const int64_t B = a.B, H = a.H, D = a.D, Hkv = a.Hkv, S = a.S;
  if (attention) {
    DX_CHECK(D == 64 || D == 128, op, ": head dim D = ", D,
             " (q.size(2)) is not supported (supported: 64, 128)");
  } else {
    DX_CHECK(D > 0 && D % 16 == 0 && D <= 1024, op,
             ": head dim D = q.size(2) must be a multiple of 16 in [16, 1024], got ", D);
  }
  DX_CHECK(H > 0 && Hkv > 0, op, ": q and k need at least one head, got H = ", H, ", Hkv = ", Hkv);
  check_heads(q, "q", B, D, q);
  check_heads(k, "k", B, D, q);
  check_heads(v, "v", B, D, q);
  DX_CHECK(v.size(1) == Hkv, "v must have Hkv = ", Hkv, " heads like k, got shape ", v.sizes());
  check_cache(k_cache, "k_cache", B, Hkv, S, D, q);
  check_cache(v_cache, "v_cache", B, Hkv, S, D, q);
  check_rope_inputs(inv_freq, positions, B, D, q);
  DX_CHECK(B <= 0x7fffffff && S <= 0x7fffffff && H + 2 * Hkv <= 0x7fffffff / (D / 16), op,
           ": sizes too large");  // B: one block a row (rows may share memory: stride(0) = 0)
  a.rx = check_rms_x(op, rms_x, rms_eps, B, q);
  a.bias = check_gemv_bias(bias, q, (H + 2 * Hkv) * D, "q");  // [q|k|v]
  return a;
}

// q_norm / k_norm [D] and norm_eps, all or none (checked for `op`): bf16 vectors on ref's device,
// contiguous, 16-byte aligned and apart from the tensors the op writes (written_names names them),
// and a head dim whose D/16 work items are a power of two up to 32 (the kernels sum a head's squares
// across those lanes of a warp). Returns the two pointers (null without them).
struct HeadNorms {
  const __nv_bfloat16* q = nullptr;
  const __nv_bfloat16* k = nullptr;
  float eps = 0.f;
};
HeadNorms check_head_norms(const char* op, const std::optional<at::Tensor>& q_norm,
                           const std::optional<at::Tensor>& k_norm, std::optional<double> norm_eps,
                           int64_t D, const at::Tensor& ref, const char* written_names,
                           std::initializer_list<const at::Tensor*> written_tensors) {
  DX_CHECK(q_norm.has_value() == k_norm.has_value() && q_norm.has_value() == norm_eps.has_value(),
           op, ": q_norm, k_norm and norm_eps go together (got ", q_norm ? "q_norm " : "",
           k_norm ? "k_norm " : "", norm_eps ? "norm_eps" : "", ")");
  HeadNorms n;
  if (!q_norm) return n;
  const int64_t slices = D / 16;
  DX_CHECK(slices <= 32 && (slices & (slices - 1)) == 0, op, ": q_norm / k_norm need a head dim ",
           "of 16, 32, 64, 128, 256 or 512, got D = ", D);
  for (const at::Tensor* t : {&*q_norm, &*k_norm}) {
    const char* name = t == &*q_norm ? "q_norm" : "k_norm";
    DX_CHECK(t->is_cuda() && t->device() == ref.device(), op, ": ", name, " must be a CUDA tensor on ",
             ref.device(), ", got ", t->device());
    DX_CHECK(t->scalar_type() == at::kBFloat16, op, ": ", name, " must have dtype BFloat16, got ",
             t->scalar_type());
    DX_CHECK(t->dim() == 1 && t->size(0) == D, op, ": ", name, " must have shape [", D,
             "] (D = q.size(2)), got ", t->sizes());
    DX_CHECK(t->stride(0) == 1 && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
             op, ": ", name, " must be contiguous and 16-byte aligned");
    for (const at::Tensor* written : written_tensors) {
      DX_CHECK(!spans_overlap(*t, *written), op, ": ", name,
               " must not overlap ", written_names, " (written while it is read)");
    }
  }
  n.q = reinterpret_cast<const __nv_bfloat16*>(q_norm->data_ptr());
  n.k = reinterpret_cast<const __nv_bfloat16*>(k_norm->data_ptr());
  n.eps = check_rms_eps(op, *norm_eps, "norm_eps");
  return n;
}

}  // namespace

// q[B,H,D], k[B,Hkv,D] rotated in place at positions[B] (int32); k and v written to
// k_cache/v_cache[B,Hkv,S,D] row positions[b]. positions[b] < 0 or >= S: row b untouched.
void rope_append(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& inv_freq,
                 const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                 const std::optional<at::Tensor>& rms_x, std::optional<double> rms_eps,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, std::optional<double> norm_eps) {
  const RopeShapes a = check_rope_append("rope_append", q, k, v, inv_freq, positions, k_cache,
                                         v_cache, rms_x, rms_eps, bias, false);
  const HeadNorms norms =
      check_head_norms("rope_append", q_norm, k_norm, norm_eps, a.D, q, "q, k or the caches",
                       {&q, &k, &k_cache, &v_cache});
  const int64_t B = a.B, H = a.H, D = a.D, Hkv = a.Hkv, S = a.S;
  const RmsX& rx = a.rx;
  const __nv_bfloat16* bias_ptr = a.bias;
  if (B == 0 || S == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  const int items = static_cast<int>((H + 2 * Hkv) * (D / 16));
  const int threads = std::min(kRopeMaxThreads, std::max(32, (items + 31) / 32 * 32));
  const size_t smem = static_cast<size_t>(D) * sizeof(float);
  const cudaError_t err = launch_pdl(
      rope_append_kernel, dim3(static_cast<unsigned>(B)), dim3(threads), smem, current_stream(),
      reinterpret_cast<__nv_bfloat16*>(q.data_ptr()), q.stride(0),
      reinterpret_cast<__nv_bfloat16*>(k.data_ptr()), k.stride(0),
      reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()), v.stride(0), inv_freq.data_ptr<float>(),
      positions.data_ptr<int>(), reinterpret_cast<__nv_bfloat16*>(k_cache.data_ptr()),
      k_cache.stride(0), k_cache.stride(1), reinterpret_cast<__nv_bfloat16*>(v_cache.data_ptr()),
      v_cache.stride(0), v_cache.stride(1), static_cast<int>(H), static_cast<int>(Hkv),
      static_cast<int>(S), static_cast<int>(D), static_cast<const __nv_bfloat16*>(rx.ptr), rx.stride,
      static_cast<int>(rx.K), rx.eps,
      bias_ptr, norms.q, norms.k, norms.eps);
  DX_CHECK_LAUNCHED(err, "rope_append");
  DX_CHECK_LAUNCH("rope_append");
}

}  // namespace decodex

namespace decodex {

// out[M, (H+2Hkv)*D] = x @ weight^T (+ bias) as gemv, then rope_append on its q|k|v rows: one kernel
// (the GEMV with the kRopeAppend epilogue, csrc/gemv_kernel.cuh), equal to the two ops bit for bit.
void gemv_rope_append(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& inv_freq,
                      const at::Tensor& positions, at::Tensor& out, at::Tensor& k_cache,
                      at::Tensor& v_cache, bool prefetch_weight, std::optional<double> rms_eps,
                      at::OptionalIntArrayRef config) {
  check_gemv_x_weight("gemv_rope_append", x, weight, out);
  DX_CHECK(k_cache.dim() == 4, "gemv_rope_append: k_cache must be 4-D [M, Hkv, S, D], got shape ",
           k_cache.sizes());
  const int64_t M = x.size(0), rows = weight.size(0);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  DX_CHECK(D > 0 && D % 16 == 0 && D <= 1024, "gemv_rope_append: head dim D = k_cache.size(3) ",
           "must be a multiple of 16 in [16, 1024], got ", D);
  DX_CHECK(Hkv > 0 && rows % D == 0 && rows / D > 2 * Hkv, "gemv_rope_append: weight must have ",
           "(H + 2 Hkv) * D rows with H >= 1 (Hkv = ", Hkv, ", D = ", D, " from k_cache), got ",
           rows, " rows");
  const int64_t H = rows / D - 2 * Hkv;
  check_gemv_out(out, M, rows);
  const __nv_bfloat16* bias_ptr = check_gemv_bias(bias, x, rows);
  check_cache(k_cache, "k_cache", M, Hkv, S, D, x);
  check_cache(v_cache, "v_cache", M, Hkv, S, D, x);
  check_rope_inputs(inv_freq, positions, M, D, x);
  DX_CHECK(S <= 0x7fffffff, "gemv_rope_append: cache capacity too large");

  RopeAppendArgs rope;
  rope.inv_freq = inv_freq.data_ptr<float>();
  rope.positions = positions.data_ptr<int>();
  rope.k_cache = reinterpret_cast<__nv_bfloat16*>(k_cache.data_ptr());
  rope.v_cache = reinterpret_cast<__nv_bfloat16*>(v_cache.data_ptr());
  rope.kc_b = M == 1 ? 0 : k_cache.stride(0);
  rope.kc_h = k_cache.stride(1);
  rope.vc_b = M == 1 ? 0 : v_cache.stride(0);
  rope.vc_h = v_cache.stride(1);
  rope.H = static_cast<int>(H);
  rope.Hkv = static_cast<int>(Hkv);
  rope.S = static_cast<int>(S);
  rope.D = static_cast<int>(D);
  const GemvOptions options =
      gemv_options("gemv_rope_append", x, out, prefetch_weight, rms_eps, false, config);
  launch_gemv("gemv_rope_append", x, weight, bias_ptr, out, GemvEpilogue::kRopeAppend, options,
              rope);
}

}  // namespace decodex

namespace decodex {

// rope_append(q, k, v, ...) then decode_attention(q, ...) in one kernel (the split kernel with
// rope_append's work in its prologue, csrc/decode_attention.cu), equal to the two ops bit for bit in
// the caches and out; q, k and v are only read (the rotated q and k are not written back).
void rope_append_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& inv_freq, const at::Tensor& positions,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                           double scale, at::Tensor& workspace, at::Tensor& out, bool prefetch_cache,
                           const std::optional<at::Tensor>& rms_x, std::optional<double> rms_eps,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q_norm,
                           const std::optional<at::Tensor>& k_norm, std::optional<double> norm_eps) {
  const RopeShapes a = check_rope_append("rope_append_attention", q, k, v, inv_freq, positions,
                                         k_cache, v_cache, rms_x, rms_eps, bias, true);
  const HeadNorms norms = check_head_norms("rope_append_attention", q_norm, k_norm, norm_eps, a.D, q,
                                           "the caches, workspace or out",
                                           {&k_cache, &v_cache, &workspace, &out});
  const int64_t B = a.B;
  // Other blocks still read the inputs while a finished one writes out.
  for (const at::Tensor* t : {&q, &k, &v}) {
    DX_CHECK(!spans_overlap(*t, out), "rope_append_attention: out must not overlap q, k or v");
  }
  // Each row's blocks append its row pos while the other rows' blocks read their caches, so rows
  // may not share cache memory (rope_append alone allows it: the prefill's expanded caches).
  const int64_t cache_row = k_cache.size(1) * k_cache.size(2) * k_cache.size(3);  // Hkv * S * D
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    DX_CHECK(B <= 1 || c->stride(0) >= cache_row, "rope_append_attention: ",
             c == &k_cache ? "k_cache" : "v_cache", " rows must not share memory: stride(0) = ",
             c->stride(0), " is less than Hkv * S * D = ", cache_row);
  }
  DX_CHECK(!spans_overlap(k_cache, v_cache), "rope_append_attention: k_cache and v_cache must not overlap");
  DX_CHECK(!rms_x || !spans_overlap(*rms_x, out), "rope_append_attention: out must not overlap rms_x");

  AttnRope rope;
  rope.k = reinterpret_cast<const __nv_bfloat16*>(k.data_ptr());
  rope.v = reinterpret_cast<const __nv_bfloat16*>(v.data_ptr());
  rope.k_bstride = B == 1 ? 0 : k.stride(0);
  rope.v_bstride = B == 1 ? 0 : v.stride(0);
  rope.inv_freq = inv_freq.data_ptr<float>();
  rope.positions = positions.data_ptr<int>();
  rope.rms_x = static_cast<const __nv_bfloat16*>(a.rx.ptr);
  rope.x_bstride = a.rx.stride;
  rope.K = static_cast<int>(a.rx.K);
  rope.rms_eps = a.rx.eps;
  rope.bias = a.bias;
  rope.q_norm = norms.q;
  rope.k_norm = norms.k;
  rope.norm_eps = norms.eps;
  launch_decode_attention("rope_append_attention", q, k_cache, v_cache, lengths, scale, workspace,
                          out, prefetch_cache, &rope);
}

}  // namespace decodex
