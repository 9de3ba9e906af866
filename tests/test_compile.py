"""The ops trace through torch's compiler stack: torch.export (dynamo + fake tensors +
functionalization of the out-params) on CPU tensors, where only the fake impls can run."""
import pytest
import torch

import decodex  # noqa: F401  (loads the kernels: registers torch.ops.decodex)


class _Block(torch.nn.Module):
    """A slice of a decode step: norm -> GEMV -> silu*mul, all through out-params."""

    def forward(self, x, residual, norm_w, w, hidden, gate_up, act):
        torch.ops.decodex.fused_add_rms_norm(x, residual, norm_w, 1e-6, hidden)
        torch.ops.decodex.gemv(hidden, w, None, gate_up)
        torch.ops.decodex.silu_mul(gate_up, act)
        return act


@pytest.mark.ext
def test_export_traces_the_ops_on_fake_tensors():
    bf = dict(dtype=torch.bfloat16)
    args = (torch.randn(2, 64, **bf), torch.randn(2, 64, **bf), torch.randn(64, **bf),
            torch.randn(256, 64, **bf), torch.empty(2, 64, **bf), torch.empty(2, 256, **bf),
            torch.empty(2, 128, **bf))
    ep = torch.export.export(_Block(), args)
    targets = " ".join(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    for op in ("fused_add_rms_norm", "gemv", "silu_mul"):
        assert f"decodex.{op}" in targets, targets
