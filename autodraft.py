"""num-draft auto: as many drafts a round as are worth their cost.

Three small parts: each row's `Calibration` (what the target lately
accepted, by the draft's confidence, at the row's settings), a `DraftCost`
for each size class of rounds (what one more draft costs a round, and what
the rounds make a second, from their times on a clock), and the rule,
`decide` (with `first_worth`, whether a round drafts at all). `AutoDraft`
keeps them for a pair from one generation to the next
(loading.Models.learned); the draft model (drafting.DraftModel) follows it.
"""

import time

from sampling import Sampling


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
    """For rows of one size class (AutoDraft.cost): d, the seconds one more
    draft adds to a round (its draft step, and its share of the target's
    pass, which on a small target is most of it), and R, the tokens a second
    the class's rounds make. Timed on `clock`, which the tests replace.

    Times are kept as a row's share of its round (seconds over rows), so
    that rounds of a server's ever-changing row counts inform one another:
    where a batch is large enough for its cost to matter, a round's time
    grows with its rows (on a CPU, and on a GPU once arithmetic binds), and
    a class spans a factor of two at most. A cost for a round of r rows is
    the share times r. Where a round's time grows more slowly than its rows
    (a GPU's small batches), floors come from a class's largest rounds and
    price its smallest ones' drafts low, by up to half: the classes are
    narrow where that happens (1, 2, 3-4 rows).

    d is the slope of round seconds against draft steps through each round
    length's floor: a busy machine only ever slows a round down, and a slope
    through averages took its hiccups for the cost of a draft. A floor falls
    at once to a faster round and rises slowly to slower ones (a longer
    prompt, a longer output, a model moved to slower memory); a length counts
    after `trusted` rounds, and weighs as many rounds as it had, up to
    `most_weight`. Until two lengths count, d is the draft step alone.

    A length's floor is its rounds' whose steps all replayed compiled graphs
    (a step that traced one, or ran a shape for the first time, is slower
    than the next will be), once `trusted` of those are seen; until then, every
    round's: a server's row count changes from round to round, so that most
    of its rounds run some step for the first time or trace it."""

    decay = 0.95  # R's weight of the past against one new round
    floor_decay = 0.98  # for floors, which change slowly
    trusted = 3
    span_least = 3
    most_weight = 20  # the lengths auto runs most would drown the rest

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.step_share = None  # a draft step's floor, a row's share
        # draft steps -> [a row's share of the round's seconds: its floor, rounds seen], of every round, of replayed ones
        self.every, self.replayed = {}, {}
        self.slope = None  # a row's share, a draft step more
        self.tokens = self.seconds = 0.0  # decayed sums over rounds
        self.idle = 0  # rounds in a row that drafted nothing
        self.idle_most = None  # before a round drafts regardless (AutoDraft.idle_most, doubled by each such round)

    def floor(self, previous: float | None, seconds: float) -> float:
        if previous is None or seconds < previous:
            return seconds
        return previous + (1 - self.floor_decay) * (seconds - previous)

    def draft_step(self, seconds: float, rows: int = 1) -> None:
        """A draft step of `rows` rows took this long (its first call's
        tracing, or a busy machine, would otherwise read as its cost: the
        floor keeps neither)."""
        self.step_share = self.floor(self.step_share, seconds / rows)

    def round(self, rows: int, steps: int, tokens: int, seconds: float, replayed: bool = True) -> None:
        """A round of `rows` rows ran `steps` draft steps (a dropped one
        included: by the drafts kept, rounds that dropped one would look dear
        for their length) and made `tokens` tokens in `seconds`; `replayed`:
        whether all its steps replayed compiled graphs."""
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        for floors in (self.every, self.replayed) if replayed else (self.every,):
            low, count = floors.get(steps, (None, 0))
            floors[steps] = [self.floor(low, seconds / rows), count + 1]
        self.fit_slope()

    @property
    def floors(self) -> dict[int, list]:
        """Each length's floor and rounds: its replayed rounds' once trusted, else every round's."""
        return {steps: self.replayed[steps] if self.replayed.get(steps, (0, 0))[1] >= self.trusted else every
                for steps, every in self.every.items()}

    def fit_slope(self) -> None:
        """The slope through the floors of two or more trusted lengths of one
        draft or more (a round of none skips the draft's call and catch-up:
        first_draft)."""
        floors = self.floors
        points = [(steps, share, min(count, self.most_weight)) for steps, (share, count) in floors.items()
                  if count >= self.trusted and steps]
        if len(points) < 2:
            return
        weight = sum(w for *_, w in points)
        mean_steps = sum(k * w for k, _, w in points) / weight
        mean_share = sum(t * w for _, t, w in points) / weight
        spread = sum(w * (k - mean_steps) ** 2 for k, _, w in points)
        self.slope = sum(w * (k - mean_steps) * (t - mean_share) for k, t, w in points) / spread

    def shorter(self, cap: int) -> int | None:
        """The most a round drafts while the lengths timed cannot price a
        draft well: one fewer than the shortest length trusted while the cap is
        one of them and they span fewer than span_least drafts (priced by its
        step alone, or by a slope between floors a draft or two apart, which
        differ by their noise as much as by a draft's cost, a draft can look
        cheap, and rounds would keep to the cap, however dear it is), or while
        their slope is below zero (lengths too close together for that noise)."""
        lengths = [steps for steps, (_, count) in self.floors.items() if steps and count >= self.trusted]
        narrow = cap in lengths and max(lengths) - min(lengths) < self.span_least
        if narrow or self.slope is not None and self.slope < 0:
            return min(lengths) - 1 if min(lengths) > 1 else None
        return None

    def no_drafts(self, rows: int) -> float | None:
        """A round of no drafts, for `rows` rows: its floor once trusted, else
        the most seen trusted length's less its drafts at per_draft (while the
        slope is above zero: below, it is noise, and working back from it would
        price a round of none above every round timed); None before either."""
        floors = self.floors
        if floors.get(0, (0, 0))[1] >= self.trusted:
            return rows * floors[0][0]
        if self.slope is None or self.slope <= 0:
            return None
        lengths = [(count, share - steps * self.per_draft(1)) for steps, (share, count) in floors.items()
                   if steps and count >= self.trusted]
        return rows * max(lengths)[1] if lengths and max(lengths)[1] > 0 else None

    def step_seconds(self, rows: int) -> float | None:
        """A draft step's floor, for a round of `rows` rows."""
        return None if self.step_share is None else self.step_share * rows

    def per_draft(self, rows: int) -> float | None:  # d
        if self.step_share is None:
            return None
        return rows * (self.step_share if self.slope is None else max(self.slope, self.step_share))

    def first_draft(self, rows: int) -> float | None:
        """What drafting at all adds to a round of `rows` rows: a round of one
        draft's floor over a round of none's; per_draft until both are trusted."""
        floors = self.floors
        one, none = floors.get(1, (0, 0)), floors.get(0, (0, 0))
        if min(one[1], none[1]) < self.trusted:
            return self.per_draft(rows)
        return rows * max(one[0] - none[0], self.step_share or 0.0)

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
    d = cost.per_draft(len(reach))
    if d is None:  # no draft step timed yet
        return worth(following, None, None), True
    if worth(following, d, cost.speed):
        return True, True
    return False, worth(last, d - cost.step_seconds(len(reach)), cost.speed)


