"""decodex::rope_append_attention: rope_append (RoPE on the unrotated q and k rows at positions[b], k
and v appended at that row, after the optional 1/rms(rms_x) scale and bias and Qwen3's q/k head
norms) then decode_attention over lengths[b], in one kernel.

The contract is the composition: the caches and out must equal rope_append followed by
decode_attention bit for bit (both are tested against the fp32 reference in their own files; the
composition is also checked against reference.rope_append_attention here), and q, k, v must be left
as they were. GPU tests cover the decode step's rows (positions = lengths - 1) and the odd ones (a dead
row, a position past the length, length 0 with a position, a position past the capacity), both
split merges, both tile paths (registers up to 8 rows, the shared-memory ring above), wide split
blocks on a long cache, groups of more than 8 heads, q/k norms, prefetch_cache, CUDA-graph replay
with positions and lengths changed on the device, and the argument checks. CPU tests: schema and
fake impl.
"""
from __future__ import annotations

import pytest
import torch

from decodex import ops as dx_ops
from decodex import reference
from helpers import MERGES, capture_graph, qkv_views, set_merge

THETA = 1_000_000.0
RMS_EPS = 1e-6
NORM_EPS = 1e-5


def _inputs(lengths, positions, H, Hkv, D, S, with_rms, with_bias, with_norms=False, K=256):
    B = len(lengths)
    qkv, q, k, v = qkv_views(B, H, Hkv, D)
    kc = torch.randn(B, Hkv, S, D, device="cuda").to(torch.bfloat16)
    vc = torch.randn(B, Hkv, S, D, device="cuda").to(torch.bfloat16)
    inv_freq = reference.rope_inv_freq(D, THETA).cuda()
    rms_x = (3.0 * torch.randn(B, K, device="cuda")).to(torch.bfloat16) if with_rms else None
    bias = (0.5 * torch.randn((H + 2 * Hkv) * D, device="cuda")).to(torch.bfloat16) if with_bias else None
    # Qwen3's q/k norms: weights around 1, a different one for q and k
    norms = (dict(q_norm=(1 + 0.3 * torch.randn(D, device="cuda")).to(torch.bfloat16),
                  k_norm=(1 + 0.3 * torch.randn(D, device="cuda")).to(torch.bfloat16), norm_eps=NORM_EPS)
             if with_norms else {})
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return dict(qkv=qkv, q=q, k=k, v=v, kc=kc, vc=vc, inv_freq=inv_freq, rms_x=rms_x, bias=bias,
                norms=norms, pos=pos, lens=lens)


def _composition(t, scale):
    """rope_append then decode_attention, on copies: (k_cache, v_cache, out). (No prefetch_cache:
    rope_append, just before, may write any row.)"""
    q, k, kc, vc = t["q"].clone(), t["k"].clone(), t["kc"].clone(), t["vc"].clone()
    eps = RMS_EPS if t["rms_x"] is not None else None
    torch.ops.decodex.rope_append(q, k, t["v"], t["inv_freq"], t["pos"], kc, vc, rms_x=t["rms_x"],
                                  rms_eps=eps, bias=t["bias"], **t["norms"])
    B, H, D = q.shape
    ws = dx_ops.attention_workspace(B, H, kc.shape[1], D, kc.shape[2], q.device)
    out = torch.full_like(q, float("nan"))
    torch.ops.decodex.decode_attention(q, kc, vc, t["lens"], scale, ws, out)
    return kc, vc, out


def _fused(t, scale, prefetch, kc=None, vc=None, out=None, ws=None):
    q = t["q"]
    B, H, D = q.shape
    kc = t["kc"].clone() if kc is None else kc
    vc = t["vc"].clone() if vc is None else vc
    ws = dx_ops.attention_workspace(B, H, kc.shape[1], D, kc.shape[2], q.device) if ws is None else ws
    out = torch.full_like(q, float("nan")) if out is None else out
    eps = RMS_EPS if t["rms_x"] is not None else None
    if prefetch and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # prefetch_cache: the kernel ahead (the clones) must be done
    torch.ops.decodex.rope_append_attention(q, t["k"], t["v"], t["inv_freq"], t["pos"], kc, vc, t["lens"],
                                            scale, ws, out, prefetch_cache=prefetch, rms_x=t["rms_x"],
                                            rms_eps=eps, bias=t["bias"], **t["norms"])
    return kc, vc, out


