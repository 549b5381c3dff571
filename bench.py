"""Measure decoding speed against Hugging Face transformers and CTranslate2.

    python bench.py regular          # T5-large-shaped random fp32 checkpoint, 100 tokens
    python bench.py speculative      # the benchmark pair, on held-out demo prompts
    python bench.py batch            # many prompts: batched speculative and regular decoding, by batch size
    python bench.py drafting         # num-draft auto against each fixed num-draft
    python bench.py fresh            # fresh processes: auto in a short session; one-shot runs against warm ones
    python bench.py lookup           # prompt lookup (no draft model) against regular decoding
    python bench.py quantized        # float and quantized: size, memory, speed and quality
    python bench.py sizes            # weights of t5-small ... t5-11b by format, and which Mac holds them
    python bench.py encode           # long inputs: time to the first token and peak memory, 128 to 8,192 tokens
    python bench.py attention        # what one block of a long input's attention costs, step by step
    python bench.py serve            # server.py under 1 to 64 concurrent clients, against batch_generate offline
    python bench.py                  # regular and speculative

Checkpoints are built once under bench_models/ and converted with convert.py
(and CTranslate2's converter). Runs of ours and of the references alternate
(`alternate`), and the tables report medians. The references run in
processes of their own (`Worker`), on as many threads as cores, so that no
library's threading settings touch another's: transformers (PyTorch CPU), and
in regular, steps and speculative CTranslate2 (float32 and int8, each with
its wheel's GNU OpenMP and with Intel's), when installed. Every table starts
with the machine it ran on.

The benchmark pair has trained agreement: the draft is the demo target
(demo/, 8.4 M parameters), and the target embeds it exactly and adds 18+18
random layers whose output projections are scaled down, with FFNs widened to
d_ff 8192 (about 220 M parameters). The draft agrees with it on any prompt,
as far as the extra layers let it; random weights never agree.
"""

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEMO = ROOT / "demo"
T5_LARGE = dict(vocab_size=32128, d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=24, initializer_factor=1.0)
T5_SMALL = dict(vocab_size=32128, d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=6, initializer_factor=1.0)
PROMPT_IDS = [13, 52, 999, 81, 7, 402, 33, 91, 18, 640, 22, 5, 77, 301, 9, 1]
# The target grown from the demo target. The scale sets the agreement: at 0.2 the
# table shows acceptance near 0.8, and greedy outputs that still differ from the draft's.
PAIR = dict(extra_layers=18, d_ff=8192, scale=0.2, seed=1)


def machine() -> str:
    """CPU model, cores and BLAS: ratios move from machine to machine."""
    import cpu

    model = platform.processor() or platform.machine()
    if sys.platform == "linux":  # a virtual machine's "AMD EPYC" may be any generation: its family tells which
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        model = fields.get("model name", model)
        if "cpu family" in fields:
            wide = ", AVX-512" if "avx512f" in fields.get("flags", "").split() else ""
            model += f" (family {fields['cpu family']} model {fields.get('model', '?')}{wide})"
    elif sys.platform == "darwin":
        model = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
    return f"{model}, {os.cpu_count()} cores, BLAS {cpu.ACTIVE.split(' (')[0]}"


def build_large(folder: Path, shapes: dict = T5_LARGE) -> Path:
    from checkpoints import make_checkpoint, t5_config

    if not (folder / "config.json").exists():
        print(f"building a random checkpoint of d_model {shapes['d_model']} in {folder} ...", file=sys.stderr)
        make_checkpoint(folder, t5_config(**shapes), 0, DEMO / "target")
    return folder


def build_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) Hugging Face checkpoints; see the module docstring."""
    import train
    from checkpoints import grow_target

    from loading import load_model

    draft, target = root / "pair-draft", root / "pair-target"
    if not (draft / "config.json").exists():
        train.save_hugging_face(load_model(DEMO / "target"), DEMO / "target", draft)
    if not (target / "config.json").exists():
        print(f"building the benchmark pair's target in {target} ...", file=sys.stderr)
        grow_target(draft, target, **PAIR)
    return target, draft


def convert_measuring_memory(source: Path, out: Path, *options: str) -> int:
    """Run convert.py in a fresh process; return its peak resident memory in bytes."""
    script = (
        "import atexit, re, runpy, sys;"
        "atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], file=sys.stderr));"
        "sys.argv = ['convert.py', *sys.argv[1:]]; runpy.run_path('convert.py', run_name='__main__')"
    )
    argv = ["--model", str(source), "--out", str(out), "--dtype", "float32", "--force", *options]
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True, text=True)
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


def hf_worker(checkpoint: str, assistant: str | None, num_draft: int, cache_fix: bool) -> None:
    """Persistent transformers process: one greedy generation per input line
    (JSON: prompt ids, max and min new tokens), assisted by `assistant` with a
    constant number of draft tokens if given. It counts the candidates the
    assistant proposed and the target accepted, round by round.

    cache_fix: transformers 5 drafts from a corrupted cache when the assistant
    is an encoder-decoder model. `_prefill` cuts the already-cached tokens off
    the assistant's decoder input only when an attention mask as long as that
    input is given, and none is: each round feeds the whole sequence again on
    top of the cache. Passing the mask restores drafting from the right
    context (docs/PERFORMANCE.md has the evidence)."""
    import torch
    from transformers import T5ForConditionalGeneration
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    torch.set_num_threads(os.cpu_count() or 1)
    model = T5ForConditionalGeneration.from_pretrained(checkpoint).eval()
    options, counts = {}, {"proposed": 0, "accepted": 0}
    if assistant:
        draft = T5ForConditionalGeneration.from_pretrained(assistant).eval()
        draft.generation_config.num_assistant_tokens = num_draft
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        options["assistant_model"] = draft
        update, get_candidates = AssistedCandidateGenerator.update_candidate_strategy, AssistedCandidateGenerator.get_candidates

        def counting(self, input_ids, scores, num_matches):
            counts["proposed"] += scores.shape[1] - 1  # the candidates; the last score is the target's own token
            counts["accepted"] += int(num_matches)
            return update(self, input_ids, scores, num_matches)

        def with_decoder_mask(self, input_ids, **kwargs):
            self.assistant_kwargs["decoder_attention_mask"] = torch.ones_like(input_ids)
            return get_candidates(self, input_ids, **kwargs)

        AssistedCandidateGenerator.update_candidate_strategy = counting
        if cache_fix:
            AssistedCandidateGenerator.get_candidates = with_decoder_mask
    print(json.dumps({"ready": torch.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        counts.update(proposed=0, accepted=0)
        if "prompts" in request:  # a batched greedy generation, batch_size prompts at a time
            print(json.dumps(hf_batched(model, request["prompts"], request["tokens"], request["batch_size"])), flush=True)
            continue
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(torch.tensor([request["prompt"]]), max_new_tokens=request["tokens"],
                                 min_new_tokens=request["min_tokens"], do_sample=False, num_beams=1, **options)
            seconds = time.perf_counter() - start
        tokens = [t for t in out[0, 1:].tolist() if t != model.config.eos_token_id]
        print(json.dumps({"seconds": seconds, "tokens": tokens, **counts}), flush=True)


def hf_batched(model, prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    """transformers' batched greedy generate over the prompts, padded on the
    right with an attention mask, as its T5 documentation does it."""
    import torch

    start, tokens = time.perf_counter(), []
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            group = prompts[first : first + batch_size]
            width = max(len(p) for p in group)
            ids = torch.tensor([p + [pad] * (width - len(p)) for p in group])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, num_beams=1)
            for row in out[:, 1:].tolist():
                tokens.append(row[: row.index(eos)] if eos in row else row)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


class Worker:
    """A reference engine in a process of its own (so that neither library's
    threading settings touch the other's), asked one JSON line at a time."""

    def __init__(self, *flags: str, env: dict | None = None):
        import cpu

        command = [sys.executable, __file__, *flags]
        # The environment as the user gave it: not cpu.py's settings for our MKL.
        given = {key: value for key, value in os.environ.items() if key not in cpu.SET_HERE}
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                        env={**given, **(env or {})})
        self.version = json.loads(self.process.stdout.readline())["ready"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def run(self, prompt: list[int], tokens: int, min_tokens: int = 0) -> dict:
        """One greedy generation: {"seconds", "tokens"} (EOS left out), and the worker's own counts."""
        return self.ask({"prompt": prompt, "tokens": tokens, "min_tokens": min_tokens})

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


class HFWorker(Worker):
    def __init__(self, checkpoint: Path, assistant: Path | None = None, num_draft: int = 0, cache_fix: bool = False):
        flags = ["--hf-worker", str(checkpoint), "--num-draft", str(num_draft)]
        if assistant:
            flags += ["--assistant", str(assistant)] + ["--cache-fix"] * cache_fix
        super().__init__(*flags)
        self.torch_version = self.version

    def run_batched(self, prompts: list[list[int]], tokens: int, batch_size: int) -> dict:
        return self.ask({"prompts": prompts, "tokens": tokens, "batch_size": batch_size})


def ct2_worker(folder: str) -> None:
    """Persistent CTranslate2 process: one greedy generation per input line,
    as HFWorker's, on every core (intra_threads), one batch at a time."""
    import ctranslate2

    vocabulary = json.loads((Path(folder) / "shared_vocabulary.json").read_text())
    index = {token: i for i, token in enumerate(vocabulary)}
    translator = ctranslate2.Translator(folder, device="cpu", intra_threads=os.cpu_count() or 1, inter_threads=1)
    print(json.dumps({"ready": ctranslate2.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        result = translator.translate_batch([[vocabulary[i] for i in request["prompt"]]], beam_size=1,
                                            max_decoding_length=request["tokens"],
                                            min_decoding_length=request["min_tokens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": [index[token] for token in result[0].hypotheses[0]]}), flush=True)


def unique_vocabulary(path: Path) -> None:
    """CTranslate2's converter pads the tokenizer's vocabulary up to the
    model's by appending <extra_id_N> names that repeat the tokenizer's own
    sentinels, so a name would stand for two ids. Renaming the padding makes
    names and ids one to one (the padded ids are never a prompt's)."""
    vocabulary, seen = json.loads(path.read_text()), set()
    for i, token in enumerate(vocabulary):
        if token in seen:
            vocabulary[i] = f"<ct2_padding_{i}>"
        seen.add(vocabulary[i])
    path.write_text(json.dumps(vocabulary))


def intel_openmp() -> str | None:
    """Intel's OpenMP runtime (intel-openmp, which MKL brings from PyPI)."""
    try:
        files = importlib.metadata.files("intel-openmp") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(file.locate()) for file in files if file.name.startswith("libiomp5.so")), None)


class CT2Worker(Worker):
    """CTranslate2 (the fastest T5 on a CPU) on a Hugging Face checkpoint,
    converted once by its own converter, in float32 or int8. Its PyPI wheel
    runs its threads on GNU OpenMP, whose idle threads sleep between
    parallel regions; `intel_openmp` preloads Intel's runtime in their place,
    whose threads spin, as MKL's do for us (docs/PERFORMANCE.md: on a
    virtual machine's cores, waking a sleeping thread is slow)."""

    def __init__(self, checkpoint: Path, quantization: str, root: Path, intel_openmp_runtime: bool = False):
        folder = root / f"{checkpoint.name}-ct2-{quantization}"
        if not (folder / "model.bin").exists():
            print(f"converting {checkpoint} for CTranslate2 ({quantization}) ...", file=sys.stderr)
            script = ("import sys, ctranslate2; ctranslate2.converters.TransformersConverter(sys.argv[1])"
                      ".convert(sys.argv[2], quantization=sys.argv[3], force=True)")
            done = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(folder), quantization],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"CTranslate2's conversion failed: {done.stderr.strip()}")
        unique_vocabulary(folder / "shared_vocabulary.json")
        preload = intel_openmp() if intel_openmp_runtime else None
        if intel_openmp_runtime and preload is None:
            raise RuntimeError("intel-openmp is not installed (pip install intel-openmp)")
        super().__init__("--ct2-worker", str(folder), env={"LD_PRELOAD": preload} if preload else None)


