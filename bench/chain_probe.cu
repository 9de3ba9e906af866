// A probe, not part of decodex: how fast could a batch-1 decode step be if its weights streamed
// into shared memory without ever waiting on the step's chain of dependencies?
//
// decodex's step is a chain of kernels (per layer: qkv, attention, its merge, o, gate|up, down), each
// of which waits for the one before (programmatic dependent launch) and can only ask for its first
// few KB of weights before that wait. bench/RESULTS.md (sessions 18-22) finds the step 30-45% above
// bytes / bandwidth at 1K context, and every tweak of that design since within a percent or two.
// The alternative is one persistent kernel in which, on every SM, a producer warp streams the
// block's share of every link's weights through a ring of shared memory, in step order, never
// waiting on a dependency (weights do not depend on activations), while consumer warps wait for
// the link before (a counter every block adds to) and then read what the ring holds. The DRAM
// stream then only stalls when the ring is full.
//
// This probe runs that schedule with the byte counts of Qwen2.5-1.5B and -7B, and nothing else:
// the consumers fold the ring's bytes into a checksum (no mma), and a link's "activation" is 16
// bytes a block writes at its end and every block reads after its wait (an L2 round trip, as a
// GEMV reads x). Links of zero bytes (attention's merge, argmax) are dependency hops only. Modes:
//   decoupled  the producer never waits; consumers wait for the link before;
//   coupled    the producer also waits for the link before, before it copies a stage that starts
//              in a new link (the kernel-chain design, without any prefetch before the wait);
//   free       nobody waits: the pure streaming rate of this machinery (its floor);
//   decoupled, no x read: as decoupled, without the 16-byte reads after each wait.
// One block an SM (160 threads: 4 consumer warps and the producer), launched cooperatively so
// every block is resident. A block's bytes of all links lie together, link after link, and stream
// through a ring of 4 (or 2, a variant of decoupled) stages of kStage bytes, one bulk copy of
// kCopy bytes per lane (stream_probe: 16 copies of 3 KB a stage streamed 4.6 TB/s at one block an
// SM); a stage may hold the end of one link and the start of the next. Every link's share is
// rounded up to whole copies, so the probe streams slightly more than the model.
// A wait on another block that lasts over 1 s goes on regardless, and the run is reported as
// failed. Each case is one launch timed with CUDA events (median of 5 after a warm-up); the
// reference is a plain read of 4 GiB with 16-byte loads (8 in flight a thread), as
// bench.common.read_bandwidth_gbs reads.
// Build and run on the GPU machine, from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Icsrc -o chain_probe bench/chain_probe.cu
//   ./chain_probe
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

#include "probe.cuh"
#include "stream.cuh"

