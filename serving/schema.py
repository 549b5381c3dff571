"""The requests the server reads: OpenAI's completion and chat fields, and our knobs beside them.

Types are strict, as OpenAI's are: `"10"` or `true` is no number, `"yes"` no
boolean. Each knob is checked against its entry in options.KNOBS, so a
request fails with the message the command line and the API give.
`CompletionBody.settings` turns a request into the Settings its row decodes
with.
"""

import re
from dataclasses import replace
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator
from pydantic import model_validator

from options import AUTO, KNOBS, MAX_SAMPLES, Settings

# What a request may send beyond the knobs' own bounds (options.KNOBS), each checked here, before any work:
# docs/SERVING.md lists them all (tests/test_docs.py holds it to this table).
BOUNDS = {
    "stop": "at most 4 strings (OpenAI's limit), each of 1 to 1,000 characters",
    "stop_token_ids": "at most 64 token ids, each below the vocabulary's size",
    "logit_bias": "at most 300 entries, keyed by token ids below the vocabulary's size written in ASCII digits",
    "n": "1 to 16 (choices: samples, or with use_beam_search the best beams)",
    "best_of": "1 to 16 (use_beam_search's beams)",
    "min_tokens": "at most max_tokens",
    "prompt": "at most 32 characters a token of the server's --max-prompt-tokens, then that many tokens",
    "messages": "as prompt, the conversation's prompt counted",
}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARACTERS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
CHARACTERS_PER_TOKEN = 32  # a prompt's characters, before it is tokenized, per token the server takes
MAX_CHOICES = MAX_SAMPLES  # n, and beams
# A beam search's defaults over the server's: greedy, no drafts (a request's own sampling or drafting is refused).
BEAM_DEFAULTS = {"temp": 0.0, "num_draft": 1, "prompt_lookup": False}
# OpenAI's fields this server does not do: a request that sets one to anything but its default is refused, not ignored.
UNSUPPORTED = {"response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "suffix": ("",), "echo": (False,), "audio": (), "modalities": (["text"],),
               "prediction": (), "web_search_options": ()}


Number = StrictFloat | StrictInt
DIGITS = re.compile(r"[0-9]{1,10}")


