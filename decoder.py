"""Regular decoding and draft-and-verify speculative decoding for T5, and the text-level API.

    models = model.load("mlx_models/t5-11b", draft="mlx_models/t5-small")
    text = generate(models, "translate English to German: Good morning.", num_draft=5)
    for response in stream_generate(models, prompt):
        print(response.text, end="", flush=True)

    generations = batch_generate(models, prompts, batch_size=8)   # many prompts, decoded together
    texts = [g.text for g in generations]

Underneath, `regular_batch` and `speculative_batch` decode a batch of
prompts whose rows move independently (each its own cache lengths and
accepted drafts); `regular_generate` and `speculative_generate` are their
one-prompt forms, generators of token ids. All turn logits into a sampling
distribution with the same `logits_to_probs`, and update `Stats` as they go.
"""

import math
import numbers
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Iterator

import cpu  # before mlx.core
import mlx.core as mx

from model import T5, DecoderCache, Models, T5Error


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


def encode_prompts(model: T5, prompts: list[list[int]]) -> DecoderCache:
    """Encode prompts together (padded on the right and masked, when their
    lengths differ) into a fresh decoder cache. The prompts' products, of
    many rows, are computed here, apart from decoding's few-row ones: the
    CPU's BLAS wants them done differently."""
    started = time.perf_counter()
    length = max(len(prompt) for prompt in prompts)
    tokens = mx.array([prompt + [model.args.pad_token_id] * (length - len(prompt)) for prompt in prompts])
    mask = None
    if any(len(prompt) < length for prompt in prompts):
        mask = mx.array([[1] * len(prompt) + [0] * (length - len(prompt)) for prompt in prompts])
    with cpu.many_rows():
        cache = model.make_cache(model.encode(tokens, mask), mask)
        mx.eval(cache.cross_keys_values)
    seconds = time.perf_counter() - started
    if seconds > 0.5:  # long enough to measure the speed by
        model.encoding_rate = len(prompts) * encoding_flops(model, length) / seconds
    return cache


def start_decoding(model: T5, prompt: list[int]) -> tuple[DecoderCache, mx.array]:
    """One prompt's cache, and the decoder's first input."""
    return encode_prompts(model, [prompt]), mx.array([model.args.decoder_start_token_id])


@dataclass
class Row:
    """One prompt's place in a batch: `index` in the caller's list."""

    index: int
    stats: Stats
    started: float
    produced: int = 0
    last: int = 0  # speculative: the token the target has not seen
    unseen: list = None  # speculative: the tokens the draft has not seen

    def emit(self, tokens: list[int], eos: int | None, max_tokens: int):
        """Yield (index, token, finished) for each token the row decided,
        counting it as it goes; the output ends at EOS (itself not output,
        token None when it came first) or at max_tokens. Returns finished."""
        finished = eos in tokens
        tokens = tokens[: tokens.index(eos)] if finished else tokens
        for i, token in enumerate(tokens):
            self.produced += 1
            self.stats.generated += 1
            self.stats.seconds = time.perf_counter() - self.started
            yield self.index, token, i == len(tokens) - 1 and (finished or self.produced >= max_tokens)
        if not tokens:
            self.stats.seconds = time.perf_counter() - self.started
            yield self.index, None, True
        return finished or self.produced >= max_tokens


