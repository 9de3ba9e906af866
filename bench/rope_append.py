"""decodex::rope_append against the PyTorch composition (cos/sin from the device positions, HF's
rotate_half RoPE on q and k in fp32, copied back in place, then k and v index_put into the caches
at the device positions) at the Qwen2.5-1.5B (H=12, Hkv=2) and -7B (H=28, Hkv=4) head layouts,
D = 128, B = 1 and 8, q/k/v as views of the merged QKV output. Latency-bound by nature (a few KB).

Timing: one (qkv, caches) set per call in a stack of up to 512 sets, every call captured in one
CUDA graph (bench.common). Bytes moved: q and k read and written, v read, the k and v cache rows
written; % is of the bandwidth measured in the same run.

Note: bench.common.copies_for caps the stack at 512 sets, so where one set is a few KB (M = 1) the
stack stays below the 60 MB L2 and those rows measure an L2-warm, latency-bound call (launch, one
round trip, the reduction) rather than DRAM bandwidth.

    python -m bench.rope_append
"""
from __future__ import annotations

import torch

from bench.common import bench_main, compare_row, read_bandwidth_gbs

CONFIGS = [("1.5B", 12, 2, 128), ("7B", 28, 4, 128)]  # (model, H, Hkv, D)
BS = [1, 8]
S = 256  # cache rows per set: only one row per sequence is written, the capacity does not matter
TITLE = "rope_append: decodex vs the torch composition (rope + index_put), L2-cold, CUDA graph, median"
HEADERS = ["shape", "decodex us", "torch us", "GB/s", "% of bw", "speedup"]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _torch_rope_append(q, k, v, inv_freq, positions, kc, vc, rows):
    ang = positions.float()[:, None] * inv_freq  # [B, D/2]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, D]
    q.copy_(q.float() * cos + _rotate_half(q.float()) * sin)
    k.copy_(k.float() * cos + _rotate_half(k.float()) * sin)
    kc[rows, :, positions] = k
    vc[rows, :, positions] = v


def rows(bandwidth_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401
    from decodex import reference

    bw = bandwidth_gbs or read_bandwidth_gbs()
    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for model, H, Hkv, D in CONFIGS:
        inv_freq = reference.rope_inv_freq(D, 1_000_000.0).cuda()
        for B in BS:
            positions = torch.randint(0, S, (B,), dtype=torch.int32, device="cuda")
            bidx = torch.arange(B, device="cuda")

            def make():  # q, k, v (views of one merged qkv row buffer), k_cache, v_cache
                x = torch.randn(B, (H + 2 * Hkv) * D, **bf)
                return (x[:, : H * D].view(B, H, D), x[:, H * D : (H + Hkv) * D].view(B, Hkv, D),
                        x[:, (H + Hkv) * D :].view(B, Hkv, D), torch.zeros(B, Hkv, S, D, **bf),
                        torch.zeros(B, Hkv, S, D, **bf))

            out.append(compare_row(
                f"{model} H={H} Hkv={Hkv} D={D} B={B}", 2 * (2 * H * D + 3 * Hkv * D + 2 * Hkv * D) * B, bw,
                make, lambda q, k, v, kc, vc: torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc),
                lambda q, k, v, kc, vc: _torch_rope_append(q, k, v, inv_freq, positions, kc, vc, bidx)))
    return out


def main(argv=None) -> None:
    bench_main(TITLE, HEADERS, rows)


if __name__ == "__main__":
    main()
