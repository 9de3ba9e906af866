"""decodex.reference against cases worked out by hand: the reference is what every kernel is tested
against, so it is itself checked on numbers that need no other implementation."""
import math

import pytest
import torch

from decodex import reference as ref


def test_gemv_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    assert torch.equal(ref.gemv(x, w), torch.tensor([[1.0, 5.0]]))
    assert torch.equal(ref.gemv(x, w, torch.tensor([0.5, -5.0])), torch.tensor([[1.5, 0.0]]))


def test_rms_norm_by_hand():
    # rms([3, 4]) = sqrt(12.5); with eps 0 the row becomes [3, 4] / sqrt(12.5) times the weight.
    out = ref.rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 0.0)
    s = math.sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[3 / s, 8 / s]]))


def test_fused_add_rms_norm_by_hand():
    out, residual = ref.fused_add_rms_norm(torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 3.0]]),
                                           torch.tensor([1.0, 1.0]), 0.0)
    assert torch.equal(residual, torch.tensor([[3.0, 4.0]]))
    s = math.sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[3 / s, 4 / s]]))


def test_rope_by_hand():
    # D = 4: pairs (0, 2) and (1, 3) with inv_freq [1, 0.01] (theta 10^4).
    inv_freq = ref.rope_inv_freq(4, 10000.0)
    torch.testing.assert_close(inv_freq, torch.tensor([1.0, 0.01]))
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # one head
    assert torch.equal(ref.rope(x, torch.tensor(0), inv_freq), x)  # position 0: identity
    # Position pi/2 turns the first pair (1, 0) by 90 degrees to (0, 1); the second pair turns by
    # 0.01 * pi/2.
    p = math.pi / 2
    out = ref.rope(x, torch.tensor(p), inv_freq)
    a = 0.01 * p
    want = torch.tensor([[math.cos(p), -math.sin(a), math.sin(p), math.cos(a)]])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_llama3_scaling_by_hand():
    # Frequencies with wavelength above old_context / low_freq_factor are divided by the factor,
    # those below old_context / high_freq_factor are kept, the band between is interpolated.
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    plain = ref.rope_inv_freq(32, 500000.0)
    scaled = ref.rope_inv_freq(32, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 64 / 4.0
    low = wavelen > 64 / 1.0
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    mid = ~high & ~low
    assert (scaled[mid] < plain[mid]).all() and (scaled[mid] > plain[mid] / 8.0).all()
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic'"):
        ref.rope_inv_freq(32, 1e4, {"rope_type": "dynamic", "factor": 2.0})


def test_rope_append_writes_the_cache_at_the_position():
    k_cache, v_cache = torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2)
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 1.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[5.0, 6.0]], [[7.0, 8.0]]])
    inv_freq = torch.tensor([1.0])
    q_rot, k_rot = ref.rope_append(q, k, v, inv_freq, torch.tensor([0, -1]), k_cache, v_cache)
    assert torch.equal(q_rot, q) and torch.equal(k_rot, k)  # position 0 (row 0), skipped (row 1)
    assert torch.equal(k_cache[0, 0, 0], torch.tensor([0.0, 1.0]))
    assert torch.equal(v_cache[0, 0, 0], torch.tensor([5.0, 6.0]))
    assert torch.count_nonzero(k_cache[1]) == 0 and torch.count_nonzero(v_cache[1]) == 0
    with pytest.raises(IndexError, match="past the cache capacity 4"):
        ref.rope_append(q, k, v, inv_freq, torch.tensor([4, 0]), k_cache, v_cache)


