"""decodex::gemv with argmax_keys, and advance_positions finishing that argmax: the product as plain
gemv stores it, and each row's argmax keys (value bits << 32 | ~index) max-reduced into the caller's
[M, slots] keys, slot (output // 16) % slots; advance_positions(..., argmax_keys, tokens) then writes
the index the largest key names and zeroes the keys. Together: decodex.argmax of the stored product,
without an argmax kernel (the greedy decode step's LM head).

GPU tests compare the product with plain gemv bit for bit and the keys with
decodex.reference.argmax_keys of that product bit for bit, over odd sizes, every kernel variant
(clusters too), the RMS scale, ties and NaN, slots from 1 to more than the tiles, repeated calls
and CUDA-graph replays of gemv + advance_positions; and the argument checks. CPU tests: the
reference's keys against torch.argmax, the fake impl.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph, linear_inputs

NS = [1, 7, 16, 17, 769, 2048, 151936]
MS = [1, 2, 3, 5, 8]
# (wr, wk, c, u) forced: spare warps, empty k-ranges, both unrolls, clusters (push and pull).
CONFIGS = ["1,1,1,4", "1,1,1,8", "2,3,1,4", "4,2,1,8", "8,1,1,4", "1,8,1,8", "1,4,2,4", "2,2,4,8",
           "8,1,8,8"]


def _poisoned(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)


def _fused(x, w, b, slots=64, rms_eps=None):
    """(out, keys) of one gemv with argmax_keys (zeroed keys), and plain gemv's out."""
    M, N = x.shape[0], w.shape[0]
    out, keys = _poisoned(M, N), torch.zeros(M, slots, device="cuda", dtype=torch.int64)
    torch.ops.decodex.gemv(x, w, b, out, rms_eps=rms_eps, argmax_keys=keys)
    plain = _poisoned(M, N)
    torch.ops.decodex.gemv(x, w, b, plain, rms_eps=rms_eps)
    return out, keys, plain


def _check(out, keys, plain):
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16)), (  # bits: NaN too
        "the product with argmax_keys differs from plain gemv's")
    want = reference.argmax_keys(out.cpu(), keys.shape[1])
    assert torch.equal(keys.cpu(), want), "the keys differ from the reference's"
    idx = torch.empty(out.shape[0], device="cuda", dtype=torch.int64)
    torch.ops.decodex.argmax(out, idx)
    assert torch.equal(reference.argmax_from_keys(keys.cpu()), idx.cpu()), "the keys name another argmax"


@pytest.mark.gpu
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_argmax_keys_values(M, N, bias):
    x, w, b = linear_inputs(M, N, 1536, bias)
    _check(*_fused(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1, 3, 64, 2000])  # 2000: more slots than the tiles of N = 769
def test_gemv_argmax_keys_slots(slots):
    x, w, b = linear_inputs(3, 769, 136)
    _check(*_fused(x, w, b, slots=slots))


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("N,K", [(769, 1544), (40, 8), (7, 8960)])
@pytest.mark.parametrize("rms", [False, True])
def test_gemv_argmax_keys_every_variant(monkeypatch, config, M, N, K, rms):
    if int(config.split(",")[2]) > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", config)
    x, w, b = linear_inputs(M, N, K, bias=True)
    _check(*_fused(x, w, b, rms_eps=1e-6 if rms else None))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_argmax_keys_ties_and_nan(M):
    """Equal weight rows give equal outputs: the lowest index wins. A NaN output wins over
    everything, the first NaN over later ones; +inf is an ordinary value below NaN."""
    N, K = 3000, 64
    x, w, _ = linear_inputs(M, N, K, bias=False)
    w[2900] = w[17] = w[1234] = 4.0 * x[0].abs().max() * torch.sign(x[0])  # row 0: a large tie
    out, keys, plain = _fused(x, w, None)
    _check(out, keys, plain)
    assert reference.argmax_from_keys(keys.cpu())[0] == 17
    b = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    b[2001], b[2500], b[1500] = float("nan"), float("nan"), float("inf")
    out, keys, plain = _fused(x, w, b)
    _check(out, keys, plain)
    assert (reference.argmax_from_keys(keys.cpu()) == 2001).all()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5])
def test_gemv_argmax_keys_then_advance_positions_in_graph(M):
    """The greedy step's tail, gemv (argmax_keys) then advance_positions (argmax_keys, tokens),
    called back to back on new inputs and then replayed in a CUDA graph: each time the tokens are
    decodex.argmax of the product, the keys are left zero, and live positions advance."""
    N, K, slots = 151936, 1536, 64
    x, w, _ = linear_inputs(M, N, K, bias=False)
    out = _poisoned(M, N)
    keys = torch.zeros(M, slots, device="cuda", dtype=torch.int64)
    tokens = torch.full((M,), -7, device="cuda", dtype=torch.int64)
    positions = torch.arange(M, device="cuda", dtype=torch.int32)
    if M > 1:
        positions[-1] = -1  # a dead row: its token is still written, its position stays
    lengths = torch.zeros(M, device="cuda", dtype=torch.int32)

    def tail():
        torch.ops.decodex.gemv(x, w, None, out, prefetch_weight=True, argmax_keys=keys)
        torch.ops.decodex.advance_positions(positions, lengths, argmax_keys=keys, tokens=tokens)

    def check(steps):
        want = torch.empty(M, device="cuda", dtype=torch.int64)
        torch.ops.decodex.argmax(out, want)
        assert torch.equal(tokens, want) and not keys.any()
        assert positions[0].item() == steps and (M == 1 or positions[-1].item() == -1)

    steps = 0
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        tail()
        steps += 1
        check(steps)
    graph = capture_graph(tail)  # the warm-up call inside runs one step
    steps += 1
    for _ in range(3):
        x.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        tokens.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        steps += 1
        check(steps)


