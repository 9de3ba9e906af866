"""decodex::advance_positions: for live rows (positions[b] >= 0) positions[b] += 1 and
lengths[b] = positions[b] + 1 (the new value); rows with a negative position are left alone.

GPU tests compare to decodex.reference.advance_positions, replay it in a CUDA graph (each replay
advances once more), and check the argument errors. CPU tests: schema, fake impl, dispatcher refusal.
"""
from __future__ import annotations

import pytest
import torch

from decodex import reference
from helpers import capture_graph

BS = [1, 5, 64, 300]


def _state(B):
    positions = torch.randint(-3, 5000, (B,), dtype=torch.int32)
    positions[0] = 0
    if B > 1:
        positions[1] = -1
    lengths = torch.randint(0, 5000, (B,), dtype=torch.int32)
    return positions, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("B", BS)
def test_advance_positions_values(B):
    pos, lens = _state(B)
    want_pos, want_len = reference.advance_positions(pos, lens)
    p, l = pos.cuda(), lens.cuda()
    torch.ops.decodex.advance_positions(p, l)
    assert torch.equal(p.cpu(), want_pos)
    assert torch.equal(l.cpu(), want_len)


@pytest.mark.gpu
def test_advance_positions_cuda_graph():
    pos, lens = _state(7)
    p, l = pos.cuda(), lens.cuda()
    graph = capture_graph(lambda: torch.ops.decodex.advance_positions(p, l))  # warm-up: one step
    pos, lens = reference.advance_positions(pos, lens)
    # Capture does not run the kernel: the state is still one step on.
    assert torch.equal(p.cpu(), pos)
    for _ in range(5):
        graph.replay()
        pos, lens = reference.advance_positions(pos, lens)
    torch.cuda.synchronize()
    assert torch.equal(p.cpu(), pos) and torch.equal(l.cpu(), lens)
    # A slot freed on the device (position -1) stops moving.
    p[2] = -1
    l2 = l[2].item()
    graph.replay()
    torch.cuda.synchronize()
    assert p[2].item() == -1 and l[2].item() == l2


def _raises(match, p, l):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.decodex.advance_positions(p, l)


@pytest.mark.gpu
def test_advance_positions_rejects():
    p = torch.zeros(4, dtype=torch.int32, device="cuda")
    l = torch.zeros(4, dtype=torch.int32, device="cuda")
    _raises("positions must have dtype", p.long(), l)
    _raises("lengths must have dtype", p, l.long())
    _raises("lengths must have shape", p, l[:3])
    _raises("positions must be 1-D", p.view(2, 2), l)
    _raises("positions must be contiguous", torch.zeros(8, dtype=torch.int32, device="cuda")[::2], l)
    _raises("different buffers", p, p)
    _raises("lengths must be a CUDA tensor", p, l.cpu())


@pytest.mark.gpu
def test_advance_positions_opcheck():
    p = torch.arange(4, dtype=torch.int32, device="cuda")
    l = torch.zeros(4, dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.decodex.advance_positions.default, (p, l))


# ---------------------------------------------------------------- CPU


@pytest.mark.ext
def test_advance_positions_schema():
    s = str(torch.ops.decodex.advance_positions.default._schema)
    assert s == "decodex::advance_positions(Tensor(a!) positions, Tensor(b!) lengths) -> ()", s


@pytest.mark.ext
def test_advance_positions_fake_and_meta():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = torch.empty(4, device="cuda", dtype=torch.int32)
        assert torch.ops.decodex.advance_positions(p, torch.empty_like(p)) is None
    p = torch.empty(4, device="meta", dtype=torch.int32)
    torch.library.opcheck(torch.ops.decodex.advance_positions.default, (p, torch.empty_like(p)),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.ext
def test_advance_positions_cpu_tensors_refused():
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.decodex.advance_positions(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))


def test_reference_advance_positions_cpu():
    p = torch.tensor([0, -1, 7], dtype=torch.int32)
    l = torch.tensor([9, 9, 9], dtype=torch.int32)
    new_p, new_l = reference.advance_positions(p, l)
    assert new_p.tolist() == [1, -1, 8] and new_l.tolist() == [2, 9, 9]
