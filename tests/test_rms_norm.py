"""decodex::rms_norm and decodex::fused_add_rms_norm over rows of x [M, K], bf16 in/out, fp32 math.

GPU tests compare every element to decodex.reference (fp32) over odd sizes (every kernel variant:
1, 2, 4 and 8 vectors per thread), strided rows, the stored residual bit for bit, opcheck, CUDA-graph
replay with new inputs, and every argument check. CPU tests check the schemas, the fake impls and
that CPU tensors are refused by the dispatcher.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph

MS = [1, 3, 64, 3000]
KS = [8, 896, 1536, 3584, 8192]
EXTRA_KS = [24, 2056, 4104, 16384]  # variant edges: 3 vectors, NV=2/4/8 with ragged last warps, max K
EPS = 1e-6

# Tolerance, bf16 output vs the fp32 reference:
#  * RTOL = 2^-8: rounding an fp32 value to bf16 moves it by at most half an ulp = 2^-8 of its size;
#  * + 1e-5 relative: the sum of squares is accumulated in another order than the reference's
#    (fp32, K <= 16384 terms, all positive: relative error < K * 2^-24 < 1e-3 worst case, ~1e-6 in
#    practice; rsqrtf adds 2 ulp). 1e-5 relative on inv_rms is 100x the typical value;
#  * ATOL = 1e-6 for outputs that round to tiny values.
# On top, the 2x criterion: the worst error is at most twice PyTorch's own bf16 result's error.
RTOL = 2.0**-8 + 1e-5
ATOL = 1e-6


def _x(M, K, device="cuda"):
    return torch.randn(M, K, device=device).to(torch.bfloat16)


def _w(K, device="cuda"):
    return (1.0 + 0.3 * torch.randn(K, device=device)).to(torch.bfloat16)


def _poisoned(M, K):
    return torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)


def _check_norm(out, xin, w):
    """out (bf16) vs reference.rms_norm in fp32 of xin; every element written and within tolerance."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    ref = reference.rms_norm(xin.float(), w.float(), EPS)  # fp32
    err = (out.float() - ref).abs()
    bound = RTOL * ref.abs() + ATOL
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        m, k = divmod(i, err.shape[1])
        raise AssertionError(f"{int(bad.sum())}/{bad.numel()} out of tolerance; worst [{m}, {k}]: got "
                             f"{float(out[m, k]):.6g}, reference {float(ref[m, k]):.6g}")
    torch_err = (reference.rms_norm(xin, w, EPS).float() - ref).abs().max()  # PyTorch, rounded to bf16
    assert err.max() <= 2 * torch_err + 1e-6, f"max error {float(err.max()):.3g} > 2x torch's {float(torch_err):.3g}"


# ---------------------------------------------------------------- GPU: values


@pytest.mark.gpu
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("K", KS + EXTRA_KS)
def test_rms_norm_values(M, K):
    x, w = _x(M, K), _w(K)
    out = _poisoned(M, K)
    x_before = x.clone()
    torch.ops.decodex.rms_norm(x, w, EPS, out)
    assert torch.equal(x, x_before), "x was modified"
    _check_norm(out, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("K", KS + EXTRA_KS)
def test_fused_add_rms_norm_values(M, K):
    x, w = _x(M, K), _w(K)
    residual = _x(M, K)
    want_out, want_res = reference.fused_add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), EPS)
    out = _poisoned(M, K)
    x_before = x.clone()
    torch.ops.decodex.fused_add_rms_norm(x, residual, w, EPS, out)
    assert torch.equal(x, x_before), "x was modified"
    # residual + x rounded to bf16: one correctly rounded fp32 add, so bit-exact with the reference.
    assert torch.equal(residual.cpu(), want_res), "the stored residual differs from bf16(residual + x)"
    _check_norm(out, residual, w)  # the norm of the STORED residual


@pytest.mark.gpu
def test_rms_norm_large_and_small_scales():
    """Rows of very different magnitudes in one call (each row has its own rms), eps matters for
    the tiny row."""
    K = 1536
    x = torch.randn(4, K, device="cuda")
    x[0] *= 1e-3
    x[1] *= 300.0
    x[2] *= 1e-20  # rms far below sqrt(eps): out ~ x / sqrt(eps)
    x = x.to(torch.bfloat16)
    w = _w(K)
    out = _poisoned(4, K)
    torch.ops.decodex.rms_norm(x, w, EPS, out)
    _check_norm(out, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5])
