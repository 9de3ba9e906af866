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

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


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
    """A transformers Qwen2Config / LlamaConfig of the TINY sizes (overrides win)."""
    from transformers import LlamaConfig, Qwen2Config

    kwargs = dict(TINY, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling, rope_theta=kwargs["rope_theta"])
    if model_type == "qwen2":
        return Qwen2Config(**kwargs)
    if model_type == "llama":
        return LlamaConfig(**kwargs)
    raise ValueError(f"model_type {model_type!r}")


def make_tiny_checkpoint(tmp_path, model_type: str = "llama", tied: bool = False, sharded: bool = False,
                         rope_scaling: dict | None = None, dtype: torch.dtype = torch.float32,
                         head_dim: int = 32, seed: int = 0, **overrides):
    """Writes a random tiny HF checkpoint to tmp_path/<name> with save_pretrained (safetensors;
    `sharded`: several shards + model.safetensors.index.json). Returns (path, hf_model): the HF model
    in fp32 eval mode with eager attention, holding exactly the saved (dtype-rounded) weights."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cfg = hf_config(model_type, tied=tied, rope_scaling=rope_scaling, head_dim=head_dim, **overrides)
    cfg._attn_implementation = "eager"
    cls = Qwen2ForCausalLM if model_type == "qwen2" else LlamaForCausalLM
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


# Where decode attention's splits merge: "cluster" (at most 8 splits on sm_90: inside the split
# kernel's cluster) or "combine" (DECODEX_ATTN_CLUSTER=0: the workspace and the combine kernel, which
# is also what more than 8 splits always take).
MERGES = ["cluster", "combine"]


def set_merge(monkeypatch, merge):
    monkeypatch.setenv("DECODEX_ATTN_CLUSTER", "1" if merge == "cluster" else "0")


def wgmma_available() -> bool:
    """Whether decodex's wgmma GEMV runs here (an sm_90a build on a device of compute capability
    9.0): gemv_silu_mul then takes up to 64 rows of x, else 8."""
    if not torch.cuda.is_available():
        return False
    from decodex import _ext

    return _ext.available() and torch.ops.decodex.gemv_silu_mul_max_rows(torch.cuda.current_device()) == 64
