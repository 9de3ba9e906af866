"""End-to-end decode benchmark: decodex's CUDA-graph runner against Hugging Face transformers, at the
real shapes of Qwen2.5-1.5B and Qwen2.5-7B (the default; MODELS also has Qwen2.5-0.5B and -3B, Qwen3
and Llama 3.x presets) with random weights (no checkpoint file: weights are drawn on the GPU), on the
H200.

Per case (batch, context):
  decodex GPU ms   median of graph replays queued back to back (CUDA events between replays)
  decodex wall ms  per step in the real host loop (CudaGraphRunner.run_loaded: async token ring,
                   host-side stop checks), 128 steps
  tok/s            batch * 1000 / wall ms
  floor ms         (weight bytes + KV bytes read, at the timed replays' mean position) / the read
                   bandwidth measured in this run
  % of floor       floor / GPU ms
  HF eager ms      transformers, DynamicCache holding `context` random tokens, per-step CUDA events
  HF compiled ms   transformers, StaticCache(max_cache_len = context + 16) + torch.compile(
                   mode="reduce-overhead"), decode step at cache_position = context, calls queued
                   back to back between CUDA events (GPU time, as decodex's GPU ms; until session
                   34 each call was timed alone, which also counted its host work)
The KV cache holds random K/V for `context` tokens and the rows sit at that position, so attention
reads the whole context; nothing is prefilled (no 32K-token prefill needed).

  python -m bench.decode                  # both models, all cases, HF included (~6 min)
  python -m bench.decode --quick          # 1.5B, 3 cases, no HF
  python -m bench.decode --no-hf | --no-compile | --models 1.5b --cases 1x1024,8x1024
  python -m bench.decode --no-hf --models 1.5b --profile   # per-kernel breakdown (b1 1K/32K, b64 1K)
  python -m bench.decode --no-hf --models qwen3-30b-a3b --cases 1x1024 --profile --profile-cases 1x1024
  python -m bench.decode --no-hf --cases 16x1024,32x1024 --plans cublas,gemv8   # without the wide gemv
  python -m bench.decode --no-hf --cases 16x1024,64x1024 --no-fused-rope   # rope_append + attention
  python -m bench.decode --sweep-gemv --models 7b --cases 1x1024,8x1024   # tuning csrc/gemv.cu kTuned
  python -m bench.decode --sweep-gemv --models 7b --cases 1x1024 --sweep-shapes 37888x3584 \
      --rms-in-gemv qkv+gate_up          # a shape tuned with the RMS scale inside (csrc/gemv.cu kTuned)
  python -m bench.decode --sweep-gemv --models qwen3-4b --cases 1x1024 --sweep-json sweeps.jsonl
                                         # also every configuration's step time, one JSON line a shape
  python -m bench.decode --live-plans --models 1.5b --cases 64x1024   # the plans above 8 rows, live
  python -m bench.decode --ab DECODEX_ATTN_CLUSTER=0 --models 7b --cases 1x1024   # A/B of a switch
  python -m bench.decode --no-hf --models 1.5b --cases 64x1024 --force-plans gate_up=gemv --profile
torch.compile takes tens of seconds per shape: compiled cases run in priority order until
--hf-compile-budget-s is spent; the rest print "skipped (budget)".
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Mapping

import torch

from bench.common import expected_experts, print_table, read_bandwidth_gbs, require_gpu
from decodex.engine import event_time_ms
from decodex.model import GEMV_MAX_ROWS

# The fields the Llama 3.x presets share (their checkpoints' config.json values).
LLAMA3 = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192))
MODELS = {
    "1.5b": dict(name="Qwen2.5-1.5B", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(name="Qwen2.5-7B", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-0.5B (head_dim 64) and -3B: shapes csrc/gemv.cu's table has no entries for, which
    # check its rule for other shapes.
    "0.5b": dict(name="Qwen2.5-0.5B", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768),
    "3b": dict(name="Qwen2.5-3B", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
               max_position_embeddings=32768),
    "qwen3-1.7b": dict(name="Qwen3-1.7B", model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-4b": dict(name="Qwen3-4B", model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-8b": dict(name="Qwen3-8B", model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960),
    "llama3.2-1b": dict(LLAMA3, name="Llama-3.2-1B", hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        vocab_size=128256, tie_word_embeddings=True,
                        rope_scaling=dict(LLAMA3["rope_scaling"], factor=32.0)),
    "llama3.2-3b": dict(LLAMA3, name="Llama-3.2-3B", hidden_size=3072, intermediate_size=8192,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                        vocab_size=128256, tie_word_embeddings=True,
                        rope_scaling=dict(LLAMA3["rope_scaling"], factor=32.0)),
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 a token (the step reads about 3B of its 30B).
    "qwen3-30b-a3b": dict(name="Qwen3-30B-A3B", model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "llama3.1-8b": dict(LLAMA3, name="Llama-3.1-8B", hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        vocab_size=128256, tie_word_embeddings=False),
}
COMMON = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=131072, bos_token_id=None, eos_token_id=[])
# (batch, context), in the order HF's compiled cases run when the budget is short.
CASES = [(1, 1024), (1, 32768), (8, 1024), (64, 1024), (1, 8192), (32, 1024), (16, 1024)]
QUICK_CASES = [(1, 1024), (1, 32768), (8, 1024)]
SWEEP_CASES = [(1, 1024), (8, 1024)]  # --sweep-gemv: the M = 1 and M = 8 entries of the table
LIVE_PLAN_CASES = [(64, 1024)]  # --live-plans
AB_CASES = QUICK_CASES  # --ab: the batch-1 bars' cases and batch 8
AB_REPS = 3  # --ab: rounds of the interleaved variants
READ_ONCE_ENV = {"DECODEX_PDL"}  # read once per process by the extension: --ab cannot switch them
PROFILE_CASES = [(1, 1024), (1, 32768), (64, 1024)]  # (batch, context) of --profile, each model
GPU_STEPS = 100  # replays timed for "GPU ms"
GPU_WARMUP = 5  # replays before them (each moves the live rows one position on)
# The timed replays decode positions context + GPU_WARMUP .. + GPU_STEPS - 1: the floor's KV bytes are
# taken at their mean.
TIMED_CONTEXT = GPU_WARMUP + (GPU_STEPS - 1) / 2
WALL_STEPS = 128  # steps of the host loop for "wall ms"
HF_STEPS = 10

HEADERS = ["model", "batch", "context", "decodex GPU ms", "decodex wall ms", "tok/s", "floor ms",
           "% of floor", "HF eager ms", "HF compiled ms", "compiled / decodex"]


# ---- decodex ---------------------------------------------------------------------------------------

def config_dict(key: str) -> dict:
    raw = dict(COMMON, **{k: v for k, v in MODELS[key].items() if k != "name"})
    raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    return raw


class _RandomWeights(Mapping):
    """HF-named random bf16 weights of a config, each drawn on the GPU when it is read (from a seed
    of its own name, so a second read gives the same tensor): a Qwen3-MoE model's 18,000 expert
    tensors never all exist beside the Model that stacks them (30B parameters twice would not fit)."""

    def __init__(self, cfg):
        self.shapes = cfg.weight_shapes()

    def __getitem__(self, name):
        shape = self.shapes[name]
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if name.endswith("norm.weight"):
            return t.normal_(1.0, 0.1, generator=g)
        if name.endswith("bias"):
            return t.normal_(0.0, 0.02, generator=g)
        if "embed_tokens" in name:
            return t.normal_(0.0, 1.0, generator=g)
        return t.normal_(0.0, shape[-1] ** -0.5, generator=g)

    def __contains__(self, name):
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def build_decodex(key: str):
    """A decodex Model with random bf16 weights drawn on the GPU (std 1/sqrt(fan_in) for matrices)."""
    from decodex.config import ModelConfig
    from decodex.model import Model

    cfg = ModelConfig.from_dict(config_dict(key), source=f"<bench {key}>")
    model = Model(cfg, _RandomWeights(cfg), "cuda", torch.bfloat16)
    torch.cuda.empty_cache()
    return model


def weight_bytes(model, batch: int = 1) -> float:
    """Bytes of weights one decode step reads (the LM head once even when tied). An expert layer
    reads its router and the experts its rows choose: num_experts_per_tok at batch 1; at batch B the
    distinct ones expected when each row's choice is uniform, E (1 - (1 - k/E)^B)."""
    c = model.config
    total = model.final_norm.numel() + model.lm_head.numel()
    for layer in model.layers:
        for t in (layer.qkv_w, layer.qkv_b, layer.o_w, layer.o_b, layer.gate_up_w, layer.down_w, layer.q_norm,
                  layer.k_norm, layer.router_w):
            if t is not None:
                total += t.numel()
        if layer.router_w is not None:
            total += expected_experts(c.num_experts, c.num_experts_per_tok, batch) * (
                layer.experts_gate_up[0].numel() + layer.experts_down[0].numel())
    return 2 * total


