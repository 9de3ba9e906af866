"""bench.gemv_rule (CPU): its copy of csrc/gemv.cu's rule_config, the costs it computes from sweep
lines, and that csrc/gemv.cu's constants are the fit's best on the sweeps shipped in bench/."""
import json

import pytest

from bench import gemv_rule


def test_rule_constants_and_configs_match_gemv_cu():
    steps, warps = gemv_rule.rule_constants()
    assert (steps, warps) == (8, 5)
    # The same picks csrc/gemv.cu's static_assert holds its rule_config to.
    assert gemv_rule.rule_config(2048, steps, warps) == "1,4,2,4"
    assert gemv_rule.rule_config(8192, steps, warps) == "1,4,8,4"
    assert gemv_rule.rule_config(896, steps, warps).split(",")[2] == "1"
    assert gemv_rule.rule_config(18944, steps, warps).endswith(",8")
    assert gemv_rule.rule_config(2048, steps, warps, clusters=False) == "1,8,1,4"
    for K in range(8, 65537, 8):
        for clusters in (True, False):
            wr, wk, c, u = map(int, gemv_rule.rule_config(K, steps, warps, clusters).split(","))
            assert wr == 1 and 1 <= wk <= 8 and c in ((1, 2, 4, 8) if clusters else (1,)) and u in (4, 8)
            assert wk * c <= -(-K // 32), K  # every k-range gets a k-step


@pytest.mark.ext
def test_rule_copy_matches_gemv_config():
    """bench.gemv_rule's copy against the extension's own choice (torch.ops.decodex.gemv_config) for
    every K up to 64K, with clusters and without, on shapes the table lacks (N = 1)."""
    import torch

    steps, warps = gemv_rule.rule_constants()
    for K in range(8, 65537, 8):
        for clusters in (True, False):
            got = ",".join(map(str, torch.ops.decodex.gemv_config(1, K, 1, clusters)))
            assert got == gemv_rule.rule_config(K, steps, warps, clusters), (K, clusters)


def test_rule_constants_missing(tmp_path):
    path = tmp_path / "gemv.cu"
    path.write_text("constexpr int kOther = 1;\n")
    with pytest.raises(ValueError, match="kRuleSteps"):
        gemv_rule.rule_constants(str(path))


def test_cost_full_and_partial_lines():
    full = dict(model="m", batch=1, N=16, K=64, before_ms=1.1, ms={"1,1,1,4": 1.0, "1,2,1,4": 1.05})
    assert gemv_rule.cost(full, "1,1,1,4") == 0
    assert gemv_rule.cost(full, "1,2,1,4") == pytest.approx(5.0)
    assert gemv_rule.before_cost(full) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="no time for 1,3,1,4"):
        gemv_rule.cost(full, "1,3,1,4")
    partial = dict(full, partial=True)
    assert gemv_rule.cost(partial, "1,3,1,4") == pytest.approx(5.0 + gemv_rule.PARTIAL_MISS)


def test_fixed_configurations():
    a = dict(model="m", batch=1, N=16, K=64, before_ms=1.0, ms={"1,1,1,4": 1.0, "1,2,1,4": 1.1, "1,3,1,4": 1.2})
    b = dict(a, ms={"1,1,1,4": 1.2, "1,2,1,4": 1.0})
    # Only the configurations both lines timed; "1,2,1,4" costs 10% and 0%, "1,1,1,4" 0% and 20%.
    assert gemv_rule.fixed([a, b]) == [(pytest.approx(5.0), "1,2,1,4"), (pytest.approx(10.0), "1,1,1,4")]
    assert gemv_rule.fixed([]) == []


def test_load_names_the_bad_line(tmp_path):
    path = tmp_path / "s.jsonl"
    good = dict(model="m", batch=1, N=16, K=64, before_ms=1.0, ms={"1,1,1,4": 1.0})
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(dict(good, ms={})) + "\n")
    with pytest.raises(ValueError, match=r"s.jsonl:3: not a --sweep-json line"):
        gemv_rule.load([str(path)])
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"s.jsonl:2"):
        gemv_rule.load([str(path)])
    path.write_text(json.dumps(good) + "\n")
    assert gemv_rule.load([str(path)]) == [good]


def test_gemv_cu_constants_are_the_fit_on_the_shipped_sweeps(capsys):
    """If the constants change without a new fit (or new sweeps move the fit), this says so."""
    lines = gemv_rule.load([gemv_rule.DATA])
    steps, warps = gemv_rule.rule_constants()
    ranked = gemv_rule.fit(lines)
    ours = next(m for m, _, s, w in ranked if (s, w) == (steps, warps))
    assert ours <= ranked[0][0] + 0.01
    gemv_rule.main(["--loo", "--top", "3"])
    out = capsys.readouterr().out
    assert f"rule_config (kRuleSteps {steps}, kRuleWarps {warps}) on those" in out
    # The numbers bench/RESULTS.md quotes from this printout (session 45's; sessions 43 and 44
    # quoted theirs from the 51 and 67 lines before sessions 44 and 45 added 16 and 4).
    assert "0.63% of the step a shape against the best; the cost model 1.99%; the rule nearer on 37 of 41" in out
    assert "20 shapes timed with the rule's own choice (models it was not fitted on): 0.96% of the step" in out
    assert "at most 2.91%" in out
    assert "the best, (2,2,4,4), 1.51%; what those shapes ran with 1.07%" in out
    assert "(1.44%), 16 of the 106 configurations would have beaten it" in out
    assert "fitted without the model" in out and "Qwen3-1.7B |" in out
