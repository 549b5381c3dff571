"""`blas`: every installed BLAS on decoding's products, each in a process of its own (the library is chosen
once a process), and the kernels BLIS picked for this CPU: what cpu.py's default order rests on."""

import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import time

from bench.harness import ROOT, table

# (rows, columns) of the weights a decode step multiplies: the demo target's, the
# benchmark pair target's FFN, T5-large's attention and FFN.
SHAPES = [(256, 256), (512, 256), (8192, 256), (256, 8192), (1024, 1024), (4096, 1024)]
ROWS = [1, 2, 5, 8, 40]  # a regular step, verify passes of 1 and 4 drafts, batches of 8 (x 5)
# d_model -> d_ff weights (T5-small's, the pair target's, T5-large's, T5-3B's), as stored and transposed (cpu.py)
LAYOUT_SHAPES = [(2048, 512), (8192, 256), (4096, 1024), (16384, 1024)]


def timed(product, count: int) -> float:
    """Microseconds a product, medians over 7 runs of `count` products (after 2)."""
    import mlx.core as mx

    runs = []
    for _ in range(9):
        start = time.perf_counter()
        mx.eval(product())
        runs.append((time.perf_counter() - start) / count)
    return statistics.median(runs[2:]) * 1e6


def blas_worker() -> None:
    """In a process whose BLAS T5_MLX_BLAS chose: microseconds a product
    x @ w.T as decoding runs it (whole with MKL's threads, else split over
    the cores), for each weight shape and row count, 10 weights a run; MLX's
    8-bit product of the same (groups of 64), which calls no BLAS and runs on
    one stream, as a quantized model's layers do; and the d_model -> d_ff
    weights as stored against stored transposed."""
    import cpu
    import mlx.core as mx

    count = 1 if cpu.THREADED else len(cpu.lanes())
    times, quantized, layouts = {}, {}, {}
    for shape in SHAPES:
        weights = [mx.random.normal(shape) for _ in range(10)]
        packed = [mx.quantize(w, group_size=64, bits=8) for w in weights]
        mx.eval(weights, packed)
        parts = [cpu.product_parts(w, count, by_input=False) for w in weights]  # made once, as decoding's are
        for rows in ROWS:
            x = mx.random.normal((rows, shape[1]))
            mx.eval(x)
            times[f"{shape}x{rows}"] = timed(lambda: [cpu.multiply(x, p) for p in parts], len(weights))
            quantized[f"{shape}x{rows}"] = timed(
                lambda: [mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=8) for q in packed], len(weights))
    for shape in LAYOUT_SHAPES:
        weights = [mx.random.normal(shape) for _ in range(10)]
        transposed = [mx.contiguous(w.T).T for w in weights]  # the same values, stored column by column
        mx.eval(weights, transposed)
        stored = [cpu.product_parts(w, count, by_input=False) for w in weights]
        flipped = [cpu.product_parts(w, count, by_input=True) for w in transposed]
        for rows in ROWS:
            x = mx.random.normal((rows, shape[1]))
            mx.eval(x)
            runs = [[], []]
            for _ in range(9):  # the two layouts in turn, so that a slow spell touches both
                for layout, parts in enumerate((stored, flipped)):
                    start = time.perf_counter()
                    mx.eval([cpu.multiply(x, p) for p in parts])
                    runs[layout].append((time.perf_counter() - start) / len(weights))
            layouts[f"{shape}x{rows}"] = [statistics.median(run[2:]) * 1e6 for run in runs]
        del weights, transposed, stored, flipped
    print(json.dumps({"active": cpu.ACTIVE, "times": times, "quantized": quantized, "layouts": layouts}))


def run_blas(args) -> dict:
    import cpu

    blis = ctypes.util.find_library("blis")
    data = {"blis_kernels": cpu.blis_kernels(blis) if blis else None, "libraries": {}, "quantized": None}
    for name in ("blis", "mkl", "openblas"):
        env = {**os.environ, "T5_MLX_BLAS": name}
        done = subprocess.run([sys.executable, "-m", "bench", "--blas-worker"], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            result = json.loads(done.stdout)
            if result["active"].startswith(name):  # not installed: the worker fell back to the bundled BLAS
                data["libraries"][name] = {"times": result["times"], "layouts": result["layouts"]}
                data["quantized"] = data["quantized"] or result["quantized"]
    return data


def render_blas(data: dict) -> str:
    names = list(data["libraries"])
    if not names:
        return "No BLAS could be measured (each worker failed, or fell back to the bundled one)."
    rows = []
    for shape in SHAPES:
        for count in ROWS:
            key = f"{tuple(shape)}x{count}"
            cells = [data["libraries"][name]["times"][key] for name in names]
            best = min(cells)
            rows.append([f"{shape[0]} x {shape[1]}", count, *(f"**{c:.0f}**" if c == best else f"{c:.0f}" for c in cells),
                         f"{data['quantized'][key]:.0f}", f"{data['quantized'][key] / best:.1f}x"])
    layouts = [[f"{shape[0]} x {shape[1]}", count] + [
        "{:.0f} / {:.0f} / {:.2f}x".format(*data["libraries"][name]["layouts"][f"{tuple(shape)}x{count}"],
                                            data["libraries"][name]["layouts"][f"{tuple(shape)}x{count}"][0]
                                            / data["libraries"][name]["layouts"][f"{tuple(shape)}x{count}"][1])
        for name in names] for shape in LAYOUT_SHAPES for count in ROWS]
    return (f"Decoding's products (x @ w.T over the cores, as decoding runs them), microseconds each, by BLAS, and "
            f"MLX's 8-bit product (no BLAS, one stream); BLIS's kernels for this CPU: "
            f"{data['blis_kernels'] or 'BLIS not installed'}\n\n"
            + table(["weight (rows x columns)", "x rows", *names, "8-bit", "8-bit / fastest float32"], rows)
            + "\n\nd_model -> d_ff weights as stored (out x in) and stored transposed (cpu.use_cores's one_row), "
            "microseconds each; speed of transposed over stored\n\n"
            + table(["weight (rows x columns)", "x rows"] + [f"{name}: stored / transposed / speed" for name in names], layouts))
