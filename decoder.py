"""The decoding engine's batches: rows of prompts decoded regularly or by draft and verify, each with its own settings.

A `Request` is one prompt's ids and its `Settings` (options.py). A `Batch`
holds the rows decoding together and their caches: `RegularBatch` runs the
target alone, `SpeculativeBatch` drafts (with a drafter from drafting.py) and
verifies; beams.py's `BeamBatch` searches. Requests join a batch between
rounds; each round moves every row on, by one token or by its accepted drafts
and one token of the target's; finished rows leave at once. batches.py makes
the batch a request's settings need and drives requests through it.
"""

import math
import numbers
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import cpu
import kernels
import mlx.core as mx

from drafting import Proposal
from cache import DecoderCache
from model import EncoderDecoder
from options import Settings, Stats
from sampling import ACCEPT, TOKEN, Penalties, RowPenalties, RowSampling, categorical, log_probabilities, logits_to_probs
from sampling import one_hot, per_row
from sampling import random_key, sample, uniform


@dataclass(eq=False)
class Request:
    """One prompt for the engine: its ids, how to decode them, and the
    statistics its decoding updates."""

    ids: list[int]
    settings: Settings = Settings()
    stats: Stats = field(default_factory=Stats)
    logprobs: list["Logprob"] = field(default_factory=list)  # each output token's, when settings.logprobs asks
    sequences: list[tuple[list[int], float, str]] = field(default_factory=list)  # beams.Search.best: the best beams


# An output token's log-probability, and the most likely tokens' (id, log-probability), most likely first.
Logprob = tuple[float, list[tuple[int, float]]]


Event = tuple[Request, "int | None", "str | None"]  # (request, token or None, finish reason or None)
TOKENS_BLOCK = 64  # Batch.tokens pads the rows' tokens to a multiple of this: no_repeat_ngram_size's graph, once a block


def encode_for(models: list[EncoderDecoder], prompts: list[list[int]]) -> list[DecoderCache]:
    """Encode prompts together (padded on the right and masked, when their
    lengths differ; a prompt given more than once, once) into a fresh decoder cache for each model, evaluated at
    once so that the models' work runs side by side. The prompts' products,
    of many rows, are computed here, apart from decoding's few-row ones: the
    CPU's BLAS wants them done differently."""
    distinct = list(dict.fromkeys(tuple(prompt) for prompt in prompts))  # a prompt given n times is encoded once
    rows = [distinct.index(tuple(prompt)) for prompt in prompts]
    prompts = [list(prompt) for prompt in distinct]
    length = max(len(prompt) for prompt in prompts)
    mask = None
    if any(len(prompt) < length for prompt in prompts):
        mask = mx.array([[1] * len(prompt) + [0] * (length - len(prompt)) for prompt in prompts])
    caches = []
    for model in models:
        tokens = mx.array([prompt + [model.args.pad_token_id] * (length - len(prompt)) for prompt in prompts])
        caches.append(model.make_cache(model.encode(tokens, mask), mask))
        if len(prompts) < len(rows):
            caches[-1].keep(rows)
    with cpu.many_rows():
        mx.eval([cache.cross_keys_values for cache in caches])
    return caches


