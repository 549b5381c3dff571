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
    python main.py --model whisper-small --audio talk.mp3 --json  # speech to text with a converted Whisper
"""

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from errors import ModelNotFound, T5Error, UsageError
from generate import batch_generate, stream_batch_generate
from display import announce_encoding, compare, show_batch, show_filled, show_generation, show_speedup, warm_up_aloud
from display import show_transcription_speedup, stats_line, why_not_timed
from interactive import Session
import real_whisper
from loading import hears_speech, load
from options import AUTO, BATCH_SIZE, KNOBS, LISTS, Settings
from pipeline import stages_option
from plans import resolve, with_presets
from audio import read as read_audio
from speech import TASKS, Guards, render, stream_transcribe, transcribe, warm_up
from sweep import check_plot_path, parse_list, sweep

DEFAULT_PROMPT = "translate English to French: Let's go to the store and buy some groceries including eggs, avocadoes, and bread."
# The library's default delta is 0 (exact); at a prompt a little lenience buys speed.
DEFAULTS = {name: getattr(Settings(), name) for name in KNOBS} | {"delta": 0.1}
# A small target/draft pair trained on the Python standard library (demo/train.py), with held-out source code whose
# masked spans they fill in. Its own best num-draft is 3 (docs/DEMO.md), and --demo opens with held-out prompt 20,
# whose acceptance there is the median of the 20 prompts'.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_DEFAULTS = DEFAULTS | {"num_draft": 3}
DEMO_PROMPT = 20
# The speech demo: Whisper tiny.en from its wheel (real_whisper.demo_target) and a one-layer draft trained on its
# transcripts (demo/train_speech.py), on held-out clips; exact acceptance: it prints the target's own transcription.
SPEECH_DIR = DEMO_DIR / "speech"
SPEECH_DEFAULTS = DEFAULTS | {"num_draft": 1, "delta": 0.0}  # its best measured (docs/DEMO.md)
SPEECH_CLIP = "held-out-2.wav"  # of the four, the one tiny.en hears word for word


def file_lines(path: Path) -> list[str]:
    """Every line of a prompts file, stripped (a blank one ""); UsageError names a line that is not UTF-8."""
    lines = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8").strip())
        except UnicodeDecodeError:
            raise UsageError(f"{path}, line {number}: not valid UTF-8 text")
    return lines


def demo_prompts() -> list[str]:
    path = DEMO_DIR / "prompts.txt"
    try:
        return [line for line in file_lines(path) if line]
    except OSError:
        raise UsageError(f"{path} is missing: restore demo/ with git checkout demo, or rebuild it with "
                         "python demo/train.py (about 50 minutes on 2 cores)")


def read_prompts(path: str) -> list[str]:
    """--prompts-file's lines, blank ones "" (a prompt is a line that is not)."""
    try:
        lines = file_lines(Path(path))
    except OSError as e:
        raise UsageError(f"cannot read --prompts-file: {e.strerror}")
    if not any(lines):
        raise UsageError(f"{path} has no prompts")
    return lines


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
                   help="use the small trained pair in demo/ (built by demo/train.py; no download): "
                        "it fills in masked spans of Python code")
    for name, knob in KNOBS.items():  # default None: --demo has defaults of its own
        default = "" if DEFAULTS[name] is None else f" (default: {DEFAULTS[name]}"
        default += "" if DEFAULTS[name] == DEMO_DEFAULTS[name] else f"; {DEMO_DEFAULTS[name]} with --demo"
        p.add_argument(f"--{knob.flag}", type=str if knob.words else knob.type, help=knob.help + default + ")" * bool(default))
    for name, option in LISTS.items():
        p.add_argument(f"--{option.flag}", metavar=option.metavar, help=option.help)
    p.add_argument("--src-lang", help="a multilingual model's code for the prompt's language (NLLB's eng_Latn, mBART-50's "
                   "en_XX, M2M-100's __en__): an unknown one lists the model's")
    p.add_argument("--tgt-lang", help="and for the output's language: its first token (mBART's: the decoder's start)")
    p.add_argument("--task", help="a task the model's config names (t5's: summarization, translation_en_to_de, ...): its "
                   "prompt prefix, and its options (beams, lengths, no-repeat n-grams) under those given here")
    p.add_argument("--audio", nargs="*", metavar="FILE",
                   help="transcribe these audio files (WAV, mp3, m4a, flac, ogg, webm; of any length: the model's windows, "
                        "30 s in every public Whisper) "
                        "with a converted Whisper --model, drafted by --draft-model if given; --task transcribe or "
                        "translate; with --demo, Whisper tiny.en and the draft in demo/speech, by default on a held-out clip")
    p.add_argument("--language", help="--audio: the language spoken (en, fr, ...; default: detected from the audio)")
    p.add_argument("--timestamps", action="store_true", help="--audio: segments with their start and end")
    p.add_argument("--word-timestamps", action="store_true",
                   help="--audio: each word's start and end too (the model's alignment heads; in --json, OpenAI's words)")
    p.add_argument("--output-format", choices=("txt", "srt", "vtt", "json"),
                   help="--audio: print (or write, with --output-dir) each file's transcription in this format "
                        "(srt and vtt with timestamps; json: OpenAI's verbose_json)")
    p.add_argument("--output-dir", help="--audio: write each file's transcription beside the others here, "
                   "named after the file (talk.mp3 -> talk.srt)")
    p.add_argument("--initial-prompt", metavar="TEXT", help="--audio: text every window follows, as if said before "
                   "(names, spellings, a style)")
    p.add_argument("--condition-on-previous-text", action="store_true",
                   help="--audio: each window follows the text decoded before it (steadier style; a mistake can repeat)")
    guards = p.add_argument_group("--audio: openai-whisper's guards (none by default, as in transformers)")
    guards.add_argument("--no-speech-threshold", type=float, metavar="P",
                        help="skip a window whose <|nospeech|> probability is over P (and, with --logprob-threshold, "
                             "whose average log-probability is under it)")
    guards.add_argument("--logprob-threshold", type=float, metavar="L",
                        help="decode a window again, hotter, when its average log-probability is under L")
    guards.add_argument("--compression-ratio-threshold", type=float, metavar="R",
                        help="decode a window again, hotter, when its tokens compress by more than R (repetition)")
    guards.add_argument("--temperature-increment-on-fallback", type=float, metavar="STEP",
                        help="the temperatures a window is decoded at again: from --temp up to 1 by STEP")
    p.add_argument("--regular-decode", action="store_true", help="decode with the target alone")
    p.add_argument("--stages", type=stages_option, help="split the target over this many machines (run under "
                   "mlx.launch, one rank each), or stages of these encoder:decoder layers (14:6,10:18): docs/SERVING.md")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the text before this string (repeat the option for several)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming; "
                   "with --prompts-file, one per prompt and line (JSON Lines)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--compare", action="store_true", help="run regular and speculative decoding and print the speedup")
    modes.add_argument("--interactive", action="store_true",
                       help="load the models once, then a prompt loop (:help for commands); --prompt, if given, runs first")
    modes.add_argument("--sweep", action="store_true", help="speculative decoding over --num-drafts x --deltas")
    p.add_argument("--num-drafts", help=f"sweep: num-draft values (default: {SWEEP_OPTIONS['num_drafts']}; "
                   f"{LOOKUP_NUM_DRAFTS} with --prompt-lookup)")
    p.add_argument("--deltas", help=f"sweep: delta values (default: {SWEEP_OPTIONS['deltas']})")
    p.add_argument("--prompts-file", help="prompts, one a line: generate for each, in order "
                   "(with --json, one JSON object a line), "
                   "or sweep over them (the sweep's default: --prompt; with --demo, demo/prompts.txt)")
    p.add_argument("--batch-size", type=int, help=f"prompts decoded together, with --prompts-file or --sweep "
                   f"(default: {BATCH_SIZE_DEFAULT}; {SWEEP_BATCH_SIZE_DEFAULT} in a sweep)")
    p.add_argument("--plot", help="sweep: save speedup against num-draft to this image, .png, .svg or .pdf (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="sweep: run the grid this many times and report medians (default: 1)")
    return p


@dataclass(frozen=True)
class Plan:
    """What a command line asks for, checked before anything loads."""

    settings: Settings
    mode: str  # "one-shot", "interactive", "compare" or "sweep"
    model: str
    draft_model: str | None  # None: no draft model is loaded
    prompt: str
    prompt_given: bool
    prompts: list[str] | None = None  # --prompts-file's, or a sweep's
    lines: list[str] | None = None  # --prompts-file's lines, blank ones too: --json answers each
    examples: list[str] | None = None  # --demo's held-out prompts
    batch_size: int = BATCH_SIZE_DEFAULT
    json: bool = False
    demo: bool = False
    num_drafts: list | None = None  # the sweep's grid
    deltas: list | None = None
    plot: str | None = None
    repeats: int = 1
    task: str | None = None
    given: frozenset = frozenset()  # the knobs given as flags, which a task's options do not override
    stages: int | list | None = None  # the target split over this many ranks of mlx.launch (pipeline.py)


def knob_settings(args, defaults: dict) -> Settings:
    """The knobs' flags, or their defaults, as Settings; an error names the flag."""
    values = {name: defaults[name] if getattr(args, name) is None else getattr(args, name) for name in KNOBS}
    values = {name: KNOBS[name].parse(value, f"--{KNOBS[name].flag}") if isinstance(value, str) else value
              for name, value in values.items()}
    if args.regular_decode and (args.prompt_lookup or values["num_draft"] == AUTO):
        raise UsageError(f"{'--prompt-lookup' if args.prompt_lookup else '--num-draft auto'} is for speculative decoding: "
                         "drop --regular-decode")
    if args.prompt_lookup and args.draft_model is not None:
        raise UsageError("--prompt-lookup drafts without a draft model: drop --draft-model (or --prompt-lookup)")
    if args.prompt_lookup and values["num_draft"] == AUTO:
        raise UsageError("--num-draft auto follows a draft model's confidence: with --prompt-lookup give a number, "
                         "the longest draft")
    if args.stop is not None and not all(args.stop):
        raise UsageError("--stop takes a non-empty string")
    lists = {name: option.parse(getattr(args, name), f"--{option.flag}") for name, option in LISTS.items()
             if getattr(args, name) is not None}
    return Settings(**{name: knob.check(values[name], f"--{knob.flag}") for name, knob in KNOBS.items()}, **lists,
                    speculative=not args.regular_decode, prompt_lookup=args.prompt_lookup, stop=tuple(args.stop or ()),
                    src_lang=args.src_lang, tgt_lang=args.tgt_lang)


def sweep_grid(args) -> dict:
    """The sweep's options, checked (with --sweep), or a refusal of any given without it."""
    given = {name: getattr(args, name) for name in SWEEP_OPTIONS if getattr(args, name) is not None}
    if not args.sweep:
        if given:
            raise UsageError(f"--{next(iter(given)).replace('_', '-')} goes with --sweep")
        return {}
    options = SWEEP_OPTIONS | {"num_drafts": LOOKUP_NUM_DRAFTS if args.prompt_lookup else SWEEP_OPTIONS["num_drafts"]} | given
    if options["repeats"] < 1:
        raise UsageError("--repeats must be at least 1")
    num_drafts = parse_list(options["num_drafts"], "num_draft", "--num-drafts")
    if args.prompt_lookup and AUTO in num_drafts:
        raise UsageError("--num-drafts: auto follows a draft model's confidence, not --prompt-lookup's drafts")
    deltas = parse_list(options["deltas"], "delta", "--deltas")
    if options["plot"]:  # fail before loading anything
        check_plot_path(options["plot"])
    return {"num_drafts": num_drafts, "deltas": deltas, "plot": options["plot"], "repeats": options["repeats"]}


def check_usage(args) -> Plan:
    """Every check that needs no model, so that bad input fails at once; what to run."""
    if args.regular_decode and (args.compare or args.sweep):
        raise UsageError("--compare and --sweep run regular decoding themselves: drop --regular-decode")
    settings = knob_settings(args, DEMO_DEFAULTS if args.demo else DEFAULTS)
    draft_model = args.draft_model
    if draft_model is None and not args.prompt_lookup:
        draft_model = str(DEMO_DIR / "draft") if args.demo else "t5-small"
    if settings.speculative and not draft_model and not args.prompt_lookup:
        raise UsageError("speculative decoding needs --draft-model (or pass --regular-decode)")
    mode = "interactive" if args.interactive else "compare" if args.compare else "sweep" if args.sweep else "one-shot"
    if mode in ("compare", "sweep") and why_not_timed(settings, mode, "--"):
        raise UsageError(why_not_timed(settings, mode, "--"))
    if args.json and mode != "one-shot":
        raise UsageError("--json goes with a one-shot run, not --interactive, --compare or --sweep")
    if args.prompts_file and mode in ("interactive", "compare"):
        raise UsageError("--prompts-file goes with a one-shot run or --sweep, not --interactive or --compare")
    if args.batch_size is not None:
        if not args.prompts_file and not args.sweep:
            raise UsageError("--batch-size goes with --prompts-file (or --sweep)")
        BATCH_SIZE.check(args.batch_size, "--batch-size")
    if args.prompts_file and args.prompt is not None:
        raise UsageError("give --prompt or --prompts-file, not both")
    examples = demo_prompts() if args.demo else None
    prompt = args.prompt if args.prompt is not None else examples[DEMO_PROMPT - 1] if args.demo else DEFAULT_PROMPT
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    grid = sweep_grid(args)
    lines = read_prompts(args.prompts_file) if args.prompts_file else None  # bad files fail before loading
    prompts = [line for line in lines if line] if lines else None
    if args.sweep and not prompts:
        prompts = examples if examples and args.prompt is None else [prompt]
    batch_size = args.batch_size or (SWEEP_BATCH_SIZE_DEFAULT if args.sweep else BATCH_SIZE_DEFAULT)
    model = args.model if args.model is not None else str(DEMO_DIR / "target") if args.demo else "t5-11b"
    if args.task is not None and mode in ("compare", "sweep"):
        raise UsageError(f"--task sets decoding options itself: --{mode} measures speculative decoding at yours")
    given = frozenset(name for name in KNOBS if getattr(args, name) is not None)
    return Plan(settings, mode, model, None if args.prompt_lookup else draft_model, prompt, args.prompt is not None,
                prompts, lines, examples, batch_size, args.json, args.demo, **grid, task=args.task, given=given,
                stages=args.stages)


def load_models(plan: Plan, one_row: bool = False):
    if hears_speech(plan.model):
        raise UsageError(f"{plan.model} is a speech model (Whisper): it transcribes audio, not a prompt: "
                         f"python main.py --model {plan.model} --audio FILE")
    drafts = (plan.settings.speculative and plan.settings.num_beams == 1) or plan.mode == "sweep"  # (beams: no draft)
    try:
        return load(plan.model, draft=plan.draft_model if drafts else None, verbose=True, one_row=one_row, stages=plan.stages)
    except ModelNotFound as e:
        if e.role == "draft":
            raise UsageError(f"{e} (or pass --regular-decode to run the target alone)")
        raise


def run(plan: Plan) -> int:
    settings = plan.settings
    # Regular decoding of one prompt at a time: each of the target's steps takes one row.
    one_row = plan.mode != "sweep" and not settings.speculative and settings.num_beams == 1 and settings.n == 1 and \
        plan.task is None and (not plan.prompts or len(plan.prompts) == 1 or plan.batch_size == 1)
    models = load_models(plan, one_row)
    plan = with_model_presets(models, plan)
    settings = plan.settings
    resolve(settings, models)  # what the models refuse (a language, a length) fails before anything is shown
    if plan.mode == "sweep":
        sweep(models, plan.prompts, settings, plan.num_drafts, plan.deltas, plan.plot, repeats=plan.repeats,
              batch_size=plan.batch_size)
        return 0
    if plan.mode == "one-shot":  # warm timings (the loop and --compare warm up themselves)
        warm_up_aloud(models, plan.prompts[0] if plan.prompts else plan.prompt, settings)
    if plan.prompts or (settings.n > 1 and plan.mode == "one-shot"):  # n outputs of one prompt: a batch of them
        prompts = plan.prompts or [plan.prompt]
        batch_size = plan.batch_size if plan.prompts else settings.n
        generations = stream_batch_generate(models, prompts, batch_size=batch_size, settings=settings)
        if plan.json:
            for record in json_records(generations, plan.lines, settings.n):
                print(json.dumps(record), flush=True)
        else:
            show_batch(generations, len(prompts), settings.drafts(models), models.tokenizer, per_prompt=settings.n)
    elif plan.mode == "interactive":
        Session(models, settings, plan.examples).run(first_prompt=plan.prompt if plan.prompt_given else None)
    elif plan.mode == "compare":
        compare(models, plan.prompt, settings)
    elif plan.json:
        announce_encoding(models, plan.prompt, settings)
        print(json.dumps(json_record(batch_generate(models, [plan.prompt], batch_size=1, settings=settings)[0])))
    else:
        show_one(models, plan)
    return 0


def with_model_presets(models, plan: Plan) -> Plan:
    """The plan with the model's generation defaults and --task's options
    under the flags given (plans.with_presets), and the task's prefix on its
    prompts; a line on stderr where a default gives way to what the flags ask."""
    prefix, settings, notes = with_presets(models, plan.settings, plan.given, plan.task)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    prompts = [prefix + prompt for prompt in plan.prompts] if plan.prompts else None
    return replace(plan, settings=settings, prompt=prefix + plan.prompt, prompts=prompts)


def json_record(generation) -> dict:
    """A generation as --json prints it: text, tokens and statistics; logprobs and beams when asked for."""
    record = {"text": generation.text, "tokens": generation.tokens, "stats": generation.stats.to_dict()}
    if generation.logprobs is not None:
        record["logprobs"] = [{"logprob": lp, "top": [[t, v] for t, v in top]} for lp, top in generation.logprobs]
    if generation.beams is not None:
        record["beams"] = [{"text": text, "score": score, "tokens": tokens}
                           for (text, score), tokens in zip(generation.beams, generation.beam_tokens)]
    return record


def json_records(generations, lines: list[str] | None, n: int):
    """--json's records of a batch: with --prompts-file, one a line of the
    file (n a prompt), each with its line's number and prompt, so that a
    pipeline can match answers to inputs; a blank line's says it was skipped."""
    if lines is None:  # n outputs of one prompt
        yield from map(json_record, generations)
        return
    for number, line in enumerate(lines, 1):
        if not line:
            yield {"line": number, "prompt": "", "skipped": "blank line"}
        for _ in range(n if line else 0):
            yield {"line": number, "prompt": line} | json_record(next(generations))


def show_one(models, plan: Plan) -> None:
    """A one-shot run at a terminal (warm: run has warmed up); with --demo, a
    first impression: the held-out prompt shown, and the speedup measured."""
    if plan.demo:
        if not plan.prompt_given:
            print(f"Held-out prompt {DEMO_PROMPT} of {len(plan.examples)} (Python code, a span masked by <extra_id_0>):\n"
                  f"{plan.prompt}\n\nOutput:", flush=True)
    text, stats = show_generation(models, plan.prompt, plan.settings)
    if plan.demo and plan.settings.drafts(models):
        show_speedup(models, plan.prompt, plan.settings, stats)
    show_filled(plan.prompt, text)


def listen(args) -> int:
    """--audio: each file's transcription (one JSON object a file, in OpenAI's verbose_json shape, with --json)."""
    if args.demo:
        return listen_demo(args)
    if not args.audio:
        raise UsageError("--audio needs one or more files (or --demo, for the speech demo pair's held-out clip)")
    if args.model is None:
        raise UsageError("--audio needs --model: a converted Whisper (python convert.py --model openai/whisper-small)")
    if args.task is not None and args.task not in TASKS:
        raise UsageError(f"--task with --audio is transcribe or translate, not {args.task!r}")
    if args.compare or args.interactive or args.sweep:
        raise UsageError("--compare, --interactive and --sweep take text prompts, not --audio: to compare, run the "
                         "files with and without --regular-decode")
    if not hears_speech(args.model):
        raise UsageError(f"{args.model} is a text model: --audio needs a converted Whisper (python convert.py --model "
                         "openai/whisper-small); give this one text with --prompt")
    if args.json and (args.output_format or args.output_dir):
        raise UsageError("--json prints verbose_json: drop it to choose --output-format or --output-dir")
    if args.output_dir is not None and not Path(args.output_dir).is_dir():
        raise UsageError(f"--output-dir {args.output_dir} is not a folder")
    stems = [Path(file).stem for file in args.audio]
    if args.output_dir is not None and len(set(stems)) < len(stems):
        twice = next(stem for stem in stems if stems.count(stem) > 1)
        raise UsageError(f"two files named {twice} would write one output in --output-dir: rename one")
    settings = knob_settings(args, DEFAULTS)  # (beam search drafts nothing: no draft is loaded for it)
    settings = replace(settings, speculative=args.draft_model is not None and not args.regular_decode
                       and settings.num_beams == 1)
    given = {name for name in KNOBS if getattr(args, name) is not None}
    samples = [read_audio(file) for file in args.audio]  # a file that is not audio fails before loading
    models = load(args.model, draft=args.draft_model if settings.speculative else None, verbose=True, stages=args.stages)
    form = {"txt": "text", "json": "verbose_json"}.get(args.output_format, args.output_format)
    timestamps = args.timestamps or form in ("srt", "vtt")
    options = dict(language=args.language, task=args.task or "transcribe", timestamps=timestamps, settings=settings,
                   given=given, prompt=args.initial_prompt, words=args.word_timestamps,
                   condition=args.condition_on_previous_text,
                   guards=Guards.of(settings.temp, args.temperature_increment_on_fallback,
                                    args.compression_ratio_threshold, args.logprob_threshold, args.no_speech_threshold))
    if len(samples) == 1 and not (args.json or form or args.output_dir):  # at a terminal: each segment as decided
        for segment in stream_transcribe(models, samples[0], **options):
            shown = f"[{segment['start']:6.2f} -> {segment['end']:6.2f}] " if args.timestamps else ""
            print(shown + segment["text"], flush=True)
            for word in segment.get("words", []):
                print(f"    [{word['start']:6.2f} -> {word['end']:6.2f}] {word['word']}")
        return 0
    transcriptions = transcribe(models, samples, **options)
    for file, transcription in zip(args.audio, transcriptions):
        if args.json:
            print(json.dumps({"file": file} | json.loads(render(transcription, "verbose_json"))))
            continue
        if args.output_dir is not None:
            path = Path(args.output_dir) / f"{Path(file).stem}.{args.output_format or 'txt'}"
            path.write_text(render(transcription, form or "text"))
            print(f"{file} -> {path}")
            continue
        if len(args.audio) > 1:
            print(f"{file}:")
        if form is not None:
            rendered = render(transcription, form)
            print(rendered, end="" if rendered.endswith("\n") else "\n")
            continue
        for segment in transcription.segments if args.timestamps else []:
            print(f"[{segment['start']:6.2f} -> {segment['end']:6.2f}] {segment['text']}")
        if not args.timestamps:
            print(transcription.text)
    return 0


def listen_demo(args) -> int:
    """--demo --audio: the speech pair transcribes a held-out clip (SPEECH_CLIP, or the files given) with its draft; the
    sentence spoken, the text heard, the drafts accepted and the speedup over regular decoding."""
    defaults = vars(build_parser().parse_args([]))
    others = sorted(name for name, value in vars(args).items()
                    if value != defaults[name] and name not in {"demo", "audio", "regular_decode", *KNOBS})
    if others:
        flags = ", ".join("--" + name.replace("_", "-") for name in others)
        raise UsageError(f"--demo --audio runs the pair in demo/speech on its clips or your files, with the decoding "
                         f"knobs and --regular-decode only: drop {flags}")
    if not all((SPEECH_DIR / part).exists() for part in ("draft", "clips/clips.json")):
        raise UsageError(f"{SPEECH_DIR} is incomplete: git checkout demo, or rebuild it: python demo/train_speech.py")
    try:
        target = real_whisper.demo_target()
    except real_whisper.Missing as e:
        raise UsageError(f"--demo --audio transcribes with OpenAI's Whisper {real_whisper.DEMO}: {e}")
    settings = replace(chosen := knob_settings(args, SPEECH_DEFAULTS), speculative=not args.regular_decode
                       and chosen.num_beams == 1)
    clips = {clip["file"]: clip for clip in json.loads((SPEECH_DIR / "clips" / "clips.json").read_text())}
    files = args.audio or [str(SPEECH_DIR / "clips" / SPEECH_CLIP)]
    samples = [read_audio(file) for file in files]
    models = load(str(target), draft=str(SPEECH_DIR / "draft") if settings.speculative else None, verbose=True)
    options = dict(settings=settings, given={name for name in KNOBS if getattr(args, name) is not None})
    warm_up(models, settings)
    for file, clip in zip(files, samples):
        said = clips.get(Path(file).name) if Path(file).parent.resolve() == (SPEECH_DIR / "clips").resolve() else None
        print(f"Held-out clip {os.path.relpath(file)} ({said['seconds']:.1f} s; espeak-ng's voice {said['voice']}, "
              f"{said['speed']} words a minute), which says:\n  {said['sentence']}\n\n" if said else "", end="")
        (transcription,) = transcribe(models, [clip], **options)
        print("Heard:\n  " + transcription.text)
        print(stats_line(transcription.stats, settings.speculative, f"{transcription.duration:.1f} s of audio"))
        if settings.speculative:
            show_transcription_speedup(models, clip, options)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return listen(args) if args.audio is not None else run(check_usage(args))
    except T5Error as e:  # bad options, and model folders the user has to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a generation stopped shows its statistics so far (show_generation)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"  # one line, no source
    sys.exit(main())
