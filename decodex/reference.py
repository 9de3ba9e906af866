"""Plain-PyTorch reference of every decodex op, in fp32 math.

These functions are the source of truth: every kernel test compares against them, and on a machine
without a GPU they are the path decodex takes. Each returns new tensors in the input's dtype (the
kernels write caller-owned buffers instead); `rope_append` is the one that also writes the caches it
is given, as the kernel does.

Shapes: B batch, M rows, K inner dim, N features, H query heads, Hkv KV heads, S cache capacity,
D head dim, V vocabulary, T tokens.
"""
from __future__ import annotations

import math

import torch


def add_rounded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b in fp32, rounded to a's dtype: the residual add of gemv(accumulate) and
    fused_add_rms_norm."""
    return (a.float() + b.float()).to(a.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         rms_eps: float | None = None, accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N].

    rms_eps: each product row is scaled by 1/rms(x row) = rsqrt(mean(x^2) + rms_eps) before the
    bias (the product of rms_norm(x, w, rms_eps) for a weight with w folded in, fold_norm_weight).
    accumulate [M, N]: returns accumulate + the product, the product rounded to x's dtype first
    (what the kernel's accumulate=True leaves in out)."""
    y = scale_rows(x.float() @ weight.float().t(), x.dtype, x if rms_eps is not None else None,
                   rms_eps, bias)
    return y if accumulate is None else add_rounded(accumulate, y)


