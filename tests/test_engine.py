"""decodex.engine: the CUDA-graph decode path (CudaGraphRunner) and its host loop.

CPU tests (unmarked): the host loop (HostLoop) against a fake device that runs queued work lazily
and in order, as a stream does, with a toy "model" whose tokens are a known function of the
prompt; they check every token of every sequence, EOS / max tokens / capacity / stop(), row reuse
(more prompts than rows), graph-size choice, and that no work touches a dead row or a position past
the cache.

GPU tests: random-weight Qwen2 (qkv bias, tied, head_dim 128) and Llama (untied, llama3 RoPE,
attention bias, head_dim 64) models. The graph path is compared at every step with the same
model run on the CPU in fp32 (decodex.reference) fed the same tokens (teacher forcing), with the
tolerance criterion of the kernel tests: the GPU's logit error against fp32 at most 2x the error of
the same model run in bf16 on the CPU (reference ops rounding where the kernels round) plus a
small floor. Greedy tokens must be the argmax of the graph's own logits, and may differ from the
fp32 argmax only at a near-tie (reported with its step and gap).
"""
from __future__ import annotations

import contextlib
import random
from collections import deque

import pytest
import torch

from decodex import engine, reference
from decodex.engine import HostLoop, graph_sizes
from helpers import check_logits, gpu_decode, same_until_near_tie

# ---------------------------------------------------------------------------------------------
# CPU: graph sizes, seeds


def test_graph_sizes():
    assert graph_sizes(1) == (1,)
    assert graph_sizes(3) == (1, 2, 3)
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(12) == (1, 2, 4, 8, 12)
    assert graph_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_seed_int64_keeps_the_64_bits():
    for seed in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, 12345678901234567890):
        s = reference.seed_int64(seed)
        assert -(2**63) <= s < 2**63
        assert s & ((1 << 64) - 1) == seed & ((1 << 64) - 1)


def test_runner_refuses_a_cpu_model():
    from helpers import random_model

    with pytest.raises(RuntimeError, match="CUDA|kernels"):
        engine.CudaGraphRunner(random_model("llama"), max_batch=1, capacity=16)


def test_runner_refuses_bad_plans():
    """plans: a subset of engine.PLANS holding "cublas", checked before anything else."""
    for bad in (("gemv", "gemv8"), ("cublas", "fast")):
        with pytest.raises(ValueError, match="plans must be a subset"):
            engine.CudaGraphRunner(None, max_batch=16, capacity=16, plans=bad)


# ---------------------------------------------------------------------------------------------
# CPU: the host loop against a fake device

V = 1000
DEAD = 10**6  # what a dead row's slot of the tokens buffer holds: never a real token


def first_token(prompt):
    return (sum(prompt) * 3 + len(prompt)) % V


def next_token(tok, pos, temperature):
    return (tok * 7 + pos * 13 + (5 if temperature <= 0 else 11)) % V


def expected_tokens(prompt_or_context, params, max_new, capacity, eos, first=None):
    """The toy model's output for one sequence, cut as the runner must cut it."""
    if isinstance(prompt_or_context, int):
        T, tok = prompt_or_context, first
    else:
        T, tok = len(prompt_or_context), first_token(prompt_or_context)
    temp = getattr(params, "temperature", 0.0)
    planned = min(max_new, capacity - T + 1)
    out, pos = [], T
    while len(out) < planned:
        out.append(tok)
        if tok in eos:
            break
        tok = next_token(tok, pos, temp)
        pos += 1
    return out


class P:
    def __init__(self, temperature=0.0):
        self.temperature = temperature
        self.top_k, self.top_p, self.seed = 0, 1.0, 0


class FakeRunner(HostLoop):
    """A device that runs queued work in order, a random amount at a time, like a stream."""

    def __init__(self, max_batch, capacity, depth=3, seed=0):
        super().__init__(max_batch, capacity, depth)
        self.rng = random.Random(seed)
        B = max_batch
        self.tokens = [0] * B
        self.positions = [-1] * B
        self.temps = [0.0] * B
        self.ring = [[None] * B for _ in range(self.ring_size)]
        self.ring_unread = [False] * self.ring_size
        self.queue = deque()
        self.submitted = 0
        self.executed = 0
        self.steps = []  # (n, greedy, live rows) per executed step
        self.cache_writes = []  # (row, position)

    def _submit(self, fn):
        self.queue.append(fn)
        self.submitted += 1
        return self.submitted

    def _progress(self, k):
        for _ in range(k):
            if not self.queue:
                return
            self.queue.popleft()()
            self.executed += 1

    # the device interface
    def _dev_reset(self):
        def fn():
            self.positions = [-1] * self.max_batch
        self._submit(fn)

    def _dev_prefill(self, row, prompt, params, live):
        def fn():
            assert len(prompt) <= self.capacity
            for p in range(len(prompt)):
                self.cache_writes.append((row, p))
            self.tokens[row] = first_token(prompt)
            self.temps[row] = params.temperature
            self.positions[row] = len(prompt) if live else -1
        self._submit(fn)

    def _dev_load(self, row, context, token, params, live):
        def fn():
            self.tokens[row] = token
            self.temps[row] = params.temperature
            self.positions[row] = context if live else -1
        self._submit(fn)

    def _dev_deactivate(self, row):
        def fn():
            self.positions[row] = -1
        self._submit(fn)

    def _dev_step(self, n, greedy):
        assert n in self.sizes

        def fn():
            live = [r for r in range(self.max_batch) if self.positions[r] >= 0]
            assert all(r < n for r in live), f"live rows {live} outside the graph of {n} rows"
            assert greedy == all(self.temps[r] <= 0 for r in live), "greedy graph with a sampling row"
            self.steps.append((n, greedy, tuple(live)))
            for r in range(n):
                p = self.positions[r]
                if p < 0:
                    self.tokens[r] = DEAD
                    continue
                assert p < self.capacity, f"row {r} consumes position {p} >= capacity {self.capacity}"
                self.cache_writes.append((r, p))
                self.tokens[r] = next_token(self.tokens[r], p, self.temps[r])
                self.positions[r] = p + 1
        self._submit(fn)

    def _dev_publish(self, slot):
        def fn():
            assert not self.ring_unread[slot], f"ring slot {slot} overwritten before the host read it"
            self.ring[slot] = list(self.tokens)
            self.ring_unread[slot] = True
        return self._submit(fn)

    def _dev_ready(self, handle):
        self._progress(self.rng.randint(0, 3))
        return self.executed >= handle

    def _dev_wait(self, handle):
        while self.executed < handle:
            self._progress(1)

    def _dev_read(self, slot):
        assert self.ring_unread[slot]
        self.ring_unread[slot] = False
        return list(self.ring[slot])

    def _dev_drain(self):
        self._progress(len(self.queue))
        self.ring_unread = [False] * self.ring_size


