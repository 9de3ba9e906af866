"""decodex::rms_norm and decodex::fused_add_rms_norm against the PyTorch composition HF uses
(x + residual, then fp32 pow / mean / rsqrt / mul, weight * result.to(bf16)), at the Qwen2.5-1.5B and
-7B hidden sizes. M = 1 is the decode step (latency-bound: a few KB per call, so % of bandwidth is
low by nature); M = 3000 is a prefill-sized call, where bandwidth is what counts.

Timing: one (x, residual, weight, out) set per call in a stack of up to 512 sets, every call
captured in one CUDA graph (bench.common). Bytes moved: x + weight + out (+ residual read and
written for the fused op); % is of the bandwidth measured in the same run.

Note: bench.common.copies_for caps the stack at 512 sets, so where one set is a few KB (M = 1) the
stack stays below the 60 MB L2 and those rows measure an L2-warm, latency-bound call (launch, one
round trip, the reduction) rather than DRAM bandwidth.

    python -m bench.rms_norm
"""
from __future__ import annotations

import torch

from bench.common import bench_main, compare_row, read_bandwidth_gbs

SHAPES = [(1, 1536), (1, 3584), (8, 3584), (3000, 1536), (3000, 3584)]  # (M, K)
EPS = 1e-6
TITLE = "rms_norm / fused_add_rms_norm: decodex vs the torch composition, L2-cold, CUDA graph, median"
HEADERS = ["shape", "decodex us", "torch us", "GB/s", "% of bw", "speedup"]


def _torch_norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _torch_fused(x, res, w):
    res.add_(x)  # bf16 residual stream, as HF's `hidden = residual + hidden`
    return _torch_norm(res, w)


def rows(bandwidth_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401  (registers torch.ops.decodex)

    bw = bandwidth_gbs or read_bandwidth_gbs()
    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for fused in (False, True):
        for M, K in SHAPES:
            if fused:  # x, residual, weight, out
                make = lambda: (torch.randn(M, K, **bf), torch.randn(M, K, **bf),  # noqa: E731
                                torch.randn(K, **bf), torch.empty(M, K, **bf))
                ours = lambda x, r, w, o: torch.ops.decodex.fused_add_rms_norm(x, r, w, EPS, o)  # noqa: E731
                base = lambda x, r, w, o: _torch_fused(x, r, w)  # noqa: E731
            else:  # x, weight, out
                make = lambda: (torch.randn(M, K, **bf), torch.randn(K, **bf), torch.empty(M, K, **bf))  # noqa: E731
                ours = lambda x, w, o: torch.ops.decodex.rms_norm(x, w, EPS, o)  # noqa: E731
                base = lambda x, w, o: _torch_norm(x, w)  # noqa: E731
            name = "fused_add_rms_norm" if fused else "rms_norm"
            out.append(compare_row(f"{name} M={M} K={K}", 2 * (M * K * (4 if fused else 2) + K), bw,
                                   make, ours, base))
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
