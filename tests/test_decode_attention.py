"""decode_attention (flash-decoding over a bf16 KV cache) against decodex.reference.decode_attention.

GPU tests compare every output element with the fp32 reference (run on the GPU in fp32 on the same
bf16 values), with the cache rows past each sequence's length poisoned (NaN V, huge K) so a read of
them shows up, the output and workspace NaN-filled before the call, and lengths read on the device
(a CUDA graph replayed while they grow). CPU tests: the schemas, the split heuristic, the fake impl,
the dispatcher's answer to CPU tensors, and a hand-computed example of the reference.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from decodex import reference
from helpers import MERGES, capture_graph, set_merge

# (H, Hkv): Qwen2.5-1.5B (group 6), plain multi-head, Qwen2.5-7B (group 7), group 4 on one KV head.
HEADS = [(12, 2), (8, 8), (28, 4), (4, 1)]
# Groups over 8 query heads take several head blocks per KV head (one partial).
BIG_GROUPS = [(20, 2), (32, 1)]
HEAD_DIMS = [64, 128]
# One sequence of each length (capacity CAPACITY: odd, so no split size divides it) ...
LENGTHS = [1, 2, 127, 128, 129, 4095]
CAPACITY = 4099
# ... and batches that mix lengths, an inactive (0) sequence among them.
MIXED = [[0, 129, 4095], [127, 1, 2], [4099, 0, 128]]
LONG = 32768  # long-context cases: capacity LONG + 5
# Few splits: batch 64 on a short cache (2 splits at Hkv 2, 1 at Hkv 8: merged in a cluster on
# sm_90, else by the combine on one warp), lengths cycling through the edge cases, the rest spread
# over [0, capacity].
FEW_SPLITS_BATCH, FEW_SPLITS_CAPACITY = 64, 1029
# Many splits: batch 1 on a LONG + 5 cache (66 splits at Hkv 2 and 132 at Hkv 1 on an H200 in wide
# blocks, one an SM; with DECODEX_ATTN_WIDE=0 132 and 264, two blocks an SM: 8 combine warps, at 264
# 33 splits a warp, i.e. two chunks of 32); the short lengths leave most splits empty.
MANY_SPLITS_HEADS = [(12, 2), (4, 1)]
MANY_SPLITS_LENGTHS = [0, 1, 127, 128, 129, 12345, LONG + 5]
# DECODEX_TEST_QUICK (set for the compute-sanitizer runs): fewer cases, no 32K ones.
QUICK = bool(os.environ.get("DECODEX_TEST_QUICK"))
if QUICK:
    LENGTHS, MIXED = [1, 129, 4095], MIXED[:1]

# bf16 tolerance vs the fp32 reference. The output is rounded to bf16 (2^-9 relative, i.e. up to
# 0.008 at |out| in [2, 4)), and P is rounded to bf16 before the tensor-core P.V product (as flash
# attention does; ~2^-9 of each weight, averaging out over the tokens): 2 bf16 ulps relative plus
# a small absolute floor for outputs near 0.
TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}

def _ops():
    return torch.ops.decodex


def _splits(batch, kv_heads, capacity, device="cuda"):
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return _ops().decode_attention_splits(batch, kv_heads, capacity, sms)


def make_inputs(lengths, H, Hkv, D, S, *, grow_to=None, q_scale=2.0, device="cuda"):
    """q [B,H,D] and caches [B,Hkv,S,D] in bf16, fresh N(0,1) values (q scaled so the softmax is
    peaked, not uniform). Cache rows at and past max(length, grow_to[b]) are poisoned: K huge (a
    read key would take all the weight), V NaN."""
    B = len(lengths)
    q = (torch.randn(B, H, D, device=device) * q_scale).to(torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=device).to(torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device=device).to(torch.bfloat16)
    for b, length in enumerate(lengths):
        live = max(length, grow_to[b] if grow_to else 0, 0)
        if live < S:
            k[b, :, live:] = 3e4
            v[b, :, live:] = float("nan")
    return q, k, v


def ref_fp32(q, k, v, lengths, scale):
    """The reference's math in fp32 on the exact bf16 values (unrounded output), on q's device."""
    return reference.decode_attention(q.float(), k.float(), v.float(), lengths, scale)


def run_op(q, k, v, lengths, scale, splits_extra=0):
    """The op into NaN-poisoned out and workspace buffers; returns out."""
    B, H, D = q.shape
    splits = _splits(B, k.shape[1], k.shape[2])
    ws = torch.full((B, H, splits + splits_extra, D + 2), float("nan"), device=q.device)
    out = torch.full_like(q, float("nan"))
    _ops().decode_attention(q, k, v, lengths, scale, ws, out)
    return out


def check(out, want):
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element unwritten or a poisoned row read"
    torch.testing.assert_close(out.float(), want.float(), **TOL[out.dtype])


# ---------------------------------------------------------------- GPU: correctness


def check_lengths(lengths, H, Hkv, D, S):
    """decode_attention on fresh inputs (make_inputs) for one batch of lengths over caches of
    capacity S, against the fp32 reference."""
    q, k, v = make_inputs(lengths, H, Hkv, D, S)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    check(run_op(q, k, v, lens, scale), ref_fp32(q, k, v, lens, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("lengths", [[n] for n in LENGTHS] + MIXED, ids=str)
def test_matches_reference(lengths, H, Hkv, D):
    check_lengths(lengths, H, Hkv, D, CAPACITY)


@pytest.mark.gpu
@pytest.mark.skipif(QUICK, reason="DECODEX_TEST_QUICK: no 32K cases")
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_long_context(H, Hkv, D):
    check_lengths([LONG, 12345], H, Hkv, D, LONG + 5)


@pytest.mark.gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", [(12, 2), (8, 8)])
def test_large_batch_few_splits(H, Hkv, D):
    """Batch 64 on a short cache, mixed lengths (0 among them): 2 splits at Hkv 2 and 1 at Hkv 8,
    merged in a cluster on sm_90 (test_every_cluster_size runs both merges at these counts)."""
    B, S = FEW_SPLITS_BATCH, FEW_SPLITS_CAPACITY
    assert _splits(B, Hkv, S) <= 16  # one combine warp
    edge = [0, 1, 127, 128, 129, S]
    lengths = [edge[b % len(edge)] if b < 4 * len(edge) else (37 * b) % (S + 1) for b in range(B)]
    check_lengths(lengths, H, Hkv, D, S)


@pytest.mark.gpu
@pytest.mark.skipif(QUICK, reason="DECODEX_TEST_QUICK: no 32K cases")
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", MANY_SPLITS_HEADS)
@pytest.mark.parametrize("length", MANY_SPLITS_LENGTHS)
@pytest.mark.parametrize("wide,warps", [("1", None), ("1", "8"), ("0", None)])
def test_batch_one_many_splits(monkeypatch, wide, warps, length, H, Hkv, D):
    """Batch 1 on a 32K cache: the combine on 5-8 warps, from all splits live to all empty; in
    wide split blocks (the default: 6 warps at D = 128, 8 at 64), wide 8-warp ones, and two
    blocks an SM (twice the splits: 4 warps at D = 128, 6 at 64)."""
    monkeypatch.setenv("DECODEX_ATTN_WIDE", wide)
    if warps is not None:
        monkeypatch.setenv("DECODEX_ATTN_WARPS", warps)
    check_lengths([length], H, Hkv, D, LONG + 5)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", [(12, 2), (28, 4)] + BIG_GROUPS)
@pytest.mark.parametrize("S,splits", [(1000, 8), (1500, 8), (2048, 8), (2053, 17)], ids=str)
def test_short_caches_at_batch_one(monkeypatch, merge, S, splits, H, Hkv, D):
    """Short caches at batch 1: 8 splits (at most 2 * 8 minimum-length splits take 8, merged in a
    cluster or by the combine on one warp) and 17 (the combine on two warps), with lengths that
    leave trailing splits empty, length 0, and groups of more than 8 heads."""
    set_merge(monkeypatch, merge)
    assert _splits(1, Hkv, S) == splits
    for lengths in ([0], [1], [127], [129], [S // 2 + 3], [S]):
        check_lengths(lengths, H, Hkv, D, S)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", [(12, 2), (20, 2)])
@pytest.mark.parametrize("B,splits", [(1, 8), (17, 7), (22, 6), (27, 4), (45, 2), (67, 1)], ids=str)
def test_every_cluster_size(monkeypatch, merge, B, splits, H, Hkv, D):
    """Batches whose split count (from the capacity and the SM count) is each cluster size, 1 to 8,
    with mixed lengths (0 and a single token among them): every split live, some empty, all empty."""
    S = 1000
    if torch.cuda.get_device_properties("cuda").multi_processor_count != 132:
        pytest.skip("the split counts are those of a 132-SM GPU")
    set_merge(monkeypatch, merge)
    assert _splits(B, Hkv, S) == splits
    edge = [0, 1, 127, 128, 129, S]
    lengths = [edge[b % len(edge)] if b < 2 * len(edge) else (53 * b) % (S + 1) for b in range(B)]
    check_lengths(lengths, H, Hkv, D, S)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", [m for m in MERGES if m.startswith("cluster")])
@pytest.mark.parametrize("B", [4, 27, 45])  # 8, 4 and 2 splits on a 132-SM GPU
def test_cluster_merge_close_to_combine(monkeypatch, merge, B):
    """The merges sum the same partials in different orders: equal to a bf16 ulp or so."""
    H, Hkv, D, S = 12, 2, 128, 1000
    assert _splits(B, Hkv, S) <= 8, "more than 8 splits: both would take the combine"
    lengths = [[S, 1, 0, S // 3][b % 4] if b < 4 else (71 * b) % (S + 1) for b in range(B)]
    q, k, v = make_inputs(lengths, H, Hkv, D, S)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    set_merge(monkeypatch, merge)
    a = run_op(q, k, v, lens, 0.088)
    set_merge(monkeypatch, "combine")
    b = run_op(q, k, v, lens, 0.088)
    torch.testing.assert_close(a.float(), b.float(), atol=8e-3, rtol=8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv", BIG_GROUPS)
def test_groups_over_eight_heads(H, Hkv, D):
    lengths = [129, 0, 4095]
    check_lengths(lengths, H, Hkv, D, CAPACITY)


@pytest.mark.gpu
def test_error_at_most_twice_torch_bf16():
    """flash-attention's criterion: the kernel's max error vs the fp32 reference is at most ~2x
    that of torch's own bf16 SDPA on the same inputs (plus half a bf16 ulp at 1 as a floor)."""
    H, Hkv, D = 12, 2, 128
    for length in (129, 4095) if QUICK else (129, 4095, LONG):
        q, k, v = make_inputs([length], H, Hkv, D, length)
        lens = torch.tensor([length], dtype=torch.int32, device="cuda")
        scale = 1 / math.sqrt(D)
        want = ref_fp32(q, k, v, lens, scale)
        ours = run_op(q, k, v, lens, scale).float()
        sdpa = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        err_ours = (ours - want).abs().max().item()
        err_torch = (sdpa.squeeze(2).float() - want).abs().max().item()
        assert err_ours <= 2 * err_torch + 2e-3, (length, err_ours, err_torch)