def collect(gen, runner=None, stop_after=None):
    """Every sequence's tokens, in order; stop_after {i: k}: call runner.stop(i) at its k-th token."""
    got = {}
    for batch in gen:
        assert batch, "empty batches are not yielded"
        for i, t in batch:
            got.setdefault(i, []).append(t)
            if stop_after and stop_after.get(i) == len(got[i]):
                runner.stop(i)
    return got


def check_run(runner, prompts, params, max_new, eos=(), stop_after=None):
    runner.eos_ids = set(eos)
    got = collect(runner.run(prompts, params, max_new), runner, stop_after)
    for i, (pr, pa, m) in enumerate(zip(prompts, params, max_new)):
        want = expected_tokens(pr, pa, m, runner.capacity, set(eos))
        if stop_after and i in stop_after:
            want = want[: stop_after[i]]
        assert got.get(i, []) == want, f"sequence {i}: got {got.get(i)}, want {want}"
    runner._dev_drain()
    assert all(p < 0 for p in runner.positions), "a row is still live after the run"
    return got


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


def test_host_loop_basic():
    r = FakeRunner(max_batch=4, capacity=64)
    check_run(r, prompts_of([3, 5, 7]), [P(), P(), P()], [5, 9, 1])
    assert r.stats.decode_steps == 8  # the longest sequence: 9 tokens = prefill + 8 steps
    assert set(r.stats.ttft_s) == {0, 1, 2}


def test_host_loop_max_new_zero_and_one():
    r = FakeRunner(max_batch=2, capacity=64)
    got = check_run(r, prompts_of([4, 4, 4]), [P()] * 3, [0, 1, 3])
    assert 0 not in got


def test_host_loop_eos_stops_and_is_yielded():
    prompts = prompts_of([6, 9])
    want = expected_tokens(prompts[0], P(), 50, 256, set())
    eos = want[5]
    assert eos not in want[:5]
    r = FakeRunner(max_batch=2, capacity=256)
    got = check_run(r, prompts, [P(), P()], [50, 50], eos=[eos])
    assert got[0][-1] == eos and len(got[0]) == 6


def test_host_loop_capacity():
    r = FakeRunner(max_batch=3, capacity=10)
    # 8-token prompt: positions 8, 9 can be consumed -> 1 + 2 tokens; a full cache: 1 token.
    got = check_run(r, prompts_of([8, 10, 2]), [P()] * 3, [100, 100, 100])
    assert [len(got[i]) for i in range(3)] == [3, 1, 9]
    assert max(p for _, p in r.cache_writes) == 9
    with pytest.raises(ValueError, match="capacity"):
        r.run(prompts_of([11]), [P()], [4])
    with pytest.raises(ValueError, match="empty"):
        r.run([[]], [P()], [4])


def test_host_loop_more_prompts_than_rows():
    lengths = [3, 9, 4, 12, 5, 7, 2, 8, 6, 11]
    r = FakeRunner(max_batch=3, capacity=64, depth=2)
    max_new = [4, 17, 1, 9, 30, 2, 5, 12, 8, 3]
    check_run(r, prompts_of(lengths), [P()] * 10, max_new)
    assert set(r.stats.graph_steps) <= {1, 2, 3}


def test_host_loop_stop():
    r = FakeRunner(max_batch=4, capacity=128)
    got = check_run(r, prompts_of([5, 6, 7]), [P()] * 3, [40, 40, 40], stop_after={1: 7, 2: 1})
    assert len(got[1]) == 7 and len(got[2]) == 1


def test_host_loop_graph_shrinks_when_high_rows_finish():
    r = FakeRunner(max_batch=8, capacity=128)
    max_new = [30, 3, 3, 3, 3, 3, 3, 3]
    check_run(r, prompts_of([4] * 8), [P()] * 8, max_new)
    sizes = [n for n, _, _ in r.steps]
    assert sizes[0] == 8 and sizes[-1] == 1, sizes


def test_host_loop_mixed_greedy_and_sampling():
    r = FakeRunner(max_batch=4, capacity=128)
    # While row 1 samples every step uses the sampling graph; once it is done, the greedy one.
    check_run(r, prompts_of([4, 5, 6]), [P(), P(0.7), P()], [20, 5, 20])
    flags = [g for _, g, _ in r.steps]
    assert flags[0] is False and flags[-1] is True


def test_host_loop_run_loaded():
    r = FakeRunner(max_batch=4, capacity=100)
    r.eos_ids = set()
    contexts, firsts = [10, 50, 99], [3, 4, 5]
    got = collect(r.run_loaded(contexts, firsts, [P()] * 3, [20, 20, 20]))
    for i in range(3):
        assert got[i] == expected_tokens(contexts[i], P(), 20, 100, set(), first=firsts[i])
    assert len(got[2]) == 2  # context 99 of 100: one step


def test_host_loop_run_loaded_lengths_must_match():
    """A list shorter than the others is an error naming the lists, not a silently dropped sequence."""
    r = FakeRunner(max_batch=4, capacity=100)
    args = dict(contexts=[10, 20, 30], first_tokens=[1, 2, 3], params=[P()] * 3, max_new_tokens=[5] * 3)
    for short in args:
        bad = dict(args, **{short: args[short][:2]})
        with pytest.raises(ValueError, match=f"{short} \\(2\\).*same length"):
            collect(r.run_loaded(**bad))
    assert not r._running


def test_host_loop_abandoned_generator_leaves_no_live_row():
    r = FakeRunner(max_batch=4, capacity=128)
    gen = r.run(prompts_of([5, 6]), [P(), P()], [50, 50])
    next(gen)
    next(gen)
    gen.close()
    r._dev_drain()
    assert all(p < 0 for p in r.positions)
    assert not r._running
    check_run(r, prompts_of([3]), [P()], [6])  # the runner is usable again


