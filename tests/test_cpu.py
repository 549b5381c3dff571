"""cpu.py: which BLAS MLX ends up calling on Linux, and products split over CPU streams."""

import json
import os
import subprocess
import sys
from ctypes.util import find_library
from pathlib import Path

import numpy as np
import pytest

import cpu

ROOT = Path(__file__).resolve().parent.parent

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="cpu.py loads no BLAS outside Linux")
needs_mkl = pytest.mark.skipif(cpu._mkl_path() is None, reason="MKL is installed from the requirements on x86-64 only")


def env_asking_for(order: str | None) -> dict:
    return {k: v for k, v in os.environ.items() if k != "T5_MLX_BLAS"} | ({"T5_MLX_BLAS": order} if order is not None else {})


def python(code: str, order: str | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (the BLAS is chosen once per process)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_asking_for(order),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def active(order: str | None) -> str:
    return python("import cpu; print(cpu.ACTIVE)", order).stdout.strip()


@linux_only
def test_the_default_is_mkl_then_blis_on_intel_and_blis_then_mkl_on_amd_skipping_a_blis_without_kernels():
    """MKL (from the requirements) first on Intel's CPUs, BLIS on AMD's, where
    MKL's few-row products are the slower; BLIS on a CPU its build does not
    know runs generic kernels, slower than the others: the order skips it,
    and says so. OpenBLAS last."""
    blis = find_library("blis")
    with_kernels = blis is not None and cpu.blis_kernels(blis) != "generic"  # unknown kernels: taken
    installed = {"mkl": cpu._mkl_path() is not None, "blis": with_kernels}
    preferred = ["blis", "mkl"] if cpu.cpu_vendor() == "AuthenticAMD" else ["mkl", "blis"]
    expected = {next((name for name in preferred if installed[name]), "openblas")}
    for order in (None, "", "auto"):
        assert active(order).split()[0] in expected, order
    without_mkl = ("import importlib.metadata as m; files = m.files; "
                   "m.files = lambda name: files('not-a-package') if name == 'mkl' else files(name); "
                   "import cpu; print(cpu.ACTIVE)")
    chosen = python(without_mkl).stdout
    assert ("BLIS skipped: it has only generic kernels" in chosen) == (blis is not None and not with_kernels), chosen


def test_amds_cpus_prefer_blis_and_every_other_cpu_mkl(monkeypatch):
    for vendor, first in (("AuthenticAMD", "blis"), ("GenuineIntel", "mkl"), ("", "mkl")):
        monkeypatch.setattr(cpu, "cpu_vendor", lambda vendor=vendor: vendor)
        assert cpu.default_order()[0] == first and sorted(cpu.default_order()) == ["blis", "mkl", "openblas"]


@linux_only
@pytest.mark.skipif(find_library("blis") is None, reason="BLIS is not installed")
def test_blis_asked_for_by_name_is_taken_whatever_its_kernels():
    assert active("blis").startswith("blis")
    assert active("blis,mkl").startswith("blis")


GLOBAL_SGEMM = """
import ctypes, cpu
class Found(ctypes.Structure):
    _fields_ = [("file", ctypes.c_char_p), ("base", ctypes.c_void_p), ("name", ctypes.c_char_p), ("address", ctypes.c_void_p)]
process, found = ctypes.CDLL(None), Found()  # dlopen(NULL): the global scope, where MLX's BLAS calls resolve first
process.dladdr(ctypes.cast(process.cblas_sgemm, ctypes.c_void_p), ctypes.byref(found))
print(cpu.ACTIVE.split()[0], found.file.decode())
"""


@linux_only
@pytest.mark.parametrize("order", [None, "mkl", "blis"])
def test_the_library_named_active_is_the_one_whose_products_mlx_calls(order):
    """A BLIS only asked for its kernels (loaded privately) never provides the products, even when skipped."""
    if order == "blis" and find_library("blis") is None:
        pytest.skip("BLIS is not installed")
    name, provider = python(GLOBAL_SGEMM, order).stdout.split()
    assert name in ("blis", "mkl", "openblas") and name in Path(provider).name, provider


@linux_only
@needs_mkl
def test_the_first_installed_library_of_the_requested_order_wins():
    assert active("mkl").startswith("mkl")
    assert active("mkl,blis").startswith("mkl")
    assert active("bundled,mkl").startswith("bundled")


@linux_only
@needs_mkl
def test_mkl_runs_its_openmp_threads_unless_asked_for_its_sequential_layer():
    """MKL spreads each product over the cores with Intel's OpenMP runtime
    (its threads spin between products, where sleeping ones would have to be
    woken); products are then left whole. MKL_THREADING_LAYER=SEQUENTIAL
    keeps it to one thread, and products are split over MLX's streams."""
    import os

    code = ("import cpu, mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); "
            "print(cpu.THREADED, 'libiomp5' in open('/proc/self/maps').read())")
    cores = len(os.sched_getaffinity(0)) > 1
    assert python(code, "mkl").stdout.split() == [str(cores), "True"]
    sequential = "import os; os.environ['MKL_THREADING_LAYER'] = 'SEQUENTIAL'; " + code
    assert python(sequential, "mkl").stdout.split() == ["False", "False"]
    assert f"{len(os.sched_getaffinity(0))} threads of its own" in active("mkl") or not cores


@linux_only
@needs_mkl
def test_mkl_spins_5_ms_unless_told_otherwise_and_heeds_a_thread_count_given():
    """cpu.py's defaults fill in what the environment leaves unset, and say
    which they set (the benchmarks' reference engines run without them)."""
    # this process set them
    unset = "import os; [os.environ.pop(key, None) for key in ('KMP_BLOCKTIME', 'MKL_THREADING_LAYER')]; "
    report = "import cpu; print(os.environ['KMP_BLOCKTIME'], sorted(cpu.SET_HERE), cpu.ACTIVE)"
    assert python(unset + report, "mkl").stdout.split()[:3] == ["5", "['KMP_BLOCKTIME',", "'MKL_THREADING_LAYER']"]
    given = python(unset + "os.environ['KMP_BLOCKTIME'] = '50'; os.environ['MKL_NUM_THREADS'] = '1'; " + report, "mkl")
    assert given.stdout.split()[:2] == ["50", "['MKL_THREADING_LAYER']"] and "1 thread per MLX stream" in given.stdout


@linux_only
@needs_mkl
def test_many_rows_holds_mkl_to_one_thread_while_the_lanes_spread_a_prompt_and_restores_its_count():
    code = """
import cpu
assert cpu.THREADED and cpu.lanes(), 'needs 2 cores'
cpu.set_threads(2)
try:
    with cpu.many_rows():
        inside = cpu._thread_getter()
        raise KeyError
except KeyError:
    pass
print(inside, cpu._thread_getter())
"""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no lanes")
    assert python(code, "mkl").stdout.split() == ["1", "2"]


@linux_only
@needs_mkl
def test_an_unknown_name_is_reported_on_stderr_and_skipped():
    done = python("import cpu; print(cpu.ACTIVE)", "not-a-blas,mkl")
    assert done.stdout.startswith("mkl") and "unknown library 'not-a-blas'" in done.stderr


@linux_only
@needs_mkl
def test_a_library_that_is_missing_or_will_not_load_is_skipped():
    # find_library answers "not found" for BLIS and a file that is no library for OpenBLAS.
    code = ("import ctypes.util; ctypes.util.find_library = lambda name: {'openblas': '/etc/hostname'}.get(name); "
            "import cpu; print(cpu.ACTIVE)")
    assert python(code, "blis,openblas,mkl").stdout.startswith("mkl")


@linux_only
def test_importing_mlx_first_is_reported_not_hidden():
    assert "imported before cpu.py" in python("import mlx.core; import cpu; print(cpu.ACTIVE)").stdout


@linux_only
def test_the_api_warns_once_when_mlx_was_imported_before_it():
    """MLX binds its BLAS when it loads, so a fast one loaded later is never called: say so, once."""
    code = ("import warnings; warnings.simplefilter('always'); import mlx.core; from loading import load; "
            "load('demo/target'); load('demo/target'); print('loaded')")
    done = python(code)
    assert done.stdout.strip() == "loaded"
    assert done.stderr.count("bundled reference BLAS (mlx.core was imported before cpu.py)") == 1, done.stderr


@linux_only
@pytest.mark.parametrize("order, warned", [("bundled", True), (None, False)])
def test_main_warns_on_stderr_only_when_the_slow_bundled_blas_is_active(order, warned):
    done = subprocess.run([sys.executable, "main.py", "--demo", "--max-tokens", "3", "--json"],
                          cwd=ROOT, env=env_asking_for(order), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated"] == 3  # stdout stays one JSON object
    assert ("bundled reference BLAS" in done.stderr) == warned
    assert done.stderr.count("warning:") == warned  # once, on one line


def test_a_product_split_by_output_over_the_lanes_equals_one_matmul():
    """Large weights are multiplied in row blocks on several streams (one
    block, one matmul, where there are no lanes)."""
    import mlx.core as mx

    x = mx.random.normal((1, 3, 1024))
    weight = mx.random.normal((4100, 1024))  # rows not divisible by the stream count
    parts = cpu.product_parts(weight, len(cpu.lanes()), by_input=False)
    np.testing.assert_allclose(np.array(cpu.multiply(x, parts)), np.array(x @ weight.T), rtol=1e-5, atol=1e-4)


def test_product_parts_by_output_and_by_input_equal_one_matmul_in_any_thread():
    """Split by the weight's rows (joined) or, stored transposed, by its
    inputs (summed), with sizes the lanes do not divide and x of three
    dimensions, and from a thread other than the one that made the parts
    (each thread has lanes of its own)."""
    import threading

    import mlx.core as mx

    if len(cpu.lanes()) < 2:
        pytest.skip("one core, or the accelerator path: nothing is split")
    lanes = len(cpu.lanes())
    x, weight = mx.random.normal((2, 3, 1027)), mx.random.normal((4101, 1027))  # odd sizes: uneven parts
    stored_transposed = mx.contiguous(weight.T).T
    expected = np.array(x @ weight.T)
    parts = [cpu.product_parts(weight, lanes, by_input=False), cpu.product_parts(stored_transposed, lanes, by_input=True)]
    results = []
    for made in parts:
        results.append(np.array(cpu.multiply(x, made)))
        thread = threading.Thread(target=lambda made=made: results.append(np.array(cpu.multiply(x, made))))
        thread.start()
        thread.join()
    assert len(results) == 4
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-3)


def converted(tokenizer_dir, tmp_path, untied: bool = False, **config) -> Path:
    """A random float32 checkpoint of these shapes, converted: its MLX folder."""
    from checkpoints import make_checkpoint, t5_config

    import convert

    make_checkpoint(tmp_path / "hf", t5_config(**config), 0, tokenizer_dir, untied_head=untied)
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    return tmp_path / "mlx"


def split_layers(model) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, cpu.DecodingProduct) and module.plan.split}


