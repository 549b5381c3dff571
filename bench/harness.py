"""What every measurement shares: the machine it ran on, reference engines in
processes of their own, contenders run in turn, our decoding through the
engine's one factory, and results written as data.

A command's `run(args)` measures and returns plain data; `render(data)` makes
its table. `report` writes {command, machine, date, data} to
bench/results/<command>.json and prints the table; `python -m bench render`
makes docs/PERFORMANCE.md from those files alone.
"""

import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- the machine


def machine() -> dict:
    """CPU model, cores, BLAS and library versions: ratios move from machine to machine."""
    import cpu
    import mlx.core as mx

    model, detail = platform.processor() or platform.machine(), ""
    if sys.platform == "linux":  # a virtual machine's "AMD EPYC" may be any generation: its family tells which
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        model = fields.get("model name", model)
        if "cpu family" in fields:
            wide = ", AVX-512" if "avx512f" in fields.get("flags", "").split() else ""
            detail = f"family {fields['cpu family']} model {fields.get('model', '?')}{wide}"
    elif sys.platform == "darwin":
        model = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
    gpu = {} if cpu.mlx_computes_on_cpu() else {"gpu": mx.device_info().get("device_name", "?")}
    return {"cpu": model, "detail": detail, "cores": os.cpu_count(), "blas": cpu.ACTIVE.split(" (")[0],
            "path": "CPU" if cpu.in_use() else "accelerator", "mlx": mx.__version__, "python": platform.python_version(),
            **gpu}


def describe(machine: dict) -> str:
    detail = f" ({machine['detail']})" if machine["detail"] else ""
    gpu = f"GPU {machine['gpu']} (MLX computing there), " if "gpu" in machine else ""
    return f"{gpu}{machine['cpu']}{detail}, {machine['cores']} cores, BLAS {machine['blas']}, MLX {machine['mlx']}"


# ---------------------------------------------------------------- results


