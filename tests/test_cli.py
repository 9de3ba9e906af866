"""The `decodex` command: `generate` in a subprocess on the converted SmolLM2 (text on stdout, the
stats line last on stderr), options in-process, errors, and `convert-gguf`. CPU only."""
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from _smollm import require_gguf, smollm_dir
from decodex import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS_LINE = re.compile(r"^\[(\d+) tokens, (\d+\.\d) tok/s, time to first token (\d+) ms\]$")


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")  # one thread: see conftest.one_thread
    return subprocess.run([sys.executable, "-m", "decodex", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_subprocess():
    r = _run("generate", "What is the capital of France?", "--model", smollm_dir(),
             "--max-new-tokens", "16", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    m = STATS_LINE.match(last)
    assert m, last
    assert 1 <= int(m.group(1)) <= 16
    assert float(m.group(2)) > 0
    assert "decodex: loaded" in r.stderr  # loading progress goes to stderr, not stdout
    assert "decodex" not in r.stdout


def test_generate_options_in_process(capsys, one_thread):
    d = smollm_dir()
    assert cli.main(["generate", "What is the capital of France?", "--model", d, "--device", "cpu",
                     "--max-new-tokens", "16", "--stop", "Paris", "France"]) == 0
    out, err = capsys.readouterr()
    assert out == "The capital of \n"  # cut before the earliest stop string
    assert STATS_LINE.match(err.strip().splitlines()[-1])
    assert cli.main(["generate", "Once upon a time", "--model", d, "--device", "cpu", "--no-chat",
                     "--max-new-tokens", "4", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9",
                     "--seed", "3", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and STATS_LINE.match(err.strip().splitlines()[-1])


def test_chat_keeps_the_conversation(capsys, monkeypatch, one_thread):
    """Each turn's prompt is the conversation so far (system message, earlier turns and answers);
    /reset starts again; an empty line ends the session. One stats line a turn on stderr."""
    import io
    G = importlib.import_module("decodex.generate")
    prompts = []
    real = G.generate
    monkeypatch.setattr(G, "generate", lambda model, prompt, **k: prompts.append(
        [dict(m) for m in prompt]) or real(model, prompt, **k))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n/reset\n"
                                                  "Hi\n\nnot read\n"))
    assert cli.main(["chat", "--model", smollm_dir(), "--device", "cpu", "--max-new-tokens", "6",
                     "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    assert len(prompts) == 3 and len([l for l in err.splitlines() if STATS_LINE.match(l)]) == 3
    system = {"role": "system", "content": "Be brief."}
    assert prompts[0] == [system, {"role": "user", "content": "What is the capital of France?"}]
    first = prompts[1][2]["content"]
    assert prompts[1][2]["role"] == "assistant" and first and out.startswith(first + "\n")
    assert prompts[1][3] == {"role": "user", "content": "And of Italy?"} and len(prompts[1]) == 4
    assert prompts[2] == [system, {"role": "user", "content": "Hi"}]


def test_errors(capsys, tmp_path):
    assert cli.main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "decodex: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate"])  # the prompt is required
    with pytest.raises(SystemExit):
        cli.main([])


@pytest.mark.parametrize("flag,value,match", [("--top-p", "0", "top_p must be in"),
                                              ("--temperature", "nan", "temperature must be finite"),
                                              ("--top-k", "-2", "top_k must be in")])
def test_bad_sampling_values_fail_before_loading(capsys, monkeypatch, flag, value, match):
    G = importlib.import_module("decodex.generate")  # the module, which decodex.generate (the function) hides
    monkeypatch.setattr(G, "load", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    assert cli.main(["generate", "hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodex: error:") and match in err


def test_convert_gguf_subprocess(tmp_path):
    gguf_path = require_gguf()
    out = tmp_path / "smol"
    r = _run("convert-gguf", str(gguf_path), str(out))
    assert r.returncode == 0, r.stderr
    assert "converted" in r.stderr and r.stdout == ""
    ref = smollm_dir()
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        with open(out / name) as a, open(os.path.join(ref, name)) as b:
            assert json.load(a) == json.load(b), name

    def digest(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    for name in ("model.safetensors", "tokenizer.json"):
        assert digest(out / name) == digest(os.path.join(ref, name)), name  # deterministic output
