"""decodex::sample: one token per row of logits [B, V] (bf16 or fp32) with per-row temperature,
top_k, top_p, seed and position, exactly decodex.reference.sample's algorithm.

The kernel sums in another order than the reference (fp64 over e = p * Z instead of fp32 cumsums
of normalised p), so a token may differ only where the reference itself sits on a rounding edge:
u * total within a tiny band of a cumulative boundary of the chosen token, the running top-p mass
within a tiny band of top_p at the nucleus' edge, or another probability within a few ulps of the
nucleus threshold. `_reference` replays the reference's computation for each row, returns its token
and whether the row is on such an edge; a mismatch is allowed only there, and such cases are
counted and must be rare.

GPU tests: many (seed, position, temperature, top_k, top_p) combinations per row in one batch over
random logits of several sharpnesses, both dtypes, V from 10 to 151936; a distribution test (V = 10,
thousands of positions: frequencies vs the reference probabilities, and every draw equal to the
reference's); top_k = 1 and temperature = 0 equal to argmax; counts past the bf16 histogram's
16-bit fields (huge tie groups); unaligned rows; CUDA-graph replay with positions changed on the
device; opcheck; argument checks. CPU tests: schema, fake impl, dispatcher refusal, the splitmix64
draw against independently computed values.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from decodex import reference
from helpers import capture_graph

VS = [10, 1000, 32003, 151936]
DTYPES = [torch.bfloat16, torch.float32]
TEMPERATURES = [0.3, 0.7, 1.0, 1.6]
TOP_KS = [0, 1, 2, 20, 50, 1000, -1]
TOP_PS = [1.0, 0.95, 0.9, 0.5, 0.05, 0.0]
SCALES = [0.5, 2.0, 6.0]  # logit spread: nearly flat .. sharply peaked

BAND = 1e-5  # relative rounding band around cumulative boundaries (fp32 eps is 1.2e-7: ~100 ulps)
P_BAND = 1e-6  # relative band around the nucleus threshold probability (expf vs exp: ~2 ulps)


def _reference(row, t, k, pp, seed, pos):
    """reference.sample for one row (its own code, step by step) -> (token, on_edge, why)."""
    row = row.float().cpu()
    token = int(reference.sample(row[None], torch.tensor([t]), torch.tensor([k], dtype=torch.int32),
                                 torch.tensor([pp]), torch.tensor([seed]), torch.tensor([pos], dtype=torch.int32))[0])
    if t <= 0:
        return token, False, ""
    y = row / t
    keep = torch.ones_like(y, dtype=torch.bool)
    if 0 < k < y.numel():
        keep &= y >= y.topk(k).values[-1]
    p = torch.exp(y - y.max()) * keep
    p = p / p.sum()
    why = []
    if pp < 1.0:
        sp = p.sort(descending=True).values
        S = sp.cumsum(0)
        need = int((S < pp).sum()) + 1
        m = min(need, sp.numel()) - 1
        for i in (m - 1, m, m + 1):
            if 0 <= i < S.numel() and abs(float(S[i]) - pp) <= BAND:
                why.append(f"top-p sum S[{i}]={float(S[i]):.9g} vs top_p={pp}")
        thr = float(sp[m])
        near = (p != thr) & ((p - thr).abs() <= P_BAND * thr)
        if bool(near.any()):
            why.append(f"a probability within {P_BAND} of the nucleus threshold {thr:.6g}")
        keep &= p >= sp[m]
        p = p * keep
    csum = p.cumsum(0)
    total = float(csum[-1])
    x = reference.uniform(seed, pos) * total
    for i in (token - 1, token):
        if 0 <= i < csum.numel() and abs(float(csum[i]) - x) <= BAND * total:
            why.append(f"u * total = {x:.9g} vs csum[{i}] = {float(csum[i]):.9g}")
    return token, bool(why), "; ".join(why)


def _params(B, rng):
    t = [rng.choice(TEMPERATURES) for _ in range(B)]
    k = [rng.choice(TOP_KS) for _ in range(B)]
    p = [rng.choice(TOP_PS) for _ in range(B)]
    seed = [rng.randrange(-(2**63), 2**63) for _ in range(B)]
    pos = [rng.randrange(0, 40000) for _ in range(B)]
    return t, k, p, seed, pos


def _sample(logits, t, k, p, seed, pos):
    dev = logits.device
    out = torch.full((logits.shape[0],), -77, dtype=torch.int64, device=dev)  # poison
    torch.ops.decodex.sample(logits, torch.tensor(t, dtype=torch.float32, device=dev),
                             torch.tensor(k, dtype=torch.int32, device=dev),
                             torch.tensor(p, dtype=torch.float32, device=dev),
                             torch.tensor(seed, dtype=torch.int64, device=dev),
                             torch.tensor(pos, dtype=torch.int32, device=dev), out)
    return out.cpu().tolist()


def _compare(logits, t, k, p, seed, pos):
    """Every row's token equals the reference's unless the row is on a rounding edge. Returns the
    number of edge mismatches."""
    got = _sample(logits, t, k, p, seed, pos)
    edge_mismatches, bad = 0, []
    for b in range(logits.shape[0]):
        want, on_edge, why = _reference(logits[b], t[b], k[b], p[b], seed[b], pos[b])
        assert 0 <= got[b] < logits.shape[1], f"row {b}: token {got[b]} out of range (not written?)"
        if got[b] != want:
            if on_edge:
                edge_mismatches += 1
            else:
                bad.append(f"row {b} (t={t[b]}, k={k[b]}, p={p[b]}, seed={seed[b]}, pos={pos[b]}): "
                           f"got {got[b]}, want {want}")
    assert not bad, f"{len(bad)} tokens differ from reference.sample off any rounding edge:\n" + "\n".join(bad[:10])
    return edge_mismatches


# ---------------------------------------------------------------- GPU: against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VS)
def test_sample_matches_reference(V, dtype):
    rng = random.Random(V * 7 + (dtype == torch.float32))
    B = 48 if V >= 100000 else 96
    total_edges = 0
    for scale in SCALES:
        logits = (scale * torch.randn(B, V, device="cuda")).to(dtype)
        total_edges += _compare(logits, *_params(B, rng))
    assert total_edges <= max(2, 0.02 * B * len(SCALES)), f"{total_edges} edge mismatches: too many"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_per_row_params_in_one_batch(dtype):
    """The same logits row under different params in one batch: each row's token is its own."""
    V, B = 32003, 24
    base = (2.0 * torch.randn(1, V, device="cuda")).to(dtype)
    logits = base.repeat(B, 1)
    rng = random.Random(5)
    t, k, p, seed, pos = _params(B, rng)
    t[0], k[0], p[0] = 0.0, 50, 0.5  # greedy despite top_k / top_p
    t[1], k[1], p[1] = 1.0, 1, 1.0
    t[2], k[2], p[2] = 1.0, 0, 1.0  # plain softmax sampling
    t[3], k[3], p[3] = -1.0, 0, 1.0  # temperature < 0: greedy
    assert _compare(logits, t, k, p, seed, pos) <= 1
    got = _sample(logits, t, k, p, seed, pos)
    am = int(base.float().argmax())
    assert got[0] == am and got[3] == am


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_greedy_and_top_k_1_are_argmax(dtype):
    V, B = 151936, 16
    logits = (3.0 * torch.randn(B, V, device="cuda")).to(dtype)
    am = logits.float().argmax(-1)
    logits[torch.arange(B), am] += 1.0  # a unique maximum: top_k = 1 then keeps one token
    want = logits.float().argmax(-1).cpu().tolist()
    seeds = list(range(B))
    pos = [3 * b for b in range(B)]
    assert _sample(logits, [0.0] * B, [0] * B, [1.0] * B, seeds, pos) == want
    assert _sample(logits, [1.0] * B, [1] * B, [1.0] * B, seeds, pos) == want
    assert _sample(logits, [0.8] * B, [1] * B, [0.3] * B, seeds, pos) == want
    assert _sample(logits, [1.0] * B, [0] * B, [0.0] * B, seeds, pos) == want  # top_p = 0: the top token


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_distribution_small_vocab(dtype):
    """V = 10, 4 seeds x 4096 positions: frequencies match the reference probabilities (chi-square,
    deterministic draws, so a fixed pass/fail), tokens outside top-k / top-p never drawn, and the
    first 300 draws of each batch equal reference.sample's."""
    V, B = 10, 4096
    base = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.1, -1.5, 0.9, 1.7, -0.2, 0.4])
    t, k, p = 0.8, 7, 0.93
    logits = base.to(dtype).cuda().repeat(B, 1)  # row stride 10: unaligned rows, scalar loads
    # The reference's kept distribution.
    y = base.to(dtype).float() / t
    keep = y >= y.topk(k).values[-1]
    prob = torch.exp(y - y.max()) * keep
    prob = prob / prob.sum()
    sp = prob.sort(descending=True).values
    need = int((sp.cumsum(0) < p).sum()) + 1
    keep &= prob >= sp[need - 1]
    prob = prob * keep
    prob = prob / prob.sum()
    counts = torch.zeros(V)
    for seed in (0, 1, 123456789, -5):
        pos = list(range(B))
        got = _sample(logits, [t] * B, [k] * B, [p] * B, [seed] * B, pos)
        counts += torch.bincount(torch.tensor(got), minlength=V).float()
        for b in range(300):
            want, on_edge, _ = _reference(logits[b], t, k, p, seed, b)
            assert got[b] == want or on_edge, f"seed {seed} position {b}: got {got[b]}, want {want}"
    n = counts.sum()
    assert counts[~keep].sum() == 0, f"tokens outside top-k/top-p drawn: {counts.tolist()}"
    exp = prob[keep] * n
    chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 8 * math.sqrt(2 * df) + 10, f"chi-square {chi2:.1f} with {df} dof: {counts.tolist()} vs {exp.tolist()}"


