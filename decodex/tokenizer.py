"""Tokenizer: an HF `tokenizer.json` run by the `tokenizers` library, the model's chat template
rendered with jinja2 the way transformers renders it, the special-token ids generation needs, and
`IncrementalDecoder`, which turns a stream of token ids into text without splitting a character.

Chat templates are rendered in jinja2's immutable sandbox with transformers' settings
(trim_blocks, lstrip_blocks, the loopcontrols extension, a `{% generation %}` tag that just renders
its body) and helpers (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text),
with the special tokens (`bos_token`, `eos_token`, ...) as variables, so a template gives the same
string here as `transformers`' `apply_chat_template(..., tokenize=False)`.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

from decodex.config import LoadError, token_ids

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_json(path: str) -> dict:
    """A JSON object from path; {} when the file is missing or holds something else."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: malformed JSON: {e}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks in
        transformers; for rendering it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json + chat template + special tokens of an HF model directory."""

    def __init__(self, tokenizer, chat_template: str | None = None, special_tokens: dict | None = None,
                 eos_token_ids: list[int] | None = None, bos_token_id: int | None = None):
        self._tok = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.eos_token_ids = list(eos_token_ids or [])
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Reads tokenizer.json, tokenizer_config.json, chat_template.jinja (preferred over the
        config's chat_template, as transformers does), generation_config.json and config.json.
        A file that cannot be read, a field of the wrong type or a chat template that does not
        compile is a LoadError naming the file (and field), raised here rather than at first use."""
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"{tok_file}: not found (decodex needs a fast-tokenizer tokenizer.json)")
        try:
            tok = _HFTokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or a bad schema
            raise LoadError(f"{tok_file}: cannot read tokenizer: {e}") from None
        tok_config = read_json(os.path.join(path, "tokenizer_config.json"))
        gen_config = read_json(os.path.join(path, "generation_config.json"))
        model_config = read_json(os.path.join(path, "config.json"))

        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        template_source = jinja_file
        if os.path.isfile(jinja_file):
            try:
                with open(jinja_file, encoding="utf-8") as f:
                    template = f.read()
            except UnicodeDecodeError as e:
                raise LoadError(f"{jinja_file}: not UTF-8 text: {e}") from None
        else:
            template_source = os.path.join(path, "tokenizer_config.json") + ": field 'chat_template'"
            template = tok_config.get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
                    raise LoadError(f"{template_source} must be a string or a list of "
                                    f'{{"name": ..., "template": "..."}} objects, got {template!r}')
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default") or next(iter(named.values()), None)
        if template is None:
            json_file = os.path.join(path, "chat_template.json")
            template_source = json_file + ": field 'chat_template'"
            template = read_json(json_file).get("chat_template")
        if template is not None:
            # Checked now, so that a broken template names its file instead of failing at the
            # first chat prompt with a bare jinja2 error.
            import jinja2
            if not isinstance(template, str):
                raise LoadError(f"{template_source} must be a string, got {template!r}")
            try:
                _compile_template(template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise LoadError(f"{template_source}: chat template syntax error "
                                f"(line {e.lineno}): {e.message}") from None

        special = {key: _token_text(tok_config.get(key)) for key in _SPECIAL_KEYS}

        eos = token_ids(gen_config.get("eos_token_id"), os.path.join(path, "generation_config.json"),
                         "eos_token_id")
        if not eos:
            eos = token_ids(model_config.get("eos_token_id"), os.path.join(path, "config.json"),
                             "eos_token_id")
        if not eos and special.get("eos_token") is not None:
            eos_id = tok.token_to_id(special["eos_token"])
            eos = [] if eos_id is None else [eos_id]
        bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        if bos is None and special.get("bos_token") is not None:
            bos = tok.token_to_id(special["bos_token"])
        return cls(tok, template, special, eos, bos)

    # -- text <-> ids ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The chat as the model's template renders it (a string; encode it without adding special
        tokens: the template writes them). Extra keyword arguments (tools, documents, ...) are passed
        to the template as transformers passes them."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no "
                             "'chat_template' and there is no chat_template.jinja)")
        variables = dict(self.special_tokens)
        variables.update(kwargs)
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)


class IncrementalDecoder:
    """Token ids in, text out, one token at a time, never splitting a character.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a prefix gives
    U+FFFD. So `push` decodes a small window (from the last point where text was emitted) and emits
    the new text only when it does not end in U+FFFD; otherwise it waits for the next token. The
    window also keeps decoders that treat the first token specially (a leading-space marker) right.
    The concatenation of everything `push` and `flush` return equals decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: text before it is emitted and final
        self._read = 0  # ids before it are emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ('' while a character is incomplete)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the stream comes out
        as U+FFFD, as decode() would give it)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]
