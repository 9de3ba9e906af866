"""CudaGraphRunner: the fast GPU decode path (the Runner of decodex/generate.py on CUDA).

One decode step for a batch of rows is a fixed sequence of kernels on preallocated buffers:

    embed (into the residual) -> per layer [gemv_rope_append (the qkv gemv (+bias) of the residual,
    RMS-normalised inside the GEMV (rms_eps); RoPE and the cache append at the device-side position
    in its epilogue) -> decode_attention (over the device-side length) -> o gemv adding into the
    residual (accumulate) -> gemv_silu_mul (the gate|up gemv of the RMS-normalised residual, SiLU*up
    in its epilogue) -> down gemv adding into the residual] -> rms_norm (final norm) -> lm_head gemv
    -> argmax | sample -> advance_positions

captured once per (graph batch size, greedy) into a CUDA graph and replayed. Positions and lengths
live on the device and advance inside the graph, so a graph captured at one context length serves
every later one; the host never syncs per token.

Rows and graph sizes: sequence state lives in rows 0..max_batch-1 of every buffer (row == KV-cache
slot). A step over the rows 0..n-1 runs in the smallest graph size >= n from GRAPH_SIZES (capped by
max_batch), on the first n rows of the same buffers. A dead row has positions = -1 and lengths = 0:
rope_append writes nothing for it and decode_attention does no work for it, so dead rows cost only
their (weight-bound, hence almost free) share of the GEMVs.

Matrix products: decodex's fused GEMVs (rms_eps, gemv_rope_append, gemv_silu_mul) take at most 8
rows, and gemv_silu_mul up to 64 where its wgmma kernel runs (sm_90a build, cc 9.0 device); the
plain gemv takes up to 64. For graphs of more than 8 rows each weight shape uses whichever of five
plans was fastest when timed once, at that graph's first capture, over all layers' weights of that
shape (L2-cold): "cublas" (one torch.mm over all rows), "cublaslt" (the same with torch's preferred
BLAS library set to cuBLASLt for the call), "lt_linear" (decodex.lt_linear: cuBLASLt with the
fastest of its candidate algorithms, each timed the same way), "gemv" (one decodex.gemv over all
rows, up to 64) and "gemv8" (the fused GEMVs over 8-row chunks). For qkv and gate|up the first four
are a product then rope_append / silu_mul, which scale it by 1/rms(residual); except the "gemv"
plan's gate|up above WGMMA_MIN_ROWS rows where gemv_silu_mul takes them: one gemv_silu_mul with
rms_eps, product, scale and activation in one wgmma kernel. The plans so chosen are then kept only
if the whole step replays faster with them than with every product on cuBLAS, both timed with every
row dead; last, each product's other plans are tried in turn with the rows reading the cache
(attention at work, nothing appended), and a change is kept where the step gains (_refine_plans).
After a wide qkv product (cuBLAS, lt_linear or the wide gemv), rope_append's work (the 1/rms scale,
the bias, RoPE and the cache append) runs inside the attention kernel, rope_append_attention, where
the attention has at least 2 splits per (row, KV head); otherwise rope_append runs as its own kernel
before decode_attention (_fused_rope_attention). Qwen3 (per-head q and k norms, which the gemv's
epilogue does not apply) takes a plain qkv gemv where the other models take gemv_rope_append, then
rope_append_attention with q_norm / k_norm where the attention has at least 2 splits, else
rope_append with them.

Host loop (run): prefill each sequence into a free row, then replay steps; after each replay (and
each prefill) the tokens buffer is copied into the next slot of a pinned host ring with
non_blocking=True and an event is recorded. The host reads a slot only once its event has
completed, keeping up to `depth` entries in flight, so the GPU always has queued work. EOS, max
tokens and stop() are seen on the host as tokens arrive; a finished row is deactivated on the
device by queued fill_ kernels (positions = -1, lengths = 0) before the next replay. The steps
already in flight produce extra tokens for it, which the host discards. A freed row takes the next
waiting prompt (continuous batching). Max tokens and cache capacity are known in advance, so a row
is deactivated right after the last step it needs is queued: no replay ever puts a live row at a
position >= capacity.

Choices, and why:
- The GEMVs are launched with prefetch_weight=True: nothing in the graph writes a weight, so each
  GEMV loads its first weights while the kernel ahead is still running (bench/RESULTS.md, session 3).
- Row state is changed with fill_ kernels on the runner's stream (the value travels in the launch)
  rather than copies from pinned staging memory: no staging buffer can be overwritten by the host
  before its copy ran, and the change is ordered before the next replay by the stream.
- Two graphs per size, greedy (argmax) and sampling (sample, whose temperature-0 rows take the
  argmax too): the greedy graph is used whenever every live row is greedy, so plain decoding never
  pays for the sampling kernel's histogram pass. Each is captured only if used.
- The residual adds live in the o and down GEMVs (accumulate), and a layer's two norms in the qkv
  and gate|up GEMVs (rms_eps; the model folded their weights into those products) where that
  measured faster at the graph's first capture (RMS_CHOICES): each kernel boundary is a launch gap
  and a round trip to memory, so a layer is 6 kernels (4 GEMVs, the attention's two) or 7. A norm
  not in a GEMV is an rms_norm kernel of unit weight into `hidden`. Where a product runs on cuBLAS
  (graphs of more than 8 rows), o and down add into the residual in place (addmm_, beta = 1; with a
  bias their output waits in `delta` and the next norm is a fused_add_rms_norm kernel), and the
  qkv and gate|up GEMMs read the residual itself: rope_append (which then also adds the qkv bias)
  and silu_mul scale their rows by 1/rms(residual), so the norms cost no kernel there either.
- First layer: the embedding is gathered straight into the residual buffer, where the eager
  model's residual starts too.
- Qwen2.5-1.5B's gate|up and down products at one row let the next kernel launch only late in
  their main loop (the GEMV ops' launch_dependents_after, DEPENDENTS_AFTER), so that its loads
  before its wait fill their drain instead of competing with their first loads.
- A GEMV's best configuration depends on the kernels around it. Where the attention merges its
  splits in a second kernel (caches of more than about 2K tokens) graphs of as many rows as an
  entry of LONG_CACHE_GEMV serves (1 or 2) give the product of its shape the configuration
  measured best there (the GEMV ops' `config`); on short caches each GEMV keeps its own table's
  choice.
- Warm-up before capture runs the step with every row dead (state saved and restored), so a
  capture in the middle of a generation changes nothing.

Sampling draws: the token generated after consuming the token at position p is drawn with
u = uniform(seed, p) (`sample` gets positions before advance_positions); the first token, from
the prefill logits of the last prompt token, uses p = T - 1.

Shapes: B rows, n graph rows, Hd hidden, H / Hkv heads, D head dim, I intermediate, V vocab,
S cache capacity, T prompt tokens.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from decodex import _ext, reference
# GEMV_MAX_ROWS: rows of x of the fused GEMVs and of rms_eps
from decodex.model import GEMV_MAX_ROWS, check_token_ids

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Which products' GEMVs RMS-normalise their own input (rms_eps), tried per graph size of at most 8
# rows at its first capture, every row reading the cache (_reading_rows); the fastest step is kept.
# Qwen2.5-1.5B keeps both, Qwen2.5-7B only qkv: its gate|up GEMV with the norm measures slower than
# an rms_norm kernel before it (bench/RESULTS.md, sessions 5 and 18).
RMS_CHOICES = (("qkv", "gate_up"), ("qkv",))
DEFAULT_DEPTH = 3  # decode steps / prefills in flight before the host waits for the oldest
# How a product runs in a graph of more than 8 rows (_plan); the first four compute the product
# alone. "cublaslt" is "cublas" (torch.mm / addmm_) with torch's preferred BLAS library set to
# cuBLASLt while the call is made and captured (blas_library): other kernels for some shapes, e.g.
# the 7B down projection at 64 rows, 37.5 us against 41.4 (bench/RESULTS.md, session 15; bench.gemv's
# "cuBLASLt us" column times it). "lt_linear" is decodex.lt_linear with the fastest of its cuBLASLt
# candidates for that product, each timed over the layers like a plan (_time_lt_linear): torch
# takes the heuristic's first answer, and at 64 rows the 1.5B gate|up product's best candidate took
# 17.7 us against cuBLAS's 20.1 (bench.lt_linear; bench/RESULTS.md, session 17).
PLANS = ("cublas", "cublaslt", "lt_linear", "gemv", "gemv8")
WIDE_PLANS = ("cublas", "cublaslt", "lt_linear", "gemv")
BLAS_PLANS = ("cublas", "cublaslt", "lt_linear")  # cuBLAS(Lt) products, torch's or lt_linear's
LT_WORKSPACE_BYTES = 32 << 20  # lt_linear's workspace (its split-K candidates' fp32 partials)
WIDE_GEMV_MAX_ROWS = 64  # decodex.gemv's limit on the rows of x (without rms_eps)
# Above this many rows decodex.gemv runs its wgmma kernel where there is one (csrc/gemv.h's
# kWgmmaMinRows), and the "gemv" plan's gate|up is one gemv_silu_mul; up to it, gemv then silu_mul.
WGMMA_MIN_ROWS = 16
PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
# The plans above 8 rows are refined with rows that read this many cache tokens (at most the
# capacity; nothing is appended) and kept only where a change wins by PLAN_MARGIN (_refine_plans).
PLAN_CONTEXT = 1024
PLAN_MARGIN = 0.005
# GEMV configurations [wr, wk, c, u] (csrc/gemv.cu) that the products of small graphs launch (the
# GEMV ops' `config`) where the attention merges its splits in the combine kernel (more than
# CLUSTER_SPLITS splits: caches of more than about 2K tokens), keyed by weight shape [N, K]: (the
# configuration, the most rows of a graph it serves); elsewhere each GEMV takes its own table's
# choice. Found by the in-step sweep (bench.decode --sweep-gemv) and timed in the step
# (bench/RESULTS.md): Qwen2.5-1.5B's qkv and gate|up (session 29), at batch 1 1.9% faster at 8K,
# 1.3% at 16K and 0.9% at 32K, at batch 2 0.6% at 32K, at batch 4 no faster, 2.1% slower at 1K,
# where the splits merge in a cluster; Qwen2.5-7B's gate|up (session 30), at batch 1 0.5% faster at
# 8K and 0.5-1.0% at 32K (two runs), at batch 2 0.8% slower at 8K, at 1K 1.7% slower. Swept again
# at 32K on the wide split blocks (session 53, H100): other entries won there, but on that
# H100 only. Swept at 32K on an H200 (session 54), whose timings the table follows: the 1.5B
# gate|up back to (4, 1, 2, 4) with a down entry (2, 3, 4, 8), together 1.2% faster than session
# 53's entries at batch 1 on 8K and 32K and at batch 2 on 32K; the 7B gate|up back to (1, 4, 1, 8)
# with down (1, 7, 1, 8) and qkv (2, 2, 4, 4), together 2.8% faster at batch 1 on 32K and 2.2% on 8K
# (2.2% slower at batch 2 on 32K, so they serve one row).
LONG_CACHE_GEMV = {
    (2048, 1536): ((1, 6, 1, 4), 2),
    (17920, 1536): ((4, 1, 2, 4), 2),
    (1536, 8960): ((2, 3, 4, 8), 2),
    (37888, 3584): ((1, 4, 1, 8), 1),
    (3584, 18944): ((1, 7, 1, 8), 1),
    (4608, 3584): ((2, 2, 4, 4), 1),
}
CLUSTER_SPLITS = 8  # csrc/decode_attention.cu's kClusterSplits: more splits take the combine kernel
# The GEMV ops' launch_dependents_after (csrc/gemv.h) for products of graphs of one row, keyed by
# weight shape [N, K]: (the percentage on short caches, on caches whose attention merges in the
# combine kernel, as LONG_CACHE_GEMV). The next kernel then launches late in the product's main
# loop, so that its loads before its wait (prefetch_weight) come as the product drains, not
# beside its first loads. Qwen2.5-1.5B's gate|up and down, percentages from A/Bs on an H100
# (bench/RESULTS.md, session 57): against the same step without them 0.9% faster at 1K, 1.4% at
# 8K, 1.3% at 16K, 1.0% at 32K. The 7B's gate|up was 0.4-0.6% slower at 50-80 and its down
# unchanged, Llama-3.2-1B's step 1.5% slower: none for them. Nor for Qwen2.5-0.5B's, -3B's and
# Qwen3-1.7B's gate|up and down (1-3% slower), or the 1.5B's qkv (1.6% slower at 32K) and LM head
# (unchanged) (session 58).
DEPENDENTS_AFTER = {
    (17920, 1536): (80, 80),
    (1536, 8960): (50, 80),
}
# The o product lets the kernel after it (gate|up) launch before its own wait (the GEMV ops'
# launch_dependents_early; session 55: on an H100 the 1.5B step 0.7-1.8% faster at 1K-32K), except
# at one row on caches whose attention merges in the combine kernel for these weight shapes [N, K].
# Qwen2.5-1.5B's o: on an H200, whose timings the bars are, its step there was 0.5-1.7% faster
# without the early launch at 4K-32K (one of three runs at 4K unchanged), but 3.1% slower at 1K and
# 0.7% at two rows on 32K; the 7B's step did not move either way (bench/RESULTS.md, session 60).
O_LATE_ON_LONG_CACHE = {(1536, 1536)}


def check_plans(plans) -> tuple[str, ...]:
    """The plans a runner measures per product above 8 rows (CudaGraphRunner's `plans`): a subset
    of PLANS holding "cublas", the fallback and the whole-step check's baseline."""
    plans = tuple(plans)
    if "cublas" not in plans or not set(plans) <= set(PLANS):
        raise ValueError(f"plans must be a subset of {PLANS} that includes 'cublas', got {plans}")
    return plans


def plans_at(plans, n: int) -> list[str]:
    """Those of `plans` a graph of n rows can run: the wide gemv takes at most WIDE_GEMV_MAX_ROWS."""
    return [p for p in plans if p != "gemv" or n <= WIDE_GEMV_MAX_ROWS]


@contextlib.contextmanager
def blas_library(plan: str):
    """torch's preferred BLAS library for the calls of a cuBLAS plan: cuBLASLt for "cublaslt"
    (restored after); "cublas" leaves it as it is."""
    if plan != "cublaslt":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def graph_sizes(max_batch: int) -> tuple[int, ...]:
    """The graph batch sizes for a runner of max_batch rows: GRAPH_SIZES below it, then max_batch."""
    return tuple(s for s in GRAPH_SIZES if s < max_batch) + (max_batch,)



@dataclass
class _Seq:
    """Host-side state of one sequence of run()."""

    index: int
    params: object
    max_new: int
    prompt: list[int] | None = None  # None: the cache was filled by the caller (run_loaded)
    context: int = 0  # tokens already in the cache when decoding starts (len(prompt) or given)
    first_token: int | None = None  # run_loaded only
    fixed_row: int | None = None  # run_loaded: the row whose cache the caller filled
    planned: int = 0  # tokens this sequence will produce at most (max_new, capped by capacity)
    row: int = -1
    enqueued: int = 0  # tokens produced by the work queued so far (prefill counts one)
    received: int = 0  # tokens that reached the host and were yielded
    pos: int = 0  # position of the token the next queued step consumes
    device_live: bool = False  # its row advances in the queued steps
    done: bool = False  # the host wants no more of its tokens
    t_first: float | None = None  # seconds from run() start to its first token on the host

    @property
    def greedy(self) -> bool:
        return float(getattr(self.params, "temperature", 0.0) or 0.0) <= 0.0


@dataclass
class _Entry:
    """One queued copy of the tokens buffer into ring slot `slot`; rows maps row -> sequence."""

    slot: int
    handle: object
    rows: list[tuple[int, _Seq]]
    decode: bool


@dataclass
class RunStats:
    """What the last run() measured on the host."""

    ttft_s: dict[int, float] = field(default_factory=dict)  # sequence index -> time to first token
    decode_steps: int = 0
    graph_steps: dict[int, int] = field(default_factory=dict)  # graph size -> replays
    tokens: int = 0
    decode_wall_s: float = 0.0  # from the first decode replay queued to the last token received
    wall_s: float = 0.0

    def ms_per_step(self) -> float:
        return 1000.0 * self.decode_wall_s / max(self.decode_steps, 1)


class HostLoop:
    """The Runner's host loop over an abstract device (the `_dev_*` methods), so the scheduling
    logic can be tested on a CPU with a fake device (tests/test_engine.py)."""

    def __init__(self, max_batch: int, capacity: int, depth: int = DEFAULT_DEPTH, ring: int | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.max_batch = max_batch
        self.capacity = capacity  # positions 0..capacity-1 can be cached
        self.depth = depth
        self.ring_size = ring if ring is not None else depth + 1
        if self.ring_size < depth:
            raise ValueError(f"ring ({self.ring_size}) must hold at least depth ({depth}) entries")
        self.sizes = graph_sizes(max_batch)
        self.eos_ids: set[int] = set()
        self.stats = RunStats()
        self._seqs: dict[int, _Seq] = {}
        self._rows: list[_Seq | None] = [None] * max_batch
        self._running = False

    # ---- the device interface (CudaGraphRunner implements it) ------------------------------------

    def _dev_reset(self) -> None:  # every row dead
        raise NotImplementedError

    def _dev_prefill(self, row: int, prompt: list[int], params, live: bool) -> None:
        """Prefill `prompt` into cache slot `row`, put its first token in tokens[row]; the row then
        consumes that token at position len(prompt) if `live`, else it is dead."""
        raise NotImplementedError

    def _dev_load(self, row: int, context: int, token: int, params, live: bool) -> None:
        """The cache of slot `row` already holds `context` tokens: the row consumes `token` next."""
        raise NotImplementedError

    def _dev_deactivate(self, row: int) -> None:
        raise NotImplementedError

    def _dev_step(self, n: int, greedy: bool) -> None:  # one decode step over rows 0..n-1
        raise NotImplementedError

    def _dev_publish(self, slot: int):  # queue tokens -> ring[slot]; returns a handle
        raise NotImplementedError

    def _dev_ready(self, handle) -> bool:
        raise NotImplementedError

    def _dev_wait(self, handle) -> None:
        raise NotImplementedError

    def _dev_read(self, slot: int) -> list[int]:  # ring[slot], max_batch token ids
        raise NotImplementedError

    def _dev_drain(self) -> None:  # wait for all queued work (after an abort)
        raise NotImplementedError

    # ---- the Runner protocol ---------------------------------------------------------------------

    def run(self, prompts: list[list[int]], params: list, max_new_tokens: list[int]):
        """Prefills every prompt, then decodes; yields lists of (sequence index, token id) as tokens
        reach the host. A sequence stops after max_new_tokens, on an EOS id (which is yielded), when
        the cache is full, or after stop(i)."""
        if not (len(prompts) == len(params) == len(max_new_tokens)):
            raise ValueError(f"prompts ({len(prompts)}), params ({len(params)}) and max_new_tokens "
                             f"({len(max_new_tokens)}) must have the same length")
        seqs = []
        for i, (prompt, p, m) in enumerate(zip(prompts, params, max_new_tokens)):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) > self._limit():
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, more than the limit of "
                                 f"{self._limit()} ({self._limit_reason()})")
            seqs.append(_Seq(index=i, params=p, max_new=int(m), prompt=prompt, context=len(prompt)))
        return self._loop(seqs)

    def run_loaded(self, contexts: list[int], first_tokens: list[int], params: list,
                   max_new_tokens: list[int]):
        """Like run(), for sequences whose cache rows the caller already filled (benchmarks):
        sequence i sits in row i with contexts[i] cached tokens and consumes first_tokens[i] next
        (which is yielded as its first token)."""
        # zip below would drop the sequences past the shortest list without a word.
        if not (len(contexts) == len(first_tokens) == len(params) == len(max_new_tokens)):
            raise ValueError(f"contexts ({len(contexts)}), first_tokens ({len(first_tokens)}), params "
                             f"({len(params)}) and max_new_tokens ({len(max_new_tokens)}) must have the "
                             f"same length")
        if len(contexts) > self.max_batch:
            raise ValueError(f"{len(contexts)} loaded sequences exceed max_batch {self.max_batch}")
        seqs = []
        for i, (c, t, p, m) in enumerate(zip(contexts, first_tokens, params, max_new_tokens)):
            if not 0 <= c < self._limit():
                raise ValueError(f"context {c} of sequence {i} must be in [0, {self._limit()})")
            seqs.append(_Seq(index=i, params=p, max_new=int(m), context=int(c), first_token=int(t),
                             fixed_row=i))
        return self._loop(seqs)

    def stop(self, i: int) -> None:
        """The host decided sequence i is done: no more of its tokens are yielded and its row stops
        costing work with the next queued step."""
        s = self._seqs.get(i)
        if s is None or s.done:
            return
        s.done = True
        if s.device_live:
            self._deactivate(s)

    # ---- the loop --------------------------------------------------------------------------------

    def _limit(self) -> int:
        return self.capacity

    def _limit_reason(self) -> str:
        return f"the KV cache capacity of {self.capacity} tokens"

    def _loop(self, seqs: list[_Seq]):
        if self._running:
            raise RuntimeError("this runner is already running a generation (one at a time)")
        self._running = True
        t0 = time.perf_counter()
        self.stats = st = RunStats()
        self._seqs = {s.index: s for s in seqs}
        self._rows = [None] * self.max_batch
        limit = self._limit()
        waiting: deque[_Seq] = deque()
        for s in seqs:
            # Consuming the token at position p writes the cache at p, so positions context ..
            # limit-1 can be consumed: 1 token from the prefill + (limit - context) steps.
            s.planned = max(0, min(s.max_new, limit - s.context + 1))
            if s.planned == 0:
                s.done = True
            else:
                waiting.append(s)
        inflight: deque[_Entry] = deque()
        counter = 0  # entries queued so far; entry k uses ring slot k % ring_size
        t_decode0 = None
        try:
            self._dev_reset()
            while True:
                # 1. The oldest entry if it has arrived, without waiting. One entry per yield: at
                #    most one token per sequence, so stop() after a token is never too late.
                if inflight and self._dev_ready(inflight[0].handle):
                    out = self._harvest(inflight.popleft(), t0)
                    if out:
                        yield out
                    continue
                # 2. The pipeline is full: wait for the oldest entry.
                if len(inflight) >= self.depth:
                    out = self._wait_oldest(inflight, t0)
                    if out:
                        yield out
                    continue
                # 3. A free row and a waiting sequence: prefill it (its first token is an entry).
                while waiting and waiting[0].done:  # stopped before it started
                    waiting.popleft()
                free = self._free_row()
                if waiting and waiting[0].fixed_row is not None:
                    r = waiting[0].fixed_row
                    free = r if self._rows[r] is None else None
                if waiting and free is not None:
                    s = waiting.popleft()
                    self._admit(s, free)
                    slot = counter % self.ring_size
                    inflight.append(_Entry(slot, self._dev_publish(slot), [(free, s)], decode=False))
                    counter += 1
                    if not s.device_live:  # its only token came from the prefill
                        self._rows[free] = None
                    continue
                # 4. A decode step over the live rows.
                live = [s for s in self._rows if s is not None and s.device_live]
                if live:
                    top = max(s.row for s in live) + 1
                    n = next(size for size in self.sizes if size >= top)
                    greedy = all(s.greedy for s in live)
                    for s in live:
                        if s.pos >= limit or s.enqueued >= s.planned:  # never past the cache
                            raise AssertionError(f"row {s.row} at position {s.pos} (limit {limit}), "
                                                 f"{s.enqueued}/{s.planned} tokens queued")
                    self._dev_step(n, greedy)
                    if t_decode0 is None:
                        t_decode0 = time.perf_counter()
                    st.decode_steps += 1
                    st.graph_steps[n] = st.graph_steps.get(n, 0) + 1
                    slot = counter % self.ring_size
                    inflight.append(_Entry(slot, self._dev_publish(slot), [(s.row, s) for s in live],
                                           decode=True))
                    counter += 1
                    for s in live:
                        s.enqueued += 1
                        s.pos += 1
                        if s.enqueued >= s.planned:  # its last token is queued: stop its row now
                            self._deactivate(s)
                    continue
                # 5. Nothing to queue: wait for what is in flight, or finish.
                if inflight:
                    out = self._wait_oldest(inflight, t0)
                    if out:
                        yield out
                    continue
                if waiting:  # no free row can appear without work in flight
                    raise AssertionError("sequences are waiting but no row is free and nothing runs")
                break
            for s in seqs:
                if not s.done:  # every planned token arrived or the sequence stopped
                    raise AssertionError(f"sequence {s.index} ended with {s.received}/{s.planned} tokens")
            if t_decode0 is not None:
                st.decode_wall_s = time.perf_counter() - t_decode0
        finally:
            st.wall_s = time.perf_counter() - t0
            st.ttft_s = {s.index: s.t_first for s in seqs if s.t_first is not None}
            if inflight or any(r is not None for r in self._rows):
                # Abandoned early (consumer stopped iterating, or an error): leave no row live and
                # no copy in flight into the ring.
                try:
                    self._dev_reset()
                    self._dev_drain()
                except Exception:  # noqa: BLE001 - do not hide the original error
                    pass
            self._rows = [None] * self.max_batch
            self._running = False

    def _wait_oldest(self, inflight: deque, t0: float) -> list[tuple[int, int]]:
        """Blocks until the oldest queued entry has reached the host; returns its tokens."""
        e = inflight.popleft()
        self._dev_wait(e.handle)
        return self._harvest(e, t0)

    def _free_row(self) -> int | None:
        for r, s in enumerate(self._rows):
            if s is None:
                return r
        return None

    def _admit(self, s: _Seq, row: int) -> None:
        s.row = row
        s.enqueued = 1
        s.pos = s.context
        s.device_live = s.planned > 1
        self._rows[row] = s
        if s.prompt is not None:
            self._dev_prefill(row, s.prompt, s.params, s.device_live)
        else:
            self._dev_load(row, s.context, s.first_token, s.params, s.device_live)

    def _deactivate(self, s: _Seq) -> None:
        """Stop the row of s on the device (queued before the next step) and free it."""
        if not s.device_live:
            return
        s.device_live = False
        self._dev_deactivate(s.row)
        if self._rows[s.row] is s:
            self._rows[s.row] = None

    def _harvest(self, e: _Entry, t0: float) -> list[tuple[int, int]]:
        """The tokens of one arrived entry, for the sequences still accepting them."""
        tokens = self._dev_read(e.slot)
        out = []
        for row, s in e.rows:
            if s.done:
                continue  # finished while this step was in flight: an extra token, discarded
            tok = int(tokens[row])
            s.received += 1
            self.stats.tokens += 1
            if s.received == 1:
                s.t_first = time.perf_counter() - t0
            out.append((s.index, tok))
            if tok in self.eos_ids or s.received >= s.planned:
                s.done = True
                self._deactivate(s)
        return out