def test_norms_strided_rows(M):
    """x, residual and out as row views of wider buffers (row stride > K)."""
    K = 896
    xb, rb, ob = _x(M, K + 24), _x(M, K + 8), torch.full((M, K + 40), float("nan"), device="cuda",
                                                         dtype=torch.bfloat16)
    x, res, out = xb[:, :K], rb[:, 8:8 + K], ob[:, 16:16 + K]
    w = _w(K)
    torch.ops.decodex.rms_norm(x, w, EPS, out)
    _check_norm(out, x, w)
    assert torch.isnan(ob[:, :16]).all() and torch.isnan(ob[:, 16 + K:]).all(), "wrote outside out"

    ob.fill_(float("nan"))
    _, want_res = reference.fused_add_rms_norm(x.cpu(), res.cpu(), w.cpu(), EPS)
    rb_before = rb.clone()
    torch.ops.decodex.fused_add_rms_norm(x, res, w, EPS, out)
    assert torch.equal(res.cpu(), want_res)
    assert torch.equal(rb[:, :8], rb_before[:, :8]), "wrote outside residual"
    _check_norm(out, res, w)
    assert torch.isnan(ob[:, :16]).all() and torch.isnan(ob[:, 16 + K:]).all(), "wrote outside out"


@pytest.mark.gpu
def test_rms_norm_deterministic_and_row_independent():
    """A row's output does not depend on M or on the other rows."""
    K = 3584
    x, w = _x(7, K), _w(K)
    a, b = _poisoned(7, K), _poisoned(1, K)
    torch.ops.decodex.rms_norm(x, w, EPS, a)
    torch.ops.decodex.rms_norm(x[3:4].clone(), w, EPS, b)
    assert torch.equal(a[3:4], b)


@pytest.mark.gpu
def test_norms_opcheck():
    K = 1536
    x, w, res = _x(3, K), _w(K), _x(3, K)
    torch.library.opcheck(torch.ops.decodex.rms_norm.default, (x, w, EPS, _poisoned(3, K)))
    torch.library.opcheck(torch.ops.decodex.fused_add_rms_norm.default, (x, res, w, EPS, _poisoned(3, K)))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 1536), (4, 3584)])
def test_norms_cuda_graph(M, K):
    """Captured once, replayed with new x / residual written on the device."""
    x, w, res, out, out2 = _x(M, K), _w(K), _x(M, K), _poisoned(M, K), _poisoned(M, K)

    def norms():
        torch.ops.decodex.rms_norm(x, w, EPS, out)
        torch.ops.decodex.fused_add_rms_norm(x, res, w, EPS, out2)

    graph = capture_graph(norms)
    for _ in range(3):
        x.copy_(_x(M, K))
        res.copy_(_x(M, K))
        res_before = res.clone()
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_norm(out, x, w)
        _, want_res = reference.fused_add_rms_norm(x.cpu(), res_before.cpu(), w.cpu(), EPS)
        assert torch.equal(res.cpu(), want_res)
        _check_norm(out2, res, w)


# ---------------------------------------------------------------- GPU: argument checks


def _raises(match, fn, *args):
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


@pytest.mark.gpu
def test_norms_reject_bad_k():
    rms, fused = torch.ops.decodex.rms_norm, torch.ops.decodex.fused_add_rms_norm
    for K in (12, 4):
        x, w = _x(2, K), _w(K)
        _raises("multiple of 8", rms, x, w, EPS, _poisoned(2, K))
        _raises("multiple of 8", fused, x, _x(2, K), w, EPS, _poisoned(2, K))
    K = 16392
    _raises("larger than", rms, _x(1, K), _w(K), EPS, _poisoned(1, K))


@pytest.mark.gpu
def test_norms_reject_dtypes_and_shapes():
    rms, fused = torch.ops.decodex.rms_norm, torch.ops.decodex.fused_add_rms_norm
    K = 64
    x, w, out = _x(2, K), _w(K), _poisoned(2, K)
    _raises("x must have dtype", rms, x.float(), w, EPS, out)
    _raises("weight must have dtype", rms, x, w.float(), EPS, out)
    _raises("out must have dtype", rms, x, w, EPS, out.half())
    _raises("residual must have dtype", fused, x, _x(2, K).float(), w, EPS, out)
    _raises("weight must have shape", rms, x, _w(K + 8), EPS, out)
    _raises("out must have shape", rms, x, w, EPS, _poisoned(3, K))
    _raises("residual must have shape", fused, x, _x(2, K + 8), w, EPS, out)
    _raises("2-D", rms, x[None], w, EPS, out)


