"""conftest.py's --shard K/N (CPU): the shares of a test file are disjoint and cover it, and a bad
spec is a usage error that names the option. Runs pytest in subprocesses, collection only."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _collect(target, *args):
    r = subprocess.run([sys.executable, "-m", "pytest", os.path.join(HERE, target), "--collect-only", "-q",
                        "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=300)
    return r, [line for line in r.stdout.splitlines() if "::" in line]


# GPU cases are collected (then skipped) anywhere. test_model.py lists 9 CPU tests, then 9 GPU ones:
# had --shard cut before -m, its GPU share 0 of 2 would be their 2nd, 4th, ... rather than 1st, 3rd, ...
@pytest.mark.parametrize("target, select, n", [("test_argmax.py", (), 3), ("test_model.py", ("-m", "gpu"), 2)])
def test_shards_are_disjoint_and_cover_the_file(target, select, n):
    """Every n-th test of what is left after -m, in order (so the shares of the GPU tests are even)."""
    r, everything = _collect(target, *select)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(everything) >= 2 * n
    shares = []
    for k in range(n):
        r, ids = _collect(target, *select, "--shard", f"{k}/{n}")
        assert r.returncode == 0, r.stdout + r.stderr
        shares.append(ids)
    assert sorted(sum(shares, [])) == sorted(everything)
    assert all(ids == everything[k::n] for k, ids in enumerate(shares))


@pytest.mark.parametrize("spec", ["3/3", "1/0", "x", "-1/2", "1/2/3"])
def test_bad_shard_is_a_usage_error(spec):
    r, _ = _collect("test_argmax.py", f"--shard={spec}")
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error
    assert "--shard must be K/N" in r.stderr and repr(spec) in r.stderr
