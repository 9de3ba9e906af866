"""The Qwen2 / Qwen3 / Qwen3-MoE / Llama / Mistral decoder as one layer loop, with weights merged
where a kernel reads them together (q|k|v rows in one matrix, gate|up rows in another, each
expert's stacked), and a static KV cache.

The weight of each layer's two RMSNorms is folded into the product after it (decodex.reference.
fold_norm_weight: qkv_w's columns scaled by input_layernorm.weight, gate_up_w's by
post_attention_layernorm.weight), so those norms have unit weight: rms_norm(x, w) @ W^T =
rms_norm(x, 1) @ (W * w)^T. That lets the decode GEMVs normalise their input themselves
(gemv(..., rms_eps)) with no norm weight to read. The final norm keeps its weight (the LM head may be
the embedding tensor).

Two paths run the same loop on the same tensors:
- reference (CPU, or any device without the kernels, or a model they do not compute: see
  kernels_missing): decodex.reference ops, fp32 math; the source of truth that the tests compare
  with transformers.
- kernels (CUDA, eager, outside graphs; `model.use_kernels`): torch.ops.decodex.* where a kernel
  exists (gemv / gemv_silu_mul and the expert ops for <= 8 rows, fused_add_rms_norm, rope_append,
  decode_attention, silu_mul, moe_route), cuBLAS and SDPA for prefill GEMMs and attention (a
  prompt's expert products grouped by expert). The CUDA-graph decode path lives in engine.py.

Shapes: T prompt tokens, B batch, M rows (T or B), Hd hidden, H query heads, Hkv KV heads,
D head dim, I intermediate, V vocabulary, S cache capacity.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodex import _ext, reference
from decodex.config import LoadError, ModelConfig

@functools.lru_cache(maxsize=8)
def unit_norm(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size] ones: the weight of a folded norm where a norm kernel still runs (cuBLAS products).
    One tensor per (size, dtype, device), made once; never written."""
    return torch.ones(size, dtype=dtype, device=device)


KERNEL_HEAD_DIMS = (64, 128)  # head dims rope_append / decode_attention are built for


MOE_MAX_EXPERTS, MOE_MAX_TOP_K = 1024, 32  # what moe_route (csrc/moe.cu) takes

GEMV_MAX_ROWS = 8  # rows of x of the fused GEMVs and of rms_eps (plain gemv: 64); eager: more go to cuBLAS


@dataclass
class Layer:
    qkv_w: torch.Tensor  # [(H + 2*Hkv) * D, Hd]  rows: q, then k, then v; input_layernorm folded in
    qkv_b: torch.Tensor | None  # [(H + 2*Hkv) * D]  (Qwen2; Llama / Qwen3 with attention_bias)
    o_w: torch.Tensor  # [Hd, H*D]
    gate_up_w: torch.Tensor | None  # [2*I, Hd]  rows: gate, then up; post_attention_layernorm folded in
    down_w: torch.Tensor | None  # [Hd, I]  (both None in a mixture-of-experts layer)
    o_b: torch.Tensor | None = None  # [Hd]  Llama / Qwen3 with attention_bias=True
    q_norm: torch.Tensor | None = None  # [D]  Qwen3: RMSNorm weight of each q head, before RoPE
    k_norm: torch.Tensor | None = None  # [D]  Qwen3: the same for each k head
    # Qwen3-MoE's expert layers (Ie: moe_intermediate_size); post_attention_layernorm folded into
    # router_w and experts_gate_up.
    router_w: torch.Tensor | None = None  # [E, Hd]
    experts_gate_up: torch.Tensor | None = None  # [E, 2*Ie, Hd]  each expert's gate rows, then up
    experts_down: torch.Tensor | None = None  # [E, Hd, Ie]


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [B, Hkv, S, D], rotated keys
    v: list[torch.Tensor]  # per layer [B, Hkv, S, D]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def _check_id_range(lo: int, hi: int, vocab_size: int, what: str) -> None:
    """Token ids outside [0, vocab_size) would index the embedding out of bounds (on a GPU, a
    device-side assert that ends the process's CUDA context): a ValueError naming `what` instead."""
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{what}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                         f"[0, {vocab_size})")


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """_check_id_range on the smallest and largest of `ids` (one host read: a sync on a GPU)."""
    if ids.numel():
        _check_id_range(*torch.stack(torch.aminmax(ids)).tolist(), vocab_size, what)