def ct2_installed() -> bool:
    try:
        importlib.metadata.version("ctranslate2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# CTranslate2's configurations: (quantization, with Intel's OpenMP runtime)
CT2_KINDS = {"CTranslate2 fp32": ("float32", False), "CTranslate2 int8": ("int8", False),
             "CTranslate2 fp32, Intel OpenMP": ("float32", True), "CTranslate2 int8, Intel OpenMP": ("int8", True)}


def ct2_workers(checkpoint: Path, root: Path) -> dict[str, CT2Worker]:
    """Every CTranslate2 configuration on the checkpoint; none (said on
    stderr) when CTranslate2 is not installed."""
    if not ct2_installed():
        print("CTranslate2 is not installed (pip install ctranslate2): its rows are left out", file=sys.stderr)
        return {}
    return {name: CT2Worker(checkpoint, quantization, root, iomp) for name, (quantization, iomp) in CT2_KINDS.items()
            if not iomp or intel_openmp()}


# The harness: every comparison runs its contenders in turn through `alternate`.

@dataclass
class Timing:
    median: float  # seconds
    seconds: list[float]
    output: object  # the last run's


def alternate(runs: dict, repeats: int, warm_up: bool = True) -> dict[str, Timing]:
    """Each run() -> (seconds, output), once to warm up, then in turn, pass
    after pass, so that a machine's slow spell falls on every contender."""
    if warm_up:
        for run in runs.values():
            run()
    seconds, outputs = {name: [] for name in runs}, {}
    for _ in range(repeats):
        for name, run in runs.items():
            elapsed, outputs[name] = run()
            seconds[name].append(elapsed)
    return {name: Timing(statistics.median(seconds[name]), seconds[name], outputs[name]) for name in runs}


def worker_run(worker: Worker, prompts: list[list[int]], tokens: int, forced: bool = False):
    """A run of a worker over the prompts for `alternate`: (seconds, outputs)."""
    def run():
        results = [worker.run(prompt, tokens, tokens if forced else 0) for prompt in prompts]
        return sum(result["seconds"] for result in results), [result["tokens"] for result in results]
    return run


def converted(checkpoint: Path, folder: Path) -> Path:
    """folder, converted from the Hugging Face checkpoint by convert.py (float32) the first time."""
    if not (folder / "config.json").exists():
        convert_measuring_memory(checkpoint, folder)
    return folder


def held_out_prompts(count: int | None = None) -> list[str]:
    """The demo's held-out prompts (demo/prompts.txt), the first `count`."""
    lines = [line.decode("utf-8").strip() for line in (DEMO / "prompts.txt").read_bytes().splitlines()]
    return [line for line in lines if line][:count]


def ct2_same_tokens(model, workers: dict, prompts: list[list[int]], tokens: int) -> str:
    """Whether each CTranslate2 configuration's greedy tokens are ours,
    generated to EOS (a forced length would differ at the EOS CTranslate2
    suppresses): "yes", or which configurations differ on how many prompts."""
    from decoder import Request, batch_for, drive
    from loading import Models
    from options import Settings

    settings = Settings(max_tokens=tokens, speculative=False)
    ours = []
    for prompt in prompts:
        ours.append([t for _, t, _ in drive(batch_for(Models(model), settings, 1), [Request(prompt, settings)]) if t is not None])
    differ = {name: sum(worker.run(prompt, tokens)["tokens"] != mine for prompt, mine in zip(prompts, ours))
              for name, worker in workers.items()}
    return "yes" if not any(differ.values()) else "; ".join(f"{name}: {count} of {len(prompts)} differ"
                                                           for name, count in differ.items() if count)


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


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}\n\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def bench_regular(args) -> None:
    """Regular greedy decoding of a forced length on T5-large shapes: ours
    against transformers and CTranslate2 (float32 and int8, with its wheel's
    OpenMP runtime and with Intel's), alternating, and how near the memory
    bandwidth ours reads the weights."""
    import mlx.core as mx

    from decoder import Stats, regular_generate
    from loading import load_model
    from sampling import Sampling

    hf_dir = build_large(args.dir / "t5-large-random")
    mlx_dir = args.dir / "t5-large-random-mlx"
    convert_start = time.perf_counter()
    convert_peak = convert_measuring_memory(hf_dir, mlx_dir)
    convert_seconds = time.perf_counter() - convert_start
    source_bytes = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))

    start = time.perf_counter()
    model = load_model(mlx_dir, one_row=True)  # regular decoding of one prompt, as main.py --regular-decode loads it
    load_seconds = time.perf_counter() - start
    hf = HFWorker(hf_dir)
    ct2 = ct2_workers(hf_dir, args.dir)

    def ours():
        stats = Stats()
        tokens = list(regular_generate(model, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
        return stats.seconds, [tokens]

    runs = {"ours": ours, "transformers": worker_run(hf, [PROMPT_IDS], args.tokens, forced=True)}
    runs |= {name: worker_run(worker, [PROMPT_IDS], args.tokens, forced=True) for name, worker in ct2.items()}
    timings = alternate(runs, args.repeats)
    # Forced lengths hide an EOS (ours emits it, the references suppress it): CTranslate2 is checked to EOS.
    same = {"transformers": timings["transformers"].output == timings["ours"].output}
    floats = {name: worker for name, worker in ct2.items() if "int8" not in name}
    ct2_same = ct2_same_tokens(model, floats, [PROMPT_IDS], args.tokens) if floats else None
    for worker in (hf, *ct2.values()):
        worker.close()

    bandwidth = memory_read_bandwidth()
    per_token = weight_bytes_per_token(model)
    rate = {name: args.tokens / timing.median for name, timing in timings.items()}
    achieved = per_token * rate["ours"]
    rows = [
        ("machine", machine()),
        ("checkpoint", f"random T5-large shapes, float32, {source_bytes / 1e9:.2f} GB"),
        (f"ours (MLX {mx.__version__})", f"{rate['ours']:.2f} tokens/s"),
        (f"transformers (PyTorch {hf.version} CPU, {os.cpu_count()} threads)", f"{rate['transformers']:.2f} tokens/s"),
        ("ours over transformers", f"{rate['ours'] / rate['transformers']:.2f}x"),
    ]
    for name, worker in ct2.items():
        rows.append((f"{name} ({worker.version}, {os.cpu_count()} threads)",
                     f"{rate[name]:.2f} tokens/s: ours {rate['ours'] / rate[name]:.2f}x"))
    rows += [
        ("same greedy tokens: transformers (forced length)", "yes" if same["transformers"] else "NO"),
        *([("CTranslate2's float32 greedy tokens to EOS equal ours", ct2_same)] if floats else []),
        ("weights read per token", f"{per_token / 1e9:.2f} GB"),
        ("achieved weight bandwidth", f"{achieved / 1e9:.1f} GB/s"),
        (f"machine read bandwidth ({os.cpu_count()} threads)", f"{bandwidth / 1e9:.1f} GB/s"),
        ("fraction of the bandwidth limit", f"{achieved / bandwidth:.0%}"),
        ("open converted model (weights mapped, read on first use)", f"{load_seconds:.2f} s"),
        ("conversion: time, peak RSS", f"{convert_seconds:.1f} s, {convert_peak / 1e6:.0f} MB"),
    ]
    print_table(f"Regular greedy decoding, {args.tokens} tokens, median of {args.repeats} alternating runs", rows)


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


def graph_size(*outputs) -> int:
    """Operations in the graph that computes outputs (as MLX will run them)."""
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return dot.read().count("shape=rectangle")


def seconds_per_op(count: int = 1000) -> float:
    """MLX's cost to run one operation, from a chain of tiny ones built beforehand."""
    import mlx.core as mx

    x = mx.zeros((1, 256))
    one = mx.array(1.0)
    mx.eval(x, one)
    times = []
    for _ in range(20):
        y = x
        for _ in range(count):
            y = y + one
        start = time.perf_counter()
        mx.eval(y)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / count


def step_profile(model, width: int = 1, steps: int = 30) -> dict:
    """One decode step over `width` new tokens with a warm cache: the Python
    time to build its graph, the whole step, and its operations."""
    import mlx.core as mx

    cache = model.make_cache(model.encode(mx.array([PROMPT_IDS])))
    mx.eval(model.decode(mx.array([[0] * 20]), cache))
    tokens = mx.array([[0] * width])
    builds, totals = [], []
    for _ in range(steps + 3):
        start = time.perf_counter()
        logits = model.decode(tokens, cache)
        built = time.perf_counter()
        mx.eval(logits)
        builds.append(built - start)
        totals.append(time.perf_counter() - start)
        cache.trim(width)
    operations = graph_size(model.decode(tokens, cache))
    return {"build": statistics.median(builds[3:]), "step": statistics.median(totals[3:]), "operations": operations}


def draft_round_seconds(draft, k: int, rounds: int = 30) -> float:
    """A speculative round's drafting, as DraftModel.propose does it: k one-token steps, no host sync between them."""
    import mlx.core as mx

    from decoder import Request, Row
    from drafting import DraftModel
    from sampling import RowSampling, Sampling

    cache = draft.make_cache(draft.encode(mx.array([PROMPT_IDS])))
    mx.eval(draft.decode(mx.array([[0] * 20]), cache))
    drafter, times = DraftModel(draft), []
    for _ in range(rounds + 3):
        row = Row(Request(PROMPT_IDS), 0.0, (0, 0), drafting=[5])
        start = time.perf_counter()
        proposal = drafter.propose([row], [k], RowSampling([Sampling()]), mx.array([0]), cache)
        mx.eval(proposal.drafts, proposal.logits)
        times.append(time.perf_counter() - start)
        cache.trim(k)
    return statistics.median(times[3:])


def bench_steps(args) -> None:
    """Regular decoding against transformers on narrow, deep and wide shapes,
    each step split into Python graph building, MLX's per-operation dispatch
    and compute; compiled steps (the default) against the graph built op by
    op; and the draft's step time at num-draft 1-8."""
    from sampling import Sampling
    from decoder import Stats, regular_generate
    from loading import load_model

    target_hf, draft_hf = build_pair(args.dir)
    shapes = {
        "demo": ("the demo target: d_model 256, 6+6 layers, 8 M", draft_hf, DEMO / "target"),
        "small": ("T5-small shapes (random): d_model 512, 6+6 layers, 60 M", build_large(args.dir / "t5-small-random", T5_SMALL),
                  args.dir / "t5-small-random-mlx"),
        "deep": ("deep and narrow: the benchmark pair's target, d_model 256, 24+24 layers, 220 M", target_hf,
                 args.dir / "pair-target-mlx"),
        "large": ("T5-large shapes (random): d_model 1024, 24+24 layers, 740 M", build_large(args.dir / "t5-large-random"),
                  args.dir / "t5-large-random-mlx"),
    }
    chosen = args.shapes.split(",") if args.shapes else list(shapes)
    per_op = seconds_per_op()
    rows = [("machine", machine()), ("MLX's cost to run an operation (a chain of 1,000 tiny ones)", f"{per_op * 1e6:.1f} us")]
    for name in chosen:
        label, hf_dir, mlx_dir = shapes[name]
        model = load_model(converted(hf_dir, mlx_dir), one_row=True)  # as main.py --regular-decode loads it
        compiled = model._compiled_step
        hf = HFWorker(hf_dir)
        ct2 = ct2_workers(hf_dir, args.dir)

        def ours(compile: bool):
            model._compiled_step = compiled if compile else None
            stats = Stats()
            tokens = list(regular_generate(model, PROMPT_IDS, args.tokens, Sampling(), stats, stop_at_eos=False))
            return stats.seconds, [tokens]

        runs = {"compiled": lambda: ours(True), "op by op": lambda: ours(False),
                "transformers": worker_run(hf, [PROMPT_IDS], args.tokens, forced=True)}
        runs |= {key: worker_run(worker, [PROMPT_IDS], args.tokens, forced=True) for key, worker in ct2.items()}
        timings = alternate(runs, args.repeats)
        model._compiled_step = compiled
        floats = {key: worker for key, worker in ct2.items() if "int8" not in key}  # int8 is another model
        same = ct2_same_tokens(model, floats, [PROMPT_IDS], args.tokens) if floats else None
        for worker in (hf, *ct2.values()):
            worker.close()
        rate = {key: args.tokens / timing.median for key, timing in timings.items()}
        profiles = {}
        for key, step in (("compiled", compiled), ("op by op", None)):
            model._compiled_step = step
            profiles[key] = step_profile(model)
        model._compiled_step = compiled

        def split(p: dict) -> str:
            dispatch = p["operations"] * per_op
            return (f"{p['step'] * 1e3:.2f} ms: Python {p['build'] * 1e3:.2f}, dispatch ~{dispatch * 1e3:.2f} "
                    f"({p['operations']} ops), compute ~{max(0.0, p['step'] - p['build'] - dispatch) * 1e3:.2f}")

        rows += [
            (f"**{label}**", ""),
            ("regular decoding: ours compiled / op by op / transformers",
             f"{rate['compiled']:.1f} / {rate['op by op']:.1f} / {rate['transformers']:.1f} tokens/s"),
            ("ours compiled over transformers", f"{rate['compiled'] / rate['transformers']:.2f}x"),
            ("ours compiled over ours op by op", f"{rate['compiled'] / rate['op by op']:.2f}x"),
            *[(f"{key} ({ct2[key].version}): tokens/s, ours compiled over it", f"{rate[key]:.1f}, {rate['compiled'] / rate[key]:.2f}x")
              for key in ct2],
            *([("CTranslate2's float32 greedy tokens to EOS equal ours", same)] if floats else []),
            ("a step, compiled", split(profiles["compiled"])),
            ("a step, op by op", split(profiles["op by op"])),
        ]
    if "demo" in chosen:
        draft = load_model(DEMO / "target")
        compiled = draft._compiled_step
        for key, step in (("compiled", compiled), ("op by op", None)):
            draft._compiled_step = step
            cells = [f"{draft_round_seconds(draft, k) / k * 1e3:.2f}" for k in range(1, 9)]
            rows.append((f"the demo target as a draft, ms per draft token at num-draft 1-8, {key}", " / ".join(cells)))
    print_table(f"Decode steps: regular greedy decoding of {args.tokens} tokens (medians of {args.repeats} alternating runs), "
                f"a step's time split (medians of 30 steps)", rows)


def bench_speculative(args) -> None:
    """The benchmark pair on held-out demo prompts, each contender over every
    prompt per pass: ours regular, speculative at --num-draft and auto (one
    AutoDraft through the passes, as a session keeps it); transformers
    regular and assisted; CTranslate2 regular, float32 and int8."""
    from decoder import Stats, regular_generate, speculative_generate
    from drafting import AutoDraft
    from loading import load_model, load_tokenizer
    from sampling import Sampling

    target_hf, draft_hf = build_pair(args.dir)
    target, draft = load_model(converted(target_hf, args.dir / "pair-target-mlx")), load_model(DEMO / "target")
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in held_out_prompts(args.prompts or 6)]
    workers = {"hf regular": HFWorker(target_hf), "hf assisted": HFWorker(target_hf, draft_hf, args.num_draft),
               "hf assisted, fixed": HFWorker(target_hf, draft_hf, args.num_draft, cache_fix=True)}
    ct2 = ct2_workers(target_hf, args.dir)
    auto = AutoDraft()

    def ours(num_draft):
        def run():
            seconds, totals = 0.0, Stats()
            outputs = []
            for prompt in prompts:
                stats = Stats()
                if num_draft:
                    outputs.append(list(speculative_generate(target, draft, prompt, args.tokens, Sampling(), num_draft, 0.0, stats)))
                else:
                    outputs.append(list(regular_generate(target, prompt, args.tokens, Sampling(), stats)))
                seconds += stats.seconds
                totals += stats
            return seconds, {"tokens": outputs, "proposed": totals.drafted, "accepted": totals.accepted}
        return run

    def theirs(worker: Worker):
        def run():
            results = [worker.run(prompt, args.tokens) for prompt in prompts]
            return sum(r["seconds"] for r in results), {"tokens": [r["tokens"] for r in results],
                                                        "proposed": sum(r.get("proposed", 0) for r in results),
                                                        "accepted": sum(r.get("accepted", 0) for r in results)}
        return run

    runs = {"regular": ours(None), "speculative": ours(args.num_draft), "auto": ours(auto)}
    runs |= {name: theirs(worker) for name, worker in (workers | ct2).items()}
    timings = alternate(runs, args.repeats)
    for worker in (*workers.values(), *ct2.values()):
        worker.close()
    t_target, t_draft = step_seconds(target), step_seconds(draft)
    verify_cost = step_seconds(target, args.num_draft + 1) / t_target

    reference = timings["regular"].output["tokens"]
    generated = sum(len(tokens) for tokens in reference)
    draft_own = [list(regular_generate(draft, prompt, args.tokens, Sampling())) for prompt in prompts]
    differ = sum(mine != theirs for mine, theirs in zip(draft_own, reference))
    rates = {name: sum(map(len, timing.output["tokens"])) / timing.median for name, timing in timings.items()}
    # int8 is another model: its tokens are counted, not required to be ours
    unequal = [name for name, timing in timings.items() if timing.output["tokens"] != reference and "int8" not in name]
    int8_same = {name: sum(a == b for a, b in zip(timing.output["tokens"], reference))
                 for name, timing in timings.items() if "int8" in name}

    def acceptance(name: str) -> str:
        counts = timings[name].output
        return f"{counts['accepted'] / max(1, counts['proposed']):.2f} ({counts['accepted']} / {counts['proposed']})"

    transformers_version = importlib.metadata.version("transformers")
    rows = [
        ("machine", machine()),
        ("pair", f"draft: the demo target (d_model 256, 6+6 layers); target: the draft + {PAIR['extra_layers']}+"
                 f"{PAIR['extra_layers']} random layers scaled by {PAIR['scale']}, d_ff {PAIR['d_ff']} (float32)"),
        ("prompts whose greedy output differs from the draft's own", f"{differ} of {len(prompts)}"),
        ("decode step: target, draft", f"{t_target * 1e3:.1f} ms, {t_draft * 1e3:.1f} ms"),
        (f"target verify pass ({args.num_draft + 1} tokens) against a single step", f"{verify_cost:.2f}x"),
        ("acceptance: ours (num-draft fixed / auto)", f"{acceptance('speculative')} / {acceptance('auto')}"),
        ("acceptance: transformers assisted, as installed / with the cache fix",
         f"{acceptance('hf assisted')} / {acceptance('hf assisted, fixed')}"),
        ("ours, regular", f"{rates['regular']:.2f} tokens/s"),
        (f"ours, speculative (num-draft {args.num_draft} / auto)", f"{rates['speculative']:.2f} / {rates['auto']:.2f} tokens/s"),
        ("ours: speculative (auto) over regular", f"{rates['auto'] / rates['regular']:.2f}x"),
        (f"transformers {transformers_version}, regular (PyTorch {workers['hf regular'].version} CPU)",
         f"{rates['hf regular']:.2f} tokens/s"),
        (f"transformers, assisted (num_assistant_tokens {args.num_draft}, constant), as installed",
         f"{rates['hf assisted']:.2f} tokens/s"),
        ("transformers, assisted with the cache fix", f"{rates['hf assisted, fixed']:.2f} tokens/s"),
        ("transformers: assisted (fixed) over regular", f"{rates['hf assisted, fixed'] / rates['hf regular']:.2f}x"),
        ("ours regular over transformers regular", f"{rates['regular'] / rates['hf regular']:.2f}x"),
        ("ours speculative (auto) over transformers assisted (fixed)", f"{rates['auto'] / rates['hf assisted, fixed']:.2f}x"),
    ]
    for name, worker in ct2.items():
        rows.append((f"{name} ({worker.version}), regular: tokens/s; ours regular, ours auto over it",
                     f"{rates[name]:.2f}; {rates['regular'] / rates[name]:.2f}x, {rates['auto'] / rates[name]:.2f}x"))
    rows.append(("same tokens (every float contender, prompt and the last pass)", "yes" if not unequal else "NO: " + ", ".join(unequal)))
    rows += [(f"{name}: prompts whose tokens are float32's (int8 rounds the weights)", f"{same} of {len(prompts)}")
             for name, same in int8_same.items()]
    print_table(f"Speculative greedy decoding (delta 0), {len(prompts)} held-out demo prompts "
                f"({generated} tokens), median of {args.repeats} alternating passes", rows)


def bench_batch(args) -> None:
    """Throughput over many prompts, by batch size: our batched speculative
    decoding at each num-draft, our batched regular decoding, and
    transformers' batched generate (its assisted mode takes no batches).
    Batch size 1 is prompt-by-prompt decoding: `speculative_generate` is a
    batch of one. Runs alternate within a pass; medians over passes."""
    from sampling import Sampling
    from decoder import Stats, encode_prompts, regular_batch, speculative_batch
    from loading import load_model, load_tokenizer

    target_hf, draft_hf = build_pair(args.dir)
    target_dir = converted(target_hf, args.dir / "pair-target-mlx")
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft", draft_hf),
             "benchmark pair": (target_dir, DEMO / "target", target_hf)}
    tokenizer = load_tokenizer(DEMO / "target")
    demo = held_out_prompts()
    count = args.prompts or 32
    prompts = [tokenizer.encode(demo[i % len(demo)]) for i in range(count)]
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    num_drafts = [int(k) for k in (args.num_drafts or "1,2,3,4").split(",")]
    repeated = ", then again from the first" if count > len(demo) else ""
    print(f"\nBatched greedy decoding: {count} prompts (the held-out demo prompts{repeated}), "
          f"at most {args.tokens} tokens each, delta 0. Generated tokens per second over all prompts, encoding included; "
          f"medians of {args.repeats} passes, runs alternating within a pass.\n\nmachine: {machine()}")
    for name, (target_dir, draft_dir, hf_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        target, draft = load_model(target_dir), load_model(draft_dir)
        worker = HFWorker(hf_dir)

        def ours(batch: list, batch_size: int, num_draft: int | None) -> tuple[float, list]:
            stats, out = [Stats() for _ in batch], [[] for _ in batch]
            start = time.perf_counter()
            if num_draft:
                events = speculative_batch(target, draft, batch, args.tokens, Sampling(), num_draft, 0.0, stats, batch_size)
            else:
                events = regular_batch(target, batch, args.tokens, Sampling(), stats, batch_size)
            for index, token, _ in events:
                out[index] += [] if token is None else [token]
            return time.perf_counter() - start, out

        def encoding(batch: list, batch_size: int) -> tuple[float, list]:
            """Both models' encoding of every prompt, in groups of batch_size: the floor under a run."""
            start = time.perf_counter()
            for first in range(0, len(batch), batch_size):
                for model in (target, draft):
                    encode_prompts(model, batch[first : first + batch_size])
            return time.perf_counter() - start, None

        def one_pass(batch: list) -> dict:
            runs = {}
            for size in sizes:
                runs[("encoding", size)] = encoding(batch, size)
                for k in num_drafts:
                    runs[(f"speculative {k}", size)] = ours(batch, size, k)
                runs[("regular", size)] = ours(batch, size, None)
                result = worker.run_batched(batch, args.tokens, size)
                runs[("transformers", size)] = (result["seconds"], result["tokens"])
            return runs

        one_pass(prompts[: max(sizes)])  # warm-up: kernels, allocator pools, every batch shape once
        passes = [one_pass(prompts) for _ in range(args.repeats)]
        worker.close()
        reference = passes[-1][("regular", 1)][1]
        generated = sum(len(tokens) for tokens in reference)
        seconds = {key: statistics.median(p[key][0] for p in passes) for key in passes[0]}
        rate = {key: generated / value for key, value in seconds.items()}
        same = all(p[key][1] == reference for p in passes for key in p if key[0] != "encoding")
        best = {size: max(num_drafts, key=lambda k: rate[(f"speculative {k}", size)]) for size in sizes}
        unbatched = rate[(f"speculative {best[1]}", 1)] if 1 in sizes else None
        print(f"\n{name}: {generated} tokens; every run's tokens equal regular decoding's prompt by prompt: "
              f"{'yes' if same else 'NO'}\n\n"
              "| batch size | speculative (best num-draft) | regular | transformers regular | "
              "speculative / unbatched speculative | speculative / transformers | encoding's share of the speculative run "
              "| ceiling over transformers |\n"
              "|---|---|---|---|---|---|---|---|")
        for size in sizes:
            key = (f"speculative {best[size]}", size)
            spec, regular, hf = rate[key], rate[("regular", size)], rate[("transformers", size)]
            over_unbatched = f"{spec / unbatched:.2f}x" if unbatched else "-"
            # Were decoding free, a run would take its encoding alone: no decoding can beat this ratio.
            ceiling = seconds[("transformers", size)] / seconds[("encoding", size)]
            print(f"| {size} | {spec:.1f} ({best[size]}) | {regular:.1f} | {hf:.1f} | {over_unbatched} | {spec / hf:.2f}x | "
                  f"{seconds[('encoding', size)] / seconds[key]:.0%} | {ceiling:.2f}x |")
        print("\nceiling over transformers: transformers' whole run against our encoding alone (both models), "
              "the ratio that speculative decoding would reach if its decoding took no time.")
        print(f"\n{name}, speculative tokens/s by num-draft (best in bold)\n\n| batch size | "
              + " | ".join(f"num-draft {k}" for k in num_drafts) + " |\n|---|" + "---|" * len(num_drafts))
        for size in sizes:
            cells = [f"{rate[(f'speculative {k}', size)]:.1f}" for k in num_drafts]
            cells = [f"**{cell}**" if k == best[size] else cell for k, cell in zip(num_drafts, cells)]
            print(f"| {size} | " + " | ".join(cells) + " |")


def timed(run) -> tuple[float, object, list]:
    """Seconds, statistics and tokens of run(stats)."""
    from decoder import Stats

    stats = Stats()
    started = time.perf_counter()
    tokens = list(run(stats))
    return time.perf_counter() - started, stats, tokens


def compare_runs(prompts: list, runs: dict, repeats: int) -> dict:
    """Every run(prompt, stats) over every prompt, alternating, repeats times:
    {name: (tokens/s median, pooled Stats, outputs of the last pass)}."""
    from decoder import Stats

    for prompt in prompts[:3]:  # warm-up: kernels and traces of each run's shapes
        for run in runs.values():
            timed(lambda stats: run(prompt, stats))
    passes = []
    for _ in range(repeats):
        totals = {name: [0.0, Stats(), []] for name in runs}
        for prompt in prompts:
            for name, run in runs.items():
                seconds, stats, tokens = timed(lambda stats: run(prompt, stats))
                totals[name][0] += seconds
                totals[name][1] += stats
                totals[name][2].append(tokens)
        passes.append(totals)
    return {name: (statistics.median(p[name][1].generated / p[name][0] for p in passes),
                   sum((p[name][1] for p in passes), Stats()), passes[-1][name][2]) for name in runs}


def copy_prompts(target, count: int = 20, run: int = 5) -> list[list[int]]:
    """A copy-heavy task for the demo target: held-out code (pieces of 64
    tokens, as the pair was trained on) whose masked 13-token span occurs,
    word for word, earlier in the same piece, kept when the target's own
    greedy filling repeats at least `run` tokens of the prompt in a row (a
    model this small often fills the span otherwise). Pieces are taken in a
    fixed shuffled order of all held-out files."""
    import random

    import train
    from sampling import Sampling
    from decoder import regular_generate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO / "target"))  # train.py's helpers take transformers' tokenizers
    sentinel, eos = tokenizer.convert_tokens_to_ids("<extra_id_0>"), tokenizer.eos_token_id
    is_word_start = train.word_starts(tokenizer)
    span, candidates = 13, []
    for piece in train.chunks(tokenizer, train.corpus_files()[1]).tolist():
        for start in range(len(piece) - span - 1, span - 1, -1):  # the last span with an earlier copy
            masked = piece[start : start + span]
            if is_word_start[masked[0]] and any(piece[j : j + span] == masked for j in range(start - span + 1)):
                candidates.append(piece[:start] + [sentinel] + piece[start + span :] + [eos])
                break
    random.Random(0).shuffle(candidates)
    chosen = []
    for prompt in candidates:
        output = list(regular_generate(target, prompt, 30, Sampling()))
        runs = {tuple(prompt[i : i + run]) for i in range(len(prompt) - run + 1)}
        if any(tuple(output[i : i + run]) in runs for i in range(len(output) - run + 1)):
            chosen.append(prompt)
            if len(chosen) == count:
                break
    return chosen


