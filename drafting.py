"""Where drafts come from: a draft model (num_draft at a time, or as many as num-draft auto finds worth it), or prompt lookup.

A drafter proposes each round's drafts for every row of a batch, and settles
its own state once the target has judged them; the round itself (decoder.py)
is the same for both:

    proposal = drafter.propose(rows, limits, sampling, positions, cache)
    ... the target scores the drafts, verify decides ...
    drafter.settle(rows, proposal, new_tokens, accepted, cache, seconds, warm)

`DraftModel` keeps a decoder cache of its own (the batch holds it beside the
target's); `LookupDrafter` copies from the prompt and the output, with no
model. With num-draft auto, the draft model drafts as autodraft.py's rule
finds worth it, from what it learnt of the pair (`AutoDraft`).
"""

import time
from dataclasses import dataclass

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from autodraft import AutoDraft, Calibration, DraftCost, first_worth
from cache import DecoderCache
from model import EncoderDecoder
from sampling import DRAFT, RowSampling, logits_to_probs, one_hot, sample


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

    def __init__(self, model: EncoderDecoder, auto: AutoDraft | None = None):
        self.model, self.auto = model, auto
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
        cost = self.auto.cost(len(rows)) if self.auto else None
        if self.auto and not self.drafts_now(rates, limits, cost):
            return Proposal(mx.zeros((len(rows), 0), mx.int32), None, [0] * len(rows), [0] * len(rows))
        lengths = [len(row.drafting.tokens) for row in rows]
        width = max(lengths)
        inputs = mx.array([row.drafting.tokens + [0] * (width - n) for row, n in zip(rows, lengths)])
        drafts, logits, confidences, steps = [], [], [], 0
        eos = self.model.args.eos_token_id
        reach = [1.0] * len(rows)  # P(row), from the confidences read so far
        last_read = self.clock()
        shorter = cost.shorter(AutoDraft.cap) if cost else None
        for i in range(max(limits) if shorter is None else min(max(limits), shorter)):
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
                cost.draft_step(now - last_read, len(rows))
                last_read = now
            more, keep = self.auto.decide(reach, rates, limits, i + 1, cost)
            if i > 0 and not keep:  # step i ran for nothing (a round keeps its first draft)
                drafts.pop(), logits.pop(), confidences.pop()
                cache.trim([1] * len(rows))  # its input, draft i - 1, is fed again next round
            if not more:
                break
        limits = [min(limit, len(drafts)) for limit in limits]
        return Proposal(mx.stack(drafts, axis=1), mx.stack(logits, axis=1), limits, limits, steps, tuple(confidences))

    def drafts_now(self, rates: list[float], limits: list[int], cost: DraftCost) -> bool:
        """Whether auto drafts this round: `first_worth`, or, after AutoDraft.idle_most rounds drafted nothing, to
        keep what auto knows current. Where a first draft could not pay even were every row to accept it (a CPU at
        a large batch: its cost is what fails, not the draft), each such round doubles the wait, to `idle_longest`,
        since those rounds cost what they measure; a draft that is merely often wrong is tried every idle_most."""
        if first_worth(rates, limits, cost):
            cost.idle, cost.idle_most = 0, None
            return True
        most = cost.idle_most or self.auto.idle_most
        if cost.idle >= most:
            hopeless = not first_worth([1.0] * len(rates), limits, cost)
            cost.idle, cost.idle_most = 0, min(2 * most, self.auto.idle_longest) if hopeless else None
            return True
        cost.idle += 1
        return False

    def settle(self, rows, proposal: Proposal, new_tokens: list[list[int]], accepted: list[int],
               cache: DecoderCache, seconds: float, warm: bool) -> None:
        """After the target judged the drafts: each row's unseen tokens, what
        auto learns (each row's calibration, and, from the round's `seconds`,
        the cost; `warm`: its every step replayed a compiled graph), and the
        draft cache rolled back to the accepted prefix."""
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
        if self.auto:  # a round of no drafts too: the floor each round length's cost is measured from
            self.auto.cost(len(rows)).round(len(rows), proposal.steps, sum(accepted) + len(rows), seconds, warm)
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
