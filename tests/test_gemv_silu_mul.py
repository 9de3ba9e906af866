"""decodex::gemv_silu_mul: out[M,I] = silu(x @ gate^T) * (x @ up^T) for weight [2I, K] = [gate; up].

The fused kernel is gemv with a different row pairing plus silu_mul in the epilogue, and promises to
equal gemv followed by silu_mul bit for bit (same configuration, same fp32 sums, gate and up rounded
to bf16 before the activation). GPU tests check exactly that on fresh random inputs (every forced
kernel variant included), check odd I (which silu_mul itself does not take) against the fp32
reference, graph replay, and every argument check. CPU tests: schema, fake impl, reference.
"""
from __future__ import annotations

import os

import pytest
import torch

from decodex import reference
from helpers import capture_graph, norm_inputs, wgmma_available

QUICK = bool(os.environ.get("DECODEX_TEST_QUICK"))

MS = [1, 3, 8] if QUICK else [1, 2, 5, 8]
# (I, K): Qwen2.5-1.5B's MLP (I 8960, K 1536), small and odd sizes.
SHAPES = [(8, 8), (768, 136), (8960, 1536)] if QUICK else [(8, 8), (768, 136), (1536, 8960), (8960, 1536)]
ODD_I = [1, 7, 769]
# More than 8 rows: the wgmma kernel (an sm_90a build on a cc 9.0 device), every forced (bn, c, s)
# variant below (as tests/test_gemv.py's WIDE_CONFIGS: both ring depths, every cluster size).
WGMMA = wgmma_available()
NO_WGMMA = "more than 8 rows need the wgmma kernel: an sm_90a build and a device of compute capability 9.0"
WIDE_MS = [9, 17, 64] if QUICK else [9, 16, 17, 40, 64]
WIDE_CONFIGS = ["64,1,4", "128,1,8", "96,2,8", "144,3,4", "64,8,8", "144,16,4"]


def _inputs(M, I, K, device="cuda"):
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(2 * I, K, device=device) / K**0.5).to(torch.bfloat16)
    return x, w


def _poisoned(M, I):
    return torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)


