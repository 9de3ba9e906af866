"""Reads an HF-format model directory (config.json + model.safetensors, or shards listed in
model.safetensors.index.json) into a decodex Model.

Tensors are read one at a time with safetensors' safe_open and checked against the shapes the config
implies before any is used; every failure is a LoadError naming the file, tensor or field. Tensors
decodex does not use (rotary inv_freq buffers, ...) are skipped without being read.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import torch
from safetensors import safe_open

from decodex.config import LoadError, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _tensor_files(directory: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file holding it."""
    index_path = os.path.join(directory, INDEX_FILE)
    single_path = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoadError(f"{index_path}: malformed JSON: {e}") from None
        except OSError as e:  # a directory of that name, no read permission
            raise LoadError(f"{index_path}: cannot read index file: {e.strerror or e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index_path}: field 'weight_map' is missing or empty")
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise LoadError(f"{index_path}: weight_map[{name!r}] = {shard!r} is not a file name")
            shard_path = os.path.join(directory, shard)
            if not os.path.isfile(shard_path):
                raise LoadError(f"{index_path}: weight_map[{name!r}] points at {shard!r}, "
                                f"but {shard_path} does not exist (missing shard)")
            files[name] = shard_path
        return files
    if os.path.exists(single_path):
        return {name: single_path for name in _keys(single_path)}
    raise LoadError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _keys(path: str) -> list[str]:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError / OSError on bad headers
        raise LoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


class _Progress:
    """One stderr line, redrawn in place on a terminal and printed once otherwise."""

    def __init__(self, total_bytes: int, quiet: bool):
        self.total, self.done, self.quiet = total_bytes, 0, quiet
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, nbytes: int):
        self.done += nbytes
        if not self.quiet and self.tty:
            pct = 100.0 * self.done / max(self.total, 1)
            sys.stderr.write(f"\rdecodex: loading weights {pct:5.1f}% ({self.done / 2**20:.0f} MiB)")
            sys.stderr.flush()

    def close(self, count: int):
        if self.quiet:
            return
        secs = time.perf_counter() - self.start
        sys.stderr.write(f"{chr(13) if self.tty else ''}decodex: loaded {count} tensors, "
                         f"{self.done / 2**20:.0f} MiB in {secs:.1f} s\n")
        sys.stderr.flush()


def load_weights(directory: str, config: ModelConfig, quiet: bool = False) -> dict[str, torch.Tensor]:
    """Reads and shape-checks every tensor `config` needs; returns them on the CPU as stored."""
    expected = config.weight_shapes()
    files = _tensor_files(directory)
    if config.tie_word_embeddings and "lm_head.weight" in files:
        # Stored next to tied embeddings: Model ties it when equal and, as transformers 5 does,
        # keeps it when it differs.
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    missing = [name for name in expected if name not in files]
    if missing:
        where = os.path.join(directory, INDEX_FILE if os.path.exists(
            os.path.join(directory, INDEX_FILE)) else SINGLE_FILE)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"{where}: missing tensor {missing[0]!r}{more}")

    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)

    # Header pass first: every shape and dtype is checked before a byte of data is read.
    total = 0
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise LoadError(f"{path}: missing tensor {name!r} (the index says it is here)")
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    if shape != expected[name]:
                        raise LoadError(f"{path}: tensor {name!r} has shape {list(shape)}, "
                                        f"expected {list(expected[name])} from config.json")
                    dtype = sl.get_dtype()
                    if dtype not in ("BF16", "F16", "F32"):
                        raise LoadError(f"{path}: tensor {name!r} has dtype {dtype}; "
                                        "supported: BF16, F16, F32")
                    n = 1
                    for s in shape:
                        n *= s
                    total += n * {"BF16": 2, "F16": 2, "F32": 4}[dtype]
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None

    progress = _Progress(total, quiet)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    t = f.get_tensor(name)
                    weights[name] = t
                    progress.update(t.numel() * t.element_size())
        except Exception as e:
            raise LoadError(f"{path}: cannot read tensor data (truncated or corrupt?): {e}") from None
    progress.close(len(weights))
    return weights


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cache_dir() -> str:
    """Where huggingface_hub keeps downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve_model_dir(path) -> str:
    """`path` itself when it exists; else, for a Hugging Face repo id ("Qwen/Qwen2.5-1.5B-Instruct"),
    the snapshot that huggingface_hub downloaded into its cache (the one refs/main names, or the only
    one). Nothing is downloaded: a repo id not in the cache is a LoadError saying how to get it."""
    path = os.fspath(path)
    if os.path.exists(path) or not _REPO_ID.match(path):
        return path
    repo = os.path.join(hf_cache_dir(), "models--" + path.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            commit = f.read().strip()
        if os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit)
    except OSError:
        pass
    found = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    if len(found) == 1:
        return os.path.join(snapshots, found[0])
    why = (f"{len(found)} snapshots and no refs/main naming one" if found else "not there")
    raise LoadError(f"{path}: not a local path, and as a Hugging Face repo id it is {why} in the "
                    f"cache {hf_cache_dir()} (decodex downloads nothing: `huggingface-cli download {path}`)")


def load_model(path, device=None, dtype=None, quiet: bool = False):
    """config.json + safetensors in directory `path` (or a Hugging Face repo id already in the
    cache: resolve_model_dir) -> Model on `device` in `dtype`.

    Defaults: cuda if available else cpu; bf16 on cuda, fp32 on cpu.
    """
    from decodex.model import Model

    directory = resolve_model_dir(path)
    if not os.path.isdir(directory):
        raise LoadError(f"{directory}: not a directory")
    try:
        device = torch.device(device) if device is not None else default_device()
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    # Checked here: torch's own error comes from deep inside Model and is a RuntimeError.
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} is not available: this machine has "
                         f"{torch.cuda.device_count()} CUDA GPU(s)")
    if dtype is None:
        dtype = default_dtype(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {dtype} is not supported (bfloat16, float16, float32)")
    config = ModelConfig.from_file(os.path.join(directory, "config.json"))
    weights = load_weights(directory, config, quiet=quiet)
    return Model(config, weights, device, dtype)
