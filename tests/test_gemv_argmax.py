"""decodex::gemv with argmax_out: the product as plain gemv stores it, and argmax_out[m] = the index of
the largest value of out[m, :], as decodex.argmax takes it from the stored bf16 values (ties to the
lowest index, NaN largest), computed inside the GEMV's epilogue.

GPU tests compare both outputs with gemv then argmax (the product bit for bit, the index exactly)
over odd sizes, every c = 1 kernel variant, the RMS scale, ties and NaN, repeated calls and CUDA-graph
replays (the kernel's reduction state must be left clean), and the argument checks. CPU tests: the
schema (test_gemv.py) and the fake impl.
"""
from __future__ import annotations

import pytest
import torch

from helpers import capture_graph, linear_inputs

NS = [1, 7, 16, 17, 769, 2048, 151936]
MS = [1, 2, 3, 5, 8]
# (wr, wk, c, u) forced, c = 1 only: spare warps, empty k-ranges, both unrolls.
CONFIGS = ["1,1,1,4", "1,1,1,8", "2,3,1,4", "4,2,1,8", "8,1,1,4", "1,8,1,8", "1,7,1,8"]


def _poisoned_idx(M):
    return torch.full((M,), -7, device="cuda", dtype=torch.int64)


def _poisoned(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)


def _both(x, w, b, rms_eps=None):
    """(out, argmax_out) of one fused call, and the out of plain gemv on the same inputs."""
    M, N = x.shape[0], w.shape[0]
    out, idx = _poisoned(M, N), _poisoned_idx(M)
    torch.ops.decodex.gemv(x, w, b, out, rms_eps=rms_eps, argmax_out=idx)
    plain = _poisoned(M, N)
    torch.ops.decodex.gemv(x, w, b, plain, rms_eps=rms_eps)
    return out, idx, plain


def _check(out, idx, plain):
    assert torch.equal(out, plain), "the fused call's product differs from plain gemv's"
    want = torch.empty_like(idx)
    torch.ops.decodex.argmax(out, want)
    assert torch.equal(idx, want), f"argmax_out {idx.tolist()} != argmax of out {want.tolist()}"
    assert torch.equal(idx, out.float().argmax(dim=1)), "decodex.argmax and torch.argmax disagree"


@pytest.mark.gpu
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_argmax_values(M, N, bias):
    x, w, b = linear_inputs(M, N, 1536, bias)
    _check(*_both(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("N,K", [(769, 1544), (40, 8), (7, 8960)])
@pytest.mark.parametrize("rms", [False, True])
def test_gemv_argmax_every_variant(monkeypatch, config, M, N, K, rms):
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    x, w, b = linear_inputs(M, N, K, bias=True)
    _check(*_both(x, w, b, rms_eps=1e-6 if rms else None))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_argmax_ties_and_nan(M):
    """Equal rows of the weight give equal outputs: the lowest index wins. A NaN output wins over
    everything, the first NaN over later ones; -inf and +inf are ordinary values."""
    N, K = 3000, 64
    x, w, _ = linear_inputs(M, N, K, bias=False)
    w[2900] = w[17] = w[1234] = 4.0 * x[0].abs().max() * torch.sign(x[0])  # row 0: a large tie
    out, idx, plain = _both(x, w, None)
    _check(out, idx, plain)
    assert idx[0] == 17
    b = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    b[2001], b[2500], b[1500] = float("nan"), float("nan"), float("inf")
    out, idx, plain = _both(x, w, b)
    _check(out, idx, plain)
    assert (idx == 2001).all()


@pytest.mark.gpu
def test_gemv_argmax_repeated_calls_and_graph():
    """The reduction state is left clean: calls back to back on new inputs, then graph replays with
    x changed in place, each give the right index."""
    M, N, K = 2, 151936, 1536
    x, w, b = linear_inputs(M, N, K, bias=False)
    out, idx = _poisoned(M, N), _poisoned_idx(M)
    def fused():
        torch.ops.decodex.gemv(x, w, None, out, prefetch_weight=True, argmax_out=idx)

    def check():
        plain = _poisoned(M, N)
        torch.ops.decodex.gemv(x, w, None, plain)
        _check(out, idx, plain)

    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        fused()
        check()
    graph = capture_graph(fused)
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        idx.fill_(-7)
        graph.replay()
        check()


@pytest.mark.gpu
def test_gemv_argmax_opcheck():
    x, w, b = linear_inputs(3, 256, 136)
    torch.library.opcheck(torch.ops.decodex.gemv.default, (x, w, b, _poisoned(3, 256)),
                          {"argmax_out": _poisoned_idx(3)})


@pytest.mark.gpu
def test_gemv_argmax_rejects():
    x, w, b = linear_inputs(2, 64, 64)
    out = _poisoned(2, 64)

    def err(match, idx, **kw):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.decodex.gemv(kw.pop("x", x), w, b, kw.pop("out", out), argmax_out=idx, **kw)

    err("argmax_out must have dtype", torch.zeros(2, device="cuda", dtype=torch.int32))
    err(r"argmax_out must be a contiguous \[M\]", _poisoned_idx(3))
    err(r"argmax_out must be a contiguous \[M\]", _poisoned_idx(4)[::2])
    err("argmax_out must be on x's device", torch.zeros(2, dtype=torch.int64))
    err("accumulate=False", _poisoned_idx(2), accumulate=True)
    x9 = torch.randn(9, 64, device="cuda").to(torch.bfloat16)
    err("argmax_out needs M <= 8", _poisoned_idx(9), x=x9, out=_poisoned(9, 64))
    err("must not overlap", out.view(torch.int64)[0, :2])  # int64 [2] inside out's bytes


@pytest.mark.gpu
def test_gemv_argmax_rejects_cluster_config(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", "1,4,2,4")
    x, w, b = linear_inputs(1, 64, 1536)
    with pytest.raises(RuntimeError, match="DECODEX_GEMV_CONFIG"):
        torch.ops.decodex.gemv(x, w, b, _poisoned(1, 64), argmax_out=_poisoned_idx(1))


@pytest.mark.ext
def test_gemv_argmax_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 136, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(769, 136, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(3, 769, device="cuda", dtype=torch.bfloat16)
        idx = torch.empty(3, device="cuda", dtype=torch.int64)
        assert torch.ops.decodex.gemv(x, w, None, out, argmax_out=idx) is None
