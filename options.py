"""What a generation is asked to do, and what it reports: the knobs, `Settings` and `Stats`.

Every front end takes its options from the one table of knobs, `KNOBS`:
`--num-draft` on the command line, `:num-draft` in the interactive loop,
`num_draft=` in the Python API, `"num_draft"` in a server request, a list of
values in a sweep. A `Settings` is every option of one generation, checked
when it is made; it goes whole from the front end to the round that decodes
its row (decoder.py), which reports in the row's `Stats`.
"""

import enum
import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable

from errors import OptionError
from rules import BadWords
from sampling import Penalties, Sampling

AUTO = "auto"  # num_draft: as many drafts as the draft's confidence makes worth it (autodraft.AutoDraft)
# Drafts a round for a seeded request with num_draft auto whose answer depends on its draft length (sampling, or
# delta > 0): what auto learnt would change which draws decide each token, so such a request drafts this many.
SEEDED_AUTO_DRAFTS = 5
# Temperatures below this decode greedily (as vLLM's do): dividing logits by less overflows float32.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's chat limit)
MAX_SAMPLES = 16  # n: outputs of one prompt
MAX_BEAMS = 64  # num_beams (the server's best_of: MAX_SAMPLES)
MAX_DRAFTS = 64  # num_draft


@dataclass(frozen=True)
class Knob:
    """One generation option: its keyword here, `--name-with-dashes` on the
    command line, `:name-with-dashes` in the interactive loop, and a list of
    values in a sweep. Errors name it as the caller's `label` does."""

    name: str
    type: type  # int, float or bool
    valid: Callable
    expected: str  # what `valid` accepts, for messages
    help: str
    optional: bool = False  # None (or "none") allowed
    words: tuple = ()  # values other than numbers, e.g. "auto"

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def check(self, value, label: str | None = None):
        """value, if this knob takes it; OptionError otherwise."""
        if (value is None and self.optional) or (isinstance(value, str) and value in self.words):
            return value
        if self.type is bool:
            if not isinstance(value, bool):
                raise OptionError(f"{label or self.name} must be {self.expected} (got {value!r})", self.name)
            return value
        kind = numbers.Real if self.type is float else numbers.Integral
        if not isinstance(value, kind) or isinstance(value, bool) or not self.valid(value):
            raise OptionError(f"{label or self.name} must be {self.expected} (got {value!r})", self.name)
        return value

    def parse(self, text: str, label: str | None = None):
        """A value from text, checked; errors quote the text."""
        if self.optional and text.strip().lower() == "none":
            return None
        if text.strip().lower() in self.words:
            return text.strip().lower()
        if self.type is bool:
            if text.strip().lower() not in ("true", "false"):
                raise OptionError(f"{label or self.name} must be {self.expected} (got '{text}')")
            return text.strip().lower() == "true"
        try:
            return self.check(self.type(text), label)
        except (ValueError, OptionError):
            raise OptionError(f"{label or self.name} must be {self.expected} (got '{text}')")


KNOBS = {knob.name: knob for knob in [
    Knob("num_draft", int, lambda v: 1 <= v <= MAX_DRAFTS, f"an integer in [1, {MAX_DRAFTS}] or auto",
         "draft tokens per verify step; auto: as many as the draft's confidence makes worth it", words=(AUTO,)),
    Knob("delta", float, lambda v: 0 <= v <= 1, "a number in [0, 1]",
         "acceptance lenience in [0, 1]: 0 exact, 1 accepts every draft"),
    Knob("temp", float, lambda v: 0 <= v <= 100, "a number in [0, 100]",
         f"sampling temperature; 0 (or below {MIN_TEMPERATURE:g}) is greedy"),
    Knob("top_k", int, lambda v: 0 <= v < 2**31, "an integer in [0, 2**31), at most the vocabulary's size",
         "sample from the k most likely tokens (0: all)"),
    Knob("top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]", "nucleus sampling mass (1: off)"),
    Knob("max_tokens", int, lambda v: 1 <= v < 2**31, "an integer in [1, 2**31)", "most tokens to generate"),
    Knob("seed", int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)",
         "random seed for sampling (default: random)", optional=True),
    Knob("repetition_penalty", float, lambda v: 0 < v <= 100, "a number in (0, 100]",
         "a seen token's logit over this when positive, times it when negative (transformers' rule; 1: off)"),
    Knob("presence_penalty", float, lambda v: -2 <= v <= 2, "a number in [-2, 2]",
         "minus this from an output token's logit (OpenAI's rule; 0: off)"),
    Knob("frequency_penalty", float, lambda v: -2 <= v <= 2, "a number in [-2, 2]",
         "minus this for each time a token was output (OpenAI's rule; 0: off)"),
    Knob("min_tokens", int, lambda v: 0 <= v < 2**31, "an integer in [0, 2**31), at most max_tokens",
         "tokens before the end of text may come"),
    Knob("logprobs", int, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}] or none",
         "give each output token's log-probability (the target's, before processors and temperature) and the N most "
         "likely", optional=True),
    Knob("n", int, lambda v: 1 <= v <= MAX_SAMPLES, f"an integer in [1, {MAX_SAMPLES}]",
         "outputs of each prompt (batch_generate, the server's n): one encoding, n rows, output j seeded seed + j"),
    Knob("num_beams", int, lambda v: 1 <= v <= MAX_BEAMS, f"an integer in [1, {MAX_BEAMS}]",
         "beam search with this many beams, the target alone (1: off)"),
    # A finished beam's score is divided by its length to this power, in float32: past 5 a long beam's overflows.
    Knob("length_penalty", float, lambda v: -5 <= v <= 5, "a number in [-5, 5]",
         "beam search: a finished beam scores its log-probability over its length to this power"),
    Knob("early_stopping", bool, lambda v: True, "true, false or never",
         "beam search: true stops once num-beams beams finished; false when no better one looks likely; "
         "never when none can be", words=("never",)),
    Knob("num_return_sequences", int, lambda v: 1 <= v <= MAX_BEAMS, f"an integer in [1, {MAX_BEAMS}]",
         "beam search: the best beams returned, at most num-beams (without beam search: unused)"),
    Knob("no_repeat_ngram_size", int, lambda v: 0 <= v <= 64, "an integer in [0, 64]",
         "no n-gram of this many tokens twice in the output (transformers' rule; 0: off)"),
]}

