"""decodex::gemv_rope_append: the merged q|k|v GEMV with rope_append in its epilogue.

It promises to equal gemv followed by rope_append on the q|k|v rows of the result bit for bit: the
same kernel configuration and fp32 sums, the product rounded to bf16 (after the bias) before the
rotation, the same cos/sin and rounding steps as rope_append. GPU tests check exactly that (out and
both caches, every row of them) on fresh random inputs over the real head layouts, batch rows that
are skipped (negative position) or past the capacity, several forced kernel variants, graph replay
with positions advanced on the device (prefetch_weight too, behind kernels that write x or the
positions), opcheck and the argument checks; and once against the fp32
reference. CPU tests: schema, fake impl, the reference composition.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph, check_config_is_launched, norm_inputs, order_sensitive_inputs

THETA = 1_000_000.0
# (H, Hkv, D, K): Qwen2.5-1.5B, Qwen2.5-7B, a head dim 64 model, a small odd one.
LAYOUTS = [(12, 2, 128, 1536), (28, 4, 128, 3584), (9, 3, 64, 576), (3, 1, 16, 40)]


def _case(M, H, Hkv, D, K, S=64, bias=True, device="cuda"):
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    N = (H + 2 * Hkv) * D
    w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
    b = (0.5 * torch.randn(N, device=device)).to(torch.bfloat16) if bias else None
    kc = torch.randn(M, Hkv, S, D, device=device).to(torch.bfloat16)
    vc = torch.randn(M, Hkv, S, D, device=device).to(torch.bfloat16)
    inv_freq = reference.rope_inv_freq(D, THETA, None).to(device)
    return x, w, b, kc, vc, inv_freq


def _fused(x, w, b, inv_freq, positions, kc, vc, rms_eps=None, config=None):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=x.device, dtype=torch.bfloat16)
    torch.ops.decodex.gemv_rope_append(x, w, b, inv_freq, positions, out, kc, vc, rms_eps=rms_eps,
                                       config=config)
    return out


def _unfused(x, w, b, inv_freq, positions, kc, vc, rms_eps=None, config=None):
    """gemv (a plain call, with `config` if given), then rope_append on the q|k|v rows of its output
    (Hkv and D from the cache)."""
    M, Hkv, D = x.shape[0], kc.shape[1], kc.shape[3]
    out = torch.full((M, w.shape[0]), float("nan"), device=x.device, dtype=torch.bfloat16)
    torch.ops.decodex.gemv(x, w, b, out, rms_eps=rms_eps, config=config)
    q, k, v = out.view(M, -1, D).split([w.shape[0] // D - 2 * Hkv, Hkv, Hkv], dim=1)
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc)
    return out


def _compare(M, H, Hkv, D, K, positions, bias=True):
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K, bias=bias)
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    got = _fused(x, w, b, inv_freq, pos, kc, vc)
    want = _unfused(x, w, b, inv_freq, pos, kc2, vc2)
    assert torch.equal(got, want), "out differs from gemv + rope_append"
    assert torch.equal(kc, kc2), "k_cache differs from gemv + rope_append"
    assert torch.equal(vc, vc2), "v_cache differs from gemv + rope_append"
    return x, w, b, inv_freq, pos, got, kc


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D,K", LAYOUTS)
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_rope_append_equals_gemv_then_rope_append(M, H, Hkv, D, K):
    positions = [(7 * m + 5) % 64 for m in range(M)]
    _compare(M, H, Hkv, D, K, positions)


@pytest.mark.gpu
def test_gemv_rope_append_skipped_rows_and_no_bias():
    """Negative positions and positions >= S: no rotation, nothing appended, as rope_append."""
    _compare(5, 12, 2, 128, 1536, [3, -1, 63, 64, 1000], bias=False)


@pytest.mark.gpu
def test_gemv_rope_append_against_reference():
    M, H, Hkv, D, K = 3, 12, 2, 128, 1536
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K)
    pos = torch.tensor([0, 17, 63], dtype=torch.int32, device="cuda")
    kc_ref, vc_ref = kc.float().cpu(), vc.float().cpu()
    got = _fused(x, w, b, inv_freq, pos, kc, vc)
    want = reference.gemv_rope_append(x.float().cpu(), w.float().cpu(), b.float().cpu(), inv_freq.cpu(),
                                      pos.cpu(), kc_ref, vc_ref)
    # One bf16 rounding of the product plus one of the rotation: 2^-7 relative, plus fp32 sums.
    torch.testing.assert_close(got.float().cpu(), want, rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(kc.float().cpu(), kc_ref, rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(vc.float().cpu(), vc_ref, rtol=2**-7, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["1,1,1,4", "2,3,1,8", "8,1,1,4", "1,8,2,8", "1,5,8,4"])
def test_gemv_rope_append_every_variant(monkeypatch, config):
    if int(config.split(",")[2]) > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    _compare(4, 9, 3, 64, 576, [1, 9, -1, 40])


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["1,6,1,4", "2,2,4,8"])
def test_gemv_rope_append_config_argument(monkeypatch, config):
    """config is checked (a bad one raises) and gives out and caches equal to that configuration
    forced through DECODEX_GEMV_CONFIG. (On these random inputs k-splits nearly always round alike;
    test_gemv_rope_append_config_is_launched shows config is launched.)"""
    cfg = [int(v) for v in config.split(",")]
    if cfg[2] > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    x, w, b, kc, vc, inv_freq = _case(3, 12, 2, 128, 1536)
    pos = torch.tensor([5, 17, 63], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    got = _fused(x, w, b, inv_freq, pos, kc, vc, config=cfg)
    with pytest.raises(RuntimeError, match=r"decodex::gemv_rope_append: config"):
        _fused(x, w, b, inv_freq, pos, kc.clone(), vc.clone(), config=[1, 1, 1, 3])
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    want = _fused(x, w, b, inv_freq, pos, kc2, vc2)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
def test_gemv_rope_append_config_is_launched(monkeypatch):
    """helpers.check_config_is_launched on the 1.5B layout (no bias): config is launched here too,
    not only checked (test_gemv_rope_append_config_argument compares with the knob on random
    inputs, where k-splits nearly always round alike), and the knob wins over it."""
    H, Hkv, D, K = 12, 2, 128, 1544
    x, w = order_sensitive_inputs((H + 2 * Hkv) * D, K)
    inv_freq = reference.rope_inv_freq(D, THETA, None).cuda()
    pos = torch.tensor([5], dtype=torch.int32, device="cuda")

    def run(cfg):
        kc = torch.zeros(1, Hkv, 8, D, device="cuda", dtype=torch.bfloat16)
        out = _fused(x, w, None, inv_freq, pos, kc, torch.zeros_like(kc), config=cfg)
        torch.cuda.synchronize()
        return out

    check_config_is_launched(run, monkeypatch)


@pytest.mark.gpu
def test_gemv_rope_append_cuda_graph():
    """Captured once; positions advanced on the device between replays: each replay rotates at the
    new position and appends to the next cache row."""
    M, H, Hkv, D, K = 2, 12, 2, 128, 1536
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K)
    pos = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    out = torch.empty(M, w.shape[0], device="cuda", dtype=torch.bfloat16)
    graph = capture_graph(lambda: torch.ops.decodex.gemv_rope_append(x, w, b, inv_freq, pos, out, kc, vc))
    kc2, vc2 = kc.clone(), vc.clone()
    for step in range(3):
        pos += 1
        graph.replay()
        want = _unfused(x, w, b, inv_freq, pos, kc2, vc2)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {step}: out differs"
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), f"replay {step}: caches differ"


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", ["positions", "x"])
def test_gemv_rope_append_prefetch_weight_after_writers(ahead):
    """prefetch_weight lets the kernel load its weight, bias and inv_freq before the kernel just
    before it has finished, but never x or the positions. In a graph where that kernel writes the
    positions (advance_positions) or x (rms_norm), every replay equals gemv + rope_append at the new
    values bit for bit."""
    M, H, Hkv, D, K = 2, 12, 2, 128, 1536
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K)
    pos = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    lengths = pos + 1
    src = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    out = torch.empty(M, w.shape[0], device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.decodex
    prefetch_config = ops.gemv_config(w.shape[0], K, M, prefetch_weight=True)  # plain calls have their own

    def writers():
        if ahead == "positions":
            ops.rms_norm(src, norm_w, 1e-6, x)
            ops.advance_positions(pos, lengths)
        else:
            ops.advance_positions(pos, lengths)
            ops.rms_norm(src, norm_w, 1e-6, x)
        ops.gemv_rope_append(x, w, b, inv_freq, pos, out, kc, vc, prefetch_weight=True)

    graph = capture_graph(writers)
    for step in range(4):
        src.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        kc2, vc2 = kc.clone(), vc.clone()
        graph.replay()
        want = _unfused(x, w, b, inv_freq, pos, kc2, vc2, config=prefetch_config)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {step}: out differs"
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), f"replay {step}: caches differ"


@pytest.mark.gpu
@pytest.mark.parametrize("knob", ["DECODEX_GEMV_DEPENDENTS_EARLY", "DECODEX_GEMV_DEPENDENTS_AFTER"])
def test_gemv_rope_append_dependents_knobs(monkeypatch, knob):
    """DECODEX_GEMV_DEPENDENTS_EARLY and _AFTER reach gemv_rope_append's launch too (the GEMV
    launcher reads them for every epilogue), so the kernel after it may launch before its wait, or
    only late in its main loop. In a graph of
    advance_positions -> gemv_rope_append (prefetch_weight) -> gemv reading its q|k|v output,
    replayed under every well-formed value, out, the caches and the next product equal gemv +
    rope_append at the advanced positions bit for bit; a malformed value is an error naming the
    knob. One row of x: launch_dependents_after is taken at one row only."""
    M, H, Hkv, D, K = 1, 12, 2, 128, 1536
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K)
    N = w.shape[0]
    w2 = (torch.randn(K, N, device="cuda") / N**0.5).to(torch.bfloat16)
    pos = torch.tensor([10], dtype=torch.int32, device="cuda")
    lengths = pos + 1
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.decodex
    prefetch_config = ops.gemv_config(N, K, M, prefetch_weight=True)  # plain calls have their own
    y_config = ops.gemv_config(K, N, M, prefetch_weight=True)

    def chain():
        ops.advance_positions(pos, lengths)
        ops.gemv_rope_append(x, w, b, inv_freq, pos, out, kc, vc, prefetch_weight=True)
        ops.gemv(out, w2, None, y, prefetch_weight=True)

    values = ("1", f"{N},{K}:1", "0") if knob.endswith("EARLY") else ("60", f"{N},{K}:100", "0")
    for value in values:
        monkeypatch.setenv(knob, value)
        graph = capture_graph(chain)  # capture_graph runs the chain once first: positions advance
        for step in range(2):
            kc2, vc2 = kc.clone(), vc.clone()
            out.fill_(float("nan"))
            y.fill_(float("nan"))
            graph.replay()
            monkeypatch.delenv(knob)
            want = _unfused(x, w, b, inv_freq, pos, kc2, vc2, config=prefetch_config)
            want_y = torch.empty_like(y)
            ops.gemv(want, w2, None, want_y, config=y_config)
            monkeypatch.setenv(knob, value)
            torch.cuda.synchronize()
            where = f"under {value!r}, replay {step}"
            assert torch.equal(out, want), f"{where}: out differs"
            assert torch.equal(kc, kc2) and torch.equal(vc, vc2), f"{where}: caches differ"
            assert torch.equal(y, want_y), f"{where}: the next product differs"
    monkeypatch.setenv(knob, "101")
    with pytest.raises(RuntimeError, match=knob):
        ops.gemv_rope_append(x, w, b, inv_freq, pos, out, kc, vc, prefetch_weight=True)


@pytest.mark.gpu
def test_gemv_rope_append_opcheck():
    x, w, b, kc, vc, inv_freq = _case(2, 3, 1, 16, 40)
    pos = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    out = torch.empty(2, w.shape[0], device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.decodex.gemv_rope_append.default, (x, w, b, inv_freq, pos, out, kc, vc))


@pytest.mark.gpu
def test_gemv_rope_append_rejects():
    x, w, b, kc, vc, inv_freq = _case(2, 3, 1, 16, 40)
    pos = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    out = torch.empty(2, w.shape[0], device="cuda", dtype=torch.bfloat16)

    def err(match, **kw):
        a = dict(x=x, weight=w, bias=b, inv_freq=inv_freq, positions=pos, out=out, k_cache=kc, v_cache=vc)
        a.update(kw)
        with pytest.raises(RuntimeError, match=match):
            torch.ops.decodex.gemv_rope_append(a["x"], a["weight"], a["bias"], a["inv_freq"], a["positions"],
                                               a["out"], a["k_cache"], a["v_cache"])

    err(r"\(H \+ 2 Hkv\) \* D rows", weight=w[:32], bias=b[:32], out=out[:, :32])
    err(r"\(H \+ 2 Hkv\) \* D rows", weight=w[:72], bias=b[:72], out=out[:, :72])
    err(r"out must have shape", out=out[:, :-16])
    err(r"positions must have dtype", positions=pos.long())
    err(r"positions must have shape", positions=pos[:1])
    err(r"inv_freq must have shape", inv_freq=inv_freq[:4])
    err(r"v_cache must have shape", v_cache=vc[:, :, :32])
    err(r"k_cache must be 4-D", k_cache=kc[0])
    err(r"bias must have shape", bias=b[:-1])
    err(r"gemv_rope_append handles M = 1\.\.8", x=torch.randn(9, 40, device="cuda").to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D,K", LAYOUTS)
@pytest.mark.parametrize("M", [1, 8])
def test_gemv_rope_append_rms_eps(M, H, Hkv, D, K):
    """rms_eps: out and both caches equal bit for bit to gemv(rms_eps) then rope_append, on rows of
    x with different scales."""
    _, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K)
    x, _ = norm_inputs(M, K)
    pos = torch.tensor([3 + 5 * m for m in range(M)], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    got = _fused(x, w, b, inv_freq, pos, kc, vc, rms_eps=1e-6)
    want = _unfused(x, w, b, inv_freq, pos, kc2, vc2, rms_eps=1e-6)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_gemv_rope_append_schema_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = str(torch.ops.decodex.gemv_rope_append.default._schema)
    assert schema == ("decodex::gemv_rope_append(Tensor x, Tensor weight, Tensor? bias, Tensor inv_freq, "
                      "Tensor positions, Tensor(a!) out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
                      "bool prefetch_weight=False, float? rms_eps=None, int[]? config=None) -> ()"), schema
    with FakeTensorMode():
        bf = dict(device="cuda", dtype=torch.bfloat16)
        args = (torch.empty(2, 40, **bf), torch.empty(80, 40, **bf), None,
                torch.empty(8, device="cuda"), torch.empty(2, device="cuda", dtype=torch.int32),
                torch.empty(2, 80, **bf), torch.empty(2, 1, 16, 16, **bf), torch.empty(2, 1, 16, 16, **bf))
        assert torch.ops.decodex.gemv_rope_append(*args) is None
        assert torch.ops.decodex.gemv_rope_append(*args, config=[1, 6, 1, 4]) is None


def test_reference_gemv_rope_append_cpu():
    """The composition: rotated q|k, plain v, caches written at the position, skipped row untouched."""
    M, H, Hkv, D, K = 2, 3, 1, 16, 40
    x, w, b, kc, vc, inv_freq = _case(M, H, Hkv, D, K, device="cpu")
    x, w, b, kc, vc = x.float(), w.float(), b.float(), kc.float(), vc.float()
    kc0, vc0 = kc.clone(), vc.clone()
    pos = torch.tensor([5, -1])
    out = reference.gemv_rope_append(x, w, b, inv_freq, pos, kc, vc)
    qkv = x @ w.t() + b
    q = qkv[0, : H * D].view(H, D)
    torch.testing.assert_close(out[0, : H * D].view(H, D), reference.rope(q, torch.tensor(5), inv_freq))
    torch.testing.assert_close(out[0, (H + Hkv) * D:], qkv[0, (H + Hkv) * D:])
    torch.testing.assert_close(kc[0, :, 5], out[0, H * D: (H + Hkv) * D].view(Hkv, D))
    torch.testing.assert_close(vc[0, :, 5], qkv[0, (H + Hkv) * D:].view(Hkv, D))
    torch.testing.assert_close(out[1], qkv[1])
    assert torch.equal(kc[1], kc0[1]) and torch.equal(vc[1], vc0[1])
