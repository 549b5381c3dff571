"""Regular and draft-and-verify decoding: the batches that decode rows with the target alone, or by drafts and one
verify pass a round, each row with its own settings.

`RegularBatch` runs the target alone, a token a round; `SpeculativeBatch`
drafts (with a drafter from drafting.py) and verifies, each row keeping its
own accepted prefix (`verify` holds the acceptance rule). Both are rows.py's
`Batch`; beams.py's `BeamBatch` searches; batches.py makes the one a
request's settings need and drives requests through it.
"""

import math
import numbers
from typing import Iterator

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from cache import DecoderCache
from drafting import Proposal
from model import EncoderDecoder
from rows import Batch, Event, Logprob, Row
from sampling import ACCEPT, TOKEN, RowPenalties, RowSampling, categorical, log_probabilities, logits_to_probs
from sampling import one_hot, per_row
from sampling import sample, uniform


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
             counts: mx.array | None = None, seen: mx.array | None = None, history: list[list[int]] | None = None,
             opened: list[int] | None = None, rows: list[Row] = ()) -> tuple[mx.array, mx.array]:
        """Each row's next token after `tokens` (B,), and the logits (B, V)
        its logprobs read (Batch.logprobs_of); with penalties, given the
        output's counts and, for no_repeat_ngram_size, its tokens (`seen`;
        `history` on the host, for rules that read them). `opened`: each
        row's opening tokens before `tokens` in the cache."""
        # The output position each row's new token takes: rows that sample, or have penalties, need it.
        positions = None
        if not sampling.all_greedy or penalties is not None:
            positions = mx.array([offset - before for offset, before in zip(cache.offsets, opened or [0] * len(tokens))])
        raw = logits = self.model.decode(tokens[:, None], cache)[:, -1]
        if penalties is not None:
            logits = penalties.apply(logits[:, None], counts[:, None], positions[:, None], seen, history)[:, 0]
        token = sample(logits, sampling, positions)
        mx.async_eval(token)
        return token, self.logprobs_of(rows, raw, logits)

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        start = mx.array([self.start(row) for row in rows])
        sampling = RowSampling([row.settings.sampling for row in rows], [row.key for row in rows])
        penalties = self.penalties_of(rows)
        counts = None if penalties is None else mx.zeros((len(rows), self.vocabulary))
        seen = history = None
        if penalties is not None and penalties.needs_tokens:
            seen = mx.array(pad_left([list(self.opening(row).start) for row in rows]))
        if penalties is not None and penalties.reads_tokens:
            history = [list(self.opening(row).start) for row in rows]
        first, logits = self.step(start, caches[0], sampling, penalties, counts, seen, history, self.opened(rows), rows)
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
            # Rules that read the tokens before them read this round's on the host: then nothing overlaps.
            history = self.history(self.rows, [[token] for token in current.tolist()]) if self.penalties is not None \
                and self.penalties.reads_tokens else None
            opened = None if self.sampling.all_greedy and self.penalties is None else self.opened(self.rows)
            self.queued, self.queued_logits = self.step(current, self.caches[0], self.sampling, self.penalties,
                                                        self.counts, self.tokens(self.rows, current[:, None]), history,
                                                        opened, self.rows)
        logprobs = [None] * len(self.rows) if logprobs is None else logprob_lists(*logprobs)
        finished = set()
        for position, (row, value, given) in enumerate(zip(self.rows, current.tolist(), logprobs)):
            row.stats.target_calls += 1
            if (yield from row.emit([value], self.eos(row), given)):
                finished.add(position)
        self.leave(finished)

    def opened(self, rows: list[Row]) -> list[int]:
        """Each row's opening tokens before its last, which its cache holds ahead of its output."""
        return [len(self.opening(row).start) - 1 for row in rows]

    def leave(self, positions: set[int]) -> list[int]:
        kept = super().leave(positions)
        if positions and self.queued is not None:
            self.queued = self.queued[mx.array(kept)] if kept else None
            self.queued_logits = self.queued_logits[mx.array(kept)] if kept else None
        return kept


def pad_left(tokens: list[list[int]]) -> list[list[int]]:
    """Rows of tokens padded on the left with -1 to the longest."""
    longest = max(len(row) for row in tokens)
    return [[-1] * (longest - len(row)) + row for row in tokens]


def logprob_lists(picked: mx.array, ids: mx.array | None, values: mx.array | None) -> list[list[Logprob]]:
    """sampling.log_probabilities' arrays (B, n) and (B, n, top), read as each row's Logprob at each position."""
    picked = picked.tolist()
    if ids is None:
        return [[(lp, []) for lp in row] for row in picked]
    return [[(lp, list(zip(i, v))) for lp, i, v in zip(*row)] for row in zip(picked, ids.tolist(), values.tolist())]


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
            self.drafter.start(row, self.opening(row).start)
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
            history = self.history(rows, proposal.drafts.tolist()) if penalties.reads_tokens else None
            target_logits = penalties.apply(target_logits, self.counts[:, None] + before, positions[:, None] + mx.arange(k + 1),
                                            self.tokens(rows, proposal.drafts), history)
        num_accepted, next_tokens = verify(target_logits, proposal.logits, proposal.drafts, self.sampling, self.deltas,
                                           mx.array(proposal.limits), positions)
        logprobs = ()
        if self.top_logprobs is not None:  # at each position the row decides: its accepted drafts, then its next token
            padded = mx.concatenate([proposal.drafts, next_tokens[:, None]], axis=1)
            chosen = mx.where(mx.arange(k + 1) == num_accepted[:, None], next_tokens[:, None], padded)
            logprobs = log_probabilities(self.logprobs_of(rows, raw, target_logits), chosen, self.top_logprobs)
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
