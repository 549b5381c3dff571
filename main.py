"""Run T5 in MLX: regular or speculative (draft-and-verify) decoding.

    python main.py                                   # t5-11b verifies what t5-small drafts
    python main.py --num-draft 4 --delta 0.2 --prompt "summarize: ..."
    python main.py --compare                         # regular vs speculative, same prompt
    python main.py --interactive                     # load once, tune knobs at a prompt
    python main.py --sweep --num-drafts 1,2,4,auto --deltas 0,0.1,0.3 --plot sweep.png
    python main.py --num-draft auto                  # drafts per round adapt to the draft's confidence
    python main.py --prompt-lookup --prompt "..."    # drafts copied from the prompt: no draft model
    python main.py --prompts-file prompts.txt --json # every line's output, 8 prompts decoded together
    python main.py --demo                            # the small trained pair in demo/ (demo/train.py), no download
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

from decoder import AUTO, KNOBS, Settings
from generate import BATCH_SIZE, stream_batch_generate, stream_generate, warm_up
from interactive import Session, announce_encoding, compare, show_batch, show_filled, show_generation, show_speedup
from loading import ModelNotFound, T5Error, load
from sweep import check_plot_path, parse_list, sweep

DEFAULT_PROMPT = (
    "translate English to French: Let's go to the store and buy some groceries "
    "including eggs, avocadoes, and bread."
)
# The library's default delta is 0 (exact); at a prompt a little lenience buys speed.
DEFAULTS = {name: getattr(Settings(), name) for name in KNOBS} | {"delta": 0.1}
# A small target/draft pair trained on the Python standard library (demo/train.py),
# with held-out source code whose masked spans they fill in. Its own best
# num-draft is 3 (docs/DEMO.md), and --demo opens with held-out prompt 20,
# whose acceptance there is the median of the 20 prompts'.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_DEFAULTS = DEFAULTS | {"num_draft": 3}
DEMO_PROMPT = 20


class UsageError(T5Error):
    """Bad input from the user; printed as one line."""


def prompt_lines(path: Path) -> list[str]:
    """The non-blank lines of a prompts file, stripped; UsageError names a line that is not UTF-8."""
    lines = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8").strip())
        except UnicodeDecodeError:
            raise UsageError(f"{path}, line {number}: not valid UTF-8 text")
    return [line for line in lines if line]


def demo_prompts() -> list[str]:
    path = DEMO_DIR / "prompts.txt"
    try:
        return prompt_lines(path)
    except OSError:
        raise UsageError(f"{path} is missing: restore demo/ with git checkout demo, or rebuild it with python demo/train.py (about 50 minutes on 2 cores)")


def read_prompts(path: str) -> list[str]:
    try:
        prompts = prompt_lines(Path(path))
    except OSError as e:
        raise UsageError(f"cannot read --prompts-file: {e.strerror}")
    if not prompts:
        raise UsageError(f"{path} has no prompts")
    return prompts


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for flags and options whose help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# Options that only --sweep reads, with their defaults (argparse's default is
# None, so that one given without --sweep is noticed).
SWEEP_OPTIONS = {"num_drafts": "1,2,4,8,auto", "deltas": "0,0.1,0.3", "plot": None, "repeats": 1}
LOOKUP_NUM_DRAFTS = "1,2,4,8"  # the sweep's default with --prompt-lookup, which auto cannot follow
# Prompts decoded together from a prompts file; a sweep times one prompt at a time unless told.
BATCH_SIZE_DEFAULT, SWEEP_BATCH_SIZE_DEFAULT = 8, 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", help="target model: converted folder, a name under mlx_models/, or the hub id it was "
                   "converted from (default: t5-11b; demo/target with --demo)")
    p.add_argument("--draft-model", help="draft model for speculative decoding (default: t5-small; demo/draft with --demo)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="draft by copying from the prompt and the text so far, with no draft model: for outputs that "
                        "repeat their input (summaries, edits, code); --num-draft caps a draft")
    p.add_argument("--prompt", help="input text (default: a translation prompt; with --demo, held-out code with masked spans)")
    p.add_argument("--demo", action="store_true",
                   help="use the small trained pair in demo/ (built by demo/train.py; no download): it fills in masked spans of Python code")
    for name, knob in KNOBS.items():  # default None: --demo has defaults of its own
        default = "" if DEFAULTS[name] is None else f" (default: {DEFAULTS[name]}"
        default += "" if DEFAULTS[name] == DEMO_DEFAULTS[name] else f"; {DEMO_DEFAULTS[name]} with --demo"
        p.add_argument(f"--{knob.flag}", type=str if knob.words else knob.type, help=knob.help + default + ")" * bool(default))
    p.add_argument("--regular-decode", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming; "
                   "with --prompts-file, one per prompt and line (JSON Lines)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--compare", action="store_true", help="run regular and speculative decoding and print the speedup")
    modes.add_argument("--interactive", action="store_true", help="load the models once, then a prompt loop (:help for commands); --prompt, if given, runs first")
    modes.add_argument("--sweep", action="store_true", help="speculative decoding over --num-drafts x --deltas")
    p.add_argument("--num-drafts", help=f"sweep: num-draft values (default: {SWEEP_OPTIONS['num_drafts']}; "
                   f"{LOOKUP_NUM_DRAFTS} with --prompt-lookup)")
    p.add_argument("--deltas", help=f"sweep: delta values (default: {SWEEP_OPTIONS['deltas']})")
    p.add_argument("--prompts-file", help="prompts, one a line: generate for each, in order (with --json, one JSON object a line), "
                   "or sweep over them (the sweep's default: --prompt; with --demo, demo/prompts.txt)")
    p.add_argument("--batch-size", type=int, help=f"prompts decoded together, with --prompts-file or --sweep "
                   f"(default: {BATCH_SIZE_DEFAULT}; {SWEEP_BATCH_SIZE_DEFAULT} in a sweep)")
    p.add_argument("--plot", help="sweep: save speedup against num-draft to this image, .png, .svg or .pdf (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="sweep: run the grid this many times and report medians (default: 1)")
    return p


def check_usage(args) -> Settings:
    """Every check that needs no model, so that bad input fails at once; the settings."""
    defaults = DEMO_DEFAULTS if args.demo else DEFAULTS
    values = {name: defaults[name] if getattr(args, name) is None else getattr(args, name) for name in KNOBS}
    values = {name: KNOBS[name].parse(value, f"--{KNOBS[name].flag}") if isinstance(value, str) else value
              for name, value in values.items()}
    if args.regular_decode and (args.compare or args.sweep):
        raise UsageError("--compare and --sweep run regular decoding themselves: drop --regular-decode")
    if args.regular_decode and (args.prompt_lookup or values["num_draft"] == AUTO):
        raise UsageError(f"{'--prompt-lookup' if args.prompt_lookup else '--num-draft auto'} is for speculative decoding: "
                         "drop --regular-decode")
    if args.prompt_lookup and args.draft_model_given:
        raise UsageError("--prompt-lookup drafts without a draft model: drop --draft-model (or --prompt-lookup)")
    if args.prompt_lookup and values["num_draft"] == AUTO:
        raise UsageError("--num-draft auto follows a draft model's confidence: with --prompt-lookup give a number, "
                         "the longest draft")
    settings = Settings(**{name: knob.check(values[name], f"--{knob.flag}") for name, knob in KNOBS.items()},
                        speculative=not args.regular_decode, prompt_lookup=args.prompt_lookup)
    if not args.regular_decode and not args.draft_model and not args.prompt_lookup:
        raise UsageError("speculative decoding needs --draft-model (or pass --regular-decode)")
    if args.json and (args.interactive or args.compare or args.sweep):
        raise UsageError("--json goes with a one-shot run, not --interactive, --compare or --sweep")
    for name, default in SWEEP_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, LOOKUP_NUM_DRAFTS if name == "num_drafts" and args.prompt_lookup else default)
        elif not args.sweep:
            raise UsageError(f"--{name.replace('_', '-')} goes with --sweep")
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if args.prompts_file and (args.interactive or args.compare):
        raise UsageError("--prompts-file goes with a one-shot run or --sweep, not --interactive or --compare")
    if args.batch_size is not None:
        if not args.prompts_file and not args.sweep:
            raise UsageError("--batch-size goes with --prompts-file (or --sweep)")
        BATCH_SIZE.check(args.batch_size, "--batch-size")
    else:
        args.batch_size = SWEEP_BATCH_SIZE_DEFAULT if args.sweep else BATCH_SIZE_DEFAULT
    if args.prompts_file and args.prompt_given:
        raise UsageError("give --prompt or --prompts-file, not both")
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    return settings


def load_models(args, speculative: bool, one_row: bool = False):
    try:
        return load(args.model, draft=args.draft_model if speculative and not args.prompt_lookup else None, verbose=True,
                    one_row=one_row)
    except ModelNotFound as e:
        if e.role == "draft":
            raise UsageError(f"{e} (or pass --regular-decode to run the target alone)")
        raise


def run(args) -> int:
    prompt_given = args.prompt_given = args.prompt is not None
    examples = demo_prompts() if args.demo else None
    if args.model is None:
        args.model = str(DEMO_DIR / "target") if args.demo else "t5-11b"
    args.draft_model_given = args.draft_model is not None
    if args.draft_model is None and not args.prompt_lookup:
        args.draft_model = str(DEMO_DIR / "draft") if args.demo else "t5-small"
    if args.prompt is None:
        args.prompt = examples[DEMO_PROMPT - 1] if args.demo else DEFAULT_PROMPT
    settings = check_usage(args)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else None  # bad files fail before loading

    if args.sweep:
        prompts = prompts or (examples if examples and not prompt_given else [args.prompt])
        num_drafts = parse_list(args.num_drafts, "num_draft", "--num-drafts")
        if args.prompt_lookup and AUTO in num_drafts:
            raise UsageError("--num-drafts: auto follows a draft model's confidence, not --prompt-lookup's drafts")
        deltas = parse_list(args.deltas, "delta", "--deltas")
        if args.plot:  # fail before loading anything
            check_plot_path(args.plot)
        sweep(load_models(args, True), prompts, settings, num_drafts, deltas, args.plot, repeats=args.repeats,
              batch_size=args.batch_size)
        return 0
    # Regular decoding of one prompt at a time: each of the target's steps takes one row.
    one_row = not settings.speculative and (not prompts or len(prompts) == 1 or args.batch_size == 1)
    models = load_models(args, settings.speculative, one_row)
    if prompts:
        generations = stream_batch_generate(models, prompts, batch_size=args.batch_size, **vars(settings))
        if args.json:
            for generation in generations:
                print(json.dumps({"text": generation.text, "tokens": generation.tokens, "stats": generation.stats.to_dict()}),
                      flush=True)
        else:
            show_batch(generations, len(prompts), settings.drafts(models))
    elif args.interactive:
        Session(models, settings, examples).run(first_prompt=args.prompt if prompt_given else None)
    elif args.compare:
        compare(models, args.prompt, settings)
    elif args.json:
        announce_encoding(models, args.prompt, settings)
        responses = list(stream_generate(models, args.prompt, **vars(settings)))
        tokens = [response.token for response in responses if response.token is not None]
        text = "".join(response.text for response in responses)
        print(json.dumps({"text": text, "tokens": tokens, "stats": responses[-1].stats.to_dict()}))
    else:
        if args.demo:  # a first impression: the timings are warm, and the speedup is measured
            warm_up(models, args.prompt, settings)
            if not prompt_given:
                print(f"Held-out prompt {DEMO_PROMPT} of {len(examples)} (Python code, a span masked by <extra_id_0>):\n"
                      f"{args.prompt}\n\nOutput:", flush=True)
        text, stats = show_generation(models, args.prompt, settings)
        if args.demo and settings.speculative:
            show_speedup(models, args.prompt, settings, stats)
        show_filled(args.prompt, text)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except T5Error as e:  # bad options, and model folders the user has to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a generation stopped shows its statistics so far (show_generation)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"  # one line, no source
    sys.exit(main())
