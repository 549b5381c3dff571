"""Regular decoding and draft-and-verify speculative decoding for T5, and the text-level API.

    models = loading.load("mlx_models/t5-11b", draft="mlx_models/t5-small")
    text = generate(models, "translate English to German: Good morning.", num_draft=5)
    for response in stream_generate(models, prompt):
        print(response.text, end="", flush=True)

    generations = batch_generate(models, prompts, batch_size=8)   # many prompts, decoded together
    texts = [g.text for g in generations]

Underneath, `regular_batch` and `speculative_batch` decode a batch of
prompts whose rows move independently (each its own cache lengths and
accepted drafts); `regular_generate` and `speculative_generate` are their
one-prompt forms, generators of token ids. Drafts come from the draft model,
num_draft at a time or as many as `AutoDraft` finds worth it
(num_draft="auto"), or from `PromptLookup` (prompt_lookup=True: copies of the
prompt, no draft model). All turn logits into a sampling distribution with
the same `logits_to_probs`, and update `Stats` as they go.
"""

import math
import numbers
import time
import warnings
from dataclasses import asdict, astuple, dataclass, fields, replace
from typing import Callable, Iterator

import cpu  # before mlx.core
import mlx.core as mx

from loading import Models, T5Error
from model import T5, DecoderCache


class OptionError(T5Error, ValueError):
    """A generation option out of its range."""


AUTO = "auto"  # num_draft: adapted as decoding goes (AutoDraft)


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
    words: tuple = ()  # values other than numbers, e.g. "auto"

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def check(self, value, label: str | None = None):
        """value, if this knob takes it; OptionError otherwise."""
        if (value is None and self.optional) or value in self.words:
            return value
        kind = numbers.Real if self.type is float else numbers.Integral
        if not isinstance(value, kind) or isinstance(value, bool) or not self.valid(value):
            raise OptionError(f"{label or self.name} must be {self.expected} (got {value!r})")
        return value

    def parse(self, text: str, label: str | None = None):
        """A value from text, checked; errors quote the text."""
        if self.optional and text.strip().lower() == "none":
            return None
        if text.strip().lower() in self.words:
            return text.strip().lower()
        try:
            return self.check(self.type(text), label)
        except (ValueError, OptionError):
            raise OptionError(f"{label or self.name} must be {self.expected} (got '{text}')")


