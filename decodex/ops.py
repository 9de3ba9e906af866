"""Python face of the kernels: fake impls (so torch.compile and opcheck can trace the ops) and
allocating wrappers for use outside a CUDA graph. The decode path calls torch.ops.decodex.* with
its own preallocated buffers instead.
"""
from __future__ import annotations

import torch

from decodex import _ext, reference

ops = torch.ops.decodex if _ext.available() else None


if _ext.available():
    # Ops that only write their out-params: nothing to describe but "no outputs".
    def _no_output(*args, **kwargs):
        return None

    for _name in ("gemv", "gemv_silu_mul", "gemv_rope_append", "rms_norm", "fused_add_rms_norm",
                  "rope_append", "silu_mul", "decode_attention", "rope_append_attention", "moe_route",
                  "moe_gemv_silu_mul", "moe_gemv_sum", "argmax", "sample", "advance_positions", "lt_linear"):
        torch.library.register_fake(f"decodex::{_name}")(_no_output)


def _require(op: str, **tensors: tuple[torch.Tensor, int]):
    """The extension is built, and each named argument is a CUDA tensor with that many dims
    (checked here because the wrapper reads shapes before the op's own checks run)."""
    if not _ext.available():
        raise RuntimeError(_ext.why_unavailable())
    for name, (t, dims) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decodex.ops.{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise RuntimeError(f"decodex.ops.{op}: {name} must be a CUDA tensor, got device {t.device} "
                               f"(decodex.reference.{op} computes the same on any device)")
        if t.dim() != dims:
            raise RuntimeError(f"decodex.ops.{op}: {name} must be {dims}-D, got shape {list(t.shape)}")


# rms_norm(x, w, eps) @ W^T as one GEMV: gemv(x, fold_norm_weight(W, w), rms_eps=eps).
fold_norm_weight = reference.fold_norm_weight


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> new [M, N], M <= 64; with rms_eps (M <= 8), each
    product row scaled by 1/rms(x row) before the bias. (Accumulating into an existing tensor:
    torch.ops.decodex.gemv(..., out=that, accumulate=True).)"""
    _require("gemv", x=(x, 2), weight=(weight, 2))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    ops.gemv(x, weight, bias, out, rms_eps=rms_eps)
    return out


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K], weight [2I, K] = [gate; up] -> new [M, I] = silu(x gate^T) * (x up^T); rms_eps as
    in gemv."""
    _require("gemv_silu_mul", x=(x, 2), weight=(weight, 2))
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    ops.gemv_silu_mul(x, weight, out, rms_eps=rms_eps)
    return out


def gemv_rope_append(x, weight, bias, inv_freq, positions, k_cache, v_cache,
                     rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K] @ the merged q|k|v weight^T (+ bias) -> new [M, (H + 2 Hkv) D] with q and k rotated
    at positions [M]; k and v written into the caches [M, Hkv, S, D] at those positions; rms_eps
    as in gemv."""
    _require("gemv_rope_append", x=(x, 2), weight=(weight, 2))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    ops.gemv_rope_append(x, weight, bias, inv_freq, positions, out, k_cache, v_cache, rms_eps=rms_eps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _require("rms_norm", x=(x, 2))
    out = torch.empty_like(x)
    ops.rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(x, residual, weight, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual)."""
    _require("fused_add_rms_norm", x=(x, 2))
    out = torch.empty_like(x)
    ops.fused_add_rms_norm(x, residual, weight, eps, out)
    return out


def silu_mul(gate_up: torch.Tensor, rms_x: torch.Tensor | None = None,
             rms_eps: float | None = None) -> torch.Tensor:
    _require("silu_mul", gate_up=(gate_up, 2))
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    ops.silu_mul(gate_up, out, rms_x=rms_x, rms_eps=rms_eps)
    return out


def attention_workspace(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, capacity: int,
                        device) -> torch.Tensor:
    """The fp32 scratch decode_attention needs for a cache of this capacity."""
    _require("attention_workspace")
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"decodex.ops.attention_workspace: device must be a CUDA device, got {device}")
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"decodex.ops.attention_workspace: {name} must be >= 1, got {value}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = ops.decode_attention_splits(batch, num_kv_heads, capacity, sms)
    return torch.empty(batch, num_heads, splits, head_dim + 2, dtype=torch.float32, device=device)


def decode_attention(q, k_cache, v_cache, lengths, scale: float) -> torch.Tensor:
    _require("decode_attention", q=(q, 3), k_cache=(k_cache, 4))
    B, H, D = q.shape
    ws = attention_workspace(B, H, k_cache.shape[1], D, k_cache.shape[2], q.device)
    out = torch.empty_like(q)
    ops.decode_attention(q, k_cache, v_cache, lengths, scale, ws, out)
    return out


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (ids [M, top_k] int32, weights [M, top_k] fp32): each row's top_k experts
    (largest logits first, ties to the lower index) and their softmax weights (renormalised over
    the top_k if norm_topk_prob)."""
    _require("moe_route", logits=(logits, 2))
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(logits.shape[0], top_k, dtype=torch.float32, device=logits.device)
    ops.moe_route(logits, top_k, norm_topk_prob, ids, weights)
    return ids, weights


def moe_gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                      rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K], the experts' gate|up weight [E, 2I, K], ids [M, k] -> new [M, k, I]:
    silu(x gate_e^T) * (x up_e^T) of each row's experts; rms_eps as in gemv."""
    _require("moe_gemv_silu_mul", x=(x, 2), weight=(weight, 3), ids=(ids, 2))
    out = torch.empty(x.shape[0], ids.shape[1], weight.shape[1] // 2, dtype=x.dtype, device=x.device)
    ops.moe_gemv_silu_mul(x, weight, ids, out, rms_eps=rms_eps)
    return out


def moe_gemv_sum(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [M, k, I], the experts' down weight [E, N, I], ids and weights [M, k] -> new [M, N]: each
    row's expert products summed with their weights."""
    _require("moe_gemv_sum", x=(x, 3), weight=(weight, 3), ids=(ids, 2))
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    ops.moe_gemv_sum(x, weight, ids, weights, out)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    _require("argmax", logits=(logits, 2))
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    ops.argmax(logits, out)
    return out


def sample(logits, temperature, top_k, top_p, seed, positions) -> torch.Tensor:
    _require("sample", logits=(logits, 2))
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    ops.sample(logits, temperature, top_k, top_p, seed, positions, out)
    return out
