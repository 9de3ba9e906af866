"""decodex::gemv_silu_mul (gate|up GEMV with SiLU * up in its epilogue) against the two-kernel
decodex path it replaces (gemv, then silu_mul) and against cuBLAS + torch (F.linear, then
F.silu(gate) * up), at the Qwen2.5-1.5B and -7B MLP shapes. Above 8 rows (where the op runs its
wgmma kernel) each M also has an "rms" row: rms_eps set, as the batched decode step calls it (the
unfused path then scales in silu_mul's rms_x, the torch path in fp32).

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
            # Above 8 rows also with rms_eps, as the batched decode step runs it: the product of the
            # unnormalised residual, scaled by 1/rms(x row) (unfused: silu_mul's rms_x does it).
            for eps in (None, 1e-6) if M > 8 else (None,):
                def unfused(w, eps=eps):
                    torch.ops.decodex.gemv(x, w, None, gate_up)
                    torch.ops.decodex.silu_mul(gate_up, act, rms_x=None if eps is None else x, rms_eps=eps)

                def torch_path(w, eps=eps):
                    gu = F.linear(x, w)
                    if eps is not None:
                        gu = gu * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + eps).to(gu.dtype)
                    return F.silu(gu[:, :I]) * gu[:, I:]

                label = f"{model} I={I} K={K} M={M}" + ("" if eps is None else " rms")
                out.append(fused_row(label, nbytes, bandwidth_gbs, ws,
                                     lambda w, eps=eps: torch.ops.decodex.gemv_silu_mul(x, w, act, rms_eps=eps),
                                     unfused, torch_path))
        del ws
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
