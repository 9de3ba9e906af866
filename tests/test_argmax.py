"""decodex::argmax: out[b] (int64) = argmax(logits[b, :]), bf16 or fp32 logits, ties to the lowest
index, NaN counted as the largest value (torch.argmax's rule).

GPU tests compare to decodex.reference.argmax (torch.argmax on the CPU) for vocabulary-sized and
odd V (the split path, the one-block path and the scalar tail), planted ties and NaNs, -inf rows,
unaligned rows, batches past the split path's row limit, many launches and CUDA-graph replays in a
row (the last-block counter must reset itself), opcheck, and every argument check. CPU tests:
schema, fake impl, dispatcher refusal.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph

BS = [1, 3, 8, 64]
VS = [1, 7, 1000, 32003, 151936, 152064]
DTYPES = [torch.bfloat16, torch.float32]


def _logits(B, V, dtype, scale=3.0):
    return (scale * torch.randn(B, V, device="cuda")).to(dtype)


def _run(logits):
    out = torch.full((logits.shape[0],), -12345, dtype=torch.int64, device="cuda")  # poison
    torch.ops.decodex.argmax(logits, out)
    return out


def _check(logits):
    got = _run(logits).cpu()
    want = reference.argmax(logits.cpu())
    assert torch.equal(got, want), f"rows differ: {(got != want).nonzero().flatten().tolist()[:10]}; got " \
                                   f"{got.tolist()[:8]}, want {want.tolist()[:8]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("B", BS)
def test_argmax_values(B, V, dtype):
    _check(_logits(B, V, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_max_at_the_edges(dtype):
    """The maximum in the first element, the last element (the scalar tail when V % 8 != 0) and at
    chunk boundaries of the split path."""
    for V in (151936, 32003):
        logits = _logits(6, V, dtype)
        for b, i in enumerate((0, V - 1, 127 * 8, 128 * 8, 128 * 8 - 1, V // 2)):
            logits[b, i] = 100.0
        _check(logits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_go_to_the_lowest_index(dtype):
    V = 151936
    logits = _logits(4, V, dtype)
    logits[0, [5000, 70000, 150000]] = 50.0  # in different blocks: the combine must keep the lowest
    logits[1, [150000, 151935]] = 50.0
    logits[2] = 1.25  # all equal: index 0
    logits[3, [8, 9, 10]] = 50.0  # in one vector
    _check(logits)
    assert _run(logits).tolist() == [5000, 150000, 0, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_nan_and_inf(dtype):
    """NaN is the largest (first NaN wins, as torch.argmax); +inf beats finite; -inf rows give 0;
    -0 and +0 tie (lowest index)."""
    V = 50000
    logits = _logits(6, V, dtype)
    logits[0, [30000, 40000]] = float("nan")
    logits[0, 100] = float("inf")
    logits[1, 777] = float("inf")
    logits[2] = float("-inf")
    logits[3] = -1.0
    logits[3, 9] = -0.0
    logits[3, 4] = 0.0
    logits[4] = -1.0
    logits[4, 4] = -0.0
    logits[4, 9] = 0.0
    logits[5, 49999] = float("nan")
    want = [30000, 777, 0, 4, 4, 49999]
    assert reference.argmax(logits.cpu()).tolist() == want  # the rule being matched
    assert _run(logits).tolist() == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_unaligned_and_strided_rows(dtype):
    """Rows that are not 16-byte aligned take the scalar path; a row view of a wider buffer."""
    big = _logits(3, 20011, dtype)
    _check(big[:, 1:20001])  # offset 1: unaligned base, row stride 20011
    _check(big[:, :20000])
    _check(big[1:2, 3:19003])  # B = 1, unaligned
    _check(_logits(1, 151936, dtype).expand(5, 151936))  # row stride 0


@pytest.mark.gpu
def test_argmax_many_rows_past_split_limit():
    """B > 256 takes one block per row (no static partials)."""
    _check(_logits(300, 5000, torch.bfloat16))
    _check(_logits(257, 151936, torch.bfloat16))


@pytest.mark.gpu
def test_argmax_repeated_launches_reset_state():
    """The split path's per-row counters reset themselves: many launches with changing B and V in a
    row, each exact."""
    for i in range(40):
        B = [1, 8, 3, 64, 256][i % 5]
        V = [151936, 152064, 4099][i % 3]
        _check(_logits(B, V, torch.bfloat16))


@pytest.mark.gpu
def test_argmax_cuda_graph():
    """Captured once, replayed with new logits written on the device; replays back to back."""
    B, V = 8, 151936
    logits = _logits(B, V, torch.bfloat16)
    out = torch.zeros(B, dtype=torch.int64, device="cuda")
    graph = capture_graph(lambda: torch.ops.decodex.argmax(logits, out))
    for _ in range(10):
        logits.copy_(_logits(B, V, torch.bfloat16))
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference.argmax(logits.cpu()))
    for _ in range(20):
        graph.replay()  # back to back, same inputs
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.argmax(logits.cpu()))


@pytest.mark.gpu
def test_argmax_opcheck():
    logits = _logits(3, 1000, torch.bfloat16)
    torch.library.opcheck(torch.ops.decodex.argmax.default, (logits, torch.empty(3, dtype=torch.int64, device="cuda")))


def _raises(match, logits, out):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.argmax(logits, out)


@pytest.mark.gpu
def test_argmax_rejects():
    lg = _logits(2, 100, torch.bfloat16)
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    _raises("logits must have dtype", lg.half(), out)
    _raises("out must have dtype", lg, out.int())
    _raises("out must have shape", lg, torch.empty(3, dtype=torch.int64, device="cuda"))
    _raises("logits must be 2-D", lg[0], out)
    _raises("logits must be contiguous along V", _logits(100, 2, torch.bfloat16).t(), out)
    _raises("V = logits.size", torch.empty(2, 0, dtype=torch.bfloat16, device="cuda"), out)
    _raises("out must be a CUDA tensor", lg, out.cpu())


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_argmax_schema():
    s = str(torch.ops.decodex.argmax.default._schema)
    assert s == "decodex::argmax(Tensor logits, Tensor(a!) out) -> ()", s


@pytest.mark.ext
def test_argmax_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lg = torch.empty(3, 1000, device="cuda", dtype=torch.bfloat16)
        assert torch.ops.decodex.argmax(lg, torch.empty(3, device="cuda", dtype=torch.int64)) is None


@pytest.mark.ext
def test_argmax_meta_opcheck():
    lg = torch.empty(3, 1000, device="meta", dtype=torch.bfloat16)
    out = torch.empty(3, device="meta", dtype=torch.int64)
    torch.library.opcheck(torch.ops.decodex.argmax.default, (lg, out),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_argmax_cpu_tensors_refused():
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.argmax(torch.randn(2, 10), torch.empty(2, dtype=torch.int64))
