"""Tiny random checkpoints and models shared by the tests.

make_tiny_checkpoint: an HF directory written by transformers (the real file layout, config dialect
and tensor names), plus the HF model to compare with. tiny_config / random_weights: a decodex
ModelConfig and HF-named weights without transformers (fast; any head dim, e.g. 64/128 for kernels).

Weights are re-drawn at unit scale (HF's std-0.02 init makes every logit ~0 and comparisons
meaningless), with non-trivial norm weights and biases so a dropped one shows up.
"""
from __future__ import annotations

import os

import torch

from decodex.config import ModelConfig

# CPU test sizes: small, with head_dim * heads != hidden so head_dim is really read from the config.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0)

# Qwen3-MoE's expert fields at the TINY sizes: 8 experts, 2 a token.
MOE_TINY = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _randomize_(named_params, generator: torch.Generator):
    """Unit-scale re-init in place: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norms ~ 1 + 0.1 N(0, 1), biases ~ 0.2 N(0, 1)."""
    with torch.no_grad():
        for name, p in named_params:
            r = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                r = 1.0 + 0.1 * r
            elif name.endswith("bias"):
                r = 0.2 * r
            elif "embed_tokens" in name:
                pass
            else:
                r = r / p.shape[-1] ** 0.5
            p.copy_(r.to(p.dtype))


def hf_config(model_type: str, tied: bool = False, rope_scaling: dict | None = None, **overrides):
    """A transformers config (Qwen2, Qwen3, Qwen3-MoE, Llama or Mistral) of the TINY sizes (overrides win;
    Mistral's sliding window is off unless given)."""
    kwargs = dict(TINY, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling, rope_theta=kwargs["rope_theta"])
    return _hf_classes(model_type)[0](**kwargs)


def _hf_classes(model_type: str):
    """transformers' (config class, causal-LM class) for a decodex model_type."""
    import transformers

    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "llama": "Llama", "mistral": "Mistral"}
    if model_type not in names:
        raise ValueError(f"model_type {model_type!r}")
    name = names[model_type]
    return getattr(transformers, name + "Config"), getattr(transformers, name + "ForCausalLM")


def make_tiny_checkpoint(tmp_path, model_type: str = "llama", tied: bool = False, sharded: bool = False,
                         rope_scaling: dict | None = None, dtype: torch.dtype = torch.float32,
                         head_dim: int = 32, seed: int = 0, **overrides):
    """Writes a random tiny HF checkpoint to tmp_path/<name> with save_pretrained (safetensors;
    `sharded`: several shards + model.safetensors.index.json). Returns (path, hf_model): the HF model
    in fp32 eval mode with eager attention, holding exactly the saved (dtype-rounded) weights."""
    cfg = hf_config(model_type, tied=tied, rope_scaling=rope_scaling, head_dim=head_dim, **overrides)
    cfg._attn_implementation = "eager"
    cls = _hf_classes(model_type)[1]
    torch.manual_seed(seed)
    model = cls(cfg)
    _randomize_(model.named_parameters(), torch.Generator().manual_seed(seed))
    model = model.to(dtype).eval()
    name = f"{model_type}{'-tied' if tied else ''}{'-sharded' if sharded else ''}-{str(dtype)[6:]}-d{head_dim}"
    path = os.path.join(os.fspath(tmp_path), name)
    # Shards of ~48 KB: the tiny model splits into several files.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="48KB" if sharded else "10GB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")) == sharded
    # A fresh fp32 model with the saved weights: `.float()` on the saved one would keep its RoPE
    # inv_freq buffer rounded to `dtype`, which HF computes in fp32 when it loads a checkpoint.
    reference = cls(cfg).eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return path, reference