@pytest.mark.parametrize("seed", range(40))
def test_host_loop_random(seed):
    rng = random.Random(seed)
    B = rng.choice([1, 2, 3, 5, 8])
    cap = rng.randrange(8, 80)
    r = FakeRunner(max_batch=B, capacity=cap, depth=rng.randint(1, 5), seed=seed)
    n = rng.randint(1, 12)
    prompts = prompts_of([rng.randint(1, cap) for _ in range(n)], seed)
    params = [P(rng.choice([0.0, 0.0, 0.8])) for _ in range(n)]
    max_new = [rng.randint(0, 40) for _ in range(n)]
    eos = set(rng.sample(range(V), rng.randint(0, 30)))
    stop_after = {i: rng.randint(1, 10) for i in range(n) if rng.random() < 0.3}
    # stop() after the k-th token only if the sequence really gets that far.
    stop_after = {i: k for i, k in stop_after.items()
                  if len(expected_tokens(prompts[i], params[i], max_new[i], cap, eos)) > k}
    check_run(r, prompts, params, max_new, eos=eos, stop_after=stop_after)
    written = [p for _, p in r.cache_writes]
    assert not written or max(written) < cap


# ---------------------------------------------------------------------------------------------
# GPU: the graph path against the fp32 reference

GPU_SHAPES = dict(hidden_size=256, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1096, num_hidden_layers=2, max_position_embeddings=8192)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 512}
MODELS = {
    # Qwen2: q/k/v bias, tied embeddings (as Qwen2.5-1.5B), head_dim 128.
    "qwen2-d128": dict(model_type="qwen2", tied=True, head_dim=128),
    # Llama: untied, llama3 RoPE scaling, q/k/v/o bias, head_dim 64.
    "llama-d64": dict(model_type="llama", tied=False, head_dim=64, rope_scaling=LLAMA3_SCALING,
                      attention_bias=True),
    # Qwen3: q/k norms (rope_append, or rope_append_attention where the attention has 2+ splits), no bias.
    "qwen3-d128": dict(model_type="qwen3", tied=True, head_dim=128),
    # Mistral: no biases; q is 4 x 128 wide, twice hidden_size (as in Mistral Nemo).
    "mistral-d128-wide-q": dict(model_type="mistral", tied=False, head_dim=128, rope_theta=1e6),
    # Qwen3-MoE: an expert layer, then a dense one. Every expert is chosen (4 of 4), so the output is
    # continuous in the router's logits and the fp32 comparison cannot meet a near-tie between
    # experts; test_moe_graph_routes_as_eager checks a real choice (4 of 16).
    "qwen3-moe-d128": dict(model_type="qwen3_moe", tied=False, head_dim=128, num_experts=4, num_experts_per_tok=4,
                           moe_intermediate_size=96, mlp_only_layers=[1]),
}


class Models:
    """The same random weights (bf16-rounded) as a GPU bf16 model, a CPU fp32 reference model and a
    CPU bf16 model (reference ops rounding where the kernels round: PyTorch's own bf16 error)."""

    def __init__(self, name, seed=0):
        from decodex.model import Model
        from helpers import random_weights, tiny_config

        spec = dict(MODELS[name])
        model_type, tied = spec.pop("model_type"), spec.pop("tied")
        self.config = tiny_config(model_type, tied=tied, **GPU_SHAPES, **spec)
        weights = {k: v.to(torch.bfloat16).float() for k, v in random_weights(self.config, seed).items()}
        self.gpu = Model(self.config, weights, "cuda", torch.bfloat16)
        assert self.gpu.use_kernels
        self.ref = Model(self.config, weights, "cpu", torch.float32)
        self.ref16 = Model(self.config, weights, "cpu", torch.bfloat16)


_MODELS_CACHE: dict = {}


def models(name) -> Models:
    if name not in _MODELS_CACHE:
        _MODELS_CACHE[name] = Models(name)
    return _MODELS_CACHE[name]


def ref_decode(model, prompts, tokens, positions, steps, capacity):
    """The same sequences on a CPU model, fed the GPU's tokens: logits [B, V] fp32 per step."""
    B = len(prompts)
    cache = model.new_cache(B, capacity)
    with torch.no_grad():
        first = torch.stack([model.prefill(torch.tensor(p), cache, r)[-1] for r, p in enumerate(prompts)])
        out = [first.float()]
        for k in range(steps):
            out.append(model.decode(tokens[k], positions[k], cache).float())
    return out


def run_and_check(label, m, runner, prompts, steps, greedy=True, params=None):
    capacity = max(map(len, prompts)) + steps + 1
    logits, tokens, positions = gpu_decode(runner, prompts, steps, params, greedy)
    ref32 = ref_decode(m.ref, prompts, tokens, positions, steps, capacity)
    ref16 = ref_decode(m.ref16, prompts, tokens, positions, steps, capacity)
    tols, div = check_logits(label, logits, ref32, ref16, tokens if greedy else None)
    return logits, tokens, positions, tols


@pytest.mark.gpu
def test_runner_rejects_token_ids_outside_the_vocabulary():
    """Checked on the host before they reach the device (an out-of-range id would index the
    embedding out of bounds: a device-side assert)."""
    m = models("qwen2-d128")
    V = m.config.vocab_size
    runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=32)
    with pytest.raises(ValueError, match=f"prompt: token id {V} is outside the vocabulary"):
        runner.prefill_row(0, [1, V, 2])
    with pytest.raises(ValueError, match="first token: token id -1 is outside the vocabulary"):
        runner.load_row(0, 4, -1)
    runner.prefill_row(0, [1, V - 1, 2])  # the runner still works
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_graph_logits_match_fp32_reference(name):
    m = models(name)
    runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=256)
    prompt = torch.randint(0, m.config.vocab_size, (37,)).tolist()
    run_and_check(f"{name} single", m, runner, [prompt], steps=64)
    assert runner.num_captures == 1
    # 2 splits here, so Qwen3's q/k norms run inside the attention kernel (rope_append_attention)
    assert runner._splits[1] >= 2
    assert runner._fused_rope_attention(1) == m.config.qk_norm
    # The same step outside the graph gives the same logits as the replay.
    runner.reset()
    runner.prefill_row(0, prompt)
    runner.step(1)
    torch.cuda.synchronize()
    replayed = runner.logits[0].clone()
    runner.reset()
    runner.prefill_row(0, prompt)
    runner.eager_step(1)
    torch.cuda.synchronize()
    torch.testing.assert_close(runner.logits[0], replayed, rtol=0, atol=0)


