"""The interactive loop (`main.py --interactive`), and how a generation is shown at a terminal.

Models load once; prompts generate with the current settings, and commands
change them: one `:name value` per knob of options.KNOBS, plus the mode,
:compare, :show, :demo N (with --demo) and :quit.
"""

import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import kernels
from errors import OptionError, T5Error
from generate import encoding_seconds, measure, stream_batch_generate, stream_generate, warm_up
from loading import Models
from options import KNOBS, LISTS, Settings, Stats, task_preset, with_task
from text import plural

SENTINEL = re.compile(r"<extra_id_(\d+)>")


# ---------------------------------------------------------------- showing a generation


def stats_line(stats: Stats, speculative: bool) -> str:
    line = (f"{plural(stats.generated, 'token')} in {stats.decoding_seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), "
            f"prompt {plural(stats.prompt_tokens, 'token')} encoded in {stats.encoding_seconds:.2f} s")
    if stats.compiling_seconds >= 0.005:
        line += f", MLX compiling kernels {stats.compiling_seconds:.2f} s (once on this machine)"
    if speculative:
        return (
            f"Accepted {stats.accepted} / {plural(stats.drafted, 'draft')} ({stats.acceptance_rate:.0%}; "
            f"{stats.drafts_per_round:.1f} a round), "
            f"{plural(stats.target_calls, 'decode step')} ({stats.tokens_per_target_call:.2f} tokens each), " + line
        )
    return f"{plural(stats.target_calls, 'decode step')}, " + line


def warm_up_aloud(models: Models, prompt: str, settings: Settings, out=None) -> None:
    """generate.warm_up before anything is timed, said (on stderr, or `out`)
    when it took a while (MLX compiling its kernels for these settings, once
    on this machine, tracing the steps' graphs), which no timing then counts."""
    compiled, compiling, started = kernels.compiled_kernels(), kernels.compiling_seconds(), time.perf_counter()
    warm_up(models, prompt, settings)
    seconds = time.perf_counter() - started
    if kernels.compiled_kernels() > compiled:
        print(f"Warmed up in {seconds:.1f} s, {kernels.compiling_seconds() - compiling:.1f} s of them MLX compiling "
              f"{plural(kernels.compiled_kernels() - compiled, 'kernel')} for these settings (once on this machine)",
              file=out or sys.stderr, flush=True)
    elif seconds > 2:
        print(f"Warmed up in {seconds:.1f} s", file=out or sys.stderr, flush=True)


def announce_encoding(models: Models, prompt: str, settings: Settings) -> None:
    """Say on stderr, before it starts, that a prompt will take a while to encode."""
    tokens = len(models.tokenizer.encode(prompt))
    seconds = encoding_seconds(models, tokens, settings)
    if seconds > 3:
        print(f"Encoding a {tokens:,}-token prompt: about {seconds:.0f} s ...", file=sys.stderr, flush=True)


def show_generation(models: Models, prompt: str, settings: Settings, out=None) -> tuple[str, Stats]:
    """Stream the text as it comes, then the statistics line. A prompt that
    will take a while to encode is announced on stderr first. Ctrl-C stops
    the generation with the statistics so far, and is raised again."""
    out = out or sys.stdout
    announce_encoding(models, prompt, settings)
    pieces, stats, logprobs, last = [], None, [], None
    try:
        for response in stream_generate(models, prompt, settings=settings):
            out.write(response.text)
            out.flush()
            pieces.append(response.text)
            stats, last = response.stats, response
            if response.logprob is not None:
                logprobs.append((response.token, response.logprob))
    except KeyboardInterrupt:
        print(file=out)
        if stats is not None:
            print(stats_line(stats, settings.drafts(models)) + " [stopped]", file=out, flush=True)
        raise
    print(file=out)
    show_asked(models.tokenizer, last.beams, logprobs, out)
    print(stats_line(stats, settings.drafts(models)), file=out)
    return "".join(pieces), stats


def show_asked(tokenizer, beams: list | None, logprobs: list, out=None) -> None:
    """What a generation gives beside its text when asked: the beams after the
    best, and each token's (token, logprob) as a table."""
    for number, (text, score) in enumerate((beams or [])[1:], 2):
        print(f"beam {number} (score {score:.3f}): {text}", file=out)
    if logprobs:
        print(logprob_table(tokenizer, logprobs), file=out)


