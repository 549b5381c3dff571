"""The decoding engine: batches of prompts decoded regularly or by draft and verify, each row on its own.

A `Request` is one prompt's ids and how to decode them (its own max_tokens,
sampling, seed, delta and num_draft). Requests join a batch between rounds
(`RegularBatch`, or `SpeculativeBatch` with a drafter from drafting.py), each
round moves every row on, by one token or by its accepted drafts and one
token of the target's, and finished rows leave at once:

    batch = SpeculativeBatch(target, DraftModel(draft), batch_size=8)
    batch.join(requests)
    while batch.rows:
        for request, token, finished in batch.round():
            ...

`regular_batch` and `speculative_batch` feed a list of prompts through a
batch, and `regular_generate` and `speculative_generate` one prompt; the
server feeds a queue. The text API is generate.py; the knobs of a
generation, `Settings`, are here.
"""

import math
import numbers
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Iterator

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from drafting import AutoDraft, DraftModel, LookupDrafter, Proposal
from loading import Models, T5Error
from model import T5, DecoderCache
from sampling import ACCEPT, TOKEN, RowSampling, Sampling, categorical, logits_to_probs, per_row, random_key, sample, uniform

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
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_k, self.top_p)

    def request(self, ids: list[int], stats: "Stats | None" = None) -> "Request":
        """The engine's request for a prompt's ids at these settings (num_draft
        "auto" is the drafter's: AutoDraft's cap)."""
        num_draft = AutoDraft.cap if self.num_draft == AUTO else self.num_draft
        return Request(ids, self.max_tokens, self.sampling, self.delta, num_draft, self.seed,
                       stats if stats is not None else Stats())


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # from when the prompt joined its batch: encoding, then decoding
    encoding_seconds: float = 0.0  # the encoding its row waited for (of the prompts that joined with it too)

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


@dataclass(eq=False)
class Request:
    """One prompt for the engine: its ids, how to decode them, and the
    statistics its decoding updates."""

    ids: list[int]
    max_tokens: int = 100
    sampling: Sampling = Sampling()
    delta: float = 0.0
    num_draft: int = 5  # the most drafts a round
    seed: int | None = None  # its own random stream (None: one drawn from MLX's generator)
    stats: Stats = field(default_factory=Stats)
    ignore_eos: bool = False  # decode on past the end of text, to max_tokens (benchmarks)


Event = tuple[Request, "int | None", bool]  # (request, token or None, finished)


def encode_prompts(model: T5, prompts: list[list[int]]) -> DecoderCache:
    """Encode prompts together into a fresh decoder cache (encode_for, one model)."""
    return encode_for([model], prompts)[0]


def encode_for(models: list[T5], prompts: list[list[int]]) -> list[DecoderCache]:
    """Encode prompts together (padded on the right and masked, when their
    lengths differ) into a fresh decoder cache for each model, evaluated at
    once so that the models' work runs side by side. The prompts' products,
    of many rows, are computed here, apart from decoding's few-row ones: the
    CPU's BLAS wants them done differently."""
    length = max(len(prompt) for prompt in prompts)
    mask = None
    if any(len(prompt) < length for prompt in prompts):
        mask = mx.array([[1] * len(prompt) + [0] * (length - len(prompt)) for prompt in prompts])
    caches = []
    for model in models:
        tokens = mx.array([prompt + [model.args.pad_token_id] * (length - len(prompt)) for prompt in prompts])
        caches.append(model.make_cache(model.encode(tokens, mask), mask))
    with cpu.many_rows():
        mx.eval([cache.cross_keys_values for cache in caches])
    return caches


def start_decoding(model: T5, prompt: list[int]) -> tuple[DecoderCache, mx.array]:
    """One prompt's cache, and the decoder's first input."""
    return encode_prompts(model, [prompt]), mx.array([model.args.decoder_start_token_id])


@dataclass(eq=False)
class Row:
    """A request's place in a batch, and where its decoding stands."""

    request: Request
    started: float
    key: tuple[int, int]  # its random stream (sampling.random_key)
    produced: int = 0
    last: int = 0  # speculative: the token the target has not seen
    drafting: object = None  # the drafter's own state for the row

    @property
    def stats(self) -> Stats:
        return self.request.stats

    def emit(self, tokens: list[int], eos: int | None) -> Iterator[Event]:
        """Yield an event for each token the row decided, counting it as it
        goes; the output ends at EOS (itself not output, token None when it
        came first) or at max_tokens. Returns whether the row has finished."""
        finished = eos in tokens
        tokens = tokens[: tokens.index(eos)] if finished else tokens
        limit = self.request.max_tokens
        for i, token in enumerate(tokens):
            self.produced += 1
            self.stats.generated += 1
            self.stats.seconds = time.perf_counter() - self.started
            yield self.request, token, i == len(tokens) - 1 and (finished or self.produced >= limit)
        if not tokens:
            self.stats.seconds = time.perf_counter() - self.started
            yield self.request, None, True
        return finished or self.produced >= limit