@pytest.mark.gpu
def test_sample_huge_tie_groups():
    """bf16 histogram counts past 32767 (the 16-bit fields' overflow table): 70000 equal logits, and
    a row where every logit is equal (uniform over 151936 tokens); top-k inside the tie group."""
    V = 151936
    logits = (2.0 * torch.randn(3, V, device="cuda")).to(torch.bfloat16)
    idx = torch.randperm(V, device="cuda")
    logits[0, idx[:70000]] = -0.5
    logits[1] = 0.25
    logits[2, idx[:40000]] = 1.0
    logits[2, idx[40000:110000]] = 0.0
    rng = random.Random(9)
    edges = 0
    for _ in range(6):
        t, k, p, seed, pos = _params(3, rng)
        k = [rng.choice([0, 5000, 90000, 39999, 40000, 40001]) for _ in range(3)]
        edges += _compare(logits, t, k, p, seed, pos)
    # Row 1 (uniform over V) is always on a rounding edge (boundaries 1/V = 6.6e-6 apart, inside the
    # band); the kernel then draws floor(u * V), which the reference matches unless u * V is within
    # ~1% of an integer.
    assert edges <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_inf_and_nan_logits(dtype):
    """-inf logits are never drawn; a NaN logit is never drawn either (documented)."""
    V, B = 4099, 16
    logits = torch.randn(B, V, device="cuda").to(dtype)
    logits[:, ::2] = float("-inf")
    logits[:8, 5] = float("nan")
    rng = random.Random(3)
    t, k, p, seed, pos = _params(B, rng)
    t = [max(x, 0.3) for x in t]
    got = _sample(logits, t, k, p, seed, pos)
    for b, tok in enumerate(got):
        assert tok % 2 == 1 and not (b < 8 and tok == 5), f"row {b}: drew {tok}"
    _compare(logits[8:], t[8:], k[8:], p[8:], seed[8:], pos[8:])  # the NaN-free rows: exact


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_unaligned_and_strided_rows(dtype):
    big = (2.0 * torch.randn(5, 20011, device="cuda")).to(dtype)
    rng = random.Random(11)
    _compare(big[:, 1:20001], *_params(5, rng))  # unaligned rows: scalar loads
    _compare(big[:, 8:20008], *_params(5, rng))


