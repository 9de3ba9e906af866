"""bench.decode's argument handling (CPU): the cases it parses and what --sweep-gemv accepts."""
import pytest

from bench import decode


def test_parse_cases():
    assert decode.parse_cases("1x1024,64x1k,1x32K") == [(1, 1024), (64, 1024), (1, 32768)]


@pytest.mark.parametrize("flags,message", [
    (["--cases", "1x"], "--cases: BATCHxCONTEXT items such as 1x1024 or 64x1k, got '1x'"),
    (["--cases", "1x1024,8"], "--cases: BATCHxCONTEXT items such as 1x1024 or 64x1k, got '8'"),
    (["--cases", "1x1kk"], "--cases: BATCHxCONTEXT items such as 1x1024 or 64x1k, got '1x1kk'"),
    (["--cases", "0x1024"], "--cases: batch and context must be >= 1, got '0x1024'"),
    (["--cases", "1x-5"], "--cases: batch and context must be >= 1, got '1x-5'"),
    (["--profile", "--profile-cases", "1x0"], "--profile-cases: batch and context must be >= 1, got '1x0'"),
])
def test_bad_cases_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(flags)
    assert message in capsys.readouterr().err


def test_sweep_gemv_cases():
    assert decode.parse_args(["--sweep-gemv"]).cases == [(1, 1024), (8, 1024)]
    assert decode.parse_args(["--sweep-gemv", "--cases", "4x2k"]).cases == [(4, 2048)]
    assert decode.parse_args([]).cases == decode.CASES
    with pytest.raises(SystemExit):  # more rows than the GEMV takes: nothing of it to tune
        decode.parse_args(["--sweep-gemv", "--cases", "1x1024,64x1024"])


def test_sweep_shapes_and_rms_arguments():
    args = decode.parse_args(["--sweep-gemv", "--sweep-shapes", "37888x3584,2048X1536", "--rms-in-gemv",
                              "qkv+gate_up"])
    assert args.sweep_shapes == [(37888, 3584), (2048, 1536)]
    assert args.rms_in_gemv == ("qkv", "gate_up")
    assert decode.parse_args(["--sweep-gemv", "--rms-in-gemv", "qkv"]).rms_in_gemv == ("qkv",)
    assert decode.parse_args(["--sweep-gemv"]).rms_in_gemv is None
    for bad in (["--sweep-gemv", "--rms-in-gemv", "gate_up"], ["--sweep-gemv", "--sweep-shapes", "37888"],
                ["--sweep-gemv", "--sweep-shapes", "ax3"], ["--rms-in-gemv", "qkv"],
                ["--sweep-shapes", "8x8"], ["--sweep-json", "s.jsonl"]):
        with pytest.raises(SystemExit):
            decode.parse_args(bad)


def test_profile_cases_argument():
    """--profile-cases: the profiled cases instead of PROFILE_CASES, only with --profile."""
    assert decode.parse_args(["--profile"]).profile_cases == decode.PROFILE_CASES
    assert decode.parse_args(["--profile", "--profile-cases", "1x1k,8x2048"]).profile_cases == [(1, 1024), (8, 2048)]
    with pytest.raises(SystemExit):
        decode.parse_args(["--profile-cases", "1x1024"])


def test_plans_argument():
    """--plans: the engine's plans above 8 rows to measure (the A/B without the wide gemv)."""
    assert decode.parse_args([]).plans is None
    assert decode.parse_args(["--plans", "cublas,gemv8"]).plans == ("cublas", "gemv8")
    for bad in ("gemv,gemv8", "cublas,fast"):
        with pytest.raises(SystemExit):
            decode.parse_args(["--plans", bad])


def test_live_plans_cases():
    """--live-plans: only cases of more than 8 rows (the plans exist only there); 64x1024 by default."""
    assert decode.parse_args(["--live-plans"]).cases == [(64, 1024)]
    assert decode.parse_args(["--live-plans", "--cases", "16x1k,32x1k"]).cases == [(16, 1024), (32, 1024)]
    with pytest.raises(SystemExit):
        decode.parse_args(["--live-plans", "--cases", "8x1024,64x1024"])


