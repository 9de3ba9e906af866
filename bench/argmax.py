"""decodex::argmax against torch.argmax at the Qwen2.5 vocabulary sizes (151936 for 1.5B, 152064 for
7B), B = 1 and 8, bf16 logits (plus fp32 at B = 1). The bar: V = 151936 bf16 at B = 1 in <= 6 us.

L2-cold: one logits tensor per call in a stack larger than the L2, every call captured in one CUDA
graph (bench.common). Bytes moved: the logits read once; % is of the bandwidth measured in the same
run (a 300 KB read is latency-bound: launch + one DRAM round trip + the combine dominate).

    python -m bench.argmax
"""
from __future__ import annotations

import torch

from bench.common import bench_main, compare_row, read_bandwidth_gbs

SHAPES = [(1, 151936, torch.bfloat16), (8, 151936, torch.bfloat16), (1, 152064, torch.bfloat16),
          (8, 152064, torch.bfloat16), (64, 151936, torch.bfloat16), (1, 151936, torch.float32)]
TITLE = "argmax: decodex vs torch.argmax, L2-cold, CUDA graph, median"
HEADERS = ["shape", "decodex us", "torch us", "GB/s", "% of bw", "speedup"]


def rows(bandwidth_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401

    bw = bandwidth_gbs or read_bandwidth_gbs()
    out = []
    for B, V, dtype in SHAPES:
        nbytes = B * V * (torch.finfo(dtype).bits // 8)
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        out.append(compare_row(
            f"B={B} V={V} {name}", nbytes, bw,
            lambda: (torch.randn(B, V, device="cuda").to(dtype), torch.empty(B, dtype=torch.int64, device="cuda")),
            torch.ops.decodex.argmax, lambda logits, _: torch.argmax(logits, dim=-1)))
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
