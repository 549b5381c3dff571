"""The requests the server reads: OpenAI's completion and chat fields, and our knobs beside them.

Each knob is checked against its entry in options.KNOBS, so a request fails
with the message the command line and the API give. `CompletionBody.settings`
turns a request into the Settings its row decodes with.
"""

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from options import KNOBS, Settings

MAX_STOP_STRINGS = 4  # OpenAI's limit


def knob_value(name: str, value, label: str | None = None):
    if value is None:
        return None
    return KNOBS[name].check(value, label or name)


class CompletionBody(BaseModel):
    """The fields of OpenAI's completion request this server reads; `top_k`,
    `num_draft`, `delta` and `prompt_lookup` are its own, `ignore_eos` is
    vLLM's. Others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    num_draft: int | str | None = None
    delta: float | None = None
    prompt_lookup: bool | None = None
    ignore_eos: bool = False  # decode on to max_tokens (benchmarks)

    @field_validator("max_tokens", "top_k", "top_p", "seed", "delta")
    @classmethod
    def in_range(cls, value, info):
        return knob_value(info.field_name, value)

    @field_validator("temperature")
    @classmethod
    def temperature_in_range(cls, value):
        return knob_value("temp", value, "temperature")

    @field_validator("num_draft")
    @classmethod
    def num_draft_in_range(cls, value):
        if isinstance(value, str):
            return KNOBS["num_draft"].parse(value, "num_draft")
        return knob_value("num_draft", value)

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def one_choice(cls, value):
        if value != 1:
            raise ValueError("n must be 1: ask again for more samples (with another seed)")
        return value

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def settings(self, defaults: Settings) -> Settings:
        """The request's Settings: what it gives, over the server's defaults."""
        given = {"max_tokens": self.max_tokens, "temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "seed": self.seed, "num_draft": self.num_draft, "delta": self.delta, "prompt_lookup": self.prompt_lookup}
        chosen = {name: value for name, value in given.items() if value is not None}
        return replace(defaults, **chosen, stop=tuple(self.stop), ignore_eos=self.ignore_eos)


class Completion(CompletionBody):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def non_empty(cls, value):
        prompts = [value] if isinstance(value, str) else value
        if not prompts or not all(p.strip() for p in prompts):
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


class Message(BaseModel):
    role: str
    content: str

    @field_validator("role")
    @classmethod
    def known_role(cls, value):
        if value not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"unknown role {value!r} (system, user or assistant)")
        return value


class ChatCompletion(CompletionBody):
    messages: list[Message]

    @model_validator(mode="after")
    def a_user_speaks(self):
        if not any(m.role == "user" and m.content.strip() for m in self.messages):
            raise ValueError("messages need a user message with some text")
        return self

    @property
    def prompts(self) -> list[str]:
        return [chat_prompt(self.messages)]


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