def test_force_plans_argument():
    """--force-plans: PRODUCT=PLAN pairs, checked; not with the sweeps, which set plans themselves."""
    assert decode.parse_args([]).force_plans is None
    got = decode.parse_args(["--force-plans", "gate_up=gemv, o=gemv8"]).force_plans
    assert got == {"gate_up": "gemv", "o": "gemv8"}
    for bad in ("gate_up", "mlp=gemv", "o=fast", "o=gemv,qkv"):
        with pytest.raises(SystemExit):
            decode.parse_args(["--force-plans", bad])
    with pytest.raises(SystemExit):
        decode.parse_args(["--live-plans", "--force-plans", "o=gemv"])


def test_forced_runner_takes_the_plans_unmeasured():
    """The --force-plans runner: the named products get their plan, the rest cuBLAS, with no timing
    and no whole-step check (a stand-in without a GPU: the two overridden methods only)."""
    from decodex import engine

    cls = decode._forced_runner({"gate_up": "gemv", "o": "gemv8"})
    r = cls.__new__(cls)
    r.linear_plan = {}
    r._plan_linears(32)
    assert r.linear_plan == {(32, name): {"gate_up": "gemv", "o": "gemv8"}.get(name, "cublas")
                             for name in engine.PRODUCTS}
    r._capture_as_chosen = lambda n, greedy: ("as chosen", n, greedy)
    assert r._capture_checking_plans(32, True) == ("as chosen", 32, True)


def test_no_fused_rope_argument():
    """--no-fused-rope: the runner's fuse_rope_attention off (the A/B of rope_append_attention)."""
    assert decode.parse_args([]).fuse_rope is True
    assert decode.parse_args(["--no-fused-rope"]).fuse_rope is False


