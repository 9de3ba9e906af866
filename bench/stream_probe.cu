// A probe, not part of decodex: which way of streaming a large read-only buffer through an SM's
// shared memory keeps the H200's HBM busy. It is what bench/RESULTS.md (session 3, "Tried and
// dropped") quotes for the copy engine's rate per block. Each block streams its share of a 2 GiB
// buffer through a ring of S stages; four consumer warps read every stage from shared memory.
//   method 0: one producer warp, one cp.async.bulk per "row" piece of a stage, on an mbarrier
//   method 1: one producer warp, 16-byte cp.async, cp.async.mbarrier.arrive.noinc
//   pf 1: L2 prefetch of the first S stages before the copies; pf 2: of stages S .. 2S-1
//   reference: plain 16-byte register loads (stream.cuh's read_kernel), 8 in flight per thread
// Build and run on the GPU machine, from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Icsrc -o stream_probe bench/stream_probe.cu
//   ./stream_probe        (the cases below)
//   ./stream_probe sms    (how fast a few SMs alone stream: 256 MiB
//                          over G blocks of one SM each, 12 stages of one 16 KB copy in flight, then
//                          plain loads by 1024 threads, 128 or 256 KB in flight an SM, spread out
//                          or in clusters of 8 and 16 blocks, each cluster on one GPC)
// Single launches timed with CUDA events (best of 5), not graph replay: compare rows with each
// other, not with the graph-replayed op benchmarks.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <string>
#include <cuda_runtime.h>

#include "probe.cuh"
#include "stream.cuh"