class _ReferenceOps:
    """decodex.reference: fp32 math, results rounded to the input dtype."""

    @staticmethod
    def linear(x, w, b=None, rms_eps=None):  # x [M, K] @ w [N, K]^T (/ rms(x)) (+ b [N]) -> [M, N]
        return reference.gemv(x, w, b, rms_eps=rms_eps)

    @staticmethod
    def add(residual, x):  # residual + x, rounded to its dtype
        return reference.add_rounded(residual, x)

    @staticmethod
    def rms_norm(x, w, eps):
        return reference.rms_norm(x, w, eps)

    @staticmethod
    def silu_mul(gate_up):  # [M, 2I] -> [M, I]
        return reference.silu_mul(gate_up)

    @classmethod
    def gate_up_silu(cls, x, w, rms_eps=None):  # w [2I, K] = [gate; up] -> silu(x gate^T) * x up^T
        return cls.silu_mul(cls.linear(x, w, rms_eps=rms_eps))

    @staticmethod
    def moe(x, layer, top_k, norm_topk_prob, rms_eps=None):  # the expert layer's output [M, Hd]
        return reference.moe(x, layer.router_w, layer.experts_gate_up, layer.experts_down, top_k,
                             norm_topk_prob, rms_eps)


class _ReferenceRowOps(_ReferenceOps):
    """Decode on the reference path: one GEMV per row. BLAS picks different kernels (so different
    summation orders) for 1 and for several rows; row by row, a sequence's logits do not depend on
    what else is in the batch, and batch decode equals single decode bit for bit."""

    @staticmethod
    def linear(x, w, b=None, rms_eps=None):
        return torch.cat([reference.gemv(x[i:i + 1], w, b, rms_eps=rms_eps) for i in range(x.shape[0])])

    @staticmethod
    def moe(x, layer, top_k, norm_topk_prob, rms_eps=None):
        return torch.cat([_ReferenceOps.moe(x[i:i + 1], layer, top_k, norm_topk_prob, rms_eps)
                          for i in range(x.shape[0])])


