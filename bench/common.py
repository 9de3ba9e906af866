"""Shared benchmark machinery: the bandwidth ceiling measured in the same run, L2-cold timing by
CUDA-graph replay over a rotating stack of inputs, and the printed table.

L2-cold: the H200 has 60 MiB of L2. Each benchmark builds `copies` independent input sets whose total
exceeds `COLD_BYTES`, captures one call per set (cycled up to MIN_GRAPH_CALLS calls) into a single
CUDA graph, and times replays of that graph queued back to back, with CUDA events between them; time
per call = replay time / calls in the graph. Median of `reps` replays.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch

COLD_BYTES = 256 << 20  # > 4x the H200's 60 MiB L2


def copies_for(nbytes: int, minimum: int = 4, maximum: int = 512) -> int:
    """How many input sets of `nbytes` make a stack larger than COLD_BYTES."""
    return max(minimum, min(maximum, math.ceil(COLD_BYTES / max(nbytes, 1))))


MIN_GRAPH_CALLS = 32  # calls a timed graph holds at least (its input sets cycled)


def cycled(calls: list, min_calls: int) -> list:
    """`calls` repeated in order, in whole passes, until there are at least `min_calls` of them."""
    return list(calls) * max(1, math.ceil(min_calls / max(len(calls), 1)))


def time_graph(calls, reps: int = 30, warmup: int = 3, min_calls: int = MIN_GRAPH_CALLS) -> float:
    """Median microseconds of one call, for `calls` a list of zero-argument callables (one per input
    set), in steady state: the calls, cycled until there are at least `min_calls` of them (each set is
    still used once per pass over the stack, so every call stays L2-cold), are captured into one CUDA
    graph, and `reps` replays are queued back to back with CUDA events between them, as the decode
    step is timed (CudaGraphRunner.time_steps). The host's launch of a replay then overlaps the replay
    ahead, and only the first call of a replay starts without its predecessor's tail to overlap
    (programmatic dependent launch does not cross graph launches). Time per call = median replay time
    / calls in the graph. (Until session 32 each replay of one pass was timed alone, so every timing
    also paid for the launch of its graph onto an idle GPU: bench/RESULTS.md, session 32.)"""
    seq = cycled(calls, min_calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[: min(len(calls), 2)]:  # warm up outside the graph (lazy init, autotune)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    for _ in range(warmup):
        graph.replay()
    events[0].record()
    for i in range(reps):
        graph.replay()
        events[i + 1].record()
    events[-1].synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) * 1000.0 / len(seq) for i in range(reps))


def compare_row(label: str, nbytes: int, bw_gbs: float, make_inputs, ours, base, reps: int = 30) -> list:
    """One row of an op table: [label, decodex us, baseline us, GB/s, % of bw, speedup].

    `make_inputs()` returns one input set (a tuple); copies_for(nbytes) of them are made so the stack
    is L2-cold, and `ours(*inputs)` / `base(*inputs)` are timed over all of them by time_graph.
    `nbytes` is what one call must move (its reads and writes), for GB/s."""
    sets = [make_inputs() for _ in range(copies_for(nbytes))]
    t_ours = time_graph([lambda s=s: ours(*s) for s in sets], reps)
    t_base = time_graph([lambda s=s: base(*s) for s in sets], reps)
    del sets
    torch.cuda.empty_cache()
    gbs = nbytes / t_ours / 1e3
    return [label, t_ours, t_base, gbs, 100 * gbs / bw_gbs, t_base / t_ours]


def fused_row(label: str, nbytes: int, bw_gbs: float, sets: list, fused, unfused, base) -> list:
    """One row of a fused-op table: [label, MB, fused us, unfused us, baseline us, GB/s, % of bw,
    unfused / fused, baseline / fused], each callable timed over every input set in `sets` (a stack
    made L2-cold by the caller, e.g. with copies_for) by time_graph."""
    t = [time_graph([lambda s=s: fn(s) for s in sets]) for fn in (fused, unfused, base)]
    gbs = nbytes / t[0] / 1e3
    return [label, nbytes / 1e6, t[0], t[1], t[2], gbs, 100 * gbs / bw_gbs, t[1] / t[0], t[2] / t[0]]


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` rows read when each chooses top_k of num_experts uniformly (without
    repeats in a row): top_k for one row, E (1 - (1 - k/E)^rows) for more (bench.moe, and the floor
    of a mixture of experts' step in bench.decode)."""
    if rows == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def read_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device bandwidth ceiling in GB/s, measured now: the better of a large device-to-device copy
    (bytes read + written) and a large read-only reduction. Both are L2-cold at this size."""
    src = torch.randn(nbytes // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    copy_us = time_graph([lambda: dst.copy_(src)], reps=10, min_calls=1)
    read_us = time_graph([lambda: torch.sum(src, dim=0, out=acc)], reps=10, min_calls=1)
    del src, dst
    torch.cuda.empty_cache()
    return max(2 * nbytes / copy_us, nbytes / read_us) / 1e3


def print_table(title: str, headers: list[str], rows: list[list], file=None) -> str:
    """A fixed-width table; returns the text (also printed, and appended to `file` if given)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [f"### {title}", ""]
    lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(cells[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if file:
        with open(file, "a") as f:
            f.write(text + "\n")
    return text


def require_gpu() -> None:
    """Exits with the reason where the benchmarks cannot run: no CUDA GPU, or the kernels not built."""
    if not torch.cuda.is_available():
        raise SystemExit("decodex's benchmarks need a CUDA GPU (torch.cuda.is_available() is False here)")
    from decodex import _ext

    if not _ext.available():
        raise SystemExit(_ext.why_unavailable())


def int_list(text: str) -> list[int]:
    """An argparse type: "1,2,8" -> [1, 2, 8]."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def bench_main(title: str, headers: list[str], rows) -> None:
    """The main() of an op benchmark: measure the ceiling, then print `rows(bw)` as one table."""
    require_gpu()
    bw = read_bandwidth_gbs()
    print(f"bandwidth measured now: {bw:.0f} GB/s", flush=True)
    print_table(title, headers, rows(bw))


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.1f}" if abs(c) >= 10 else f"{c:.2f}"
    return str(c)