class CudaGraphRunner(HostLoop):
    """The fast decode path: static buffers, one CUDA graph per (batch size, greedy), async tokens.

    runner = CudaGraphRunner(model, max_batch, capacity)
    for tokens in runner.run(prompts, params, max_new_tokens): ...   # the Runner protocol

    Lower-level pieces (tests, benchmarks): reset(), prefill_row(), load_row(), deactivate_row(),
    step(n, greedy), eager_step(), time_steps(), and the buffers tokens / positions / lengths /
    logits [max_batch, ...].
    """

    def __init__(self, model, max_batch: int, capacity: int, depth: int = DEFAULT_DEPTH,
                 plans: tuple[str, ...] = PLANS, fuse_rope_attention: bool = True):
        self.plans = check_plans(plans)  # checked first: a bad argument fails on any machine
        if not _ext.available():
            raise RuntimeError(f"CudaGraphRunner needs the decodex kernels: {_ext.why_unavailable()}")
        if model.device.type != "cuda":
            raise RuntimeError(f"CudaGraphRunner needs a model on a CUDA device, got {model.device}")
        if model.dtype != torch.bfloat16:
            raise RuntimeError(f"CudaGraphRunner runs bf16 models, got {model.dtype}")
        if model.kernels_missing():  # else its step would leave that part out
            raise RuntimeError(f"CudaGraphRunner: decodex has no kernels for {model.kernels_missing()}")
        super().__init__(max_batch, capacity, depth)
        c = model.config
        self.model = model
        self.config = c
        self.device = model.device
        # The ids ReferenceRunner stops on: the tokenizer's / generation_config's when load() set them.
        self.eos_ids = set(getattr(model, "eos_token_ids", None) or c.eos_token_id or [])
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        Hd, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
        self.H, self.Hkv, self.D = H, Hkv, D
        self.eps = float(c.rms_norm_eps)
        self.scale = float(getattr(model, "scale", D ** -0.5))
        B, dev, dt = max_batch, self.device, model.dtype
        self.stream = torch.cuda.Stream(device=dev)  # every queued piece of work runs on it
        self._capture_stream = torch.cuda.Stream(device=dev)

        def zeros(*shape, dtype=dt):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        # Plain tensors even if built under inference_mode (they are updated in place later).
        with torch.cuda.device(dev), torch.inference_mode(False):
            # Sequence state (rows = cache slots).
            self.tokens = zeros(B, dtype=torch.int64)  # [B] the token each row consumes next
            self.positions = torch.full((B,), -1, dtype=torch.int32, device=dev)  # [B] its position
            self.lengths = zeros(B, dtype=torch.int32)  # [B] positions + 1 (0: dead)
            self.temperature = zeros(B, dtype=torch.float32)  # [B] sampling params per row
            self.top_k = zeros(B, dtype=torch.int32)
            self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
            self.seed = zeros(B, dtype=torch.int64)
            self.cache = model.new_cache(B, capacity)  # k/v[layer]: [B, Hkv, S, D]
            # Step intermediates.
            self.residual = zeros(B, Hd)  # [B, Hd] the residual stream
            self.hidden = zeros(B, Hd)  # [B, Hd] the normed residual, for products on cuBLAS and lm_head
            self.delta = zeros(B, Hd)  # [B, Hd] a cuBLAS o / down output, added by the next norm
            self.qkv = zeros(B, (H + 2 * Hkv) * D)  # [B, (H+2Hkv)*D] rows: q | k | v
            self.attn = zeros(B, H * D)  # [B, H*D]
            self.gate_up = zeros(B, 2 * I)  # [B, 2I]
            self.act = zeros(B, I)  # [B, I]
            if c.moe_layers:  # Qwen3-MoE's expert layers: the router's logits, its choice, the activations
                k = c.num_experts_per_tok
                self.router_logits = zeros(B, c.num_experts)  # [B, E]
                self.moe_ids = zeros(B, k, dtype=torch.int32)  # [B, k]
                self.moe_weights = zeros(B, k, dtype=torch.float32)  # [B, k]
                self.moe_act = zeros(B, k, c.moe_intermediate_size)  # [B, k, Ie]
            self.logits = zeros(B, V)  # [B, V] bf16
            # decode_attention scratch: one buffer sized for the largest graph, viewed per size.
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            self._splits = {n: int(torch.ops.decodex.decode_attention_splits(n, Hkv, capacity, sms))
                            for n in self.sizes}
            ws = max(n * H * self._splits[n] * (D + 2) for n in self.sizes)
            self._workspace = torch.empty(ws, dtype=torch.float32, device=dev)
            self._lt_workspace = (torch.empty(LT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
                                  if "lt_linear" in self.plans else None)
            # The rows one gemv_silu_mul takes here: 64 where its wgmma kernel runs, else 8.
            self._silu_rows = int(torch.ops.decodex.gemv_silu_mul_max_rows(torch.cuda.current_device()))
            self._clusters = torch.cuda.get_device_capability(dev)[0] >= 9  # GEMV configs with c > 1
            # Host side: the pinned ring the tokens land in, one event per slot.
            self.ring = torch.zeros(self.ring_size, B, dtype=torch.int64, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(self.ring_size)]
        # The products planned above 8 rows: gate|up and down only where a layer has a dense MLP.
        self.products = tuple(p for p in PRODUCTS if p not in ("gate_up", "down")
                              or any(layer.gate_up_w is not None for layer in model.layers))
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.linear_plan: dict[tuple[int, str], str] = {}  # (n, weight name) -> one of PLANS
        self.linear_times_us: dict[tuple[int, str], dict[str, float]] = {}
        # (n, weight name) -> lt_linear's candidate in use, and what each candidate measured
        self.lt_algo: dict[tuple[int, str], int] = {}
        self.lt_times_us: dict[tuple[int, str], list[float]] = {}
        self._lt_count: dict[tuple[int, str], int] = {}  # candidates, counted while planning
        self._lt_counting = False  # _time_lt_linear's run that only counts them
        self.num_captures = 0
        self._pending_delta = False  # while a step is queued: delta holds a product not yet added
        self.rms_in_gemv: dict[int, tuple[str, ...]] = {}  # graph size -> products normed in their GEMV
        self.rms_times_ms: dict[tuple[int, tuple[str, ...]], float] = {}  # what each choice measured
        # graph size n > 8 -> step ms (dead rows) of the per-product plans and of all-cuBLAS
        self.plan_step_ms: dict[int, dict[str, float]] = {}
        # graph size n > 8 -> step ms with rows reading the cache: "start" (the plans above), then
        # "<product> <plan>" for each change tried (_refine_plans)
        self.plan_refine_ms: dict[int, dict[str, float]] = {}
        # Graphs of more than 8 rows whose qkv product is cuBLAS or the wide gemv: rope_append's work
        # may run inside the attention kernel (_fused_rope_attention); False keeps the two kernels.
        self.fuse_rope_attention = bool(fuse_rope_attention)
        self._host_pos: list[int] = [-1] * B  # for time_steps: positions the caller loaded
        self._join_caller()  # the model's weights and these buffers were written on the caller's stream

    def _join_caller(self) -> None:
        """Work queued on self.stream from now on follows everything the caller queued so far on
        its current stream (weights, a cache it filled). Called where the caller hands over: reset,
        prefill_row, load_row, time_steps; not per step. Reading results back, the caller syncs."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    # ---- the step ---------------------------------------------------------------------------------

    def _views(self, n: int):
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = self.qkv[:n]
        q = qkv[:, : H * D].view(n, H, D)  # row stride (H+2Hkv)*D
        k = qkv[:, H * D: (H + Hkv) * D].view(n, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(n, Hkv, D)
        ws = self._workspace[: n * H * self._splits[n] * (D + 2)].view(n, H, self._splits[n], D + 2)
        return q, k, v, ws

    def _plan(self, n: int, name: str) -> str:
        """How the product `name` runs in a graph of n rows, one of PLANS: "gemv8" (decodex's fused
        GEMVs over 8-row chunks; the only choice up to 8 rows), "gemv" (one plain decodex.gemv over
        all n <= 64 rows), "cublas" or "cublaslt"; the last three leave the norm, RoPE and SiLU to
        the ops after."""
        return "gemv8" if n <= GEMV_MAX_ROWS else self.linear_plan.get((n, name), "cublas")

    def _gemv_rows(self, n: int, name: str) -> list[slice]:
        """The row slices the decodex GEMVs of product `name` take in a graph of n rows: all n at once
        by the "gemv" plan, 8-row chunks otherwise."""
        step = n if self._plan(n, name) == "gemv" else GEMV_MAX_ROWS
        return [slice(r, min(r + step, n)) for r in range(0, n, step)]

    def _normed(self, n: int, name: str, weight=None):
        """The input of product `name`, rms_norm(residual, weight), as (x, rms_eps) for the product:
        (residual, eps) when the norm's weight is folded into the product's (weight None) and its
        GEMV normalises x itself; else (hidden, None) after a norm kernel (fused_add_rms_norm when a
        cuBLAS product still waits in delta; unit weight when folded)."""
        ops = torch.ops.decodex
        residual, hidden = self.residual[:n], self.hidden[:n]
        # Sizes over 8 rows (whose _plan_linears times gemv8 against cuBLAS) take RMS_CHOICES[0].
        if (weight is None and not self._pending_delta and self._plan(n, name) == "gemv8"
                and name in self.rms_in_gemv.get(n, RMS_CHOICES[0])):
            return residual, self.eps
        # cuBLAS or wide-gemv qkv / gate|up: rope_append / silu_mul scale the product by
        # 1/rms(residual) (no norm kernel).
        if weight is None and not self._pending_delta and self._plan(n, name) in WIDE_PLANS:
            return residual, self.eps
        weight = self.model.unit_norm if weight is None else weight
        if self._pending_delta:
            ops.fused_add_rms_norm(self.delta[:n], residual, weight, self.eps, hidden)
            self._pending_delta = False
        else:
            ops.rms_norm(residual, weight, self.eps, hidden)
        return hidden, None

    def _long_cache(self, n: int) -> bool:
        """Whether the attention of a graph of n rows merges its splits in the combine kernel (more
        than CLUSTER_SPLITS splits), where LONG_CACHE_GEMV and the long-cache entries apply."""
        return self._splits[n] > CLUSTER_SPLITS

    def _gemv_config(self, n: int, w) -> list[int] | None:
        """The GEMV ops' `config` for a product of n rows with weight w: LONG_CACHE_GEMV's entry for
        w's shape where it applies (n at most the entry's rows, the attention merging in the combine
        kernel, and clusters on the device if the entry has them), else None (the GEMV's choice)."""
        cfg, rows = LONG_CACHE_GEMV.get(tuple(w.shape), (None, 0))
        if cfg is None or n > rows or not self._long_cache(n):
            return None
        return list(cfg) if cfg[2] == 1 or self._clusters else None

    def _dependents_after(self, n: int, w) -> int:
        """The GEMV ops' launch_dependents_after for a product of n rows with weight w:
        DEPENDENTS_AFTER's entry for w's shape at one row (short or long cache), else 0."""
        short, long = DEPENDENTS_AFTER.get(tuple(w.shape), (0, 0))
        if n != 1:
            return 0
        return long if self._long_cache(n) else short

    def _o_early(self, n: int, w) -> bool:
        """Whether the o product (weight w, n rows) lets the next kernel launch before its own wait:
        yes, but at one row on a long cache (the combine kernel) for O_LATE_ON_LONG_CACHE's shapes."""
        return not (n == 1 and self._long_cache(n) and tuple(w.shape) in O_LATE_ON_LONG_CACHE)

    def _linear(self, n: int, name: str, x, w, b, out, rms_eps=None) -> None:
        """out[n, N] = x[n, K] @ w[N, K]^T (+ b) by the plan of `name`, scaled by 1/rms(x) if
        rms_eps is given (gemv8 only)."""
        if self._plan(n, name) in BLAS_PLANS:
            self._blas(n, name, x, w, b, out, accumulate=False)
            return
        for s in self._gemv_rows(n, name):
            torch.ops.decodex.gemv(x[s], w, b, out[s], prefetch_weight=True, rms_eps=rms_eps,
                                   config=self._gemv_config(n, w))

    def _blas(self, n: int, name: str, x, w, b, out, accumulate: bool) -> None:
        """out (+)= x @ w^T (+ b) by a BLAS plan: torch (cuBLAS, or cuBLASLt by blas_library) or
        lt_linear with the candidate chosen for this product. accumulate (no bias: _add_product
        sends a biased product to delta): beta = 1, the sum rounded once."""
        plan = self._plan(n, name)
        if plan == "lt_linear":
            self._lt_linear(n, name, x, w, b, out, accumulate)
            return
        if accumulate and b is not None:
            raise ValueError(f"_blas: accumulate with a bias is not supported ({name} at {n} rows)")
        with blas_library(plan):
            if accumulate:
                out.addmm_(x, w.t())
            else:
                _cublas_linear(x, w, b, out)

    def _lt_linear(self, n: int, name: str, x, w, b, out, accumulate: bool) -> None:
        """lt_linear with the candidate chosen for product `name`. Before one is chosen, counts the
        candidates (into _lt_count), then returns while _time_lt_linear counts, else runs the
        first (a plan forced untimed, as bench.decode --force-plans does)."""
        key = (n, name)
        algo = self.lt_algo.get(key)
        if algo is None:
            # The list depends on the call's problem, pointer alignments included: the layers'
            # lists could differ in length, so keep the shortest.
            count = int(torch.ops.decodex.lt_linear_algos(x, w, b, out, self._lt_workspace, accumulate))
            count = self._lt_count[key] = min(count, self._lt_count.get(key, count))
            if self._lt_counting:
                return
            if count == 0:
                raise RuntimeError(f"lt_linear: cuBLASLt has no candidate for the {name} product at {n} rows")
            algo = 0
        torch.ops.decodex.lt_linear(x, w, b, out, self._lt_workspace, algo, accumulate)

    def _add_product(self, n: int, name: str, x, w, b) -> None:
        """residual[n] += x @ w^T (+ b): gemv with accumulate (_gemv_rows: 8-row chunks, or all rows
        at once by the "gemv" plan), or a BLAS plan: in place (beta = 1, the sum rounded once)
        without a bias, else into delta, which the next norm adds (_normed)."""
        plan = self._plan(n, name)
        if plan in BLAS_PLANS:
            if b is None:
                self._blas(n, name, x, w, None, self.residual[:n], accumulate=True)
                return
            self._blas(n, name, x, w, b, self.delta[:n], accumulate=False)
            self._pending_delta = True
            return
        # The o product lets the kernel after it (gate|up, loading its first weights before its
        # wait) launch before it waits for the attention, whose merge leaves the memory bus idle
        # (_o_early). The 1.5B down product lets it launch late instead (DEPENDENTS_AFTER).
        residual, early = self.residual[:n], name == "o" and self._o_early(n, w)
        after = 0 if early else self._dependents_after(n, w)
        for s in self._gemv_rows(n, name):
            torch.ops.decodex.gemv(x[s], w, b, residual[s], prefetch_weight=True, accumulate=True,
                                   config=self._gemv_config(n, w), launch_dependents_early=early,
                                   launch_dependents_after=after)

    def _qkv_rope(self, n: int, x, rms_eps, layer, k_cache, v_cache, append: bool = True) -> None:
        """qkv[n] = x @ qkv_w^T (+ qkv_b) (scaled by 1/rms(x) first if rms_eps is given) with q and k
        rotated at the rows' positions, k and v appended to the caches there: gemv_rope_append, or
        a product (cuBLAS, the wide gemv, or a plain gemv where Qwen3's q/k norms must follow) then
        rope_append, or (append False) that product alone, its rows left for rope_append_attention
        (_rope_args says what the rope work after it takes)."""
        m, qkv, positions = self.model, self.qkv[:n], self.positions[:n]
        wide, norms = self._plan(n, "qkv") in WIDE_PLANS, m.head_norms(layer)
        if wide or norms or not append:
            # A wide product reads x unscaled; with rms_eps (x the residual) the rope work after it
            # scales the rows by 1/rms(x), then adds the bias the product left out (args).
            args = self._rope_args(n, x, rms_eps, layer)
            self._linear(n, "qkv", x, layer.qkv_w, None if "bias" in args else layer.qkv_b, qkv,
                         rms_eps=None if wide else rms_eps)
            if append:
                q, k, v, _ = self._views(n)
                torch.ops.decodex.rope_append(q, k, v, m.inv_freq, positions, k_cache, v_cache, **args)
        else:
            for s in self._gemv_rows(n, "qkv"):
                torch.ops.decodex.gemv_rope_append(x[s], layer.qkv_w, layer.qkv_b, m.inv_freq, positions[s],
                                                   qkv[s], k_cache[s], v_cache[s], prefetch_weight=True,
                                                   rms_eps=rms_eps, config=self._gemv_config(n, layer.qkv_w))

    def _fused_rope_attention(self, n: int) -> bool:
        """Whether rope_append's work runs inside the attention kernel (rope_append_attention) in a
        graph of n rows, where the attention has at least 2 splits per (row, KV head): after a wide
        qkv product (cuBLAS or the wide gemv), or for Qwen3 (q/k norms) after any product (the other
        models' GEMV plans put rope_append in the qkv gemv's epilogue instead: gemv_rope_append).
        Measured in the step (bench/RESULTS.md): after a wide product 1.5-4% faster at 16-32 rows and
        1.5B at 64 (2 splits), 1.7% slower at 7B, 64 rows (1 split) (session 11); for Qwen3 at batch 1
        against gemv, rope_append, decode_attention, 1% faster (30B-A3B, 1K) and 0-2.2% (1.7B, 1K to
        32K) on an H100 (session 40)."""
        return (self.fuse_rope_attention and self._splits[n] >= 2
                and (self._plan(n, "qkv") in WIDE_PLANS or self.config.qk_norm))

    def _rope_args(self, n: int, x, rms_eps, layer) -> dict:
        """rope_append's (and rope_append_attention's) optional arguments after _qkv_rope's product
        of x: after a wide product with rms_eps (x the residual, the product unscaled, without its
        bias) rms_x / rms_eps / bias, so the rows are scaled by 1/rms(x) and the bias added; Qwen3's
        q_norm / k_norm / norm_eps."""
        args = self.model.head_norms(layer)
        if self._plan(n, "qkv") in WIDE_PLANS and rms_eps is not None:
            args.update(rms_x=x, rms_eps=rms_eps, bias=layer.qkv_b)
        return args

    def _gate_up_silu(self, n: int, x, rms_eps, w, act) -> None:
        """act[n, I] = silu_mul(x[n, Hd] @ w^T) for the merged gate|up weight w [2I, Hd] (the
        product scaled by 1/rms(x) first if rms_eps is given): gemv_silu_mul (over 8-row chunks, or
        by the "gemv" plan all n rows at once where its wgmma kernel takes them, above
        WGMMA_MIN_ROWS), or a product (cuBLAS or the wide gemv) then silu_mul."""
        plan = self._plan(n, "gate_up")
        if plan == "gemv" and WGMMA_MIN_ROWS < n <= self._silu_rows:
            torch.ops.decodex.gemv_silu_mul(x, w, act, prefetch_weight=True, rms_eps=rms_eps)
        elif plan in WIDE_PLANS:
            self._linear(n, "gate_up", x, w, None, self.gate_up[:n])
            # With rms_eps, x is the residual: the product's rows are scaled by 1/rms(x) first.
            torch.ops.decodex.silu_mul(self.gate_up[:n], act, rms_x=None if rms_eps is None else x,
                                       rms_eps=rms_eps)
        else:
            for s in self._gemv_rows(n, "gate_up"):
                torch.ops.decodex.gemv_silu_mul(x[s], w, act[s], prefetch_weight=True, rms_eps=rms_eps,
                                                config=self._gemv_config(n, w),
                                                launch_dependents_after=self._dependents_after(n, w))

    def _moe(self, n: int, x, rms_eps, layer) -> None:
        """residual[n] += the expert layer's output for x[n, Hd] (scaled by 1/rms(x) first if rms_eps
        is given): the router gemv (8-row chunks), moe_route, moe_gemv_silu_mul over the chosen
        experts, moe_gemv_sum adding their weighted sum into the residual. Every row's expert choice
        stays on the device."""
        ops, c = torch.ops.decodex, self.config
        logits, ids, weights, act = self.router_logits[:n], self.moe_ids[:n], self.moe_weights[:n], self.moe_act[:n]
        for r in range(0, n, GEMV_MAX_ROWS):
            s = slice(r, min(r + GEMV_MAX_ROWS, n))
            ops.gemv(x[s], layer.router_w, None, logits[s], prefetch_weight=True, rms_eps=rms_eps)
        ops.moe_route(logits, c.num_experts_per_tok, c.norm_topk_prob, ids, weights)
        ops.moe_gemv_silu_mul(x, layer.experts_gate_up, ids, act, rms_eps=rms_eps)
        # prefetch_weight: moe_route, which writes ids and weights, runs two kernels ahead.
        ops.moe_gemv_sum(act, layer.experts_down, ids, weights, self.residual[:n], accumulate=True,
                         prefetch_weight=True)

    def _step(self, n: int, greedy: bool) -> None:
        """One decode step over rows 0..n-1, on the current stream, on the static buffers only."""
        m, ops = self.model, torch.ops.decodex
        tokens, positions, lengths = self.tokens[:n], self.positions[:n], self.lengths[:n]
        attn, act = self.attn[:n], self.act[:n]
        logits = self.logits[:n]
        q, k, v, ws = self._views(n)
        attn3 = attn.view(n, self.H, self.D)
        self._pending_delta = False  # a cuBLAS product in delta not yet added to the residual
        torch.index_select(m.embed, 0, tokens, out=self.residual[:n])  # [n, Hd]
        for i, layer in enumerate(m.layers):
            k_cache, v_cache = self.cache.k[i][:n], self.cache.v[i][:n]  # [n, Hkv, S, D]
            x, rms_eps = self._normed(n, "qkv")  # the input norm: folded into qkv_w
            # q stays a strided view into qkv (row stride (H+2Hkv)*D): decode_attention reads it so.
            if self._fused_rope_attention(n):
                # The product alone; the attention kernel does rope_append's work first.
                # prefetch_cache: the product writes no cache row, lengths nor positions.
                self._qkv_rope(n, x, rms_eps, layer, k_cache, v_cache, append=False)
                ops.rope_append_attention(q, k, v, m.inv_freq, positions, k_cache, v_cache, lengths,
                                          self.scale, ws, attn3, prefetch_cache=True,
                                          **self._rope_args(n, x, rms_eps, layer))
            else:
                self._qkv_rope(n, x, rms_eps, layer, k_cache, v_cache)  # q, k rotated; k, v appended
                # prefetch_cache: the kernel ahead (the append) writes only row lengths - 1 of the cache.
                ops.decode_attention(q, k_cache, v_cache, lengths, self.scale, ws, attn3, prefetch_cache=True)
            self._add_product(n, "o", attn, layer.o_w, getattr(layer, "o_b", None))
            x, rms_eps = self._normed(n, "gate_up")  # the post-attention norm: folded into gate_up_w
            if layer.router_w is not None:  # Qwen3-MoE (its router_w and experts_gate_up hold the norm)
                self._moe(n, x, rms_eps, layer)
                continue
            self._gate_up_silu(n, x, rms_eps, layer.gate_up_w, act)
            self._add_product(n, "down", act, layer.down_w, None)
        x, _ = self._normed(n, "lm_head", m.final_norm)
        self._linear(n, "lm_head", x, m.lm_head, None, logits)
        if greedy:
            ops.argmax(logits, tokens)
        else:
            ops.sample(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n],
                       positions, tokens)
        ops.advance_positions(positions, lengths)

    # ---- graphs -----------------------------------------------------------------------------------

    def graph_size(self, batch: int) -> int:
        """The smallest graph size holding `batch` rows."""
        for s in self.sizes:
            if s >= batch:
                return s
        raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch}")

    def _graph(self, n: int, greedy: bool) -> torch.cuda.CUDAGraph:
        g = self._graphs.get((n, greedy))
        if g is None:
            g = self._graphs[(n, greedy)] = self._capture(n, greedy)
        return g

    @contextlib.contextmanager
    def _quiet_rows(self, length: int = 0):
        """Run warm-up steps with every row dead, then restore the sequence state exactly (dead
        rows write no cache entry, so the KV cache is untouched). With length > 0 the rows still
        append nothing and stay where they are (position -1), but attention reads `length` tokens
        of each row's cache."""
        saved = (self.tokens.clone(), self.positions.clone(), self.lengths.clone())
        self.positions.fill_(-1)
        self.lengths.fill_(length)
        try:
            yield
        finally:
            self.tokens.copy_(saved[0])
            self.positions.copy_(saved[1])
            self.lengths.copy_(saved[2])

    def _reading_rows(self):
        """_quiet_rows whose attention reads min(capacity, PLAN_CONTEXT) tokens (what the cache
        holds there, never written by this)."""
        return self._quiet_rows(min(self.capacity, PLAN_CONTEXT))

    def _capture(self, n: int, greedy: bool) -> torch.cuda.CUDAGraph:
        """The graph of a step over n rows. At a size's first capture of at most 8 rows the step is
        captured once per RMS_CHOICES entry and the one whose replays are fastest with every row
        reading the cache is kept (its choice reused for the other greedy flag); over 8 rows, the
        products' plans are checked against all-cuBLAS (_capture_checking_plans)."""
        if n not in self.sizes:
            raise ValueError(f"graph size {n} is not one of {self.sizes}")
        self.num_captures += 1  # graphs kept (the trial captures of a choice count as one)
        if n > GEMV_MAX_ROWS and n not in self.plan_step_ms:
            return self._capture_checking_plans(n, greedy)
        if n in self.rms_in_gemv or n > GEMV_MAX_ROWS:
            return self._capture_as_chosen(n, greedy)
        best = None
        for choice in RMS_CHOICES:
            self.rms_in_gemv[n] = choice
            graph = self._capture_as_chosen(n, greedy)
            ms = self._replay_ms(graph, reading=True)
            self.rms_times_ms[(n, choice)] = ms
            if best is None or ms < best[0]:
                best = (ms, choice, graph)
        self.rms_in_gemv[n] = best[1]
        return best[2]

    def _capture_checking_plans(self, n: int, greedy: bool) -> torch.cuda.CUDAGraph:
        """First capture of a size over 8 rows: the products' plans as _plan_linears measured them
        one product at a time, kept only if the whole step replays faster with them than with every
        product on cuBLAS (each product's neighbours in the step differ from its own in the trial:
        at 32 rows the wide gemv won its trials on qkv and o and lost in the step,
        bench/RESULTS.md, session 9); then refined with attention at work (_refine_plans)."""
        graph = self._capture_as_chosen(n, greedy)  # plans the products on first use
        chosen = {k: v for k, v in self.linear_plan.items() if k[0] == n}
        times = {"per product": self._replay_ms(graph)}
        self.plan_step_ms[n] = times
        if not all(v == "cublas" for v in chosen.values()):
            self.linear_plan.update({k: "cublas" for k in chosen})
            cublas = self._capture_as_chosen(n, greedy)
            times["all cublas"] = self._replay_ms(cublas)
            if times["all cublas"] < times["per product"]:
                graph = cublas
            else:
                self.linear_plan.update(chosen)
        return self._refine_plans(n, greedy, graph)

    def _refine_plans(self, n: int, greedy: bool, graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
        """The plans so far were timed with every row dead, so attention did nothing. But a decodex
        GEMV loads its first weights while the kernel ahead runs, and after attention that competes
        with attention's reads: at 1.5B, 32 rows the wide gemv o product lost 1.5% in the live step
        (bench/RESULTS.md, session 12). So each product's plan is changed in turn to each other
        plan, the step timed with rows that read min(capacity, PLAN_CONTEXT) cache tokens
        (_reading_rows: nothing is appended), and a change kept where it wins by PLAN_MARGIN.
        Returns the graph of the plans kept."""
        plans = plans_at(self.plans, n)
        best = self._replay_ms(graph, reading=True)
        tried = {"start": best}
        for name in self.products:
            start = kept = self.linear_plan[(n, name)]
            for plan in plans:
                if plan == start:
                    continue
                self.linear_plan[(n, name)] = plan
                trial = self._capture_as_chosen(n, greedy)
                ms = tried[f"{name} {plan}"] = self._replay_ms(trial, reading=True)
                if ms < (1.0 - PLAN_MARGIN) * best:
                    best, kept, graph = ms, plan, trial
            self.linear_plan[(n, name)] = kept
        self.plan_refine_ms[n] = tried
        return graph

    def _replay_ms(self, graph: torch.cuda.CUDAGraph, reps: int = 20, reading: bool = False) -> float:
        """GPU ms per replay of a step graph, the row state saved and restored: every row dead (the
        weight products run in full, attention and the appends do nothing) or, with reading, every
        row reading the cache (_reading_rows)."""
        cs = self._capture_stream
        cs.wait_stream(self.stream)
        rows = self._reading_rows() if reading else self._quiet_rows()
        with torch.cuda.device(self.device), torch.cuda.stream(cs), rows:
            ms = event_time_ms(lambda: [graph.replay() for _ in range(reps)], reps=3) / reps
        self.stream.wait_stream(cs)
        return ms

    def _capture_as_chosen(self, n: int, greedy: bool) -> torch.cuda.CUDAGraph:
        cs = self._capture_stream
        cs.wait_stream(self.stream)  # the state the warm-up saves and restores is current
        with torch.cuda.device(self.device), torch.cuda.stream(cs), torch.no_grad():
            with self._quiet_rows():  # lazy init (cuBLAS handles, workspaces) outside the graph
                if n > GEMV_MAX_ROWS and (n, "qkv") not in self.linear_plan:
                    self._plan_linears(n)
                for _ in range(2):
                    self._step(n, greedy)
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph synchronizes the device before capturing; nothing executes during capture.
        with torch.cuda.device(self.device), torch.no_grad(), torch.cuda.graph(graph, stream=cs):
            self._step(n, greedy)
        self.stream.wait_stream(cs)
        return graph

    def drop_graphs(self) -> None:
        """Forget the captured step graphs, so the next step captures again (tuning sweeps that
        change DECODEX_GEMV_CONFIG between captures). The norm choices (rms_in_gemv) are kept."""
        self._graphs.clear()

    def capture(self, batch: int, greedy: bool = True) -> int:
        """Capture the graph for `batch` rows now (rather than on first use); returns its size."""
        n = self.graph_size(batch)
        self._graph(n, greedy)
        return n

    def _plan_linears(self, n: int) -> None:
        """For a graph of n > 8 rows: per product, time each of PLANS (cuBLAS and, up to 64 rows,
        the wide gemv over all n rows; decodex's fused GEMVs over 8-row chunks) over all layers'
        weights of that shape, so L2-cold, each with its fused epilogue or its separate rope_append /
        silu_mul, and its input norm (inside the GEMV, an rms_norm kernel, or the op after), and
        keep the fastest. Each plan's step's worth of calls is captured into a CUDA graph and its
        replays timed, as the step will run them (timed eagerly, the launches would be the
        measure). Runs once per graph size on the current (capture) stream, before the step's
        capture, with every row dead (nothing is appended to the cache)."""
        m, L = self.model, self.model.layers
        dense = [l for l in L if l.gate_up_w is not None]  # the layers with a gate|up and a down product
        attn, act = self.attn[:n], self.act[:n]

        def normed_then(name, norm, product):  # the input norm as the step runs it, then product
            self._pending_delta = False
            product(*self._normed(n, name, norm))

        runs = {  # name -> (calls per step, one step's worth of that product, with its input norm)
            "qkv": (len(L), lambda: [normed_then("qkv", None, lambda x, e, l=l, i=i: self._qkv_rope(
                n, x, e, l, self.cache.k[i][:n], self.cache.v[i][:n])) for i, l in enumerate(L)]),
            "o": (len(L), lambda: [self._add_product(n, "o", attn, l.o_w, getattr(l, "o_b", None)) for l in L]),
            "gate_up": (len(dense), lambda: [normed_then("gate_up", None, lambda x, e, l=l: self._gate_up_silu(
                n, x, e, l.gate_up_w, act)) for l in dense]),
            "down": (len(dense), lambda: [self._add_product(n, "down", act, l.down_w, None) for l in dense]),
            "lm_head": (1, lambda: normed_then("lm_head", m.final_norm, lambda x, e: self._linear(
                n, "lm_head", x, m.lm_head, None, self.logits[:n], e))),
        }
        def replay_us(run, calls):  # us per call, replayed in a graph
            run()  # lazy init (cuBLAS handles, workspaces) outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
                run()
            return event_time_ms(graph.replay, reps=5, warmup=1) * 1000.0 / calls

        for name, (calls, run) in runs.items():
            if name not in self.products:
                continue
            times = {}
            for plan in plans_at(self.plans, n):
                self.linear_plan[(n, name)] = plan
                if plan != "lt_linear":
                    times[plan] = replay_us(run, calls)
                elif (us := self._time_lt_linear(n, name, run, lambda: replay_us(run, calls))) is not None:
                    times[plan] = us
            self.linear_times_us[(n, name)] = times
            self.linear_plan[(n, name)] = min(times, key=times.get)
        self._pending_delta = False

    def _time_lt_linear(self, n: int, name: str, run, timed) -> float | None:
        """Times each of lt_linear's candidates for product `name` (run(): one step's worth of
        the product, its plan set to "lt_linear"; timed(): us per call of it), keeps the fastest
        in lt_algo and returns its time; None if cuBLASLt has no candidate for it."""
        key = (n, name)
        self.lt_algo.pop(key, None)
        self._lt_count.pop(key, None)
        self._lt_counting = True  # run() only counts: _lt_linear computes nothing
        try:
            run()
        finally:
            self._lt_counting = False
        times = []
        for algo in range(self._lt_count[key]):
            self.lt_algo[key] = algo
            times.append(timed())
        if not times:
            return None
        self.lt_times_us[key] = times
        self.lt_algo[key] = min(range(len(times)), key=times.__getitem__)
        return times[self.lt_algo[key]]

    # ---- row state (all queued on self.stream, no host sync) --------------------------------------

    def _set_params(self, row: int, params) -> None:
        t = float(getattr(params, "temperature", 0.0) or 0.0)
        self.temperature[row].fill_(t)
        self.top_k[row].fill_(int(getattr(params, "top_k", 0) or 0))
        self.top_p[row].fill_(float(getattr(params, "top_p", 1.0) if params is not None else 1.0))
        self.seed[row].fill_(reference.seed_int64(getattr(params, "seed", 0) or 0))

    def _sample_row(self, row: int, greedy: bool) -> None:
        """tokens[row] = the token drawn from logits[row] at positions[row]."""
        r = slice(row, row + 1)
        if greedy:
            torch.ops.decodex.argmax(self.logits[r], self.tokens[r])
        else:
            torch.ops.decodex.sample(self.logits[r], self.temperature[r], self.top_k[r], self.top_p[r],
                                     self.seed[r], self.positions[r], self.tokens[r])

    def _set_row(self, row: int, position: int, live: bool) -> None:
        self.positions[row].fill_(position if live else -1)
        self.lengths[row].fill_(position + 1 if live else 0)

    def reset(self) -> None:
        """Every row dead."""
        self._join_caller()
        with torch.cuda.stream(self.stream):
            self.positions.fill_(-1)
            self.lengths.fill_(0)
        self._host_pos = [-1] * self.max_batch

    def prefill_row(self, row: int, prompt: list[int], params=None, live: bool = True) -> None:
        """Prefill `prompt` into cache slot `row` (cuBLAS/SDPA path of model.prefill) and draw the
        first token from the logits of the last prompt token (position T-1) into tokens[row]."""
        T = len(prompt)
        if not 0 < T <= self.capacity:
            raise ValueError(f"prompt of {T} tokens: must be 1 .. the cache capacity {self.capacity}")
        ids = torch.tensor(prompt, dtype=torch.int64)  # [T], checked here while still on the host
        check_token_ids(ids, self.model.config.vocab_size, "prompt")
        self._join_caller()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            ids = ids.pin_memory().to(self.device, non_blocking=True)
            logits = self.model.prefill(ids, self.cache, row, last_only=True)  # [1, V] fp32: token T-1's
            self._set_params(row, params)
            self.logits[row].copy_(logits[0])  # rounded to bf16, like every decode step's logits
            del logits
            self.positions[row].fill_(T - 1)
            greedy = float(getattr(params, "temperature", 0.0) or 0.0) <= 0.0
            self._sample_row(row, greedy)
            self._set_row(row, T, live)
        self._host_pos[row] = T if live else -1

    def load_row(self, row: int, context: int, token: int, params=None, live: bool = True) -> None:
        """The caller filled cache rows 0..context-1 of slot `row`: the row consumes `token` at
        position `context` next (benchmarks: no prefill needed)."""
        if not 0 <= context < self.capacity:
            raise ValueError(f"context {context} must be in [0, {self.capacity})")
        check_token_ids(torch.tensor([int(token)]), self.model.config.vocab_size, "first token")
        self._join_caller()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._set_params(row, params)
            self.tokens[row].fill_(int(token))
            self._set_row(row, context, live)
        self._host_pos[row] = context if live else -1

    def deactivate_row(self, row: int) -> None:
        with torch.cuda.stream(self.stream):
            self._set_row(row, 0, False)
        self._host_pos[row] = -1

    def step(self, n: int, greedy: bool = True) -> None:
        """One decode step over rows 0..n-1 (n a graph size) by graph replay, captured on first use.
        The caller keeps every live row's position below capacity."""
        graph = self._graph(n, greedy)
        with torch.cuda.stream(self.stream):
            graph.replay()
        self._host_pos = [p + 1 if p >= 0 and r < n else p for r, p in enumerate(self._host_pos)]

    def eager_step(self, n: int, greedy: bool = True) -> None:
        """The same step without the graph (profiling, debugging)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            self._step(n, greedy)
        self._host_pos = [p + 1 if p >= 0 and r < n else p for r, p in enumerate(self._host_pos)]

    def time_steps(self, n: int, greedy: bool = True, steps: int = 100, warmup: int = 5) -> list[float]:
        """Milliseconds of each of `steps` graph replays queued back to back (CUDA events between
        replays), for rows loaded with load_row / prefill_row. Live rows advance steps + warmup
        positions; this raises if that would pass the cache capacity."""
        top = max(self._host_pos)
        if top + warmup + steps > self.capacity:
            raise ValueError(f"rows at position {top} + {warmup + steps} steps pass the capacity "
                             f"{self.capacity}")
        graph = self._graph(n, greedy)
        self._join_caller()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                graph.replay()
            events[0].record()
            for i in range(steps):
                graph.replay()
                events[i + 1].record()
        events[-1].synchronize()
        self._host_pos = [p + warmup + steps if p >= 0 and r < n else p for r, p in enumerate(self._host_pos)]
        return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]

    def step_time_ms(self, n: int, greedy: bool = True, steps: int = 100) -> float:
        """Median ms per replayed step (see time_steps)."""
        return statistics.median(self.time_steps(n, greedy, steps))

    # ---- HostLoop's device interface --------------------------------------------------------------

    def _limit(self) -> int:
        return min(self.capacity, self.config.max_context)

    def _limit_reason(self) -> str:
        if self.capacity <= self.config.max_context:
            return f"the KV cache capacity of {self.capacity} tokens"
        return f"the model's {self.config.context_name}"

    def _dev_reset(self) -> None:
        self.reset()

    def _dev_prefill(self, row, prompt, params, live) -> None:
        self.prefill_row(row, prompt, params, live)

    def _dev_load(self, row, context, token, params, live) -> None:
        self.load_row(row, context, token, params, live)

    def _dev_deactivate(self, row) -> None:
        self.deactivate_row(row)

    def _dev_step(self, n, greedy) -> None:
        self.step(n, greedy)

    def _dev_publish(self, slot):
        ev = self._events[slot]
        with torch.cuda.stream(self.stream):
            self.ring[slot].copy_(self.tokens, non_blocking=True)
            ev.record(self.stream)
        return ev

    def _dev_ready(self, handle) -> bool:
        return handle.query()

    def _dev_wait(self, handle) -> None:
        handle.synchronize()

    def _dev_read(self, slot) -> list[int]:
        return self.ring[slot].tolist()

    def _dev_drain(self) -> None:
        self.stream.synchronize()


def _cublas_linear(x, w, b, out) -> None:
    """out = x @ w^T (+ b) through cuBLAS, into the given buffer (no allocation)."""
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def event_time_ms(fn, reps: int = 5, warmup: int = 1, calls: int = 1) -> float:
    """Median milliseconds of fn() on the current stream over `reps` timings with CUDA events, after
    `warmup` untimed calls. A timing is `calls` calls queued back to back between two events (no
    synchronisation between them), divided by `calls`: with calls > 1 that is GPU time per call, each
    call's host work hidden wherever the host keeps ahead of the GPU. (The linear plan uses it; so
    does bench/decode.py.)"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