class _KernelOps:
    """torch.ops.decodex kernels (bf16, CUDA); cuBLAS for GEMMs with more rows than gemv takes
    (after an rms_norm kernel of unit weight where the GEMV would scale by 1/rms). For <= 8 rows
    these are the decode graph's kernels on the same inputs, so eager and graph decode agree bit
    for bit."""

    @classmethod
    def _normed(cls, x, rms_eps):  # rms_norm(x, 1), the input cuBLAS gets where the GEMV would scale
        return cls.rms_norm(x, unit_norm(x.shape[1], x.dtype, x.device), rms_eps)

    @classmethod
    def linear(cls, x, w, b=None, rms_eps=None):
        if x.shape[0] > GEMV_MAX_ROWS:
            return F.linear(x if rms_eps is None else cls._normed(x, rms_eps), w, b)
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        torch.ops.decodex.gemv(x, w, b, out, rms_eps=rms_eps)
        return out

    @staticmethod
    def add(residual, x):  # torch's bf16 add: the fp32 sum rounded once, as gemv(accumulate) rounds
        return residual + x

    @staticmethod
    def rms_norm(x, w, eps):
        out = torch.empty_like(x)
        torch.ops.decodex.rms_norm(x, w, eps, out)
        return out

    @staticmethod
    def silu_mul(gate_up):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype,
                          device=gate_up.device)
        torch.ops.decodex.silu_mul(gate_up, out)
        return out

    @classmethod
    def gate_up_silu(cls, x, w, rms_eps=None):
        if x.shape[0] > GEMV_MAX_ROWS:
            return cls.silu_mul(F.linear(x if rms_eps is None else cls._normed(x, rms_eps), w))
        out = torch.empty(x.shape[0], w.shape[0] // 2, dtype=x.dtype, device=x.device)
        torch.ops.decodex.gemv_silu_mul(x, w, out, rms_eps=rms_eps)
        return out

    @classmethod
    def moe(cls, x, layer, top_k, norm_topk_prob, rms_eps=None):
        """The expert layer: up to 8 rows on the decode graph's kernels (router gemv, moe_route,
        moe_gemv_silu_mul, moe_gemv_sum); more (a prompt) routed by moe_route on a cuBLAS router
        product, then cuBLAS products grouped by expert (_moe_grouped)."""
        M = x.shape[0]
        ops, (E, Hd) = torch.ops.decodex, layer.router_w.shape
        ids = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
        weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
        if M > GEMV_MAX_ROWS:
            h = x if rms_eps is None else cls._normed(x, rms_eps)
            ops.moe_route(F.linear(h, layer.router_w), top_k, norm_topk_prob, ids, weights)
            return cls._moe_grouped(h, layer, ids, weights)
        logits = torch.empty(M, E, dtype=x.dtype, device=x.device)
        ops.gemv(x, layer.router_w, None, logits, rms_eps=rms_eps)
        ops.moe_route(logits, top_k, norm_topk_prob, ids, weights)
        act = torch.empty(M, top_k, layer.experts_down.shape[2], dtype=x.dtype, device=x.device)
        ops.moe_gemv_silu_mul(x, layer.experts_gate_up, ids, act, rms_eps=rms_eps)
        out = torch.empty(M, Hd, dtype=x.dtype, device=x.device)
        ops.moe_gemv_sum(act, layer.experts_down, ids, weights, out)
        return out

    @classmethod
    def _moe_grouped(cls, h, layer, ids, weights):
        """Many rows h [M, Hd] (normalised) with their choice ids / weights [M, k]: the (row, slot)
        pairs sorted by expert, each expert's rows through its gate|up and down products (cuBLAS)
        and silu_mul, the results weighted and added per row in fp32. One host read a layer (how
        many rows each expert got)."""
        M, k = ids.shape
        flat = ids.flatten().long()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, rows in order within
        counts = torch.bincount(flat, minlength=layer.router_w.shape[0]).tolist()
        rows = order // k
        xs = h.index_select(0, rows)  # [M k, Hd]
        ys = torch.empty(M * k, h.shape[1], dtype=h.dtype, device=h.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                seg = slice(start, start + count)
                ys[seg] = F.linear(cls.silu_mul(F.linear(xs[seg], layer.experts_gate_up[e])),
                                   layer.experts_down[e])
                start += count
        out = torch.zeros(M, h.shape[1], dtype=torch.float32, device=h.device)
        out.index_add_(0, rows, ys.float() * weights.flatten()[order, None])
        return out.to(h.dtype)


class Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device=None, dtype=None):
        """weights: HF tensor names -> tensors (any device / float dtype), checked against config."""
        self.config = config
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype if dtype is not None else torch.float32
        c = config
        shapes = c.weight_shapes()
        if "lm_head.weight" in weights:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for name, shape in shapes.items():
            if name not in weights:
                raise LoadError(f"missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise LoadError(f"tensor {name!r} has shape {list(weights[name].shape)}, "
                                f"expected {list(shape)} from the config")

        def w(name):  # copy to the device first, then cast there (faster than casting on the CPU)
            return weights[name].to(self.device).to(self.dtype).contiguous()

        def cat(*names, norm):  # rows of several tensors, with the norm weight `norm` folded in
            rows = torch.cat([weights[n].to(self.device) for n in names], dim=0)
            return reference.fold_norm_weight(rows.float(), weights[norm].to(self.device)).to(self.dtype).contiguous()

        def cat_bias(*names):
            return torch.cat([w(n) for n in names], dim=0)

        self.embed = w("model.embed_tokens.weight")  # [V, Hd]
        self.final_norm = w("model.norm.weight")  # [Hd]
        # [Hd] ones for the folded norms, made here, at load: the decode graph's capture must not be
        # the first to ask unit_norm for it (an allocation and a fill inside the capture).
        self.unit_norm = unit_norm(c.hidden_size, self.dtype, self.device)
        # Tied (Llama 3.2, small Qwen2): the LM head IS the embedding tensor. An lm_head.weight stored
        # anyway is used only if it differs, as transformers 5 does (it then declines to tie).
        self.lm_head = self.embed  # [V, Hd]
        if not c.tie_word_embeddings or "lm_head.weight" in weights:
            lm_head = w("lm_head.weight")
            if not (c.tie_word_embeddings and torch.equal(lm_head, self.embed)):
                if c.tie_word_embeddings:
                    warnings.warn("tie_word_embeddings is true but the checkpoint's lm_head.weight "
                                  "differs from the embeddings: using lm_head.weight (as transformers does)")
                self.lm_head = lm_head
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            post_norm = p + "post_attention_layernorm.weight"
            if i in c.moe_layers:
                experts = [p + f"mlp.experts.{e}." for e in range(c.num_experts)]
                mlp = dict(gate_up_w=None, down_w=None, router_w=cat(p + "mlp.gate.weight", norm=post_norm),
                           experts_gate_up=torch.stack([cat(x + "gate_proj.weight", x + "up_proj.weight",
                                                            norm=post_norm) for x in experts]),
                           experts_down=torch.stack([w(x + "down_proj.weight") for x in experts]))
            else:
                mlp = dict(gate_up_w=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", norm=post_norm),
                           down_w=w(p + "mlp.down_proj.weight"))
            self.layers.append(Layer(
                qkv_w=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                          norm=p + "input_layernorm.weight"),
                qkv_b=cat_bias(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if c.attention_bias else None,
                o_w=w(a + "o_proj.weight"),
                o_b=w(a + "o_proj.bias") if c.o_proj_bias else None,
                q_norm=w(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=w(a + "k_norm.weight") if c.qk_norm else None,
                **mlp,
            ))
        self.inv_freq = reference.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(self.device)  # [D/2]
        # YaRN scales cos and sin, so q and k, by its attention factor: every logit by its square.
        self.scale = reference.rope_attention_factor(c.rope_scaling) ** 2 / math.sqrt(c.head_dim)
        self.use_kernels = self.kernels_supported()
        gap = self.kernels_missing()
        if gap and self.device.type == "cuda" and _ext.available() and self.dtype == torch.bfloat16:
            warnings.warn(f"decodex has no kernels for {gap}: this model runs on the reference path "
                          "(PyTorch ops, many times slower than the kernels)")

    def kernels_missing(self) -> str | None:
        """What of this model's architecture the kernels do not compute, or None."""
        c = self.config
        if c.head_dim not in KERNEL_HEAD_DIMS:
            return f"head dim {c.head_dim} (they are built for {' and '.join(map(str, KERNEL_HEAD_DIMS))})"
        if c.moe_layers and not (c.num_experts <= MOE_MAX_EXPERTS and c.num_experts_per_tok <= MOE_MAX_TOP_K
                                 and c.moe_intermediate_size % 8 == 0):
            return (f"{c.num_experts} experts, {c.num_experts_per_tok} a token, moe_intermediate_size "
                    f"{c.moe_intermediate_size} (moe_route and the expert GEMVs take up to {MOE_MAX_EXPERTS} "
                    f"experts, {MOE_MAX_TOP_K} a token, and an intermediate size that is a multiple of 8)")
        return None

    def head_norms(self, layer: Layer) -> dict:
        """rope_append's q_norm / k_norm / norm_eps for `layer` (Qwen3), else nothing."""
        if layer.q_norm is None:
            return {}
        return dict(q_norm=layer.q_norm, k_norm=layer.k_norm, norm_eps=self.config.rms_norm_eps)

    def kernels_supported(self) -> bool:
        """The eager kernel path needs CUDA, the built kernels, bf16 and an architecture they compute."""
        return (self.device.type == "cuda" and _ext.available() and self.dtype == torch.bfloat16
                and self.kernels_missing() is None)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        if batch < 1 or capacity < 1:
            raise ValueError(f"cache batch ({batch}) and capacity ({capacity}) must be >= 1")
        shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
        return KVCache(k=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
                       v=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers])

    # ---- the layer loop, shared by prefill and decode --------------------------------------------

    def _forward(self, tokens: torch.Tensor, attend, ops, last_only: bool = False) -> torch.Tensor:
        """tokens [M] -> logits [M, V] fp32 ([1, V], the last token's, with last_only). attend(layer,
        q [M,H,D], k [M,Hkv,D], v [M,Hkv,D]) applies RoPE, writes the cache and returns the attention
        output [M, H*D]."""
        c = self.config
        H, Hkv, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        M = tokens.shape[0]
        residual = F.embedding(tokens, self.embed)  # [M, Hd]
        for i, layer in enumerate(self.layers):
            # The norms' weights are folded into qkv_w and gate_up_w: those products take the
            # residual itself and scale by 1/rms (rms_eps), as the decode GEMVs do.
            qkv = ops.linear(residual, layer.qkv_w, layer.qkv_b, rms_eps=eps)  # [M, (H + 2*Hkv) * D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.view(M, H, D), k.view(M, Hkv, D), v.view(M, Hkv, D)
            # Qwen3: each q and k head normed before RoPE (on the kernel path inside rope_append:
            # attend passes head_norms).
            if layer.q_norm is not None and ops is not _KernelOps:
                q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)
            attn = attend(i, q, k, v)  # [M, H*D]
            residual = ops.add(residual, ops.linear(attn, layer.o_w, layer.o_b))  # [M, Hd]
            if layer.router_w is not None:  # Qwen3-MoE: the chosen experts' MLPs, weighted
                residual = ops.add(residual, ops.moe(residual, layer, c.num_experts_per_tok,
                                                     c.norm_topk_prob, rms_eps=eps))  # [M, Hd]
                continue
            act = ops.gate_up_silu(residual, layer.gate_up_w, rms_eps=eps)  # [M, I] = silu(gate) * up
            residual = ops.add(residual, ops.linear(act, layer.down_w))  # [M, Hd]
        if last_only:
            residual = residual[-1:]  # [1, Hd]
        h = ops.rms_norm(residual, self.final_norm, eps)  # [M, Hd]
        return ops.linear(h, self.lm_head).float()  # [M, V]

    # ---- prefill: the whole prompt of one sequence -----------------------------------------------

    def prefill(self, tokens: torch.Tensor, cache: KVCache, slot: int, last_only: bool = False) -> torch.Tensor:
        """tokens [T] at positions 0..T-1 of batch slot `slot` -> logits [T, V] fp32; writes cache
        rows 0..T-1 of that slot. last_only: logits [1, V] of the last token only, which is all
        that generation needs; the final norm and LM head then run on that one row (at T = 32K and
        a 152K vocabulary the [T, V] logits alone would take 20 GB in fp32). Token ids given on the
        host are checked against the vocabulary; ids already on a GPU are the caller's to check
        (reading them would synchronise: the engine checks its prompts before they go there)."""
        c = self.config
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.shape[0] < 1:
            raise ValueError(f"prefill takes a non-empty 1-D token tensor, got shape {list(tokens.shape)}")
        if tokens.device.type == "cpu":
            check_token_ids(tokens, c.vocab_size, "prefill")
        tokens = tokens.to(self.device, torch.long)
        T = tokens.shape[0]
        if T > cache.capacity:
            raise ValueError(f"prompt of {T} tokens exceeds the KV cache capacity of {cache.capacity} tokens")
        if T > c.max_context:
            raise ValueError(f"prompt of {T} tokens exceeds the model's context of {c.context_name} tokens")
        if not 0 <= slot < cache.batch:
            raise ValueError(f"slot {slot} is outside the cache batch of {cache.batch}")
        H, D = c.num_attention_heads, c.head_dim
        positions = torch.arange(T, device=self.device)  # [T]

        def attend(i, q, k, v):  # q [T,H,D], k/v [T,Hkv,D] -> [T, H*D]
            k_cache, v_cache = cache.k[i], cache.v[i]  # [B, Hkv, S, D]
            if self.use_kernels:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                # Every token row writes the same slot (batch stride 0) at its own position; q and
                # k are rotated in place.
                torch.ops.decodex.rope_append(
                    q, k, v, self.inv_freq, positions.to(torch.int32),
                    k_cache[slot:slot + 1].expand(T, -1, -1, -1),
                    v_cache[slot:slot + 1].expand(T, -1, -1, -1), **self.head_norms(self.layers[i]))
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
                    k_cache[slot:slot + 1, :, :T], v_cache[slot:slot + 1, :, :T],  # [1, Hkv, T, D]
                    is_causal=True, scale=self.scale, enable_gqa=True)  # [1, H, T, D]
                return o[0].transpose(0, 1).reshape(T, H * D)
            q = reference.rope(q, positions, self.inv_freq)
            k = reference.rope(k, positions, self.inv_freq)
            k_cache[slot, :, :T] = k.transpose(0, 1)
            v_cache[slot, :, :T] = v.transpose(0, 1)
            return reference.causal_attention(q, k, v, self.scale).reshape(T, H * D)

        return self._forward(tokens, attend, _KernelOps if self.use_kernels else _ReferenceOps, last_only)

    # ---- decode: one token for each sequence of the batch ----------------------------------------

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B] at positions [B] -> logits [B, V] fp32. Row b attends over cache rows
        0..positions[b] of slot b after writing its own; rows with positions < 0 are skipped
        (their logits are meaningless)."""
        c = self.config
        tokens = torch.as_tensor(tokens).to(self.device, torch.long)
        positions = torch.as_tensor(positions).to(self.device, torch.int32)
        B = tokens.shape[0]
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(f"decode takes tokens [B] and positions [B], got {list(tokens.shape)} "
                             f"and {list(positions.shape)}")
        if B > cache.batch:
            raise ValueError(f"decode batch {B} exceeds the cache batch of {cache.batch}")
        limit = min(cache.capacity, c.max_context)
        tokens = torch.where(positions >= 0, tokens, 0)  # skipped rows may hold any token id
        # The last position and the live ids' range in one host read (the eager path's one sync a step).
        last, lo, hi = torch.stack([positions.max().long(), *torch.aminmax(tokens)]).tolist()
        if last >= limit:
            what = (f"the KV cache capacity of {cache.capacity}" if cache.capacity <= c.max_context
                    else f"the model's context of {c.context_name}")
            raise ValueError(f"position {last} is past {what} tokens")
        _check_id_range(lo, hi, c.vocab_size, "decode")
        lengths = (positions + 1).clamp(min=0)  # [B] int32: cache rows each query attends over
        H, D = c.num_attention_heads, c.head_dim
        if self.use_kernels:
            from decodex import ops
            workspace = ops.attention_workspace(B, H, c.num_key_value_heads, D, cache.capacity, self.device)

        def attend(i, q, k, v):  # q [B,H,D], k/v [B,Hkv,D] -> [B, H*D]
            k_cache, v_cache = cache.k[i][:B], cache.v[i][:B]  # [B, Hkv, S, D]
            if self.use_kernels:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                torch.ops.decodex.rope_append(q, k, v, self.inv_freq, positions, k_cache, v_cache,
                                              **self.head_norms(self.layers[i]))
                out = torch.empty_like(q)
                torch.ops.decodex.decode_attention(q, k_cache, v_cache, lengths, self.scale, workspace, out)
                return out.reshape(B, H * D)
            q, _ = reference.rope_append(q, k, v, self.inv_freq, positions, k_cache, v_cache)
            return reference.decode_attention(q, k_cache, v_cache, lengths, self.scale).reshape(B, H * D)

        return self._forward(tokens, attend, _KernelOps if self.use_kernels else _ReferenceRowOps)
