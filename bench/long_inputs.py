"""Long prompts: `encode` (time to the first token and peak memory, 128 to 8,192 tokens) and `attention`
(one block of a long input's attention, step by step)."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import ROOT, ratio, table


def encode_worker(folder: str, length: int, hf: bool) -> None:
    """In a fresh process: the time from a prompt of `length` tokens to the
    first token's logits (encoding, cross-attention keys and values, one
    decoder step), ours or transformers', and the process's peak memory."""
    ids = [(i * 7919) % 1000 + 3 for i in range(length - 1)] + [1]
    if hf:
        import torch
        from transformers import T5ForConditionalGeneration

        torch.set_num_threads(os.cpu_count() or 1)
        model = T5ForConditionalGeneration.from_pretrained(folder).eval()

        def first_logits(prompt):
            with torch.no_grad():
                return model(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[0]])).logits
    else:
        import mlx.core as mx

        from rows import encode_for
        from loading import load_model

        model = load_model(folder)
        mx.eval(model.parameters())

        def first_logits(prompt):
            (cache,) = encode_for([model], [prompt])
            return mx.eval(model.decode(mx.array([[model.args.decoder_start_token_id]]), cache))

    first_logits(ids[:64])  # a warm-up on a short prompt: libraries load, kernels compile
    start = time.perf_counter()
    first_logits(ids)
    seconds = time.perf_counter() - start
    peak = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024
    print(json.dumps({"seconds": seconds, "peak": peak}))


def run_encode(args) -> dict:
    """Long inputs, ours against transformers, on T5-large shapes and the
    demo target's, each run in a fresh process, alternating."""
    pair = fixtures.benchmark_pair(args.dir)  # its draft_hf: the demo target as a Hugging Face checkpoint
    large_hf = fixtures.build_large(args.dir / "t5-large-random")
    shapes = {"T5-large shapes": (fixtures.converted(large_hf, args.dir / "t5-large-random-mlx"), large_hf),
              "demo target": (DEMO / "target", pair["draft_hf"])}

    def run(folder: Path, length: int, hf: bool) -> dict:
        command = [sys.executable, "-m", "bench", "--encode-worker", str(folder), "--tokens", str(length)] + ["--hf"] * hf
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"seconds": math.nan, "peak": math.nan, "error": done.stderr.strip().splitlines()[-1]}
        return json.loads(done.stdout)

    rows = []
    for name, (ours_dir, hf_dir) in shapes.items():
        for length in [int(n) for n in args.lengths.split(",")]:
            repeats = args.repeats if length < 8192 else 1
            runs = [(run(ours_dir, length, False), run(hf_dir, length, True)) for _ in range(repeats)]
            medians = [{key: statistics.median(r[key] for r in side) for key in ("seconds", "peak")} for side in zip(*runs)]
            rows.append({"model": name, "tokens": length, "ours": medians[0], "transformers": medians[1]})
    return {"repeats": args.repeats, "rows": rows}


def render_encode(data: dict) -> str:
    rows = [[r["model"], f"{r['tokens']:,}", f"{r['ours']['seconds']:.2f} s", f"{r['transformers']['seconds']:.2f} s",
             f"{r['ours']['seconds'] / r['transformers']['seconds']:.2f}", f"{r['ours']['peak'] / 1e9:.2f} GB",
             f"{r['transformers']['peak'] / 1e9:.2f} GB"] for r in data["rows"]]
    return ("From a prompt to its first token's logits (encoding, cross-attention keys and values, one decoder step), "
            f"float32, each run in a fresh process, alternating, medians of {data['repeats']} (one run at 8,192 tokens)\n\n"
            + table(["model", "input tokens", "ours", "transformers", "ours / transformers", "ours' peak memory",
                     "transformers' peak memory"], rows))


def run_attention(args) -> dict:
    """One block of encoder attention as attention.py cuts it (the demo
    target's 4 heads, 128 queries, 4,096 keys: 2 M scores), step by step, in
    ns a score on one core; and the page faults that reused memory avoids."""
    import mlx.core as mx

    import attention
    import model

    heads, rows, keys, d_kv = 4, 128, 4096, 64
    queries, k, v = (mx.random.normal((1, heads, n, d_kv)) for n in (rows, keys, keys))
    bias = model.bias_rows(mx.random.normal((2 * keys - 1, heads)), 0, rows, keys)
    scores = mx.addmm(bias, queries, k.swapaxes(-1, -2))
    below_zero = scores - scores.max(axis=-1, keepdims=True)
    mx.eval(queries, k, v, scores, below_zero)

    def cost(make, elements=heads * rows * keys) -> float:  # ns an element, median of 9 after a warm-up
        mx.eval(make())
        times = []
        for _ in range(9):
            start = time.perf_counter()
            mx.eval(make())
            times.append(time.perf_counter() - start)
        return statistics.median(times) / elements * 1e9

    steps = {
        "query-key product with the bias (mx.addmm)": lambda: mx.addmm(bias, queries, k.swapaxes(-1, -2)),
        "row maximum": lambda: scores.max(axis=-1, keepdims=True),
        "MLX's exp": lambda: mx.exp(below_zero),
        "MLX's power (e ** x)": lambda: mx.power(math.e, below_zero),
        "our exp (compiled polynomial, attention.py's)": lambda: attention.exp_below_zero(below_zero),
        "weighted sum of values": lambda: scores @ v,
        "row sum": lambda: scores.sum(axis=-1, keepdims=True),
        "the whole block: our CPU attention": lambda: attention.softmax_attention(queries, k, v, bias, own=True),
        "the whole block: MLX's fused attention":
            lambda: mx.fast.scaled_dot_product_attention(queries, k, v, scale=1.0, mask=bias),
    }
    small, large = mx.random.normal((1 << 20,)), mx.random.normal((1 << 23,))
    mx.eval(small, large)
    return {"ns_per_score": {name: cost(make) for name, make in steps.items()},
            "ns_per_element": {"reused": cost(lambda: small + 1, 1 << 20), "fresh": cost(lambda: large + 1, 1 << 23)}}


def render_attention(data: dict) -> str:
    rows = [[name, f"{ns:.2f}"] for name, ns in data["ns_per_score"].items()]
    per = data["ns_per_element"]
    return ("One block of attention (4 heads, 128 queries, 4,096 keys), ns a score, one core\n\n"
            + table(["step", "ns a score"], rows)
            + f"\n\nAn addition over 1 M floats (memory reused): {per['reused']:.2f} ns an element; over 8 M (fresh pages): "
            f"{per['fresh']:.2f} ns, {ratio(per['fresh'], per['reused'])}.")
