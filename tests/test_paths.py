"""The two paths: cpu.in_use() alone decides, and T5_MLX_PATH=accelerator takes the GPU's path on a CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpu

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import cpu, convert
import mlx.core as mx
from loading import load_model
fused = []
real = mx.fast.scaled_dot_product_attention
mx.fast.scaled_dot_product_attention = lambda *args, **kwargs: fused.append(1) or real(*args, **kwargs)
model = load_model("demo/target")
model.decode(mx.array([[0, 5]]), model.make_cache(model.encode(mx.array([[9] * 40 + [1]]))))
print(cpu.in_use(), len(cpu.lanes()), mx.default_device() == mx.cpu, len(fused) > 0, convert.default_dtype())
"""


def probe(path: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != cpu.PATH_SETTING} | ({cpu.PATH_SETTING: path} if path else {})
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_only_cpu_py_asks_which_device_mlx_computes_on():
    """One place decides the path; every other module asks cpu.in_use()."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("demo/*.py"), *ROOT.glob("tests/*.py")]
    asking = [path.relative_to(ROOT) for path in sorted(files)
              if "default_device(" in path.read_text() and path.name not in ("cpu.py", "test_paths.py")]
    assert asking == []


@pytest.mark.skipif(not cpu.mlx_computes_on_cpu(), reason="MLX computes on a GPU here: both paths are the accelerator's")
def test_the_accelerator_setting_takes_the_gpus_path_while_mlx_computes_on_the_cpu():
    """Fused attention, no lanes, bfloat16 by default, MLX on the CPU all
    the same; without the setting, the CPU path: our attention, one lane per
    core (two or more cores), float32."""
    assert probe("accelerator").stdout.split() == ["False", "0", "True", "True", "bfloat16"]
    in_use, lanes, on_cpu, fused, dtype = probe(None).stdout.split()
    assert (in_use, on_cpu, fused, dtype) == ("True", "True", "False", "float32")
    assert int(lanes) == (min(os.cpu_count(), 4) if os.cpu_count() > 1 else 0)


def test_an_unknown_path_is_said_and_the_devices_own_taken():
    done = probe("gpu")
    assert "T5_MLX_PATH: unknown path 'gpu'" in done.stderr
    assert done.stdout.split()[0] == str(probe(None).stdout.split()[0])
