"""Where drafts come from: a draft model (num_draft at a time, or as many as num-draft auto finds worth it), or prompt lookup.

A drafter proposes each round's drafts for every row of a batch, and settles
its own state once the target has judged them; the round itself (decoder.py)
is the same for both:

    proposal = drafter.propose(rows, limits, sampling, positions, cache)
    ... the target scores the drafts, verify decides ...
    drafter.settle(rows, proposal, new_tokens, accepted, cache, seconds, warm)

`DraftModel` keeps a decoder cache of its own (the batch holds it beside the
target's); `LookupDrafter` copies from the prompt and the output, with no
model. num-draft auto is three small parts: each row's `Calibration` (what
the target lately accepted, by the draft's confidence, at the row's
settings), the batch's `DraftCost` (what one more draft costs a round, and
what the batch makes a second, from the rounds' times on its clock), and the
rule, `decide`. `AutoDraft` keeps them for a pair from one generation to the
next (loading.Models.learned).
"""

import time
from dataclasses import dataclass

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from cache import DecoderCache
from model import EncoderDecoder
from sampling import DRAFT, RowSampling, Sampling, logits_to_probs, one_hot, sample


@dataclass
class Proposal:
    """A round's drafts: (B, k) tokens, the drafter's logits (B, k, V) for the
    sampling rule (None for greedy lookup, which needs none), each row's
    count to weigh and the draft model's calls it cost, the draft steps run
    (one dropped included), and what the round's one sync reads besides."""

    drafts: mx.array
    logits: mx.array | None
    limits: list[int]
    calls: list[int]
    steps: int = 0
    pending: tuple = ()


# ---------------------------------------------------------------- num-draft auto


class Calibration:
    """g(c) and a for rows of one setting (delta and sampling): of the recent
    drafts of about confidence c (a fifth of [0, 1]), the share the target
    accepted; a, the share of all of them. Only drafts the target judged
    count (up to each row's first rejection), and recent rounds weigh more."""

    bins = 5
    decay = 0.95  # the weight of the past against one new round

    def __init__(self):
        self.accepted, self.judged = [0.0] * self.bins, [0.0] * self.bins  # decayed counts by confidence

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

    def learn(self, rows: list[tuple[list[float], int]]) -> None:
        """After a round: for each of its rows at this setting, its drafts'
        confidences and how many passed."""
        self.accepted = [self.decay * n for n in self.accepted]
        self.judged = [self.decay * n for n in self.judged]
        for confidences, passed in rows:
            for i, confidence in enumerate(confidences[: passed + 1]):  # the first rejected draft is judged too
                self.judged[self.bin(confidence)] += 1
                self.accepted[self.bin(confidence)] += i < passed


