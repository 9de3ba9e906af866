"""decodex::moe_gemv_silu_mul and moe_gemv_sum (with moe_route ahead of them in the decode step)
against the torch composition that keeps the expert choice on the device (index_select of the
chosen experts' weights, then bmm), at Qwen3-30B-A3B's expert shapes (128 experts, 8 a token,
moe_intermediate_size 768, hidden 2048), M = 1, 2, 4, 8 rows.

Timing: bench.common.compare_row (input sets rotated in one CUDA graph), each set with its own x,
out and a fresh random choice of 8 distinct experts per row, all sets sharing one layer's stacked
expert weights (gate|up 805 MB, down 403 MB): the sets read different experts, so the calls are
L2-cold in practice. Bytes moved: the distinct experts M uniformly routed rows read in expectation
(bench.common.expected_experts), plus x and out; % is of the read bandwidth measured in the same
run. moe_route itself reads 256 bytes a row (bench.argmax's shape class: latency). The
prefetch_weight rows read the routing and the first expert weights before the PDL wait, as the
decode step does (there moe_route runs two kernels ahead; here the call ahead is another
moe_gemv_sum, which writes none of them).

    python -m bench.moe
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import bench_main, compare_row, expected_experts

E, TOP_K, I, HIDDEN = 128, 8, 768, 2048  # Qwen3-30B-A3B
MS = [1, 2, 4, 8]
TITLE = "moe expert GEMVs: decodex vs torch (index_select + bmm), Qwen3-30B-A3B shapes, L2-cold, CUDA graph, median"
HEADERS = ["op", "decodex us", "torch us", "GB/s", "% of bw", "speedup"]


def _ids(M: int) -> torch.Tensor:
    return torch.stack([torch.randperm(E, device="cuda")[:TOP_K] for _ in range(M)]).to(torch.int32)


def _silu_torch(x, w, ids, out):
    gu = torch.bmm(w.index_select(0, ids.flatten().long()), x.repeat_interleave(TOP_K, 0)[:, :, None])
    gate, up = gu[:, :, 0].chunk(2, dim=-1)
    out.copy_((F.silu(gate) * up).view(out.shape))


def _sum_torch(act, w, ids, weights, out):
    y = torch.bmm(w.index_select(0, ids.flatten().long()), act.flatten(0, 1)[:, :, None])[:, :, 0]
    out.copy_((y.view(*ids.shape, -1).float() * weights[:, :, None]).sum(1))


def rows(bandwidth_gbs: float) -> list[list]:
    import decodex  # noqa: F401

    bf = dict(device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(E, 2 * I, HIDDEN, **bf) / HIDDEN**0.5)
    down = (torch.randn(E, HIDDEN, I, **bf) / I**0.5)
    ops = torch.ops.decodex
    out = []
    for M in MS:
        experts = expected_experts(E, TOP_K, M)
        out.append(compare_row(
            f"moe_gemv_silu_mul M={M} ({experts:.1f} experts)",
            2 * (experts * 2 * I * HIDDEN + M * HIDDEN + M * TOP_K * I), bandwidth_gbs,
            lambda M=M: (torch.randn(M, HIDDEN, **bf), gate_up, _ids(M), torch.empty(M, TOP_K, I, **bf)),
            lambda x, w, ids, o: ops.moe_gemv_silu_mul(x, w, ids, o), _silu_torch))
        for prefetch in (False, True):
            out.append(compare_row(
                f"moe_gemv_sum M={M} ({experts:.1f} experts){', prefetch_weight' if prefetch else ''}",
                2 * (experts * HIDDEN * I + M * TOP_K * I + M * HIDDEN), bandwidth_gbs,
                lambda M=M: (torch.randn(M, TOP_K, I, **bf), down, _ids(M), torch.rand(M, TOP_K, device="cuda"),
                             torch.empty(M, HIDDEN, **bf)),
                lambda a, w, ids, wt, o, p=prefetch: ops.moe_gemv_sum(a, w, ids, wt, o, prefetch_weight=p),
                _sum_torch))
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