namespace probe {
using namespace decodex;

constexpr int kCons = 4;
// method 0: TMA 1D, stage = rows x rowbytes pieces taken from rows `stride` bytes apart
// method 1: cp.async 16B by the producer warp, cp.async.mbarrier.arrive.noinc
__global__ void __launch_bounds__(160, 2) ring_kernel(const unsigned char* __restrict__ buf, size_t per_block,
    int rows, int rowbytes, size_t stride, int S, int method, int pf, float* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[16], empty[16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int stage_bytes = rows * rowbytes;
  // block's region: per_block bytes of "stages" laid out as rows with stride
  const unsigned char* base = buf + (size_t)blockIdx.x * per_block;
  const int nst = (int)(per_block / stage_bytes);  // stages (tile-chunk) this block streams
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) { mbar_init(&full[i], method == 0 ? 1 : 32); mbar_init(&empty[i], kCons); }
    fence_mbar_init();
  }
  if (warp == kCons && pf) {
    const int cpr = (int)(stride / rowbytes);
    for (int q = pf == 1 ? 0 : S; q < (pf == 1 ? S : 2 * S) && q < nst; ++q) {
      const unsigned char* src0 = base + (size_t)(q / cpr) * rows * stride + (size_t)(q % cpr) * rowbytes;
      for (int r = lane; r < rows; r += 32) prefetch_l2_bulk(src0 + r * stride, rowbytes);
    }
  }
  __syncthreads();
  if (warp == kCons) {
    const uint64_t pol = l2_evict_first();
    for (int q = 0; q < nst; ++q) {
      const int slot = q % S, round = q / S;
      if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
      // stage q: rows r of group (q / pieces_per_row ...) simple: stage q covers rows [0,rows) at column offset
      // piece p: address = base + (q / cpr) * rows*stride + r*stride + (q % cpr)*rowbytes, where cpr = stride/rowbytes
      const int cpr = (int)(stride / rowbytes);
      const unsigned char* src0 = base + (size_t)(q / cpr) * rows * stride + (size_t)(q % cpr) * rowbytes;
      unsigned char* dst0 = smem + (size_t)slot * stage_bytes;
      if (method == 0) {
        if (lane == 0) mbar_arrive_expect(&full[slot], stage_bytes);
        __syncwarp();
        for (int r = lane; r < rows; r += 32)
          bulk_copy_to_shared(dst0 + r * rowbytes, src0 + r * stride, rowbytes, &full[slot], pol);
      } else {
        const int chunks = stage_bytes / 16, per_row = rowbytes / 16;
        for (int i = lane; i < chunks; i += 32) {
          const int r = i / per_row, c = i % per_row;
          const unsigned char* s = src0 + r * stride + c * 16;
          asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" :: "r"(smem_u32(dst0 + r * rowbytes + c * 16)), "l"(s) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_u32(&full[slot])) : "memory");
      }
    }
    return;
  }
  float acc = 0.f;
  for (int q = 0; q < nst; ++q) {
    const int slot = q % S;
    mbar_wait(&full[slot], (q / S) & 1);
    const uint32_t a = smem_u32(smem + (size_t)slot * stage_bytes);
    for (int off = (warp * 32 + lane) * 16; off < stage_bytes; off += kCons * 32 * 16) {
      uint4 v = lds16(a + off);
      acc += __int_as_float(v.x) + __int_as_float(v.w);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
  if (acc == 12345.f) sink[0] = acc;
}

// The "sms" mode's plain read: block b reads its own per_block bytes with 16-byte loads, U in
// flight a thread (1024 threads: U * 16 KB a block). Not stream.cuh's read_kernel, whose 256-thread
// blocks stride over the whole buffer: here one block must hold an SM's loads in flight alone.
template <int U>
__global__ void __launch_bounds__(1024, 1) block_read_kernel(const uint4* __restrict__ buf, int64_t n16_block,
                                                             float* sink) {
  const uint4* p = buf + blockIdx.x * n16_block;
  unsigned acc = 0;
  for (int64_t i = threadIdx.x; i < n16_block; i += U * 1024) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = decodex::load16_stream_l2_256(p + i + j * 1024, i + j * 1024 < n16_block);
#pragma unroll
    for (int j = 0; j < U; ++j) acc += v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9E3779B9u) sink[0] = static_cast<float>(acc);
}

}  // namespace probe

int main(int argc, char** argv) {
  using namespace probe;
  const bool few_sms = argc > 1 && std::string(argv[1]) == "sms";
  const size_t total = (size_t)2 << 30;  // 2 GiB
  unsigned char* buf; float* sink;
  cudaMalloc(&buf, total); cudaMalloc(&sink, 4); cudaMemset(buf, 1, total);
  cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  auto timeit = [&](auto launch) {  // best of 5 after a warm-up
    launch(); cudaDeviceSynchronize();
    float best = 1e9;
    for (int r = 0; r < 5; ++r) best = std::min(best, event_ms(launch));
    return best;
  };
  if (few_sms) {
    const size_t bytes = (size_t)256 << 20, stage = 16384;  // long enough to hide the launch
    for (int g : {8, 16, 32, 64, 132}) {
      const size_t per_block = bytes / g / stage * stage;
      float ms = timeit([&] { ring_kernel<<<g, 160, 12 * stage>>>(buf, per_block, 1, stage, stage, 12, 0, 0, sink); });
      cudaError_t err = cudaGetLastError();
      printf("%3d SMs, %7zu B/block: %.0f GB/s (%.1f GB/s an SM), %.2f us %s\n", g, per_block,
             per_block * g / ms / 1e6, per_block / ms / 1e6, ms * 1e3, err ? cudaGetErrorString(err) : "");
    }
    // The same with plain 16-byte loads, 1024 threads a block (the 120 KB of dynamic shared memory
    // asked for and unused keeps it to one block an SM).
    cudaFuncSetAttribute(block_read_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10);
    cudaFuncSetAttribute(block_read_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10);
    for (int u : {8, 16}) {
      for (int g : {8, 16, 32, 64, 132}) {
        const size_t per_block = bytes / g / 16 * 16;
        const int64_t n16 = static_cast<int64_t>(per_block / 16);
        float ms = timeit([&] {
          if (u == 8) block_read_kernel<8><<<g, 1024, 120 << 10>>>((const uint4*)buf, n16, sink);
          else block_read_kernel<16><<<g, 1024, 120 << 10>>>((const uint4*)buf, n16, sink);
        });
        cudaError_t err = cudaGetLastError();
        printf("plain U%-2d %3d SMs: %.0f GB/s (%.1f GB/s an SM) %s\n", u, g, per_block * g / ms / 1e6,
               per_block / ms / 1e6, err ? cudaGetErrorString(err) : "");
      }
    }
    // U = 8 again with the blocks in clusters of c (c = 16: non-portable), which the hardware puts
    // on the SMs of one GPC each: does a GPC's SMs stream as fast as as many SMs spread out?
    cudaFuncSetAttribute(block_read_kernel<8>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    for (int c : {8, 16}) {
      for (int g : {c, 2 * c, 4 * c, 8 * c}) {
        const size_t per_block = bytes / g / 16 * 16;
        const int64_t n16 = static_cast<int64_t>(per_block / 16);
        const uint4* src = reinterpret_cast<const uint4*>(buf);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = c;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(g);
        cfg.blockDim = dim3(1024);
        cfg.dynamicSmemBytes = 120 << 10;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        int clusters = 0;
        cudaOccupancyMaxActiveClusters(&clusters, block_read_kernel<8>, &cfg);
        float ms = timeit([&] { cudaLaunchKernelEx(&cfg, block_read_kernel<8>, src, n16, sink); });
        cudaError_t err = cudaGetLastError();
        printf("plain U8  %3d SMs in clusters of %2d (%d fit at once): %.0f GB/s (%.1f GB/s an SM) %s\n", g, c,
               clusters, per_block * g / ms / 1e6, per_block / ms / 1e6, err ? cudaGetErrorString(err) : "");
      }
    }
    return 0;
  }
  printf("regs: ");
  for (int bps : {2, 4, 8}) {
    float ms = timeit([&] { read_kernel<8><<<sms * bps, 256>>>((const uint4*)buf, static_cast<int64_t>(total / 16), sink); });
    printf(" U8 %d blk/sm %.0f GB/s |", bps, total / ms / 1e6);
  }
  printf("\n");
  struct Case { int method, rows, rowbytes; size_t stride; int S, bps; int pf = 0; size_t limit = 0; };
  Case cases[] = {
    // whole buffer: the rate per block of many small copies against fewer large ones
    {0, 16, 1024, 3072, 6, 1}, {0, 16, 1024, 3072, 6, 2}, {0, 16, 1024, 3072, 12, 1},
    {0, 16, 1024, 1024, 6, 1},
    {0, 1, 16384, 16384, 6, 1}, {0, 1, 16384, 16384, 6, 2}, {0, 1, 16384, 16384, 12, 1},
    {0, 2, 8192, 8192, 6, 1}, {0, 4, 4096, 4096, 6, 1},
    {0, 16, 3072, 3072, 2, 1}, {0, 16, 3072, 3072, 4, 1}, {0, 16, 3072, 3072, 2, 2},
    {0, 1, 32768, 32768, 3, 2}, {0, 1, 32768, 32768, 6, 1},
    {1, 16, 1024, 3072, 6, 1}, {1, 16, 1024, 3072, 6, 2}, {1, 16, 1024, 3072, 12, 1},
    {1, 1, 16384, 16384, 6, 1},
    // L2 prefetch before the copies, whole buffer and short shares per block
    {0, 16, 3072, 3072, 2, 1, 1}, {0, 16, 3072, 3072, 2, 1, 2},
    {0, 1, 16384, 16384, 6, 1, 0, 256 << 10}, {0, 1, 16384, 16384, 6, 1, 1, 256 << 10},
    {0, 1, 16384, 16384, 3, 1, 2, 256 << 10},
    {0, 16, 3072, 3072, 2, 1, 0, 192 << 10}, {0, 16, 3072, 3072, 2, 1, 1, 192 << 10},
    {0, 16, 3072, 3072, 2, 1, 2, 192 << 10},
    {0, 1, 32768, 32768, 3, 2, 0, 128 << 10}, {0, 1, 32768, 32768, 3, 2, 1, 128 << 10},
    {0, 1, 32768, 32768, 3, 2, 0, 32 << 10}, {0, 1, 32768, 32768, 3, 2, 1, 32 << 10},
  };
  for (const Case& c : cases) {
    const int blocks = sms * c.bps;
    const size_t stage = (size_t)c.rows * c.rowbytes;
    // per block: whole groups of rows*stride bytes
    const size_t group = (size_t)c.rows * c.stride;
    const size_t per_block = (c.limit ? c.limit : total / blocks) / group * group;
    const size_t smem = (size_t)c.S * stage;
    float ms = timeit([&] { ring_kernel<<<blocks, 160, smem>>>(buf, per_block, c.rows, c.rowbytes, c.stride, c.S, c.method, c.pf, sink); });
    cudaError_t err = cudaGetLastError();
    printf("%s rows %2d x %5d B S %2d blk/sm %d pf %d, %7zu B/block: %.0f GB/s, %.2f us %s\n", c.method ? "cp.async" : "tma1d   ",
           c.rows, c.rowbytes, c.S, c.bps, c.pf, per_block, per_block * blocks / ms / 1e6, ms * 1e3, err ? cudaGetErrorString(err) : "");
  }
  return 0;
}
