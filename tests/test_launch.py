"""The launch switch every decodex kernel reads: DECODEX_PDL (programmatic dependent launch), read
once per process at the first launch, so each value runs in its own subprocess. GPU only."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two argmax launches in a fresh process: "ok" where both match torch, else each error's message;
# then the output row as it was left.
SCRIPT = """
import torch, decodex
logits = torch.randn(3, 1001, device="cuda")
out = torch.full((3,), -7, dtype=torch.int64, device="cuda")
for _ in range(2):
    try:
        torch.ops.decodex.argmax(logits, out)
        print("ok" if torch.equal(out, logits.argmax(1)) else f"wrong {out.tolist()}")
    except RuntimeError as e:
        print(str(e).splitlines()[0])
print(out.tolist())
"""


def _run(value):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DECODEX_PDL", None)
    if value is not None:
        env["DECODEX_PDL"] = value
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.gpu
@pytest.mark.parametrize("value", [None, "", "0", "1"])
def test_pdl_switch_values(value):
    lines = _run(value)
    assert lines[:2] == ["ok", "ok"], lines


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["false", "off", "2", "00"])
def test_rejects_bad_pdl_switch(value):
    """Anything but 0 or 1 fails every launch with an error naming DECODEX_PDL (it had been a silent
    "on" for any value not starting with "0"), and nothing is written."""
    lines = _run(value)
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert f'DECODEX_PDL must be 0 or 1 (or unset), got "{value}"' in line, lines
    assert lines[2] == "[-7, -7, -7]", lines