namespace {
using decodex::lds16;

constexpr int kConsumers = 4;                    // consumer warps a block
constexpr int kThreads = (kConsumers + 1) * 32;  // and the producer warp
constexpr int kCopy = 3072;                      // bytes a bulk copy (one lane's)
constexpr int kStage = 16 * kCopy;               // bytes a ring slot
constexpr int kMaxSlots = 4;                     // 192 KB of ring at most

enum Mode { kDecoupled = 0, kCoupled = 1, kFree = 2, kNoX = 3 };
const char* const kModeNames[] = {"decoupled", "coupled", "free", "decoupled, no x read"};

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void consumers_sync() {  // the consumer warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"r"(kConsumers * 32) : "memory");
}

// Until every block has finished link l (one thread spins). After 1 s it sets *error and goes on
// as if they had: the run then ends (its timing is void) rather than hanging.
__device__ void wait_link(const unsigned* counters, int l, unsigned* error) {
  const long long t0 = globaltimer();
  while (ld_acquire(&counters[l]) < gridDim.x) {
    if (globaltimer() - t0 > 1000000000LL) {
      atomicExch(error, 1u);
      return;
    }
  }
}

// Block b's bytes of every link lie together, link after link: link l's share[l] bytes at
// buf + b * per_block + offset[l]. The producer streams them in stages of kStage bytes that run
// across link boundaries; the consumers take each link's bytes from whichever stages hold them.
__global__ void __launch_bounds__(kThreads, 1)
chain_kernel(const unsigned char* __restrict__ buf, const int64_t* __restrict__ offset,
             const int* __restrict__ share, int links, int64_t per_block, int mode, int slots,
             unsigned* counters, uint4* act, unsigned* error) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ uint64_t full[kMaxSlots], empty[kMaxSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumers);
    }
    fence_mbar_init();
  }
  __syncthreads();
  const unsigned char* mine = buf + static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t stages = (per_block + kStage - 1) / kStage;

  if (warp == kConsumers) {  // the producer
    const uint64_t policy = l2_evict_first();
    int l = 0;       // the link holding the stage's first byte
    int waited = 0;  // coupled: links before this one are known finished
    for (int64_t q = 0; q < stages; ++q) {
      const int64_t at = q * kStage;
      const int slot = static_cast<int>(q % slots), round = static_cast<int>(q / slots);
      const int bytes = static_cast<int>(min(static_cast<int64_t>(kStage), per_block - at));
      while (l + 1 < links && offset[l + 1] <= at) ++l;
      if (mode == kCoupled && l > waited) {  // the stage's first link starts after the link before
        if (lane == 0) wait_link(counters, l - 1, error);
        __syncwarp();
        waited = l;
      }
      if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
      if (lane == 0) mbar_arrive_expect(&full[slot], bytes);
      __syncwarp();
      for (int c = lane * kCopy; c < bytes; c += 32 * kCopy) {
        bulk_copy_to_shared(ring + slot * kStage + c, mine + at + c, kCopy, &full[slot], policy);
      }
    }
    return;
  }

  float acc = 0.f;
  int64_t pos = 0, filled = -1;  // bytes consumed; the last stage known filled
  for (int l = 0; l < links; ++l) {
    if (mode != kFree && l > 0) {
      if (threadIdx.x == 0) wait_link(counters, l - 1, error);
      consumers_sync();
      if (mode != kNoX) {  // x: what every block wrote at the end of link l - 1 (an L2 round trip)
        const uint4 x = __ldcg(&act[static_cast<int64_t>(l - 1) * gridDim.x + threadIdx.x % gridDim.x]);
        acc += __uint_as_float(x.x);
      }
    }
    const int64_t end = offset[l] + share[l];
    while (pos < end) {
      const int64_t q = pos / kStage, stage_end = min(static_cast<int64_t>((q + 1) * kStage), per_block);
      const int slot = static_cast<int>(q % slots);
      if (q != filled) {
        mbar_wait(&full[slot], static_cast<uint32_t>(q / slots) & 1);
        filled = q;
      }
      const int64_t stop = min(end, stage_end);
      const uint32_t a = smem_u32(ring + slot * kStage);
      const int64_t from = pos - q * kStage, to = stop - q * kStage;  // bytes of the slot
      for (int64_t off = from + threadIdx.x * 16; off < to; off += kConsumers * 32 * 16) {
        const uint4 v = lds16(a + static_cast<uint32_t>(off));
        acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
      }
      pos = stop;
      if (pos == stage_end) {  // the stage is used up: free its slot
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
      }
    }
    consumers_sync();  // the block's share of link l is consumed
    if (threadIdx.x == 0) {
      act[static_cast<int64_t>(l) * gridDim.x + blockIdx.x] = make_uint4(__float_as_uint(acc), 0, 0, 0);
      __threadfence();
      red_release(&counters[l], 1u);
    }
  }
}

struct Model {
  const char* name;
  double qkv, o, gate_up, down, lm_head;  // weight MB a link
  double kv_mb_per_k;                     // KV cache MB a layer per 1024 tokens
};
constexpr Model kModels[] = {
    {"Qwen2.5-1.5B", 6.291, 4.719, 55.050, 27.525, 466.747, 1.049},
    {"Qwen2.5-7B", 33.030, 25.690, 271.581, 135.790, 1089.994, 2.097},
};

