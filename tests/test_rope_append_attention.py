"""decodex::rope_append_attention: rope_append (RoPE on the unrotated q and k rows at positions[b], k
and v appended at that row, after the optional 1/rms(rms_x) scale and bias) then decode_attention
over lengths[b], in one kernel.

The contract is the composition: the caches and out must equal rope_append followed by
decode_attention bit for bit (both are tested against the fp32 reference in their own files; the
composition is also checked against reference.rope_append_attention here), and q, k, v must be left
as they were. GPU tests cover the decode step's rows (positions = lengths - 1) and the odd ones (a dead
row, a position past the length, length 0 with a position, a position past the capacity), both
split merges, groups of more than 8 heads, prefetch_cache, CUDA-graph replay with positions and
lengths changed on the device, and the argument checks. CPU tests: schema and fake impl.
"""
from __future__ import annotations

import pytest
import torch

from decodex import ops as dx_ops
from decodex import reference
from helpers import MERGES, capture_graph, qkv_views, set_merge

THETA = 1_000_000.0
RMS_EPS = 1e-6


def _inputs(lengths, positions, H, Hkv, D, S, with_rms, with_bias, K=256):
    B = len(lengths)
    qkv, q, k, v = qkv_views(B, H, Hkv, D)
    kc = torch.randn(B, Hkv, S, D, device="cuda").to(torch.bfloat16)
    vc = torch.randn(B, Hkv, S, D, device="cuda").to(torch.bfloat16)
    inv_freq = reference.rope_inv_freq(D, THETA).cuda()
    rms_x = (3.0 * torch.randn(B, K, device="cuda")).to(torch.bfloat16) if with_rms else None
    bias = (0.5 * torch.randn((H + 2 * Hkv) * D, device="cuda")).to(torch.bfloat16) if with_bias else None
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return dict(qkv=qkv, q=q, k=k, v=v, kc=kc, vc=vc, inv_freq=inv_freq, rms_x=rms_x, bias=bias,
                pos=pos, lens=lens)


def _composition(t, scale):
    """rope_append then decode_attention, on copies: (k_cache, v_cache, out). (No prefetch_cache:
    rope_append, just before, may write any row.)"""
    q, k, kc, vc = t["q"].clone(), t["k"].clone(), t["kc"].clone(), t["vc"].clone()
    eps = RMS_EPS if t["rms_x"] is not None else None
    torch.ops.decodex.rope_append(q, k, t["v"], t["inv_freq"], t["pos"], kc, vc, rms_x=t["rms_x"],
                                  rms_eps=eps, bias=t["bias"])
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
                                            rms_eps=eps, bias=t["bias"])
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


# The ring path has 4 warps a block; the composition's decode_attention equals it bit for bit with as
# many warps merging in the same order, so "cluster-8w" is left out, and every test here runs the
# composition on 4 warps (the op would take 8 for a short cache at a small batch).
RING_MERGES = [m for m in MERGES if not m.endswith("-8w")]


@pytest.fixture(autouse=True)
def _four_warps(monkeypatch):
    monkeypatch.setenv("DECODEX_ATTN_WARPS", "4")


