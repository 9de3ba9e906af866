"""decodex::gemv: out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N]), bf16 in/out, fp32 accumulation.

GPU tests compare every element to decodex.reference.gemv taken in fp32, over odd sizes, with and
without bias, strided rows, every kernel variant (forced through DECODEX_GEMV_CONFIG), opcheck,
CUDA-graph replay and every argument check. CPU tests check the schema, the fake impl and that CPU
tensors are refused by the dispatcher.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from decodex import reference
from helpers import (capture_graph, check_config_is_launched, linear_inputs as _inputs, norm_inputs,
                     order_sensitive_inputs, wgmma_available)

QUICK = bool(os.environ.get("DECODEX_TEST_QUICK"))  # under compute-sanitizer: fewer sizes, no cuBLAS check

MS = [1, 2, 3, 5, 8]
# The wide GEMV: M = 9..64 rows of x (the plain epilogue; kernels for M rounded up to a multiple of
# 8, the rows past M masked).
WIDE_MS = [9, 16, 23, 33, 48, 64]
NS = [1, 7, 256, 769, 2048]
KS = [8, 136, 1536, 8960]
BIG_N = 151936  # the Qwen2.5 vocabulary: an lm_head-sized grid, only M = 1 and 8
if QUICK:
    MS, NS, KS, WIDE_MS = [1, 3, 8], [7, 769], [8, 136, 1544], [9, 64]

# Tolerance, bf16 output vs the fp32 reference:
#  * RTOL = 2^-8: rounding an fp32 value to bf16 (8 significant bits, round to nearest) moves it by
#    at most half an ulp, i.e. 2^-8 of its magnitude;
#  * plus an accumulation term: fp32 sums of K products in a different order than the reference
#    differ by ~sqrt(K) * eps_fp32 * sum|x*w| (random walk); 8x that covers tensor-core adders that
#    truncate instead of rounding.
# On top, the 2x criterion: the worst error is at most twice PyTorch's own bf16 F.linear error.
RTOL = 2.0**-8
ACC_FACTOR = 8.0
EPS32 = torch.finfo(torch.float32).eps


def _poisoned(M, N, device="cuda"):
    return torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)


def _check(out, x, w, b, rms_eps=None):
    """Every element of `out` finite and within tolerance of the fp32 reference; worst error at
    most 2x PyTorch's own bf16 error (with rms_eps: cuBLAS's product scaled by 1/rms in fp32)."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left) or overflowed"
    # Under the sanitizers the fp32 reference products run on the CPU: a cuBLAS kernel on the GPU
    # trips racecheck itself (RESULTS, session 9).
    dev = "cpu" if QUICK else out.device
    xf, wf = x.float().to(dev), w.float().to(dev)
    ref = reference.gemv(xf, wf, None if b is None else b.float().to(dev), rms_eps=rms_eps)  # fp32
    K = x.shape[1]
    scale = 1.0 if rms_eps is None else reference.inv_rms(xf, rms_eps)  # [M, 1]
    mag = (xf.abs() @ wf.abs().t()) * scale  # sum_k |x w| (/ rms), [M, N]
    atol = ACC_FACTOR * K**0.5 * EPS32 * mag + 1e-6
    err = (out.float().to(dev) - ref).abs()
    bound = RTOL * ref.abs() + atol
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        m, n = divmod(i, err.shape[1])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements out of tolerance; worst at [{m}, {n}]: "
            f"got {float(out[m, n]):.6g}, reference {float(ref[m, n]):.6g}, bound {float(bound[m, n]):.3g}")
    if QUICK:  # the sanitizer runs: no cuBLAS cross-check either
        return
    if rms_eps is None:
        torch_out = F.linear(x, w, b)
    else:
        torch_out = (F.linear(x, w).float() * scale + (0.0 if b is None else b.float())).to(torch.bfloat16)
    torch_err = (torch_out.float() - ref).abs().max()
    assert err.max() <= 2 * torch_err + 1e-5, f"max error {float(err.max()):.3g} > 2x torch's {float(torch_err):.3g}"


def _gemv(x, w, b, out):
    torch.ops.decodex.gemv(x, w, b, out)
    return out


# ---------------------------------------------------------------- GPU: values


@pytest.mark.gpu
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M", MS + WIDE_MS)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_values(M, N, K, bias):
    x, w, b = _inputs(M, N, K, bias)
    out = _gemv(x, w, b, _poisoned(M, N))
    _check(out, x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 40, 64])
def test_gemv_wide_writes_only_its_rows(M):
    """Rows of a wider buffer past M (out is a slice of it) and the padding of strided rows are
    left as they were: the kernel's rows rounded up to a multiple of 8 are masked, not written."""
    N, K = 776, 1536
    x_buf = torch.randn(M + 8, K + 16, device="cuda").to(torch.bfloat16)
    x = x_buf[:M, :K]
    _, w, b = _inputs(M, N, K)
    buf = _poisoned(M + 8, N + 24)
    out = buf[:M, :N]
    torch.ops.decodex.gemv(x, w, b, out)
    _check(out, x, w, b)
    assert torch.isnan(buf[M:]).all() and torch.isnan(buf[:, N:]).all(), "wrote outside out"


def _check_rows_independent(M, N, K, part, first):
    """M rows at once give the same bits as calls of `part` rows, and their first `first` rows as one
    call of `first`."""
    x, w, b = _inputs(M, N, K)
    wide = _gemv(x, w, b, _poisoned(M, N))
    for r in range(0, M, part):
        assert torch.equal(wide[r: r + part], _gemv(x[r: r + part], w, b, _poisoned(part, N)))
    assert torch.equal(wide[:first], _gemv(x[:first], w, b, _poisoned(first, N)))