def kv_bytes(model, batch: int, context: float) -> float:
    """K and V bytes the step reads for rows at position `context` (context + 1 cached tokens each)."""
    c = model.config
    return 2 * batch * c.num_hidden_layers * 2 * c.num_key_value_heads * (context + 1) * c.head_dim


def make_runner(model, batch: int, context: int, plans=None, fuse_rope: bool = True, forced=None):
    """A runner whose rows 0..batch-1 sit at `context` over a cache of random K/V (plans: the
    engine's products' plans above 8 rows to measure, default all; fuse_rope: the runner's
    fuse_rope_attention; forced: {product: plan} set above 8 rows without measuring, every other
    product on cuBLAS, and no whole-step check or refinement: --force-plans)."""
    from decodex.engine import PLANS, CudaGraphRunner

    cls = CudaGraphRunner if not forced else _forced_runner(forced)
    capacity = context + max(GPU_STEPS + 10, WALL_STEPS) + 16
    runner = cls(model, max_batch=batch, capacity=capacity, plans=plans or PLANS, fuse_rope_attention=fuse_rope)
    runner.eos_ids = set()  # random weights: never stop early
    for t in runner.cache.k + runner.cache.v:
        t.normal_()
    return runner


def _forced_runner(forced: dict):
    """A CudaGraphRunner whose products above 8 rows take the plans in `forced` (cuBLAS for the
    rest) as they are: for looking at a plan inside the step (--force-plans), not for use."""
    from decodex.engine import PRODUCTS, CudaGraphRunner

    class ForcedPlans(CudaGraphRunner):
        def _plan_linears(self, n):
            for name in PRODUCTS:
                self.linear_plan[(n, name)] = forced.get(name, "cublas")

        def _capture_checking_plans(self, n, greedy):
            return self._capture_as_chosen(n, greedy)

    return ForcedPlans