def test_use_cores_splits_the_large_decoding_products_only_and_keeps_the_logits(tokenizer_dir, tmp_path, monkeypatch):
    """A model whose tied head and FFN are over the threshold and whose
    attention is not: the head and the decoder's FFN are split; the
    encoder's FFN is not (the encoder spreads a prompt's chunks of rows over
    the cores itself), nor the small projections; and the logits are the
    unsplit model's, the weights the same arrays under the same names."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import loading

    if not cpu.lanes():
        pytest.skip("one core, or the accelerator path: nothing is split")
    monkeypatch.setattr(cpu, "THREADED", False)  # as with a single-threaded BLAS (BLIS)
    converted(tokenizer_dir, tmp_path, vocab_size=20000, d_model=128, d_ff=16384, initializer_factor=1.0)
    split = loading.load_model(tmp_path / "mlx")
    assert {"shared", "decoder.layers.0.ffn.wi", "decoder.layers.1.ffn.wo"} <= split_layers(split)
    assert type(split.encoder.layers[0].ffn.wi) is nn.Linear  # a prompt's products
    assert "decoder.layers.0.self_attention.q" not in split_layers(split)  # under the threshold
    use_cores = cpu.use_cores
    monkeypatch.setattr(cpu, "use_cores", lambda model, one_row=False: model)
    whole = loading.load_model(tmp_path / "mlx")
    assert type(whole.shared) is nn.Embedding
    before = [(name, id(array)) for name, array in tree_flatten(whole.parameters())]
    swapped = use_cores(whole)
    assert swapped is whole and isinstance(swapped.shared, cpu.DecodingEmbedding)
    assert [(name, id(array)) for name, array in tree_flatten(swapped.parameters())] == before  # same arrays, names
    unsplit = loading.load_model(tmp_path / "mlx")

    def logits(model):
        return np.array(model.decode(mx.array([[0, 5, 9]]), model.make_cache(model.encode(mx.array([[7, 8, 9, 1]])))))

    np.testing.assert_allclose(logits(split), logits(unsplit), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("untied", [False, True])
def test_use_cores_splits_exactly_the_decoders_step_layers(tokenizer_dir, tmp_path, monkeypatch, untied):
    """With no size threshold: every projection a decode step runs (the
    decoder's, but cross-attention's keys and values, which make_cache
    computes once a prompt) and the head (the tied embedding, or lm_head);
    nothing of the encoder's."""

    import loading

    if not cpu.lanes():
        pytest.skip("one core, or the accelerator path: nothing is split")
    monkeypatch.setattr(cpu, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu, "THREADED", False)  # as with a single-threaded BLAS (BLIS)
    converted(tokenizer_dir, tmp_path, untied, num_decoder_layers=2)
    model = loading.load_model(tmp_path / "mlx")
    decoding = {f"decoder.layers.{i}.{part}" for i in range(2) for part in
                ("self_attention.q", "self_attention.k", "self_attention.v", "self_attention.o",
                 "cross_attention.q", "cross_attention.o", "ffn.wi", "ffn.wo")}
    head = {"lm_head", "shared"} if untied else {"shared"}  # an untied model's shared is split too: a lookup, unchanged
    assert split_layers(model) == decoding | head


