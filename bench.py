"""Measure regular decoding against Hugging Face transformers on one checkpoint.

    python bench.py                  # T5-large-shaped random fp32 checkpoint, 100 tokens, 5 repeats

Builds (once, under bench_models/) a random checkpoint with T5-large's shapes,
converts it with convert.py (peak memory recorded), then alternates greedy
decoding runs of ours and of transformers (PyTorch CPU, same thread count, in
a separate process so neither library's threading settings touch the other)
and prints a Markdown table of medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent
T5_LARGE = dict(vocab_size=32128, d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=24, initializer_factor=1.0)
PROMPT_IDS = [13, 52, 999, 81, 7, 402, 33, 91, 18, 640, 22, 5, 77, 301, 9, 1]


def build_checkpoint(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_checkpoint, t5_config, train_tokenizer

    if not (folder / "config.json").exists():
        print(f"building a random T5-large-shaped checkpoint in {folder} ...", file=sys.stderr)
        tokenizer = train_tokenizer(folder.parent / "tokenizer")
        make_checkpoint(folder, t5_config(**T5_LARGE), 0, tokenizer)
    return folder


def convert_measuring_memory(source: Path, out: Path) -> int:
    """Run convert.py in a fresh process; return its peak resident memory in bytes."""
    script = (
        "import atexit, re, runpy, sys;"
        "atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], file=sys.stderr));"
        "sys.argv = ['convert.py', *sys.argv[1:]]; runpy.run_path('convert.py', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", script, "--model", str(source), "--out", str(out), "--dtype", "float32", "--force"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"conversion failed: {done.stderr.strip().splitlines()[-1]}")
    return int(done.stderr.split("VmHWM")[-1].split()[0]) * 1024


def memory_read_bandwidth() -> float:
    """Bytes/s summing a 1 GiB array with one thread per core (the machine's read limit)."""
    import numpy as np

    data = np.ones(1 << 28, dtype=np.float32)
    parts = np.array_split(data, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(parts)) as pool:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return data.nbytes / statistics.median(times)


def hf_worker(checkpoint: str, tokens: int) -> None:
    """Persistent transformers process: one greedy generation per input line."""
    import torch
    from transformers import T5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = T5ForConditionalGeneration.from_pretrained(checkpoint).eval()
    prompt = torch.tensor([PROMPT_IDS])
    print(json.dumps({"ready": torch.__version__}), flush=True)
    for _ in sys.stdin:
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1)
            seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": out[0, 1:].tolist()}), flush=True)


def weight_bytes_per_token(model) -> int:
    """Weights one decode step reads: the decoder (cross-attention keys/values
    are computed once per prompt) and the output head."""
    from mlx.utils import tree_flatten

    total = 0
    for name, array in tree_flatten(model.parameters()):
        if name.startswith("encoder.") or ".cross_attention.k." in name or ".cross_attention.v." in name:
            continue
        if name == "shared.weight" and not model.args.tie_word_embeddings:
            continue  # only one embedding row is read
        total += array.nbytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description="Regular decoding: ours vs Hugging Face transformers")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=ROOT / "bench_models")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.tokens)

    hf_dir = build_checkpoint(args.dir / "t5-large-random")
    mlx_dir = args.dir / "t5-large-random-mlx"
    convert_start = time.perf_counter()
    convert_peak = convert_measuring_memory(hf_dir, mlx_dir)
    convert_seconds = time.perf_counter() - convert_start
    source_bytes = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))

    import blas
    import mlx.core as mx

    from decoder import Sampling, Stats, regular_generate
    from model import load_model

    start = time.perf_counter()
    model = load_model(mlx_dir)
    load_seconds = time.perf_counter() - start

    worker = subprocess.Popen([sys.executable, __file__, "--hf-worker", str(hf_dir), "--tokens", str(args.tokens)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    torch_version = json.loads(worker.stdout.readline())["ready"]

    def ours():
        stats = Stats()
        tokens = list(regular_generate(model, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
        return stats.seconds, tokens

    def theirs():
        worker.stdin.write("go\n")
        worker.stdin.flush()
        result = json.loads(worker.stdout.readline())
        return result["seconds"], result["tokens"]

    ours(), theirs()  # warm-up
    our_times, their_times = [], []
    for _ in range(args.repeats):
        seconds, our_tokens = ours()
        our_times.append(seconds)
        seconds, their_tokens = theirs()
        their_times.append(seconds)
    worker.stdin.close()
    worker.wait()

    bandwidth = memory_read_bandwidth()
    per_token = weight_bytes_per_token(model)
    our_rate = args.tokens / statistics.median(our_times)
    their_rate = args.tokens / statistics.median(their_times)
    achieved = per_token * our_rate
    threads = os.cpu_count()
    rows = [
        ("checkpoint", f"random T5-large shapes, float32, {source_bytes / 1e9:.2f} GB"),
        ("ours: MLX " + mx.__version__ + ", BLAS " + blas.ACTIVE.split(" (")[0], f"{our_rate:.2f} tokens/s"),
        (f"transformers (PyTorch {torch_version} CPU, {threads} threads)", f"{their_rate:.2f} tokens/s"),
        ("speedup over transformers", f"{our_rate / their_rate:.2f}x"),
        ("same greedy tokens", "yes" if our_tokens == their_tokens else "NO"),
        ("weights read per token", f"{per_token / 1e9:.2f} GB"),
        ("achieved weight bandwidth", f"{achieved / 1e9:.1f} GB/s"),
        (f"machine read bandwidth ({threads} threads)", f"{bandwidth / 1e9:.1f} GB/s"),
        ("fraction of the bandwidth limit", f"{achieved / bandwidth:.0%}"),
        ("load converted model (before first forward)", f"{load_seconds:.2f} s"),
        ("conversion: time, peak RSS", f"{convert_seconds:.1f} s, {convert_peak / 1e6:.0f} MB"),
    ]
    print(f"\nGreedy decoding, {args.tokens} tokens, median of {args.repeats} alternating runs\n")
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
