"""Run T5 in MLX: regular or speculative (draft-and-verify) decoding.

    python main.py                                   # t5-11b verifies what t5-small drafts
    python main.py --num-draft 4 --delta 0.2 --prompt "summarize: ..."
    python main.py --compare                         # regular vs speculative, same prompt
    python main.py --interactive                     # load once, tune knobs at a prompt
    python main.py --sweep --num-drafts 1,2,4,8 --deltas 0,0.1,0.3 --plot sweep.png
    python main.py --demo                            # the small trained pair in demo/ (demo/train.py), no download
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import blas  # before mlx.core
import mlx.core as mx
from tqdm import tqdm

from decoder import Sampling, Stats, regular_generate, speculative_generate
from model import FORMAT_KEY, NotAConvertedModel, load_model, load_tokenizer, read_config

DEFAULT_PROMPT = (
    "translate English to French: Let's go to the store and buy some groceries "
    "including eggs, avocadoes, and bread."
)
MODELS_DIR = Path("mlx_models")
# A small target/draft pair trained on the Python standard library (demo/train.py),
# with held-out source code whose masked spans they fill in.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
SENTINEL = re.compile(r"<extra_id_(\d+)>")


class UsageError(Exception):
    """Bad input from the user; printed as one line."""


def resolve_model(name: str, role: str = "model") -> Path:
    """A converted folder path, else mlx_models/NAME, else for a hub id
    ORG/REPO the mlx_models/REPO that convert.py made from that very id.
    `role` ("target", "draft") names the model in errors."""
    problem = None
    candidates = (Path(name).expanduser(), MODELS_DIR / name)
    for folder in candidates:
        if folder.is_dir():
            try:
                read_config(folder)
                return folder
            except NotAConvertedModel as e:
                problem = problem or str(e)
    org, _, repo = name.partition("/")
    if problem is None and org and repo and "/" not in repo:
        folder = MODELS_DIR / repo
        try:
            if read_config(folder)[FORMAT_KEY].get("source") == name:
                return folder
        except NotAConvertedModel:
            pass
    if problem:
        raise UsageError(problem)
    if Path(name).expanduser().is_file():
        raise UsageError(f"{role} {name} is a file: give a folder written by convert.py")
    looked = " and ".join(dict.fromkeys(str(folder) for folder in candidates))
    hint = " (or pass --regular-decode to run the target alone)" if role == "draft" else ""
    raise UsageError(f"no converted {role} '{name}' (looked for {looked}): "
                     f"run `python convert.py --model {name}` first{hint}")


@dataclass
class Settings:
    """Every knob of one generation; the interactive loop edits a copy."""

    max_tokens: int = 100
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_draft: int = 5
    delta: float = 0.1
    speculative: bool = True

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_k, self.top_p)


def check_settings(args) -> None:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if not 0 <= args.temp < math.inf:  # also refuses nan
        raise UsageError(f"--temp must be a finite number >= 0 (got {args.temp})")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (got {args.top_p})")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (got {args.top_k})")
    if args.num_draft < 1:
        raise UsageError(f"--num-draft must be at least 1 (got {args.num_draft})")
    if not 0 <= args.delta <= 1:
        raise UsageError(f"--delta must be in [0, 1] (got {args.delta})")
    if args.seed is not None and not valid_seed(args.seed):
        raise UsageError(f"--seed must be in [0, 2**64) (got {args.seed})")


def valid_seed(seed: int) -> bool:
    return 0 <= seed < 2**64  # what mx.random.seed takes


def check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise UsageError("the prompt is empty")


def stream_text(tokens_iter, tokenizer, out=None) -> tuple[list[int], str]:
    """Print text as tokens arrive. Decoding the whole prefix each time keeps
    SentencePiece spacing right; an incomplete UTF-8 sequence is held back."""
    out = out or sys.stdout
    tokens, printed = [], ""
    for token in tokens_iter:
        tokens.append(token)
        text = tokenizer.decode(tokens)
        if text.endswith("\ufffd") or not text.startswith(printed):
            continue
        out.write(text[len(printed):])
        out.flush()
        printed = text
    text = tokenizer.decode(tokens)
    if text.startswith(printed):
        out.write(text[len(printed):])
    out.write("\n")
    out.flush()
    return tokens, text


def demo_prompts() -> list[str]:
    path = DEMO_DIR / "prompts.txt"
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        raise UsageError(f"{path} is missing: restore demo/ with git checkout demo, or rebuild it with python demo/train.py (about 50 minutes on 2 cores)")


def fill_spans(prompt: str, output: str) -> str:
    """The prompt with each <extra_id_N> replaced by the span the model wrote
    after it in its output, marked «like this»."""
    pieces = SENTINEL.split(output)  # text, id, span, id, span, ...
    spans = {int(pieces[i]): pieces[i + 1].strip() for i in range(1, len(pieces) - 1, 2)}
    return SENTINEL.sub(lambda m: f"«{spans.get(int(m.group(1)), '?')}»", prompt)


def show_filled(prompt: str, output: str, out=None) -> None:
    """For a span-corruption prompt (T5's pre-training task), the prompt with its spans filled in."""
    if SENTINEL.search(prompt) and SENTINEL.search(output):
        print(f"\nFilled in:\n{fill_spans(prompt, output)}", file=out)


class Models:
    """The target, the draft (None for regular decoding only) and their tokenizer."""

    def __init__(self, target_name: str, draft_name: str | None):
        target_dir = resolve_model(target_name, "target")
        draft_dir = resolve_model(draft_name, "draft") if draft_name else None
        self.tokenizer = load_tokenizer(target_dir)
        if draft_dir is not None:  # refuse a mismatched pair before loading any weights
            target_vocab, draft_vocab = read_config(target_dir)["vocab_size"], read_config(draft_dir)["vocab_size"]
            if draft_vocab != target_vocab:
                raise UsageError(f"{draft_name} has {draft_vocab} output tokens, {target_name} {target_vocab}: not a draft for it")
            if load_tokenizer(draft_dir).get_vocab() != self.tokenizer.get_vocab():
                raise UsageError(f"{draft_name} and {target_name} have different tokenizers: the draft must share the target's")
        self.target = load_model(target_dir)
        self.draft = load_model(draft_dir) if draft_dir is not None else None
        # load_model maps the weights lazily; read them now, so that a
        # generation's time (and tokens/s) is decoding, not disk reads. Said
        # on stderr (stdout may be --json): T5-11B's weights take a while.
        print(f"Loading {target_dir}" + (f" and {draft_dir}" if draft_dir else "") + " ...", file=sys.stderr, flush=True)
        mx.eval(self.target.parameters(), self.draft.parameters() if self.draft is not None else [])

    def generate(self, prompt: str, settings: Settings, stats: Stats):
        """Token ids as they are decided."""
        if settings.speculative and self.draft is None:
            raise UsageError("speculative decoding needs --draft-model (or pass --regular-decode)")
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        ids = self.tokenizer(prompt).input_ids
        if settings.speculative:
            return speculative_generate(self.target, self.draft, ids, settings.max_tokens, settings.sampling,
                                        settings.num_draft, settings.delta, stats)
        return regular_generate(self.target, ids, settings.max_tokens, settings.sampling, stats)

    def run(self, prompt: str, settings: Settings) -> tuple[list[int], Stats]:
        stats = Stats()
        return list(self.generate(prompt, settings, stats)), stats

    def warm_up(self, prompt: str, settings: Settings) -> None:
        """One short run of each path, so first-call costs (compiling kernels,
        growing the allocator's pools) stay out of timings."""
        for speculative in (False, True) if self.draft is not None else (False,):
            self.run(prompt, replace(settings, max_tokens=4, speculative=speculative))


def stats_line(stats: Stats, speculative: bool) -> str:
    line = f"{stats.generated} tokens in {stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s)"
    if speculative:
        return (
            f"Accepted {stats.accepted} / {stats.drafted} drafts ({stats.acceptance_rate:.0%}), "
            f"{stats.target_calls} decode steps ({stats.tokens_per_target_call:.2f} tokens each), " + line
        )
    return f"{stats.target_calls} decode steps, " + line


def show_generation(models: Models, prompt: str, settings: Settings, out=None) -> tuple[str, Stats]:
    stats = Stats()
    _, text = stream_text(models.generate(prompt, settings, stats), models.tokenizer, out)
    print(stats_line(stats, settings.speculative), file=out)
    return text, stats


def compare(models: Models, prompt: str, settings: Settings, out=None) -> None:
    """Regular then speculative decoding of one prompt, with times and speedup."""
    models.warm_up(prompt, settings)
    results = {}
    for speculative in (False, True):
        label = "speculative" if speculative else "regular"
        print(f"--- {label}", file=out)
        _, results[label] = show_generation(models, prompt, replace(settings, speculative=speculative), out)
    regular, spec = results["regular"], results["speculative"]
    speedup = spec.tokens_per_second / regular.tokens_per_second if regular.tokens_per_second else 0.0
    print(f"regular {regular.seconds:.2f} s, speculative {spec.seconds:.2f} s: speedup {speedup:.2f}x "
          f"(num-draft {settings.num_draft}, delta {settings.delta})", file=out)


# ---------------------------------------------------------------- interactive

HELP = """Type a prompt to generate. Commands:
  :num-draft N   :delta X   :temp T   :top-p P   :top-k K   :max-tokens N   :seed S (or :seed none)
  :regular / :speculative   decoding mode
  :compare                  regular vs speculative on the last prompt
  :show                     current settings
  :help   :quit             (Ctrl-C stops a generation, Ctrl-D exits)"""


def help_text(examples: list[str] | None) -> str:
    if not examples:
        return HELP
    return HELP + f"\n  :demo N                   run held-out demo prompt N (1-{len(examples)}): code with masked spans"


KNOBS = {  # command -> (settings field, parser, check, what the check wants)
    "num-draft": ("num_draft", int, lambda v: v >= 1, "an integer >= 1"),
    "delta": ("delta", float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "temp": ("temp", float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "top-p": ("top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top-k": ("top_k", int, lambda v: v >= 0, "an integer >= 0"),
    "max-tokens": ("max_tokens", int, lambda v: v >= 1, "an integer >= 1"),
    "seed": ("seed", lambda text: None if text == "none" else int(text), lambda v: v is None or valid_seed(v),
             "an integer in [0, 2**64) or none"),
}


def show_settings(settings: Settings, has_draft: bool) -> str:
    mode = "speculative" if settings.speculative else "regular"
    return (f"mode {mode}{'' if has_draft else ' (no draft model)'}, num-draft {settings.num_draft}, delta {settings.delta}, "
            f"temp {settings.temp}, top-k {settings.top_k}, top-p {settings.top_p}, max-tokens {settings.max_tokens}, seed {settings.seed}")


def command(line: str, settings: Settings, models: Models, last_prompt: str | None, out,
            examples: list[str] | None = None) -> Settings | None:
    """Apply one ':command'; return the new settings, or None to quit."""
    name, _, value = line[1:].strip().partition(" ")
    value = value.strip()
    if name in ("quit", "exit", "q"):
        return None
    if name == "help":
        print(help_text(examples), file=out)
    elif name == "show":
        print(show_settings(settings, models.draft is not None), file=out)
    elif name in ("regular", "speculative"):
        if name == "speculative" and models.draft is None:
            print("no draft model loaded (started with --regular-decode)", file=out)
        else:
            settings = replace(settings, speculative=name == "speculative")
            print(show_settings(settings, models.draft is not None), file=out)
    elif name == "compare":
        if models.draft is None:
            print("no draft model loaded", file=out)
        elif last_prompt is None:
            print("type a prompt first", file=out)
        else:
            compare(models, last_prompt, settings, out)
    elif name in KNOBS:
        field, parse, ok, expected = KNOBS[name]
        try:
            parsed = parse(value)
        except ValueError:
            parsed = None
            print(f":{name} takes {expected} (got '{value}')", file=out)
        else:
            if ok(parsed):
                settings = replace(settings, **{field: parsed})
                print(show_settings(settings, models.draft is not None), file=out)
            else:
                print(f":{name} takes {expected} (got '{value}')", file=out)
    else:
        print(f"unknown command ':{name}' (:help lists them)", file=out)
    return settings


def pick_example(line: str, examples: list[str] | None, out) -> str | None:
    """The prompt that ':demo N' names, or None (with a message)."""
    if not examples:
        print(":demo needs the demo pair (start with --demo)", file=out)
        return None
    value = line[len(":demo"):].strip() or "1"
    if not value.isdigit() or not 1 <= int(value) <= len(examples):
        print(f":demo takes a prompt number from 1 to {len(examples)} (got '{value}')", file=out)
        return None
    prompt = examples[int(value) - 1]
    print(prompt, file=out)
    return prompt


def interactive(models: Models, settings: Settings, out=None, examples: list[str] | None = None,
                first_prompt: str | None = None) -> None:
    """The prompt loop; first_prompt (--prompt) runs as if typed first."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print("Warming up ...", file=out, flush=True)
    models.warm_up(first_prompt or (examples[0] if examples else DEFAULT_PROMPT), settings)
    print(help_text(examples), file=out)
    print(show_settings(settings, models.draft is not None), file=out)
    last_prompt = None
    while True:
        try:
            if first_prompt:
                line, first_prompt = first_prompt, None
                print(f"> {line}", file=out)
            else:
                line = input("> ").strip()
        except EOFError:
            print(file=out)
            return
        except KeyboardInterrupt:
            print(file=out)
            continue
        if not line:
            continue
        try:
            if line.split()[0] == ":demo":
                line = pick_example(line, examples, out)
                if line is None:
                    continue
            elif line.startswith(":"):
                settings = command(line, settings, models, last_prompt, out, examples)
                if settings is None:
                    return
                continue
            last_prompt = line
            text, _ = show_generation(models, line, settings, out)
            show_filled(line, text, out)
        except KeyboardInterrupt:
            print("\n[stopped]", file=out)


# ---------------------------------------------------------------- sweep


def parse_list(text: str, kind, flag: str, valid, expected: str) -> list:
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or not all(valid(v) for v in values):
        raise UsageError(f"{flag} takes a comma-separated list of {expected} (got '{text}')")
    return values


def sweep(models: Models, prompts: list[str], settings: Settings, num_drafts: list[int], deltas: list[float],
          plot: str | None, out=None, repeats: int = 1) -> list[dict]:
    """Speculative decoding over a grid of (num_draft, delta), against regular
    decoding. Prompt by prompt, regular decoding runs just before the grid's
    settings, so a slow spell on the machine touches both sides of a ratio.
    With repeats, the whole grid runs that many times: tokens/s and speedup
    are medians over the passes (each speedup against its own pass's regular
    decoding), and the speedups' range is shown; acceptance pools the passes."""
    models.warm_up(prompts[0], settings)

    def add(total: Stats, stats: Stats) -> None:
        for field in ("generated", "target_calls", "draft_calls", "drafted", "accepted", "seconds"):
            setattr(total, field, getattr(total, field) + getattr(stats, field))

    grid = [(num_draft, delta) for num_draft in num_drafts for delta in deltas]
    passes = []  # each: (regular decoding's Stats, {setting: Stats}), summed over the prompts
    # A progress bar on stderr, only when it is a terminal: a sweep takes minutes.
    with tqdm(total=repeats * len(prompts) * (1 + len(grid)), desc="sweep", unit="run", leave=False,
              disable=None) as progress:
        for _ in range(repeats):
            regular, results = Stats(), {setting: Stats() for setting in grid}
            for prompt in prompts:
                add(regular, models.run(prompt, replace(settings, speculative=False))[1])
                progress.update()
                for num_draft, delta in grid:
                    speculative = replace(settings, speculative=True, num_draft=num_draft, delta=delta)
                    add(results[(num_draft, delta)], models.run(prompt, speculative)[1])
                    progress.update()
            if regular.generated == 0:
                raise UsageError("regular decoding generated nothing (EOS first) on every prompt: nothing to compare")
            passes.append((regular, results))
    rows = []
    for num_draft, delta in grid:
        runs = [(regular, results[(num_draft, delta)]) for regular, results in passes]
        speedups = [s.tokens_per_second / r.tokens_per_second for r, s in runs]
        rows.append({"num_draft": num_draft, "delta": delta,
                     "acceptance": sum(s.accepted for _, s in runs) / max(1, sum(s.drafted for _, s in runs)),
                     "tokens_per_second": statistics.median(s.tokens_per_second for _, s in runs),
                     "speedup": statistics.median(speedups), "speedup_range": (min(speedups), max(speedups))})
    best = max(rows, key=lambda row: row["speedup"])
    regular_speed = statistics.median(regular.tokens_per_second for regular, _ in passes)
    medians = f", medians of {repeats} passes" if repeats > 1 else ""
    print(f"{len(prompts)} prompt(s), regular decoding {regular_speed:.1f} tokens/s{medians}\n", file=out)
    spread = " speedup range |" if repeats > 1 else ""
    print(f"| num-draft | delta | acceptance | tokens/s | speedup |{spread}", file=out)
    print("|---|---|---|---|---|" + "---|" * (repeats > 1), file=out)
    for row in rows:
        mark = " **best**" if row is best else ""
        low, high = row["speedup_range"]
        spread = f" {low:.2f}-{high:.2f}x |" if repeats > 1 else ""
        print(f"| {row['num_draft']} | {row['delta']} | {row['acceptance']:.2f} | {row['tokens_per_second']:.1f} | "
              f"{row['speedup']:.2f}x{mark} |{spread}", file=out)
    if plot:
        plot_sweep(rows, deltas, plot)
        print(f"\nplot saved to {plot}", file=out)
    return rows


def check_plot_path(path: str) -> None:
    import_pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    folder, suffix = Path(path).resolve().parent, Path(path).suffix.lstrip(".").lower()
    if Path(path).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UsageError(f"--plot {path}: cannot write there")
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise UsageError(f"--plot {path}: give a .png, .svg or .pdf file name")


def import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib")
    return plt


def plot_sweep(rows: list[dict], deltas: list[float], path: str) -> None:
    plt = import_pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for delta in deltas:
        points = [(row["num_draft"], row["speedup"]) for row in rows if row["delta"] == delta]
        axes.plot(*zip(*points), marker="o", label=f"delta {delta}")
    axes.set_xticks(sorted({row["num_draft"] for row in rows}))  # whole numbers only
    axes.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    axes.set_xlabel("num-draft")
    axes.set_ylabel("speedup over regular decoding")
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot save the plot to {path}: {e.strerror or e}")


# ---------------------------------------------------------------- command line


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for flags and options whose help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# Options that only --sweep reads, with their defaults (argparse's default is
# None, so that one given without --sweep is noticed).
SWEEP_OPTIONS = {"num_drafts": "1,2,4,8", "deltas": "0,0.1,0.3", "prompts_file": None, "plot": None, "repeats": 1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", help="target model: converted folder, a name under mlx_models/, or the hub id it was "
                   "converted from (default: t5-11b; demo/target with --demo)")
    p.add_argument("--draft-model", help="draft model for speculative decoding (default: t5-small; demo/draft with --demo)")
    p.add_argument("--prompt", help="input text (default: a translation prompt; with --demo, held-out code with masked spans)")
    p.add_argument("--demo", action="store_true",
                   help="use the small trained pair in demo/ (built by demo/train.py; no download): it fills in masked spans of Python code")
    p.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--num-draft", type=int, default=5, help="draft tokens per verify step")
    p.add_argument("--delta", type=float, default=0.1, help="acceptance lenience in [0, 1]: 0 exact, 1 accepts every draft")
    p.add_argument("--regular-decode", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--compare", action="store_true", help="run regular and speculative decoding and print the speedup")
    modes.add_argument("--interactive", action="store_true", help="load the models once, then a prompt loop (:help for commands); --prompt, if given, runs first")
    modes.add_argument("--sweep", action="store_true", help="speculative decoding over --num-drafts x --deltas")
    p.add_argument("--num-drafts", help=f"sweep: num-draft values (default: {SWEEP_OPTIONS['num_drafts']})")
    p.add_argument("--deltas", help=f"sweep: delta values (default: {SWEEP_OPTIONS['deltas']})")
    p.add_argument("--prompts-file", help="sweep: prompts, one a line (default: --prompt; with --demo, demo/prompts.txt)")
    p.add_argument("--plot", help="sweep: save speedup against num-draft to this image, .png, .svg or .pdf (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="sweep: run the grid this many times and report medians (default: 1)")
    return p


def apply_defaults(args) -> list[str] | None:
    """Fill in --model, --draft-model and --prompt; returns the demo's prompts with --demo."""
    examples = demo_prompts() if args.demo else None
    args.model = args.model or (str(DEMO_DIR / "target") if args.demo else "t5-11b")
    if args.draft_model is None:
        args.draft_model = str(DEMO_DIR / "draft") if args.demo else "t5-small"
    if args.prompt is None:
        args.prompt = examples[0] if args.demo else DEFAULT_PROMPT
    return examples


def run(args) -> int:
    prompt_given = args.prompt is not None
    examples = apply_defaults(args)
    check_settings(args)
    settings = Settings(args.max_tokens, args.temp, args.top_k, args.top_p, args.seed, args.num_draft, args.delta,
                        speculative=not args.regular_decode)
    if args.regular_decode and (args.compare or args.sweep):
        raise UsageError("--compare and --sweep run regular decoding themselves: drop --regular-decode")
    needs_draft = not args.regular_decode
    if needs_draft and not args.draft_model:
        raise UsageError("speculative decoding needs --draft-model (or pass --regular-decode)")
    if args.json and (args.interactive or args.compare or args.sweep):
        raise UsageError("--json goes with a one-shot run, not --interactive, --compare or --sweep")
    for name, default in SWEEP_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not args.sweep:
            raise UsageError(f"--{name.replace('_', '-')} goes with --sweep")
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if args.sweep:
        prompts = examples if examples and not prompt_given else [args.prompt]
        if args.prompts_file:
            try:
                prompts = [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
            except OSError as e:
                raise UsageError(f"cannot read --prompts-file: {e.strerror}")
            if not prompts:
                raise UsageError(f"{args.prompts_file} has no prompts")
        num_drafts = parse_list(args.num_drafts, int, "--num-drafts", lambda n: n >= 1, "integers >= 1")
        deltas = parse_list(args.deltas, float, "--deltas", lambda d: 0 <= d <= 1, "numbers in [0, 1]")
        for prompt in prompts:
            check_prompt(prompt)
        if args.plot:  # fail before loading anything
            check_plot_path(args.plot)
        models = Models(args.model, args.draft_model)
        sweep(models, prompts, settings, num_drafts, deltas, args.plot, repeats=args.repeats)
        return 0
    check_prompt(args.prompt)
    models = Models(args.model, args.draft_model if needs_draft else None)
    if args.interactive:
        interactive(models, settings, examples=examples, first_prompt=args.prompt if prompt_given else None)
    elif args.compare:
        compare(models, args.prompt, settings)
    elif args.json:
        tokens, stats = models.run(args.prompt, settings)
        print(json.dumps({"text": models.tokenizer.decode(tokens), "tokens": tokens, "stats": stats.to_dict()}))
    else:
        if args.demo and not prompt_given:
            print(f"Prompt (held-out code, masked spans):\n{args.prompt}\n\nOutput:", flush=True)
        text, _ = show_generation(models, args.prompt, settings)
        show_filled(args.prompt, text)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, NotAConvertedModel) as e:  # a damaged model folder is the user's to fix too
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    if blas.ACTIVE.startswith("bundled"):  # Linux without a fast BLAS: 4-5x slower matrix products
        print(f"warning: MLX's CPU backend runs on its {blas.ACTIVE}; see README, Linux", file=sys.stderr)
    sys.exit(main())