@pytest.mark.gpu
def test_lengths_past_capacity_are_clamped():
    """lengths[b] > S reads only the S rows (the next batch's memory is NaN); negative = inactive."""
    H, Hkv, D, S = 12, 2, 128, 257
    lengths = [S + 7, S, 1 << 30, -3]
    B = len(lengths)
    q, k_all, v_all = make_inputs([S] * (B + 1), H, Hkv, D, S)
    k_all[B] = float("nan")
    v_all[B] = float("nan")
    k, v = k_all[:B], v_all[:B]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    out = run_op(q[:B], k, v, lens, scale)
    want = ref_fp32(q[:B], k, v, lens, scale)  # the reference clamps by slicing
    check(out, want)
    assert (out[3] == 0).all()


@pytest.mark.gpu
def test_batch_strides_and_oversized_workspace():
    """Caches as every other batch of a larger buffer (the gaps NaN), a stride-0 (expanded) cache,
    q as a slice of a wider buffer, and a workspace with more split slots than needed."""
    H, Hkv, D, S = 28, 4, 64, 1000
    lengths = [1000, 0, 333]
    B = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    q_wide = (torch.randn(B, H + 4, D, device="cuda") * 2).to(torch.bfloat16)
    q = q_wide[:, :H]
    k_all = torch.full((2 * B, Hkv, S, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_all = torch.full_like(k_all, float("nan"))
    _, k_live, v_live = make_inputs(lengths, H, Hkv, D, S)
    k_all[::2], v_all[::2] = k_live, v_live
    k, v = k_all[::2], v_all[::2]
    assert k.stride(0) == 2 * Hkv * S * D
    check(run_op(q, k, v, lens, scale, splits_extra=3), ref_fp32(q, k, v, lens, scale))

    _, k1, v1 = make_inputs([S], H, Hkv, D, S)
    k, v = k1.expand(B, -1, -1, -1), v1.expand(B, -1, -1, -1)
    assert k.stride(0) == 0
    lens = torch.tensor([5, 999, 1000], dtype=torch.int32, device="cuda")
    check(run_op(q, k, v, lens, scale), ref_fp32(q, k, v, lens, scale))


@pytest.mark.gpu
def test_cuda_graph_replay_as_lengths_grow():
    """Capture once; between replays lengths grow on the device (crossing split boundaries, one
    sequence starting inactive); each replay matches the reference at the current lengths."""
    H, Hkv, D, S = 12, 2, 128, 1000
    start, step, replays = [120, 0, 250], [1, 1, 3], 12
    final = [s + d * replays for s, d in zip(start, step)]
    q, k, v = make_inputs(start, H, Hkv, D, S, grow_to=final)
    lens = torch.tensor(start, dtype=torch.int32, device="cuda")
    inc = torch.tensor(step, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    ws = torch.full((3, H, _splits(3, Hkv, S), D + 2), float("nan"), device="cuda")
    out = torch.full_like(q, float("nan"))

    def call():
        _ops().decode_attention(q, k, v, lens, scale, ws, out)

    graph = capture_graph(call)
    for _ in range(replays):
        out.fill_(float("nan"))
        ws.fill_(float("nan"))
        graph.replay()
        check(out, ref_fp32(q, k, v, lens, scale))
        lens.add_(inc)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("start,S", [([0, 127, 4000], 4100), ([1, 128, 2], 4100), ([0, 127, 900], 1000),
                                     ([990 - 13 * i for i in range(45)], 1000)], ids=lambda v: str(v)[:40])
def test_prefetch_cache_after_the_append(monkeypatch, merge, start, S, D):
    """prefetch_cache=True right behind the append of row lengths - 1, as the decode step runs them:
    [rope_append at positions, decode_attention, advance_positions] in one CUDA graph. The appended
    row was poison before (huge K, NaN V), so reading it before the append finished would show; each
    replay matches the reference on the cache as appended. (S = 1000: 8 splits, merged in a cluster
    on sm_90. 45 rows: 2 splits of up to 8 tiles a warp, so the appended row also falls in tiles
    loaded after the wait, not only in the two loaded before it.)"""
    set_merge(monkeypatch, merge)
    H, Hkv = 12, 2
    B = len(start)
    q, kc, vc = make_inputs(start, H, Hkv, D, S)
    pos = torch.tensor(start, dtype=torch.int32, device="cuda")
    lens = pos + 1
    inv_freq = reference.rope_inv_freq(D, 10000.0, None).cuda()
    k_new = torch.randn(B, Hkv, D, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(B, Hkv, D, device="cuda").to(torch.bfloat16)
    ws = torch.full((B, H, _splits(B, Hkv, S), D + 2), float("nan"), device="cuda")
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(D)

    def step():
        _ops().rope_append(q, k_new, v_new, inv_freq, pos, kc, vc)
        _ops().decode_attention(q, kc, vc, lens, scale, ws, out, prefetch_cache=True)
        _ops().advance_positions(pos, lens)

    graph = capture_graph(step)  # runs one step first
    for _ in range(4):
        k_new.copy_(torch.randn(B, Hkv, D, device="cuda"))
        v_new.copy_(torch.randn(B, Hkv, D, device="cuda"))
        used = lens.clone()
        out.fill_(float("nan"))
        graph.replay()
        check(out, ref_fp32(q, kc, vc, used, scale))
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_opcheck_cuda():
    H, Hkv, D, S = 12, 2, 128, 300
    lengths = [300, 17]
    q, k, v = make_inputs(lengths, H, Hkv, D, S)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ws = torch.empty(2, H, _splits(2, Hkv, S), D + 2, device="cuda")
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.decodex.decode_attention.default, (q, k, v, lens, 0.125, ws, out))


# ---------------------------------------------------------------- GPU: argument checks


def _valid_args(D=128, H=12, Hkv=2, S=64, B=2):
    q = torch.randn(B, H, D, device="cuda").to(torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    ws = torch.empty(B, H, _splits(B, Hkv, S), D + 2, device="cuda")
    out = torch.empty_like(q)
    return [q, k, v, lens, 0.1, ws, out]


@pytest.mark.gpu
def test_rejects_unsupported_head_dim():
    with pytest.raises(RuntimeError, match="head dim D = 96"):
        _ops().decode_attention(*_valid_args(D=96))


@pytest.mark.gpu
def test_rejects_heads_not_multiple_of_kv_heads():
    args = _valid_args(H=12, Hkv=2)
    args[1] = torch.randn(2, 5, 64, 128, device="cuda").to(torch.bfloat16)
    args[2] = torch.randn_like(args[1])
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        _ops().decode_attention(*args)


@pytest.mark.gpu
def test_rejects_int64_lengths():
    args = _valid_args()
    args[3] = args[3].long()
    with pytest.raises(RuntimeError, match="lengths must have dtype"):
        _ops().decode_attention(*args)


@pytest.mark.gpu
def test_rejects_small_workspace():
    S = 1 << 15
    args = _valid_args(S=S)
    splits = _splits(2, 2, S)
    assert splits > 1
    args[5] = torch.empty(2, 12, splits - 1, 130, device="cuda")
    with pytest.raises(RuntimeError, match="workspace has room for"):
        _ops().decode_attention(*args)


@pytest.mark.ext
@pytest.mark.parametrize("value", ["2", "off", "false"])
def test_rejects_bad_wide_switch(monkeypatch, value):
    """DECODEX_ATTN_WIDE takes 0 or 1; anything else ("false" among them) is an error naming it, not
    a silent "on". decode_attention_splits reads it, so this needs no GPU."""
    monkeypatch.setenv("DECODEX_ATTN_WIDE", value)
    with pytest.raises(RuntimeError, match="DECODEX_ATTN_WIDE must be 0 or 1"):
        torch.ops.decodex.decode_attention_splits(1, 2, 32768, 132)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["2", "off", "false"])
def test_rejects_bad_cluster_switch(monkeypatch, value):
    """DECODEX_ATTN_CLUSTER takes 0 or 1 (read where the splits could merge in a cluster: here 1
    split); anything else is an error naming it, not a silent "on" ("false" was one)."""
    monkeypatch.setenv("DECODEX_ATTN_CLUSTER", value)
    with pytest.raises(RuntimeError, match="DECODEX_ATTN_CLUSTER must be 0 or 1"):
        _ops().decode_attention(*_valid_args())


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["5", "16", "eight"])
def test_rejects_bad_warps_switch(monkeypatch, value):
    """DECODEX_ATTN_WARPS takes 4, 6 or 8; anything else is an error naming it, not a silent 4."""
    monkeypatch.setenv("DECODEX_ATTN_WARPS", value)
    with pytest.raises(RuntimeError, match="DECODEX_ATTN_WARPS must be 4, 6 or 8"):
        _ops().decode_attention(*_valid_args())


@pytest.mark.gpu
def test_rejects_wrong_out_shape():
    args = _valid_args()
    args[6] = torch.empty(2, 12, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out must have shape"):
        _ops().decode_attention(*args)


@pytest.mark.gpu
def test_rejects_bad_scale_and_shared_outputs():
    """A non-finite scale gives NaN rows; out written while other blocks read q or the workspace."""
    for scale in (float("nan"), float("inf")):
        args = _valid_args()
        args[4] = scale
        with pytest.raises(RuntimeError, match="decode_attention: scale must be finite"):
            _ops().decode_attention(*args)
    args = _valid_args()
    args[6] = args[0]
    with pytest.raises(RuntimeError, match="decode_attention: out must not overlap q"):
        _ops().decode_attention(*args)
    args = _valid_args()
    B, H, D = args[0].shape
    args[6] = args[5].view(-1).view(torch.bfloat16)[:B * H * D].view(B, H, D)  # out inside the workspace
    with pytest.raises(RuntimeError, match="decode_attention: workspace and out must not overlap"):
        _ops().decode_attention(*args)


@pytest.mark.gpu
def test_rejects_cpu_lengths_and_bad_cache_strides():
    args = _valid_args()
    args[3] = args[3].cpu()
    with pytest.raises(RuntimeError, match="lengths must be a CUDA tensor"):
        _ops().decode_attention(*args)
    args = _valid_args()
    args[1] = args[1].transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hkv, S, D] view, S outer
    with pytest.raises(RuntimeError, match="k_cache must be contiguous in its inner three dims"):
        _ops().decode_attention(*args)


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_schemas_registered():
    schema = str(torch.ops.decodex.decode_attention.default._schema)
    assert "Tensor(a!) workspace" in schema and "Tensor(b!) out" in schema and "float scale" in schema
    assert schema.endswith("Tensor(b!) out, bool prefetch_cache=False) -> ()"), schema
    assert "-> int" in str(torch.ops.decodex.decode_attention_splits.default._schema)


@pytest.mark.ext
def test_splits_heuristic_is_sane(monkeypatch):
    monkeypatch.delenv("DECODEX_ATTN_WIDE", raising=False)
    f = torch.ops.decodex.decode_attention_splits
    sms = 132
    prev = 0
    for capacity in list(range(1, 2000, 7)) + [4095, 4096, 8192, 32768, 32769, 33793, 131072, 1 << 20]:
        n = f(1, 2, capacity, sms)
        assert 1 <= n <= max(1, math.ceil(capacity / 128)), (capacity, n)  # no absurd splits
        assert n >= prev, "must not decrease as the capacity grows"
        prev = n
    for kv in (1, 2, 4):  # a long cache fills the GPU: one wave of one wide block an SM
        blocks = kv * f(1, kv, 131072, sms)
        assert sms - kv < blocks <= sms
    for kv in (5, 8, 16, 33):  # ... or, with more (b, KV head) pairs, of two 4-warp blocks an SM
        blocks = kv * f(1, kv, 131072, sms)
        assert 2 * sms - kv < blocks <= 2 * sms
    assert f(64, 8, 131072, sms) == 1  # 512 (b, kv head) pairs already fill the GPU
    assert f(1, 2, 32768, 132) >= f(4, 2, 32768, 132) >= f(16, 2, 32768, 132)
    assert f(1, 2, 64, 132) == 1
    # a short cache (at most 16 minimum-length splits) takes 8, so they merge in one cluster
    assert [f(1, 2, c, 132) for c in (1024, 1025, 1500, 2048, 2049)] == [8, 8, 8, 8, 17]
    assert f(8, 2, 32768, 132) == 16  # a long cache keeps its split count
    # Wide blocks where one an SM gives each pair at least 32 splits (up to 4 pairs at 132 SMs) and
    # the cache has that many minimum-length splits; shorter caches keep their splits.
    assert [f(b, 2, 32768, sms) for b in (1, 2, 3, 4, 8)] == [66, 33, 44, 33, 16]
    assert [f(1, 2, c, sms) for c in (4096, 65 * 128, 65 * 128 + 1)] == [32, 65, 66]
    for capacity in (1000, 32768):  # non-increasing in batch on either side of that bound
        for batches in (range(1, 3), range(3, 65)):
            counts = [f(b, 2, capacity, sms) for b in batches]
            assert counts == sorted(counts, reverse=True), (capacity, counts)
    monkeypatch.setenv("DECODEX_ATTN_WIDE", "1")  # the rule, as unset
    assert [f(b, 2, 32768, sms) for b in (1, 2, 3, 4, 8)] == [66, 33, 44, 33, 16]
    monkeypatch.setenv("DECODEX_ATTN_WIDE", "0")  # 4-warp blocks only: two an SM
    assert [f(b, 2, 32768, sms) for b in (1, 2, 3, 4, 8)] == [132, 66, 44, 33, 16]
    assert f(1, 2, 65 * 128 + 1, sms) == 66
    assert [f(1, kv, 131072, sms) for kv in (1, 2, 4)] == [264, 132, 66]
    monkeypatch.delenv("DECODEX_ATTN_WIDE")
    with pytest.raises(RuntimeError, match="batch must be >= 1"):
        f(0, 2, 100, sms)
    with pytest.raises(RuntimeError, match="sm_count must be >= 1"):
        f(1, 2, 100, 0)
    # batch * num_kv_heads wrapped to 0 here and the division by it killed the process (SIGFPE).
    for args in ((1 << 32, 1 << 32, 100, sms), (1, 2, 1 << 62, sms), (1, 2, 100, 1 << 40)):
        with pytest.raises(RuntimeError, match="must be < 2\\^31"):
            f(*args)
    assert f(2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1) >= 1  # the largest accepted: no overflow


@pytest.mark.ext
def test_fake_impl_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 12, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 64, 128, dtype=torch.bfloat16)
        lens = torch.empty(2, dtype=torch.int32)
        ws = torch.empty(2, 12, 1, 130)
        out = torch.empty_like(q)
        assert torch.ops.decodex.decode_attention(q, k, k, lens, 0.1, ws, out) is None


@pytest.mark.ext
def test_cpu_tensors_are_rejected():
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    k = torch.randn(1, 1, 8, 64).to(torch.bfloat16)
    lens = torch.tensor([8], dtype=torch.int32)
    ws = torch.empty(1, 4, 1, 66)
    out = torch.empty_like(q)
    with pytest.raises((NotImplementedError, RuntimeError), match="CPU"):
        torch.ops.decodex.decode_attention(q, k, k, lens, 0.125, ws, out)


def test_reference_worked_example():
    """By hand: q = [2, 2], keys [1,0], [0,1], [1,1], values [1,0], [0,1], [2,2], scale 1/sqrt(2):
    scores sqrt(2) * [1, 1, 2], weights e^s / sum = [a, a, c], out = [a + 2c, a + 2c] ~ 1.5092.
    A fourth, NaN row past the length must not matter."""
    q = torch.tensor([[[2.0, 2.0]]])  # [B=1, H=1, D=2]
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [float("nan")] * 2]]])  # [1, 1, 4, 2]
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [float("nan")] * 2]]])
    out = reference.decode_attention(q, k, v, torch.tensor([3], dtype=torch.int32), 1 / math.sqrt(2))
    e1, e2 = math.exp(math.sqrt(2)), math.exp(2 * math.sqrt(2))
    a, c = e1 / (2 * e1 + e2), e2 / (2 * e1 + e2)
    expected = torch.tensor([[[a + 2 * c, a + 2 * c]]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert abs(out[0, 0, 0].item() - 1.5092) < 1e-4
    zero = reference.decode_attention(q, k, v, torch.tensor([0], dtype=torch.int32), 1.0)
    assert (zero == 0).all()
