"""decodex.config / decodex.loader: every bad input fails with one LoadError (or ValueError for
runtime limits) whose message names the file, field, tensor or limit; good inputs of each dialect
and dtype load. CPU only, tiny checkpoints."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from decodex.config import LoadError, ModelConfig
from decodex.loader import load_model
from helpers import LLAMA3_SCALING, make_tiny_checkpoint, random_model

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One single-file and one sharded tiny checkpoint, written once; tests edit copies."""
    root = tmp_path_factory.mktemp("ckpt")
    single, _ = make_tiny_checkpoint(root, "llama", tied=False, sharded=False)
    sharded, _ = make_tiny_checkpoint(root, "qwen2", tied=False, sharded=True, dtype=torch.bfloat16)
    return {"single": single, "sharded": sharded}


def _copy(checkpoints, kind, tmp_path):
    dst = os.path.join(tmp_path, kind)
    shutil.copytree(checkpoints[kind], dst)
    return dst


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    for k, v in changes.items():
        if v is _DELETE:
            raw.pop(k, None)
        else:
            raw[k] = v
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    return cfg_path


_DELETE = object()


def _load(path):
    return load_model(path, device="cpu", dtype=torch.float32, quiet=True)


# ---- config.json ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (dict(model_type="gemma"), ["model_type", "gemma", "qwen2, qwen3, qwen3_moe, llama, mistral"]),
    (dict(hidden_size=_DELETE), ["hidden_size", "required"]),
    (dict(num_hidden_layers="2"), ["num_hidden_layers", "integer"]),
    (dict(num_key_value_heads=3), ["num_key_value_heads", "divide"]),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     ["rope_parameters.rope_type", "dynamic"]),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), ["rope_parameters.factor", "required"]),
    (dict(rope_scaling={"type": "yarn", "factor": -4.0}), ["rope_scaling.factor", "positive"]),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": float("nan")}), ["rope_scaling.beta_fast"]),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "truncate": 1}), ["rope_scaling.truncate", "true or false"]),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}),
     ["rope_scaling.partial_rotary_factor"]),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), ["rope_scaling.rope_type", "linear"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0}), ["rope_scaling.original_max_position_embeddings"]),
    (dict(mlp_bias=True), ["mlp_bias"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    # Values that parse but would give NaN/inf logits, a ZeroDivisionError or wrong positions.
    (dict(rope_theta=0), ["rope_theta", "positive"]),
    (dict(rope_theta=-10000.0), ["rope_theta", "positive"]),
    (dict(rope_theta=float("nan")), ["rope_theta", "finite"]),  # json writes NaN, and reads it
    (dict(rope_theta=_DELETE, rope_parameters={"rope_type": "default", "rope_theta": 0}),
     ["rope_parameters.rope_theta", "positive"]),
    (dict(rms_norm_eps=-1e-6), ["rms_norm_eps", "negative"]),
    (dict(rms_norm_eps=float("inf")), ["rms_norm_eps", "finite"]),
    (dict(rope_scaling=dict(LLAMA3_SCALING, low_freq_factor=0)), ["rope_scaling.low_freq_factor", "positive"]),
    (dict(rope_scaling=dict(LLAMA3_SCALING, factor=-8.0)), ["rope_scaling.factor", "positive"]),
    (dict(rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=0)),
     ["rope_scaling.original_max_position_embeddings", "positive"]),
    (dict(rope_scaling=dict(LLAMA3_SCALING, high_freq_factor=float("nan"))),
     ["rope_scaling.high_freq_factor", "positive"]),
    (dict(eos_token_id=2.0), ["eos_token_id", "integer"]),
    (dict(model_type="qwen2", layer_types=5), ["layer_types", "list"]),
    # Qwen3-MoE's expert fields.
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=9), ["num_experts_per_tok", "1..num_experts"]),
    (dict(model_type="qwen3_moe", num_local_experts=0), ["num_local_experts", "positive"]),
    (dict(model_type="qwen3_moe", moe_intermediate_size=-4), ["moe_intermediate_size", "positive"]),
    (dict(model_type="qwen3_moe", decoder_sparse_step=0), ["decoder_sparse_step", "positive"]),
    (dict(model_type="qwen3_moe", mlp_only_layers=[0, "1"]), ["mlp_only_layers", "list of layer indices"]),
    (dict(model_type="qwen3_moe", shared_expert_intermediate_size=512), ["shared_expert_intermediate_size",
                                                                          "not supported"]),
])
def test_bad_config_field(checkpoints, tmp_path, change, words):
    path = _copy(checkpoints, "single", tmp_path)
    cfg_path = _edit_config(path, **change)
    with pytest.raises(LoadError) as e:
        _load(path)
    msg = str(e.value)
    for word in [cfg_path] + words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_qwen2_sliding_window_refused(checkpoints, tmp_path):
    path = _copy(checkpoints, "sharded", tmp_path)
    cfg_path = _edit_config(path, use_sliding_window=True, sliding_window=16)
    with pytest.raises(LoadError, match="use_sliding_window") as e:
        _load(path)
    assert cfg_path in str(e.value)