def parse_forced(text: str) -> dict:
    """--force-plans "gate_up=gemv,o=gemv" -> {"gate_up": "gemv", "o": "gemv"}; ValueError names a
    bad entry."""
    from decodex.engine import PLANS, PRODUCTS

    forced = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        name, _, plan = part.partition("=")
        if name not in PRODUCTS or plan not in PLANS:
            raise ValueError(f"{part!r} is not PRODUCT=PLAN with PRODUCT in {PRODUCTS} and PLAN in {PLANS}")
        forced[name] = plan
    return forced


def load_rows(runner, batch: int, context: int):
    V = runner.config.vocab_size
    tokens = torch.randint(0, V, (batch,)).tolist()
    runner.reset()
    for r in range(batch):
        runner.load_row(r, context, tokens[r])
    return tokens


def decodex_case(model, batch: int, context: int, plans=None, fuse_rope: bool = True, forced=None) -> dict:
    runner = make_runner(model, batch, context, plans, fuse_rope, forced)
    load_rows(runner, batch, context)
    n = runner.capture(batch)
    gpu_ms = statistics.median(runner.time_steps(n, steps=GPU_STEPS, warmup=GPU_WARMUP))
    # The real loop: run_loaded from the same starting point, tokens streamed to the host.
    tokens = load_rows(runner, batch, context)
    for _ in runner.run_loaded([context] * batch, tokens, [None] * batch, [WALL_STEPS + 1] * batch):
        pass
    assert runner.stats.decode_steps == WALL_STEPS, runner.stats
    wall_ms = runner.stats.ms_per_step()
    plan = {}  # product -> the plan kept, with what each plan measured (us per call)
    for (m, name), v in runner.linear_plan.items():
        if m == n:
            times = {p: round(us, 2) for p, us in runner.linear_times_us.get((m, name), {}).items()}
            plan[name] = f"{v} {times}" if times else v
    if n in runner.plan_step_ms:
        plan["step ms with dead rows"] = {k: round(ms, 3) for k, ms in runner.plan_step_ms[n].items()}
    if n in runner.plan_refine_ms:
        plan["step ms, rows reading the cache"] = {k: round(ms, 3) for k, ms in runner.plan_refine_ms[n].items()}
    if n in runner.rms_in_gemv:
        times = {"+".join(c): round(ms, 3) for (m, c), ms in runner.rms_times_ms.items() if m == n}
        plan["rms in gemv"] = f"{'+'.join(runner.rms_in_gemv[n])} (step ms, rows reading the cache: {times})"
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return dict(gpu_ms=gpu_ms, wall_ms=wall_ms, plan=plan)


def time_to_first_token(model, prompt_len: int = 1024) -> float:
    """ms from run() to the first token of a prompt of `prompt_len` random tokens (prefill path)."""
    from decodex.engine import CudaGraphRunner

    runner = CudaGraphRunner(model, max_batch=1, capacity=prompt_len + 16)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    for _ in runner.run([prompt], [None], [1]):  # warm-up (cuBLAS / SDPA first calls)
        pass
    times = []
    for _ in range(5):
        for _ in runner.run([prompt], [None], [1]):
            pass
        times.append(runner.stats.ttft_s[0] * 1000.0)
    del runner
    torch.cuda.empty_cache()
    return statistics.median(times)


# ---- profile ---------------------------------------------------------------------------------------

def kernel_times(events) -> dict:
    """{name: [calls, span us, gaps, gap us]} from kernel events (end us, span us, name): a kernel's
    gap is its end minus the end of the kernel that ended before it (none for the first)."""
    per_kernel = {}
    events = sorted(events)
    for i, (end, us, name) in enumerate(events):
        slot = per_kernel.setdefault(name, [0, 0.0, 0, 0.0])
        slot[0] += 1
        slot[1] += us
        if i > 0:
            slot[2] += 1
            slot[3] += end - events[i - 1][0]
    return per_kernel