class Batch:
    """The rows decoding together and their caches (the target's, then any
    the drafter keeps), row i in row i of each. Prompts that join together
    are encoded together: a prompt encoded alone costs up to twice as much
    (bench.py batch)."""

    def __init__(self, models: list[T5], batch_size: int):
        self.models, self.batch_size = models, batch_size
        self.rows: list[Row] = []
        self.caches: list[DecoderCache] = []
        self._sampling = None  # the rows' RowSampling, made again when they change
        self.encoding_seconds = 0.0  # every join's, all told

    @property
    def free(self) -> int:
        return self.batch_size - len(self.rows)

    def joining(self, waiting: int) -> int:
        """How many of `waiting` prompts to take now: as many as fit, once half
        the batch is free (or all of them fit), so that they encode together."""
        count = min(self.free, waiting)
        return 0 if count == 0 or count < min(waiting, self.batch_size // 2) else count

    def join(self, requests: list[Request]) -> list[Row]:
        """Encode these requests' prompts together and give them rows."""
        assert 0 < len(requests) <= self.free
        started = time.perf_counter()
        prompts = [request.ids for request in requests]
        caches = encode_for(self.models, prompts)
        encoded = time.perf_counter() - started
        rows = [Row(request, started, random_key(request.seed) if request.sampling.temp > 0 else (0, 0))
                for request in requests]
        self.encoding_seconds += encoded
        for request in requests:
            request.stats.prompt_tokens = len(request.ids)
            request.stats.encoding_seconds = encoded  # each row waited for the whole join's encoding
        self.joined(rows, caches)
        if self.caches:
            for mine, theirs in zip(self.caches, caches):
                mine.extend(theirs)
        else:
            self.caches = caches
        self.rows += rows
        self._sampling = None
        return rows

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        """What a kind of batch does with rows that join, on their own caches before they merge."""

    def leave(self, positions: set[int]) -> list[int]:
        """Drop the rows at these positions; the positions kept."""
        kept = [i for i in range(len(self.rows)) if i not in positions]
        if positions:
            self.rows = [self.rows[i] for i in kept]
            if kept:
                longest = max(len(row.request.ids) for row in self.rows)
                for cache in self.caches:
                    cache.keep(kept, longest)
            else:
                self.caches = []
            self._sampling = None
        return kept

    def cancel(self, requests: set[Request]) -> None:
        """Drop these requests' rows (a client gone, a stop string found)."""
        self.leave({i for i, row in enumerate(self.rows) if row.request in requests})

    @property
    def sampling(self) -> RowSampling:
        if self._sampling is None:
            self._sampling = RowSampling([row.request.sampling for row in self.rows], [row.key for row in self.rows])
        return self._sampling

    def round(self) -> Iterator[Event]:
        """One round: every row moves on; yields each new token's event as it
        is counted, and the finished rows leave once all are out."""
        raise NotImplementedError


class RegularBatch(Batch):
    """The model alone: every row advances one token a round. Each step is
    built and queued before the previous one's tokens are read back, so
    Python work overlaps the model's compute (a row that finishes wastes
    that queued step). stop_at_eos=False (benchmarks) times a fixed number
    of tokens."""

    def __init__(self, model: T5, batch_size: int, stop_at_eos: bool = True):
        super().__init__([model], batch_size)
        self.model, self.eos = model, model.args.eos_token_id if stop_at_eos else None
        self.queued: mx.array | None = None  # each row's next token, in flight

    def step(self, tokens: mx.array, cache: DecoderCache, sampling: RowSampling) -> mx.array:
        # The output position each row's new token takes: only rows that sample need it.
        positions = None if sampling.all_greedy else mx.array(cache.offsets)
        token = sample(self.model.decode(tokens[:, None], cache)[:, -1], sampling, positions)
        mx.async_eval(token)
        return token

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        start = mx.array([self.model.args.decoder_start_token_id] * len(rows))
        sampling = RowSampling([row.request.sampling for row in rows], [row.key for row in rows])
        first = self.step(start, caches[0], sampling)
        self.queued = first if self.queued is None else mx.concatenate([self.queued, first])

    def round(self) -> Iterator[Event]:
        current, self.queued = self.queued, None
        if any(row.produced + 1 < row.request.max_tokens for row in self.rows):  # else no row reads it
            self.queued = self.step(current, self.caches[0], self.sampling)  # queued before current is read
        finished = set()
        for position, (row, value) in enumerate(zip(self.rows, current.tolist())):
            row.stats.target_calls += 1
            if (yield from row.emit([value], None if row.request.ignore_eos else self.eos)):
                finished.add(position)
        self.leave(finished)

    def leave(self, positions: set[int]) -> list[int]:
        kept = super().leave(positions)
        if positions and self.queued is not None:
            self.queued = self.queued[mx.array(kept)] if kept else None
        return kept


def greedy_accept(scores: mx.array, drafts: mx.array, delta, best: mx.array | None = None) -> mx.array:
    """The greedy rule on the target's scores (..., k, V) for drafts (..., k):
    accept x when p(x) >= (1 - delta) max p (p at temperature 1), in log
    space; at delta 0 exactly regular greedy's choice, ties included. delta:
    a number, or one per row (B,); best: the scores' argmax, if known."""
    if drafts.shape[-1] == 0:
        return mx.zeros(drafts.shape, mx.bool_)
    exact = drafts == (mx.argmax(scores, axis=-1) if best is None else best)
    if isinstance(delta, numbers.Real) and delta == 0:
        return exact
    chosen = mx.take_along_axis(scores, drafts[..., None], axis=-1)[..., 0]
    gap = chosen - scores.max(axis=-1)
    if isinstance(delta, numbers.Real):
        return gap >= (math.log(1 - delta) if delta < 1 else -math.inf)
    return mx.where(per_row(delta == 0, gap), exact, gap >= per_row(mx.log(1 - delta), gap))


def accept_sampled(p, q, drafts, delta, u) -> mx.array:
    """The sampling rule on distributions already computed, (..., k, V) each:
    accept x when max(u - delta, 0) <= p(x) / q(x)."""
    p_x = mx.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    if not isinstance(delta, numbers.Real):
        delta = per_row(delta, u)
    return mx.maximum(u - delta, 0) * q_x <= p_x  # q_x > 0: x was drawn from q


def accept_mask(target_logits, draft_logits, drafts, sampling: Sampling, delta: float, u=None) -> mx.array:
    """Which of the k drafts pass the acceptance rule, each on its own:
    drafts (..., k) -> (..., k) bool, target_logits (..., k + 1 or k, V).

    Sampling: accept x when max(u - delta, 0) <= p(x) / q(x), u ~ U[0, 1), with
    p, q the target's and draft's distributions after temperature/top-k/top-p.
    Greedy: accept x when p(x) >= (1 - delta) max p (p at temperature 1).
    delta = 0 is exact (speculative sampling / the target's argmax); delta = 1
    accepts everything; a larger delta never accepts less. `verify` applies
    it to each row of a batch with the row's own settings.
    """
    scores = target_logits[..., : drafts.shape[-1], :]
    if sampling.temp == 0:
        return greedy_accept(scores, drafts, delta)
    u = mx.random.uniform(shape=drafts.shape) if u is None else u
    return accept_sampled(logits_to_probs(scores, sampling), logits_to_probs(draft_logits, sampling), drafts, delta, u)


def verify(target_logits, draft_logits, drafts, sampling: RowSampling, delta, limits: mx.array,
           positions: mx.array | None):
    """Decide, on the device, how many drafts the target accepts in each row and the token it adds.

    target_logits (B, k+1, V): the target's scores after each row's last
    accepted token and after each draft; draft_logits (B, k, V) and drafts
    (B, k): what the drafter proposed. Row b weighs only its first limits[b]
    drafts, and decides output positions positions[b] onward (None when no row samples). delta: a
    number, or one per row (B,). Returns (number accepted, next token), each
    (B,): the correction at the first rejection, or the bonus token after the
    row's drafts all pass. Greedy rows: the target's argmax (accept_mask's
    rule). Sampling rows: drawn from max(0, p - q) normalised (p if that is
    all zeros, and where the row had no draft), which makes delta = 0 exact
    speculative sampling.
    """
    B, k = drafts.shape
    weighed = mx.arange(k)[None] < limits[:, None]
    greedy_next = mx.argmax(target_logits, axis=-1)
    accept = next_tokens = None
    if any(sampling.greedy):
        accept, next_tokens = greedy_accept(target_logits[:, :k], drafts, delta, greedy_next[:, :k]), greedy_next
    if not sampling.all_greedy:  # each distribution computed once, for the rule and the residual
        p = logits_to_probs(target_logits, sampling)
        q = mx.where(weighed[..., None], logits_to_probs(draft_logits, sampling), 0.0) if k else mx.zeros((B, 0, p.shape[-1]))
        at = positions[:, None] + mx.arange(k + 1)
        u = uniform(sampling.keys_at(at[:, :k], ACCEPT)) if k else mx.zeros((B, 0))
        sampled_accept = accept_sampled(p[:, :k], q, drafts, delta, u)
        residual = mx.maximum(p - mx.concatenate([q, mx.zeros((B, 1, p.shape[-1]))], axis=1), 0)
        mass = residual.sum(axis=-1, keepdims=True)
        residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p)
        drawn = categorical(mx.log(residual), sampling.keys_at(at, TOKEN))
        if accept is None:
            accept, next_tokens = sampled_accept, drawn
        else:
            greedy = sampling.is_greedy[:, None]
            accept, next_tokens = mx.where(greedy, accept, sampled_accept), mx.where(greedy, greedy_next, drawn)
    num_accepted = mx.cumprod((accept & weighed).astype(mx.int32), axis=-1).sum(axis=-1)
    return num_accepted, mx.take_along_axis(next_tokens, num_accepted[:, None], axis=-1)[:, 0]