def test_rope_append_rms_and_bias_by_hand():
    """rms_x / bias: rows scaled by 1/rms(x), biased, then rotated (position 0: no rotation); a
    skipped row is returned as it was."""
    k_cache, v_cache = torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2)
    q, k, v = torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2), 3 * torch.ones(2, 1, 2)
    x = torch.tensor([[3.0, 4.0], [1.0, 1.0]])  # rms 3.5355 and 1
    bias = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 10.0])
    q_rot, k_rot = ref.rope_append(q, k, v, torch.tensor([1.0]), torch.tensor([0, -1]), k_cache, v_cache,
                                   rms_x=x, rms_eps=0.0, bias=bias)
    r = (12.5) ** 0.5
    torch.testing.assert_close(q_rot[0, 0], torch.tensor([1 / r + 1, 1 / r]))
    torch.testing.assert_close(k_rot[0, 0], torch.tensor([2 / r, 2 / r]))
    torch.testing.assert_close(v_cache[0, 0, 0], torch.tensor([3 / r, 3 / r + 10]))
    assert torch.equal(q_rot[1], q[1]) and torch.equal(k_rot[1], k[1])
    assert torch.count_nonzero(v_cache[1]) == 0


def test_silu_mul_by_hand():
    out = ref.silu_mul(torch.tensor([[0.0, 2.0, 3.0, 5.0]]))  # gate [0, 2], up [3, 5]
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0 / (1 + math.exp(-2.0)) * 5.0]]))


def test_decode_attention_worked_example():
    # The cache holds k0 = [1, 0], v0 = [1, 0], k1 = [0, 1], v1 = [0, 1] and the new token k = [1, 1],
    # v = [2, 2]; q = [2, 2], head dim 2, scale 1/sqrt(2): scores sqrt(2), sqrt(2), 2 sqrt(2).
    k_cache = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])  # [B=1, Hkv=1, S=3, D=2]
    v_cache = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]]])
    out = ref.decode_attention(torch.tensor([[[2.0, 2.0]]]), k_cache, v_cache, torch.tensor([3]),
                               1 / math.sqrt(2))
    torch.testing.assert_close(out, torch.tensor([[[1.5092, 1.5092]]]), atol=1e-4, rtol=0)
    # Length 2 leaves the new token out: two equal scores, the mean of v0 and v1.
    out2 = ref.decode_attention(torch.tensor([[[2.0, 2.0]]]), k_cache, v_cache, torch.tensor([2]),
                                1 / math.sqrt(2))
    torch.testing.assert_close(out2, torch.tensor([[[0.5, 0.5]]]))


def test_grouped_query_heads_share_their_kv_head():
    # 2 query heads over 1 KV head: both read the same cache; a length-0 sequence gets zeros.
    k_cache = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[1.0, 0.0], [0.0, 1.0]]]])
    v_cache = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[1.0, 0.0], [0.0, 1.0]]]])
    q = torch.tensor([[[100.0, 0.0], [0.0, 100.0]], [[1.0, 1.0], [1.0, 1.0]]])
    out = ref.decode_attention(q, k_cache, v_cache, torch.tensor([2, 0]), 1.0)
    torch.testing.assert_close(out[0], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.equal(out[1], torch.zeros(2, 2))


def test_causal_attention_by_hand():
    # Query 0 sees key 0 only; query 1 sees both keys, with equal scores.
    q = torch.zeros(2, 1, 2)
    k = torch.zeros(2, 1, 2)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = ref.causal_attention(q, k, v, 1.0)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0]], [[0.5, 0.5]]]))


def test_argmax_ties_go_to_the_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert ref.argmax(logits).tolist() == [1, 0]


def test_sample_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # probabilities 1/4, 3/4
    one = dict(top_k=torch.tensor([0]), top_p=torch.tensor([1.0]), positions=torch.tensor([0]))
    assert ref.sample(logits, torch.tensor([0.0]), seed=torch.tensor([1]), **one).tolist() == [1]
    # u < 1/4 picks token 0, u >= 1/4 token 1: find seeds on both sides of the boundary.
    picks = {}
    for seed in range(64):
        u = ref.uniform(seed, 0)
        picks[u < 0.25] = int(ref.sample(logits, torch.tensor([1.0]), seed=torch.tensor([seed]), **one))
    assert picks == {True: 0, False: 1}
    # top_k = 1 and a top_p below the larger probability both keep only token 1.
    for k, p in [(1, 1.0), (0, 0.5)]:
        for seed in range(16):
            got = ref.sample(logits, torch.tensor([1.0]), torch.tensor([k]), torch.tensor([p]),
                             torch.tensor([seed]), torch.tensor([0]))
            assert got.tolist() == [1]


