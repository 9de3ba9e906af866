// A probe, not part of decodex: does the order in which decodex's GEMV reads a weight cost DRAM
// bandwidth? (bench/RESULTS.md, session 21: the 7B down projection, K = 18944, streams 12% slower
// than a pure read of its bytes, and no configuration changed that.)
// One kernel reads an N x K bf16 "weight" with exactly gemv_kernel's loads (csrc/gemv.cu, M = 1,
// nothing computed): a warp owns one 16-row tile and one of P = wk * c k-ranges, and takes U
// k-steps of 32 values a trip, lane (g, t) reading 16 bytes of rows g and g + 8 at k = 32 s + 8 t
// with ld.global.nc.L1::no_allocate.L2::256B, all 2U loads of a trip in flight at once. Blocks of
// wr * wk warps, ceil(N / 16 / wr) * c of them (no cluster: the c blocks of a tile group only split
// its k-steps), as many resident on an SM as of gemv_kernel (its 96 or 128 registers a thread, from
// ptxas, allow `bps` blocks; this kernel needs fewer, so unused dynamic shared memory holds it to
// that). Two layouts of the same bytes, the same loads and the same grid:
//   row-major  [N, K]: a trip reads 16 rows x 64U bytes, each row's piece K * 2 bytes from the next
//              (decodex today);
//   tile-packed: each tile's k-step (16 rows x 32 values, 1 KB) stored contiguously in k-step
//              order, so a warp's k-range of a tile is one contiguous run and a trip U KB of it.
// Each layout is timed L2-cold (each launch reads a copy of the weight the launches before did not
// touch: two 1.1 GB buffers, each cut into as many copies as fit), one launch at a time between
// CUDA events, median of 21, after 3 warm-ups; GB/s is weight bytes over that time. The shapes and
// configurations are those csrc/gemv.cu's table picks at M = 1 for Qwen2.5-7B and -1.5B (wr, wk,
// c, U). A reference line times a 1 GiB device-to-device cudaMemcpy (read and write).
// Every word of each load is folded into a checksum that decides a store which never happens, so
// no load is narrowed or dropped.
// Build here or on the GPU machine, from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o layout_probe bench/layout_probe.cu
//   ./layout_probe
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "probe.cuh"

namespace {

constexpr int kTileRows = 16;  // weight rows a warp owns (the mma's m)
constexpr int kStepK = 32;     // values of a row a warp step reads (4 lanes x 8 bf16)

__device__ __forceinline__ uint4 load16(const void* p, bool pred) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (pred) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  }
  return v;
}

// Byte offset of the 16 bytes lane t reads of row r (0..15) of `tile` at k-step s.
__device__ __forceinline__ int64_t offset(bool packed, int64_t tile, int r, int64_t s, int t, int64_t K) {
  const int64_t ksteps = K / kStepK;
  return packed ? (((tile * ksteps + s) * kTileRows + r) * kStepK + 8 * t) * 2
                : ((tile * kTileRows + r) * K + s * kStepK + 8 * t) * 2;
}