class Batch:
    """The rows decoding together and their caches, row i in row i of each
    cache. A finished row leaves at once. Waiting prompts join when half the
    batch is free (or all of them fit), encoded together as they join: a
    prompt encoded alone costs up to twice as much (bench.py batch)."""

    def __init__(self, models: list[T5], prompts: list[list[int]], stats: list[Stats], batch_size: int):
        self.models, self.prompts, self.stats, self.batch_size = models, prompts, stats, batch_size
        self.waiting = list(range(len(prompts)))[::-1]  # popped from the end: input order
        self.rows: list[Row] = []
        self.caches: list[DecoderCache] = []

    def join(self, first_step: Callable | None = None):
        """Start waiting prompts if there is room enough. first_step(caches), if
        given, runs on the joining rows' own caches before they merge; its
        result is returned (None when no prompt joined)."""
        count = min(self.batch_size - len(self.rows), len(self.waiting))
        if count == 0 or count < min(len(self.waiting), self.batch_size // 2):
            return None
        started = time.perf_counter()
        indices = [self.waiting.pop() for _ in range(count)]
        prompts = [self.prompts[i] for i in indices]
        caches = [encode_prompts(model, prompts) for model in self.models]
        result = first_step(caches) if first_step else None
        if self.caches:
            for mine, theirs in zip(self.caches, caches):
                mine.extend(theirs)
        else:
            self.caches = caches
        for i, prompt in zip(indices, prompts):
            self.stats[i].prompt_tokens = len(prompt)
            self.rows.append(Row(i, self.stats[i], started, unseen=[]))
        return result

    def leave(self, finished: set[int]) -> list[int]:
        """Drop the finished rows (positions in the batch); the positions kept."""
        kept = [i for i in range(len(self.rows)) if i not in finished]
        if finished:
            self.rows = [self.rows[i] for i in kept]
            if kept:
                longest = max(len(self.prompts[row.index]) for row in self.rows)
                for cache in self.caches:
                    cache.keep(kept, longest)
            else:
                self.caches = []
        return kept


def regular_batch(model: T5, prompts: list[list[int]], max_tokens: int, sampling: Sampling, stats: list[Stats],
                  batch_size: int = 8, stop_at_eos: bool = True) -> Iterator[tuple[int, int | None, bool]]:
    """Decode prompts with the model alone, batch_size rows at a time, and
    yield (prompt index, token, finished) as each row's token is read (None
    when it read EOS). Every row advances one token a step.

    Each step is built and queued before the previous one's tokens are read
    back, so Python work overlaps the model's compute (a row that finishes
    wastes that queued step). benchmarks pass stop_at_eos=False to time a
    fixed number of tokens.
    """
    if max_tokens < 1:
        return
    batch = Batch([model], prompts, stats, batch_size)
    eos = model.args.eos_token_id if stop_at_eos else None
    start = model.args.decoder_start_token_id

    def step(tokens: mx.array, cache: DecoderCache) -> mx.array:
        token = sample(model.decode(tokens[:, None], cache)[:, -1], sampling)
        mx.async_eval(token)
        return token

    def first_step(caches: list[DecoderCache]) -> mx.array:  # the joining rows' first tokens
        return step(mx.array([start] * len(caches[0].offsets)), caches[0])

    tokens = batch.join(first_step)
    while batch.rows:
        if any(row.produced + 1 < max_tokens for row in batch.rows):  # else no row reads it
            queued = step(tokens, batch.caches[0])
        finished = set()
        for position, (row, value) in enumerate(zip(batch.rows, tokens.tolist())):
            row.stats.target_calls += 1
            if (yield from row.emit([value], eos, max_tokens)):
                finished.add(position)
        kept = batch.leave(finished)
        tokens = (queued[mx.array(kept)] if finished else queued) if kept else None
        joined = batch.join(first_step)
        if joined is not None:
            tokens = joined if tokens is None else mx.concatenate([tokens, joined])


def regular_generate(model: T5, prompt: list[int], max_tokens: int, sampling: Sampling, stats: Stats | None = None,
                     stop_at_eos: bool = True) -> Iterator[int]:
    """Yield up to max_tokens ids from the model alone: a batch of one."""
    for _, token, _ in regular_batch(model, [prompt], max_tokens, sampling, [stats if stats is not None else Stats()],
                                     1, stop_at_eos):
        if token is not None:
            yield token


def accept_mask(target_logits, draft_logits, drafts, sampling: Sampling, delta: float, u=None) -> mx.array:
    """Which of the k drafts pass the acceptance rule, each on its own:
    drafts (..., k) -> (..., k) bool, target_logits (..., k + 1 or k, V).

    Sampling: accept x when max(u - delta, 0) <= p(x) / q(x), u ~ U[0, 1), with
    p, q the target's and draft's distributions after temperature/top-k/top-p.
    Greedy: accept x when p(x) >= (1 - delta) max p (p at temperature 1).
    delta = 0 is exact (speculative sampling / the target's argmax); delta = 1
    accepts everything; a larger delta never accepts less.
    """
    k = drafts.shape[-1]
    scores = target_logits[..., :k, :]
    if sampling.temp == 0:
        if delta == 0:  # exactly regular greedy's choice, ties included
            return drafts == mx.argmax(scores, axis=-1)
        # In log space: logit(x) - max logit >= log(1 - delta).
        chosen = mx.take_along_axis(scores, drafts[..., None], axis=-1)[..., 0]
        threshold = math.log(1 - delta) if delta < 1 else -math.inf
        return (chosen - scores.max(axis=-1)) >= threshold
    return accept_sampled(logits_to_probs(scores, sampling), logits_to_probs(draft_logits, sampling), drafts, delta, u)


def accept_sampled(p, q, drafts, delta: float, u=None) -> mx.array:
    """The sampling rule on distributions already computed: (..., k, V) each."""
    p_x = mx.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = mx.random.uniform(shape=drafts.shape) if u is None else u
    return mx.maximum(u - delta, 0) * q_x <= p_x  # q_x > 0: x was drawn from q


def verify(target_logits, draft_logits, drafts, sampling: Sampling, delta: float, limits: mx.array):
    """Decide, on the device, how many drafts the target accepts in each row and the token it adds.

    target_logits (B, k+1, V): the target's scores after each row's last
    accepted token and after each draft; draft_logits (B, k, V) and drafts
    (B, k): what the draft saw and chose. Row b weighs only its first
    limits[b] drafts (a row near max_tokens wants fewer than the batch drafted).
    Returns (number accepted, next token), each (B,): the correction at the
    first rejection, or the bonus token after the row's drafts all pass.
    Greedy: the target's argmax. Sampling: drawn from max(0, p - q)
    normalised (p if that is all zeros, and where the row had no draft),
    which makes delta = 0 exact speculative sampling.
    """
    B, k = drafts.shape
    weighed = mx.arange(k)[None] < limits[:, None]
    if sampling.temp == 0:
        accept = accept_mask(target_logits, draft_logits, drafts, sampling, delta)
        next_tokens = mx.argmax(target_logits, axis=-1)
    else:  # each distribution computed once, for the rule and the residual
        p = logits_to_probs(target_logits, sampling)
        q = mx.where(weighed[..., None], logits_to_probs(draft_logits, sampling), 0.0) if k else mx.zeros((B, 0, p.shape[-1]))
        accept = accept_sampled(p[:, :k], q, drafts, delta)
        residual = mx.maximum(p - mx.concatenate([q, mx.zeros((B, 1, p.shape[-1]))], axis=1), 0)
        mass = residual.sum(axis=-1, keepdims=True)
        residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p)
        next_tokens = mx.random.categorical(mx.log(residual))
    num_accepted = mx.cumprod((accept & weighed).astype(mx.int32), axis=-1).sum(axis=-1)
    return num_accepted, mx.take_along_axis(next_tokens, num_accepted[:, None], axis=-1)[:, 0]