// The step's links: per layer qkv, attention (its cache), the merge (0 B), o, gate|up, down; then
// the LM head and argmax (0 B).
std::vector<double> step_links(const Model& m, int context) {
  std::vector<double> mb;
  for (int layer = 0; layer < 28; ++layer) {
    for (double v : {m.qkv, m.kv_mb_per_k * context / 1024.0, 0.0, m.o, m.gate_up, m.down}) {
      mb.push_back(v);
    }
  }
  mb.push_back(m.lm_head);
  mb.push_back(0.0);
  return mb;
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // The largest schedule: 7B at 32K.
  int64_t max_bytes = 0;
  for (const Model& m : kModels) {
    int64_t total = 0;
    for (double mb : step_links(m, 32768)) {
      total += static_cast<int64_t>((mb * 1e6 / sms + kCopy - 1) / kCopy) * kCopy * sms;
    }
    max_bytes = std::max(max_bytes, total);
  }
  max_bytes = std::max<int64_t>(max_bytes, int64_t{4} << 30);
  unsigned char* buf;
  CK(cudaMalloc(&buf, max_bytes));
  CK(cudaMemset(buf, 0x3c, max_bytes));
  float* sink;
  unsigned *counters, *error;
  uint4* act;
  constexpr int kMaxLinks = 256;
  CK(cudaMalloc(&sink, 4));
  CK(cudaMalloc(&counters, kMaxLinks * sizeof(unsigned)));
  CK(cudaMalloc(&error, sizeof(unsigned)));
  CK(cudaMalloc(&act, static_cast<size_t>(kMaxLinks) * sms * sizeof(uint4)));
  CK(cudaMemset(act, 0, static_cast<size_t>(kMaxLinks) * sms * sizeof(uint4)));
  int64_t* d_offset;
  int* d_share;
  CK(cudaMalloc(&d_offset, kMaxLinks * sizeof(int64_t)));
  CK(cudaMalloc(&d_share, kMaxLinks * sizeof(int)));
  CK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSlots * kStage));

  // Reference read rate.
  const int64_t ref_bytes = int64_t{4} << 30;
  std::vector<float> ref;
  for (int i = 0; i < 6; ++i) {
    ref.push_back(event_ms([&] {
      read_kernel<8><<<2 * sms, 256>>>(reinterpret_cast<const uint4*>(buf), ref_bytes / 16, sink);
    }));
  }
  std::sort(ref.begin() + 1, ref.end());
  const double bw = ref_bytes / (ref[3] * 1e-3) / 1e9;
  std::printf("plain read of 4 GiB: %.0f GB/s (median of 5)\n", bw);
  std::printf("| model | context | links | MB streamed | bytes / read bw, ms | ring KB | mode | ms | GB/s "
              "| %% of read bw |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");

  for (const Model& m : kModels) {
    for (int context : {1024, 32768}) {
      const std::vector<double> mb = step_links(m, context);
      const int links = static_cast<int>(mb.size());
      if (links > kMaxLinks) {
        std::printf("%d links, the probe holds %d\n", links, kMaxLinks);
        return 1;
      }
      std::vector<int64_t> offset(links);
      std::vector<int> share(links);
      int64_t at = 0;  // bytes a block, so far
      for (int l = 0; l < links; ++l) {
        share[l] = static_cast<int>((mb[l] * 1e6 / sms + kCopy - 1) / kCopy) * kCopy;
        offset[l] = at;
        at += share[l];
      }
      const int64_t total = at * sms;
      CK(cudaMemcpy(d_offset, offset.data(), links * sizeof(int64_t), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_share, share.data(), links * sizeof(int), cudaMemcpyHostToDevice));
      for (int slots : {4, 2}) {
        for (int mode : {kDecoupled, kCoupled, kFree, kNoX}) {
          if (slots != kMaxSlots && mode != kDecoupled) continue;
          std::vector<float> ms;
          unsigned failed = 0;
          for (int i = 0; i < 6; ++i) {
            CK(cudaMemset(counters, 0, kMaxLinks * sizeof(unsigned)));
            CK(cudaMemset(error, 0, sizeof(unsigned)));
            const unsigned char* b = buf;
            int n = links, md = mode, sl = slots;
            int64_t pb = at;
            void* args[] = {&b, &d_offset, &d_share, &n, &pb, &md, &sl, &counters, &act, &error};
            ms.push_back(event_ms([&] {
              CK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_kernel), dim3(sms),
                                             dim3(kThreads), args, static_cast<size_t>(slots) * kStage, 0));
            }));
            unsigned e = 0;
            CK(cudaMemcpy(&e, error, sizeof(unsigned), cudaMemcpyDeviceToHost));
            failed |= e;
          }
          std::sort(ms.begin() + 1, ms.end());
          const double t = ms[3];
          std::printf("| %s | %d | %d | %.0f | %.3f | %d | %s%s | %.3f | %.0f | %.1f |\n", m.name, context,
                      links, total / 1e6, total / bw / 1e6, slots * kStage / 1024, kModeNames[mode],
                      failed ? " (a wait timed out)" : "", t, total / (t * 1e-3) / 1e9,
                      100.0 * total / (t * 1e-3) / 1e9 / bw);
        }
      }
    }
  }
  return 0;
}
