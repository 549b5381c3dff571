"""Where drafts come from: a draft model (num_draft at a time, or as many as AutoDraft finds worth it), or prompt lookup.

A drafter proposes each round's drafts for every row of a batch and settles
its own state once the target has judged them; the round itself (decoder.py)
is the same for both:

    proposal = drafter.propose(rows, limits, sampling, positions, cache)
    ... the target scores the drafts, verify decides ...
    drafter.settle(rows, proposal, new_tokens, accepted, cache, seconds)

`DraftModel` keeps a decoder cache of its own (the batch holds it beside the
target's, `models` names whose); `LookupDrafter` copies from the prompt and
the output, with no model.
"""

import time
from dataclasses import dataclass

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from model import T5, DecoderCache
from sampling import DRAFT, RowSampling, logits_to_probs, sample


@dataclass
class Proposal:
    """A round's drafts: (B, k) tokens, the drafter's logits (B, k, V) for the
    sampling rule (None for greedy lookup, which needs none), each row's
    count to weigh and the draft model's calls it cost, and what the
    round's one sync reads besides."""

    drafts: mx.array
    logits: mx.array | None
    limits: list[int]
    calls: list[int]
    pending: list[mx.array]


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
    the fastest rounds' seconds against their draft steps. Only drafts the
    target judged count (up to each row's first rejection), and recent
    rounds weigh more. So drafting goes further after full acceptances and
    stops sooner after rejections; a slow draft, or a fast target, drafts
    less; a draft whose confidence says nothing (it agrees either way) is
    trusted on its record.

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
    # Rounds of a length before its floor counts: one slow round (a trace for a
    # new cache size) would otherwise price a length auto then never drafts again.
    trusted = 3
    most_weight = 20  # rounds a length's floor weighs at most: the lengths auto runs most would drown the rest
    bins = 5

    def __init__(self):
        self.accepted, self.judged = [0.0] * self.bins, [0.0] * self.bins  # decayed counts by confidence
        self.tokens = self.seconds = 0.0  # decayed sums over rounds
        self.draft_seconds = None
        self.floors = {}  # (rows, draft steps) -> [round seconds of the fastest such rounds, rounds seen]
        self.slope = None  # fit_slope's, once two lengths' floors count
        self.shapes = {}  # (rows, drafts) -> rounds seen of that shape
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
        The slope of round seconds against draft steps (`fit_slope`), once
        rounds of different lengths were seen; the draft step alone until then."""
        return self.draft_seconds if self.slope is None else max(self.slope, self.draft_seconds)

    def fit_slope(self):
        """The slope of round seconds against draft steps, through each
        length's floor (`floor`), for the batch size with the most rounds
        behind two or more lengths: a busy machine only ever slows a round
        down, and a slope through averages took its hiccups for the cost of
        a draft. A length counts after `trusted` rounds, and weighs as many
        rounds as it had, up to `most_weight`."""
        by_rows = {}
        for (rows, steps), (seconds, rounds) in self.floors.items():
            if rounds >= self.trusted:
                by_rows.setdefault(rows, []).append((steps, seconds, min(rounds, self.most_weight)))
        fits = [points for points in by_rows.values() if len(points) >= 2]
        if not fits:
            return
        points = max(fits, key=lambda p: sum(w for *_, w in p))
        weight = sum(w for *_, w in points)
        mean_steps = sum(k * w for k, _, w in points) / weight
        mean_seconds = sum(t * w for _, t, w in points) / weight
        spread = sum(w * (k - mean_steps) ** 2 for k, _, w in points)
        self.slope = sum(w * (k - mean_steps) * (t - mean_seconds) for k, t, w in points) / spread

    def floor(self, previous: float | None, seconds: float) -> float:
        """A time's floor after one more reading: a faster one at once, a
        slower one slowly (a longer prompt, a longer output, a model moved
        to slower memory)."""
        if previous is None or seconds < previous:
            return seconds
        return previous + (1 - self.cost_decay) * (seconds - previous)

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
        """A draft step took this long: its floor, since a first call's
        tracing and compiling, or a busy machine, would otherwise read as
        the step's cost."""
        self.draft_seconds = self.floor(self.draft_seconds, seconds)

    def learn(self, confidences: list[list[float]], accepted: list[int], seconds: float):
        """After a round: each row's drafts' confidences and how many passed,
        and the round's seconds (not counted in the first two rounds where a
        batch of its size drafts as many, which run their steps plainly and
        then trace them; later rounds that meet a new cache size do too, and
        the floors and `trusted` absorb those)."""
        self.accepted = [self.decay * n for n in self.accepted]
        self.judged = [self.decay * n for n in self.judged]
        for row, passed in zip(confidences, accepted):
            for i, confidence in enumerate(row[: passed + 1]):  # the first rejected draft is judged too
                self.judged[self.bin(confidence)] += 1
                self.accepted[self.bin(confidence)] += i < passed
        drafts = max(len(row) for row in confidences)
        shape_rounds = self.shapes[(len(accepted), drafts)] = self.shapes.get((len(accepted), drafts), 0) + 1
        if shape_rounds <= 2:  # a shape's first round runs its steps plainly, its second traces them (T5.decode)
            return
        self.tokens = self.decay * self.tokens + sum(accepted) + len(accepted)
        self.seconds = self.decay * self.seconds + seconds
        # By the draft steps run, a dropped one included: by the drafts kept,
        # rounds that dropped one would look dear for their length.
        low, rounds = self.floors.get((len(accepted), self.steps), (None, 0))
        self.floors[(len(accepted), self.steps)] = [self.floor(low, seconds), rounds + 1]
        self.fit_slope()


def draft_confidence(scores: mx.array, tokens: mx.array, sampling: RowSampling) -> mx.array:
    """The draft's probability for the tokens it drafted: (B, V), (B,) -> (B,).
    Greedy rows: the argmax's probability at temperature 1."""
    greedy = mx.exp(scores.max(axis=-1) - mx.logsumexp(scores, axis=-1))
    if sampling.all_greedy:
        return greedy
    drawn = mx.take_along_axis(logits_to_probs(scores, sampling), tokens[:, None], axis=-1)[:, 0]
    return mx.where(sampling.is_greedy, greedy, drawn)


class DraftModel:
    """Drafts from a small model sharing the target's tokenizer: up to each
    row's num_draft tokens a round, or, given an AutoDraft, as many as it
    finds worth their cost. Each row's state: the tokens the draft has not
    seen yet (`last`, and the final draft after a full acceptance, which it
    never ran on)."""

    def __init__(self, model: T5, auto: AutoDraft | None = None):
        self.model, self.auto = model, auto
        self.models = [model]

    def longest(self, num_draft: int) -> int:
        """The most drafts a row asks for in a round."""
        return self.auto.cap if self.auto else num_draft

    def start(self, row) -> None:
        row.drafting = [self.model.args.decoder_start_token_id]

    def propose(self, rows, limits: list[int], sampling: RowSampling, positions: mx.array | None,
                cache: DecoderCache) -> Proposal:
        """Tokens drafted for every row, one draft call each, max(limits) of
        them or fewer when `auto` stops early. No host sync without `auto`;
        with it, each step's confidences are read while the next step runs,
        so a decision to stop comes one draft late (AutoDraft.decide says
        whether that draft is kept). The first call feeds each row's unseen
        tokens (one or two), padded on the right where they differ; the
        padding's cache positions are trimmed at once."""
        auto = self.auto
        lengths = [len(row.drafting) for row in rows]
        width = max(lengths)
        inputs = mx.array([row.drafting + [0] * (width - len(row.drafting)) for row in rows])
        drafts, logits, confidences = [], [], []
        eos = self.model.args.eos_token_id
        reach, last_read = [1.0] * len(rows), time.perf_counter()  # P(row), from the confidences read so far
        for i in range(max(limits)):
            scores = self.model.decode(inputs, cache)
            if i == 0 and width > 1:
                last = mx.array(lengths)[:, None, None] - 1
                scores = mx.take_along_axis(scores, last, axis=1)
                cache.trim([width - n for n in lengths])
            scores = scores[:, -1]
            token = sample(scores, sampling, None if positions is None else positions + i, DRAFT)
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
        limits = [min(limit, len(drafts)) for limit in limits]
        return Proposal(mx.stack(drafts, axis=1), mx.stack(logits, axis=1), limits, limits, confidences)

    def settle(self, rows, proposal: Proposal, new_tokens: list[list[int]], accepted: list[int],
               cache: DecoderCache, seconds: float) -> None:
        """After the target judged the drafts: each row's unseen tokens, what
        auto learns, and the draft cache rolled back to the accepted prefix."""
        k = proposal.drafts.shape[1]
        for row, tokens, taken in zip(rows, new_tokens, accepted):
            row.drafting = (tokens[-2:] if taken == k else tokens[-1:]) if k else row.drafting + tokens
        if self.auto and k:
            confidences = list(zip(*(step.tolist() for step in proposal.pending)))  # by row
            self.auto.learn([c[:limit] for c, limit in zip(confidences, proposal.limits)], accepted, seconds)
        if k:
            cache.trim([k - 1 - min(taken, k - 1) for taken in accepted])


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

    def __init__(self, vocab: int):
        self.vocab = vocab

    def longest(self, num_draft: int) -> int:
        return num_draft

    def start(self, row) -> None:
        row.drafting = PromptLookup(row.request.ids)

    def propose(self, rows, limits: list[int], sampling: RowSampling, positions: mx.array | None, cache=None) -> Proposal:
        """Every row's looked-up drafts, padded to the longest; their logits
        one-hot for rows that sample (q(x) = 1: accept x with probability
        p(x), and resample from p without x)."""
        proposals = [row.drafting.draft(limit) for row, limit in zip(rows, limits)]
        k = max(len(p) for p in proposals)
        drafts = mx.array([p + [0] * (k - len(p)) for p in proposals], dtype=mx.int32)
        one_hot = None
        if not sampling.all_greedy and k:
            one_hot = mx.where(mx.arange(self.vocab) == drafts[..., None], 0.0, -mx.inf)
        return Proposal(drafts, one_hot, [len(p) for p in proposals], [0] * len(rows), [])

    def settle(self, rows, proposal: Proposal, new_tokens: list[list[int]], accepted: list[int], cache, seconds: float):
        for row, tokens in zip(rows, new_tokens):
            row.drafting.add(tokens)