@dataclass(eq=False)
class Row:
    """A request's place in a batch, and where its decoding stands."""

    request: Request
    started: tuple[float, float]  # on its batch's clocks, when it joined
    key: tuple[int, int]  # its random stream (sampling.random_key)
    clocks: tuple[Callable[[], float], ...] = (time.perf_counter, kernels.compiling_seconds)  # its batch's (Batch.clocks)
    produced: int = 0
    output: list[int] = field(default_factory=list)  # the tokens emitted
    forced_end: bool = False  # its model forces the end of text at max_tokens (forced_eos_token_id)
    last: int = 0  # speculative: the token the target has not seen
    drafting: object = None  # the drafter's own state for the row (beam search: its beams.Search)

    @property
    def settings(self) -> Settings:
        return self.request.settings

    @property
    def stats(self) -> Stats:
        return self.request.stats

    def end(self, tokens: list[int], eos: int | None) -> int | None:
        """Where in tokens the row's output ends: the first EOS or stop token id, if any."""
        stops = self.settings.stop_token_ids
        return next((i for i, token in enumerate(tokens) if token == eos or token in stops), None)

    def emit(self, tokens: list[int], eos: int | None, logprobs: list[Logprob] | None = None) -> Iterator[Event]:
        """Yield an event for each token the row decided, counting it as it
        goes (and keeping its `logprobs`, when the row asks for them); the
        output ends at EOS (itself not output, token None when it came
        first), after a stop token id (output, as vLLM does) or at
        max_tokens. Returns the finish reason, or None while the row goes on."""
        end = self.end(tokens, eos)
        # An end of text the model's config forces at max_tokens ends the output by its length.
        cut = end is not None and self.forced_end and self.produced + end + 1 == self.settings.max_tokens
        if end is not None:
            tokens = tokens[: end + (tokens[end] != eos)]
        self.output += tokens
        if self.settings.logprobs is not None:
            self.request.logprobs += [(lp, top[: self.settings.logprobs]) for lp, top in logprobs[: len(tokens)]]
        self.timed()  # once: the round decided its tokens together
        for i, token in enumerate(tokens):
            self.produced += 1
            self.stats.generated += 1
            yield self.request, token, self.finish(end is not None, cut) if i == len(tokens) - 1 else None
        if not tokens:
            yield self.request, None, self.finish(True, cut)
        return self.finish(end is not None, cut)

    def timed(self) -> None:
        """Its statistics' seconds, now: since it joined, and of those MLX's compiling (another process's compiles
        at the same time count too: never more than the row's time)."""
        seconds, compiling = (clock() - start for clock, start in zip(self.clocks, self.started))
        self.stats.seconds, self.stats.compiling_seconds = seconds, min(compiling, seconds)

    def finish(self, ended: bool, cut: bool = False) -> str | None:
        if ended:
            return "length" if cut else "stop"
        return "length" if self.produced >= self.settings.max_tokens else None


