"""Regular decoding and draft-and-verify speculative decoding for T5, and the text-level API.

    models = model.load("mlx_models/t5-11b", draft="mlx_models/t5-small")
    text = generate(models, "translate English to German: Good morning.", num_draft=5)
    for response in stream_generate(models, prompt):
        print(response.text, end="", flush=True)

Underneath, `regular_generate` and `speculative_generate` are generators of
token ids that update a `Stats` object as they go. Both turn logits into a
sampling distribution with the same `logits_to_probs`.
"""

import math
import numbers
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Iterator

import cpu  # before mlx.core
import mlx.core as mx

from model import T5, Models, T5Error


class OptionError(T5Error, ValueError):
    """A generation option out of its range."""


@dataclass(frozen=True)
class Knob:
    """One generation option: its keyword here, `--name-with-dashes` on the
    command line, `:name-with-dashes` in the interactive loop, and a list of
    values in a sweep. Errors name it as the caller's `label` does."""

    name: str
    type: type  # int or float
    valid: Callable
    expected: str  # what `valid` accepts, for messages
    help: str
    optional: bool = False  # None (or "none") allowed

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def check(self, value, label: str | None = None):
        """value, if this knob takes it; OptionError otherwise."""
        if value is None and self.optional:
            return value
        kind = numbers.Real if self.type is float else numbers.Integral
        if not isinstance(value, kind) or isinstance(value, bool) or not self.valid(value):
            raise OptionError(f"{label or self.name} must be {self.expected} (got {value!r})")
        return value

    def parse(self, text: str, label: str | None = None):
        """A value from text, checked; errors quote the text."""
        if self.optional and text.strip().lower() == "none":
            return None
        try:
            return self.check(self.type(text), label)
        except (ValueError, OptionError):
            raise OptionError(f"{label or self.name} must be {self.expected} (got '{text}')")


KNOBS = {knob.name: knob for knob in [
    Knob("num_draft", int, lambda v: v >= 1, "an integer >= 1", "draft tokens per verify step"),
    Knob("delta", float, lambda v: 0 <= v <= 1, "a number in [0, 1]",
         "acceptance lenience in [0, 1]: 0 exact, 1 accepts every draft"),
    Knob("temp", float, lambda v: 0 <= v < math.inf, "a finite number >= 0", "sampling temperature; 0 is greedy"),
    Knob("top_k", int, lambda v: v >= 0, "an integer >= 0", "sample from the k most likely tokens (0: all)"),
    Knob("top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]", "nucleus sampling mass (1: off)"),
    Knob("max_tokens", int, lambda v: v >= 1, "an integer >= 1", "most tokens to generate"),
    Knob("seed", int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)",
         "random seed for sampling (default: random)", optional=True),
]}


@dataclass(frozen=True)
class Settings:
    """Every option of one generation, each checked against its knob."""

    max_tokens: int = 100
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_draft: int = 5
    delta: float = 0.0
    speculative: bool = True  # with a draft loaded; False: the target alone

    def __post_init__(self):
        for name, knob in KNOBS.items():
            knob.check(getattr(self, name))
        if not isinstance(self.speculative, bool):
            raise OptionError(f"speculative must be True or False (got {self.speculative!r})")

    @classmethod
    def of(cls, options: dict) -> "Settings":
        """From keyword options; an unknown one is named with those there are."""
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown option {sorted(unknown)[0]!r} (options: {', '.join(f.name for f in fields(cls))})")
        return cls(**options)

    @property
    def sampling(self) -> "Sampling":
        return Sampling(self.temp, self.top_k, self.top_p)


@dataclass
class Sampling:
    temp: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.generated / self.target_calls if self.target_calls else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second,
                "acceptance_rate": self.acceptance_rate, "tokens_per_target_call": self.tokens_per_target_call}


def logits_to_probs(logits: mx.array, sampling: Sampling) -> mx.array:
    """Logits (..., vocab) -> float32 probabilities after temperature, top-k and top-p."""
    assert sampling.temp > 0, "greedy decoding takes the argmax, it has no distribution"
    logits = logits.astype(mx.float32) / sampling.temp
    if 0 < sampling.top_k < logits.shape[-1]:
        kth_largest = mx.sort(logits, axis=-1)[..., -sampling.top_k][..., None]
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < sampling.top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(logits: mx.array, sampling: Sampling) -> mx.array:
    """One token per row of logits (..., vocab) -> (...)."""
    if sampling.temp == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(mx.log(logits_to_probs(logits, sampling)))


