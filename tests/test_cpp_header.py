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
