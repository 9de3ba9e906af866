"""The benchmark harness's arithmetic, which needs no GPU: how many input sets make a stack L2-cold,
what a table row holds, and how the table prints; and the benchmarks' usage errors. (The timing
itself runs on the GPU only.)"""
import argparse
import importlib

import pytest
import torch

import bench.common as bc
from bench import gemv, lt_linear, run_all


def test_copies_for_exceeds_the_cold_stack():
    assert bc.copies_for(1 << 20) * (1 << 20) >= bc.COLD_BYTES
    assert bc.copies_for(10 << 30) == 4  # a single huge set still gets the minimum
    assert bc.copies_for(1) == 512  # tiny sets are capped


def test_cycled_repeats_whole_passes():
    # A timed graph cycles its input sets in order, whole passes only, so every call still comes
    # after all the other sets (L2-cold) and each set is used equally often.
    assert bc.cycled(["a", "b", "c"], 8) == ["a", "b", "c"] * 3
    assert bc.cycled(["a", "b"], 2) == ["a", "b"]
    assert bc.cycled(list(range(40)), 32) == list(range(40))
    assert bc.cycled(["a"], 1) == ["a"]
    assert bc.cycled(["a"], bc.MIN_GRAPH_CALLS) == ["a"] * bc.MIN_GRAPH_CALLS


def test_compare_row(monkeypatch):
    timed = []

    def fake_time_graph(calls, reps=30):
        for c in calls:
            c()
        timed.append(len(calls))
        return 2.0 if len(timed) == 1 else 6.0  # ours first, then the baseline

    monkeypatch.setattr(bc, "time_graph", fake_time_graph)
    monkeypatch.setattr(bc, "copies_for", lambda nbytes: 3)
    monkeypatch.setattr(bc.torch.cuda, "empty_cache", lambda: None)
    seen = {"ours": [], "base": []}
    made = iter(range(100))
    row = bc.compare_row("op", 4_000_000, 4000.0, lambda: (next(made), "out"),
                         lambda a, b: seen["ours"].append((a, b)), lambda a, b: seen["base"].append((a, b)))
    assert timed == [3, 3]
    assert seen["ours"] == seen["base"] == [(0, "out"), (1, "out"), (2, "out")]
    # 4 MB in 2 us = 2000 GB/s = 50% of 4000 GB/s; the baseline is 3x slower.
    assert row == ["op", 2.0, 6.0, 2000.0, 50.0, 3.0]


def test_print_table(tmp_path, capsys):
    out = tmp_path / "t.md"
    text = bc.print_table("title", ["a", "bb"], [[1.234, "x"], [123.4, "yy"]], file=str(out))
    assert "### title" in text and "|  1.23 |  x |" in text and "| 123.4 | yy |" in text
    assert out.read_text().startswith("### title")
    assert "### title" in capsys.readouterr().out


def test_expected_experts():
    """One row reads its k experts; many rows approach all E; two rows of 8 of 128 share 0.5 in
    expectation (8 * 8 / 128)."""
    assert bc.expected_experts(128, 8, 1) == 8.0
    assert bc.expected_experts(128, 8, 2) == pytest.approx(16 - 0.5)
    assert 127 < bc.expected_experts(128, 8, 1000) <= 128


def test_int_list():
    assert bc.int_list("1,8,64") == [1, 8, 64]
    for bad in ("x", "1,,2", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"comma-separated integers, got '{bad}'"):
            bc.int_list(bad)


@pytest.mark.parametrize("module", [gemv, lt_linear])
def test_ms_that_is_not_integers_is_a_usage_error(module, capsys):
    with pytest.raises(SystemExit):
        module.main(["--ms", "1,x"])
    assert "argument --ms: comma-separated integers, got '1,x'" in capsys.readouterr().err


def test_require_gpu_says_why(monkeypatch):
    # Every benchmark calls it before its first CUDA call: no GPU is one line, not a driver traceback.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"decodex's benchmarks need a CUDA GPU"):
        bc.require_gpu()


def test_run_all_ops_have_modules():
    # Every name --ops accepts is a benchmark with a main() (run_all no longer skips missing ones).
    for name in run_all.OPS:
        assert callable(importlib.import_module(f"bench.{name}").main), name


def test_run_all_rejects_unknown_ops(tmp_path, capsys):
    out = tmp_path / "r.md"
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(out), "--ops", "gemv,nosuch"])
    assert "--ops: no op benchmark 'nosuch'; choose from gemv, " in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran or was written
