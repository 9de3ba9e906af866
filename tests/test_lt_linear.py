"""decodex::lt_linear: out (+)= x @ weight^T (+ bias) by cuBLASLt's candidate `algo`, and
lt_linear_algos, the number of candidates.

GPU tests run every candidate of each problem against decodex.reference (fp32) over odd sizes, with
bias, accumulate, strided rows, poisoned outputs, CUDA-graph replay, opcheck and the argument
checks. CPU tests: schemas, fake impl, dispatcher refusal.
"""
from __future__ import annotations

import os

import pytest
import torch

from decodex import reference
from decodex.engine import LT_WORKSPACE_BYTES
from helpers import capture_graph, linear_inputs

QUICK = bool(os.environ.get("DECODEX_TEST_QUICK"))  # under compute-sanitizer: fewer shapes
# (M, N, K): decode's batched rows at odd sizes, and the 1.5B shapes at 64 rows.
SHAPES = [(1, 7, 8), (3, 769, 136), (16, 256, 1544), (27, 2048, 1536), (64, 1536, 8960), (64, 17920, 1536)]
if QUICK:
    SHAPES = [(3, 769, 136), (64, 1536, 8960)]

# Tolerance, bf16 output vs the fp32 reference:
#  * RTOL = 2^-8: the output's rounding to bf16;
#  * an fp32 accumulation term as in test_gemv: 8 sqrt(K) eps32 sum_k |x w|;
#  * split-K with in-place reduction adds the splits' partial sums in bf16 (cuBLASLt's
#    CUBLASLT_REDUCTION_SCHEME_INPLACE): up to 16 - 1 more roundings, each at most 2^-9 of a
#    running sum, which for these inputs (outputs O(1), partials smaller) stays below
#    16 * 2^-9 * (|reference| + the row's rms): SPLIT_TOL.
RTOL = 2.0**-8
ACC_FACTOR = 8.0
EPS32 = torch.finfo(torch.float32).eps
SPLIT_TOL = 16 * 2.0**-9


def _workspace():
    return torch.empty(LT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def _poisoned(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)


def _check(out, x, w, b, before=None):
    """out within tolerance of before + x @ w^T + b (fp32); every element written."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left) or overflowed"
    ref = reference.gemv(x.float(), w.float(), None if b is None else b.float())
    if before is not None:
        ref = ref + before.float()
    mag = x.float().abs() @ w.float().abs().t()
    rms = ref.pow(2).mean(dim=1, keepdim=True).sqrt()
    bound = RTOL * ref.abs() + ACC_FACTOR * x.shape[1] ** 0.5 * EPS32 * mag + SPLIT_TOL * (ref.abs() + rms) + 1e-6
    err = (out.float() - ref).abs()
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        m, n = divmod(i, err.shape[1])
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} out of tolerance; worst [{m}, {n}]: got "
                             f"{float(out[m, n]):.6g}, reference {float(ref[m, n]):.6g}, bound {float(bound[m, n]):.3g}")


def _algos(x, w, b, out, ws, accumulate=False):
    n = int(torch.ops.decodex.lt_linear_algos(x, w, b, out, ws, accumulate))
    assert n >= 1, "cuBLASLt offered no candidate for a plain bf16 product"
    return n


def _check_every_algo(x, w, b, out, ws, before=None, after=None):
    """Every candidate in turn into out (poisoned first, or, with `before`, reset to it and
    accumulated into), each result checked (_check), then after(algo) if given."""
    n = _algos(x, w, b, out, ws, accumulate=before is not None)
    for algo in range(n):
        if before is None:
            out.fill_(float("nan"))
        else:
            out.copy_(before)
        torch.ops.decodex.lt_linear(x, w, b, out, ws, algo, accumulate=before is not None)
        try:
            _check(out, x, w, b, before=before)
        except AssertionError as e:
            raise AssertionError(f"algo {algo} of {n} (workspace {ws.numel()} bytes): {e}") from None
        if after is not None:
            after(algo)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_lt_linear_every_algo(M, N, K, bias):
    x, w, b = linear_inputs(M, N, K, bias)
    x0, w0 = x.clone(), w.clone()
    _check_every_algo(x, w, b, _poisoned(M, N), _workspace())
    assert torch.equal(x, x0) and torch.equal(w, w0), "an input was modified"


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SHAPES[:2] + SHAPES[-2:])
def test_lt_linear_accumulate(M, N, K):
    """out += x @ w^T (beta = 1): what the engine's o and down products do to the residual."""
    x, w, _ = linear_inputs(M, N, K, bias=False)
    before = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    _check_every_algo(x, w, None, before.clone(), _workspace(), before=before)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 24])
def test_lt_linear_strided(M):
    """x and out are row views of wider buffers (the engine's slices); nothing is written outside
    out's columns."""
    N, K = 520, 1000
    xb = torch.randn(M, K + 24, device="cuda").to(torch.bfloat16)
    x = xb[:, 8: 8 + K]
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    ob = _poisoned(M, N + 16)
    out = ob[:, 8: 8 + N]

    def outside_untouched(algo):
        assert torch.isnan(ob[:, :8]).all() and torch.isnan(ob[:, 8 + N:]).all(), f"algo {algo} wrote outside out"

    _check_every_algo(x, w, None, out, _workspace(), after=outside_untouched)


