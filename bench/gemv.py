"""decodex::gemv against cuBLAS (F.linear) at the Qwen2.5-1.5B and -7B decode shapes, M = 1, 2, 4, 8.

L2-cold: one weight copy per call in a stack larger than the L2 (bench.common.copies_for, capped at
MAX_STACK_BYTES), every call captured in one CUDA graph; both sides time the same stack in the same
run. Bytes moved = weight + x + out; % is of the read bandwidth measured in the same run.
"decodex us" is a plain call; "prefetch_weight us" passes prefetch_weight=True (each call loads its
first weights while the call before it runs), as the decode graph does; GB/s, % of bw and the
speedup over cuBLAS are of the prefetch_weight calls, "plain speedup" of the plain call (what a
caller who cannot promise that the kernel ahead leaves the weight alone gets). "cuBLASLt us" is
F.linear with torch's preferred BLAS library set to cuBLASLt (engine.blas_library: the engine's
"cublaslt" plan). Two smaller tables follow: the RMS norm inside the GEMV (rms_eps, the norm weight
folded into W) against an rms_norm kernel then the GEMV, beside the plain GEMV; and accumulate (out
+= product) against the plain GEMV; all with prefetch_weight.

    python -m bench.gemv                       # the table
    python -m bench.gemv --ms 16,32,64         # the table at other M (up to 64: the wide GEMV)
    python -m bench.gemv --sweep [--only 7B] [--ms 1,8]   # tuning: every configuration per shape
    python -m bench.gemv --sweep --plain --only "7B qkv"  # the same for plain calls (no prefetch_weight)
    python -m bench.gemv --models llama3.1-8b,qwen3-8b --ms 1   # another bench.decode preset's shapes
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from bench.common import copies_for, int_list, print_table, read_bandwidth_gbs, require_gpu, time_graph

# (model, name, N, K): weight [N, K].
SHAPES = [
    ("1.5B", "q", 1536, 1536),
    ("1.5B", "k", 256, 1536),
    ("1.5B", "v", 256, 1536),
    ("1.5B", "qkv", 2048, 1536),
    ("1.5B", "o", 1536, 1536),
    ("1.5B", "gate|up", 17920, 1536),
    ("1.5B", "down", 1536, 8960),
    ("1.5B", "lm_head", 151936, 1536),
    ("7B", "q", 3584, 3584),
    ("7B", "k", 512, 3584),
    ("7B", "v", 512, 3584),
    ("7B", "qkv", 4608, 3584),
    ("7B", "o", 3584, 3584),
    ("7B", "gate|up", 37888, 3584),
    ("7B", "down", 3584, 18944),
    ("7B", "lm_head", 152064, 3584),
]
MS = [1, 2, 4, 8]


def model_shapes(keys) -> list[tuple[str, str, int, int]]:
    """SHAPES' rows for bench.decode's model presets (by key): each decode-step product's weight (for
    a mixture of experts, its router's; bench.moe times the experts)."""
    from bench.decode import MODELS, config_dict

    out = []
    for key in keys:
        if key not in MODELS:
            raise ValueError(f"--models: {key!r} is not one of {', '.join(MODELS)}")
        c = config_dict(key)
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        # A mixture of experts' layers have a router instead (the experts: bench.moe).
        mlp = ((("router", c["num_experts"], hidden),) if c.get("num_experts") else
               (("gate|up", 2 * inter, hidden), ("down", hidden, inter)))
        out += [(MODELS[key]["name"], name, N, K) for name, N, K in (
            ("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden), ("qkv", q + 2 * kv, hidden), ("o", hidden, q),
            *mlp, ("lm_head", c["vocab_size"], hidden))]
    return out
MAX_STACK_BYTES = 3 << 30  # the two lm_heads would otherwise stack 4 GB copies
TITLE = "gemv: decodex vs cuBLAS (F.linear), L2-cold, CUDA graph, median"
HEADERS = ["shape", "weight MB", "decodex us", "prefetch_weight us", "cuBLAS us", "cuBLASLt us", "GB/s",
           "% of bw", "speedup", "plain speedup"]
ENV = "DECODEX_GEMV_CONFIG"
WIDE_ENV = "DECODEX_GEMV_WIDE_CONFIG"  # the wgmma kernel's (M > 16)


def _copies(nbytes: int) -> int:
    return max(2, min(copies_for(nbytes), MAX_STACK_BYTES // nbytes))


def _stack(N: int, K: int):
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(_copies(2 * N * K))]


def _buffers(weights, M: int):
    """Per weight copy: x [M, K] ~ N(0, 1) and a zeroed out [M, N]."""
    K = weights[0].shape[1]
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in weights]
    outs = [torch.zeros(M, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in weights]
    return xs, outs


def _time_ours(weights, M: int, reps: int = 30, prefetch_weight: bool = False, **options) -> float:
    """One gemv per weight copy; options: the op's rms_eps / accumulate."""
    xs, outs = _buffers(weights, M)
    calls = [lambda i=i: torch.ops.decodex.gemv(xs[i], weights[i], None, outs[i], prefetch_weight=prefetch_weight,
                                                **options)
             for i in range(len(weights))]
    return time_graph(calls, reps=reps)


def _time_rms_norm_then_gemv(weights, M: int) -> float:
    """Per weight copy: an rms_norm kernel, then the gemv of its output (what rms_eps replaces)."""
    xs, outs = _buffers(weights, M)
    nw = (1 + 0.1 * torch.randn(xs[0].shape[1], device="cuda")).to(torch.bfloat16)
    hs = [torch.empty_like(x) for x in xs]

    def call(i):
        torch.ops.decodex.rms_norm(xs[i], nw, 1e-6, hs[i])
        torch.ops.decodex.gemv(hs[i], weights[i], None, outs[i], prefetch_weight=True)
    return time_graph([lambda i=i: call(i) for i in range(len(weights))])


NORM_SHAPES = ("qkv", "gate|up")  # the products the decode step feeds normed (rms_eps)
ACCUMULATE_SHAPES = ("o", "down")  # the products it adds into the residual
NORM_TITLE = "gemv RMS norm: rms_norm + gemv vs gemv(rms_eps), beside plain gemv, prefetch_weight, L2-cold, median"
NORM_HEADERS = ["shape", "gemv us", "rms_norm + gemv us", "rms_eps us", "saved us"]
ACC_TITLE = "gemv accumulate: plain vs accumulate=True (out += product), prefetch_weight, L2-cold, median"
ACC_HEADERS = ["shape", "gemv us", "accumulate us"]


def fused_rows(shapes=SHAPES) -> tuple[list[list], list[list]]:
    """The RMS-norm and accumulate tables."""
    import decodex  # noqa: F401

    norm, acc = [], []
    for model, name, N, K in shapes:
        if name not in NORM_SHAPES + ACCUMULATE_SHAPES:
            continue
        weights = _stack(N, K)
        for M in (1, 8):
            label = f"{model} {name} {N}x{K} M={M}"
            plain = _time_ours(weights, M, prefetch_weight=True)
            if name in NORM_SHAPES:
                two, one = _time_rms_norm_then_gemv(weights, M), _time_ours(weights, M, prefetch_weight=True,
                                                                           rms_eps=1e-6)
                norm.append([label, plain, two, one, two - one])
            else:
                acc.append([label, plain, _time_ours(weights, M, prefetch_weight=True, accumulate=True)])
        del weights
        torch.cuda.empty_cache()
    return norm, acc


def _time_cublas(weights, M: int, plan: str = "cublas") -> float:
    """F.linear per weight copy, called (and so captured) with the BLAS library of the engine's
    plan `plan` ("cublas": torch's choice; "cublaslt")."""
    from decodex.engine import blas_library

    xs, _ = _buffers(weights, M)
    with blas_library(plan):
        return time_graph([lambda i=i: F.linear(xs[i], weights[i]) for i in range(len(weights))])


def _selected(label: str, only: str | None) -> bool:
    return not only or any(o in label for o in only.split(","))


def rows(bandwidth_gbs: float | None = None, ms=MS, only: str | None = None, shapes=SHAPES) -> list[list]:
    import decodex  # noqa: F401  (registers torch.ops.decodex)

    bw = bandwidth_gbs or read_bandwidth_gbs()
    out = []
    for model, name, N, K in shapes:
        if not _selected(f"{model} {name} {N}x{K}", only):
            continue
        weights = _stack(N, K)
        for M in ms:
            ours, cublas = _time_ours(weights, M), _time_cublas(weights, M)
            cublaslt = _time_cublas(weights, M, "cublaslt")
            early = _time_ours(weights, M, prefetch_weight=True)
            nbytes = 2 * (N * K + M * K + M * N)
            gbs = nbytes / early / 1e3
            out.append([f"{model} {name} {N}x{K} M={M}", 2 * N * K / 1e6, ours, early, cublas, cublaslt,
                        gbs, 100 * gbs / bw, cublas / early, cublas / ours])
        del weights
        torch.cuda.empty_cache()
    return out


def _configs(N: int, K: int, clusters: bool):
    """Every (wr, wk, c, u) the kernel takes whose k-ranges all get at least one k-step."""
    ksteps = -(-K // 32)
    for c in (1, 2, 4, 8) if clusters else (1,):
        for u in (4, 8):
            for wk in range(1, 9):
                for wr in (1, 2, 4, 8):
                    if wr * wk <= 8 and wk * c <= ksteps and wr <= -(-N // 16):
                        yield f"{wr},{wk},{c},{u}"


def _wide_configs(K: int):
    """Every (bn, c, s) of the wgmma kernel (M > 16) whose cluster ranks all get at least one
    k-stage."""
    ksteps = -(-K // 64)
    for bn in (64, 96, 128, 144):
        for c in (1, 2, 3, 4, 6, 8, 16):
            for s in (4, 8):
                if c <= ksteps:
                    yield f"{bn},{c},{s}"


def sweep(only: str | None = None, ms=(1, 8), shapes=SHAPES, prefetch_weight: bool = True) -> None:
    """Per shape and M: the heuristic's time, then the best configurations found; every call with
    prefetch_weight as given (True: as the decode graph calls the GEMV; False: plain calls)."""
    require_gpu()
    import decodex  # noqa: F401

    clusters = torch.cuda.get_device_capability()[0] >= 9
    bw = read_bandwidth_gbs()
    seen = set()
    for model, name, N, K in shapes:
        label = f"{model} {name} {N}x{K}"
        if not _selected(label, only):
            continue
        if (N, K) in seen:  # v is k's shape, o often q's
            continue
        seen.add((N, K))
        weights = _stack(N, K)
        for M in ms:
            env, configs, fields = ((WIDE_ENV, _wide_configs(K), "bn,c,s") if M > 16 else
                                    (ENV, _configs(N, K, clusters), "wr,wk,c,u"))
            os.environ.pop(env, None)
            default = _time_ours(weights, M, reps=10, prefetch_weight=prefetch_weight)
            results = []
            for cfg in configs:
                os.environ[env] = cfg
                results.append((_time_ours(weights, M, reps=10, prefetch_weight=prefetch_weight), cfg))
            os.environ.pop(env, None)
            results.sort()
            floor = 2 * N * K / bw / 1e3
            best = ", ".join(f"{c} {t:.2f}" for t, c in results[:4])
            call = "" if prefetch_weight else " plain"
            print(f"{label} M={M}{call}: floor {floor:.2f} us, heuristic {default:.2f} us, "
                  f"best ({fields} us): {best}", flush=True)
        del weights
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="time every kernel configuration per shape")
    p.add_argument("--plain", action="store_true", help="with --sweep: time plain calls (prefetch_weight=False) "
                                                        "instead of the decode graph's prefetch_weight calls")
    p.add_argument("--only", help="only shapes whose label contains one of these (comma-separated), "
                                  "e.g. '7B' or '1.5B down,7B gate'")
    p.add_argument("--models", help="the shapes of these bench.decode presets (comma-separated keys, e.g. "
                                    "'llama3.1-8b,qwen3-8b') instead of Qwen2.5-1.5B's and -7B's")
    p.add_argument("--ms", type=int_list, help="rows of x, comma-separated (1..64; default 1,2,4,8 for the table, 1,8 "
                                "for --sweep); with it the table skips the RMS and accumulate tables")
    args = p.parse_args(argv)
    ms = args.ms
    if ms is not None and not all(1 <= m <= 64 for m in ms):
        p.error(f"--ms: every M must be in 1..64, got {args.ms}")
    try:
        shapes = SHAPES if args.models is None else model_shapes(args.models.split(","))
    except ValueError as e:
        p.error(str(e))
    if args.plain and not args.sweep:
        p.error("--plain goes with --sweep (the table times both kinds of call)")
    if args.sweep:
        sweep(args.only, ms or (1, 8), shapes, prefetch_weight=not args.plain)
        return
    require_gpu()
    bw = read_bandwidth_gbs()
    print(f"read bandwidth measured now: {bw:.0f} GB/s", flush=True)
    print_table(TITLE, HEADERS, rows(bw, ms or MS, args.only, shapes))
    if ms is not None or args.only:
        return
    norm, acc = fused_rows(shapes)
    print_table(NORM_TITLE, NORM_HEADERS, norm)
    print_table(ACC_TITLE, ACC_HEADERS, acc)


if __name__ == "__main__":
    main()