def bench_drafting(args) -> None:
    """num-draft auto against every fixed num-draft, on both pairs. Greedy,
    one prompt at a time; the settings alternate prompt by prompt, and auto
    keeps what it learnt from one prompt to the next (as `Models.drafting`
    does in a session)."""
    from sampling import Sampling
    from decoder import AutoDraft, speculative_generate
    from loading import load_model, load_tokenizer

    target_hf, _ = build_pair(args.dir)
    target_dir = converted(target_hf, args.dir / "pair-target-mlx")
    models = {"demo target": load_model(DEMO / "target"), "demo draft": load_model(DEMO / "draft"),
              "benchmark target": load_model(target_dir)}
    tokenizer = load_tokenizer(DEMO / "target")
    demo = [tokenizer.encode(text) for text in held_out_prompts()][: args.prompts]
    fixed = [int(k) for k in (args.num_drafts or "1,2,3,4,5,6,8").split(",")]
    print(f"\nDrafting without tuning: greedy, at most {args.tokens} tokens a prompt, one prompt at a time, "
          f"settings alternating prompt by prompt; tokens/s over all prompts (encoding included), "
          f"medians of {args.repeats} passes.\n\nmachine: {machine()}")

    cases = [("demo pair", "demo target", "demo draft", 0.0), ("demo pair", "demo target", "demo draft", 0.5),
             ("benchmark pair", "benchmark target", "demo target", 0.0)]
    pairs = args.pairs.split(",") if args.pairs else ["demo", "benchmark"]
    for pair, target_name, draft_name, delta in cases:
        if pair.split()[0] not in pairs:
            continue
        target, draft = models[target_name], models[draft_name]
        auto = AutoDraft()
        runs = {k: (lambda prompt, stats, k=k: speculative_generate(target, draft, prompt, args.tokens, Sampling(), k,
                                                                    delta, stats)) for k in fixed}
        runs["auto"] = lambda prompt, stats: speculative_generate(target, draft, prompt, args.tokens, Sampling(), auto,
                                                                  delta, stats)
        results = compare_runs(demo, runs, args.repeats)
        best = max(fixed, key=lambda k: results[k][0])
        print(f"\n{pair} (target: the {target_name}, draft: the {draft_name}), delta {delta}, {len(demo)} held-out demo "
              f"prompts\n\n| num-draft | tokens/s | acceptance | drafts a round |\n|---|---|---|---|")
        for name, (rate, stats, _) in results.items():
            mark = " (best fixed)" if name == best else ""
            print(f"| {name}{mark} | {rate:.1f} | {stats.acceptance_rate:.2f} | {stats.drafts_per_round:.2f} |")
        same = all(result[2] == results[fixed[0]][2] for result in results.values())
        exact = f"; every run's tokens the same: {'yes' if same else 'NO'}" if delta == 0 else ""
        print(f"\nauto / best fixed: {results['auto'][0] / results[best][0]:.1%}{exact}")