def command_line(argv: list[str]) -> str:
    """The command as a user would type it; --dir (where checkpoints are kept) changes no figure."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--dir" or arg.startswith("--dir="):
            skip = arg == "--dir"
            continue
        kept.append(arg)
    return "python -m bench " + " ".join(shlex.quote(arg) for arg in kept)


def report(name: str, argv: list[str], data: dict, render) -> dict:
    """Write a command's result (bench/results/NAME.json; NAME-gpu.json where MLX computes on a GPU, a Mac's
    included) and print its table."""
    result = {"command": command_line(argv), "machine": machine(), "date": datetime.date.today().isoformat(), "data": data}
    RESULTS.mkdir(exist_ok=True)
    # A GPU's figures beside a CPU's, not in their place: their ratios answer another question.
    (RESULTS / f"{name}{'-gpu' if 'gpu' in result['machine'] else ''}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['command']}\n\n{describe(result['machine'])}\n\n{render(data)}")
    return result


def table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


# ---------------------------------------------------------------- contenders


class Worker:
    """A reference engine in a process of its own (so that neither library's
    threading settings touch the other's), asked one JSON line at a time."""

    def __init__(self, *flags: str, env: dict | None = None):
        import cpu

        # The environment as the user gave it: not cpu.py's settings for our MKL.
        given = {key: value for key, value in os.environ.items() if key not in cpu.SET_HERE}
        self.process = subprocess.Popen([sys.executable, "-m", "bench", *flags], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**given, **(env or {})})
        self.version = json.loads(self.process.stdout.readline())["ready"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def run(self, prompt: list[int], tokens: int, min_tokens: int = 0, beams: int = 1) -> dict:
        """One greedy generation (a beam search, with beams): {"seconds",
        "tokens"} (EOS left out), and the worker's own counts."""
        return self.ask({"prompt": prompt, "tokens": tokens, "min_tokens": min_tokens, "beams": beams})

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


@dataclass
class Timing:
    median: float  # seconds
    seconds: list[float]
    output: object  # the last run's
    warm_ups: int = 0  # the whole runs it took before its time was steady (warm_until_steady)


STEADY = 0.2  # two runs in a row this near each other's time: warm
MOST_WARM_UPS = 6


def warm_until_steady(run) -> int:
    """Run a contender (run() -> (seconds, output)) until two runs in a row
    take times within STEADY of each other, at most MOST_WARM_UPS runs; how
    many it took. One short call does not warm every library: on an Intel
    Xeon, transformers' generate ran its first two whole calls at 0.5
    tokens/s and every later one at 7 (docs/DECISIONS.md)."""
    last = None
    for count in range(1, MOST_WARM_UPS + 1):
        seconds, _ = run()
        if last is not None and abs(seconds - last) <= STEADY * min(seconds, last):
            return count
        last = seconds
    return MOST_WARM_UPS


def alternate(runs: dict, repeats: int, warm_up: bool = True) -> dict[str, Timing]:
    """Each run() -> (seconds, output), warmed until its time is steady, then
    in turn, pass after pass, so that a machine's slow spell falls on every
    contender."""
    warm_ups = {name: warm_until_steady(run) if warm_up else 0 for name, run in runs.items()}
    seconds, outputs = {name: [] for name in runs}, {}
    for _ in range(repeats):
        for name, run in runs.items():
            elapsed, outputs[name] = run()
            seconds[name].append(elapsed)
    return {name: Timing(statistics.median(seconds[name]), seconds[name], outputs[name], warm_ups[name]) for name in runs}


def warm_up_note(warm_ups: dict | None) -> str:
    """A sentence for a table: the warm-up runs each contender took (results written before they were counted: none)."""
    if not warm_ups:
        return ""
    counts = ", ".join(f"{name} {count}" for name, count in warm_ups.items())
    return (f"\n\nEach contender was timed once warm: run until two whole runs in a row were within {STEADY:.0%} of each "
            f"other (runs it took: {counts}).")


def worker_run(worker: Worker, prompts: list[list[int]], tokens: int, forced: bool = False, beams: int = 1):
    """A run of a worker over the prompts for `alternate`: (seconds,
    {tokens, drafted, accepted}), the last two counted by an assisted
    transformers worker (None otherwise)."""
    def run():
        results = [worker.run(prompt, tokens, tokens if forced else 0, beams) for prompt in prompts]
        counted = "proposed" in results[0]
        return sum(result["seconds"] for result in results), {
            "tokens": [result["tokens"] for result in results],
            "drafted": sum(r["proposed"] for r in results) if counted else None,
            "accepted": sum(r["accepted"] for r in results) if counted else None}
    return run


def decode(models, prompts: list[list[int]], settings, batch_size: int = 1) -> tuple[list[list[int]], list, float]:
    """Our decoding of prompt ids through the engine's one factory (as
    generate and the server decode): each prompt's tokens and Stats, and the
    run's wall-clock seconds."""
    from batches import batch_for, drive
    from rows import Request

    requests = [Request(prompt, settings) for prompt in prompts]
    index = {id(request): i for i, request in enumerate(requests)}
    tokens = [[] for _ in prompts]
    started = time.perf_counter()
    for request, token, _ in drive(batch_for(models, settings, batch_size), requests):
        if token is not None:
            tokens[index[id(request)]].append(token)
    return tokens, [request.stats for request in requests], time.perf_counter() - started


def ours_run(models, prompts: list[list[int]], settings):
    """A run of ours over the prompts, one at a time, for `alternate`:
    (seconds from each prompt's join to its last token, summed;
    {tokens, drafted, accepted})."""
    def run():
        results = [decode(models, [prompt], settings) for prompt in prompts]
        stats = [s for result in results for s in result[1]]
        return (sum(s.seconds for s in stats), {"tokens": [t for result in results for t in result[0]],
                                                "drafted": sum(s.drafted for s in stats),
                                                "accepted": sum(s.accepted for s in stats)})
    return run


def same_tokens(reference: list[list[int]], workers: dict, prompts: list[list[int]], tokens: int) -> dict:
    """How many prompts each worker's greedy tokens differ from `reference`
    on, generated to EOS (a forced length would differ at the EOS the
    references suppress)."""
    return {name: sum(worker.run(prompt, tokens)["tokens"] != mine for prompt, mine in zip(prompts, reference))
            for name, worker in workers.items()}


def median(values) -> float:
    return statistics.median(values)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]
