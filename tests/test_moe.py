"""decodex::moe_route, moe_gemv_silu_mul and moe_gemv_sum: Qwen3-MoE's routing and expert products
for a few rows, the expert choice read on the device.

GPU tests compare with decodex.reference on fresh random inputs: the route's ids exactly (ties and
NaN included) and its weights to fp32 rounding; the expert products within bf16 rounding of the
fp32 math, over odd sizes, repeated experts and both norms; ids outside [0, E) give NaN and read
nothing (compute-sanitizer memcheck runs this file); the three ops replayed in one CUDA graph while
the routing changes; opcheck; argument checks. CPU tests: schemas, fake impls, the reference.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph

bf16 = torch.bfloat16
# (M rows, E experts, k a row): one row; Qwen3-30B-A3B's routing (128, 8); odd E; k = E; batch 8.
ROUTES = [(1, 8, 2), (1, 128, 8), (3, 60, 4), (5, 7, 7), (8, 128, 8), (2, 1000, 32), (4, 33, 1)]
# (M, E, k, I, K): odd and real sizes (Qwen3-30B-A3B: I 768, K 2048), k = 32 (the most the ops
# take), and I = 1544, 2056 and 1536, where moe_gemv_sum walks each expert row in 3, 3 and 2 trips.
# moe_gemv_sum (K is its N) takes its three-buffer kernel up to 4 * SMs blocks (M * ceil(K / 8)),
# the two-buffer one above (on a 132-SM H100 or H200: the last two sizes and M = 8).
PRODUCTS = [(1, 4, 2, 8, 8), (1, 128, 8, 768, 2048), (3, 5, 3, 24, 264), (8, 16, 4, 136, 1000),
            (2, 3, 3, 1000, 72), (2, 40, 12, 64, 96), (1, 64, 32, 40, 24), (1, 4, 2, 1544, 72),
            (2, 6, 3, 2056, 40), (5, 16, 4, 768, 2048), (6, 8, 5, 1536, 1032)]


def _logits(M, E, scale=3.0):
    return (scale * torch.randn(M, E, device="cuda")).to(bf16)


def _route(logits, k, norm):
    ids = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device="cuda")
    weights = torch.full((logits.shape[0], k), float("nan"), device="cuda")
    torch.ops.decodex.moe_route(logits, k, norm, ids, weights)
    return ids, weights


def _check_route(ids, weights, logits, k, norm):
    want_ids, want_w = reference.moe_route(logits, k, norm)
    assert torch.equal(ids.cpu(), want_ids.cpu()), f"ids {ids.tolist()} != reference {want_ids.tolist()}"
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("M,E,k", ROUTES)
def test_moe_route_values(M, E, k, norm):
    logits = _logits(M, E)
    logits0 = logits.clone()
    ids, weights = _route(logits, k, norm)
    assert torch.equal(logits, logits0), "logits were modified"
    _check_route(ids, weights, logits, k, norm)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(M, device="cuda"), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_moe_route_ties_nan_and_strided_rows():
    """Equal logits go to the lower expert first; NaN ranks last in the choice (and makes every
    weight of its row NaN, as softmax does); rows may be strided."""
    E, k = 40, 5
    big = _logits(3, E + 8)
    logits = big[:, 4:4 + E]
    logits[0] = 1.0  # all tied: experts 0..k-1
    logits[1, [3, 17, 30]] = 9.0  # a three-way tie at the top
    logits[2, 5] = float("nan")
    ids, weights = _route(logits, k, True)
    _check_route(ids[:2], weights[:2], logits[:2], k, True)
    assert ids[0].tolist() == list(range(k)) and ids[1, :3].tolist() == [3, 17, 30]
    assert 5 not in ids[2].tolist() and torch.isnan(weights[2]).all()
    assert torch.equal(ids[2].cpu(), reference.moe_route(logits[2:], k, True)[0][0].cpu())


@pytest.mark.gpu
def test_moe_route_orders_signed_zeros_and_infinities():
    """Every expert chosen (k = E): -0 and +0 tie, as do NaN and -inf (NaN counts as -inf), each
    tie to the lower index."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, -0.0, nan, 0.0, -inf, 2.0, -inf, nan]], device="cuda").to(bf16)
    ids, _ = _route(logits, 8, False)
    assert ids[0].tolist() == [5, 0, 1, 3, 2, 4, 6, 7]
    assert torch.equal(ids.cpu(), reference.moe_route(logits, 8, False)[0].cpu())