@pytest.mark.gpu
def test_norms_reject_layouts():
    rms, fused = torch.ops.decodex.rms_norm, torch.ops.decodex.fused_add_rms_norm
    K = 64
    w, out = _w(K), _poisoned(2, K)
    _raises("x must be contiguous along K", rms, _x(K, 2).t(), w, EPS, out)
    buf = _x(1, 2 * K + 8)
    _raises("x must be 16-byte aligned", rms, buf[0, 1:1 + 2 * K].view(2, K), w, EPS, out)
    _raises("x row stride must be a multiple of 8", rms, _x(2, K + 4)[:, :K], w, EPS, out)
    _raises("weight must be contiguous", rms, _x(2, K), _w(2 * K)[::2], EPS, out)
    _raises("residual must be contiguous along K", fused, _x(2, K), _x(K, 2).t(), w, EPS, out)
    _raises("out must be contiguous along K", rms, _x(2, K), w, EPS, _poisoned(K, 2).t())


@pytest.mark.gpu
def test_norms_reject_bad_eps_and_shared_outputs():
    """eps as gemv's rms_eps is checked; written rows that share memory (a row stride under K, out
    on top of residual) would race or lose the residual sum."""
    rms, fused = torch.ops.decodex.rms_norm, torch.ops.decodex.fused_add_rms_norm
    K = 64
    x, w = _x(2, K), _w(K)
    for eps in (float("nan"), float("inf"), -1e-6):
        _raises(r"decodex::rms_norm: eps must be finite and >= 0", rms, x, w, eps, _poisoned(2, K))
        _raises(r"decodex::fused_add_rms_norm: eps must be finite and >= 0", fused, x, _x(2, K), w, eps,
                _poisoned(2, K))
    _raises("out is written, so its rows must not overlap", rms, x, w, EPS, _poisoned(1, K).expand(2, K))
    _raises("residual is written, so its rows must not overlap", fused, x, _x(1, K).expand(2, K), w, EPS,
            _poisoned(2, K))
    res = _x(2, K)
    _raises("residual and out must not overlap", fused, x, res, w, EPS, res)


@pytest.mark.gpu
def test_norms_reject_devices():
    rms = torch.ops.decodex.rms_norm
    K = 64
    _raises("weight must be on", rms, _x(2, K), _w(K, device="cpu"), EPS, _poisoned(2, K))
    _raises("out must be a CUDA tensor", rms, _x(2, K), _w(K), EPS, torch.empty(2, K, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_norms_empty_batch():
    K = 64
    out = _poisoned(0, K)
    torch.ops.decodex.rms_norm(_x(0, K), _w(K), EPS, out)
    torch.ops.decodex.fused_add_rms_norm(_x(0, K), _x(0, K), _w(K), EPS, out)
    torch.cuda.synchronize()  # M = 0 launches nothing: no launch error may surface here either
    assert out.shape == (0, K)


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_norms_schema():
    s = str(torch.ops.decodex.rms_norm.default._schema)
    assert s == "decodex::rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", s
    s = str(torch.ops.decodex.fused_add_rms_norm.default._schema)
    assert s == ("decodex::fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
                 "Tensor(b!) out) -> ()"), s


@pytest.mark.ext
def test_norms_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 896, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(896, device="cuda", dtype=torch.bfloat16)
        assert torch.ops.decodex.rms_norm(x, w, EPS, torch.empty_like(x)) is None
        assert torch.ops.decodex.fused_add_rms_norm(x, torch.empty_like(x), w, EPS, torch.empty_like(x)) is None


@pytest.mark.ext
def test_norms_meta_opcheck():
    x = torch.empty(3, 896, device="meta", dtype=torch.bfloat16)
    w = torch.empty(896, device="meta", dtype=torch.bfloat16)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.decodex.rms_norm.default, (x, w, EPS, torch.empty_like(x)), test_utils=utils)
    torch.library.opcheck(torch.ops.decodex.fused_add_rms_norm.default,
                          (x, torch.empty_like(x), w, EPS, torch.empty_like(x)), test_utils=utils)


@pytest.mark.ext
def test_norms_cpu_tensors_refused():
    x, w = _x(2, 64, device="cpu"), _w(64, device="cpu")
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.rms_norm(x, w, EPS, torch.empty_like(x))
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.fused_add_rms_norm(x, x.clone(), w, EPS, torch.empty_like(x))


def test_reference_norms_cpu():
    x, w, res = _x(3, 64, device="cpu"), _w(64, device="cpu"), _x(3, 64, device="cpu")
    xf = x.float()
    want = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + EPS) * w.float()
    torch.testing.assert_close(reference.rms_norm(xf, w.float(), EPS), want)
    out, new_res = reference.fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, (res.float() + x.float()).to(torch.bfloat16))
    assert torch.equal(out, reference.rms_norm(new_res, w, EPS))