@dataclass(frozen=True)
class ListOption:
    """A generation option that takes a list: `--flag A,B` on the command line,
    `:flag A B` (or `:flag none`) in the interactive loop, a list in the API
    and the server."""

    name: str
    metavar: str
    help: str
    item: Callable  # one item's text -> its value; ValueError if it is none

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def parse(self, text: str, label: str | None = None):
        """The values in text (commas or spaces between them); "none": no values."""
        if text.strip().lower() == "none":
            return ()
        try:
            return tuple(self.item(part) for part in text.replace(",", " ").split())
        except ValueError:
            raise OptionError(f"{label or self.name} takes {self.metavar} (got '{text}')")


def bias_item(text: str) -> tuple[int, float]:
    token, equals, bias = text.partition("=")
    if not equals:
        raise ValueError(text)
    return int(token), float(bias)


LISTS = {option.name: option for option in [
    ListOption("stop_token_ids", "ID[,ID...]", "token ids that end the output, each kept in it (vLLM's)", int),
    ListOption("logit_bias", "ID=BIAS[,ID=BIAS...]", "add BIAS, in [-100, 100], to the token's logit (OpenAI's)",
               bias_item),
]}

BATCH_SIZE = Knob("batch_size", int, lambda v: v >= 1, "an integer >= 1", "prompts decoded together")

class Decoding(enum.Enum):
    """How rows decode (Settings.kind)."""

    REGULAR = "regular"  # the target alone
    LOOKUP = "lookup"  # drafts copied from the prompt and the output (drafting.LookupDrafter)
    DRAFT = "draft"  # the draft model's drafts, num_draft at a time
    AUTO_DRAFT = "auto"  # the draft model's drafts, as many as num-draft auto finds worth it
    BEAMS = "beams"  # beam search, the target alone


@dataclass(frozen=True)
class Kind:
    """How rows decode, and with how many beams: rows of one kind share a batch."""

    how: Decoding
    beams: int = 1

    @property
    def drafts(self) -> bool:
        return self.how in (Decoding.LOOKUP, Decoding.DRAFT, Decoding.AUTO_DRAFT)


@dataclass(frozen=True)
class Opening:
    """How a row's decoder opens: the tokens it starts from, before its
    first output token (the model's decoder start token; mBART's target
    language; any prefix of several), and a first output token forced
    whatever the logits, None for none (NLLB's and M2M-100's target
    language, BART's BOS: transformers' forced_bos_token_id), which stays
    in the output as transformers gives it."""

    start: tuple[int, ...]
    forced: int | None = None

    @classmethod
    def of(cls, args) -> "Opening":
        """The model's own (its config's decoder start token and forced first token)."""
        return cls((args.decoder_start_token_id,), args.forced_bos_token_id)


