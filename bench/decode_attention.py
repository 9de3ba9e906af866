"""decode_attention vs torch SDPA at head dim 128, H = 6 * Hkv (Qwen2.5-1.5B's ratio): batch 1 over
contexts and KV heads, and batches 8 and 64 at context 1024, Hkv 2 (the batched decode step, where
the splits are few; every sequence at the full context).

Bytes moved: the K and V rows read, 2 * B * len * Hkv * D * 2 bytes (q, the partials and the output
are noise next to them). Both ops run L2-cold in one CUDA graph over a rotating stack of caches
(bench.common.copies_for), in the same run; the baseline is F.scaled_dot_product_attention with
enable_gqa=True on q [B, H, 1, D] and the [B, Hkv, len, D] caches. % of bw is against the read
bandwidth measured in this run. "prefetch_cache us" passes prefetch_cache=True, as the decode graph
does (the call before, another cache's, writes no row of this one): each call starts reading its
cache while the call ahead drains. GB/s, % of bw and the ratio to SDPA are of that column.

"sum us" is one torch.sum over the same cache bytes (K and V of a copy share one buffer, read as
fp32, as read_bandwidth_gbs reads its 4 GiB), timed the same way: what a generic read-only reduction
of those bytes costs in this harness, launch and ramp-up included. It is a reference point, not a
ceiling (at 32K with 2 KV heads the op is faster; a chain of streaming reads of those 33.55 MB,
`./sync_probe ceiling` from bench/sync_probe.cu, took 9.4 us in session 19). "% of sum" is sum us
over the prefetch_cache time.

    python -m bench.decode_attention
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench.common import copies_for, print_table, read_bandwidth_gbs, require_gpu, time_graph

CONTEXTS = [1024, 8192, 32768, 131072]
KV_HEADS = [2, 4, 8]
HEAD_DIM = 128
GROUP = 6  # query heads per KV head
BATCHED = [(8, 1024, 2), (64, 1024, 2)]  # (batch, context, KV heads)

TITLE = "decode_attention (D 128, H = 6 Hkv, L2-cold)"
HEADERS = ["shape", "decodex us", "prefetch_cache us", "SDPA us", "sum us", "cache MB", "GB/s", "% of bw",
           "% of sum", "vs SDPA"]


def _row(ctx: int, kv_heads: int, bw_gbs: float, batch: int = 1) -> list:
    B, H, D = batch, GROUP * kv_heads, HEAD_DIM
    cache_bytes = 2 * B * ctx * kv_heads * D * 2
    n = copies_for(cache_bytes)
    dev, bf16 = "cuda", torch.bfloat16
    qs = [torch.randn(B, H, D, device=dev, dtype=bf16) for _ in range(n)]
    kvs = [torch.randn(2, B, kv_heads, ctx, D, device=dev, dtype=bf16) for _ in range(n)]
    ks, vs = [kv[0] for kv in kvs], [kv[1] for kv in kvs]
    total = torch.empty((), device=dev, dtype=torch.float32)
    lengths = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = torch.ops.decodex.decode_attention_splits(B, kv_heads, ctx, sms)
    ws = torch.empty(B, H, splits, D + 2, device=dev, dtype=torch.float32)
    out = torch.empty(B, H, D, device=dev, dtype=bf16)
    scale = 1.0 / math.sqrt(D)

    def ours(i, prefetch=False):
        return lambda: torch.ops.decodex.decode_attention(qs[i], ks[i], vs[i], lengths, scale, ws, out,
                                                          prefetch_cache=prefetch)

    def sdpa(i):
        return lambda: F.scaled_dot_product_attention(qs[i].unsqueeze(2), ks[i], vs[i], scale=scale,
                                                      enable_gqa=True)

    # Sanity: the two agree before either is timed.
    ours(0)()
    want = sdpa(0)().squeeze(2)
    if not torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2):
        print(f"WARNING: decodex and SDPA disagree at B {B}, ctx {ctx}, Hkv {kv_heads}: max diff "
              f"{(out.float() - want.float()).abs().max().item():.3g}")

    plain = time_graph([ours(i) for i in range(n)])
    us = time_graph([ours(i, prefetch=True) for i in range(n)])
    sdpa_us = time_graph([sdpa(i) for i in range(n)])
    sum_us = time_graph([lambda kv=kv: torch.sum(kv.view(-1).view(torch.float32), dim=0, out=total) for kv in kvs])
    gbs = cache_bytes / us / 1e3
    del qs, ks, vs, kvs
    torch.cuda.empty_cache()
    shape = f"ctx {ctx} Hkv {kv_heads} H {H}"
    return [shape if B == 1 else f"B {B} {shape}", plain, us, sdpa_us, sum_us, cache_bytes / 1e6, gbs,
            100.0 * gbs / bw_gbs, 100.0 * sum_us / us, f"{sdpa_us / us:.2f}x"]


def rows(bw_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401  (registers torch.ops.decodex)

    if bw_gbs is None:
        bw_gbs = read_bandwidth_gbs()
    batch_one = [_row(ctx, kv, bw_gbs) for kv in KV_HEADS for ctx in CONTEXTS]
    return batch_one + [_row(ctx, kv, bw_gbs, batch=B) for B, ctx, kv in BATCHED]


def main() -> None:
    require_gpu()
    bw = read_bandwidth_gbs()
    print_table(f"{TITLE}; measured read bandwidth {bw:.0f} GB/s", HEADERS, rows(bw))


if __name__ == "__main__":
    main()
