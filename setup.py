"""Builds decodex._C, the CUDA kernels, as a torch extension with ninja.

Works without a GPU: the architecture list is explicit (sm_90a by default: the batched GEMV uses
Hopper's wgmma; set TORCH_CUDA_ARCH_LIST, e.g. "9.0a;10.0", to change it; without 9.0a the batched
GEMV falls back to its mma.sync kernel) and CUDA_HOME defaults to the toolkit nvcc belongs to.
The module uses Python's stable ABI (abi3), so one build serves every Python version.
"""
import glob
import importlib.util
import os
import shutil

from setuptools import setup

# Before importing torch.utils.cpp_extension: it reads these at import time.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
    for candidate in ("/usr/local/cuda-13.0", "/usr/local/cuda"):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = candidate
            break

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

# torch >= 2.13's headers need C++20; older torch is built as C++17 and its headers are compiled the
# same way here (mixing the two breaks inline code shared with libtorch). DECODEX_CXX_STD overrides.
_torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
CXX_STD = os.environ.get("DECODEX_CXX_STD", "c++20" if _torch_version >= (2, 13) else "c++17")

HERE = os.path.dirname(os.path.abspath(__file__))

# The header other C++ extensions include travels inside the package (decodex.include_dir()).
_header_src = os.path.join(HERE, "csrc", "decodex_ops.h")
_header_dst = os.path.join(HERE, "decodex", "include", "decodex", "decodex_ops.h")
if os.path.exists(_header_src):
    os.makedirs(os.path.dirname(_header_dst), exist_ok=True)
    shutil.copyfile(_header_src, _header_dst)

nvcc_flags = [
    "-O3",
    f"-std={CXX_STD}",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # torch hides bf16 conversions from nvcc; decodex converts explicitly, but re-enable the
    # operators so kernels can use __nv_bfloat16 arithmetic where it reads better.
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
]
# The host code may send work to sm_90a-only kernels (wgmma) only when such code is built.
_archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()
SM90A = ["-DDECODEX_SM90A=1"] if "9.0a" in _archs else []
nvcc_flags += SM90A
if os.environ.get("DECODEX_PTXAS_VERBOSE"):
    nvcc_flags.append("-Xptxas=-v")



def _cublaslt():
    """(include dir, library dir, library file name) of cuBLASLt (csrc/lt_linear.cu calls it): the
    CUDA toolkit's, else the nvidia-cublas wheel's that torch's CUDA build depends on (torch has
    loaded that library by the time decodex._C loads, so the soname resolves to it)."""
    roots = [os.environ["CUDA_HOME"]] if os.environ.get("CUDA_HOME") else []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            roots += sorted(glob.glob(os.path.join(loc, "*")))
    for root in roots:
        for inc, lib in (("include", "lib64"), ("include", "lib"),
                         ("targets/x86_64-linux/include", "targets/x86_64-linux/lib")):
            header = os.path.join(root, inc, "cublasLt.h")
            libs = sorted(glob.glob(os.path.join(root, lib, "libcublasLt.so*")), key=len)
            if os.path.exists(header) and libs:
                return os.path.dirname(header), os.path.dirname(libs[0]), os.path.basename(libs[0])
    raise RuntimeError("decodex needs cuBLASLt's header and library (cublasLt.h, libcublasLt.so*): "
                       "none under CUDA_HOME or the nvidia-* wheels; install torch's CUDA build "
                       "(it depends on nvidia-cublas) or a full CUDA toolkit")


LT_INCLUDE, LT_LIBDIR, LT_LIB = _cublaslt()

setup(
    ext_modules=[
        CUDAExtension(
            name="decodex._C",
            sources=sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu")),
            include_dirs=[os.path.join(HERE, "csrc"), LT_INCLUDE],
            extra_compile_args={
                "cxx": ["-O3", f"-std={CXX_STD}"] + SM90A,
                "nvcc": nvcc_flags,
            },
            extra_link_args=[f"-L{LT_LIBDIR}", f"-l:{LT_LIB}", f"-Wl,-rpath,{LT_LIBDIR}"],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
