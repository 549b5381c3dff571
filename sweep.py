"""The sweep (`main.py --sweep`): speculative decoding over a grid of
(num-draft, delta), against regular decoding, as a table and a plot."""

import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from errors import OptionError, SweepError
from generate import measure_batch
from display import warm_up_aloud
from loading import Models
from options import AUTO, KNOBS, Settings, Stats
from text import plural


def parse_list(text: str, name: str, label: str) -> list:
    """Comma-separated values of the knob `name`, each checked."""
    knob = KNOBS[name]
    try:
        values = [knob.parse(item) for item in text.split(",") if item.strip()]
    except OptionError:
        values = []
    if not values:
        raise OptionError(f"{label} must be a comma-separated list, each {knob.expected} (got '{text}')")
    return values


def sweep(models: Models, prompts: list[str], settings: Settings, num_drafts: list[int], deltas: list[float],
          plot: str | None = None, out=None, repeats: int = 1, batch_size: int = 1) -> list[dict]:
    """Prompt by prompt, regular decoding runs just before the grid's
    settings, so a slow spell on the machine touches both sides of a ratio.
    With batch_size > 1, the prompts run as one batched run per setting
    (regular decoding batched too), and tokens/s is the whole run's.
    With repeats, the whole grid runs that many times: tokens/s and speedup
    are medians over the passes (each speedup against its own pass's regular
    decoding), and the speedups' range is shown; acceptance pools the passes."""
    grid = [(num_draft, delta) for num_draft in num_drafts for delta in deltas]
    groups = [[prompt] for prompt in prompts] if batch_size == 1 else [prompts]
    passes = []  # each: (regular decoding's Stats, {setting: Stats}), summed over the prompts
    runs = repeats * len(groups) * (1 + len(grid))
    batched = f" in batches of {batch_size}" if batch_size > 1 else ""
    print(f"sweep: {plural(runs, 'run')} ({plural(repeats, 'pass', 'passes')} over {plural(len(prompts), 'prompt')}{batched}: "
          f"regular decoding and {plural(len(grid), 'setting')}); warming up ...", file=sys.stderr, flush=True)
    warm_up_aloud(models, prompts[0], settings)
    with Progress(runs) as progress:
        for _ in range(repeats):
            regular, results = Stats(), {setting: Stats() for setting in grid}
            for group in groups:
                regular += measure_batch(models, group, replace(settings, speculative=False), batch_size)
                progress.update()
                for num_draft, delta in grid:
                    speculative = replace(settings, speculative=True, num_draft=num_draft, delta=delta)
                    results[(num_draft, delta)] += measure_batch(models, group, speculative, batch_size)
                    progress.update()
            if regular.generated == 0:
                raise SweepError("regular decoding generated nothing (EOS first) on every prompt: nothing to compare")
            passes.append((regular, results))
    rows = []
    for num_draft, delta in grid:
        runs = [(regular, results[(num_draft, delta)]) for regular, results in passes]
        speedups = [s.tokens_per_second / r.tokens_per_second if r.tokens_per_second else 0.0 for r, s in runs]
        pooled = sum((s for _, s in runs), Stats())
        rows.append({"num_draft": num_draft, "delta": delta, "acceptance": pooled.acceptance_rate,
                     "tokens_per_second": statistics.median(s.tokens_per_second for _, s in runs),
                     "speedup": statistics.median(speedups), "speedup_range": (min(speedups), max(speedups))})
    regular_speed = statistics.median(regular.tokens_per_second for regular, _ in passes)
    print_table(rows, len(prompts), regular_speed, repeats, out, batch_size)
    if plot:
        plot_sweep(rows, deltas, plot)
        print(f"\nplot saved to {plot}", file=out)
    return rows


class Progress:
    """A sweep's runs done (it takes minutes): tqdm's bar at a terminal; in a
    log or a pipe, a line at each tenth, with the time it has taken."""

    def __init__(self, total: int, out=None):
        self.total, self.done, self.out = total, 0, out or sys.stderr
        self.bar = tqdm(total=total, desc="sweep", unit="run", leave=False, file=self.out) if self.out.isatty() else None
        self.started = time.perf_counter()

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif self.done * 10 // self.total > (self.done - 1) * 10 // self.total:
            seconds = time.perf_counter() - self.started
            left = seconds * (self.total - self.done) / self.done
            print(f"sweep: {self.done * 100 // self.total}% ({self.done:,} of {plural(self.total, 'run')}) in {seconds:.0f} s"
                  + (f", about {left:.0f} s to go" if self.done < self.total else ""), file=self.out, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def print_table(rows: list[dict], prompts: int, regular_speed: float, repeats: int, out=None, batch_size: int = 1) -> None:
    best = max(rows, key=lambda row: row["speedup"])
    medians = f", medians of {repeats} passes" if repeats > 1 else ""
    batched = f" in batches of {batch_size}" if batch_size > 1 else ""
    print(f"{plural(prompts, 'prompt')}{batched}, regular decoding {regular_speed:.1f} tokens/s{medians}\n", file=out)
    spread = " speedup range |" if repeats > 1 else ""
    print(f"| num-draft | delta | acceptance | tokens/s | speedup |{spread}", file=out)
    print("|---|---|---|---|---|" + "---|" * (repeats > 1), file=out)
    for row in rows:
        mark = " **best**" if row is best else ""
        low, high = row["speedup_range"]
        spread = f" {low:.2f}-{high:.2f}x |" if repeats > 1 else ""
        print(f"| {row['num_draft']} | {row['delta']} | {row['acceptance']:.2f} | {row['tokens_per_second']:.1f} | "
              f"{row['speedup']:.2f}x{mark} |{spread}", file=out)


def import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SweepError("--plot needs matplotlib: pip install matplotlib")
    return plt


def check_plot_path(path: str) -> None:
    """Before a sweep of minutes: can a plot be saved there?"""
    import_pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    folder, suffix = Path(path).resolve().parent, Path(path).suffix.lstrip(".").lower()
    if Path(path).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise SweepError(f"--plot {path}: cannot write there")
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise SweepError(f"--plot {path}: give a .png, .svg or .pdf file name")


def plot_sweep(rows: list[dict], deltas: list[float], path: str) -> None:
    plt = import_pyplot()
    figure = sweep_figure(rows, deltas)
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")  # the whole legend, beside the axes
    except OSError as e:
        raise SweepError(f"cannot save the plot to {path}: {e.strerror or e}")
    finally:
        plt.close(figure)


def sweep_figure(rows: list[dict], deltas: list[float]):
    """Speedup against num-draft, one line per delta; num-draft auto, which
    has no place on that axis, as a dotted level in its delta's colour. The
    legend stands right of the axes, where it covers no point."""
    plt = import_pyplot()
    figure, axes = plt.subplots(figsize=(7.5, 4))
    for delta in deltas:
        points = [(row["num_draft"], row["speedup"]) for row in rows if row["delta"] == delta and row["num_draft"] != AUTO]
        line = axes.plot(*zip(*points), marker="o", label=f"delta {delta}")[0] if points else None
        for row in rows:
            if row["delta"] == delta and row["num_draft"] == AUTO:
                axes.axhline(row["speedup"], linestyle=":", linewidth=1.5, color=line.get_color() if line else None,
                             label=f"delta {delta}, num-draft auto")
    axes.set_xticks(sorted({row["num_draft"] for row in rows if row["num_draft"] != AUTO}))  # whole numbers only
    axes.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    axes.set_xlabel("num-draft")
    axes.set_ylabel("speedup over regular decoding")
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    figure.tight_layout()
    return figure
