"""ModelConfig: the fields of an HF `config.json` that decodex needs, for Qwen2 / Qwen2.5, Qwen3
(dense: an RMSNorm on each q and k head before RoPE), Qwen3-MoE (Qwen3's attention; a router and
top-k experts in place of the MLP), Llama 2, 3, 3.1 (llama3 RoPE scaling) and 3.2 (tied
embeddings), and Mistral without a sliding window (v0.2, v0.3, Nemo: a Llama without biases).

Both config dialects are read: the older one (`rope_theta`, `rope_scaling`, `torch_dtype`) that
published checkpoints carry, and transformers 5's (`rope_parameters`, `dtype`). Anything decodex
would silently compute wrongly (another activation, MLP bias, sliding-window attention, an unknown
RoPE scaling) is refused with a LoadError naming the file and the field.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field


class LoadError(ValueError):
    """A checkpoint decodex cannot load; the message names the file, tensor, field or limit."""


def token_ids(value, source: str, name: str) -> list[int]:
    """A token-id field (eos_token_id in config.json or generation_config.json): null, an id or a
    list of ids -> the list; anything else a LoadError naming `source` and the field."""
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    # bool is an int to Python: `true` would stop generation at token 1.
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise LoadError(f"{source}: field {name!r} must be an integer or a list of integers, got {value!r}")
    return ids


SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama", "mistral")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "max_position_embeddings")


def _positive_number(value) -> bool:
    """A RoPE scaling field that divides or scales frequencies: zero, negative, NaN or inf would give
    inf/NaN logits or silently wrong positions."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def _yarn_fields(scaling: dict, name: str, max_position_embeddings: int, fail) -> dict:
    """A yarn rope_scaling dict, checked, with transformers' defaults filled in (the original
    context defaults to max_position_embeddings)."""
    out = {"rope_type": "yarn"}
    for key, required in (("factor", True), ("original_max_position_embeddings", False),
                          ("beta_fast", False), ("beta_slow", False), ("attention_factor", False),
                          ("mscale", False), ("mscale_all_dim", False)):
        value = scaling.get(key)
        if value is None:
            if required:
                fail(f"{name}.{key}", "is required for yarn scaling")
            continue
        if not _positive_number(value):
            fail(f"{name}.{key}", f"must be a positive finite number for yarn scaling, got {value!r}")
        out[key] = value
    out.setdefault("original_max_position_embeddings", max_position_embeddings)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        fail(f"{name}.truncate", f"must be true or false, got {truncate!r}")
    out["truncate"] = truncate
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"{name}.partial_rotary_factor", "is not 1; partial RoPE is not supported")
    return out


