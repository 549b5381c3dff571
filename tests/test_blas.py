"""blas.py: which BLAS MLX ends up calling on Linux."""

import json
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


@pytest.mark.parametrize("order, warned", [("bundled", True), (None, False)])
def test_main_warns_on_stderr_only_when_the_slow_bundled_blas_is_active(order, warned):
    env = {k: v for k, v in os.environ.items() if k != "T5_MLX_BLAS"} | ({"T5_MLX_BLAS": order} if order else {})
    done = subprocess.run([sys.executable, "main.py", "--demo", "--max-tokens", "3", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated"] == 3  # stdout stays one JSON object
    assert ("bundled reference BLAS" in done.stderr) == warned