@pytest.mark.gpu
def test_moe_graph_routes_as_eager():
    """Qwen3-MoE choosing 4 of 16 experts a token: the graph's steps (router gemv, moe_route and the
    expert GEMVs reading the choice on the device) give the eager step's logits bit for bit, step
    after step, as the choice changes; one capture serves them all."""
    from decodex.model import Model
    from helpers import random_weights, tiny_config

    config = tiny_config("qwen3_moe", **dict(GPU_SHAPES, head_dim=128, num_experts=16, num_experts_per_tok=4,
                                             moe_intermediate_size=96, norm_topk_prob=True))
    gpu = Model(config, random_weights(config, seed=5), "cuda", torch.bfloat16)
    runner = engine.CudaGraphRunner(gpu, max_batch=2, capacity=64)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (11, 4)]
    graph, eager = [], []
    for step_fn, out in ((runner.step, graph), (runner.eager_step, eager)):
        runner.reset()
        for row, p in enumerate(prompts):
            runner.prefill_row(row, p)
        for _ in range(8):
            step_fn(2)
            torch.cuda.synchronize()
            out.append((runner.logits[:2].clone(), runner.moe_ids[:2].clone()))
    for i, ((g, gi), (e, ei)) in enumerate(zip(graph, eager)):
        assert torch.equal(gi, ei), f"step {i}: graph chose experts {gi.tolist()}, eager {ei.tolist()}"
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"step {i}")
    assert len({tuple(ids.flatten().tolist()) for _, ids in graph}) > 1, "the choice never changed"
    assert runner.num_captures == 1


@pytest.mark.parametrize("per_product_ms, keeps", [(1.0, "per product"), (3.0, "all cublas")])
def test_checking_plans_keeps_the_faster_set_then_refines(per_product_ms, keeps):
    """_capture_checking_plans on a stand-in runner (no GPU): the per-product plans against every
    product on cuBLAS, both with dead rows; the faster set is what _refine_plans starts from (the
    graph it gets was captured with those plans, and linear_plan holds them)."""
    r = engine.CudaGraphRunner.__new__(engine.CudaGraphRunner)
    r.plan_step_ms = {}
    per_product = {(16, name): "gemv" if name == "o" else "cublas" for name in engine.PRODUCTS}
    r.linear_plan = {}
    refined = []

    def capture(n, greedy):
        if not r.linear_plan:  # the first capture plans the products (_plan_linears)
            r.linear_plan.update(per_product)
        return dict(r.linear_plan)

    def replay_ms(graph, reading=False):
        assert not reading
        return per_product_ms if graph == per_product else 2.0

    def refine(n, greedy, graph):
        refined.append((graph, dict(r.linear_plan)))
        return graph

    r._capture_as_chosen, r._replay_ms, r._refine_plans = capture, replay_ms, refine
    graph = r._capture_checking_plans(16, True)
    want = per_product if keeps == "per product" else {k: "cublas" for k in per_product}
    assert graph == want and refined == [(want, want)]
    assert r.plan_step_ms[16] == {"per product": per_product_ms, "all cublas": 2.0}


def test_plans_at():
    """The wide gemv only up to WIDE_GEMV_MAX_ROWS rows."""
    assert engine.plans_at(engine.PLANS, engine.WIDE_GEMV_MAX_ROWS) == list(engine.PLANS)
    assert engine.plans_at(engine.PLANS, engine.WIDE_GEMV_MAX_ROWS + 1) == ["cublas", "cublaslt", "lt_linear",
                                                                              "gemv8"]


@pytest.mark.parametrize("raises", [False, True])
def test_blas_library_is_set_for_the_call_only(raises):
    """The "cublaslt" plan's calls run with torch's preferred BLAS library set to cuBLASLt; the
    caller's setting is back afterwards, also when the call raises; "cublas" changes nothing."""
    before = torch.backends.cuda.preferred_blas_library()
    with engine.blas_library("cublas"):
        assert torch.backends.cuda.preferred_blas_library() == before
    with contextlib.suppress(RuntimeError):
        with engine.blas_library("cublaslt"):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
            if raises:
                raise RuntimeError("the product failed")
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.parametrize("count", [0, 3])
def test_time_lt_linear_keeps_the_fastest_candidate(count):
    """_time_lt_linear on a stand-in runner (no GPU): run() counts the candidates (as _lt_linear does
    with none chosen), each is timed once, the fastest is kept; with none, the plan is not offered."""
    r = engine.CudaGraphRunner.__new__(engine.CudaGraphRunner)
    r.lt_algo, r.lt_times_us, r._lt_count = {(16, "o"): 7}, {}, {(16, "o"): 9}
    key, made_up = (16, "o"), [5.0, 4.0, 6.0]

    def run():
        assert key not in r.lt_algo and key not in r._lt_count, "a stale choice or count was kept"
        assert r._lt_counting, "the counting run would compute"
        r._lt_count[key] = count

    timed = []
    us = r._time_lt_linear(16, "o", run, lambda: timed.append(r.lt_algo[key]) or made_up[r.lt_algo[key]])
    assert not r._lt_counting
    if count == 0:
        assert us is None and timed == [] and key not in r.lt_times_us
    else:
        assert us == 4.0 and r.lt_algo[key] == 1 and timed == [0, 1, 2] and r.lt_times_us[key] == made_up