def tiny_config(model_type: str = "llama", tied: bool = False, rope_scaling: dict | None = None,
                **overrides) -> ModelConfig:
    """A decodex ModelConfig of the TINY sizes, without transformers."""
    raw = dict(TINY, model_type=model_type, tie_word_embeddings=tied, rope_scaling=rope_scaling,
               bos_token_id=1, eos_token_id=2)
    raw.update(overrides)
    return ModelConfig.from_dict(raw, source="<tiny_config>")


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """HF-named random weights of every tensor `config` needs, at unit scale, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.empty(shape) for name, shape in config.weight_shapes().items()}
    _randomize_(weights.items(), g)
    return {name: t.to(dtype) for name, t in weights.items()}


def random_model(model_type: str = "llama", device="cpu", dtype=torch.float32, seed: int = 0, **overrides):
    """A decodex Model with random weights of the TINY sizes (overrides win)."""
    from decodex.model import Model

    config = tiny_config(model_type, **overrides)
    return Model(config, random_weights(config, seed), device, dtype)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() run once on a side stream (lazy initialisation stays out of the capture), then captured
    into a CUDA graph, which is returned without being replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def linear_inputs(M: int, N: int, K: int, bias: bool = True, device="cuda"):
    """x [M, K] ~ N(0, 1), weight [N, K] ~ N(0, 1/K), bias [N] ~ N(0, 0.25) (None without bias), bf16:
    the product's outputs are O(1)."""
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
    b = (0.5 * torch.randn(N, device=device)).to(torch.bfloat16) if bias else None
    return x, w, b


def order_sensitive_inputs(N: int, K: int, device="cuda"):
    """x, one row of ones, and weight rows [2^30, 1, ..., 1, -2^30] (bf16): an fp32 partial sum that
    holds +-2^30 (ulp 128) loses the ones added to it a k-step (32) at a time, while a k-range without
    them counts its ones exactly; so a GEMV's result depends on where its configuration's k-ranges
    split K, and stays small enough (at most K) for bf16 to show it."""
    x = torch.ones(1, K, device=device, dtype=torch.bfloat16)
    w = torch.ones(N, K, device=device, dtype=torch.bfloat16)
    w[:, 0], w[:, -1] = 2.0 ** 30, -(2.0 ** 30)
    return x, w


def check_config_is_launched(run, monkeypatch) -> None:
    """For run(config) -> a GEMV op's output on order_sensitive_inputs (config None: the op's own
    choice): configurations of 6, 3, 2 and 40 k-ranges (the last two only with clusters, sm_90) do
    not all give the table's bits, so config is launched, not only checked; and with
    DECODEX_GEMV_CONFIG set (one k-range), each gives the knob's bits (the knob wins)."""
    clusters = torch.cuda.get_device_capability()[0] >= 9
    configs = [[1, 6, 1, 4], [2, 3, 1, 8]] + ([[4, 1, 2, 4], [1, 5, 8, 8]] if clusters else [])
    table = run(None)
    own = [run(c) for c in configs]
    assert any(not torch.equal(o, table) for o in own), "config changed no result"
    monkeypatch.setenv("DECODEX_GEMV_CONFIG", "1,1,1,4")
    knob = run(None)
    assert any(not torch.equal(o, knob) for o in own), "the knob's configuration is not told apart"
    for c in configs:
        assert torch.equal(run(c), knob)


def norm_inputs(M: int, K: int, device="cuda"):
    """x with rows of different scales (rms from ~0.3 to ~5) and a norm weight ~ 1 + 0.2 N(0, 1)."""
    scale = torch.exp(torch.linspace(-1.2, 1.6, M, device=device))[:, None]
    x = (torch.randn(M, K, device=device) * scale).to(torch.bfloat16)
    w = (1.0 + 0.2 * torch.randn(K, device=device)).to(torch.bfloat16)
    return x, w