def _moe_fields(raw: dict, get, fail) -> dict:
    """Qwen3-MoE's expert fields, checked; the layers that route (moe_layers) as transformers picks
    them: not in mlp_only_layers, and every decoder_sparse_step-th."""
    # Absent fields take transformers' Qwen3MoeConfig defaults; transformers 5 writes num_experts
    # as num_local_experts.
    experts_name = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = get(experts_name, int, default=128)
    top_k = get("num_experts_per_tok", int, default=8)
    size = get("moe_intermediate_size", int, default=768)
    if experts < 1:
        fail(experts_name, f"must be positive, got {experts}")
    if not 1 <= top_k <= experts:
        fail("num_experts_per_tok", f"= {top_k} must be in 1..{experts_name} = {experts}")
    if size < 1:
        fail("moe_intermediate_size", f"must be positive, got {size}")
    step = get("decoder_sparse_step", int, default=1)
    if step < 1:
        fail("decoder_sparse_step", f"must be positive, got {step}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        fail("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    if get("shared_expert_intermediate_size", int, default=0):
        fail("shared_expert_intermediate_size", "is set; shared experts (Qwen2-MoE) are not supported")
    layers = tuple(i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=size,
                norm_topk_prob=get("norm_topk_prob", bool, default=False), moe_layers=layers)


@dataclass
class ModelConfig:
    model_type: str  # 'qwen2' | 'qwen3' | 'qwen3_moe' | 'llama' | 'mistral'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or a llama3 or yarn dict ("rope_type" and its fields)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2: q/k/v bias; llama, qwen3: q/k/v/o bias; mistral: none
    mlp_bias: bool = False  # always False (True is refused)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Qwen3-MoE: the layers in moe_layers route each row to num_experts_per_tok of num_experts
    # experts (SwiGLU MLPs of moe_intermediate_size); the others keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' softmax weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads config.json (or the config.json inside a directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise LoadError(f"{path}: config file not found") from None
        except OSError as e:  # a directory named config.json, no read permission
            raise LoadError(f"{path}: cannot read config file: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoadError(f"{path}: malformed JSON: {e}") from None
        if not isinstance(raw, dict):
            raise LoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def fail(name, why):
            raise LoadError(f"{source}: field {name!r} {why}")

        def get(name, kind, default=None, required=False):
            value = raw.get(name)
            if value is None:
                if required:
                    fail(name, "is required but missing")
                return default
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                fail(name, f"must be an integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):  # json reads NaN and Infinity
                fail(name, f"must be a finite number, got {value!r}")
            if kind is bool and not isinstance(value, bool):
                fail(name, f"must be true or false, got {value!r}")
            return kind(value)

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            fail("model_type", f"is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in _REQUIRED:
            get(name, int, required=True)
            if raw[name] <= 0:
                fail(name, f"must be positive, got {raw[name]}")

        heads = raw["num_attention_heads"]
        kv_heads = get("num_key_value_heads", int, default=heads)
        if kv_heads <= 0 or heads % kv_heads:
            fail("num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {heads}")
        head_dim = get("head_dim", int, default=None)
        if head_dim is None:
            if raw["hidden_size"] % heads:
                fail("hidden_size", f"= {raw['hidden_size']} is not divisible by num_attention_heads = "
                     f"{heads} (and there is no head_dim)")
            head_dim = raw["hidden_size"] // heads
        if head_dim <= 0 or head_dim % 2:
            fail("head_dim", f"= {head_dim} must be positive and even (half-split RoPE)")

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            fail("hidden_act", f"is {act!r}; only 'silu' is supported")
        if get("mlp_bias", bool, default=False):
            fail("mlp_bias", "is true; MLP biases are not supported")
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            # Qwen2 always has q/k/v biases (and none on o_proj); Qwen3 has all four or none.
            attention_bias = True if model_type == "qwen2" else get("attention_bias", bool, default=False)
            layer_types = raw.get("layer_types") or []
            if not isinstance(layer_types, list):
                fail("layer_types", f"must be a list, got {layer_types!r}")
            if get("use_sliding_window", bool, default=False) or "sliding_attention" in layer_types:
                fail("use_sliding_window", "is true; sliding-window attention is not supported")
        elif model_type == "mistral":
            attention_bias = False  # transformers' Mistral has no bias option
            window = get("sliding_window", int, default=None)
            # Keys more than `window` positions back are masked; below the context limit no key is.
            if window is not None and window < raw["max_position_embeddings"]:
                fail("sliding_window", f"= {window} is below max_position_embeddings = "
                     f"{raw['max_position_embeddings']}; sliding-window attention is not supported")
        else:
            attention_bias = get("attention_bias", bool, default=False)

        # RoPE: transformers 5 nests theta and scaling in rope_parameters; older files keep them apart.
        rope_params = raw.get("rope_parameters")
        if rope_params is not None and not isinstance(rope_params, dict):
            fail("rope_parameters", f"must be an object, got {rope_params!r}")
        rope_params = dict(rope_params or {})
        theta_name = "rope_theta"
        if raw.get("rope_theta") is not None:
            rope_theta = get("rope_theta", float)
        elif rope_params.get("rope_theta") is not None:
            theta_name, rope_theta = "rope_parameters.rope_theta", rope_params["rope_theta"]
            if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
                fail(theta_name, f"must be a number, got {rope_theta!r}")
            rope_theta = float(rope_theta)
        else:
            rope_theta = 10000.0
        if not 0 < rope_theta < math.inf:  # else every RoPE frequency is inf or NaN
            fail(theta_name, f"must be a positive finite number, got {rope_theta!r}")
        scaling_name = "rope_scaling"
        scaling = raw.get("rope_scaling")
        if scaling is None and rope_params:
            scaling_name, scaling = "rope_parameters", rope_params
        rope_scaling = None
        if scaling is not None:
            if not isinstance(scaling, dict):
                fail(scaling_name, f"must be an object or null, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "llama3":
                rope_scaling = {"rope_type": "llama3"}
                for name in _LLAMA3_FIELDS:
                    value = scaling.get(name)
                    if not _positive_number(value):
                        fail(f"{scaling_name}.{name}",
                             f"must be a positive finite number for llama3 scaling, got {value!r}")
                    rope_scaling[name] = value
                if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
                    fail(f"{scaling_name}.high_freq_factor", "must exceed low_freq_factor")
            elif kind == "yarn":
                rope_scaling = _yarn_fields(scaling, scaling_name, raw["max_position_embeddings"], fail)
            elif kind not in (None, "default"):
                fail(f"{scaling_name}.rope_type", f"is {kind!r}; supported: default, llama3, yarn")

        eos_list = token_ids(raw.get("eos_token_id"), source, "eos_token_id")

        rms_norm_eps = get("rms_norm_eps", float, default=1e-6)
        if rms_norm_eps < 0:  # rsqrt of a negative mean square: NaN logits
            fail("rms_norm_eps", f"must not be negative, got {rms_norm_eps!r}")
        moe = _moe_fields(raw, get, fail) if model_type == "qwen3_moe" else {}

        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=get("tie_word_embeddings", bool, default=False),
            attention_bias=attention_bias,
            mlp_bias=False,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
            bos_token_id=get("bos_token_id", int, default=None),
            eos_token_id=eos_list,
            **moe,
        )

    @property
    def max_context(self) -> int:
        """The most tokens a sequence may hold: max_position_embeddings, or with YaRN the original
        context times the factor where that is more (Qwen2.5 keeps 32768 beside factor 4)."""
        s = self.rope_scaling
        if s and s["rope_type"] == "yarn":
            return max(self.max_position_embeddings, int(s["factor"] * s["original_max_position_embeddings"]))
        return self.max_position_embeddings

    @property
    def context_name(self) -> str:
        """max_context as error messages name it."""
        if self.max_context == self.max_position_embeddings:
            return f"max_position_embeddings={self.max_position_embeddings}"
        s = self.rope_scaling
        return (f"{self.max_context} (YaRN: factor {s['factor']} x original_max_position_embeddings "
                f"{s['original_max_position_embeddings']})")

    @property
    def qk_norm(self) -> bool:
        """Qwen3's q_norm / k_norm: an RMSNorm over each q and k head before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def o_proj_bias(self) -> bool:
        """attention_bias covers o_proj too, except in Qwen2 (q/k/v only)."""
        return self.attention_bias and self.model_type != "qwen2"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor decodex reads (HF names) and its shape. lm_head.weight is listed only when
        the embeddings are not tied."""
        Hd, I, V = self.hidden_size, self.intermediate_size, self.vocab_size
        q_dim = self.num_attention_heads * self.head_dim
        kv_dim = self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (V, Hd), "model.norm.weight": (Hd,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, Hd)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (Hd,)
            shapes[p + "post_attention_layernorm.weight"] = (Hd,)
            for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                shapes[p + f"self_attn.{name}.weight"] = (rows, Hd)
                if self.attention_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (Hd, q_dim)
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (Hd,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            if i in self.moe_layers:
                Ie = self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, Hd)
                for e in range(self.num_experts):
                    x = p + f"mlp.experts.{e}."
                    shapes[x + "gate_proj.weight"] = (Ie, Hd)
                    shapes[x + "up_proj.weight"] = (Ie, Hd)
                    shapes[x + "down_proj.weight"] = (Hd, Ie)
                continue
            shapes[p + "mlp.gate_proj.weight"] = (I, Hd)
            shapes[p + "mlp.up_proj.weight"] = (I, Hd)
            shapes[p + "mlp.down_proj.weight"] = (Hd, I)
        return shapes