@pytest.mark.parametrize("window, ok", [(None, True), (512, True), (511, False), (0, False), (4096, True)])
def test_mistral_sliding_window(checkpoints, tmp_path, window, ok):
    """A window that masks nothing below max_position_embeddings (512 here) loads as Llama without
    biases; a smaller one is refused: decodex attends to the whole context."""
    path = _copy(checkpoints, "single", tmp_path)
    cfg_path = _edit_config(path, model_type="mistral", sliding_window=window)
    if ok:
        assert _load(path).config.model_type == "mistral"
        return
    with pytest.raises(LoadError, match=f"'sliding_window' = {window} is below max_position_embeddings = 512; "
                                        "sliding-window attention is not supported") as e:
        _load(path)
    assert cfg_path in str(e.value)


def test_malformed_config_json(checkpoints, tmp_path):
    path = _copy(checkpoints, "single", tmp_path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, "w") as f:
        f.write('{"model_type": "llama", "hidden_size": 64,')  # cut off
    with pytest.raises(LoadError) as e:
        _load(path)
    assert cfg_path in str(e.value) and "malformed JSON" in str(e.value)


def test_missing_config(tmp_path):
    with pytest.raises(LoadError, match="config.json"):
        _load(tmp_path)


@pytest.mark.parametrize("kind, name, how", [("single", "config.json", "symlink loop"),
                                             ("sharded", INDEX, "directory")])
def test_unreadable_json_file(checkpoints, tmp_path, kind, name, how):
    """open() fails with an OSError other than FileNotFoundError (a permission error is the usual
    one; these fail alike for root)."""
    path = _copy(checkpoints, kind, tmp_path)
    f = os.path.join(path, name)
    os.remove(f)
    if how == "directory":
        os.mkdir(f)
    else:
        os.symlink(name, f)
    with pytest.raises(LoadError) as e:
        _load(path)
    assert f in str(e.value)


@pytest.mark.parametrize("device, words", [("gpu0", ["'gpu0'", "not a torch device"]),
                                           ("cuda:99", ["'cuda:99'", "not available"])])
def test_bad_device(checkpoints, device, words):
    with pytest.raises(ValueError) as e:
        load_model(checkpoints["single"], device=device, quiet=True)
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


def test_old_and_new_config_dialects():
    """Llama 3.1 as published (rope_theta + rope_scaling beside it, torch_dtype, eos list), Llama 2
    (no head_dim, no num_key_value_heads), transformers-5 rope_parameters: all parse alike."""
    base = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=131072)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    old = ModelConfig.from_dict(dict(base, num_key_value_heads=8, rope_theta=500000.0, rope_scaling=scaling,
                                     torch_dtype="bfloat16", eos_token_id=[128001, 128008, 128009],
                                     bos_token_id=128000))
    new = ModelConfig.from_dict(dict(base, num_key_value_heads=8, dtype="bfloat16",
                                     rope_parameters=dict(scaling, rope_theta=500000.0),
                                     eos_token_id=[128001, 128008, 128009], bos_token_id=128000))
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    assert old.head_dim == 128 and old.torch_dtype == "bfloat16" and old.eos_token_id == [128001, 128008, 128009]
    llama2 = ModelConfig.from_dict(dict(base, rope_scaling=None, eos_token_id=2))
    assert llama2.num_key_value_heads == 32 and llama2.head_dim == 128 and llama2.eos_token_id == [2]
    assert llama2.rope_theta == 10000.0 and llama2.rope_scaling is None and not llama2.attention_bias
    qwen = ModelConfig.from_dict(dict(base, model_type="qwen2", tie_word_embeddings=True,
                                      rope_theta=1000000.0, use_sliding_window=False, sliding_window=4096))
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.rope_scaling is None