@pytest.mark.gpu
def test_gemv_wide_rows_independent(monkeypatch):
    """Among the rows the wgmma kernel takes (M > 16) a row's result is the same bits whatever the
    other rows and their number: 64 rows at once equal two calls of 32, and the first 17 of them one
    call of 17. (Up to 16 rows gemv.cu's kernels run, whose summation order differs.)"""
    if not WGMMA:
        pytest.skip(NO_WGMMA)
    monkeypatch.setenv("DECODEX_GEMV_WIDE_CONFIG", "64,4,4")
    _check_rows_independent(64, 1536, 8960, 32, 17)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["-1", "0", "100"])
def test_carveout_switch_keeps_results(monkeypatch, value):
    """DECODEX_CARVEOUT changes only where each SM splits shared memory and L1 (common.h): the
    products are the same bits as under the default split, for M = 1, 8 and a wide M (and again
    once the variable is gone, when the default is asked for again)."""
    x, w, b = _inputs(24, 769, 1536)
    want = {m: _gemv(x[:m], w, b, _poisoned(m, 769)) for m in (1, 8, 24)}
    monkeypatch.setenv("DECODEX_CARVEOUT", value)
    for m, out in want.items():
        assert torch.equal(_gemv(x[:m], w, b, _poisoned(m, 769)), out), m
    monkeypatch.delenv("DECODEX_CARVEOUT")
    for m, out in want.items():
        assert torch.equal(_gemv(x[:m], w, b, _poisoned(m, 769)), out), m


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["101", "-2", "44%", "big"])
def test_rejects_bad_carveout_switch(monkeypatch, value):
    """DECODEX_CARVEOUT takes a percent from 0 to 100 or -1; anything else is an error naming it."""
    x, w, b = _inputs(1, 64, 64)
    monkeypatch.setenv("DECODEX_CARVEOUT", value)
    with pytest.raises(RuntimeError, match="DECODEX_CARVEOUT must be a percent"):
        _gemv(x, w, b, _poisoned(1, 64))


@pytest.mark.gpu
def test_gemv_wide_mma_rows_independent(monkeypatch):
    """gemv.cu's wide variants (M > 8; a small product up to 32 rows runs on them on every build): a
    row's result is the same bits whatever the other rows and their number: 32 rows at once equal
    two calls of 16, and the first 9 of them one call of 9."""
    monkeypatch.delenv("DECODEX_GEMV_WIDE_CONFIG", raising=False)
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", "1,4,1,4")
    _check_rows_independent(32, 1536, 1536, 16, 9)


@pytest.mark.gpu
@pytest.mark.skipif(QUICK, reason="large: skipped in quick mode")
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("M", [1, 8])
def test_gemv_values_vocab_sized(M, K):
    x, w, b = _inputs(M, BIG_N, K, bias=(K == 1536))
    out = _gemv(x, w, b, _poisoned(M, BIG_N))
    _check(out, x, w, b)
    del w
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 37])  # 37: the wide kernel's element-wise stores
def test_gemv_strided_rows(M):
    """x, weight and out as row slices of wider buffers; the padding of out stays untouched."""
    N, K = 769, 1544
    x_buf = torch.randn(M, K + 24, device="cuda").to(torch.bfloat16)
    w_buf = (torch.randn(N, K + 16, device="cuda") / K**0.5).to(torch.bfloat16)
    x, w = x_buf[:, 8 : 8 + K], w_buf[:, 8 : 8 + K]  # 16-byte aligned offsets and row strides
    b = torch.randn(2 * N, device="cuda").to(torch.bfloat16)[::2].contiguous()
    out_buf = torch.full((M, N + 5), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :N]  # row stride N + 5: odd, allowed (out is written with scalar stores)
    _gemv(x, w, b, out)
    _check(out, x, w, b)
    assert torch.isnan(out_buf[:, N:]).all(), "gemv wrote outside out's view"


@pytest.mark.gpu
def test_gemv_size1_strides_ignored():
    """M = 1 / N = 1: the stride of a size-1 dim carries no meaning and is not checked."""
    K = 136
    x = torch.randn(K, device="cuda").to(torch.bfloat16).as_strided((1, K), (3, 1))
    w = (torch.randn(K, device="cuda") / 4).to(torch.bfloat16).as_strided((1, K), (5, 1))
    out = torch.full((1,), float("nan"), device="cuda", dtype=torch.bfloat16).as_strided((1, 1), (7, 5))
    _gemv(x, w, None, out)
    _check(out, x, w, None)