class Batch:
    """The rows decoding together and their caches (the target's, then any
    the drafter keeps), row i in row i of each. Prompts that join together
    are encoded together: a prompt encoded alone costs up to twice as much
    (`python -m bench batch`)."""

    width = 1  # the caches' rows each request takes (beam search: one a beam)
    # What a row's seconds are read from (Stats): the time, and the time MLX has spent compiling kernels. The tests
    # give it clocks of theirs.
    clocks = (time.perf_counter, kernels.compiling_seconds)

    def __init__(self, models: list[EncoderDecoder], batch_size: int):
        self.models, self.batch_size = models, batch_size
        self.rows: list[Row] = []
        self.caches: list[DecoderCache] = []
        self._sampling = None  # the rows' RowSampling, made again when they change
        self._penalties = None  # (the rows' RowPenalties or None,), made again when they change
        self.counts: mx.array | None = None  # (B, V): each row's output tokens counted, while a row has penalties
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
        started = tuple(clock() for clock in self.clocks)
        caches = encode_for(self.models, [request.ids for request in requests])
        seconds, compiling = (clock() - start for clock, start in zip(self.clocks, started))
        encoded = max(seconds - compiling, 0.0)  # a kernel compiled on the way is compiling's
        forced_end = self.models[0].args.forced_eos_token_id is not None
        rows = [Row(request, started, random_key(request.settings.seed) if request.settings.temp > 0 else (0, 0),
                    self.clocks, forced_end=forced_end) for request in requests]
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
        if self.counts is not None or any(self.row_penalties(row) != Penalties() for row in rows):
            # Rows without penalties count from here on, and never read their counts.
            old = self.counts if self.counts is not None else mx.zeros((len(self.rows) * self.width, self.vocabulary))
            self.counts = mx.concatenate([old, mx.zeros((len(rows) * self.width, self.vocabulary))])
        self.rows += rows
        self._sampling = self._penalties = None
        return rows

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        """What a kind of batch does with rows that join, on their own caches before they merge."""

    def leave(self, positions: set[int]) -> list[int]:
        """Drop the rows at these positions; the positions kept."""
        kept = [i for i in range(len(self.rows)) if i not in positions]
        if positions:
            self.rows = [self.rows[i] for i in kept]
            cache_rows = [i * self.width + j for i in kept for j in range(self.width)]
            if kept:
                longest = max(len(row.request.ids) for row in self.rows)
                for cache in self.caches:
                    cache.keep(cache_rows, longest)
            else:
                self.caches = []
            self._sampling = self._penalties = None
            penalized = any(self.row_penalties(row) != Penalties() for row in self.rows)
            self.counts = self.counts[mx.array(cache_rows)] if penalized and self.counts is not None else None
        return kept

    def cancel(self, requests: set[Request]) -> None:
        """Drop these requests' rows (a client gone, a stop string found)."""
        self.leave({i for i, row in enumerate(self.rows) if row.request in requests})

    @property
    def sampling(self) -> RowSampling:
        if self._sampling is None:
            self._sampling = RowSampling([row.settings.sampling for row in self.rows], [row.key for row in self.rows])
        return self._sampling

    @property
    def penalties(self) -> RowPenalties | None:
        if self._penalties is None:
            self._penalties = (self.penalties_of(self.rows),)
        return self._penalties[0]

    def penalties_of(self, rows: list[Row]) -> RowPenalties | None:
        """These rows' RowPenalties (one a cache row), None when none has any."""
        args = self.models[0].args
        penalties = [self.row_penalties(row) for row in rows for _ in range(self.width)]
        starts = [self.start(row) for row in rows for _ in range(self.width)]
        return RowPenalties.of(penalties, starts, args.eos_token_id, args.vocab_size, args.forced_eos_token_id)

    def start(self, row: Row) -> int:
        """The token a row's decoder starts from: its model's, or its target language's (mBART's)."""
        chosen = row.settings.decoder_start_token_id
        return self.models[0].args.decoder_start_token_id if chosen is None else chosen

    def row_penalties(self, row: Row) -> Penalties:
        """A row's Penalties, with the tokens its model's config forces (BART's
        first token, the end of text at max_tokens)."""
        return forced(row.settings, self.models[0].args)

    def tokens(self, rows: list[Row], then: mx.array | None = None) -> mx.array | None:
        """What no_repeat_ngram_size reads, when a row has it: each row's start
        token and output, then `then` (B, n), padded on the left with -1."""
        if self.penalties is None or not self.penalties.needs_tokens:
            return None
        longest = -(-(max(len(row.output) for row in rows) + 1) // TOKENS_BLOCK) * TOKENS_BLOCK  # one shape a block
        seen = mx.array([[-1] * (longest - 1 - len(row.output)) + [self.start(row)] + row.output for row in rows])
        return seen if then is None else mx.concatenate([seen, then.astype(seen.dtype)], axis=1)

    @property
    def top_logprobs(self) -> int | None:
        """The most alternatives a row asks logprobs for; None when no row asks for logprobs."""
        asked = [row.settings.logprobs for row in self.rows if row.settings.logprobs is not None]
        return max(asked) if asked else None

    @property
    def vocabulary(self) -> int:
        return self.models[0].args.vocab_size

    def eos(self, row: Row) -> int | None:
        return None if row.settings.ignore_eos else self.models[0].args.eos_token_id

    def round(self) -> Iterator[Event]:
        """One round: every row moves on; yields each new token's event as it
        is counted, and the finished rows leave once all are out."""
        raise NotImplementedError


class RegularBatch(Batch):
    """The model alone: every row advances one token a round. Each step is
    built and queued before the previous one's tokens are read back, so
    Python work overlaps the model's compute (a row that finishes wastes
    that queued step)."""

    def __init__(self, model: EncoderDecoder, batch_size: int):
        super().__init__([model], batch_size)
        self.model = model
        self.queued: mx.array | None = None  # each row's next token, in flight
        self.queued_logits: mx.array | None = None  # the target's logits it came from, for logprobs

    def step(self, tokens: mx.array, cache: DecoderCache, sampling: RowSampling, penalties: RowPenalties | None = None,
             counts: mx.array | None = None, seen: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Each row's next token after `tokens` (B,), and the logits (B, V)
        the target gave before any processor; with penalties, given the
        output's counts and, for no_repeat_ngram_size, its tokens (`seen`)."""
        # The output position each row's new token takes: rows that sample, or have penalties, need it.
        positions = None if sampling.all_greedy and penalties is None else mx.array(cache.offsets)
        raw = logits = self.model.decode(tokens[:, None], cache)[:, -1]
        if penalties is not None:
            logits = penalties.apply(logits[:, None], counts[:, None], positions[:, None], seen)[:, 0]
        token = sample(logits, sampling, positions)
        mx.async_eval(token)
        return token, raw

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        start = mx.array([self.start(row) for row in rows])
        sampling = RowSampling([row.settings.sampling for row in rows], [row.key for row in rows])
        penalties = self.penalties_of(rows)
        counts = None if penalties is None else mx.zeros((len(rows), self.vocabulary))
        seen = start[:, None] if penalties is not None and penalties.needs_tokens else None
        first, logits = self.step(start, caches[0], sampling, penalties, counts, seen)
        self.queued = first if self.queued is None else mx.concatenate([self.queued, first])
        self.queued_logits = logits if self.queued_logits is None else mx.concatenate([self.queued_logits, logits])

    def round(self) -> Iterator[Event]:
        current, logits = self.queued, self.queued_logits
        self.queued = self.queued_logits = None
        if self.counts is not None:  # on the device, before current is read
            self.counts = self.counts + one_hot(current, self.vocabulary)
        logprobs = None
        if self.top_logprobs is not None:  # queued before the next step, so that reading them waits for this one only
            logprobs = log_probabilities(logits[:, None], current[:, None], self.top_logprobs)
            mx.async_eval(*(a for a in logprobs if a is not None))
        if any(row.produced + 1 < row.settings.max_tokens for row in self.rows):  # else no row reads it
            self.queued, self.queued_logits = self.step(current, self.caches[0], self.sampling, self.penalties,
                                                        self.counts, self.tokens(self.rows, current[:, None]))
        logprobs = [None] * len(self.rows) if logprobs is None else logprob_lists(*logprobs)
        finished = set()
        for position, (row, value, given) in enumerate(zip(self.rows, current.tolist(), logprobs)):
            row.stats.target_calls += 1
            if (yield from row.emit([value], self.eos(row), given)):
                finished.add(position)
        self.leave(finished)

    def leave(self, positions: set[int]) -> list[int]:
        kept = super().leave(positions)
        if positions and self.queued is not None:
            self.queued = self.queued[mx.array(kept)] if kept else None
            self.queued_logits = self.queued_logits[mx.array(kept)] if kept else None
        return kept


def logprob_lists(picked: mx.array, ids: mx.array | None, values: mx.array | None) -> list[list[Logprob]]:
    """sampling.log_probabilities' arrays (B, n) and (B, n, top), read as each row's Logprob at each position."""
    picked = picked.tolist()
    if ids is None:
        return [[(lp, []) for lp in row] for row in picked]
    return [[(lp, list(zip(i, v))) for lp, i, v in zip(*row)] for row in zip(picked, ids.tolist(), values.tolist())]


def forced(settings: Settings, args) -> Penalties:
    """The settings' Penalties with what the model's config forces: its first
    output token (forced_bos_token_id, or the settings' own: a target
    language) and the end of text as the last (forced_eos_token_id), as
    transformers' generate forces them."""
    penalties = settings.penalties
    first = args.forced_bos_token_id if settings.forced_bos_token_id is None else settings.forced_bos_token_id
    if first is not None:
        penalties = replace(penalties, forced_first=first)
    if args.forced_eos_token_id is not None:
        penalties = replace(penalties, forced_end_at=settings.max_tokens - 1)
    return penalties


def greedy_accept(scores: mx.array, drafts: mx.array, delta, best: mx.array) -> mx.array:
    """The greedy rule on the target's scores (B, k, V) for drafts (B, k):
    accept x when p(x) >= (1 - delta) max p (p at temperature 1), in log
    space; at delta 0 exactly regular greedy's choice, ties included (best:
    the scores' argmax). delta: a number, or one per row (B,)."""
    exact = drafts == best
    if isinstance(delta, numbers.Real) and delta == 0:
        return exact
    chosen = mx.take_along_axis(scores, drafts[..., None], axis=-1)[..., 0]
    gap = chosen - scores.max(axis=-1)
    if isinstance(delta, numbers.Real):
        return gap >= (math.log(1 - delta) if delta < 1 else -math.inf)
    return mx.where(per_row(delta == 0, gap), exact, gap >= per_row(mx.log(1 - delta), gap))


def accept_sampled(p, q, drafts, delta, u) -> mx.array:
    """The sampling rule on distributions already computed, (B, k, V) each:
    accept x when max(u - delta, 0) <= p(x) / q(x)."""
    p_x = mx.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    if not isinstance(delta, numbers.Real):
        delta = per_row(delta, u)
    return mx.maximum(u - delta, 0) * q_x <= p_x  # q_x > 0: x was drawn from q


def verify(target_logits, draft_logits, drafts, sampling: RowSampling, delta, limits: mx.array,
           positions: mx.array | None):
    """Decide, on the device, how many drafts the target accepts in each row and the token it adds.

    target_logits (B, k+1, V): the target's scores after each row's last
    accepted token and after each draft; draft_logits (B, k, V) and drafts
    (B, k): what the drafter proposed. Row b weighs only its first limits[b]
    drafts, and decides output positions positions[b] onward (None when no
    row samples). delta: a number, or one per row (B,). Drafts are accepted
    left to right until the first rejection. Returns (number accepted, next
    token), each (B,): the correction at the first rejection, or the bonus
    token after the row's drafts all pass.

    Greedy rows (temperature 0): accept x when p(x) >= (1 - delta) max p, p
    at temperature 1; the next token is the target's argmax. Sampling rows:
    accept x when max(u - delta, 0) <= p(x) / q(x), u uniform in [0, 1), p
    and q the target's and the drafter's distributions after each row's
    temperature, top-k and top-p; the next token is drawn from max(0, p - q)
    normalised (p where that is all zeros, and where the row had no draft).
    At delta 0 that is exact speculative sampling: the output is distributed
    as the target's. delta 1 accepts every draft, and a larger delta never
    accepts less.
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

    def __init__(self, target: EncoderDecoder, drafter, batch_size: int):
        super().__init__([target] + drafter.models, batch_size)
        self.target, self.drafter = target, drafter
        self._deltas = None

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        for row in rows:
            row.last = self.start(row)
            self.drafter.start(row, row.last)
        self._deltas = None

    def leave(self, positions: set[int]) -> list[int]:
        if positions:
            self._deltas = None
        return super().leave(positions)

    @property
    def deltas(self):
        """The rows' delta: one number when they share it, else one per row."""
        if self._deltas is None:
            deltas = [row.settings.delta for row in self.rows]
            self._deltas = deltas[0] if len(set(deltas)) == 1 else mx.array(deltas)
        return self._deltas

    def round(self) -> Iterator[Event]:
        rows, target = self.rows, self.target
        started, cold = self.drafter.clock(), sum(model.cold_steps for model in self.models)
        # Drafts past max_tokens would be wasted.
        limits = [min(self.drafter.longest(row.settings), row.settings.max_tokens - row.produced - 1) for row in rows]
        # The output position each row decides first: only rows that sample, or have penalties, need it.
        penalties = self.penalties
        positions = None if self.sampling.all_greedy and penalties is None else mx.array([row.produced for row in rows])
        penalized = None if penalties is None else (penalties, self.counts, self.tokens(rows))
        # 1. Draft up to each row's limit.
        drafter_cache = self.caches[1] if len(self.caches) > 1 else None
        if max(limits):
            proposal = self.drafter.propose(rows, limits, self.sampling, positions, drafter_cache, penalized)
        else:
            proposal = Proposal(mx.zeros((len(rows), 0), mx.int32), None, [0] * len(rows), [0] * len(rows))
        k = proposal.drafts.shape[1]
        # 2. The target scores each row's `last` and drafts in one pass, and decides.
        lasts = mx.array([[row.last] for row in rows])
        raw = target_logits = target.decode(mx.concatenate([lasts, proposal.drafts], axis=1) if k else lasts, self.caches[0])
        if penalties is not None:  # each position after the row's output and the drafts before it
            drafted = mx.cumsum(one_hot(proposal.drafts, self.vocabulary), axis=1)
            before = mx.concatenate([mx.zeros((len(rows), 1, self.vocabulary)), drafted], axis=1)
            target_logits = penalties.apply(target_logits, self.counts[:, None] + before, positions[:, None] + mx.arange(k + 1),
                                            self.tokens(rows, proposal.drafts))
        num_accepted, next_tokens = verify(target_logits, proposal.logits, proposal.drafts, self.sampling, self.deltas,
                                           mx.array(proposal.limits), positions)
        logprobs = ()
        if self.top_logprobs is not None:  # at each position the row decides: its accepted drafts, then its next token
            padded = mx.concatenate([proposal.drafts, next_tokens[:, None]], axis=1)
            chosen = mx.where(mx.arange(k + 1) == num_accepted[:, None], next_tokens[:, None], padded)
            logprobs = log_probabilities(raw, chosen, self.top_logprobs)
        # The round's one host sync (with auto, one a draft step too, and the last step's confidences in this one).
        mx.eval(num_accepted, next_tokens, proposal.drafts, *proposal.pending, *(a for a in logprobs if a is not None))
        logprobs = logprob_lists(*logprobs) if logprobs else [None] * len(rows)
        seconds = self.drafter.clock() - started  # before the rows' tokens go out to the caller
        warm = sum(model.cold_steps for model in self.models) == cold  # every step replayed a compiled graph
        # 3. Each row takes its accepted prefix; the caches roll back to it.
        finished, accepted_counts, new_tokens = set(), num_accepted.tolist(), []
        for position, (row, accepted, token, drafted, limit, calls, given) in enumerate(zip(
                rows, accepted_counts, next_tokens.tolist(), proposal.drafts.tolist(), proposal.limits, proposal.calls,
                logprobs)):
            tokens = drafted[:accepted] + [token]
            counted, eos = limit, self.eos(row)
            end = row.end(tokens[:accepted], eos)
            if end is not None:  # drafts after an accepted end never reach the output: not counted
                counted = accepted = end + 1
            row.stats.target_calls += 1
            row.stats.draft_calls += calls
            row.stats.drafted += counted
            row.stats.accepted += accepted
            row.last = tokens[-1]
            new_tokens.append(tokens)
            if (yield from row.emit(tokens, eos, given)):
                finished.add(position)
        self.drafter.settle(rows, proposal, new_tokens, accepted_counts, drafter_cache, seconds, warm)
        self.caches[0].trim([k - a for a in accepted_counts])
        if self.counts is not None:  # the round's tokens, counted in one scatter
            rows_of = mx.array([r for r, tokens in enumerate(new_tokens) for _ in tokens])
            self.counts = self.counts.at[rows_of, mx.array([t for tokens in new_tokens for t in tokens])].add(1.0)
        self.leave(finished)
