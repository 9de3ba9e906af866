"""decodex::rope_append_attention (rope_append done by the attention split kernel) against the two
ops it replaces (rope_append then decode_attention, as the decode step ran them before) and the
torch composition (rope + index_put in fp32, then SDPA), D = 128, 1K-token caches: at the batched
step's shapes, the Qwen2.5-1.5B (H=12, Hkv=2) and -7B (H=28, Hkv=4) head layouts with the
1/rms(rms_x) scale and the bias of the step's unscaled q|k|v product (the ring path, above 8 rows);
and Qwen3's batch-1 step, the Qwen3-1.7B (H=16, Hkv=8) and Qwen3-30B-A3B (H=32, Hkv=4) layouts with
the q/k head norms after a plain (scaled) gemv (the register path; torch: F.rms_norm on the heads
first).

Timing: one input set per call in a stack made L2-cold by bench.common.copies_for, all calls in one
CUDA graph (bench.common.fused_row), prefetch_cache=True as the decode step passes it. MB and GB/s
are of the cache bytes read; % is of the bandwidth measured in the same run.

    python -m bench.rope_append_attention
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench.common import copies_for, fused_row, print_table, read_bandwidth_gbs, require_gpu
from bench.rope_append import _torch_rope_append

# (model, H, Hkv, B, Qwen3's q/k norms: then no rms_x / bias)
CASES = [("1.5B", 12, 2, 16, False), ("1.5B", 12, 2, 32, False), ("1.5B", 12, 2, 64, False),
         ("7B", 28, 4, 16, False), ("Qwen3-1.7B", 16, 8, 1, True), ("Qwen3-30B-A3B", 32, 4, 1, True)]
D, CTX, HIDDEN = 128, 1024, 1536
TITLE = "rope_append_attention: fused vs rope_append + decode_attention vs torch (rope + SDPA), 1K, L2-cold"
HEADERS = ["shape", "cache MB", "fused us", "two ops us", "torch us", "GB/s", "% of bw", "two ops / fused",
           "torch / fused"]


def _row(model, H, Hkv, B, norms, bw) -> list:
    from decodex import ops as dx_ops
    from decodex import reference

    bf = dict(device="cuda", dtype=torch.bfloat16)
    S = CTX + 16
    cache_bytes = 2 * B * Hkv * CTX * D * 2
    inv_freq = reference.rope_inv_freq(D, 1_000_000.0).cuda()
    positions = torch.full((B,), CTX - 1, dtype=torch.int32, device="cuda")
    lengths = positions + 1
    bidx = torch.arange(B, device="cuda")
    bias = (0.1 * torch.randn((H + 2 * Hkv) * D, device="cuda")).to(torch.bfloat16)
    ws = dx_ops.attention_workspace(B, H, Hkv, D, S, "cuda")
    out = torch.empty(B, H, D, **bf)
    scale = 1.0 / math.sqrt(D)

    def make():
        x = torch.randn(B, (H + 2 * Hkv) * D, **bf)
        q = x[:, : H * D].view(B, H, D)
        k = x[:, H * D: (H + Hkv) * D].view(B, Hkv, D)
        v = x[:, (H + Hkv) * D:].view(B, Hkv, D)
        return (q, k, v, torch.randn(B, Hkv, S, D, **bf), torch.randn(B, Hkv, S, D, **bf),
                torch.randn(B, HIDDEN, **bf))

    sets = [make() for _ in range(copies_for(cache_bytes))]
    q_norm, k_norm = ((1 + 0.1 * torch.randn(D, device="cuda")).to(torch.bfloat16) for _ in range(2))
    rope = (dict(q_norm=q_norm, k_norm=k_norm, norm_eps=1e-6) if norms else dict(rms_eps=1e-6, bias=bias))

    def fused(s):
        q, k, v, kc, vc, x = s
        torch.ops.decodex.rope_append_attention(q, k, v, inv_freq, positions, kc, vc, lengths, scale, ws,
                                                out, prefetch_cache=True, rms_x=None if norms else x, **rope)

    def two_ops(s):
        q, k, v, kc, vc, x = s
        torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc, rms_x=None if norms else x, **rope)
        torch.ops.decodex.decode_attention(q, kc, vc, lengths, scale, ws, out, prefetch_cache=True)

    def torch_ops(s):  # the scale and bias are left out: the baseline is the unfused rope and SDPA
        q, k, v, kc, vc, _ = s
        if norms:
            q, k = F.rms_norm(q, (D,), q_norm, 1e-6), F.rms_norm(k, (D,), k_norm, 1e-6)
        _torch_rope_append(q, k, v, inv_freq, positions, kc, vc, bidx)
        F.scaled_dot_product_attention(q.unsqueeze(2), kc[:, :, :CTX], vc[:, :, :CTX], scale=scale,
                                       enable_gqa=True)

    label = f"{model} H={H} Hkv={Hkv} B={B}" + (" q/k norms" if norms else "")
    row = fused_row(label, cache_bytes, bw, sets, fused, two_ops, torch_ops)
    del sets
    torch.cuda.empty_cache()
    return row


def rows(bw_gbs: float | None = None) -> list[list]:
    import decodex  # noqa: F401  (registers torch.ops.decodex)

    bw = bw_gbs or read_bandwidth_gbs()
    return [_row(model, H, Hkv, B, norms, bw) for model, H, Hkv, B, norms in CASES]


def main() -> None:
    require_gpu()
    bw = read_bandwidth_gbs()
    print_table(f"{TITLE}; measured read bandwidth {bw:.0f} GB/s", HEADERS, rows(bw))


if __name__ == "__main__":
    main()