class FieldError(ValueError):
    """A refusal that names the field it refuses (OpenAI's `param`), where pydantic's own location has none."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def knob_value(name: str, value, label: str | None = None):
    if value is None:
        return None
    return KNOBS[name].check(value, label or name)


def valid_unicode(text: str, what: str) -> str:
    """text, if it can be encoded (JSON's escapes can name a lone surrogate, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {e.start})")
    return text


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class CompletionBody(BaseModel):
    """The fields of OpenAI's completion request this server reads; `top_k`,
    `num_draft`, `delta` and `prompt_lookup` are its own; `ignore_eos`,
    `skip_special_tokens`, `repetition_penalty`, `min_tokens`,
    `stop_token_ids` and `truncate_prompt_tokens` are vLLM's;
    `no_repeat_ngram_size` is transformers'. OpenAI's fields for what a T5
    cannot do (UNSUPPORTED) are refused; others (`user`, `metadata`) are ignored."""

    model_config = ConfigDict(extra="ignore")
    prompt_field: ClassVar[str] = "prompt"  # the field the prompts come in, as refusals name it

    model: StrictStr
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name for max_tokens (chat)
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # vLLM's (transformers' rule)
    min_tokens: StrictInt | None = None  # vLLM's
    no_repeat_ngram_size: StrictInt | None = None  # transformers'
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: the output ends after one of these, kept in it
    logit_bias: dict[StrictStr, Number] | None = None  # token ids, as JSON's keys are strings
    stop: StrictStr | list[StrictStr] | None = Field(default=None, validate_default=True)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)  # choices per prompt: samples, or with use_beam_search the best beams
    use_beam_search: StrictBool = False  # vLLM's: best_of beams (n if not given), the n best returned
    best_of: StrictInt | None = Field(default=None, ge=1)
    length_penalty: Number | None = None  # beam search (vLLM's, transformers' rule)
    early_stopping: StrictBool | Literal["never"] | None = None
    num_draft: StrictInt | StrictStr | None = None
    delta: Number | None = None
    prompt_lookup: StrictBool | None = None
    ignore_eos: StrictBool = False  # decode on to max_tokens (benchmarks)
    skip_special_tokens: StrictBool = True  # vLLM's default: no <extra_id_0>, </s> or <pad> in the text
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)  # vLLM's: keep a prompt's last N tokens
    task: StrictStr | None = None  # a task the model's config names: its prefix, and its options under the request's
    src_lang: StrictStr | None = None  # a multilingual model's language codes: the prompt's
    tgt_lang: StrictStr | None = None  # and the answer's

    @field_validator("max_tokens", "max_completion_tokens", "top_k", "top_p", "seed", "delta", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "no_repeat_ngram_size", "length_penalty")
    @classmethod
    def in_range(cls, value, info):
        knob = "max_tokens" if info.field_name == "max_completion_tokens" else info.field_name
        return knob_value(knob, value, info.field_name)

    @field_validator("temperature")
    @classmethod
    def temperature_in_range(cls, value):
        return knob_value("temp", value, "temperature")

    @field_validator("num_draft")
    @classmethod
    def num_draft_in_range(cls, value):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(f"num_draft must be {KNOBS['num_draft'].expected} (got {value!r})")
        return knob_value("num_draft", value)

    @model_validator(mode="before")
    @classmethod
    def supported(cls, data):
        if isinstance(data, dict):
            for name, defaults in UNSUPPORTED.items():
                if data.get(name) is not None and data[name] not in defaults:
                    raise FieldError(f"{name} is not supported by this server", name)
            for name in ("n", "stream"):  # null where OpenAI's schema allows it: the default
                if name in data and data[name] is None:
                    data = {key: value for key, value in data.items() if key != name}
        return data

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or not all(0 < len(stop) <= MAX_STOP_CHARACTERS for stop in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} strings, each of 1 to {MAX_STOP_CHARACTERS:,} characters")
        return [valid_unicode(stop, "a stop string") for stop in stops]

    @field_validator("stop_token_ids")
    @classmethod
    def few_stop_tokens(cls, value):
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes up to {MAX_STOP_TOKEN_IDS} token ids")
        return value

    @model_validator(mode="after")
    def beams_or_samples(self):
        if self.use_beam_search:
            if self.beams < 2:
                raise FieldError("use_beam_search needs best_of (the beams; n when not given) of at least 2", "best_of")
            if self.beams > MAX_CHOICES or self.n > self.beams:
                raise FieldError(f"use_beam_search takes up to {MAX_CHOICES} beams (best_of), and n at most best_of",
                                 "best_of")
            if self.stream:
                raise FieldError("beam search does not stream: its best beams are known only at the end", "stream")
        elif self.best_of not in (None, self.n):
            raise FieldError("best_of (more samples than returned) is not supported: use n, or use_beam_search", "best_of")
        if self.min_tokens is not None and self.most_tokens is not None and self.min_tokens > self.most_tokens:
            raise FieldError(f"min_tokens ({self.min_tokens}) is at most max_tokens ({self.most_tokens})", "min_tokens")
        return self

    @property
    def beams(self) -> int:
        """The beams a beam search request asks for: best_of, or n when not given."""
        return self.best_of or self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator("logit_bias")
    @classmethod
    def token_ids(cls, value):
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes up to {MAX_LOGIT_BIAS} entries")
        # ASCII digits only: str.isdigit() also takes "²" and "①", which int() refuses
        if value is not None and not all(DIGITS.fullmatch(key) for key in value):
            raise ValueError("logit_bias's keys must be token ids (\"42\")")
        return value

    @property
    def token_biases(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(key): bias for key, bias in self.logit_bias.items()}

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives each token's logprobs list; None: no logprobs."""
        return None

    @property
    def most_tokens(self) -> int | None:
        """max_completion_tokens, or else max_tokens (None: the server's default)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def settings(self, defaults: Settings) -> Settings:
        """The request's Settings: what it gives, over the server's defaults."""
        given = {"max_tokens": self.most_tokens, "temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "seed": self.seed, "num_draft": self.num_draft, "delta": self.delta, "prompt_lookup": self.prompt_lookup,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                 "no_repeat_ngram_size": self.no_repeat_ngram_size, "stop_token_ids": self.stop_token_ids,
                 "logit_bias": self.token_biases, "logprobs": self.logprob_count, "length_penalty": self.length_penalty,
                 "early_stopping": self.early_stopping, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang}
        if self.use_beam_search:  # over defaults the server made greedy and draftless (BEAM_DEFAULTS)
            given |= {"num_beams": self.beams, "num_return_sequences": self.n}
        chosen = {name: value for name, value in given.items() if value is not None}
        return replace(defaults, **chosen, stop=tuple(self.stop), ignore_eos=self.ignore_eos,
                       skip_special_tokens=self.skip_special_tokens)


Prompt = StrictStr | list[StrictInt]  # text, or token ids as given (OpenAI's and vLLM's)


class Completion(CompletionBody):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # the legacy completion's: this many alternatives for each token

    @field_validator("logprobs")
    @classmethod
    def logprobs_in_range(cls, value):
        return knob_value("logprobs", value)

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def non_empty(cls, value):
        prompts = one_or_many(value)
        if not prompts or not all(p.strip() if isinstance(p, str) else p for p in prompts):
            raise ValueError("the prompt is empty")
        for prompt in prompts:
            if isinstance(prompt, str):
                valid_unicode(prompt, "the prompt")
        return value

    @property
    def prompts(self) -> list[Prompt]:
        return one_or_many(self.prompt)


def one_or_many(prompt) -> list[Prompt]:
    """A request's prompts: a text or a list of ids is one prompt; a list of texts, or of id lists, many."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class TextPart(BaseModel):
    """A part of a message's content, as OpenAI's clients (and LangChain's blocks) send it: text only here."""

    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def text_only(self):
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text parts are supported ({{'type': 'text', 'text': ...}}; got type {self.type!r})")
        return self


