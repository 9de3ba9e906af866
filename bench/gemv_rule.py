"""The fit behind csrc/gemv.cu's rule_config (the GEMV configuration of a shape its table lacks, up
to 8 rows of x), rerunnable from in-step sweeps.

Each line of the data is one weight shape swept inside a decode step (`python -m bench.decode
--sweep-gemv --sweep-json PATH`): the step's GPU ms under each configuration "wr,wk,c,u", and
before_ms, the step with the configuration decodex chose then (before_from: "table" for a kTuned
entry, "choose" for the cost model that chose the rest until session 43, "rule" for rule_config
since; lines without it, as --sweep-json writes them, count in the fit only). A rule with s k-steps
a warp and up to w k-warps a block (the rest of K over a cluster of up to 8) costs a shape its step
time against the shape's best configuration, in % of the step. Lines with "partial": true (session
42's printouts) hold only the five best; a configuration outside them is charged the fifth's cost
plus PARTIAL_MISS points (a guess: it is at least the fifth's).

    python -m bench.gemv_rule                         # bench/gemv_sweeps.jsonl (H100, sessions 41-45)
    python -m bench.gemv_rule --data a.jsonl,b.jsonl  # other sweeps (e.g. an H200's)
    python -m bench.gemv_rule --loo                   # also refitted with one model left out at a time
"""
from __future__ import annotations

import argparse
import json
import os
import re
from itertools import product

from bench.common import print_table

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_sweeps.jsonl")
GEMV_CU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "gemv.cu")
PARTIAL_MISS = 0.3
STEPS = (4, 6, 7, 8, 9, 10, 12, 16, 24)  # the grid the fit searches: k-steps a warp
WARPS = (2, 3, 4, 5, 6, 8)               # and k-warps a block
K_STEP, MAX_WARPS, MAX_CLUSTER = 32, 8, 8  # csrc/gemv_kernel.cuh's kStepK, kMaxWarps, kMaxCluster


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rule_constants(path: str = GEMV_CU) -> tuple[int, int]:
    """(kRuleSteps, kRuleWarps) as csrc/gemv.cu has them."""
    m = re.search(r"constexpr int kRuleSteps = (\d+), kRuleWarps = (\d+);", open(path).read())
    if m is None:
        raise ValueError(f"{path}: no 'constexpr int kRuleSteps = ..., kRuleWarps = ...;' line")
    return int(m.group(1)), int(m.group(2))


def rule_config(K: int, steps: int, warps: int, clusters: bool = True) -> str:
    """csrc/gemv.cu's rule_config for these constants, as "wr,wk,c,u" (tests check the two agree)."""
    ksteps = _ceil_div(K, K_STEP)
    parts = _ceil_div(ksteps, steps)
    c = 1
    while c < (MAX_CLUSTER if clusters else 1) and _ceil_div(parts, c) > warps:
        c *= 2
    wk = min(_ceil_div(parts, c), MAX_WARPS)
    return f"1,{wk},{c},{8 if _ceil_div(ksteps, wk * c) > steps else 4}"


def load(paths: list[str]) -> list[dict]:
    lines = []
    for path in paths:
        with open(path) as f:
            for i, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    d = json.loads(text)
                    if not d["ms"] or not all(k in d for k in ("model", "batch", "N", "K", "before_ms")):
                        raise KeyError("model, batch, N, K, before_ms or ms")
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{i}: not a --sweep-json line ({e})") from None
                lines.append(d)
    return lines


def cost(line: dict, cfg: str) -> float:
    """% of the step cfg loses against the line's best configuration."""
    ms = line["ms"]
    best = min(ms.values())
    if cfg in ms:
        return 100 * (ms[cfg] / best - 1)
    if not line.get("partial"):
        raise ValueError(f"{line['model']} {line['N']}x{line['K']}: no time for {cfg}")
    return 100 * (max(ms.values()) / best - 1) + PARTIAL_MISS