def logprob_table(tokenizer, logprobs: list) -> str:
    """Each output token's log-probability, and the most likely tokens', a line each."""
    def shown(token: int) -> str:
        return repr(tokenizer.decode([token]))

    lines = ["token            logprob   most likely"]
    for token, (logprob, top) in logprobs:
        lines.append(f"{shown(token):<16} {logprob:8.3f}   " + "  ".join(f"{shown(t)} {v:.3f}" for t, v in top))
    return "\n".join(lines)


def show_batch(generations, count: int, speculative: bool, tokenizer, out=None, per_prompt: int = 1) -> Stats:
    """Each prompt's text (per_prompt of them, n outputs), what it was asked
    for beside (beams, logprobs) and statistics line as it comes (in input
    order), then the whole run's throughput; the summed statistics."""
    started, total, compiling = time.perf_counter(), Stats(), kernels.compiling_seconds()
    for number, generation in enumerate(generations):
        prompt, output = divmod(number, per_prompt)
        which = f"prompt {prompt + 1} of {count}" + (f", output {output + 1} of {per_prompt}" if per_prompt > 1 else "")
        print(f"--- {which}\n{generation.text}", file=out)
        show_asked(tokenizer, generation.beams, list(zip(generation.tokens, generation.logprobs or [])), out)
        print(stats_line(generation.stats, speculative), file=out, flush=True)
        total += generation.stats
    wall = time.perf_counter() - started
    compiling = min(kernels.compiling_seconds() - compiling, wall)  # (another process's compiles count too)
    seconds = wall - compiling
    speed = f"{total.generated / seconds:.1f}" if seconds > 0 else "-"
    print(f"--- {plural(count, 'prompt')}: {plural(total.generated, 'token')} in {seconds:.2f} s ({speed} tokens/s)"
          + (f", MLX compiling kernels {compiling:.2f} s more (once on this machine)" if compiling >= 0.005 else ""),
          file=out)
    return total


def why_not_timed(settings: Settings, mode: str, prefix: str) -> str | None:
    """Why `mode` (compare or sweep: they time one output of speculative decoding) cannot run at these settings, its
    options named with `prefix` (the command line's "--", the loop's ":"); None when it can."""
    if settings.n > 1:
        return f"{prefix}n gives several outputs of a prompt: {prefix}{mode} times one"
    if settings.num_beams > 1:
        return f"{prefix}num-beams searches with the target alone: {prefix}{mode} measures speculative decoding"
    return None


def compare(models: Models, prompt: str, settings: Settings, out=None) -> None:
    """Regular then speculative decoding of one prompt, with times and speedup."""
    warm_up_aloud(models, prompt, settings)
    results = {}
    for speculative in (False, True):
        label = "speculative" if speculative else "regular"
        print(f"--- {label}", file=out)
        _, results[label] = show_generation(models, prompt, replace(settings, speculative=speculative), out)
    regular, spec = results["regular"], results["speculative"]
    speedup = spec.tokens_per_second / regular.tokens_per_second if regular.tokens_per_second else 0.0
    lookup = ", prompt lookup" if settings.prompt_lookup else ""
    print(f"decoding: regular {regular.decoding_seconds:.2f} s, speculative {spec.decoding_seconds:.2f} s, "
          f"speedup {speedup:.2f}x "
          f"(num-draft {settings.num_draft}, delta {settings.delta}{lookup})", file=out)


SPEEDUP_SECONDS = 5.0  # the most show_speedup may take


