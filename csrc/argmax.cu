// Greedy decoding: out[b] = argmax(logits[b, :]) (int64), ties to the lowest index, NaN counted as
// the largest value (as torch.argmax does). logits bf16 or fp32, [B, V], any V (a ragged tail and
// unaligned rows fall back to scalar loads), inner dim contiguous.
//
// Idea: a single block per row is latency-bound (V = 151936 bf16 is 300 KB: one SM cannot pull it
// fast), so each row is split into `chunks` blocks (grid = chunks x B, at most one resident wave;
// 149 blocks of 128 threads at B = 1, each thread one 16-byte load; at B = 64 on an H200, 18
// blocks a row, each thread 8-9 loads, 4 in flight at a time). Each thread keeps its best
// (value, index) as floats compare (logits.cuh), and that becomes a 64-bit key (order-preserving
// value bits << 32 | ~index), so the rest of the reduction is an unsigned max. Every block writes
// its key to a static partial array and bumps a per-row counter; the block that brings the counter
// to `chunks` (last block done, after a __threadfence) combines the partials, writes out[b] and
// resets the counter to 0, so the next launch and every CUDA-graph replay start clean. No
// allocation, no workspace argument, one launch.
//
// Limits of the static state: rows use the split path only for B <= kArgmaxMaxRows (256); larger
// batches take one block per row (chunks = 1: no partials, no counter), which is already wide enough.
// Two argmax launches must not run concurrently on different streams of the same device (they would
// share the partials); the decode loop runs on one stream.
#include <algorithm>

#include "common.h"
#include "logits.cuh"
#include "ops.h"

namespace decodex {

constexpr int kArgmaxThreads = 128;
constexpr int kArgmaxMaxChunks = 256;
constexpr int kArgmaxMaxRows = 256;

__device__ u64 g_argmax_partial[kArgmaxMaxRows * kArgmaxMaxChunks];
__device__ unsigned g_argmax_done[kArgmaxMaxRows];  // zero at load; every launch leaves it zero

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
argmax_kernel(const T* __restrict__ logits,  // [B, V], row stride row_stride
              int64_t row_stride, int64_t V, bool vec_ok,
              int64_t chunk_len,          // 8-element groups per block
              int64_t* __restrict__ out,  // [B], stride out_stride
              int64_t out_stride) {
  pdl_begin();
  __shared__ u64 scratch[32];
  __shared__ bool is_last;
  const int64_t b = blockIdx.y;
  const int chunks = gridDim.x, chunk = blockIdx.x;
  const T* row = logits + b * row_stride;
  const int64_t groups = (V + 7) / 8;
  const int64_t begin = chunk * chunk_len;
  const int64_t end = begin + chunk_len < groups ? begin + chunk_len : groups;
  u64 best = block_max_u64(thread_argmax(row, V, begin, end, vec_ok), scratch);

  if (chunks == 1) {
    if (threadIdx.x == 0) out[b * out_stride] = argmax_key_index(best);
    return;
  }
  if (threadIdx.x == 0) {
    g_argmax_partial[b * kArgmaxMaxChunks + chunk] = best;
    __threadfence();  // the partial is visible device-wide before the counter says so
    const unsigned prev = atomicAdd(&g_argmax_done[b], 1u);
    is_last = prev == static_cast<unsigned>(chunks - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  best = 0;
  for (int i = threadIdx.x; i < chunks; i += blockDim.x)
    best = Max{}(best, __ldcg(&g_argmax_partial[b * kArgmaxMaxChunks + i]));
  best = block_max_u64(best, scratch);
  if (threadIdx.x == 0) {
    out[b * out_stride] = argmax_key_index(best);
    g_argmax_done[b] = 0;  // ready for the next launch (kernel boundaries order this store)
  }
}

namespace {

// Resident blocks per SM of argmax_kernel<T> (bf16 or fp32); asked once per dtype, cached.
int argmax_blocks_per_sm(at::ScalarType dtype) {
  static std::atomic<int> cache[2];  // bf16, fp32
  const bool fp32 = dtype == at::kFloat;
  const void* kernel = fp32 ? reinterpret_cast<const void*>(argmax_kernel<float>)
                            : reinterpret_cast<const void*>(argmax_kernel<__nv_bfloat16>);
  return cached_blocks_per_sm(cache[fp32], kernel, kArgmaxThreads, "argmax");
}

}  // namespace

// out[B] (int64) = argmax(logits[B,V]); ties go to the lowest index.
void argmax(const at::Tensor& logits, at::Tensor& out) {
  DX_CHECK_CUDA(logits);
  DX_CHECK_CUDA(out);
  DX_CHECK_SAME_DEVICE(logits, out);
  DX_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "logits must have dtype BFloat16 or Float, got ", logits.scalar_type());
  DX_CHECK_DIM(logits, 2);
  const int64_t B = logits.size(0), V = logits.size(1);
  DX_CHECK(V >= 1 && V <= 0x7fffffff, "argmax: V = logits.size(1) must be in [1, 2^31), got ", V);
  DX_CHECK(logits.stride(1) == 1 || V == 1, "logits must be contiguous along V, got strides ",
              logits.strides());
  DX_CHECK_DTYPE(out, at::kLong);
  DX_CHECK_SHAPE(out, B);
  if (B == 0) return;
  DX_CHECK(B <= 65535, "argmax: B = ", B, " rows is more than one grid column holds (65535)");

  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t esize = logits.element_size();
  const bool vec_ok = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 &&
                      (B == 1 || (logits.stride(0) * esize) % 16 == 0);
  const int64_t groups = (V + 7) / 8;
  // One resident wave of blocks, split evenly over the rows: a block per 128 groups at batch 1
  // (149 blocks), 18 chunks a row at batch 64 (bf16: 9 blocks an SM), each thread looping over its
  // groups 4 loads at a time. Sized for 16 blocks an SM instead (2112 blocks at batch 64, where
  // 1188 are resident at once), batch 64 took 16.4 us against 14.6 now, and batch 8 5.78 against
  // 5.38 (H200, bench/RESULTS.md, session 15).
  const int64_t wave = static_cast<int64_t>(argmax_blocks_per_sm(logits.scalar_type())) *
                       sm_count(logits.get_device());
  int64_t chunks = std::min<int64_t>((groups + kArgmaxThreads - 1) / kArgmaxThreads, kArgmaxMaxChunks);
  chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, wave / B));
  if (B > kArgmaxMaxRows) chunks = 1;
  const int64_t chunk_len = (groups + chunks - 1) / chunks;
  chunks = (groups + chunk_len - 1) / chunk_len;  // no empty block
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(B));
  cudaError_t err;
  if (logits.scalar_type() == at::kBFloat16) {
    err = launch_pdl(argmax_kernel<__nv_bfloat16>, grid, dim3(kArgmaxThreads), 0, current_stream(),
                     reinterpret_cast<const __nv_bfloat16*>(logits.data_ptr()), logits.stride(0), V,
                     vec_ok, chunk_len, out.data_ptr<int64_t>(), out.stride(0));
  } else {
    err = launch_pdl(argmax_kernel<float>, grid, dim3(kArgmaxThreads), 0, current_stream(),
                     logits.data_ptr<float>(), logits.stride(0), V, vec_ok, chunk_len,
                     out.data_ptr<int64_t>(), out.stride(0));
  }
  DX_CHECK_LAUNCHED(err, "argmax");
  DX_CHECK_LAUNCH("argmax");
}

}  // namespace decodex
