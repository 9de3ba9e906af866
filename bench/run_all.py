"""Runs every op benchmark (bench/<op>.py main()) and writes all their tables into one markdown file.

  python -m bench.run_all --out bench_ops.md            # every op benchmark that exists
  python -m bench.run_all --out r.md --ops gemv,sample   # a subset
  python -m bench.run_all --out r.md --decode "--quick"  # and bench.decode with these arguments

Each benchmark prints its tables through bench.common.print_table; what it prints is copied into
--out when it finishes (so a crash later keeps the earlier tables). --ops names only benchmarks of
OPS; one that fails is reported with its error and the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import shlex
import sys
import time
import traceback

OPS = ["gemv", "gemv_silu_mul", "gemv_rope_append", "lt_linear", "decode_attention", "rope_append_attention",
       "rms_norm", "rope_append", "silu_mul", "moe", "argmax", "sample"]


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, stream):
        self.stream = stream
        self.parts: list[str] = []

    def write(self, s):
        self.stream.write(s)
        self.parts.append(s)
        return len(s)

    def flush(self):
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.parts)


def run_module(name: str, argv: list[str]) -> tuple[str, str]:
    """Imports bench.<name> and calls its main() with sys.argv = [name] + argv; returns (status,
    everything it printed)."""
    try:
        module = importlib.import_module(f"bench.{name}")
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"import failed: {type(e).__name__}: {e}", traceback.format_exc()
    main = getattr(module, "main", None)
    if main is None:
        return "no main()", ""
    tee = _Tee(sys.stdout)
    saved_argv = sys.argv
    sys.argv = [f"bench.{name}"] + argv  # benchmarks that parse sys.argv see only their own flags
    status = "ok"
    try:
        with contextlib.redirect_stdout(tee):
            main()
    except SystemExit as e:
        if e.code not in (None, 0):
            status = f"exited with {e.code}"
    except Exception as e:  # noqa: BLE001
        status = f"failed: {type(e).__name__}: {e}"
        tee.write(traceback.format_exc())
    finally:
        sys.argv = saved_argv
    return status, tee.text()


def main(argv=None):
    p = argparse.ArgumentParser(description="Run every decodex benchmark; tables into one markdown file.")
    p.add_argument("--out", required=True, help="markdown file to write (overwritten)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of op benchmarks (default: all)")
    p.add_argument("--decode", default=None, metavar="ARGS",
                   help='also run bench.decode with these arguments (e.g. "--quick"; "" for the defaults)')
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    jobs = [(op.strip(), []) for op in args.ops.split(",") if op.strip()]
    unknown = [name for name, _ in jobs if name not in OPS]
    if unknown:
        p.error(f"--ops: no op benchmark {', '.join(map(repr, unknown))}; choose from {', '.join(OPS)}")
    if args.decode is not None:
        jobs.append(("decode", shlex.split(args.decode)))
    with open(args.out, "w") as f:
        f.write("# decodex benchmarks\n\n")
    summary = []
    for name, argv_ in jobs:
        t0 = time.perf_counter()
        print(f"== bench.{name} ==", flush=True)
        status, text = run_module(name, argv_)
        took = time.perf_counter() - t0
        summary.append((name, status, took))
        _free_gpu_memory()
        with open(args.out, "a") as f:
            f.write(f"## bench.{name}\n\n")
            if status != "ok":
                f.write(f"**{status}**\n\n")
            # Tables are markdown already; anything else (notes, tracebacks) goes in a code block.
            tables, other = _split_tables(text)
            f.write(tables)
            if other.strip():
                f.write("```\n" + other.strip() + "\n```\n\n")
        if status != "ok":
            print(f"bench.{name}: {status}", flush=True)
    lines = ["| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s} | {t:.0f} |" for n, s, t in summary]
    with open(args.out, "a") as f:
        f.write("## summary\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"tables written to {args.out}")
    return 0 if all(s == "ok" for _, s, _ in summary) else 1


def _free_gpu_memory():
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort between benchmarks
        pass


def _split_tables(text: str) -> tuple[str, str]:
    """(the `### title` + `| ... |` table blocks, the other lines)."""
    tables, other = [], []
    in_table = False
    for line in text.splitlines():
        if line.startswith("### "):
            in_table = True
            tables.append(line)
        elif in_table and (line.startswith("|") or not line.strip()):
            tables.append(line)
            if not line.strip() and len(tables) > 2 and tables[-2].startswith("|"):
                in_table = False
        else:
            in_table = False
            other.append(line)
    return "\n".join(tables) + ("\n\n" if tables else ""), "\n".join(other)


if __name__ == "__main__":
    sys.exit(main())