@pytest.mark.parametrize("threaded", [False, True])
def test_one_row_stores_the_wide_d_model_to_d_ff_weights_transposed_with_the_same_values_and_logits(
        tokenizer_dir, tmp_path, monkeypatch, threaded):
    """A model loaded for one row a step (regular decoding) stores the
    weights of its decoder's d_model -> d_ff products (at least 4 outputs an
    input) transposed, with a one-thread BLAS only: the same
    names and values, the same logits, and a weight updated afterwards is
    multiplied as given."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import loading

    if not cpu.in_use():
        pytest.skip("the accelerator path: nothing is swapped")
    monkeypatch.setattr(cpu, "THREADED", threaded)
    converted(tokenizer_dir, tmp_path, d_model=64, d_ff=512, num_decoder_layers=2)
    one_row, default = loading.load_model(tmp_path / "mlx", one_row=True), loading.load_model(tmp_path / "mlx")
    transposed = {name for name, module in one_row.named_modules()
                  if isinstance(module, cpu.DecodingProduct) and module.plan.transposed}
    assert transposed == (set() if threaded else {"decoder.layers.0.ffn.wi", "decoder.layers.1.ffn.wi"})
    mine, theirs = tree_flatten(one_row.parameters()), tree_flatten(default.parameters())
    assert [name for name, _ in mine] == [name for name, _ in theirs]
    assert all(np.array_equal(np.array(a), np.array(b)) for (_, a), (_, b) in zip(mine, theirs))

    def logits(model):
        cache = model.make_cache(model.encode(mx.array([[7, 8, 9, 1]])))
        return np.array(mx.concatenate([model.decode(mx.array([[token]]), cache) for token in (0, 5, 9)], axis=1))

    np.testing.assert_allclose(logits(one_row), logits(default), rtol=1e-5, atol=1e-3)  # logits of ~100
    doubled = {"decoder": {"layers": [{"ffn": {"wi": {"weight": layer.ffn.wi.weight * 2}}} for layer in default.decoder.layers]}}
    one_row.update(doubled)
    default.update(doubled)
    np.testing.assert_allclose(logits(one_row), logits(default), rtol=1e-5, atol=1e-3)  # logits of ~100


def test_a_compiled_one_token_step_transposes_and_slices_no_weight(tokenizer_dir, tmp_path, monkeypatch):
    """The weights' transposes and split parts are made once, at load: a
    one-token step's graph keeps only attention's transposes of its keys
    (two a layer) and the position bias's, and no slices."""
    import re
    import tempfile

    import mlx.core as mx

    import loading

    if not cpu.in_use():
        pytest.skip("the accelerator path: nothing is swapped")
    monkeypatch.setattr(cpu, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu, "THREADED", False)
    converted(tokenizer_dir, tmp_path, num_decoder_layers=2)
    model = loading.load_model(tmp_path / "mlx")
    cache = model.make_cache(model.encode(mx.array([[7, 8, 9, 1]])))
    for token in (0, 5):  # run plainly, then traced
        mx.eval(model.decode(mx.array([[token]]), cache))
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, model.decode(mx.array([[9]]), cache))
        operations = re.findall(r'label\s*=\s*"(\w+)[^"]*"[^\]]*shape=rectangle', dot.read())
    assert operations.count("Transpose") == 2 * 2 + 1 and "Slice" not in operations