# Every variant of the kernel, forced: (wr, wk, c, u). Includes spare warps (wr > tiles left),
# clusters of every size, k-ranges with no steps (wk * c > ceil(K / 32)), both unrolls, and both
# cluster sums up to 8 rows: the push where (c - 1) * wr <= 8 (1,4,2,4, 2,2,4,8, 1,5,8,4, ...) and
# the pull past it (8,1,8,8); the wide rows (16, 32) always pull.
CONFIGS = ["1,1,1,4", "1,1,1,8", "2,3,1,4", "4,2,1,8", "8,1,1,4", "1,8,1,8", "1,4,2,4", "2,2,4,8",
           "1,5,8,4", "1,5,8,8", "8,1,8,8", "1,8,8,4", "2,4,3,4", "1,8,2,8", "1,3,4,8"]


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
# 16 and 32: gemv.cu's wide variants (the small products stay on them up to 32 rows where the wgmma
# kernel exists, and take every M > 8 where it does not; (7, 8960) at 32 rows runs wgmma there).
@pytest.mark.parametrize("M", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("N,K", [(769, 1544), (40, 8), (7, 8960)])
def test_gemv_every_variant(monkeypatch, config, M, N, K):
    if int(config.split(",")[2]) > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    x, w, b = _inputs(M, N, K, bias=True)
    out = _gemv(x, w, b, _poisoned(M, N))
    torch.cuda.synchronize()
    _check(out, x, w, b)


# Every variant of the wgmma kernel (M > 16), forced: (bn, c, s). Includes every block size and ring
# depth, clusters of many sizes (3 and 6 too), ranks with no k-stages (c > ceil(K / 64)), k-ranges
# of several stages, spare rows past N.
WIDE_CONFIGS = ["64,1,4", "128,1,8", "96,2,8", "144,2,4", "64,3,4", "128,4,8", "96,6,4", "144,8,8",
                "64,16,4", "128,16,8"]
WGMMA = wgmma_available()
NO_WGMMA = "the wgmma kernel needs an sm_90a build and a device of compute capability 9.0"


@pytest.mark.gpu
@pytest.mark.parametrize("config", WIDE_CONFIGS)
@pytest.mark.parametrize("M", [17, 37, 64])
@pytest.mark.parametrize("N,K", [(769, 1544), (40, 8), (7, 8960), (2048, 264)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_wide_every_variant(monkeypatch, config, M, N, K, accumulate):
    if not WGMMA:
        pytest.skip(NO_WGMMA)
    monkeypatch.setenv("DECODEX_GEMV_WIDE_CONFIG", config)
    x, w, b = _inputs(M, N, K, bias=True)
    if accumulate:
        base = (2.0 * torch.randn(M, N, device="cuda")).to(torch.bfloat16)
        out = base.clone()
        torch.ops.decodex.gemv(x, w, b, out, accumulate=True)
        want = (base.float() + _gemv(x, w, b, _poisoned(M, N)).float()).to(torch.bfloat16)
        assert torch.equal(out, want)
    else:
        _check(_gemv(x, w, b, _poisoned(M, N)), x, w, b)


@pytest.mark.gpu
def test_gemv_bad_wide_config_override(monkeypatch):
    if not WGMMA:
        pytest.skip(NO_WGMMA)
    x, w, b = _inputs(32, 64, 64)
    for bad in ["32,1,4", "0,1,4", "65,1,4", "64,0,4", "64,9,4", "64,32,4", "64,1,2", "64,1,16",
                "nonsense", "64", "64,1", "64,1,4,4", "64,64:64,1", "64,64:64,1,4;", "64,64:64,1,4;junk"]:
        monkeypatch.setenv("DECODEX_GEMV_WIDE_CONFIG", bad)
        with pytest.raises(RuntimeError, match="DECODEX_GEMV_WIDE_CONFIG"):
            _gemv(x, w, b, _poisoned(32, 64))


@pytest.mark.gpu
def test_gemv_per_shape_config_override(monkeypatch):
    """The per-shape form runs correctly both for the shape it names (a cluster variant here) and
    for a shape it does not name (the usual choice). Which configuration ran is not visible here."""
    need = "2" if torch.cuda.get_device_capability()[0] >= 9 else "1"
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", f"8,8:1,1,1,4;769,1544:1,3,{need},8")
    for N, K in [(769, 1544), (40, 8)]:
        x, w, b = _inputs(3, N, K, bias=True)
        out = _gemv(x, w, b, _poisoned(3, N))
        torch.cuda.synchronize()
        _check(out, x, w, b)


@pytest.mark.gpu
def test_gemv_bad_config_override(monkeypatch):
    x, w, b = _inputs(2, 64, 64)
    for bad in ["3,3,1,4", "1,1,16,4", "1,1,1,5", "nonsense", "64,64:3,3,1,4", "8,8:1,1,1,4;junk",
                "64,64:1,1,1,4;", "64,64:1,1,1,4;junk"]:
        monkeypatch.setenv("DECODEX_GEMV_CONFIG", bad)
        with pytest.raises(RuntimeError, match="DECODEX_GEMV_CONFIG"):
            _gemv(x, w, b, _poisoned(2, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["1,6,1,4", "4,1,2,4", "2,3,1,8", "1,5,8,8"])
@pytest.mark.parametrize("M", [1, 2, 8])
def test_gemv_config_argument(monkeypatch, config, M):
    """config launches the configuration it names: the same bits as that configuration forced through
    DECODEX_GEMV_CONFIG, for gemv (plain, accumulate, rms_eps) and gemv_silu_mul (gemv_rope_append:
    its own test file). That config is launched at all, and that the knob wins over it: the test
    below, on inputs whose bits tell the configurations apart."""
    cfg = [int(v) for v in config.split(",")]
    if cfg[2] > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    N, K = 769, 1544
    x, w, b = _inputs(M, N, K, bias=True)
    base = (2.0 * torch.randn(M, N, device="cuda")).to(torch.bfloat16)
    ops = torch.ops.decodex

    def run(**kw):
        outs = [_poisoned(M, N), base.clone(), _poisoned(M, N), _poisoned(M, 384)]
        ops.gemv(x, w, b, outs[0], **kw)
        ops.gemv(x, w, None, outs[1], accumulate=True, **kw)
        ops.gemv(x, w, b, outs[2], rms_eps=1e-5, **kw)
        ops.gemv_silu_mul(x, w[:768], outs[3], **kw)
        torch.cuda.synchronize()
        return outs

    given = run(config=cfg)
    _check(given[0], x, w, b)
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    forced = run()
    for a, e in zip(given, forced):
        assert torch.equal(a, e)


@pytest.mark.gpu
def test_gemv_config_argument_is_launched(monkeypatch):
    """helpers.check_config_is_launched on a 64 x 1544 weight: config is launched, not only checked
    (test_gemv_config_argument compares with the knob on random inputs, where k-splits nearly always
    round alike), and the knob wins over it."""
    x, w = order_sensitive_inputs(64, 1544)

    def run(cfg):
        out = _poisoned(1, 64)
        torch.ops.decodex.gemv(x, w, None, out, config=cfg)
        torch.cuda.synchronize()
        return out

    check_config_is_launched(run, monkeypatch)


def _launched_grid(call, tmp_path) -> tuple[list[int], list[int]]:
    """The (grid, block) of the one kernel `call` launches, from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    call()  # the configuration chosen and cached outside the profile
    torch.cuda.synchronize()
    # acc_events: keep the events past the profile's one cycle (and no warning that it clears them)
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        call()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    kernels = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat", "").lower() == "kernel"]
    assert len(kernels) == 1, [e.get("name") for e in kernels]
    return kernels[0]["args"]["grid"], kernels[0]["args"]["block"]


@pytest.mark.gpu
def test_gemv_plain_and_prefetch_calls_launch_their_configs(tmp_path):
    """On a 1536 x 1536 weight at M = 1 a plain call launches its kTunedPlain entry (1,6,2,4): 96
    tiles in clusters of 2, 192 blocks of 6 warps; a prefetch call kTuned's (1,6,1,8), 96 blocks of
    6 warps (the grid and block read from the profiler's trace)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the plain entries use clusters (sm_90 and later)")
    f = torch.ops.decodex.gemv_config
    assert f(1536, 1536, 1) == [1, 6, 2, 4] and f(1536, 1536, 1, prefetch_weight=True) == [1, 6, 1, 8]
    x, w = _inputs(1, 1536, 1536)[:2]
    out = _poisoned(1, 1536)
    for prefetch_weight, blocks in ((False, 192), (True, 96)):
        call = lambda: torch.ops.decodex.gemv(x, w, None, out, prefetch_weight=prefetch_weight)  # noqa: E731
        assert _launched_grid(call, tmp_path) == ([blocks, 1, 1], [192, 1, 1]), prefetch_weight


@pytest.mark.gpu
def test_gemv_bad_config_argument():
    ops = torch.ops.decodex
    x, w, b = _inputs(2, 64, 64)
    out = _poisoned(2, 64)
    for bad in [[3, 3, 1, 4], [1, 1, 16, 4], [1, 1, 1, 5], [0, 1, 1, 4]]:
        with pytest.raises(RuntimeError, match=r"decodex::gemv: config"):
            ops.gemv(x, w, b, out, config=bad)
        with pytest.raises(RuntimeError, match=r"decodex::gemv_silu_mul: config"):
            ops.gemv_silu_mul(x, w, out[:, :32], config=bad)
    for bad in [[1, 1, 1], [1, 1, 1, 4, 4], [1, 1, 1, 400]]:
        with pytest.raises(RuntimeError, match=r"config must be \[wr, wk, c, u\]|config values must be in"):
            ops.gemv(x, w, b, out, config=bad)
    x9, _, _ = _inputs(9, 64, 64)
    with pytest.raises(RuntimeError, match=r"config applies to at most 8 rows of x"):
        ops.gemv(x9, w, b, _poisoned(9, 64), config=[1, 1, 1, 4])


@pytest.mark.gpu
def test_gemv_deterministic_and_m_independent():
    """Same inputs: bitwise the same output twice; and row m of an M = 8 call equals the M = 1 call
    on that row (each output is one fixed-order fp32 sum, whatever M)."""
    N, K = 2048, 1536
    x, w, b = _inputs(8, N, K)
    out1 = _gemv(x, w, b, _poisoned(8, N))
    out2 = _gemv(x, w, b, _poisoned(8, N))
    assert torch.equal(out1, out2)
    for m in (0, 5):
        row = _gemv(x[m : m + 1].contiguous(), w, b, _poisoned(1, N))
        torch.testing.assert_close(row, out1[m : m + 1], rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
def test_gemv_opcheck():
    x, w, b = _inputs(3, 256, 136)
    out = _poisoned(3, 256)
    torch.library.opcheck(torch.ops.decodex.gemv.default, (x, w, b, out))
    torch.library.opcheck(torch.ops.decodex.gemv.default, (x, w, None, out))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 256, 1536), (8, 2048, 1536), (5, 769, 8960), (64, 2048, 1536)])
def test_gemv_cuda_graph(M, N, K):
    """Captured once, replayed with x changed in place: the output follows x."""
    x, w, b = _inputs(M, N, K)
    out = _poisoned(M, N)
    graph = capture_graph(lambda: _gemv(x, w, b, out))  # warm-up: config choice, occupancy queries
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 2048, 1536), (8, 776, 8960), (3, 17920, 1536), (64, 2048, 1536)])
def test_gemv_prefetch_weight(M, N, K):
    """prefetch_weight=True (first weights loaded before the PDL wait) in one CUDA graph of GEMVs,
    each reading the output of the one before as x: bitwise the same as plain calls."""
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    shapes = [(N, K), (K, N)] * 3  # x -> [M, N] -> [M, K] -> [M, N] ...
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for n, k in shapes]
    outs = [_poisoned(M, n) for n, _ in shapes]

    def chain(prefetch):  # each GEMV reads the output of the one before
        inp = x
        for w, out in zip(ws, outs):
            torch.ops.decodex.gemv(inp, w, None, out, prefetch_weight=prefetch)
            inp = out

    chain(False)
    want = [t.clone() for t in outs]
    graph = capture_graph(lambda: chain(True))
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)


