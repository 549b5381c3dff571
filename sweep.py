"""The sweep (`main.py --sweep`): speculative decoding over a grid of
(num-draft, delta), against regular decoding, as a table and a plot."""

import os
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from errors import OptionError, SweepError
from generate import measure_batch, warm_up
from loading import Models
from options import AUTO, KNOBS, Settings, Stats


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
    warm_up(models, prompts[0], settings)
    grid = [(num_draft, delta) for num_draft in num_drafts for delta in deltas]
    groups = [[prompt] for prompt in prompts] if batch_size == 1 else [prompts]
    passes = []  # each: (regular decoding's Stats, {setting: Stats}), summed over the prompts
    # A progress bar on stderr, only when it is a terminal: a sweep takes minutes.
    with tqdm(total=repeats * len(groups) * (1 + len(grid)), desc="sweep", unit="run", leave=False,
              disable=None) as progress:
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
        speedups = [s.tokens_per_second / r.tokens_per_second for r, s in runs]
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


def print_table(rows: list[dict], prompts: int, regular_speed: float, repeats: int, out=None, batch_size: int = 1) -> None:
    best = max(rows, key=lambda row: row["speedup"])
    medians = f", medians of {repeats} passes" if repeats > 1 else ""
    batched = f" in batches of {batch_size}" if batch_size > 1 else ""
    print(f"{prompts} prompt(s){batched}, regular decoding {regular_speed:.1f} tokens/s{medians}\n", file=out)
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
    """Speedup against num-draft, one line per delta; num-draft auto, which
    has no place on that axis, as a dotted level in its delta's colour."""
    plt = import_pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
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
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as e:
        raise SweepError(f"cannot save the plot to {path}: {e.strerror or e}")
    finally:
        plt.close(figure)
