// RMSNorm and fused residual-add + RMSNorm over rows of x [M, K], bf16 in/out, fp32 math.
//
// Idea: one block per row, each thread owning NV 16-byte vectors (8 bf16) of the row, strided by the
// block so a warp's loads are coalesced. The row (and its weight) stay in registers between the
// sum-of-squares pass and the scale pass, so x is read once and out written once; the weight is
// asked of L2 before the PDL wait and loaded up front, so its latency hides behind the row's. NV in
// {1, 2, 4, 8} and the block size (<= 256 threads, a multiple of 32) are picked from K: K = 1536
// runs 192 threads x 1 vector, K = 8192 256 x 4; a small K gets a single warp (block_sum then costs
// one warp shuffle tree).
// fused_add_rms_norm rounds residual + x to bf16, stores it, and normalises the rounded value, as
// decodex.reference.fused_add_rms_norm does. Precise rsqrtf, no fast-math.
#include "common.h"
#include "ops.h"
#include "ptx.cuh"

namespace decodex {

constexpr int kNormMaxThreads = 256;
constexpr int kNormMaxVecs = 8;  // K <= 8 * 8 * 256 = 16384

// bf16((x * inv_rms) * w), each product rounded, as decodex.reference.rms_norm computes it.
__device__ __forceinline__ bf16x8 rms_scale8(const bf16x8& x, const bf16x8& w, float inv_rms) {
  float a[8], g[8];
  bf16x8_to_float(x, a);
  bf16x8_to_float(w, g);
#pragma unroll
  for (int e = 0; e < 8; ++e) a[e] = __fmul_rn(__fmul_rn(a[e], inv_rms), g[e]);
  return float_to_bf16x8(a);
}

template <int NV, bool kFused>
__global__ void __launch_bounds__(kNormMaxThreads)
rms_norm_kernel(const __nv_bfloat16* __restrict__ x,  // [M, K], row stride x_stride
                int64_t x_stride,
                __nv_bfloat16* __restrict__ residual,  // [M, K], row stride r_stride (kFused only)
                int64_t r_stride,
                const __nv_bfloat16* __restrict__ weight,  // [K]
                __nv_bfloat16* __restrict__ out,           // [M, K], row stride o_stride
                int64_t o_stride, int K, float eps) {
  // The weight (3-16 KB, not recently read in a decode step) is asked of L2 while the kernel ahead
  // finishes: its DRAM round trip no longer follows the wait. One request, from the first block:
  // the other rows' blocks find it there (or load it themselves), rather than each asking again.
  if (blockIdx.x == 0 && threadIdx.x == 0) prefetch_l2_bulk(weight, static_cast<uint32_t>(K) * 2u);
  pdl_begin();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int nvec = K / 8;
  const bf16x8* xr = reinterpret_cast<const bf16x8*>(x + row * x_stride);
  const bf16x8* wr = reinterpret_cast<const bf16x8*>(weight);

  bf16x8 v[NV], w[NV];
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) {
      v[j] = xr[i];
      w[j] = wr[i];
    }
  }
  if constexpr (kFused) {
    bf16x8* rr = reinterpret_cast<bf16x8*>(residual + row * r_stride);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < nvec) {
        float a[8], b[8];
        bf16x8_to_float(v[j], a);
        bf16x8_to_float(rr[i], b);
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = __fadd_rn(b[e], a[e]);
        v[j] = float_to_bf16x8(a);  // the stored (rounded) residual is what gets normalised
        rr[i] = v[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) sumsq = add_squares8(v[j], sumsq);
  }
  sumsq = block_sum(sumsq, scratch);
  const float inv_rms = rms_inv(sumsq, K, eps);

  bf16x8* orow = reinterpret_cast<bf16x8*>(out + row * o_stride);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) orow[i] = rms_scale8(v[j], w[j], inv_rms);
  }
}