def main_py(*options: str) -> list[dict]:
    """main.py --json in a fresh process: one result (text, tokens, stats) per prompt."""
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--json", *options], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"main.py {' '.join(options)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def bench_fresh(args) -> None:
    """What a fresh process sees, where nothing is traced yet and auto has
    learnt nothing: a short session (the 20 held-out demo prompts through
    main.py --prompts-file, demo pair) under each fixed num-draft and auto;
    and one-shot runs of the benchmark pair (main.py --prompt, one prompt a
    process) against the same prompts warm (a second pass in one process)."""
    fixed = (args.num_drafts or "1,2,3,4").split(",")
    session = ["--demo", "--prompts-file", str(DEMO / "prompts.txt"), "--batch-size", "1", "--max-tokens", "40",
               "--delta", "0"]

    def short(num_draft: str):
        def run():
            results = main_py(*session, "--num-draft", num_draft)
            return sum(r["stats"]["seconds"] for r in results), [r["tokens"] for r in results]
        return run

    timings = alternate({k: short(k) for k in [*fixed, "auto"]}, args.repeats)
    best = min(fixed, key=lambda k: timings[k].median)
    same = all(t.output == timings[best].output for t in timings.values())
    print(f"\nA short session in a fresh process: main.py {' '.join(session[:1] + session[3:])}, the 20 held-out "
          f"demo prompts; seconds over the prompts (encoding and decoding), medians of {args.repeats} alternating "
          f"runs after a warm-up run each\n\nmachine: {machine()}\n\n| num-draft | seconds | runs |\n|---|---|---|")
    for name, timing in timings.items():
        mark = " (best fixed)" if name == best else ""
        print(f"| {name}{mark} | {timing.median:.3f} | {' '.join(f'{s:.2f}' for s in timing.seconds)} |")
    print(f"\nauto / best fixed (speed): {timings[best].median / timings['auto'].median:.1%}; "
          f"every run's tokens the same: {'yes' if same else 'NO'}")

    target_hf, _ = build_pair(args.dir)
    pair = ["--model", str(converted(target_hf, args.dir / "pair-target-mlx")), "--draft-model", str(DEMO / "target"),
            "--delta", "0", "--max-tokens", str(args.tokens)]
    prompts = held_out_prompts(args.prompts or 6)
    listed = args.dir / "fresh-prompts.txt"
    listed.write_text("\n".join(prompts * 2) + "\n")
    print(f"\nOne-shot against warm, the benchmark pair: {len(prompts)} held-out demo prompts, delta 0, at most "
          f"{args.tokens} tokens; tokens/s over the prompts (encoding and decoding; loading apart), medians of "
          f"{args.repeats} runs\n\n| num-draft | one-shot: main.py --prompt, a process a prompt | warm: the "
          f"prompts' second pass in one process (--prompts-file) | one-shot / warm |\n|---|---|---|---|")
    for num_draft in [str(args.num_draft), "auto"]:
        def one_shot():
            results = [main_py(*pair, "--num-draft", num_draft, "--prompt", prompt)[0] for prompt in prompts]
            return sum(r["stats"]["seconds"] for r in results), [r["tokens"] for r in results]

        def warm():
            second_pass = main_py(*pair, "--num-draft", num_draft, "--prompts-file", str(listed),
                                  "--batch-size", "1")[len(prompts):]
            return sum(r["stats"]["seconds"] for r in second_pass), [r["tokens"] for r in second_pass]

        timings = alternate({"one-shot": one_shot, "warm": warm}, args.repeats)
        assert timings["one-shot"].output == timings["warm"].output, "one-shot and warm runs must give the same tokens"
        tokens = sum(map(len, timings["warm"].output))
        rates = {name: tokens / timing.median for name, timing in timings.items()}
        print(f"| {num_draft} | {rates['one-shot']:.1f} | {rates['warm']:.1f} | {rates['one-shot'] / rates['warm']:.0%} |")


def bench_lookup(args) -> None:
    """Prompt lookup against regular decoding, on both targets, over the
    held-out demo prompts and the copy-heavy ones (copy_prompts)."""
    from sampling import Sampling
    from decoder import regular_generate, speculative_generate
    from loading import load_model, load_tokenizer

    target_hf, _ = build_pair(args.dir)
    target_dir = converted(target_hf, args.dir / "pair-target-mlx")
    models = {"demo target": load_model(DEMO / "target"), "benchmark target": load_model(target_dir)}
    tokenizer = load_tokenizer(DEMO / "target")
    demo = [tokenizer.encode(text) for text in held_out_prompts()][: args.prompts]
    copies = copy_prompts(models["demo target"], args.prompts or 20)
    pairs = args.pairs.split(",") if args.pairs else ["demo", "benchmark"]
    longest = [2, 4, 8]
    print(f"\nPrompt lookup (no draft model) against regular decoding: greedy, delta 0, num-draft {longest} "
          f"(the longest draft), at most {args.tokens} tokens a prompt, runs alternating prompt by prompt, medians of "
          f"{args.repeats} passes.\n\nmachine: {machine()}\n\n| target | prompts | regular tokens/s | "
          + " | ".join(f"lookup {k}: tokens/s, acceptance, speedup" for k in longest)
          + " | same tokens as regular |\n|---|---|---|" + "---|" * len(longest) + "---|")
    for target_name in ("demo target", "benchmark target"):
        if target_name.split()[0] not in pairs:
            continue
        target = models[target_name]
        for prompts_name, prompts in (("held-out demo", demo), ("copy-heavy", copies)):
            runs = {0: lambda prompt, stats: regular_generate(target, prompt, args.tokens, Sampling(), stats)}
            runs |= {k: (lambda prompt, stats, k=k: speculative_generate(target, None, prompt, args.tokens, Sampling(), k,
                                                                         0.0, stats)) for k in longest}
            results = compare_runs(prompts, runs, args.repeats)
            regular = results[0][0]
            same = all(results[k][2] == results[0][2] for k in longest)
            cells = [f"{results[k][0]:.1f}, {results[k][1].acceptance_rate:.2f}, {results[k][0] / regular:.2f}x"
                     for k in longest]
            print(f"| {target_name} | {prompts_name} ({len(prompts)}) | {regular:.1f} | " + " | ".join(cells)
                  + f" | {'yes' if same else 'NO'} |")


def decode_worker(folder: str, tokens: int) -> None:
    """In a fresh process: read every weight, decode `tokens` greedy tokens
    twice (the second timed), and report resident memory."""
    import re

    import mlx.core as mx

    from sampling import Sampling
    from decoder import Stats, regular_generate
    from loading import load_model

    def resident(field: str) -> int:
        return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024

    model = load_model(folder)
    mx.eval(model.parameters())
    loaded = resident("VmRSS")
    list(regular_generate(model, PROMPT_IDS, tokens, Sampling(), stop_at_eos=False))
    stats = Stats()
    list(regular_generate(model, PROMPT_IDS, tokens, Sampling(), stats, stop_at_eos=False))
    print(json.dumps({"loaded": loaded, "peak": resident("VmHWM"), "tokens_per_second": stats.tokens_per_second}))


def bench_quantized(args) -> None:
    """Size, memory and speed of float and quantized T5-large shapes; the
    demo target's fillings, acceptance and held-out loss at 8 and 4 bits."""
    import train

    from sampling import Sampling
    from decoder import Stats, regular_generate, speculative_generate
    from loading import load_model, load_tokenizer

    hf_dir = build_large(args.dir / "t5-large-random")
    formats = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "8-bit": ["-q", "--q-bits", "8"], "4-bit": ["-q", "--q-bits", "4"]}
    folders, convert_peaks = {}, {}
    for name, options in formats.items():  # float32: the folder `bench.py regular` uses
        folders[name] = args.dir / ("t5-large-random-mlx" if name == "float32" else f"t5-large-random-{name}")
        convert_peaks[name] = convert_measuring_memory(hf_dir, folders[name], *options)
    runs = {name: [] for name in formats}
    for _ in range(args.repeats):  # alternating, each in a fresh process
        for name, folder in folders.items():
            done = subprocess.run([sys.executable, __file__, "--decode-worker", str(folder), "--tokens", str(args.tokens)],
                                  cwd=ROOT, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout))
    float_bytes = sum(f.stat().st_size for f in folders["float32"].glob("*.safetensors"))
    print(f"\nT5-large shapes (random weights), {args.tokens} greedy tokens, median of {args.repeats} runs "
          f"alternating in fresh processes; quantized: groups of 64, the rest float32\n\n| measure | "
          + " | ".join(formats) + " |\n|---|" + "---|" * len(formats))
    print(f"| machine | {machine()} |" + " |" * (len(formats) - 1))
    rows = {
        "weights on disk": lambda name: f"{sum(f.stat().st_size for f in folders[name].glob('*.safetensors')) / 1e9:.2f} GB",
        "resident after reading the weights": lambda name: f"{statistics.median(r['loaded'] for r in runs[name]) / 1e9:.2f} GB",
        "peak resident while decoding": lambda name: f"{statistics.median(r['peak'] for r in runs[name]) / 1e9:.2f} GB",
        "decoding speed": lambda name: f"{statistics.median(r['tokens_per_second'] for r in runs[name]):.2f} tokens/s",
        "conversion peak resident (from the float32 checkpoint)": lambda name: f"{convert_peaks[name] / 1e6:.0f} MB",
    }
    for row, cell in rows.items():
        print(f"| {row} | " + " | ".join(cell(name) for name in formats) + " |")
    runtime = statistics.median(r["peak"] for r in runs["float32"]) - float_bytes
    print(f"\nWhat decoding holds beside the float32 weights (runtime, caches): {runtime / 1e9:.2f} GB")

    # The demo target: trained weights, where quality can be seen.
    quantized = {bits: args.dir / f"demo-target-{bits}bit" for bits in (8, 4)}
    for bits, folder in quantized.items():
        convert_measuring_memory(DEMO / "target", folder, "-q", "--q-bits", str(bits))
    targets = {"float32": DEMO / "target", "8-bit": quantized[8], "4-bit": quantized[4]}
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in held_out_prompts()]
    draft = load_model(DEMO / "draft")
    fillings, acceptance = {}, {}
    for name, folder in targets.items():
        model = load_model(folder)
        fillings[name] = [list(regular_generate(model, prompt, 100, Sampling())) for prompt in prompts]
        stats = Stats()
        for prompt in prompts:
            list(speculative_generate(model, draft, prompt, 100, Sampling(), 3, 0.0, stats))
        acceptance[name] = stats.acceptance_rate
    losses = dict(zip(targets, train.evaluate(list(targets.values())).values()))
    sizes = {name: sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) for name, folder in targets.items()}
    print(f"\nThe demo target (8.4 M parameters) quantized in groups of 64, on the {len(prompts)} held-out demo prompts, "
          "greedy\n\n| measure | " + " | ".join(targets) + " |\n|---|" + "---|" * len(targets))
    print("| weights on disk | " + " | ".join(f"{sizes[name] / 1e6:.1f} MB" for name in targets) + " |")
    print("| fillings equal to float32's | " + " | ".join(
        f"{sum(a == b for a, b in zip(fillings[name], fillings['float32']))} of {len(prompts)}" for name in targets) + " |")
    print("| held-out loss (nats per token) | " + " | ".join(f"{losses[name]:.4f}" for name in targets) + " |")
    print("| acceptance of the float32 draft (num-draft 3, delta 0) | " + " | ".join(f"{acceptance[name]:.2f}" for name in targets) + " |")


