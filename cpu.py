"""MLX's CPU backend made fast, and the one place that decides whether its path runs.

`in_use()` says whether this process takes the CPU path (our attention,
lanes, products over every core, float32 by default) or the accelerator
path that Metal and CUDA take (MLX's fused attention, bfloat16 by default);
the model, the decoder and the loader ask it and test nothing else.
T5_MLX_PATH=accelerator takes the accelerator path while MLX computes on the
CPU: the tests run both paths on Linux that way, and a Mac's report can be
followed on a Linux machine.

Import this module before `mlx.core`: the BLAS can only be chosen before MLX's
library loads (loaded afterwards, it is never called: MLX has already bound
its symbols to the bundled one).

The `mlx[cpu]` wheel for Linux links the slow reference BLAS. Decoding is
matrix-vector products over the weights, so the BLAS decides the speed.
Loading the chosen library with RTLD_GLOBAL before MLX's own library resolves
its symbols makes MLX call it. Intel MKL (from PyPI) runs its own OpenMP
threads, which spin between products instead of sleeping, so each product
spreads over the cores with no hand-off between sleeping threads. Debian's
BLIS (`libblis4-serial`) runs one thread: with it, `use_cores` splits each
large decoding product over several MLX CPU streams (threads) instead, and
every split product is a hand-off between threads. Which is faster depends on
the CPU (`default_order`): MKL's threads on an Intel Xeon, BLIS on a Zen 4
(docs/DECISIONS.md).
On a CPU newer than its build (BLIS 0.9 on a Zen 5) BLIS falls back to its
portable "generic" kernels; the order skips such a BLIS.

Either way the encoder spreads a prompt's blocks of work over the MLX
streams (`lanes`), and MKL runs one thread meanwhile (`many_rows`).

On macOS MLX uses Accelerate (CPU) and Metal (GPU); nothing is loaded there.
T5_MLX_BLAS picks the library: `mkl`, `blis`, `openblas` or `bundled`, or a
comma-separated order of preference (the default is `mkl,blis,openblas`, or
`blis,mkl,openblas` on AMD's CPUs).
MKL_THREADING_LAYER=SEQUENTIAL keeps MKL to one thread, split as BLIS is.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import re
import sys
import threading


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


def cpu_vendor() -> str:
    """The CPU's maker as Linux names it ("GenuineIntel", "AuthenticAMD"), or ""."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def default_order() -> list[str]:
    """MKL first on Intel's CPUs, BLIS first on AMD's: MKL's products of a
    few rows, decoding's, ran slower than BLIS's split over the cores on a
    Zen 4, where MKL's threads were the faster on an Intel Xeon
    (docs/DECISIONS.md)."""
    return ["blis", "mkl", "openblas"] if cpu_vendor() == "AuthenticAMD" else ["mkl", "blis", "openblas"]

MLX_FIRST = "bundled reference BLAS (mlx.core was imported before cpu.py)"


def _load() -> str:
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if "mlx.core" in sys.modules:
        return MLX_FIRST
    order = [name.strip() for name in os.environ.get("T5_MLX_BLAS", "").lower().split(",") if name.strip()]
    asked = order not in ([], ["auto"])  # a library named by the user is taken whatever its kernels
    if not asked:
        order = default_order()
    skipped = ""
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
        if name == "blis" and not asked and blis_kernels(path) == "generic":
            skipped = "; BLIS skipped: it has only generic kernels for this CPU"
            continue
        if name == "mkl":  # its OpenMP threads (intel-openmp, from the requirements)
            # Idle threads spin this many ms before they sleep: long enough to
            # span a decode step's gaps, short enough not to crowd the Python
            # thread or another library's threads (the default is 200 ms).
            for key, value in (("MKL_THREADING_LAYER", "INTEL"), ("KMP_BLOCKTIME", "5")):
                if key not in os.environ:
                    os.environ[key] = SET_HERE[key] = value
        try:
            library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if name == "blis" and hasattr(library, "bli_pack_set_pack_a"):
            global _library
            _library = library
        if hasattr(library, setter_name):
            global _thread_setter, THREADED
            _thread_setter = getattr(library, setter_name)
            _thread_setter.argtypes, _thread_setter.restype = [count_type], None
            if name == "mkl" and os.environ["MKL_THREADING_LAYER"].upper() != "SEQUENTIAL":
                global _thread_getter
                _thread_getter = library.MKL_Get_Max_Threads
                _thread_getter.argtypes, _thread_getter.restype = [], ctypes.c_int
                if not {"MKL_NUM_THREADS", "OMP_NUM_THREADS"} & set(os.environ):  # else MKL heeds them
                    _thread_setter(_cores())
                THREADED = _thread_getter() > 1
            else:
                _thread_setter(1)
        for setter in ("bli_pack_set_pack_a", "bli_pack_set_pack_b"):
            if name == "blis" and hasattr(library, setter):
                getattr(library, setter).argtypes = [ctypes.c_bool]
        threads = f"{_thread_getter()} threads of its own" if THREADED else "1 thread per MLX stream"
        return f"{name} ({os.path.basename(path)}, {threads}{skipped})"
    return f"bundled reference BLAS (slow: pip install mkl, or apt install libblis4-serial{skipped})"