# (H, Hkv, D): Qwen2.5-1.5B, Qwen2.5-7B, a D = 64 model, a group of 16 (two head blocks), MHA.
HEADS = [(12, 2, 128), (28, 4, 128), (9, 3, 64), (32, 2, 128), (4, 4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("merge", RING_MERGES)
@pytest.mark.parametrize("H,Hkv,D", HEADS)
@pytest.mark.parametrize("B,S", [(1, 1000), (1, 5000), (5, 1100), (64, 1030)], ids=str)
@pytest.mark.parametrize("with_rms,with_bias", [(True, True), (False, False), (False, True)])
def test_equals_rope_append_then_attention(monkeypatch, merge, H, Hkv, D, B, S, with_rms, with_bias):
    set_merge(monkeypatch, merge)
    gen = torch.Generator().manual_seed(B * 7 + S + H)
    lengths, positions = _decode_rows(B, S, gen)
    lengths[0], positions[0] = S, S - 1  # the last row of the cache
    if B > 1:
        lengths[1], positions[1] = 1, 0  # the first row alone
    t = _inputs(lengths, positions, H, Hkv, D, S, with_rms, with_bias)
    _check_equal(t, D ** -0.5, prefetch=True)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", RING_MERGES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_odd_rows(monkeypatch, merge, prefetch):
    """A dead row (position -1, length 0), a position past the length (appended, not attended), a
    length-0 row with a position (appended by split 0; zeros out), a position past the capacity
    (nothing appended, q unrotated), a position inside the length (the row attended is the new one)
    and ordinary rows."""
    set_merge(monkeypatch, merge)
    S = 700
    lengths = [0, 300, 0, 50, 400, 699, 1]
    positions = [-1, 450, 20, S + 5, 100, 698, 0]
    t = _inputs(lengths, positions, 12, 2, 128, S, with_rms=True, with_bias=True)
    _check_equal(t, 0.1, prefetch)


@pytest.mark.gpu
def test_matches_reference():
    """The composition the op equals, against reference.rope_append_attention (fp32 attention)."""
    S = 300
    lengths, positions = [300, 17, 129], [299, 16, 128]
    t = _inputs(lengths, positions, 12, 2, 128, S, with_rms=True, with_bias=True)
    kc, vc, out = _fused(t, 128 ** -0.5, prefetch=False)
    kc_ref, vc_ref = t["kc"].clone(), t["vc"].clone()
    want = reference.rope_append_attention(t["q"], t["k"], t["v"], t["inv_freq"], t["pos"], kc_ref, vc_ref,
                                           t["lens"], 128 ** -0.5, t["rms_x"], RMS_EPS, t["bias"])
    torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(vc, vc_ref)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_positions_advance_on_device():
    """One captured call replayed while positions and lengths grow on the device: each replay equals
    the composition at that step (the caches carry over)."""
    S, B, H, Hkv, D = 600, 3, 12, 2, 128
    lengths = [5, 130, 511]
    t = _inputs(lengths, [n - 1 for n in lengths], H, Hkv, D, S, with_rms=True, with_bias=False)
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
          a["scale"], a["workspace"], a["out"], **{k: v for k, v in kw.items() if k in ("rms_x", "rms_eps", "bias")})

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


@pytest.mark.ext
def test_schema():
    schema = str(torch.ops.decodex.rope_append_attention.default._schema)
    assert schema == ("decodex::rope_append_attention(Tensor q, Tensor k, Tensor v, Tensor inv_freq, "
                      "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lengths, "
                      "float scale, Tensor(c!) workspace, Tensor(d!) out, bool prefetch_cache=False, "
                      "Tensor? rms_x=None, float? rms_eps=None, Tensor? bias=None) -> ()"), schema


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


def test_reference_is_the_composition():
    """reference.rope_append_attention on the CPU: rope_append (its rms_x / rms_eps / bias passed
    through in that order) then decode_attention with the rotated q; inputs kept."""
    torch.manual_seed(0)
    B, H, Hkv, D, S, K = 2, 4, 2, 16, 10, 24
    q, k, v = torch.randn(B, H, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    kc, vc = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    inv = reference.rope_inv_freq(D, THETA)
    pos, lens = torch.tensor([3, 9]), torch.tensor([4, 10])
    rms_x, bias = 3.0 * torch.randn(B, K), torch.randn((H + 2 * Hkv) * D)
    q0, kc0, vc0, kc2, vc2 = q.clone(), kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = reference.rope_append_attention(q, k, v, inv, pos, kc, vc, lens, 0.25, rms_x, RMS_EPS, bias)
    assert torch.equal(q, q0)
    q_rot, _ = reference.rope_append(q, k, v, inv, pos, kc2, vc2, rms_x=rms_x, rms_eps=RMS_EPS, bias=bias)
    assert torch.equal(out, reference.decode_attention(q_rot, kc2, vc2, lens, 0.25))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc[0, :, 3], kc0[0, :, 3]) and not torch.equal(vc[1, :, 9], vc0[1, :, 9])  # appended
