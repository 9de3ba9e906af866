"""decodex::gemv_silu_mul (gate|up GEMV with SiLU * up in its epilogue) against the two-kernel
decodex path it replaces (gemv, then silu_mul) and against cuBLAS + torch (F.linear, then
F.silu(gate) * up), at the Qwen2.5-1.5B and -7B MLP shapes.

All three run L2-cold in CUDA graphs over a rotating stack of weights (bench.common), in the same
run. Bytes moved: the [2I, K] weight (x and the output are noise next to it); % is of the read
bandwidth measured in the same run.

    python -m bench.gemv_silu_mul
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import bench_main, copies_for, fused_row

SHAPES = [("1.5B", 8960, 1536), ("7B", 18944, 3584)]  # (model, I, K): weight [2I, K]
MS = [1, 8, 32, 64]  # above 8 only where gemv_silu_mul takes them (its wgmma kernel: sm_90a, cc 9.0)
TITLE = "gemv_silu_mul: fused vs decodex gemv + silu_mul vs cuBLAS + torch, L2-cold, CUDA graph, median"
HEADERS = ["shape", "weight MB", "fused us", "gemv+silu_mul us", "cuBLAS+torch us", "GB/s", "% of bw",
           "vs unfused", "vs cuBLAS"]


def rows(bandwidth_gbs: float) -> list[list]:
    import decodex  # noqa: F401

    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    max_rows = torch.ops.decodex.gemv_silu_mul_max_rows(torch.cuda.current_device())
    for model, I, K in SHAPES:
        nbytes = 2 * 2 * I * K
        ws = [torch.randn(2 * I, K, **bf) / K**0.5 for _ in range(copies_for(nbytes))]
        for M in (m for m in MS if m <= max_rows):
            x = torch.randn(M, K, **bf)
            gate_up, act = torch.empty(M, 2 * I, **bf), torch.empty(M, I, **bf)

            def unfused(w):
                torch.ops.decodex.gemv(x, w, None, gate_up)
                torch.ops.decodex.silu_mul(gate_up, act)

            def torch_path(w):
                gu = F.linear(x, w)
                return F.silu(gu[:, :I]) * gu[:, I:]

            out.append(fused_row(f"{model} I={I} K={K} M={M}", nbytes, bandwidth_gbs, ws,
                                 lambda w: torch.ops.decodex.gemv_silu_mul(x, w, act), unfused, torch_path))
        del ws
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