class DraftCost:
    """For a batch size: d, the seconds one more draft adds to a round (its
    draft step, and its share of the target's pass, which on a small target
    is most of it), and R, the tokens a second the batch makes. Timed on
    `clock`, which the tests replace.

    d is the slope of round seconds against draft steps through each round
    length's floor: a busy machine only ever slows a round down, and a slope
    through averages took its hiccups for the cost of a draft. A floor falls
    at once to a faster round and rises slowly to slower ones (a longer
    prompt, a longer output, a model moved to slower memory); a length counts
    after `trusted` rounds, and weighs as many rounds as it had, up to
    `most_weight`. Until two lengths count, d is the draft step alone."""

    decay = 0.95  # R's weight of the past against one new round
    floor_decay = 0.98  # for floors, which change slowly
    trusted = 3
    most_weight = 20  # the lengths auto runs most would drown the rest

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.step_seconds = None  # a draft step's floor
        self.floors = {}  # (rows, draft steps) -> [the round seconds' floor, rounds seen]
        self.slope = None
        self.tokens = self.seconds = 0.0  # decayed sums over rounds
        self.idle = 0  # rounds in a row that drafted nothing (AutoDraft.idle_most)

    def floor(self, previous: float | None, seconds: float) -> float:
        if previous is None or seconds < previous:
            return seconds
        return previous + (1 - self.floor_decay) * (seconds - previous)

    def draft_step(self, seconds: float) -> None:
        """A draft step took this long (its first call's tracing, or a busy
        machine, would otherwise read as its cost: the floor keeps neither)."""
        self.step_seconds = self.floor(self.step_seconds, seconds)

    def round(self, rows: int, steps: int, tokens: int, seconds: float) -> None:
        """A round of `rows` rows ran `steps` draft steps (a dropped one
        included: by the drafts kept, rounds that dropped one would look dear
        for their length) and made `tokens` tokens in `seconds`. Only rounds
        whose steps all replayed compiled graphs are given: a round that
        traced one, or ran one plainly, says nothing of the next."""
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        low, count = self.floors.get((rows, steps), (None, 0))
        self.floors[(rows, steps)] = [self.floor(low, seconds), count + 1]
        self.fit_slope()

    def fit_slope(self) -> None:
        """The slope through the floors of the batch size (rows) with the most
        rounds behind two or more trusted lengths of one draft or more (a
        round of none skips the draft's call and catch-up: first_draft)."""
        by_rows = {}
        for (rows, steps), (seconds, count) in self.floors.items():
            if count >= self.trusted and steps:
                by_rows.setdefault(rows, []).append((steps, seconds, min(count, self.most_weight)))
        fits = [points for points in by_rows.values() if len(points) >= 2]
        if not fits:
            return
        points = max(fits, key=lambda p: sum(w for *_, w in p))
        weight = sum(w for *_, w in points)
        mean_steps = sum(k * w for k, _, w in points) / weight
        mean_seconds = sum(t * w for _, t, w in points) / weight
        spread = sum(w * (k - mean_steps) ** 2 for k, _, w in points)
        self.slope = sum(w * (k - mean_steps) * (t - mean_seconds) for k, t, w in points) / spread

    @property
    def per_draft(self) -> float | None:  # d
        if self.step_seconds is None:
            return None
        return self.step_seconds if self.slope is None else max(self.slope, self.step_seconds)

    @property
    def first_draft(self) -> float | None:
        """What drafting at all adds to a round: a round of one draft's floor over a round of none's, for the batch
        size with the most rounds of both; per_draft until both are trusted."""
        pairs = [(self.floors[(rows, 1)], floor) for (rows, steps), floor in self.floors.items()
                 if not steps and (rows, 1) in self.floors]
        pairs = [(one, none) for one, none in pairs if min(one[1], none[1]) >= self.trusted]
        if not pairs:
            return self.per_draft
        one, none = max(pairs, key=lambda pair: pair[0][1] + pair[1][1])
        return max(one[0] - none[0], self.step_seconds or 0.0)

    @property
    def speed(self) -> float | None:  # R
        return self.tokens / self.seconds if self.seconds else None


def worth(gain: float, seconds: float | None, speed: float | None) -> bool:
    """Whether drafts expected to add `gain` tokens beat what `seconds` would
    make at `speed` tokens a second (before any timing: half a token)."""
    if gain == 0:
        return False
    return gain >= 0.5 if seconds is None or speed is None else gain >= speed * seconds


def decide(reach: list[float], rates: list[float], limits: list[int], made: int, cost: DraftCost) -> tuple[bool, bool]:
    """The rule: draft one more token while it is worth its cost,

        sum over rows of a(row) * P(row)  >=  R * d,

    the tokens it is expected to add on the left (P(row): the chance that
    all of the row's drafts so far pass, the product of g(c) over them; a
    stands in for g of a draft whose c is not read yet), what its time would
    have made at the batch's speed on the right. `made` drafts are made, the
    last one's confidences not read yet; `reach` is each row's P over the
    others, `rates` its a. Returns (draft another?, keep the last?): the
    last draft's step is spent, so it stays if it is worth its share of the
    target's pass alone."""
    last = sum(p * a for p, a, limit in zip(reach, rates, limits) if made <= limit)
    following = sum(p * a * a for p, a, limit in zip(reach, rates, limits) if made < limit)
    d = cost.per_draft
    if d is None:  # no draft step timed yet
        return worth(following, None, None), True
    if worth(following, d, cost.speed):
        return True, True
    return False, worth(last, d - cost.step_seconds, cost.speed)


