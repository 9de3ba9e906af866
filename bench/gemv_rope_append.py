"""decodex::gemv_rope_append (merged q|k|v GEMV with RoPE and the KV-cache append in its epilogue)
against the two-kernel decodex path it replaces (gemv, then rope_append) and against cuBLAS
(torch.addmm) followed by decodex's rope_append, at the Qwen2.5-1.5B and -7B attention shapes, 1K-token
caches.

All three run L2-cold in CUDA graphs over a rotating stack of weights (bench.common), in the same
run. Bytes moved: the q|k|v weight (x, the output and the appended rows are noise next to it); % is
of the read bandwidth measured in the same run.

    python -m bench.gemv_rope_append
"""
from __future__ import annotations

import torch

from bench.common import bench_main, copies_for, fused_row

SHAPES = [("1.5B", 12, 2, 128, 1536), ("7B", 28, 4, 128, 3584)]  # (model, H, Hkv, D, K)
MS = [1, 8]
CONTEXT = 1024
TITLE = ("gemv_rope_append: fused vs decodex gemv + rope_append vs cuBLAS + rope_append, L2-cold, "
         "CUDA graph, median")
HEADERS = ["shape", "weight MB", "fused us", "gemv+rope_append us", "cuBLAS+rope_append us", "GB/s",
           "% of bw", "vs unfused", "vs cuBLAS"]


def rows(bandwidth_gbs: float) -> list[list]:
    import decodex  # noqa: F401
    from decodex import reference

    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for model, H, Hkv, D, K in SHAPES:
        N = (H + 2 * Hkv) * D
        nbytes = 2 * N * K
        ws = [torch.randn(N, K, **bf) / K**0.5 for _ in range(copies_for(nbytes))]
        inv_freq = reference.rope_inv_freq(D, 1e6, None).cuda()
        for M in MS:
            x, b = torch.randn(M, K, **bf), torch.randn(N, **bf)
            qkv = torch.empty(M, N, **bf)
            kc, vc = torch.zeros(M, Hkv, CONTEXT, D, **bf), torch.zeros(M, Hkv, CONTEXT, D, **bf)
            pos = torch.full((M,), CONTEXT - 1, dtype=torch.int32, device="cuda")
            q = qkv[:, : H * D].view(M, H, D)
            k = qkv[:, H * D: (H + Hkv) * D].view(M, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(M, Hkv, D)

            def unfused(w):
                torch.ops.decodex.gemv(x, w, b, qkv)
                torch.ops.decodex.rope_append(q, k, v, inv_freq, pos, kc, vc)

            def cublas(w):
                torch.addmm(b, x, w.t(), out=qkv)
                torch.ops.decodex.rope_append(q, k, v, inv_freq, pos, kc, vc)

            def fused(w):
                torch.ops.decodex.gemv_rope_append(x, w, b, inv_freq, pos, qkv, kc, vc)

            out.append(fused_row(f"{model} H={H} Hkv={Hkv} K={K} M={M}", nbytes, bandwidth_gbs, ws,
                                 fused, unfused, cublas))
        del ws
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