def test_refine_plans_keeps_only_real_gains():
    """_refine_plans on a stand-in runner (no GPU): each product's other plans tried in turn, the
    step times made up. o on the wide gemv is 5% faster and kept; o on gemv8 (0.2%, under
    PLAN_MARGIN) and down on the wide gemv (slower) are not; lm_head starts on gemv8 and moves to
    cuBLAS, and gemv8 is not tried again after that; the graph returned is the one captured with
    the plans kept, and every trial is recorded."""
    r = engine.CudaGraphRunner.__new__(engine.CudaGraphRunner)
    r.plans, r.plan_refine_ms, r.products = engine.PLANS, {}, engine.PRODUCTS
    r.linear_plan = {(16, name): "gemv8" if name == "lm_head" else "cublas" for name in engine.PRODUCTS}
    gains = {("o", "gemv"): 0.95, ("o", "gemv8"): 0.998, ("down", "gemv"): 1.2, ("lm_head", "gemv8"): 1.1}

    def capture(n, greedy):  # the "graph": the plans it was captured with
        return {name: r.linear_plan[(n, name)] for name in engine.PRODUCTS}

    def replay_ms(graph, reading=False):
        assert reading
        ms = 2.0
        for name, plan in graph.items():
            ms *= gains.get((name, plan), 1.0 if plan == "cublas" else 1.1)
        return ms

    r._capture_as_chosen, r._replay_ms = capture, replay_ms
    graph = r._refine_plans(16, True, capture(16, True))
    want = {name: "gemv" if name == "o" else "cublas" for name in engine.PRODUCTS}
    assert graph == want and capture(16, True) == want
    tried = r.plan_refine_ms[16]
    assert tried["start"] == pytest.approx(2.2)
    assert len(tried) == 1 + (len(engine.PLANS) - 1) * len(engine.PRODUCTS)
    assert tried["o gemv"] == pytest.approx(2.2 * 0.95) and tried["down gemv"] == pytest.approx(2.2 * 0.95 * 1.2)
    assert tried["lm_head cublas"] == pytest.approx(1.9) and "lm_head gemv8" not in tried


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_graph_batch_over_8_rows_uses_measured_linears(name):
    """12 sequences in the 16-row graph: the measured choice among engine.PLANS, per row vs fp32."""
    m = models(name)
    runner = engine.CudaGraphRunner(m.gpu, max_batch=16, capacity=128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, m.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (12,), generator=g)]
    run_and_check(f"{name} batch 12", m, runner, prompts, steps=12)
    plan = {k: v for k, v in runner.linear_plan.items() if k[0] == 16}
    print(f"{name}: linear plan for 16 rows: {plan}, times (us): "
          f"{ {k: v for k, v in runner.linear_times_us.items() if k[0] == 16} }")
    assert set(name for _, name in plan) == set(engine.PRODUCTS)
    for key, p in plan.items():  # an lt_linear product runs the candidate its timing chose
        assert p != "lt_linear" or runner.lt_algo[key] == min(
            range(len(runner.lt_times_us[key])), key=runner.lt_times_us[key].__getitem__)
    checked, refined = runner.plan_step_ms[16], runner.plan_refine_ms[16]
    print(f"{name}: step ms with dead rows: {checked}; rows reading the cache: {refined}")
    # then every other plan of every product was tried with attention at work (_refine_plans)
    assert "start" in refined and len(refined) == 1 + len(engine.PRODUCTS) * (len(engine.PLANS) - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2-d128", "qwen3-d128"])  # qwen3: q/k norms on each plan
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("plan,max_batch,batch", [(p, 16, 11) for p in engine.PLANS] + [("gemv", 32, 27)])
def test_graph_batch_over_8_rows_each_plan(monkeypatch, plan, max_batch, batch, fuse, name):
    """Each way of running the products above 8 rows, forced for every product: cuBLAS or the wide
    gemv over all rows, then rope_append / silu_mul (rope_append inside the attention kernel,
    rope_append_attention, with fuse: the cache has 3 splits; the wide gemv's gate|up is one
    gemv_silu_mul where that takes the rows); and the fused decodex kernels over 8-row chunks (the
    last chunk partly dead rows). The 32-row graph runs the wide gemv on the wgmma kernel where it
    exists (above 16 rows). Qwen3 (q/k norms) takes rope_append_attention with fuse on every plan,
    the gemv8 plan's plain gemv included."""
    m = models(name)

    def forced(self, n):
        for name in engine.PRODUCTS:
            self.linear_plan[(n, name)] = plan

    monkeypatch.setattr(engine.CudaGraphRunner, "_plan_linears", forced)
    # and no whole-step check, which could put the products back on cuBLAS
    monkeypatch.setattr(engine.CudaGraphRunner, "_capture_checking_plans",
                        engine.CudaGraphRunner._capture_as_chosen)
    runner = engine.CudaGraphRunner(m.gpu, max_batch=max_batch, capacity=300, fuse_rope_attention=fuse)
    assert runner._splits[max_batch] >= 2
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, m.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (batch,), generator=g)]
    run_and_check(f"{name} plan {plan} batch {batch} fuse {fuse}", m, runner, prompts, steps=8)
    assert runner._fused_rope_attention(max_batch) == (fuse and (plan in engine.WIDE_PLANS
                                                                 or m.config.qk_norm))


