"""The standalone probes in bench/ (sync_probe.cu, stream_probe.cu, chain_probe.cu) are not part of
the extension, so nothing else compiles them: these tests do, with the toolkit's nvcc, on the CPU.
And they check that sync_probe streams with 16-byte loads: until session 19 its checksum used only
two words of each load, and the compiler narrowed every 16-byte load to two 4-byte ones, which the
timings did not show."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCH = "-gencode=arch=compute_90,code=sm_90"


def _tool(name: str) -> str | None:
    """`name` from PATH, CUDA_HOME/bin, or (cuobjdump) the copy that triton ships."""
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / name
    if candidate.is_file():
        return str(candidate)
    try:
        import triton
    except ImportError:
        return None
    candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(candidate) if candidate.is_file() else None


NVCC = _tool("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH or CUDA_HOME/bin)")


def _nvcc(tmp_path: Path, source: str, *extra: str) -> Path:
    out = tmp_path / (Path(source).stem + (".cubin" if "-cubin" in extra else ""))
    cmd = [NVCC, "-O3", "-std=c++17", ARCH, f"-I{ROOT / 'csrc'}", *extra, "-o", str(out), str(ROOT / source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}"
    return out


@needs_nvcc
@pytest.mark.parametrize("source", ["bench/sync_probe.cu", "bench/stream_probe.cu", "bench/chain_probe.cu"])
def test_probe_compiles(tmp_path, source):
    assert _nvcc(tmp_path, source).is_file()


@needs_nvcc
def test_sync_probe_streams_16_byte_loads(tmp_path):
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (PATH, CUDA_HOME/bin or triton's copy)")
    cubin = _nvcc(tmp_path, "bench/sync_probe.cu", "-cubin")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)[1:]
    named = [(k.split("\n", 1)[0], k) for k in kernels]
    links = [(name, k) for name, k in named if "link_kernel" in name or "persistent_kernel" in name]
    assert links, "no link kernel in the probe's SASS"
    for name, k in links:
        # The stream's loads are the non-coherent, no-L1-allocate ones (ld_stream); x is read plainly.
        stream = re.findall(r"LDG\.E\.NA\S*", k)
        assert stream, f"no streaming load in {name}"
        narrow = [op for op in stream if ".128" not in op]
        assert not narrow, f"{name}: streaming loads narrower than 16 bytes: {narrow[:4]}"
