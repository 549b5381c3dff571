"""What the caller asks, resolved against the loaded models: a generation's `Plan`.

    prefix, settings, notes = with_presets(models, settings, given, task="summarization")
    plan = resolve(settings, models, prefix)
    requests = [plan.request(ids) for ids in tokenized]

`Settings` (options.py) hold only the caller's choices. `with_presets`
puts the model's own generation defaults (its generation_config.json, as
transformers' generate applies them) and a task's options under the
options the caller named. `resolve` then decides what the models make of the
settings: how rows decode (`options.Kind`), how each row's decoder opens
(`options.Opening`: a target language there, or the model's start), the form
prompts take (a task's prefix, language codes around the text), and the
rules the settings imply (`bad_words_ids`). Everything downstream reads the
plan.
"""

from dataclasses import dataclass, replace

from errors import OptionError
from options import Kind, Opening, Settings, task_preset
from rows import Request

# The model's generation defaults that search with beams: they give way where the caller chose drafts or sampling.
SEARCH_DEFAULTS = ("num_beams", "length_penalty", "early_stopping")


@dataclass(frozen=True)
class PromptForm:
    """How a prompt's text becomes ids: after a task's prefix, and with the
    ids a multilingual model puts around it (languages.Languages.marks), or
    the tokenizer's own special tokens."""

    prefix: str = ""
    marks: tuple | None = None  # (ids before the text, ids after it); None: the tokenizer's own

    def ids(self, models, text: str, keep: int | None = None) -> list[int]:
        """The text's ids in this form; at most `keep` of them (the prefix
        and the marks whole, the text's last tokens), when given."""
        tokenizer = models.tokenizer
        ids = self.marked(tokenizer.encode(self.prefix + text, add_special_tokens=self.marks is None))
        if keep is None or len(ids) <= keep:
            return ids
        # The prefix and the special tokens the tokenizer or the marks put around the text stay whole.
        head = tokenizer.encode(self.prefix, add_special_tokens=False) if self.prefix else []
        body = tokenizer.encode(text, add_special_tokens=False)
        before, after = [], []
        if self.marks is None:  # the tokenizer's own: around the text in encode(text)
            whole = tokenizer.encode(text)
            at = next((i for i in range(len(whole) - len(body) + 1) if whole[i : i + len(body)] == body), 0)
            before, after = whole[:at], whole[at + len(body) :]
        marked = 0 if self.marks is None else len(self.marks[0]) + len(self.marks[1])
        room = max(keep - len(head) - len(before) - len(after) - marked, 1)
        return self.marked(before + head + body[-room:] + after)

    def marked(self, ids: list[int]) -> list[int]:
        return ids if self.marks is None else [*self.marks[0], *ids, *self.marks[1]]


@dataclass(frozen=True)
class Plan:
    """Settings resolved against the models: everything a generation's requests need."""

    settings: Settings
    kind: Kind
    opening: Opening  # each row's decoder opening
    form: PromptForm
    rules: tuple = ()  # rules.Rule objects the models add to the settings' own

    def request(self, ids: list[int], settings: Settings | None = None) -> Request:
        """A request for the engine: a prompt's ids at these settings (or one of their copies, Settings.copies)."""
        return Request(ids, settings or self.settings, opening=self.opening, rules=self.rules)


def resolve(settings: Settings, models, prefix: str = "") -> Plan:
    """The plan for these settings with these models (loading.Models), a
    task's prompt prefix given; OptionError for what the models cannot run
    (a language they do not mark, a length past their positions)."""
    settings = settings.check_models(models)
    opening = Opening.of(models.target.args)
    marks = None
    if settings.src_lang is not None or settings.tgt_lang is not None:
        if models.languages is None:
            raise OptionError("this model's tokenizer marks no languages: it takes no src-lang or tgt-lang")
        marks = models.languages.marks(settings.src_lang, settings.tgt_lang, models.target.args.eos_token_id)
        opening = models.languages.opening(settings.tgt_lang, opening)
    return Plan(settings, settings.kind(models), opening, PromptForm(prefix, marks))


def generation_defaults(generation: dict) -> dict:
    """The options a model's generation_config.json sets (transformers'
    names, as TASK_PARAMETERS maps them, and bad_words_ids), as options
    here. Lengths there count the decoder's start token."""
    defaults = task_preset({"config": {name: value for name, value in generation.items() if value is not None}}, "config")[1]
    if generation.get("bad_words_ids"):
        defaults["bad_words_ids"] = tuple(tuple(words) for words in generation["bad_words_ids"])
    return defaults


def with_presets(models, settings: Settings, given=(), task: str | None = None, searching: dict | None = None,
                 search: bool = True, generation: bool = True) -> tuple[str, Settings, list[str]]:
    """`settings` with the model's generation defaults, then a task's
    options (options.task_preset), put over them but under the options named
    in `given` (those the caller chose); `searching`'s too when the task
    searches with beams. `search` False: the defaults' beam search does not
    apply (the server's: requests search only when they ask); `generation`
    False: settings that have the defaults already, a task only. The defaults'
    beams give way where the caller's choices cannot search (a draft loaded
    and drafting on, prompt lookup, sampling, logprobs, n): a note for each
    says which runs. Returns the task's prompt prefix, the settings and the
    notes. Every front end applies presets here."""
    defaults = generation_defaults(models.generation) if generation else {}
    notes = []
    beams = defaults.get("num_beams", 1)
    if beams > 1 and search:
        refuses = [why for why, asked in (  # (the defaults set none of these)
            ("drafting with the loaded draft model", models.draft is not None and settings.speculative),
            ("prompt lookup", settings.prompt_lookup), ("sampling", settings.temp > 0),
            ("logprobs", settings.logprobs is not None), ("n", settings.n > 1)) if asked]
        if refuses and "num_beams" not in given:
            search = False
            notes.append(f"the model's generation config searches with {beams} beams; {refuses[0]} runs instead "
                         f"(--num-beams {beams} searches, with the target alone)")
    if not search:
        defaults = {name: value for name, value in defaults.items() if name not in SEARCH_DEFAULTS}
    prefix, preset = "", {}
    if task is not None:
        prefix, preset = task_preset(models.tasks, task)
        if preset.get("num_beams", 1) > 1:
            preset |= searching or {}
    changes = {name: value for name, value in (defaults | preset).items() if name not in given}
    # A preset's least length gives way to the most the caller asked for (transformers' min_length past max_length)
    most = changes.get("max_tokens", settings.max_tokens)
    if "min_tokens" not in given and changes.get("min_tokens", settings.min_tokens) > most:
        changes["min_tokens"] = most
    return prefix, replace(settings, **changes), notes