@pytest.mark.gpu
def test_context_grows_past_capture_length_without_recapture():
    """Captured at context L, the same graph decodes on to 4L (lengths live on the device); no
    replay allocates memory."""
    m = models("qwen2-d128")
    L = 64  # 4L + 8 = 264 capacity: 3 KV splits of 128, so the context crosses split boundaries too
    runner = engine.CudaGraphRunner(m.gpu, max_batch=2, capacity=4 * L + 8)
    prompt = torch.randint(0, m.config.vocab_size, (L,)).tolist()
    logits, tokens, positions = gpu_decode(runner, [prompt], steps=1)
    assert runner.num_captures == 1
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    run_and_check("qwen2 L->4L", m, runner, [prompt], steps=3 * L)
    assert runner.num_captures == 1, "the graph was captured again"
    assert int(runner.positions[0]) == 4 * L
    assert torch.cuda.memory_allocated() <= allocated + (1 << 20)  # prefill temporaries are freed
    before = torch.cuda.memory_allocated()
    runner.step(1)
    runner.step(1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "a graph replay allocated memory"


class Weight:
    """A weight's stand-in for the plan-choice tests below: its shape only."""

    def __init__(self, *shape):
        self.shape = torch.Size(shape)


def stand_in_runner():
    """A CudaGraphRunner without __init__ (no GPU, no model): the tests set the attributes that the
    method under test reads (_splits, _clusters)."""
    return object.__new__(engine.CudaGraphRunner)


def test_long_cache_gemv_config_choice():
    """_gemv_config on a stand-in runner (no GPU): LONG_CACHE_GEMV's entry only for a named shape,
    at most the entry's rows, more than CLUSTER_SPLITS splits, and clusters where it has them."""
    runner = stand_in_runner()
    runner._splits = {1: 132, 2: 66, 4: 33, 8: 8}
    runner._clusters = True
    qkv, gate_up, gate_up_7b = Weight(2048, 1536), Weight(17920, 1536), Weight(37888, 3584)
    entry = {shape: list(cfg) for shape, (cfg, _) in engine.LONG_CACHE_GEMV.items()}
    assert engine.LONG_CACHE_GEMV[(2048, 1536)][1] == 2 and engine.LONG_CACHE_GEMV[(37888, 3584)][1] == 1
    assert runner._gemv_config(1, qkv) == entry[(2048, 1536)]
    assert runner._gemv_config(2, gate_up) == entry[(17920, 1536)]
    assert runner._gemv_config(4, qkv) is None  # more rows than the entry serves
    assert runner._gemv_config(1, gate_up_7b) == entry[(37888, 3584)]
    assert runner._gemv_config(2, gate_up_7b) is None  # this entry serves one row
    assert runner._gemv_config(1, Weight(1536, 1536)) is None  # a shape not named
    runner._splits = {1: 8}  # a short cache: the splits merge in a cluster
    assert runner._gemv_config(1, qkv) is None
    runner._splits, runner._clusters = {1: 132}, False  # no clusters: entries with c > 1 are left out
    assert engine.LONG_CACHE_GEMV[(17920, 1536)][0][2] > 1 and runner._gemv_config(1, gate_up) is None
    assert runner._gemv_config(1, qkv) == entry[(2048, 1536)]


def test_long_cache_gemv_entries_are_configurations_of_their_shapes():
    """Every LONG_CACHE_GEMV entry is one the GEMV kernel takes for its shape (bench.gemv's list,
    which the in-step sweeps draw from), and serves 1 or 2 rows. Runs on a CPU machine."""
    from bench.gemv import _configs

    for (N, K), (cfg, rows) in engine.LONG_CACHE_GEMV.items():
        assert ",".join(map(str, cfg)) in set(_configs(N, K, True)), (N, K, cfg)
        assert rows in (1, 2), (N, K, rows)


def test_dependents_after_choice():
    """_dependents_after on a stand-in runner (no GPU): DEPENDENTS_AFTER's short-cache entry where
    the splits merge in a cluster, its long-cache entry past CLUSTER_SPLITS, for one row only and
    named shapes only; every entry a percentage the GEMV ops take."""
    for shape, pcts in engine.DEPENDENTS_AFTER.items():
        assert len(pcts) == 2 and all(0 <= p <= 100 for p in pcts), (shape, pcts)
    runner = stand_in_runner()
    gate_up, down = Weight(17920, 1536), Weight(1536, 8960)
    short_gu, long_gu = engine.DEPENDENTS_AFTER[(17920, 1536)]
    short_down, long_down = engine.DEPENDENTS_AFTER[(1536, 8960)]
    runner._splits = {1: 132, 2: 66}
    assert runner._dependents_after(1, gate_up) == long_gu and runner._dependents_after(1, down) == long_down
    assert runner._dependents_after(2, gate_up) == 0  # one row only
    assert runner._dependents_after(1, Weight(1536, 1536)) == 0  # a shape not named
    runner._splits = {1: 8}  # a short cache: the splits merge in a cluster
    assert runner._dependents_after(1, gate_up) == short_gu and runner._dependents_after(1, down) == short_down


def test_o_early_choice():
    """_o_early on a stand-in runner (no GPU): the o product launches the next kernel early, but not
    at one row on a long cache (more than CLUSTER_SPLITS splits) for O_LATE_ON_LONG_CACHE's shapes."""
    assert (1536, 1536) in engine.O_LATE_ON_LONG_CACHE  # Qwen2.5-1.5B's o (session 60, H200)
    runner = stand_in_runner()
    o_15b, o_7b = Weight(1536, 1536), Weight(3584, 3584)
    runner._splits = {1: 66, 2: 33}
    assert not runner._o_early(1, o_15b)  # one row, the combine kernel, a named shape
    assert runner._o_early(2, o_15b)  # two rows
    assert runner._o_early(1, o_7b)  # a shape not named
    runner._splits = {1: 8}  # a short cache: the splits merge in a cluster
    assert runner._o_early(1, o_15b)


@pytest.mark.ext
def test_cluster_splits_is_the_attention_cluster_limit():
    """engine.CLUSTER_SPLITS mirrors decode_attention.cu's kClusterSplits: a cache of 9-16
    minimum-length splits is given that many splits (so that they merge in one cluster), one more
    tile of 128 tokens gives more (the combine kernel). Runs on a CPU machine."""
    splits = torch.ops.decodex.decode_attention_splits
    assert splits(1, 2, 16 * 128, 132) == engine.CLUSTER_SPLITS
    assert splits(1, 2, 17 * 128, 132) == 17 > engine.CLUSTER_SPLITS


@pytest.mark.gpu
def test_long_cache_gemv_configs_reach_the_products(monkeypatch):
    """LONG_CACHE_GEMV: with the splits merged in the combine kernel (a 2200-token cache: 17 splits)
    and at most the entry's rows, the products of the named shapes (qkv, gate|up, and down through
    the residual-accumulating gemv) launch the configuration given (an impossible one fails, so it
    was passed), the step still matching the reference; a 1-row graph on a short cache (8 splits,
    the cluster merge) and graphs of more rows than an entry serves pass none."""
    m = models("qwen2-d128")
    layer = m.gpu.layers[0]
    qkv, gate_up, down = tuple(layer.qkv_w.shape), tuple(layer.gate_up_w.shape), tuple(layer.down_w.shape)
    assert len({qkv, gate_up, down, tuple(layer.o_w.shape)}) == 4  # each failure names its product
    for shape, op in [(qkv, "gemv_rope_append"), (gate_up, "gemv_silu_mul"), (down, "gemv")]:
        monkeypatch.setattr(engine, "LONG_CACHE_GEMV", {shape: ((3, 3, 1, 4), 2)})
        runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=2200)
        with pytest.raises(RuntimeError, match=rf"decodex::{op}: config = \[3, 3, 1, 4\]"):
            runner.capture(1)
    c = 2 if torch.cuda.get_device_capability()[0] >= 9 else 1
    monkeypatch.setattr(engine, "LONG_CACHE_GEMV", {qkv: ((1, 2, 1, 4), 2), gate_up: ((2, 1, c, 4), 1)})
    runner = engine.CudaGraphRunner(m.gpu, max_batch=4, capacity=2200)
    assert runner._splits[1] > engine.CLUSTER_SPLITS
    assert runner._gemv_config(2, layer.qkv_w) == [1, 2, 1, 4]
    assert runner._gemv_config(1, layer.gate_up_w) == [2, 1, c, 4]
    assert runner._gemv_config(2, layer.gate_up_w) is None  # more rows than the entry serves
    assert runner._gemv_config(4, layer.qkv_w) is None  # likewise
    assert runner._gemv_config(1, layer.o_w) is None  # a shape not named
    prompt = torch.randint(0, m.config.vocab_size, (37,)).tolist()
    run_and_check("qwen2 long-cache configs", m, runner, [prompt], steps=16)
    short = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=256)
    assert short._splits[1] <= engine.CLUSTER_SPLITS and short._gemv_config(1, layer.qkv_w) is None