class SpeculativeBatch(Batch):
    """Draft and verify: each round the drafter proposes up to each row's
    num_draft tokens, the target scores them all in one pass, and each row
    keeps its own accepted prefix, rolling back its own caches.

    Invariant between rounds, per row: the target's cache holds every token
    but `last`; the drafter's state is its own (drafting.py)."""

    def __init__(self, target: T5, drafter, batch_size: int):
        super().__init__([target] + drafter.models, batch_size)
        self.target, self.drafter = target, drafter
        self._deltas = None

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        for row in rows:
            row.last = self.target.args.decoder_start_token_id
            self.drafter.start(row)
        self._deltas = None

    def leave(self, positions: set[int]) -> list[int]:
        if positions:
            self._deltas = None
        return super().leave(positions)

    @property
    def deltas(self):
        """The rows' delta: one number when they share it, else one per row."""
        if self._deltas is None:
            deltas = [row.request.delta for row in self.rows]
            self._deltas = deltas[0] if len(set(deltas)) == 1 else mx.array(deltas)
        return self._deltas

    def round(self) -> Iterator[Event]:
        rows, target, eos = self.rows, self.target, self.target.args.eos_token_id
        started = time.perf_counter()
        # Drafts past max_tokens would be wasted.
        limits = [min(self.drafter.longest(row.request.num_draft), row.request.max_tokens - row.produced - 1)
                  for row in rows]
        # The output position each row decides first: only rows that sample need it.
        positions = None if self.sampling.all_greedy else mx.array([row.produced for row in rows])
        # 1. Draft up to each row's limit.
        drafter_cache = self.caches[1] if len(self.caches) > 1 else None
        if max(limits):
            proposal = self.drafter.propose(rows, limits, self.sampling, positions, drafter_cache)
        else:
            proposal = Proposal(mx.zeros((len(rows), 0), mx.int32), None, [0] * len(rows), [0] * len(rows), [])
        k = proposal.drafts.shape[1]
        # 2. The target scores each row's `last` and drafts in one pass, and decides.
        lasts = mx.array([[row.last] for row in rows])
        target_logits = target.decode(mx.concatenate([lasts, proposal.drafts], axis=1) if k else lasts, self.caches[0])
        num_accepted, next_tokens = verify(target_logits, proposal.logits, proposal.drafts, self.sampling, self.deltas,
                                           mx.array(proposal.limits), positions)
        # The round's one host sync (with auto, one a draft step too, and the last step's confidences in this one).
        mx.eval(num_accepted, next_tokens, proposal.drafts, *proposal.pending)
        seconds = time.perf_counter() - started  # before the rows' tokens go out to the caller
        # 3. Each row takes its accepted prefix; the caches roll back to it.
        finished, accepted_counts, new_tokens = set(), num_accepted.tolist(), []
        for position, (row, accepted, token, drafted, limit, calls) in enumerate(zip(
                rows, accepted_counts, next_tokens.tolist(), proposal.drafts.tolist(), proposal.limits, proposal.calls)):
            tokens = drafted[:accepted] + [token]
            counted, row_eos = limit, None if row.request.ignore_eos else eos
            if row_eos in tokens[:accepted]:  # drafts after an accepted EOS never reach the output: not counted
                counted = accepted = tokens.index(row_eos) + 1
            row.stats.target_calls += 1
            row.stats.draft_calls += calls
            row.stats.drafted += counted
            row.stats.accepted += accepted
            row.last = tokens[-1]
            new_tokens.append(tokens)
            if (yield from row.emit(tokens, row_eos)):
                finished.add(position)
        self.drafter.settle(rows, proposal, new_tokens, accepted_counts, drafter_cache, seconds)
        self.caches[0].trim([k - a for a in accepted_counts])
        self.leave(finished)


