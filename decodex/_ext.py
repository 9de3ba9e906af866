"""Loads the compiled kernels (decodex._C), which registers torch.ops.decodex.*.

`import decodex` works without them (a CPU machine, or a checkout not yet built): decodex then runs
on the reference ops, and `available()` says why the kernels are missing.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

_error: str | None = None
try:
    from decodex import _C  # noqa: F401  (registers the ops)
except ImportError as e:  # not built, or built against another torch
    _error = f"decodex._C could not be imported: {e}"


def available() -> bool:
    """True when the CUDA kernels are loaded."""
    return _error is None


def why_unavailable() -> str | None:
    return _error