@pytest.mark.gpu
def test_sample_cuda_graph():
    """Captured once; replays with new positions (and logits) written on the device draw the
    reference's tokens for the new positions."""
    V, B = 151936, 4
    logits = (1.5 * torch.randn(B, V, device="cuda")).to(torch.bfloat16)
    t = torch.tensor([0.7, 1.0, 0.0, 1.3], device="cuda")
    k = torch.tensor([0, 50, 0, 1000], dtype=torch.int32, device="cuda")
    p = torch.tensor([0.9, 1.0, 1.0, 0.8], device="cuda")
    seed = torch.tensor([1, 2, 3, -4], dtype=torch.int64, device="cuda")
    pos = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.zeros(B, dtype=torch.int64, device="cuda")
    graph = capture_graph(lambda: torch.ops.decodex.sample(logits, t, k, p, seed, pos, out))
    edges, drawn = 0, set()
    for step in range(8):
        pos.copy_(torch.tensor([step, 100 + step, 7, 5000 - step], dtype=torch.int32, device="cuda"))
        if step == 4:
            logits.copy_((1.5 * torch.randn(B, V, device="cuda")).to(torch.bfloat16))
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        for b in range(B):
            want, on_edge, _ = _reference(logits[b], float(t[b]), int(k[b]), float(p[b]), int(seed[b]), int(pos[b]))
            got = int(out[b])
            drawn.add((b, got))
            if got != want:
                assert on_edge, f"step {step} row {b}: got {got}, want {want}"
                edges += 1
    assert edges <= 1
    assert len({tok for b, tok in drawn if b == 0}) > 1, "row 0 drew the same token at every position"