def test_sweep_gemv_keeps_only_a_real_gain(monkeypatch, capsys, tmp_path):
    """The greedy rule on a stand-in runner (no GPU): a step time that depends on the forced
    configurations. Only the down shape's "1,1,1,4" is 10% faster; the other shapes' best is within
    0.3%, so nothing else is kept, each later sweep carries the kept entry, and the environment is
    left as found. --sweep-json's file gets one line a shape with every configuration's time."""
    import json
    import os
    import types

    import torch

    from bench.gemv import ENV

    seen = []

    class Runner:
        def drop_graphs(self):
            pass

        def capture(self, batch):
            return batch

        def time_steps(self, n, steps):
            env = os.environ.get(ENV, "")
            seen.append(env)
            ms = 1.0 - (0.1 if "32,256:1,1,1,4" in env else 0.0) - (0.001 if "48,32:1,1,1,8" in env else 0.0)
            return [ms] * steps

    layer = types.SimpleNamespace(down_w=torch.empty(32, 256), gate_up_w=torch.empty(48, 32), router_w=None,
                                  qkv_w=torch.empty(40, 32), o_w=torch.empty(32, 32))
    model = types.SimpleNamespace(layers=[layer], lm_head=torch.empty(64, 32))
    monkeypatch.setattr(decode, "make_runner", lambda m, b, c: Runner())
    monkeypatch.setattr(decode, "load_rows", lambda r, b, c: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.delenv(ENV, raising=False)
    path = tmp_path / "sweeps.jsonl"
    assert decode.sweep_gemv(model, 1, 1024, json_path=str(path), label="stand-in") == {(32, 256): "1,1,1,4"}
    assert ENV not in os.environ
    from bench.gemv import _configs

    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert [(d["N"], d["K"], d["kept"]) for d in lines] == [(32, 256, "1,1,1,4"), (48, 32, None), (40, 32, None),
                                                             (32, 32, None), (64, 32, None)]
    down = lines[0]
    assert (down["gpu"], down["model"], down["batch"], down["context"]) == ("stand-in GPU", "stand-in", 1, 1024)
    assert down["others"] == {}
    assert set(down["ms"]) == set(_configs(32, 256, True)) and down["ms"]["1,1,1,4"] == pytest.approx(0.9)
    assert down["before_ms"] == pytest.approx(1.0) and lines[1]["others"] == {"32,256": "1,1,1,4"}
    assert set(lines[1]["ms"]) == set(_configs(48, 32, True))
    later = [e for e in seen if "48,32:" in e or "40,32:" in e]
    assert later and all(e.startswith("32,256:1,1,1,4;") for e in later)
    assert "all kept: DECODEX_GEMV_CONFIG=\"32,256:1,1,1,4\"" in capsys.readouterr().out
    # A mixture-of-experts layer: no down or gate|up product; the router's shape is swept instead.
    seen.clear()
    moe = types.SimpleNamespace(down_w=None, gate_up_w=None, router_w=torch.empty(8, 32),
                                qkv_w=torch.empty(40, 32), o_w=torch.empty(32, 32))
    assert decode.sweep_gemv(types.SimpleNamespace(layers=[moe], lm_head=torch.empty(64, 32)), 1, 1024) == {}
    assert {e.split(":")[0] for e in seen if e} == {"8,32", "40,32", "32,32", "64,32"}


def test_kernel_times_gaps():
    """--profile's critical path: each kernel's end minus the previous end, whatever its span (a
    kernel launched early under PDL has a long span but adds only its gap)."""
    events = [(10.0, 10.0, "a"), (30.0, 25.0, "b"), (32.0, 20.0, "c"), (40.0, 8.0, "b")]
    got = decode.kernel_times(reversed(events))  # any order: sorted by end
    assert got == {"a": [1, 10.0, 0, 0.0], "b": [2, 33.0, 2, 28.0], "c": [1, 20.0, 1, 2.0]}
    assert sum(v[3] for v in got.values()) == 40.0 - 10.0  # the gaps add up to the span after the first


def test_ab_arguments():
    """--ab: variants of NAME=VALUE items (values may hold commas and semicolons); its own run."""
    args = decode.parse_args(["--ab", "DECODEX_ATTN_CLUSTER=0", "--ab",
                              "DECODEX_GEMV_CONFIG=37888,3584:1,2,1,8;512,3584:1,7,2,8 DECODEX_ATTN_CLUSTER=1"])
    assert args.ab == [{"DECODEX_ATTN_CLUSTER": "0"},
                       {"DECODEX_GEMV_CONFIG": "37888,3584:1,2,1,8;512,3584:1,7,2,8", "DECODEX_ATTN_CLUSTER": "1"}]
    assert args.cases == decode.AB_CASES and args.ab_reps == decode.AB_REPS
    assert decode.parse_args(["--ab", "X=", "--cases", "1x2k", "--ab-reps", "5"]).cases == [(1, 2048)]
    assert decode.parse_args([]).ab is None
    for bad in (["--ab", "DECODEX_PDL"], ["--ab", "DECODEX_PDL=0"], ["--ab", "X=1 DECODEX_PDL=0"], ["--ab", "=1"], ["--ab", "1X=2"], ["--ab", " "],
                ["--ab", "X=1", "--sweep-gemv"], ["--ab", "X=1", "--live-plans"], ["--ab", "X=1", "--ab-reps", "0"],
                ["--ab", "X=1", "--ab", "X=1"], ["--ab", "X=1", "--profile"]):
        with pytest.raises(SystemExit):
            decode.parse_args(bad)


def test_ab_step_interleaves_and_restores(monkeypatch, capsys):
    """On a stand-in runner (no GPU): each round times "as is" and every variant (every other round
    in reverse order), each timing sees exactly its variant's variables over the environment as
    found, and the environment is restored."""
    import os

    seen = []

    def fake_live_step_ms(runner, batch, context):
        seen.append((os.environ.get("DX_AB_A"), os.environ.get("DX_AB_B")))
        return 2.0 if os.environ.get("DX_AB_A") == "1" else 1.0

    made = []
    monkeypatch.setattr(decode, "make_runner", lambda *a: made.append(a[1:]) or object())
    monkeypatch.setattr(decode, "live_step_ms", fake_live_step_ms)
    monkeypatch.delenv("DX_AB_A", raising=False)
    monkeypatch.setenv("DX_AB_B", "kept")
    got = decode.ab_step(None, 1, 1024, [{"DX_AB_A": "1"}, {"DX_AB_B": "x"}], reps=2, plans=("cublas",))
    assert made == [(1, 1024, ("cublas",), True, None)]  # one runner, with the table's options
    # Round 0 in order, round 1 reversed: a drift within a round does not always favour one variant.
    assert seen == [(None, "kept"), ("1", "kept"), (None, "x"), (None, "x"), ("1", "kept"), (None, "kept")]
    assert got == {"as is": [1.0, 1.0], "DX_AB_A=1": [2.0, 2.0], "DX_AB_B=x": [1.0, 1.0]}
    assert "DX_AB_A" not in os.environ and os.environ["DX_AB_B"] == "kept"
    assert "DX_AB_A=1: median 2.0000 ms (min 2.0000), +100.00% against as is" in capsys.readouterr().out


@pytest.mark.parametrize("key", list(decode.MODELS))
def test_presets_match_transformers_config(key):
    """Every preset is a config decodex loads, and transformers' model beside it in the same run
    has the same shapes and RoPE (its class from the preset's model_type)."""
    pytest.importorskip("transformers")
    from decodex.config import ModelConfig

    ours, theirs = ModelConfig.from_dict(decode.config_dict(key)), decode.hf_config(key)
    assert theirs.model_type == ours.model_type
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(theirs, field) == getattr(ours, field), field
    if ours.moe_layers:
        assert (theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size, theirs.norm_topk_prob) == (
            ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.norm_topk_prob)
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta,
                                                        **(theirs.rope_scaling or {})}
    assert rope["rope_theta"] == ours.rope_theta
    assert rope.get("factor") == (ours.rope_scaling or {}).get("factor")