def draft_tokens(draft: T5, cache: DecoderCache, rows: list[Row], k: int, sampling: Sampling) -> tuple[mx.array, mx.array]:
    """k tokens drafted for every row, one draft call each and no host sync:
    (drafts (B, k), the draft's logits (B, k, V)). The first call feeds each
    row's unseen tokens (one or two), padded on the right where they differ;
    the padding's cache positions are trimmed at once."""
    lengths = [len(row.unseen) for row in rows]
    width = max(lengths)
    inputs = mx.array([row.unseen + [0] * (width - len(row.unseen)) for row in rows])
    drafts, logits = [], []
    for i in range(k):
        scores = draft.decode(inputs, cache)
        if i == 0 and width > 1:
            last = mx.array(lengths)[:, None, None] - 1
            scores = mx.take_along_axis(scores, last, axis=1)
            cache.trim([width - n for n in lengths])
        scores = scores[:, -1]
        token = sample(scores, sampling)
        mx.async_eval(token)
        drafts.append(token)
        logits.append(scores)
        inputs = token[:, None]
    return mx.stack(drafts, axis=1), mx.stack(logits, axis=1)


def speculative_batch(target: T5, draft: T5, prompts: list[list[int]], max_tokens: int, sampling: Sampling,
                      num_draft: int, delta: float, stats: list[Stats],
                      batch_size: int = 8) -> Iterator[tuple[int, int | None, bool]]:
    """Decode prompts batch_size rows at a time, and yield (prompt index,
    token, finished) for each new token of each row after each round: the draft proposes
    num_draft tokens for every row, the target scores them all in one pass,
    and each row keeps its own accepted prefix, rolling back its own caches.

    Invariants between rounds, per row: the target's cache holds every
    token but `last`; the draft's every token but those in `unseen` (`last`,
    and the final draft after a full acceptance, which it never ran on).
    """
    batch = Batch([target, draft], prompts, stats, batch_size)
    eos, start = target.args.eos_token_id, target.args.decoder_start_token_id
    while True:
        batch.join()
        rows = batch.rows
        if not rows:
            return
        for row in rows:
            if not row.unseen:  # just joined
                row.last, row.unseen = start, [start]
        target_cache, draft_cache = batch.caches
        limits = [min(num_draft, max_tokens - row.produced - 1) for row in rows]  # drafts past max_tokens are wasted
        k = max(limits)
        # 1. Draft k tokens for every row.
        drafts, draft_logits = draft_tokens(draft, draft_cache, rows, k, sampling) if k else (None, None)
        # 2. The target scores each row's `last` and drafts in one pass.
        lasts = mx.array([[row.last] for row in rows])
        target_logits = target.decode(mx.concatenate([lasts, drafts], axis=1) if k else lasts, target_cache)
        if k:
            num_accepted, next_tokens = verify(target_logits, draft_logits, drafts, sampling, delta, mx.array(limits))
        else:
            num_accepted, next_tokens = mx.zeros((len(rows),), mx.int32), sample(target_logits[:, 0], sampling)
            drafts = mx.zeros((len(rows), 0), mx.int32)
        mx.eval(num_accepted, next_tokens, drafts)  # the round's one host sync
        # 3. Each row takes its accepted prefix; both caches roll back to it.
        finished = set()
        for position, (row, accepted, token, drafted) in enumerate(
                zip(rows, num_accepted.tolist(), next_tokens.tolist(), drafts.tolist())):
            limit = limits[position]
            new_tokens = drafted[:accepted] + [token]
            counted = limit
            if eos in new_tokens[:accepted]:  # drafts after an accepted EOS never reach the output: not counted
                counted = accepted = new_tokens.index(eos) + 1
            row.stats.target_calls += 1
            row.stats.draft_calls += limit
            row.stats.drafted += counted
            row.stats.accepted += accepted
            if k:
                row.unseen = new_tokens[-2:] if accepted == k else new_tokens[-1:]
            else:
                row.unseen = row.unseen + new_tokens
            row.last = new_tokens[-1]
            if (yield from row.emit(new_tokens, eos, max_tokens)):
                finished.add(position)
        target_cache.trim([k - a for a in num_accepted.tolist()])
        if k:
            draft_cache.trim([k - 1 - min(a, k - 1) for a in num_accepted.tolist()])
        batch.leave(finished)