def encode_worker(folder: str, length: int, hf: bool) -> None:
    """In a fresh process: the time from a prompt of `length` tokens to the
    first token's logits (encoding, cross-attention keys and values, one
    decoder step), ours or transformers', and the process's peak memory."""
    import re

    ids = [(i * 7919) % 1000 + 3 for i in range(length - 1)] + [1]
    if hf:
        import torch
        from transformers import T5ForConditionalGeneration

        torch.set_num_threads(os.cpu_count() or 1)
        model = T5ForConditionalGeneration.from_pretrained(folder).eval()

        def first_logits():
            with torch.no_grad():
                return model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([[0]])).logits
    else:
        import mlx.core as mx

        from decoder import start_decoding
        from loading import load_model

        model = load_model(folder)
        mx.eval(model.parameters())

        def first_logits():
            cache, start = start_decoding(model, ids)
            return mx.eval(model.decode(start[None], cache))

    full = ids
    ids = full[:64]
    first_logits()  # a warm-up on a short prompt: libraries load, kernels compile
    ids = full
    start = time.perf_counter()
    first_logits()
    seconds = time.perf_counter() - start
    peak = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024
    print(json.dumps({"seconds": seconds, "peak": peak}))


def bench_encode(args) -> None:
    """Long inputs: ours against transformers, T5-large shapes and the demo target's, each run in a fresh process."""
    target_hf, draft_hf = build_pair(args.dir)  # draft_hf: the demo target as a Hugging Face checkpoint
    shapes = {"T5-large shapes": (args.dir / "t5-large-random-mlx", build_large(args.dir / "t5-large-random")),
              "demo target": (DEMO / "target", draft_hf)}
    converted(shapes["T5-large shapes"][1], shapes["T5-large shapes"][0])
    lengths = [int(n) for n in args.lengths.split(",")]

    def run(folder: Path, length: int, hf: bool) -> dict:
        command = [sys.executable, __file__, "--encode-worker", str(folder), "--tokens", str(length)] + ["--hf"] * hf
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"seconds": math.nan, "peak": math.nan, "error": done.stderr.strip().splitlines()[-1]}
        return json.loads(done.stdout)

    def median_of(runs: list[dict]) -> dict:
        return {key: statistics.median(run[key] for run in runs) for key in ("seconds", "peak")}

    print(f"\nFrom a prompt to its first token's logits (encoding, cross-attention keys and values, one decoder step), "
          f"float32, each run in a fresh process, alternating, medians of {args.repeats} (one run from 8,192 tokens)\n\n"
          f"machine: {machine()}\n\n"
          "| model | input tokens | ours | transformers | ours / transformers | ours peak memory | transformers peak memory |\n"
          "|---|---|---|---|---|---|---|")
    for name, (ours_dir, hf_dir) in shapes.items():
        for length in lengths:
            runs = [(run(ours_dir, length, False), run(hf_dir, length, True)) for _ in range(args.repeats if length < 8192 else 1)]
            ours, theirs = median_of([a for a, _ in runs]), median_of([b for _, b in runs])
            print(f"| {name} | {length:,} | {ours['seconds']:.2f} s | {theirs['seconds']:.2f} s | "
                  f"{ours['seconds'] / theirs['seconds']:.2f} | {ours['peak'] / 1e9:.2f} GB | {theirs['peak'] / 1e9:.2f} GB |", flush=True)