namespace {

// x-like argument: [M, K] bf16 on the device of `ref`, inner dim contiguous, rows 16-byte aligned;
// a written one (out, residual) also rows that do not overlap (each block writes its own row).
void check_rows(const at::Tensor& t, const char* name, int64_t M, int64_t K, const at::Tensor& ref,
                bool written = false) {
  DX_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  DX_CHECK(t.device() == ref.device(), name, " must be on ", ref.device(), ", got ", t.device());
  DX_CHECK(t.scalar_type() == at::kBFloat16, name, " must have dtype BFloat16, got ", t.scalar_type());
  DX_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == K, name, " must have shape [", M, ", ", K,
              "], got ", t.sizes());
  DX_CHECK(t.stride(1) == 1, name, " must be contiguous along K, got strides ", t.strides());
  DX_CHECK(t.stride(0) % 8 == 0 || M == 1, name,
              " row stride must be a multiple of 8 elements (16-byte rows), got ", t.stride(0));
  DX_CHECK(!written || M == 1 || t.stride(0) >= K, name, " is written, so its rows must not overlap: ",
              "row stride ", t.stride(0), " is less than K = ", K);
  DX_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned (its storage offset breaks vector loads)");
}

void launch_norm(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps,
                 at::Tensor& out, const char* op) {
  DX_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got shape ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  DX_CHECK(K > 0 && K % 8 == 0, op, ": K = x.size(1) must be a positive multiple of 8, got ", K);
  DX_CHECK(K <= 8 * kNormMaxVecs * kNormMaxThreads, op, ": K = ", K, " is larger than the ",
              8 * kNormMaxVecs * kNormMaxThreads, " this kernel supports");
  check_rows(x, "x", M, K, x);
  check_rows(out, "out", M, K, x, true);
  if (residual) {
    check_rows(*residual, "residual", M, K, x, true);
    // A block writes its residual row, then its out row: shared bytes would lose the sum.
    DX_CHECK(!spans_overlap(*residual, out), op, ": residual and out must not overlap in memory");
  }
  const float epsf = check_rms_eps(op, eps, "eps");
  DX_CHECK(weight.is_cuda() && weight.device() == x.device(), "weight must be on ", x.device(),
              ", got ", weight.device());
  DX_CHECK_DTYPE(weight, at::kBFloat16);
  DX_CHECK_SHAPE(weight, K);
  DX_CHECK_CONTIGUOUS(weight);
  DX_CHECK_ALIGNED16(weight);
  if (M == 0) return;
  DX_CHECK(M <= 0x7fffffff, op, ": M = ", M, " rows is more than one grid holds");

  const c10::cuda::CUDAGuard guard(x.device());
  const int nvec = static_cast<int>(K / 8);
  const int nv = nvec <= 256 ? 1 : nvec <= 512 ? 2 : nvec <= 1024 ? 4 : 8;
  const int threads = ((nvec + nv - 1) / nv + 31) / 32 * 32;
  auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  auto* rp = residual ? reinterpret_cast<__nv_bfloat16*>(residual->data_ptr()) : nullptr;
  const int64_t rs = residual ? residual->stride(0) : 0;
  auto* wp = reinterpret_cast<const __nv_bfloat16*>(weight.data_ptr());
  auto* op_ = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  const dim3 grid(static_cast<unsigned>(M));
  auto go = [&](auto kernel) {
    const cudaError_t err = launch_pdl(kernel, grid, dim3(threads), 0, current_stream(), xp,
                                       x.stride(0), rp, rs, wp, op_, out.stride(0),
                                       static_cast<int>(K), epsf);
    DX_CHECK_LAUNCHED(err, "rms_norm");
  };
  if (residual) {
    switch (nv) {
      case 1: go(rms_norm_kernel<1, true>); break;
      case 2: go(rms_norm_kernel<2, true>); break;
      case 4: go(rms_norm_kernel<4, true>); break;
      default: go(rms_norm_kernel<8, true>); break;
    }
  } else {
    switch (nv) {
      case 1: go(rms_norm_kernel<1, false>); break;
      case 2: go(rms_norm_kernel<2, false>); break;
      case 4: go(rms_norm_kernel<4, false>); break;
      default: go(rms_norm_kernel<8, false>); break;
    }
  }
}

}  // namespace

// out[M,K] = x / rms(x) * weight.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  launch_norm(x, nullptr, weight, eps, out, "rms_norm");
  DX_CHECK_LAUNCH("rms_norm");
}

// residual[M,K] = bf16(residual + x); out = residual / rms(residual) * weight.
void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, at::Tensor& out) {
  launch_norm(x, &residual, weight, eps, out, "fused_add_rms_norm");
  DX_CHECK_LAUNCH("fused_add_rms_norm");
}

}  // namespace decodex