def test_uniform_is_a_fixed_function_of_seed_and_position():
    assert ref.uniform(7, 11) == ref.uniform(7, 11)
    draws = [ref.uniform(7, p) for p in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55
    assert ref.seed_int64(2**64 - 1) == -1 and ref.seed_int64(5) == 5


def test_advance_positions_by_hand():
    pos, lens = ref.advance_positions(torch.tensor([0, 5, -1]), torch.tensor([1, 6, 0]))
    assert pos.tolist() == [1, 6, -1] and lens.tolist() == [2, 7, 0]


# ---- gaps found by mutation testing: each test below fails on a plausible one-token change of the
# reference that the tests above let through.

def test_rms_norm_eps_by_hand():
    # mean([3^2, 4^2]) + eps = 12.5 + 3.5 = 16: the row is divided by 4 exactly. An eps of 1e-6 on
    # unit-scale rows (every other test) moves the result by ~1e-7 relative: a dropped eps passes.
    x = torch.tensor([[3.0, 4.0]])
    assert torch.equal(ref.rms_norm(x, torch.tensor([1.0, 2.0]), 3.5), torch.tensor([[0.75, 2.0]]))
    assert torch.equal(ref.inv_rms(x, 3.5), torch.tensor([[0.25]]))
    # gemv's rms_eps and silu_mul's / rope_append's rms_x scale by the same 1/rms.
    assert torch.equal(ref.gemv(x, torch.eye(2), rms_eps=3.5), torch.tensor([[0.75, 1.0]]))
    assert torch.equal(ref.scale_rows(torch.tensor([[8.0]]), torch.float32, x, 3.5), torch.tensor([[2.0]]))


def test_bf16_results_are_the_fp32_results_rounded_once():
    """On bf16 inputs each op returns its fp32 result on the same (bf16) values, rounded to bf16 once,
    bit for bit: no intermediate rounding (rms_norm rounding x / rms before the weight, say, is off by
    an ulp in a good share of the elements). Odd sizes, fresh random inputs."""
    bf = torch.bfloat16
    x, w = torch.randn(5, 37).to(bf), (1 + 0.3 * torch.randn(37)).to(bf)
    assert torch.equal(ref.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6).to(bf))
    gu = torch.randn(5, 2 * 19).to(bf)
    assert torch.equal(ref.silu_mul(gu), ref.silu_mul(gu.float()).to(bf))
    wt, b = torch.randn(23, 37).to(bf), torch.randn(23).to(bf)
    assert torch.equal(ref.gemv(x, wt, b, rms_eps=1e-6), ref.gemv(x.float(), wt.float(), b.float(), rms_eps=1e-6).to(bf))
    q = torch.randn(5, 3, 18).to(bf)
    inv_freq, pos = ref.rope_inv_freq(18, 1e4), torch.tensor([0, 3, 17, 100, 2047])
    assert torch.equal(ref.rope(q, pos, inv_freq), ref.rope(q.float(), pos, inv_freq).to(bf))


def test_silu_mul_rms_rounds_the_scaled_product_first():
    """With rms_x, gate|up is scaled by 1/rms and rounded to its dtype before the activation (the
    product gemv would have stored), then silu(gate) * up is rounded again: checked against that
    composition by hand, and against the single-rounding result, which differs (so the check can
    fail)."""
    bf = torch.bfloat16
    gu, x = torch.randn(7, 2 * 29).to(bf), torch.randn(7, 41).to(bf)
    inv = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    scaled = (gu.float() * inv).to(bf)
    g, u = scaled.float().chunk(2, dim=-1)
    got = ref.silu_mul(gu, x, 1e-6)
    assert torch.equal(got, (torch.nn.functional.silu(g) * u).to(bf))
    g1, u1 = (gu.float() * inv).chunk(2, dim=-1)
    assert not torch.equal(got, (torch.nn.functional.silu(g1) * u1).to(bf))