def _cores() -> int:
    """The cores this process may run on (a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def blis_kernels(path: str) -> str | None:
    """The kernels ("sub-configuration") BLIS chose for this CPU: zen3,
    haswell, skx..., or "generic" when its build does not know the CPU.
    Asked of a private copy (RTLD_LOCAL), which MLX never binds to."""
    try:
        library = ctypes.CDLL(path)
        library.bli_arch_string.restype, library.bli_arch_string.argtypes = ctypes.c_char_p, [ctypes.c_int]
        return library.bli_arch_string(library.bli_arch_query_id()).decode()
    except (OSError, AttributeError):  # not loadable, or a BLIS too old to say
        return None


_thread_setter = _thread_getter = None
_library = None  # the loaded BLAS, when it is BLIS (see many_rows)
THREADED = False  # whether the BLAS spreads each product over the cores itself (MKL's OpenMP threads)
SET_HERE = {}  # the environment variables _load set (child processes of other libraries may want them gone)


def _keep_freed_memory() -> None:
    """MLX's CPU arrays come from malloc. glibc serves large ones with fresh
    pages from the OS and hands them back when freed, so every pass over a
    new multi-megabyte array (a long prompt's attention scores) first faults
    its pages in: 3-5x the cost of the pass itself. Up to 32 MB (glibc's most),
    keep freed memory in the heap for reuse. Peak memory stays as it was;
    memory freed after a peak is kept for the next one."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


_keep_freed_memory()


def set_threads(count: int) -> None:
    """Set how many threads the BLAS runs (training's --threads; MKL
    starts with one per core). A single-threaded build (Debian's
    libblis4-serial) ignores it."""
    if _thread_setter is not None:
        _thread_setter(count)


@contextlib.contextmanager
def many_rows():
    """Evaluate a prompt's products (hundreds of rows) in here: the lanes
    spread its blocks over the cores, so a threaded BLAS runs one thread
    (its threads would crowd the lanes'); BLIS, which skips packing its
    operands for small products ("sup") as suits decoding's few rows but
    runs a prompt's at a third of the speed that way, packs them. Both
    settings are the library's own, global to every thread."""
    threads = _thread_getter() if THREADED and lanes() else None  # no lanes: MKL's threads do the spreading
    if threads:
        _thread_setter(1)
    if _library is not None:
        _library.bli_pack_set_pack_a(True)
        _library.bli_pack_set_pack_b(True)
    try:
        yield
    finally:
        if threads:
            _thread_setter(threads)
        if _library is not None:
            _library.bli_pack_set_pack_a(False)
            _library.bli_pack_set_pack_b(False)


# float32 means float32: MLX runs float32 matrix products as TF32 (10-bit
# mantissas) on CUDA GPUs and M5-class Macs unless told not to, and the greedy
# tokens of a float32 model then drift from transformers'. Whoever wants TF32
# sets MLX_ENABLE_TF32=1; bfloat16 and float16 models never take it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
ACTIVE = _load()
SLOW = ACTIVE.startswith("bundled")  # 4-5x slower matrix products than a real BLAS

import mlx.core as mx  # noqa: E402  (after the BLAS is loaded)
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_map_with_path  # noqa: E402

# With a single-threaded BLAS, splitting costs a hand-off between threads:
# worth it from ~1 MB of float32 weights (T5-small's 512 x 512 attention and
# every larger product); the pair's target's 256 x 256 attention (256 KB)
# ran slower split (docs/DECISIONS.md).
SPLIT_MIN_ELEMENTS = 250_000


PATH_SETTING = "T5_MLX_PATH"  # "accelerator": the path a GPU takes, whatever device MLX computes on


def mlx_computes_on_cpu() -> bool:
    """Whether MLX runs its arrays on the CPU (a GPU's kernels round and
    order their sums differently, whichever path the code takes)."""
    return mx.default_device() == mx.cpu


@functools.cache  # on first use, not at import: the default device may change in between
def in_use() -> bool:
    """Whether this process takes the CPU path: MLX computes on the CPU and
    T5_MLX_PATH does not ask for the accelerator's path."""
    setting = os.environ.get(PATH_SETTING, "").strip().lower()
    if setting not in ("", "auto", "accelerator"):
        print(f"{PATH_SETTING}: unknown path {setting!r} (accelerator, or auto: the device's)", file=sys.stderr)
    return setting != "accelerator" and mlx_computes_on_cpu()


_streams = threading.local()  # MLX's streams belong to the thread that made them


def lanes() -> tuple:
    """The streams that independent blocks of a prompt's work, and the
    parts of a split product, spread over: one per core (up to 4) on the
    CPU path of a multi-core CPU, made once per thread; none otherwise (a
    GPU is parallel already)."""
    if not hasattr(_streams, "lanes"):
        count = min(os.cpu_count() or 1, 4)
        _streams.lanes = () if not in_use() or count < 2 else \
            (mx.default_stream(mx.cpu),) + tuple(mx.new_stream(mx.cpu) for _ in range(count - 1))
    return _streams.lanes


def lane(streams: tuple, i: int):
    """Where block i's work runs: the streams in turn, or the default stream."""
    return mx.stream(streams[i % len(streams)]) if streams else contextlib.nullcontext()


def from_lane(streams: tuple, i: int) -> tuple:
    """The streams in the same turn, starting from stream i: a chunk's blocks
    start on the chunk's own lane, so that chunks of a single block still
    spread over the cores."""
    return streams[i % len(streams):] + streams[:i % len(streams)] if streams else streams


# A one-row product by a (out, in) weight stored row by row runs BLIS's dot
# product kernel along `in`: with the short rows of a d_model -> d_ff weight
# (256-1024 numbers) it ran 1.04-1.8x slower than by the same weight stored
# transposed, whose long rows BLIS streams (`python -m bench blas`, Zen 4).
# With several rows (a verify pass, a batch) the transposed layout was the
# slower by up to 30%, so only a model that decodes one row a step
# (use_cores's one_row) takes it.
TRANSPOSED_MIN_RATIO = 4  # outputs per input, at least
D_FF_INPUT = re.compile(r"ffn\.wi(_0|_1)?$")  # the d_model -> d_ff products (the layout was measured on these)


def product_parts(weight: mx.array, count: int, by_input: bool) -> list[tuple]:
    """x @ weight.T for a weight (out, in) as `count` parts, one per lane:
    (the lane's index or None, the columns of x it takes or None, its block
    of weight.T). By output, the parts are blocks of the weight's rows and
    their products are joined; by input (for a weight stored transposed:
    weight.T is then contiguous, and so is each block of its rows), blocks of
    weight.T's rows, whose products are summed. Every part is a view: no copy.
    Lanes are named by index: each thread has streams of its own (lanes)."""
    if count < 2:
        return [(None, None, weight.T)]
    if by_input:
        size = -(-weight.shape[1] // count)
        return [(i, (i * size, (i + 1) * size), weight.T[i * size : (i + 1) * size]) for i in range(count)]
    size = -(-weight.shape[0] // count)
    return [(i, None, weight[i * size : (i + 1) * size].T) for i in range(count)]


def multiply(x: mx.array, parts: list[tuple]) -> mx.array:
    """x @ weight.T from product_parts, each part's product on its lane (its
    own thread; the BLAS runs one): decoding reads every weight once per
    token, and one core alone cannot saturate memory; a batch's verify pass
    (tens of rows) is bound by arithmetic, and ran 1.5-1.8x faster on two
    cores than on one."""
    if len(parts) == 1:
        return x @ parts[0][2]
    streams = lanes()
    products = [mx.matmul(x if cut is None else x[..., cut[0] : cut[1]], part, stream=streams[lane])
                for lane, cut, part in parts]
    if parts[0][1] is None:
        return mx.concatenate(products, axis=-1)
    total = products[0]
    for product in products[1:]:
        total = total + product
    return total


class DecodingProduct:
    """A decoding layer's product x @ weight.T with its parts (product_parts)
    made once, when the weights are final (`prepare`, which EncoderDecoder.compile_decoding
    calls): a compiled step then runs no transpose or slice of its weights
    (a fifth of a narrow model's operations a step). A
    weight replaced afterwards (update) is multiplied as stored, split by
    output, until the next prepare."""

    def _plan(self, split: bool, transposed: bool) -> None:
        # Not an array, list or tuple: nn.Module keeps it out of the parameters.
        self.plan = _Plan(split, transposed)

    def prepare(self) -> None:
        plan = self.plan
        if plan.weight is self["weight"]:
            return
        transposed = plan.transposed and self["weight"].dtype == mx.float32  # the BLAS's products only
        if transposed:  # the same (out, in) values, stored column by column
            self.weight = mx.contiguous(self["weight"].T).T
        plan.parts = product_parts(self["weight"], len(lanes()) if plan.split else 1, by_input=transposed)
        mx.eval(self["weight"], [part for *_, part in plan.parts])
        plan.weight = self["weight"]

    def product(self, x: mx.array) -> mx.array:
        plan, weight = self.plan, self["weight"]
        if plan.weight is not weight:  # replaced since prepare: drop the old weight's parts (and memory)
            plan.weight = plan.parts = None
            return multiply(x, product_parts(weight, len(lanes()) if plan.split else 1, by_input=False))
        return multiply(x, plan.parts)


class _Plan:
    def __init__(self, split: bool, transposed: bool):
        self.split, self.transposed = split, transposed
        self.weight = self.parts = None  # the weight the parts were made of, and they


class DecodingLinear(nn.Module, DecodingProduct):
    """An nn.Linear as a decode step multiplies by it (DecodingProduct):
    split over the cores (`split`), its weight stored transposed (`transposed`);
    its bias (the BART family's), if any, added to the joined product."""

    def __init__(self, weight: mx.array, split: bool = False, transposed: bool = False, bias: mx.array | None = None):
        nn.Module.__init__(self)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self._plan(split, transposed)

    def __call__(self, x: mx.array) -> mx.array:
        product = self.product(x)
        return product + self["bias"] if "bias" in self else product


class DecodingEmbedding(nn.Embedding, DecodingProduct):
    """An nn.Embedding whose linear form (a tied output head) is a DecodingProduct."""

    def __init__(self, weight: mx.array, split: bool = False):
        nn.Module.__init__(self)
        self.weight = weight
        self._plan(split, transposed=False)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.product(x)


# The layers a decode step runs: the decoder's, but for the cross-attention
# keys and values (a prompt's products, made once by make_cache), and the head.
# The encoder's are left whole: it spreads a prompt's chunks of rows over the lanes.
DECODING_LAYER = re.compile(r"decoder\.layers\.\d+\.(self_attention\.[qkvo]|cross_attention\.[qo]|ffn\.\w+)|lm_head|shared")


def use_cores(model: nn.Module, one_row: bool = False) -> nn.Module:
    """On the CPU path, swap a model's decoding layers (DECODING_LAYER) for
    DecodingLinear and DecodingEmbedding, in place, as nn.quantize swaps
    layers: large products split over the cores (with a BLAS that runs one
    thread, on a multi-core CPU); with `one_row` (every step of this model
    decodes one row: regular decoding of one prompt at a time), the wide
    float32 weights of d_model -> d_ff products stored transposed (with a
    one-thread BLAS). The weights keep their names and values; those not
    stored transposed stay the same arrays. Quantized layers are left alone."""
    if not in_use():
        return model
    one_thread = not THREADED

    def swap(path, module):
        if not DECODING_LAYER.fullmatch(path) or type(module) not in (nn.Linear, nn.Embedding):
            return module
        split = bool(lanes()) and one_thread and module.weight.size >= SPLIT_MIN_ELEMENTS
        if type(module) is nn.Embedding:
            return DecodingEmbedding(module.weight, split)
        outputs, inputs = module.weight.shape
        transposed = one_row and one_thread and module.weight.dtype == mx.float32 and \
            D_FF_INPUT.search(path) is not None and TRANSPOSED_MIN_RATIO * inputs <= outputs
        return DecodingLinear(module.weight, split, transposed, module.get("bias"))

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def prepare(model: nn.Module) -> None:
    """Make every DecodingProduct's parts (and transposed storage) once the
    weights are read; EncoderDecoder.compile_decoding calls it."""
    for _, module in model.named_modules():
        if isinstance(module, DecodingProduct):
            module.prepare()