@pytest.mark.gpu
def test_advance_positions_all_zero_keys():
    keys = torch.zeros(3, 5, device="cuda", dtype=torch.int64)
    tokens = torch.full((3,), 9, device="cuda", dtype=torch.int64)
    p, l = torch.zeros(3, device="cuda", dtype=torch.int32), torch.zeros(3, device="cuda", dtype=torch.int32)
    torch.ops.decodex.advance_positions(p, l, argmax_keys=keys, tokens=tokens)
    assert tokens.tolist() == [-1, -1, -1] and p.tolist() == [1, 1, 1]


@pytest.mark.gpu
def test_gemv_argmax_keys_opcheck():
    x, w, b = linear_inputs(3, 256, 136)
    keys = torch.zeros(3, 8, device="cuda", dtype=torch.int64)
    # Not idempotent in general (a max into keys), but opcheck's repeated calls reduce the same keys.
    torch.library.opcheck(torch.ops.decodex.gemv.default, (x, w, b, _poisoned(3, 256)), {"argmax_keys": keys})


@pytest.mark.gpu
def test_gemv_argmax_keys_rejects():
    x, w, b = linear_inputs(2, 64, 64)
    out = _poisoned(2, 64)

    def err(match, keys, **kw):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.decodex.gemv(kw.pop("x", x), w, b, kw.pop("out", out), argmax_keys=keys, **kw)

    def zeros(*shape, dtype=torch.int64, device="cuda"):
        return torch.zeros(*shape, dtype=dtype, device=device)

    err("argmax_keys must have dtype", zeros(2, 4, dtype=torch.int32))
    err(r"argmax_keys must have shape \[M, slots\]", zeros(3, 4))
    err(r"argmax_keys must have shape \[M, slots\]", zeros(2))
    err(r"argmax_keys must have shape \[M, slots\]", zeros(2, 0))
    err("contiguous last dim", zeros(2, 8)[:, ::2])
    err("argmax_keys must be on x's device", zeros(2, 4, device="cpu"))
    err("accumulate=False", zeros(2, 4), accumulate=True)
    x9 = torch.randn(9, 64, device="cuda").to(torch.bfloat16)
    err("argmax_keys needs M <= 8", zeros(9, 4), x=x9, out=_poisoned(9, 64))
    err("must not overlap", out.view(torch.int64).view(2, 16)[:, :4])  # inside out's bytes


@pytest.mark.gpu
def test_advance_positions_argmax_rejects():
    p, l = torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(4, dtype=torch.int32, device="cuda")
    keys, tokens = torch.zeros(4, 8, dtype=torch.int64, device="cuda"), torch.zeros(4, dtype=torch.int64, device="cuda")

    def err(match, k, t):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.decodex.advance_positions(p, l, argmax_keys=k, tokens=t)

    err("together", keys, None)
    err("together", None, tokens)
    err("must have dtype", keys.int(), tokens)
    err("must have dtype", keys, tokens.int())
    err(r"argmax_keys must be \[B, slots\]", keys[:3], tokens)
    err(r"argmax_keys must be \[B, slots\]", keys[:, ::2], tokens)
    err(r"tokens must be a contiguous \[B\]", keys, tokens[:3])
    err("must be on positions' device", keys.cpu(), tokens)
    err("must not overlap", keys, keys.view(-1)[:4])


def test_reference_argmax_keys_cpu():
    """The reference's keys name torch.argmax's answer (ties to the first, NaN first), -1 for none."""
    v = torch.randn(4, 1000).to(torch.bfloat16)
    v[1, 500] = v[1, 20] = 50.0
    v[2, 700] = v[2, 900] = float("nan")
    v[3] = -0.0
    v[3, 5] = 0.0
    for slots in (1, 7, 64):
        got = reference.argmax_from_keys(reference.argmax_keys(v, slots))
        assert got.tolist() == v.float().argmax(dim=1).tolist() == [int(v[0].float().argmax()), 20, 700, 0]
    assert reference.argmax_from_keys(torch.zeros(2, 3, dtype=torch.int64)).tolist() == [-1, -1]


@pytest.mark.ext
def test_gemv_argmax_keys_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 136, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(769, 136, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(3, 769, device="cuda", dtype=torch.bfloat16)
        keys = torch.empty(3, 64, device="cuda", dtype=torch.int64)
        tokens = torch.empty(3, device="cuda", dtype=torch.int64)
        p = torch.empty(3, device="cuda", dtype=torch.int32)
        assert torch.ops.decodex.gemv(x, w, None, out, argmax_keys=keys) is None
        assert torch.ops.decodex.advance_positions(p, torch.empty_like(p), argmax_keys=keys, tokens=tokens) is None