template <int U>
__global__ void __launch_bounds__(256, 2) stream_kernel(const char* __restrict__ w, int N, int64_t K,
                                                        int wr, int wk, int c, bool packed,
                                                        unsigned* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x % c;
  const int64_t tile = (blockIdx.x / c) * wr + warp / wk;
  const int parts = wk * c, part = rank * wk + warp % wk;
  const int64_t ksteps = K / kStepK;
  const bool tile_ok = tile * kTileRows < N;
  const int64_t s_begin = part * ksteps / parts;
  const int64_t s_end = tile_ok ? (part + 1) * ksteps / parts : s_begin;
  unsigned acc = 0;
  for (int64_t s = s_begin; s < s_end; s += U) {
    uint4 a[U], b[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const bool in = s + j < s_end;
      a[j] = load16(w + offset(packed, tile, g, in ? s + j : s_begin, t, K), in);
      b[j] = load16(w + offset(packed, tile, g + 8, in ? s + j : s_begin, t, K), in);
    }
#pragma unroll
    for (int j = 0; j < U; ++j) acc += a[j].x ^ a[j].y ^ a[j].z ^ a[j].w ^ b[j].x ^ b[j].y ^ b[j].z ^ b[j].w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // (never, for these bytes)
}

struct Shape {
  const char* name;
  int N;
  int64_t K;
  int wr, wk, c, u;  // csrc/gemv.cu's M = 1 choice
  int bps;            // gemv_kernel's blocks an SM at that choice (65536 registers)
};

constexpr Shape kShapes[] = {
    {"7B down", 3584, 18944, 1, 8, 1, 4, 2},       // 8 warps x 96 registers
    {"7B gate|up", 37888, 3584, 1, 8, 1, 8, 2},    // 8 x 128
    {"7B q, o", 3584, 3584, 1, 7, 1, 4, 3},        // 7 x 96
    {"7B lm_head", 152064, 3584, 1, 5, 1, 8, 3},   // 5 x 128
    {"1.5B down", 1536, 8960, 1, 7, 2, 8, 2},      // 7 x 128
    {"1.5B gate|up", 17920, 1536, 1, 2, 1, 4, 10},  // 2 x 96
};

// GPU milliseconds of what `launch` enqueues, between two CUDA events.
template <typename F>
float event_ms(F launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  launch();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms;
}

float median_us(const Shape& sh, bool packed, char* const (&bufs)[2], int64_t buf_bytes, unsigned* sink) {
  const int64_t bytes = (int64_t{2} * sh.N * sh.K + 255) / 256 * 256;
  const int64_t copies = std::max<int64_t>(1, buf_bytes / bytes);  // per buffer
  const int64_t tiles = (sh.N + kTileRows - 1) / kTileRows;
  const dim3 grid(static_cast<unsigned>((tiles + sh.wr - 1) / sh.wr * sh.c));
  const dim3 block(static_cast<unsigned>(sh.wr * sh.wk * 32));
  // Shared memory that only limits the blocks an SM to sh.bps (228 KB an SM, 1 KB reserved a block).
  const int pad = ((228 << 10) / sh.bps - (2 << 10)) / 1024 * 1024;
  auto* k4 = stream_kernel<4>;
  auto* k8 = stream_kernel<8>;
  for (const void* k : {reinterpret_cast<const void*>(k4), reinterpret_cast<const void*>(k8)}) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    CK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  }
  std::vector<float> times;
  for (int i = 0; i < 24; ++i) {
    const char* w = bufs[i & 1] + ((i / 2) % copies) * bytes;
    const float ms = event_ms([&] {
      if (sh.u == 8) {
        stream_kernel<8><<<grid, block, pad>>>(w, sh.N, sh.K, sh.wr, sh.wk, sh.c, packed, sink);
      } else {
        stream_kernel<4><<<grid, block, pad>>>(w, sh.N, sh.K, sh.wr, sh.wk, sh.c, packed, sink);
      }
      CK(cudaGetLastError());
    });
    if (i >= 3) times.push_back(ms * 1000.f);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main() {
  int64_t max_bytes = 0;
  for (const Shape& sh : kShapes) max_bytes = std::max(max_bytes, int64_t{2} * sh.N * sh.K);
  char* bufs[2];
  for (char*& b : bufs) {
    CK(cudaMalloc(&b, max_bytes));
    CK(cudaMemset(b, 0x3c, max_bytes));
  }
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 20));

  // Reference: a 1 GiB device-to-device copy reads 1 GiB and writes 1 GiB.
  {
    const size_t n = size_t{1} << 30;
    char *src, *dst;
    CK(cudaMalloc(&src, n));
    CK(cudaMalloc(&dst, n));
    float best = 1e30f;
    for (int i = 0; i < 5; ++i) {
      best = std::min(best, event_ms([&] { CK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice)); }));
    }
    std::printf("reference: 1 GiB cudaMemcpy D2D, best of 5: %.0f GB/s (read + write)\n",
                2.0 * n / (best * 1e-3) / 1e9);
    CK(cudaFree(src));
    CK(cudaFree(dst));
  }

  std::printf("| shape | N x K | wr,wk,c,U | blocks an SM | MB | row-major us | GB/s | tile-packed us | GB/s |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Shape& sh : kShapes) {
    const double bytes = 2.0 * sh.N * sh.K;
    const float rm = median_us(sh, false, bufs, max_bytes, sink);
    const float pk = median_us(sh, true, bufs, max_bytes, sink);
    std::printf("| %s | %d x %lld | %d,%d,%d,%d | %d | %.1f | %.2f | %.0f | %.2f | %.0f |\n", sh.name, sh.N,
                static_cast<long long>(sh.K), sh.wr, sh.wk, sh.c, sh.u, sh.bps, bytes / 1e6, rm,
                bytes / (rm * 1e-6) / 1e9, pk, bytes / (pk * 1e-6) / 1e9);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
