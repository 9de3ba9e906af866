"""decodex.Model against transformers, and the CUDA kernel path against the CPU reference path.

CPU (CI): tiny random checkpoints written by transformers, loaded by decodex.loader; prefill logits
at every prompt position and 20 greedy decode steps must match HF's fp32 logits. Batch decode must
equal single-sequence decode exactly on the reference path.

GPU: the eager kernel path (bf16, head dims 64 / 128 as the kernels need) against the fp32 CPU path
on the same weights, for the prompt and 64 decode steps.
"""
import pytest
import torch

from decodex.loader import load_model
from helpers import (LLAMA3_SCALING, MOE_TINY, YARN_SCALING, make_tiny_checkpoint, random_model, random_weights,
                     tiny_config)

# fp32 vs fp32 (transformers): both do the same math in fp32, so only summation order differs:
# ~1e-6 relative seen; 1e-4 relative to the largest logit leaves room for other BLAS builds.
HF_RTOL = 1e-4

HF_CASES = {
    # id: (model_type, tied, sharded, rope_scaling, checkpoint dtype, prompt length, overrides)
    "qwen2-single-untied": ("qwen2", False, False, None, torch.float32, 13, {}),
    "qwen2-tied-bf16": ("qwen2", True, False, None, torch.bfloat16, 9, {}),
    "llama-sharded": ("llama", False, True, None, torch.float32, 17, {}),
    # Positions 0..80 cross original_max_position_embeddings=64; the head dim spans all three
    # llama3 bands (wavelengths below 16, between 16 and 64, above 64).
    "llama3-rope-scaling": ("llama", False, False, LLAMA3_SCALING, torch.float32, 61, {}),
    "llama-tied-fp16": ("llama", True, False, None, torch.float16, 11, {"rope_theta": 500000.0}),
    "llama-attention-bias": ("llama", False, False, None, torch.float32, 7, {"attention_bias": True}),
    # YaRN (Qwen2.5's long-context setting): positions 0..80 pass the original context of 64; the
    # default attention factor, then beta, mscale and truncate given (Llama), then an explicit factor.
    "qwen2-yarn": ("qwen2", False, False, YARN_SCALING, torch.float32, 61, {}),
    "llama-yarn-fields": ("llama", False, False, dict(YARN_SCALING, factor=8.0, beta_fast=16, beta_slow=2,
                                                      mscale=0.8, mscale_all_dim=0.5, truncate=False),
                          torch.float32, 61, {}),
    "qwen3-yarn-attention-factor": ("qwen3", True, False, dict(YARN_SCALING, attention_factor=1.3),
                                    torch.float32, 61, {}),
    # Qwen3: q_norm / k_norm on each head before RoPE; tied as the small ones are, and with the
    # optional q/k/v/o biases.
    "qwen3-tied-bf16": ("qwen3", True, False, None, torch.bfloat16, 12, {}),
    "qwen3-attention-bias": ("qwen3", False, True, None, torch.float32, 8, {"attention_bias": True}),
    # Qwen3-MoE: 8 experts, 2 a token (renormalised); then unnormalised weights, tied, with a dense
    # first layer (mlp_only_layers).
    "qwen3-moe": ("qwen3_moe", False, False, None, torch.float32, 11, MOE_TINY),
    "qwen3-moe-dense-layer-bf16": ("qwen3_moe", True, False, None, torch.bfloat16, 9,
                                   dict(MOE_TINY, norm_topk_prob=False, mlp_only_layers=[0])),
    # Mistral v0.3's layout: no biases, no sliding window, theta 1e6; the head dim is not
    # hidden_size / heads (as in Mistral Nemo).
    "mistral-head-dim": ("mistral", False, False, None, torch.bfloat16, 15,
                         {"rope_theta": 1e6, "head_dim": 48}),
}
DECODE_STEPS = 20