def first_worth(rates: list[float], limits: list[int], cost: DraftCost) -> bool:
    """Whether a round should draft at all: its first draft adds each row's a (P is 1 before any draft), against
    R times what drafting at all costs (DraftCost.first_draft), as `decide` weighs every later one. Where a verify
    pass costs in proportion to the positions it scores (a CPU at a large batch), a first draft can cost more than
    it adds: the round then decodes as regular decoding does."""
    return worth(sum(a for a, limit in zip(rates, limits) if limit >= 1), cost.first_draft, cost.speed)


class AutoDraft:
    """num_draft="auto": each round the batch drafts one more token while
    that token is worth its cost (`decide`). So drafting goes further after
    full acceptances and stops sooner after rejections; a slow draft, or a
    fast target, drafts less; a draft whose confidence says nothing (it
    agrees either way) is trusted on its record. A row whose draft ended its
    text has P 0: what follows would never be output.

    This is what auto has learnt of one pair: a `Calibration` for each
    setting rows ran at, whatever batch they shared, and a `DraftCost` for
    each batch size, timed on one clock. `cap` drafts a round at most, and
    none when even one is not worth its cost (`first_worth`), but never
    more than `idle_most` rounds in a row: a round that drafts keeps what
    auto knows of the draft (its acceptance, its cost) up to date.
    `python -m bench drafting` measures it against each fixed num-draft
    (docs/PERFORMANCE.md)."""

    cap = 8
    idle_most = 8
    settings_kept = 64  # calibrations kept, the least recently used dropped (a server's clients choose any delta)

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.calibrations: dict[tuple, Calibration] = {}
        self.costs: dict[int, DraftCost] = {}

    def calibration(self, settings) -> Calibration:
        """The record of rows at this setting: its delta and sampling (all
        greedy rows alike: top-k and top-p change nothing there)."""
        key = (settings.delta, settings.sampling if settings.temp > 0 else Sampling())
        calibration = self.calibrations.pop(key, None) or Calibration()
        self.calibrations[key] = calibration  # the most recently used last
        if len(self.calibrations) > self.settings_kept:
            del self.calibrations[next(iter(self.calibrations))]
        return calibration

    def cost(self, batch_size: int) -> DraftCost:
        return self.costs.setdefault(batch_size, DraftCost(self.clock))

    def decide(self, reach: list[float], rates: list[float], limits: list[int], made: int,
               cost: DraftCost) -> tuple[bool, bool]:
        """The rule the draft model follows (`decide`)."""
        return decide(reach, rates, limits, made, cost)


# ---------------------------------------------------------------- the draft model


def draft_confidence(scores: mx.array, tokens: mx.array, sampling: RowSampling) -> mx.array:
    """The draft's probability for the tokens it drafted: (B, V), (B,) -> (B,).
    Greedy rows: the argmax's probability at temperature 1."""
    greedy = mx.exp(scores.max(axis=-1) - mx.logsumexp(scores, axis=-1))
    if sampling.all_greedy:
        return greedy
    drawn = mx.take_along_axis(logits_to_probs(scores, sampling), tokens[:, None], axis=-1)[:, 0]
    return mx.where(sampling.is_greedy, greedy, drawn)


@dataclass
class Unseen:
    """A row's state in DraftModel: the tokens the draft has not run on yet
    (`last`, and the final draft after a full acceptance), and, with auto,
    the calibration of the row's setting."""

    tokens: list[int]
    calibration: Calibration | None = None


