"""decodex.ops, the allocating wrappers around torch.ops.decodex.*: a tensor on the wrong device or
with the wrong number of dims is an error that names the wrapper and the argument (and, off CUDA,
the reference function that computes the same), before the wrapper reads any shape."""
import pytest
import torch

from decodex import ops, reference

bf16 = torch.bfloat16
# wrapper name -> (positional arguments on the CPU, the argument the error must name)
CPU_CALLS = {
    "gemv": ((torch.randn(2, 8, dtype=bf16), torch.randn(4, 8, dtype=bf16)), "x"),
    "gemv_silu_mul": ((torch.randn(2, 8, dtype=bf16), torch.randn(4, 8, dtype=bf16)), "x"),
    "gemv_rope_append": ((torch.randn(1, 8, dtype=bf16), torch.randn(4, 8, dtype=bf16), None, None, None,
                          None, None), "x"),
    "rms_norm": ((torch.randn(2, 8, dtype=bf16), torch.ones(8, dtype=bf16), 1e-6), "x"),
    "fused_add_rms_norm": ((torch.randn(2, 8, dtype=bf16), torch.randn(2, 8, dtype=bf16),
                            torch.ones(8, dtype=bf16), 1e-6), "x"),
    "silu_mul": ((torch.randn(2, 8, dtype=bf16),), "gate_up"),
    "decode_attention": ((torch.randn(1, 2, 8, dtype=bf16), torch.randn(1, 1, 4, 8, dtype=bf16), None, None,
                          1.0), "q"),
    "moe_route": ((torch.randn(2, 5, dtype=bf16), 2, True), "logits"),
    "moe_gemv_silu_mul": ((torch.randn(2, 8, dtype=bf16), torch.randn(3, 4, 8, dtype=bf16),
                           torch.zeros(2, 2, dtype=torch.int32)), "x"),
    "moe_gemv_sum": ((torch.randn(2, 2, 8, dtype=bf16), torch.randn(3, 4, 8, dtype=bf16),
                      torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)), "x"),
    "argmax": ((torch.randn(2, 5),), "logits"),
    "sample": ((torch.randn(2, 5), None, None, None, None, None), "logits"),
}


@pytest.mark.ext
@pytest.mark.parametrize("name", sorted(CPU_CALLS))
def test_wrapper_rejects_cpu_tensors(name):
    args, arg = CPU_CALLS[name]
    assert hasattr(reference, name)  # the function the message points to
    with pytest.raises(RuntimeError, match=rf"decodex\.ops\.{name}: {arg} must be a CUDA tensor, got device cpu "
                                           rf"\(decodex\.reference\.{name} "):
        getattr(ops, name)(*args)


@pytest.mark.ext
def test_wrapper_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"decodex\.ops\.argmax: logits must be a tensor, got list"):
        ops.argmax([[1.0, 2.0]])


@pytest.mark.gpu
@pytest.mark.parametrize("name,args,match", [
    ("gemv", lambda: (torch.randn(8, dtype=bf16, device="cuda"), torch.randn(4, 8, dtype=bf16, device="cuda")),
     r"decodex\.ops\.gemv: x must be 2-D, got shape \[8\]"),
    ("decode_attention", lambda: (torch.randn(2, 8, dtype=bf16, device="cuda"),
                                  torch.randn(1, 1, 4, 8, dtype=bf16, device="cuda"), None, None, 1.0),
     r"decodex\.ops\.decode_attention: q must be 3-D, got shape \[2, 8\]"),
    ("decode_attention", lambda: (torch.randn(1, 2, 8, dtype=bf16, device="cuda"),
                                  torch.randn(1, 4, 8, dtype=bf16, device="cuda"), None, None, 1.0),
     r"decodex\.ops\.decode_attention: k_cache must be 4-D, got shape \[1, 4, 8\]"),
    ("argmax", lambda: (torch.randn(5, device="cuda"),), r"decodex\.ops\.argmax: logits must be 2-D, got shape \[5\]"),
])
def test_wrapper_rejects_wrong_dims(name, args, match):
    with pytest.raises(RuntimeError, match=match):
        getattr(ops, name)(*args())


@pytest.mark.ext
@pytest.mark.parametrize("args,error,match", [
    ((1, 12, 2, 128, 1024, "cpu"), RuntimeError,
     r"decodex\.ops\.attention_workspace: device must be a CUDA device, got cpu"),
    ((1, 0, 2, 128, 1024, "cuda"), ValueError, r"decodex\.ops\.attention_workspace: num_heads must be >= 1, got 0"),
    ((1, 12, 2, -128, 1024, "cuda"), ValueError,
     r"decodex\.ops\.attention_workspace: head_dim must be >= 1, got -128"),
])
def test_attention_workspace_rejects_bad_arguments(args, error, match):
    # Checked before any CUDA call, so these run without a GPU.
    with pytest.raises(error, match=match):
        ops.attention_workspace(*args)


@pytest.mark.parametrize("weight,norm_weight,match", [
    (torch.randn(4, 8), torch.ones(7), r"norm_weight must have shape \[8\] \(weight's K\), got \[7\]"),
    (torch.randn(4, 8), torch.ones(1), r"norm_weight must have shape \[8\] \(weight's K\), got \[1\]"),
    (torch.randn(4, 8), torch.ones(4, 8), r"norm_weight must have shape \[8\] \(weight's K\), got \[4, 8\]"),
    (torch.randn(8), torch.ones(8), r"weight must be 2-D \[N, K\], got shape \[8\]"),
])
def test_fold_norm_weight_checks_shapes(weight, norm_weight, match):
    # A [1] norm weight would broadcast over every column: an error, not a silent scaling.
    with pytest.raises(ValueError, match=rf"fold_norm_weight: {match}"):
        ops.fold_norm_weight(weight, norm_weight)
    assert ops.fold_norm_weight is reference.fold_norm_weight
