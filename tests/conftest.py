"""Test setup shared by every test file: the `gpu` marker skips (with its reason) where there is no
CUDA GPU or the kernels are not built, the `ext` marker where the kernels are not built (schemas and
fake impls are tested without a GPU), each test starts from a fixed seed, and `--shard K/N` keeps one
of N disjoint shares of the collected tests (bench/h200.sh runs compute-sanitizer over shards in
parallel processes, since one process per test file outlasts a device call)."""
import re

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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only the collected tests whose index i has i %% N == K (0 <= K < N): "
                          "N such runs cover every test once")


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N), 0 <= K < N; anything else is a usage error that names --shard."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not int(m.group(1)) < int(m.group(2)):
        raise pytest.UsageError(f"--shard must be K/N with 0 <= K < N, got {text!r}")
    return int(m.group(1)), int(m.group(2))


@pytest.hookimpl(trylast=True)  # --shard after -m and -k have deselected theirs: even shares
def pytest_collection_modifyitems(config, items):
    gpu_reason = _gpu_skip_reason()
    ext_reason = None if _ext.available() else f"needs the built kernels: {_ext.why_unavailable()}"
    for item in items:
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        elif "ext" in item.keywords and ext_reason:
            item.add_marker(pytest.mark.skip(reason=ext_reason))
    shard = config.getoption("--shard")
    if shard is not None:
        k, n = parse_shard(shard)
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
        items[:] = [item for i, item in enumerate(items) if i % n == k]


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