class Message(BaseModel):
    role: StrictStr
    content: StrictStr | list[TextPart]

    @field_validator("role")
    @classmethod
    def known_role(cls, value):
        if value not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"unknown role {value!r} (system, user or assistant)")
        return value

    @field_validator("content")
    @classmethod
    def joined(cls, value):
        """The parts' texts joined by newlines, as vLLM joins them."""
        text = value if isinstance(value, str) else "\n".join(part.text for part in value)
        return valid_unicode(text, "a message")


class ChatCompletion(CompletionBody):
    prompt_field: ClassVar[str] = "messages"
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None  # alternatives for each token, with logprobs

    @field_validator("logprobs", mode="before")
    @classmethod
    def null_is_false(cls, value):  # null where OpenAI's schema allows it
        return False if value is None else value

    @field_validator("top_logprobs")
    @classmethod
    def top_logprobs_in_range(cls, value):
        return knob_value("logprobs", value, "top_logprobs")

    @model_validator(mode="after")
    def top_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def a_user_speaks(cls, messages):
        return conversation(messages)

    @property
    def prompts(self) -> list[str]:
        return [chat_prompt(self.messages)]


def conversation(messages: list[Message]) -> list[Message]:
    """Messages chat takes (and /tokenize, the same): a user's with some text among them."""
    if not any(m.role == "user" and m.content.strip() for m in messages):
        raise ValueError("messages need a user message with some text")
    return messages


def chat_prompt(messages: list[Message]) -> str:
    """The one T5 prompt a conversation maps to: a single user message (after
    any system message) as it is, the system message first; longer
    conversations as "User: ..." and "Assistant: ..." lines, the system
    message first and "Assistant:" last, for the model to go on."""
    system = [m.content.strip() for m in messages if m.role in ("system", "developer")]
    turns = [m for m in messages if m.role in ("user", "assistant")]
    if len(turns) == 1:
        return "\n\n".join(system + [turns[0].content.strip()])
    lines = [f"{m.role.capitalize()}: {m.content.strip()}" for m in turns] + ["Assistant:"]
    return "\n\n".join(system + ["\n".join(lines)])


class Tokenize(BaseModel):
    """POST /tokenize, as vLLM takes it: a prompt, or a chat's messages (the one prompt they map to)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True  # T5's: the end-of-text token after the text
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def one_text(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages")
        if self.prompt is not None:
            valid_unicode(self.prompt, "the prompt")
        return self

    @field_validator("messages")
    @classmethod
    def as_chat_takes_them(cls, messages):
        return None if messages is None else conversation(messages)

    @property
    def text(self) -> str:
        return self.prompt if self.prompt is not None else chat_prompt(self.messages)


class Detokenize(BaseModel):
    """POST /detokenize: token ids back to text, special tokens included."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]
