// SwiGLU activation: out[M, I] = silu(gate_up[M, :I]) * gate_up[M, I:], bf16 in/out, fp32 math.
//
// Idea: a flat grid over all M * I/8 output vectors, one thread per 16-byte vector: it loads 8 gate
// and the 8 matching up values (two 16-byte loads), computes silu(g) = g / (1 + expf(-g)) with the
// precise expf, as torch's silu, times up, each step rounded separately, and stores 8 outputs. The
// flat index keeps every SM busy at M = 1 (I = 8960 is 1120 vectors: 9 blocks of 128) and needs no
// grid-dimension limit at prefill sizes. gate_up rows may be strided (stride(0) >= 2I), e.g. a view
// into a wider buffer. With rms_x (the decode step's cuBLAS path at batch > 8, whose gate|up GEMM
// reads the unnormalised residual): each row is scaled by 1/rms(rms_x row) first (kernel below).
#include "common.h"
#include "ops.h"

namespace decodex {

constexpr int kSiluThreads = 128;

// kRms: grid (ceil(I/8 / kSiluThreads), M), a block per (chunk of a row): it first sums the squares
// of its row of rms_x (every block of the row does, from L2; the gate/up loads are already in
// flight) and scales gate and up by 1/rms before the activation, each rounded to bf16 as gemv's
// rms_eps product is. Otherwise the flat grid above.
template <bool kRms>
__global__ void __launch_bounds__(kSiluThreads)
silu_mul_kernel(const __nv_bfloat16* __restrict__ gate_up,  // [M, 2I], row stride g_stride
                int64_t g_stride,
                __nv_bfloat16* __restrict__ out,  // [M, I], row stride o_stride
                int64_t o_stride, int64_t total /* M * I/8 */, int nvec /* I/8 */,
                const __nv_bfloat16* __restrict__ rms_x,  // kRms: [M, K], row stride x_stride
                int64_t x_stride, int K, float rms_eps) {
  pdl_begin();
  const int64_t i = kRms ? static_cast<int64_t>(blockIdx.y) * nvec + blockIdx.x * blockDim.x + threadIdx.x
                         : static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = kRms ? static_cast<int64_t>(blockIdx.y) : i / nvec;
  const int c = static_cast<int>(i - row * nvec);
  const bool live = kRms ? c < nvec : i < total;
  const __nv_bfloat16* g = gate_up + row * g_stride + static_cast<int64_t>(c) * 8;
  bf16x8 gv = {}, uv = {};
  if (live) {
    gv = *reinterpret_cast<const bf16x8*>(g);
    uv = *reinterpret_cast<const bf16x8*>(g + static_cast<int64_t>(nvec) * 8);
  }
  float scale = 1.f;
  if constexpr (kRms) {  // the whole block: no thread leaves before the reduction
    __shared__ float scratch[32];
    scale = rms_inv(block_sum(thread_sum_squares(rms_x + row * x_stride, K), scratch), K, rms_eps);
  }
  if (!live) return;
  float gf[8], uf[8];
  bf16x8_to_float(gv, gf);
  bf16x8_to_float(uv, uf);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (kRms) {  // the scaled product, rounded as gemv(rms_eps) stores it
      gf[j] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(gf[j], scale)));
      uf[j] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(uf[j], scale)));
    }
    gf[j] = silu_times(gf[j], uf[j]);
  }
  *reinterpret_cast<bf16x8*>(out + row * o_stride + static_cast<int64_t>(c) * 8) = float_to_bf16x8(gf);
}

// out[M,I] = silu(gate_up[M,:I]) * gate_up[M,I:] (gate_up first scaled by 1/rms(rms_x) per row).
void silu_mul(const at::Tensor& gate_up, at::Tensor& out, const std::optional<at::Tensor>& rms_x,
              std::optional<double> rms_eps) {
  DX_CHECK_CUDA(gate_up);
  DX_CHECK_CUDA(out);
  DX_CHECK_SAME_DEVICE(gate_up, out);
  DX_CHECK_DTYPE(gate_up, at::kBFloat16);
  DX_CHECK_DTYPE(out, at::kBFloat16);
  DX_CHECK_DIM(gate_up, 2);
  DX_CHECK_DIM(out, 2);
  const int64_t M = gate_up.size(0), I2 = gate_up.size(1);
  DX_CHECK(I2 % 16 == 0 && I2 > 0,
              "silu_mul: gate_up.size(1) = 2I must be a positive multiple of 16 (I % 8 == 0), got ", I2);
  const int64_t I = I2 / 2;
  DX_CHECK_SHAPE(out, M, I);
  DX_CHECK(gate_up.stride(1) == 1, "gate_up must be contiguous along its last dim, got strides ",
              gate_up.strides());
  DX_CHECK(out.stride(1) == 1, "out must be contiguous along its last dim, got strides ", out.strides());
  DX_CHECK(M <= 1 || (gate_up.stride(0) >= I2 && gate_up.stride(0) % 8 == 0),
              "gate_up row stride must be >= 2I = ", I2, " and a multiple of 8 elements, got ",
              gate_up.stride(0));
  DX_CHECK(M <= 1 || (out.stride(0) >= I && out.stride(0) % 8 == 0),
              "out row stride must be >= I = ", I, " and a multiple of 8 elements, got ", out.stride(0));
  DX_CHECK_ALIGNED16(gate_up);
  DX_CHECK_ALIGNED16(out);
  DX_CHECK(I / 8 <= 0x7fffffff, "silu_mul: I too large");
  const RmsX rx = check_rms_x("silu_mul", rms_x, rms_eps, M, gate_up);
  // Blocks read rms_x rows for their scale while others write out.
  DX_CHECK(!rms_x || !spans_overlap(*rms_x, out), "silu_mul: out must not overlap rms_x");
  DX_CHECK(!rms_x || M <= 65535, "silu_mul: M = ", M,
           " rows is more than one grid column holds (65535) with rms_x");
  const int64_t total = M * (I / 8);
  if (total == 0) return;
  const int64_t blocks = (total + kSiluThreads - 1) / kSiluThreads;
  DX_CHECK(blocks <= 0x7fffffff, "silu_mul: M * I too large for one grid");

  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int nvec = static_cast<int>(I / 8);
  const dim3 grid = rms_x ? dim3(static_cast<unsigned>((nvec + kSiluThreads - 1) / kSiluThreads),
                                 static_cast<unsigned>(M))
                          : dim3(static_cast<unsigned>(blocks));
  const cudaError_t err = launch_pdl(
      rms_x ? silu_mul_kernel<true> : silu_mul_kernel<false>, grid, dim3(kSiluThreads), 0,
      current_stream(), reinterpret_cast<const __nv_bfloat16*>(gate_up.data_ptr()), gate_up.stride(0),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), out.stride(0), total, nvec,
      static_cast<const __nv_bfloat16*>(rx.ptr), rx.stride, static_cast<int>(rx.K), rx.eps);
  DX_CHECK_LAUNCHED(err, "silu_mul");
  DX_CHECK_LAUNCH("silu_mul");
}

}  // namespace decodex