@pytest.mark.gpu
def test_dependents_after_reaches_the_products(monkeypatch):
    """DEPENDENTS_AFTER: a 1-row graph's gate|up (gemv_silu_mul) and down (the residual-accumulating
    gemv) products are launched with their entry's percentage, short cache or long (an impossible
    one fails, so it was passed), and the step with entries in place still matches the reference."""
    m = models("qwen2-d128")
    layer = m.gpu.layers[0]
    gate_up, down = tuple(layer.gate_up_w.shape), tuple(layer.down_w.shape)
    for shape, op in [(gate_up, "gemv_silu_mul"), (down, "gemv")]:
        for capacity, bad in [(256, (101, 0)), (2200, (0, 101))]:
            monkeypatch.setattr(engine, "DEPENDENTS_AFTER", {shape: bad})
            runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=capacity)
            with pytest.raises(RuntimeError, match=rf"decodex::{op}: launch_dependents_after must be 0 to 100"):
                runner.capture(1)
    monkeypatch.setattr(engine, "DEPENDENTS_AFTER", {gate_up: (80, 90), down: (50, 100)})
    prompt = torch.randint(0, m.config.vocab_size, (37,)).tolist()
    for capacity in (256, 2200):
        runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=capacity)
        run_and_check(f"qwen2 dependents after, capacity {capacity}", m, runner, [prompt], steps=16)


@pytest.mark.gpu
def test_o_late_on_long_cache_matches_reference(monkeypatch):
    """O_LATE_ON_LONG_CACHE naming the test model's o: on a long cache (more than CLUSTER_SPLITS
    splits, the combine kernel) the runner gives its 1-row graph's o no early trigger and its 2-row
    graph's o one (a bool hint, so the launch itself cannot be checked here), and both graphs' steps
    match the reference."""
    m = models("qwen2-d128")
    o = tuple(m.gpu.layers[0].o_w.shape)
    monkeypatch.setattr(engine, "O_LATE_ON_LONG_CACHE", {o})
    runner = engine.CudaGraphRunner(m.gpu, max_batch=2, capacity=2200)
    assert runner._splits[1] > engine.CLUSTER_SPLITS
    assert not runner._o_early(1, m.gpu.layers[0].o_w) and runner._o_early(2, m.gpu.layers[0].o_w)
    prompts = [torch.randint(0, m.config.vocab_size, (T,)).tolist() for T in (37, 90)]
    run_and_check("qwen2 o late on a long cache, 1 row", m, runner, prompts[:1], steps=16)
    run_and_check("qwen2 o late on a long cache, 2 rows", m, runner, prompts, steps=16)


@pytest.mark.gpu
def test_sampling_graph_draws_reference_tokens():
    """The sampling graph: per-row params (one greedy row among them), each draw keyed by the
    position of the consumed token, as reference.sample draws from the same logits."""
    from decodex.generate import SamplingParams

    m = models("llama-d64")
    runner = engine.CudaGraphRunner(m.gpu, max_batch=4, capacity=128)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=1.0, seed=7),
              SamplingParams(),  # greedy
              SamplingParams(temperature=1.0, top_k=0, top_p=0.9, seed=2**64 - 5)]
    prompts = [torch.randint(0, m.config.vocab_size, (n,)).tolist() for n in (9, 17, 4)]
    logits, tokens, positions = gpu_decode(runner, prompts, steps=40, params=params, greedy=False)
    mismatches, draws = [], 0
    for k in range(len(logits)):
        for b, p in enumerate(params):
            consumed = len(prompts[b]) - 1 if k == 0 else int(positions[k - 1][b])
            want = reference.sample(logits[k][b:b + 1], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                                    torch.tensor([p.top_p]), torch.tensor([reference.seed_int64(p.seed)]),
                                    torch.tensor([consumed], dtype=torch.int32))
            draws += 1
            if int(tokens[k][b]) != int(want):
                mismatches.append((k, b, int(tokens[k][b]), int(want)))
    # A draw exactly on a cumulative-sum boundary may round the other way in fp32: allow one.
    assert len(mismatches) <= 1, f"{len(mismatches)}/{draws} draws differ from reference.sample: {mismatches}"
    # The sampled sequences really sample (not all greedy).
    assert any(int(tokens[k][0]) != int(logits[k][0].argmax()) for k in range(len(logits)))


@pytest.mark.gpu
def test_batched_equals_alone_long_prompts():
    """Prompts of 5, 700 and 3000 tokens: each sequence decoded in a batch (graph of 4, through
    run()'s host loop too) gives the same greedy tokens as decoded alone, until the first near-tie."""
    m = models("qwen2-d128")
    steps = 16  # the fp32 CPU reference at 3000 tokens is the slow part
    lengths = (5, 700, 3000)
    runner = engine.CudaGraphRunner(m.gpu, max_batch=4, capacity=3000 + steps + 8)
    prompts = [torch.randint(0, m.config.vocab_size, (n,)).tolist() for n in lengths]
    # Batched, step by step, against the fp32 reference (teacher-forced).
    logits_b, tokens_b, _, tols = run_and_check("batch 5/700/3000", m, runner, prompts, steps)
    batched = [[int(tokens_b[k][b]) for k in range(steps + 1)] for b in range(3)]
    # Alone (graph of 1): same tokens until the alone run's top-2 gap falls under the tolerance.
    for b, prompt in enumerate(prompts):
        logits_a, tokens_a, _ = gpu_decode(runner, [prompt], steps)
        alone = [int(tokens_a[k][0]) for k in range(steps + 1)]
        for k in range(steps + 1):
            if alone[k] != batched[b][k]:
                top2 = logits_a[k][0].topk(2).values
                gap = (top2[0] - top2[1]).item()
                print(f"prompt of {lengths[b]}: batched and alone differ at step {k}, top-2 gap {gap:.4f}")
                assert gap <= 2 * tols[k][b], (f"prompt of {lengths[b]} tokens: batched token {batched[b][k]} "
                                               f"!= alone {alone[k]} at step {k} with a top-2 gap of {gap:.4f}")
                break
            # Same tokens so far: the logits agree to bf16 noise.
            err = (logits_a[k][0] - logits_b[k][b]).abs().max().item()
            assert err <= tols[k][b], f"prompt of {lengths[b]}: step {k}: alone vs batched logits differ by {err}"
    # run(): the real host loop (async token ring) gives the step-by-step batched tokens.
    runner.eos_ids = set()
    got = {}
    for out in runner.run(prompts, [None] * 3, [steps + 1] * 3):
        for i, t in out:
            got.setdefault(i, []).append(t)
    for b in range(3):
        assert got[b] == batched[b], f"run() sequence {b}: {got[b]} != step-by-step {batched[b]}"
    assert runner.stats.graph_steps == {4: steps}
    print(f"time to first token (s): {runner.stats.ttft_s}")


