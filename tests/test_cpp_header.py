"""The header shipped for other C++ extensions (decodex.include_dir()/decodex/decodex_ops.h) compiles
in a third-party extension and reaches the ops through the dispatcher. Runs on a CPU machine: the
op it calls, decode_attention_splits, needs no GPU."""
import os

import pytest
import torch

import decodex


def test_include_dir_has_header():
    assert os.path.isfile(os.path.join(decodex.include_dir(), "decodex", "decodex_ops.h"))


@pytest.mark.ext
def test_header_calls_op_from_another_extension(tmp_path):
    from torch.utils.cpp_extension import load_inline

    source = """
    #include <decodex/decodex_ops.h>
    int64_t splits(int64_t b, int64_t h, int64_t s, int64_t sms) {
      return decodex_ops::decode_attention_splits(b, h, s, sms);
    }
    """
    ext = load_inline(name="uses_decodex", cpp_sources=[source], functions=["splits"],
                      extra_include_paths=[decodex.include_dir()], build_directory=str(tmp_path),
                      extra_cflags=["-O0"], verbose=False)
    for args in [(1, 2, 32768, 132), (4, 8, 1024, 132)]:
        assert ext.splits(*args) == torch.ops.decodex.decode_attention_splits(*args)


@pytest.mark.ext
def test_header_signatures_match_the_schemas(tmp_path):
    """Every function of the header reaches its op with the op's own signature: on CPU tensors each
    call gets past the typed handle (a signature that drifted from the schema fails there, "wrong
    signature") and stops at the dispatcher (no CPU kernel) or the op's own checks."""
    from torch.utils.cpp_extension import load_inline

    source = """
    #include <decodex/decodex_ops.h>
    #include <functional>
    std::vector<std::string> call_all() {
      at::Tensor t = at::zeros({1});
      std::vector<std::function<void()>> calls = {
        [&] { decodex_ops::gemv(t, t, t, t); },
        [&] { decodex_ops::gemv_silu_mul(t, t, t); },
        [&] { decodex_ops::gemv_silu_mul_max_rows(-1); },
        [&] { decodex_ops::gemv_config(0, 8, 1); },
        [&] { decodex_ops::rms_norm(t, t, 1e-6, t); },
        [&] { decodex_ops::fused_add_rms_norm(t, t, t, 1e-6, t); },
        [&] { decodex_ops::rope_append(t, t, t, t, t, t, t, t, 1e-6, t, t, t, 1e-6); },
        [&] { decodex_ops::gemv_rope_append(t, t, t, t, t, t, t, t); },
        [&] { decodex_ops::silu_mul(t, t); },
        [&] { decodex_ops::decode_attention(t, t, t, t, 1.0, t, t); },
        [&] { decodex_ops::rope_append_attention(t, t, t, t, t, t, t, t, 1.0, t, t); },
        [&] { decodex_ops::argmax(t, t); },
        [&] { decodex_ops::sample(t, t, t, t, t, t, t); },
        [&] { decodex_ops::advance_positions(t, t); },
        [&] { decodex_ops::lt_linear(t, t, t, t, t, 0); },
        [&] { decodex_ops::lt_linear_algos(t, t, t, t, t); },
      };
      std::vector<std::string> errors;
      for (auto& call : calls) {
        try { call(); errors.push_back(""); } catch (const std::exception& e) { errors.push_back(e.what()); }
      }
      return errors;
    }
    """
    ext = load_inline(name="decodex_header_sigs", cpp_sources=[source], functions=["call_all"],
                      extra_include_paths=[decodex.include_dir()], build_directory=str(tmp_path),
                      extra_cflags=["-O0"], verbose=False)
    errors = ext.call_all()
    assert len(errors) == 16
    for i, e in enumerate(errors):
        assert e and "wrong signature" not in e, f"call {i}: {e[:300]}"