class DraftModel:
    """Drafts from a small model sharing the target's tokenizer: up to each
    row's num_draft tokens a round, or, given what auto learnt of the pair
    (an AutoDraft), as many as `decide` finds worth their cost."""

    def __init__(self, model: EncoderDecoder, auto: AutoDraft | None = None, batch_size: int = 1):
        self.model, self.auto = model, auto
        self.cost = auto.cost(batch_size) if auto else None
        self.clock = auto.clock if auto else time.perf_counter  # the round's timing, for auto's cost
        self.models = [model]

    def longest(self, settings) -> int:
        """The most drafts a row at these settings asks for in a round."""
        return AutoDraft.cap if self.auto else settings.draft_length

    def start(self, row, opening: tuple[int, ...]) -> None:
        """Begin drafting for a row whose decoder opens with these tokens (the draft has seen none of them)."""
        calibration = self.auto.calibration(row.settings) if self.auto else None
        row.drafting = Unseen(list(opening), calibration)

    def propose(self, rows, limits: list[int], sampling: RowSampling, positions: mx.array | None,
                cache: DecoderCache, penalized: tuple | None = None) -> Proposal:
        """Tokens drafted for every row, one draft call each, max(limits) of
        them or fewer when auto stops early. No host sync without auto;
        with it, each step's confidences are read while the next step runs
        (a read that waited would idle the machine for longer than a step of
        a small draft), so a decision to stop comes one draft late (`decide`
        says whether that draft is kept). The first call feeds each row's
        unseen tokens (one or two), padded on the right where they differ;
        the padding's cache positions are trimmed at once. `penalized` (the
        rows' RowPenalties, output counts and tokens, Batch.tokens) applies to each draft's logits
        what the target's will get there: its logits are the distribution
        the drafts were drawn from."""
        rates = [row.drafting.calibration.pass_rate for row in rows] if self.auto else []
        if self.auto and not self.drafts_now(rates, limits):
            return Proposal(mx.zeros((len(rows), 0), mx.int32), None, [0] * len(rows), [0] * len(rows))
        lengths = [len(row.drafting.tokens) for row in rows]
        width = max(lengths)
        inputs = mx.array([row.drafting.tokens + [0] * (width - n) for row, n in zip(rows, lengths)])
        drafts, logits, confidences, steps = [], [], [], 0
        eos = self.model.args.eos_token_id
        reach = [1.0] * len(rows)  # P(row), from the confidences read so far
        last_read = self.clock()
        for i in range(max(limits)):
            scores = self.model.decode(inputs, cache)
            if i == 0 and width > 1:
                scores = mx.take_along_axis(scores, mx.array(lengths)[:, None, None] - 1, axis=1)
                cache.trim([width - n for n in lengths])
            scores = scores[:, -1]
            if penalized is not None:  # the output's counts and tokens, then each draft's as it comes
                penalties, counts, seen = penalized
                if i > 0:
                    counts = counts + one_hot(drafts[-1], counts.shape[-1])
                    seen = None if seen is None else mx.concatenate([seen, drafts[-1][:, None].astype(seen.dtype)], axis=1)
                penalized = penalties, counts, seen
                scores = penalties.apply(scores[:, None], counts[:, None], positions[:, None] + i, seen)[:, 0]
            token = sample(scores, sampling, None if positions is None else positions + i, DRAFT)
            drafts.append(token)
            logits.append(scores)
            inputs, steps = token[:, None], i + 1
            if not self.auto:
                mx.async_eval(token)
                continue
            confidences.append(draft_confidence(scores, token, sampling))
            mx.async_eval(token, confidences[-1])
            if i > 0:  # step i runs while step i - 1's confidences are read and timed
                for r, (confidence, drafted) in enumerate(zip(confidences[-2].tolist(), drafts[-2].tolist())):
                    # Drafts after an end of text would never reach the output.
                    reach[r] = 0.0 if drafted == eos else rows[r].drafting.calibration.reach(reach[r], confidence)
                now = self.clock()
                self.cost.draft_step(now - last_read)
                last_read = now
            more, keep = self.auto.decide(reach, rates, limits, i + 1, self.cost)
            if i > 0 and not keep:  # step i ran for nothing (a round keeps its first draft)
                drafts.pop(), logits.pop(), confidences.pop()
                cache.trim([1] * len(rows))  # its input, draft i - 1, is fed again next round
            if not more:
                break
        limits = [min(limit, len(drafts)) for limit in limits]
        return Proposal(mx.stack(drafts, axis=1), mx.stack(logits, axis=1), limits, limits, steps, tuple(confidences))

    def drafts_now(self, rates: list[float], limits: list[int]) -> bool:
        """Whether auto drafts this round (AutoDraft: `first_worth`, or `idle_most` rounds drafted nothing)."""
        if first_worth(rates, limits, self.cost) or self.cost.idle >= self.auto.idle_most:
            self.cost.idle = 0
            return True
        self.cost.idle += 1
        return False

    def settle(self, rows, proposal: Proposal, new_tokens: list[list[int]], accepted: list[int],
               cache: DecoderCache, seconds: float, warm: bool) -> None:
        """After the target judged the drafts: each row's unseen tokens, what
        auto learns (each row's calibration, and, from a `warm` round of
        `seconds`, the cost), and the draft cache rolled back to the
        accepted prefix."""
        k = proposal.drafts.shape[1]
        for row, tokens, taken in zip(rows, new_tokens, accepted):
            unseen = row.drafting
            unseen.tokens = (tokens[-2:] if taken == k else tokens[-1:]) if k else unseen.tokens + tokens
        if self.auto and k:
            by_row = list(zip(*(step.tolist() for step in proposal.pending)))
            judged = {}
            for row, confidences, limit, taken in zip(rows, by_row, proposal.limits, accepted):
                judged.setdefault(id(row.drafting.calibration), (row.drafting.calibration, []))[1].append(
                    (list(confidences[:limit]), taken))
            for calibration, rounds in judged.values():
                calibration.learn(rounds)
        if self.auto and warm:  # a round of no drafts too: the floor each round length's cost is measured from
            self.cost.round(len(rows), proposal.steps, sum(accepted) + len(rows), seconds)
        if k:
            cache.trim([k - 1 - min(taken, k - 1) for taken in accepted])


