"""decodex: handwritten CUDA decode kernels and a thin Qwen / Llama / Mistral runner.

    import decodex
    text = decodex.generate(prompt="What is the capital of France?")   # the embedded default model
    model = decodex.load("path/to/hf_dir")                              # Qwen / Llama / Mistral safetensors
    torch.ops.decodex.gemv(x, w, None, out)                             # the kernels, from any code
"""
import os as _os

from decodex import _ext, reference  # noqa: F401
from decodex import ops  # noqa: F401  (registers the fake impls)
from decodex.generate import GenerationStats, SamplingParams, generate, load  # noqa: F401

__version__ = "0.1.0"


def include_dir() -> str:
    """Folder holding decodex/decodex_ops.h, the header other C++ extensions use to call the ops."""
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")