def test_gemv_model_shapes():
    """bench.gemv --models derives each product's shape from a preset; for Qwen2.5-1.5B and -7B
    that is the issue's SHAPES list."""
    from bench import gemv

    assert [r[1:] for r in gemv.model_shapes(["1.5b", "7b"])] == [r[1:] for r in gemv.SHAPES]
    assert ("Llama-3.1-8B", "gate|up", 28672, 4096) in gemv.model_shapes(["llama3.1-8b"])
    with pytest.raises(ValueError, match="--models"):
        gemv.model_shapes(["8b"])


def test_gemv_table_speedups(monkeypatch):
    """bench.gemv's table: "speedup" is cuBLAS over the prefetch_weight call, "plain speedup" over
    the plain call (timings stubbed: plain 2 us, prefetch 1, cuBLAS and cuBLASLt 3)."""
    from bench import gemv

    monkeypatch.setattr(gemv, "_stack", lambda N, K: [None])
    monkeypatch.setattr(gemv, "_time_ours", lambda w, M, prefetch_weight=False: 1.0 if prefetch_weight else 2.0)
    monkeypatch.setattr(gemv, "_time_cublas", lambda w, M, plan="cublas": 3.0)
    (row,) = gemv.rows(1000.0, ms=[1], only="7B qkv")
    got = dict(zip(gemv.HEADERS, row))
    assert got["decodex us"] == 2.0 and got["prefetch_weight us"] == 1.0
    assert got["speedup"] == 3.0 and got["plain speedup"] == 1.5


def test_gemv_sweep_plain_calls(monkeypatch, capsys):
    """bench.gemv --sweep --plain sweeps plain calls (prefetch_weight=False); --plain alone is an
    error naming it, since the table times both kinds of call."""
    from bench import gemv

    seen = []
    monkeypatch.setattr(gemv, "sweep", lambda only, ms, shapes, prefetch_weight=True: seen.append(
        (only, tuple(ms), prefetch_weight)))
    gemv.main(["--sweep", "--plain", "--only", "7B qkv", "--ms", "1"])
    gemv.main(["--sweep", "--only", "7B qkv"])
    assert seen == [("7B qkv", (1,), False), ("7B qkv", (1, 8), True)]
    with pytest.raises(SystemExit):
        gemv.main(["--plain"])
    assert "--plain goes with --sweep" in capsys.readouterr().err
    assert len(seen) == 2