# ---------------------------------------------------------------- prompt lookup


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


class LookupDrafter:
    """Prompt lookup as a drafter: each row's PromptLookup proposes up to its
    num_draft tokens; rows with nothing to copy propose none."""

    models = []  # no model, no cache
    clock = staticmethod(time.perf_counter)

    def __init__(self, vocab: int):
        self.vocab = vocab

    def longest(self, settings) -> int:
        return settings.num_draft

    def start(self, row, opening: tuple[int, ...]) -> None:
        source = row.request.source  # features have no tokens to copy: drafts come from the output alone
        row.drafting = PromptLookup(list(source) if isinstance(source, (list, tuple)) else [])

    def propose(self, rows, limits: list[int], sampling: RowSampling, positions: mx.array | None, cache=None,
                penalized=None) -> Proposal:
        """Every row's looked-up drafts, padded to the longest; their logits
        one-hot for rows that sample (q(x) = 1: accept x with probability
        p(x), and resample from p without x)."""
        proposals = [row.drafting.draft(limit) for row, limit in zip(rows, limits)]
        k = max(len(p) for p in proposals)
        drafts = mx.array([p + [0] * (k - len(p)) for p in proposals], dtype=mx.int32)
        one_hot = None
        if not sampling.all_greedy and k:
            one_hot = mx.where(mx.arange(self.vocab) == drafts[..., None], 0.0, -mx.inf)
        return Proposal(drafts, one_hot, [len(p) for p in proposals], [0] * len(rows))

    def settle(self, rows, proposal: Proposal, new_tokens: list[list[int]], accepted: list[int], cache,
               seconds: float, warm: bool) -> None:
        for row, tokens in zip(rows, new_tokens):
            row.drafting.add(tokens)