KNOBS = {knob.name: knob for knob in [
    Knob("num_draft", int, lambda v: v >= 1, "an integer >= 1 or auto",
         "draft tokens per verify step; auto: as many as the draft's confidence makes worth it", words=("auto",)),
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
    num_draft: int | str = 5  # or "auto"
    delta: float = 0.0
    speculative: bool = True  # with a draft loaded or prompt_lookup; False: the target alone
    prompt_lookup: bool = False  # drafts copied from the prompt and the output, not from the draft model

    def __post_init__(self):
        for name, knob in KNOBS.items():
            knob.check(getattr(self, name))
        for name in ("speculative", "prompt_lookup"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be True or False (got {getattr(self, name)!r})")
        if self.prompt_lookup and self.num_draft == AUTO:
            raise OptionError("num-draft 'auto' follows a draft model's confidence: prompt lookup takes a number, "
                              "the longest draft")

    def drafts(self, models: Models) -> bool:
        """Whether decoding drafts and verifies (else the target decodes alone)."""
        return self.speculative and (self.prompt_lookup or models.draft is not None)

    def check_models(self, models: Models) -> "Settings":
        """These settings, if the models can run them; OptionError otherwise."""
        if not isinstance(models, Models):
            shown = f" {models!r}" if isinstance(models, str) else ""
            raise TypeError(f"models must be what loading.load returns (got {type(models).__name__}{shown}): "
                            "models = load(TARGET, draft=DRAFT)")
        if self.num_draft == AUTO and models.draft is None:
            raise OptionError("num-draft 'auto' follows a draft model's confidence, and no draft model is loaded")
        return self

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
    seconds: float = 0.0  # from when the prompt joined its batch: encoding, then decoding
    encoding_seconds: float = 0.0  # the prompt's share of its batch's encoding

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def decoding_seconds(self) -> float:
        return max(self.seconds - self.encoding_seconds, 0.0)

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
        return {**asdict(self), "decoding_seconds": self.decoding_seconds, "tokens_per_second": self.tokens_per_second, "acceptance_rate": self.acceptance_rate,
                "tokens_per_target_call": self.tokens_per_target_call, "drafts_per_round": self.drafts_per_round}


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


def assumed_encoding_rate() -> float:
    """Encoding speed (flops/s) assumed until a long prompt measures it: on
    the CPU path the slow end of what 2 x86 cores did on T5-large and the
    demo target (30-140 G, by machine and length: bench.py encode), so that
    a wait is announced, not missed."""
    return 30e9 if cpu.in_use() else 1e12


def encoding_flops(model: T5, tokens: int) -> float:
    """The work of encoding a prompt: its products (2 flops per weight and
    token, cross-attention keys and values included) and attention (its two
    products, 4 flops per query, key and inner dimension), which grows with
    the square of the length."""
    a = model.args
    inner = a.num_heads * a.d_kv
    ffn = (3 if a.feed_forward_proj.startswith("gated") else 2) * a.d_model * a.d_ff
    per_token = 2 * a.num_layers * (4 * a.d_model * inner + ffn) + 2 * a.num_decoder_layers * 2 * a.d_model * inner
    return tokens * per_token + 4 * a.num_layers * tokens * tokens * inner


def encoders(models: Models, settings: "Settings") -> list[T5]:
    """The models that encode each prompt: the target, and the draft model when it drafts."""
    return [models.target] + ([models.draft] if settings.drafts(models) and not settings.prompt_lookup else [])


def encoding_seconds(models: Models, tokens: int, settings: "Settings") -> float:
    """A rough estimate of a prompt's encoding, from the speed the pair's
    earlier prompts were encoded at."""
    flops = sum(encoding_flops(model, tokens) for model in encoders(models, settings))
    return flops / (models.encoding_rate or assumed_encoding_rate())


def learn_encoding_rate(models: Models, settings: "Settings", stats: Stats) -> None:
    """Keep the speed a prompt was encoded at, when it took long enough to tell."""
    if stats.encoding_seconds > 0.5:
        flops = sum(encoding_flops(model, stats.prompt_tokens) for model in encoders(models, settings))
        models.encoding_rate = flops / stats.encoding_seconds


def encode_prompts(model: T5, prompts: list[list[int]]) -> DecoderCache:
    """Encode prompts together (padded on the right and masked, when their
    lengths differ) into a fresh decoder cache. The prompts' products, of
    many rows, are computed here, apart from decoding's few-row ones: the
    CPU's BLAS wants them done differently."""
    length = max(len(prompt) for prompt in prompts)
    tokens = mx.array([prompt + [model.args.pad_token_id] * (length - len(prompt)) for prompt in prompts])
    mask = None
    if any(len(prompt) < length for prompt in prompts):
        mask = mx.array([[1] * len(prompt) + [0] * (length - len(prompt)) for prompt in prompts])
    with cpu.many_rows():
        cache = model.make_cache(model.encode(tokens, mask), mask)
        mx.eval(cache.cross_keys_values)
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
    lookup: "PromptLookup | None" = None  # prompt lookup: where this row's drafts come from

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
        encoded = time.perf_counter() - started
        result = first_step(caches) if first_step else None
        if self.caches:
            for mine, theirs in zip(self.caches, caches):
                mine.extend(theirs)
        else:
            self.caches = caches
        for i, prompt in zip(indices, prompts):
            self.stats[i].prompt_tokens = len(prompt)
            self.stats[i].encoding_seconds = encoded * len(prompt) / sum(map(len, prompts))
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


class AutoDraft:
    """num_draft="auto": the batch drafts one more token while that token is
    worth its cost,

        a * sum over rows of P(row)  >=  R * d,

    the tokens it is expected to add on the left, what its time would have
    made at the current speed on the right. P(row) is the chance that all of
    the row's drafts so far pass: the product of g(c) over them, c the
    draft's own probability for the token it drafted, and g(c) the share of
    recent drafts of about that confidence (a fifth of [0, 1]) that the
    target accepted; a is the share of all recent drafts accepted (standing
    in for g of a draft whose c is not read yet). A row whose draft ended
    its text has P 0: what follows would never be output. R is the speed
    (tokens a second, all rows); d the seconds one more draft adds to a
    round, its draft step and its share of the target's pass: the slope of
    round seconds against draft steps, the last one measured while rounds
    are all of one length. Only drafts the target judged count (up to each
    row's first rejection), and recent rounds weigh more. So drafting goes
    further after full acceptances and stops sooner after rejections; a slow
    draft, or a fast target, drafts less; a draft whose confidence says
    nothing (it agrees either way) is trusted on its record.

    Step i's confidences are read while step i + 1 runs (a read that waited
    would idle the machine for longer than a step of a small draft), so
    each decision comes one draft late: the second step is decided on `a`
    alone, and a draft found not worth it after its step ran is kept if it
    is worth its share of the target's pass alone. One draft at least,
    `cap` at most; before any timing, drafting goes on while a * sum P >= 0.5.
    `python bench.py drafting` measures it against each fixed num-draft
    (docs/PERFORMANCE.md, "Drafting without tuning")."""

    cap = 8
    decay = 0.95  # the weight of the past against one new round
    cost_decay = 0.98  # for the cost of a draft, which changes slowly
    bins = 5

    def __init__(self):
        self.accepted, self.judged = [0.0] * self.bins, [0.0] * self.bins  # decayed counts by confidence
        self.tokens = self.seconds = 0.0  # decayed sums over rounds
        self.draft_seconds = None
        self.slope = None  # the last slope measured: rounds of one length, all that auto may run, measure none
        self.rounds = [0.0] * 5  # decayed sums of 1, k, k^2, seconds, k * seconds over rounds of k drafts
        self.shapes = set()  # (rows, drafts) of the rounds seen
        self.steps = 0  # draft steps run this round (draft_tokens counts them)

    def bin(self, confidence: float) -> int:
        return min(int(confidence * self.bins), self.bins - 1)

    @property
    def pass_rate(self) -> float:  # a
        judged = sum(self.judged)
        return sum(self.accepted) / judged if judged else 1.0

    def reach(self, previous: float, confidence: float) -> float:
        """P after one more draft of this confidence: g(c), a bin's record
        with one draft at the overall rate added (a bin seldom seen follows a)."""
        b = self.bin(confidence)
        return previous * (self.accepted[b] + self.pass_rate) / (self.judged[b] + 1)

    @property
    def draft_cost(self) -> float:
        """Seconds one more draft adds to a round (d): its draft step, and its
        share of the target's pass, which on a small target is most of it.
        The slope of round seconds against draft steps, once rounds of different
        lengths were seen (and the last slope measured while they are all of
        one length); the draft step alone until then."""
        weight, drafts, squares, seconds, products = self.rounds
        spread = squares / weight - (drafts / weight) ** 2 if weight else 0.0
        if spread >= 0.25:
            self.slope = (products / weight - drafts / weight * seconds / weight) / spread
        return max(self.slope or 0.0, self.draft_seconds)

    def worth(self, reach: list[float], seconds: float | None) -> bool:
        """Whether drafts that rows reach with these P add more tokens than
        `seconds` would make at the current speed (before any timing: half
        a token)."""
        gain = self.pass_rate * sum(reach)
        if gain == 0:
            return False
        if seconds is None or not self.seconds:
            return gain >= 0.5
        return gain >= self.tokens / self.seconds * seconds

    def decide(self, reach: list[float], limits: list[int], made: int) -> tuple[bool, bool]:
        """With `made` drafts made, the last one's confidences not read yet,
        and each row's P over the others: (draft another?, keep the last?).
        The last draft's step is spent, so it stays if it is worth its share
        of the target's pass alone."""
        last = [p if made <= limit else 0.0 for p, limit in zip(reach, limits)]
        following = [p * self.pass_rate if made < limit else 0.0 for p, limit in zip(reach, limits)]
        if self.draft_seconds is None:
            return self.worth(following, None), True
        if self.worth(following, self.draft_cost):
            return True, True
        return False, self.worth(last, self.draft_cost - self.draft_seconds)

    def timed(self, seconds: float):
        """A draft step took this long. The estimate follows a faster step at
        once and a slower one slowly: a first call's tracing and compiling,
        or a busy machine, would otherwise read as the step's cost."""
        if self.draft_seconds is None or seconds < self.draft_seconds:
            self.draft_seconds = seconds
        else:
            self.draft_seconds += (1 - self.decay) / 2 * (seconds - self.draft_seconds)

    def learn(self, confidences: list[list[float]], accepted: list[int], seconds: float):
        """After a round: each row's drafts' confidences and how many passed,
        and the round's seconds (not counted the first time a batch of its
        size drafts as many: those rounds trace graphs for their shapes)."""
        self.accepted = [self.decay * n for n in self.accepted]
        self.judged = [self.decay * n for n in self.judged]
        for row, passed in zip(confidences, accepted):
            for i, confidence in enumerate(row[: passed + 1]):  # the first rejected draft is judged too
                self.judged[self.bin(confidence)] += 1
                self.accepted[self.bin(confidence)] += i < passed
        drafts = max(len(row) for row in confidences)
        if (len(accepted), drafts) not in self.shapes:  # the first round of a shape also traces its graphs
            self.shapes.add((len(accepted), drafts))
            return
        self.tokens = self.decay * self.tokens + sum(accepted) + len(accepted)
        self.seconds = self.decay * self.seconds + seconds
        # Against the draft steps run, a dropped one included: against the drafts
        # kept, rounds that dropped one would look dear for their length.
        steps, keep = self.steps, self.cost_decay
        self.rounds = [keep * total + new for total, new in
                       zip(self.rounds, (1, steps, steps * steps, seconds, steps * seconds))]


def draft_confidence(scores: mx.array, tokens: mx.array, sampling: Sampling) -> mx.array:
    """The draft's probability for the tokens it drafted: (B, V), (B,) -> (B,).
    Greedy: the argmax's probability at temperature 1."""
    if sampling.temp == 0:
        return mx.exp(scores.max(axis=-1) - mx.logsumexp(scores, axis=-1))
    return mx.take_along_axis(logits_to_probs(scores, sampling), tokens[:, None], axis=-1)[:, 0]


def draft_tokens(draft: T5, cache: DecoderCache, rows: list[Row], limits: list[int], sampling: Sampling,
                 auto: AutoDraft | None = None) -> tuple[mx.array, mx.array, list[mx.array] | None]:
    """Tokens drafted for every row, one draft call each: (drafts (B, k),
    the draft's logits (B, k, V), with `auto` the draft's confidence in
    each step's drafts, k (B,) arrays). k = max(limits), or fewer when
    `auto` stops early.
    No host sync without `auto`; with it, each step's confidences are read
    while the next step runs, so a decision to stop comes one draft late
    (AutoDraft.decide says whether that draft is kept).
    The first call feeds each row's unseen tokens (one or two), padded on
    the right where they differ; the padding's cache positions are trimmed
    at once."""
    lengths = [len(row.unseen) for row in rows]
    width = max(lengths)
    inputs = mx.array([row.unseen + [0] * (width - len(row.unseen)) for row in rows])
    drafts, logits, confidences = [], [], []
    eos = draft.args.eos_token_id
    reach, last_read = [1.0] * len(rows), time.perf_counter()  # P(row), from the confidences read so far
    for i in range(max(limits)):
        scores = draft.decode(inputs, cache)
        if i == 0 and width > 1:
            last = mx.array(lengths)[:, None, None] - 1
            scores = mx.take_along_axis(scores, last, axis=1)
            cache.trim([width - n for n in lengths])
        scores = scores[:, -1]
        token = sample(scores, sampling)
        drafts.append(token)
        logits.append(scores)
        inputs = token[:, None]
        if auto is None:
            mx.async_eval(token)
            continue
        confidences.append(draft_confidence(scores, token, sampling))
        mx.async_eval(token, confidences[-1])
        auto.steps = i + 1
        if i > 0:  # step i runs while step i - 1's confidences are read and timed
            for row, (confidence, drafted) in enumerate(zip(confidences[-2].tolist(), drafts[-2].tolist())):
                # Drafts after an end of text would never reach the output.
                reach[row] = 0.0 if drafted == eos else auto.reach(reach[row], confidence)
            now = time.perf_counter()
            auto.timed(now - last_read)
            last_read = now
        more, keep = auto.decide(reach, limits, i + 1)
        if i > 0 and not keep:  # step i ran for nothing (a round keeps its first draft)
            drafts.pop(), logits.pop(), confidences.pop()
            cache.trim([1] * len(rows))  # its input, draft i - 1, is fed again next round
        if not more:
            break
    return mx.stack(drafts, axis=1), mx.stack(logits, axis=1), confidences if auto else None


class PromptLookup:
    """One row's drafts without a draft model: the tokens that followed the
    last earlier occurrence of its output's final n tokens, for the longest
    n up to 3 that occurs, in the output first, then in the prompt (the
    encoder's input, where a T5's copies come from)."""

    longest = 3

    def __init__(self, prompt: list[int]):
        self.prompt, self.output = list(prompt), []
        self.in_prompt, self.in_output = {}, {}  # n-gram -> the position after its last occurrence
        self.index(self.in_prompt, self.prompt, 0, len(self.prompt) - 1)  # n-grams with a token after them
        self.indexed = 0  # output positions whose n-grams are indexed

    @classmethod
    def index(cls, table: dict, tokens: list[int], start: int, stop: int):
        """Index the n-grams ending at positions start..stop-1."""
        for end in range(start, stop):
            for n in range(1, min(cls.longest, end + 1) + 1):
                table[tuple(tokens[end + 1 - n : end + 1])] = end + 1

    def add(self, tokens: list[int]):
        self.output += tokens

    def draft(self, limit: int) -> list[int]:
        """Up to limit tokens; none when nothing matches."""
        if limit <= 0 or not self.output:
            return []
        # Every output n-gram but those ending at the last token: the tail must not match itself.
        self.index(self.in_output, self.output, self.indexed, len(self.output) - 1)
        self.indexed = len(self.output) - 1
        for n in range(min(self.longest, len(self.output)), 0, -1):
            tail = tuple(self.output[-n:])
            for table, tokens in ((self.in_output, self.output), (self.in_prompt, self.prompt)):
                if tail in table:
                    return tokens[table[tail] : table[tail] + limit]
        return []


def lookup_drafts(rows: list[Row], limits: list[int], vocab: int, sampling: Sampling):
    """Every row's looked-up drafts, padded to the longest: (drafts (B, k), their one-hot
    logits (None when greedy, which needs none), each row's count)."""
    proposals = [row.lookup.draft(limit) for row, limit in zip(rows, limits)]
    k = max(len(p) for p in proposals)
    drafts = mx.array([p + [0] * (k - len(p)) for p in proposals], dtype=mx.int32)
    one_hot = None
    if sampling.temp > 0 and k:  # q(x) = 1: accept x with probability p(x), and resample from p without x
        one_hot = mx.where(mx.arange(vocab) == drafts[..., None], 0.0, -mx.inf)
    return drafts, one_hot, [len(p) for p in proposals]


def speculative_batch(target: T5, draft: T5 | None, prompts: list[list[int]], max_tokens: int, sampling: Sampling,
                      num_draft: "int | str | AutoDraft", delta: float, stats: list[Stats],
                      batch_size: int = 8) -> Iterator[tuple[int, int | None, bool]]:
    """Decode prompts batch_size rows at a time, and yield (prompt index,
    token, finished) for each new token of each row after each round: the
    draft proposes up to num_draft tokens for every row (with "auto", or an
    AutoDraft that carries what earlier calls learnt, it decides how many;
    with draft None, PromptLookup proposes them), the
    target scores them all in one pass, and each row keeps its own accepted
    prefix, rolling back its own caches.

    Invariants between rounds, per row: the target's cache holds every
    token but `last`; the draft's every token but those in `unseen` (`last`,
    and the final draft after a full acceptance, which it never ran on).
    """
    batch = Batch([target] if draft is None else [target, draft], prompts, stats, batch_size)
    eos, start = target.args.eos_token_id, target.args.decoder_start_token_id
    auto = None
    if num_draft == AUTO or isinstance(num_draft, AutoDraft):
        auto = num_draft if isinstance(num_draft, AutoDraft) else AutoDraft()
    longest = auto.cap if auto else num_draft
    while True:
        batch.join()
        rows = batch.rows
        if not rows:
            return
        started = time.perf_counter()
        for row in rows:
            if not row.unseen:  # just joined
                row.last, row.unseen = start, [start]
                row.lookup = PromptLookup(prompts[row.index]) if draft is None else None
        target_cache = batch.caches[0]
        limits = [min(longest, max_tokens - row.produced - 1) for row in rows]  # drafts past max_tokens are wasted
        # 1. Draft up to num_draft tokens for every row.
        draft_logits = confidences = None
        if draft is None:
            drafts, draft_logits, limits = lookup_drafts(rows, limits, target.args.vocab_size, sampling)
        elif max(limits):
            drafts, draft_logits, confidences = draft_tokens(draft, batch.caches[1], rows, limits, sampling, auto)
            limits = [min(limit, drafts.shape[1]) for limit in limits]
        k = max(limits)
        # 2. The target scores each row's `last` and drafts in one pass.
        lasts = mx.array([[row.last] for row in rows])
        target_logits = target.decode(mx.concatenate([lasts, drafts], axis=1) if k else lasts, target_cache)
        if k:
            num_accepted, next_tokens = verify(target_logits, draft_logits, drafts, sampling, delta, mx.array(limits))
        else:
            num_accepted, next_tokens = mx.zeros((len(rows),), mx.int32), sample(target_logits[:, 0], sampling)
            drafts = mx.zeros((len(rows), 0), mx.int32)
        # The round's one host sync (with auto, one a draft step too, and the last step's confidences in this one).
        mx.eval(num_accepted, next_tokens, drafts, *(confidences or ()))
        seconds = time.perf_counter() - started  # before the rows' tokens go out to the caller
        if confidences:  # by row
            confidences = list(zip(*(step.tolist() for step in confidences)))
        # 3. Each row takes its accepted prefix; both caches roll back to it.
        finished = set()
        accepted_counts = num_accepted.tolist()
        for position, (row, accepted, token, drafted) in enumerate(
                zip(rows, accepted_counts, next_tokens.tolist(), drafts.tolist())):
            limit = limits[position]
            new_tokens = drafted[:accepted] + [token]
            counted = limit
            if eos in new_tokens[:accepted]:  # drafts after an accepted EOS never reach the output: not counted
                counted = accepted = new_tokens.index(eos) + 1
            row.stats.target_calls += 1
            row.stats.draft_calls += limit if draft is not None else 0
            row.stats.drafted += counted
            row.stats.accepted += accepted
            if draft is None:
                row.lookup.add(new_tokens)
            elif k:
                row.unseen = new_tokens[-2:] if accepted == k else new_tokens[-1:]
            else:
                row.unseen = row.unseen + new_tokens
            row.last = new_tokens[-1]
            if (yield from row.emit(new_tokens, eos, max_tokens)):
                finished.add(position)
        if auto and k:
            auto.learn([c[:limit] for c, limit in zip(confidences, limits)], accepted_counts, seconds)
        target_cache.trim([k - a for a in accepted_counts])
        if draft is not None and k:
            batch.caches[1].trim([k - 1 - min(a, k - 1) for a in accepted_counts])
        batch.leave(finished)


def speculative_generate(target: T5, draft: T5 | None, prompt: list[int], max_tokens: int, sampling: Sampling,
                         num_draft: int | str, delta: float, stats: Stats | None = None) -> Iterator[int]:
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


def check_prompts(prompts: list[str]) -> None:
    """TypeError unless prompts is a list (or tuple) of strings; OptionError if it is empty."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings (got one string: generate takes one prompt)")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of strings (got {type(prompts).__name__})")
    if not prompts:
        raise OptionError("prompts must be a non-empty list of strings (got an empty one)")
    for number, prompt in enumerate(prompts, 1):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts must be a list of strings (prompt {number} is {type(prompt).__name__})")


def check_prompt(prompt: str) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a string (got {type(prompt).__name__})")


def tokenize(models: Models, prompts: list[str]) -> list[list[int]]:
    """Each prompt's ids. OptionError for an empty prompt; a warning for
    prompts longer than T5 was trained on."""
    check_prompts(prompts)
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
    """(prompt index, token, finished) as rows decide them (Row.emit):
    speculative decoding when settings.drafts(models) (with prompt lookup's
    drafts, or the draft model's), else the target alone. The seed is set
    when decoding starts."""
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    if settings.drafts(models):
        draft = None if settings.prompt_lookup else models.draft
        num_draft = settings.num_draft
        if num_draft == AUTO:  # what the pair has shown so far, at these settings
            num_draft = models.drafting.setdefault((settings.delta, astuple(settings.sampling), batch_size), AutoDraft())
        yield from speculative_batch(models.target, draft, ids, settings.max_tokens, settings.sampling,
                                     num_draft, settings.delta, stats, batch_size)
    else:
        yield from regular_batch(models.target, ids, settings.max_tokens, settings.sampling, stats, batch_size)


def generate_tokens(models: Models, prompt: str, settings: Settings, stats: Stats) -> Iterator[int]:
    """One prompt's token ids as they are decided; the prompt is checked now."""
    check_prompt(prompt)
    ids = tokenize(models, [prompt])
    return (token for _, token, _ in decode_batch(models, ids, settings, [stats], 1) if token is not None)


def stream_generate(models: Models, prompt: str, **options) -> Iterator[Response]:
    """Yield a Response as each token is decided. Options, all keywords:
    max_tokens=100, num_draft=5 (or "auto": see AutoDraft), delta=0.0,
    temp=0.0, top_k=0, top_p=1.0, seed=None (reseeds MLX's global
    generator), speculative=True (False: the target alone, even with a
    draft), prompt_lookup=False (True: drafts copied from the prompt and the
    output, see PromptLookup; a draft model, if loaded, is not used).
    Options and the prompt are checked at the call, before any decoding:
    OptionError names one out of range."""
    settings = Settings.of(options).check_models(models)
    stats = Stats()
    tokens = generate_tokens(models, prompt, settings, stats)
    detokenizer = Detokenizer(models.tokenizer)

    def responses():
        for token in tokens:
            yield Response(detokenizer.add(token), token, replace(stats))  # stats as they are now
        finish = "length" if stats.generated == settings.max_tokens else "eos"
        learn_encoding_rate(models, settings, stats)
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


WARM_UP_TOKENS = 64  # of a long prompt: warming up must not cost an encoding of it


def warm_up(models: Models, prompt: str, settings: Settings = Settings()) -> None:
    """A few tokens of each decoding path, so that first-call costs (compiling
    kernels, growing the allocator's pools) stay out of timings. A long
    prompt is cut to its first WARM_UP_TOKENS tokens."""
    ids = models.tokenizer.encode(prompt)
    if len(ids) > WARM_UP_TOKENS:
        prompt = models.tokenizer.decode(ids[:WARM_UP_TOKENS])
    for speculative in (False, True) if replace(settings, speculative=True).drafts(models) else (False,):
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
    settings = Settings.of(options).check_models(models)
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