@dataclass(frozen=True)
class Settings:
    """Every option of one generation, each checked against its knob."""

    max_tokens: int = 100
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0
    logprobs: int | None = None  # each token's log-probability and this many alternatives; None: none
    n: int = 1  # outputs of each prompt (Settings.copies)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    num_draft: int | str = 5  # or "auto"
    delta: float = 0.0
    speculative: bool = True  # with a draft loaded or prompt_lookup; False: the target alone
    prompt_lookup: bool = False  # drafts copied from the prompt and the output, not from the draft model
    stop: tuple[str, ...] = ()  # the text ends before the first of these it would contain
    stop_token_ids: tuple[int, ...] = ()  # the output ends after the first of these (vLLM's: the token is output)
    ignore_eos: bool = False  # decode on past the end of text, to max_tokens (benchmarks)
    skip_special_tokens: bool = False  # leave special tokens (<extra_id_0>, </s>, <pad>) out of the text
    logit_bias: dict | tuple = ()  # {token id: bias in [-100, 100]} added to the logits (OpenAI's); kept as sorted pairs
    bad_words_ids: tuple = ()  # token sequences never output (transformers' bad_words_ids: rules.BadWords)
    src_lang: str | None = None  # a multilingual model's language codes: the prompt's ("eng_Latn", "en_XX", ...)
    tgt_lang: str | None = None  # and the output's

    def __post_init__(self):
        for name, knob in KNOBS.items():
            knob.check(getattr(self, name))
        for name in ("src_lang", "tgt_lang"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise OptionError(f"{name} must be a language code (got {getattr(self, name)!r})")
        for name in ("speculative", "prompt_lookup", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be True or False (got {getattr(self, name)!r})")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise OptionError(f"stop must be a string or a list of non-empty strings (got {self.stop!r})")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids):
            raise OptionError(f"stop_token_ids must be a list of token ids, integers >= 0 (got {ids!r})")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.temp < MIN_TEMPERATURE:
            object.__setattr__(self, "temp", 0.0)
        object.__setattr__(self, "logit_bias", checked_bias(self.logit_bias))
        words = self.bad_words_ids
        if not isinstance(words, (list, tuple)) or not all(
                isinstance(sequence, (list, tuple)) and sequence and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sequence) for sequence in words):
            raise OptionError(f"bad_words_ids must be a list of token id lists, each non-empty (got {words!r})")
        object.__setattr__(self, "bad_words_ids", tuple(tuple(sequence) for sequence in words))
        if self.prompt_lookup and self.num_draft == AUTO:
            raise OptionError("num-draft 'auto' follows a draft model's confidence: prompt lookup takes a number, "
                              "the longest draft")
        if self.min_tokens > self.max_tokens:
            raise OptionError(f"min_tokens ({self.min_tokens}) is at most max_tokens ({self.max_tokens})", "min_tokens")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise OptionError(f"num_return_sequences ({self.num_return_sequences}) is at most num_beams ({self.num_beams})")
        if self.num_beams > 1 and self.n > 1:
            raise OptionError("beam search returns its best beams as num_return_sequences, not n")
        if self.num_beams > 1:
            refused = [name for name, asked in (("prompt lookup", self.prompt_lookup), ("num-draft auto", self.num_draft == AUTO),
                                                ("sampling (temp > 0)", self.temp > 0), ("logprobs", self.logprobs is not None))
                       if asked]
            if refused:
                raise OptionError(f"beam search decodes greedily with the target alone: it does not take {refused[0]}")

    @classmethod
    def of(cls, options: dict, base: "Settings | None" = None) -> "Settings":
        """From keyword options (over `base`'s, if given); an unknown one is
        named with those there are."""
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown option {sorted(unknown)[0]!r} (options: {', '.join(f.name for f in fields(cls))})")
        if base is not None and not isinstance(base, Settings):
            raise TypeError(f"settings must be an options.Settings (got {type(base).__name__})")
        return cls(**options) if base is None else replace(base, **options)

    def copies(self) -> list["Settings"]:
        """The settings of each of a prompt's n outputs: a seed moves on by
        one a copy, so that seeded outputs differ, and each is the one its
        seed gives alone."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else (self.seed + j) % 2**64) for j in range(self.n)]

    def kind(self, models) -> Kind:
        """How rows at these settings decode with these models (a target, and a draft model or None)."""
        if self.num_beams > 1:
            return Kind(Decoding.BEAMS, self.num_beams)
        if not self.speculative or (not self.prompt_lookup and models.draft is None):
            return Kind(Decoding.REGULAR)
        if self.prompt_lookup:
            return Kind(Decoding.LOOKUP)
        return Kind(Decoding.AUTO_DRAFT if self.draft_length == AUTO else Decoding.DRAFT)

    @property
    def draft_length(self) -> int | str:
        """num_draft as decoding runs it: AUTO, or a number. A seeded request
        whose answer depends on how far it drafts (sampling, or delta > 0)
        drafts SEEDED_AUTO_DRAFTS under auto, so that its seed gives one
        answer whatever auto has learnt and whatever shares its batch."""
        if self.num_draft == AUTO and self.seed is not None and (self.temp > 0 or self.delta > 0):
            return SEEDED_AUTO_DRAFTS
        return self.num_draft

    def drafts(self, models) -> bool:
        """Whether decoding drafts and verifies (else the target decodes alone)."""
        return self.kind(models).drafts

    def check_models(self, models) -> "Settings":
        """These settings, if the models can run their numbers; OptionError
        otherwise (plans.resolve checks the languages)."""
        if self.num_draft == AUTO and models.draft is None:
            raise OptionError("num-draft 'auto' follows a draft model's confidence, and no draft model is loaded")
        vocabulary, longest = models.target.args.vocab_size, models.longest_input
        if self.top_k > vocabulary:
            raise OptionError(f"top_k is {self.top_k:,}: at most the vocabulary's size, {vocabulary:,} (0: all)", "top_k")
        if longest is not None and self.max_tokens > longest:
            raise OptionError(f"max_tokens is {self.max_tokens:,}: this model's positions stop at {longest:,}", "max_tokens")
        for name, tokens in (("logit_bias's keys", [token for token, _ in self.logit_bias]),
                             ("stop_token_ids", self.stop_token_ids),
                             ("bad_words_ids", [token for sequence in self.bad_words_ids for token in sequence])):
            if any(token >= vocabulary for token in tokens):
                raise OptionError(f"{name} must be token ids below {vocabulary:,}", name.split("'")[0])
        return self

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_k, self.top_p)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.min_tokens,
                         self.logit_bias, self.no_repeat_ngram_size, self.stop_token_ids if self.min_tokens else (),
                         rules=(BadWords(self.bad_words_ids),) if self.bad_words_ids else ())


# transformers' generation parameters, as a model's config names them for a task, and the options they are here.
# Lengths there count the decoder's start token; here, the tokens generated.
TASK_PARAMETERS = {"num_beams": ("num_beams", 0), "length_penalty": ("length_penalty", 0),
                   "early_stopping": ("early_stopping", 0), "no_repeat_ngram_size": ("no_repeat_ngram_size", 0),
                   "repetition_penalty": ("repetition_penalty", 0), "min_length": ("min_tokens", -1),
                   "max_length": ("max_tokens", -1), "min_new_tokens": ("min_tokens", 0),
                   "max_new_tokens": ("max_tokens", 0)}


def task_preset(tasks: dict, name: str) -> tuple[str, dict]:
    """A task's prompt prefix and options, from a model's task_specific_params
    (T5's: summarization, translation_en_to_de, ...), as transformers'
    pipelines apply them. Parameters with no option here are left out."""
    if name not in tasks:
        known = ", ".join(sorted(tasks)) or "none"
        raise OptionError(f"the model's config names no task {name!r} (its tasks: {known})")
    params = tasks[name]
    options = {ours: params[theirs] for theirs, (ours, _) in TASK_PARAMETERS.items() if theirs in params}
    for theirs, (ours, shift) in TASK_PARAMETERS.items():
        if shift and theirs in params:
            options[ours] = max(params[theirs] + shift, 0 if ours == "min_tokens" else 1)
    return params.get("prefix", ""), options


def checked_bias(given) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, each checked as OpenAI checks them."""
    pairs = given.items() if isinstance(given, dict) else given
    try:
        pairs = sorted((token, bias) for token, bias in pairs)
    except (TypeError, ValueError):
        raise OptionError(f"logit_bias must map token ids to biases (got {given!r})")
    for token, bias in pairs:
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            raise OptionError(f"logit_bias's keys must be token ids, integers >= 0 (got {token!r})")
        if not isinstance(bias, numbers.Real) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise OptionError(f"logit_bias's values must be numbers in [-100, 100] (got {bias!r})")
    return tuple((int(token), float(bias)) for token, bias in pairs)


@dataclass
class Stats:
    """What one generation did: tokens, the target's and the draft's calls,
    drafts proposed and accepted, and its time."""

    prompt_tokens: int = 0
    generated: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # from when the prompt joined its batch: encoding, then decoding
    encoding_seconds: float = 0.0  # the encoding its row waited for (of the prompts that joined with it too)
    # MLX compiling CPU kernels while its row waited (once a kernel and machine: kernels.compiling_seconds), in neither
    compiling_seconds: float = 0.0

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def decoding_seconds(self) -> float:
        return max(self.seconds - self.encoding_seconds - self.compiling_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: the prompt's encoding is not counted."""
        return self.generated / self.decoding_seconds if self.decoding_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.generated / self.target_calls if self.target_calls else 0.0

    @property
    def drafts_per_round(self) -> float:
        return self.drafted / self.target_calls if self.target_calls else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "decoding_seconds": self.decoding_seconds, "tokens_per_second": self.tokens_per_second,
                "acceptance_rate": self.acceptance_rate, "tokens_per_target_call": self.tokens_per_target_call,
                "drafts_per_round": self.drafts_per_round}