def bench_attention(args) -> None:
    """One block of encoder attention as attention.py cuts it (the demo target's
    4 heads, 128 queries, 4,096 keys: 2 M scores), step by step, in ns per score
    on one core; and the page faults that blocks of reused memory avoid."""
    import mlx.core as mx

    import attention
    import model

    heads, rows, keys, d_kv = 4, 128, 4096, 64
    queries, k, v = (mx.random.normal((1, heads, n, d_kv)) for n in (rows, keys, keys))
    bias = model.bias_rows(mx.random.normal((2 * keys - 1, heads)), 0, rows, keys)
    scores = mx.addmm(bias, queries, k.swapaxes(-1, -2))
    below_zero = scores - scores.max(axis=-1, keepdims=True)
    mx.eval(queries, k, v, scores, below_zero)

    def cost(make, elements=heads * rows * keys) -> float:  # ns per element, median of 9 after a warm-up
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
        "the whole block: MLX's fused attention": lambda: mx.fast.scaled_dot_product_attention(queries, k, v, scale=1.0, mask=bias),
    }
    print(f"\nOne block of attention ({heads} heads, {rows} queries, {keys:,} keys), ns per score, one core\n\n"
          f"machine: {machine()}\n\n| step | ns per score |\n|---|---|")
    for name, make in steps.items():
        print(f"| {name} | {cost(make):.2f} |", flush=True)
    small, large = mx.random.normal((1 << 20,)), mx.random.normal((1 << 23,))
    mx.eval(small, large)
    print(f"| an addition over 1 M floats (memory reused) / over 8 M floats (fresh pages) | "
          f"{cost(lambda: small + 1, 1 << 20):.2f} / {cost(lambda: large + 1, 1 << 23):.2f} ns per element |")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