def _assert_logits_close(got, want, what):
    atol = HF_RTOL * want.abs().max().item()
    err = (got - want).abs()
    bad = err > atol + HF_RTOL * want.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} logits differ; max error {err.max().item():.3g} "
                           f"at {tuple(int(i) for i in torch.nonzero(bad)[0])}, allowed {atol:.3g} + "
                           f"{HF_RTOL} * |logit|")


@pytest.mark.parametrize("case", list(HF_CASES))
def test_matches_transformers(tmp_path, case):
    model_type, tied, sharded, scaling, ckpt_dtype, T, overrides = HF_CASES[case]
    path, hf = make_tiny_checkpoint(tmp_path, model_type, tied=tied, sharded=sharded,
                                    rope_scaling=scaling, dtype=ckpt_dtype, **overrides)
    model = load_model(path, device="cpu", dtype=torch.float32, quiet=True)
    assert (model.lm_head is model.embed) == tied
    assert model.use_kernels is False

    ids = torch.randint(0, model.config.vocab_size, (T,))
    cache = model.new_cache(batch=1, capacity=T + DECODE_STEPS)
    logits = [model.prefill(ids, cache, slot=0)]  # [T, V]
    for step in range(DECODE_STEPS):  # greedy: feed back the argmax
        token = logits[-1][-1].argmax()
        ids = torch.cat([ids, token[None]])
        logits.append(model.decode(token[None], torch.tensor([T + step], dtype=torch.int32), cache))
    # HF on the whole sequence at once: causal, so its logits at position T-1+s are what an
    # incremental step s computes (a full recompute, with no cache logic to agree on).
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()  # [T + DECODE_STEPS, V]
    _assert_logits_close(logits[0], want[:T], f"{case} prefill")
    for step in range(DECODE_STEPS):
        _assert_logits_close(logits[step + 1], want[T + step:T + step + 1],
                             f"{case} decode step {step} (position {T + step})")


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "mistral"])
def test_prefill_last_only(model_type):
    """last_only (what generation calls) gives the last row of the full logits and writes the same
    cache rows."""
    model = random_model(model_type)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (13,))
    caches = [model.new_cache(batch=2, capacity=16) for _ in range(2)]
    full = model.prefill(ids, caches[0], 1)  # [T, V]
    last = model.prefill(ids, caches[1], 1, last_only=True)
    assert last.shape == (1, V) and last.dtype == torch.float32
    # fp32 both ways; only the LM head's row count (and so its BLAS blocking) differs.
    torch.testing.assert_close(last, full[-1:], rtol=1e-5, atol=1e-5 * full.abs().max().item())
    for layer in range(len(model.layers)):
        assert torch.equal(caches[0].k[layer], caches[1].k[layer]) and torch.equal(caches[0].v[layer], caches[1].v[layer])


