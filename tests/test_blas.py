"""blas.py: which BLAS MLX ends up calling on Linux."""

import json
import os
import subprocess
import sys
from ctypes.util import find_library
from pathlib import Path

import pytest

import blas

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="blas.py loads nothing outside Linux")
needs_mkl = pytest.mark.skipif(blas._mkl_path() is None, reason="MKL is installed from the requirements on x86-64 only")


def env_asking_for(order: str | None) -> dict:
    return {k: v for k, v in os.environ.items() if k != "T5_MLX_BLAS"} | ({"T5_MLX_BLAS": order} if order is not None else {})


def python(code: str, order: str | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (the BLAS is chosen once per process)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_asking_for(order),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def active(order: str | None) -> str:
    return python("import blas; print(blas.ACTIVE)", order).stdout.strip()


def test_the_default_is_blis_when_installed_else_another_fast_library():
    expected = {"blis"} if find_library("blis") else {"mkl", "openblas"}
    for order in (None, "", "auto"):
        assert active(order).split()[0] in expected, order


@needs_mkl
def test_the_first_installed_library_of_the_requested_order_wins():
    assert active("mkl").startswith("mkl")
    assert active("mkl,blis").startswith("mkl")
    assert active("bundled,mkl").startswith("bundled")


@needs_mkl
def test_an_unknown_name_is_reported_on_stderr_and_skipped():
    done = python("import blas; print(blas.ACTIVE)", "not-a-blas,mkl")
    assert done.stdout.startswith("mkl") and "unknown library 'not-a-blas'" in done.stderr


@needs_mkl
def test_a_library_that_is_missing_or_will_not_load_is_skipped():
    # find_library answers "not found" for BLIS and a file that is no library for OpenBLAS.
    code = ("import ctypes.util; ctypes.util.find_library = lambda name: {'openblas': '/etc/hostname'}.get(name); "
            "import blas; print(blas.ACTIVE)")
    assert python(code, "blis,openblas,mkl").stdout.startswith("mkl")


def test_importing_mlx_first_is_reported_not_hidden():
    assert "imported before blas.py" in python("import mlx.core; import blas; print(blas.ACTIVE)").stdout


@pytest.mark.parametrize("order, warned", [("bundled", True), (None, False)])
def test_main_warns_on_stderr_only_when_the_slow_bundled_blas_is_active(order, warned):
    done = subprocess.run([sys.executable, "main.py", "--demo", "--max-tokens", "3", "--json"],
                          cwd=ROOT, env=env_asking_for(order), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated"] == 3  # stdout stays one JSON object
    assert ("bundled reference BLAS" in done.stderr) == warned