def drive(batch: Batch, requests: list[Request]) -> Iterator[Event]:
    """Decode a list of requests through a batch: waiting prompts join as
    rows leave (Batch.joining), in input order."""
    waiting = list(requests)
    while waiting or batch.rows:
        count = batch.joining(len(waiting))
        if count:
            batch.join(waiting[:count])
            waiting = waiting[count:]
        yield from batch.round()


def numbered(requests: list[Request], events: Iterator[Event]) -> Iterator[tuple[int, "int | None", bool]]:
    """(index in requests, token, finished) for each event."""
    index = {id(request): i for i, request in enumerate(requests)}
    for request, token, finished in events:
        yield index[id(request)], token, finished


def regular_batch(model: T5, prompts: list[list[int]], max_tokens: int, sampling: Sampling, stats: list[Stats],
                  batch_size: int = 8, stop_at_eos: bool = True) -> Iterator[tuple[int, int | None, bool]]:
    """Decode prompts with the model alone, batch_size rows at a time, and
    yield (prompt index, token, finished) as each row's token is read (None
    when it read EOS)."""
    if max_tokens < 1:
        return
    requests = [Request(p, max_tokens, sampling, stats=s) for p, s in zip(prompts, stats)]
    yield from numbered(requests, drive(RegularBatch(model, batch_size, stop_at_eos), requests))


