"""decodex::lt_linear (cuBLASLt, each candidate algorithm timed) against torch's cuBLAS (F.linear) at
the Qwen2.5-1.5B and -7B products of the batched decode step (M = 16, 32, 64 rows).

L2-cold as bench.gemv: one weight copy per call in a stack larger than the L2, every call captured
in one CUDA graph. "first us" is lt_linear's candidate 0 (cuBLASLt's heuristic's first answer,
which torch's cuBLASLt path also takes); "best us" the fastest candidate, which the engine's
"lt_linear" plan would pick the same way (over the layers' weights). Bytes moved = weight + x + out;
% is of the read bandwidth measured in the same run.

    python -m bench.lt_linear                  # 16, 32 and 64 rows
    python -m bench.lt_linear --ms 64 --only "1.5B gate"
"""
from __future__ import annotations

import argparse

import torch

from bench.common import int_list, print_table, read_bandwidth_gbs, require_gpu, time_graph
from bench.gemv import SHAPES, _buffers, _selected, _stack, _time_cublas
from decodex.engine import LT_WORKSPACE_BYTES

PRODUCTS = ("qkv", "o", "gate|up", "down", "lm_head")  # the engine's products
MS = [16, 32, 64]
TITLE = "lt_linear: every cuBLASLt candidate vs cuBLAS (F.linear), L2-cold, CUDA graph, median"
HEADERS = ["shape", "weight MB", "cuBLAS us", "first us", "best us", "best algo", "candidates", "GB/s",
           "% of bw", "speedup"]


def _time_lt(weights, M: int, ws) -> list[float]:
    """us per call of each lt_linear candidate over the stack."""
    xs, outs = _buffers(weights, M)
    n = int(torch.ops.decodex.lt_linear_algos(xs[0], weights[0], None, outs[0], ws))
    return [time_graph([lambda i=i, a=a: torch.ops.decodex.lt_linear(xs[i], weights[i], None, outs[i], ws, a)
                        for i in range(len(weights))], reps=10) for a in range(n)]


def rows(bw: float, ms=MS, only: str | None = None) -> list[list]:
    import decodex  # noqa: F401  (registers torch.ops.decodex)

    ws = torch.empty(LT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    out = []
    for model, name, N, K in SHAPES:
        label = f"{model} {name} {N}x{K}"
        if name not in PRODUCTS or not _selected(label, only):
            continue
        weights = _stack(N, K)
        for M in ms:
            cublas, lt = _time_cublas(weights, M), _time_lt(weights, M, ws)
            best = min(range(len(lt)), key=lt.__getitem__)
            gbs = 2 * (N * K + M * K + M * N) / lt[best] / 1e3
            out.append([f"{label} M={M}", 2 * N * K / 1e6, cublas, lt[0], lt[best], best, len(lt), gbs,
                        100 * gbs / bw, cublas / lt[best]])
        del weights
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="only shapes whose label contains one of these (comma-separated)")
    p.add_argument("--ms", type=int_list, help="rows of x, comma-separated (default 16,32,64)")
    args = p.parse_args(argv)
    ms = MS if args.ms is None else args.ms
    if not all(m >= 1 for m in ms):
        p.error(f"--ms: every M must be >= 1, got {args.ms}")
    require_gpu()
    bw = read_bandwidth_gbs()
    print(f"read bandwidth measured now: {bw:.0f} GB/s", flush=True)
    print_table(TITLE, HEADERS, rows(bw, ms, args.only))


if __name__ == "__main__":
    main()