@pytest.mark.gpu
def test_lt_linear_cuda_graph():
    """Captured once, replayed on new x: the same algorithm computes each new product."""
    M, N, K = 32, 2048, 1536
    x, w, b = linear_inputs(M, N, K, bias=True)
    ws, out = _workspace(), _poisoned(M, N)
    algo = _algos(x, w, b, out, ws) - 1  # the list's last: a forced split-K where there is one
    graph = capture_graph(lambda: torch.ops.decodex.lt_linear(x, w, b, out, ws, algo))
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w, b)


@pytest.mark.gpu
def test_lt_linear_opcheck():
    x, w, b = linear_inputs(5, 136, 64, bias=True)
    ws = _workspace()
    torch.library.opcheck(torch.ops.decodex.lt_linear.default, (x, w, b, _poisoned(5, 136), ws, 0))


@pytest.mark.gpu
def test_lt_linear_workspace_size_is_part_of_the_problem():
    """The cached list is per problem, workspace size included: after the list for a 32 MB
    workspace (out-of-place split-K candidates, which need workspace) is cached, the same product
    with an empty workspace gets its own list, and every candidate of it runs correctly there."""
    M, N, K = 64, 1536, 8960  # down at 64 rows: split-K candidates exist
    x, w, _ = linear_inputs(M, N, K, bias=False)
    out = _poisoned(M, N)
    _algos(x, w, None, out, _workspace())
    _check_every_algo(x, w, None, out, torch.empty(0, dtype=torch.uint8, device="cuda"))


@pytest.mark.gpu
def test_lt_linear_rejects():
    ops = torch.ops.decodex
    x, w, b = linear_inputs(4, 64, 32, bias=True)
    ws, out = _workspace(), _poisoned(4, 64)
    n = _algos(x, w, b, out, ws)

    def raises(match, *args, **kw):
        with pytest.raises(RuntimeError, match=match):
            ops.lt_linear(*args, **kw)

    raises("algo must be in", x, w, b, out, ws, n)
    raises("algo must be in", x, w, b, out, ws, -1)
    raises("weight must have shape", x, w[:, :16], b, out, ws, 0)
    raises("out must have shape", x, w, b, _poisoned(4, 65), ws, 0)
    raises("bias must have shape", x, w, b[:10], out, ws, 0)
    raises("bias must be 16-byte aligned", x, w, torch.cat([b, b])[1:65], out, ws, 0)  # 2 bytes in
    raises("x must have dtype", x.float(), w, b, out, ws, 0)
    raises("weight must have dtype", x, w.half(), b, out, ws, 0)
    raises("out must have dtype", x, w, b, out.float(), ws, 0)
    raises("workspace must have dtype", x, w, b, out, ws.float(), 0)
    raises("x must have contiguous rows", torch.randn(32, 4, device="cuda").to(torch.bfloat16).t(), w, b, out, ws, 0)
    raises("x must be a CUDA tensor", x.cpu(), w, b, out, ws, 0)
    big = torch.randn(4, 96, device="cuda").to(torch.bfloat16)  # x and out interleaved in one buffer
    raises("out must not overlap", big[:, :32], w, b, big[:, 32:], ws, 0)
    raises("must be non-empty", x[:0], w, b, out[:0], ws, 0)
    with pytest.raises(RuntimeError, match="workspace must be 1-D"):
        ops.lt_linear_algos(x, w, b, out, ws.view(2, -1))


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_lt_linear_schema():
    s = str(torch.ops.decodex.lt_linear.default._schema)
    assert s == ("decodex::lt_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, Tensor(b!) workspace, "
                 "int algo, bool accumulate=False) -> ()"), s
    s = str(torch.ops.decodex.lt_linear_algos.default._schema)
    assert s == ("decodex::lt_linear_algos(Tensor x, Tensor weight, Tensor? bias, Tensor out, Tensor workspace, "
                 "bool accumulate=False) -> int"), s


@pytest.mark.ext
def test_lt_linear_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x, w, out = torch.empty(3, 64, **bf), torch.empty(16, 64, **bf), torch.empty(3, 16, **bf)
        ws = torch.empty(1024, device="cuda", dtype=torch.uint8)
        assert torch.ops.decodex.lt_linear(x, w, None, out, ws, 0) is None


@pytest.mark.ext
def test_lt_linear_cpu_tensors_refused():
    x, w, _ = linear_inputs(2, 16, 8, bias=False, device="cpu")
    out, ws = torch.empty(2, 16, dtype=torch.bfloat16), torch.empty(64, dtype=torch.uint8)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.lt_linear(x, w, None, out, ws, 0)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.lt_linear_algos(x, w, None, out, ws)
