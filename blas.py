"""Give MLX a fast BLAS on Linux; import this module before `mlx.core`.

The `mlx[cpu]` wheel for Linux links the slow reference BLAS. Decoding is
matrix-vector products over the weights, so the BLAS decides the speed: on a
2-core x86 machine a 32128x1024 fp32 matvec reads about 1-4 GB/s with the
bundled library, about 8 GB/s with Debian's OpenBLAS and 14-25 GB/s with Intel
MKL (from PyPI, `pip install mkl`). Loading one of them with RTLD_GLOBAL before
MLX's own library resolves its symbols makes MLX call it.

The library is set to one thread: a single core reads memory at ~18-20 GB/s
whatever the BLAS's own threading does for a matrix-vector product, so
model.py splits each product over several MLX CPU streams (threads) instead.

On macOS MLX uses Accelerate (CPU) and Metal (GPU); nothing is loaded there.
Set T5_MLX_BLAS to `mkl`, `openblas` or `bundled` to force a choice.
"""

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys


def _mkl_path():
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmkl_rt.so"):
            return str(file.locate())
    return None


def _openblas_path():
    return ctypes.util.find_library("openblas")


def _load() -> str:
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if "mlx.core" in sys.modules:
        return "bundled reference BLAS (mlx.core was imported before blas.py)"
    choice = os.environ.get("T5_MLX_BLAS", "auto").lower()
    candidates = {"mkl": _mkl_path, "openblas": _openblas_path}
    order = ["mkl", "openblas"] if choice == "auto" else [choice]
    for name in order:
        if name not in candidates:
            break
        path = candidates[name]()
        if path is None:
            continue
        try:
            library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        setter = {"mkl": "MKL_Set_Num_Threads", "openblas": "openblas_set_num_threads"}[name]
        if hasattr(library, setter):
            global _thread_setter
            _thread_setter = getattr(library, setter)
            _thread_setter(1)
        return f"{name} ({os.path.basename(path)}, 1 thread per MLX stream)"
    return "bundled reference BLAS (slow: pip install mkl)"


_thread_setter = None


def set_threads(count: int) -> None:
    """Let the BLAS use several threads: right for training's large matrix
    products, where decoding's matrix-vector products gain nothing from it."""
    if _thread_setter is not None:
        _thread_setter(count)


ACTIVE = _load()