def first_worth(rates: list[float], limits: list[int], cost: DraftCost) -> bool:
    """Whether a round should draft at all: its first draft adds each row's a (P is 1 before any draft), against
    what drafting at all costs (DraftCost.first_draft) would make in a round of no drafts, a token a row (the batch's
    speed R until such a round is priced: R is what rounds that drafted made, not what a round of none would). Where
    a verify pass costs in proportion to the positions it scores (a CPU at a large batch), a first draft can cost
    more than it adds: the round then decodes as regular decoding does."""
    plain = cost.no_drafts(len(rates))
    return worth(sum(a for a, limit in zip(rates, limits) if limit >= 1), cost.first_draft(len(rates)),
                 len(rates) / plain if plain else cost.speed)


class AutoDraft:
    """num_draft="auto": each round the batch drafts one more token while
    that token is worth its cost (`decide`). So drafting goes further after
    full acceptances and stops sooner after rejections; a slow draft, or a
    fast target, drafts less; a draft whose confidence says nothing (it
    agrees either way) is trusted on its record. A row whose draft ended its
    text has P 0: what follows would never be output.

    This is what auto has learnt of one pair: a `Calibration` for each
    setting rows ran at, whatever batch they shared, and a `DraftCost` for
    each size class of rounds (1, 2, 3-4, 5-8 rows ...), timed on one
    clock. `cap` drafts a round at most, and none when even one is not
    worth its cost (`first_worth`), but never more than `idle_most` rounds
    in a row (twice as many after each such round, up to `idle_longest`):
    a round that drafts keeps what auto knows of the draft (its acceptance,
    its cost) up to date.
    `python -m bench drafting` measures it against each fixed num-draft
    (docs/PERFORMANCE.md)."""

    cap = 8
    # A round after idle ones feeds the draft each row's tokens since (one a round) in one call, whose logits span
    # them all: idle_longest keeps that within the logits the server's budget holds for a round (serving/budget.py).
    idle_most, idle_longest = 8, 64
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

    def cost(self, rows: int) -> DraftCost:
        """The cost of drafting in a round of `rows` rows: its size class's."""
        return self.costs.setdefault(1 << (rows - 1).bit_length(), DraftCost(self.clock))

    def decide(self, reach: list[float], rates: list[float], limits: list[int], made: int,
               cost: DraftCost) -> tuple[bool, bool]:
        """The rule the draft model follows (`decide`)."""
        return decide(reach, rates, limits, made, cost)
