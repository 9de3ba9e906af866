// A probe, not part of decodex: what one kernel boundary of the decode step costs, and whether a
// counter in global memory hands data from one kernel to the next sooner than griddepcontrol.wait.
// A CUDA graph of L chained kernels ("links") of G blocks x 128 threads. Every link reads all n
// floats the link before wrote (x, as a GEMV reads its input), streams its share of `mb` MiB of a
// weight-like buffer (the first 8 loads a thread issued before the wait, as decodex's GEMV does
// with prefetch_weight; the links walk a 4 GiB buffer, L2-cold wherever the L links of a replay
// read more than the L2 holds), and writes n floats for the next.
//   mode 0: plain launches (stream order, no PDL)
//   mode 1: PDL: prefetch; griddepcontrol.wait; launch_dependents; the rest (decodex today)
//   mode 2: PDL launch, but the link waits on a counter that each block of the link before bumps
//           after its last store (fence + red.release.gpu; the waiter: ld.acquire.gpu, then a
//           block barrier) instead of griddepcontrol.wait; launch_dependents after the wait
//   mode 3: as mode 2, with launch_dependents first thing (the next links launch, prefetch and
//           spin while this one runs)
//   mode 4: no boundary at all: ONE persistent kernel of G blocks runs the L links as phases, with
//           a grid barrier between them (each block: fence, block barrier, red.release.gpu on one
//           counter; the next phase's first 8 loads issued, then thread 0 spins with ld.acquire.gpu
//           until the counter reaches link * G, then a block barrier). x is read with ld.global.cg
//           (L2, not L1: the buffers alternate, so L1 could hold a stale copy). What a megakernel's
//           phase change would cost, against mode 1's kernel boundary.
// Checks that every link saw its predecessor's x (the chain adds 1 per link), then prints us per
// link and, for streaming links, GB/s of the stream.
// `sync_probe ceiling` prints instead, for mode 1 only, the link time of the byte counts of the
// decode step's kernels with 8, 16 or 32 loads a thread in flight: how fast a chain of dependent
// streaming kernels runs at each size, a reference for the GEMVs and attention of the step (not a
// hard floor: a link issues only KP loads a thread before its wait, and the step's GEMVs, which
// load a whole round of weights into registers before theirs, can beat it).
// `sync_probe handoff` prints mode 1's chain (264 blocks, 16 loads a thread) beside the same chain
// whose links hold back their pre-wait loads until the link before has at most `ahead` MB left to
// request (a progress counter per link; session 57): whether DRAM idles at a kernel boundary because
// the next kernel's first loads were served too early, beside the previous kernel's own.
// Every word of each 16-byte load is used (folded into acc): a load whose middle words are dead is
// narrowed by the compiler to two 4-byte loads (this probe before session 19 streamed that way).
// Build here or on the GPU machine, from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o sync_probe bench/sync_probe.cu
//   ./sync_probe            # the modes
//   ./sync_probe ceiling    # a dependent streaming chain, per size
//   ./sync_probe handoff    # that chain with its pre-wait loads held back to the boundary
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <cuda_runtime.h>

#include "probe.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kPre = 8;  // 16-byte loads a thread issues before the wait (the ceiling table: KP)

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The first KP loads of the block's share of the stream (issued before a link waits).
template <int KP>
__device__ __forceinline__ void prefetch_first(uint4 (&pre)[KP], const uint4* wb, int64_t w_per_block) {
#pragma unroll
  for (int j = 0; j < KP; ++j) {
    const int64_t i = threadIdx.x + j * kThreads;
    pre[j] = i < w_per_block ? ld_stream(wb + i) : make_uint4(0, 0, 0, 0);
  }
}

