"""Give MLX a fast BLAS on Linux; import this module before `mlx.core`.

The `mlx[cpu]` wheel for Linux links the slow reference BLAS. Decoding is
matrix-vector products over the weights, so the BLAS decides the speed. On a
2-core AMD EPYC (x86-64, AVX-512), T5-large decoding with each of them,
measured by `bench.py regular` in back-to-back runs: BLIS (Debian's
`libblis4-serial`) 11.6 tokens/s, Intel MKL (from PyPI, `pip install mkl`)
10.4 tokens/s. BLIS also multiplies a few rows (speculative verification)
faster: 1.7-1.9 ms against 2.3-2.9 ms for 5 rows of a 4096x1024 float32 weight.
Debian's OpenBLAS and the bundled library are far slower (8 and 1-4 GB/s in a
32128x1024 product, against 17-20 for both above). Loading one of them with
RTLD_GLOBAL before MLX's own library resolves its symbols makes MLX call it.

The library is set to one thread: a single core reads memory at ~18-20 GB/s
whatever the BLAS's own threading does for a matrix-vector product, so
model.py splits each product over several MLX CPU streams (threads) instead.

On macOS MLX uses Accelerate (CPU) and Metal (GPU); nothing is loaded there.
T5_MLX_BLAS picks the library: `blis`, `mkl`, `openblas` or `bundled`, or a
comma-separated order of preference (the default is `blis,mkl,openblas`;
training, whose large products want MKL's threads, asks for `mkl,blis,openblas`).
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


def _blis_path():
    return ctypes.util.find_library("blis")


def _load() -> str:
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if "mlx.core" in sys.modules:
        return "bundled reference BLAS (mlx.core was imported before blas.py)"
    candidates = {"blis": _blis_path, "mkl": _mkl_path, "openblas": _openblas_path}
    order = [name.strip() for name in os.environ.get("T5_MLX_BLAS", "blis,mkl,openblas").lower().split(",")]
    for name in order:
        if name == "bundled":
            break
        if name not in candidates:
            print(f"T5_MLX_BLAS: unknown library {name!r} (blis, mkl, openblas, bundled)", file=sys.stderr)
            continue
        path = candidates[name]()
        if path is None:
            continue
        try:
            library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        setter = {"blis": "bli_thread_set_num_threads", "mkl": "MKL_Set_Num_Threads", "openblas": "openblas_set_num_threads"}[name]
        if hasattr(library, setter):
            global _thread_setter
            _thread_setter = getattr(library, setter)
            if name == "blis":  # takes a dim_t
                _thread_setter.argtypes = [ctypes.c_int64]
            _thread_setter(1)
        return f"{name} ({os.path.basename(path)}, 1 thread per MLX stream)"
    return "bundled reference BLAS (slow: apt install libblis4-serial, or pip install mkl)"


_thread_setter = None


def set_threads(count: int) -> None:
    """Let the BLAS use several threads: right for training's large matrix
    products, where decoding's matrix-vector products gain nothing from it."""
    if _thread_setter is not None:
        _thread_setter(count)


ACTIVE = _load()