def test_token_ids_outside_the_vocabulary_are_errors():
    """An id outside [0, V) would index the embedding out of bounds (a device-side assert on a GPU);
    a skipped decode row (position -1) may still hold any id."""
    model = random_model("llama")
    V = model.config.vocab_size
    cache = model.new_cache(batch=2, capacity=16)
    for bad in (V, -1):
        with pytest.raises(ValueError, match=f"prefill: token id {bad} is outside the vocabulary \\[0, {V}\\)"):
            model.prefill(torch.tensor([1, bad, 2]), cache, 0)
        with pytest.raises(ValueError, match=f"prefill: token id {bad} is outside"):
            model.prefill([3, bad], cache, 0)
    model.prefill(torch.tensor([1, V - 1]), cache, 0)
    with pytest.raises(ValueError, match=f"decode: token id {V} is outside the vocabulary"):
        model.decode(torch.tensor([V, 1]), torch.tensor([2, 0], dtype=torch.int32), cache)
    model.decode(torch.tensor([5, V + 3]), torch.tensor([2, -1], dtype=torch.int32), cache)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_batch_decode_equals_single(model_type):
    """Two sequences of different lengths decoded in one batch give exactly the logits each gives
    alone; a skipped row (position -1) writes nothing and does not disturb the others."""
    model = random_model(model_type)
    V, capacity, steps = model.config.vocab_size, 32, 8
    prompts = [torch.randint(0, V, (5,)), torch.randint(0, V, (11,))]

    batch_cache = model.new_cache(batch=3, capacity=capacity)
    single_caches = [model.new_cache(batch=1, capacity=capacity) for _ in prompts]
    tokens = []
    for slot, prompt in enumerate(prompts):
        batch_logits = model.prefill(prompt, batch_cache, slot)
        single_logits = model.prefill(prompt, single_caches[slot], 0)
        assert torch.equal(batch_logits, single_logits)
        tokens.append(single_logits[-1].argmax())
    dead_row_before = [k[2].clone() for k in batch_cache.k]

    positions = [len(p) for p in prompts]
    for step in range(steps):
        got = model.decode(torch.stack(tokens + [torch.tensor(V + 7)]),  # row 2: skipped, bad id
                           torch.tensor(positions + [-1], dtype=torch.int32), batch_cache)
        for b in range(len(prompts)):
            alone = model.decode(tokens[b][None], torch.tensor([positions[b]], dtype=torch.int32),
                                 single_caches[b])[0]
            assert torch.equal(got[b], alone), f"row {b} at step {step}"
            tokens[b] = alone.argmax()
            positions[b] += 1
    for layer, before in enumerate(dead_row_before):
        assert torch.equal(batch_cache.k[layer][2], before), f"skipped row written in layer {layer}"
    for layer in range(len(model.layers)):  # single and batched caches hold the same rows
        for b in range(len(prompts)):
            assert torch.equal(batch_cache.k[layer][b], single_caches[b].k[layer][0])
            assert torch.equal(batch_cache.v[layer][b], single_caches[b].v[layer][0])