def test_qwen3_config_as_published():
    """Qwen3-0.6B's config.json: head_dim 128 beside hidden 1024 / 16 heads, q/k norms, no biases;
    a sliding window or dynamic RoPE scaling is refused."""
    raw = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, bos_token_id=151643,
               eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024, intermediate_size=3072,
               max_position_embeddings=40960, max_window_layers=28, num_attention_heads=16, num_hidden_layers=28,
               num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
               sliding_window=None, tie_word_embeddings=True, torch_dtype="bfloat16", use_sliding_window=False,
               vocab_size=151936)
    c = ModelConfig.from_dict(raw)
    assert (c.qk_norm, c.attention_bias, c.o_proj_bias, c.head_dim, c.rope_theta) == (True, False, False, 128, 1e6)
    shapes = c.weight_shapes()
    assert shapes["model.layers.27.self_attn.q_norm.weight"] == shapes["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024) and "lm_head.weight" not in shapes
    assert not any(name.endswith("bias") for name in shapes)
    biased = ModelConfig.from_dict(dict(raw, attention_bias=True)).weight_shapes()
    assert biased["model.layers.0.self_attn.o_proj.bias"] == (1024,)
    for change, field in ((dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
                          (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling.rope_type")):
        with pytest.raises(LoadError, match=f"'{field}'"):
            ModelConfig.from_dict(dict(raw, **change))
    qwen2 = ModelConfig.from_dict(dict(raw, model_type="qwen2"))
    assert not qwen2.qk_norm and qwen2.attention_bias and not qwen2.o_proj_bias


def test_kernels_missing_names_what_the_kernels_do_not_compute():
    """The kernel path is taken only where it computes the whole model (else the reference path)."""
    assert random_model("llama", head_dim=64).kernels_missing() is None
    assert random_model("qwen3", head_dim=128).kernels_missing() is None
    assert random_model("qwen3").kernels_missing() == "head dim 32 (they are built for 64 and 128)"


def test_yarn_context():
    """Qwen2.5's documented long-context setting (YaRN, factor 4 over its 32768 positions): the
    context is 131072 tokens and errors name how; a config whose max_position_embeddings already
    is the longer one keeps it; without the original context, max_position_embeddings is it."""
    base = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=32768, rope_theta=1000000.0)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    c = ModelConfig.from_dict(dict(base, rope_scaling=yarn))
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                              "truncate": True}
    assert c.max_context == 131072 and c.max_position_embeddings == 32768
    assert c.context_name == "131072 (YaRN: factor 4.0 x original_max_position_embeddings 32768)"
    longer = ModelConfig.from_dict(dict(base, max_position_embeddings=262144, rope_scaling=yarn))
    assert longer.max_context == 262144 and longer.context_name == "max_position_embeddings=262144"
    implicit = ModelConfig.from_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert implicit.rope_scaling["original_max_position_embeddings"] == 32768 and implicit.max_context == 65536
    plain = ModelConfig.from_dict(base)
    assert plain.max_context == 32768 and plain.context_name == "max_position_embeddings=32768"


def test_yarn_context_limits_generation():
    """The longer context is what the model's decode accepts, and its error names it."""
    model = random_model("qwen2", max_position_embeddings=12,
                         rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8})
    assert model.config.max_context == 16
    cache = model.new_cache(batch=1, capacity=32)
    model.prefill(torch.arange(14), cache, 0)  # past max_position_embeddings, inside the context
    tok = torch.tensor([1])
    model.decode(tok, torch.tensor([15], dtype=torch.int32), cache)
    with pytest.raises(ValueError, match=r"position 16 is past the model's context of 16 \(YaRN: factor 2.0 x "
                                         r"original_max_position_embeddings 8\) tokens"):
        model.decode(tok, torch.tensor([16], dtype=torch.int32), cache)
    with pytest.raises(ValueError, match=r"prompt of 17 tokens exceeds the model's context of 16 \(YaRN"):
        model.prefill(torch.arange(17), cache, 0)


def test_mistral_configs_as_published():
    """Mistral 7B v0.3 and Nemo (head_dim 128 beside hidden 5120 / 32 heads) load; v0.1's 4096-token
    window under a 32K context does not."""
    v03 = dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32768, hidden_size=4096,
               intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=32768, rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=None,
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    c = ModelConfig.from_dict(v03)
    assert (c.head_dim, c.attention_bias, c.rope_theta, c.eos_token_id) == (128, False, 1e6, [2])
    assert "self_attn.q_proj.bias" not in " ".join(c.weight_shapes())
    nemo = ModelConfig.from_dict(dict(v03, vocab_size=131072, hidden_size=5120, num_hidden_layers=40,
                                      head_dim=128, max_position_embeddings=1024000))
    assert nemo.weight_shapes()["model.layers.0.self_attn.o_proj.weight"] == (5120, 4096)
    with pytest.raises(LoadError, match="'sliding_window' = 4096 is below max_position_embeddings = 32768"):
        ModelConfig.from_dict(dict(v03, sliding_window=4096, rope_theta=10000.0))


def test_llama3_scaling_fields_kept_and_checked():
    """Found by mutation testing: the llama3 fields are kept as given (not truncated), equal
    high/low frequency factors are refused (the band interpolation divides by their difference),
    and rms_norm_eps = 0 is allowed (only a negative one is refused)."""
    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=160,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    scaling = dict(rope_type="llama3", factor=2.5, low_freq_factor=1.5, high_freq_factor=4.25,
                   original_max_position_embeddings=64)
    got = ModelConfig.from_dict(dict(base, rope_scaling=scaling)).rope_scaling
    assert got == scaling and isinstance(got["factor"], float)
    with pytest.raises(LoadError, match="rope_scaling.high_freq_factor' must exceed low_freq_factor"):
        ModelConfig.from_dict(dict(base, rope_scaling=dict(scaling, high_freq_factor=1.5)))
    assert ModelConfig.from_dict(dict(base, rms_norm_eps=0.0)).rms_norm_eps == 0.0


# ---- safetensors files ---------------------------------------------------------------------------

def test_loads_and_casts(checkpoints):
    """bf16 sharded checkpoint -> fp32 (the CPU default) or bf16 on request; progress line printed."""
    model = load_model(checkpoints["sharded"], device="cpu", quiet=True)
    assert model.dtype == torch.float32 and model.embed.dtype == torch.float32
    assert model.layers[0].qkv_b.dtype == torch.float32
    bf16 = load_model(checkpoints["sharded"], device="cpu", dtype=torch.bfloat16, quiet=True)
    assert bf16.layers[1].gate_up_w.dtype == torch.bfloat16
    assert torch.equal(bf16.layers[1].o_w.float(), model.layers[1].o_w)
    # The folded norm weight: the same fp32 product, rounded once to the model's dtype.
    assert torch.equal(bf16.layers[1].gate_up_w, model.layers[1].gate_up_w.to(torch.bfloat16))


def test_progress_line(checkpoints, capsys):
    load_model(checkpoints["single"], device="cpu")
    err = capsys.readouterr().err
    assert "decodex: loaded" in err and "tensors" in err
    load_model(checkpoints["single"], device="cpu", quiet=True)
    assert capsys.readouterr().err == ""


def _rewrite(f: str, changes: dict) -> dict:
    """Rewrites the safetensors file f with tensors replaced, added, or (value None) removed; returns
    the tensors now in the file."""
    tensors = load_file(f)
    for name, t in changes.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, f, metadata={"format": "pt"})
    return tensors