# ---------------------------------------------------------------- GPU: rms_eps, accumulate

RMS_EPS = 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 2048, 1536), (1, 37888, 3584), (3, 769, 1544), (8, 4608, 3584),
                                   (8, 7, 8960), (5, 40, 8), (2, 1, 136), (8, 16, 16384)])
def test_gemv_rms_eps(M, N, K):
    """rms_eps: each product row scaled by 1/rms(x row) before the bias, on rows of x whose rms
    ranges from ~0.3 to ~5; and with the norm weight folded into W it is rms_norm then gemv."""
    x, nw = norm_inputs(M, K)
    _, w, b = _inputs(M, N, K)
    out = _poisoned(M, N)
    torch.ops.decodex.gemv(x, w, b, out, rms_eps=RMS_EPS)
    _check(out, x, w, b, rms_eps=RMS_EPS)
    # The folded form against the unfolded one (rms_norm, then the product): close, not equal
    # (rms_norm rounds x / rms * w to bf16, the fold rounds W * w).
    folded = _poisoned(M, N)
    torch.ops.decodex.gemv(x, reference.fold_norm_weight(w, nw), b, folded, rms_eps=RMS_EPS)
    want = reference.gemv(reference.rms_norm(x.float(), nw.float(), RMS_EPS), w.float(), b.float())
    torch.testing.assert_close(folded.float(), want, rtol=2**-6, atol=2**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("N,K", [(769, 1544), (7, 8960)])
def test_gemv_rms_eps_every_variant(monkeypatch, config, M, N, K):
    """The sum of squares goes through every variant's k-range reduction (warps, clusters, spare
    warps, empty k-ranges) beside the dot products."""
    if int(config.split(",")[2]) > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    x, _ = norm_inputs(M, K)
    _, w, b = _inputs(M, N, K)
    out = _poisoned(M, N)
    torch.ops.decodex.gemv(x, w, b, out, rms_eps=RMS_EPS)
    _check(out, x, w, b, rms_eps=RMS_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 1536, 8960), (8, 769, 1536), (3, 7, 8),
                                   (9, 1536, 8960), (64, 769, 1536), (33, 7, 8)])  # wide: M > 8
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prefetch_weight", [False, True])
def test_gemv_accumulate(M, N, K, bias, prefetch_weight):
    """accumulate: out += the product, rounded as gemv then a bf16 add (bit for bit)."""
    x, w, b = _inputs(M, N, K, bias)
    base = (2.0 * torch.randn(M, N, device="cuda")).to(torch.bfloat16)
    out = base.clone()
    torch.ops.decodex.gemv(x, w, b, out, accumulate=True, prefetch_weight=prefetch_weight)
    plain = _gemv(x, w, b, _poisoned(M, N))
    assert torch.equal(out, (base.float() + plain.float()).to(torch.bfloat16))
    ref = reference.gemv(x, w, b, accumulate=base)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("trigger", ["wait", "early", "after1", "after60", "after100"])
