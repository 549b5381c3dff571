"""Measure decoding speed against Hugging Face transformers.

    python bench.py regular          # T5-large-shaped random fp32 checkpoint, 100 tokens
    python bench.py speculative      # a target/draft pair with controlled agreement
    python bench.py                  # both

Checkpoints are built once under bench_models/ and converted with convert.py.
Runs of ours and of transformers (PyTorch CPU, same thread count, in a separate
process so neither library's threading settings touch the other) alternate,
and the tables report medians.

The speculative pair: random weights make two models never agree, so the
target embeds the draft exactly (same embeddings, the draft's layers first
with their FFN zero-padded to a wider d_ff) and adds layers whose output
projections are scaled by a small epsilon: the draft plus an epsilon-sized
perturbation, costing what a larger model costs.
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
PAIR_DRAFT = dict(vocab_size=32128, d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=6, initializer_factor=10.0)
PAIR_TARGET = dict(PAIR_DRAFT, d_ff=8192, num_layers=24)  # 18 extra layers per stack
PAIR_EPSILON = 0.001  # greedy acceptance ~0.8 at num-draft 4 (initializer_factor 10 makes the target chaotic)
PAIR_DRAFT_SEED = 3  # greedy output of 83 distinct tokens in 100 (most seeds repeat a few)
PROMPT_IDS = [13, 52, 999, 81, 7, 402, 33, 91, 18, 640, 22, 5, 77, 301, 9, 1]


sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "demo")]  # checkpoints.py (random T5 checkpoints), train.py


def tokenizer_folder(root: Path) -> Path:
    from checkpoints import train_tokenizer

    folder = root / "tokenizer"
    return folder if (folder / "tokenizer.json").exists() else train_tokenizer(folder)


def build_checkpoint(folder: Path) -> Path:
    from checkpoints import make_checkpoint, t5_config

    if not (folder / "config.json").exists():
        print(f"building a random T5-large-shaped checkpoint in {folder} ...", file=sys.stderr)
        make_checkpoint(folder, t5_config(**T5_LARGE), 0, tokenizer_folder(folder.parent))
    return folder


def build_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) Hugging Face checkpoints; see the module docstring."""
    import torch
    from checkpoints import make_checkpoint, t5_config
    from safetensors.torch import load_file, save_file

    draft, target = root / "pair-draft", root / "pair-target"
    if (target / "config.json").exists():
        return target, draft
    print(f"building the speculative pair in {root} ...", file=sys.stderr)
    tokenizer = tokenizer_folder(root)
    make_checkpoint(draft, t5_config(**PAIR_DRAFT), PAIR_DRAFT_SEED, tokenizer)
    make_checkpoint(target, t5_config(**PAIR_TARGET), 1, tokenizer)
    draft_state = load_file(str(draft / "model.safetensors"))
    state = load_file(str(target / "model.safetensors"))
    for name, tensor in state.items():
        if name in draft_state:  # the draft's layers, embeddings and norms, FFN zero-padded
            padded = torch.zeros_like(tensor)
            padded[tuple(slice(0, n) for n in draft_state[name].shape)] = draft_state[name]
            state[name] = padded
        elif name.endswith(("SelfAttention.o.weight", "EncDecAttention.o.weight", "DenseReluDense.wo.weight")):
            state[name] = tensor * PAIR_EPSILON  # extra layers: an epsilon-sized perturbation
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target, draft


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


def hf_worker(checkpoint: str, tokens: int, assistant: str | None, num_draft: int) -> None:
    """Persistent transformers process: one greedy generation per input line,
    assisted by `assistant` with a constant number of draft tokens if given."""
    import torch
    from transformers import T5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = T5ForConditionalGeneration.from_pretrained(checkpoint).eval()
    options = {}
    if assistant:
        draft = T5ForConditionalGeneration.from_pretrained(assistant).eval()
        draft.generation_config.num_assistant_tokens = num_draft
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        options["assistant_model"] = draft
    prompt = torch.tensor([PROMPT_IDS])
    print(json.dumps({"ready": torch.__version__}), flush=True)
    for _ in sys.stdin:
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1, **options)
            seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": out[0, 1:].tolist()}), flush=True)