def show_speedup(models: Models, prompt: str, settings: Settings, answer: Stats, runs: int = 5, out=None) -> float | None:
    """Time both modes on the prompt, alternating, and print the speedup of
    the medians of their decoding speeds: a short generation's single timing
    is too noisy to quote. A run of each mode costs about twice the answer
    (`answer`, its statistics: each run encodes the prompt again), so the
    runs are cut to what fits in SPEEDUP_SECONDS, and none is made when not
    even one of each fits (None). Run it warm (after warm_up)."""
    pair = 2 * (answer.seconds - answer.compiling_seconds)  # the kernels it compiled are there for the runs
    runs = min(runs, int(SPEEDUP_SECONDS // pair)) if pair > 0 else runs
    if runs == 0:
        print(f"(Speedup not measured: a run of each mode would take about {pair:.0f} s, more than the "
              f"{SPEEDUP_SECONDS:.0f} s this line may take; `main.py --compare` runs each once.)", file=out)
        return None
    times = {False: [], True: []}
    for _ in range(runs):
        for speculative in (False, True):
            times[speculative].append(measure(models, prompt, replace(settings, speculative=speculative)).tokens_per_second)
    regular, spec = statistics.median(times[False]), statistics.median(times[True])
    speedup = spec / regular if regular else 0.0
    how = f"medians of {runs} runs each" if runs > 1 else "one run each"
    if runs < 5:
        how += f": a run of each takes about {pair:.1f} s"
    print(f"Speculative decoding ran {speedup:.2f}x as fast as regular decoding on this prompt "
          f"({spec:.0f} against {regular:.0f} tokens/s, {how})", file=out)
    return speedup


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


# ---------------------------------------------------------------- the loop


ALWAYS_SHOWN = ("num_draft", "delta", "temp", "top_k", "top_p", "max_tokens", "seed")


def knob_lines() -> str:
    width = max(len(knob.flag) for knob in KNOBS.values()) + 4
    lines = [f"  :{knob.flag + (' N' if knob.type is int else ' X'):<{width}} {knob.help}"
             + (" (or none)" if knob.optional else "") for knob in KNOBS.values()]
    lines += [f"  :{option.flag + ' ...':<{width}} {option.help}: {option.metavar} (or none)" for option in LISTS.values()]
    lines.append(f"  :{'stop TEXT':<{width}} end the text before TEXT (or none)")
    lines.append(f"  :{'task NAME':<{width}} a task the model's config names: its prefix and options (or none)")
    lines.append(f"  :{'src-lang CODE':<{width}} a multilingual model's prompt language; :tgt-lang CODE, the output's")
    return "\n".join(lines)


@dataclass
class Session:
    """What the loop carries from one line to the next."""

    models: Models
    settings: Settings
    examples: list[str] | None = None  # --demo's held-out prompts, for :demo N
    last_prompt: str | None = None
    prefix: str = ""  # :task's, before every prompt
    before_task: dict = field(default_factory=dict)  # the options :task changed: (as they were, as it set them)
    out: object = field(default=None)

    def say(self, text: str) -> None:
        print(text, file=self.out)

    def help(self) -> str:
        lines = ["Type a prompt to generate. Commands:", knob_lines(),
                 "  :regular / :speculative   decoding mode",
                 "  :lookup                   speculative, drafts copied from the prompt (no draft model)",
                 "  :compare                  regular vs speculative on the last prompt",
                 "  :show                     current settings",
                 "  :help   :quit             (Ctrl-C stops a generation, Ctrl-D exits)"]
        if self.examples:
            lines.append(f"  :demo N                   run held-out demo prompt N (1-{len(self.examples)}): "
                         "code with masked spans")
        return "\n".join(lines)

    def describe(self) -> str:
        if self.settings.num_beams > 1:
            mode = f"beam search, {self.settings.num_beams} beams"
        elif self.settings.drafts(self.models):
            mode = "speculative, prompt lookup" if self.settings.prompt_lookup else "speculative"
        else:
            mode = "regular" + ("" if self.models.draft is not None else " (no draft model)")
        # The drafting and sampling knobs always; the rest (processors, beams, logprobs) once changed.
        default = Settings()
        shown = [f"{knob.flag} {getattr(self.settings, name)}" for name, knob in KNOBS.items()
                 if name in ALWAYS_SHOWN or getattr(self.settings, name) != getattr(default, name)]
        shown += [f"{option.flag} {getattr(self.settings, name)}" for name, option in LISTS.items()
                  if getattr(self.settings, name)]
        shown += [f"stop {self.settings.stop[0]!r}"] if self.settings.stop else []
        shown += [f"{name.replace('_', '-')} {getattr(self.settings, name)}" for name in ("src_lang", "tgt_lang")
                  if getattr(self.settings, name)]
        return f"mode {mode}, " + ", ".join(shown)

    def change(self, **changes) -> None:
        """New settings, or the reason they cannot be."""
        try:
            self.settings = replace(self.settings, **changes).check_models(self.models)
            self.say(self.describe())
        except OptionError as e:
            self.say(str(e))

    def generate(self, prompt: str) -> None:
        prompt = self.prefix + prompt
        self.last_prompt = prompt
        if self.settings.n > 1:  # n outputs, decoded together
            generations = stream_batch_generate(self.models, [prompt], batch_size=self.settings.n, settings=self.settings)
            show_batch(generations, 1, self.settings.drafts(self.models), self.models.tokenizer, self.out,
                       per_prompt=self.settings.n)
            return
        text, _ = show_generation(self.models, prompt, self.settings, self.out)
        show_filled(prompt, text, self.out)

    def command(self, line: str) -> bool:
        """Apply one ':command'; False to quit."""
        name, _, value = line[1:].strip().partition(" ")
        value = value.strip()
        if name in ("quit", "exit", "q"):
            return False
        if name == "help":
            self.say(self.help())
        elif name == "show":
            self.say(self.describe())
        elif name in ("regular", "speculative"):
            if name == "speculative" and self.models.draft is None:
                self.say("no draft model loaded (:lookup drafts without one)")
            else:
                self.change(speculative=name == "speculative", prompt_lookup=False)
        elif name == "lookup":
            self.change(speculative=True, prompt_lookup=True)
        elif name == "compare":
            if why_not_timed(self.settings, "compare", ":"):
                self.say(why_not_timed(self.settings, "compare", ":"))
            elif not replace(self.settings, speculative=True).drafts(self.models):
                self.say("no draft model loaded (:lookup drafts without one)")
            elif self.last_prompt is None:
                self.say("type a prompt first")
            else:
                compare(self.models, self.last_prompt, self.settings, self.out)
        elif name == "demo":
            self.run_example(value or "1")
        elif name.replace("-", "_") in KNOBS or name.replace("-", "_") in LISTS:
            option = KNOBS.get(name.replace("-", "_")) or LISTS[name.replace("-", "_")]
            try:
                self.change(**{option.name: option.parse(value, f":{name}")})
            except OptionError as e:
                self.say(str(e))
        elif name == "stop":
            self.change(stop=() if value.lower() in ("", "none") else (value,))
        elif name == "task":
            self.task(value)
        elif name in ("src-lang", "tgt-lang"):
            self.change(**{name.replace("-", "_"): None if value.lower() in ("", "none") else value})
        else:
            self.say(f"unknown command ':{name}' (:help lists them)")
        return True

    def task(self, name: str) -> None:
        """A task the model's config names: its prefix before each prompt, its
        options over the session's (commands after it change them); none: no
        prefix, and the options the task set back as they were."""
        if name.lower() in ("", "none"):  # what a command has changed since stays
            self.prefix = ""
            self.change(**{key: old for key, (old, set_to) in self.before_task.items()
                           if getattr(self.settings, key) == set_to})
            self.before_task = {}
            return
        try:
            _, preset = task_preset(self.models.tasks, name)  # what it sets, to set back with :task none
            prefix, settings = with_task(self.models.tasks, name, self.settings)
            settings = settings.check_models(self.models)
        except OptionError as e:
            self.say(str(e))
            return
        self.before_task = {key: (getattr(self.settings, key), value) for key, value in preset.items()} | {
            key: (old, preset.get(key, set_to)) for key, (old, set_to) in self.before_task.items()}
        self.prefix, self.settings = prefix, settings
        self.say(f"task {name}: prompts start {prefix!r}; {self.describe()}")

    def run_example(self, number: str) -> None:
        if not self.examples:
            self.say(":demo needs the demo pair (start with --demo)")
        elif not number.isdigit() or not 1 <= int(number) <= len(self.examples):
            self.say(f":demo takes a prompt number from 1 to {len(self.examples)} (got '{number}')")
        else:
            prompt = self.examples[int(number) - 1]
            self.say(prompt)
            self.generate(prompt)

    def run(self, first_prompt: str | None = None) -> None:
        """Read lines until :quit or end of input; first_prompt runs as if typed first."""
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        self.say("Warming up ...")
        warm_up_aloud(self.models, first_prompt or (self.examples[0] if self.examples else "warm up"), self.settings,
                      self.out)
        self.say(self.help())
        self.say(self.describe())
        while True:
            try:
                if first_prompt:
                    line, first_prompt = first_prompt, None
                    self.say(f"> {line}")
                else:
                    line = input("> ").strip()
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:
                self.say("")
                continue
            if not line:
                continue
            try:
                if line.startswith(":"):
                    if not self.command(line):
                        return
                else:
                    self.generate(line)
            except KeyboardInterrupt:  # show_generation has ended the line with the statistics so far
                self.say("")
            except T5Error as e:  # what the command line would refuse; the models stay loaded
                self.say(f"error: {e}")