TRAINED_LENGTH = 512  # T5's pre-training inputs; longer ones work, less well
# Encoding speed (flops/s) assumed until a model's first long prompt measures
# its own: roughly what 2 x86 cores did on T5-large and the demo target (bench.py encode).
ASSUMED_ENCODING_RATE = 30e9 if mx.default_device() == mx.cpu else 1e12


def encoding_flops(model: T5, tokens: int) -> float:
    """The work of encoding a prompt: its products (2 flops per weight and
    token, cross-attention keys and values included) and attention, which
    grows with the square of the length."""
    a = model.args
    inner = a.num_heads * a.d_kv
    ffn = (3 if a.feed_forward_proj.startswith("gated") else 2) * a.d_model * a.d_ff
    per_token = 2 * a.num_layers * (4 * a.d_model * inner + ffn) + 2 * a.num_decoder_layers * 2 * a.d_model * inner
    return tokens * per_token + 4 * a.num_layers * tokens * tokens * inner


def encoding_seconds(model: T5, tokens: int) -> float:
    """A rough estimate, from the speed the model's earlier prompts were encoded at."""
    return encoding_flops(model, tokens) / getattr(model, "encoding_rate", ASSUMED_ENCODING_RATE)


def start_decoding(model: T5, prompt: list[int]):
    """Encode the prompt and return (cache, first decoder input). The
    prompt's products, of many rows, are computed here, apart from
    decoding's few-row ones: the CPU's BLAS wants them done differently."""
    started = time.perf_counter()
    with cpu.many_rows():
        cache = model.make_cache(model.encode(mx.array([prompt])))
        mx.eval(cache.cross_keys_values)
    seconds = time.perf_counter() - started
    if seconds > 0.5:  # long enough to measure the speed by
        model.encoding_rate = encoding_flops(model, len(prompt)) / seconds
    return cache, mx.array([model.args.decoder_start_token_id])


def regular_generate(model: T5, prompt: list[int], max_tokens: int, sampling: Sampling, stats: Stats | None = None,
                     stop_at_eos: bool = True):
    """Yield up to max_tokens ids from the model alone, stopping at EOS
    (benchmarks turn that off to time a fixed number of tokens).

    The next step's graph is built and queued before the current token is read
    back, so Python work overlaps the model's compute. After EOS that queued
    step is wasted; target_calls counts only the steps whose token was read.
    """
    stats = stats if stats is not None else Stats()
    if max_tokens < 1:
        return
    started = time.perf_counter()
    cache, token = start_decoding(model, prompt)
    eos = model.args.eos_token_id

    def step(token: mx.array) -> mx.array:
        logits = model.decode(token[:, None], cache)[:, -1]
        return sample(logits, sampling)

    token = step(token)
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_token = step(token)
            mx.async_eval(next_token)
        value = token.item()
        stats.target_calls += 1
        if value == eos and stop_at_eos:
            break
        stats.generated += 1
        stats.seconds = time.perf_counter() - started
        yield value
        if n + 1 < max_tokens:
            token = next_token
    stats.seconds = time.perf_counter() - started


def accept_mask(target_logits, draft_logits, drafts, sampling: Sampling, delta: float, u=None) -> mx.array:
    """Which of the k drafts pass the acceptance rule, each on its own (k,) bool.

    Sampling: accept x when max(u - delta, 0) <= p(x) / q(x), u ~ U[0, 1), with
    p, q the target's and draft's distributions after temperature/top-k/top-p.
    Greedy: accept x when p(x) >= (1 - delta) max p (p at temperature 1).
    delta = 0 is exact (speculative sampling / the target's argmax); delta = 1
    accepts everything; a larger delta never accepts less.
    """
    k = drafts.shape[0]
    if sampling.temp == 0:
        if delta == 0:  # exactly regular greedy's choice, ties included
            return drafts == mx.argmax(target_logits[:k], axis=-1)
        # In log space: logit(x) - max logit >= log(1 - delta).
        chosen = mx.take_along_axis(target_logits[:k], drafts[:, None], axis=-1)[:, 0]
        threshold = math.log(1 - delta) if delta < 1 else -math.inf
        return (chosen - target_logits[:k].max(axis=-1)) >= threshold
    return accept_sampled(logits_to_probs(target_logits[:k], sampling), logits_to_probs(draft_logits, sampling), drafts, delta, u)