def speculative_generate(target: T5, draft: T5, prompt: list[int], max_tokens: int, sampling: Sampling,
                         num_draft: int, delta: float, stats: Stats | None = None) -> Iterator[int]:
    """Yield up to max_tokens ids of one prompt: a batch of one."""
    for _, token, _ in speculative_batch(target, draft, [prompt], max_tokens, sampling, num_draft, delta,
                                         [stats if stats is not None else Stats()], 1):
        if token is not None:
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


BATCH_SIZE = Knob("batch_size", int, lambda v: v >= 1, "an integer >= 1", "prompts decoded together")


def tokenize(models: Models, prompts: list[str]) -> list[list[int]]:
    """Each prompt's ids. OptionError for an empty prompt; a warning for
    prompts longer than T5 was trained on."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise OptionError(f"prompts must be a non-empty list of strings (got {type(prompts).__name__})")
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise OptionError("the prompt is empty" if len(prompts) == 1 else f"prompt {number} of {len(prompts)} is empty")
    ids = [models.tokenizer.encode(prompt) for prompt in prompts]
    longest = max(len(i) for i in ids)
    if longest > TRAINED_LENGTH:
        which = "the prompt has" if len(ids) == 1 else f"{sum(len(i) > TRAINED_LENGTH for i in ids)} prompt(s) have up to"
        warnings.warn(f"{which} {longest:,} tokens, more than the {TRAINED_LENGTH} T5 was trained on: "
                      "the output may suffer", RuntimeWarning, stacklevel=4)
    return ids


def decode_batch(models: Models, ids: list[list[int]], settings: Settings, stats: list[Stats],
                 batch_size: int) -> Iterator[tuple[int, int | None, bool]]:
    """(prompt index, token, finished) as rows decide them (Row.emit): speculative
    decoding when a draft is loaded and settings.speculative, else the target
    alone. The seed is set when decoding starts."""
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    if settings.speculative and models.draft is not None:
        yield from speculative_batch(models.target, models.draft, ids, settings.max_tokens, settings.sampling,
                                     settings.num_draft, settings.delta, stats, batch_size)
    else:
        yield from regular_batch(models.target, ids, settings.max_tokens, settings.sampling, stats, batch_size)


def generate_tokens(models: Models, prompt: str, settings: Settings, stats: Stats) -> Iterator[int]:
    """One prompt's token ids as they are decided; the prompt is checked now."""
    ids = tokenize(models, [prompt])
    return (token for _, token, _ in decode_batch(models, ids, settings, [stats], 1) if token is not None)


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