def regular_generate(model: T5, prompt: list[int], max_tokens: int, sampling: Sampling, stats: Stats | None = None,
                     stop_at_eos: bool = True) -> Iterator[int]:
    """Yield up to max_tokens ids from the model alone: a batch of one."""
    for _, token, _ in regular_batch(model, [prompt], max_tokens, sampling, [stats if stats is not None else Stats()],
                                     1, stop_at_eos):
        if token is not None:
            yield token


def drafter_for(target: T5, draft: T5 | None, num_draft: "int | str | AutoDraft"):
    """A draft model's drafter (AutoDraft deciding with "auto", or the one
    given), or prompt lookup's when draft is None."""
    if draft is None:
        return LookupDrafter(target.args.vocab_size)
    if num_draft == AUTO or isinstance(num_draft, AutoDraft):
        return DraftModel(draft, num_draft if isinstance(num_draft, AutoDraft) else AutoDraft())
    return DraftModel(draft)


def speculative_batch(target: T5, draft: T5 | None, prompts: list[list[int]], max_tokens: int, sampling: Sampling,
                      num_draft: "int | str | AutoDraft", delta: float, stats: list[Stats],
                      batch_size: int = 8) -> Iterator[tuple[int, int | None, bool]]:
    """Decode prompts batch_size rows at a time, and yield (prompt index,
    token, finished) for each new token of each row after each round: the
    draft proposes up to num_draft tokens for every row (with "auto", or an
    AutoDraft that carries what earlier calls learnt, it decides how many;
    with draft None, prompt lookup proposes them)."""
    longest = AutoDraft.cap if num_draft == AUTO or isinstance(num_draft, AutoDraft) else num_draft
    requests = [Request(p, max_tokens, sampling, delta, longest, stats=s) for p, s in zip(prompts, stats)]
    batch = SpeculativeBatch(target, drafter_for(target, draft, num_draft), batch_size)
    yield from numbered(requests, drive(batch, requests))


def speculative_generate(target: T5, draft: T5 | None, prompt: list[int], max_tokens: int, sampling: Sampling,
                         num_draft: int | str, delta: float, stats: Stats | None = None) -> Iterator[int]:
    """Yield up to max_tokens ids of one prompt: a batch of one."""
    for _, token, _ in speculative_batch(target, draft, [prompt], max_tokens, sampling, num_draft, delta,
                                         [stats if stats is not None else Stats()], 1):
        if token is not None:
            yield token
