"""The interactive loop (`main.py --interactive`): models load once; prompts generate with the current settings,
and commands change them: one `:name value` per knob of options.KNOBS, plus the mode, :compare, :show, :demo N
(with --demo) and :quit. What it shows, display.py shows.
"""

from dataclasses import dataclass, field, replace

from display import compare, show_batch, show_filled, show_generation, warm_up_aloud, why_not_timed
from errors import OptionError, T5Error
from generate import stream_batch_generate
from loading import Models
from options import KNOBS, LISTS, Settings, task_preset
from plans import resolve, with_presets


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
            self.settings = resolve(replace(self.settings, **changes), self.models).settings
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
        """Apply one ':command' (a knob's, or one of COMMANDS); False to quit."""
        name, _, value = line[1:].strip().partition(" ")
        value = value.strip()
        if name in ("quit", "exit", "q"):
            return False
        option = KNOBS.get(name.replace("-", "_")) or LISTS.get(name.replace("-", "_"))
        if option is not None:
            try:
                self.change(**{option.name: option.parse(value, f":{name}")})
            except OptionError as e:
                self.say(str(e))
        elif name in COMMANDS:
            COMMANDS[name](self, value)
        else:
            self.say(f"unknown command ':{name}' (:help lists them)")
        return True

    def mode(self, speculative: bool) -> None:
        if speculative and self.models.draft is None:
            self.say("no draft model loaded (:lookup drafts without one)")
        else:
            self.change(speculative=speculative, prompt_lookup=False)

    def compare_last(self, _: str = "") -> None:
        """Regular then speculative decoding of the last prompt, as --compare runs them (and refuses what it refuses)."""
        if why_not_timed(self.settings, "compare", ":"):
            self.say(why_not_timed(self.settings, "compare", ":"))
        elif not replace(self.settings, speculative=True).drafts(self.models):
            self.say("no draft model loaded (:lookup drafts without one)")
        elif self.last_prompt is None:
            self.say("type a prompt first")
        else:
            compare(self.models, self.last_prompt, self.settings, self.out)

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
            prefix, settings, _ = with_presets(self.models, self.settings, task=name, generation=False)
            settings = resolve(settings, self.models).settings
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


def given_or_none(value: str):
    """A command's value; None for "none" or nothing."""
    return None if value.lower() in ("", "none") else value


# The loop's commands beside the knobs': name -> what it does with the session and the text after it.
COMMANDS = {
    "help": lambda session, _: session.say(session.help()),
    "show": lambda session, _: session.say(session.describe()),
    "regular": lambda session, _: session.mode(speculative=False),
    "speculative": lambda session, _: session.mode(speculative=True),
    "lookup": lambda session, _: session.change(speculative=True, prompt_lookup=True),
    "compare": Session.compare_last,
    "demo": lambda session, value: session.run_example(value or "1"),
    "stop": lambda session, value: session.change(stop=() if given_or_none(value) is None else (value,)),
    "task": Session.task,
    "src-lang": lambda session, value: session.change(src_lang=given_or_none(value)),
    "tgt-lang": lambda session, value: session.change(tgt_lang=given_or_none(value)),
}