def test_missing_tensor(checkpoints, tmp_path):
    path = _copy(checkpoints, "single", tmp_path)
    f = os.path.join(path, SINGLE)
    _rewrite(f, {"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(LoadError) as e:
        _load(path)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and f in str(e.value)


def test_missing_tensor_in_shard(checkpoints, tmp_path):
    """The index lists a tensor that its shard does not hold."""
    path = _copy(checkpoints, "sharded", tmp_path)
    with open(os.path.join(path, INDEX)) as fh:
        shard = json.load(fh)["weight_map"]["model.layers.0.self_attn.k_proj.bias"]
    f = os.path.join(path, shard)
    _rewrite(f, {"model.layers.0.self_attn.k_proj.bias": None})
    with pytest.raises(LoadError) as e:
        _load(path)
    assert "model.layers.0.self_attn.k_proj.bias" in str(e.value) and f in str(e.value)


def test_misshaped_tensor(checkpoints, tmp_path):
    path = _copy(checkpoints, "single", tmp_path)
    f = os.path.join(path, SINGLE)
    _rewrite(f, {"model.layers.0.self_attn.o_proj.weight": torch.randn(64, 96)})
    with pytest.raises(LoadError) as e:
        _load(path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.o_proj.weight" in msg and f in msg
    assert "[64, 96]" in msg and "[64, 128]" in msg  # got vs expected


@pytest.mark.parametrize("keep", [0.5, 0.999, 6])  # data cut short; data cut by a few bytes; header cut
def test_truncated_file(checkpoints, tmp_path, keep):
    path = _copy(checkpoints, "single", tmp_path)
    f = os.path.join(path, SINGLE)
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(keep if isinstance(keep, int) else int(size * keep))
    with pytest.raises(LoadError) as e:
        _load(path)
    assert f in str(e.value) and "truncated or corrupt" in str(e.value)


def test_missing_shard(checkpoints, tmp_path):
    path = _copy(checkpoints, "sharded", tmp_path)
    shard = sorted(n for n in os.listdir(path) if n.startswith("model-"))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(LoadError) as e:
        _load(path)
    assert shard in str(e.value) and INDEX in str(e.value) and "missing shard" in str(e.value)


def test_index_points_at_missing_file(checkpoints, tmp_path):
    path = _copy(checkpoints, "sharded", tmp_path)
    index_path = os.path.join(path, INDEX)
    with open(index_path) as fh:
        index = json.load(fh)
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    with open(index_path, "w") as fh:
        json.dump(index, fh)
    with pytest.raises(LoadError) as e:
        _load(path)
    assert "model-99999-of-99999.safetensors" in str(e.value) and "model.norm.weight" in str(e.value)


def test_no_weights(checkpoints, tmp_path):
    path = _copy(checkpoints, "single", tmp_path)
    os.remove(os.path.join(path, SINGLE))
    with pytest.raises(LoadError, match=f"no {SINGLE} or {INDEX}"):
        _load(path)


def test_extra_tensors_ignored(checkpoints, tmp_path):
    path = _copy(checkpoints, "single", tmp_path)
    f = os.path.join(path, SINGLE)
    tensors = _rewrite(f, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(16)})
    model = _load(path)
    assert torch.equal(model.embed, tensors["model.embed_tokens.weight"])


def test_tied_with_stored_lm_head(tmp_path):
    """tie_word_embeddings with an lm_head.weight in the file: equal -> one tensor; different ->
    the stored head is used, as transformers 5 does (it declines to tie)."""
    path, _ = make_tiny_checkpoint(tmp_path, "llama", tied=True)
    f = os.path.join(path, SINGLE)
    embed = load_file(f)["model.embed_tokens.weight"]
    assert "lm_head.weight" not in load_file(f)
    _rewrite(f, {"lm_head.weight": embed.clone()})
    model = _load(path)
    assert model.lm_head is model.embed
    tensors = _rewrite(f, {"lm_head.weight": torch.randn_like(embed)})
    with pytest.warns(UserWarning, match="lm_head.weight"):
        model = _load(path)
    assert torch.equal(model.lm_head, tensors["lm_head.weight"])


# ---- runtime limits --------------------------------------------------------------------------------

def test_prompt_longer_than_cache():
    model = random_model("llama")
    cache = model.new_cache(batch=1, capacity=16)
    with pytest.raises(ValueError, match="17 tokens exceeds the KV cache capacity of 16"):
        model.prefill(torch.zeros(17, dtype=torch.long), cache, 0)


def test_prompt_longer_than_context():
    model = random_model("qwen2", max_position_embeddings=12)
    cache = model.new_cache(batch=1, capacity=32)
    with pytest.raises(ValueError, match="max_position_embeddings=12"):
        model.prefill(torch.zeros(13, dtype=torch.long), cache, 0)


def test_decode_past_limits():
    model = random_model("llama", max_position_embeddings=20)
    small = model.new_cache(batch=2, capacity=8)
    with pytest.raises(ValueError, match="position 8 is past the KV cache capacity of 8"):
        model.decode(torch.zeros(2, dtype=torch.long), torch.tensor([3, 8], dtype=torch.int32), small)
    big = model.new_cache(batch=1, capacity=64)
    with pytest.raises(ValueError, match="max_position_embeddings=20"):
        model.decode(torch.zeros(1, dtype=torch.long), torch.tensor([20], dtype=torch.int32), big)
    with pytest.raises(ValueError, match="slot 2"):
        model.prefill(torch.zeros(3, dtype=torch.long), small, 2)


def test_decode_position_past_the_limit():
    """decode at the cache's last row is fine, one past it is a ValueError naming the limit (the
    capacity, or max_position_embeddings when that is the smaller); found by mutation testing: the
    prefill limits were tested, decode's were not."""
    model = random_model("llama", max_position_embeddings=12)
    tok = torch.tensor([1])
    model.decode(tok, torch.tensor([7], dtype=torch.int32), model.new_cache(batch=1, capacity=8))
    with pytest.raises(ValueError, match="position 8 is past the KV cache capacity of 8"):
        model.decode(tok, torch.tensor([8], dtype=torch.int32), model.new_cache(batch=1, capacity=8))
    cache = model.new_cache(batch=1, capacity=32)
    model.decode(tok, torch.tensor([11], dtype=torch.int32), cache)
    with pytest.raises(ValueError, match="position 12 is past the model's context of max_position_embeddings=12"):
        model.decode(tok, torch.tensor([12], dtype=torch.int32), cache)


def test_repo_id_resolves_to_the_hf_cache(checkpoints, tmp_path, monkeypatch):
    """A repo id that is not a local path loads the snapshot huggingface_hub downloaded (refs/main's,
    else the only one); nothing is downloaded, and a missing repo says how to get it."""
    from decodex.loader import resolve_model_dir
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # no local "org/tiny" directory
    repo = hub / "models--org--tiny"
    for commit in ("abc123", "def456"):
        shutil.copytree(checkpoints["single"], repo / "snapshots" / commit)
    with pytest.raises(LoadError, match=r"org/tiny: not a local path, and as a Hugging Face repo id it is "
                                        r"2 snapshots and no refs/main naming one in the cache .*hub"):
        resolve_model_dir("org/tiny")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("def456\n")
    assert resolve_model_dir("org/tiny") == str(repo / "snapshots" / "def456")
    model = load_model("org/tiny", device="cpu", quiet=True)
    assert model.config.model_type == "llama"
    shutil.rmtree(repo / "snapshots" / "abc123")
    (repo / "refs" / "main").write_text("0ther\n")  # names no snapshot: the only one is taken
    assert resolve_model_dir("org/tiny") == str(repo / "snapshots" / "def456")
    with pytest.raises(LoadError, match=r"org/other: .* it is not there in the cache .*"
                                        r"huggingface-cli download org/other"):
        load_model("org/other", quiet=True)
    assert resolve_model_dir("no-slash") == "no-slash"  # not a repo id: left to the caller's error
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # its hub/ is the cache above
    assert resolve_model_dir("org/tiny") == str(repo / "snapshots" / "def456")