@pytest.mark.gpu
def test_finished_sequences_stop():
    """max tokens, EOS and stop(): the sequence yields nothing more, its row is dead on the device
    and its cache slot is no longer written, while the others run on (same graph size, so the
    others' tokens are bitwise those of an undisturbed run)."""
    m = models("llama-d64")
    runner = engine.CudaGraphRunner(m.gpu, max_batch=4, capacity=128)
    prompts = [torch.randint(0, m.config.vocab_size, (n,)).tolist() for n in (6, 11, 8)]
    runner.eos_ids = set()
    # Row 2 lives longest so every step runs in the 4-row graph.
    base = {}
    for out in runner.run(prompts, [None] * 3, [40, 40, 60]):
        for i, t in out:
            base.setdefault(i, []).append(t)
    assert [len(base[i]) for i in range(3)] == [40, 40, 60]
    # An EOS id that sequence 1 produces at step k >= 3 and sequence 2 never does.
    k = next((k for k in range(3, 40) if base[1][k] not in base[1][:k] + base[0][:4] + base[2]), None)
    if k is None:
        pytest.skip("no usable EOS candidate in this random model's output")
    eos = base[1][k]
    runner.eos_ids = {eos}
    got, snap = {}, {}
    for out in runner.run(prompts, [None] * 3, [4, 40, 60]):
        for i, t in out:
            got.setdefault(i, []).append(t)
        for i in (0, 1):
            done = len(got.get(i, [])) == (4 if i == 0 else k + 1)
            if done and i not in snap:
                torch.cuda.synchronize()  # the extra in-flight steps have run
                assert int(runner.positions[i]) == -1 and int(runner.lengths[i]) == 0, f"row {i} still live"
                snap[i] = (runner.cache.k[0][i].clone(), runner.cache.v[-1][i].clone())
    assert set(snap) == {0, 1}, "a finished row was never seen dead on the device"
    want0 = base[0][:4]
    want1 = base[1][:k + 1]
    assert got[0] == want0
    assert got[1] == want1 and got[1][-1] == eos
    assert got[2] == [t for t in base[2]][: len(got[2])] and len(got[2]) == 60
    for i, (kc, vc) in snap.items():
        assert torch.equal(runner.cache.k[0][i], kc) and torch.equal(runner.cache.v[-1][i], vc), \
            f"row {i}'s cache was written after it finished"
    # stop(): sequence 1 stopped after 7 tokens by the host (a stop string, say).
    runner.eos_ids = set()
    got = {}
    for out in runner.run(prompts, [None] * 3, [40, 40, 60]):
        for i, t in out:
            got.setdefault(i, []).append(t)
            if i == 1 and len(got[1]) == 7:
                runner.stop(1)
    assert got[1] == base[1][:7]
    assert got[0] == base[0] and got[2] == base[2]
    torch.cuda.synchronize()
    assert (runner.positions < 0).all(), "rows left live after the run"


@pytest.mark.gpu
def test_more_prompts_than_rows():
    """Five prompts through a 2-row runner (rows reused as sequences finish, graphs of 1 and 2)
    give the tokens each gives alone."""
    m = models("qwen2-d128")
    runner = engine.CudaGraphRunner(m.gpu, max_batch=2, capacity=128)
    runner.eos_ids = set()
    prompts = [torch.randint(0, m.config.vocab_size, (n,)).tolist() for n in (3, 14, 7, 20, 5)]
    max_new = [6, 3, 9, 1, 5]
    got = {}
    for out in runner.run(prompts, [None] * 5, max_new):
        for i, t in out:
            got.setdefault(i, []).append(t)
    assert set(runner.stats.graph_steps) <= {1, 2}
    for i, p in enumerate(prompts):
        assert len(got[i]) == max_new[i]
        logits, tokens, _ = gpu_decode(runner, [p], max_new[i] - 1)
        same_until_near_tie(f"sequence {i}", got[i], [int(t[0]) for t in tokens], [l[0] for l in logits])


@pytest.mark.gpu
def test_sampled_tokens_match_reference_runner(monkeypatch):
    """The same prompt and SamplingParams through CudaGraphRunner.run and generate.ReferenceRunner
    (eager kernels, same model): the same tokens. Both draw with (seed, position of the consumed
    token), and a lone sequence runs the same kernels on the same shapes on both paths (the runner
    held to the eager path's norms: both inside the GEMVs)."""
    from decodex.generate import ReferenceRunner, SamplingParams

    monkeypatch.setattr(engine, "RMS_CHOICES", (("qkv", "gate_up"),))

    m = models("llama-d64")  # untied: logits of unit scale, so sampling really samples
    prompt = torch.randint(0, m.config.vocab_size, (23,)).tolist()
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=3)):
        # Both stop on the config's EOS id (ReferenceRunner: model.eos_token_ids or config's).
        runner = engine.CudaGraphRunner(m.gpu, max_batch=1, capacity=128)
        graph = [t for out in runner.run([prompt], [params], [24]) for _, t in out]
        eager = [t for out in ReferenceRunner(m.gpu, 1, 128).run([prompt], [params], [24]) for _, t in out]
        assert graph == eager, f"{params}: graph {graph} != eager {eager}"