def test_merged_weights_layout():
    """qkv rows are q, k, v; gate_up rows are gate, up: the layout the kernels read; each with the
    norm before it folded into its columns (fp32 model: the exact fp32 product)."""
    config = tiny_config("qwen2")
    weights = random_weights(config)
    model = random_model("qwen2")
    layer = model.layers[1]
    p = "model.layers.1."
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    attn_norm, mlp_norm = weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"]
    assert layer.qkv_w.shape == (q_rows + 2 * kv_rows, config.hidden_size)
    assert torch.equal(layer.qkv_w[:q_rows], weights[p + "self_attn.q_proj.weight"] * attn_norm)
    assert torch.equal(layer.qkv_w[q_rows:q_rows + kv_rows], weights[p + "self_attn.k_proj.weight"] * attn_norm)
    assert torch.equal(layer.qkv_w[q_rows + kv_rows:], weights[p + "self_attn.v_proj.weight"] * attn_norm)
    assert torch.equal(layer.qkv_b[q_rows + kv_rows:], weights[p + "self_attn.v_proj.bias"])
    assert torch.equal(layer.gate_up_w[:config.intermediate_size], weights[p + "mlp.gate_proj.weight"] * mlp_norm)
    assert torch.equal(layer.gate_up_w[config.intermediate_size:], weights[p + "mlp.up_proj.weight"] * mlp_norm)
    assert not torch.equal(attn_norm, torch.ones_like(attn_norm)), "random norm weights expected"
    assert layer.o_b is None
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq.shape == (config.head_dim // 2,)
    cache = model.new_cache(batch=3, capacity=17)
    assert len(cache.k) == config.num_hidden_layers and cache.batch == 3 and cache.capacity == 17
    assert cache.k[0].shape == (3, config.num_key_value_heads, 17, config.head_dim)


# ---- GPU: eager kernel path vs the fp32 CPU path ---------------------------------------------------

# Realistic head dims (the kernels are built for 64 and 128) at a small width.
GPU_CASES = {
    "qwen2-d128": dict(model_type="qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, intermediate_size=704, vocab_size=1000),
    "llama-d64-llama3": dict(model_type="llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=64, intermediate_size=512, vocab_size=1000, rope_scaling=LLAMA3_SCALING),
    "llama-d128-tied": dict(model_type="llama", hidden_size=512, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=128, intermediate_size=1024, vocab_size=1000, tie_word_embeddings=True),
    # YaRN: its frequencies reach the rope kernels through inv_freq, its attention factor the
    # attention through the scale; the 64 decode steps pass the original context of 64.
    "qwen2-d128-yarn": dict(model_type="qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=128, intermediate_size=704, vocab_size=1000, rope_scaling=YARN_SCALING),
    # Qwen3: q/k norms inside rope_append; q is wider
    # than hidden_size, as in Qwen3-0.6B.
    "qwen3-d128": dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, intermediate_size=704, vocab_size=1000),
    # q's width (4 x 128) is not hidden_size, as in Mistral Nemo.
    "mistral-d128-wide-q": dict(model_type="mistral", hidden_size=384, num_attention_heads=4, num_key_value_heads=1,
                                head_dim=128, intermediate_size=768, vocab_size=1000, rope_theta=1e6),
}
GPU_DECODE_STEPS = 64
# Floor of the allowed error, relative to the largest fp32 logit: bf16 has 8 bits of mantissa, so
# one rounding of a logit is up to 2^-9 of it; two layers and the LM head leave a few of those.
GPU_ATOL_REL = 1e-2


def _three_models(case, seed=0):
    """The same bf16-rounded weights as: fp32 on CPU (truth), bf16 on CPU (PyTorch's own bf16
    error), bf16 on CUDA through the kernels (under test; Qwen3's q/k norms in them too)."""
    from decodex.model import Model

    kw = dict(GPU_CASES[case])
    model_type = kw.pop("model_type")
    tied = kw.pop("tie_word_embeddings", False)
    config = tiny_config(model_type, tied=tied, **kw)
    weights = random_weights(config, seed=seed, dtype=torch.bfloat16)
    fp32 = Model(config, weights, "cpu", torch.float32)
    bf16 = Model(config, weights, "cpu", torch.bfloat16)
    gpu = Model(config, weights, "cuda", torch.bfloat16)
    assert gpu.use_kernels, "the CUDA model should take the kernel path"
    return fp32, bf16, gpu


def _check_step(what, got, bf16, want):
    """Kernel logits vs fp32 truth: error at most 2x the bf16 reference's own error, or the floor.
    Returns the tolerance used."""
    got, bf16 = got.float().cpu(), bf16.float()
    floor = GPU_ATOL_REL * want.abs().max().item()
    tol = max(2.0 * (bf16 - want).abs().max().item(), floor)
    err = (got - want).abs()
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    assert err.max().item() <= tol, (f"{what}: max |kernel - fp32| = {err.max().item():.4g} at "
                                     f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}, "
                                     f"allowed {tol:.4g} (2x bf16 reference error, floor {floor:.3g})")
    return tol


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [5, 37])  # 5: gemv prefill (<= 8 rows); 37: cuBLAS + SDPA
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_kernel_path_matches_reference(case, prompt_len):
    """Teacher-forced with the fp32 greedy tokens, so every one of the 64 steps is compared; any
    step where the kernel's greedy token differs must be a near-tie (fp32 top-2 gap < tolerance)."""
    fp32, bf16, gpu = _three_models(case)
    V = fp32.config.vocab_size
    capacity = prompt_len + GPU_DECODE_STEPS + 3  # odd capacity: not a multiple of any split
    ids = torch.randint(0, V, (prompt_len,))
    caches = [m.new_cache(batch=2, capacity=capacity) for m in (fp32, bf16, gpu)]
    slot = 1  # not slot 0: checks the prefill's expanded-cache write lands in the right slot
    want = fp32.prefill(ids, caches[0], slot)
    base = bf16.prefill(ids, caches[1], slot)
    got = gpu.prefill(ids.cuda(), caches[2], slot)
    tol = _check_step(f"{case} prefill (T={prompt_len})", got, base, want)
    assert not caches[2].k[0][0].any(), "prefill into slot 1 wrote slot 0"
    # last_only (what generation calls): the last token's logits alone, the LM head on one row.
    last = gpu.prefill(ids.cuda(), gpu.new_cache(batch=2, capacity=capacity), slot, last_only=True)
    assert last.shape == (1, V)
    _check_step(f"{case} prefill last_only (T={prompt_len})", last, base[-1:], want[-1:])

    near_ties = []
    for step in range(GPU_DECODE_STEPS):
        token = want[-1].argmax()
        pos = prompt_len + step
        kernel_token = int(got[-1].float().argmax())
        top2 = want[-1].topk(2).values
        gap = (top2[0] - top2[1]).item()
        if kernel_token != int(token):
            # Both logits within tol of fp32 can only swap the argmax when the gap is < 2 tol.
            assert gap < 2 * tol, (f"{case}: greedy tokens diverge at position {pos - 1} (kernel "
                                   f"{kernel_token}, fp32 {int(token)}) but fp32's top-2 gap {gap:.4g} "
                                   f"is no near-tie (logit tolerance {tol:.4g})")
            near_ties.append((pos - 1, kernel_token, int(token), gap))
        tokens = torch.full((2,), int(token))
        positions = torch.tensor([-1, pos], dtype=torch.int32)  # row 0 idle
        want = fp32.decode(tokens, positions, caches[0])[1:]
        base = bf16.decode(tokens, positions, caches[1])[1:]
        got = gpu.decode(tokens.cuda(), positions.cuda(), caches[2])[1:]
        tol = _check_step(f"{case} decode step {step} (position {pos})", got, base, want)
    if near_ties:
        print(f"{case}: greedy tokens differed only at near-ties (position, kernel, fp32, gap): {near_ties}")
    assert not caches[2].k[0][0].any(), "an idle row (position -1) wrote its cache slot"
    # The caches hold the same rotated keys and values (bf16 rounding apart).
    for layer in range(len(gpu.layers)):
        for name in ("k", "v"):
            g = getattr(caches[2], name)[layer][slot].float().cpu()
            w = getattr(caches[0], name)[layer][slot]
            b = getattr(caches[1], name)[layer][slot].float()
            tol = max(2.0 * (b - w).abs().max().item(), 1e-2)
            assert (g - w).abs().max().item() <= tol, f"{case} {name}-cache layer {layer}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 11])  # 11 rows: projections go to cuBLAS instead of gemv
def test_kernel_batch_decode(batch):
    """A batch of sequences of different lengths (one idle) on the kernel path vs the fp32 path."""
    fp32, bf16, gpu = _three_models("llama-d64-llama3", seed=1)
    V, capacity = fp32.config.vocab_size, 80
    lengths = [3 + 7 * b for b in range(batch)]
    caches = [m.new_cache(batch=batch, capacity=capacity) for m in (fp32, bf16, gpu)]
    last = []
    for slot, n in enumerate(lengths):
        ids = torch.randint(0, V, (n,))
        last.append(fp32.prefill(ids, caches[0], slot)[-1].argmax())
        bf16.prefill(ids, caches[1], slot)
        gpu.prefill(ids.cuda(), caches[2], slot)
    idle = batch // 2
    positions = torch.tensor(lengths, dtype=torch.int32)
    positions[idle] = -1
    tokens = torch.stack(last)
    for step in range(6):
        want = fp32.decode(tokens, positions, caches[0])
        base = bf16.decode(tokens, positions, caches[1])
        got = gpu.decode(tokens.cuda(), positions.cuda(), caches[2])
        live = positions >= 0
        _check_step(f"batch {batch} step {step}", got.cpu()[live], base[live], want[live])
        tokens = want.argmax(-1)
        positions = torch.where(live, positions + 1, positions)


@pytest.mark.gpu
def test_load_defaults_to_cuda_bf16_kernels(tmp_path):
    """load_model with no device/dtype on a GPU host: cuda, bf16, kernel path; its logits follow
    HF's fp32 ones within the bf16 floor for a prompt and a few greedy steps."""
    path, hf = make_tiny_checkpoint(tmp_path, "qwen2", tied=True, head_dim=64)
    model = load_model(path, quiet=True)
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16 and model.use_kernels
    _assert_follows_hf(model, hf)


@pytest.mark.gpu
def test_qwen3_loads_onto_the_kernels_and_other_head_dims_onto_the_reference_path(tmp_path):
    """A Qwen3 checkpoint on a GPU takes the kernels (its q/k norms in rope_append) and follows HF.
    A head dim the kernels are not built for loads with a warning, runs the reference ops in bf16
    on the GPU (still following HF), and the CUDA-graph runner refuses it."""
    from decodex.engine import CudaGraphRunner

    path, hf = make_tiny_checkpoint(tmp_path, "qwen3", tied=True, head_dim=128)
    model = load_model(path, quiet=True)
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16 and model.use_kernels
    _assert_follows_hf(model, hf)
    path, hf = make_tiny_checkpoint(tmp_path, "qwen3", head_dim=32)
    with pytest.warns(UserWarning, match=r"no kernels for head dim 32 \(they are built for 64 and 128\): this "
                                         "model runs on the reference path"):
        model = load_model(path, quiet=True)
    assert model.device.type == "cuda" and not model.use_kernels
    _assert_follows_hf(model, hf)
    with pytest.raises(RuntimeError, match="CudaGraphRunner: decodex has no kernels for head dim 32"):
        CudaGraphRunner(model, max_batch=1, capacity=32)


def _assert_follows_hf(model, hf):
    """A 12-token prompt and 8 greedy steps on `model`: logits within the bf16 floor of HF's fp32."""
    T, steps = 12, 8
    ids = torch.randint(0, model.config.vocab_size, (T,))
    cache = model.new_cache(batch=1, capacity=T + steps)
    logits = [model.prefill(ids, cache, 0).cpu()]
    for step in range(steps):
        token = logits[-1][-1].argmax()
        ids = torch.cat([ids, token[None]])
        logits.append(model.decode(token[None], torch.tensor([T + step], dtype=torch.int32), cache).cpu())
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    got = torch.cat(logits)
    tol = GPU_ATOL_REL * want.abs().max().item()
    err = (got - want).abs().max(dim=-1).values  # per position
    assert (err <= tol).all(), f"positions over {tol:.3g}: {[(i, round(e, 4)) for i, e in enumerate(err.tolist()) if e > tol]}"


class _SharedRouting:
    """Routes the CPU reference models with the kernel path's expert choice, so a near-tie between
    two experts (which bf16 and fp32 may break differently, a jump in the output) cannot hide a real
    error: the GPU model's moe_route kernel (and reference.moe_route, which its prompts take) are
    recorded row by row, and the CPU models' reference.moe_route then takes those ids (their weights
    still from their own logits). Where the recorded choice is not the fp32 model's own, the test
    checks it is a near-tie."""

    def __init__(self, monkeypatch):
        from decodex import reference

        self.reference_route, self.kernel_route = reference.moe_route, torch.ops.decodex.moe_route
        self.rows, self.replay, self.gaps = [], None, []
        monkeypatch.setattr(reference, "moe_route", self._reference)
        monkeypatch.setattr(torch.ops.decodex, "moe_route", self._kernel)

    def _kernel(self, logits, top_k, norm, ids, weights):
        self.kernel_route(logits, top_k, norm, ids, weights)
        self.rows += list(ids.cpu())

    def _reference(self, logits, top_k, norm):
        if self.replay is None:  # the GPU model's prompt (more than 8 rows): recorded
            ids, weights = self.reference_route(logits, top_k, norm)
            self.rows += list(ids.cpu())
            return ids, weights
        ids = torch.stack([self.replay.pop(0) for _ in range(logits.shape[0])]).to(logits.device)
        own, _ = self.reference_route(logits, top_k, norm)
        x = logits.float()
        # How far the shared choice is from this model's own: its top_k sum of logits minus theirs.
        self.gaps.append(float((x.gather(-1, own.long()).sum(-1) - x.gather(-1, ids.long()).sum(-1)).max()))
        weights = torch.softmax(x, -1).gather(-1, ids.long())
        return ids, weights / weights.sum(-1, keepdim=True) if norm else weights

    def run(self, gpu_call, *cpu_calls):
        """gpu_call() recorded, then each of cpu_calls with its choice; returns all results."""
        self.rows = []
        out = [gpu_call()]
        for call in cpu_calls:
            self.replay = list(self.rows)
            out.append(call())
            assert not self.replay, "the CPU model routed fewer rows than the GPU model"
        self.replay = None
        return out


MOE_GPU = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=704,
               vocab_size=1000, num_hidden_layers=3, mlp_only_layers=[1], num_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=96, norm_topk_prob=True)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [5, 37])  # 5: the kernels' routing (<= 8 rows); 37: grouped by expert