class ServerProcess:
    """server.py (or `code` run as a script, given server.py's options) in a
    process of its own on a free port of 127.0.0.1, once /health answers.
    Its output goes to `log` (a file), or nowhere."""

    def __init__(self, *options: str, code: str | None = None, log=None, wait_seconds: float = 180):
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [*options, "--port", str(self.port)]
        command = [sys.executable, "server.py", *argv] if code is None else [sys.executable, "-c", code, *argv]
        output = subprocess.DEVNULL if log is None else log
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.time() + wait_seconds
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server.py exited ({self.process.returncode}) before it answered: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server.py did not answer in {wait_seconds:.0f} s: {self.output()}")

    def output(self) -> str:
        return "(its output was not kept)"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


def stream_request(client, url: str, body: dict) -> dict:
    """One streamed completion: its time to the first text, its latency and its tokens."""
    started = time.perf_counter()
    first, tokens = None, 0
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and any(choice["text"] for choice in data["choices"]):
                first = time.perf_counter() - started
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return {"first": first if first is not None else time.perf_counter() - started,
            "latency": time.perf_counter() - started, "tokens": tokens}


def run_clients(url: str, prompts: list[str], clients: int, body: dict) -> dict:
    """`clients` threads each sending the next prompt as soon as their last answer is in."""
    import httpx

    queue = list(reversed(prompts))
    results = []

    def client_loop():
        with httpx.Client(timeout=600) as client:
            while True:
                try:
                    prompt = queue.pop()
                except IndexError:
                    return
                results.append(stream_request(client, url, {**body, "prompt": prompt}))

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result()
    seconds = time.perf_counter() - started
    return {"tokens_per_second": sum(r["tokens"] for r in results) / seconds,
            "first": [r["first"] for r in results], "latency": [r["latency"] for r in results]}


def bench_serve(args) -> None:
    """server.py under 1, 4, 16 and 64 concurrent clients (each sending its
    next request when its last answer is in), against the same prompts
    through batch_generate offline at the same batch size; and a short
    request sent while long ones run, against the same request alone."""
    from decoder import Settings
    from generate import measure_batch
    from loading import load

    target_hf, _ = build_pair(args.dir)
    target_dir = converted(target_hf, args.dir / "pair-target-mlx")
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft"), "benchmark pair": (target_dir, DEMO / "target")}
    demo = held_out_prompts()
    client_counts = [int(n) for n in (args.clients or "1,4,16,64").split(",")]
    body = {"model": "default", "max_tokens": args.tokens, "num_draft": args.num_draft, "delta": 0}
    print(f"\nserver.py under load: greedy, delta 0, num-draft {args.num_draft}, at most {args.tokens} tokens, "
          f"the held-out demo prompts (as many requests as 4 per client, 32 at least). Offline: the same prompts "
          f"through batch_generate at a batch size of the client count. Medians of {args.repeats} runs.\n\n"
          f"machine: {machine()}")
    for name, (target_dir, draft_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        requests = {n: [demo[i % len(demo)] for i in range(max(32, 4 * n))] for n in client_counts}
        models = load(target_dir, draft=draft_dir)
        settings = Settings(max_tokens=args.tokens, num_draft=args.num_draft, delta=0.0)
        offline = {}
        for n in client_counts:
            measure_batch(models, requests[n][:n], settings, n)  # warm-up: this batch size's shapes
            runs = [measure_batch(models, requests[n], settings, n) for _ in range(args.repeats)]
            offline[n] = statistics.median(r.generated / r.seconds for r in runs)
        del models
        server = ServerProcess("--model", str(target_dir), "--draft-model", str(draft_dir), "--max-batch",
                               str(max(client_counts)), "--max-queue", str(4 * max(client_counts)))
        try:
            rows = {}
            for n in client_counts:
                run_clients(server.url, requests[n][:n], n, body)  # warm-up
                runs = [run_clients(server.url, requests[n], n, body) for _ in range(args.repeats)]
                rows[n] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                           "first": sum((r["first"] for r in runs), []), "latency": sum((r["latency"] for r in runs), [])}
            short, long = short_among_long(server.url, demo, args.repeats, args.num_draft)
        finally:
            server.close()
        sequential = rows[min(client_counts)]["tokens_per_second"]
        print(f"\n{name}\n\n| clients | server tokens/s | offline batch_generate | server / offline | "
              "server / one client | first token p50 / p99 | latency p50 / p99 |\n|---|---|---|---|---|---|---|")
        for n in client_counts:
            row = rows[n]
            print(f"| {n} | {row['tokens_per_second']:.1f} | {offline[n]:.1f} | {row['tokens_per_second'] / offline[n]:.0%} | "
                  f"{row['tokens_per_second'] / sequential:.2f}x | {percentile(row['first'], 0.5) * 1e3:.0f} / "
                  f"{percentile(row['first'], 0.99) * 1e3:.0f} ms | {percentile(row['latency'], 0.5) * 1e3:.0f} / "
                  f"{percentile(row['latency'], 0.99) * 1e3:.0f} ms |", flush=True)
        print(f"\nA 5-token request alone: {short * 1e3:.0f} ms; sent while 8 requests of 500 tokens run: "
              f"{long * 1e3:.0f} ms ({long / short:.2f}x), medians of {args.repeats}.")


def short_among_long(url: str, prompts: list[str], repeats: int, num_draft: int) -> tuple[float, float]:
    """A 5-token request's latency alone, and sent while 8 requests of 500
    tokens (decoding past their end of text) run: medians."""
    import httpx

    short = {"model": "default", "prompt": prompts[0], "max_tokens": 5, "ignore_eos": True, "delta": 0, "num_draft": num_draft}
    long = {**short, "max_tokens": 500}
    with httpx.Client(timeout=600) as client:
        alone = [stream_request(client, url, short)["latency"] for _ in range(repeats + 1)][1:]
        together = []
        for _ in range(repeats):
            with ThreadPoolExecutor(8) as pool:
                running = [pool.submit(stream_request, httpx.Client(timeout=600), url, {**long, "prompt": p})
                           for p in prompts[1:9]]
                deadline = time.time() + 60
                while httpx.get(url + "/metrics").json()["active_rows"] < 8 and time.time() < deadline:
                    time.sleep(0.01)
                together.append(stream_request(client, url, short)["latency"])
                for future in running:
                    future.result()
    return statistics.median(alone), statistics.median(together)


# (rows, columns) of the weights a decode step multiplies: the demo target's, the
# benchmark pair target's FFN, T5-large's attention and FFN.
BLAS_SHAPES = [(256, 256), (512, 256), (8192, 256), (256, 8192), (1024, 1024), (4096, 1024)]
BLAS_ROWS = [1, 2, 5, 8, 40]  # a regular step, verify passes of 1 and 4 drafts, batches of 8 (x 5)
# d_model -> d_ff weights (T5-small's, the pair target's, T5-large's, T5-3B's), as stored and transposed (cpu.py)
LAYOUT_SHAPES = [(2048, 512), (8192, 256), (4096, 1024), (16384, 1024)]


def blas_worker() -> None:
    """In a process whose BLAS T5_MLX_BLAS chose: microseconds per product
    x @ w.T, as decoding runs it (whole with MKL's threads, else split over
    the cores), for each weight shape and row count, medians over 7 runs of 10
    products; and MLX's 8-bit product of the same (groups of 64), which
    calls no BLAS and runs on one stream, as a quantized model's layers do."""
    import cpu
    import mlx.core as mx

    count = 1 if cpu.THREADED else len(cpu.lanes())
    times, quantized = {}, {}
    for shape in BLAS_SHAPES:
        weights = [mx.random.normal(shape) for _ in range(10)]
        packed = [mx.quantize(w, group_size=64, bits=8) for w in weights]
        mx.eval(weights, packed)
        parts = [cpu.product_parts(w, count, by_input=False) for w in weights]  # made once, as decoding's are
        for rows in BLAS_ROWS:
            x = mx.random.normal((rows, shape[1]))
            mx.eval(x)
            products = {
                "float32": lambda: [cpu.multiply(x, p) for p in parts],
                "8-bit": lambda: [mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=8) for q in packed],
            }
            for kind, product in products.items():
                runs = []
                for _ in range(9):
                    start = time.perf_counter()
                    mx.eval(product())
                    runs.append((time.perf_counter() - start) / len(weights))
                (times if kind == "float32" else quantized)[f"{shape}x{rows}"] = statistics.median(runs[2:]) * 1e6
    layouts = {}  # the products as decoding runs them, by the weight as stored and stored transposed
    for shape in LAYOUT_SHAPES:
        weights = [mx.random.normal(shape) for _ in range(10)]
        mx.eval(weights)
        transposed = [mx.contiguous(w.T).T for w in weights]  # the same values, stored column by column
        mx.eval(transposed)
        parts = {False: [cpu.product_parts(w, count, by_input=False) for w in weights],
                 True: [cpu.product_parts(w, count, by_input=True) for w in transposed]}
        for rows in BLAS_ROWS:
            x = mx.random.normal((rows, shape[1]))
            mx.eval(x)
            runs = {False: [], True: []}
            for _ in range(9):
                for layout in runs:
                    start = time.perf_counter()
                    mx.eval([cpu.multiply(x, p) for p in parts[layout]])
                    runs[layout].append((time.perf_counter() - start) / len(weights))
            layouts[f"{shape}x{rows}"] = [statistics.median(runs[layout][2:]) * 1e6 for layout in (False, True)]
        del weights, transposed, parts
    print(json.dumps({"active": cpu.ACTIVE, "times": times, "quantized": quantized, "layouts": layouts}))