def test_llama3_scaling_band_edges():
    """The interpolated band is continuous at its edges: a frequency whose wavelength is exactly
    old_context / low_freq_factor gets inv_freq / factor (as beyond it), one exactly at
    old_context / high_freq_factor keeps inv_freq (as below it). The edges are placed on a real
    wavelength (an fp32 value, so the comparisons are exact); test_llama3_scaling_by_hand never
    lands on an edge."""
    plain = ref.rope_inv_freq(32, 500000.0)
    wavelen = 2 * math.pi / plain
    i = 9
    for low, high, want in [(1.0, 4.0, plain[i] / 8.0), (0.25, 1.0, plain[i])]:
        # low edge at wavelen[i] (low_freq_factor 1), then high edge at wavelen[i] (high_freq_factor 1)
        old = float(wavelen[i]) * (low if low == 1.0 else high)
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=old)
        assert float(old / (low if low == 1.0 else high)) == float(wavelen[i])
        assert torch.equal(ref.rope_inv_freq(32, 500000.0, scaling)[i], want)  # smooth is exactly 0 / 1 there


def test_llama3_scaling_legacy_type_key():
    """Older configs name the scaling `type` instead of `rope_type`: the same frequencies."""
    fields = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    new = ref.rope_inv_freq(32, 500000.0, dict(fields, rope_type="llama3"))
    assert torch.equal(ref.rope_inv_freq(32, 500000.0, dict(fields, type="llama3")), new)
    assert not torch.equal(new, ref.rope_inv_freq(32, 500000.0))


def test_causal_attention_queries_are_the_last_positions():
    # T = 2 queries over L = 3 keys: query 0 is position 1 (sees keys 0, 1), query 1 is position 2
    # (sees all three); zero scores, so each output is the mean of the values it sees.
    q, k = torch.zeros(2, 1, 3), torch.zeros(3, 1, 3)
    v = torch.eye(3).unsqueeze(1)  # [L, Hkv=1, D=3]: value l is the unit vector l
    out = ref.causal_attention(q, k, v, 1.0)
    torch.testing.assert_close(out, torch.tensor([[[0.5, 0.5, 0.0]], [[1 / 3, 1 / 3, 1 / 3]]]))


def test_seed_int64_at_the_sign_bit():
    assert ref.seed_int64(2**63 - 1) == 2**63 - 1
    assert ref.seed_int64(2**63) == -(2**63)
    assert ref.seed_int64(-1) == -1 and ref.seed_int64(2**64) == 0


def test_sample_temperature_by_hand():
    # logits [0, log 3] at temperature 2: probabilities proportional to [1, sqrt(3)], so token 0
    # iff u < 1 / (1 + sqrt(3)) = 0.366 (at temperature 1 the cut would be 0.25, at 1/2 0.1).
    logits = torch.tensor([[0.0, math.log(3.0)]])
    cut = 1 / (1 + math.sqrt(3.0))
    draws = [ref.uniform(seed, 5) for seed in range(64)]
    for seed, u in enumerate(draws):
        if abs(u - cut) < 1e-6:  # too close to call in fp32
            continue
        got = int(ref.sample(logits, torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0]),
                             torch.tensor([seed]), torch.tensor([5])))
        assert got == (0 if u < cut else 1), (seed, u)
    assert any(0.25 < u < cut for u in draws)  # a draw that temperature 1 (or 1/2) sends to token 1


