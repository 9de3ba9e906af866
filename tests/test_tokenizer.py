"""decodex.tokenizer against transformers on the SmolLM2 tokenizer rebuilt from its GGUF: token ids,
decoding, chat templates (the model's and ones exercising the jinja helpers), special-token ids,
and IncrementalDecoder's multi-byte safety. CPU only."""
import json
import os
import shutil

import pytest

from _smollm import hf_tokenizer, smollm_dir
from decodex.config import LoadError
from decodex.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "\n",
    "  leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "\t\t\n \n\r\n  \u00a0nbsp",
    "日本語のテキストと中文字符，還有한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "Ünïcödé façade naïve résumé — “quotes” ‘single’ …",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14f; }",
    "numbers 12345 3.14159 1,000,000 and  42 with two spaces",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>repo<file_sep>",
    "half a special token <|im_sta and <|im_end",
    "x" * 97,
    "don't we'll they're I'M",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀 你好"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?\n\twith tabs  "}],
]

# Templates exercising what transformers' renderer provides: trim_blocks/lstrip_blocks, loop
# controls, tojson keeping non-ASCII text, the special-token variables, {% generation %}.
CUSTOM_TEMPLATES = [
    "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "[{{ m.role }}] {{ m.content | tojson }}\n{% endfor %}\n{% if add_generation_prompt %}[assistant]{% endif %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson(indent=2) }}"
    "{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endif %}"
    "{% endfor %}{{ eos_token }}",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(smollm_dir())


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text)  # SmolLM2 adds no BOS/EOS on its own either
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.decode([1, 2, 0], skip_special_tokens=True) == ""


def test_special_ids(tok):
    assert tok.eos_token_ids == [2]
    assert tok.bos_token_id == 1
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.special_tokens["bos_token"] == "<|im_start|>"
    assert tok.has_chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_chat_template_matches_transformers(tok, hf, chat, add_generation_prompt):
    ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    assert tok.encode(ours) == list(ids)


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES, ids=range(len(CUSTOM_TEMPLATES)))
def test_custom_template_matches_transformers(tok, hf, template):
    chat = [{"role": "user", "content": "naïve ünïcode 日本"}] + CHATS[2] + [{"role": "system", "content": "s"}]
    tok2 = Tokenizer(tok._tok, template, tok.special_tokens, tok.eos_token_ids, tok.bos_token_id)
    ours = tok2.apply_chat_template(chat, add_generation_prompt=True)
    theirs = hf.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "日本" in ours and "\\u" not in ours  # tojson keeps non-ASCII text


def test_template_helpers(tok):
    t = Tokenizer(tok._tok, "{% if messages|length > 1 %}{{ raise_exception('only one message') }}"
                            "{% endif %}{{ strftime_now('%Y') }}", tok.special_tokens)
    import datetime
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == str(datetime.date.today().year)
    import jinja2
    with pytest.raises(jinja2.exceptions.TemplateError, match="only one message"):
        t.apply_chat_template(CHATS[2])
    # The sandbox refuses attribute access to internals.
    evil = Tokenizer(tok._tok, "{{ messages.__class__.__mro__ }}", tok.special_tokens)
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template(CHATS[0])
    none = Tokenizer(tok._tok, None, tok.special_tokens)
    assert not none.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        none.apply_chat_template(CHATS[0])


def test_from_dir_sources(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; EOS ids come from generation_config.json
    (a list), else config.json, else the eos_token."""
    src = smollm_dir()
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(os.path.join(src, "tokenizer.json"), d)
    shutil.copy(os.path.join(src, "tokenizer_config.json"), d)
    assert Tokenizer.from_dir(d).eos_token_ids == [2]  # from the eos_token only
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    assert Tokenizer.from_dir(d).eos_token_ids == [0]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == [2, 0] and t.bos_token_id == 1
    (d / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == "JINJA" + CHATS[0][0]["content"]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _merged(name, **changes):
    """Writes `name` as the SmolLM2 directory's copy with `changes` merged in (a dict file)."""
    def write(d):
        path = d / name
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(dict(old, **changes)))
    return write