def before_cost(line: dict) -> float:
    return 100 * (line["before_ms"] / min(line["ms"].values()) - 1)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def fit(lines: list[dict]) -> list[tuple[float, float, int, int]]:
    """(mean cost, max cost, steps, warps) of every grid point, best first."""
    out = []
    for s, w in product(STEPS, WARPS):
        costs = [cost(d, rule_config(d["K"], s, w)) for d in lines]
        out.append((mean(costs), max(costs), s, w))
    return sorted(out)


def fixed(full: list[dict]) -> list[tuple[float, str]]:
    """(mean cost, config) of each configuration used for every one of these full (not partial)
    lines that all of them timed, best first."""
    if not full:
        return []
    common = set.intersection(*(set(d["ms"]) for d in full))
    return sorted((mean([cost(d, cfg) for d in full]), cfg) for cfg in common)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=DATA, help="comma list of --sweep-json files (default: %(default)s)")
    p.add_argument("--loo", action="store_true", help="also fit with each model left out, cost it on that model")
    p.add_argument("--top", type=int, default=10, help="grid points to print (default %(default)s)")
    args = p.parse_args(argv)
    lines = load([x for x in args.data.split(",") if x])
    if not lines:
        p.error(f"--data {args.data}: no lines")
    steps, warps = rule_constants()
    chosen = [d for d in lines if d.get("before_from") == "choose"]
    ours = [cost(d, rule_config(d["K"], steps, warps)) for d in chosen]
    was = [before_cost(d) for d in chosen]
    print(f"{len(lines)} shapes ({sum(bool(d.get('partial')) for d in lines)} with only the five best), "
          f"{len(chosen)} of them timed with the cost model's choice")
    print(f"rule_config (kRuleSteps {steps}, kRuleWarps {warps}) on those: {mean(ours):.2f}% of the step "
          f"a shape against the best; the cost model {mean(was):.2f}%; the rule nearer on "
          f"{sum(a < b for a, b in zip(ours, was))} of {len(chosen)}")
    built = [d for d in lines if d.get("before_from") == "rule"]
    if built:
        costs = [before_cost(d) for d in built]
        print(f"{len(built)} shapes timed with the rule's own choice (models it was not fitted on): "
              f"{mean(costs):.2f}% of the step a shape against the best, at most {max(costs):.2f}%")
    full = [d for d in lines if not d.get("partial")]
    one = fixed(full)
    if one:
        full_chosen = [d for d in full if d.get("before_from") == "choose"]
        model = mean([before_cost(d) for d in full_chosen])
        print(f"one configuration for every one of the {len(full)} full lines: the best, ({one[0][1]}), "
              f"{one[0][0]:.2f}%; what those shapes ran with {mean([before_cost(d) for d in full]):.2f}%; "
              f"on the {len(full_chosen)} of them timed with the cost model's choice ({model:.2f}%), "
              f"{sum(mean([cost(d, cfg) for d in full_chosen]) < model for _, cfg in one)} of the "
              f"{len(one)} configurations would have beaten it")
    print()
    rows = [[f"{s}", f"{w}", f"{m:.3f}", f"{x:.2f}"] for m, x, s, w in fit(lines)[:args.top]]
    print_table("rule_config's constants by mean cost over every shape (% of the step)",
                ["k-steps a warp", "k-warps a block", "mean %", "max %"], rows)
    if args.loo:
        held = []
        rows = []
        for model in sorted({d["model"] for d in lines}):
            train = [d for d in lines if d["model"] != model]
            test = [d for d in lines if d["model"] == model]
            _, _, s, w = fit(train)[0]
            costs = [cost(d, rule_config(d["K"], s, w)) for d in test]
            held += costs
            rows.append([model, f"{s}", f"{w}", f"{len(test)}", f"{mean(costs):.3f}"])
        rows.append(["all", "", "", f"{len(held)}", f"{mean(held):.3f}"])
        print_table("fitted without the model, costed on it (% of the step)",
                    ["left out", "k-steps", "k-warps", "shapes", "mean %"], rows)


if __name__ == "__main__":
    main()
