"""conftest.py's --shard K/N (CPU): the shares of a test file are disjoint and cover it, and a bad
spec is a usage error that names the option. Runs pytest in subprocesses, collection only."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "test_argmax.py")  # GPU cases are collected (then skipped) anywhere


def _collect(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", TARGET, "--collect-only", "-q", "-p", "no:cacheprovider",
                        *args], capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=300)
    return r, [line for line in r.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize("select", [(), ("-m", "gpu")])
def test_shards_are_disjoint_and_cover_the_file(select):
    """Every third test of what is left after -m (so the shares of the GPU tests are even)."""
    r, everything = _collect(*select)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(everything) >= 6
    shares = []
    for k in range(3):
        r, ids = _collect(*select, "--shard", f"{k}/3")
        assert r.returncode == 0, r.stdout + r.stderr
        assert ids, f"shard {k}/3 is empty"
        shares.append(ids)
    assert sorted(sum(shares, [])) == sorted(everything)
    assert len(set(sum(shares, []))) == len(everything)
    assert all(ids == everything[k::3] for k, ids in enumerate(shares))


@pytest.mark.parametrize("spec", ["3/3", "1/0", "x", "-1/2", "1/2/3"])
def test_bad_shard_is_a_usage_error(spec):
    r, _ = _collect(f"--shard={spec}")
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error
    assert "--shard must be K/N" in r.stderr and repr(spec) in r.stderr
