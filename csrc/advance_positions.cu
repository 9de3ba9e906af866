// Moves every live sequence one token on, on the device, so a captured decode step needs no host
// work between tokens: for positions[b] >= 0, positions[b] += 1 and lengths[b] = positions[b] + 1
// (the new value). Rows with positions[b] < 0 (free slots) are left as they are, lengths included.
// Idea: one thread per row; B is at most a few hundred, so a single block-sized grid is enough.
#include "common.h"
#include "ops.h"

namespace decodex {

__global__ void advance_positions_kernel(int* __restrict__ positions,  // [B]
                                         int* __restrict__ lengths,    // [B]
                                         int64_t B) {
  pdl_begin();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int p = positions[b];
  if (p < 0) return;
  positions[b] = p + 1;
  lengths[b] = p + 2;
}

// For each live row (positions[b] >= 0): positions[b] += 1; lengths[b] = positions[b] + 1.
void advance_positions(at::Tensor& positions, at::Tensor& lengths) {
  DX_CHECK_CUDA(positions);
  DX_CHECK_CUDA(lengths);
  DX_CHECK_SAME_DEVICE(positions, lengths);
  DX_CHECK_DTYPE(positions, at::kInt);
  DX_CHECK_DTYPE(lengths, at::kInt);
  DX_CHECK_DIM(positions, 1);
  DX_CHECK_SHAPE(lengths, positions.size(0));
  DX_CHECK_CONTIGUOUS(positions);
  DX_CHECK_CONTIGUOUS(lengths);
  DX_CHECK(!positions.is_same(lengths) && positions.data_ptr() != lengths.data_ptr(),
              "positions and lengths must be different buffers");
  const int64_t B = positions.size(0);
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(positions.device());
  const int threads = 128;
  const cudaError_t err = launch_pdl(advance_positions_kernel,
                                     dim3(static_cast<unsigned>((B + threads - 1) / threads)),
                                     dim3(threads), 0, current_stream(), positions.data_ptr<int>(),
                                     lengths.data_ptr<int>(), B);
  DX_CHECK_LAUNCHED(err, "advance_positions");
  DX_CHECK_LAUNCH("advance_positions");
}

}  // namespace decodex
