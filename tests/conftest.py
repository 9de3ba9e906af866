"""Test setup shared by every test file: the `gpu` marker skips (with its reason) where there is no
CUDA GPU or the kernels are not built, and each test starts from a fixed seed."""
import pytest
import torch

from decodex import _ext


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here)"
    if not _ext.available():
        return f"needs the built kernels: {_ext.why_unavailable()}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