def test_gemv_rms_and_accumulate_chain_in_graph(M, trigger):
    """The decode step's pattern, captured with prefetch_weight: h = (W1 r) / rms(r); r += W2 h,
    three times over, each kernel reading what the one before wrote. Where each lets the next
    launch (`trigger`): right after its wait; "early": the accumulating calls before their wait,
    as the step's o product does, so a W1 product starts while the W1 product two kernels ahead may
    still run; "afterP": both products only after P% of their main loop (launch_dependents_after,
    as the step's 1.5B gate|up and down; one row only, M = 8 ignores it). Bitwise equal to plain
    calls, and close to the fp32 reference of the chain."""
    early = trigger == "early"
    after = int(trigger[5:]) if trigger.startswith("after") else 0
    K, N = 1536, 2048
    r0, _ = norm_inputs(M, K)
    w1 = [(torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16) for _ in range(3)]
    w2 = [(torch.randn(K, N, device="cuda") / N**0.5).to(torch.bfloat16) for _ in range(3)]
    r, h = r0.clone(), _poisoned(M, N)

    def chain(prefetch):  # plain calls launch the prefetch calls' configurations (kTunedPlain aside)
        for a, c in zip(w1, w2):
            torch.ops.decodex.gemv(r, a, None, h, prefetch_weight=prefetch, rms_eps=RMS_EPS,
                                   config=torch.ops.decodex.gemv_config(N, K, M, prefetch_weight=True),
                                   launch_dependents_after=after if prefetch else 0)
            torch.ops.decodex.gemv(h, c, None, r, prefetch_weight=prefetch, accumulate=True,
                                   config=torch.ops.decodex.gemv_config(K, N, M, prefetch_weight=True),
                                   launch_dependents_early=prefetch and early,
                                   launch_dependents_after=after if prefetch else 0)

    chain(False)
    want = r.clone()
    ref = r0
    for a, c in zip(w1, w2):
        ref = reference.gemv(reference.gemv(ref, a, rms_eps=RMS_EPS), c, accumulate=ref)
    torch.testing.assert_close(want.float(), ref.float(), rtol=0.05, atol=0.05)
    r.copy_(r0)
    graph = capture_graph(lambda: chain(True))  # runs the chain once more before capturing
    r.copy_(r0)
    h.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(r, want)


