"""blas.py: which BLAS MLX ends up calling on Linux."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="blas.py loads nothing outside Linux")


def active(order: str | None, import_mlx_first: bool = False) -> str:
    env = dict(os.environ)
    env.pop("T5_MLX_BLAS", None)
    if order is not None:
        env["T5_MLX_BLAS"] = order
    code = ("import mlx.core; " if import_mlx_first else "") + "import blas; print(blas.ACTIVE)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_a_fast_blas_is_active_by_default():
    assert active(None).split()[0] in {"blis", "mkl", "openblas"}


def test_the_first_installed_library_of_the_requested_order_wins():
    # MKL comes from the requirements, so it is always there.
    assert active("mkl").startswith("mkl")
    assert active("bundled,mkl").startswith("bundled")
    assert active("not-a-blas,mkl").startswith("mkl")  # named on stderr, then skipped


def test_a_library_that_is_not_installed_is_skipped():
    from ctypes.util import find_library

    missing = [name for name in ("blis", "openblas") if find_library(name) is None]
    if not missing:
        pytest.skip("BLIS and OpenBLAS are both installed")
    assert active(f"{missing[0]},mkl").startswith("mkl")


def test_importing_mlx_first_is_reported_not_hidden():
    assert "imported before blas.py" in active(None, import_mlx_first=True)
