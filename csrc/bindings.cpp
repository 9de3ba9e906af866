// Every decodex op, each schema written once. Decode-path ops write into caller-owned buffers and
// return () so one CUDA graph can replay them on fixed memory. Shapes: B batch, M rows of x,
// K inner dim, N output features, H query heads, Hkv KV heads, S cache capacity, D head dim, V vocab.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

// A minimal module init so `import decodex._C` loads this library (and its registrations) under
// Python's stable ABI: the same .so works on every Python 3.x that torch supports.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(decodex, m) {
  // out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N]); bf16, fp32 accumulation, K % 8 == 0, M <= 64
  // (M <= 8 with rms_eps).
  // prefetch_weight (all three GEMV ops): the caller promises that the kernel just before this one
  // on the stream does not write `weight` (nor gemv_rope_append's bias and inv_freq), so the GEMV
  // may start reading them while that kernel runs (programmatic dependent launch); the decode graph
  // sets it, since its weights never change.
  // rms_eps (all three GEMV ops): each product row is scaled by 1/rms(x row) = rsqrt(mean(x^2) +
  // rms_eps) before the bias: the product of rms_norm(x, w, rms_eps) when w is folded into weight's
  // columns (weight * w, decodex.ops.fold_norm_weight). accumulate (gemv): out += the product (bias
  // included), the product rounded to bf16 first. x must not overlap out.
  // config (all three GEMV ops, at most 8 rows of x): [wr, wk, c, u], the kernel configuration to
  // launch instead of the one decodex picks for the shape (csrc/gemv.cu: wr * wk <= 8 warps a block,
  // clusters of c <= 8 blocks (1 below sm_90), u 4 or 8); the result is the same up to the order of
  // the fp32 sums. For callers that time the step around the product (decodex's engine picks other
  // configurations where long-context attention surrounds it).
  // launch_dependents_early (gemv): the next kernel on the stream may launch before this one waits
  // for the kernel ahead, so its loads before its own wait (prefetch_weight) overlap that kernel
  // too. The caller promises that the next kernel reads before its wait nothing the kernel ahead of
  // this one writes. A hint: the results are the same; the wgmma kernel (above 16 rows) ignores it.
  // launch_dependents_after (gemv, gemv_silu_mul; 0 to 100, 0 = off): the next kernel may launch
  // only once each block's first warp has issued that percentage of its main loop's loads, so
  // that its loads before its wait fill this product's drain (csrc/gemv.h). Also a hint, taken at
  // one row of x only; excludes launch_dependents_early.
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, bool prefetch_weight=False, "
        "float? rms_eps=None, bool accumulate=False, int[]? config=None, "
        "bool launch_dependents_early=False, int launch_dependents_after=0) -> ()");
  // out[M,I] = silu(x @ weight[:I]^T) * (x @ weight[I:]^T) for weight [2I, K] = [gate; up]: gemv and
  // silu_mul in one kernel (equal to them bit for bit up to 8 rows); K % 8 == 0; M <=
  // gemv_silu_mul_max_rows(x's device).
  m.def("gemv_silu_mul(Tensor x, Tensor weight, Tensor(a!) out, bool prefetch_weight=False, "
        "float? rms_eps=None, int[]? config=None, int launch_dependents_after=0) -> ()");
  // The most rows of x gemv_silu_mul takes on CUDA device `device`: 64 where its wgmma kernel runs
  // (an sm_90a build on a device of compute capability 9.0), else 8.
  m.def("gemv_silu_mul_max_rows(int device) -> int", &decodex::gemv_silu_mul_max_rows);
  // The configuration [wr, wk, c, u] gemv, gemv_silu_mul and gemv_rope_append launch for a weight
  // [N, K] (N its rows: 2I for gate|up) and M = 1..8 rows of x when neither `config` nor
  // DECODEX_GEMV_CONFIG gives one: the measured tables' entry for the shape (kTunedPlain for plain
  // calls, kTunedRows at 2-4 rows, kTuned), else the rule for other shapes (csrc/gemv.cu); clusters:
  // whether the device has them (sm_90 and later); prefetch_weight: the call's (plain calls, the
  // ops' default, have their own table). A pure function, so CPU tests and callers without a GPU
  // can ask.
  m.def("gemv_config(int N, int K, int M, bool clusters=True, bool prefetch_weight=False) -> int[]",
        &decodex::gemv_config);
  // out[M,K] = x / rms(x) * weight.
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  // residual[M,K] += x; out = residual / rms(residual) * weight.
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) out) -> ()");
  // q[B,H,D] and k[B,Hkv,D] rotated in place (half-split RoPE at positions[B], int32);
  // k and v then written to k_cache/v_cache[B,Hkv,S,D] at that position. positions[b] < 0: row skipped.
  // rms_x [B, K] (with rms_eps) and bias [(H+2Hkv)*D]: q, k, v (rows of an unscaled q|k|v product)
  // first scaled by 1/rms(rms_x row), biased and rounded to bf16, as gemv(rms_eps) + bias stores
  // them; v keeps its values, its cache row gets the scaled ones. q_norm and k_norm [D] with
  // norm_eps (Qwen3): each q and k head then RMS-normalised with that weight, before RoPE.
  m.def("rope_append(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor inv_freq, Tensor positions, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor? rms_x=None, float? rms_eps=None, "
        "Tensor? bias=None, Tensor? q_norm=None, Tensor? k_norm=None, float? norm_eps=None) -> ()");
  // out[M,(H+2Hkv)*D] = x @ weight^T (+ bias) for the merged q|k|v weight, then rope_append on out's
  // q|k|v rows (q, k rotated, k and v written to the caches [M,Hkv,S,D] at positions[M]): one kernel,
  // equal to gemv + rope_append bit for bit; M <= 8.
  m.def("gemv_rope_append(Tensor x, Tensor weight, Tensor? bias, Tensor inv_freq, Tensor positions, "
        "Tensor(a!) out, Tensor(b!) k_cache, Tensor(c!) v_cache, bool prefetch_weight=False, "
        "float? rms_eps=None, int[]? config=None) -> ()");
  // out[M,I] = silu(gate_up[M,:I]) * gate_up[M,I:]. rms_x [M, K] (with rms_eps): each gate_up row
  // is first scaled by 1/rms(rms_x row) = rsqrt(mean(x^2) + rms_eps) and rounded to bf16, as gemv's
  // rms_eps scales its product (for a gate|up product of x that cuBLAS computed unscaled).
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out, Tensor? rms_x=None, float? rms_eps=None) -> ()");
  // out[B,H,D] = softmax(q k^T * scale) v over the first lengths[b] (int32, on device) cache rows.
  // workspace: fp32 [B, H, splits, D + 2], splits >= decode_attention_splits(B, Hkv, S).
  // prefetch_cache: the caller promises that the kernel just before this one on the stream writes
  // neither `lengths` nor any cache row but row lengths[b] - 1 of each sequence (the decode step's
  // append), so the kernel may start reading the cache while that kernel runs.
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float scale, "
        "Tensor(a!) workspace, Tensor(b!) out, bool prefetch_cache=False) -> ()");
  // rope_append(q, k, v, inv_freq, positions, k_cache, v_cache, rms_x, rms_eps, bias, q_norm, k_norm,
  // norm_eps) then decode_attention(q, k_cache, v_cache, lengths, scale, workspace, out) in one
  // kernel, equal to the two bit for bit in the caches and out; q, k and v (the unrotated product
  // rows) are only read. prefetch_cache: the kernel just before writes no cache row, nor lengths,
  // positions, inv_freq, q_norm or k_norm.
  m.def("rope_append_attention(Tensor q, Tensor k, Tensor v, Tensor inv_freq, Tensor positions, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lengths, float scale, Tensor(c!) workspace, "
        "Tensor(d!) out, bool prefetch_cache=False, Tensor? rms_x=None, float? rms_eps=None, "
        "Tensor? bias=None, Tensor? q_norm=None, Tensor? k_norm=None, float? norm_eps=None) -> ()");
  // How many KV splits decode_attention uses for this batch, KV heads, cache capacity and SM count
  // (a pure function, so Python can size the workspace and CPU tests can check it).
  m.def("decode_attention_splits(int batch, int num_kv_heads, int capacity, int sm_count) -> int",
        &decodex::decode_attention_splits);
  // Mixture of experts (Qwen3-MoE), the expert choice on the device. moe_route: ids[M,top_k]
  // (int32) = the top_k largest logits[M,E] (bf16) of each row, descending, ties to the lower
  // index (NaN counts as -inf); weights[M,top_k] (fp32) = their softmax probabilities over all E,
  // renormalised to sum to 1 if norm_topk_prob. E <= 1024, top_k <= 32.
  m.def("moe_route(Tensor logits, int top_k, bool norm_topk_prob, Tensor(a!) ids, Tensor(b!) weights) -> ()");
  // out[M,k,I] = silu(x[m] @ gate_e^T) * (x[m] @ up_e^T), e = ids[m,s], for the experts' merged
  // weight[E,2I,K] (rows of each: gate, then up); rms_eps as in gemv. K % 8 == 0.
  m.def("moe_gemv_silu_mul(Tensor x, Tensor weight, Tensor ids, Tensor(a!) out, float? rms_eps=None) -> ()");
  // out[M,N] (+)= sum_s weights[m,s] * (x[m,s] @ weight[e]^T), e = ids[m,s], for x[M,k,I] and the
  // experts' weight[E,N,I]: the fp32 sum rounded to bf16 once (accumulate: then added to out, as
  // gemv's accumulate). I % 8 == 0. Ids outside [0, E) give NaN, never a read outside weight.
  // prefetch_weight: ids, weights and the first expert weights are read before the PDL wait (the
  // caller promises the kernel ahead writes none of them; x is read after it).
  m.def("moe_gemv_sum(Tensor x, Tensor weight, Tensor ids, Tensor weights, Tensor(a!) out, "
        "bool accumulate=False, bool prefetch_weight=False) -> ()");
  // out[B] (int64) = argmax(logits[B,V]); ties go to the lowest index.
  m.def("argmax(Tensor logits, Tensor(a!) out) -> ()");
  // out[B] (int64): a token drawn from softmax(logits / temperature) restricted to top_k (0: off)
  // and top_p; temperature[b] == 0 means greedy. The draw is a hash of (seed[b], positions[b]).
  m.def("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, Tensor positions, Tensor(a!) out) -> ()");
  // For each live row (positions[b] >= 0): positions[b] += 1; lengths[b] = positions[b] + 1.
  m.def("advance_positions(Tensor(a!) positions, Tensor(b!) lengths) -> ()");
  // out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N]) (accumulate: out += that, rounded once) by
  // cuBLASLt with candidate number `algo` of this problem's list (0 <= algo < lt_linear_algos(...)
  // with the same arguments); bf16, fp32 accumulation. workspace: a uint8 CUDA buffer the chosen
  // algorithm may use (its size is part of the problem). For callers that time the candidates.
  m.def("lt_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, Tensor(b!) workspace, "
        "int algo, bool accumulate=False) -> ()");
  // How many candidate algorithms lt_linear has for these arguments (shapes, strides, pointer
  // alignments, bias, accumulate, workspace size, device); 0 if cuBLASLt has none.
  m.def("lt_linear_algos(Tensor x, Tensor weight, Tensor? bias, Tensor out, Tensor workspace, "
        "bool accumulate=False) -> int");
}

TORCH_LIBRARY_IMPL(decodex, CUDA, m) {
  m.impl("gemv", &decodex::gemv);
  m.impl("gemv_silu_mul", &decodex::gemv_silu_mul);
  m.impl("rms_norm", &decodex::rms_norm);
  m.impl("fused_add_rms_norm", &decodex::fused_add_rms_norm);
  m.impl("rope_append", &decodex::rope_append);
  m.impl("gemv_rope_append", &decodex::gemv_rope_append);
  m.impl("silu_mul", &decodex::silu_mul);
  m.impl("decode_attention", &decodex::decode_attention);
  m.impl("rope_append_attention", &decodex::rope_append_attention);
  m.impl("moe_route", &decodex::moe_route);
  m.impl("moe_gemv_silu_mul", &decodex::moe_gemv_silu_mul);
  m.impl("moe_gemv_sum", &decodex::moe_gemv_sum);
  m.impl("argmax", &decodex::argmax);
  m.impl("sample", &decodex::sample);
  m.impl("advance_positions", &decodex::advance_positions);
  m.impl("lt_linear", &decodex::lt_linear);
  m.impl("lt_linear_algos", &decodex::lt_linear_algos);
}
