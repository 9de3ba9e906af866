"""Test setup shared by every test file: the `gpu` marker skips (with its reason) where there is no
CUDA GPU or the kernels are not built, the `ext` marker where the kernels are not built (schemas and
fake impls are tested without a GPU), and each test starts from a fixed seed."""
import pytest
import torch

from decodex import _ext

# CPU-only machines (CI, 2 shared cores): tiny-tensor tests run ~10x faster on one intra-op thread
# than on two (no OpenMP spin-waiting against other processes). GPU hosts keep their threads for
# the large CPU references.
if not torch.cuda.is_available():
    torch.set_num_threads(1)


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here)"
    if not _ext.available():
        return f"needs the built kernels: {_ext.why_unavailable()}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_reason = _gpu_skip_reason()
    ext_reason = None if _ext.available() else f"needs the built kernels: {_ext.why_unavailable()}"
    for item in items:
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        elif "ext" in item.keywords and ext_reason:
            item.add_marker(pytest.mark.skip(reason=ext_reason))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: batch-1 decode of a small model on the CPU is op-latency
    bound, so one thread is as fast on an idle 2-core runner and several times faster on a busy one
    (no oversubscription). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