def measure_batch(models: Models, prompts: list[str], settings: Settings, batch_size: int) -> Stats:
    """Every prompt's statistics summed, with seconds the wall-clock time of
    the whole batch run (for timings)."""
    ids = tokenize(models, prompts)
    stats = [Stats() for _ in ids]
    started = time.perf_counter()
    for _ in decode_batch(models, ids, settings, stats, batch_size):
        pass
    return replace(sum(stats, Stats()), seconds=time.perf_counter() - started)


def warm_up(models: Models, prompt: str, settings: Settings = Settings()) -> None:
    """A few tokens of each decoding path, so that first-call costs (compiling
    kernels, growing the allocator's pools) stay out of timings."""
    for speculative in (False, True) if models.draft is not None else (False,):
        measure(models, prompt, replace(settings, max_tokens=4, speculative=speculative))


@dataclass
class Generation:
    """One prompt's whole generation: its text and token ids, its own
    statistics (seconds count from when its row joined the batch), and why
    it stopped, "eos" or "length"."""

    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str


def stream_batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> Iterator[Generation]:
    """Decode prompts batch_size at a time and yield each one's Generation
    in input order, as soon as it and every prompt before it are done. Rows
    move independently: each accepts its own drafts, a finished row leaves
    the batch and waiting prompts take its place. Greedy at delta 0, each
    text equals `generate` on its prompt alone. Options as for
    stream_generate; they, batch_size and every prompt are checked at the call."""
    settings = Settings.of(options)
    BATCH_SIZE.check(batch_size)
    ids = tokenize(models, prompts)
    stats = [Stats() for _ in prompts]

    def generations():
        tokens, done, next_out = [[] for _ in prompts], [False] * len(prompts), 0
        for index, token, finished in decode_batch(models, ids, settings, stats, batch_size):
            tokens[index] += [] if token is None else [token]
            done[index] = finished
            while next_out < len(prompts) and done[next_out]:
                row = stats[next_out]
                finish = "length" if row.generated == settings.max_tokens else "eos"
                yield Generation(Detokenizer(models.tokenizer).decode(tokens[next_out]), tokens[next_out], row, finish)
                next_out += 1

    return generations()


def batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> list[Generation]:
    """Every prompt's Generation, in input order (`[g.text for g in ...]`
    for the texts); options as for stream_batch_generate."""
    return list(stream_batch_generate(models, prompts, batch_size=batch_size, **options))