def _fused(x, w, rms_eps=None):
    out = _poisoned(x.shape[0], w.shape[0] // 2)
    torch.ops.decodex.gemv_silu_mul(x, w, out, rms_eps=rms_eps)
    return out


def _unfused(x, w, rms_eps=None):
    gate_up = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.ops.decodex.gemv(x, w, None, gate_up, rms_eps=rms_eps)
    out = _poisoned(x.shape[0], w.shape[0] // 2)
    torch.ops.decodex.silu_mul(gate_up, out)
    return out


def _check_close(out, x, w, rms_eps=None):
    """Within bf16 rounding of the fp32 reference: gate and up each carry up to one bf16 rounding
    (2^-8 relative, the kernel and reference may round different fp32 sums), silu' <= 1.1, and the
    product one more rounding. rms_eps: the products scaled by 1/rms(x row) (fp32)."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    gu = x.float() @ w.float().t()
    if rms_eps is not None:
        gu = gu * torch.rsqrt(x.float().pow(2).mean(dim=1, keepdim=True) + rms_eps)
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    bound = 2.0**-7 * (1.1 * gate.abs() * up.abs() + ref.abs() + up.abs() * 0.01) + 1e-5
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("I,K", SHAPES)
@pytest.mark.parametrize("M", MS)
def test_gemv_silu_mul_equals_gemv_then_silu_mul(M, I, K):
    x, w = _inputs(M, I, K)
    out = _fused(x, w)
    assert torch.equal(out, _unfused(x, w))
    _check_close(out, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [8, 136, 1544])
@pytest.mark.parametrize("I", ODD_I)
@pytest.mark.parametrize("M", [1, 5, 8])
def test_gemv_silu_mul_odd_sizes(M, I, K):
    """I not a multiple of 8 (silu_mul needs one; the fused op does not)."""
    x, w = _inputs(M, I, K)
    out = _fused(x, w)
    _check_close(out, x, w)
    torch.testing.assert_close(out, reference.gemv_silu_mul(x, w), rtol=2**-6, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["1,1,1,4", "2,3,1,8", "8,1,1,4", "1,8,2,8", "2,2,4,4", "1,5,8,4"])
@pytest.mark.parametrize("M", [1, 8])
def test_gemv_silu_mul_every_variant(monkeypatch, config, M):
    if int(config.split(",")[2]) > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    x, w = _inputs(M, 776, 1544)
    assert torch.equal(_fused(x, w), _unfused(x, w))


@pytest.mark.gpu
def test_gemv_silu_mul_strided_and_graph():
    """x and out as row slices of wider buffers, captured once and replayed as x changes."""
    M, I, K = 3, 776, 1536
    x_buf = torch.randn(M, K + 16, device="cuda").to(torch.bfloat16)
    x = x_buf[:, 8:8 + K]
    w = (torch.randn(2 * I, K, device="cuda") / K**0.5).to(torch.bfloat16)
    out_buf = torch.full((M, I + 3), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :I]
    graph = capture_graph(lambda: torch.ops.decodex.gemv_silu_mul(x, w, out))
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _unfused(x.contiguous(), w))
    assert torch.isnan(out_buf[:, I:]).all(), "gemv_silu_mul wrote outside out's view"


@pytest.mark.gpu
@pytest.mark.parametrize("knob", ["DECODEX_GEMV_DEPENDENTS_EARLY", "DECODEX_GEMV_DEPENDENTS_AFTER"])
def test_gemv_silu_mul_dependents_knobs(monkeypatch, knob):
    """Where gemv_silu_mul lets the next kernel launch: launch_dependents_after, and both knobs (the
    GEMV launcher reads them for every epilogue), so this product may let the next kernel launch
    before its own wait, or only late in its main loop. In a graph of rms_norm -> gemv_silu_mul ->
    gemv (the down product, reading the SiLU output; both GEMVs with prefetch_weight) replayed with
    launch_dependents_after and under every well-formed value, the bits equal the same chain run
    eagerly without them; a bad argument or knob value is an error naming it."""
    M, I, K = 1, 776, 1544
    src = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(2 * I, K, device="cuda") / K**0.5).to(torch.bfloat16)
    w2 = (torch.randn(K, I, device="cuda") / I**0.5).to(torch.bfloat16)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    h, y = _poisoned(M, I), torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.decodex

    def chain(after=0):
        ops.rms_norm(src, norm_w, 1e-6, x)
        ops.gemv_silu_mul(x, w, h, prefetch_weight=True, launch_dependents_after=after)
        ops.gemv(h, w2, None, y, prefetch_weight=True)

    chain()
    want_h, want_y = h.clone(), y.clone()
    _check_close(want_h, x, w)
    values = ("1", f"{2 * I},{K}:1", "0") if knob.endswith("EARLY") else ("80", f"{2 * I},{K}:100", "0")
    for value, after in [(None, 80)] + [(v, 0) for v in values]:
        if value is not None:
            monkeypatch.setenv(knob, value)
        graph = capture_graph(lambda: chain(after))
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, want_h) and torch.equal(y, want_y), f"differs under {value!r}, after {after}"
    monkeypatch.delenv(knob)
    with pytest.raises(RuntimeError, match="gemv_silu_mul: launch_dependents_after must be 0 to 100"):
        ops.gemv_silu_mul(x, w, h, prefetch_weight=True, launch_dependents_after=101)
    monkeypatch.setenv(knob, "101")
    with pytest.raises(RuntimeError, match=knob):
        ops.gemv_silu_mul(x, w, h, prefetch_weight=True)


@pytest.mark.gpu
def test_gemv_silu_mul_opcheck():
    x, w = _inputs(3, 40, 136)
    torch.library.opcheck(torch.ops.decodex.gemv_silu_mul.default, (x, w, _poisoned(3, 40)))


@pytest.mark.gpu
def test_gemv_silu_mul_rejects():
    x, w = _inputs(2, 16, 64)

    def err(match, x, w, out):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.decodex.gemv_silu_mul(x, w, out)

    err(r"weight.size\(0\) must be even", x, w[:31], _poisoned(2, 15))
    err(r"out must have shape", x, w, _poisoned(2, 32))
    err(r"gemv_silu_mul needs K.*multiple of 8", x[:, :12].contiguous(), w[:, :12].contiguous(), _poisoned(2, 16))
    err(r"weight must have dtype", x, w.float(), _poisoned(2, 16))
    err(r"out must be a CUDA tensor", x, w, _poisoned(2, 16).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("M,I,K", [(1, 8960, 1536), (1, 18944, 3584), (8, 776, 3584), (3, 8, 8)])
def test_gemv_silu_mul_rms_eps(M, I, K):  # I % 8 == 0: what the unfused silu_mul kernel takes
    """rms_eps: equal bit for bit to gemv(rms_eps) then silu_mul (test_gemv.py checks gemv's rms
    scale against the reference), on rows of x with different scales."""
    x, _ = norm_inputs(M, K)
    _, w = _inputs(M, I, K)
    out = _fused(x, w, rms_eps=1e-6)
    assert torch.equal(out, _unfused(x, w, rms_eps=1e-6))
    assert not torch.equal(out, _fused(x, w)), "rms_eps changed nothing"
    with pytest.raises(RuntimeError, match="rms_eps must be finite and >= 0"):
        torch.ops.decodex.gemv_silu_mul(x, w, out, rms_eps=-1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("config", WIDE_CONFIGS)
@pytest.mark.parametrize("I,K", [(7, 8), (769, 1544), (40, 8960), (1024, 136)])
@pytest.mark.parametrize("M", WIDE_MS)
@pytest.mark.parametrize("rms", [False, True])
def test_gemv_silu_mul_wide(monkeypatch, config, M, I, K, rms):
    """9..64 rows (the wgmma kernel), every forced variant, odd I, with and without rms_eps: close
    to the fp32 reference; without rms_eps and above 16 rows (where gemv also runs the wgmma kernel,
    same configuration for the same [2I, K] weight), equal to gemv then silu_mul bit for bit."""
    if not WGMMA:
        pytest.skip(NO_WGMMA)
    monkeypatch.setenv("DECODEX_GEMV_WIDE_CONFIG", config)
    x, _ = norm_inputs(M, K)
    _, w = _inputs(M, I, K)
    eps = 1e-6 if rms else None
    out = _fused(x, w, rms_eps=eps)
    _check_close(out, x, w, rms_eps=eps)
    if not rms and M > 16 and I % 8 == 0:
        assert torch.equal(out, _unfused(x, w))


@pytest.mark.gpu
def test_gemv_silu_mul_wide_rows_independent_and_graph():
    """With the wgmma kernel a row's result does not depend on the other rows (64 rows at once equal
    two calls of 32 and the first 9 one call of 9, rms_eps included); x and out as row slices of
    wider buffers, captured once and replayed as x changes, nothing written outside out's view."""
    if not WGMMA:
        pytest.skip(NO_WGMMA)
    M, I, K = 64, 8960, 1536
    x_buf = torch.randn(M, K + 16, device="cuda").to(torch.bfloat16)
    x = x_buf[:, 8:8 + K]
    _, w = _inputs(M, I, K)
    out_buf = torch.full((M + 3, I + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = out_buf[:M, :I]
    graph = capture_graph(lambda: torch.ops.decodex.gemv_silu_mul(x, w, out, rms_eps=1e-6))
    for _ in range(2):
        x.copy_(norm_inputs(M, K)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _fused(x.contiguous(), w, rms_eps=1e-6)
        assert torch.equal(out, want)
        _check_close(out, x, w, rms_eps=1e-6)
        for r in range(0, M, 32):
            assert torch.equal(want[r: r + 32], _fused(x[r: r + 32].contiguous(), w, rms_eps=1e-6))
        assert torch.equal(want[:9], _fused(x[:9].contiguous(), w, rms_eps=1e-6))
    assert torch.isnan(out_buf[M:]).all() and torch.isnan(out_buf[:, I:]).all(), "wrote outside out"


@pytest.mark.gpu
def test_gemv_silu_mul_max_rows():
    """The op takes exactly the rows gemv_silu_mul_max_rows reports: that many work (close to the
    reference), one more is refused naming the limit. 64 only on a device of compute capability 9.0
    (with an sm_90a build), else 8."""
    rows = torch.ops.decodex.gemv_silu_mul_max_rows(torch.cuda.current_device())
    assert rows in (8, 64)
    if torch.cuda.get_device_capability() != (9, 0):
        assert rows == 8
    x, w = _inputs(rows + 1, 16, 64)
    _check_close(_fused(x[:rows], w), x[:rows], w)
    match = r"gemv_silu_mul handles M = 1\.\.64" if rows == 64 else r"more than 8 rows of x need the wgmma kernel"
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.gemv_silu_mul(x, w, _poisoned(rows + 1, 16))


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_gemv_silu_mul_schema_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows_schema = str(torch.ops.decodex.gemv_silu_mul_max_rows.default._schema)
    assert rows_schema == "decodex::gemv_silu_mul_max_rows(int device) -> int", rows_schema
    with pytest.raises(RuntimeError, match="must be a CUDA device index"):
        torch.ops.decodex.gemv_silu_mul_max_rows(-1)
    # A device that is not there (was: the answer 8, and a CUDA error left for the next launch).
    missing = torch.cuda.device_count() + 3
    with pytest.raises(RuntimeError, match=rf"must be a CUDA device index \(0 to {missing - 4} here\), got {missing}"):
        torch.ops.decodex.gemv_silu_mul_max_rows(missing)
    schema = str(torch.ops.decodex.gemv_silu_mul.default._schema)
    assert schema == ("decodex::gemv_silu_mul(Tensor x, Tensor weight, Tensor(a!) out, "
                      "bool prefetch_weight=False, float? rms_eps=None, int[]? config=None, "
                      "int launch_dependents_after=0) -> ()"), schema
    with FakeTensorMode():
        x = torch.empty(3, 136, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(80, 136, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(3, 40, device="cuda", dtype=torch.bfloat16)
        assert torch.ops.decodex.gemv_silu_mul(x, w, out) is None
        assert torch.ops.decodex.gemv_silu_mul(x, w, out, rms_eps=1e-6) is None
        assert torch.ops.decodex.gemv_silu_mul(x, w, out, config=[4, 1, 2, 4]) is None
    meta = dict(device="meta", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.decodex.gemv_silu_mul.default,
                          (torch.empty(3, 136, **meta), torch.empty(80, 136, **meta), torch.empty(3, 40, **meta)),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_reference_gemv_silu_mul_cpu():
    """Equal to silu_mul(gemv(.)) by definition; checked against a hand composition in fp32."""
    x, w = _inputs(3, 7, 136, device="cpu")
    got = reference.gemv_silu_mul(x.float(), w.float())
    gu = x.float() @ w.float().t()
    torch.testing.assert_close(got, torch.nn.functional.silu(gu[:, :7]) * gu[:, 7:])
    assert reference.gemv_silu_mul(x, w).dtype == torch.bfloat16