def test_moe_kernel_path_matches_reference(monkeypatch, prompt_len):
    """Qwen3-MoE (16 experts, 4 a token; a dense middle layer) on the eager kernel path against the
    fp32 reference for the prompt and 64 decode steps, every step with the same expert choice
    (_SharedRouting); the kernels' choice differs from fp32's own only at near-ties."""
    from decodex.model import Model

    config = tiny_config("qwen3_moe", **MOE_GPU)
    weights = random_weights(config, seed=3, dtype=torch.bfloat16)
    fp32, bf16, gpu = (Model(config, weights, d, t) for d, t in
                       (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.bfloat16)))
    assert gpu.use_kernels and gpu.layers[0].router_w is not None and gpu.layers[1].router_w is None
    routing = _SharedRouting(monkeypatch)
    V, capacity = config.vocab_size, prompt_len + GPU_DECODE_STEPS + 3
    ids = torch.randint(0, V, (prompt_len,))
    caches = [m.new_cache(batch=2, capacity=capacity) for m in (fp32, bf16, gpu)]
    got, want, base = routing.run(lambda: gpu.prefill(ids.cuda(), caches[2], 1),
                                  lambda: fp32.prefill(ids, caches[0], 1), lambda: bf16.prefill(ids, caches[1], 1))
    _check_step(f"moe prefill (T={prompt_len})", got, base, want)
    for step in range(GPU_DECODE_STEPS):
        pos = prompt_len + step
        tokens = torch.full((2,), int(want[-1].argmax()))
        positions = torch.tensor([-1, pos], dtype=torch.int32)  # row 0 idle
        got, want, base = routing.run(lambda: gpu.decode(tokens.cuda(), positions.cuda(), caches[2]),
                                      lambda: fp32.decode(tokens, positions, caches[0]),
                                      lambda: bf16.decode(tokens, positions, caches[1]))
        want, base, got = want[1:], base[1:], got[1:]
        _check_step(f"moe decode step {step} (position {pos})", got, base, want)
    # The shared choice was fp32's own but for near-ties: its logits then within bf16's error of it.
    near = [g for g in routing.gaps if g > 0]
    assert max(routing.gaps) < 0.1, f"the kernels chose experts fp32 ranks well below its own: gaps {near}"
    print(f"expert choices that differed from fp32's own (near-ties; logit-sum gaps): {near}")