@pytest.mark.gpu
def test_sample_opcheck():
    B, V = 3, 1000
    dev = "cuda"
    args = ((2.0 * torch.randn(B, V, device=dev)).to(torch.bfloat16), torch.tensor([0.5, 1.0, 0.0], device=dev),
            torch.tensor([0, 5, 0], dtype=torch.int32, device=dev), torch.tensor([0.9, 1.0, 1.0], device=dev),
            torch.tensor([1, 2, 3], dtype=torch.int64, device=dev), torch.tensor([0, 1, 2], dtype=torch.int32, device=dev),
            torch.empty(B, dtype=torch.int64, device=dev))
    torch.library.opcheck(torch.ops.decodex.sample.default, args)


def _good_args(B=2, V=100):
    dev = "cuda"
    return dict(logits=torch.randn(B, V, device=dev).to(torch.bfloat16),
                temperature=torch.ones(B, device=dev), top_k=torch.zeros(B, dtype=torch.int32, device=dev),
                top_p=torch.ones(B, device=dev), seed=torch.zeros(B, dtype=torch.int64, device=dev),
                positions=torch.zeros(B, dtype=torch.int32, device=dev),
                out=torch.empty(B, dtype=torch.int64, device=dev))


def _raises(match, **overrides):
    a = _good_args()
    a.update(overrides)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.sample(a["logits"], a["temperature"], a["top_k"], a["top_p"], a["seed"],
                                 a["positions"], a["out"])


@pytest.mark.gpu
def test_sample_rejects():
    a = _good_args()
    _raises("logits must have dtype", logits=a["logits"].half())
    _raises("logits must be 2-D", logits=a["logits"][0])
    _raises("logits must be contiguous along V", logits=torch.randn(100, 2, device="cuda").to(torch.bfloat16).t())
    _raises("V = logits.size", logits=torch.zeros(2, 1 << 19, device="cuda", dtype=torch.bfloat16))
    _raises("temperature must have dtype", temperature=a["temperature"].double())
    _raises("top_k must have dtype", top_k=a["top_k"].long())
    _raises("top_p must have dtype", top_p=a["top_p"].half())
    _raises("seed must have dtype", seed=a["seed"].int())
    _raises("positions must have dtype", positions=a["positions"].long())
    _raises("temperature must have shape", temperature=torch.ones(3, device="cuda"))
    _raises("positions must have shape", positions=torch.zeros(1, dtype=torch.int32, device="cuda"))
    _raises("top_k must be a CUDA tensor", top_k=a["top_k"].cpu())
    _raises("out must have dtype", out=a["out"].int())
    _raises("out must have shape", out=torch.empty(3, dtype=torch.int64, device="cuda"))
    _raises("out must be a CUDA tensor", out=a["out"].cpu())


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_sample_schema():
    s = str(torch.ops.decodex.sample.default._schema)
    assert s == ("decodex::sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
                 "Tensor positions, Tensor(a!) out) -> ()"), s


def _meta_args(device):
    B, V = 3, 1000
    return (torch.empty(B, V, device=device, dtype=torch.bfloat16), torch.empty(B, device=device),
            torch.empty(B, device=device, dtype=torch.int32), torch.empty(B, device=device),
            torch.empty(B, device=device, dtype=torch.int64), torch.empty(B, device=device, dtype=torch.int32),
            torch.empty(B, device=device, dtype=torch.int64))


@pytest.mark.ext
def test_sample_fake_and_meta():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert torch.ops.decodex.sample(*_meta_args("cuda")) is None
    torch.library.opcheck(torch.ops.decodex.sample.default, _meta_args("meta"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_sample_cpu_tensors_refused():
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.sample(*_meta_args("cpu"))


def _splitmix64_independent(x):
    """splitmix64 written from its published definition (Steele, Lea, Flood 2014)."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_reference_uniform_is_24_bit_splitmix():
    """The draw the kernel reproduces: 24 high bits of splitmix64(splitmix64(seed) + position), with
    seeds and positions taken as 64-bit two's complement; exact multiples of 2^-24 in [0, 1)."""
    # Known value of the first splitmix64 output from state 0 (the generator's standard test vector).
    assert _splitmix64_independent(0) == 0xE220A8397B1DCDAF
    m = (1 << 64) - 1
    for seed, pos in [(0, 0), (1, 5), (-1, 0), (2**63 - 1, 40000), (-(2**63), 7), (12345, -3)]:
        h = _splitmix64_independent((_splitmix64_independent(seed & m) + (pos & m)) & m)
        u = reference.uniform(seed, pos)
        assert u == (h >> 40) / 2**24 and 0.0 <= u < 1.0
        assert u * 2**24 == int(u * 2**24)