@pytest.mark.gpu
def test_gemv_dependents_early_knob(monkeypatch):
    """launch_dependents_early is a hint: the same bits with it on or off, and under every well-formed
    DECODEX_GEMV_DEPENDENTS_EARLY (whether the knob really moved the trigger is not observable
    here; test_gemv_rms_and_accumulate_chain_in_graph runs the early trigger inside a dependent
    chain); a malformed value is an error naming the knob."""
    x, w, b = _inputs(1, 256, 136)

    def call(early):
        out = _poisoned(1, 256)
        torch.ops.decodex.gemv(x, w, b, out, prefetch_weight=True, launch_dependents_early=early)
        return out

    want = call(False)
    _check(want, x, w, b)
    assert torch.equal(call(True), want)
    for value in ("1", "0", "256,136:1;8,8:0", "8,8:1"):
        monkeypatch.setenv("DECODEX_GEMV_DEPENDENTS_EARLY", value)
        assert torch.equal(call(True), want) and torch.equal(call(False), want)
    for bad in ("2", "yes", "256,136:1;", "256,136:0,1"):
        monkeypatch.setenv("DECODEX_GEMV_DEPENDENTS_EARLY", bad)
        with pytest.raises(RuntimeError, match="DECODEX_GEMV_DEPENDENTS_EARLY"):
            call(True)


@pytest.mark.gpu
def test_gemv_dependents_after_checks_and_knob(monkeypatch):
    """launch_dependents_after is a hint too: the same bits at 0 to 100 and under every well-formed
    DECODEX_GEMV_DEPENDENTS_AFTER (which wins over the argument; test_gemv_rms_and_accumulate_chain_
    in_graph runs the late trigger inside a dependent chain); outside 0..100, or beside
    launch_dependents_early, the argument is an error naming it; a malformed knob one naming the
    knob. A warp with fewer trips than the percentage asks for (K = 136: 5 k-steps) triggers as its
    block exits."""
    x, w, b = _inputs(1, 256, 136)

    def call(after, early=False):
        out = _poisoned(1, 256)
        torch.ops.decodex.gemv(x, w, b, out, prefetch_weight=True, launch_dependents_early=early,
                               launch_dependents_after=after)
        return out

    want = call(0)
    _check(want, x, w, b)
    for after in (1, 50, 99, 100):
        assert torch.equal(call(after), want), after
    for bad in (-1, 101):
        with pytest.raises(RuntimeError, match=r"gemv: launch_dependents_after must be 0 to 100"):
            call(bad)
    with pytest.raises(RuntimeError, match="launch_dependents_early and launch_dependents_after"):
        call(50, early=True)
    for value in ("100", "0", "256,136:70;8,8:0", "8,8:30"):
        monkeypatch.setenv("DECODEX_GEMV_DEPENDENTS_AFTER", value)
        assert torch.equal(call(0), want) and torch.equal(call(40), want)
    for bad in ("101", "-1", "late", "256,136:50;", "256,136:1,2"):
        monkeypatch.setenv("DECODEX_GEMV_DEPENDENTS_AFTER", bad)
        with pytest.raises(RuntimeError, match="DECODEX_GEMV_DEPENDENTS_AFTER"):
            call(0)


@pytest.mark.gpu
def test_gemv_rms_eps_rejects():
    x, w, b = _inputs(2, 32, 64)
    out = _poisoned(2, 32)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match=r"gemv: rms_eps must be finite and >= 0"):
            torch.ops.decodex.gemv(x, w, b, out, rms_eps=bad)
    assert torch.isnan(out).all(), "a refused call wrote out"


@pytest.mark.gpu
def test_gemv_rejects_x_overlapping_out():
    """x and out whose address ranges intersect: refused (blocks would read x while others write
    out), with or without accumulate, even when the elements interleave without sharing; views of
    one buffer with separate ranges are fine."""
    buf = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    w = (torch.randn(64, 64, device="cuda") / 8).to(torch.bfloat16)
    for accumulate in (False, True):
        with pytest.raises(RuntimeError, match="x and out must not overlap"):
            torch.ops.decodex.gemv(buf[:2, :64], w, None, buf[:2, 32:96], accumulate=accumulate)
        with pytest.raises(RuntimeError, match="x and out must not overlap"):
            torch.ops.decodex.gemv(buf[:2, :64], w, None, buf[:2, 64:], accumulate=accumulate)
    x, out = buf[:2, :64], buf[2:, :64]
    torch.ops.decodex.gemv(x, w, None, out)
    _check(out, x, w, None)


# ---------------------------------------------------------------- GPU: argument checks


def _err(match, x, w, b, out, exc=RuntimeError):
    with pytest.raises(exc, match=match):
        torch.ops.decodex.gemv(x, w, b, out)


