// The GEMV kernel's instances that split K over a thread-block cluster (c > 1; see
// csrc/gemv_kernel.cuh), compiled apart from gemv.cu's c = 1 instances so the two build in parallel.
#include "gemv_kernel.cuh"

namespace decodex {
namespace gemv_detail {

template GemvKernel kernel_for<true>(int m, int u, GemvEpilogue epi, bool rms);

}  // namespace gemv_detail
}  // namespace decodex