def _raw(name, data: bytes):
    return lambda d: (d / name).write_bytes(data)


@pytest.mark.parametrize("edit, file, words", [
    (_raw("tokenizer.json", b'{"version": "1.0", '), "tokenizer.json", ["cannot read tokenizer"]),
    (_raw("tokenizer.json", b'{"version": "1.0"}'), "tokenizer.json", ["cannot read tokenizer"]),
    (_raw("tokenizer_config.json", b'{"eos_token": '), "tokenizer_config.json", ["malformed JSON"]),
    (_raw("generation_config.json", b"\xff\xfe"), "generation_config.json", ["malformed JSON"]),
    (_raw("chat_template.jinja", b"\xff{{ x }}"), "chat_template.jinja", ["UTF-8"]),
    (_raw("chat_template.jinja", b"{% for m in messages %}{{ m.content }}"), "chat_template.jinja",
     ["syntax error", "line 1"]),
    # eos ids: a float crashed, `true` became token 1, a string was dropped silently
    (_merged("generation_config.json", eos_token_id=2.0), "generation_config.json", ["eos_token_id", "2.0"]),
    (_merged("generation_config.json", eos_token_id=True), "generation_config.json", ["eos_token_id", "True"]),
    (_merged("generation_config.json", eos_token_id="<|im_end|>"), "generation_config.json", ["eos_token_id"]),
    (_merged("generation_config.json", eos_token_id=[2, "0"]), "generation_config.json", ["eos_token_id"]),
    (_merged("config.json", eos_token_id=2.0), "config.json", ["eos_token_id", "2.0"]),
    # chat templates that are not text: rendering them crashed, or a chat prompt silently went raw
    (_merged("tokenizer_config.json", chat_template=5), "tokenizer_config.json", ["chat_template", "string"]),
    (_merged("tokenizer_config.json", chat_template={"default": "{{ x }}"}), "tokenizer_config.json",
     ["chat_template", "string"]),
    (_merged("tokenizer_config.json", chat_template=["{{ x }}"]), "tokenizer_config.json", ["chat_template"]),
    (_merged("tokenizer_config.json", chat_template=[{"name": "default", "template": None}]),
     "tokenizer_config.json", ["chat_template"]),
    (_merged("tokenizer_config.json", chat_template=[{"name": "default", "template": "{% if %}"}]),
     "tokenizer_config.json", ["chat_template", "syntax error"]),
], ids=["tokenizer-cut", "tokenizer-no-model", "tokenizer_config-cut", "generation_config-binary",
        "jinja-binary", "jinja-syntax", "eos-float", "eos-true", "eos-string", "eos-mixed-list",
        "config-eos-float", "template-int", "template-dict", "template-list-of-str",
        "template-named-null", "template-named-syntax"])
def test_from_dir_bad_files(tmp_path, edit, file, words):
    """A corrupt or wrong-typed file is a LoadError naming the file and field, raised when the
    directory is read (not a bare tokenizers / json / jinja2 error, nor a value quietly dropped)."""
    src = smollm_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    edit(tmp_path)
    with pytest.raises(LoadError) as e:
        Tokenizer.from_dir(tmp_path)
    msg = str(e.value)
    for word in [str(tmp_path / file)] + words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_named_chat_templates(tmp_path):
    src = smollm_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), tmp_path)
    _merged("tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D"}])(tmp_path)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHATS[0]) == "D"


