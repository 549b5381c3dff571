"""Give MLX a fast BLAS on Linux; import this module before `mlx.core`.

The `mlx[cpu]` wheel for Linux links the slow reference BLAS. Decoding is
matrix-vector products over the weights, so the BLAS decides the speed.
Loading the chosen library with RTLD_GLOBAL before MLX's own library resolves
its symbols makes MLX call it. Measured on a 2-core AMD EPYC (x86-64, AVX-512):
- BLIS (Debian's `libblis4-serial`; `libblis3-serial` on older releases) and
  Intel MKL (from PyPI, `pip install mkl`) both read 17-20 GB/s in a
  32128x1024 float32 product; Debian's OpenBLAS about 8, the bundled one 1-4.
- T5-large decoding, `bench.py regular` once each, back to back: BLIS 11.6,
  MKL 10.4 tokens/s (this machine's runs vary by ~10%).
- A product with a few rows (speculative verification), 5 rows of a 4096x1024
  weight: BLIS 1.7-1.9 ms, MKL 2.3-2.9 ms.

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


# name: (where it is, its thread-count setter, the setter's argument type;
# BLIS's default build counts in 64-bit dim_t)
_LIBRARIES = {
    "blis": (lambda: ctypes.util.find_library("blis"), "bli_thread_set_num_threads", ctypes.c_int64),
    "mkl": (_mkl_path, "MKL_Set_Num_Threads", ctypes.c_int),
    "openblas": (lambda: ctypes.util.find_library("openblas"), "openblas_set_num_threads", ctypes.c_int),
}
DEFAULT_ORDER = "blis,mkl,openblas"


def _load() -> str:
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if "mlx.core" in sys.modules:
        return "bundled reference BLAS (mlx.core was imported before blas.py)"
    order = [name.strip() for name in os.environ.get("T5_MLX_BLAS", "").lower().split(",") if name.strip()]
    if order in ([], ["auto"]):
        order = DEFAULT_ORDER.split(",")
    for name in order:
        if name == "bundled":
            break
        if name not in _LIBRARIES:
            print(f"T5_MLX_BLAS: unknown library {name!r} (blis, mkl, openblas, bundled)", file=sys.stderr)
            continue
        find, setter_name, count_type = _LIBRARIES[name]
        path = find()
        if path is None:
            continue
        try:
            library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(library, setter_name):
            global _thread_setter
            _thread_setter = getattr(library, setter_name)
            _thread_setter.argtypes, _thread_setter.restype = [count_type], None
            _thread_setter(1)
        return f"{name} ({os.path.basename(path)}, 1 thread per MLX stream)"
    return "bundled reference BLAS (slow: apt install libblis4-serial, or pip install mkl)"


_thread_setter = None


def set_threads(count: int) -> None:
    """Let the BLAS use several threads: right for training's large matrix
    products, where decoding's matrix-vector products gain nothing from it.
    A single-threaded build (Debian's libblis4-serial) ignores it."""
    if _thread_setter is not None:
        _thread_setter(count)


ACTIVE = _load()