def accept_sampled(p, q, drafts, delta: float, u=None) -> mx.array:
    """The sampling rule on distributions already computed: (k, V) each."""
    p_x = mx.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=drafts.shape) if u is None else u
    return mx.maximum(u - delta, 0) * q_x <= p_x  # q_x > 0: x was drawn from q


def verify(target_logits, draft_logits, drafts, sampling: Sampling, delta: float):
    """Decide, on the device, how many drafts the target accepts and the token it adds.

    target_logits (k+1, V): the target's scores after the last accepted token and
    after each draft; draft_logits (k, V) and drafts (k,): what the draft saw and chose.
    Returns (number accepted, next token): the correction at the first
    rejection, or the bonus token after k acceptances. Greedy: the target's
    argmax. Sampling: drawn from max(0, p - q) normalised (p if that is all
    zeros), which makes delta = 0 exact speculative sampling.
    """
    k = drafts.shape[0]
    if sampling.temp == 0:
        accept = accept_mask(target_logits, draft_logits, drafts, sampling, delta) if k else mx.zeros((0,), mx.bool_)
        next_tokens = mx.argmax(target_logits, axis=-1)
    else:  # each distribution computed once, for the rule and the residual
        p = logits_to_probs(target_logits, sampling)
        q = logits_to_probs(draft_logits, sampling) if k else mx.zeros((0, p.shape[-1]))
        accept = accept_sampled(p[:k], q, drafts, delta)
        # Position k (all accepted) has no draft: its residual is p itself.
        residual = mx.maximum(p - mx.concatenate([q, mx.zeros((1, p.shape[-1]))]), 0)
        mass = residual.sum(axis=-1, keepdims=True)
        residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p)
        next_tokens = mx.random.categorical(mx.log(residual))
    num_accepted = mx.cumprod(accept.astype(mx.int32)).sum() if k else mx.array(0)
    return num_accepted, next_tokens[num_accepted]


def speculative_generate(target: T5, draft: T5, prompt: list[int], max_tokens: int, sampling: Sampling,
                         num_draft: int, delta: float, stats: Stats | None = None):
    """Yield up to max_tokens ids: each round the draft proposes num_draft
    tokens, the target scores them all in one pass, and both caches are
    trimmed back to the accepted prefix.

    Invariants between rounds: the target's cache holds every token but
    `last`; the draft's holds every token but those in `unseen` (`last`,
    and the final draft after a full acceptance, which it never ran on).
    """
    stats = stats if stats is not None else Stats()
    started = time.perf_counter()
    target_cache, start = start_decoding(target, prompt)
    draft_cache, _ = start_decoding(draft, prompt)
    last, unseen = start.item(), [start.item()]
    eos, produced = target.args.eos_token_id, 0
    while produced < max_tokens:
        k = min(num_draft, max_tokens - produced - 1)  # drafts past max_tokens are wasted
        # 1. Draft k tokens, one draft call each; no host sync in between.
        drafts, draft_logits, inputs = [], [], mx.array([unseen])
        for _ in range(k):
            logits = draft.decode(inputs, draft_cache)[0, -1:]
            token = sample(logits, sampling)
            mx.async_eval(token)
            drafts.append(token)
            draft_logits.append(logits)
            inputs = token[None]
        # 2. The target scores `last` and every draft in one pass.
        verify_input = mx.concatenate([mx.array([last])] + drafts)[None]
        target_logits = target.decode(verify_input, target_cache)[0]
        draft_tokens = mx.concatenate(drafts) if k else mx.zeros((0,), mx.int32)
        draft_scores = mx.concatenate(draft_logits) if k else None
        num_accepted, next_token = verify(target_logits, draft_scores, draft_tokens, sampling, delta)
        mx.eval(num_accepted, next_token, draft_tokens)  # the round's one host sync
        accepted = num_accepted.item()
        new_tokens = draft_tokens[:accepted].tolist() + [next_token.item()]
        drafted = k
        if eos in new_tokens[:accepted]:  # drafts after an accepted EOS never reach the output: not counted
            drafted = accepted = new_tokens.index(eos) + 1
            new_tokens = new_tokens[:accepted]
        stats.target_calls += 1
        stats.draft_calls += k
        stats.drafted += drafted
        stats.accepted += accepted
        # 3. Roll both caches back to the accepted prefix.
        target_cache.trim(k - accepted)
        if k:
            draft_cache.trim(k - 1 - min(accepted, k - 1))
            unseen = new_tokens[-2:] if accepted == k else new_tokens[-1:]
        else:
            unseen = unseen + new_tokens
        last = new_tokens[-1]
        for token in new_tokens:
            if token == eos:
                stats.seconds = time.perf_counter() - started
                return
            produced += 1
            stats.generated += 1
            stats.seconds = time.perf_counter() - started
            yield token


