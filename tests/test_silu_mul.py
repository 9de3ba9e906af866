"""decodex::silu_mul: out[M, I] = silu(gate_up[M, :I]) * gate_up[M, I:], bf16 in/out, fp32 math.

GPU tests compare every element to decodex.reference (fp32) over odd sizes, strided gate_up and out
rows, extreme inputs, opcheck, CUDA-graph replay and every argument check. CPU tests: schema, fake
impl, dispatcher refusal.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodex import reference
from helpers import capture_graph

MS = [1, 3, 64, 3000]
IS = [8, 136, 1000, 8960, 18944]

# Tolerance, bf16 output vs the fp32 reference: RTOL = 2^-8 (one rounding to bf16) + 1e-5 relative
# (expf within 2 ulp of torch's exp, a division and a product: a few fp32 ulps, 100x margin) and
# ATOL 1e-6 for values that round to ~0. On top, at most 2x PyTorch's own bf16 error.
RTOL = 2.0**-8 + 1e-5
ATOL = 1e-6


def _gu(M, I, scale=2.0, device="cuda"):
    return (scale * torch.randn(M, 2 * I, device=device)).to(torch.bfloat16)


def _poisoned(M, I):
    return torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)


def _check(out, gate_up):
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    ref = reference.silu_mul(gate_up.float())  # fp32, on the GPU
    err = (out.float() - ref).abs()
    bound = RTOL * ref.abs() + ATOL
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        m, n = divmod(i, err.shape[1])
        raise AssertionError(f"{int(bad.sum())}/{bad.numel()} out of tolerance; worst [{m}, {n}]: "
                             f"got {float(out[m, n]):.6g}, reference {float(ref[m, n]):.6g}")
    I = out.shape[1]
    torch_out = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # PyTorch's own bf16 composition
    torch_err = (torch_out.float() - ref).abs().max()
    assert err.max() <= 2 * torch_err + 1e-6, f"max error {float(err.max()):.3g} > 2x torch's {float(torch_err):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("I", IS)
def test_silu_mul_values(M, I):
    gu = _gu(M, I)
    gu0 = gu.clone()
    out = _poisoned(M, I)
    torch.ops.decodex.silu_mul(gu, out)
    assert torch.equal(gu, gu0), "gate_up was modified"
    _check(out, gu)


@pytest.mark.gpu
def test_silu_mul_extremes():
    """Large |gate| (expf overflow to inf for gate << 0 gives silu -> -0), zeros, infinities."""
    I = 64
    gu = _gu(2, I, scale=30.0)
    gu[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 88.0, -88.0, -90.0, 1e-30])
    out = _poisoned(2, I)
    torch.ops.decodex.silu_mul(gu, out)
    _check(out, gu)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7])
def test_silu_mul_strided(M):
    """gate_up rows wider than 2I (a view into a bigger buffer); out rows strided too."""
    I = 1000
    big = _gu(M, I + 12)  # row stride 2I + 24
    gu = big[:, 8 : 8 + 2 * I]
    ob = torch.full((M, I + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = ob[:, 8 : 8 + I]
    torch.ops.decodex.silu_mul(gu, out)
    _check(out, gu)
    assert torch.isnan(ob[:, :8]).all() and torch.isnan(ob[:, 8 + I :]).all(), "wrote outside out"


@pytest.mark.gpu
def test_silu_mul_opcheck():
    torch.library.opcheck(torch.ops.decodex.silu_mul.default, (_gu(3, 136), _poisoned(3, 136)))


@pytest.mark.gpu
def test_silu_mul_cuda_graph():
    M, I = 2, 8960
    gu, out = _gu(M, I), _poisoned(M, I)
    graph = capture_graph(lambda: torch.ops.decodex.silu_mul(gu, out))
    for _ in range(3):
        gu.copy_(_gu(M, I))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, gu)


# rms_x: the kernel rounds gate_up * 1/rms(x) to bf16 before the activation, and its scale (rsqrtf,
# a fp32 sum of squares in another order) may differ from the reference's by a few fp32 ulps, which
# can flip that rounding: one bf16 ulp of a scaled input, up to 2^-7 relative, passed on to the output.
RMS_RTOL = 2.0**-7 + 2.0**-8


def _check_rms(out, gate_up, x, eps):
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    ref = reference.silu_mul(reference.scale_rows(gate_up, torch.bfloat16, x, eps).float())
    torch.testing.assert_close(out.float(), ref, rtol=RMS_RTOL, atol=ATOL)
    # and against the reference's own definition (scaled and rounded there)
    torch.testing.assert_close(out.float(), reference.silu_mul(gate_up, x, eps).float(), rtol=RMS_RTOL,
                               atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("I,K", [(8, 8), (136, 1000), (8960, 1536), (18944, 3584)])
def test_silu_mul_rms_values(M, I, K):
    gu = _gu(M, I, scale=30.0)  # a product of the unnormalised x: large
    big = torch.randn(M, K + 16, device="cuda").mul_(3.0).to(torch.bfloat16)
    x = big[:, 8 : 8 + K]  # strided rows
    gu0, x0 = gu.clone(), x.clone()
    out = _poisoned(M, I)
    torch.ops.decodex.silu_mul(gu, out, rms_x=x, rms_eps=1e-6)
    assert torch.equal(gu, gu0) and torch.equal(x, x0), "an input was modified"
    _check_rms(out, gu, x, 1e-6)


@pytest.mark.gpu
def test_silu_mul_rms_cuda_graph():
    M, I, K = 64, 8960, 1536
    gu, out = _gu(M, I), _poisoned(M, I)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    graph = capture_graph(lambda: torch.ops.decodex.silu_mul(gu, out, rms_x=x, rms_eps=1e-5))
    for _ in range(3):
        gu.copy_(_gu(M, I))
        x.copy_(torch.randn(M, K, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_rms(out, gu, x, 1e-5)


@pytest.mark.gpu
def test_silu_mul_rms_rejects():
    gu, out = _gu(2, 64), _poisoned(2, 64)
    x = torch.randn(2, 32, device="cuda").to(torch.bfloat16)
    ops = torch.ops.decodex
    with pytest.raises(RuntimeError, match="rms_x and rms_eps go together"):
        ops.silu_mul(gu, out, rms_x=x)
    with pytest.raises(RuntimeError, match="rms_x and rms_eps go together"):
        ops.silu_mul(gu, out, rms_eps=1e-6)
    with pytest.raises(RuntimeError, match="rms_x must have shape"):
        ops.silu_mul(gu, out, rms_x=x[:1], rms_eps=1e-6)
    with pytest.raises(RuntimeError, match="rms_x must have shape"):
        ops.silu_mul(gu, out, rms_x=x[:, :12], rms_eps=1e-6)
    with pytest.raises(RuntimeError, match="rms_x must have dtype"):
        ops.silu_mul(gu, out, rms_x=x.float(), rms_eps=1e-6)
    with pytest.raises(RuntimeError, match="rms_x must have contiguous rows"):
        ops.silu_mul(gu, out, rms_x=torch.randn(32, 2, device="cuda").to(torch.bfloat16).t(), rms_eps=1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="silu_mul: rms_eps must be finite and >= 0"):
            ops.silu_mul(gu, out, rms_x=x, rms_eps=bad)
    with pytest.raises(RuntimeError, match="rms_x must be a CUDA tensor"):
        ops.silu_mul(gu, out, rms_x=x.cpu(), rms_eps=1e-6)


def _raises(match, gu, out):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.silu_mul(gu, out)


@pytest.mark.gpu
def test_silu_mul_rejects():
    _raises("multiple of 16", _gu(2, 12), _poisoned(2, 12))  # I = 12: not a multiple of 8
    _raises("multiple of 16", torch.randn(2, 17, device="cuda").to(torch.bfloat16), _poisoned(2, 8))
    _raises("out must have shape", _gu(2, 64), _poisoned(2, 128))
    _raises("out must have shape", _gu(2, 64), _poisoned(3, 64))
    _raises("gate_up must have dtype", _gu(2, 64).float(), _poisoned(2, 64))
    _raises("out must have dtype", _gu(2, 64), _poisoned(2, 64).float())
    _raises("gate_up must be 2-D", _gu(2, 64)[None], _poisoned(2, 64))
    _raises("gate_up must be contiguous along", _gu(64, 1).view(64, 2).t(), _poisoned(2, 32))
    _raises("gate_up row stride", _gu(2, 68)[:, 4:132].as_strided((2, 128), (68, 1)), _poisoned(2, 64))
    _raises("gate_up row stride", _gu(2, 66)[:, :128].as_strided((2, 128), (132, 1)), _poisoned(2, 64))
    _raises("gate_up must be 16-byte aligned", _gu(1, 65).view(-1)[1:129].view(1, 128), _poisoned(1, 64))
    _raises("out must be contiguous along", _gu(2, 64), _poisoned(64, 2).t())
    _raises("out must be a CUDA tensor", _gu(2, 64), torch.empty(2, 64, dtype=torch.bfloat16))


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_silu_mul_schema():
    s = str(torch.ops.decodex.silu_mul.default._schema)
    assert s == ("decodex::silu_mul(Tensor gate_up, Tensor(a!) out, Tensor? rms_x=None, "
                 "float? rms_eps=None) -> ()"), s


@pytest.mark.ext
def test_silu_mul_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gu = torch.empty(3, 272, device="cuda", dtype=torch.bfloat16)
        assert torch.ops.decodex.silu_mul(gu, torch.empty(3, 136, device="cuda", dtype=torch.bfloat16)) is None


@pytest.mark.ext
def test_silu_mul_meta_opcheck():
    gu = torch.empty(3, 272, device="meta", dtype=torch.bfloat16)
    out = torch.empty(3, 136, device="meta", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.decodex.silu_mul.default, (gu, out),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_silu_mul_cpu_tensors_refused():
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.silu_mul(_gu(2, 8, device="cpu"), torch.empty(2, 8, dtype=torch.bfloat16))


def test_reference_silu_mul_cpu():
    gu = torch.randn(3, 16)
    torch.testing.assert_close(reference.silu_mul(gu), gu[:, :8] * torch.sigmoid(gu[:, :8]) * gu[:, 8:])


def test_reference_silu_mul_rms_cpu():
    """With rms_x, the rows are first divided by sqrt(mean(x^2) + eps)."""
    gu, x = torch.randn(3, 16), torch.randn(3, 5)
    r = (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(reference.silu_mul(gu, x, 1e-6), reference.silu_mul(gu / r))
