"""decodex::rope_append: half-split RoPE on q [B, H, D] and k [B, Hkv, D] in place at positions [B],
then k and v written into k_cache / v_cache [B, Hkv, S, D] at row positions[b].

GPU tests compare to decodex.reference (fp32) at positions 0, 1, 4095, 32767 with plain and
Llama-3-scaled inv_freq, q/k/v as strided views of a merged qkv buffer, the prefill write through an
expanded (stride-0) cache, skipped rows (negative position), positions >= S (nothing written: the
cache sits between guard regions that must stay untouched), CUDA-graph replay with positions changed
on the device, opcheck, and every argument check. CPU tests: schema, fake impl, dispatcher refusal.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph, qkv_views

# (H, Hkv, D): Qwen2.5-1.5B, Qwen2.5-7B, Llama-3-8B, SmolLM2-135M-like, an odd small one.
HEADS = [(12, 2, 128), (28, 4, 128), (32, 8, 128), (9, 3, 64), (3, 1, 16)]
BS = [1, 3, 8]
THETA = 1_000_000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

# Tolerance, bf16 output vs the fp32 reference rope: RTOL = 2^-8 (one rounding to bf16) plus an
# absolute term for cos/sin: both sides compute cos/sin of the same fp32 angle with correctly
# range-reduced functions (CUDA's precise sincosf: 2 ulp; torch CPU: 1 ulp), so the rotated value
# differs by ~1e-7 * (|x1| + |x2|) before rounding; 1e-5 * max|x| of the row covers that 100x.
RTOL = 2.0**-8


def _bf16(*shape, device="cuda"):
    return torch.randn(*shape, device=device).to(torch.bfloat16)


def _inv_freq(D, scaled=False, device="cuda"):
    return reference.rope_inv_freq(D, THETA, LLAMA3 if scaled else None).to(device)


def _rope_ref(x, pos, inv_freq):
    """fp32 rotated x [heads, D] at an int position (reference.rope on the fp32 values)."""
    return reference.rope(x.float().cpu(), torch.tensor(pos), inv_freq.cpu())


def _check_rot(got, x_before, pos, inv_freq, what):
    ref = _rope_ref(x_before, pos, inv_freq)
    got = got.float().cpu()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    bound = RTOL * ref.abs() + 1e-5 * x_before.float().abs().max().cpu() + 1e-7
    err = (got - ref).abs()
    if (err > bound).any():
        i = int((err - bound).argmax())
        h, d = divmod(i, err.shape[-1])
        raise AssertionError(f"{what} at position {pos}: [{h}, {d}] got {float(got[h, d]):.6g}, "
                             f"reference {float(ref[h, d]):.6g}")


def _run_and_check(q, k, v, inv_freq, positions, kc, vc):
    """Runs the kernel and checks q, k, the two caches (written row and all others) against the
    reference, for positions in [-inf, S)."""
    q0, k0, v0, kc0, vc0 = q.clone(), k.clone(), v.clone(), kc.clone(), vc.clone()
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc)
    torch.cuda.synchronize()
    assert torch.equal(v, v0), "v was modified"
    want_kc, want_vc = kc0.clone(), vc0.clone()
    for b, pos in enumerate(positions.tolist()):
        if pos < 0:
            assert torch.equal(q[b], q0[b]) and torch.equal(k[b], k0[b]), f"row {b} (skipped) was modified"
            continue
        _check_rot(q[b], q0[b], pos, inv_freq, f"q row {b}")
        _check_rot(k[b], k0[b], pos, inv_freq, f"k row {b}")
        want_kc[b, :, pos] = k[b]  # the cache row is the kernel's own rotated k, bit for bit
        want_vc[b, :, pos] = v0[b]
    assert torch.equal(kc, want_kc), "k_cache differs (wrong row written, or another row touched)"
    assert torch.equal(vc, want_vc), "v_cache differs (wrong row written, or another row touched)"


# ---------------------------------------------------------------- GPU: values


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", HEADS)
@pytest.mark.parametrize("B", BS)
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_append_values(H, Hkv, D, B, scaled):
    S = 4133
    q, k, v = _bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D)
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.tensor([0, 1, 4095, 4132, 17, 2, 3000, 9][:B], dtype=torch.int32, device="cuda")
    _run_and_check(q, k, v, _inv_freq(D, scaled), positions, kc, vc)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_append_large_positions(D, scaled):
    """Angles up to 32767 rad (and 131071 with theta's fastest frequency 1): the precise sincosf's
    range reduction, where __sinf would be far off."""
    S = 131072
    H, Hkv, B = 4, 1, 5
    q, k, v = _bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D)
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.tensor([0, 1, 4095, 32767, 131071], dtype=torch.int32, device="cuda")
    _run_and_check(q, k, v, _inv_freq(D, scaled), positions, kc, vc)


@pytest.mark.gpu
def test_rope_append_matches_reference_function():
    """The whole op against reference.rope_append (q, k and both caches), bf16 outputs compared
    within one bf16 ulp (cos/sin may differ in the last fp32 bit and flip a rounding)."""
    B, H, Hkv, D, S = 3, 12, 2, 128, 300
    q, k, v = _bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D)
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    inv_freq = _inv_freq(D)
    positions = torch.tensor([5, -1, 299], dtype=torch.int32, device="cuda")
    kc_ref, vc_ref = kc.cpu(), vc.cpu()
    q_ref, k_ref = reference.rope_append(q.cpu(), k.cpu(), v.cpu(), inv_freq.cpu(), positions.cpu(), kc_ref, vc_ref)
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc)
    for got, want in ((q, q_ref), (k, k_ref), (kc, kc_ref), (vc, vc_ref)):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2.0**-7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (28, 4, 128), (9, 3, 64)])
def test_rope_append_merged_qkv_views(H, Hkv, D):
    """q, k, v strided views of the QKV GEMV output; nothing outside q and k changes in the buffer."""
    B, S = 5, 77
    qkv, q, k, v = qkv_views(B, H, Hkv, D)
    v_before = v.clone()
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.tensor([3, 0, -1, 76, 40], dtype=torch.int32, device="cuda")
    _run_and_check(q, k, v, _inv_freq(D), positions, kc, vc)
    assert torch.equal(qkv[:, (H + Hkv) * D :].view(B, Hkv, D), v_before)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 300])
def test_rope_append_prefill_expanded_cache(T):
    """Prefill: a prompt's T tokens into cache slot s through cache[s:s+1].expand(T, ...) (stride 0)
    with positions = arange(T). Other slots and rows >= T stay as they were."""
    slots, H, Hkv, D, S, s = 4, 12, 2, 128, 512, 2
    k_cache, v_cache = _bf16(slots, Hkv, S, D), _bf16(slots, Hkv, S, D)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    _, q, k, v = qkv_views(T, H, Hkv, D)
    q0, k0 = q.clone(), k.clone()
    inv_freq = _inv_freq(D)
    positions = torch.arange(T, dtype=torch.int32, device="cuda")
    kc = k_cache[s : s + 1].expand(T, Hkv, S, D)
    vc = v_cache[s : s + 1].expand(T, Hkv, S, D)
    assert kc.stride(0) == 0 or T == 1  # expand() keeps the stride of a dim that stays size 1
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc)
    torch.cuda.synchronize()
    for t in range(T):
        _check_rot(q[t], q0[t], t, inv_freq, f"q token {t}")
        _check_rot(k[t], k0[t], t, inv_freq, f"k token {t}")
    want_k, want_v = kc0.clone(), vc0.clone()
    want_k[s, :, :T] = k.transpose(0, 1)
    want_v[s, :, :T] = v.transpose(0, 1)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.gpu
def test_rope_append_positions_past_capacity_write_nothing():
    """positions[b] >= S must never write (not even past the cache's end): the caches sit inside
    larger buffers whose guard regions are checked untouched; those rows keep q and k unrotated.
    A negative position skips its row too; the one valid row is applied."""
    B, H, Hkv, D, S, G = 4, 4, 2, 64, 16, 4096
    n = B * Hkv * S * D
    kbuf, vbuf = _bf16(n + 2 * G), _bf16(n + 2 * G)
    kb0, vb0 = kbuf.clone(), vbuf.clone()
    kc, vc = kbuf[G : G + n].view(B, Hkv, S, D), vbuf[G : G + n].view(B, Hkv, S, D)
    q, k, v = _bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([S, S + 1000, -7, 3], dtype=torch.int32, device="cuda")
    torch.ops.decodex.rope_append(q, k, v, _inv_freq(D), positions, kc, vc)
    torch.cuda.synchronize()
    for b in range(3):
        assert torch.equal(q[b], q0[b]) and torch.equal(k[b], k0[b]), f"row {b} was modified"
    _check_rot(k[3], k0[3], 3, _inv_freq(D), "k row 3")
    want_k, want_v = kb0.clone(), vb0.clone()
    want_k[G : G + n].view(B, Hkv, S, D)[3, :, 3] = k[3]
    want_v[G : G + n].view(B, Hkv, S, D)[3, :, 3] = v[3]
    assert torch.equal(kbuf, want_k), "k buffer changed outside the one valid row"
    assert torch.equal(vbuf, want_v), "v buffer changed outside the one valid row"


@pytest.mark.gpu
def test_rope_append_all_rows_skipped():
    B, H, Hkv, D, S = 3, 4, 2, 128, 8
    q, k, v = _bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D)
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    before = [t.clone() for t in (q, k, kc, vc)]
    positions = torch.full((B,), -1, dtype=torch.int32, device="cuda")
    torch.ops.decodex.rope_append(q, k, v, _inv_freq(D), positions, kc, vc)
    for t, t0 in zip((q, k, kc, vc), before):
        assert torch.equal(t, t0)


@pytest.mark.gpu
def test_rope_append_opcheck():
    B, H, Hkv, D, S = 2, 4, 2, 64, 16
    args = (_bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D), _inv_freq(D),
            torch.tensor([1, 5], dtype=torch.int32, device="cuda"), _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D))
    torch.library.opcheck(torch.ops.decodex.rope_append.default, args)


@pytest.mark.gpu
def test_rope_append_cuda_graph():
    """Captured once; each replay gets fresh q/k/v and new positions written on the device."""
    B, H, Hkv, D, S = 3, 12, 2, 128, 64
    inv_freq = _inv_freq(D, scaled=True)
    qkv, q, k, v = qkv_views(B, H, Hkv, D)
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.zeros(B, dtype=torch.int32, device="cuda")
    graph = capture_graph(lambda: torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc))
    for step, pos in enumerate(([0, 1, 2], [63, -1, 5], [10, 20, 30])):
        qkv.copy_(_bf16(*qkv.shape))
        q0, k0, kc0, vc0 = q.clone(), k.clone(), kc.clone(), vc.clone()
        positions.copy_(torch.tensor(pos, dtype=torch.int32, device="cuda"))  # device-side change
        graph.replay()
        torch.cuda.synchronize()
        want_kc, want_vc = kc0.clone(), vc0.clone()
        for b, p in enumerate(pos):
            if p < 0:
                assert torch.equal(q[b], q0[b]) and torch.equal(k[b], k0[b])
                continue
            _check_rot(q[b], q0[b], p, inv_freq, f"replay {step} q row {b}")
            _check_rot(k[b], k0[b], p, inv_freq, f"replay {step} k row {b}")
            want_kc[b, :, p] = k[b]
            want_vc[b, :, p] = v[b]
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (28, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("B", [1, 5, 64])
@pytest.mark.parametrize("with_rms,with_bias", [(True, True), (True, False), (False, True)])
def test_rope_append_rms_and_bias(H, Hkv, D, B, with_rms, with_bias):
    """rms_x / bias (the cuBLAS qkv path of the batched decode step): q, k rotated from the scaled,
    biased rows; both caches get the scaled rows; v and rms_x are not modified; a skipped row is
    left alone."""
    S, K = 300, 1536
    qkv = (30.0 * torch.randn(B, (H + 2 * Hkv) * D, device="cuda")).to(torch.bfloat16)
    q = qkv[:, : H * D].view(B, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(B, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(B, Hkv, D)
    x = (3.0 * torch.randn(B, K, device="cuda")).to(torch.bfloat16) if with_rms else None
    bias = _bf16((H + 2 * Hkv) * D) if with_bias else None
    eps = 1e-6 if with_rms else None
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.tensor([(37 * b + 3) % S for b in range(B)], dtype=torch.int32, device="cuda")
    if B > 1:
        positions[B // 2] = -1  # a skipped row (with one row, it would be the only one)
    inv_freq = _inv_freq(D)
    want = reference.scale_rows(qkv, torch.bfloat16, x, eps, bias).view(B, H + 2 * Hkv, D)
    qkv0, kc0, vc0 = qkv.clone(), kc.clone(), vc.clone()
    x0 = x.clone() if x is not None else None
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc, rms_x=x, rms_eps=eps, bias=bias)
    torch.cuda.synchronize()
    assert torch.equal(v, qkv0[:, (H + Hkv) * D :].view(B, Hkv, D)), "v was modified"
    assert x is None or torch.equal(x, x0), "rms_x was modified"
    # The scaled rows can differ from the test's by one bf16 rounding (the kernel's 1/rms is rsqrtf
    # of a sum in another order): 2^-7 relative, then rotated.
    tol = dict(rtol=2.0**-7 + 2.0**-8, atol=1e-2)
    want_kc, want_vc = kc0.clone(), vc0.clone()
    for b, pos in enumerate(positions.tolist()):
        if pos < 0:
            assert torch.equal(qkv[b], qkv0[b]), f"row {b} (skipped) was modified"
            continue
        p = torch.tensor(pos)
        for got, heads, what in ((q[b], want[b, :H], "q"), (k[b], want[b, H : H + Hkv], "k")):
            ref = reference.rope(heads.float().cpu(), p, inv_freq.cpu())
            torch.testing.assert_close(got.float().cpu(), ref, **tol, msg=f"{what} row {b}")
        want_kc[b, :, pos] = k[b]  # the cache row is the kernel's own rotated k
        torch.testing.assert_close(vc[b, :, pos].float(), want[b, H + Hkv :].float(), **tol)
        want_vc[b, :, pos] = vc[b, :, pos]
    assert torch.equal(kc, want_kc), "k_cache differs (wrong row written, or another row touched)"
    assert torch.equal(vc, want_vc), "v_cache: a row other than the positions' was touched"


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(16, 8, 128), (64, 8, 128), (12, 2, 128), (9, 3, 64), (3, 1, 16), (2, 1, 512)])
@pytest.mark.parametrize("B", [1, 5, 40])
@pytest.mark.parametrize("with_rms", [False, True])
def test_rope_append_head_norms(H, Hkv, D, B, with_rms):
    """q_norm / k_norm (Qwen3): each q and k head RMS-normalised with its weight before RoPE (after
    the rms_x / bias step when given), v and its cache row not normalised; against
    decodex.reference.rope_append. Qwen3-0.6B's and -32B's heads ((64, 8, 128): 640 work items, more
    than a block's 512 threads, so a second, partly filled pass), 40 rows, and (2, 1, 512), whose
    heads fill whole warps. Head 0 of q and k is tiny, so norm_eps (1e-4, not rms_eps) shows."""
    S, K, rms_eps, norm_eps = 300, 1536, 1e-6, 1e-4
    qkv, q, k, v = qkv_views(B, H, Hkv, D)
    qkv.mul_(30.0)  # far from the unit rms the norm gives
    q[:, 0].mul_(1e-4)
    k[:, 0].mul_(1e-4)
    x = (3.0 * torch.randn(B, K, device="cuda")).to(torch.bfloat16) if with_rms else None
    bias = _bf16((H + 2 * Hkv) * D) * 1e-3 if with_rms else None
    q_norm, k_norm = (1.0 + 0.3 * torch.randn(2, D, device="cuda")).to(torch.bfloat16).unbind(0)
    q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    kc, vc = _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D)
    positions = torch.tensor([(37 * b + 3) % S for b in range(B)], dtype=torch.int32, device="cuda")
    if B > 1:
        positions[B // 2] = -1  # a skipped row
    inv_freq = _inv_freq(D)
    scale = dict(rms_x=x, rms_eps=rms_eps if with_rms else None, bias=bias)
    args = [t.clone() for t in (q, k, v)] + [inv_freq, positions, kc.clone(), vc.clone()]
    want_q, want_k = reference.rope_append(*args, **scale, q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps)
    want_kc, want_vc = args[5], args[6]
    qkv0 = qkv.clone()
    torch.ops.decodex.rope_append(q, k, v, inv_freq, positions, kc, vc, **scale, q_norm=q_norm, k_norm=k_norm,
                                  norm_eps=norm_eps)
    torch.cuda.synchronize()
    assert torch.equal(v, qkv0[:, (H + Hkv) * D :].view(B, Hkv, D)), "v was modified"
    # Only the order of a head's sum of squares differs from the reference: a bf16 rounding now and
    # then (tolerance), and rarely (count).
    tol = dict(rtol=2.0**-7 + 2.0**-8, atol=2e-2)
    differ = total = 0
    for b, pos in enumerate(positions.tolist()):
        if pos < 0:
            assert torch.equal(qkv[b], qkv0[b]), f"row {b} (skipped) was modified"
            continue
        for got, want, what in ((q[b], want_q[b], "q"), (k[b], want_k[b], "k")):
            torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"{what} row {b}")
            differ, total = differ + int((got != want).sum()), total + got.numel()
        torch.testing.assert_close(kc[b, :, pos], k[b], rtol=0, atol=0, msg=f"k_cache row {b}")
        if with_rms:  # v scaled and biased: one rounding may differ
            torch.testing.assert_close(vc[b, :, pos].float(), want_vc[b, :, pos].float(), **tol)
        else:
            assert torch.equal(vc[b, :, pos], want_vc[b, :, pos]), f"v_cache row {b}"
        want_kc[b, :, pos] = kc[b, :, pos]
        want_vc[b, :, pos] = vc[b, :, pos]
    assert differ <= 1e-3 * total + 2, f"{differ} of {total} q/k values differ from the reference"
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), "a cache row other than the positions' changed"
    # Normalised heads have rms ~ 1 before the weight: far from the raw product's ~30.
    live = positions >= 0
    assert (q[live].float().pow(2).mean(-1).sqrt() < 3).all()


@pytest.mark.gpu
def test_rope_append_head_norms_rejects():
    a = _args()
    call = lambda **kw: torch.ops.decodex.rope_append(a["q"], a["k"], a["v"], a["inv_freq"], a["positions"],
                                                      a["k_cache"], a["v_cache"], **kw)
    w = _bf16(64)
    with pytest.raises(RuntimeError, match="q_norm, k_norm and norm_eps go together"):
        call(q_norm=w, norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="q_norm, k_norm and norm_eps go together"):
        call(q_norm=w, k_norm=w)
    with pytest.raises(RuntimeError, match=r"k_norm must have shape \[64\]"):
        call(q_norm=w, k_norm=_bf16(128), norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="q_norm must have dtype BFloat16"):
        call(q_norm=w.float(), k_norm=w, norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="q_norm must be a CUDA tensor"):
        call(q_norm=w.cpu(), k_norm=w, norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="k_norm must be contiguous and 16-byte aligned"):
        call(q_norm=w, k_norm=_bf16(65)[1:], norm_eps=1e-6)
    with pytest.raises(RuntimeError, match="rope_append: norm_eps must be finite and >= 0"):
        call(q_norm=w, k_norm=w, norm_eps=float("nan"))
    with pytest.raises(RuntimeError, match="rope_append: q_norm must not overlap q, k or the caches"):
        call(q_norm=a["q"][0, 0], k_norm=w, norm_eps=1e-6)  # a head of q, written in place
    D, B, H, Hkv, S = 48, 2, 4, 2, 16  # 3 work items a head: not a power of two
    with pytest.raises(RuntimeError, match="q_norm / k_norm need a head dim of 16, 32, 64, 128, 256 or 512"):
        torch.ops.decodex.rope_append(_bf16(B, H, D), _bf16(B, Hkv, D), _bf16(B, Hkv, D), _inv_freq(D),
                                      a["positions"], _bf16(B, Hkv, S, D), _bf16(B, Hkv, S, D),
                                      q_norm=_bf16(D), k_norm=_bf16(D), norm_eps=1e-6)


@pytest.mark.gpu
def test_rope_append_rms_rejects():
    a = _args()
    ops = torch.ops.decodex
    call = lambda **kw: ops.rope_append(a["q"], a["k"], a["v"], a["inv_freq"], a["positions"], a["k_cache"],
                                        a["v_cache"], **kw)
    x = _bf16(2, 64)
    with pytest.raises(RuntimeError, match="rms_x and rms_eps go together"):
        call(rms_x=x)
    with pytest.raises(RuntimeError, match="rms_x must have shape"):
        call(rms_x=_bf16(3, 64), rms_eps=1e-6)
    with pytest.raises(RuntimeError, match="rms_x must have dtype"):
        call(rms_x=x.float(), rms_eps=1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="rope_append: rms_eps must be finite and >= 0"):
            call(rms_x=x, rms_eps=bad)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        call(bias=_bf16(7))
    with pytest.raises(RuntimeError, match="bias must have dtype"):
        call(bias=_bf16((4 + 4) * 64).float())
    with pytest.raises(RuntimeError, match="bias must be a CUDA tensor"):
        call(bias=_bf16((4 + 4) * 64).cpu())


# ---------------------------------------------------------------- GPU: argument checks


def _args(B=2, H=4, Hkv=2, D=64, S=16):
    return dict(q=_bf16(B, H, D), k=_bf16(B, Hkv, D), v=_bf16(B, Hkv, D), inv_freq=_inv_freq(D),
                positions=torch.tensor(list(range(B)), dtype=torch.int32, device="cuda"),
                k_cache=_bf16(B, Hkv, S, D), v_cache=_bf16(B, Hkv, S, D))


def _raises(match, **overrides):
    a = _args()
    a.update(overrides)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.rope_append(a["q"], a["k"], a["v"], a["inv_freq"], a["positions"], a["k_cache"],
                                      a["v_cache"])


@pytest.mark.gpu
def test_rope_append_rejects():
    B, H, Hkv, D, S = 2, 4, 2, 64, 16
    a = _args()
    _raises("multiple of 16", q=_bf16(B, H, 40), k=_bf16(B, Hkv, 40), v=_bf16(B, Hkv, 40),
            inv_freq=_inv_freq(40), k_cache=_bf16(B, Hkv, S, 40), v_cache=_bf16(B, Hkv, S, 40))
    _raises("q must have dtype", q=a["q"].float())
    _raises("k must have dtype", k=a["k"].half())
    _raises("v_cache must have dtype", v_cache=a["v_cache"].float())
    _raises("positions must have dtype", positions=a["positions"].long())
    _raises("inv_freq must have dtype", inv_freq=a["inv_freq"].double())
    _raises("inv_freq must have shape", inv_freq=_inv_freq(128))
    _raises("positions must have shape", positions=torch.zeros(3, dtype=torch.int32, device="cuda"))
    _raises("v must have Hkv", v=_bf16(B, Hkv + 1, D))
    _raises("k must have shape", k=_bf16(B + 1, Hkv, D))
    _raises("k_cache must have shape", k_cache=_bf16(B, Hkv + 1, S, D))
    _raises("v_cache must have shape", v_cache=_bf16(B, Hkv, S + 1, D))
    _raises("q must be contiguous within a row", q=_bf16(B, D, H).transpose(1, 2))
    _raises("k_cache must be contiguous in its inner", k_cache=_bf16(B, S, Hkv, D).transpose(1, 2))
    _raises("q must be 16-byte aligned", q=_bf16(B * H * D + 1)[1:].view(B, H, D))
    _raises("q row stride must be a multiple of 8", q=_bf16(B, H * D + 4)[:, : H * D].view(B, H, D))
    _raises("positions must be on", positions=a["positions"].cpu())
    _raises("inv_freq must be on", inv_freq=a["inv_freq"].cpu())
    _raises("k_cache must be a CUDA tensor", k_cache=a["k_cache"].cpu())
    _raises("3-D", q=a["q"][0])


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_rope_append_schema():
    s = str(torch.ops.decodex.rope_append.default._schema)
    assert s == ("decodex::rope_append(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor inv_freq, Tensor positions, "
                 "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor? rms_x=None, float? rms_eps=None, "
                 "Tensor? bias=None, Tensor? q_norm=None, Tensor? k_norm=None, float? norm_eps=None) -> ()"), s


@pytest.mark.ext
def test_rope_append_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        B, H, Hkv, D, S = 2, 4, 2, 64, 16
        bf = dict(device="cuda", dtype=torch.bfloat16)
        out = torch.ops.decodex.rope_append(
            torch.empty(B, H, D, **bf), torch.empty(B, Hkv, D, **bf), torch.empty(B, Hkv, D, **bf),
            torch.empty(D // 2, device="cuda"), torch.empty(B, device="cuda", dtype=torch.int32),
            torch.empty(B, Hkv, S, D, **bf), torch.empty(B, Hkv, S, D, **bf))
        assert out is None


@pytest.mark.ext
def test_rope_append_meta_opcheck():
    B, H, Hkv, D, S = 2, 4, 2, 64, 16
    bf = dict(device="meta", dtype=torch.bfloat16)
    args = (torch.empty(B, H, D, **bf), torch.empty(B, Hkv, D, **bf), torch.empty(B, Hkv, D, **bf),
            torch.empty(D // 2, device="meta"), torch.empty(B, device="meta", dtype=torch.int32),
            torch.empty(B, Hkv, S, D, **bf), torch.empty(B, Hkv, S, D, **bf))
    torch.library.opcheck(torch.ops.decodex.rope_append.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_rope_append_cpu_tensors_refused():
    B, H, Hkv, D, S = 2, 4, 2, 64, 16
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.rope_append(_bf16(B, H, D, device="cpu"), _bf16(B, Hkv, D, device="cpu"),
                                      _bf16(B, Hkv, D, device="cpu"), _inv_freq(D, device="cpu"),
                                      torch.zeros(B, dtype=torch.int32), _bf16(B, Hkv, S, D, device="cpu"),
                                      _bf16(B, Hkv, S, D, device="cpu"))


def test_reference_rope_rotates_pairs_i_and_i_plus_half():
    """The reference's layout: pair (i, i + D/2) rotated by angle pos * inv_freq[i]."""
    D = 8
    inv_freq = _inv_freq(D, device="cpu")
    x = torch.randn(1, D)
    pos = 3
    got = reference.rope(x, torch.tensor(pos), inv_freq)
    a = pos * inv_freq
    want = torch.cat([x[:, :4] * a.cos() - x[:, 4:] * a.sin(), x[:, 4:] * a.cos() + x[:, :4] * a.sin()], -1)
    torch.testing.assert_close(got, want)