def _check_equal(t, scale, prefetch):
    qkv0 = t["qkv"].clone()
    want = _composition(t, scale)
    got = _fused(t, scale, prefetch)
    torch.cuda.synchronize()
    assert torch.equal(t["qkv"], qkv0), "q, k or v was modified"
    for name, g, w in zip(("k_cache", "v_cache", "out"), got, want):
        assert torch.equal(g, w), f"{name} differs from rope_append + decode_attention"


def _decode_rows(B, S, gen):
    """Lengths in [1, S], positions = lengths - 1 (the decode step's rows)."""
    lengths = torch.randint(1, S + 1, (B,), generator=gen).tolist()
    return lengths, [n - 1 for n in lengths]


# Up to REGISTER_ROWS rows the op takes decode_attention's register path, with as many warps as
# decode_attention takes (DECODEX_ATTN_WARPS forces both); above, the ring path, always 4 warps a
# block. The composition's decode_attention equals the op bit for bit with as many warps merging in
# the same order, so the ring path's cases leave "cluster-8w" and "combine-6w" out, and every test
# here that does not set a merge runs both on 4 warps.
REGISTER_ROWS = 8


def merges_for(B):
    return [m for m in MERGES if B <= REGISTER_ROWS or not m.endswith("w")]


@pytest.fixture(autouse=True)
def _four_warps(monkeypatch):
    monkeypatch.setenv("DECODEX_ATTN_WARPS", "4")


# (H, Hkv, D): Qwen2.5-1.5B, Qwen2.5-7B, a D = 64 model, a group of 16 (two head blocks), MHA.
HEADS = [(12, 2, 128), (28, 4, 128), (9, 3, 64), (32, 2, 128), (4, 4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,merge", [(B, S, m) for B, S in [(1, 1000), (1, 5000), (5, 1100), (64, 1030)]
                                       for m in merges_for(B)], ids=str)
@pytest.mark.parametrize("H,Hkv,D", HEADS)
# (rms, bias, q/k norms): the last two as Qwen3's steps have them after a plain gemv and a wide product
@pytest.mark.parametrize("with_rms,with_bias,with_norms",
                         [(True, True, False), (False, False, False), (False, True, False), (False, False, True),
                          (True, False, True)])