// A link's work after its wait: read all of x (as a GEMV's block reads its input), stream the rest
// of the block's share (KP loads in flight), write x_out = x_in + 1 (each element from one
// thread; xs and acc only keep the reads alive). kCg: x through L2 only (ld.global.cg), for a
// buffer that this kernel wrote earlier (the persistent kernel), where L1 could be stale.
// progress (handoff only): thread 0 adds 1 to it as the block requests each batch of KP loads.
template <bool kCg, int KP>
__device__ __forceinline__ void link_body(const float* x_in, float* x_out, int n, const uint4* wb,
                                          int64_t w_per_block, const uint4 (&pre)[KP],
                                          unsigned* progress = nullptr) {
  auto ld_x = [&](int i) { return kCg ? __ldcg(x_in + i) : x_in[i]; };
  float xs = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) xs += ld_x(i);
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < KP; ++j) acc ^= pre[j].x ^ pre[j].y ^ pre[j].z ^ pre[j].w;
  for (int64_t i0 = threadIdx.x + KP * kThreads; i0 < w_per_block; i0 += KP * kThreads) {
    uint4 v[KP];
#pragma unroll
    for (int j = 0; j < KP; ++j) {
      const int64_t i = i0 + j * kThreads;
      v[j] = i < w_per_block ? ld_stream(wb + i) : make_uint4(0, 0, 0, 0);
    }
    if (progress != nullptr && threadIdx.x == 0) red_relaxed(progress, 1u);
#pragma unroll
    for (int j = 0; j < KP; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  const bool never = xs == -1.2345e30f && acc == 0x9E3779B9u;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) {
    x_out[i] = never ? 0.f : ld_x(i) + 1.f;
  }
}

template <int MODE, int KP = kPre>
__global__ void __launch_bounds__(kThreads) link_kernel(const float* x_in, float* x_out, int n,
                                                        const uint4* w, int64_t w_per_block,
                                                        unsigned* flags, int link,
                                                        unsigned wait_count) {
  if (MODE == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint4* wb = w + blockIdx.x * w_per_block;
  uint4 pre[KP];
  prefetch_first<KP>(pre, wb, w_per_block);
  if (MODE == 1 || (MODE >= 2 && link == 0)) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (MODE >= 2 && link > 0) {
    if (threadIdx.x == 0) {
      while (ld_acquire(&flags[link - 1]) < wait_count) {
      }
    }
    __syncthreads();
  }
  if (MODE == 1 || MODE == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  link_body<false, KP>(x_in, x_out, n, wb, w_per_block, pre);
  if (MODE >= 2) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) red_release(&flags[link], 1u);
  }
}

// Mode 4: the L links of the graph as phases of one kernel (G blocks, all resident).
__global__ void __launch_bounds__(kThreads) persistent_kernel(float* x0, float* x1, int n, const uint4* w,
                                                              int64_t per_link, int64_t w_words,
                                                              int64_t w_per_block, unsigned* counter,
                                                              int links) {
  for (int link = 0; link < links; ++link) {
    const uint4* wb = w + (link * per_link) % (w_words - per_link - 1) + blockIdx.x * w_per_block;
    uint4 pre[kPre];
    prefetch_first<kPre>(pre, wb, w_per_block);
    if (link > 0) {
      if (threadIdx.x == 0) {
        const unsigned target = static_cast<unsigned>(link) * gridDim.x;
        while (ld_acquire(counter) < target) {
        }
      }
      __syncthreads();
    }
    link_body<true, kPre>(link % 2 ? x1 : x0, link % 2 ? x0 : x1, n, wb, w_per_block, pre);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) red_release(counter, 1u);
  }
}

// `sync_probe handoff`: mode 1's chain, but a link issues its pre-wait loads only once the link
// before it has requested `gate` batches (of all its blocks' batches; a batch is one round of KP
// loads by a block's threads; each block counts its own on the link's progress counter). gate = 0:
// no holding back (mode 1). Under mode 1 the next link's pre-wait loads are served early, beside
// this link's own, and DRAM idles from this link's last loads until the next link's loads after its
// wait come back; held back, they are requested while this link drains. No deadlock: a link
// launches only once every block of the link before has passed its wait (its trigger), so the
// blocks whose progress it waits for are running.
template <int KP>
__global__ void __launch_bounds__(kThreads) handoff_kernel(const float* x_in, float* x_out, int n,
                                                           const uint4* w, int64_t w_per_block,
                                                           unsigned* progress, int link,
                                                           unsigned gate) {
  const uint4* wb = w + blockIdx.x * w_per_block;
  if (link > 0 && gate > 0) {
    if (threadIdx.x == 0) {
      while (ld_relaxed(&progress[link - 1]) < gate) __nanosleep(32);
    }
    __syncthreads();
  }
  uint4 pre[KP];
  prefetch_first<KP>(pre, wb, w_per_block);
  if (threadIdx.x == 0) red_relaxed(&progress[link], 1u);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  link_body<false, KP>(x_in, x_out, n, wb, w_per_block, pre, &progress[link]);
}