def qkv_views(B, H, Hkv, D, device="cuda"):
    """q, k, v as views into one merged random bf16 [B, (H + 2 Hkv) D] buffer (the QKV product's
    output); returns (qkv, q, k, v)."""
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=device).to(torch.bfloat16)
    q = qkv[:, : H * D].view(B, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(B, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(B, Hkv, D)
    return qkv, q, k, v


# Where decode attention's splits merge, and the split kernel's warps a block: "cluster" (at most 8
# splits on sm_90: inside the split kernel's cluster, 4 warps a block), "cluster-8w" (the same with 8
# warps a block, which the op takes for short caches at small batches), "combine"
# (DECODEX_ATTN_CLUSTER=0: the workspace and the combine kernel, which is also what more than 8 splits
# always take) or "combine-6w" (the same with 6 warps a block).
MERGES = ["cluster", "cluster-8w", "combine", "combine-6w"]


def set_merge(monkeypatch, merge):
    monkeypatch.setenv("DECODEX_ATTN_CLUSTER", "0" if merge.startswith("combine") else "1")
    warps = merge.rsplit("-", 1)[1][:-1] if merge.endswith("w") else "4"
    monkeypatch.setenv("DECODEX_ATTN_WARPS", warps)


def wgmma_available() -> bool:
    """Whether decodex's wgmma GEMV runs here (an sm_90a build on a device of compute capability
    9.0): gemv_silu_mul then takes up to 64 rows of x, else 8."""
    if not torch.cuda.is_available():
        return False
    from decodex import _ext

    return _ext.available() and torch.ops.decodex.gemv_silu_mul_max_rows(torch.cuda.current_device()) == 64


# ---- greedy decoding through the CUDA-graph runner, compared sequence by sequence ----------------

FLOOR = 0.02  # tolerance floor, as a fraction of the fp32 logits' RMS (a few bf16 ulps of a logit)


def gpu_decode(runner, prompts, steps, params=None, greedy=True, rows=None):
    """Prefill prompts into rows 0..B-1 and replay `steps` graph steps of the smallest graph that
    holds them. Returns per step k (k = 0: the prefill) the bf16 logits [B, V] as fp32, the tokens
    [B] drawn from them, and the positions [B] the drawn tokens will be consumed at."""
    B = len(prompts)
    n = runner.graph_size(B)
    runner.reset()
    for r, p in enumerate(prompts):
        runner.prefill_row(r, p, params[r] if params else None)
    logits, tokens, positions = [], [], []

    def record():
        torch.cuda.synchronize()
        logits.append(runner.logits[:B].float().cpu())
        tokens.append(runner.tokens[:B].cpu())
        positions.append(runner.positions[:B].cpu())

    record()
    for _ in range(steps):
        runner.step(n, greedy)
        record()
    return logits, tokens, positions


def same_until_near_tie(label, got, alone_tokens, alone_logits):
    """got == alone tokens, except after a step where the alone run's top-2 logit gap is a near-tie."""
    for k, t in enumerate(got):
        if t != alone_tokens[k]:
            row = alone_logits[k]
            top2 = row.topk(2).values
            gap = (top2[0] - top2[1]).item()
            tie = 2 * FLOOR * row.pow(2).mean().sqrt().item()
            print(f"{label}: differs from the lone run at step {k}: top-2 gap {gap:.4f} (tie < {tie:.4f})")
            assert gap <= tie, f"{label}: token {t} != lone run's {alone_tokens[k]} at step {k}, gap {gap:.4f}"
            return


def check_logits(label, gpu, ref32, ref16, tokens=None):
    """Per step and row: |gpu - fp32| <= 2 |bf16 CPU - fp32| + FLOOR * rms. Greedy tokens (if given)
    must be the argmax of the GPU's own logits and may differ from the fp32 argmax only at a
    near-tie. Returns the per-step tolerances [steps][B] and the first divergence (or None)."""
    tols, first_div, worst = [], None, 0.0
    for k, (g, r, h) in enumerate(zip(gpu, ref32, ref16)):
        row_tols = []
        for b in range(g.shape[0]):
            err = (g[b] - r[b]).abs().max().item()
            err16 = (h[b].float() - r[b]).abs().max().item()
            rms = r[b].pow(2).mean().sqrt().item()
            tol = 2 * err16 + FLOOR * rms
            row_tols.append(tol)
            worst = max(worst, err / tol)
            assert err <= tol, (f"{label}: step {k} row {b}: max |logit error| {err:.4f} > tolerance "
                                f"{tol:.4f} (bf16 CPU error {err16:.4f}, logit rms {rms:.3f})")
            if tokens is not None:
                t = int(tokens[k][b])
                assert t == int(g[b].argmax()), (f"{label}: step {k} row {b}: token {t} is not the argmax "
                                                 f"{int(g[b].argmax())} of the graph's own logits")
                best = int(r[b].argmax())
                if t != best:
                    gap = (r[b][best] - r[b][t]).item()
                    if first_div is None:
                        first_div = (k, b, gap)
                        print(f"{label}: greedy token differs from fp32 at step {k} row {b}: {t} vs {best}, "
                              f"fp32 gap {gap:.4f} (near-tie threshold {2 * tol:.4f})")
                    assert gap <= 2 * tol, (f"{label}: step {k} row {b}: token {t} differs from the fp32 "
                                            f"argmax {best} by a gap of {gap:.4f} > {2 * tol:.4f}: not a tie")
        tols.append(row_tols)
    print(f"{label}: worst error / tolerance = {worst:.3f}")
    return tols, first_div