# ---------------------------------------------------------------- text


class Detokenizer:
    """Text from token ids as they come, equal to decoding them all at once.

    Each token decodes a short window: the tokens since the last piece of
    text was settled, twice (with and without the new ones). The difference
    is the new text, held back while it ends in an incomplete character. The
    window restarts after every emitted piece, so the work per token follows
    the new piece, not the length of the output. Decoding never "cleans up"
    spaces before punctuation (an old transformers default, off since v5):
    that would take back a space already shown."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = []
        self.start = 0  # first token of the window
        self.settled = 0  # tokens already turned into emitted text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """The text this token adds; "" while it is held back."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.settled = self.settled, len(self.tokens)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as \ufffd)."""
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        self.start = self.settled = len(self.tokens)
        return after[len(before) :]


@dataclass
class Response:
    """One step of `stream_generate`: the new piece of text, the token that
    made it, and the statistics so far. The last response has token None,
    carries any text held back until the end, and says why generation
    stopped: finish_reason "eos" or "length"."""

    text: str
    token: int | None
    stats: Stats
    finish_reason: str | None = None


def generate_tokens(models: Models, prompt: str, settings: Settings, stats: Stats) -> Iterator[int]:
    """Token ids as they are decided: speculative decoding when a draft is
    loaded and settings.speculative, else the target alone. The prompt is
    checked now; the seed is set when decoding starts."""
    if not prompt.strip():
        raise OptionError("the prompt is empty")
    ids = models.tokenizer.encode(prompt)
    stats.prompt_tokens = len(ids)
    if len(ids) > TRAINED_LENGTH:
        warnings.warn(f"the prompt has {len(ids):,} tokens, more than the {TRAINED_LENGTH} T5 was trained on: "
                      "the output may suffer", RuntimeWarning, stacklevel=3)

    def tokens():
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        if settings.speculative and models.draft is not None:
            yield from speculative_generate(models.target, models.draft, ids, settings.max_tokens, settings.sampling,
                                            settings.num_draft, settings.delta, stats)
        else:
            yield from regular_generate(models.target, ids, settings.max_tokens, settings.sampling, stats)

    return tokens()


def stream_generate(models: Models, prompt: str, **options) -> Iterator[Response]:
    """Yield a Response as each token is decided. Options, all keywords:
    max_tokens=100, num_draft=5, delta=0.0, temp=0.0, top_k=0, top_p=1.0,
    seed=None (reseeds MLX's global generator), speculative=True (False: the
    target alone, even with a draft). Options and the prompt are checked at
    the call, before any decoding: OptionError names one out of range."""
    settings = Settings.of(options)
    stats = Stats()
    tokens = generate_tokens(models, prompt, settings, stats)
    detokenizer = Detokenizer(models.tokenizer)

    def responses():
        for token in tokens:
            yield Response(detokenizer.add(token), token, replace(stats))  # stats as they are now
        finish = "length" if stats.generated == settings.max_tokens else "eos"
        yield Response(detokenizer.flush(), None, replace(stats), finish)

    return responses()


def generate(models: Models, prompt: str, **options) -> str:
    """The generated text; options as for stream_generate."""
    return "".join(response.text for response in stream_generate(models, prompt, **options))


def measure(models: Models, prompt: str, settings: Settings) -> Stats:
    """The statistics of one generation, its text unused (for timings)."""
    stats = Stats()
    for _ in generate_tokens(models, prompt, settings, stats):
        pass
    return stats


def warm_up(models: Models, prompt: str, settings: Settings = Settings()) -> None:
    """A few tokens of each decoding path, so that first-call costs (compiling
    kernels, growing the allocator's pools) stay out of timings."""
    for speculative in (False, True) if models.draft is not None else (False,):
        measure(models, prompt, replace(settings, max_tokens=4, speculative=speculative))
