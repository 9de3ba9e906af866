"""decodex::silu_mul against F.silu(gate) * up (PyTorch, two kernels) at the Qwen2.5-1.5B and -7B
intermediate sizes. M = 1 is the decode step (latency-bound), M = 3000 a prefill-sized call.

Timing: one (gate_up, out) set per call in a stack of up to 512 sets, every call captured in one
CUDA graph (bench.common). Bytes moved: gate_up read + out written; % is of the bandwidth measured
in the same run.

Note: bench.common.copies_for caps the stack at 512 sets, so where one set is a few KB (M = 1) the
stack stays below the 60 MB L2 and those rows measure an L2-warm, latency-bound call (launch, one
round trip, the reduction) rather than DRAM bandwidth.

The rms_x rows (M = 64, the batched decode step's cuBLAS path) time silu_mul with rms_x, the
residual [64, K] whose 1/rms scales each row first, against the torch composition of that norm
and the activation; their bytes include the rms_x read.

    python -m bench.silu_mul
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import bench_main, compare_row, read_bandwidth_gbs

SHAPES = [(1, 8960), (1, 18944), (8, 18944), (3000, 8960), (3000, 18944)]  # (M, I)
RMS_SHAPES = [(64, 8960, 1536), (64, 18944, 3584)]  # (M, I, K): Qwen2.5-1.5B / -7B at batch 64
EPS = 1e-6
TITLE = "silu_mul: decodex vs F.silu(g) * u, L2-cold, CUDA graph, median"
HEADERS = ["shape", "decodex us", "torch us", "GB/s", "% of bw", "speedup"]


def rows(bandwidth_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401

    bw = bandwidth_gbs or read_bandwidth_gbs()
    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for M, I in SHAPES:
        out.append(compare_row(
            f"M={M} I={I}", 2 * (M * 2 * I + M * I), bw,
            lambda: (torch.randn(M, 2 * I, **bf), torch.empty(M, I, **bf)),
            torch.ops.decodex.silu_mul, lambda gu, _: F.silu(gu[:, :I]) * gu[:, I:]))
    for M, I, K in RMS_SHAPES:
        def torch_rms(gu, _, x, I=I):
            s = gu * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS).to(gu.dtype)
            return F.silu(s[:, :I]) * s[:, I:]

        out.append(compare_row(
            f"M={M} I={I} rms_x K={K}", 2 * (M * 2 * I + M * I + M * K), bw,
            lambda: (torch.randn(M, 2 * I, **bf), torch.empty(M, I, **bf), torch.randn(M, K, **bf)),
            lambda gu, o, x: torch.ops.decodex.silu_mul(gu, o, rms_x=x, rms_eps=EPS), torch_rms))
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