def _experts(E, rows, K):
    return (torch.randn(E, rows, K, device="cuda") / K**0.5).to(bf16)


def _silu_out(M, k, I):
    return torch.full((M, k, I), float("nan"), device="cuda", dtype=bf16)


def _check_silu(out, x, w, ids, rms_eps):
    """Each (row, slot) within bf16 rounding of the fp32 product of its expert (as gemv_silu_mul's
    test: gate and up each rounded once, silu' <= 1.1, the output rounded once)."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    for m in range(x.shape[0]):
        for s, e in enumerate(ids[m].tolist()):
            gu = x[m].float() @ w[e].float().t()
            if rms_eps is not None:
                gu = gu * torch.rsqrt(x[m].float().pow(2).mean() + rms_eps)
            gate, up = gu.chunk(2)
            ref = torch.nn.functional.silu(gate) * up
            bound = 2.0**-7 * (1.1 * gate.abs() * up.abs() + ref.abs() + up.abs() * 0.01) + 1e-5
            err = (out[m, s].float() - ref).abs()
            assert (err <= bound).all(), f"row {m} slot {s} (expert {e}): max excess {float((err - bound).max()):.3g}"


def _sum_out(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=bf16)


def _check_sum(out, x, w, ids, weights, before=None):
    """Within one bf16 rounding of the fp32 weighted sum (plus fp32 summation slack, and one more
    rounding where it is added to `before`)."""
    assert torch.isfinite(out).all(), "some outputs were not written (NaN poison left)"
    for m in range(x.shape[0]):
        ref = torch.zeros(w.shape[1], device="cuda")
        mag = torch.zeros_like(ref)
        for s, (e, c) in enumerate(zip(ids[m].tolist(), weights[m].tolist())):
            ref += c * (x[m, s].float() @ w[e].float().t())
            mag += abs(c) * (x[m, s].float().abs() @ w[e].float().abs().t())
        bound = 2.0**-8 * ref.abs() + 1e-5 * mag + 1e-6
        if before is not None:
            ref = ref + before[m].float()
            bound = bound + 2.0**-8 * ref.abs()
        err = (out[m].float() - ref).abs()
        assert (err <= bound).all(), f"row {m}: max excess {float((err - bound).max()):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [None, 1e-6])
@pytest.mark.parametrize("M,E,k,I,K", PRODUCTS)
def test_moe_gemv_silu_mul_values(M, E, k, I, K, rms):
    x = (3.0 * torch.randn(M, K, device="cuda")).to(bf16)
    w = _experts(E, 2 * I, K)
    ids = torch.randint(0, E, (M, k), dtype=torch.int32, device="cuda")
    ids[0, -1] = ids[0, 0]  # an expert twice in a row (never from moe_route; still computed)
    x0, w0 = x.clone(), w.clone()
    out = _silu_out(M, k, I)
    torch.ops.decodex.moe_gemv_silu_mul(x, w, ids, out, rms_eps=rms)
    assert torch.equal(x, x0) and torch.equal(w, w0), "an input was modified"
    _check_silu(out, x, w, ids, rms)
    if rms is not None:  # the reference op's own definition
        torch.testing.assert_close(out.float(), reference.moe_gemv_silu_mul(x, w, ids, rms).float(),
                                   rtol=2.0**-6, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch_weight", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("M,E,k,I,N", PRODUCTS)
def test_moe_gemv_sum_values(M, E, k, I, N, accumulate, prefetch_weight):
    x = torch.randn(M, k, I, device="cuda").to(bf16)
    w = _experts(E, N, I)
    ids = torch.randint(0, E, (M, k), dtype=torch.int32, device="cuda")
    weights = torch.rand(M, k, device="cuda")
    before = torch.randn(M, N, device="cuda").to(bf16) if accumulate else None
    out = before.clone() if accumulate else _sum_out(M, N)
    torch.ops.decodex.moe_gemv_sum(x, w, ids, weights, out, accumulate=accumulate, prefetch_weight=prefetch_weight)
    _check_sum(out, x, w, ids, weights, before)
    want = reference.moe_gemv_sum(x, w, ids, weights, accumulate=before)
    torch.testing.assert_close(out.float(), want.float(), rtol=2.0**-7, atol=1e-3)


@pytest.mark.gpu
def test_moe_gemv_sum_strided_out():
    """out may be a view with wider rows (the decode step's residual is not); nothing outside it
    is written."""
    M, E, k, I, N = 3, 6, 2, 64, 40
    x, w = torch.randn(M, k, I, device="cuda").to(bf16), _experts(E, N, I)
    ids = torch.randint(0, E, (M, k), dtype=torch.int32, device="cuda")
    weights = torch.rand(M, k, device="cuda")
    big = _sum_out(M, N + 16)
    out = big[:, 8:8 + N]
    torch.ops.decodex.moe_gemv_sum(x, w, ids, weights, out)
    _check_sum(out, x, w, ids, weights)
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + N:]).all(), "wrote outside out"


@pytest.mark.gpu
def test_moe_bad_ids_give_nan_and_read_nothing():
    """An id outside [0, E) (a caller's bug: moe_route never writes one) is never dereferenced; its
    outputs are NaN. Run under compute-sanitizer memcheck (bench/h200.sh sanitize), a read outside
    weight would be reported."""
    M, E, k, I, K = 2, 4, 3, 64, 128
    x = torch.randn(M, K, device="cuda").to(bf16)
    gate_up, down = _experts(E, 2 * I, K), _experts(E, K, I)
    ids = torch.tensor([[0, -1, 2], [E, 1, 2**31 - 1]], dtype=torch.int32, device="cuda")
    act = _silu_out(M, k, I)
    torch.ops.decodex.moe_gemv_silu_mul(x, gate_up, ids, act)
    torch.cuda.synchronize()
    assert torch.isfinite(act[0, 0]).all() and torch.isfinite(act[0, 2]).all()
    assert torch.isnan(act[0, 1]).all() and torch.isnan(act[1, 0]).all() and torch.isnan(act[1, 2]).all()
    for prefetch_weight in (False, True):
        out = _sum_out(M, K)
        torch.ops.decodex.moe_gemv_sum(act.nan_to_num(), down, ids, torch.ones(M, k, device="cuda"), out,
                                       prefetch_weight=prefetch_weight)
        assert torch.isnan(out).all()


@pytest.mark.gpu
def test_moe_cuda_graph_follows_the_routing():
    """The three ops in one graph (as the decode step runs them, moe_gemv_sum reading the routing
    before its PDL wait): replayed with new logits, each replay routes anew and the products follow."""
    M, E, k, I, K = 2, 16, 4, 136, 256
    x = torch.randn(M, K, device="cuda").to(bf16)
    gate_up, down = _experts(E, 2 * I, K), _experts(E, K, I)
    logits = _logits(M, E)
    ids = torch.zeros(M, k, dtype=torch.int32, device="cuda")
    weights = torch.zeros(M, k, device="cuda")
    act, out = _silu_out(M, k, I), _sum_out(M, K)

    def step():
        ops = torch.ops.decodex
        ops.moe_route(logits, k, True, ids, weights)
        ops.moe_gemv_silu_mul(x, gate_up, ids, act, rms_eps=1e-6)
        ops.moe_gemv_sum(act, down, ids, weights, out, prefetch_weight=True)  # moe_route: two kernels ahead

    graph = capture_graph(step)
    seen = set()
    for _ in range(4):
        logits.copy_(_logits(M, E))
        x.copy_(torch.randn(M, K, device="cuda"))
        act.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_route(ids, weights, logits, k, True)
        _check_silu(act, x, gate_up, ids, 1e-6)
        _check_sum(out, act, down, ids, weights)
        seen.add(tuple(ids.flatten().tolist()))
    assert len(seen) > 1, "the routing never changed between replays"


@pytest.mark.gpu
def test_moe_opcheck():
    M, E, k, I, K = 2, 5, 2, 16, 32
    x, gate_up, down = torch.randn(M, K, device="cuda").to(bf16), _experts(E, 2 * I, K), _experts(E, K, I)
    ids = torch.randint(0, E, (M, k), dtype=torch.int32, device="cuda")
    weights = torch.rand(M, k, device="cuda")
    ops = torch.ops.decodex
    torch.library.opcheck(ops.moe_route.default, (_logits(M, E), k, True, ids.clone(), weights.clone()))
    torch.library.opcheck(ops.moe_gemv_silu_mul.default, (x, gate_up, ids, _silu_out(M, k, I)), {"rms_eps": 1e-6})
    for prefetch_weight in (False, True):
        torch.library.opcheck(ops.moe_gemv_sum.default, (_silu_out(M, k, I).normal_(), down, ids, weights,
                                                          _sum_out(M, K)), {"prefetch_weight": prefetch_weight})


@pytest.mark.gpu
def test_moe_rejects():
    M, E, k, I, K = 2, 5, 2, 16, 32
    ops = torch.ops.decodex
    x, gate_up, down = torch.randn(M, K, device="cuda").to(bf16), _experts(E, 2 * I, K), _experts(E, K, I)
    ids = torch.randint(0, E, (M, k), dtype=torch.int32, device="cuda")
    weights = torch.rand(M, k, device="cuda")
    act, out = _silu_out(M, k, I), _sum_out(M, K)

    def raises(match, fn):
        with pytest.raises(RuntimeError, match=match):
            fn()

    raises("top_k must be in 1", lambda: ops.moe_route(_logits(M, E), E + 1, True, ids, weights))
    raises("top_k must be in 1", lambda: ops.moe_route(_logits(M, E), 0, True, ids, weights))
    raises("experts\\) must be in 1..1024", lambda: ops.moe_route(_logits(M, 1025), 2, True, ids, weights))
    raises("logits must have dtype", lambda: ops.moe_route(_logits(M, E).float(), k, True, ids, weights))
    raises("ids must have shape \\[M, top_k\\]", lambda: ops.moe_route(_logits(M, E), 3, True, ids, weights))
    raises("ids must have dtype Int", lambda: ops.moe_route(_logits(M, E), k, True, ids.long(), weights))
    raises("weights must have dtype", lambda: ops.moe_route(_logits(M, E), k, True, ids, weights.double()))
    raises("weight.size\\(2\\) must equal x.size\\(1\\)",
           lambda: ops.moe_gemv_silu_mul(x, _experts(E, 2 * I, K + 8), ids, act))
    raises("K a positive multiple of 8", lambda: ops.moe_gemv_silu_mul(x[:, :12], _experts(E, 2 * I, 12), ids, act))
    raises("2I must be even", lambda: ops.moe_gemv_silu_mul(x, _experts(E, 2 * I + 1, K), ids, act))
    raises("out must have shape", lambda: ops.moe_gemv_silu_mul(x, gate_up, ids, act[:, :1]))
    raises("ids must have shape \\[M, k\\]", lambda: ops.moe_gemv_silu_mul(x, gate_up, ids[:1], act))
    raises("weight must be contiguous", lambda: ops.moe_gemv_silu_mul(x, gate_up.transpose(1, 2).contiguous()
                                                                        .transpose(1, 2), ids, act))
    raises("rms_eps must be finite", lambda: ops.moe_gemv_silu_mul(x, gate_up, ids, act, rms_eps=float("nan")))
    raises("out must not overlap", lambda: ops.moe_gemv_silu_mul(x, gate_up, ids, gate_up.view(-1)[:M * k * I]
                                                                   .view(M, k, I)))
    raises("weight.size\\(2\\) must equal x.size\\(2\\)", lambda: ops.moe_gemv_sum(act, _experts(E, K, I + 8), ids,
                                                                                  weights, out))
    raises("out must have shape \\[M, N\\]", lambda: ops.moe_gemv_sum(act, down, ids, weights, out[:, :8]))
    raises("weights must have dtype", lambda: ops.moe_gemv_sum(act, down, ids, weights.to(bf16), out))
    raises("ids must be a CUDA tensor", lambda: ops.moe_gemv_sum(act, down, ids.cpu(), weights, out))
    raises("out must not overlap", lambda: ops.moe_gemv_sum(act, down, ids, weights, act.view(-1)[:M * K]
                                                            .view(M, K)))


# ---------------------------------------------------------------- CPU

SCHEMAS = {
    "moe_route": "decodex::moe_route(Tensor logits, int top_k, bool norm_topk_prob, Tensor(a!) ids, "
                 "Tensor(b!) weights) -> ()",
    "moe_gemv_silu_mul": "decodex::moe_gemv_silu_mul(Tensor x, Tensor weight, Tensor ids, Tensor(a!) out, "
                         "float? rms_eps=None) -> ()",
    "moe_gemv_sum": "decodex::moe_gemv_sum(Tensor x, Tensor weight, Tensor ids, Tensor weights, Tensor(a!) out, "
                    "bool accumulate=False, bool prefetch_weight=False) -> ()",
}


@pytest.mark.ext
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_moe_schemas(name):
    assert str(getattr(torch.ops.decodex, name).default._schema) == SCHEMAS[name]


@pytest.mark.ext
def test_moe_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.decodex
    with FakeTensorMode():
        ids = torch.empty(2, 3, dtype=torch.int32, device="cuda")
        x = torch.empty(2, 64, dtype=bf16, device="cuda")
        act = torch.empty(2, 3, 16, dtype=bf16, device="cuda")
        assert ops.moe_route(torch.empty(2, 8, dtype=bf16, device="cuda"), 3, True, ids,
                             torch.empty(2, 3, device="cuda")) is None
        assert ops.moe_gemv_silu_mul(x, torch.empty(8, 32, 64, dtype=bf16, device="cuda"), ids, act) is None
        assert ops.moe_gemv_sum(act, torch.empty(8, 64, 16, dtype=bf16, device="cuda"), ids,
                                torch.empty(2, 3, device="cuda"), x) is None


def test_reference_moe_route_cpu():
    """Softmax over all experts, the top k by logit (ties to the lower index, NaN as -inf),
    renormalised."""
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, 0.5]])
    ids, w = reference.moe_route(logits, 3, False)
    assert ids.tolist() == [[1, 2, 0]] and ids.dtype == torch.int32
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(w[0], p[[1, 2, 0]])
    ids, w = reference.moe_route(logits, 3, True)
    torch.testing.assert_close(w[0], p[[1, 2, 0]] / p[[1, 2, 0]].sum())
    nan, inf = float("nan"), float("inf")
    ids, _ = reference.moe_route(torch.tensor([[1.0, -0.0, nan, 0.0, -inf, 2.0, -inf, nan]]), 8, False)
    assert ids.tolist() == [[5, 0, 1, 3, 2, 4, 6, 7]]


def test_reference_moe_equals_its_ops():
    """reference.moe (grouped by expert: what prompts take) equals the per-row ops it stands for."""
    M, E, k, I, K = 5, 6, 2, 8, 16
    x, router = torch.randn(M, K), torch.randn(E, K)
    gate_up, down = torch.randn(E, 2 * I, K) / 4, torch.randn(E, K, I) / 3
    ids, weights = reference.moe_route(reference.gemv(x, router, rms_eps=1e-6), k, True)
    act = reference.moe_gemv_silu_mul(x, gate_up, ids, rms_eps=1e-6)
    torch.testing.assert_close(reference.moe(x, router, gate_up, down, k, True, rms_eps=1e-6),
                               reference.moe_gemv_sum(act, down, ids, weights), rtol=1e-5, atol=1e-5)