def bench_blas(args) -> None:
    """Every installed BLAS on decoding's products, each in its own process
    (the library is chosen once per process), and the kernels BLIS picked for
    this CPU: what cpu.py's default order rests on."""
    import ctypes.util

    import cpu

    blis = ctypes.util.find_library("blis")
    print(f"\nDecoding's products (x @ w.T, over the cores as decoding runs them), microseconds each, by BLAS, "
          f"and MLX's 8-bit product (no BLAS, one stream)\n\nmachine: {machine()}\nBLIS's kernels for this CPU: "
          f"{cpu.blis_kernels(blis) if blis else 'BLIS not installed'}\n")
    results, quantized, layouts = {}, None, {}
    for name in ("blis", "mkl", "openblas"):
        env = {**os.environ, "T5_MLX_BLAS": name}
        done = subprocess.run([sys.executable, __file__, "--blas-worker"], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            result = json.loads(done.stdout)
            if result["active"].startswith(name):  # not installed: the worker fell back to the bundled BLAS
                results[name], layouts[name] = result["times"], result["layouts"]
                quantized = quantized or result["quantized"]
    names = list(results)
    print("| weight (rows x columns) | x rows | " + " | ".join(names) + " | 8-bit | 8-bit / fastest float32 |\n"
          "|---|---|" + "---|" * (len(names) + 2))
    for shape in BLAS_SHAPES:
        for rows in BLAS_ROWS:
            key = f"{shape}x{rows}"
            cells = [results[name][key] for name in names]
            best = min(cells)
            print(f"| {shape[0]} x {shape[1]} | {rows} | "
                  + " | ".join(f"**{c:.0f}**" if c == best else f"{c:.0f}" for c in cells)
                  + f" | {quantized[key]:.0f} | {quantized[key] / best:.1f}x |")
    print("\nThe weights of d_model -> d_ff products as stored (out x in) and stored transposed "
          "(cpu.use_cores's one_row), microseconds each, as decoding runs them; speed of transposed over stored\n\n"
          "| weight (rows x columns) | x rows | " + " | ".join(f"{name}: stored / transposed / speed" for name in names)
          + " |\n|---|---|" + "---|" * len(names))
    for shape in LAYOUT_SHAPES:
        for rows in BLAS_ROWS:
            cells = [layouts[name][f"{shape}x{rows}"] for name in names]
            print(f"| {shape[0]} x {shape[1]} | {rows} | "
                  + " | ".join(f"{stored:.0f} / {flipped:.0f} / {stored / flipped:.2f}x" for stored, flipped in cells) + " |")


# Shapes from the public configs on the Hugging Face hub (v1.0 T5: tied head, vocabulary 32128).
PUBLIC_T5 = {
    "t5-small": dict(d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=6),
    "t5-base": dict(d_model=768, d_ff=3072, num_heads=12, d_kv=64, num_layers=12),
    "t5-large": dict(d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=24),
    "t5-3b": dict(d_model=1024, d_ff=16384, num_heads=32, d_kv=128, num_layers=24),
    "t5-11b": dict(d_model=1024, d_ff=65536, num_heads=128, d_kv=128, num_layers=24),
}
# Metal's recommended working set (what a Mac's GPU may keep resident) by memory size:
RUNTIME_GB = 1.0  # an allowance for Python, MLX, transformers and caches (decoding itself adds ~0.1 GB: `bench.py quantized`)
# GiB: two thirds of memory up to 32 GB (10.67 GiB reported on 16 GB Macs), 37.44 GiB
# reported on a 48 GB one, three quarters assumed for 64 GB. sudo sysctl iogpu.wired_limit_mb raises it.
MAC_WORKING_SET_GIB = {8: 5.33, 16: 10.67, 24: 16.0, 32: 21.33, 48: 37.44, 64: 48.0}
FORMATS = {"float32": None, "bfloat16": None, "8-bit": 8, "4-bit": 4}


def weight_bytes(shapes: dict, format: str, group_size: int = 64) -> int:
    """Bytes of a converted model's weights: projections and the embedding are
    quantized (with a bfloat16 scale and bias per group), the rest stays float."""
    from convert import Quantization
    from mlx.utils import tree_flatten

    from model import T5, ModelArgs

    args = ModelArgs(vocab_size=32128, num_decoder_layers=shapes["num_layers"], **shapes)
    model = T5(args)  # lazily initialised: nothing is computed, only shapes are read
    bits, total = FORMATS[format], 0
    for name, array in tree_flatten(model.parameters()):
        if bits and Quantization(bits, group_size).applies(name, array.shape):
            total += array.size * bits // 8 + 2 * 2 * array.size // group_size
        else:
            total += array.size * (4 if format == "float32" else 2)
    return total


def bench_sizes(args) -> None:
    """Weights by model and format, computed from the public shapes, and the
    smallest Mac whose working set holds the model with a t5-small draft of the
    same format and the runtime (RUNTIME_GB)."""
    sizes = {name: {format: weight_bytes(shapes, format) for format in FORMATS} for name, shapes in PUBLIC_T5.items()}

    def smallest_mac(name: str, format: str) -> str:
        need = sizes[name][format] + sizes["t5-small"][format] + RUNTIME_GB * 1e9
        return next((f"{memory} GB" for memory, limit in MAC_WORKING_SET_GIB.items() if need <= limit * 2**30), "> 64 GB")

    print("\nWeights (GB) and the smallest Mac that runs the model with a t5-small draft\n\n| model | parameters | "
          + " | ".join(FORMATS) + " |\n|---|---|" + "---|" * len(FORMATS))
    for name in PUBLIC_T5:
        cells = [f"{sizes[name][format] / 1e9:.2f}, {smallest_mac(name, format)} Mac" for format in FORMATS]
        print(f"| {name} | {sizes[name]['float32'] // 4 / 1e6:,.0f} M | " + " | ".join(cells) + " |")
    # Each row of a batch keeps, per decoder layer, keys and values for its prompt (cross-attention)
    # and for its output so far (self-attention): 2 x heads x d_kv numbers a token a layer.
    print("\nCache memory a row of a batch needs, bfloat16, with a t5-small draft: per token of prompt and output, "
          "and for a 512-token prompt with 100 tokens of output\n\n| target | per token | 512 + 100 tokens |\n|---|---|---|")
    draft = PUBLIC_T5["t5-small"]
    for name, shapes in PUBLIC_T5.items():
        per_token = sum(2 * s["num_heads"] * s["d_kv"] * s["num_layers"] * 2 for s in (shapes, draft))
        print(f"| {name} | {per_token / 2**10:,.0f} KiB | {per_token * 612 / 2**20:,.0f} MiB |")


BENCHMARKS = ["regular", "speculative", "steps", "batch", "drafting", "fresh", "lookup", "quantized", "sizes", "encode",
              "attention", "blas", "serve", "all"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Decoding speed: ours vs Hugging Face transformers")
    parser.add_argument("which", nargs="?", choices=BENCHMARKS, default="all")
    parser.add_argument("--tokens", type=int, default=100,
                        help="tokens to generate (speculative, fresh's one-shot runs: at most, EOS stops)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-draft", type=int, default=4, help="speculative, fresh: draft tokens per verify step")
    parser.add_argument("--prompts", type=int,
                        help="speculative, fresh's one-shot runs: how many held-out demo prompts (default 6); "
                        "batch: how many prompts (default 32, the demo's repeated)")
    parser.add_argument("--batch-sizes", default="1,4,8,16", help="batch: batch sizes")
    parser.add_argument("--num-drafts", help="batch, drafting, fresh: fixed num-draft values (default 1,2,3,4; drafting: 1,2,3,4,5,6,8)")
    parser.add_argument("--pairs", help="batch, drafting, lookup: only these pairs (demo, benchmark)")
    parser.add_argument("--shapes", help="steps: only these shapes (demo, small, deep, large)")
    parser.add_argument("--clients", help="serve: concurrent client counts (default 1,4,16,64)")
    parser.add_argument("--dir", type=Path, default=ROOT / "bench_models")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--ct2-worker", help=argparse.SUPPRESS)
    parser.add_argument("--assistant", help=argparse.SUPPRESS)
    parser.add_argument("--cache-fix", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default="128,512,2048,8192", help="encode: input lengths in tokens")
    parser.add_argument("--decode-worker", help=argparse.SUPPRESS)
    parser.add_argument("--encode-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blas-worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.blas_worker:
        return blas_worker()
    if args.encode_worker:
        import cpu  # noqa: F401  (before mlx.core)

        sys.path.insert(0, str(DEMO))
        return encode_worker(args.encode_worker, args.tokens, args.hf)
    if args.decode_worker:
        import cpu  # noqa: F401  (before mlx.core)

        return decode_worker(args.decode_worker, args.tokens)
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.assistant, args.num_draft, args.cache_fix)
    if args.ct2_worker:
        return ct2_worker(args.ct2_worker)
    import cpu  # noqa: F401  (before mlx.core, which the benchmarks import)

    sys.path.insert(0, str(DEMO))  # train.py writes the pair's draft as a Hugging Face checkpoint
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.which in ("regular", "all"):
        bench_regular(args)
    if args.which in ("speculative", "all"):
        bench_speculative(args)
    if args.which in ("steps", "all"):
        bench_steps(args)
    if args.which == "batch":
        bench_batch(args)
    if args.which == "drafting":
        bench_drafting(args)
    if args.which == "fresh":
        bench_fresh(args)
    if args.which == "lookup":
        bench_lookup(args)
    if args.which == "quantized":
        bench_quantized(args)
    if args.which == "sizes":
        bench_sizes(args)
    if args.which == "encode":
        bench_encode(args)
    if args.which == "attention":
        bench_attention(args)
    if args.which == "blas":
        bench_blas(args)
    if args.which == "serve":
        bench_serve(args)


if __name__ == "__main__":
    main()