def scale_rows(y: torch.Tensor, dtype: torch.dtype, rms_x: torch.Tensor | None = None,
               rms_eps: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A product y [M, N] as gemv stores it: each row scaled by 1/rms(rms_x row) if rms_x [M, K] is
    given, plus bias [N] if given, in fp32, rounded to dtype once. Also what silu_mul and
    rope_append do to an unscaled product given rms_x (and bias)."""
    y = y.float()
    if rms_x is not None:
        y = y * inv_rms(rms_x, rms_eps)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K], weight [2I, K] = [gate; up] -> silu_mul(gemv(x, weight)) [M, I] (the gate|up
    product rounded to x's dtype before the activation, as the fused kernel does); rms_eps as in
    gemv."""
    return silu_mul(gemv(x, weight, rms_eps=rms_eps))


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with its columns scaled by norm_weight [K] (fp32 product, rounded to weight's
    dtype): rms_norm(x, norm_weight) @ weight^T == gemv(x, fold_norm_weight(weight, norm_weight),
    rms_eps=eps) up to that rounding."""
    if weight.dim() != 2:
        raise ValueError(f"fold_norm_weight: weight must be 2-D [N, K], got shape {list(weight.shape)}")
    if norm_weight.shape != weight.shape[1:]:
        raise ValueError(f"fold_norm_weight: norm_weight must have shape [{weight.shape[1]}] (weight's K), "
                         f"got {list(norm_weight.shape)}")
    return (weight.float() * norm_weight.float()).to(weight.dtype)


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each row of x [..., K], fp32 [..., 1]."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] / rms(x) * weight [K]."""
    return (x.float() * inv_rms(x, eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; out = rms_norm(residual). Returns (out, new residual).

    The norm is taken of the residual as stored (rounded to its dtype), as the kernel does.
    """
    new_residual = add_rounded(residual, x)
    return rms_norm(new_residual, weight, eps), new_residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32) of the half-split RoPE, with Llama-3 or YaRN scaling if given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, yarn)")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: pairs that turn more than beta_fast times over the original context keep their
    frequency, pairs that turn fewer than beta_slow times are slowed by `factor`, and the pairs
    between are blended along a linear ramp of the pair index."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    period = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # 2 pi / frequency of each pair

    def pair_turning(turns):  # the (fractional) pair index whose pair turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 0.001
    slowed = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * period)) * slowed + (1.0 / period) * (1 - slowed)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN scales cos and sin by (so q and k by it, and every attention logit by its
    square); 1 for other RoPE types."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor, m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return float(mscale(factor))


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE of x [..., H, D] at positions [...] (one per row of heads)."""
    angle = positions.float()[..., None] * inv_freq.float()  # [..., D/2]
    cos, sin = angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)  # [..., 1, D/2]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rms_x: torch.Tensor | None = None,
    rms_eps: float | None = None,
    bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B, H, D] and k [B, Hkv, D] at positions [B], then k and v written into
    k_cache / v_cache [B, Hkv, S, D] at that position. Rows with a negative position are skipped
    (left as they were). Returns (rotated q, rotated k). With rms_x [B, K] and / or bias
    [(H + 2 Hkv) D], q, k and v are first scaled by 1/rms(rms_x row) (as gemv's rms_eps), biased and
    rounded to their dtype: rows of a q|k|v product computed unscaled and without its bias. With
    q_norm and k_norm [D] (Qwen3), each head of q and k is then rms_norm'ed with that weight and
    norm_eps, before RoPE."""
    q_rot, k_rot = q.clone(), k.clone()  # a skipped row stays as it was
    if rms_x is not None or bias is not None:
        B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
        qkv = scale_rows(torch.cat([q, k, v], dim=1).reshape(B, -1), q.dtype, rms_x, rms_eps, bias)
        q, k, v = qkv.view(B, H + 2 * Hkv, -1).split([H, Hkv, Hkv], dim=1)
    if (q_norm is None) != (k_norm is None) or (q_norm is None) != (norm_eps is None):
        raise ValueError("q_norm, k_norm and norm_eps go together")
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)
    capacity = k_cache.shape[2]
    for b, pos in enumerate(positions.tolist()):
        if pos < 0:
            continue
        if pos >= capacity:
            raise IndexError(f"positions[{b}] = {pos} is past the cache capacity {capacity}")
        p = torch.tensor(pos, device=q.device)
        q_rot[b] = rope(q[b], p, inv_freq)
        k_rot[b] = rope(k[b], p, inv_freq)
        k_cache[b, :, pos] = k_rot[b].to(k_cache.dtype)
        v_cache[b, :, pos] = v[b].to(v_cache.dtype)
    return q_rot, k_rot


def gemv_rope_append(x, weight, bias, inv_freq, positions, k_cache, v_cache,
                     rms_eps: float | None = None) -> torch.Tensor:
    """gemv of x [M, K] with the merged q|k|v weight [(H + 2 Hkv) D, K] (+ bias), then rope_append on
    the q|k|v rows of the result (writes the caches [M, Hkv, S, D]); returns [M, (H + 2 Hkv) D] with
    q and k rotated. Hkv and D come from k_cache; rms_eps as in gemv."""
    M, Hkv, D = x.shape[0], k_cache.shape[1], k_cache.shape[3]
    qkv = gemv(x, weight, bias, rms_eps=rms_eps)
    H = qkv.shape[1] // D - 2 * Hkv
    q, k, v = qkv.view(M, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=1)
    q, k = rope_append(q, k, v, inv_freq, positions, k_cache, v_cache)
    return torch.cat([q, k, v], dim=1).reshape(M, -1)


def silu_mul(gate_up: torch.Tensor, rms_x: torch.Tensor | None = None,
             rms_eps: float | None = None) -> torch.Tensor:
    """gate_up [M, 2I] -> silu(gate) * up [M, I]. With rms_x [M, K], gate_up's rows are first scaled
    by 1/rms(rms_x row) (as gemv's rms_eps) and rounded to its dtype: the gate|up product of the
    RMS-normalised x when the norm weight is folded into the weight and the product was not scaled."""
    if rms_x is not None:
        gate_up = scale_rows(gate_up, gate_up.dtype, rms_x, rms_eps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (ids [M, top_k] int32, weights [M, top_k] fp32): the top_k largest logits of
    each row, descending, ties to the lower index (a stable sort), and their softmax probabilities
    over all E, divided by the chosen ones' sum if norm_topk_prob (Qwen3-MoE's router). NaN counts as
    -inf in the choice (and makes every weight of its row NaN, as softmax does)."""
    x = logits.float()
    key = torch.where(torch.isnan(x), -math.inf, x)
    ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(x, dim=-1).gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


def moe_gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                      rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K], the experts' merged gate|up weight [E, 2I, K], ids [M, k] -> [M, k, I]: row m's
    gemv_silu_mul with expert ids[m, s]'s weight, for each slot s."""
    return torch.stack([torch.stack([gemv_silu_mul(x[m:m + 1], weight[int(e)], rms_eps=rms_eps)[0]
                                     for e in ids[m]]) for m in range(x.shape[0])])


def moe_gemv_sum(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k, I], the experts' weight [E, N, I], ids [M, k], weights [M, k] -> [M, N]: sum over s of
    weights[m, s] * (x[m, s] @ weight[ids[m, s]]^T) in fp32, rounded to x's dtype once (accumulate
    [M, N]: then added to it, as gemv's accumulate)."""
    y = torch.stack([sum(float(w) * (x[m, s].float() @ weight[int(e)].float().t())
                         for s, (e, w) in enumerate(zip(ids[m], weights[m]))) for m in range(x.shape[0])])
    y = y.to(x.dtype)
    return y if accumulate is None else add_rounded(accumulate, y)


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        norm_topk_prob: bool, rms_eps: float | None = None) -> torch.Tensor:
    """A Qwen3-MoE block on x [M, K] -> [M, K]: each row routed with router [E, K] (moe_route on the
    logits rounded to x's dtype), then its chosen experts' SwiGLU MLPs (gate_up [E, 2I, K], down
    [E, K, I]; activations rounded to x's dtype, as moe_gemv_silu_mul stores them) weighted and
    summed in fp32, rounded once. rms_eps: x is first scaled by 1/rms(x row), as gemv's rms_eps (the
    norm's weight folded into router's and gate_up's columns). Grouped by expert, so a prompt of
    many rows reads each expert once."""
    xf = x.float() if rms_eps is None else x.float() * inv_rms(x, rms_eps)
    ids, weights = moe_route((xf @ router.float().t()).to(x.dtype), top_k, norm_topk_prob)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == e)
        act = silu_mul((xf[rows] @ gate_up[e].float().t()).to(x.dtype))
        out.index_add_(0, rows, weights[rows, slots, None] * (act.float() @ down[e].float().t()))
    return out.to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None) -> torch.Tensor:
    """q [T, H, D] over k, v [L, Hkv, D] (grouped-query heads), fp32 softmax. mask [T, L] bool."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), kf) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), vf)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence: q [B, H, D] over the first lengths[b] rows of k_cache / v_cache
    [B, Hkv, S, D]. A sequence of length 0 gets zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(lengths.tolist()):
        if length > 0:
            k = k_cache[b, :, :length].transpose(0, 1)  # [L, Hkv, D]
            v = v_cache[b, :, :length].transpose(0, 1)
            out[b] = _attend(q[b : b + 1], k, v, scale)[0]
    return out.to(q.dtype)


def rope_append_attention(q, k, v, inv_freq, positions, k_cache, v_cache, lengths, scale: float,
                          rms_x=None, rms_eps: float | None = None, bias=None, q_norm=None, k_norm=None,
                          norm_eps: float | None = None) -> torch.Tensor:
    """rope_append (writes the caches) then decode_attention with the rotated q; returns out
    [B, H, D]. q, k and v are not changed."""
    q_rot, _ = rope_append(q, k, v, inv_freq, positions, k_cache, v_cache, rms_x, rms_eps, bias, q_norm,
                           k_norm, norm_eps)
    return decode_attention(q_rot, k_cache, v_cache, lengths, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill attention: q [T, H, D] are the last T of the L positions in k, v [L, Hkv, D];
    query i (position L - T + i) sees keys 0 .. L - T + i."""
    T, L = q.shape[0], k.shape[0]
    mask = torch.arange(L, device=q.device)[None, :] <= (torch.arange(T, device=q.device)[:, None] + (L - T))
    return _attend(q, k, v, scale, mask).to(q.dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B]; ties go to the lowest index."""
    return logits.float().argmax(dim=-1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_int64(seed: int) -> int:
    """Any Python int as the int64 whose bits are seed mod 2^64 (the draw hashes those 64 bits), so
    seeds of 2^63 and more fit the int64 seed tensors the kernels take."""
    s = int(seed) & _MASK64
    return s - (1 << 64) if s >= 1 << 63 else s


def uniform(seed: int, position: int) -> float:
    """The draw in [0, 1) that `sample` uses for a sequence at a position: 24 bits of a hash, so the
    kernel reproduces it exactly and a (seed, position) pair always gives the same token."""
    h = _splitmix64((_splitmix64(seed & _MASK64) + (position & _MASK64)) & _MASK64)
    return (h >> 40) * (1.0 / (1 << 24))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row of logits [B, V] -> int64 [B].

    Row b: greedy if temperature[b] <= 0. Otherwise p = softmax(logits / temperature) restricted to
    the logits >= the top_k-th largest (top_k <= 0: no limit), then to the probabilities >= the
    smallest one that the top_p nucleus needs (ties kept), renormalised; the token is the first index
    whose running sum of p (in index order) exceeds u * sum, u = uniform(seed[b], positions[b]).
    """
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for b in range(logits.shape[0]):
        row = logits[b].float()
        t = float(temperature[b])
        if t <= 0:
            out[b] = row.argmax()
            continue
        row = row / t
        keep = torch.ones_like(row, dtype=torch.bool)
        k = int(top_k[b])
        if 0 < k < row.numel():
            keep &= row >= row.topk(k).values[-1]
        p = torch.exp(row - row.max()) * keep
        p = p / p.sum()
        pp = float(top_p[b])
        if pp < 1.0:
            sorted_p = p.sort(descending=True).values
            need = int((sorted_p.cumsum(0) < pp).sum()) + 1  # smallest prefix reaching top_p
            keep &= p >= sorted_p[min(need, sorted_p.numel()) - 1]
            p = p * keep
        csum = p.cumsum(0)
        u = uniform(int(seed[b]), int(positions[b]))
        idx = int((csum <= u * float(csum[-1])).sum())
        # The running sum can stop short of the last kept token by rounding: clamp to one kept.
        kept = keep.nonzero().flatten()
        out[b] = min(idx, int(kept[-1]))
    return out


def advance_positions(positions: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Live rows (positions >= 0) move one token on: positions + 1, lengths = positions + 1."""
    live = positions >= 0
    new_pos = torch.where(live, positions + 1, positions)
    new_len = torch.where(live, new_pos + 1, lengths)
    return new_pos, new_len
