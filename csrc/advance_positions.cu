// Moves every live sequence one token on, on the device, so a captured decode step needs no host
// work between tokens: for positions[b] >= 0, positions[b] += 1 and lengths[b] = positions[b] + 1
// (the new value). Rows with positions[b] < 0 (free slots) are left as they are, lengths included.
// With argmax_keys (the greedy step's LM head GEMV left each row's argmax keys there, gemv's
// argmax_keys) it first finishes that argmax: tokens[b] = the index of row b's largest key (-1 if
// every key is 0, i.e. nothing was reduced into the row), and zeroes the keys for the next step.
// Idea: one thread per row (B is at most a few hundred); with keys, one block per row, whose
// thread 0 then advances it.
#include "common.h"
#include "logits.cuh"
#include "ops.h"

namespace decodex {

constexpr int kAdvanceThreads = 128;

// Grid: without keys, one thread per row; with keys, one block per row (the keys of a row: 8 KB in
// the decode step, 8 loads a thread).
__global__ void __launch_bounds__(kAdvanceThreads)
advance_positions_kernel(int* __restrict__ positions,  // [B]
                         int* __restrict__ lengths,    // [B]
                         int64_t B,
                         u64* __restrict__ keys,       // [B, slots], row stride ldk; or nullptr
                         int64_t ldk, int slots,
                         int64_t* __restrict__ tokens) {  // [B] (with keys)
  pdl_begin();
  int64_t b = static_cast<int64_t>(blockIdx.x) * kAdvanceThreads + threadIdx.x;
  if (keys != nullptr) {
    __shared__ u64 scratch[32];
    constexpr int kBatch = 4;  // loads in flight a thread
    b = blockIdx.x;
    u64* row = keys + b * ldk;
    u64 best = 0;
    for (int j0 = threadIdx.x; j0 < slots; j0 += kBatch * kAdvanceThreads) {
      u64 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u * kAdvanceThreads;
        v[u] = j < slots ? row[j] : u64{0};
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u * kAdvanceThreads;
        if (j < slots) row[j] = 0;
        best = Max{}(best, v[u]);
      }
    }
    best = block_max_u64(best, scratch);
    if (threadIdx.x != 0) return;
    tokens[b] = best == 0 ? -1 : argmax_key_index(best);
  }
  if (b >= B) return;
  const int p = positions[b];
  if (p < 0) return;
  positions[b] = p + 1;
  lengths[b] = p + 2;
}

// For each live row (positions[b] >= 0): positions[b] += 1; lengths[b] = positions[b] + 1. With
// argmax_keys [B, slots] int64 (gemv's): first tokens[b] = the argmax its keys name, keys zeroed.
void advance_positions(at::Tensor& positions, at::Tensor& lengths,
                       const std::optional<at::Tensor>& argmax_keys,
                       const std::optional<at::Tensor>& tokens) {
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
  DX_CHECK(argmax_keys.has_value() == tokens.has_value(),
           "advance_positions: pass argmax_keys and tokens together (or neither)");
  u64* keys = nullptr;
  int64_t ldk = 0;
  int slots = 1;
  int64_t* tok = nullptr;
  if (argmax_keys.has_value()) {
    const at::Tensor& k = *argmax_keys;  // checked by hand: the messages must name the arguments
    const at::Tensor& t = *tokens;
    DX_CHECK(k.is_cuda() && k.device() == positions.device() && t.is_cuda() &&
                 t.device() == positions.device(),
             "argmax_keys and tokens must be on positions' device ", positions.device(), ", got ",
             k.device(), " and ", t.device());
    DX_CHECK(k.scalar_type() == at::kLong && t.scalar_type() == at::kLong,
             "argmax_keys and tokens must have dtype ", at::kLong, ", got ", k.scalar_type(),
             " and ", t.scalar_type());
    DX_CHECK(k.dim() == 2 && k.size(0) == B && k.size(1) >= 1 && k.size(1) <= (int64_t{1} << 30) &&
                 (k.size(1) == 1 || k.stride(1) == 1) && (B <= 1 || k.stride(0) >= k.size(1)),
             "argmax_keys must be [B, slots] = [", B, ", >= 1] with a contiguous last dim and rows ",
             "that do not overlap, got shape ", k.sizes(), " and strides ", k.strides());
    DX_CHECK(t.dim() == 1 && t.size(0) == B && (B <= 1 || t.stride(0) == 1),
             "tokens must be a contiguous [B] = [", B, "] tensor, got shape ", t.sizes(),
             " and strides ", t.strides());
    DX_CHECK(!spans_overlap(k, t) && !spans_overlap(k, positions) && !spans_overlap(k, lengths) &&
                 !spans_overlap(t, positions) && !spans_overlap(t, lengths),
             "advance_positions: argmax_keys, tokens, positions and lengths must not overlap");
    keys = reinterpret_cast<u64*>(k.data_ptr<int64_t>());
    ldk = B <= 1 ? 0 : k.stride(0);
    slots = static_cast<int>(k.size(1));
    tok = t.data_ptr<int64_t>();
  }
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t blocks = keys != nullptr ? B : (B + kAdvanceThreads - 1) / kAdvanceThreads;
  DX_CHECK(blocks <= 0x7fffffff, "advance_positions: B = ", B, " rows is more than one grid holds");
  const cudaError_t err = launch_pdl(advance_positions_kernel, dim3(static_cast<unsigned>(blocks)),
                                     dim3(kAdvanceThreads), 0, current_stream(),
                                     positions.data_ptr<int>(), lengths.data_ptr<int>(), B, keys, ldk,
                                     slots, tok);
  DX_CHECK_LAUNCHED(err, "advance_positions");
  DX_CHECK_LAUNCH("advance_positions");
}

}  // namespace decodex