def test_a_blas_with_threads_of_its_own_leaves_every_product_whole(tokenizer_dir, tmp_path, monkeypatch):
    """MKL's threads already spread each product: splitting it over MLX's streams too would crowd the cores."""
    import mlx.nn as nn

    import loading

    if not cpu.lanes():
        pytest.skip("one core, or the accelerator path: nothing is split anyway")
    monkeypatch.setattr(cpu, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu, "THREADED", True)
    converted(tokenizer_dir, tmp_path, num_decoder_layers=2)
    model = loading.load_model(tmp_path / "mlx")
    assert not split_layers(model)
    assert type(model.encoder.layers[0].ffn.wi) is nn.Linear


@pytest.mark.parametrize("asked, expected", [(None, "0"), ("1", "1")])
def test_float32_products_stay_float32_unless_tf32_is_asked_for(asked, expected):
    """MLX multiplies float32 as TF32 on CUDA GPUs and M5 Macs by default; cpu.py,
    imported before mlx.core, turns that off, and a user's MLX_ENABLE_TF32 wins."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"} | ({"MLX_ENABLE_TF32": asked} if asked else {})
    done = subprocess.run([sys.executable, "-c", "import cpu, os; print(os.environ['MLX_ENABLE_TF32'])"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr


def test_projections_with_biases_split_as_t5s_do_with_the_same_logits(tokenizer_dir, tmp_path, monkeypatch):
    """The BART family's decoding projections carry biases: split over the
    cores all the same, each bias added once to the joined product, the
    logits the unsplit model's."""
    import mlx.core as mx
    from checkpoints import family_checkpoint

    import convert
    import loading

    if not cpu.lanes():
        pytest.skip("one core, or the accelerator path: nothing is split")
    monkeypatch.setattr(cpu, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu, "THREADED", False)  # as with a single-threaded BLAS (BLIS)
    family_checkpoint("bart", tmp_path / "hf", tokenizer_dir)
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    split = loading.load_model(tmp_path / "mlx", one_row=True)
    with_bias = {name for name, module in split.named_modules() if isinstance(module, cpu.DecodingLinear) and "bias" in module}
    assert {"decoder.layers.0.self_attention.q", "decoder.layers.1.cross_attention.o", "decoder.layers.1.ffn.wo"} <= with_bias
    assert with_bias <= split_layers(split)
    monkeypatch.setattr(cpu, "use_cores", lambda model, one_row=False: model)
    unsplit = loading.load_model(tmp_path / "mlx")

    def logits(model):
        cache = model.make_cache(model.encode(mx.array([[7, 8, 9, 2]])))
        return np.array(mx.concatenate([model.decode(mx.array([[token]]), cache) for token in (2, 5, 9)], axis=1))

    np.testing.assert_allclose(logits(split), logits(unsplit), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(cpu.mlx_computes_on_cpu(), reason="TF32 is a GPU's: MLX's CPU products are float32")
def test_a_gpus_float32_products_keep_float32s_precision():
    """With cpu.py imported first, MLX honours MLX_ENABLE_TF32=0: a float32
    product is within float32's rounding of float64's (TF32 is ~1e-3 off)."""
    code = ("import cpu, numpy as np, mlx.core as mx; rng = np.random.default_rng(0);"
            "a, b = rng.normal(size=(256, 512)), rng.normal(size=(512, 256));"
            "ours = np.array(mx.array(a, mx.float32) @ mx.array(b, mx.float32), dtype=np.float64);"
            "print(np.abs(ours - a @ b).max() / np.abs(a @ b).max())")
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert float(done.stdout) < 1e-5, done.stderr


def test_compiling_seconds_sum_each_kernels_compile_and_move_only_when_one_is_added(tmp_path):
    """A kernel's compile runs from its source written to its library written;
    the clock reads the folder again only when the folder has changed."""
    import os

    def kernel(name: str, source_at: float, seconds: float) -> None:
        (tmp_path / f"{name}.cpp").write_text("//")
        (tmp_path / f"lib{name}.so").write_bytes(b"")
        os.utime(tmp_path / f"{name}.cpp", (source_at, source_at))
        os.utime(tmp_path / f"lib{name}.so", (source_at + seconds, source_at + seconds))
        os.utime(tmp_path, ns=(int(source_at * 1e9), int((source_at + seconds) * 1e9)))  # as the folder's own change

    import kernels

    folder = kernels.Kernels(tmp_path)
    assert folder.read() == (0.0, 0) and kernels.Kernels(tmp_path / "none yet").read() == (0.0, 0)
    kernel("Af4OAdd_contiguous", 1000.0, 2.5)
    kernel("Bf4OMultiply_strided_2", 2000.0, 1.25)
    assert folder.read() == (3.75, 2)
    (tmp_path / "libBf4OMultiply_strided_2.so").unlink()
    os.utime(tmp_path, ns=(int(2001.25e9), int(2001.25e9)))  # the folder's time as it was: not read again
    assert folder.read() == (3.75, 2)
    os.utime(tmp_path, ns=(int(3000e9), int(3000e9)))
    assert folder.read() == (2.5, 1)
