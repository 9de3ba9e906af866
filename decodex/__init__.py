"""decodex: handwritten CUDA decode kernels and a thin Qwen2/Llama runner."""
from decodex import _ext, reference  # noqa: F401
from decodex import ops  # noqa: F401  (fake impls)

__version__ = "0.1.0"