def test_sample_top_p_reached_exactly_keeps_one_token():
    """top_p equal to the largest probability: that token alone reaches the nucleus (the smallest
    prefix whose sum reaches top_p), so the other is never drawn. top_p is set to the largest
    probability exactly as fp32 softmax gives it (exp(x - max) / sum), so the sum reaches it
    exactly."""
    logits = torch.tensor([0.0, -1.0])
    e = torch.exp(logits - logits.max())
    p_max = float((e / e.sum())[0])
    drawn = set()
    for seed in range(32):
        drawn.add(int(ref.sample(logits[None], torch.tensor([1.0]), torch.tensor([0]),
                                 torch.tensor([p_max], dtype=torch.float32), torch.tensor([seed]),
                                 torch.tensor([0]))))
    assert drawn == {0}
    # Just above it, both tokens are needed, and both get drawn.
    above = float(torch.nextafter(torch.tensor(p_max), torch.tensor(1.0)))
    drawn = {int(ref.sample(logits[None], torch.tensor([1.0]), torch.tensor([0]), torch.tensor([above]),
                            torch.tensor([seed]), torch.tensor([0]))) for seed in range(32)}
    assert drawn == {0, 1}


def test_sample_draw_lands_on_the_first_token_past_u():
    """V = 2^20 equal logits: the running sum after token j is (j + 1) / V exactly, so the token is
    floor(u * V), the first whose running sum exceeds u; a draw u that is a multiple of 1/V (1 in
    16: u has 24 bits) is exactly on a running sum and must go to the next token."""
    V = 1 << 20
    logits = torch.zeros(1, V)
    on_boundary = 0
    for seed in range(48):
        u = ref.uniform(seed, 0)
        on_boundary += (u * V).is_integer()
        got = int(ref.sample(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]),
                             torch.tensor([seed]), torch.tensor([0])))
        assert got == math.floor(u * V), (seed, u)
    assert on_boundary > 0  # the fixed seeds include draws on a boundary


@pytest.mark.parametrize("fields", [
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=4.0, original_max_position_embeddings=32768),  # Qwen2.5's, for head dim 128 below
    dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=8.0, original_max_position_embeddings=64, mscale=0.8, mscale_all_dim=0.5),
    dict(factor=2.0, original_max_position_embeddings=100, attention_factor=1.3),
    dict(factor=1.0, original_max_position_embeddings=64),  # no slowing; attention factor 1
])
@pytest.mark.parametrize("head_dim, theta", [(32, 10000.0), (128, 1000000.0)])
def test_yarn_matches_transformers(fields, head_dim, theta):
    """YaRN's frequencies and attention factor against transformers' own computation of them."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = dict(fields, rope_type="yarn")
    config = Qwen2Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=512, rope_scaling=dict(scaling, rope_theta=theta))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    torch.testing.assert_close(ref.rope_inv_freq(head_dim, theta, scaling), want_freq, rtol=1e-6, atol=0)
    assert ref.rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert ref.rope_attention_factor(None) == ref.rope_attention_factor({"rope_type": "llama3"}) == 1.0


def test_rope_append_head_norms_go_together():
    """As the kernel: q_norm, k_norm and norm_eps all or none (one alone would be ignored, or fail
    deep inside)."""
    B, H, Hkv, D, S = 1, 2, 1, 8, 4
    q, k, v = torch.randn(B, H, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    args = (q, k, v, ref.rope_inv_freq(D, 1e4), torch.tensor([0]), torch.zeros(B, Hkv, S, D),
            torch.zeros(B, Hkv, S, D))
    w = torch.ones(D)
    for norms in (dict(q_norm=w), dict(k_norm=w, norm_eps=1e-6), dict(q_norm=w, k_norm=w)):
        with pytest.raises(ValueError, match="q_norm, k_norm and norm_eps go together"):
            ref.rope_append(*args, **norms)
    got_q, _ = ref.rope_append(*args, q_norm=w, k_norm=w, norm_eps=0.0)
    want_q, _ = ref.rope_append(*args[:2], *args[2:])
    assert not torch.allclose(got_q, want_q)  # the norm changed q
    torch.testing.assert_close(got_q.pow(2).mean(-1), torch.ones(B, H))  # unit rms, rotation keeps it