def test_equals_rope_append_then_attention(monkeypatch, merge, H, Hkv, D, B, S, with_rms, with_bias, with_norms):
    set_merge(monkeypatch, merge)
    gen = torch.Generator().manual_seed(B * 7 + S + H)
    lengths, positions = _decode_rows(B, S, gen)
    lengths[0], positions[0] = S, S - 1  # the last row of the cache
    if B > 1:
        lengths[1], positions[1] = 1, 0  # the first row alone
    t = _inputs(lengths, positions, H, Hkv, D, S, with_rms, with_bias, with_norms)
    _check_equal(t, D ** -0.5, prefetch=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,merge", [(B, m) for B in (7, 12) for m in merges_for(B)], ids=str)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("with_norms", [False, True])
def test_odd_rows(monkeypatch, B, merge, prefetch, with_norms):
    """A dead row (position -1, length 0), a position past the length (appended, not attended), a
    length-0 row with a position (appended by split 0; zeros out), a position past the capacity
    (nothing appended, q unrotated), a position inside the length (the row attended is the new one)
    and ordinary rows: 7 rows (the register path) or 12 (the ring path)."""
    set_merge(monkeypatch, merge)
    S = 700
    lengths = [0, 300, 0, 50, 400, 699, 1, 650, 2, 129, 128, 0][:B]
    positions = [-1, 450, 20, S + 5, 100, 698, 0, 649, 1, 128, 127, -1][:B]
    t = _inputs(lengths, positions, 12, 2, 128, S, with_rms=True, with_bias=True, with_norms=with_norms)
    _check_equal(t, 0.1, prefetch)


@pytest.mark.gpu
@pytest.mark.parametrize("with_norms", [False, True])
def test_matches_reference(with_norms):
    """The composition the op equals, against reference.rope_append_attention (fp32 attention)."""
    S = 300
    lengths, positions = [300, 17, 129], [299, 16, 128]
    t = _inputs(lengths, positions, 12, 2, 128, S, with_rms=True, with_bias=True, with_norms=with_norms)
    kc, vc, out = _fused(t, 128 ** -0.5, prefetch=False)
    kc_ref, vc_ref = t["kc"].clone(), t["vc"].clone()
    want = reference.rope_append_attention(t["q"], t["k"], t["v"], t["inv_freq"], t["pos"], kc_ref, vc_ref,
                                           t["lens"], 128 ** -0.5, t["rms_x"], RMS_EPS, t["bias"], **t["norms"])
    torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(vc, vc_ref)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", [(12, 2), (32, 4)])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("with_norms", [False, True])
def test_wide_blocks(monkeypatch, H, Hkv, prefetch, with_norms):
    """One row on a long cache takes wide split blocks (6 warps at D = 128, one an SM: the split
    count is one block an SM per KV head), as the Qwen3 steps do at batch 1 (Qwen3-30B-A3B: 32
    heads over 4 KV heads, q/k norms); the appended row the cache's last, or 264 rows before it."""
    monkeypatch.delenv("DECODEX_ATTN_WARPS")  # the op's own choice
    S = 33000
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms // Hkv < 32:  # kWideMinSplits
        pytest.skip(f"{sms} SMs leave {Hkv} KV heads fewer than 32 wide splits each: no wide blocks")
    assert torch.ops.decodex.decode_attention_splits(1, Hkv, S, sms) == sms // Hkv
    for n in (S, 32737):
        t = _inputs([n], [n - 1], H, Hkv, 128, S, with_rms=not with_norms, with_bias=True,
                    with_norms=with_norms)
        _check_equal(t, 128 ** -0.5, prefetch)


@pytest.mark.gpu
@pytest.mark.parametrize("with_norms", [False, True])
def test_cuda_graph_positions_advance_on_device(with_norms):
    """One captured call replayed while positions and lengths grow on the device: each replay equals
    the composition at that step (the caches carry over)."""
    S, B, H, Hkv, D = 600, 3, 12, 2, 128
    lengths = [5, 130, 511]
    t = _inputs(lengths, [n - 1 for n in lengths], H, Hkv, D, S, with_rms=not with_norms, with_bias=False,
                with_norms=with_norms)
    kc, vc = t["kc"].clone(), t["vc"].clone()
    ws = dx_ops.attention_workspace(B, H, Hkv, D, S, "cuda")
    out = torch.empty_like(t["q"])
    graph = capture_graph(lambda: _fused(t, 0.09, True, kc, vc, out, ws))
    want_kc, want_vc = t["kc"].clone(), t["vc"].clone()
    for _ in range(3):
        t["qkv"].normal_()
        out.fill_(float("nan"))
        graph.replay()
        ref = dict(t, kc=want_kc, vc=want_vc)
        want_kc, want_vc, want_out = _composition(ref, 0.09)
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
        t["pos"] += 1
        t["lens"] += 1


@pytest.mark.gpu
def test_rejects():
    t = _inputs([10, 20], [9, 19], 12, 2, 128, 2048, with_rms=False, with_bias=False)
    ws = dx_ops.attention_workspace(2, 12, 2, 128, 2048, "cuda")  # 8 splits
    assert ws.shape[2] > 1
    f = torch.ops.decodex.rope_append_attention

    def call(**kw):
        a = dict(q=t["q"], k=t["k"], v=t["v"], inv_freq=t["inv_freq"], positions=t["pos"],
                 k_cache=t["kc"], v_cache=t["vc"], lengths=t["lens"], scale=0.1, workspace=ws,
                 out=torch.empty_like(t["q"]))
        a.update(kw)
        f(a["q"], a["k"], a["v"], a["inv_freq"], a["positions"], a["k_cache"], a["v_cache"], a["lengths"],
          a["scale"], a["workspace"], a["out"],
          **{k: v for k, v in kw.items() if k in ("rms_x", "rms_eps", "bias", "q_norm", "k_norm", "norm_eps")})

    with pytest.raises(RuntimeError, match="out must not overlap q, k or v"):
        call(out=t["q"])
    # Rows sharing a cache (rope_append's prefill pattern): a row's append races the others' reads.
    with pytest.raises(RuntimeError, match=r"k_cache rows must not share memory: stride\(0\) = 0"):
        call(k_cache=t["kc"][:1].expand(2, -1, -1, -1))
    with pytest.raises(RuntimeError, match="v_cache rows must not share memory"):
        call(v_cache=t["vc"][:1].expand(2, -1, -1, -1))
    with pytest.raises(RuntimeError, match="k_cache and v_cache must not overlap"):
        call(v_cache=t["kc"])
    with pytest.raises(RuntimeError, match="rope_append_attention: scale must be finite"):
        call(scale=float("nan"))
    with pytest.raises(RuntimeError, match=r"head dim D = 32 \(q.size\(2\)\) is not supported"):
        q32 = torch.zeros(2, 12, 32, device="cuda", dtype=torch.bfloat16)
        call(q=q32)
    with pytest.raises(RuntimeError, match="positions must have shape"):
        call(positions=t["pos"][:1])
    with pytest.raises(RuntimeError, match="rms_x and rms_eps go together"):
        call(rms_x=torch.zeros(2, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="workspace has room for"):
        call(workspace=ws[:, :, :1].contiguous())
    with pytest.raises(RuntimeError, match="lengths"):
        call(lengths=t["lens"].long())
    w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rope_append_attention: q_norm, k_norm and norm_eps go together"):
        call(q_norm=w, k_norm=w)
    with pytest.raises(RuntimeError, match=r"rope_append_attention: k_norm must have shape \[128\]"):
        call(q_norm=w, k_norm=w[:64], norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="rope_append_attention: q_norm must have dtype BFloat16"):
        call(q_norm=w.float(), k_norm=w, norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="rope_append_attention: norm_eps must be finite"):
        call(q_norm=w, k_norm=w, norm_eps=float("inf"))
    out = torch.empty_like(t["q"])
    with pytest.raises(RuntimeError, match="rope_append_attention: k_norm must not overlap the caches, "
                                           "workspace or out"):
        call(out=out, q_norm=w, k_norm=out[0, 0], norm_eps=1e-6)


@pytest.mark.ext
def test_schema():
    schema = str(torch.ops.decodex.rope_append_attention.default._schema)
    assert schema == ("decodex::rope_append_attention(Tensor q, Tensor k, Tensor v, Tensor inv_freq, "
                      "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lengths, "
                      "float scale, Tensor(c!) workspace, Tensor(d!) out, bool prefetch_cache=False, "
                      "Tensor? rms_x=None, float? rms_eps=None, Tensor? bias=None, Tensor? q_norm=None, "
                      "Tensor? k_norm=None, float? norm_eps=None) -> ()"), schema


@pytest.mark.ext
def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bf = dict(device="cuda", dtype=torch.bfloat16)
        q, k, v = torch.empty(2, 12, 128, **bf), torch.empty(2, 2, 128, **bf), torch.empty(2, 2, 128, **bf)
        kc, vc = torch.empty(2, 2, 64, 128, **bf), torch.empty(2, 2, 64, 128, **bf)
        inv = torch.empty(64, device="cuda")
        pos = torch.empty(2, device="cuda", dtype=torch.int32)
        ws = torch.empty(2, 12, 4, 130, device="cuda")
        assert torch.ops.decodex.rope_append_attention(q, k, v, inv, pos, kc, vc, pos, 0.1, ws,
                                                       torch.empty_like(q)) is None


@pytest.mark.parametrize("with_norms", [False, True])
def test_reference_is_the_composition(with_norms):
    """reference.rope_append_attention on the CPU: rope_append (its rms_x / rms_eps / bias and q/k
    norms passed through in that order) then decode_attention with the rotated q; inputs kept."""
    torch.manual_seed(0)
    B, H, Hkv, D, S, K = 2, 4, 2, 16, 10, 24
    q, k, v = torch.randn(B, H, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    kc, vc = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    inv = reference.rope_inv_freq(D, THETA)
    pos, lens = torch.tensor([3, 9]), torch.tensor([4, 10])
    rms_x, bias = 3.0 * torch.randn(B, K), torch.randn((H + 2 * Hkv) * D)
    norms = {}
    if with_norms:
        norms = dict(q_norm=1 + 0.3 * torch.randn(D), k_norm=1 + 0.3 * torch.randn(D), norm_eps=NORM_EPS)
    q0, kc0, vc0, kc2, vc2 = q.clone(), kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = reference.rope_append_attention(q, k, v, inv, pos, kc, vc, lens, 0.25, rms_x, RMS_EPS, bias, **norms)
    assert torch.equal(q, q0)
    q_rot, _ = reference.rope_append(q, k, v, inv, pos, kc2, vc2, rms_x=rms_x, rms_eps=RMS_EPS, bias=bias, **norms)
    assert torch.equal(out, reference.decode_attention(q_rot, kc2, vc2, lens, 0.25))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc[0, :, 3], kc0[0, :, 3]) and not torch.equal(vc[1, :, 9], vc0[1, :, 9])  # appended