class HFWorker:
    def __init__(self, checkpoint: Path, tokens: int, assistant: Path | None = None, num_draft: int = 0):
        command = [sys.executable, __file__, "--hf-worker", str(checkpoint), "--tokens", str(tokens), "--num-draft", str(num_draft)]
        if assistant:
            command += ["--assistant", str(assistant)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.torch_version = json.loads(self.process.stdout.readline())["ready"]

    def run(self) -> tuple[float, list[int]]:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        result = json.loads(self.process.stdout.readline())
        return result["seconds"], result["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


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


def median_rate(tokens: int, times: list[float]) -> float:
    return tokens / statistics.median(times)


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}\n\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def bench_regular(args) -> None:
    import blas
    import mlx.core as mx

    from decoder import Sampling, Stats, regular_generate
    from model import load_model

    hf_dir = build_checkpoint(args.dir / "t5-large-random")
    mlx_dir = args.dir / "t5-large-random-mlx"
    convert_start = time.perf_counter()
    convert_peak = convert_measuring_memory(hf_dir, mlx_dir)
    convert_seconds = time.perf_counter() - convert_start
    source_bytes = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))

    start = time.perf_counter()
    model = load_model(mlx_dir)
    load_seconds = time.perf_counter() - start
    worker = HFWorker(hf_dir, args.tokens)

    def ours():
        stats = Stats()
        tokens = list(regular_generate(model, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
        return stats.seconds, tokens

    ours(), worker.run()  # warm-up
    our_times, their_times = [], []
    for _ in range(args.repeats):
        seconds, our_tokens = ours()
        our_times.append(seconds)
        seconds, their_tokens = worker.run()
        their_times.append(seconds)
    worker.close()

    bandwidth = memory_read_bandwidth()
    per_token = weight_bytes_per_token(model)
    our_rate, their_rate = median_rate(args.tokens, our_times), median_rate(args.tokens, their_times)
    achieved = per_token * our_rate
    threads = os.cpu_count()
    print_table(f"Regular greedy decoding, {args.tokens} tokens, median of {args.repeats} alternating runs", [
        ("checkpoint", f"random T5-large shapes, float32, {source_bytes / 1e9:.2f} GB"),
        ("ours: MLX " + mx.__version__ + ", BLAS " + blas.ACTIVE.split(" (")[0], f"{our_rate:.2f} tokens/s"),
        (f"transformers (PyTorch {worker.torch_version} CPU, {threads} threads)", f"{their_rate:.2f} tokens/s"),
        ("speedup over transformers", f"{our_rate / their_rate:.2f}x"),
        ("same greedy tokens", "yes" if our_tokens == their_tokens else "NO"),
        ("weights read per token", f"{per_token / 1e9:.2f} GB"),
        ("achieved weight bandwidth", f"{achieved / 1e9:.1f} GB/s"),
        (f"machine read bandwidth ({threads} threads)", f"{bandwidth / 1e9:.1f} GB/s"),
        ("fraction of the bandwidth limit", f"{achieved / bandwidth:.0%}"),
        ("load converted model (before first forward)", f"{load_seconds:.2f} s"),
        ("conversion: time, peak RSS", f"{convert_seconds:.1f} s, {convert_peak / 1e6:.0f} MB"),
    ])


def step_seconds(model, width: int = 1, steps: int = 20) -> float:
    """Median time of one decode step over `width` new tokens with a warm cache."""
    import mlx.core as mx

    cache = model.make_cache(model.encode(mx.array([PROMPT_IDS])))
    mx.eval(model.decode(mx.array([[0] * 20]), cache))
    tokens = mx.array([[0] * width])
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        mx.eval(model.decode(tokens, cache))
        times.append(time.perf_counter() - start)
        cache.trim(width)
    return statistics.median(times[3:])


def bench_speculative(args) -> None:
    import mlx.core as mx

    from decoder import Sampling, Stats, regular_generate, speculative_generate
    from model import load_model

    target_hf, draft_hf = build_pair(args.dir)
    target_dir, draft_dir = args.dir / "pair-target-mlx", args.dir / "pair-draft-mlx"
    for source, out in ((target_hf, target_dir), (draft_hf, draft_dir)):
        if not (out / "config.json").exists():
            convert_measuring_memory(source, out)
    target, draft = load_model(target_dir), load_model(draft_dir)
    worker_regular = HFWorker(target_hf, args.tokens)
    worker_assisted = HFWorker(target_hf, args.tokens, draft_hf, args.num_draft)

    def regular():
        stats = Stats()
        tokens = list(regular_generate(target, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
        return stats, tokens

    def speculative():
        stats = Stats()
        tokens = list(speculative_generate(target, draft, PROMPT_IDS, args.tokens, Sampling(), args.num_draft, 0.0, stats))
        return stats, tokens

    def draft_alone():
        stats = Stats()
        list(regular_generate(draft, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
        return stats

    regular(), speculative(), draft_alone(), worker_regular.run(), worker_assisted.run()  # warm-up
    runs = {name: [] for name in ("regular", "speculative", "hf regular", "hf assisted")}
    # Single-step times for the ideal: each model decoding alone, through the
    # same code path and in the same alternation as the runs they judge.
    target_steps, draft_steps, verify_costs = [], [], []
    for _ in range(args.repeats):
        stats, regular_tokens = regular()
        runs["regular"].append(stats.seconds)
        target_steps.append(stats.seconds / stats.target_calls)
        # What a verify pass over num_draft + 1 tokens costs against one step, timed back to back.
        verify_costs.append(step_seconds(target, args.num_draft + 1) / step_seconds(target))
        stats = draft_alone()
        draft_steps.append(stats.seconds / stats.target_calls)
        stats, spec_tokens = speculative()
        runs["speculative"].append(stats)
        seconds, hf_tokens = worker_regular.run()
        runs["hf regular"].append(seconds)
        seconds, assisted_tokens = worker_assisted.run()
        runs["hf assisted"].append(seconds)
    worker_regular.close()
    worker_assisted.close()

    t_target, t_draft, verify_cost = (statistics.median(x) for x in (target_steps, draft_steps, verify_costs))
    spec_times = [stats.seconds for stats in runs["speculative"]]
    spec = runs["speculative"][spec_times.index(statistics.median_low(spec_times))]
    ideal = spec.target_calls * t_target + spec.draft_calls * t_draft
    rates = {name: median_rate(args.tokens, [s.seconds for s in times] if name == "speculative" else times)
             for name, times in runs.items()}
    same = regular_tokens == spec_tokens == hf_tokens == assisted_tokens
    print_table(f"Speculative greedy decoding (num-draft {args.num_draft}, delta 0), {args.tokens} tokens, "
                f"median of {args.repeats} alternating runs", [
        ("pair", f"draft: d_model 512, 6+6 layers, d_ff 2048; target: the draft + 18+18 layers scaled by "
                 f"{PAIR_EPSILON}, d_ff 8192 (float32)"),
        ("decode step, each model decoding alone: target, draft", f"{t_target * 1e3:.1f} ms, {t_draft * 1e3:.1f} ms"),
        (f"target verify pass ({args.num_draft + 1} tokens) against a single step", f"{verify_cost:.2f}x"),
        ("acceptance rate", f"{spec.acceptance_rate:.2f} ({spec.accepted} / {spec.drafted})"),
        ("ours, regular", f"{rates['regular']:.2f} tokens/s"),
        ("ours, speculative", f"{rates['speculative']:.2f} tokens/s"),
        ("speedup over our regular decoding", f"{rates['speculative'] / rates['regular']:.2f}x"),
        (f"transformers, regular (PyTorch {worker_regular.torch_version} CPU)", f"{rates['hf regular']:.2f} tokens/s"),
        (f"transformers, assisted (num_assistant_tokens {args.num_draft}, constant)", f"{rates['hf assisted']:.2f} tokens/s"),
        ("ours speculative over transformers assisted", f"{rates['speculative'] / rates['hf assisted']:.2f}x"),
        ("same tokens (ours regular, speculative; transformers regular, assisted)", "yes" if same else "NO"),
        ("target calls, draft calls", f"{spec.target_calls}, {spec.draft_calls}"),
        ("ideal time (target calls x step + draft calls x step)", f"{ideal:.2f} s"),
        ("measured time", f"{spec.seconds:.2f} s"),
        ("efficiency (ideal / measured)", f"{ideal / spec.seconds:.0%}"),
        ("efficiency counting the verify pass's real cost",
         f"{(spec.target_calls * t_target * verify_cost + spec.draft_calls * t_draft) / spec.seconds:.0%}"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description="Decoding speed: ours vs Hugging Face transformers")
    parser.add_argument("which", nargs="?", choices=["regular", "speculative", "all"], default="all")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-draft", type=int, default=4, help="speculative: draft tokens per verify step")
    parser.add_argument("--dir", type=Path, default=ROOT / "bench_models")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--assistant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.tokens, args.assistant, args.num_draft)
    import blas  # noqa: F401  (before mlx.core, which the benchmarks import)

    args.dir.mkdir(parents=True, exist_ok=True)
    if args.which in ("regular", "all"):
        bench_regular(args)
    if args.which in ("speculative", "all"):
        bench_speculative(args)


if __name__ == "__main__":
    main()