// kernel<<<G, kThreads, 0, s>>>(args...), with the PDL attribute if pdl.
template <typename... Params, typename... Args>
void launch_probe(cudaStream_t s, int G, bool pdl, void (*kernel)(Params...), Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(G);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <int MODE, int KP = kPre>
void launch_link(cudaStream_t s, int G, bool pdl, const float* in, float* out, int n, const uint4* w,
                 int64_t wpb, unsigned* flags, int link, unsigned wait_count) {
  launch_probe(s, G, pdl, link_kernel<MODE, KP>, in, out, n, w, wpb, flags, link, wait_count);
}

}  // namespace

int main(int argc, char** argv) {
  const int L = 56, n = 1536;
  int reps = 50;                             // graph replays a timing (fewer for the big links)
  const int64_t wbytes = int64_t(4) << 30;  // links walk this buffer: L2-cold
  uint4* w;
  float *x[2];
  unsigned* flags;
  CK(cudaMalloc(&w, wbytes));
  CK(cudaMemset(w, 1, wbytes));
  CK(cudaMalloc(&x[0], n * sizeof(float)));
  CK(cudaMalloc(&x[1], n * sizeof(float)));
  CK(cudaMalloc(&flags, L * sizeof(unsigned)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Captures `body(k)` for the L links (or once, for the persistent kernel), checks the chain and
  // returns the best of 5 timings in us per link (negative: the chain's result was wrong).
  auto measure = [&](auto&& body, bool persistent) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CK(cudaMemsetAsync(flags, 0, L * sizeof(unsigned), s));
    for (int k = 0; k < (persistent ? 1 : L); ++k) body(k);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    // Correctness: x starts at 0 and each link adds 1 (L is even: the result is in x[0]).
    CK(cudaMemsetAsync(x[0], 0, n * sizeof(float), s));
    CK(cudaGraphLaunch(exec, s));
    float host[n];
    CK(cudaMemcpyAsync(host, x[0], sizeof(host), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    bool ok = true;
    for (int i = 0; i < n; ++i) ok = ok && host[i] == static_cast<float>(L);
    for (int r = 0; r < 5; ++r) CK(cudaGraphLaunch(exec, s));
    float best = 1e30f;
    for (int trial = 0; trial < 5; ++trial) {
      const float ms = event_ms([&] { for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(exec, s)); }, s);
      best = ms < best ? ms : best;
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    const double us = best * 1e3 / (reps * L);
    return ok ? us : -us;
  };
  auto link_args = [&](int k, int64_t per_link) {
    struct A { const uint4* w; const float* in; float* out; };
    return A{w + (k * per_link) % (wbytes / 16 - per_link - 1), x[k % 2], x[(k + 1) % 2]};
  };
  auto row = [&](int G, double mib, const char* what, double us, int64_t per_link) {
    const double gbs = per_link > 0 ? per_link * 16.0 / (std::fabs(us) * 1e3) : 0.0;
    std::printf("| %d | %.2f | %s | %.2f | %.0f | %s |\n", G, mib, what, std::fabs(us), gbs,
                us > 0 ? "yes" : "NO");
  };

  if (argc > 1 && std::strcmp(argv[1], "handoff") == 0) {
    // Mode 1's chain (264 blocks, KP = 16: the ceiling table's best below 1 GB) against the same
    // chain gated: a link's pre-wait loads wait until the link before has `ahead` MB left to ask.
    constexpr int KP = 16;
    const int G = 264;
    const int64_t batch = int64_t(KP) * kThreads;  // uint4s a block requests a batch
    std::printf("| MB per link | ahead MB (- = mode 1) | us per link | GB/s of the stream | chain ok |\n");
    std::printf("| --- | --- | --- | --- | --- |\n");
    for (double mb : {16.0, 25.69, 27.53, 33.03, 55.05, 135.8}) {
      reps = mb > 100 ? 8 : 50;
      const int64_t per_link = static_cast<int64_t>(mb * 1e6) / 16;
      const int64_t wpb = per_link / G;
      const int64_t total = G * ((wpb + batch - 1) / batch);  // batches a link, all blocks
      for (double ahead : {-1.0, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0}) {
        const int64_t ahead_batches = static_cast<int64_t>(ahead * 1e6 / (batch * 16.0));
        const unsigned gate =
            ahead < 0 ? 0u : static_cast<unsigned>(std::max<int64_t>(1, total - ahead_batches));
        const double us = measure(
            [&](int k) {
              const auto a = link_args(k, per_link);
              launch_probe(s, G, k > 0, handoff_kernel<KP>, a.in, a.out, n, a.w, wpb, flags, k, gate);
            },
            false);
        const double gbs = wpb * G * 16.0 / (std::fabs(us) * 1e3);
        char what[32];
        if (ahead < 0) std::snprintf(what, sizeof(what), "-");
        else std::snprintf(what, sizeof(what), "%.1f", ahead);
        std::printf("| %.2f | %s | %.2f | %.0f | %s |\n", mb, what, std::fabs(us), gbs,
                    us > 0 ? "yes" : "NO");
      }
    }
    return 0;
  }
  if (argc < 2 || std::strcmp(argv[1], "ceiling") != 0) {
    std::printf("| G blocks | MiB per link | mode | us per link | GB/s of the stream | chain ok |\n");
    std::printf("| --- | --- | --- | --- | --- | --- |\n");
    const int grids[] = {16, 132, 264};
    const double mibs[] = {0.0, 4.0, 32.0};
    const char* names[] = {"0", "1", "2", "3", "4"};
    for (int G : grids) {
      for (double mib : mibs) {
        const int64_t per_link = static_cast<int64_t>(mib * 1024 * 1024) / 16;  // uint4s
        const int64_t wpb = per_link / G;
        for (int mode = 0; mode < 5; ++mode) {
          const double us = measure(
              [&](int k) {
                if (mode == 4) {
                  persistent_kernel<<<G, kThreads, 0, s>>>(x[0], x[1], n, w, per_link, wbytes / 16,
                                                           wpb, flags, L);
                  CK(cudaGetLastError());
                  return;
                }
                const auto a = link_args(k, per_link);
                const bool pdl = mode != 0 && k > 0;
                if (mode == 0) launch_link<0>(s, G, pdl, a.in, a.out, n, a.w, wpb, flags, k, G);
                if (mode == 1) launch_link<1>(s, G, pdl, a.in, a.out, n, a.w, wpb, flags, k, G);
                if (mode == 2) launch_link<2>(s, G, pdl, a.in, a.out, n, a.w, wpb, flags, k, G);
                if (mode == 3) launch_link<3>(s, G, pdl, a.in, a.out, n, a.w, wpb, flags, k, G);
              },
              mode == 4);
          row(G, mib, names[mode], us, per_link);
        }
      }
    }
    return 0;
  }

  // `sync_probe ceiling`: mode 1 (PDL, decodex's chain) streaming the byte counts of the decode
  // step's kernels (Qwen2.5-1.5B and -7B weights, 1K and 32K caches; issue 3's 16 MB line) with
  // KP loads a thread in flight, KP of them issued before the wait: how close a chain of dependent
  // streaming kernels comes to the read bandwidth, launch, wait and ramp included (KP = 8 is the
  // modes table's; 32 keeps 128 KB a SM in flight at 2 blocks a SM).
  std::printf("| G blocks | MB per link | loads a thread (KP) | us per link | GB/s of the stream | chain ok |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  const double mbs[] = {1.05, 2.10, 4.72, 6.29, 16.0, 25.69, 27.53, 33.03, 33.55, 55.05, 67.11, 135.8,
                        271.6, 466.8, 1089.9};
  for (int G : {132, 264}) {
    for (double mb : mbs) {
      reps = mb > 100 ? 8 : 50;
      const int64_t per_link = static_cast<int64_t>(mb * 1e6) / 16;
      const int64_t wpb = per_link / G;
      auto chain = [&](auto kp_tag) {
        constexpr int KP = decltype(kp_tag)::value;
        return measure(
            [&](int k) {
              const auto a = link_args(k, per_link);
              launch_link<1, KP>(s, G, k > 0, a.in, a.out, n, a.w, wpb, flags, k, G);
            },
            false);
      };
      row(G, mb, "8", chain(std::integral_constant<int, 8>{}), wpb * G);
      row(G, mb, "16", chain(std::integral_constant<int, 16>{}), wpb * G);
      row(G, mb, "32", chain(std::integral_constant<int, 32>{}), wpb * G);
    }
  }
  return 0;
}