@pytest.mark.gpu
def test_gemv_rejects_k_not_multiple_of_8():
    x, w, _ = _inputs(2, 16, 16)
    _err(r"K.*multiple of 8.*K = 12", x[:, :12].contiguous(), w[:, :12].contiguous(), None, _poisoned(2, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [0, 65, 128])
def test_gemv_rejects_m(M):
    x = torch.randn(M, 64, device="cuda").to(torch.bfloat16)
    w = torch.randn(32, 64, device="cuda").to(torch.bfloat16)
    _err(r"M = 1\.\.64.*M = " + str(M), x, w, None, _poisoned(M, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 64])
def test_gemv_wide_rejects_rms_eps(M):
    """The RMS scale exists for at most 8 rows; a wide call with rms_eps is refused, not run
    unscaled."""
    x, w, b = _inputs(M, 32, 64)
    out = _poisoned(M, 32)
    with pytest.raises(RuntimeError, match=r"gemv: rms_eps needs M <= 8 rows of x.*" + str(M)):
        torch.ops.decodex.gemv(x, w, b, out, rms_eps=RMS_EPS)
    assert torch.isnan(out).all(), "a refused call wrote out"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("which", ["x", "weight", "out", "bias"])
def test_gemv_rejects_dtype(which, dtype):
    x, w, b = _inputs(2, 32, 64)
    out = _poisoned(2, 32)
    args = dict(x=x, weight=w, bias=b, out=out)
    args[which] = args[which].to(dtype)
    _err(rf"{which} must have dtype", args["x"], args["weight"], args["bias"], args["out"])


@pytest.mark.gpu
def test_gemv_rejects_shapes():
    x, w, b = _inputs(2, 32, 64)
    _err(r"out must have shape", x, w, b, _poisoned(2, 33))
    _err(r"out must have shape", x, w, b, _poisoned(3, 32))
    _err(r"out must be 2-D", x, w, b, _poisoned(2, 32)[0])
    _err(r"weight must have shape \[N, K\]", x, w[:, :56].contiguous(), b, _poisoned(2, 32))
    _err(r"bias must have shape \[N\]", x, w, torch.zeros(33, device="cuda", dtype=torch.bfloat16), _poisoned(2, 32))
    _err(r"bias must have shape \[N\]", x, w, b[None], _poisoned(2, 32))
    _err(r"x must be 2-D", x[None], w, b, _poisoned(2, 32))
    _err(r"weight must be 2-D", x, w[None], b, _poisoned(2, 32))


@pytest.mark.gpu
def test_gemv_rejects_devices():
    x, w, b = _inputs(2, 32, 64)
    out = _poisoned(2, 32)
    _err(r"x must be a CUDA tensor", x.cpu(), w, b, out)
    _err(r"weight must be a CUDA tensor", x, w.cpu(), b, out)
    _err(r"out must be a CUDA tensor", x, w, b, out.cpu())
    _err(r"bias must be a CUDA tensor", x, w, b.cpu(), out)
    if torch.cuda.device_count() > 1:
        _err(r"must be on the same device", x, w.to("cuda:1"), b, out)
        _err(r"must be on the same device", x, w, b.to("cuda:1"), out)


@pytest.mark.gpu
def test_gemv_rejects_layouts():
    M, N, K = 2, 32, 64
    x, w, b = _inputs(M, N, K)
    out = _poisoned(M, N)
    # Misaligned storage offsets: 2 bytes past a 16-byte boundary.
    x_mis = torch.empty(M * K + 8, device="cuda", dtype=torch.bfloat16)[1 : 1 + M * K].view(M, K)
    w_mis = torch.empty(N * K + 8, device="cuda", dtype=torch.bfloat16)[1 : 1 + N * K].view(N, K)
    _err(r"x must be 16-byte aligned", x_mis, w, b, out)
    _err(r"weight must be 16-byte aligned", x, w_mis, b, out)
    # weight[:, 1:] slicing: K of 65 - 1 = 64 but rows 65 elements apart and misaligned.
    w65 = torch.randn(N, K + 1, device="cuda").to(torch.bfloat16)
    _err(r"weight rows", x, w65[:, 1:], b, out)
    # Row strides that break 16-byte row alignment, overlapping rows, non-contiguous last dims.
    _err(r"x rows", torch.randn(M, K + 4, device="cuda").to(torch.bfloat16)[:, :K], w, b, out)
    _err(r"weight rows", x, torch.randn(N, K + 4, device="cuda").to(torch.bfloat16)[:, :K], b, out)
    _err(r"x rows", x.as_strided((M, K), (8, 1)), w, b, out)
    _err(r"out rows", x, w, b, out.as_strided((M, N), (8, 1)))
    _err(r"x must have a contiguous last dim", x.t().contiguous().t(), w, b, out)
    _err(r"weight must have a contiguous last dim", x, w.t().contiguous().t(), b, out)
    _err(r"out must have a contiguous last dim", x, w, b, out.t().contiguous().t())
    _err(r"bias must be contiguous", x, w, torch.randn(2 * N, device="cuda").to(torch.bfloat16)[::2], out)


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_gemv_schema():
    schema = str(torch.ops.decodex.gemv.default._schema)
    assert schema == ("decodex::gemv(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, "
                      "bool prefetch_weight=False, float? rms_eps=None, "
                      "bool accumulate=False, int[]? config=None, "
                      "bool launch_dependents_early=False, int launch_dependents_after=0) -> ()"), schema


@pytest.mark.ext
def test_gemv_fake_tensor_mode():
    """Traceable without a GPU: fake CUDA tensors go through the registered fake impl."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 136, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(769, 136, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(769, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(3, 769, device="cuda", dtype=torch.bfloat16)
        assert torch.ops.decodex.gemv(x, w, b, out) is None
        assert torch.ops.decodex.gemv(x, w, None, out) is None
        assert torch.ops.decodex.gemv(x, w, None, out, rms_eps=1e-6, accumulate=True) is None
        assert torch.ops.decodex.gemv(x, w, b, out, config=[1, 6, 1, 4]) is None


@pytest.mark.ext
def test_gemv_meta_opcheck():
    """opcheck (schema, fake impl, autograd registration) on meta tensors: runs on a CPU machine."""
    x = torch.empty(3, 136, device="meta", dtype=torch.bfloat16)
    w = torch.empty(769, 136, device="meta", dtype=torch.bfloat16)
    b = torch.empty(769, device="meta", dtype=torch.bfloat16)
    out = torch.empty(3, 769, device="meta", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.decodex.gemv.default, (x, w, b, out),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_gemv_config_table_then_rule():
    """gemv_config (no GPU): a tabled shape gets its entry for M's range; another shape the rule
    (bench.gemv_rule's tests hold it to the rule for every K), whatever N and M; without clusters,
    a tabled entry with a cluster gives way to the rule's c = 1."""
    op = torch.ops.decodex.gemv_config
    assert str(op.default._schema) == ("decodex::gemv_config(int N, int K, int M, bool clusters=True, "
                                       "bool prefetch_weight=False) -> int[]")

    def f(*args, **kwargs):  # prefetch calls, as the decode step makes them (plain ones: the next test)
        return op(*args, prefetch_weight=True, **kwargs)

    assert f(1536, 1536, 1) == f(1536, 1536, 4) == [1, 6, 1, 8]  # Qwen2.5-1.5B q, o: M <= 4
    assert f(1536, 1536, 5) == f(1536, 1536, 8) == [1, 7, 1, 4]  # and M = 5..8
    assert f(2048, 6144, 1) == [1, 3, 4, 8]  # Qwen3-1.7B down, a cluster of 4
    assert f(2048, 6144, 1, clusters=False) == [1, 8, 1, 8]  # 192 k-steps over 8 warps: 24 each, U = 8
    assert f(1, 2048, 1) == f(77777, 2048, 8) == [1, 4, 2, 4]
    assert f(2560, 2048, 4) == [1, 4, 2, 4] and f(2560, 2048, 5) == [2, 2, 4, 8]  # Qwen2.5-3B qkv: M = 5..8 only
    assert f(4096, 14336, 8) == f(4096, 12288, 5) == [2, 4, 2, 8]  # the 8Bs' downs at M = 5..8
    # kTunedRows: the 7B qkv at M = 2..4, the 1.5B qkv at 3..4 (a cluster of 4; kTuned's m1 without
    # clusters, at M = 1 and at the 1.5B's M = 2)
    assert f(4608, 3584, 2) == f(4608, 3584, 4) == [2, 1, 4, 8] and f(4608, 3584, 1) == [1, 5, 1, 8]
    assert f(2048, 1536, 3) == f(2048, 1536, 4) == [2, 2, 4, 4]
    assert f(2048, 1536, 1) == f(2048, 1536, 2) == f(2048, 1536, 3, clusters=False) == [1, 6, 1, 8]
    assert f(2048, 1536, 5) == [1, 6, 1, 8]
    # ... and Llama-3.1-8B's down at M = 2..4 (a cluster of 8)
    assert f(4096, 14336, 2) == f(4096, 14336, 4) == [1, 4, 8, 8] and f(4096, 14336, 1) == [1, 7, 1, 8]


@pytest.mark.ext
def test_gemv_config_plain_calls():
    """gemv_config for plain calls (prefetch_weight=False, the default): kTunedPlain's entry for the
    rows it serves; the prefetch choice on the shapes and rows it leaves out, and without clusters
    (every entry has one)."""
    f = torch.ops.decodex.gemv_config
    for M in (1, 4, 8):
        assert f(1536, 1536, M) == f(1536, 1536, M, prefetch_weight=False) == [1, 6, 2, 4]
    assert f(1536, 1536, 1, prefetch_weight=True) == [1, 6, 1, 8]
    assert f(4608, 3584, 1) == [2, 2, 4, 4] and f(4608, 3584, 2) == f(4608, 3584, 8) == [1, 7, 2, 4]
    assert f(152064, 3584, 1) == [1, 2, 8, 8] and f(152064, 3584, 5) == [1, 5, 4, 8]
    assert f(151936, 1536, 1) == f(151936, 1536, 1, prefetch_weight=True) == [1, 7, 1, 8]  # M = 1 left out
    assert f(151936, 1536, 2) == [1, 6, 2, 4]
    assert f(1536, 1536, 1, clusters=False) == f(1536, 1536, 1, clusters=False, prefetch_weight=True)
    assert f(4096, 14336, 2) == f(4096, 14336, 2, prefetch_weight=True) == [1, 4, 8, 8]  # not in the table
    # other presets' shapes (session 51): one row, then 2..8 rows, each its own entry
    assert f(2048, 2048, 1) == [1, 4, 1, 4] and f(2048, 2048, 2) == f(2048, 2048, 8) == [1, 4, 4, 4]
    assert f(6144, 2560, 1) == f(6144, 2560, 4) == f(6144, 2560, 8) == [1, 5, 1, 8]


@pytest.mark.ext
@pytest.mark.parametrize("args, match", [((0, 8, 1), "N"), ((16, 12, 1), "K must be"), ((16, 0, 1), "K must be"),
                                         ((16, 8, 0), "M "), ((16, 8, 9), "M ")])
def test_gemv_config_rejects(args, match):
    with pytest.raises(RuntimeError, match=f"gemv_config: {match}"):
        torch.ops.decodex.gemv_config(*args)


@pytest.mark.ext
def test_gemv_cpu_tensors_refused():
    """No CPU kernel: CPU tensors stop at the dispatcher (the K check lives in the CUDA launcher)."""
    x = torch.randn(2, 12).to(torch.bfloat16)  # K = 12 would also fail the launcher's check
    w = torch.randn(4, 12).to(torch.bfloat16)
    out = torch.empty(2, 4, dtype=torch.bfloat16)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.gemv(x, w, None, out)


def test_reference_gemv_cpu():
    """The reference (the CPU path) in fp32 and bf16 against a plain matmul."""
    x, w, b = _inputs(3, 7, 136, device="cpu")
    torch.testing.assert_close(reference.gemv(x.float(), w.float(), b.float()),
                               x.float() @ w.float().t() + b.float())
    y = reference.gemv(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 7)
    # rms_eps with the norm weight folded in: rms_norm then the product (exactly, in fp32);
    # accumulate: added to the given tensor.
    nw = 1.0 + 0.1 * torch.randn(136)
    xf, wf, bf = x.float(), w.float(), b.float()
    torch.testing.assert_close(reference.gemv(xf, reference.fold_norm_weight(wf, nw), bf, rms_eps=1e-6),
                               reference.gemv(reference.rms_norm(xf, nw, 1e-6), wf, bf))
    acc = torch.randn(3, 7).to(torch.bfloat16)
    assert torch.equal(reference.gemv(x, w, b, accumulate=acc), (acc.float() + y.float()).to(torch.bfloat16))