STREAM_TEXTS = [
    "汉字 and emoji 😀👍🏽 Ünï 日本 👨‍👩‍👧‍👦 end",
    "😀😀😀🇫🇷🇯🇵 ① ② ③ ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑🏿‍🚀",
    "plain ascii text with numbers 123",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder(tok, text):
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if any(ord(c) > 0x7FF for c in text):  # some token ends inside a character: text was held back
        assert "" in pieces[:-1]


def test_incremental_decoder_incomplete_end(tok):
    """A stream that stops inside a character: flush gives what decode gives (U+FFFD)."""
    ids = tok.encode("ok 😀")
    for cut in range(1, len(ids) + 1):
        dec = IncrementalDecoder(tok)
        out = "".join(dec.push(i) for i in ids[:cut]) + dec.flush()
        assert out == tok.decode(ids[:cut])


def test_incremental_decoder_skips_special(tok):
    ids = tok.encode("<|im_start|>assistant\nhé 日本<|im_end|>")
    dec = IncrementalDecoder(tok, skip_special_tokens=True)
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids, skip_special_tokens=True) == "assistant\nhé 日本"


# ---- gaps found by mutation testing: SmolLM2's tokenizer adds no BOS and is byte-level, so it cannot
# tell whether `add_special_tokens` reaches the tokenizer or whether IncrementalDecoder keeps its
# window; the tests below use tokenizers that can.

def test_encode_add_special_tokens_flag(tok):
    """A tokenizer whose post-processor adds a BOS (as Llama's does): encode() adds it only when
    asked (chat prompts are encoded without it: the template writes its own)."""
    from tokenizers import Tokenizer as HFTokenizer, processors
    hf_tok = HFTokenizer.from_str(tok._tok.to_str())
    hf_tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                          special_tokens=[("<|im_start|>", 1)])
    t = Tokenizer(hf_tok, None, tok.special_tokens, tok.eos_token_ids, tok.bos_token_id)
    plain = tok.encode("Hello world")
    assert t.encode("Hello world") == plain
    assert t.encode("Hello world", add_special_tokens=False) == plain
    assert t.encode("Hello world", add_special_tokens=True) == [1] + plain


def test_incremental_decoder_keeps_the_leading_space_of_sentencepiece_tokens():
    """A SentencePiece-style (Metaspace) decoder drops the "▁" space of the first token it decodes:
    decoding each new token alone would glue the words together. The decoder's window (text from the
    previous token on) keeps the space."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁ok": 4}
    hf_tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    hf_tok.decoder = decoders.Metaspace()
    t = Tokenizer(hf_tok)
    ids = [1, 2, 3, 4]
    assert t.decode(ids) == "Hello world! ok" and t.decode([2]) == "world"
    dec = IncrementalDecoder(t)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "Hello world! ok"


def test_incremental_decoder_flush_empties_it(tok):
    """After flush nothing is held back: a second flush gives '' (not the same tail again)."""
    ids = tok.encode("ok 😀")
    cut = next(c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd"))
    dec = IncrementalDecoder(tok)
    out = "".join(dec.push(i) for i in ids[:cut])
    tail = dec.flush()
    assert tail.endswith("\ufffd") and out + tail == tok.decode(ids[:cut])
    assert dec.flush() == ""


def test_template_keyword_arguments_override_special_tokens(tok, hf):
    """apply_chat_template(..., eos_token=X): X is what the template sees, as in transformers."""
    t = Tokenizer(tok._tok, "{{ bos_token }}|{{ eos_token }}", tok.special_tokens)
    ours = t.apply_chat_template(CHATS[0], eos_token="<END>")
    assert ours == "<|im_start|>|<END>"
    assert ours == hf.apply_chat_template(CHATS[0], chat_template="{{ bos_token }}|{{ eos_token }}",
                                          tokenize=False, eos_token="<END>")


def test_from_dir_added_token_dicts_and_bos_priority(tmp_path):
    """Special tokens written as AddedToken dicts ({"content": ...}, as many checkpoints do) are read;
    the eos id then falls back on that token. bos_token_id: generation_config.json wins over
    config.json."""
    src = smollm_dir()
    shutil.copy(os.path.join(src, "tokenizer.json"), tmp_path)
    cfg = json.loads(open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8").read())
    cfg["eos_token"] = {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert t.special_tokens["eos_token"] == "<|endoftext|>" and t.eos_token_ids == [0]
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert Tokenizer.from_dir(tmp_path).bos_token_id == 1