def profile_step(model, context: int, batch: int = 1, reps: int = 3, forced=None, name: str = "model") -> None:
    """Per-kernel device time of one graph step, from torch.profiler over `reps` replays. "us/step"
    is each kernel's own span (launch to end; spans overlap under PDL). "critical us/step" is what
    it adds to the step: the kernels of a step complete in order, each waiting for the one before,
    so a kernel's end minus the previous kernel's end is its share of the step, whatever overlap its
    start had. Those shares add up to the replays' span."""
    from torch.profiler import ProfilerActivity, profile

    runner = make_runner(model, batch, context, forced=forced)
    load_rows(runner, batch, context)
    n = runner.capture(batch)
    step_ms = statistics.median(runner.time_steps(n, steps=20))
    per_kernel, how = {}, "graph replay"
    for mode in ("graph", "eager"):
        load_rows(runner, batch, context)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                runner.step(n) if mode == "graph" else runner.eager_step(n)
            torch.cuda.synchronize()
        per_kernel = kernel_times([(e.time_range.end, e.time_range.elapsed_us(), e.name) for e in prof.events()
                                   if str(getattr(e, "device_type", "")).endswith("CUDA")
                                   and e.time_range.elapsed_us() > 0])
        if per_kernel:
            break
        how = "eager step (the profiler saw no kernels inside the graph replay)"
    total_us = sum(v[1] for v in per_kernel.values()) / reps
    rows, crit_total = [], 0.0
    for kernel, (calls, us, gaps, gap_us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        short = kernel if len(kernel) <= 90 else kernel[:87] + "..."
        crit = gap_us / gaps * calls / reps if gaps else 0.0
        crit_total += crit
        rows.append([short, calls // reps, us / reps, crit, 100.0 * crit / (step_ms * 1000.0)])
    rows.append(["(sum of kernels)", "", total_us, crit_total, 100.0 * crit_total / (step_ms * 1000.0)])
    rows.append(["(graph step, CUDA events)", "", "", step_ms * 1000.0, 100.0])
    print_table(f"{name} step at context {context}, batch {batch}: kernels ({how})",
                ["kernel", "calls/step", "us/step", "critical us/step", "% of step"], rows)
    del runner
    torch.cuda.empty_cache()


# ---- Hugging Face ----------------------------------------------------------------------------------

def hf_config(key: str):
    """transformers' config of the preset, from the same fields decodex reads (its model_type picks
    the class: Qwen2, Qwen3 or Llama)."""
    from transformers import AutoConfig

    raw = {k: v for k, v in config_dict(key).items() if k not in ("bos_token_id", "eos_token_id")}
    return AutoConfig.for_model(raw.pop("model_type"), **raw, use_cache=True)


def build_hf(key: str):
    """transformers' model of the preset with random bf16 weights on the GPU."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(key)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


def hf_eager(model, cfg, batch: int, context: int) -> float:
    """ms per decode step of the eager model over a DynamicCache holding `context` random tokens."""
    from transformers import DynamicCache

    D = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    for i in range(cfg.num_hidden_layers):
        shape = (batch, cfg.num_key_value_heads, context, D)
        cache.update(torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
                     torch.randn(shape, dtype=torch.bfloat16, device="cuda"), i)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
    pos = [context]

    def step():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.tensor(pos, device="cuda"),
              use_cache=True)
        pos[0] += 1

    with torch.no_grad():
        ms = event_time_ms(step, HF_STEPS, warmup=3)
    del cache
    torch.cuda.empty_cache()
    return ms


def hf_compiled(model, cfg, batch: int, context: int) -> float:
    """ms per decode step of torch.compile(mode="reduce-overhead") over a StaticCache."""
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=context + 16)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
    pos = torch.tensor([context], device="cuda")

    def step(ids, pos):
        return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits

    with torch.no_grad():
        step(ids, pos)  # eager: allocates the static cache tensors before compiling
        compiled = torch.compile(step, mode="reduce-overhead", dynamic=False)
        # Calls queued back to back (GPU time, as decodex's GPU ms), 5 timings of 20 calls.
        ms = event_time_ms(lambda: compiled(ids, pos), 5, warmup=4, calls=HF_STEPS * 2)
    del cache, compiled
    torch.cuda.empty_cache()
    return ms


def _err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


# ---- main ------------------------------------------------------------------------------------------

SWEEP_STEPS = 60  # replays per configuration in --sweep-gemv


def live_step_ms(runner, batch: int, context: int) -> float:
    """The median GPU ms of the step as the runner's settings now stand: graphs recaptured, rows
    reloaded at `context` (the sweeps below change a setting between calls)."""
    runner.drop_graphs()
    load_rows(runner, batch, context)
    return statistics.median(runner.time_steps(runner.capture(batch), steps=SWEEP_STEPS))


def sweep_gemv(model, batch: int, context: int, shapes=None, rms=None, json_path=None, label=None) -> dict:
    """The GEMV configurations that make the decode step fastest, chosen inside the step: for each
    weight shape in turn (down, gate|up or the router, qkv, o, lm_head), the step is captured once per kernel
    configuration of that shape (bench.gemv's list, forced through DECODEX_GEMV_CONFIG's per-shape
    form, the shapes before it at their kept choice) and its replays timed; a configuration is kept
    if it beats the step as it was by more than 0.3%. batch 1 tunes csrc/gemv.cu's M = 1 entries
    (kTuned's, which also serve 2..4 rows where kTunedRows lacks the shape), 2..4 kTunedRows, 5..8
    the M = 8 entries. Prints each shape's five best and returns {(N, K): "wr,wk,c,u"} kept.
    shapes: only these weight shapes [(N, K)]; rms: the norm choice forced on every graph size of up
    to 8 rows (an RMS_CHOICES entry) instead of the engine's, so the RMS variant is what is tuned.
    json_path: also append one JSON line a shape to this file, with every configuration's step time
    (the printout has only the five best), for fitting csrc/gemv.cu's cost model; label names the
    model there."""
    from bench.gemv import ENV, _configs

    clusters = torch.cuda.get_device_capability()[0] >= 9
    gpu = torch.cuda.get_device_name() if json_path is not None else None
    layer = model.layers[0]
    # A mixture-of-experts layer has no down and gate|up products but a router GEMV.
    every = [tuple(t.shape) for t in (layer.down_w, layer.gate_up_w, layer.router_w, layer.qkv_w, layer.o_w,
                                      model.lm_head) if t is not None]
    missing = [s for s in shapes or () if s not in every]
    if missing:
        raise ValueError(f"--sweep-shapes {missing} are not weight shapes of this model ({every})")
    shapes = [s for s in every if shapes is None or s in shapes]
    runner = make_runner(model, batch, context)
    if rms is not None:
        runner.rms_in_gemv.update({n: rms for n in runner.sizes if n <= GEMV_MAX_ROWS})
    kept: dict[tuple[int, int], str] = {}

    def step_ms(extra: dict) -> float:
        entries = {**kept, **extra}
        if entries:
            os.environ[ENV] = ";".join(f"{n},{k}:{cfg}" for (n, k), cfg in entries.items())
        else:
            os.environ.pop(ENV, None)
        return live_step_ms(runner, batch, context)

    try:
        for N, K in shapes:
            t0 = time.perf_counter()
            before = min(step_ms({}) for _ in range(2))
            timed = sorted((step_ms({(N, K): cfg}), cfg) for cfg in _configs(N, K, clusters))
            if timed[0][0] < 0.997 * before:
                kept[(N, K)] = timed[0][1]
            if json_path is not None:
                line = dict(gpu=gpu, model=label, batch=batch, context=context, N=N, K=K, before_ms=before,
                            kept=kept.get((N, K)), ms={cfg: ms for ms, cfg in timed},
                            others={f"{n},{k}": c for (n, k), c in kept.items() if (n, k) != (N, K)})
                with open(json_path, "a") as f:
                    f.write(json.dumps(line) + "\n")
            best = ", ".join(f"({cfg}) {ms:.4f}" for ms, cfg in timed[:5])
            print(f"  {N}x{K}: step {before:.4f} ms as it was; best {best}; kept: {kept.get((N, K), '-')}"
                  f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        print(f"  all kept: {ENV}=\"{';'.join(f'{n},{k}:{c}' for (n, k), c in kept.items())}\": step "
              f"{min(step_ms({}) for _ in range(3)):.4f} ms", flush=True)
    finally:
        os.environ.pop(ENV, None)
    return kept


def live_plans(model, batch: int, context: int) -> dict:
    """The engine picks each product's plan above 8 rows from graphs of that product alone, checks
    the whole step with every row dead, then refines the plans with rows that read the cache but
    append nothing (CudaGraphRunner._refine_plans). This measures the choice as the step really
    runs: with the engine's plans, then with each product's plan forced in turn to each of PLANS'
    wide plans (the others as chosen), the step replayed with live rows at `context` (appends,
    RoPE and all). Prints each and returns {"as chosen": ms, (product, plan): ms}."""
    from decodex.engine import WIDE_PLANS, plans_at

    runner = make_runner(model, batch, context)
    load_rows(runner, batch, context)
    n = runner.capture(batch)
    chosen = {k: v for k, v in runner.linear_plan.items() if k[0] == n}
    out = {"as chosen": min(live_step_ms(runner, batch, context) for _ in range(2))}
    print(f"  chosen: {', '.join(f'{k[1]} {v}' for k, v in chosen.items())}; step {out['as chosen']:.4f} ms",
          flush=True)
    for _, name in chosen:
        for plan in plans_at(WIDE_PLANS, n):
            runner.linear_plan.update(chosen)
            runner.linear_plan[(n, name)] = plan
            out[(name, plan)] = live_step_ms(runner, batch, context)
            print(f"  {name} {plan}: step {out[(name, plan)]:.4f} ms", flush=True)
    runner.linear_plan.update(chosen)
    return out


def ab_step(model, batch: int, context: int, variants: list[dict], reps: int = AB_REPS, plans=None,
            fuse_rope: bool = True, forced=None) -> dict:
    """The step under environment variants (--ab), against the environment as found ("as is"): one
    runner, its graph recaptured for every timing, so variables read at capture or at launch
    (DECODEX_GEMV_CONFIG, DECODEX_ATTN_CLUSTER, ...) take effect, while ones read once per process
    (DECODEX_PDL, which parse_ab refuses) do not. The variants run interleaved, `reps` rounds, every
    other round in reverse order (so a drift within a round does not always favour the same one),
    and the environment is restored after every timing. The runner sizes its attention workspace
    once, for the splits as found, so a variant may use fewer splits but not more: time 4-warp
    against wide split blocks as `DECODEX_ATTN_WIDE=0 python -m bench.decode --ab
    DECODEX_ATTN_WIDE=1` (the other way round the engine stops at its workspace check). plans,
    fuse_rope, forced: make_runner's (the table's --plans, --no-fused-rope, --force-plans). Prints
    each timing and the medians; returns {label: [ms, ...]}."""
    runner = make_runner(model, batch, context, plans, fuse_rope, forced)
    labels = ["as is"] + [" ".join(f"{k}={v}" for k, v in var.items()) for var in variants]
    times: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        order = list(zip(labels, [{}, *variants]))
        for label, var in order if rep % 2 == 0 else order[::-1]:
            saved = {k: os.environ.get(k) for k in var}
            os.environ.update(var)
            try:
                ms = live_step_ms(runner, batch, context)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            times[label].append(ms)
            print(f"  round {rep}, {label}: {ms:.4f} ms", flush=True)
    base = statistics.median(times["as is"])
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"  {label}: median {med:.4f} ms (min {min(ts):.4f}), {100.0 * (med / base - 1.0):+.2f}% "
              f"against as is", flush=True)
    return times


def parse_ab(text: str) -> dict:
    """One --ab variant: NAME=VALUE items separated by spaces (values may hold commas and semicolons,
    as DECODEX_GEMV_CONFIG's do)."""
    variant = {}
    for item in text.split():
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"NAME=VALUE items separated by spaces, got {item!r} in {text!r}")
        if name in READ_ONCE_ENV:
            raise ValueError(f"{name} is read once per process (csrc/common.h), so an --ab variant cannot "
                             f"switch it: run the benchmark once with it and once without")
        variant[name] = value
    if not variant:
        raise ValueError("an empty variant")
    return variant


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"1x1024,64x1k" -> [(1, 1024), (64, 1024)]; a ValueError names the item it cannot read."""
    cases = []
    for part in text.split(","):
        b, _, c = part.lower().partition("x")
        k = c.endswith("k")
        try:
            batch, context = int(b), int(c[:-1] if k else c) * (1024 if k else 1)
        except ValueError:
            raise ValueError(f"BATCHxCONTEXT items such as 1x1024 or 64x1k, got {part!r}") from None
        if batch < 1 or context < 1:
            raise ValueError(f"batch and context must be >= 1, got {part!r}")
        cases.append((batch, context))
    return cases


def rows(args=None) -> list[list]:
    """Runs the benchmark; returns the table rows (also printed)."""
    args = args or parse_args([])
    bw = read_bandwidth_gbs()
    print(f"read bandwidth measured now: {bw:.0f} GB/s", flush=True)
    out_rows = []
    compile_budget_left = args.hf_compile_budget_s
    for mi, key in enumerate(args.models):
        label = MODELS[key]["name"]
        t0 = time.perf_counter()
        model = build_decodex(key)
        print(f"{label}: {weight_bytes(model) / 1e9:.2f} GB of weights read per step at batch 1 (built in "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        results = {}
        for batch, context in args.cases:
            try:
                r = decodex_case(model, batch, context, args.plans, args.fuse_rope, args.force_plans)
                nbytes = weight_bytes(model, batch) + kv_bytes(model, batch, context + TIMED_CONTEXT)
                floor = nbytes / (bw * 1e9) * 1e3
                r["floor_ms"] = floor
                results[(batch, context)] = r
                extra = f", plan for {batch} rows: {r['plan']}" if r["plan"] else ""
                print(f"  {label} b{batch} ctx{context}: GPU {r['gpu_ms']:.3f} ms, wall {r['wall_ms']:.3f} ms, "
                      f"floor {floor:.3f} ms{extra}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the other cases
                traceback.print_exc()
                results[(batch, context)] = dict(error=_err(e))
        try:
            print(f"  {label}: time to first token, 1024-token prompt: {time_to_first_token(model):.1f} ms",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {label}: time to first token failed: {_err(e)}")
        if args.profile:
            for batch, context in args.profile_cases:
                try:
                    profile_step(model, context, batch, forced=args.force_plans, name=label)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    print(f"profile of batch {batch} at {context} failed: {_err(e)}")
        del model
        gc.collect()
        torch.cuda.empty_cache()

        hf = {case: {} for case in args.cases}
        if args.hf:
            try:
                hf_model, cfg = build_hf(key)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                hf_model, cfg = None, None
                for case in args.cases:
                    hf[case] = dict(eager=_err(e), compiled=_err(e))
            if hf_model is not None:
                for case in args.cases:
                    try:
                        hf[case]["eager"] = hf_eager(hf_model, cfg, *case)
                        print(f"  HF eager {label} b{case[0]} ctx{case[1]}: {hf[case]['eager']}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        hf[case]["eager"] = _err(e)
                # This model's share of what is left of the compile budget.
                share = compile_budget_left / (len(args.models) - mi)
                spent = 0.0
                for case in args.cases:  # CASES order = priority order
                    if not args.compile:
                        hf[case]["compiled"] = "skipped (--no-compile)"
                        continue
                    if spent >= share:
                        hf[case]["compiled"] = "skipped (budget)"
                        continue
                    t = time.perf_counter()
                    try:
                        hf[case]["compiled"] = hf_compiled(hf_model, cfg, *case)
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        hf[case]["compiled"] = _err(e)
                    took = time.perf_counter() - t
                    spent += took
                    print(f"  HF compiled {label} b{case[0]} ctx{case[1]}: {hf[case]['compiled']} "
                          f"(compile + timing {took:.0f} s)", flush=True)
                compile_budget_left -= spent
                torch._dynamo.reset()
                del hf_model
                gc.collect()
                torch.cuda.empty_cache()

        for batch, context in args.cases:
            r, h = results[(batch, context)], hf[(batch, context)]
            eager, comp = h.get("eager", "-"), h.get("compiled", "-")
            if "error" in r:
                out_rows.append([label, batch, context, r["error"], "", "", "", "", eager, comp, ""])
                continue
            ratio = f"{comp / r['gpu_ms']:.2f}x" if isinstance(comp, float) else ""
            out_rows.append([label, batch, context, r["gpu_ms"], r["wall_ms"], batch * 1000.0 / r["wall_ms"],
                             r["floor_ms"], 100.0 * r["floor_ms"] / r["gpu_ms"], eager, comp, ratio])
    print_table(f"decode step, random weights at real shapes (read bandwidth {bw:.0f} GB/s)", HEADERS, out_rows,
                file=args.out)
    return out_rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="1.5b,7b", help="comma list of: " + ", ".join(MODELS))
    p.add_argument("--cases", default=None, help="comma list of BATCHxCONTEXT, e.g. 1x1024,1x32k,64x1k")
    p.add_argument("--quick", action="store_true", help="1.5B, 3 cases, no HF")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip transformers+torch.compile")
    p.add_argument("--hf-compile-budget-s", type=float, default=200.0,
                   help="seconds for torch.compile cases over all models (default 200)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel breakdown of each model's step (batch 1 at 1K and 32K, batch 64 at 1K)")
    p.add_argument("--profile-cases", default=None,
                   help="with --profile: these BATCHxCONTEXT cases instead, e.g. 1x1024")
    p.add_argument("--sweep-gemv", action="store_true",
                   help="instead of the table: choose each GEMV shape's configuration inside the step "
                        "(per model and case; batch <= 8, no HF)")
    p.add_argument("--live-plans", action="store_true",
                   help="instead of the table: each product's plan above 8 rows forced in turn, the "
                        "step timed with live rows (per model and case; batch > 8, no HF)")
    p.add_argument("--plans", default=None,
                   help="the ways a product may run above 8 rows, comma list of cublas, cublaslt, gemv, gemv8 "
                        "(cublas required; default all), e.g. cublas,gemv8 for the step without the "
                        "wide gemv")
    p.add_argument("--no-fused-rope", dest="fuse_rope", action="store_false",
                   help="above 8 rows, run rope_append and decode_attention as two kernels instead of "
                        "rope_append_attention (the engine's fuse_rope_attention=False)")
    p.add_argument("--force-plans", default=None,
                   help="above 8 rows, run these products' plans without measuring them and the others "
                        "on cuBLAS, e.g. gate_up=gemv,o=gemv (the table, --profile and --ab; for looking at a "
                        "plan inside the step)")
    p.add_argument("--sweep-shapes", default=None,
                   help="with --sweep-gemv: only these weight shapes, comma list of NxK (e.g. 37888x3584)")
    p.add_argument("--sweep-json", default=None, metavar="PATH",
                   help="with --sweep-gemv: also append every configuration's step time to PATH, one JSON "
                        "line a shape")
    p.add_argument("--rms-in-gemv", default=None,
                   help="with --sweep-gemv: the norms inside the GEMVs, forced (qkv+gate_up or qkv)")
    p.add_argument("--ab", action="append", default=None, metavar="NAME=VALUE[ NAME=VALUE...]",
                   help="instead of the table: the step timed with these environment variables set, "
                        "against the environment as found, interleaved (repeat for more variants; per "
                        "model and case, default cases " + ",".join(f"{b}x{c}" for b, c in AB_CASES) + ")")
    p.add_argument("--ab-reps", type=int, default=AB_REPS, help=f"with --ab: rounds (default {AB_REPS})")
    p.add_argument("--out", default=None, help="append the table (markdown) to this file")
    args = p.parse_args(argv)
    if sum(bool(x) for x in (args.sweep_gemv, args.live_plans, args.ab)) > 1:
        p.error("--sweep-gemv, --live-plans and --ab are separate runs: give one")
    if args.ab:
        try:
            args.ab = [parse_ab(v) for v in args.ab]
        except ValueError as e:
            p.error(f"--ab: {e}")
        if len({tuple(v.items()) for v in args.ab}) < len(args.ab):
            p.error("--ab: the same variant twice")
        if args.ab_reps < 1:
            p.error(f"--ab-reps must be >= 1, got {args.ab_reps}")
        if args.profile:
            p.error("--profile goes with the table, not --ab")
    if args.force_plans is not None:
        if args.sweep_gemv or args.live_plans:
            p.error("--force-plans goes with the table and --profile, not --sweep-gemv / --live-plans")
        try:
            args.force_plans = parse_forced(args.force_plans)
        except ValueError as e:
            p.error(f"--force-plans: {e}")
    if args.plans is not None:
        from decodex.engine import check_plans

        try:
            args.plans = check_plans(x.strip() for x in args.plans.split(",") if x.strip())
        except ValueError as e:
            p.error(f"--plans: {e}")
    if args.quick:
        args.models, args.hf = "1.5b", False
        args.cases = args.cases or ",".join(f"{b}x{c}" for b, c in QUICK_CASES)
    args.models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if (args.sweep_shapes or args.rms_in_gemv or args.sweep_json) and not args.sweep_gemv:
        p.error("--sweep-shapes, --rms-in-gemv and --sweep-json go with --sweep-gemv")
    if args.sweep_shapes:
        try:
            args.sweep_shapes = [tuple(int(v) for v in x.lower().split("x")) for x in args.sweep_shapes.split(",")]
        except ValueError:
            p.error(f"--sweep-shapes: NxK items, got {args.sweep_shapes!r}")
        if not all(len(t) == 2 for t in args.sweep_shapes):
            p.error(f"--sweep-shapes: NxK items, got {args.sweep_shapes}")
    if args.rms_in_gemv:
        from decodex.engine import RMS_CHOICES

        choice = tuple(args.rms_in_gemv.split("+"))
        if choice not in RMS_CHOICES:
            p.error(f"--rms-in-gemv: one of {', '.join('+'.join(c) for c in RMS_CHOICES)}, got {args.rms_in_gemv!r}")
        args.rms_in_gemv = choice
    default = (SWEEP_CASES if args.sweep_gemv else LIVE_PLAN_CASES if args.live_plans
               else AB_CASES if args.ab else CASES)
    if args.profile_cases is not None and not args.profile:
        p.error("--profile-cases goes with --profile")

    def cases_arg(flag, given, fallback):
        try:
            return parse_cases(given) if given else list(fallback)
        except ValueError as e:
            p.error(f"{flag}: {e}")

    args.cases = cases_arg("--cases", args.cases, default)
    args.profile_cases = cases_arg("--profile-cases", args.profile_cases, PROFILE_CASES)
    if args.sweep_gemv and any(b > GEMV_MAX_ROWS for b, _ in args.cases):
        p.error(f"--sweep-gemv tunes the GEMV of at most {GEMV_MAX_ROWS} rows; got cases {args.cases}")
    if args.live_plans and any(b <= GEMV_MAX_ROWS for b, _ in args.cases):
        p.error(f"--live-plans needs cases of more than {GEMV_MAX_ROWS} rows (below, every product is "
                f"decodex's fused GEMV); got cases {args.cases}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    require_gpu()
    t0 = time.perf_counter()
    if args.sweep_gemv or args.live_plans or args.ab:
        for key in args.models:
            model = build_decodex(key)
            for batch, context in args.cases:
                what = ("in-step GEMV sweep" if args.sweep_gemv else "products' plans, live rows"
                        if args.live_plans else "environment A/B, GPU ms a step")
                print(f"{MODELS[key]['name']} b{batch} ctx{context}: {what}", flush=True)
                if args.sweep_gemv:
                    sweep_gemv(model, batch, context, args.sweep_shapes, args.rms_in_gemv, args.sweep_json,
                               MODELS[key]["name"])
                elif args.live_plans:
                    live_plans(model, batch, context)
                else:
                    ab_step(model, batch, context, args.ab, args.ab_reps, args.plans, args.fuse_rope,
                            args.force_plans)
                gc.collect()
                torch.cuda.empty_cache()
            del model
            gc.collect()
            torch.cuda.empty_cache()
    else:
        rows(args)
    print(f"bench.decode took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
